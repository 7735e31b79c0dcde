"""``rlvla3 run``'s controller: the run folder and its config, the job on this machine, the progress
it shows while it goes, and the summary it leaves.

The command line only gathers options into :class:`RunOptions`; :meth:`RunController.prepare`
turns them into a config and a folder (or refuses with a :class:`RunRefused` that names the
option), and :meth:`RunController.run` starts the job and follows it until the step count, a stop
signal or a process that dies.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import structlog

from rlvla3.app.launch import JobInterrupted, LocalJob
from rlvla3.app.progress import STEPS_CHECK_EVERY_S, RunRecord
from rlvla3.auth import AuthError, check_bind
from rlvla3.config import ConfigError, JobConfig, load
from rlvla3.config_rules import sync_off_policy
from rlvla3.lifetime import on_stop_signals
from rlvla3.scale_config import gpu_overrides

log = structlog.get_logger()



class RunRefused(Exception):
    """An option or config that cannot start a run; the message names it."""


@dataclass
class RunOptions:
    """What ``rlvla3 run`` was asked for (its command-line options)."""

    config: str | None = None
    steps: int | None = None
    overrides: tuple[str, ...] = ()
    run_dir: str | None = None
    bind: str = "tcp://127.0.0.1:0"
    pub: str = "tcp://127.0.0.1:0"
    resume: str | None = None
    keys_dir: str | None = None
    record_dir: str | None = None
    record_slots: str | None = None
    gpus: tuple[str, ...] = ()
    log_json: bool = False


def load_config(config: str | None, overrides: tuple[str, ...], gpus: tuple[str, ...] = ()) -> JobConfig:
    """The job config with ``--set`` and ``--gpus`` applied; a bad key is a :class:`RunRefused`."""
    try:
        return load(config, overrides + gpu_overrides(gpus))
    except ConfigError as exc:
        raise RunRefused(str(exc)) from None


def require_simulator(cfg: JobConfig) -> None:
    """Fail before starting anything when the job's simulator is not installed here: an env
    adapter module may define ``require_installed()``, which raises ModuleNotFoundError with
    install instructions (Meta-World's does); an env no adapter registers (``env.plugins``) fails too."""
    from workers.envs.base import require_simulator as check

    try:
        check(cfg.env.name, cfg.env.plugins)
    except (ImportError, ValueError) as exc:
        raise RunRefused(f"env {cfg.env.name!r}: {exc}") from None


def require_model_options(cfg: JobConfig) -> None:
    """Fail before starting anything when ``model.options`` has a key or value its family does
    not take (the workers would each refuse it only once they had started)."""
    from workers.contract import parse_options
    from workers.policies.base import options_class, policy_families

    fam = cfg.model.family
    cls = options_class(fam)  # imports this family's module only
    if cls is None and fam not in policy_families():
        raise RunRefused(f"model.family: {fam!r} is not a registered policy family: {policy_families()}")
    try:
        parse_options(cls, cfg.model.options, f"model.options for {fam!r}")
    except ValueError as exc:
        raise RunRefused(str(exc)) from None


class RunController:
    """One ``rlvla3 run``: a prepared config and folder, then the job followed to its end."""

    def __init__(self, cfg: JobConfig, folder: Path, opts: RunOptions, echo: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.folder = folder
        self.opts = opts
        self.echo = echo
        self.total = opts.steps or cfg.run.total_env_steps
        if not opts.resume:  # the trainer anneals over it; a resumed run keeps its config as it was
            cfg.run.total_env_steps = self.total

    @classmethod
    def prepare(cls, opts: RunOptions, echo: Callable[[str], None] = print) -> "RunController":
        """The config (the resumed run's own, or CONFIG with --set/--gpus), the run folder, the
        recording and key settings, and the behaviour-cloning warm start when the config asks."""
        if opts.resume:
            from workers.checkpoint import latest_checkpoint

            if opts.config or opts.overrides or opts.run_dir:
                raise RunRefused("--resume continues a run with its own config and folder: drop CONFIG, --set and --run-dir")
            folder = Path(opts.resume)
            if latest_checkpoint(folder) is None:
                raise RunRefused(f"--resume {opts.resume}: no checkpoint under {folder / 'checkpoints'}")
            cfg = load_config(str(folder / "config.yaml"), ())
        else:
            cfg = load_config(opts.config, opts.overrides, opts.gpus)
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            folder = Path(opts.run_dir) if opts.run_dir else Path(cfg.run.run_dir) / f"{cfg.run.name}-{stamp}"
        require_simulator(cfg)
        require_model_options(cfg)
        if opts.record_dir:
            from workers.lerobot_dataset import require_pyarrow

            try:
                require_pyarrow()
                cfg.run.record_slots = [int(x) for x in opts.record_slots.split(",")] if opts.record_slots else []
            except (ModuleNotFoundError, ValueError) as exc:
                raise RunRefused(f"--record: {exc}") from None
            cfg.run.record_dir = str(Path(opts.record_dir).resolve())
        if opts.keys_dir:
            cfg.broker.keys_dir = str(Path(opts.keys_dir).resolve())
        if cfg.broker.keys_dir:
            try:
                check_bind([opts.bind, opts.pub], cfg.broker.keys_dir, False, False)
            except AuthError as exc:
                raise RunRefused(str(exc)) from None
        if (why := sync_off_policy(cfg)) is not None:
            log.warning("sync_not_on_policy", reason=why)
            echo(f"note: {why}")
        folder.mkdir(parents=True, exist_ok=True)
        controller = cls(cfg, folder, opts, echo)
        if not opts.resume and cfg.run.sft_episodes > 0 and not cfg.model.checkpoint:
            controller.warm_start()
        return controller

    def warm_start(self) -> None:
        """Clone the scripted expert into ``sft/`` and start RL from it."""
        from workers.sft import run_sft

        cfg, out = self.cfg, self.folder / "sft"
        self.echo(f"warm start: cloning {cfg.run.sft_episodes} scripted-expert episodes into {out}")
        fig = run_sft(cfg, out, episodes=cfg.run.sft_episodes, epochs=cfg.run.sft_epochs)
        self.echo(f"warm start: deterministic success {fig['success_before']} -> {fig['success_after']}")
        cfg.model.checkpoint = str(out.resolve())

    def run(self) -> str:
        """Start the job, follow it, stop it, write the summary; returns why it ended
        (``steps_reached``, ``interrupted`` or ``process_exited(code=N)``)."""
        cfg, folder = self.cfg, self.folder
        cfg_path = folder / "config.yaml"
        cfg_path.write_text(cfg.to_yaml())
        job = LocalJob(cfg, folder, cfg_path, log_json=self.opts.log_json, resume=str(folder) if self.opts.resume else None)
        on_stop_signals(job.request_stop)  # Ctrl-C, preemption (SIGTERM), a closed terminal (SIGHUP)
        self.echo(f"run folder {folder}  mode={cfg.run.mode}  env={cfg.env.name}  model={cfg.model.family}  steps={self.total}")
        record = RunRecord(folder, cfg.run.progress_every_s, self.echo)
        reason = "steps_reached"
        run_id = ""
        try:
            job.start_broker(self.opts.bind, self.opts.pub)
            run_id = json.loads((folder / "broker.json").read_text())["run_id"]
            job.start_all()
            reason = self.follow(job, record)
        except JobInterrupted:
            reason = "interrupted"
        finally:
            job.stop()
            summary = record.close(reason, run_id)
            if cfg.run.record_dir:
                summary["dataset"] = self.write_recording()
            record.write_summary(summary)
        return reason

    def first_error(self) -> str:
        """The first error a worker or the broker logged in this run's folder (``trainer0.log:
        setup_failed ...``), so a run that ends early says why without a trip through its logs."""
        for log_file in sorted(self.folder.glob("*.log")):
            for line in log_file.read_text(errors="replace").splitlines():
                if "[error" in line or '"level": "error"' in line:
                    return f"{log_file.name}: {line.strip()[:600]}"
        return ""

    def follow(self, job: LocalJob, record: RunRecord) -> str:
        """Poll STATUS until the step count is reached, a stop is asked or a process dies, each
        answer into the run's ``record``."""
        next_check = time.monotonic()
        while True:
            if job.stop_requested:
                return "interrupted"
            dead = [p for p in [job.broker_proc, *job.workers] if p.poll() is not None]
            if dead:
                return f"process_exited(code={dead[0].returncode})"
            if time.monotonic() >= next_check:  # the step count, often; progress every progress_every_s
                next_check = time.monotonic() + STEPS_CHECK_EVERY_S
                try:
                    fig = job.status()
                except TimeoutError:
                    continue
                done = fig["env_steps"] >= self.total
                record.observe(fig, force=done)
                if done:
                    return "steps_reached"
            time.sleep(0.1)  # the controller only polls STATUS; nothing waits on this

    def write_recording(self) -> dict[str, Any]:
        """The run's staged episodes as a LeRobot dataset (a failure is reported, not raised: the
        staged episodes stay and the run's summary is still written)."""
        from workers.lerobot_dataset import write_dataset

        try:
            return write_dataset(self.cfg.run.record_dir, robot_type=self.cfg.env.name)
        except Exception as exc:  # noqa: BLE001 - reported in the summary, the staging files remain
            log.error("dataset_write_failed", error=repr(exc))
            return {"dataset": self.cfg.run.record_dir, "error": repr(exc)}
