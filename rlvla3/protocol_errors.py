"""What a peer answers a bad message with: the ERROR codes and the exception that carries one.

Both the message codec (``rlvla3.protocol``) and the tensor codec (``rlvla3.tensors``) raise
:class:`ProtocolError`; the receiver answers it with ERROR and drops the message.
"""

from __future__ import annotations

# Error codes carried by ERROR messages.
E_MALFORMED = "malformed"
E_VERSION = "version"
E_TYPE = "unknown_type"
E_OVERSIZE = "oversize"
E_FIELD = "bad_field"
E_TENSOR = "bad_tensor"
E_STATE = "out_of_order"
E_ROLE = "wrong_role"
E_AUTH = "unauthorized"  # a key, segment or identity this peer may not use
E_LIMIT = "over_limit"  # a per-peer cap (broker.max_peer_*) or a request no batch can hold


class ProtocolError(ValueError):
    """A message that must be answered with ERROR and dropped."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
