"""Job configuration: YAML validated into dataclasses, overridable with ``--set key=value``.

One way to set each thing: the YAML file, then ``--set`` overrides. Unknown keys and values of
the wrong type are errors that name the key. The broker holds the validated config and hands
it (as a plain dict) to every worker in its reply to READY.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from rlvla3.config_rules import check_renamed, validate_job
from rlvla3.scale_config import ConfigError, LoraConfig, PlacementConfig, TrainConfig, WeightsConfig

SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A number in exponent notation without a dot (``1e-4``), which YAML 1.1 reads as a string."""


@dataclass
class RunConfig:
    name: str = "synthetic"
    """Run name; the run folder is ``<run_dir>/<name>-<timestamp>``."""
    seed: int = 0
    """Seeds envs, policies and samplers."""
    mode: str = "async"
    """``sync`` (all slots step together, generation and training alternate), ``async_rollout``
    (slots independent, training alternates) or ``async`` (everything overlaps)."""
    total_env_steps: int = 20_000
    """``rlvla3 run`` stops after this many env steps (one step = one env, one action)."""
    run_dir: str = "runs"
    """Parent folder of run folders (metrics, checkpoints, logs)."""
    progress_every_s: float = 2.0
    """How often ``rlvla3 run`` prints progress and writes a metrics line."""
    sft_episodes: int = 0
    """Warm start: when > 0 and ``model.checkpoint`` is empty, ``rlvla3 run`` first clones this
    many scripted-expert episodes into ``<run folder>/sft`` (``rlvla3 sft``) and starts RL from
    that checkpoint."""
    sft_epochs: int = 30
    """Warm start: behaviour-cloning passes over the demonstrations."""
    record_dir: str = ""
    """Save the finished episodes of ``run.record_slots`` here as a LeRobot dataset (``rlvla3 run
    --record DIR``; simulators stage episodes, the launcher writes the dataset at the end)."""
    record_slots: list = field(default_factory=list)
    """Simulator slot indices whose episodes are recorded (empty: every slot)."""


@dataclass
class BrokerConfig:
    bind: str = "tcp://127.0.0.1:5555"
    """ROUTER address every worker connects to."""
    pub: str = "tcp://127.0.0.1:5556"
    """PUB address that publishes weight versions."""
    heartbeat_s: float = 1.0
    """Heartbeat interval; a peer silent for ``liveness`` intervals is dead."""
    liveness: int = 3
    """Missed heartbeats before a peer is declared dead."""
    keys_dir: str = ""
    """CURVE key folder made by ``rlvla3 keys DIR`` (rlvla3/auth.py): the broker's ROUTER and PUB
    become CURVE servers that admit only the public keys in ``DIR/clients``. Empty: no CURVE, and
    a non-loopback bind is refused unless the broker is started with ``--insecure``."""
    max_version_step: int = 1000
    """WEIGHTS, and trainers' version reports (TRAIN, READY) once a version is announced, may move
    the policy version at most this far past the newest the broker knows."""
    max_peer_requests: int = 256
    """OBS requests one simulator may have queued at once; more are answered with ERROR."""
    max_peer_trajs: int = 1024
    """Trajectory fragments one simulator may have waiting for a trainer; more get ERROR."""
    max_peer_bytes: int = 1 << 30
    """Inline tensor bytes one peer's queued requests and waiting fragments may hold."""
    reject_log_per_s: int = 20
    """``message_rejected`` log lines per peer per second; the rest are counted in one line."""
    max_peer_msgs_per_s: int = 50_000
    """Messages one peer (ROUTER identity) may send per second, a BUNDLE's parts each counting,
    with bursts of half a second of it (``brokers.peer_rate``); more are dropped unread, counted
    in STATUS ``peer_rate``. A real worker never comes near it: the broker routes 21,000-33,000
    requests/s per core for all peers together (docs/scaling.md), so no simulator gets more
    served, a generator sends one RESULT per batch and a trainer one TRAJ_ACK per batch taken;
    a flooding peer is held to well under a core of the broker's loop."""


