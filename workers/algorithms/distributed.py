"""Several trainer processes as one torch.distributed group with DDP.

The broker hands every trainer its ``rank``, the ``world_size`` and a rendezvous address; the
trainers call :func:`init_trainer_group`, wrap their policy with :func:`wrap_ddp`, and from
then on every optimizer step all-reduces gradients, so the replicas stay identical. gloo is
used on CPU, NCCL on CUDA.

DDP only synchronizes gradients of computations that went through its ``forward``. A policy's
trainer-side call is ``evaluate``, not ``forward``, so :class:`EvaluateForward` turns
``evaluate`` into a ``forward`` and :class:`DDPPolicy` exposes it again as ``evaluate`` - the
PPO/GRPO code calls ``policy.evaluate`` either way.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.policies.base import EvalOutput


def rendezvous_host(broker_url: str) -> str:
    """The local address other trainers can reach us at: the one that routes to the broker."""
    host = urlparse(broker_url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "*", "0.0.0.0"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks a route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rendezvous_address(broker_url: str) -> dict[str, Any]:
    """What a trainer announces in READY (rank 0's is handed to the others): a reachable
    address and a free port for ``init_trainer_group``."""
    host = rendezvous_host(broker_url)
    return {"addr": host, "port": _free_port(host)}


def default_backend(device: torch.device | str | None = None) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    return "nccl" if device.type == "cuda" else "gloo"


def init_trainer_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    device: torch.device | str | None = None,
    backend: str | None = None,
    timeout_s: float = 300.0,
    rendezvous_s: float = 900.0,
) -> str:
    """Join the trainers' process group over ``tcp://master_addr:master_port``; returns the backend.

    Everything is passed explicitly (no MASTER_ADDR / RANK environment variables) because the
    broker, not a launcher, decides who the trainers are. Joining waits up to ``rendezvous_s``
    for every rank (ranks started by hand may come minutes apart); each collective after that
    waits at most ``timeout_s`` (``train.collective_timeout_s``) for the others, then raises.
    """
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialized in this process")
    backend = backend or default_backend(device)
    if backend == "nccl":
        if device is None:
            raise ValueError("NCCL needs the rank's CUDA device (the broker assigns it, e.g. cuda:2)")
        torch.cuda.set_device(torch.device(device))
    # A store of our own, so that the wait for the ranks to start is not the collectives' timeout.
    store = dist.TCPStore(master_addr, int(master_port), int(world_size), is_master=int(rank) == 0,
                          timeout=timedelta(seconds=rendezvous_s))
    dist.init_process_group(backend=backend, store=store, rank=int(rank), world_size=int(world_size),
                            timeout=timedelta(seconds=timeout_s))
    return backend


def destroy_trainer_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# DDP around `evaluate`
# ---------------------------------------------------------------------------------------------


class EvaluateForward(nn.Module):
    """``forward(obs, actions, replay)`` = ``policy.evaluate`` as a tuple DDP can trace."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.module = policy

    def forward(
        self, obs: Any, actions: torch.Tensor, replay: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.module.evaluate(obs, actions, replay)
        return out.logprob, out.entropy, out.value


class DDPPolicy(DistributedDataParallel):
    """DDP whose ``evaluate`` goes through DDP's forward (so gradients are all-reduced)."""

    @property
    def policy(self) -> nn.Module:
        return self.module.module

    def evaluate(self, obs: Any, actions: torch.Tensor, replay: dict[str, torch.Tensor]) -> EvalOutput:
        logprob, entropy, value = self(obs, actions, replay)
        return EvalOutput(logprob=logprob, entropy=entropy, value=value)

    def act(self, obs: Any, deterministic: bool = False) -> Any:
        return self.policy.act(obs, deterministic)


def wrap_ddp(policy: nn.Module, find_unused_parameters: bool = True) -> DDPPolicy:
    """Wrap ``policy`` (already on its device) for data-parallel training.

    DDP broadcasts rank 0's parameters and buffers at construction, so replicas start equal.
    ``find_unused_parameters`` defaults to True because GRPO leaves a value head out of the
    loss; turn it off for speed when every parameter gets a gradient every step.
    """
    return DDPPolicy(EvaluateForward(policy), device_ids=None, find_unused_parameters=find_unused_parameters)


# ---------------------------------------------------------------------------------------------
# FSDP2 (train.fsdp): parameters, gradients and optimizer state sharded across the ranks
# ---------------------------------------------------------------------------------------------


class FSDPPolicy(EvaluateForward):
    """The sharded policy: ``evaluate`` goes through ``forward`` so FSDP's hooks gather the
    root's parameters (each transformer layer gathers its own when it runs)."""

    @property
    def policy(self) -> nn.Module:
        return self.module

    def evaluate(self, obs: Any, actions: torch.Tensor, replay: dict[str, torch.Tensor]) -> EvalOutput:
        logprob, entropy, value = self(obs, actions, replay)
        return EvalOutput(logprob=logprob, entropy=entropy, value=value)


def wrap_fsdp(policy: nn.Module) -> FSDPPolicy:
    """Shard ``policy`` over the trainer group with FSDP2's ``fully_shard``: one unit per
    transformer layer (transformers' ``GradientCheckpointingLayer``: decoder/encoder blocks),
    the rest (embeddings, heads, projectors) in the root unit. Every rank must call it with the
    same weights (the trainer broadcasts rank 0's first). Build the optimizer after: the
    parameters become sharded DTensors."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4 / 2.5: FSDP2 before it became public
        from torch.distributed._composable.fsdp import fully_shard
    from transformers.modeling_layers import GradientCheckpointingLayer

    for m in policy.modules():
        if isinstance(m, GradientCheckpointingLayer):
            fully_shard(m)
    return fully_shard(FSDPPolicy(policy))


def is_sharded(model: nn.Module) -> bool:
    """True for the FSDP-wrapped policy (its parameters are DTensor shards)."""
    return isinstance(model, FSDPPolicy)


@torch.no_grad()
def gather_tensors(policy: nn.Module, keep: bool, everything: bool) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, whole tensor, trainable) of an FSDP-sharded ``policy``, as the weight publisher
    reads a module: the trainable parameters, or with ``everything`` every parameter and buffer
    (the first publication). Shards are gathered one tensor at a time; a collective, so every
    rank calls it in the same order, and ranks that do not publish pass ``keep=False`` and drop
    each tensor once gathered. Rank 0 holds the gathered tensors until the store has them."""
    out = []
    for name, p in policy.named_parameters():
        if not (p.requires_grad or everything):
            continue
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if keep:
            out.append((name, full, p.requires_grad))
    if everything and keep:
        out.extend((name, b, False) for name, b in policy.named_buffers())
    return out


# ---------------------------------------------------------------------------------------------
# Keeping replicas identical
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with rank ``src``'s (e.g. after a resume)."""
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=src)


@torch.no_grad()
def parameter_checksum(model: nn.Module) -> torch.Tensor:
    """A float64 scalar that changes when any parameter value changes or two values swap places.
    FSDP shards are gathered first (a collective): the checksum is the whole model's."""
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i, p in enumerate(model.parameters()):
        flat = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().to(torch.float64)
        # Position weights make the sum order-sensitive; the index separates equal tensors.
        weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=device)
        total += (i + 1) * (flat * weights).sum()
    return total


