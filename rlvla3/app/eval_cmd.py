"""``rlvla3 eval``: a checkpoint through its benchmark's official protocol, with a per-task table.

It runs in one process (the policy and one batch of envs, ``workers/evaluation.py``), because an
evaluation has nothing to overlap: every episode is deterministic and nothing is trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from rlvla3.config import ConfigError, load


def _config_for(checkpoint: Path, config: str | None, overrides: tuple[str, ...]):
    """``--config``, else the run folder's own config.yaml, else the embedded default."""
    if config is None:
        for cand in (checkpoint / "config.yaml", checkpoint.parent / "config.yaml", checkpoint.parent.parent / "config.yaml"):
            if checkpoint.is_dir() and cand.is_file():
                config = str(cand)
                break
    try:
        cfg = load(config, overrides)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    cfg.model.checkpoint = str(checkpoint)
    return cfg


@click.command("eval")
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--config", "config", default=None,
              help="Job config YAML (default: the run folder's config.yaml, else the embedded default).")
@click.option("--episodes", type=int, default=None, help="Starts per task (shortens the protocol; the table says so).")
@click.option("--envs-per-task", type=int, default=1, show_default=True, help="Envs stepping each task's starts together.")
@click.option("--video", "video_dir", default=None, help="Write videos of the first --video-episodes episodes per task here.")
@click.option("--video-episodes", type=int, default=1, show_default=True, help="Episodes per task to film.")
@click.option("--video-format", type=click.Choice(["mp4", "gif"]), default="mp4", show_default=True)
@click.option("--camera", "cameras", multiple=True, help="Camera(s) to film, side by side (default: all of the env's).")
@click.option("--out", "out_dir", default=None, help="Where eval.md / eval.json go (default: --video, else the current folder).")
@click.option("--set", "overrides", multiple=True, help="Override a config key.")
def eval_command(checkpoint: str, config: str | None, episodes: int | None, envs_per_task: int, video_dir: str | None,
                 video_episodes: int, video_format: str, cameras: tuple[str, ...], out_dir: str | None,
                 overrides: tuple[str, ...]) -> None:
    """Evaluate CHECKPOINT (an rlvla3 run folder or checkpoint, or a released layout) with the
    official protocol: LIBERO's 50 init states per task, Meta-World's goals (ML1: held-out test
    goals), ManiSkill's seeds 0..49. Writes eval.md and eval.json (per-task success)."""
    import torch

    from workers.evaluation import protocol_for, run_protocol, success_table, table_markdown
    from workers.model import build_policy
    from workers.videos import write_video

    if episodes is not None and episodes < 1:
        raise click.ClickException("--episodes must be >= 1")
    cfg = _config_for(Path(checkpoint), config, overrides)
    torch.set_num_threads(max(1, cfg.workers.torch_threads))
    proto = protocol_for(cfg, episodes)
    try:
        policy = build_policy(cfg)
        eps = run_protocol(cfg, policy, proto, envs_per_task=envs_per_task,
                           video_episodes=video_episodes if video_dir else 0, cameras=list(cameras) or None)
    except (ValueError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    table = success_table(eps, proto, str(checkpoint))
    out = Path(out_dir or video_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    if video_dir:
        videos = []
        for i, ep in enumerate(e for e in eps if e.frames):
            name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in ep.task)[:60]
            path = write_video(Path(video_dir) / f"{name}_seed{ep.seed}.{video_format}", ep.frames)
            videos.append({"task": ep.task, "seed": ep.seed, "path": str(path), "frames": len(ep.frames),
                           "success": ep.success})
        table["videos"] = videos
    (out / "eval.json").write_text(json.dumps(table, indent=1))
    (out / "eval.md").write_text(table_markdown(table))
    click.echo(table_markdown(table))
    click.echo(f"wrote {out / 'eval.md'} and {out / 'eval.json'}")
