#!/usr/bin/env bash
# The prepared GPU check: one H200, no network, under 7 minutes. bench/gpu/README.md says what
# each stage measures, its timeouts (GPU_CHECK_T_*, GPU_CHECK_TOTAL_S) and how to run it.
#
#   bash bench/gpu/check.sh --prepare [--carry gpu_carry]   # here, with a network: fill the carry folder
#   bash bench/gpu/check.sh [--carry gpu_carry] [--out DIR]  # on the GPU machine
#   bash bench/gpu/check.sh --dry-run [--out DIR]            # every stage on CPU with tiny models
#   ... --stages update,job_async                            # only these (a rerun; the rest: "not selected")
#
# Stages, in order, each under its own timeout, each writing OUT/<stage>.json the moment it ends:
# install, models, update, job_sync, job_async, job_gr00t. The last line of stdout is one JSON object
# summarising every stage (also OUT/summary.json).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${PYTHON:-python3}"
DRY=0
PREPARE=0
OUT="bench/out/gpu_check"
CARRY="gpu_carry"
SELECTED="install,models,update,job_sync,job_async,job_gr00t"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run|--tiny) DRY=1 ;;
    --prepare) PREPARE=1 ;;
    --out) OUT="$2"; shift ;;
    --carry) CARRY="$2"; shift ;;
    --stages) SELECTED="$2"; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

