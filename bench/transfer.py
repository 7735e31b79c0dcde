"""Moving a batch of camera images between two processes: shared memory vs inline frames.

    python bench/transfer.py [--images 32] [--size 224] [--reps 30] [--out bench/out] [--quick | --smoke]

Both ways run side by side in one run, repetitions interleaved (shm, inline, shm, ...), between
this process (the writer) and a receiver process, over tcp://127.0.0.1:

- ``shm``: the writer copies the batch into a block of its :class:`rlvla3.shm.ShmPool` (the
  simulator's observation write) and sends an OBS whose tensor is a ShmRef descriptor; the
  receiver decodes, maps the segment (once, :class:`ShmAttachments`) and copies the block into
  its own buffer.
- ``inline``: the writer encodes the batch with :func:`rlvla3.protocol.encode` (a zero-copy
  frame) and sends it; the receiver decodes and copies the frame into its own buffer.

- ``shm_view`` (extra, for context): as ``shm``, but the receiver uses the mapped view in place
  (no copy into its own buffer), as a reader that feeds the block straight to its model would.

Each message is acknowledged before the next one reuses the writer's buffer. A repetition's time
runs from the start of the write (shm) or encode (inline) to the ack. The receiver reports its
own decode and copy times in the ack so the number can be explained.

Last line of stdout: one JSON object (``shm_mb_s``, ``inline_mb_s``, ``ratio`` = shm/inline from
total time over the reps, ``ratio_median`` from median reps, ``shm_view_mb_s``, ``batch_bytes``,
``reps``, ...). Writes ``transfer.png`` and ``transfer.json`` under ``--out``. MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, note, parse_bench_args, start_child, stop_child  # noqa: E402

from rlvla3 import names
from rlvla3 import protocol as P  # noqa: E402
from rlvla3.lifetime import follow_launcher  # noqa: E402
from rlvla3.observation import IMAGES  # noqa: E402
from rlvla3.shm import ShmAttachments, ShmPool, host_id  # noqa: E402

TENSOR = names.tensor_name(IMAGES, "front")
"""The batch travels as one camera's images of an OBS, named as the simulator names it."""


# =============================================================================================
# Receiver (separate process)
# =============================================================================================