@dataclass
class BatchingConfig:
    max_batch: int = 32
    """A batch is dispatched once this many envs are queued..."""
    max_wait_ms: float = 5.0
    """...or once the oldest queued request has waited this long."""
    ordering: str = "arrival"
    """Request order: ``arrival``, ``episode_progress``, ``policy_version`` or ``module:function``."""
    credits: int = 2
    """Batches in flight per generator."""
    assignment: str = "dynamic"
    """``dynamic`` (any generator serves any slot) or ``sticky`` (a slot stays with one)."""
    batch_timeout_s: float = 120.0
    """A batch out at a generator this long without a RESULT goes back into the queue (the
    generator keeps that credit until it answers or leaves)."""
    adaptive: bool = False
    """Tune ``max_batch`` and ``max_wait_ms`` online (``brokers/adaptive.py``), starting from the
    values above and staying within the ``adaptive_*`` bounds; STATUS reports the current ones."""
    adaptive_min_batch: int = 1
    """Adaptive: the smallest ``max_batch`` it may set."""
    adaptive_max_batch: int = 256
    """Adaptive: the largest ``max_batch`` it may set."""
    adaptive_min_wait_ms: float = 0.0
    """Adaptive: the shortest ``max_wait_ms`` it may set."""
    adaptive_max_wait_ms: float = 50.0
    """Adaptive: the longest ``max_wait_ms`` it may set."""
    adaptive_window_s: float = 2.0
    """Adaptive: seconds of served throughput measured per trial point (longer: less noise, slower)."""


@dataclass
class EnvConfig:
    name: str = "synthetic"
    """Registered env adapter (``synthetic``, ``metaworld``, ``libero``, ``maniskill``, ``robocasa``)."""
    num_envs: int = 8
    """Envs per simulator worker."""
    slots: int = 4
    """Slots per simulator worker; each slot steps ``num_envs / slots`` envs on its own."""
    parallel: str = "thread"
    """Where slots step: ``thread`` (in the worker) or ``process`` (a child process per slot)."""
    step_timeout_s: float = 60.0
    """A slot step that takes longer is treated as a hung env and restarted (process mode)."""
    obs_resend_s: float = 30.0
    """A slot whose ACT has not come this long after its OBS sends that OBS again (the broker may
    have refused or lost it, or its ACT was lost); the broker serves each request once and
    answers a copy of an answered one with the same ACT. 0: never re-send."""
    fragment_len: int = 32
    """Decision steps per shipped trajectory fragment of a long episode."""
    group_size: int = 1
    """Episodes sharing one initial state: the simulators start them from one seed, and with
    ``algo.name: grpo`` the trainer scores each such group against itself (>= 2)."""
    group_mode: str = "parallel"
    """``parallel``: a group is ``group_size`` neighbouring envs of a worker starting their n-th
    episodes from one state (groups complete together); ``sequential``: ``group_size``
    consecutive episodes of one env."""
    eval_slots: int = 0
    """Slots per simulator worker reserved for evaluation (the last ones); they never feed training."""
    eval_every: int = 0
    """Run an evaluation round every this many policy versions (0: never)."""
    eval_episodes: int = 0
    """Held-out initial states per evaluation round per worker (0: one per eval env)."""
    options: dict = field(default_factory=dict)
    """The adapter's own options, validated by the adapter."""
    plugins: list = field(default_factory=list)
    """Python modules to import before the env is looked up, in every process that builds it or
    reads its spec: adapters registered with ``@register_env`` outside ``workers.envs``."""


@dataclass
class ModelConfig:
    family: str = "mlp"
    """Registered policy family (``mlp``, ``openvla_oft``, ``pi0``, ``pi05``, ``gr00t_n15``)."""
    chunk_size: int = 1
    """Actions per decision (action chunk length); the family's builder gets it, not ``options``."""
    dtype: str = "auto"
    """``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32`` or ``bfloat16``."""
    checkpoint: str = ""
    """Local directory of a released checkpoint (LeRobot pi0/pi0.5, transformers pi0, GR00T N1.5 or
    OpenVLA-OFT folder; see docs/checkpoints.md), or a run folder to warm-start from."""
    tokenizer: str = ""
    """Tokenizer folder for a release that ships none (GR00T N1.5: Eagle 2.5's); empty: its own."""
    base: str = ""
    """Local release folder that an OpenVLA-OFT ``checkpoint`` of peft LoRA adapters without weights
    was trained on (its ``adapter_config.json`` names a hub id); empty: none, or the recorded base
    when that folder exists here."""
    options: dict = field(default_factory=dict)
    """The family's own options (validated by the family's config dataclass)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (``rlvla3.scale_config.LoraConfig``); off by default."""


