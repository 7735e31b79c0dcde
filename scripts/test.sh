#!/usr/bin/env bash
# Install what the tests need, then run them. Extra arguments go to pytest.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$HERE/scripts/bootstrap.sh" | tail -n 1)"
cd "$HERE"
export MUJOCO_GL="${MUJOCO_GL:-egl}" PYOPENGL_PLATFORM="${PYOPENGL_PLATFORM:-egl}"
set +e
"$VENV/bin/python" -m pytest -q -ra --durations=20 "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $rc