# ---------------------------------------------------------------------------------------------
# --prepare: the carry folder (run where pip and apt-get reach their registries)
# ---------------------------------------------------------------------------------------------
if [[ $PREPARE == 1 ]]; then
  set -e
  FETCH="${FETCH_WHEELS:-$ROOT/../shared/gpu/fetch-wheels.sh}"
  [[ -f "$FETCH" ]] || { echo "gpu_check: no $FETCH (set FETCH_WHEELS to the shared fetch-wheels.sh)" >&2; exit 2; }
  mkdir -p "$CARRY/wheels" "$CARRY/gl" /tmp/amd64-lists/partial
  bash "$FETCH" "$CARRY/wheels" >&2
  # The image's transformers (5.17) predates the project's floor (5.24: `cache=` replaced
  # `past_key_values=`, and Dinov2's attention was renamed): carry the floor's own release.
  tf_floor=$(sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml")
  [[ -n "$tf_floor" ]] || { echo "gpu_check: no transformers floor in pyproject.toml" >&2; exit 2; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    -d "$CARRY/wheels" "transformers==$tf_floor" >&2
  # The CUDA-IPC byte test (tests/test_weights.py) runs under pytest, which the image may lack.
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    -d "$CARRY/wheels" pytest pluggy iniconfig pygments >&2
  # The device takes 64 MiB in all; solid xz carries transformers in a third of its wheel.
  "$PY" "$HERE/install.py" --pack "$CARRY/wheels" >&2
  apt_opts=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64-lists)
  apt-get "${apt_opts[@]}" update >/dev/null
  (cd "$CARRY/gl" && apt-get "${apt_opts[@]}" download libegl1 libglvnd0 libopengl0 libgl1 libglx0 >&2)
  "$PY" - "$CARRY" <<'EOF'
import json, sys
from pathlib import Path
carry = Path(sys.argv[1])
mib = lambda ps: round(sum(p.stat().st_size for p in ps) / 2**20, 1)
files = sorted(p for p in carry.rglob("*") if p.is_file())
print(json.dumps({"carry": str(carry), "files": [str(p.relative_to(carry)) for p in files],
                  "wheels_mib": mib(carry.glob("wheels/*")), "gl_mib": mib(carry.glob("gl/*")),
                  "total_mib": mib(files), "limit_mib": 64}))
EOF
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"              # both relative to the folder it is started from
CARRY="$(realpath -m "$CARRY")"
cd "$ROOT"
rm -f "$OUT"/*.json
SITE="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/rlvla3-gpu-site}"
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MUJOCO_GL="${MUJOCO_GL:-egl}" PYOPENGL_PLATFORM="${PYOPENGL_PLATFORM:-egl}"
NV_EGL=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json  # the driver's mount on the GPU machine
if [[ $DRY == 0 && -f $NV_EGL && -z "${__EGL_VENDOR_LIBRARY_FILENAMES:-}" ]]; then
  export __EGL_VENDOR_LIBRARY_FILENAMES=$NV_EGL
fi
T0=$(date +%s.%N)
TOTAL="${GPU_CHECK_TOTAL_S:-400}"

elapsed() { "$PY" -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$T0" "$(date +%s.%N)"; }

# run_stage NAME TIMEOUT_S CMD...: run it under its timeout, then write OUT/NAME.json at once.
run_stage() {
  local name=$1 tmo=$2; shift 2
  local t1 rc
  if [[ ",$SELECTED," != *",$name,"* ]]; then
    "$PY" "$HERE/report.py" skip "$name" "not selected (--stages)" >"$OUT/$name.json"
    return
  fi
  echo "gpu_check: stage $name (timeout ${tmo} s): $*" >&2
  t1=$(date +%s.%N)
  timeout -k 10 "$tmo" "$@" >"$OUT/logs/$name.out" 2>"$OUT/logs/$name.log"
  rc=$?
  "$PY" "$HERE/report.py" stage "$name" "$rc" \
    "$("$PY" -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$t1" "$(date +%s.%N)")" \
    "$tmo" "$OUT/logs/$name.out" "$OUT/logs/$name.log" >"$OUT/$name.json"
  echo "gpu_check: stage $name done, rc=$rc" >&2
}

job_budget() {  # what is left for the job stages, split between those still to run; <= 90 s each
  "$PY" -c "import sys; left = float(sys.argv[1]) - float(sys.argv[2]); print(int(max(30, min(90, left / int(sys.argv[3])))))" \
    "$TOTAL" "$(elapsed)" "$1"
}

if [[ $DRY == 1 ]]; then
  run_stage install "${GPU_CHECK_T_INSTALL:-120}" "$PY" bench/gpu/install.py --carry "$CARRY" --site "$SITE" --dry-run
  run_stage models "${GPU_CHECK_T_MODELS:-180}" "$PY" bench/gpu/models.py --device cpu --tiny --batches 1,2 --reps 1
  run_stage update "${GPU_CHECK_T_UPDATE:-240}" "$PY" bench/gpu/update.py --device cpu --tiny --updates 1 --batch-steps 8 --minibatch 8 \
    --fragment-len 4 --group-size 2
  tiny_job=(--device cpu --tiny --until-version 1 --simulators 1 --envs 2 --slots 1 --batch-steps 8 --minibatch 8
            --fragment-len 4 --seconds 150)
  run_stage job_sync 180 "$PY" bench/gpu/job.py --mode sync "${tiny_job[@]}"
  run_stage job_async 180 "$PY" bench/gpu/job.py --mode async "${tiny_job[@]}"
  run_stage job_gr00t 180 "$PY" bench/gpu/job.py --mode async --family gr00t_n15 "${tiny_job[@]}"
  CUDA=0
else
  run_stage install "${GPU_CHECK_T_INSTALL:-45}" "$PY" bench/gpu/install.py --carry "$CARRY" --site "$SITE"
  if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
    CUDA=1
    run_stage models "${GPU_CHECK_T_MODELS:-75}" "$PY" bench/gpu/models.py --reps 2
    run_stage update "${GPU_CHECK_T_UPDATE:-110}" "$PY" bench/gpu/update.py --updates 1
    t=$(job_budget 3)
    run_stage job_sync "$t" "$PY" bench/gpu/job.py --mode sync --seconds $((t - 15))
    t=$(job_budget 2)
    run_stage job_async "$t" "$PY" bench/gpu/job.py --mode async --seconds $((t - 15))
    t=$(job_budget 1)
    run_stage job_gr00t "$t" "$PY" bench/gpu/job.py --mode async --family gr00t_n15 --seconds $((t - 15))
  else
    CUDA=0
    echo "gpu_check: CUDA is not available here; the GPU stages are skipped (--dry-run rehearses them on CPU)" >&2
    for s in models update job_sync job_async job_gr00t; do
      "$PY" "$HERE/report.py" skip "$s" "CUDA not available" >"$OUT/$s.json"
    done
  fi
fi
"$PY" "$HERE/report.py" summary "$OUT" "$DRY" "$CUDA" "$(elapsed)"
exit 0
