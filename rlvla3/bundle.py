"""BUNDLE: several messages to one peer as one ZeroMQ message, and back.

A bundle is ``[header, *frames of message 1, *frames of message 2, ...]`` whose header (a
``protocol`` message of type BUNDLE) lists each message's frame count in ``parts``. One message
instead of several is one pass through each socket and zmq's I/O thread and one wake-up of the
reader; each part stays a whole message, validated and answered alone. A peer gets bundles only
if its READY said ``bundles``.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from rlvla3 import protocol as P


def bundle(messages: list[list[Any]]) -> list[tuple[int, list[Any]]]:
    """Encoded messages for one peer, as few messages as the limits allow (``MAX_BUNDLE_PARTS``
    messages, ``MAX_FRAMES`` frames, ``MAX_BUNDLE_BYTES``): a run goes as one BUNDLE, a message
    alone as itself. Order is kept. Each item: (how many messages it holds, its frames)."""
    out: list[tuple[int, list[Any]]] = []
    run: list[list[Any]] = []
    frames = nbytes = 0
    for frames_of in messages:
        size = sum(f.nbytes if type(f) is memoryview else len(f) for f in frames_of)
        if run and (len(run) == P.MAX_BUNDLE_PARTS or frames + len(frames_of) >= P.MAX_FRAMES
                    or nbytes + size > P.MAX_BUNDLE_BYTES):
            out.append(_bundled(run))
            run, frames, nbytes = [], 0, 0
        run.append(frames_of)
        frames += len(frames_of)
        nbytes += size
    if run:
        out.append(_bundled(run))
    return out


def _bundled(run: list[list[Any]]) -> tuple[int, list[Any]]:
    if len(run) == 1:
        return 1, run[0]
    header = P.pack_header({"v": P.PROTOCOL_VERSION, "type": P.BUNDLE, "parts": [len(m) for m in run]})
    return len(run), [header, *(f for m in run for f in m)]


def parts(counts: list[int], frames: Sequence[Any]) -> list[Sequence[Any]]:
    """Each part's frames: ``counts`` is a BUNDLE header's ``parts``, ``frames`` what follows it."""
    out, at = [], 0
    for n in counts:
        out.append(frames[at:at + n])
        at += n
    return out


def decode_each(frames: Sequence[Any]) -> Iterator[P.Message | P.ProtocolError]:
    """The messages ``frames`` carry: one, or each part of a BUNDLE in order (``opened``)."""
    return opened(frames)[1]


def opened(frames: Sequence[Any]) -> tuple[int, Iterator[P.Message | P.ProtocolError]]:
    """How many messages ``frames`` carry, and the messages, each decoded when it is asked for
    (the broker counts a bundle's parts against the peer's rate cap before decoding them, and may
    handle them over several loop turns). A bad part comes back as its ProtocolError, and the
    parts beside it still count; a bad bundle is one error."""
    try:
        msg = P.decode(frames)
    except P.ProtocolError as err:
        return 1, iter((err,))
    if msg.type != P.BUNDLE:
        return 1, iter((msg,))
    counts = msg.header["parts"]
    return len(counts), _decoded(counts, frames[1:])


def _decoded(counts: list[int], frames: Sequence[Any]) -> Iterator[P.Message | P.ProtocolError]:
    for part in parts(counts, frames):
        try:
            m = P.decode(part)
            yield m if m.type != P.BUNDLE else P.ProtocolError(P.E_MALFORMED, "a BUNDLE inside a BUNDLE")
        except P.ProtocolError as err:
            yield err
