"""The ``rlvla3`` command line: broker, worker, run, status, sft, export."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import click
import structlog

from rlvla3 import logging as rlog
from rlvla3.config import ConfigError, load
from rlvla3.lifetime import on_stop_signals, stopped_cleanly
from rlvla3.progress import CURVES_EVERY_S, latest_eval, progress_line, progress_row, write_curves

log = structlog.get_logger()

STEPS_CHECK_EVERY_S = 0.25
"""How often ``rlvla3 run`` asks the broker whether ``--steps`` is reached (it stops within this
of the count, not within ``run.progress_every_s``)."""


@click.group()
@click.option("--log-json", is_flag=True, help="One JSON object per log line (default: key=value).")
@click.option("--log-level", default="info", show_default=True, help="debug, info, warning, error.")
def main(log_json: bool, log_level: str) -> None:
    """rlvla3: fully asynchronous RL for Vision-Language-Action policies."""
    rlog.configure(json=log_json, level=log_level)


def _load(config: str | None, overrides: tuple[str, ...], gpus: tuple[str, ...] = ()):
    from rlvla3.scale_config import gpu_overrides

    try:
        return load(config, overrides + gpu_overrides(gpus))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _require_simulator(cfg: Any) -> None:
    """Fail before starting anything when the job's simulator is not installed here: an env
    adapter module may define ``require_installed()``, which raises ModuleNotFoundError with
    install instructions (Meta-World's does)."""
    import importlib

    module = f"workers.envs.{cfg.env.name}"
    try:
        check = getattr(importlib.import_module(module), "require_installed", None)
        if check is not None:
            check()
    except ModuleNotFoundError as exc:
        if exc.name == module:  # not a built-in adapter: building the env will judge
            return
        raise click.ClickException(f"env {cfg.env.name!r}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# broker
# ---------------------------------------------------------------------------------------------


@main.command()
@click.option("--config", "config", default=None, help="Job config YAML (default: the embedded one).")
@click.option("--bind", default=None, help="ROUTER address, e.g. tcp://*:5555 (default: broker.bind).")
@click.option("--pub", default=None, help="PUB address for weights, e.g. tcp://*:5556 (default: broker.pub).")
@click.option("--set", "overrides", multiple=True, help="Override a config key: --set batching.max_batch=16.")
@click.option("--info-file", default=None, help="Write the bound endpoints here as JSON once listening.")
@click.option("--keys", "keys_dir", default=None, envvar="RLVLA3_KEYS",
              help="CURVE key folder from `rlvla3 keys` (default: broker.keys_dir): only allowlisted clients join.")
@click.option("--auth", "require_auth", is_flag=True, help="Refuse to start without keys, loopback included.")
@click.option("--insecure", is_flag=True, help="Allow a non-loopback bind without keys (a trusted network only).")
def broker(config: str | None, bind: str | None, pub: str | None, overrides: tuple[str, ...], info_file: str | None,
           keys_dir: str | None, require_auth: bool, insecure: bool) -> None:
    """Run the broker: the job's config, slot registry, batcher and weight snapshot."""
    from brokers.broker import Broker
    from rlvla3.auth import AuthError, check_bind
    from rlvla3.protocol import LINGER_MS

    cfg = _load(config, overrides)
    if keys_dir:
        cfg.broker.keys_dir = str(Path(keys_dir).resolve())
    try:
        check_bind([bind or cfg.broker.bind, pub or cfg.broker.pub], cfg.broker.keys_dir, require_auth, insecure)
    except AuthError as exc:
        raise click.ClickException(str(exc)) from None
    rlog.configure(role="broker", pid=os.getpid())
    b = Broker(cfg, bind=bind, pub=pub)
    on_stop_signals(b.stop)
    if info_file:
        tmp = Path(info_file + ".tmp")
        tmp.write_text(json.dumps({"bind": b.bound, "pub": b.pub_bound, "run_id": b.run_id, "pid": os.getpid()}))
        tmp.replace(info_file)
    b.run()
    b.ctx.destroy(linger=LINGER_MS)  # what close() queued (DISCONNECTs) leaves before the process
    stopped_cleanly()


# ---------------------------------------------------------------------------------------------
# worker
# ---------------------------------------------------------------------------------------------


@main.command()
@click.option("--role", type=click.Choice(["simulator", "generator", "trainer"]), required=True)
@click.option("--broker", "broker_url", default="tcp://127.0.0.1:5555", show_default=True, help="The broker's ROUTER address.")
@click.option("--gpus", default=None, help="Devices, e.g. 0-3 or 0,2: one worker per device.")
@click.option("--count", default=1, show_default=True, help="Workers of this role to start here.")
@click.option("--num-envs", type=int, default=None, help="Simulator: envs in this worker (default: env.num_envs).")
@click.option("--slots", type=int, default=None, help="Simulator: slots in this worker (default: env.slots).")
@click.option("--index", type=int, default=0, help="Worker index (seeds differ per index).")
@click.option("--name", default=None, help="Name in logs and STATUS.")
@click.option("--run-dir", default=None, help="Where the trainer writes metrics and checkpoints.")
@click.option("--set", "overrides", multiple=True, help="Local config override for this worker.")
@click.option("--resume", default=None, help="Trainer: continue from this run folder's latest checkpoint.")
@click.option("--keys", "keys_dir", default=None, envvar="RLVLA3_KEYS",
              help="CURVE key folder (needs broker.key and clients/NAME.key_secret) when the broker has keys.")
@click.option("--key-name", default=None, envvar="RLVLA3_KEY_NAME", help="Client key pair to use (default: the role).")
def worker(role: str, broker_url: str, gpus: str | None, count: int, num_envs: int | None, slots: int | None,
           index: int, name: str | None, run_dir: str | None, overrides: tuple[str, ...], resume: str | None,
           keys_dir: str | None, key_name: str | None) -> None:
    """Run simulator, generator or trainer workers that join a broker (at any time)."""
    from rlvla3.launch import spawn, stop_processes
    from rlvla3.scale_config import parse_gpus

    try:
        devices = parse_gpus(gpus)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    n = max(len(devices), 1) * count
    if n > 1:  # one process per device (x count); this process supervises them
        procs = []
        for i in range(n):
            args = ["worker", "--role", role, "--broker", broker_url, "--index", str(index + i),
                    "--name", f"{name or role}{index + i}"]
            if devices:
                args += ["--gpus", str(devices[i % len(devices)])]
            if num_envs:
                args += ["--num-envs", str(num_envs)]
            if slots:
                args += ["--slots", str(slots)]
            if run_dir:
                args += ["--run-dir", run_dir]
            if resume:
                args += ["--resume", resume]
            for o in overrides:
                args += ["--set", o]
            if keys_dir:
                args += ["--keys", keys_dir]
            if key_name:
                args += ["--key-name", key_name]
            procs.append(spawn(args))
        stopping = {"flag": False}
        on_stop_signals(lambda: stopping.update(flag=True))
        while not stopping["flag"] and any(p.poll() is None for p in procs):
            time.sleep(0.2)  # supervising children; nothing to synchronise with
        stop_processes(procs)
        sys.exit(max((p.returncode or 0) for p in procs))

    device = f"cuda:{devices[0]}" if devices else None
    rlog.configure(role=role, pid=os.getpid(), name=name or f"{role}{index}")
    kw: dict[str, Any] = dict(name=name or f"{role}{index}", overrides=overrides, device=device,
                              keys_dir=keys_dir, key_name=key_name)
    if role == "simulator":
        from workers.simulator import SimulatorWorker

        w = SimulatorWorker(broker_url, num_envs=num_envs, slots=slots, index=index, **kw)
    elif role == "generator":
        from workers.generator import GeneratorWorker

        w = GeneratorWorker(broker_url, **kw)
    else:
        from workers.trainer import TrainerWorker

        w = TrainerWorker(broker_url, run_dir=run_dir, resume=resume, **kw)
    w.run()
    stopped_cleanly()  # files closed, checkpoint written: leave without the interpreter's teardown


# ---------------------------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------------------------


@main.command()
@click.option("--broker", "broker_url", default="tcp://127.0.0.1:5555", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds to wait for the reply.")
@click.option("--keys", "keys_dir", default=None, envvar="RLVLA3_KEYS", help="CURVE key folder when the broker has keys.")
@click.option("--key-name", default="client", show_default=True, envvar="RLVLA3_KEY_NAME", help="Client key pair to use.")
def status(broker_url: str, as_json: bool, timeout: float, keys_dir: str | None, key_name: str) -> None:
    """Print a broker's live figures."""
    from rlvla3.auth import AuthError
    from rlvla3.launch import request_status

    try:
        fig = request_status(broker_url, timeout, keys_dir=keys_dir, key_name=key_name)
    except (TimeoutError, AuthError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(fig))
        return
    click.echo(f"run {fig['run_id']}  mode={fig['mode']}  workers={fig['workers']}  slots={fig['slots']}")
    click.echo(f"env_steps={fig['env_steps']}  env_steps/s={fig['env_steps_per_s']}  queue_depth={fig['queue_depth']}  "
               f"policy_version={fig['policy_version']}  episodes={fig['episodes']}  success={fig['success_rate_recent']}  "
               f"return={fig['return_recent']}")
    for k in ("batch_size", "queue_wait_us", "generate_us", "staleness"):
        click.echo(f"{k}: {fig[k]}")
    ev = latest_eval(fig.get("eval") or {})
    click.echo(f"latest eval: version {ev['eval_version']}  success={ev['eval_success']}  episodes={ev['eval_episodes']}"
               if ev["eval_version"] is not None else "latest eval: none yet (env.eval_slots / env.eval_every)")


# ---------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------


@main.command()
@click.argument("keys_dir")
@click.option("--client", "clients", multiple=True,
              help="A client key pair to make (repeatable; default: simulator, generator, trainer, client).")
def keys(keys_dir: str, clients: tuple[str, ...]) -> None:
    """Make CURVE key pairs: the broker's, and one per client (existing pairs are kept).

    Give the broker the whole folder; give each worker host broker.key and its own
    clients/NAME.key_secret. Start with `rlvla3 broker --keys DIR` and `rlvla3 worker --keys DIR`.
    A key named ROLE* (trainer, trainer0, ...) may join only as that role; `client` may only
    ask STATUS.
    """
    from rlvla3.auth import DEFAULT_CLIENTS, AuthError, make_keys

    try:
        made = make_keys(keys_dir, clients or DEFAULT_CLIENTS)
    except AuthError as exc:
        raise click.ClickException(str(exc)) from None
    for path in made:
        click.echo(f"made {path} (+ {path.name}_secret)")
    click.echo(f"allowlist: {Path(keys_dir) / 'clients'}/*.key")


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------


@main.command()
@click.argument("config", required=False)
@click.option("--steps", type=int, default=None, help="Stop after this many env steps (default: run.total_env_steps).")
@click.option("--set", "overrides", multiple=True, help="Override a config key: --set batching.max_batch=16.")
@click.option("--run-dir", default=None, help="Run folder (default: <run.run_dir>/<run.name>-<time>).")
@click.option("--bind", default="tcp://127.0.0.1:0", show_default=True, help="Broker ROUTER address (port 0: any free).")
@click.option("--pub", default="tcp://127.0.0.1:0", show_default=True, help="Broker PUB address.")
@click.option("--resume", "resume", default=None, metavar="RUN_DIR",
              help="Continue RUN_DIR at its latest checkpoint's version, with its config (--steps counts anew).")
@click.option("--record", "record_dir", default=None, metavar="DIR",
              help="Save finished episodes as a LeRobot dataset in DIR (written when the run ends).")
@click.option("--record-slots", default=None, metavar="0,1",
              help="With --record: simulator slot indices to record (default: every slot).")
@click.option("--keys", "keys_dir", default=None, envvar="RLVLA3_KEYS",
              help="CURVE key folder from `rlvla3 keys`: workers use their role's key pair, STATUS polls `client`.")
@click.option("--gpus", "gpus", multiple=True, metavar="ROLE=DEVICES",
              help="Devices per role: --gpus generator=0-3 --gpus trainer=4-7 (sets placement.<role>_gpus).")
@click.pass_context
def run(ctx: click.Context, config: str | None, steps: int | None, overrides: tuple[str, ...], run_dir: str | None,
        bind: str, pub: str, resume: str | None, keys_dir: str | None, record_dir: str | None,
        record_slots: str | None, gpus: tuple[str, ...]) -> None:
    """Run broker and all workers on this machine from one config, with live progress."""
    from rlvla3.auth import AuthError, check_bind
    from rlvla3.launch import JobInterrupted, LocalJob
    from rlvla3.shm import segments_of_run
    if resume:
        from workers.checkpoint import latest_checkpoint

        if config or overrides or run_dir:
            raise click.ClickException("--resume continues a run with its own config and folder: drop CONFIG, --set and --run-dir")
        folder = Path(resume)
        if latest_checkpoint(folder) is None:
            raise click.ClickException(f"--resume {resume}: no checkpoint under {folder / 'checkpoints'}")
        cfg = _load(str(folder / "config.yaml"), ())
    else:
        cfg = _load(config, overrides, gpus)
        folder = Path(run_dir) if run_dir else Path(cfg.run.run_dir) / f"{cfg.run.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    _require_simulator(cfg)
    if record_dir:
        from workers.lerobot_dataset import require_pyarrow

        try:
            require_pyarrow()
            cfg.run.record_slots = [int(x) for x in record_slots.split(",")] if record_slots else []
        except (ModuleNotFoundError, ValueError) as exc:
            raise click.ClickException(f"--record: {exc}") from None
        cfg.run.record_dir = str(Path(record_dir).resolve())
    if keys_dir:
        cfg.broker.keys_dir = str(Path(keys_dir).resolve())
    if cfg.broker.keys_dir:
        try:
            check_bind([bind, pub], cfg.broker.keys_dir, False, False)
        except AuthError as exc:
            raise click.ClickException(str(exc)) from None
    total = cfg.run.total_env_steps = steps or cfg.run.total_env_steps  # the trainer anneals over it
    folder.mkdir(parents=True, exist_ok=True)
    if not resume and cfg.run.sft_episodes > 0 and not cfg.model.checkpoint:
        from workers.sft import run_sft

        click.echo(f"warm start: cloning {cfg.run.sft_episodes} scripted-expert episodes into {folder / 'sft'}")
        fig = run_sft(cfg, folder / "sft", episodes=cfg.run.sft_episodes, epochs=cfg.run.sft_epochs)
        click.echo(f"warm start: deterministic success {fig['success_before']} -> {fig['success_after']}")
        cfg.model.checkpoint = str((folder / "sft").resolve())
    cfg_path = folder / "config.yaml"
    cfg_path.write_text(cfg.to_yaml())
    log_json = ctx.parent.params.get("log_json", False) if ctx.parent else False
    job = LocalJob(cfg, folder, cfg_path, log_json=log_json, resume=str(folder) if resume else None)
    on_stop_signals(job.request_stop)  # Ctrl-C, preemption (SIGTERM), a closed terminal (SIGHUP)
    click.echo(f"run folder {folder}  mode={cfg.run.mode}  env={cfg.env.name}  model={cfg.model.family}  steps={total}")
    metrics = open(folder / "metrics.jsonl", "a", buffering=1)
    t0 = time.monotonic()
    last: dict[str, Any] = {}
    reason = "steps_reached"
    run_id = ""
    try:
        job.start_broker(bind, pub)
        run_id = json.loads((folder / "broker.json").read_text())["run_id"]
        job.start_all()
        next_print = next_curves = next_check = time.monotonic()
        while True:
            if job.stop_requested:
                reason = "interrupted"
                break
            dead = [p for p in [job.broker_proc, *job.workers] if p.poll() is not None]
            if dead:
                reason = f"process_exited(code={dead[0].returncode})"
                break
            now = time.monotonic()
            if now >= next_check:  # the step count, often; progress every progress_every_s
                next_check = now + STEPS_CHECK_EVERY_S
                try:
                    fig = job.status()
                except TimeoutError:
                    continue
                last = fig
                done = fig["env_steps"] >= total
                if done or now >= next_print:
                    next_print = now + cfg.run.progress_every_s
                    row = progress_row(fig, now - t0)
                    metrics.write(json.dumps(row) + "\n")
                    click.echo(progress_line(row))
                    if now >= next_curves:
                        next_curves = now + CURVES_EVERY_S
                        write_curves(folder / "metrics.jsonl", folder / "curves.png")
                if done:
                    break
            time.sleep(0.1)  # the controller only polls STATUS; nothing waits on this
    except JobInterrupted:
        reason = "interrupted"
    finally:
        job.stop()
        metrics.close()
        write_curves(folder / "metrics.jsonl", folder / "curves.png")
        leftovers = segments_of_run(run_id) if run_id else []
        summary = {"run_dir": str(folder), "reason": reason, "seconds": round(time.monotonic() - t0, 1),
                   "shm_leftovers": len(leftovers), **(progress_row(last, time.monotonic() - t0) if last else {})}
        if cfg.run.record_dir:
            summary["dataset"] = _write_recording(cfg)
        (folder / "summary.json").write_text(json.dumps(summary, indent=1))
        click.echo(json.dumps(summary))
    if reason.startswith("process_exited"):
        raise click.ClickException(f"a process exited early; logs are in {folder}")


def _write_recording(cfg: Any) -> dict[str, Any]:
    """The run's staged episodes as a LeRobot dataset (a failure is reported, not raised: the
    staged episodes stay and the run's summary is still written)."""
    from workers.lerobot_dataset import write_dataset

    try:
        return write_dataset(cfg.run.record_dir, robot_type=cfg.env.name)
    except Exception as exc:  # noqa: BLE001 - reported in the summary, the staging files remain
        log.error("dataset_write_failed", error=repr(exc))
        return {"dataset": cfg.run.record_dir, "error": repr(exc)}


# ---------------------------------------------------------------------------------------------
# sft
# ---------------------------------------------------------------------------------------------


@main.command()
@click.argument("config", required=False)
@click.option("--out", required=True, help="Checkpoint folder to write (model.safetensors); use it as model.checkpoint.")
@click.option("--episodes", type=int, default=128, show_default=True, help="Expert episodes to collect.")
@click.option("--epochs", type=int, default=50, show_default=True, help="Behaviour-cloning passes over the data.")
@click.option("--lr", type=float, default=3e-3, show_default=True, help="Adam learning rate.")
@click.option("--demos", default=None, help="Read recorded demonstrations (.npz, see workers/sft.py) instead of an expert.")
@click.option("--save-demos", default=None, help="Also write the collected demonstrations to this .npz.")
@click.option("--eval-episodes", type=int, default=32, show_default=True, help="Deterministic episodes before/after.")
@click.option("--set", "overrides", multiple=True, help="Override a config key.")
def sft(config: str | None, out: str, episodes: int, epochs: int, lr: float, demos: str | None, save_demos: str | None,
        eval_episodes: int, overrides: tuple[str, ...]) -> None:
    """Behaviour-clone a scripted expert (or recorded demos) into a warm-start checkpoint."""
    from workers.sft import run_sft

    cfg = _load(config, overrides)
    _require_simulator(cfg)
    fig = run_sft(cfg, out, episodes=episodes, epochs=epochs, demos_path=demos, save_demos_to=save_demos,
                  eval_episodes=eval_episodes, lr=lr)
    click.echo(json.dumps(fig))


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--format", "fmt", required=True, type=click.Choice(["lerobot", "transformers", "release"]),
              help="lerobot (pi0, pi0.5), transformers (pi0), release (GR00T N1.5, OpenVLA-OFT).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write (created).")
def export(run_dir: str, fmt: str, out_dir: str) -> None:
    """Write RUN_DIR's trained policy (its latest checkpoint) in the family's own format."""
    from workers.release.export import export_run

    try:
        summary = export_run(run_dir, fmt, out_dir)
    except (ValueError, FileNotFoundError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(summary))


from rlvla3.eval_cmd import eval_command  # noqa: E402  (a command of its own module)

main.add_command(eval_command)

if __name__ == "__main__":
    main()
