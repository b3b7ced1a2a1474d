"""What a subscriber yields: one capture (one step x one site), as views on the received frames.

    cap = parse_capture(frames)            # one multipart message of bytes or zmq.Frames; WireError if invalid
    cap.site, cap.layer, cap.phase, cap.step, cap.run, cap.seq, cap.sent_at
    cap.tensor                             # [n_tokens, hidden] in the captured dtype, a view (no copy)
    cap.seq_ids, cap.positions, cap.token_ids   # int64 [n_tokens] each; cap.token_array: all three, numpy

`Subscriber` (`_subscriber.py`) builds them from each message and each bundle entry;
the frames are validated first (`_decode.py`).
"""

from __future__ import annotations

import numpy as np
import torch

from ._decode import decode_fields
from ._wire import WireError


class Capture:
    """One forward step x one site: valid tokens only, each with its own identity.

    `tensor` ([n, hidden], captured dtype) and the int64 `seq_ids`, `positions`,
    `token_ids` are views on the received frames, built on first access; `payload`
    and `token_array` give the same memory as a memoryview / numpy array. `seq` is
    this site's count of captures published before this one; `sent_at` the wall-clock
    time (s since the epoch) at which the hook published it.
    """

    __slots__ = ("site", "layer", "phase", "step", "run", "dtype", "hidden", "n_tokens", "seq", "sent_ns",
                 "_tokens", "_payload", "_tensor", "_ids")

    def __init__(self, site: str, layer: int, phase: str, step: int, run: str, dtype: torch.dtype, hidden: int,
                 n_tokens: int, tokens: memoryview, payload: memoryview, seq: int = 0, sent_ns: int = 0) -> None:
        self.site, self.layer, self.phase, self.step, self.run = site, layer, phase, step, run
        self.dtype, self.hidden, self.n_tokens, self.seq, self.sent_ns = dtype, hidden, n_tokens, seq, sent_ns
        self._tokens, self._payload = tokens, payload
        self._tensor: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.frombuffer(self._payload, dtype=self.dtype).view(self.n_tokens, self.hidden)
        return self._tensor

    def _id_rows(self) -> torch.Tensor:
        if self._ids is None:
            self._ids = torch.frombuffer(self._tokens, dtype=torch.int64).view(3, self.n_tokens)
        return self._ids

    @property
    def seq_ids(self) -> torch.Tensor:
        return self._id_rows()[0]

    @property
    def positions(self) -> torch.Tensor:
        return self._id_rows()[1]

    @property
    def token_ids(self) -> torch.Tensor:
        return self._id_rows()[2]

    @property
    def token_array(self) -> np.ndarray:
        """int64 [3, n]: seq_id, position, token_id rows (a view, no copy)."""
        return np.frombuffer(self._tokens, dtype=np.int64).reshape(3, self.n_tokens)

    @property
    def payload(self) -> memoryview:
        """The activation bytes, C-contiguous [n, hidden] in `dtype` (a view, no copy)."""
        return self._payload

    @property
    def sent_at(self) -> float:
        return self.sent_ns / 1e9

    def __repr__(self) -> str:
        return (f"Capture(site={self.site!r}, phase={self.phase!r}, step={self.step}, n_tokens={self.n_tokens}, "
                f"hidden={self.hidden}, dtype={self.dtype})")


def parse_capture(frames: list) -> Capture:
    """Validate and decode one multipart message of bytes or zmq.Frames (raises WireError)."""
    if len(frames) not in (1, 2):
        raise WireError("frames", f"expected 1 or 2 frames (envelope[, payload]), got {len(frames)}")
    bufs = [f if isinstance(f, (bytes, memoryview)) else f.buffer for f in frames]
    return capture_of(memoryview(bufs[0]), memoryview(bufs[1]) if len(bufs) == 2 else None)


def capture_of(frame0: memoryview, payload_frame: memoryview | None) -> Capture:
    return Capture(*decode_fields(frame0, payload_frame))
