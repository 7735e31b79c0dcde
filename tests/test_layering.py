"""The broker is bookkeeping: it loads no torch and nothing from ``workers/`` (issue 8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_broker_loads_no_torch_and_no_worker_module() -> None:
    code = ("import sys, brokers.broker; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'workers'))); "
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[-2000:]
