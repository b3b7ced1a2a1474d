"""Probes inside one vLLM worker: the same sites and wire format, identity from vLLM's flat batch.

    probe = VllmProbe(worker, sites, endpoint=None, policy="complete", run=new_run(), ...)  # WorkerExtension does
    probe.pause(); probe.resume()              # taps off / on between steps
    probe.close(timeout)                       # the end of stream; returns the final stats

Runs in the worker process (installed by `probe.vllm.WorkerExtension` through
`collective_rpc`); the caller never imports vLLM for it. vLLM runs one flat batch of
tokens per step, many requests mixed, prefills chunked; which request, position, token
and phase each row is comes from the model runner's host arrays (`_identity.py`), and
where each site is read from the model is `_arch.py`.

In vLLM's default compiled mode the same sites are tapped before vLLM compiles the model, and
`VllmProbe` switches those taps on instead of adding its own (`_compiled.py`).
"""

from __future__ import annotations

import logging
import os
import socket
import time

import torch
from torch import nn

from .. import _discovery
from .._copy import CopyPath
from .._curve import curve_settings
from .._endpoint import bind_address, remove_private
from .._exit import close_at_exit, closed
from .._hooks import tap
from .._identity import StepIdentity
from .._placement import parent_cpus
from .._publisher import MAX_DELAY_S, ZERO_COPY_MIN, Publisher
from .._sites import SiteKey
from .._version import __version__
from .._wire import REQUESTS_TOPIC, VERSION, encode_control
from ._arch import VllmArch
from ._common import EXTENSION, SITES_ENV
from ._compiled import Dormant, Switch, dormant_of
from ._defer import Check, Deferral
from ._identity import FlatBatchIdentity

log = logging.getLogger("probebus")


