"""Stage a of ``bench/gpu/check.sh``: install what the GPU machine lacks from the carried folder,
with no network, then check that everything the other stages import is there.

    python bench/gpu/install.py --carry gpu_carry --site /tmp/rlvla3-site [--dry-run]

- ``CARRY/wheels/*.whl`` (``bash bench/gpu/check.sh --prepare``): each wheel whose distribution is
  missing, or installed at an older version than the wheel's, goes into ``--site`` (``pip install
  --no-index --no-deps --no-compile``; the caller puts ``--site`` first on ``PYTHONPATH`` for every
  later stage). The image's transformers (5.17) is older than the project's floor (5.24), so its
  carried wheel replaces it there.
- ``CARRY/wheels/*.whl.tar.xz``: a wheel whose members ``--prepare`` repacked as one solid xz
  stream (``python bench/gpu/install.py --pack DIR``), because the device takes 64 MiB in all and
  zip compresses file by file: transformers is 12.9 MiB as a wheel and 3.6 MiB packed. Here it is
  zipped back, member for member, and installed like the others.
- ``CARRY/gl/*.deb``: the GL loaders headless MuJoCo needs, unpacked into ``/`` (``dpkg -x``,
  ``ldconfig``) when ``libEGL.so.1`` is missing; never in ``--dry-run``, which must not write
  outside its folders.
- then, in a fresh interpreter: every module the check needs imports (versions reported), and
  MuJoCo makes an EGL context (``MUJOCO_GL=egl``): Meta-World's camera needs it.

Prints one JSON object last; ``ok`` is false when a needed module is missing (in ``--dry-run``
the simulators and EGL are reported but optional: the job stage falls back to the synthetic env).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

from packaging.version import InvalidVersion, Version

CORE = ["torch", "transformers", "zmq", "structlog", "hdrh", "xxhash", "msgpack", "click", "yaml", "safetensors"]
"""Modules every stage imports (the image has torch, transformers, msgpack, click, pyyaml,
safetensors and xxhash; the wheels bring pyzmq, structlog and hdrhistogram)."""
SIMS = ["mujoco", "metaworld", "gymnasium"]
"""Modules of the real job's simulator (the wheels bring them, with glfw, pyopengl, farama)."""

PROBE = r"""
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        m = importlib.import_module(name)
        out[name] = str(getattr(m, "__version__", "ok"))
    except Exception as exc:
        out[name] = f"missing: {type(exc).__name__}: {exc}"[:200]
print(json.dumps(out))
"""
EGL = r"""
import mujoco
ctx = mujoco.GLContext(64, 64)
ctx.make_current()
ctx.free()
print("ok")
"""


PACKED = ".tar.xz"
PACK_MIN_BYTES = 2 * 2**20
"""Smaller wheels are carried as they are: packing them saves too little to matter."""
PACK_KEEP_RATIO = 0.7
"""A packed wheel replaces its wheel only when it is this much smaller (metaworld's meshes and
textures do not compress: 35.0 MiB either way)."""


def dist_name(wheel: Path) -> str:
    """A wheel's distribution name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def new_enough(have: str, carried: str) -> bool:
    """Whether the installed version serves instead of the carried one (same or newer)."""
    try:
        return Version(have) >= Version(carried)
    except InvalidVersion:
        return have == carried


def pack_wheel(wheel: Path) -> Path | None:
    """Repack ``wheel``'s members, in order, as one xz tar beside it; keep whichever is smaller."""
    packed = wheel.with_name(wheel.name + PACKED)
    with zipfile.ZipFile(wheel) as zf, tarfile.open(packed, "w:xz", preset=9) as tf:
        for info in zf.infolist():
            data = zf.read(info)
            ti = tarfile.TarInfo(info.filename)
            ti.size, ti.mtime, ti.mode = len(data), 0, (info.external_attr >> 16) or 0o644
            tf.addfile(ti, io.BytesIO(data))
    if packed.stat().st_size <= PACK_KEEP_RATIO * wheel.stat().st_size:
        wheel.unlink()
        return packed
    packed.unlink()
    return None