@torch.no_grad()
def assert_replicas_identical(model: nn.Module) -> float:
    """Raise on every rank unless all ranks hold bit-identical parameters; returns the checksum.

    All-reduces the checksum with MAX and MIN: equal iff every rank computed the same value
    (same values in the same places; the checksum is deterministic for identical weights).
    """
    local = parameter_checksum(model)
    hi, lo = local.clone(), local.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    if float(hi) != float(lo):
        raise AssertionError(
            f"rank {dist.get_rank()}: replicas differ (checksum {float(local)!r}, range [{float(lo)!r}, {float(hi)!r}])"
        )
    return float(local)


# ---------------------------------------------------------------------------------------------
# Agreeing when to update
# ---------------------------------------------------------------------------------------------


@dataclass
class Agreement:
    """The outcome of one round: ``update`` (all ranks train now, padded to ``pad_to``),
    ``wait`` (the ranks together hold less than a batch, or one holds nothing) or ``stop``."""

    decision: str
    taken: list[int]

    @property
    def pad_to(self) -> int:
        return max(self.taken)


def agree_to_update(taken: int, available: int, stopping: bool, batch_steps: int) -> Agreement:
    """One collective round, on every rank: all-gather (steps taken, steps available, stopping).
    Ranks update together once they hold ``batch_steps`` between them and each has a share."""
    local = torch.tensor([taken, available, int(stopping)], dtype=torch.int64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    shares = [int(g[0]) for g in gathered]
    if any(int(g[2]) for g in gathered):
        return Agreement("stop", shares)
    if sum(int(g[1]) for g in gathered) < batch_steps or min(shares) == 0:
        return Agreement("wait", shares)
    return Agreement("update", shares)


def mean_over_ranks(x: float, device: torch.device) -> float:
    """``x`` averaged over the trainer ranks (itself with one process), so a decision every rank
    takes from it is the same on all: ``algo.target_kl``'s stop, where a rank that stopped alone
    would leave the others' next all-reduce waiting."""
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()