class VllmProbe:
    """One worker's probes. Publishes only from tensor-parallel rank 0 (the residual stream,
    attention and MLP outputs are all-reduced, so every TP rank holds the same values);
    each pipeline stage publishes the layers it computes."""

    def __init__(self, worker: object, sites: list[str], *, endpoint: str | None, policy: str, run: str,
                 capacity_bytes: int, stall_timeout: float | None, model_name: str,
                 io_cpus: list[int] | None = None, max_delay: float = MAX_DELAY_S, allow_remote: bool = False,
                 curve_secret_key: str | None = None, curve_clients: list[str] | None = None) -> None:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        runner = worker.model_runner  # type: ignore[attr-defined]
        cfg = worker.vllm_config  # type: ignore[attr-defined]
        self.runner = runner
        self.arch = VllmArch(runner.get_model())
        self._dormant = _dormant(cfg, self.arch.model)  # None: eager mode, where the taps go in at attach
        self.tp_rank = get_tensor_model_parallel_rank()
        self.pp_rank = get_pp_group().rank_in_group
        self.run = run
        self.policy = policy
        self.model_name = model_name
        self.started = time.time()
        # Once: to_diff_dict + JSON + sha256 of the config cost a millisecond, and `info()` runs at every step
        # that brings a new request (docs/design.md, "Costs behind the code", Session info).
        self._config_hash = _discovery.config_hash(cfg.model_config.hf_config)
        self.sites = [s for s in self.arch.local_sites() if s in set(sites)]
        if self._dormant is not None:
            untapped = [s for s in self.sites if s not in self._dormant.names]
            if untapped:
                raise RuntimeError(f"probebus: this engine's compiled model has no taps for {', '.join(untapped[:4])}"
                                   f"{' ...' if len(untapped) > 4 else ''}: it was started with {SITES_ENV}="
                                   f"{os.environ.get(SITES_ENV, '')!r}; restart the engine with those sites in "
                                   f"{SITES_ENV} (or without it: every site), or attach to the sites it has")
        self.wanted = frozenset(self.sites)
        self.publishing = self.tp_rank == 0 and bool(self.sites)
        self._ipc_dir: str | None = None
        self._handles: list = []
        self._idents: list[StepIdentity] = []
        self._flat = FlatBatchIdentity()  # request, position, token and phase of each row, step by step
        self._flat.watch(getattr(runner, "requests", ()))  # requests running at attach: `joined` in the map
        self._defer = Deferral(enabled=runner.device.type == "cpu")  # decode steps captured at their end
        self._deferred: list | None = None  # this step's captures, while deferring
        self._check: Check | None = None  # this step's, while checking that deferring is safe
        self._closed = False
        self.publisher: Publisher | None = None
        self.endpoint = ""
        if not self.publishing:
            return
        secret, clients = curve_settings(curve_secret_key, curve_clients)
        endpoint, self._ipc_dir = bind_address(endpoint, allow_remote=allow_remote, curve=secret is not None,
                                               prefix="probebus-vllm-")
        cpus = spare_cpus() if io_cpus is None else set(io_cpus) or None
        self.publisher = Publisher(endpoint, run=run, policy=policy, sndhwm=max(64, capacity_bytes // ZERO_COPY_MIN),
                                   curve_secret_key=secret, stall_timeout=stall_timeout, io_cpus=cpus,
                                   max_delay=max_delay, curve_clients=clients)
        self.endpoint = self.publisher.endpoint
        self._copy = CopyPath(self.publisher, run=run.encode(), capacity=capacity_bytes,
                              cuda_device=None if runner.device.type == "cpu" else runner.device)
        self.publisher.idle_packer = self._copy.pack_stale  # waiting decode steps of an engine gone idle
        self._tap()
        self.publisher.set_info(self.info)  # built when an info goes out (a new subscriber), never per step
        self._registered = _discovery.register(_discovery.SessionInfo.from_dict(self.info()))
        close_at_exit(self)  # a worker that exits without detach still sends its held steps and the end

    def _tap(self) -> None:
        if self._dormant is not None:  # compiled: the taps are in the graph already, this switches them on
            self._handles = [Switch(self._dormant, self)]
            return
        model = self.arch.model
        self._handles = [tap(model, self._step_start, pre=True), tap(model, self._step_end, pre=False)]
        self._handles += [self.arch.hook(site, self._capture) for site in self.sites]

    @property
    def paused(self) -> bool:
        return self.publishing and not self._handles

    def pause(self, *, flush: bool = True) -> None:
        """Take every tap off the model until `resume()`: its steps run unprobed (collective_rpc runs between
        steps). `flush`: send what was held for a later burst now, since no step may come soon."""
        if self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []
            if self._deferred:
                self._end_deferred()
            self._idents, self._deferred, self._check = [], None, None
            if flush:
                self._copy.flush_device(block=True)

    def resume(self) -> None:
        if self.publisher is not None and not self._handles and not self._closed:
            self._flat.watch(getattr(self.runner, "requests", ()))  # what ran while paused: joined, not cached
            self._tap()

    # --- the model's thread ---------------------------------------------------------------------
    def _step_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._deferred:  # the last forward raised before its end: its captures still go out
            self._end_deferred()
        self._idents = self._flat.step(self.runner, args, kwargs)
        self._deferred, self._check = self._defer.begin(self._idents)
        self._copy.in_step = True

    def _capture(self, key: SiteKey, t: torch.Tensor) -> None:
        deferred = self._deferred
        if deferred is not None:  # a decode step: copied at its end, with warm caches (`_defer.py`)
            deferred.append((key, t, None))
            return
        try:
            for ident in self._idents:
                self._copy.capture(key, t, ident)
            if self._check is not None:
                self._check.note(key, t)
        except Exception:  # never crash the engine being observed (the copy path counted it dropped)
            pass

    def _end_deferred(self) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred and self._idents:
            if self._dormant is not None:  # graph outputs, which nothing writes into: they may wait (`_pending.py`)
                self._copy.defer_step(deferred, self._idents[0])
            else:
                self._copy.capture_deferred(deferred, self._idents[0])  # counts what failed as dropped
            self._copy.failed.clear()  # (counted as dropped; vLLM's tensors have no version to tell of)

    def _step_end(self, module: nn.Module, args: tuple, output: object) -> None:
        pub = self.publisher
        assert pub is not None
        try:
            if self._deferred:
                self._end_deferred()
            check, self._check = self._check, None
            changed = [] if check is None else self._defer.end(check, self._idents[0].batch)
            if changed:
                log.warning("probebus: vLLM wrote into a captured tensor after its hook (%s); this session now "
                            "copies each capture in its hook", ", ".join(changed[:3]))
        except Exception:  # never crash the engine being observed
            pass
        self._idents, self._deferred = [], None
        try:
            new = self._flat.new_requests()
            if new:  # only the new entries (the info, which has them all, goes to new subscribers)
                if self._copy.pending:  # the steps before the entries go before them
                    self._copy.pack_now()
                    self._copy.flush(hold=True)
                pub.send_control(encode_control(REQUESTS_TOPIC, {"run": self.run, "requests": new,
                                                                 "recomputed": self._flat.recomputed}), hold=True)
            self._copy.flush_device(block=False)  # the step's small captures, in one burst
        except Exception:  # never crash the engine being observed
            pass
        self._copy.in_step = False
        pub.step_done()

    # --- control (called through collective_rpc) ----------------------------------------------
    def info(self) -> dict:
        cfg = self.runner.vllm_config.model_config
        return _discovery.SessionInfo(
            run=self.run, endpoint=self.endpoint, pid=os.getpid(), model=self.model_name,
            config_hash=self._config_hash, dtype=str(cfg.dtype).removeprefix("torch."),
            sites=self.sites, policy=self.policy, probebus_version=__version__, wire_version=VERSION,
            started=self.started, host=socket.gethostname(), backend="vllm",
        ).to_dict() | {"tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
                       "requests": self._flat.requests(), "recomputed": self._flat.recomputed}

    def stats(self) -> dict:
        if self.publisher is None:
            return {"captured": 0, "published": 0, "dropped": 0, "bytes": 0, "stall_seconds": 0.0,
                    "subscribers": 0, "degraded": False, "publishing": False, "queued": 0}
        pub, cp = self.publisher, self._copy
        return {"captured": cp.captured + cp.pending, "published": pub.published, "dropped": cp.dropped + pub.dropped,
                "bytes": pub.bytes, "stall_seconds": pub.stall_seconds, "subscribers": len(pub.subscribers),
                "degraded": pub.degraded, "publishing": True, "paused": self.paused,
                "deferred_steps": self._defer.steps, "recomputed": self._flat.recomputed, "queued": cp.queued}

    def wait_for_subscribers(self, n: int, timeout: float | None) -> int:
        pub = self.publisher
        if pub is None:
            return n
        pub.wait_until(lambda: len(pub.subscribers) >= n, timeout)
        return len(pub.subscribers)

    def close(self, timeout: float) -> dict:
        if self._closed:  # idempotent: detach, then the exit hook (`_exit.py`)
            return self.stats()
        self._closed = True
        self.pause(flush=False)
        if self.publisher is not None:
            self._copy.flush_device(block=True)
        out = self.stats()
        if self.publisher is not None:
            self.publisher.close({"run": self.run, "captured": out["captured"], "published": out["published"],
                                  "dropped": out["dropped"]}, timeout)
            _discovery.unregister(self._registered)
        remove_private(self._ipc_dir)
        closed(self)
        return out


def _dormant(cfg: object, model: nn.Module) -> Dormant | None:
    """The compiled model's dormant taps (`_compiled.py`); None in eager mode. A compiled model without
    them would capture nothing: that is an error naming why."""
    mode = int(cfg.compilation_config.mode)  # type: ignore[attr-defined]
    if mode == 1:  # the runner compiles the outer model with guards: taps added now would put the identity in it
        raise RuntimeError("probebus cannot capture with compilation_config mode=STOCK_TORCH_COMPILE, which "
                           "compiles the whole outer model: use vLLM's default mode, or enforce_eager=True")
    # enforce_eager (compilation mode NONE), or a model vLLM runs uncompiled: the taps go in at attach
    if mode == 0 or getattr(getattr(model, "model", None), "do_not_compile", True):  # type: ignore[attr-defined]
        return None
    found = dormant_of(model)
    if isinstance(found, Dormant):
        found.check()
        return found
    if isinstance(found, str):
        raise RuntimeError(f"probebus cannot capture in this engine's compiled model with {found}, or "
                           "enforce_eager=True")
    raise RuntimeError("probebus: this engine compiles its model (vLLM's default mode) and its workers were "
                       "started without probebus's taps, which must be in the model before vLLM compiles it. "
                       f"Start the engine with **probe.vllm.ENGINE_KWARGS (worker_extension_cls='{EXTENSION}'), "
                       "or with enforce_eager=True")


def spare_cpus() -> set[int] | None:
    """Cores this process may use but its threads are not bound to, or None when there are none.

    vLLM's CPU worker binds itself, and every thread it starts later, to its OpenMP cores
    (VLLM_CPU_OMP_THREADS_BIND), so without this ZeroMQ's I/O thread would run on the
    model's core. The cores the engine process (our parent) may use are the ones vLLM left."""
    allowed = parent_cpus() or set(range(os.cpu_count() or 1))
    return (allowed - os.sched_getaffinity(0)) or None
