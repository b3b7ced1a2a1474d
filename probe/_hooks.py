"""The hooks of one session: registered per site, plus a pre-hook and a hook on the model.

    hooks = Hooks(model, arch, copy_path, publisher, stop_ids)
    hooks.change("add", ["layers.3.resid_post"])     # from any thread; applied at a step boundary
    hooks.override = {"phase": 2, "positions": ...}   # session.context(...) sets this
    hooks.remove_all()

The model pre-hook computes the step's identity once (`_identity.py`); each site hook
hands its tensor to the copy path (`_copy.py`); the model hook sends what CUDA copies
have landed and reads new subscriptions (`_publisher.py`). This is the hot path: it runs
on the model's thread, never raises into the model, and does no per-step work beyond
numpy on host arrays and the sends themselves.

"Hooks" here are taps (`tap`): a module's `forward` is wrapped by a pass-through that
calls them, because PyTorch calls a module through its fast path only while it has no
hooks at all; a no-op forward hook made a module call cost more than twice as much, on
every probed module of every step (see docs/design.md, "Costs behind the code"). A module that already has hooks
of its own gets real hooks instead, so ours keep their place among them.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from . import _compiled
from ._arch import Arch
from ._copy import CopyPath
from ._identity import PREFILL, IdentityTracker, StepIdentity, cache_length
from ._publisher import Publisher
from ._sites import SiteKey

_TAPS = "_probebus_taps"  # a tapped module's `_Taps`, in its __dict__
# What a tap asks to know whether Dynamo is tracing it (folded to a constant there): a global, so that Dynamo's guards
# check it once for every tap, where a closure cell was checked once per tap (`Hooks._site_hook`)
_compiling = torch.compiler.is_compiling
DEFER_ROWS = 64  # steps of at most this many rows (decode steps) are captured at their end (see `Hooks`)


class _Taps:
    """A module's wrapped forward: callbacks before and after the forward it had (`prev`: its own instance
    attribute, if something had already replaced it; None: the class's), and where each of the session's site hooks
    stages its tensor when torch.compile traces the module (`sinks`, see `_stage_traced`)."""

    __slots__ = ("pre", "post", "prev", "wrapper", "sinks", "kind")

    def __init__(self, prev: object) -> None:
        self.pre: list[Callable] = []  # fn(module, args, kwargs)
        self.post: list[Callable] = []  # fn(module, args, output)
        self.prev = prev
        self.wrapper: object = None
        self.sinks: dict[Callable, tuple[list, int]] = {}  # a site hook -> (its session's staged list, its number)
        self.kind: tuple[bool, bool] | None = None  # what the wrapper stages when traced (None: it runs the callbacks)


# What the taps traced by torch.compile stage: (module, its input?, tensor), appended as a side effect of the graph
# (`_compiled.py`) and handed to the sessions' staged lists at a step's end (`route_traced`). One global, read by
# every tap: Dynamo checks it once per call, where a list reached through each tap was a chain of guards per tap.
_traced: list[tuple[nn.Module, bool, object]] = []


def route_traced() -> None:
    """Hand what traced taps staged, as (site number, tensor), to the staged list of each session whose site hook
    is on the module (dropped where none is left)."""
    items = _traced[:]
    del _traced[: len(items)]  # (another thread's graph may have appended since: those stay for it)
    for module, is_input, t in items:
        taps = module.__dict__.get(_TAPS)
        if taps is not None:
            sinks = taps.sinks
            for f in taps.pre if is_input else taps.post:
                sink = sinks.get(f)
                if sink is not None:
                    sink[0].append((sink[1], t))


def _stage_traced(self: nn.Module, args: tuple, kwargs: dict, stage_in: bool, stage_out: bool) -> Any:
    """A tapped module's call while Dynamo traces it: the class's forward, with its input and/or output appended to
    `_traced`. Dynamo guards what this reads: the module (already guarded), `type(self).forward` and two globals, so
    a tap adds the few guards of its wrapper and nothing per callback or slot (docs/design.md, "A tap under Dynamo")."""
    if stage_in:
        _traced.append((self, True, args[0] if args else kwargs.get("hidden_states")))
    out = type(self).forward(self, *args, **kwargs)
    if stage_out:
        _traced.append((self, False, out[0] if isinstance(out, (tuple, list)) else out))
    return out


class TapHandle:
    """What `register_forward_hook` returns, for a tap: `remove()` takes the callback out, and gives the module
    its own forward back once no tap is left (unless something has wrapped it since: then ours stays, empty)."""

    def __init__(self, module: nn.Module, taps: _Taps, callbacks: list[Callable], fn: Callable) -> None:
        self.module, self.taps, self.callbacks, self.fn = module, taps, callbacks, fn

    def remove(self) -> None:
        taps, module = self.taps, self.module
        if any(f is self.fn for f in self.callbacks):
            self.callbacks.remove(self.fn)
        taps.sinks.pop(self.fn, None)
        ours = module.__dict__.get("forward") is taps.wrapper
        if (taps.pre or taps.post) and ours:
            _wrap(module, taps)  # what the traced wrapper stages may have changed
        if taps.pre or taps.post or not ours:
            return
        if taps.prev is None:
            del module.forward
        else:
            module.forward = taps.prev
        del module.__dict__[_TAPS]


def tap(module: nn.Module, fn: Callable, *, pre: bool, sink: tuple[list, int] | None = None) -> object:
    """`fn(module, args, kwargs)` before the module's forward (`pre`), or `fn(module, args, output)` after it;
    returns a handle with `remove()`. Falls back to a hook when the module has hooks of its own.

    `sink`: (a list, a number) for a session's site hook, which stages its tensor itself when Dynamo traces it:
    while every callback on the module has one, the traced wrapper stages the tensor instead of calling them, and
    `route_traced` appends (number, tensor) to the list once the graph has run."""
    taps = module.__dict__.get(_TAPS)
    if taps is None:
        if module._forward_hooks or module._forward_pre_hooks:
            if pre:
                return module.register_forward_pre_hook(fn, with_kwargs=True)
            return module.register_forward_hook(fn)
        taps = _Taps(module.__dict__.get("forward"))
        module.__dict__[_TAPS] = taps
    elif module.__dict__.get("forward") is not taps.wrapper:  # someone wrapped ours since: a hook keeps its place
        return module.register_forward_pre_hook(fn, with_kwargs=True) if pre else module.register_forward_hook(fn)
    callbacks = taps.pre if pre else taps.post
    callbacks.append(fn)
    if sink is not None:
        taps.sinks[fn] = sink
    _wrap(module, taps)
    return TapHandle(module, taps, callbacks, fn)


def _wrap(module: nn.Module, taps: _Taps) -> None:
    """(Re)place the module's forward by the wrapper its callbacks need: one that, traced by Dynamo, stages what
    they would take (the class's forward, every callback a site hook with a sink), or one that calls them."""
    pres, posts = taps.pre, taps.post
    kind = None
    if taps.prev is None and all(f in taps.sinks for f in pres) and all(f in taps.sinks for f in posts):
        kind = (bool(pres), bool(posts))
    if taps.wrapper is not None and kind == taps.kind:
        return
    taps.kind = kind
    wrapper: Callable
    if taps.prev is None:  # the class's forward: the wrapper is bound to the module, as that forward is
        own = type(module).forward

        @functools.wraps(own)  # keeps the signature: transformers inspects forward's parameters
        def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            for f in pres:
                f(self, args, kwargs)
            out = own(self, *args, **kwargs)
            for f in posts:
                f(self, args, out)
            return out

        # One function per kind, so that what a traced wrapper stages is in its code (a constant to Dynamo, compared by
        # the guard on the code it already has), not in a closure cell or attribute it would guard per tap.
        forward = call
        if kind == (False, True):
            def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                if _compiling():
                    return _stage_traced(self, args, kwargs, False, True)
                return call(self, *args, **kwargs)
        elif kind == (True, False):
            def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                if _compiling():
                    return _stage_traced(self, args, kwargs, True, False)
                return call(self, *args, **kwargs)
        elif kind == (True, True):
            def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                if _compiling():
                    return _stage_traced(self, args, kwargs, True, True)
                return call(self, *args, **kwargs)
        functools.update_wrapper(forward, own)
        # Bound, not closing over the module: a closure's reference to it (or a bound method's) is the module
        # reached by a second path, which Dynamo checks with a guard in Python per tap per step.
        wrapper = types.MethodType(forward, module)
    else:  # a forward of the instance's own (someone's wrapper, a compiled function)
        inner = taps.prev

        @functools.wraps(inner)  # type: ignore[arg-type]
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for f in pres:
                f(module, args, kwargs)
            out = inner(*args, **kwargs)  # type: ignore[operator]
            for f in posts:
                f(module, args, out)
            return out

    taps.wrapper = wrapper
    module.forward = wrapper


def tapped(model: nn.Module) -> int:
    """Hooks and taps on the model's modules (0: nothing of probebus, or anyone else, is attached)."""
    n = 0
    for m in model.modules():
        taps = m.__dict__.get(_TAPS)
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + (len(taps.pre) + len(taps.post) if taps else 0)
    return n


class Hooks:
    """The session's taps and what they do on the model's thread.

    A step of at most `DEFER_ROWS` rows on a host model (every decode step) is captured at its end: each
    site's hook only keeps a reference to its tensor and the tensor's version counter, and the step's end
    copies them all in one loop. Between a model's layers every Python operation runs from caches the
    layers have just flushed: copying in each hook cost a step about three times its taps and bookkeeping
    (`benchmarks/paired_steps.py`; the figures: docs/design.md, "Costs behind the code"). A tensor the
    model writes into after its hook (its version counter moved) is not what the layer returned: that
    capture is dropped with a warning and the session goes back to copying in the hook. Steps under
    `torch.inference_mode` (no version counters), CUDA models and larger steps (prefills: holding every
    layer's output would raise the model's peak memory) copy in the hook.
    """

    def __init__(self, model: nn.Module, arch: Arch, copy: CopyPath, publisher: Publisher,
                 stop_ids: np.ndarray) -> None:
        self.model, self.arch, self._copy, self.publisher = model, arch, copy, publisher
        self.ids = IdentityTracker(stop_ids)
        self.active: set[str] = set()
        self.override: dict | None = None
        self._handles: dict[str, object] = {}
        self._top: list = []
        self._pending: list[tuple[str, list[str]]] = []
        self._lock = threading.RLock()
        self._model_thread: int | None = None
        self._ident: StepIdentity | None = None
        self._warned: set[str] = set()
        self.defer = copy._cuda_device is None  # captures of small steps wait for the step's end (see above)
        self._deferred: list[tuple[SiteKey, torch.Tensor, int]] | None = None  # this step's, while deferring
        # What taps traced by torch.compile stage: (the site's `_compiled.number`, tensor), filled once the graph
        # has run (`_compiled.py`).
        self._staged: list[tuple[int, torch.Tensor]] = []
        # Each site hook's own list (with its site's number), where it stages its tensor when Dynamo traces it (not
        # the usual case: `_stage_traced`), gathered into `_staged` at the step's end: one list shared by every hook
        # is one object reached through each hook's closure, which Dynamo checks with a guard in Python per tap.
        self._slots: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._keys: dict[int, SiteKey] = {}
        self._fired = 0  # captures taken in this step outside the deferred list (see `_on_step_end`)

    def change(self, op: str, names: list[str]) -> None:
        """Add or remove sites; from another thread while a forward may run, at the next step."""
        with self._lock:
            if op == "remove":
                self.active.difference_update(names)  # the hooks stop capturing right now
            me = threading.get_ident()
            if self._model_thread is None or self._model_thread == me:
                self._apply(op, names)
            else:  # another thread may be inside forward: hook dicts change at the next step
                self._pending.append((op, names))

    def remove_all(self) -> None:
        with self._lock:
            if threading.get_ident() == self._model_thread and (self._gather() or self._staged):
                self._take_staged()
            if self._deferred and threading.get_ident() == self._model_thread:
                self._end_deferred()  # a forward that raised left its captures: they go out with the rest
            self._deferred = None  # (from another thread a forward may be running: its partial step is not sent)
            self.active.clear()
            self._pending.clear()
            for h in list(self._handles.values()) + self._top:
                h.remove()  # type: ignore[attr-defined]
            self._handles.clear()
            self._top.clear()

    def _apply(self, op: str, names: list[str]) -> None:
        if op == "add":
            for site in names:
                if site in self._handles:  # tapped already (a second tap would capture it twice)
                    self.active.add(site)
                    continue
                point = self.arch.locate(site)
                key = SiteKey.of(site)
                pre = point.kind == "pre"
                index = _compiled.number(site)
                self._keys[index] = key
                slot: list[torch.Tensor] = []
                self._slots[site] = (index, slot)
                self._handles[site] = tap(point.module, self._site_hook(key, pre, slot), pre=pre,
                                         sink=(self._staged, index))
                self.active.add(site)
        else:
            for site in names:
                if site in self.active:  # added back since this removal was queued (`change`): its tap stays
                    continue
                h = self._handles.pop(site, None)
                if h is not None:
                    h.remove()  # type: ignore[attr-defined]
                    number, slot = self._slots.pop(site, (0, []))
                    self._staged += [(number, t) for t in slot]  # (a forward that raised may have left some)
        if self._handles and not self._top:
            # Module hooks, not taps: they run in `Module.__call__`, so a `model.forward` compiled before or after
            # attach leaves the step's identity to eager code (a tap would be inside the compiled forward).
            self._top = [self.model.register_forward_pre_hook(_compiled.eager(self._on_step_start), with_kwargs=True),
                         self.model.register_forward_hook(_compiled.eager(self._on_step_end))]
        elif not self._handles and self._top:
            for h in self._top:
                h.remove()
            self._top = []

    # --- hot path ------------------------------------------------------------------------------
    def _on_step_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._model_thread = threading.get_ident()
        if self._pending:
            with self._lock:
                for op, names in self._pending:
                    self._apply(op, names)
                self._pending.clear()
        ids = kwargs.get("input_ids", args[0] if args else None)
        ref = ids if ids is not None else kwargs.get("inputs_embeds")
        if ref is None:
            self._ident = None
            return
        if _traced and self._ident is not None:  # the last compiled forward raised after its graph had run: what it
            self._gather()  # staged goes out as that step's, and Dynamo's guard finds the list empty again
            self._take_staged()
        if self._deferred:  # the last forward raised before its end: its captures still go out
            self._end_deferred()
        self._copy.in_step = True  # no other thread packs waiting steps until this one ends (`_pending.py`)
        tracker = self.ids
        self._fired = 0
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        shape = ref.shape
        self._ident = ident = tracker.begin(ids, kwargs.get("attention_mask"), cache_length(cache), shape[0],
                                            shape[1], self.override, ref.device)
        self._deferred = ([] if self.defer and ident.batch * ident.seq_len <= DEFER_ROWS
                          and not torch.is_inference_mode_enabled() else None)
        if tracker.warnings:
            for msg in tracker.warnings:
                self._warn_once(msg, msg)
            tracker.warnings.clear()

    def _on_step_end(self, module: nn.Module, args: tuple, output: object) -> None:
        """The step is over: its deferred captures are copied and everything it staged goes to the publisher."""
        staged, cp = self._staged, self._copy
        if self._gather() or staged:
            ident = self._ident
            # The common compiled step (a decode step, every tapped site active, nothing else captured): its graph
            # outputs wait as they are, and the rest of this (keys, versions' check, packing) runs in the pack.
            if (self._deferred == [] and ident is not None and len(self.active) == len(self._handles)
                    and cp.wait_staged(staged, ident, self._keys)):
                staged.clear()
                self._ident = self._deferred = None
                if cp.failed:
                    self._report(cp)
                if cp.due_at_step_end:
                    self._flush(cp)
                cp.in_step = False
                self.publisher.step_done()
                return
            self._take_staged()
        if self._ident is not None and self.active and not self._deferred and not self._fired:
            self._warn_once("bypass", "probebus: a forward of the attached model ran none of its taps (no site "
                            "captured anything): something runs the model without its modules' forwards, e.g. a "
                            "graph exported or compiled elsewhere (torch.export, AOTInductor, a CUDA graph "
                            "captured by hand). Attach before exporting, or compile with torch.compile, whose "
                            "graphs keep the taps")
        if self._deferred:
            self._end_deferred()
        self._ident = self._deferred = None
        if cp.failed:
            self._report(cp)
        self._flush(cp)
        cp.in_step = False
        self.publisher.step_done()

    def _flush(self, cp: CopyPath) -> None:
        try:
            cp.flush_device(block=False)  # sends the step's small captures first
        except Exception as exc:  # never crash the model being observed
            self._warn_once(repr(type(exc)), f"probebus: sending a step's captures failed: {exc!r}")

    def _gather(self) -> bool:
        """Move what the traced taps staged this step into `_staged` as (site number, tensor): the wrappers' (in the
        order the graph ran them), then the site hooks' own slots (in the order the sites were added); True if any."""
        staged = self._staged
        n = len(staged)
        if _traced:
            route_traced()
        for number, slot in self._slots.values():
            if slot:
                staged += [(number, t) for t in slot]
                slot.clear()
        return len(staged) > n

    def _site_hook(self, key: SiteKey, pre: bool, slot: list) -> Callable:
        """The tap of one site: before its module's forward (`pre`: the tensor is its input) or after it.

        A closure over what it reads: between the model's layers every object a hook touches is a cache miss,
        and a partial of a bound method touched three more than this. Under torch.compile the module's wrapper
        usually stages the tensor without calling this (`_stage_traced`); where it does call it (a wrapper with
        other callbacks, a module with hooks of its own), this stages the tensor in its own `slot` for the step's
        end (`_gather`, `_take_staged`, `_compiled.py`), reading as little as it can: what it reads, Dynamo checks
        before every call of the compiled forward (docs/design.md, "A tap under Dynamo")."""
        active, name, tensor, capture = self.active, key.name, torch.Tensor, self._capture

        def take(t: object) -> None:  # eager mode: defer to the step's end or capture now (as `_take_staged` does)
            if isinstance(t, tensor) and name in active:
                deferred = self._deferred
                if deferred is not None:
                    deferred.append((key, t, t._version))
                else:
                    capture(key, t)

        if pre:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                t = args[0] if args else kwargs.get("hidden_states")
                if _compiling():
                    slot.append(t)
                else:
                    take(t)
        else:
            def hook(module: nn.Module, args: tuple, out: object) -> None:
                t = out[0] if isinstance(out, (tuple, list)) else out
                if _compiling():
                    slot.append(t)
                else:
                    take(t)
        return hook

    def _take_staged(self) -> None:
        """The tensors that taps traced by torch.compile staged (`_compiled.py`), each taken as its tap takes one in
        eager mode. They are outputs of the graph, which nothing writes into later."""
        staged, active, get, deferred = self._staged, self.active, self._keys.get, self._deferred
        tensor = torch.Tensor
        for index, t in staged:
            key = get(index)
            if key is not None and key.name in active and isinstance(t, tensor):
                if deferred is not None:  # as the site tap's eager branch does, inline on this path too
                    deferred.append((key, t, t._version))
                else:
                    self._capture(key, t)
        staged.clear()

    def _end_deferred(self) -> None:
        """Hand the step's deferred tensors, in the order their hooks ran, to the copy path, which packs them now
        or with later steps' (`_pending.py`)."""
        deferred, self._deferred = self._deferred or [], None
        ident = self._ident
        if ident is None:
            return
        cp = self._copy
        try:
            cp.defer_step(deferred, ident)
        except Exception as exc:  # never crash the model being observed
            self._warn_once(repr(type(exc)), f"probebus: a step's captures failed and were dropped: {exc!r}")
        if cp.failed:
            self._report(cp)

    def _report(self, cp: CopyPath) -> None:
        """Warn about the deferred captures that packing dropped (a tensor written since its hook: from then on
        this session copies each capture in its hook)."""
        failed, cp.failed = cp.failed, []
        for key, exc in failed:
            if exc is not None:
                self._warn_once(repr(type(exc)), f"probebus: capture of {key.name} failed and was dropped: {exc!r}")
                continue
            self.defer = False  # from the next step on, every capture is copied in its hook
            self._warn_once("inplace", f"probebus: the model wrote into {key.name}'s tensor after its hook "
                            "returned; that capture was dropped, and this session now copies each capture "
                            "inside its hook")

    def _capture(self, key: SiteKey, t: torch.Tensor, *, hold: bool = True) -> None:
        cp = self._copy
        self._fired += 1
        try:
            ident = self._ident
            if ident is None:  # the layer ran outside a forward of the attached model: no step end follows
                cp.in_step = True
                try:
                    cp.capture(key, t, self._ident_from_shape(t))
                    cp.flush_device(block=False)  # CPU: sends it now; CUDA: marks its copy for a later boundary
                finally:
                    cp.in_step = False
            else:
                cp.capture(key, t, ident, hold=hold)
        except Exception as exc:  # never crash the model being observed (the copy path counted it dropped)
            self._warn_once(repr(type(exc)), f"probebus: capture of {key.name} failed and was dropped: {exc!r}")

    def _ident_from_shape(self, t: torch.Tensor) -> StepIdentity:
        self._warn_once("noctx", "probebus: a probed module ran outside a forward of the attached model; "
                        "captures get fresh seq_ids and positions 0..S-1")
        batch, seq_len = (t.shape[0], t.shape[1]) if t.dim() == 3 else (1, t.shape[0])
        tracker = self.ids
        tracker.step += 1
        pos = np.arange(seq_len, dtype=np.int64)[None, :]
        tokens = np.full((batch, seq_len), -1, dtype=np.int64)
        return StepIdentity(tracker.step, PREFILL, batch, seq_len, None, tracker.new_seq_ids(batch),
                            pos, tokens, t.device)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)
