"""What a run shows while it goes: the live progress line, the metrics row behind it, and the
run folder's PNG curves (success, return, env steps/s, staleness against env steps), redrawn from
``metrics.jsonl`` every ``CURVES_EVERY_S`` seconds by the ``rlvla3 run`` launcher."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

CURVES_EVERY_S = 30.0
"""How often ``rlvla3 run`` redraws ``curves.png`` (and once more at the end)."""
STEPS_CHECK_EVERY_S = 0.25
"""How often ``rlvla3 run`` (and ``rlvla3 watch``) asks the broker whether the step target is
reached (it stops within this of the count, not within ``run.progress_every_s``)."""


def progress_row(fig: dict[str, Any], elapsed: float) -> dict[str, Any]:
    tr = fig.get("trainer") or {}
    st = fig.get("staleness") or {}
    return {
        "elapsed_s": round(elapsed, 2),
        "env_steps": fig.get("env_steps", 0),
        "env_steps_per_s": fig.get("env_steps_per_s", 0.0),
        "episodes": fig.get("episodes", 0),
        "return": fig.get("return_recent"),
        "success": fig.get("success_rate_recent"),
        "policy_version": fig.get("policy_version", -1),
        "staleness_p50": (st.get("p50", 1) - 1) if st.get("count") else None,
        "staleness_max": (st.get("max", 1) - 1) if st.get("count") else None,
        "dropped_stale": tr.get("dropped_stale_total", 0),
        "policy_loss": tr.get("policy_loss"),
        "approx_kl": tr.get("approx_kl"),
        "workers": fig.get("workers"),
        "batch_p50": (fig.get("batch_size") or {}).get("p50"),
        **latest_eval(fig.get("eval") or {}),
    }


def run_summary(folder: Path, reason: str, seconds: float, last: dict[str, Any], run_id: str) -> dict[str, Any]:
    """A finished run's ``summary.json``: why it ended, how long it took, the shared-memory
    segments it left behind (after every process stopped) and its last progress row."""
    from rlvla3.shm import segments_of_run

    leftovers = segments_of_run(run_id) if run_id else []
    return {"run_dir": str(folder), "reason": reason, "seconds": round(seconds, 1), "shm_leftovers": len(leftovers),
            **(progress_row(last, seconds) if last else {})}


def latest_eval(evals: dict[str, Any]) -> dict[str, Any]:
    """The newest evaluated policy version's deterministic success (env.eval_slots), if any."""
    if not evals:
        return {"eval_version": None, "eval_success": None, "eval_episodes": 0}
    v = max(evals, key=int)
    return {"eval_version": int(v), "eval_success": evals[v].get("success"), "eval_episodes": evals[v].get("episodes", 0)}


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def progress_line(r: dict[str, Any]) -> str:
    return (f"[{r['elapsed_s']:7.1f}s] steps={r['env_steps']:>8} sps={_fmt(r['env_steps_per_s']):>8} "
            f"return={_fmt(r['return']):>7} success={_fmt(r['success']):>6} version={r['policy_version']:>4} "
            f"staleness p50={_fmt(r['staleness_p50'])} max={_fmt(r['staleness_max'])} batch={_fmt(r['batch_p50'])}"
            + (f" eval(v{r['eval_version']})={_fmt(r['eval_success'])}" if r.get("eval_version") is not None else ""))


CURVES = (("success", ("success", "eval_success"), "success rate"), ("return", ("return",), "episode return"),
          ("env steps/s", ("env_steps_per_s",), "env steps/s"), ("staleness", ("staleness_p50", "staleness_max"), "versions"))
"""Panels of ``curves.png``: title, metrics-row keys drawn against env steps, y label."""


def write_curves(metrics_path: Path, out_png: Path) -> bool:
    """Redraw ``out_png`` from the rows of ``metrics_path``; False when there is nothing to draw.
    Written to a temporary file and renamed, so a viewer never sees half an image."""
    rows = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written right now
    if len(rows) < 1:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.2))
    x = [r.get("env_steps", 0) for r in rows]
    for ax, (title, keys, ylabel) in zip(axes, CURVES):
        for k in keys:
            pts = [(xi, r[k]) for xi, r in zip(x, rows) if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
            if k == "eval_success":  # one point per evaluated version, not per progress line
                seen: dict[Any, tuple[int, float]] = {}
                for xi, r in zip(x, rows):
                    if r.get("eval_version") is not None and isinstance(r.get(k), (int, float)):
                        seen.setdefault(r["eval_version"], (xi, r[k]))
                pts = sorted(seen.values())
            if pts:
                ax.plot(*zip(*pts), marker="o" if k == "eval_success" else None, ms=3,
                        label={"eval_success": "eval (deterministic)", "success": "training episodes"}.get(k, k))
        ax.set_title(title)
        ax.set_xlabel("env steps")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1 and ax.get_legend_handles_labels()[0]:  # nothing drawn yet: no legend
            ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = out_png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    tmp.replace(out_png)
    return True
