"""When a vLLM decode step's captures may wait for the step's end, checked on the engine itself.

    defer = Deferral(enabled=runner.device.type == "cpu")
    deferred, check = defer.begin(idents)    # the step's start: a list to note captures in, or None
    check.note(key, t)                        # a hook of a checked step (captured as usual too)
    defer.end(check)                          # the step's end: False when something wrote into a capture

The transformers backend defers a decode step's captures to its end (`Hooks`): the hook only
keeps the tensor, and one loop at the step's end copies them all, from warm caches, where
each copy between layers runs from cold ones. It knows a tensor written since its hook by
its version counter. vLLM runs under `torch.inference_mode`, which keeps no version
counters, and on a GPU its fused add-and-norm kernel writes the residual in place, so
what a hook saw may be gone by the step's end. Which kernel runs is fixed by the build and
the device, not by the step, so it is checked on the running engine: the first decode step
of each batch size, and every `EVERY`th after, copies in its hooks as before *and* keeps
each tensor's bytes; at its end every tensor must still hold them. Until a check has
passed nothing is deferred; one that fails turns deferral off for the session (nothing
is lost: that step's captures were copied in their hooks).
"""

from __future__ import annotations

import ctypes

import torch

from .._hooks import DEFER_ROWS  # decode steps of at most this many requests are deferred
from .._identity import StepIdentity
from .._sites import SiteKey

EVERY = 512  # deferred steps of one batch size between two checks


class Check:
    """One checked step: each capture's tensor and its bytes at its hook."""

    def __init__(self) -> None:
        self.seen: list[tuple[SiteKey, torch.Tensor, bytes]] = []
        self.unchecked = False  # a capture whose bytes could not be read as one block

    def note(self, key: SiteKey, t: torch.Tensor) -> None:
        if t.is_cpu and t.is_contiguous():
            self.seen.append((key, t, ctypes.string_at(t.data_ptr(), t.nbytes)))
        else:
            self.unchecked = True

    def changed(self) -> list[str]:
        """Sites whose tensor no longer holds what its hook saw."""
        return [k.name for k, t, b in self.seen if ctypes.string_at(t.data_ptr(), len(b)) != b]


class Deferral:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.steps = 0  # steps deferred so far
        self.checks = 0  # checks passed so far
        self._left: dict[int, int] = {}  # batch size -> deferred steps until its next check

    def begin(self, idents: list[StepIdentity]) -> tuple[list | None, Check | None]:
        """(a list for the step's deferred captures, or None), (a Check, or None)."""
        if not self.enabled or len(idents) != 1:
            return None, None
        ident = idents[0]
        if ident.valid is not None or ident.seq_len != 1 or ident.batch > DEFER_ROWS:
            return None, None  # a prefill or a mixed step: larger, and rarer
        left = self._left.get(ident.batch, 0)
        if left:
            self._left[ident.batch] = left - 1
            self.steps += 1
            return [], None
        return None, Check()

    def end(self, check: Check, batch: int) -> list[str]:
        """After a checked step: the sites written into since their hook (deferral is now off), or []."""
        changed = check.changed()
        if changed or check.unchecked:
            self.enabled = False
            return changed or ["(a capture not readable as one block)"]
        self._left[batch] = EVERY
        self.checks += 1
        return []
