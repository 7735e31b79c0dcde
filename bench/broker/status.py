"""What a STATUS answer costs the broker's loop: ``BrokerState.handle`` of one STATUS, timed,
with figures as full as a long run's (64 workers, histograms of 100k values, 1000 evaluation
versions). The figures are built and encoded at most every ``STATUS_REFRESH_S`` (percentiles at
most once a second), so the figure that matters is the cost of an answer in between
(``cached_us``) and of the refresh itself (``refresh_us``). ``bench/broker/status_flood.py`` measures
the same on a live broker under a flood. On a
busy machine the tails measure the scheduler; the medians measure the broker.

    python bench/broker/status.py
"""

from __future__ import annotations

import json
import random
import time

from brokers.state import BrokerState
from rlvla3 import protocol as P
from rlvla3.config import load


def main() -> None:
    state = BrokerState(load("synthetic.yaml"), 0.0, run_id="bench", host="h")
    for i in range(64):
        role = ("simulator", "generator", "trainer")[i % 3] if i < 63 else "simulator"
        msg = P.decode(P.encode(P.READY, {"role": role, "host": "h", "pid": i, "credits": 2}))
        if role != "trainer" or i == 2:
            state.handle(b"w%d" % i, msg, 0.0)
    rng = random.Random(0)
    st = state.stats
    for _ in range(100_000):
        for h in (st.batch_size, st.queue_wait_us, st.batch_form_us, st.generate_us, st.staleness):
            h.record_value(rng.randint(1, 1_000_000))
    for v in range(1000):
        st.add_eval(v, rng.random() < 0.5, rng.random())
    st.add_episodes([rng.random() for _ in range(200)], [rng.random() < 0.5 for _ in range(200)])
    status = P.decode(P.encode(P.STATUS))
    now, cached, refresh = 10.0, [], []
    state.status(now)  # builds the percentile tables once, as the first STATUS of a run does
    for i in range(2000):
        now += 0.001 if i % 100 else 1.0  # 99 answers within STATUS_REFRESH_S, then a refresh
        t0 = time.perf_counter()
        out = state.handle(b"client", status, now)
        out[0].encode()  # the shell encodes the answer in the loop too
        dt = (time.perf_counter() - t0) * 1e6
        (refresh if i % 100 == 0 else cached).append(dt)
    cached.sort()
    refresh.sort()
    print(json.dumps({"cached_us_p50": round(cached[len(cached) // 2], 1),
                      "cached_us_p99": round(cached[len(cached) * 99 // 100], 1),
                      "refresh_us_p50": round(refresh[len(refresh) // 2], 1),
                      "refresh_us_max": round(refresh[-1], 1), "target_us": 1000}))


if __name__ == "__main__":
    main()
