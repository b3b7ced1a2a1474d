"""Decode steps whose captures wait, unpacked, to be packed many steps at a time.

    class CopyPath(PendingSteps, ...): ...     # `_copy.py`
    path.defer_step(items, ident)              # a step's end: kept with its identity; packed once due
    path.flush()                               # packs what waits first, in order (`_pack_pending`)
    path.pack_idle()                           # any thread: packs and sends, unless a step is running

While no subscriber is live the publisher holds a step's bundles for a later burst anyway (`_linger.py`),
so nothing needs them packed at the step's end. Packing there ran from the caches the model's layers had
just flushed: the step's end cost the model's thread about as much as its taps, its identity and the
graph's extra outputs together (docs/design.md, "Costs behind the code", Pending steps). So a decode
step whose identity rows are already bytes (the tracker's decode fast path) keeps its captures as they
are, tensors and version counters (`Hooks` deferred them, or a compiled graph returned them), and packing
runs once the oldest has waited a linger, `MAX_STEPS` steps have, or `MAX_BYTES` would be held: one loop
over many steps, whose code and data stay warm from one to the next. A live subscriber, a step with
padding or a prefill is packed at its end as before, after anything waiting (their order on the wire is
the order of the steps).

What waits is counted as captured (`pending`, in the session's stats) and is in the order of its steps:
anything else that goes into a bundle or the ring packs it first, so per-site sequence numbers follow
the steps. A tensor written since its hook is dropped at packing as it would have been at the step's end
(its version counter moved); `failed` keeps what packing dropped for the hooks to report on the model's
thread. Threads: the model's thread packs as steps end; the control thread (`pack_idle`, a model that
stopped stepping) and `pause()` or `flush()` on another thread pack only between steps (`in_step`), under
`lock`, which the model's thread takes too wherever it touches the bundle.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ._bundle import Bundler
    from ._identity import StepIdentity
    from ._publisher import Publisher
    from ._sites import SiteKey

MAX_STEPS = 64  # steps that wait at most before they are packed
MAX_BYTES = 1 << 20  # bytes of their tensors that wait at most (the publisher holds as much before a burst)

Items = list[tuple["SiteKey", "torch.Tensor", "int | None"]]


class PendingSteps:
    # CopyPath's (see the module docstring): the publisher, the counts, the bundler and the packer.
    pub: Publisher
    captured: int
    dropped: int
    _bundler: Bundler

    def _init_pending(self) -> None:
        # (items, identity, None), or (None, identity, (staged, versions, keys)) for a compiled step's outputs
        self._pending: list[tuple[Items | None, StepIdentity, tuple | None]] = []
        self.pending = 0  # captures waiting in `_pending` (counted as captured: stats add them)
        self._pending_bytes = 0
        self._pending_since = 0.0  # when the oldest of them ended
        self._packed_since: float | None = None  # the oldest packed step not yet handed to the publisher
        self.in_step = False  # the model's thread is inside a forward (set by the hooks)
        self.lock = threading.RLock()  # around everything that writes into the bundle, on any thread
        self.failed: list[tuple[SiteKey, Exception | None]] = []  # what packing dropped, for the hooks to report

    def defer_step(self, items: Items, ident: StepIdentity) -> None:
        """A step's captures at its end: kept for a later pack when that is safe (see the module docstring),
        else packed now, after anything kept before them."""
        if not items:
            return
        pub = self.pub
        # A tensor the model wrote into during its own step is caught now, as before steps waited: the session
        # then copies in its hooks from the next step on, instead of losing a capture at every step until a pack.
        if (not pub._holding or ident.valid is not None or not ident.settled
                or any(v is not None and t._version != v for _, t, v in items)):
            with self.lock:
                if self._pending:
                    self._pack_pending()
                self.failed += self.capture_deferred(items, ident)  # type: ignore[attr-defined]
            return
        now = time.monotonic()
        with self.lock:  # (uncontended but for a control thread packing a stopped model's steps)
            if not self._pending:
                self._pending_since = now
            self._pending.append((items, ident, None))
            self.pending += len(items)
            self._pending_bytes += len(items) * items[0][1].nbytes
            if (len(self._pending) >= MAX_STEPS or self._pending_bytes >= MAX_BYTES
                    or now - self._pending_since >= pub.linger):
                self._pack_pending()

    def wait_staged(self, staged: list[tuple[int, torch.Tensor]], ident: StepIdentity,
                    keys: dict[int, SiteKey]) -> bool:
        """A compiled step's staged graph outputs (site number, tensor), every one of an active site, kept as they
        are with their version counters, the rest of `defer_step`'s work left to the pack; False (nothing kept):
        this step cannot wait, the caller takes the general path. The step's end runs from caches its forward
        flushed, where every attribute, property and call costs: this reads each once (docs/design.md, "Costs
        behind the code", Pending steps)."""
        pub = self.pub
        if (pub.live or pub.max_delay <= 0 or ident.valid is not None  # (`pub._holding`, inline)
                or ident._decode is None and 1 not in ident._rows):  # (not `ident.settled`, inline)
            return False
        try:
            versions = [t._version for _, t in staged]
        except AttributeError:  # something that is not a tensor: the general path skips it
            return False
        now = time.monotonic()
        n = len(versions)
        with self.lock:
            pending = self._pending
            if not pending:
                self._pending_since = now
            pending.append((None, ident, (staged.copy(), versions, keys)))
            self.pending += n
            self._pending_bytes += n * staged[0][1].nbytes
            if (len(pending) >= MAX_STEPS or self._pending_bytes >= MAX_BYTES
                    or now - self._pending_since >= pub._linger):
                self._pack_pending()
        return True

    @property
    def due_at_step_end(self) -> bool:
        """What the end of a step whose captures wait (`wait_staged`) must flush: bundles or large captures (its own,
        or packed just now), borrowed tensors, held bundles due to go. Held bundles not yet due are left alone:
        flushing only to find that out cost every step ~10 us while any were held (docs/design.md, "Costs behind
        the code", Pending steps)."""
        b = self._bundler
        return bool(b.meta or b.sealed or self._held or self._large or self._borrowed  # type: ignore[attr-defined]
                    or self.pub.held_due())

    def _pack_pending(self) -> None:
        """Pack every waiting step into the bundle, oldest first (under `lock`)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if self._packed_since is None:
            self._packed_since = self._pending_since
        self.pending = self._pending_bytes = 0  # capture_deferred counts them as captured as it packs them
        failed = self.failed
        for i, (items, ident, raw) in enumerate(pending):
            try:
                if items is None:  # a compiled step's graph outputs, as `wait_staged` kept them
                    staged, versions, keys = raw  # type: ignore[misc]
                    items = [(keys[n], t, v) for (n, t), v in zip(staged, versions, strict=True)]
                failed += self.capture_deferred(items, ident)  # type: ignore[attr-defined]
            except BaseException:  # (it catches per capture: this is an interrupt) the rest is counted, dropped
                rest = sum(len(later[2][1]) if later[0] is None else len(later[0]) for later in pending[i + 1:])
                self.captured += rest
                self.dropped += rest
                raise

    def pack_now(self) -> None:
        """Pack what waits into the bundle now, on the model's thread (before something that must follow it)."""
        with self.lock:
            if self._pending:
                self._pack_pending()

    def take_packed_since(self) -> float | None:
        """When the oldest step in the bundle now ended, if it waited unpacked (the publisher's hold starts then)."""
        since, self._packed_since = self._packed_since, None
        return since

    def pack_idle(self) -> None:
        """From any thread: pack what waits and send it now, unless a forward is running (the model's thread
        packs then, at the step's end)."""
        if not self._pending or self.in_step or not self.lock.acquire(blocking=False):
            return
        try:
            if self._pending and not self.in_step and not self._held:  # type: ignore[attr-defined]
                self._pack_pending()
                self.flush()  # type: ignore[attr-defined]
        finally:
            self.lock.release()

    def pack_stale(self) -> None:
        """The control thread's tick: pack and send the waiting steps once the oldest is a linger old."""
        if self._pending and time.monotonic() - self._pending_since >= self.pub.linger:
            self.pack_idle()