@dataclass
class AlgoConfig:
    """Every algorithm setting, read directly by the update (``workers.algorithms``): one
    default each, no second layer of PPO/GRPO configs."""

    name: str = "ppo"
    """``ppo`` or ``grpo`` (groups of ``env.group_size`` episodes from one start, no critic)."""
    lr: float = 3e-4
    """Adam learning rate."""
    batch_steps: int = 512
    """Decision steps (env x chunk) per update."""
    epochs: int = 4
    """Passes over each batch."""
    minibatch_size: int = 128
    """Most decision steps per gradient step: an epoch of n samples is ceil(n / this) minibatches
    of near-equal size."""
    gamma: float = 0.99
    """PPO: discount per decision step (GAE)."""
    lam: float = 0.95
    """PPO: GAE lambda, the bias/variance trade-off of the advantage estimate."""
    clip_eps: float = 0.2
    """Half-width of the trust region on the proximal -> current ratio: r in [1-eps, 1+eps]."""
    dual_clip: float = 3.0
    """Dual-clip bound c > 1: for A < 0 the objective is bounded below by c*A (0 disables)."""
    ratio_level: str = "unit"
    """``unit``: one clipped ratio per token/action with the advantage broadcast; ``chunk``: sum
    the log-probs of a decision first and clip one ratio per decision."""
    value_clip_eps: float = 0.2
    """PPO: new values may move at most this far from the behaviour values before the clipped
    loss wins (0 disables: plain MSE)."""
    vf_coef: float = 0.5
    """PPO: value loss weight (GRPO has no value term)."""
    target_kl: float = 0.0
    """Stop an update's epochs after the first whose mean approx KL from the behaviour policy (the
    actor's) exceeds this; 0: every epoch. In sync that is CleanRL's ``target_kl`` read per epoch;
    in async it also counts how far the policy had moved before the update began."""
    ent_coef: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    max_grad_norm: float = 1.0
    """Global L2 norm the gradients are clipped to before every optimizer step."""
    trust_region: str = "proximal"
    """PPO: the clip's centre, ``proximal`` (the update's start, decoupled PPO with a capped weight)
    or ``behaviour`` (the actor, Sample Factory's APPO). The same in sync."""
    behav_weight_cap: float = 2.0
    """Cap (>= 1) on the detached behaviour -> proximal importance weight of decoupled PPO
    (0: uncapped)."""
    adv_norm: str = "batch"
    """PPO: how advantages are standardised before the update. ``batch``: mean and std over the
    batch as it was acted (CleanRL). ``proximal``: each sample weighted by its behaviour ->
    proximal likelihood ratio (capped as above), so the mean is the one under the policy the
    update starts from. The same in sync; with stale samples ``batch`` leaves a positive mean
    advantage under that policy, which ten epochs on one batch spend narrowing the Gaussian."""
    max_staleness: int = 4
    """Samples from policies more than this many versions old are dropped."""
    admission_lag: int | None = None
    """Async: batches of rollout work admitted ahead of the trainer (None: ``max_staleness``). Fast
    simulators fill it, so their samples train this many versions stale; 1 overlaps one rollout
    with one update. Long-tailed simulators want ``max_staleness``, so stragglers hold no one back."""
    publish_every: int = 1
    """Publish a weight version every this many updates."""
    grpo_reward: str = "success"
    """GRPO: the episode score compared within a group, ``success`` (0/1, as SimpleVLA-RL) or
    ``return`` (the summed env reward)."""
    grpo_std_scale: bool = True
    """GRPO: divide each group's centred scores by the group's std (DeepSeekMath); false only
    centres them (Dr. GRPO). With ``grpo_reward: return`` a group whose episodes all succeed
    differs by noise, which the std would blow up to the same weight as success against failure."""
    reward_scale: float = 1.0
    """PPO: rewards are multiplied by this before GAE (Meta-World's dense rewards sum to ~1e3 per
    episode; with an absolute value clip the critic cannot follow returns that large)."""
    reward_norm: bool = False
    """PPO: divide each reward by a running std of its env's discounted return (Gymnasium's NormalizeReward)."""
    reward_clip: float = 0.0
    """PPO: clip the (scaled) rewards to +-this before GAE (0: no clip)."""
    anneal_lr: bool = False
    """Lower the learning rate linearly from ``lr`` to 0 over ``run.total_env_steps`` consumed."""
    value_lr: float = 0.0
    """PPO: the critic's learning rate (top modules whose name holds ``value``; 0: ``lr``)."""
    frozen: list = field(default_factory=list)
    """Parameter-name prefixes RL never steps (``[vlm]``: RLinf's ``train_expert_only``)."""
    critic_warmup_updates: int = 0
    """PPO: the first this many updates train the value head only (advantages zeroed), so a
    warm-started policy is not pushed around by a critic that has not learnt anything yet."""
    checkpoint_every: int = 50
    """Rank 0 writes a checkpoint every this many versions (0: only at shutdown)."""
    keep_checkpoints: int = 3
    """Checkpoints kept in the run folder (older ones are pruned; 0 keeps all)."""
    check_replicas: bool = False
    """Several trainer ranks: assert after every update that all ranks hold identical weights
    (an all-reduce of a parameter checksum; for debugging and tests)."""


