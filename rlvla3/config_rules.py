"""The config's rules (``rlvla3.config.validate``): keys that were renamed, and the cross-field
rules. Each error names its key."""

from __future__ import annotations

from typing import Any

from rlvla3.scale_config import ConfigError, validate_scale

MODES = ("sync", "async_rollout", "async")
RATIO_LEVELS = ("unit", "chunk")
TRUST_REGIONS = ("proximal", "behaviour")
ADV_NORMS = ("batch", "proximal")

RENAMED: dict[str, str] = {
    "algo.group_size": "env.group_size",
    "model.options.chunk_size": "model.chunk_size",
    "model.options.device": "workers.device",
    "model.options.dtype": "model.dtype",
}
"""Keys that were removed, and the one key that now holds each setting. A config that still
uses an old key is refused with an error naming the new one (never silently mapped: a value
set twice would otherwise have two sources)."""


def check_renamed(data: dict[str, Any]) -> None:
    """Refuse a config that uses a key of :data:`RENAMED`, naming its replacement."""
    for old, new in RENAMED.items():
        node: Any = data
        for part in old.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            raise ConfigError(f"{old} was removed: set {new} instead")


def training_envs(env: Any) -> int:
    """A simulator's envs that feed training: ``env.num_envs`` less the evaluation slots' envs."""
    return env.num_envs - env.eval_slots * (env.num_envs // max(env.slots, 1))


def sync_off_policy(cfg: Any) -> str | None:
    """Why a sync job's updates will train some steps one version late (None: they will not).
    A sync round ships every training env's fragment of ``env.fragment_len`` decisions at once;
    a batch that is not a whole number of rounds leaves a remainder that the next version's
    update takes (docs/architecture.md, Modes). Simulators added at run time change the round."""
    if cfg.run.mode != "sync":
        return None
    round_steps = cfg.workers.simulators * training_envs(cfg.env) * cfg.env.fragment_len
    if cfg.algo.batch_steps % round_steps == 0:
        return None
    return (f"algo.batch_steps ({cfg.algo.batch_steps}) is not a whole number of sync rounds of {round_steps} "
            f"decisions (workers.simulators x training envs x env.fragment_len): part of each update "
            f"will be one version stale")


def validate_job(cfg: Any) -> None:
    """Every rule of the job's config."""
    validate_scale(cfg.model.lora, cfg.train, cfg.placement, cfg.workers.generators, cfg.workers.trainers)
    if cfg.run.mode not in MODES:
        raise ConfigError(f"run.mode: {cfg.run.mode!r} not in {MODES}")
    if cfg.broker.max_peer_msgs_per_s < 1:
        raise ConfigError(f"broker.max_peer_msgs_per_s ({cfg.broker.max_peer_msgs_per_s}) must be >= 1")
    if cfg.env.num_envs < 1 or cfg.env.slots < 1:
        raise ConfigError("env.num_envs and env.slots must be >= 1")
    if cfg.env.num_envs % cfg.env.slots:
        raise ConfigError(f"env.num_envs ({cfg.env.num_envs}) must be a multiple of env.slots ({cfg.env.slots})")
    if cfg.env.eval_slots < 0 or cfg.env.eval_slots >= cfg.env.slots:
        raise ConfigError(f"env.eval_slots ({cfg.env.eval_slots}) must leave at least one training slot of env.slots ({cfg.env.slots})")
    if cfg.env.group_mode not in ("parallel", "sequential"):
        raise ConfigError(f"env.group_mode: {cfg.env.group_mode!r} not in ('parallel', 'sequential')")
    n_training = training_envs(cfg.env)
    if cfg.env.group_mode == "parallel" and cfg.env.group_size > 1 and n_training % cfg.env.group_size:
        # A group whose envs reach into an evaluation slot would never complete.
        raise ConfigError(f"the training envs of a simulator (env.num_envs minus the eval slots' envs: "
                          f"{n_training}) must be a multiple of env.group_size ({cfg.env.group_size}) "
                          f"with env.group_mode=parallel")
    if not isinstance(cfg.env.plugins, list) or not all(isinstance(m, str) and m for m in cfg.env.plugins):
        raise ConfigError(f"env.plugins must be a list of module names, got {cfg.env.plugins!r}")
    if cfg.env.parallel not in ("thread", "process"):
        raise ConfigError(f"env.parallel: {cfg.env.parallel!r} not in ('thread', 'process')")
    if cfg.batching.assignment not in ("dynamic", "sticky"):
        raise ConfigError(f"batching.assignment: {cfg.batching.assignment!r} not in ('dynamic', 'sticky')")
    if cfg.batching.max_batch < 1:
        raise ConfigError("batching.max_batch must be >= 1")
    b = cfg.batching
    if not (1 <= b.adaptive_min_batch <= b.adaptive_max_batch and 0 <= b.adaptive_min_wait_ms <= b.adaptive_max_wait_ms):
        raise ConfigError("batching.adaptive_*: need 1 <= adaptive_min_batch <= adaptive_max_batch and "
                          "0 <= adaptive_min_wait_ms <= adaptive_max_wait_ms")
    if b.adaptive_window_s <= 0:
        raise ConfigError("batching.adaptive_window_s must be > 0")
    if cfg.batching.credits < 1:
        raise ConfigError("batching.credits must be >= 1")
    if cfg.model.chunk_size < 1:
        raise ConfigError("model.chunk_size must be >= 1")
    if cfg.workers.device != "cpu" and not cfg.workers.device.startswith("cuda"):
        raise ConfigError(f"workers.device: {cfg.workers.device!r} is neither 'cpu' nor 'cuda[:N]'")
    if cfg.workers.broker_wait_s <= 0:
        raise ConfigError(f"workers.broker_wait_s: {cfg.workers.broker_wait_s} is not a positive number of seconds")
    if min(cfg.workers.simulators, cfg.workers.generators, cfg.workers.trainers) < 0:
        raise ConfigError("workers.simulators, workers.generators and workers.trainers must be >= 0")
    if cfg.model.dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"model.dtype: {cfg.model.dtype!r} not in ('auto', 'float32', 'bfloat16')")
    if cfg.weights.copy_threads < 1:
        raise ConfigError("weights.copy_threads must be >= 1")
    if cfg.weights.delta not in ("none", "bf16"):
        raise ConfigError(f"weights.delta must be none or bf16, not {cfg.weights.delta!r}")
    if cfg.weights.delta != "none" and cfg.weights.cuda_ipc:
        raise ConfigError("weights.delta and weights.cuda_ipc do not combine (the device slot holds the new tensors, not the rebuilt ones)")
    if not 1 <= cfg.weights.bucket_mb <= 256:
        raise ConfigError(f"weights.bucket_mb: {cfg.weights.bucket_mb} not in 1..256")
    if cfg.weights.in_flight and (cfg.algo.publish_every != 1 or cfg.train.fsdp):
        raise ConfigError("weights.in_flight publishes within every update: it needs algo.publish_every: 1, and "
                          "not train.fsdp (rank 0 alone would have to gather the shards between two epochs)")
    if cfg.weights.collect_after_epochs:
        k = cfg.weights.collect_after_epochs
        # Like weights.in_flight, it is kept and ignored in the alternating modes (they hold rollouts
        # for the whole update), so one config runs in every mode.
        if not cfg.weights.in_flight or not 0 < k < cfg.algo.epochs or cfg.workers.trainers > 1:
            raise ConfigError(f"weights.collect_after_epochs: {k} waits for weights published between an update's epochs: "
                              f"it needs weights.in_flight, 0 < it < algo.epochs ({cfg.algo.epochs}) and one trainer "
                              f"(workers.trainers: {cfg.workers.trainers})")
    if not cfg.weights.shm and not cfg.weights.stream_bind:
        raise ConfigError("weights.stream_bind: empty with weights.shm off leaves generators no way to fetch weights")
    if cfg.env.name == "gymnasium":
        from rlvla3.gym_config import check_gymnasium

        check_gymnasium(cfg.env.options)
    validate_algo(cfg)


