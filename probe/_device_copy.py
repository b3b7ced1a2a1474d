"""Captures of a CUDA model: device-to-host copies in the model's stream, sent once they have landed.

    device = DeviceCopies(cuda_device)            # owned by a CopyPath (`_copy.py`) on a CUDA model
    device.capture(key, t, ident, index, tokens, n, dtype, off, data)   # from a hook: queue the copy into a slot
    for copy in device.landed(block=False): ...   # at a step's end: mark the step; the copies that have landed

The rows are gathered on the device and copied non-blocking into the pinned ring, in the
model's own stream order; one event per step marks them, and they are sent (a header
frame, then the payload zero-copy) at a later step boundary once it has completed, so the
model's thread never waits for the copy. (A side stream with an event per capture cost 6
CUDA calls per capture, and the host, not the GPU, bounds a decode step: docs/design.md, "Costs behind the code", CUDA.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from ._identity import StepIdentity
from ._sites import SiteKey


class DeviceCopy(NamedTuple):
    key: SiteKey
    step: int
    phase: int
    dtype: int
    hidden: int
    tokens: bytes
    off: int | None  # ring slot, or None for a one-off buffer
    data: np.ndarray
    failed: bool = False  # the capture failed: nothing to send, the slot only waits for the step's event


class DeviceCopies:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._step: list[DeviceCopy] = []  # copies of the running step, not yet marked by an event
        self._pending: deque[tuple[object, list[DeviceCopy]]] = deque()  # (event after them, copies) per step

    @property
    def queued(self) -> int:
        return sum(len(c) for _, c in self._pending) + len(self._step)

    def capture(self, key: SiteKey, t: torch.Tensor, ident: StepIdentity, index: object, tokens: bytes, n: int,
                dtype: int, off: int | None, data: np.ndarray) -> None:
        """Queue the copy of the valid rows (`index` into the step's rows, or None for all) into `data`, the
        pinned ring slot at `off` (None: a one-off buffer)."""
        seq_len, hidden = t.shape[1], t.shape[2]
        copy = DeviceCopy(key, ident.step, ident.phase, dtype, hidden, tokens, off, data)
        try:
            _device_rows(t, None if index is None else ident.device_index(seq_len), data, n)
        except BaseException:
            # The ring frees in order, so a slot left staged would block it for good; a copy may already be
            # queued into it, so it is freed at the step's event like the others, and never sent.
            self._step.append(copy._replace(failed=True))
            raise
        self._step.append(copy)

    def landed(self, block: bool) -> Iterator[DeviceCopy]:
        """Mark the step's copies with one event; yield, in order, every copy that has landed (all when `block`).
        A failed one (`failed`) is yielded too, for its slot to be freed."""
        if self._step:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._pending.append((event, self._step))
            self._step = []
        pending = self._pending
        while pending and (block or pending[0][0].query()):  # type: ignore[attr-defined]
            event, copies = pending.popleft()
            event.synchronize()  # type: ignore[attr-defined]
            yield from copies


def _device_rows(t: torch.Tensor, index: torch.Tensor | None, data: np.ndarray, n: int) -> None:
    """Gather the valid rows on the device and queue their copy into `data` (pinned), non-blocking."""
    hidden = t.shape[-1]
    src = t.detach().reshape(-1, hidden)
    rows = src if index is None else src.index_select(0, index)
    dst = torch.from_numpy(data).view(t.dtype).view(n, hidden)
    dst.copy_(rows, non_blocking=True)  # the model's stream: ordered after the layer, no record_stream needed
