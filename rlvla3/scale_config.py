"""Config sections for models at real size: LoRA, trainer precision/memory/sharding, placement,
and how weights travel to the generators.

Kept apart from ``rlvla3.config`` (which holds the job's other sections and the loader) so each
module stays small; ``rlvla3.config`` imports these into :class:`~rlvla3.config.JobConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEMENTS = ("disaggregated", "colocated", "hybrid")
OFFLOAD = ("auto", "always", "never")
CHECKPOINT_FORMATS = ("full", "sharded")


class ConfigError(ValueError):
    """A config that cannot run: the message names the key (``rlvla3.config`` raises it too)."""


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy's linear layers (OpenVLA-OFT is trained this way at 7.5B).

    Every process builds them (they are part of the served model); the base weights are frozen,
    so only the adapters and the ``train_also`` modules train and are published after version 0."""

    enabled: bool = False
    """Add adapters and freeze everything else (but ``train_also``)."""
    rank: int = 32
    """Adapter rank r (OpenVLA-OFT's fine-tuning recipe uses 32)."""
    alpha: float = 16.0
    """Scale: the adapter's output is multiplied by ``alpha / rank``."""
    targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                         "gate_proj", "up_proj", "down_proj"])
    """Linear layers that get an adapter, by the last part of their module name."""
    train_also: list[str] = field(default_factory=lambda: ["value_head", "proprio_proj"])
    """Top-level parts trained in full next to the adapters (the fresh RL heads; small)."""


@dataclass
class TrainConfig:
    """How trainer processes hold and step the model (the update's maths is ``algo``'s)."""

    gradient_checkpointing: bool = False
    """Recompute the transformer layers' activations in backward (transformers' non-reentrant
    checkpointing on every transformers tower of the policy): less memory, ~30% more compute."""
    fsdp: bool = False
    """Shard the trainer group's parameters, gradients and optimizer state with FSDP2
    (``torch.distributed.fsdp.fully_shard``, ``workers.algorithms.distributed.wrap_fsdp``) instead
    of replicating them with DDP (``workers.trainers`` >= 2). Every rank takes part when rank 0
    publishes (the trainable parameters are gathered one tensor at a time) and checkpoints."""
    checkpoint_format: str = "full"
    """``full``: rank 0 writes ``model.safetensors`` + ``optimizer.pt`` (gathered under FSDP);
    ``sharded``: every rank writes its shard with torch.distributed.checkpoint (DCP), which
    resumes on any number of ranks, with or without FSDP. Several hosts need the run folder on
    a filesystem they share."""
    collective_timeout_s: float = 300.0
    """How long a trainer rank waits in one collective (an all-reduce of the update, the gathers
    and barriers of a checkpoint) for the other ranks before it gives up: a rank lost during a
    collective checkpoint makes the others stop, with a ``checkpoint_group_lost`` error line,
    within it (``workers.trainer_checkpoints``). The slowest honest wait is the other ranks at
    the barrier while rank 0 writes a gathered ``full`` checkpoint (a 7B model's weights and
    optimizer, ~45 GB, at 200 MB/s onto a network filesystem: ~4 min), so 5 min. Joining the
    group waits as long as the ranks take to start (``workers.broker_wait_s``)."""
    min_update_s: float = 0.0
    """For benchmarks: every update lasts at least this long (the rest after the optimizer
    steps is slept, before the version is published), so a small model stands in for a large
    model's update time on a CPU machine, as ``model.options.forward_delay_ms`` does for the
    forward pass (``bench/ablation.py --train-cost``). 0: off."""


