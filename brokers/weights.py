"""The latest weights: kept encoded once, published to every generator on arrival and sent
again to any generator that asks (SNAPSHOT) after joining late or missing a publication."""

from __future__ import annotations

from typing import Any

import structlog

from brokers.outgoing import Out
from rlvla3 import protocol as P

log = structlog.get_logger()


class WeightsSnapshot:
    def __init__(self) -> None:
        self.version = -1
        self.frames: list[Any] | None = None

    def on_weights(self, msg: P.Message) -> list[Out]:
        """A trainer published ``version``: keep it and publish it, unless it is not newer."""
        version = msg["version"]
        if version <= self.version:
            log.info("weights_ignored_old", version=version, current=self.version)
            return []
        self.frames = P.encode(P.WEIGHTS, {"version": version, "published_at": msg.get("published_at")}, dict(msg.tensors))
        self.version = version
        log.info("weights_published", version=version, tensors=len(msg.tensors))
        return [Out(None, P.WEIGHTS, {"version": version}, frames=self.frames)]

    def on_snapshot(self, to: bytes) -> list[Out]:
        if self.frames is None:
            return [Out(to, P.WEIGHTS, {"version": -1})]
        return [Out(to, P.WEIGHTS, {"version": self.version}, frames=self.frames)]
