"""The broker's Python cost per request, stage by stage, with no sockets: what
``bench/broker/capacity.py`` is bounded by, and where to cut (docs/scaling.md).

    python bench/broker/hotpath.py --quick     # --max-batch 32 --requests 20000 --backlog 0 --profile

In this one process: a real ``BrokerState`` with one simulator (many slots, shared-memory
observations sent as a simulator worker sends them) and one generator, joined through READY.
Each request goes the way the broker's shell takes it, minus the sockets: ``protocol.decode``
of the OBS, ``state.handle``; every ``--max-batch`` requests ``state.tick`` forms the BATCH and
``Out.encode`` encodes it; the generator's RESULT (encoded untimed) is decoded and handled, and
every ACT encoded. Times are this process's CPU time per request, in us (``stages_us`` by stage;
``untimed_us_per_request``: the generator's side and the loop). ``--profile``: the 30 functions
with the most own time, in ``broker_hotpath.prof.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from pathlib import Path
from typing import Any

import numpy as np

from brokers.state import BrokerState
from rlvla3 import protocol as P
from rlvla3.config import load
from rlvla3.harness.bench import emit_to, load_avg, parse_bench_args, shm_slots
from rlvla3.harness.echo import echo_result
from rlvla3.logging import configure
from rlvla3.shm import host_id

SIM, GEN = b"\x00sim", b"\x00gen"
STAGES = ("decode_obs", "handle_obs", "tick_and_encode_batch", "decode_result", "handle_result", "encode_act")


class HotPath:
    def __init__(self, max_batch: int, slots: int, backlog: int) -> None:
        cfg = load("synthetic.yaml", ["env.name=synthetic", "env.options.image_size=16", f"batching.max_batch={max_batch}",
                                      "batching.max_wait_ms=1000", "run.mode=async", "workers.trainers=0"])
        self.max_batch = max_batch
        self.state = BrokerState(cfg, time.monotonic(), "hotpath", host_id(), os.getpid(), "")
        now = time.monotonic()
        self.state.handle(SIM, P.decode(P.encode(P.READY, {"role": "simulator", "host": host_id(), "pid": os.getpid(),
                                                           "slots": slots, "num_envs": slots})), now)
        self.state.handle(GEN, P.decode(P.encode(P.READY, {"role": "generator", "host": host_id(), "pid": os.getpid(),
                                                           "credits": 1})), now)
        self.pool, blocks, refs = shm_slots("hotpath", slots, 1, {"top": (16, 16)}, 4)
        blocks.clear()  # the broker reads only the descriptors
        self.obs = [({"slot": s, "req_id": 0, "n": 1, "instruction": ["reach the goal"], "episode_step": [1],
                      "env_steps": 1, "block": s}, tensors) for s, tensors in enumerate(refs)]
        self.zeros: dict[int, np.ndarray] = {}  # the echo's actions by envs in the batch
        self.slots = slots
        self.ns = dict.fromkeys(STAGES, 0)
        self.acts = 0
        self.sent = 0  # OBS sent so far: request k goes from slot k % slots
        for _ in range(backlog):  # queued beyond every batch, as at saturation (untimed)
            self.state.handle(SIM, P.decode(self.next_obs()), now)

    def next_obs(self) -> list[Any]:
        """The next slot's OBS, encoded as a simulator worker sends it: the slot's first carries its
        block's descriptors, the later ones name the block. Each is new (a higher ``req_id``: the
        broker drops a re-sent one); encoding is the simulator's cost."""
        fields, tensors = self.obs[self.sent % self.slots]
        self.sent += 1
        fields["req_id"] += 1
        return P.encode(P.OBS, fields, tensors if fields["req_id"] == 1 else None)

    def run(self, requests: int) -> None:
        clock, st, ns = time.thread_time_ns, self.state, self.ns  # CPU time: a busy neighbour does not inflate it
        for _ in range(requests // self.max_batch):
            for _ in range(self.max_batch):
                frames = self.next_obs()
                t0 = clock()
                msg = P.decode(frames)
                t1 = clock()
                st.handle(SIM, msg, time.monotonic())
                ns["decode_obs"] += t1 - t0
                ns["handle_obs"] += clock() - t1
            t0 = clock()
            outs = st.tick(time.monotonic())
            batches = [o.encode() for o in outs if o.type == P.BATCH]
            ns["tick_and_encode_batch"] += clock() - t0
            for frames in batches:
                result = echo_result(P.decode(frames), self.zeros)  # the generator's own cost: untimed
                t0 = clock()
                msg = P.decode(result)
                t1 = clock()
                acts = st.handle(GEN, msg, time.monotonic())
                t2 = clock()
                for a in acts:
                    a.encode()
                ns["decode_result"] += t1 - t0
                ns["handle_result"] += t2 - t1
                ns["encode_act"] += clock() - t2
                self.acts += len(acts)

    def close(self) -> None:
        self.pool.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--backlog", type=int, default=0,
                    help="requests kept queued beyond each batch, as at saturation (slots - max_batch at most)")
    ap.add_argument("--profile", action="store_true", help="also a cProfile of the loop (own time, top 30)")
    args = parse_bench_args(ap, "fewer requests")
    if args.quick:
        args.requests = 10000
    if args.smoke:
        args.requests = 640
    configure(level="warning")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not 0 <= args.backlog <= args.slots - args.max_batch:
        ap.error(f"--backlog: 0 to --slots - --max-batch ({args.slots - args.max_batch}); a slot has one request out")
    hot = HotPath(args.max_batch, args.slots, args.backlog)
    try:
        hot.run(min(args.requests, 2000))  # warm-up
        hot.ns, hot.acts = dict.fromkeys(STAGES, 0), 0
        cpu0 = time.process_time()
        hot.run(args.requests)
        cpu = time.process_time() - cpu0
        done = hot.acts
        broker_us = sum(hot.ns.values()) / 1000 / done
        result: dict[str, Any] = {
            "us_per_request": round(broker_us, 2),
            "requests_per_cpu_s": round(1e6 / broker_us, 1),
            "untimed_us_per_request": round(cpu / done * 1e6 - broker_us, 2),
            "stages_us": {k: round(v / 1000 / done, 2) for k, v in hot.ns.items()},
            "requests": done, "max_batch": args.max_batch, "slots": args.slots, "backlog": args.backlog,
            "load_avg": load_avg(),
        }
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            hot.run(args.requests)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
            path = out / "broker_hotpath.prof.txt"
            path.write_text(text.getvalue())
            result["profile"] = str(path)
        emit_to(out, "broker_hotpath.json", result)
    finally:
        hot.close()


if __name__ == "__main__":
    main()
