"""A checkpoint writer to kill: ``python -m tests.checkpoint_writer MB``.

It builds a policy of about MB megabytes with Adam state once, then for each ``save V FORMAT
RUN_DIR`` line on stdin forks a child that writes checkpoint V in FORMAT into RUN_DIR
(``workers.checkpoint.save_checkpoint``) and prints ``start V PID`` before and ``done V`` after;
the writer prints ``exit V CODE`` when the child is gone. The test SIGKILLs children in the middle
of their writes: forking keeps each round cheap (torch is imported and the model built once, for
both formats)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed.checkpoint  # noqa: F401 - imported once here, not in every forked child
from torch import nn

from workers.checkpoint import save_checkpoint


def main() -> None:
    mb = float(sys.argv[1])
    torch.set_num_threads(1)  # no thread pool to inherit half-held across fork
    width = 1024
    layers = max(1, int(mb * 2**20 / 4 / (width * width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # Adam state exists from here on: optimizer.pt is twice the model
    print("ready", flush=True)
    for line in sys.stdin:
        _, v, fmt, run_dir = line.rstrip("\n").split(" ", 3)
        version = int(v)
        pid = os.fork()
        if pid == 0:
            print(f"start {version} {os.getpid()}", flush=True)
            save_checkpoint(run_dir, model, opt, version, {"updates": version}, "run: {}\n", keep_last=3, fmt=fmt)
            print(f"done {version}", flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(f"exit {version} {status}", flush=True)


if __name__ == "__main__":
    main()
