"""The trainer worker: take trajectory fragments, run PPO (decoupled, staleness-aware) or GRPO,
publish weight versions.

The socket thread only receives, acknowledges and buffers; updates run on a JobRunner thread so
heartbeats keep flowing during a long update. A fragment is acknowledged (TRAJ_ACK) as soon as
its tensors are copied out of shared memory / the message: from then on the trainer owns it.

One update, top to bottom (``_update``):
  1. take ``batch_steps`` decision steps of buffered fragments;
  2. drop samples staler than ``max_staleness`` (counted);
  3. advantages: GAE on behaviour values with a bootstrap value of each fragment's last
     observation (PPO), or group-relative returns (GRPO);
  4. ``ppo_update``: proximal log-probs recomputed, decoupled clipped loss, epochs x minibatches;
  5. version += 1; publish WEIGHTS every ``publish_every`` updates; checkpoint.
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from rlvla3 import protocol as P
from workers.algorithms.gae import compute_gae
from workers.algorithms.ppo import PPOConfig, make_optimizer, ppo_update
from workers.base import WorkerBase
from workers.model import build_policy, state_tensors

log = structlog.get_logger()


def ppo_config(cfg: Any) -> PPOConfig:
    a = cfg.algo
    return PPOConfig(
        clip_eps=a.clip_eps, dual_clip=a.dual_clip if a.dual_clip > 1 else None,
        value_clip_eps=a.value_clip_eps if a.value_clip_eps > 0 else None, vf_coef=a.vf_coef if a.name == "ppo" else 0.0,
        ent_coef=a.ent_coef, max_grad_norm=a.max_grad_norm, epochs=a.epochs, minibatch_size=a.minibatch_size,
        gamma=a.gamma, lam=a.lam, behav_weight_cap=a.behav_weight_cap, lr=a.lr,
        normalize_advantages=a.name == "ppo",
    )


class Fragment:
    """A received trajectory fragment, copied into process memory."""

    def __init__(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.header = header
        self.arrays = arrays
        self.steps = int(arrays["reward"].shape[0])


class TrainerWorker(WorkerBase):
    role = "trainer"

    def __init__(self, broker: str, run_dir: str | None = None, credits: int = 256, **kw: Any) -> None:
        super().__init__(broker, **kw)
        self.run_dir = Path(run_dir) if run_dir else None
        self.credits = credits
        self.buffer: deque[Fragment] = deque()
        self.buffered_steps = 0
        self.version = 0
        self.updates = 0
        self.training = False
        self.acks: list[int] = []
        self.dropped_stale = 0
        self.dropped_unsent = 0
        self.metrics_file = None

    def ready_fields(self) -> dict[str, Any]:
        return {"credits": self.credits}

    def setup(self) -> None:
        cfg = self.cfg
        torch.set_num_threads(max(1, cfg.workers.torch_threads))
        self.policy = build_policy(cfg, device=self.device)
        self.policy.train()
        self.ppo = ppo_config(cfg)
        self.optimizer = make_optimizer(self.policy.parameters(), self.ppo)
        self.version = int(self.welcome.get("trainer_version", 0))
        self.runner = self.new_runner("update")  # created here, used only from the socket thread
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.metrics_file = open(self.run_dir / "trainer_metrics.jsonl", "a", buffering=1)
        log.info("trainer_ready", algo=cfg.algo.name, batch_steps=cfg.algo.batch_steps, version=self.version,
                 params=sum(p.numel() for p in self.policy.parameters()))

    def heartbeat_fields(self) -> dict[str, Any]:
        return {"credits": self.credits, "version": self.version}

    # -- receiving ----------------------------------------------------------------------------

    def on_message(self, msg: P.Message) -> None:
        if msg.type != P.TRAJ:
            return
        try:
            arrays = {name: self.attach.materialize(t, copy=True) for name, t in msg.tensors.items()}
            frag = Fragment(msg.header, arrays)
        except (KeyError, ValueError) as err:  # unreadable: ack it so the sim frees it, count it
            log.warning("traj_unreadable", gid=msg.get("gid"), error=str(err))
            self.acks.append(msg["gid"]) if isinstance(msg.get("gid"), int) else None
            return
        self.acks.append(msg["gid"])
        self.buffer.append(frag)
        self.buffered_steps += frag.steps

    def tick(self, now: float) -> None:
        if self.acks:
            self.send(P.TRAJ_ACK, {"traj_ids": self.acks, "dropped_stale": 0})
            self.acks = []
        if not self.training and self.buffered_steps >= self.cfg.algo.batch_steps:
            frags = []
            steps = 0
            while self.buffer and steps < self.cfg.algo.batch_steps:
                f = self.buffer.popleft()
                frags.append(f)
                steps += f.steps
            self.buffered_steps -= steps
            self.training = True
            self.send(P.TRAIN, {"phase": "begin", "version": self.version, "steps": steps})
            self.runner.submit(lambda: self._update(frags), "update")

    # -- the update (runs on the update thread) -----------------------------------------------

    def _update(self, frags: list[Fragment]) -> dict[str, Any]:
        t0 = time.perf_counter()
        a = self.cfg.algo

        # ---- 1. staleness: drop samples older than max_staleness ---------------------------
        versions = np.concatenate([f.arrays["version"] for f in frags])
        staleness = self.version - versions
        keep = staleness <= a.max_staleness
        dropped = int((~keep).sum())

        # ---- 2. advantages: GAE on behaviour values, bootstrapped from the last obs --------
        boot = self._bootstrap_values(frags)
        advs, rets = [], []
        for f, bv in zip(frags, boot):
            terminated = torch.as_tensor(f.arrays["terminated"])
            adv, ret = compute_gae(torch.as_tensor(f.arrays["reward"]), torch.as_tensor(f.arrays["value"]),
                                   terminated, 0.0 if bool(terminated[-1]) else bv, a.gamma, a.lam)
            advs.append(adv)
            rets.append(ret)

        # ---- 3. one batch of decision steps -------------------------------------------------
        batch = self._batch(frags)
        batch["advantages"] = torch.cat(advs).float()
        batch["returns"] = torch.cat(rets).float()
        batch["mask"] = torch.as_tensor(keep)
        if not bool(batch["mask"].any()):
            return {"skipped": True, "dropped_stale": dropped, "staleness": staleness}

        # ---- 4. PPO with recomputed proximal log-probs --------------------------------------
        stats = ppo_update(self.policy, self.optimizer, batch, self.ppo)
        stats.update({
            "update_s": time.perf_counter() - t0, "samples": int(keep.sum()), "dropped_stale": dropped,
            "return_mean_batch": float(np.mean([f.header.get("episode_return") for f in frags if f.header.get("done")] or [np.nan])),
        })
        stats["staleness"] = staleness
        return stats

    def _bootstrap_values(self, frags: list[Fragment]) -> list[float]:
        """V(s_N) of each fragment's observation after its last step (value heads read the
        observation only, so the last step's actions and replay serve as placeholders)."""
        obs = {
            "images": {k[len("obs/images/"):]: np.stack([f.arrays[k][-1] for f in frags])
                       for k in frags[0].arrays if k.startswith("obs/images/")},
            "state": np.stack([f.arrays["obs/state"][-1] for f in frags]),
            "instruction": [f.header.get("instruction", "") for f in frags],
        }
        actions = torch.as_tensor(np.stack([f.arrays["actions"][-1] for f in frags]))
        replay = {k[len("replay/"):]: torch.as_tensor(np.stack([f.arrays[k][-1] for f in frags]))
                  for k in frags[0].arrays if k.startswith("replay/")}
        with torch.no_grad():
            out = self.policy.evaluate(obs, actions.to(self.policy.device), {k: v.to(self.policy.device) for k, v in replay.items()})
        return out.value.float().cpu().tolist()

    def _batch(self, frags: list[Fragment]) -> dict[str, Any]:
        cams = [k for k in frags[0].arrays if k.startswith("obs/images/")]
        obs = {
            "images": {k[len("obs/images/"):]: np.concatenate([f.arrays[k][:-1] for f in frags]) for k in cams},
            "state": np.concatenate([f.arrays["obs/state"][:-1] for f in frags]),
            "instruction": [f.header.get("instruction", "") for f in frags for _ in range(f.steps)],
        }
        replay = {k[len("replay/"):]: torch.as_tensor(np.concatenate([f.arrays[k] for f in frags]))
                  for k in frags[0].arrays if k.startswith("replay/")}
        return {
            "obs": obs,
            "actions": torch.as_tensor(np.concatenate([f.arrays["actions"] for f in frags])),
            "replay": replay,
            "behav_logprob": torch.as_tensor(np.concatenate([f.arrays["logprob"] for f in frags])),
            "values": torch.as_tensor(np.concatenate([f.arrays["value"] for f in frags])),
        }

    # -- after an update (socket thread) ------------------------------------------------------

    def on_job_done(self, tag: Any, result: Any, error: BaseException | None) -> None:
        self.training = False
        if error is not None:
            log.error("update_failed", error=repr(error)[:1000])
            raise error
        staleness = result.pop("staleness")
        counts = Counter(int(s) for s in staleness.tolist())
        self.dropped_stale += result.get("dropped_stale", 0)
        if not result.get("skipped"):
            self.version += 1
            self.updates += 1
            if self.updates % max(1, self.cfg.algo.publish_every) == 0:
                self.send(P.WEIGHTS, {"version": self.version, "published_at": time.time_ns()}, state_tensors(self.policy))
        figures = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in result.items() if isinstance(v, (int, float))}
        figures["version"] = self.version
        figures["dropped_stale_total"] = self.dropped_stale
        figures["staleness_counts"] = {str(k): v for k, v in sorted(counts.items())}
        self.send(P.TRAIN, {"phase": "end", "version": self.version, "stats": figures})
        log.info("update_done", version=self.version, **{k: figures[k] for k in ("policy_loss", "value_loss", "approx_kl", "clip_frac", "update_s") if k in figures})
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps({"t": time.time(), **figures}) + "\n")

    def teardown(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