def unpack_wheel(packed: Path, into: Path) -> Path:
    """Zip a packed wheel's members back into ``into/<wheel name>`` for pip (no file is written
    outside ``into``: member names only become zip entries)."""
    wheel = into / packed.name[: -len(PACKED)]
    with tarfile.open(packed, "r:xz") as tf, zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        for ti in tf:
            if not ti.isfile():
                raise ValueError(f"{packed.name}: {ti.name} is not a regular file")
            info = zipfile.ZipInfo(ti.name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (ti.mode & 0o777) << 16
            zf.writestr(info, tf.extractfile(ti).read())
    return wheel


def install_wheels(carry: Path, site: Path) -> dict:
    wheels = sorted([*(carry / "wheels").glob("*.whl"), *(carry / "wheels").glob("*.whl" + PACKED)])
    there = {w.name: v for w in wheels if (v := installed(dist_name(w))) and new_enough(v, wheel_version(w))}
    todo = [w for w in wheels if w.name not in there]
    row: dict = {"wheels_carried": len(wheels), "already_there": sorted(there), "installed": [w.name for w in todo]}
    if todo:
        site.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="rlvla3-wheels-") as tmp:
            try:
                paths = [unpack_wheel(w, Path(tmp)) if w.name.endswith(PACKED) else w for w in todo]
            except (OSError, ValueError, tarfile.TarError) as exc:
                row["error"] = f"unpacking a carried wheel failed: {type(exc).__name__}: {exc}"
                return row
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                   "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, paths)],
                                  capture_output=True, text=True)
        row["install_s"] = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0:
            row["error"] = f"pip install failed ({proc.returncode}): {proc.stderr[-800:]}"
    return row


def egl_present() -> bool:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout if shutil.which("ldconfig") else ""
    return "libEGL.so.1" in out


def install_gl(carry: Path, dry_run: bool) -> dict:
    debs = sorted((carry / "gl").glob("*.deb"))
    row: dict = {"debs_carried": [d.name for d in debs], "libEGL_before": egl_present()}
    if row["libEGL_before"] or not debs:
        return row
    if dry_run:
        row["unpacked"] = "no (dry run)"
        return row
    for deb in debs:
        proc = subprocess.run(["dpkg", "-x", str(deb), "/"], capture_output=True, text=True)
        if proc.returncode != 0:
            row["error"] = f"dpkg -x {deb.name}: {proc.stderr[-300:]}"
            return row
    subprocess.run(["ldconfig"], capture_output=True)
    row["unpacked"] = "yes"
    row["libEGL_after"] = egl_present()
    return row


def probe(code: str, args: list[str], timeout: float) -> str:
    """Run ``code`` in a fresh interpreter (it sees ``--site`` through PYTHONPATH, which this
    process's import system, set up before the install, may not)."""
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout} s"
    if proc.returncode != 0:
        return f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"[:300]
    return proc.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carry", default="gpu_carry", help="folder with wheels/ and gl/ (bench/gpu/check.sh --prepare)")
    ap.add_argument("--site", help="where the wheels go (put it first on PYTHONPATH afterwards)")
    ap.add_argument("--dry-run", action="store_true", help="CPU rehearsal: never writes outside --site")
    ap.add_argument("--pack", metavar="DIR", help="(--prepare) repack DIR's large wheels as solid xz, then exit")
    args = ap.parse_args()
    if args.pack:
        big = [w for w in sorted(Path(args.pack).glob("*.whl")) if w.stat().st_size >= PACK_MIN_BYTES]
        print(json.dumps({"packed": [p.name for w in big if (p := pack_wheel(w))]}), flush=True)
        return
    if not args.site:
        ap.error("--site is required (or --pack DIR)")
    carry, site = Path(args.carry), Path(args.site)
    out: dict = {"carry": str(carry), "carry_found": carry.is_dir(), "site": str(site),
                 "python": sys.version.split()[0]}
    out["wheels"] = install_wheels(carry, site)
    out["gl"] = install_gl(carry, args.dry_run)
    env_path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(site) not in env_path and str(site.resolve()) not in env_path:
        out["warning"] = f"{site} is not on PYTHONPATH: later stages will not see what was installed"
    raw = probe(PROBE, CORE + SIMS, timeout=120)
    try:
        out["modules"] = json.loads(raw)
    except json.JSONDecodeError:
        out["modules"] = {"error": raw}
    mods = out["modules"]
    missing = [m for m in CORE if str(mods.get(m, "missing")).startswith("missing")]
    sims_missing = [m for m in SIMS if str(mods.get(m, "missing")).startswith("missing")]
    out["egl"] = probe(EGL, [], timeout=30) if "mujoco" not in sims_missing else "not tried (no mujoco)"
    out["missing"] = missing
    out["sims_missing"] = sims_missing
    problems = missing + ([] if args.dry_run else sims_missing + ([] if out["egl"] == "ok" else ["egl"]))
    if out["wheels"].get("error"):
        problems.append("pip")
    out["ok"] = not problems
    if problems:
        out["error"] = f"not ready: {', '.join(problems)}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