def validate_algo(cfg: Any) -> None:
    """The algorithm's rules (``config.validate`` calls it), each error naming its key."""
    a = cfg.algo
    if a.name not in ("ppo", "grpo"):
        raise ConfigError(f"algo.name: {a.name!r} not in ('ppo', 'grpo')")
    if a.minibatch_size < 1 or a.batch_steps < 1 or a.epochs < 1:
        raise ConfigError("algo.batch_steps, algo.minibatch_size and algo.epochs must be >= 1")
    if a.clip_eps <= 0:
        raise ConfigError(f"algo.clip_eps must be > 0, got {a.clip_eps}")
    if a.ratio_level not in RATIO_LEVELS:
        raise ConfigError(f"algo.ratio_level: {a.ratio_level!r} not in {RATIO_LEVELS}")
    if a.trust_region not in TRUST_REGIONS:
        raise ConfigError(f"algo.trust_region: {a.trust_region!r} not in {TRUST_REGIONS}")
    if a.adv_norm not in ADV_NORMS:
        raise ConfigError(f"algo.adv_norm: {a.adv_norm!r} not in {ADV_NORMS}")
    if a.dual_clip != 0 and a.dual_clip <= 1.0:
        raise ConfigError(f"algo.dual_clip must be > 1 (or 0: off), got {a.dual_clip}")
    if a.behav_weight_cap != 0 and a.behav_weight_cap < 1.0:
        # Below 1 it would down-weight even fresh samples, and PPO would no longer be PPO.
        raise ConfigError(f"algo.behav_weight_cap must be >= 1 (or 0: uncapped), got {a.behav_weight_cap}")
    if a.value_clip_eps < 0 or a.max_grad_norm <= 0 or a.reward_clip < 0:
        raise ConfigError("algo.value_clip_eps and algo.reward_clip must be >= 0 and algo.max_grad_norm > 0")
    if a.target_kl < 0:
        raise ConfigError(f"algo.target_kl must be >= 0 (0: off), got {a.target_kl}")
    if a.value_lr < 0:
        raise ConfigError(f"algo.value_lr must be >= 0 (0: algo.lr), got {a.value_lr}")
    if not isinstance(a.frozen, list) or not all(isinstance(x, str) and x for x in a.frozen):
        raise ConfigError(f"algo.frozen must be a list of parameter-name prefixes, got {a.frozen!r}")
    if a.max_staleness < 0:
        raise ConfigError(f"algo.max_staleness must be >= 0, got {a.max_staleness}")
    if a.admission_lag is not None and not 0 <= a.admission_lag <= a.max_staleness:
        # Work admitted further ahead than the filter allows would be generated only to be dropped.
        raise ConfigError(f"algo.admission_lag must be in [0, algo.max_staleness={a.max_staleness}], "
                          f"got {a.admission_lag}")
    if a.grpo_reward not in ("success", "return"):
        raise ConfigError(f"algo.grpo_reward: {a.grpo_reward!r} not in ('success', 'return')")
    if a.name == "grpo" and cfg.env.group_size < 2:
        # A group of one has no variance: nothing would ever be trained on.
        raise ConfigError(f"algo.name=grpo needs env.group_size >= 2 (episodes compared within a group), "
                          f"got {cfg.env.group_size}")
