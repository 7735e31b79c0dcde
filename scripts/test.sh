#!/usr/bin/env bash
# Install what the tests need, then run them. Extra arguments go to pytest.
# Two pytest workers (pytest-xdist), one test file each at a time: most tests wait on child
# processes and sockets, so one runner leaves a third of two cores idle. A file stays on one
# worker because some share a module-scoped job or process pool, and files go out longest first
# (tests/file_order.py: xdist's own order left the longest file for last). `-n 0` runs in one process.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$HERE/scripts/bootstrap.sh" | tail -n 1)"
cd "$HERE"
export MUJOCO_GL="${MUJOCO_GL:-egl}" PYOPENGL_PLATFORM="${PYOPENGL_PLATFORM:-egl}"
set +e
"$VENV/bin/python" -m pytest -q -ra --durations=20 -n 2 --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $rc
