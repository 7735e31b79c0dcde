#!/usr/bin/env bash
# Install what a run needs, then `rlvla3 run` (the embedded default config unless one is given).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$HERE/scripts/bootstrap.sh" | tail -n 1)"
cd "$HERE"
export MUJOCO_GL="${MUJOCO_GL:-egl}" PYOPENGL_PLATFORM="${PYOPENGL_PLATFORM:-egl}"
exec "$VENV/bin/rlvla3" run "$@"
