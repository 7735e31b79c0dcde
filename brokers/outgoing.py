"""What the broker's state asks its shell to send, and the shm-to-inline bridge for remote readers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlvla3 import protocol as P
from rlvla3.shm import ShmAttachments, to_inline

E_INTERNAL = "internal"  # ERROR code: the broker failed on a message (a bug, logged with its traceback)


@dataclass(slots=True)
class Out:
    """One message to send. ``to`` is a ROUTER identity, or ``None`` to publish on the weights
    PUB socket. ``frames`` holds an already encoded message (the weight snapshot, sent as is)."""

    to: bytes | None
    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] | None = None
    frames: list[Any] | None = None

    def encode(self) -> list[Any]:
        return self.frames if self.frames is not None else P.encode(self.type, self.fields, self.tensors)


def error(to: bytes, code: str, reason: str, ref_type: str | None) -> Out:
    """An ERROR answering a bad message."""
    return Out(to, P.ERROR, {"code": code, "reason": reason[:1000], "ref_type": ref_type})


class ShmBridge:
    """Passes a shared-memory reference on to a reader on the writer's host; for a reader on
    another host it reads the bytes here (the broker shares the writer's host) and inlines them."""

    def __init__(self, host: str, attach: ShmAttachments | None = None) -> None:
        self.host = host
        self.attach = attach or ShmAttachments()

    def for_host(self, t: Any, reader_host: str) -> Any:
        if isinstance(t, P.ShmRef) and t.host != reader_host:
            if t.host != self.host:
                raise P.ProtocolError(P.E_TENSOR, f"segment {t.seg} is on {t.host}, unreachable from here")
            return to_inline(self.attach, t)
        return t

    def close(self) -> None:
        self.attach.close()
