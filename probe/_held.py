"""A step's small captures, packed at the step's end: the held captures and the deferred ones.

    class CopyPath(HeldCaptures): ...         # `_copy.py`; the hooks call these on the model's thread
    path.capture(key, t, ident)               # a decode step's capture: its bytes go into the arena at once
    path.capture_deferred(items, ident)       # at a step's end: the tensors the hooks only noted
    path.flush()                              # packs the held captures into the bundle first (`_pack_held`)

Two ways a step's small captures wait for its end, where one loop packs them:
- *held* (`CopyPath.capture`; the vLLM worker, `inference_mode` steps): the bytes are copied
  into an arena at once, because the model may overwrite them (vLLM's C kernel adds the
  residual in place); the shape, the identity rows and the header wait for the step's end.
- *deferred* (`capture_deferred`; the transformers backend's decode steps): the hook keeps
  the tensor and its version counter; at the step's end a tensor written since is dropped
  and counted, and the others are copied once, straight into the bundle.
Runs of captures that share the step's rows, dtype and width (a decode step's sites) go
into the bundle as one group (`Bundler.group`): one header, the checks once per run.

A mixin of `CopyPath`, which owns the counts (`captured`, `dropped`), the bundler and the
general path (`capture`, `_warn_once`); it lives apart so the copy path stays one file's read.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ._bundle import Bundler, GroupError
from ._host import chars, dtype_info, known_dtype
from ._identity import StepIdentity
from ._publisher import ZERO_COPY_MIN
from ._sites import SiteKey

ARENA_START, ARENA_MAX = 256 << 10, 16 << 20  # bytes of a step's held small captures


class HeldCaptures:
    # CopyPath's (see the module docstring), as are `capture` and `_warn_once`.
    captured: int
    dropped: int
    _bundler: Bundler

    def _init_arena(self) -> None:
        """The arena the held captures copy their bytes into; it grows at a step's end when one found it full."""
        self._arena = np.empty(ARENA_START, dtype=np.uint8)
        self._arena_at = self._arena.ctypes.data
        self._arena_size = ARENA_START
        self._arena_used = 0
        self._arena_short = False  # a capture found it full this step: it grows at the step's end
        self._held: list[tuple[SiteKey, torch.Tensor, StepIdentity, int, int]] = []  # key, tensor, ident, at, bytes

    def capture_deferred(self, items: list[tuple[SiteKey, torch.Tensor, int | None]],
                         ident: StepIdentity) -> list[tuple[SiteKey, Exception | None]]:
        """A step's deferred captures (site, tensor, its version at the hook or None when it has no version
        counter), in hook order, at the step's end.

        Returns what failed: (site, exception), or (site, None) for a tensor written since its hook (dropped).
        Runs of the common capture (every row real, a host tensor of the step's rows, under 64 KiB, the same
        shape and dtype: a decode step's sites) go into the bundle as one group, one copy each; the checks
        run once per run. Anything else takes `capture`'s general path, in order."""
        if self._pending:  # type: ignore[attr-defined]
            self._pack_pending()  # type: ignore[attr-defined]  # earlier steps first (`_pending.py`)
        failed: list[tuple[SiteKey, Exception | None]] = []
        sent_ns = time.time_ns()  # one stamp: they leave together
        last: tuple = ()
        fast: tuple | None = None
        run: list[tuple[SiteKey, object]] = []  # the current run of common captures, not yet in the bundle
        for key, t, version in items:
            before = self.captured
            try:
                if version is not None and t._version != version:  # None: vLLM's (see `VllmProbe.defer`)
                    self.captured += 1
                    self.dropped += 1
                    failed.append((key, None))
                    continue
                shape, dt = t.shape, t.dtype
                if last != (shape, dt):
                    if run:
                        self._group(ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
                        run = []
                    last, fast = (shape, dt), None
                    info = known_dtype(dt)
                    # [batch, seq, hidden], or vLLM's flat [tokens, hidden] of a step of one token per row
                    flat = len(shape) == 2 and ident.seq_len == 1 and shape[0] == ident.batch
                    if (len(shape) == 3 or flat) and ident.valid is None and info is not None:
                        index, tokens, n = ident.rows(1 if flat else shape[1])
                        nbytes = n * shape[-1] * info[1]
                        if index is None and n and nbytes < ZERO_COPY_MIN and nbytes == t.nbytes:
                            fast = (info[0], shape[-1], n, tokens, nbytes)
                            at_address = chars(nbytes).from_address
                if fast is not None and t.is_cpu and t.is_contiguous():
                    run.append((key, at_address(t.data_ptr())))  # the tensor's own bytes: copied once, into the bundle
                    continue
                if run:
                    self._group(ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
                    run = []
                self.capture(key, t, ident, hold=False)  # counts a failure itself
            except Exception as exc:  # the step's other captures still go out
                if self.captured == before:
                    self.captured = before + 1
                    self.dropped += 1
                failed.append((key, exc))
        if run:
            self._group(ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
        return failed

    def _group(self, ident: StepIdentity, fast: tuple[int, int, int, bytes, int], run: list[tuple[SiteKey, object]],
               sent_ns: int, failed: list[tuple[SiteKey, Exception | None]]) -> None:
        """Bundle a run of common captures as one group; counts them, and what a failure dropped."""
        dtype, hidden, n, tokens, nbytes = fast
        self.captured += len(run)
        try:
            self._bundler.group(ident, dtype, hidden, n, tokens, nbytes, run, sent_ns)
        except GroupError as exc:
            self.dropped += len(run) - exc.written
            failed.extend((key, exc.__cause__) for key, _ in run[exc.written:])  # type: ignore[misc]

    def _pack_held(self) -> None:
        """Put the captures `capture` held (their bytes already in the arena) into the bundle, in order."""
        held, self._held = self._held, []
        arena = memoryview(self._arena)
        sent_ns = time.time_ns()  # one stamp: they leave together
        last: tuple = ()  # (ident, shape, dtype) of the capture before: a decode step's captures share them
        fast: tuple = ()
        run: list[tuple[SiteKey, object]] = []  # consecutive captures of one (ident, shape, dtype): one group
        run_ident = None
        failed: list[tuple[SiteKey, Exception | None]] = []
        for key, t, ident, at, nbytes in held:
            try:
                shape, dt = t.shape, t.dtype
                if last != (ident, shape, dt):
                    if run:
                        self._group(run_ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
                        run = []
                    last = (ident, shape, dt)
                    hidden = shape[-1]
                    # The rows `_capture_now` would see: it reshapes any other rank to [batch, -1, hidden].
                    seq_len = shape[1] if len(shape) == 3 else math.prod(shape) // (ident.batch * hidden)
                    index, tokens, n = ident.rows(seq_len)
                    dtype, itemsize = dtype_info(dt)
                    fast, run_ident = (dtype, hidden, n, tokens, n * hidden * itemsize), ident
                    if n and index is not None:
                        raise ValueError(f"a {tuple(shape)} activation does not match the step's {ident.batch} rows")
                if n == 0:
                    continue
                if nbytes != fast[4]:
                    raise ValueError(f"a {tuple(shape)} activation does not match the step's {ident.batch} rows")
                run.append((key, arena[at : at + nbytes]))
            except Exception as exc:  # the step's other captures still go out
                last = ()
                self.captured += 1
                self.dropped += 1
                failed.append((key, exc))
        if run:
            self._group(run_ident, fast, run, sent_ns, failed)  # type: ignore[arg-type]
        for key, exc in failed:
            self._warn_once(repr(type(exc)), f"probebus: capture of {key.name} failed and was dropped: {exc!r}")
        self._arena_used = 0
        if self._arena_short:  # it ran out this step: twice the size from the next one (within a bound)
            self._arena_short = False
            if self._arena_size < ARENA_MAX:
                self._arena = np.empty(min(2 * self._arena_size, ARENA_MAX), dtype=np.uint8)
                self._arena_at, self._arena_size = self._arena.ctypes.data, len(self._arena)
