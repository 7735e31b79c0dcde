"""The ``rlvla3`` command line: broker, worker, run, status, sft, export."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from rlvla3 import logging as rlog
from rlvla3.app.eval_cmd import eval_command
from rlvla3.app.launch import request_status, spawn, stop_processes
from rlvla3.app.progress import latest_eval
from rlvla3.app.run import RunController, RunOptions, RunRefused, load_config, require_simulator
from rlvla3.app.watch import watch_command
from rlvla3.config import ConfigError, JobConfig
from rlvla3.devices import check_gpus
from rlvla3.lifetime import on_stop_signals, stopped_cleanly

SET_HELP = "Override a config key: --set batching.max_batch=16; --set ~KEY removes one, so its default applies."
"""The help of every command's --set that applies overrides to the job config."""


@click.group()
@click.option("--log-json", is_flag=True, help="One JSON object per log line (default: key=value).")
@click.option("--log-level", default="info", show_default=True, help="debug, info, warning, error.")
def main(log_json: bool, log_level: str) -> None:
    """rlvla3: fully asynchronous RL for Vision-Language-Action policies."""
    rlog.configure(json=log_json, level=log_level)


def _load(config: str | None, overrides: tuple[str, ...]) -> JobConfig:
    try:
        return load_config(config, overrides)
    except RunRefused as exc:
        raise click.ClickException(str(exc)) from None


def _require_simulator(cfg: JobConfig) -> None:
    try:
        require_simulator(cfg)
    except RunRefused as exc:
        raise click.ClickException(str(exc)) from None


# ---------------------------------------------------------------------------------------------
# broker
# ---------------------------------------------------------------------------------------------


@main.command()
@click.option("--config", "config", default=None, help="Job config YAML (default: the embedded one).")
@click.option("--bind", default=None, help="ROUTER address, e.g. tcp://*:5555 (default: broker.bind).")
@click.option("--pub", default=None, help="PUB address for weights, e.g. tcp://*:5556 (default: broker.pub).")
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
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
    from rlvla3.scale_config import parse_gpus

    try:
        devices = check_gpus(parse_gpus(gpus))
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
@click.option("--set", "overrides", multiple=True, help=SET_HELP)
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
    log_json = ctx.parent.params.get("log_json", False) if ctx.parent else False
    opts = RunOptions(config=config, steps=steps, overrides=overrides, run_dir=run_dir, bind=bind, pub=pub,
                      resume=resume, keys_dir=keys_dir, record_dir=record_dir, record_slots=record_slots,
                      gpus=gpus, log_json=log_json)
    try:
        controller = RunController.prepare(opts, echo=click.echo)
    except RunRefused as exc:
        raise click.ClickException(str(exc)) from None
    if controller.run().startswith("process_exited"):
        why = controller.first_error()
        raise click.ClickException(f"a process exited early; logs are in {controller.folder}" + (f"\n{why}" if why else ""))
    stopped_cleanly()  # summary and checkpoint written: leave without the interpreter's teardown


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
    from workers.export import export_run

    try:
        summary = export_run(run_dir, fmt, out_dir)
    except (ValueError, FileNotFoundError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(summary))


main.add_command(eval_command)
main.add_command(watch_command)

if __name__ == "__main__":
    main()
