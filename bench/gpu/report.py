"""The bookkeeping of ``bench/gpu/check.sh``: one JSON file per stage as it ends, and the summary.

    python bench/gpu/report.py stage NAME RC SECONDS TIMEOUT_S STDOUT STDERR > OUT/NAME.json
    python bench/gpu/report.py skip NAME REASON > OUT/NAME.json
    python bench/gpu/report.py summary OUT DRY_RUN CUDA TOTAL_S      # one JSON object (also OUT/summary.json)

The summary holds every stage's JSON under ``stages`` and the figures a note quotes under
``headline``. A stage's result is the last line of its stdout that parses as a JSON object (the
stage scripts print their figures so far after each part, so one cut off by its timeout, ``RC``
124 or 137, still hands in what it measured); it is ``ok`` when it exited 0 and its result holds
no ``error`` (nor any family/case error inside). Standard library only: it runs before anything
is installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

STAGES = ("install", "models", "update", "job_sync", "job_async", "job_gr00t")


def last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def errors_in(result: Any, path: str = "") -> list[str]:
    """Every ``error`` in a result, with where it sits (``pi0.grpo: out of memory``)."""
    out = []
    if isinstance(result, dict):
        for k, v in result.items():
            if k == "error":
                out.append(f"{path or 'stage'}: {v}"[:300])
            elif k != "log_errors":
                out += errors_in(v, f"{path}.{k}" if path else str(k))
    return out


def stage(name: str, rc: int, seconds: float, timeout_s: float, stdout: Path, stderr: Path) -> dict[str, Any]:
    text = stdout.read_text(errors="replace") if stdout.is_file() else ""
    result = last_json(text)
    timed_out = rc in (124, 137)
    errs = errors_in(result) if result is not None else []
    row: dict[str, Any] = {"stage": name, "ok": rc == 0 and result is not None and not errs, "rc": rc,
                           "seconds": round(seconds, 1), "timeout_s": timeout_s, "timed_out": timed_out,
                           "result": result}
    if not row["ok"]:
        why = "timed out (figures so far kept)" if timed_out else f"exited {rc}" if rc else "reported errors"
        if result is None:
            why += "; printed no JSON"
        tail = stderr.read_text(errors="replace")[-1500:] if stderr.is_file() else ""
        row["error"] = "; ".join([why, *errs[:5]])
        row["stderr_tail"] = tail
    return row


def headline(stages: dict[str, Any]) -> dict[str, Any]:
    """The figures a note quotes, picked out of the stage results (None where a stage has none)."""
    res = {n: (r.get("result") or {}) for n, r in stages.items()}
    models = {f: {b: row.get("samples_per_s") for b, row in (v.get("batches") or {}).items()}
              for f, v in res["models"].items() if isinstance(v, dict) and "batches" in v}
    peak = {f: max([row["peak_mem_gib"] for row in v["batches"].values() if row.get("peak_mem_gib") is not None],
                   default=None)
            for f, v in res["models"].items() if isinstance(v, dict) and "batches" in v}
    updates = {f"{f}.{a}": {"update_s": c.get("update_s"), "peak_mem_gib": c.get("peak_mem_gib")}
               for f, v in res["update"].items() if isinstance(v, dict)
               for a, c in v.items() if a in ("ppo", "grpo") and isinstance(c, dict)}
    jobs = {n[4:]: {k: res[n].get(k) for k in ("env_steps_per_s", "env_steps_per_s_after_v1", "versions",
                                                "publish_to_swap_ms_median", "startup_s", "seconds")}
            | {"staleness_p50": (res[n].get("staleness") or {}).get("p50"),
               "staleness_max": (res[n].get("staleness") or {}).get("max"),
               "dropped_stale": res[n].get("dropped_stale")}
            for n in ("job_sync", "job_async", "job_gr00t") if res[n]}
    return {"act_samples_per_s": models, "act_peak_mem_gib": peak, "updates": updates, "jobs": jobs}


def summary(out: Path, dry_run: bool, cuda: str, total_s: float) -> dict[str, Any]:
    stages = {}
    for name in STAGES:
        p = out / f"{name}.json"
        stages[name] = json.loads(p.read_text()) if p.is_file() else {"stage": name, "ok": False, "error": "did not run"}
    for row in stages.values():
        row.pop("stderr_tail", None)  # in OUT/NAME.json; the summary stays short
    return {"check": "gpu_check", "dry_run": dry_run, "cuda": {"1": True, "0": False}.get(cuda),
            "ok": all(r.get("ok") for r in stages.values()), "total_s": round(total_s, 1),
            "failed": [n for n, r in stages.items() if not r.get("ok")], "headline": headline(stages),
            "stages": stages}


def main(argv: list[str]) -> None:
    cmd = argv[0] if argv else ""
    if cmd == "stage":
        name, rc, secs, tmo, so, se = argv[1:7]
        print(json.dumps(stage(name, int(rc), float(secs), float(tmo), Path(so), Path(se))))
    elif cmd == "skip":
        print(json.dumps({"stage": argv[1], "ok": False, "skipped": argv[2], "error": f"skipped: {argv[2]}"}))
    elif cmd == "summary":
        out = Path(argv[1])
        s = summary(out, argv[2] == "1", argv[3], float(argv[4]))
        (out / "summary.json").write_text(json.dumps(s, indent=1))
        print(json.dumps(s))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
