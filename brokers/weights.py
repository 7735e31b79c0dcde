"""The latest weight announcement: published to every generator on arrival and sent again to
any generator that asks (SNAPSHOT) after joining late or missing a publication.

The broker handles versions, not bytes: the rule (:class:`rlvla3.weights.announce.LatestWeights`)
keeps the newest announcement (version, manifest, where the bytes are), accepts only increasing
versions and refuses a WEIGHTS that carries tensors (ERROR). Its memory does not grow with the
model: a manifest is a few tens of KB whatever the model's size.
"""

from __future__ import annotations

from typing import Any

import structlog

from brokers.outgoing import Out
from rlvla3 import protocol as P
from rlvla3.weights.announce import LatestWeights

log = structlog.get_logger()


class WeightsAnnouncements:
    def __init__(self) -> None:
        self.latest = LatestWeights()
        self._frames: list[Any] | None = None  # the newest announcement, encoded once

    @property
    def version(self) -> int:
        """The policy version the newest announcement acts as (-1: none yet). Its publication
        number (``self.latest.version``) is the weight layer's own order."""
        return self.latest.policy_version

    def on_weights(self, msg: P.Message) -> list[Out]:
        """A trainer announced ``version``: keep it and publish it, unless it is not newer.
        A WEIGHTS with tensors or a malformed manifest raises ProtocolError (answered ERROR)."""
        fields = self.latest.offer(msg)
        if fields is None:
            log.info("weights_ignored_old", version=msg["version"], current=self.version)
            return []
        self._frames = P.encode(P.WEIGHTS, fields)
        log.info("weights_published", version=self.version, publication=self.latest.version, tensors=len(fields["manifest"]["entries"]),
                 announcement_bytes=len(self._frames[0]))
        return [Out(None, P.WEIGHTS, {"version": self.version}, frames=self._frames)]

    def on_snapshot(self, to: bytes) -> list[Out]:
        if self._frames is None:
            return [Out(to, P.WEIGHTS, {"version": -1})]
        return [Out(to, P.WEIGHTS, {"version": self.version}, frames=self._frames)]
