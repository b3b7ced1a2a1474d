"""Large captures sent from the model's own tensor: no copy on the model's thread.

    class CopyPath(HeldCaptures, BorrowedCaptures): ...   # `_copy.py`
    if path._try_borrow(key, t, ident, index, dtype, hidden, tokens, nbytes):
        return                                            # queued for the step's end; no copy made
    path.return_borrowed()                                # at each capture and step end: let go, check

A capture of BORROW_MIN bytes or more, every row, contiguous and on the host, is sent as two
frames, its header and the tensor's own bytes (zero-copy), instead of being copied into the
staging ring: the tensor is held until ZeroMQ has sent it, at most `capacity` bytes of them,
and under `complete` the model waits for room as it would for the ring. That is what
transformers' `output_hidden_states` and TransformerLens's cache do (they keep references);
here the tensor's version counter also checks that the model did not write into it before
the send. One written before its send (within the step: the usual case) is never sent: dropped and
counted (`torn`). One written while ZeroMQ was sending it may have gone out half old, half new: it
is counted, and a TORN_TOPIC control message names it (site, seq) to subscribers (`Subscriber.torn`,
`SubscriberStats.torn`). Either way the session warns once and copies every later capture at its
hook. No supported family does (tests/test_probe_borrow.py); vLLM's workers never borrow (their
kernels add the residual in place).

What it gains against copying, relative to raw pyzmq: docs/design.md, "Costs behind the code", Borrowing.

A mixin of `CopyPath`, which owns the ring, the publisher, the step's large sends (`_large`,
`_send_large`), the bundler and `_warn_once`.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch

from ._host import host_rows
from ._identity import StepIdentity
from ._sites import SiteKey
from ._wire import TORN_TOPIC, encode_control, encode_envelope

BORROW_MIN = 1 << 18  # bytes: below this a copy into the ring (one frame, a cache-warm slot) costs less


class BorrowedCaptures:
    # CopyPath's (see the module docstring)
    _large: list
    _seq: dict[bytes, int]

    def _init_borrow(self, borrow: bool) -> None:
        self.borrow = borrow  # may large captures be sent from the model's own tensor
        self.borrowed = 0  # captures that were
        self.torn = 0  # ... that the model wrote into before ZeroMQ had sent them
        # (held, tensor, version, nbytes, topic, seq) of each capture handed to ZeroMQ from the model's tensor
        self._borrowed: deque[tuple[object, torch.Tensor, int, int, bytes, int]] = deque()
        self._borrowed_bytes = 0  # of tensors queued or in ZeroMQ's hands

    def _try_borrow(self, key: SiteKey, t: torch.Tensor, ident: StepIdentity, index: np.ndarray | None, dtype: int,
                    hidden: int, tokens: bytes, nbytes: int) -> bool:
        """Queue this capture to be sent from `t` itself at the step's end; False: copy it instead."""
        if not (self.borrow and index is None and nbytes >= BORROW_MIN and t.is_contiguous()
                and not t.is_inference()):  # an inference tensor has no version counter to check
            return False
        if not (self._lend(nbytes) or self._wait_to_lend(nbytes)):
            return False
        if self._held or self._bundler.queued:  # type: ignore[attr-defined]
            self.flush()  # type: ignore[attr-defined]  # in order: the step's small captures before this one
        topic = key.topic
        seq = self._seq.get(topic, 0)
        self._seq[topic] = seq + 1
        env = encode_envelope(self.run, topic, ident.phase, dtype, ident.step, key.layer, hidden, tokens,  # type: ignore[attr-defined]
                              seq=seq, sent_ns=time.time_ns())
        self._borrowed_bytes += nbytes
        self.borrowed += 1
        self._large.append((topic, (env, host_rows(t), t, t._version), nbytes, seq, -1))  # offset -1: borrowed
        return True

    def _send_borrowed(self, topic: bytes, frame: tuple, nbytes: int, seq: int) -> None:
        env, payload, t, version = frame
        if t._version != version:  # written since its hook, within the step: never sent (it would be torn)
            self._borrowed_bytes -= nbytes
            self.dropped += 1  # type: ignore[attr-defined]
            self._torn_found()
            return
        held = self.pub.send(topic, env, payload, nbytes=nbytes, seq=seq)  # type: ignore[attr-defined]
        self._borrowed.append((None if held is False else held, t, version, nbytes, topic, seq))

    def _torn_found(self, topic: bytes | None = None, seq: int = 0) -> None:
        """Count a capture the model wrote into; with `topic`, one already sent: subscribers are told in-band."""
        self.torn += 1
        self.borrow = False
        if topic is not None:
            try:
                self.pub.send_control(encode_control(TORN_TOPIC, {"run": self.run.decode(),  # type: ignore[attr-defined]
                                                                  "site": topic.decode(), "seq": seq}))
            except Exception:  # never crash the model: it is counted in stats.torn all the same
                pass
        self._warn_once("torn", "probebus: the model wrote into a captured tensor in place after its hook (a "  # type: ignore[attr-defined]
                        "capture sent from the tensor itself: one not yet sent is dropped, one already sent may "
                        "mix old and new values and is flagged to subscribers, `Subscriber.torn`; counted in "
                        "stats.torn); this session copies every capture from now on")

    def _unsend_borrowed(self, nbytes: int) -> None:
        """A queued borrowed capture that was never handed to ZeroMQ (a send before it raised)."""
        self._borrowed_bytes -= nbytes

    def _lend(self, nbytes: int) -> bool:
        """Whether `nbytes` more of the model's tensors may be held for ZeroMQ now (at most `capacity` bytes)."""
        if self._borrowed:
            self.return_borrowed()
        return self._borrowed_bytes + nbytes <= self.ring.capacity  # type: ignore[attr-defined]

    def _wait_to_lend(self, nbytes: int) -> bool:
        """Room to borrow `nbytes` once this step's borrowed captures have left and, under `complete`, ZeroMQ has
        sent enough of the earlier ones (the model waits, as for a full ring); False: copy it, or drop it."""
        if nbytes > self.ring.capacity:  # type: ignore[attr-defined]
            return False
        if self._large:  # the step's own captures hold the room: send them first
            self._send_large()  # type: ignore[attr-defined]
            if self._lend(nbytes):
                return True
        return self.pub.backpressure(lambda: self._lend(nbytes) or False) is True  # type: ignore[attr-defined]

    def return_borrowed(self) -> None:
        """Let go of the tensors ZeroMQ is done with, in order, checking that none was written meanwhile."""
        borrowed = self._borrowed
        while borrowed:
            held, t, version, nbytes, topic, seq = borrowed[0]
            if held is not None and held() is not None:  # type: ignore[operator]
                break
            borrowed.popleft()
            self._borrowed_bytes -= nbytes
            if t._version != version:  # written while ZeroMQ sent it: flagged in-band (`Subscriber.torn`)
                self._torn_found(topic if held is not None else None, seq)