def receiver(images: int, size: int) -> None:
    follow_launcher()  # SIGTERM (default action: exit) when the benchmark dies
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
    sock.bind("tcp://127.0.0.1:0")
    print(sock.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
    own = np.ones((images, size, size, 3), np.uint8)  # touched: no page faults in the timed copy
    att = ShmAttachments()
    try:
        while True:
            if not sock.poll(200):
                continue
            frames = sock.recv_multipart(copy=False)
            ident, body = frames[0], frames[1:]
            if body and body[0].bytes == b"stop":
                break
            t0 = time.perf_counter_ns()
            msg = P.decode(body)
            t1 = time.perf_counter_ns()
            arr = att.materialize(msg.tensors[TENSOR])
            if msg.get("copy", True):
                np.copyto(own, arr)
            t2 = time.perf_counter_ns()
            sock.send_multipart([ident, msgpack.packb({"decode_us": (t1 - t0) // 1000, "copy_us": (t2 - t1) // 1000,
                                                       "sum": int(own[:, 0, 0, 0].sum())})])
    finally:
        att.close()
        sock.close()
        ctx.term()


# =============================================================================================
# Writer
# =============================================================================================


def fields(n: int, rep: int, copy: bool = True) -> dict[str, Any]:
    return {"slot": 0, "req_id": rep, "n": n, "instruction": [""] * n, "episode_step": [0] * n, "copy": copy}


def wait_ack(sock: zmq.Socket, timeout_s: float = 30.0) -> dict[str, Any]:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError(f"no ack within {timeout_s} s")
    return msgpack.unpackb(sock.recv())


def bar_chart(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ["shm", "inline", "shm_view"]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    vals = [res[f"{m}_mb_s"] for m in modes]
    bars = ax.bar(modes, vals, color=["tab:green", "tab:blue", "tab:olive"])
    for m, b in zip(modes, bars):
        per = res["per_rep_mb_s"][m]
        ax.scatter([b.get_x() + b.get_width() / 2] * len(per), per, color="k", s=6, zorder=3)
        ax.annotate(f"{b.get_height():.0f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom")
    ax.set_ylabel("MB/s (batch bytes / write-to-ack time)")
    ax.set_title(f"{res['images']}x{res['size']}x{res['size']}x3 uint8 = {res['batch_bytes'] / 1e6:.1f} MB, "
                 f"{res['reps']} reps; shm/inline = {res['ratio']}x", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per way")
    args = parse_bench_args(ap, "short run (well under 60 s)", lambda a: receiver(a.images, a.size))
    if args is None:
        return
    if args.quick:
        args.reps = min(args.reps, 15)
    if args.smoke:
        args.reps, args.images = 2, min(args.images, 4)
    out = Path(args.out)
    t_start = time.monotonic()

    shape = (args.images, args.size, args.size, 3)
    batch = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    nbytes = batch.nbytes
    proc, ep = start_child([__file__, "--child", "--images", str(args.images), "--size", str(args.size)])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ep)
    pool = ShmPool(f"bench{os.getpid()}", nbytes + 4096, host=host_id())
    off = pool.alloc(nbytes)
    times: dict[str, list[int]] = {"shm": [], "inline": [], "shm_view": []}
    parts: dict[str, dict[str, list[int]]] = {m: {"write_us": [], "decode_us": [], "copy_us": []} for m in times}
    try:
        def once(mode: str, rep: int, keep: bool) -> None:
            t0 = time.perf_counter_ns()
            if mode in ("shm", "shm_view"):
                pool.view(off, "uint8", shape)[...] = batch
                frames = P.encode(P.OBS, fields(args.images, rep, mode == "shm"), {TENSOR: pool.ref(off, "uint8", shape)})
            else:
                frames = P.encode(P.OBS, fields(args.images, rep), {TENSOR: batch})
            t1 = time.perf_counter_ns()
            sock.send_multipart(frames, copy=False)
            ack = wait_ack(sock)
            t2 = time.perf_counter_ns()
            if keep:
                times[mode].append(t2 - t0)
                parts[mode]["write_us"].append((t1 - t0) // 1000)
                parts[mode]["decode_us"].append(ack["decode_us"])
                parts[mode]["copy_us"].append(ack["copy_us"])

        for rep in range(2):  # warm-up: page faults, segment attach, socket buffers
            once("shm", rep, False)
            once("inline", rep, False)
            once("shm_view", rep, False)
        for rep in range(args.reps):
            order = ("shm", "inline", "shm_view") if rep % 2 == 0 else ("shm_view", "inline", "shm")
            for mode in order:
                once(mode, rep, True)
        sock.send(b"stop")
    finally:
        sock.close(0)
        ctx.term()
        stop_child(proc)
        pool.close()

    def mb_s(ns: list[int]) -> float:
        return round(nbytes * len(ns) / (sum(ns) / 1e9) / 1e6, 1)

    med = {m: float(np.median(v)) for m, v in times.items()}
    res: dict[str, Any] = {
        "shm_mb_s": mb_s(times["shm"]),
        "inline_mb_s": mb_s(times["inline"]),
        "shm_view_mb_s": mb_s(times["shm_view"]),
    }
    res["ratio"] = round(res["shm_mb_s"] / res["inline_mb_s"], 2)
    res.update({
        "target_ratio": 5.0,
        "shm_median_mb_s": round(nbytes / (med["shm"] / 1e9) / 1e6, 1),
        "inline_median_mb_s": round(nbytes / (med["inline"] / 1e9) / 1e6, 1),
        "ratio_median": round(med["inline"] / med["shm"], 2),
        "ratio_view": round(res["shm_view_mb_s"] / res["inline_mb_s"], 2),
        "shm_view_median_mb_s": round(nbytes / (med["shm_view"] / 1e9) / 1e6, 1),
        "shm_median_ms": round(med["shm"] / 1e6, 3),
        "shm_view_median_ms": round(med["shm_view"] / 1e6, 3),
        "inline_median_ms": round(med["inline"] / 1e6, 3),
        "parts_median_us": {m: {k: int(np.median(v)) for k, v in p.items()} for m, p in parts.items()},
        "batch_bytes": nbytes, "images": args.images, "size": args.size, "reps": args.reps,
        "per_rep_mb_s": {m: [round(nbytes / (t / 1e9) / 1e6, 1) for t in v] for m, v in times.items()},
        "wall_s": round(time.monotonic() - t_start, 1),
    })
    res["png"] = str(bar_chart(res, out / "transfer.png"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(res, indent=1))
    res.pop("per_rep_mb_s")
    note(f"shm {res['shm_mb_s']} MB/s, inline {res['inline_mb_s']} MB/s, ratio {res['ratio']}")
    emit(res)


if __name__ == "__main__":
    main()
