"""A reader process for the weight tests: a WeightReceiver beside a loop that keeps serving.

    python tests/weights_peer.py --pub EP --snap EP --report EP --name NAME [--host ID] [--bucket-mb N]
                                 [--device cuda --cuda-ipc]

It subscribes to the announcements (PUB), asks for the snapshot (Clone pattern), and runs
forward passes on its model back to back; a "weights" thread fetches announced versions, and
the loop swaps them in between two forward passes, as the generator does. It reports to the
test over PUSH (JSON): ``ready``, ``swapped`` (version, source, digest of its weights, forward
passes so far), ``rejected`` (a fetch failed and will be retried). Exits on a ``stop``
message on PUB.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlvla3 import protocol as P  # noqa: E402
from rlvla3.shm import host_id  # noqa: E402
from rlvla3.weights.receiver import WeightReceiver  # noqa: E402


def tiny_model(seed: int | None = None) -> torch.nn.Module:
    """The tests' model: trainable layers (one of 5.8 MB, so hashing runs in chunks), a frozen
    LayerNorm weight and a buffer. ``seed=None``: zeros, as a reader starts."""
    if seed is not None:
        torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 1200), torch.nn.Linear(1200, 1200), torch.nn.LayerNorm(1200),
                            torch.nn.Linear(1200, 4))
    m[2].weight.requires_grad_(False)
    m.register_buffer("stats", torch.arange(6, dtype=torch.float32))
    m[3].to(torch.bfloat16)
    if seed is None:
        with torch.no_grad():
            for t in [*m.parameters(), *m.buffers()]:
                t.zero_()
    return m


def digest(module: torch.nn.Module) -> str:
    """xxh3 of every parameter and buffer, in order (what the test compares)."""
    h = xxhash.xxh3_64()
    for t in [*module.parameters(), *module.buffers()]:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pub", required=True)
    ap.add_argument("--snap", required=True)
    ap.add_argument("--report", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--host", default="")
    ap.add_argument("--bucket-mb", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cuda-ipc", action="store_true", help="read trainable tensors from the publisher's GPU buffer")
    args = ap.parse_args()
    model = tiny_model(None).to(args.device).eval()
    rx = WeightReceiver(model, args.host or host_id(), bucket_mb=args.bucket_mb, cuda_ipc=args.cuda_ipc)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(args.pub)
    snap = ctx.socket(zmq.DEALER)
    snap.connect(args.snap)
    report = ctx.socket(zmq.PUSH)
    report.setsockopt(zmq.LINGER, 2000)
    report.connect(args.report)

    def tell(event: str, **kw: object) -> None:
        report.send_json({"event": event, "name": args.name, "pid": os.getpid(), **kw})

    snap.send_multipart(P.encode(P.SNAPSHOT, {}))
    pool = ThreadPoolExecutor(1, thread_name_prefix="weights")
    job: tuple | None = None
    x = torch.randn(4, 8, device=args.device)
    batches = 0
    stop = False
    rejected = 0
    try:
        while not stop:
            with torch.inference_mode():  # one "batch"
                model[3](model[2](model[1](model[0](x))).to(torch.bfloat16))
            batches += 1
            while snap.poll(0, zmq.POLLIN):  # the snapshot reply
                msg = P.decode(snap.recv_multipart())
                if msg["version"] >= 0:
                    rx.offer(msg.header)
                tell("ready")
            while sub.poll(0, zmq.POLLIN):  # [b"W", *WEIGHTS frames] or [b"stop"]
                frames = sub.recv_multipart()
                if frames[0] == b"stop":
                    stop = True
                else:
                    rx.offer(P.decode(frames[1:]).header)
            now = time.monotonic()
            if job is not None and job[1].done():
                ann, fut = job
                job = None
                err = fut.exception()
                rx.fetched(ann, None if err else fut.result(), err, now)
                if rx.rejected > rejected:
                    rejected = rx.rejected
                    tell("rejected", version=ann.version, error=str(err)[:200])
            staged = rx.swap()  # between batches
            if staged is not None:
                tell("swapped", version=staged.version, source=staged.source, digest=digest(model), batches=batches,
                     nbytes=staged.nbytes)
            if job is None:
                ann = rx.next_fetch(now)
                if ann is not None:
                    fut: Future = pool.submit(rx.fetch, ann)
                    job = (ann, fut)
            sub.poll(2, zmq.POLLIN)  # the rest of a batch's time
    finally:
        pool.shutdown(wait=True)
        rx.close()
        tell("stopped", batches=batches)
        for s in (sub, snap, report):
            s.close()
        ctx.term()


if __name__ == "__main__":
    main()
