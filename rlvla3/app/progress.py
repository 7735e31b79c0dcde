"""What a run shows while it goes and leaves behind: the live progress line, the metrics row
behind it, the run folder's PNG curves (success, return, env steps/s, staleness against env
steps), redrawn from ``metrics.jsonl`` every ``CURVES_EVERY_S`` seconds, and ``summary.json``.
:class:`RunRecord` keeps them for ``rlvla3 run`` and for ``rlvla3 watch`` (a job a scheduler
started) alike, so both leave the same run folder."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

import structlog

from rlvla3.shm import segments_of_run

log = structlog.get_logger()

CURVES_EVERY_S = 30.0
"""How often ``curves.png`` is redrawn while a run goes (and once more at the end)."""
STEPS_CHECK_EVERY_S = 0.25
"""How often ``rlvla3 run`` and ``rlvla3 watch`` ask the broker whether the step target is
reached (they stop within this of the count, not within ``run.progress_every_s``)."""
SUCCESS_AFTER_EPISODES = 100
"""The progress line shows the sampled success once this many episodes have ended: episodes that
succeed end first, so the first few to end overstate it (by at most the envs still running, a
share that shrinks as episodes accumulate)."""
CURVES_STOP_WAIT_S = 3.0
"""How long a run stopped by a signal waits for its final curves: a preemption's grace period is
for the checkpoint, and on a loaded machine a plot can take tens of seconds."""


def progress_row(fig: dict[str, Any], elapsed: float, before: dict[str, Any] | None = None) -> dict[str, Any]:
    """The figures a progress line shows; ``before``: the STATUS of the previous line, for what
    happened in between."""
    tr = fig.get("trainer") or {}
    st = fig.get("staleness") or {}
    return {
        "elapsed_s": round(elapsed, 2),
        "env_steps": fig.get("env_steps", 0),
        "env_steps_per_s": fig.get("env_steps_per_s", 0.0),
        "episodes": fig.get("episodes", 0),
        "return": fig.get("return_recent"),
        "success": fig.get("success_rate_recent") if fig.get("episodes", 0) >= SUCCESS_AFTER_EPISODES else None,
        "successes": fig.get("successes"),
        "policy_version": fig.get("policy_version", -1),
        "staleness_p50": (st.get("p50", 1) - 1) if st.get("count") else None,
        "staleness_max": (st.get("max", 1) - 1) if st.get("count") else None,
        "dropped_stale": tr.get("dropped_stale_total", 0),
        "policy_loss": tr.get("policy_loss"),
        "approx_kl": tr.get("approx_kl"),
        "workers": fig.get("workers"),
        "batch_p50": (fig.get("batch_size") or {}).get("p50"),
        "no_variance": no_variance_share(fig, before or {}),
        **latest_eval(fig.get("eval") or {}),
    }


def no_variance_share(fig: dict[str, Any], before: dict[str, Any]) -> float | None:
    """The share of the steps trainers acknowledged since ``before`` that they discarded: in
    GRPO, groups whose episodes all succeeded or all failed, which teach nothing. When it is 1
    the version stands still, and the line says why."""
    now, then = fig.get("acked_steps") or {}, before.get("acked_steps") or {}
    delta = {k: now.get(k, 0) - then.get(k, 0) for k in ("trained", "stale", "discarded")}
    total = sum(delta.values())
    return round(delta["discarded"] / total, 3) if total > 0 and now.get("discarded") is not None else None


def latest_eval(evals: dict[str, Any]) -> dict[str, Any]:
    """The newest policy version whose evaluation round is whole (env.eval_slots), if any: the
    episodes that succeed end first, so part of a round would overstate its success."""
    whole = [v for v, e in evals.items() if e.get("episodes", 0) >= e.get("round", 0) > 0]
    if not whole:
        return {"eval_version": None, "eval_success": None, "eval_episodes": 0}
    v = max(whole, key=int)
    return {"eval_version": int(v), "eval_success": evals[v].get("success"), "eval_episodes": evals[v].get("episodes", 0)}


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def progress_line(r: dict[str, Any]) -> str:
    return (f"[{r['elapsed_s']:7.1f}s] steps={r['env_steps']:>8} sps={_fmt(r['env_steps_per_s']):>8} "
            f"return={_fmt(r['return']):>7} success={_fmt(r['success']):>6} version={r['policy_version']:>4} "
            f"staleness p50={_fmt(r['staleness_p50'])} max={_fmt(r['staleness_max'])} batch={_fmt(r['batch_p50'])}"
            + (f" eval(v{r['eval_version']})={_fmt(r['eval_success'])}" if r.get("eval_version") is not None else "")
            + (f" groups without variance: {r['no_variance']:.0%} of steps" if r.get("no_variance") else ""))


CURVES = (("success", ("success", "eval_success"), "success rate"), ("return", ("return",), "episode return"),
          ("env steps/s", ("env_steps_per_s",), "env steps/s"), ("staleness", ("staleness_p50", "staleness_max"), "versions"))
"""Panels of ``curves.png``: title, metrics-row keys drawn against env steps, y label."""


def write_curves(metrics_path: Path, out_png: Path) -> bool:
    """Redraw ``out_png`` from the rows of ``metrics_path``; False when there is nothing to draw.
    Written to a hidden temporary file and renamed, so a viewer never sees half an image. Uses a
    bare ``Figure`` (no pyplot state), so it may run on a thread of its own (:class:`CurvesPlotter`)."""
    rows = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written right now
    if len(rows) < 1:
        return False
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4 * len(CURVES), 3.2))
    axes = fig.subplots(1, len(CURVES))
    x = [r.get("env_steps", 0) for r in rows]
    for ax, (title, keys, ylabel) in zip(axes, CURVES):
        drawn = False
        for k in keys:
            pts = [(xi, r[k]) for xi, r in zip(x, rows) if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
            if k == "eval_success":  # one point per evaluated version, not per progress line
                seen: dict[Any, tuple[int, float]] = {}
                for xi, r in zip(x, rows):
                    if r.get("eval_version") is not None and isinstance(r.get(k), (int, float)):
                        seen.setdefault(r["eval_version"], (xi, r[k]))
                pts = sorted(seen.values())
            if pts:
                drawn = True
                ax.plot(*zip(*pts), marker="o" if k == "eval_success" else None, ms=3,
                        label={"eval_success": "eval (deterministic)", "success": "training episodes"}.get(k, k))
        ax.set_title(title)
        ax.set_xlabel("env steps")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1 and drawn:
            ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = out_png.with_name(f".{out_png.name}.tmp")
    fig.savefig(tmp, dpi=80, format="png")
    tmp.replace(out_png)
    return True


class CurvesPlotter:
    """Redraws a run's ``curves.png`` on a thread of its own.

    A draw costs one to two seconds of CPU, and many times that on a machine loaded by other
    work; drawn inline, it held the ``rlvla3 run`` controller, so a stop signal waited behind the
    plot. Here the controller only asks for a draw (:meth:`request`) and, at the end, waits for
    the last one for as long as it can afford (:meth:`finish`)."""

    def __init__(self, metrics_path: Path, out_png: Path) -> None:
        self.metrics_path, self.out_png = metrics_path, out_png
        self._thread: threading.Thread | None = None

    def _draw(self) -> None:
        try:
            write_curves(self.metrics_path, self.out_png)
        except Exception as exc:  # noqa: BLE001 - a plot must never end a run
            log.warning("curves_failed", error=repr(exc), path=str(self.out_png))

    def request(self) -> bool:
        """Start a redraw unless one is still running (then this request is dropped: the next
        one draws every row). True when a draw started."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._thread = threading.Thread(target=self._draw, name="curves", daemon=True)
        self._thread.start()
        return True

    def finish(self, timeout_s: float | None) -> bool:
        """Draw the final curves, waiting at most ``timeout_s`` (None: as long as it takes) for
        the running draw and the final one together. False, with a log line, when time ran out:
        ``curves.png`` then shows the rows up to the previous draw, and ``metrics.jsonl`` has all."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._join(deadline):  # the draw in flight may have missed the last rows
            return False
        self.request()
        return self._join(deadline)

    def _join(self, deadline: float | None) -> bool:
        if self._thread is not None:
            self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                log.warning("curves_not_redrawn", reason="stop_deadline", path=str(self.out_png))
                return False
        return True


class RunRecord:
    """The run folder's record of a job it follows: a ``metrics.jsonl`` row and a progress line
    every ``progress_every_s`` (and at the step target), ``curves.png`` every ``CURVES_EVERY_S``
    on a thread of its own, and at the end ``summary.json``."""

    def __init__(self, folder: Path, progress_every_s: float, echo: Callable[[str], None]) -> None:
        self.folder, self.every_s, self.echo = folder, progress_every_s, echo
        self.metrics = open(folder / "metrics.jsonl", "a", buffering=1)
        self.curves = CurvesPlotter(folder / "metrics.jsonl", folder / "curves.png")
        self.t0 = time.monotonic()
        self.next_print = self.t0
        self.next_curves = self.t0 + CURVES_EVERY_S  # nothing to draw yet: the start-up has better use for the CPU
        self.last: dict[str, Any] = {}
        """The newest STATUS figures (the summary's last progress row)."""
        self.printed: dict[str, Any] = {}
        """The STATUS figures of the last progress line."""

    def observe(self, fig: dict[str, Any], force: bool = False) -> None:
        """Take the broker's figures; write a row and a line when one is due (or ``force``)."""
        self.last = fig
        now = time.monotonic()
        if force or now >= self.next_print:
            self.next_print = now + self.every_s
            row = progress_row(fig, now - self.t0, self.printed)
            self.printed = fig
            self.metrics.write(json.dumps(row) + "\n")
            self.echo(progress_line(row))
            if now >= self.next_curves:
                self.next_curves = now + CURVES_EVERY_S
                self.curves.request()  # drawn on its own thread: a stop never waits behind a plot

    def close(self, reason: str, run_id: str) -> dict[str, Any]:
        """Close the metrics, draw the final curves (at most ``CURVES_STOP_WAIT_S`` after a stop
        signal) and return the summary: why it ended, how long it took, the shared-memory
        segments left behind (call it after every process stopped) and the last progress row."""
        self.metrics.close()
        self.curves.finish(CURVES_STOP_WAIT_S if reason == "interrupted" else None)
        leftovers = segments_of_run(run_id) if run_id else []
        elapsed = time.monotonic() - self.t0
        return {"run_dir": str(self.folder), "reason": reason, "seconds": round(elapsed, 1),
                "shm_leftovers": len(leftovers), **(progress_row(self.last, elapsed) if self.last else {})}

    def write_summary(self, summary: dict[str, Any]) -> None:
        (self.folder / "summary.json").write_text(json.dumps(summary, indent=1))
        self.echo(json.dumps(summary))
