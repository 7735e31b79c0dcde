"""Config sections for models at real size: LoRA, trainer precision/memory/sharding, placement.

Kept apart from ``rlvla3.config`` (which holds the job's other sections and the loader) so each
module stays small; ``rlvla3.config`` imports these into :class:`~rlvla3.config.JobConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEMENTS = ("disaggregated", "colocated", "hybrid")
OFFLOAD = ("auto", "always", "never")


class ScaleConfigError(ValueError):
    """A LoRA / train / placement setting that cannot work (raised as the loader's ConfigError)."""


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
    train_also: list[str] = field(default_factory=lambda: ["value_head", "action_queries", "proprio_proj"])
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
    of replicating them with DDP. Refused for now: publishing and checkpoints read rank 0's
    parameters whole, and under FSDP they must be gathered on every rank first."""


@dataclass
class PlacementConfig:
    """Which devices each role uses (``rlvla3 run --gpus``) and how colocated roles share them."""

    mode: str = "disaggregated"
    """``disaggregated``: generators and trainers on separate devices; ``colocated``: they share
    every device; ``hybrid``: some devices are shared, the rest serve or train only."""
    offload: str = "auto"
    """Colocated only: ``always`` moves trainer state (optimizer, gradients, parameters) off the
    device while generators work and back for the update; ``never`` keeps it; ``auto`` offloads
    when the device's free memory is short."""


def validate_scale(lora: LoraConfig, train: TrainConfig, placement: PlacementConfig) -> None:
    if lora.rank < 1 or lora.alpha <= 0 or not lora.targets:
        raise ScaleConfigError("model.lora: rank must be >= 1, alpha > 0 and targets non-empty")
    if train.fsdp:
        raise ScaleConfigError("train.fsdp: the sharded update works (wrap_fsdp), but the trainer's weight "
                               "publication and checkpoints do not gather FSDP shards yet; use DDP (false)")
    if placement.mode not in PLACEMENTS:
        raise ScaleConfigError(f"placement.mode: {placement.mode!r} not in {PLACEMENTS}")
    if placement.offload not in OFFLOAD:
        raise ScaleConfigError(f"placement.offload: {placement.offload!r} not in {OFFLOAD}")