@dataclass
class PlacementConfig:
    """Which devices each role uses (``rlvla3 run --gpus``) and how colocated roles share them."""

    mode: str = "disaggregated"
    """``disaggregated``: generators and trainers on separate devices; ``colocated``: they share
    every device; ``hybrid``: some devices are shared, the rest serve or train only."""
    generator_gpus: str = ""
    """Devices of the generators (``0-3``, ``0,2``): one generator per device. Empty: no mapping
    (``workers.device`` for all, as on CPU). ``rlvla3 run --gpus generator=0-3`` sets it."""
    trainer_gpus: str = ""
    """Devices of the trainers, one rank per device (``rlvla3 run --gpus trainer=4-7``)."""
    offload: str = "auto"
    """Colocated only: ``always`` moves trainer state (optimizer, gradients, parameters) off the
    device while generators work and back for the update; ``never`` keeps it; ``auto`` offloads
    when the device's free memory is short."""


def parse_gpus(spec: str | None) -> list[int]:
    """``"0-3"`` -> [0, 1, 2, 3]; ``"0,2"`` -> [0, 2]; ``"1"`` -> [1]; None/"" -> []."""
    if not spec:
        return []
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"--gpus: bad range {part!r}")
            out.extend(range(int(lo), int(hi) + 1))
        elif part.isdigit():
            out.append(int(part))
        else:
            raise ValueError(f"--gpus: {part!r} is not a device index or range")
    if len(set(out)) != len(out):
        raise ValueError(f"--gpus: {spec!r} names a device twice")
    return out


def gpu_overrides(gpus: tuple[str, ...]) -> tuple[str, ...]:
    """``rlvla3 run --gpus ROLE=DEVICES`` -> the config overrides that set the mapping."""
    bad = [g for g in gpus if "=" not in g or g.partition("=")[0] not in ("generator", "trainer")]
    if bad:
        raise ConfigError(f"--gpus {bad[0]!r}: expected generator=DEVICES or trainer=DEVICES")
    return tuple(f"placement.{g.partition('=')[0]}_gpus='{g.partition('=')[2]}'" for g in gpus)


def validate_placement(p: PlacementConfig, generators: int, trainers: int) -> dict[str, list[int]]:
    """The device mapping ``{"generator": [...], "trainer": [...]}`` of a placement, or an error
    that says what is wrong with it. No mapping at all (CPU) is valid for every mode."""
    if p.mode not in PLACEMENTS:
        raise ConfigError(f"placement.mode: {p.mode!r} not in {PLACEMENTS}")
    if p.offload not in OFFLOAD:
        raise ConfigError(f"placement.offload: {p.offload!r} not in {OFFLOAD}")
    try:
        gen, tr = parse_gpus(p.generator_gpus), parse_gpus(p.trainer_gpus)
    except ValueError as exc:
        raise ConfigError(f"placement: {exc}") from None
    if p.offload != "auto" and p.mode == "disaggregated":
        raise ConfigError(f"placement.offload: {p.offload} needs a shared device (colocated or hybrid); "
                               "disaggregated trainers never give theirs up")
    if not gen and not tr:
        return {"generator": [], "trainer": []}
    if not gen or not tr:
        raise ConfigError("placement: map both roles (--gpus generator=... --gpus trainer=...) or neither")
    for role, devs, count in (("generator", gen, generators), ("trainer", tr, trainers)):
        if len(devs) != count:
            raise ConfigError(f"placement.{role}_gpus names {len(devs)} devices but workers.{role}s is {count} "
                                   "(one worker per device)")
    shared = set(gen) & set(tr)
    if p.mode == "disaggregated" and shared:
        raise ConfigError(f"placement: disaggregated, but devices {sorted(shared)} serve and train; "
                               "use colocated or hybrid, or give each role its own devices")
    if p.mode == "colocated" and set(gen) != set(tr):
        raise ConfigError(f"placement: colocated shares every device, but generators use {gen} and trainers {tr}")
    if p.mode == "hybrid" and (not shared or set(gen) == set(tr)):
        raise ConfigError(f"placement: hybrid shares some devices and not others; generators {gen}, trainers {tr} "
                               f"({'share none: disaggregated' if not shared else 'share all: colocated'})")
    return {"generator": gen, "trainer": tr}


