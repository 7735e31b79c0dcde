"""Camera images from the renderer's output in a simulator to a tensor ready in a generator:
shared memory vs inline frames (docs/architecture.md's steps 1-6 of an observation's path).

    python bench/fabric/transfer.py --quick     # --images 32 --size 224 --requests 1 --reps 30 --device cpu|auto

This process plays the simulator, a child process the generator, over tcp://127.0.0.1: the batch
is ``--requests`` slots' observations (``--images`` uint8 images in all, with their states) sent
as the BATCH the broker forwards (its own hop is ``bench/broker/latency.py``'s). Three ways,
interleaved rep by rep:

- ``shm``: the production path. The renderer wrote each slot's images into its shared-memory
  block; the BATCH names the blocks; the generator maps them, gathers with the real
  :func:`workers.generator.gather`, then ``Observation.to_torch``.
- ``shm_copy``: as ``shm`` for a simulator that hands over a fresh array in GL row order
  (robosuite, ManiSkill): one flipped copy into the block, timed.
- ``inline``: the generator is on another host: the BATCH carries the bytes as zero-copy frames.

``--device auto`` with CUDA: the gather goes into pinned memory and the tensor to the GPU.
``ratio`` = shm/inline MB/s; ``<way>_cpu_median_ms``: CPU time of both processes (robust to a
loaded machine). Writes ``transfer.png`` and ``transfer.json`` under ``--out``. MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from rlvla3 import names
from rlvla3 import protocol as P
from rlvla3.harness.bench import emit_to, note, parse_bench_args, save_figure, shm_slots, start_child, stop_child, subplots
from rlvla3.harness.peer import zmq_socket
from rlvla3.lifetime import follow_launcher
from rlvla3.observation import Observation
from rlvla3.shm import ShmAttachments

MODES = ("shm", "shm_copy", "inline")
STATE_DIM = 8
STAGES = ("write_us", "encode_us", "wire_us", "decode_us", "gather_us", "torch_us")


def receiver(device_opt: str) -> None:
    follow_launcher()  # SIGTERM (default action: exit) when the benchmark dies
    import torch

    from workers.generator import gather

    device = "cuda" if device_opt == "auto" and torch.cuda.is_available() else "cpu"
    ctx = zmq.Context()
    sock = zmq_socket(ctx, zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MESSAGE_BYTES)
    sock.bind("tcp://127.0.0.1:0")
    print(sock.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
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
            obs, _, _ = gather(msg, att, pinned=device == "cuda")
            t2 = time.perf_counter_ns()
            ready = obs.to_torch(device)
            if device == "cuda":
                torch.cuda.synchronize()
            t3 = time.perf_counter_ns()
            check = int(sum(int(t.reshape(-1)[-1]) for t in ready.images.values()))
            sock.send_multipart([ident, msgpack.packb({
                "decode_us": (t1 - t0) // 1000, "gather_us": (t2 - t1) // 1000, "torch_us": (t3 - t2) // 1000,
                "device": device, "check": check, "cpu_ns": time.process_time_ns()})])
    finally:
        att.close()
        sock.close()
        ctx.term()


def batch_fields(blocks: list[Observation], rep: int) -> dict[str, Any]:
    reqs = [{"req_id": rep, "slot": i, "n": len(b), "instruction": b.instruction, "episode_step": [0] * len(b)}
            for i, b in enumerate(blocks)]
    return {"batch_id": rep, "requests": reqs}


def bar_chart(res: dict[str, Any], path: Path) -> Path:
    fig, (ax, ax2) = subplots(1, 2, figsize=(10, 4))
    vals = [res[f"{m}_mb_s"] for m in MODES]
    bars = ax.bar(MODES, vals, color=["tab:green", "tab:olive", "tab:blue"])
    for m, b in zip(MODES, bars):
        per = res["per_rep_mb_s"][m]
        ax.scatter([b.get_x() + b.get_width() / 2] * len(per), per, color="k", s=6, zorder=3)
        ax.annotate(f"{b.get_height():.0f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom")
    ax.set_ylabel("MB/s (batch bytes / renderer output to tensor)")
    ax.set_title(f"{res['images']}x{res['size']}x{res['size']}x3 uint8 in {res['requests']} request(s) = "
                 f"{res['batch_bytes'] / 1e6:.1f} MB, {res['reps']} reps\nshm/inline = {res['ratio']}x, "
                 f"shm_copy/inline = {res['ratio_copy']}x", fontsize=9)
    bottom = np.zeros(len(MODES))
    for stage in STAGES:
        h = np.array([res["parts_median_us"][m][stage] for m in MODES], float)
        ax2.bar(MODES, h, bottom=bottom, label=stage.removesuffix("_us"))
        bottom += h
    ax2.set_ylabel("median us per batch")
    ax2.set_title("where the time goes (median rep)", fontsize=9)
    ax2.legend(fontsize=8)
    return save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=32, help="images in the batch, over all requests")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--requests", type=int, default=1,
                    help="requests (slots) gathered into the batch; above 1 the gather's one copy is paid both ways")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions per way")
    ap.add_argument("--device", choices=("cpu", "auto"), default="cpu", help="auto: the tensor on CUDA if present")
    args = parse_bench_args(ap, "short run (well under 60 s)", lambda a: receiver(a.device))
    if args is None:
        return
    if args.quick:
        args.reps = min(args.reps, 15)
    if args.smoke:
        args.reps, args.images, args.requests = 2, min(args.images, 4), min(args.requests, 2)
    if args.images % args.requests:
        raise SystemExit(f"--images {args.images} is not a multiple of --requests {args.requests}")
    out = Path(args.out)
    t_start = time.monotonic()

    k, s = args.images // args.requests, args.size
    cams = {"front": (s, s)}
    pool, blocks, refs = shm_slots(f"bench{os.getpid()}", args.requests, k, cams, STATE_DIM)  # refs: as a slot keeps them
    rng = np.random.default_rng(0)
    # Two renderer outputs per slot, alternated by rep (so no rep reads what the last one left).
    rendered = [rng.integers(0, 256, (args.requests, k, s, s, 3), dtype=np.uint8) for _ in range(2)]
    for b in blocks:
        b.state[:] = rng.standard_normal(b.state.shape)
        b.instruction[:] = ["pick up the cube"] * k
    nbytes = args.images * s * s * 3
    proc, ep = start_child([__file__, "--child", "--device", args.device])
    ctx = zmq.Context()
    sock = zmq_socket(ctx, zmq.DEALER)
    sock.connect(ep)
    times: dict[str, list[int]] = {m: [] for m in MODES}
    parts: dict[str, dict[str, list[int]]] = {m: {st: [] for st in STAGES} for m in MODES}
    cpu: dict[str, list[int]] = {m: [] for m in MODES}
    device = "cpu"
    last_cpu = [0]  # the generator's CPU clock at its last ack
    try:
        def once(mode: str, rep: int, keep: bool) -> None:
            nonlocal device
            frame = rendered[rep % 2]
            if mode != "shm_copy":  # the renderer writes into the block (not timed)
                for b, img in zip(blocks, frame):
                    np.copyto(b.images["front"], img)
            c0 = time.process_time_ns()
            t0 = time.perf_counter_ns()
            if mode == "shm_copy":  # the simulator hands over a fresh, bottom-up array: one copy
                for b, img in zip(blocks, frame):
                    np.copyto(b.images["front"], img[:, ::-1])
            t1 = time.perf_counter_ns()
            tensors: dict[str, Any] = {}
            for i, b in enumerate(blocks):
                wire = b.to_tensors() if mode == "inline" else refs[i]
                tensors.update(names.with_prefix(names.request_prefix(i), wire))
            frames = P.encode(P.BATCH, batch_fields(blocks, rep), tensors)
            t2 = time.perf_counter_ns()
            sock.send_multipart(frames, copy=False)
            if not sock.poll(30_000):
                raise TimeoutError("no ack from the generator within 30 s")
            ack = msgpack.unpackb(sock.recv())
            t3 = time.perf_counter_ns()
            c3 = time.process_time_ns()
            device = ack["device"]
            gen_cpu, last_cpu[0] = ack["cpu_ns"] - last_cpu[0], ack["cpu_ns"]
            if keep:
                times[mode].append(t3 - t0)
                cpu[mode].append(c3 - c0 + gen_cpu)
                p = parts[mode]
                p["write_us"].append((t1 - t0) // 1000)
                p["encode_us"].append((t2 - t1) // 1000)
                for st in ("decode_us", "gather_us", "torch_us"):
                    p[st].append(ack[st])
                p["wire_us"].append(max(0, (t3 - t2) // 1000 - ack["decode_us"] - ack["gather_us"] - ack["torch_us"]))

        for rep in range(2):  # warm-up: page faults, segment attach, socket buffers
            for mode in MODES:
                once(mode, rep, False)
        for rep in range(args.reps):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                once(mode, rep, True)
        sock.send(b"stop")
    finally:
        sock.close(0)
        ctx.term()
        stop_child(proc)
        blocks.clear()  # their arrays are views of the pool's memory
        pool.close()

    def mb_s(ns: list[int]) -> float:
        return round(nbytes * len(ns) / (sum(ns) / 1e9) / 1e6, 1)

    med = {m: float(np.median(v)) for m, v in times.items()}
    res: dict[str, Any] = {f"{m}_mb_s": mb_s(times[m]) for m in MODES}
    res["ratio"] = round(res["shm_mb_s"] / res["inline_mb_s"], 2)
    res.update({
        "target_ratio": 5.0,
        "ratio_median": round(med["inline"] / med["shm"], 2),
        "ratio_copy": round(res["shm_copy_mb_s"] / res["inline_mb_s"], 2),
        "ratio_copy_median": round(med["inline"] / med["shm_copy"], 2),
        **{f"{m}_median_mb_s": round(nbytes / (med[m] / 1e9) / 1e6, 1) for m in MODES},
        **{f"{m}_median_ms": round(med[m] / 1e6, 3) for m in MODES},
        "parts_median_us": {m: {k: int(np.median(v)) for k, v in p.items()} for m, p in parts.items()},
        **{f"{m}_cpu_median_ms": round(float(np.median(cpu[m])) / 1e6, 3) for m in MODES},
        "ratio_cpu": round(float(np.median(cpu["inline"]) / np.median(cpu["shm"])), 2),
        "batch_bytes": nbytes, "images": args.images, "size": args.size, "requests": args.requests,
        "reps": args.reps, "device": device,
        "per_rep_mb_s": {m: [round(nbytes / (t / 1e9) / 1e6, 1) for t in v] for m, v in times.items()},
        "wall_s": round(time.monotonic() - t_start, 1),
    })
    res["png"] = str(bar_chart(res, out / "transfer.png"))
    note(f"shm {res['shm_mb_s']} MB/s, shm_copy {res['shm_copy_mb_s']} MB/s, inline {res['inline_mb_s']} MB/s, "
         f"ratio {res['ratio']} (copy {res['ratio_copy']})")
    emit_to(out, "transfer.json", res, per_rep_mb_s=res.pop("per_rep_mb_s"))


if __name__ == "__main__":
    main()
