#!/usr/bin/env bash
# Install the real simulators (Meta-World, ManiSkill, LIBERO + assets, Gymnasium MuJoCo) into one venv.
#
# Run as root. Idempotent: re-running only re-checks. Give the venv as $PY (its python) or
# $PIP (its pip); default: the python on PATH. Set SKIP_APT=1 to skip the system packages.
#
# Why the odd steps:
#  * ManiSkill renders on the CPU only through Mesa >= 25's lavapipe (bookworm-backports);
#    Debian stable's Mesa 22 fails with "Failed to find a supported physical device". The
#    backports suite is added by copying this machine's own Debian stanza, so no mirror host is
#    written here.
#  * LIBERO pulls torchvision (robomimic, thop). The registry's torchvision does not load beside
#    the CPU torch wheel and then breaks `import transformers`, so LIBERO's offenders go in with
#    --no-deps plus the list of what they really need.
set -euo pipefail

if [[ -n "${PY:-}" ]]; then
  PIP=("$PY" -m pip)
elif [[ -n "${PIP:-}" ]]; then
  PIP=("$PIP")
  PY="$(dirname "$PIP")/python"
else
  PY=python3
  PIP=("$PY" -m pip)
fi
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

log() { echo "[install_sims] $*" >&2; }

# ---------------------------------------------------------------------------------------------
# 1. System packages from bookworm-backports (Mesa 25 lavapipe, EGL, OSMesa)
# ---------------------------------------------------------------------------------------------
APT_PKGS=(mesa-vulkan-drivers libvulkan1 libosmesa6 libegl1 libegl-mesa0 libgl1 libgl1-mesa-dri libglx-mesa0 libgles2)
if [[ "${SKIP_APT:-0}" != "1" ]]; then
  SRC=/etc/apt/sources.list.d/debian.sources
  BP=/etc/apt/sources.list.d/backports.sources
  CODENAME="$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")"
  if [[ ! -f "$BP" ]] && ! grep -rqs "${CODENAME}-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    [[ -f "$SRC" ]] || { log "no $SRC to copy a stanza from"; exit 1; }
    # First stanza whose Suites line names the plain release: reuse its URIs / key as-is.
    awk -v rel="$CODENAME" -v bp="${CODENAME}-backports" '
      BEGIN { RS=""; ORS="\n\n" }
      $0 ~ ("Suites:[^\n]*[ \t]" rel "([ \t]|$|\n)") && !done {
        n = split($0, lines, "\n"); out = ""
        for (i = 1; i <= n; i++) {
          if (lines[i] ~ /^Suites:/) lines[i] = "Suites: " bp
          out = out lines[i] "\n"
        }
        printf "%s", out; done = 1
      }' "$SRC" > "$BP.tmp"
    [[ -s "$BP.tmp" ]] || { rm -f "$BP.tmp"; log "no stanza for $CODENAME in $SRC"; exit 1; }
    mv "$BP.tmp" "$BP"
    log "added ${CODENAME}-backports as $BP"
    apt-get update -q
  fi
  if ! dpkg-query -W -f='${Version}\n' mesa-vulkan-drivers 2>/dev/null | grep -q '^25\|^2[6-9]'; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      -t "${CODENAME}-backports" "${APT_PKGS[@]}"
  fi
fi

# ---------------------------------------------------------------------------------------------
# 2. Python packages
# ---------------------------------------------------------------------------------------------
"${PIP[@]}" install -q "torch==2.13.0"
# The three simulators' real needs (the [libero] extra holds LIBERO's env deps and assets) ...
"${PIP[@]}" install -q -e "$HERE[dev,all]" "torch==2.13.0"
# ... and LIBERO itself without its declared deps (robomimic / thop -> torchvision); its envs
# do not use robomimic or thop, only its lifelong-learning training code does.
"${PIP[@]}" install -q --no-deps "libero==0.1.1"
if "${PIP[@]}" show torchvision >/dev/null 2>&1; then
  log "torchvision found: removing it (breaks transformers beside the CPU torch wheel)"
  "${PIP[@]}" uninstall -y -q torchvision
fi

# ---------------------------------------------------------------------------------------------
# 3. Check
# ---------------------------------------------------------------------------------------------
cd "$HERE" && MUJOCO_GL="${MUJOCO_GL:-egl}" "$PY" - <<'PYEOF'
import importlib
from workers.envs.libero import prepare_offline
prepare_offline()  # LIBERO config pre-seeded, so its import does not prompt
for mod in ("torch", "transformers", "mujoco", "metaworld", "mani_skill", "robosuite", "libero.libero", "gymnasium.envs.mujoco.hopper_v4"):
    importlib.import_module(mod)
import importlib.util
assert importlib.util.find_spec("torchvision") is None, "torchvision is back: transformers would break"
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("[install_sims] ok: torch", torch.__version__)
PYEOF