def validate_scale(lora: LoraConfig, train: TrainConfig, placement: PlacementConfig, generators: int = 1,
                   trainers: int = 1) -> None:
    if lora.rank < 1 or lora.alpha <= 0 or not lora.targets:
        raise ConfigError("model.lora: rank must be >= 1, alpha > 0 and targets non-empty")
    if not 0.0 <= train.min_update_s <= 3600.0:
        raise ConfigError(f"train.min_update_s: {train.min_update_s} is not in [0, 3600] seconds")
    if not train.collective_timeout_s > 0:
        raise ConfigError(f"train.collective_timeout_s: {train.collective_timeout_s} must be > 0 seconds")
    if train.checkpoint_format not in CHECKPOINT_FORMATS:
        raise ConfigError(f"train.checkpoint_format: {train.checkpoint_format!r} not in {CHECKPOINT_FORMATS}")
    if train.fsdp and trainers < 2:
        raise ConfigError("train.fsdp: shards over the trainer group, which needs workers.trainers >= 2")
    if train.fsdp and placement.offload == "always":
        raise ConfigError("train.fsdp with placement.offload: always: moving sharded (DTensor) trainer state "
                          "off the device is not supported; use offload: never or auto")
    validate_placement(placement, generators, trainers)


@dataclass
class WeightsConfig:
    shm: bool = True
    """Generators on trainer rank 0's host read each version from its shared-memory weight
    store; off: every generator fetches from the stream."""
    stream_bind: str = "tcp://127.0.0.1:0"
    """Where trainer rank 0 serves versions to generators on other hosts (``tcp://0.0.0.0:0``
    across hosts); empty: no stream (then ``shm`` must be on)."""
    advertise_host: str = ""
    """Host name announced for a wildcard ``stream_bind`` (empty: this machine's host name)."""
    bucket_mb: int = 128
    """Bytes (MiB) per bucket on the stream: one FETCH, one reply frame (1-256)."""
    copy_threads: int = 2
    """Threads that copy and hash weights into the store (trainer) and out of it (generator)."""
    cuda_ipc: bool = False
    """CUDA only: trainer rank 0 also keeps its trainable slot on its GPU and announces a CUDA IPC
    handle; generators on the same GPU copy device to device from it (``rlvla3.weights.cuda_ipc``;
    one H200 job ran with it, and its byte test passed on an H200). No effect on CPU."""
    delta: str = "none"
    """``bf16``: after the first version, each trainable tensor is also published as a bf16
    delta against the previous version; generators on other hosts holding that version read
    the deltas over the stream (half the bytes of fp32 parameters, the same for bf16 ones) and
    rebuild, others read whole (``none``: always whole). Not with ``cuda_ipc``."""
    in_flight: bool = False
    """Async: trainer rank 0 also publishes the weights after every epoch of an update but the
    last (PipelineRL's in-flight weight updates), so simulators act on weights at most one epoch
    behind the trainer instead of a whole update. Those weights act as the version the update
    started from (``policy_version``; staleness counts whole versions), under publication
    numbers of their own (``rlvla3.weights.announce.publications_per_version``). Sync mode
    pauses the simulators during an update, so there it publishes nothing extra."""
    collect_after_epochs: int = 0
    """Async with ``in_flight``: while an update runs, rollouts wait until it has published its
    weights after this many of its epochs (0: they never wait). Simulators that outrun the
    trainer otherwise collect the next batch at the update's start, with the weights it started
    from, so each sample trains a whole version stale; started late, they act with weights this
    far into the update. Set it so the rest of the update is time enough to collect a batch, or
    the trainer waits for it (a critic warm-up or a ``target_kl`` stop publishes nothing between
    epochs: the rollouts then wait for the update's end). One trainer rank: the broker hears of
    a multi-rank update only after it. Ignored outside async, as ``in_flight`` is: the
    alternating modes hold rollouts for the whole update."""
