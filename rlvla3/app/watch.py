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

import os
import signal
import time
from pathlib import Path

import click

from rlvla3.app.launch import request_status
from rlvla3.app.progress import STEPS_CHECK_EVERY_S, RunRecord
from rlvla3.config import ConfigError, load
from rlvla3.lifetime import on_stop_signals

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
    folder = Path(run_dir)
    cfg_path = folder / "config.yaml"
    try:
        if resume:
            from workers.checkpoint import latest_checkpoint  # torch: only a resumed watch pays for it

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

    record = RunRecord(folder, cfg.run.progress_every_s, click.echo)
    run_id = ""
    reached = False
    while not stopping["flag"]:
        try:
            fig = request_status(broker_url, timeout_s=2.0, keys_dir=keys_dir, key_name=key_name)
        except TimeoutError:
            continue  # not up yet, or busy: the scheduler's script judges the broker's step
        run_id = fig.get("run_id", run_id)
        hit = not reached and fig["env_steps"] >= total
        record.observe(fig, force=hit)
        if hit:
            reached = True
            if notify is None:
                break
            click.echo(f"{fig['env_steps']} env steps reached; asking the job to stop")
            os.kill(notify, TARGET_SIGNAL)
        time.sleep(STEPS_CHECK_EVERY_S)  # polling STATUS, as `rlvla3 run` does
    reason = "process_exited" if stopping["failed"] else "steps_reached" if reached else "interrupted"
    record.write_summary(record.close(reason, run_id))
