"""When the decoder's probes publish: on for its own speculative rounds, off everywhere else.

    class SpeculativeDecoder(ProbeSwitch): ...   # `_loop.py`
    self._capture(on)                            # pause or resume the session
    with self._context("verify", run, positions): target(...)   # the loop's identity on its forwards

A mixin of `SpeculativeDecoder`, which owns `session`, `slots`, `feeder`, `cost` and the switch's state
(`_capturing`, `_toggle_s`, `_valid_on`, `_valid_off`).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ._run import Run


class ProbeSwitch:
    session: object  # SpeculativeDecoder's, as are the attributes the module docstring names

    def _quiet(self, run: Run):  # noqa: ANN202
        """A drafter that runs the target's own modules (the target as draft model, layer skip) must not publish
        captures on the decoder's session: its forwards run with every capture marked invalid."""
        slot = self.slots[self._cur_slot()] if self.slots else None
        if self.session is None or slot is None or slot.sites:
            return contextlib.nullcontext()
        return self.session.context(seq_ids=run.seq_ids, valid=self._valid_off)

    def _cur_slot(self) -> int:
        return next(i for i, sl in enumerate(self.slots) if sl.feeder is self.feeder)

    def _awake(self, run: Run) -> bool:
        """Keep the probes on unless the call asks no model drafter (plain rounds, n-gram alone), or every model
        drafter rests long enough for removing them to pay."""
        if not run.model_drafters:
            return False
        return run.sched.fixed or min(sc.rest for sc in run.scheds) < self._sleep_after(run.b)

    def _sleep_after(self, batch: int) -> int:
        """Rounds of rest from which taking the probes off pays: removing and adding them back costs
        `_toggle_s` (measured), keeping them costs the capture tax every round."""
        tax = self.cost.capture_tax(batch, 1) if self._cost is not None and self._cost.has(batch, self.k) else 0.0
        if tax <= 0:
            return 8
        return max(1, min(8, int(2 * self._toggle_s / tax) + 1))

    def _capture(self, on: bool) -> None:
        """Probes on the model or off it. Off costs nothing per forward (even a hook that publishes nothing
        costs a visible share of a small model's step). A toggle is the session's pause/resume (~40 us: the
        site list it announces stays), and within a call it happens only when EAGLE-3 rests for several
        rounds. Every call ends with the probes off: left on, any other forward of the model (the user's own
        `generate`, another decoder) published into a session nobody reads between this decoder's calls, and
        after six plain 96-token calls the `complete` policy's back-pressure froze the model for its 60 s
        stall timeout. Without session.pause/resume, forwards publish nothing instead."""
        if on == self._capturing:
            return
        if hasattr(self.session, "pause"):
            t0 = time.perf_counter()
            self.session.resume() if on else self.session.pause()
            self._toggle_s += 0.2 * (time.perf_counter() - t0 - self._toggle_s)
        self._capturing = on

    def _probes(self, on: bool):  # noqa: ANN202
        """A context factory: the probes in state `on` (publishing when on) for a cost measurement."""
        @contextlib.contextmanager
        def ctx():  # noqa: ANN202
            before = self._capturing
            self._capture(on)
            try:
                with torch.no_grad(), self.session.context(valid=self._valid_on if on else self._valid_off):
                    yield
            finally:
                self._capture(before)
        return ctx

    def _context(self, phase: str, run: Run, positions: torch.Tensor | None = None):  # noqa: ANN202
        """The probes' identity for the loop's own forwards: its rows keep the sequence ids reserved at the
        prefill, whatever else runs on the model in between (a drafter that is the target's own layers)."""
        if self.session is None:
            return contextlib.nullcontext()
        if phase == "prefill":
            ctx = self.session.context(phase="prefill", seq_ids=run.seq_ids)
        else:
            ctx = self.session.context(phase="verify", seq_ids=run.seq_ids, positions=positions,
                                       valid=self._valid_on if self._capturing else self._valid_off)
        return then_sync(ctx, self.session, run.device.type == "cuda" and self._capturing)


def then_sync(ctx, session, cuda: bool):  # noqa: ANN001, ANN201
    """`ctx`, then (`cuda`) the step's captures sent: on a CUDA model they otherwise wait for a later step
    boundary, and the drafter reads them before the next forward (the loop reads the step's logits anyway).
    The loop's forwards and the oracle bound's committed ones both go through here."""
    return _synced(ctx, session) if cuda else ctx


@contextlib.contextmanager
def _synced(ctx, session):  # noqa: ANN001, ANN202
    with ctx:
        yield
    getattr(session, "sync", lambda: None)()
