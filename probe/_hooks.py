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
"""

from __future__ import annotations

import threading
import warnings
from functools import partial

import numpy as np
import torch
from torch import nn

from ._arch import Arch
from ._copy import CopyPath, SiteKey
from ._identity import PREFILL, IdentityTracker, StepIdentity, cache_length
from ._publisher import Publisher
from ._sites import site_layer


class Hooks:
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
            self.active.clear()
            self._pending.clear()
            for h in list(self._handles.values()) + self._top:
                h.remove()  # type: ignore[attr-defined]
            self._handles.clear()
            self._top.clear()

    def _apply(self, op: str, names: list[str]) -> None:
        if op == "add":
            for site in names:
                point = self.arch.locate(site)
                key = SiteKey(site, site.encode(), site_layer(site))
                if point.kind == "pre":
                    h = point.module.register_forward_pre_hook(partial(self._pre_hook, key), with_kwargs=True)
                else:
                    h = point.module.register_forward_hook(partial(self._post_hook, key))
                self._handles[site] = h
                self.active.add(site)
        else:
            for site in names:
                h = self._handles.pop(site, None)
                if h is not None and site not in self.active:
                    h.remove()  # type: ignore[attr-defined]
        if self._handles and not self._top:
            self._top = [
                self.model.register_forward_pre_hook(self._on_step_start, with_kwargs=True),
                self.model.register_forward_hook(self._on_step_end),
            ]
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
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        tracker = self.ids
        self._ident = tracker.begin(ids, kwargs.get("attention_mask"), cache_length(cache), ref.shape[0],
                                    ref.shape[1], self.override, ref.device)
        if tracker.warnings:
            for msg in tracker.warnings:
                self._warn_once(msg, msg)
            tracker.warnings.clear()

    def _on_step_end(self, module: nn.Module, args: tuple, output: object) -> None:
        self._ident = None
        try:
            self._copy.flush_device(block=False)  # sends the step's small captures first
            self.publisher.step_done()
        except Exception as exc:  # never crash the model being observed
            self._warn_once(repr(type(exc)), f"probebus: sending a step's captures failed: {exc!r}")

    def _pre_hook(self, key: SiteKey, module: nn.Module, args: tuple, kwargs: dict) -> None:
        t = args[0] if args else kwargs.get("hidden_states")
        if isinstance(t, torch.Tensor) and key.name in self.active:
            self._capture(key, t)

    def _post_hook(self, key: SiteKey, module: nn.Module, args: tuple, output: object) -> None:
        t = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(t, torch.Tensor) and key.name in self.active:
            self._capture(key, t)

    def _capture(self, key: SiteKey, t: torch.Tensor) -> None:
        cp = self._copy
        before = cp.captured
        try:
            ident = self._ident
            if ident is None:  # the layer ran outside a forward of the attached model: no step end follows
                cp.capture(key, t, self._ident_from_shape(t))
                cp.flush_device(block=False)  # CPU: sends it now; CUDA: marks its copy for a later boundary
            else:
                cp.capture(key, t, ident)
        except Exception as exc:  # never crash the model being observed
            cp.captured = before + 1
            cp.dropped += 1
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
