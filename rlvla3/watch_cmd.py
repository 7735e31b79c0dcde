"""``rlvla3 watch``: the ``run`` controller's bookkeeping for a job a scheduler started.

``rlvla3 run`` starts the processes itself; on a cluster a scheduler starts them
(``deploy/slurm/rlvla3.sbatch``). This command does the rest of what ``run`` does, so the run
folder is the same: it writes ``config.yaml`` (what the broker is then started with), polls the
broker's STATUS into ``metrics.jsonl``, the progress line and ``curves.png``, and writes
``summary.json`` when it ends. The scheduler's script does the starting and the stopping: with
``--notify PID`` this command sends that process SIGUSR1 once the step target is reached and
writes the summary when it is itself sent SIGTERM, after the job has stopped (so the summary's
shared-memory count is the one left behind).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import click

from rlvla3.config import ConfigError, load
from rlvla3.lifetime import on_stop_signals
from rlvla3.progress import CURVES_EVERY_S, STEPS_CHECK_EVERY_S, progress_line, progress_row, run_summary, write_curves

TARGET_SIGNAL = signal.SIGUSR1
"""What ``--notify PID`` receives when the step target is reached."""
FAILED_SIGNAL = signal.SIGUSR2
"""What the scheduler's script sends instead of SIGTERM when the job stopped because a process
exited: the summary's reason is then ``process_exited``, as with ``rlvla3 run``."""


@click.command("watch")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False), help="The job's run folder (created).")
@click.option("--broker", "broker_url", required=True, help="The broker's ROUTER address.")
@click.option("--config", "config", default=None, help="Job config YAML; written to RUN_DIR/config.yaml for the broker.")
@click.option("--set", "overrides", multiple=True, help="Override a config key (as the broker would be given).")
@click.option("--resume", is_flag=True, help="Continue RUN_DIR: its own config.yaml, appended metrics; needs a checkpoint.")
@click.option("--steps", type=int, default=None, help="Step target (default: run.total_env_steps).")
@click.option("--keys", "keys_dir", default=None, envvar="RLVLA3_KEYS", help="CURVE key folder when the broker has keys.")
@click.option("--key-name", default="client", show_default=True, help="Client key pair STATUS is asked with.")
@click.option("--notify", type=int, default=None, metavar="PID",
              help="At the target, send PID SIGUSR1 and keep watching until SIGTERM (default: stop at the target).")
def watch_command(run_dir: str, broker_url: str, config: str | None, overrides: tuple[str, ...], resume: bool,
                  steps: int | None, keys_dir: str | None, key_name: str, notify: int | None) -> None:
    """Follow a job started by a scheduler: the run folder's config, metrics, curves and summary."""
    from rlvla3.launch import request_status

    folder = Path(run_dir)
    cfg_path = folder / "config.yaml"
    try:
        if resume:
            from workers.checkpoint import latest_checkpoint

            if config or overrides:
                raise click.ClickException("--resume continues RUN_DIR with its own config.yaml: drop --config and --set")
            if latest_checkpoint(folder) is None:
                raise click.ClickException(f"--resume {folder}: no checkpoint under {folder / 'checkpoints'}")
            cfg = load(str(cfg_path))
        else:
            cfg = load(config, overrides)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    folder.mkdir(parents=True, exist_ok=True)
    if not resume:
        tmp = cfg_path.with_suffix(".tmp")
        tmp.write_text(cfg.to_yaml())
        tmp.replace(cfg_path)  # the broker is started with it once it exists whole
    total = steps or cfg.run.total_env_steps
    stopping = {"flag": False, "failed": False}
    on_stop_signals(lambda: stopping.update(flag=True))
    signal.signal(FAILED_SIGNAL, lambda signum, frame: stopping.update(flag=True, failed=True))
    click.echo(f"run folder {folder}  mode={cfg.run.mode}  env={cfg.env.name}  model={cfg.model.family}  steps={total}")

    t0 = time.monotonic()
    last: dict[str, Any] = {}
    run_id = ""
    reached = False
    next_print = time.monotonic()
    next_curves = next_print + CURVES_EVERY_S  # nothing to draw yet; the start-up has better use for the CPU
    with open(folder / "metrics.jsonl", "a", buffering=1) as metrics:
        while not stopping["flag"]:
            try:
                fig = request_status(broker_url, timeout_s=2.0, keys_dir=keys_dir, key_name=key_name)
            except TimeoutError:
                continue  # not up yet, or busy: the scheduler's script judges the broker's step
            last, run_id = fig, fig.get("run_id", run_id)
            now = time.monotonic()
            hit = not reached and fig["env_steps"] >= total
            if hit or now >= next_print:
                next_print = now + cfg.run.progress_every_s
                row = progress_row(fig, now - t0)
                metrics.write(json.dumps(row) + "\n")
                click.echo(progress_line(row))
                if now >= next_curves:
                    next_curves = now + CURVES_EVERY_S
                    write_curves(folder / "metrics.jsonl", folder / "curves.png")
            if hit:
                reached = True
                if notify is None:
                    break
                click.echo(f"{fig['env_steps']} env steps reached; asking the job to stop")
                os.kill(notify, TARGET_SIGNAL)
            time.sleep(STEPS_CHECK_EVERY_S)  # polling STATUS, as `rlvla3 run` does
    write_curves(folder / "metrics.jsonl", folder / "curves.png")
    reason = "process_exited" if stopping["failed"] else "steps_reached" if reached else "interrupted"
    summary = run_summary(folder, reason, time.monotonic() - t0, last, run_id)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    click.echo(json.dumps(summary))
