#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install everything into it:
# torch (the CPU wheel the machine provides, or the registry's), rlvla3 with its dev extras,
# and the simulators that install here (Meta-World, ManiSkill, LIBERO; system packages as root);
# as root also Slurm and munge (.ci/install_slurm.sh), for tests/test_slurm.py.
#
#   RLVLA3_VENV   where the venv lives (default: .venv in the repo)
#   RLVLA3_SIMS   0 to skip the simulators (default: 1)
#   RLVLA3_ROBOCASA  1 to also make .venv-robocasa: RoboCasa's code (rlinf-robocasa365) with
#                 robosuite>=1.5.2, which LIBERO's robosuite 1.4 rules out of the main venv
#   RLVLA3_MPLIB  1 to also make .mplib-numpy1: NumPy 1 for the process that runs ManiSkill's
#                 motion-planning solutions (`rlvla3 sft` on ManiSkill): mplib segfaults under
#                 NumPy 2 (workers/envs/maniskill_expert.py)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLVLA3_VENV:-$HERE/.venv}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# torch first, pinned, so nothing later pulls a multi-GB CUDA build; the project accepts >=2.4.
"$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.4"
"$PY" -m pip install -q --disable-pip-version-check -e "$HERE[dev]"
if [[ "${RLVLA3_SIMS:-1}" == "1" ]]; then
  if [[ "$(id -u)" == "0" ]]; then
    PY="$PY" bash "$HERE/.ci/install_sims.sh"
  else
    PY="$PY" SKIP_APT=1 bash "$HERE/.ci/install_sims.sh"
  fi
fi
if [[ "$(id -u)" == "0" ]]; then
  bash "$HERE/.ci/install_slurm.sh"  # tests/test_slurm.py runs the Slurm recipe on a one-node Slurm
fi
if [[ "${RLVLA3_ROBOCASA:-0}" == "1" ]]; then
  RC="$HERE/.venv-robocasa"
  [[ -x "$RC/bin/python" ]] || "$PYTHON" -m venv "$RC"
  "$RC/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" || "$RC/bin/python" -m pip install -q "torch>=2.4"
  "$RC/bin/python" -m pip install -q --disable-pip-version-check rlinf-robocasa365 "robosuite>=1.5.2" -e "$HERE"
  # What it can and cannot build here: docs/robocasa.md.
  "$RC/bin/python" -m workers.envs.robocasa || true
fi
if [[ "${RLVLA3_MPLIB:-0}" == "1" ]]; then
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --upgrade \
    --target "$HERE/.mplib-numpy1" "numpy==1.26.4"
fi
echo "$VENV"
