"""The target model as the loop runs it: one forward call for every round kind, its packed weights, the name of its
cache argument, and the probes' switch (they publish during the decoder's own rounds only).

    target = Target(model, packed="all", session=session)      # session: the drafters' probe session, or None
    logits = target.forward(run, ids, positions, mask)          # phase "verify": probes label the rows' positions
    target.capture(target.awake(run, cost, k))                  # probes on while a model drafter may read them
    with target.quiet(run, reads_features=False): drafter.draft(...)   # a drafter running the target's own layers

Probes off costs nothing per forward: even a hook that publishes nothing costs a visible share of a small
model's step. A toggle is the session's pause/resume; every call ends with the probes off, or any other forward
of the model would publish into a session nobody reads (measured: docs/design.md, "Decoder: measurements
behind the code").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..forward._compat import cache_kw
from ..forward._compiled import CompiledForward, StaticLoopCache, bucket
from ..forward._kv import GrowingCache
from ..forward._packed import PackedLinears

if TYPE_CHECKING:
    from ..schedule import CostModel
    from ._run import Run


class Target:
    def __init__(self, model: nn.Module, packed: str, session: object | None, compiled: bool = False) -> None:
        self.model = model
        self.cache_kw = cache_kw(model.forward)  # how this transformers release names the KV cache (`_compat.py`)
        # the forwards compiled over a static cache (`_compiled.py`), or None: eager over a GrowingCache
        self.compiled = CompiledForward.of(model) if compiled else None
        self.packed = PackedLinears.of(model, packed)  # verify forwards' linear layers, packed once
        shared = self.compiled.packed if self.compiled is not None else None
        if shared is not None and self.packed is not None and shared.kind == self.packed.kind:
            self.packed = shared  # the compiled forwards' packed copies serve the eager ones (no second copy)
        self.session = session  # a probe.Session on the model drafters' feature sites, or None
        self.capturing = True
        self.plain_s: dict[int, float] = {}  # per batch: seconds of a compiled plain round, measured as they run
        self.toggle_s = 2e-3  # seconds to pause or resume the probes, measured as it happens (from a high guess)
        self._valid_on = torch.ones(1, 1, dtype=torch.bool)
        self._valid_off = torch.zeros(1, 1, dtype=torch.bool)

    @property
    def step(self) -> int:
        """The probe session's step (the forward a feed names), 0 without a session."""
        return self.session.step if self.session is not None else 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def weights(self) -> contextlib.AbstractContextManager:
        """Around each of the loop's forwards: the linear layers with their weights packed once (`_packed.py`),
        where that applies."""
        return self.packed.active() if self.packed is not None else contextlib.nullcontext()

    def new_cache(self, batch: int, columns: int, static: bool) -> GrowingCache | StaticLoopCache:
        """A call's KV cache for `columns` columns: static where the forwards run compiled (`static`: nothing
        else reads the cache as a GrowingCache, e.g. layer skip's drafter), else a GrowingCache."""
        if self.compiled is not None and static:
            return self.compiled.new_cache(batch, columns)
        return GrowingCache(capacity=columns + 64)  # a tree's nodes fit too (`forward/_kv.py`)

    def warm(self, run: Run, lengths: list[int], tapped: bool) -> None:
        """Compile the graphs a call on its static cache may run, before its first round (a round would otherwise
        pay a compile, and judge drafting by it): `lengths` without taps (the probes off, as `forward` runs them),
        and with a probe session and `tapped` the same lengths with the taps in (their captures marked invalid)."""
        self.capture(False)
        self.compiled.warm(run.b, run.cache.capacity, lengths, self.cache_kw)
        if tapped and self.session is not None:
            self.capture(True)
            with self.quiet(run, reads_features=False):
                self.compiled.warm(run.b, run.cache.capacity, lengths, self.cache_kw, tapped=True)
            self.capture(False)

    def warm_plain(self, run: Run) -> None:
        """Compile the one-token graph (probes off) that `go_static` would run for this call."""
        self.capture(False)
        self.compiled.warm(run.b, run.mask.shape[1] + 1, [1], self.cache_kw)

    def go_static(self, run: Run) -> None:
        """The rest of the call on a static cache holding what the call's cache holds, its one-token graph compiled
        (the plain steps of a sampled call that measured itself losing: `_plain.py`)."""
        self.warm_plain(run)
        cache = self.compiled.new_cache(run.b, run.mask.shape[1] + 1)  # (warm's own, emptied: no second buffers)
        cache.load(run.cache)
        run.cache = cache

    def forward(self, run: Run, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                phase: str = "verify", labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V] of one forward on the call's cache. `labels`: the positions the probes publish
        (a tree forward labels node j with last + j; default `positions`)."""
        labels = positions if labels is None else labels
        if isinstance(run.cache, StaticLoopCache):
            # compiled but the prefill (its length is the prompt's; eager, packed weights). A graph runs at its
            # padded length (`bucket`), the taps in it where the probes publish: its padding rows are labelled
            # invalid, so the bus carries exactly the real rows.
            if phase == "prefill":
                with self.context(phase, run, labels), self.weights():
                    return self.compiled(ids, positions, mask, run.cache, self.cache_kw, compiled=False)
            with self.context(phase, run, labels, rows=bucket(ids.shape[1])):
                return self.compiled(ids, positions, mask, run.cache, self.cache_kw)
        with self.context(phase, run, labels), self.weights():
            return self.model(ids, attention_mask=mask, position_ids=positions, **{self.cache_kw: run.cache},
                              use_cache=True).logits

    # --- the probes -------------------------------------------------------------------
    def capture(self, on: bool) -> None:
        """Probes on the model or off it (the session's pause/resume, timed as it happens); without a session's
        pause/resume, forwards publish nothing instead."""
        if on == self.capturing:
            return
        if hasattr(self.session, "pause"):
            t0 = time.perf_counter()
            self.session.resume() if on else self.session.pause()
            self.toggle_s += 0.2 * (time.perf_counter() - t0 - self.toggle_s)
        self.capturing = on

    def awake(self, run: Run, cost: CostModel | None, k: int) -> bool:
        """Keep the probes on unless the call asks no model drafter (plain rounds, n-gram alone), or every model
        drafter rests long enough for removing them to pay: removing and adding them back costs `toggle_s`,
        keeping them the capture tax every round."""
        if not run.model_drafters:
            return False
        tax = cost.capture_tax(run.b, 1) if cost is not None and cost.has(run.b, k) else 0.0
        sleep_after = 8 if tax <= 0 else max(1, min(8, int(2 * self.toggle_s / tax) + 1))
        return run.sched.fixed or min(sc.rest for sc in run.scheds) < sleep_after

    def quiet(self, run: Run, reads_features: bool) -> contextlib.AbstractContextManager:
        """A drafter that runs the target's own modules (the target as draft model, layer skip) must not publish
        captures on the decoder's session: its forwards run with every capture marked invalid."""
        if self.session is None or reads_features:
            return contextlib.nullcontext()
        return self.session.context(seq_ids=run.seq_ids, valid=self._valid_off)

    def probes(self, on: bool) -> Callable[[], contextlib.AbstractContextManager]:
        """A context factory: the probes in state `on` (publishing when on), for a cost measurement."""
        @contextlib.contextmanager
        def ctx() -> Iterator[None]:
            before = self.capturing
            self.capture(on)
            try:
                with torch.no_grad(), self.session.context(valid=self._valid_on if on else self._valid_off):
                    yield
            finally:
                self.capture(before)
        return ctx

    def context(self, phase: str, run: Run, positions: torch.Tensor | None = None,
                rows: int | None = None) -> contextlib.AbstractContextManager:
        """The probes' identity for the loop's own forwards: its rows keep the sequence ids reserved at the
        prefill, whatever else runs on the model in between (a drafter that is the target's own layers). `rows`:
        the forward runs padded to this many (a compiled graph's length); the rows past `positions` are invalid."""
        if self.session is None:
            return contextlib.nullcontext()
        if phase == "prefill":
            ctx = self.session.context(phase="prefill", seq_ids=run.seq_ids)
        else:
            valid = self._valid_on if self.capturing else self._valid_off
            if rows is not None and positions is not None and rows > positions.shape[1]:
                positions, valid = self._padded(positions, rows, valid)
            ctx = self.session.context(phase="verify", seq_ids=run.seq_ids, positions=positions, valid=valid)
        return then_sync(ctx, self.session, run.device.type == "cuda" and self.capturing)

    def _padded(self, positions: torch.Tensor, rows: int, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and validity of a forward padded to `rows`: the padding continues each row's positions
        (never published: invalid)."""
        length = positions.shape[1]
        pad = positions[:, -1:] + torch.arange(1, rows - length + 1, device=positions.device)
        real = torch.arange(rows) < length
        return torch.cat([positions, pad], 1), real[None] & valid.reshape(1, 1).cpu()

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def then_sync(ctx: contextlib.AbstractContextManager, session: object,
              cuda: bool) -> contextlib.AbstractContextManager:
    """`ctx`, then (`cuda`) the step's captures sent: on a CUDA model they otherwise wait for a later step
    boundary, and the drafter reads them before the next forward (the loop reads the step's logits anyway).
    The loop's forwards and the oracle bound's committed ones both go through here."""
    return _synced(ctx, session) if cuda else ctx


@contextlib.contextmanager
def _synced(ctx: contextlib.AbstractContextManager, session: object) -> Iterator[None]:
    with ctx:
        yield
    getattr(session, "sync", lambda: None)()