@dataclass
class WorkersConfig:
    simulators: int = 2
    """Simulator workers ``rlvla3 run`` starts."""
    generators: int = 1
    """Generator workers ``rlvla3 run`` starts (one per device with --gpus)."""
    trainers: int = 1
    """Trainer workers (one torch.distributed group)."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` for every model-holding worker (the one device setting: a family's
    ``model.options`` take none); ``--gpus`` overrides per worker."""
    torch_threads: int = 1
    """torch intra-op threads per worker process."""
    broker_wait_s: float = 900.0
    """How long a worker started before its broker keeps asking (back-off 1 s doubling to 32 s)
    before it exits with an error: a scheduler may start the broker minutes after the workers.
    Read from the worker's own ``--set workers.broker_wait_s=60`` (no job config before a broker)."""


@dataclass
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------------


def from_dict(data: dict[str, Any] | None) -> JobConfig:
    check_renamed(data or {})
    cfg = _build(JobConfig, data or {}, "")
    validate(cfg)
    return cfg


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"unknown config key {where}{unknown[0]}; known in {path or 'top level'}: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            kwargs[name] = _build(typ, value if value is not None else {}, key)
        else:
            kwargs[name] = _coerce(typ, value, key)
    return cls(**kwargs)


def _coerce(typ: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} is not {typ}")
    if typ is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and SCIENTIFIC.fullmatch(value.strip()):  # YAML 1.1 reads 1e-4 as a string
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        if value is None:
            return ""
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def validate(cfg: JobConfig) -> None:
    """Cross-field rules (``rlvla3/config_rules.py``), each error naming its key."""
    validate_job(cfg)


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` (value parsed as YAML) and ``~a.b.c`` (Hydra's: drop a key, default applies)."""
    for item in overrides:
        remove = item.startswith("~")
        key, sep, raw = item.removeprefix("~").partition("=")
        if remove == bool(sep):
            raise ConfigError(f"override {item!r}: expected key=value or ~key (~key takes no value)")
        *path, last = key.strip().split(".")
        node = data
        for p in path:  # a removal walks without making sections
            node = node.get(p, {}) if remove else node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {p} is not a section" + (", so not set" if remove else ""))
        if remove:
            if last not in node:
                raise ConfigError(f"override ~{key}: not set, nothing to remove")
            del node[last]
            continue
        try:
            node[last] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {key}: cannot parse {raw!r}: {exc}") from None
    return data


DEFAULT_CONFIG = "metaworld_default.yaml"


def read_yaml(path: str | Path | None) -> dict[str, Any]:
    """Read a config file; ``None`` reads the embedded default config."""
    if path is None:
        text = resources.files("rlvla3").joinpath("configs", DEFAULT_CONFIG).read_text()
    else:
        p = Path(path)
        if not p.exists():
            packaged = resources.files("rlvla3").joinpath("configs", str(path))
            if packaged.is_file():
                text = packaged.read_text()
            else:
                raise ConfigError(f"config file {path} not found")
        else:
            text = p.read_text()
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Load, override, validate."""
    return from_dict(apply_overrides(read_yaml(path), overrides))
