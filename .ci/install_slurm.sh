#!/usr/bin/env bash
# Slurm and munge for tests/test_slurm.py: Debian's slurm-wlm and munge. The test starts its own
# munged, slurmctld and slurmd from a config in a temporary folder; nothing here configures or
# starts a service. Run as root (scripts/bootstrap.sh does, when it runs as root). Idempotent:
# once both are installed it only checks.
set -euo pipefail
log() { echo "[install_slurm] $*" >&2; }
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  log "no apt-get here: install Slurm (slurmctld, slurmd, sbatch) and munge yourself, or tests/test_slurm.py skips"
  exit 0
fi
apt-get update -q >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >&2
log "ok: $(slurmctld -V)"
