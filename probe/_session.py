"""attach(): hooks on a live model that hand each capture to the bus and return.

    with probe.attach(model, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        model.generate(**inputs, max_new_tokens=16)
    print(session.stats)

Each site is one tap on its module's forward (after it for outputs, before it for
inputs; `_hooks.tap`, which PyTorch calls at the cost of a plain call, unlike a hook)
plus a tap before and after the model's own forward: the first computes the step's
identity once (`_identity.py`), a site tap copies the valid rows into a message
(`_copy.py`) that ZeroMQ sends from its own I/O thread, and the last reads any new
subscriptions. Removing the last site gives every module its own forward back.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
import zmq
from torch import nn

from . import _discovery
from ._arch import SiteError, resolve_arch
from ._copy import CopyPath
from ._curve import Clients, curve_settings
from ._endpoint import bind_address, remove_private
from ._exit import close_at_exit, closed
from ._hooks import Hooks
from ._identity import stop_tokens
from ._malloc import keep_freed_frames
from ._publisher import MAX_DELAY_S, ZERO_COPY_MIN, Publisher
from ._sites import expand_sites
from ._stats import POLICIES, ProbeStats
from ._subscriber import Subscriber
from ._version import __version__
from ._wire import PHASE_CODE, VERSION


class ProbeSession:
    """Probes attached to one model. Create with `probe.attach`."""

    def __init__(self, model: nn.Module, sites: str | Iterable[str], *, endpoint: str | None, policy: str,
                 capacity_bytes: int, run: str | None, sndhwm: int | None, allow_remote: bool,
                 curve_secret_key: bytes | str | None, strip_finished: bool, stall_timeout: float | None,
                 max_delay: float = MAX_DELAY_S, curve_clients: Clients = None, borrow: bool = True,
                 tune_malloc: bool = True) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.model = model
        self.arch = resolve_arch(model)
        if tune_malloc:  # freed heap stays mapped: no probed step faults its pages back in (see attach)
            keep_freed_frames()
        self.policy = policy
        self.run = run or uuid.uuid4().hex[:12]
        self._started = time.time()
        self._config_hash = _discovery.config_hash(getattr(model, "config", None))  # once: it costs a millisecond
        curve_secret_key, clients = curve_settings(curve_secret_key, curve_clients)
        self.curve_public_key = None if curve_secret_key is None else zmq.curve_public(curve_secret_key)
        """What subscribers pass as `curve_server_key` (Z85), or None without CURVE."""
        # With an allowlist, one more admitted client key for this process's own subscribers (an ArrowRecorder
        # given the session), which otherwise could not read their own session.
        self.curve_local_client = None if clients is None else zmq.curve_keypair()
        if clients is not None:
            clients = clients | {self.curve_local_client[0]}
        endpoint, self._ipc_dir = bind_address(endpoint, allow_remote=allow_remote,
                                               curve=curve_secret_key is not None)
        param = next(model.parameters(), None)
        cuda = param.device if param is not None and param.is_cuda else None
        if sndhwm is None:  # small messages queued in ZeroMQ then stay within about capacity_bytes
            sndhwm = max(64, capacity_bytes // ZERO_COPY_MIN)
        self.publisher = Publisher(endpoint, run=self.run, policy=policy, sndhwm=sndhwm,
                                   curve_secret_key=curve_secret_key, stall_timeout=stall_timeout,
                                   max_delay=max_delay, curve_clients=clients)
        self._copy = CopyPath(self.publisher, run=self.run.encode(), capacity=capacity_bytes, cuda_device=cuda,
                              borrow=borrow)
        self.publisher.idle_packer = self._copy.pack_stale  # a model that stopped stepping strands nothing
        self.ring = self._copy.ring
        stop = stop_tokens(model) if strip_finished else np.empty(0, dtype=np.int64)
        self._hooks = Hooks(model, self.arch, self._copy, self.publisher, stop)
        self._closed = False
        self._paused: list[str] | None = None  # the sites a pause took off, until resume()
        self._muted = False  # that pause left the taps in place, capturing nothing (paused from another thread)
        self._pause_lock = threading.Lock()
        self._announced = False
        self._registered = None
        try:
            self.add(sites)
        except BaseException:
            self.close()
            raise
        info = self.info
        self.publisher.set_info(info.to_dict())
        self._registered = _discovery.register(info)
        self._announced = True
        # A process that ends without close() still sends its held steps and the end of stream; the registry holds
        # what ending the stream needs, not the session (which would keep the model alive until exit).
        self._at_exit = _StreamEnd(self._copy, self.publisher, self.run, self._registered, self._ipc_dir)
        close_at_exit(self._at_exit)

    # --- public API --------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """Where subscribers connect (`ipc://...` private to this user by default)."""
        return self.publisher.endpoint

    @property
    def step(self) -> int:
        """Number of forward steps of the attached model seen so far (the last capture's `step`)."""
        return self._hooks.ids.step

    @property
    def sites(self) -> list[str]:
        active = self._hooks.active if self._paused is None else set(self._paused)
        return [s for s in self.arch.sites() if s in active]

    @property
    def paused(self) -> bool:
        return self._paused is not None

    def pause(self) -> None:
        """Take every tap off the model until `resume()`: its forwards run unprobed and publish nothing.

            session.pause()
            model.generate(...)   # not captured, at the model's own speed
            session.resume()

        The site list that subscribers and `probe.live_sessions()` see stays as it is: a pause is not a
        change of what the session captures, so nothing is announced (far cheaper than add/remove, which
        announce the new list and rewrite the discovery file: docs/design.md, "Costs behind the code").

        From any thread. From a thread other than the model's, while the model may be inside a forward, the
        taps stay and capture nothing until `resume()` (taking them off mid-forward took the step's end with
        them: captures stopped for good, or came with fresh seq_ids and positions); the model's forwards are
        still counted as steps then, so identities stay right across the pause."""
        if self._closed:
            raise RuntimeError("this probe session is closed")
        with self._pause_lock:
            if self._paused is None:
                names = sorted(self._hooks.active)
                self._muted = not self._on_model_thread()
                if self._muted:
                    self._hooks.active.difference_update(names)  # each site's tap checks this set: off at once
                else:
                    self._hooks.change("remove", names)
                self._paused = names
        self._copy.pack_idle()  # steps that wait unpacked (`_pending.py`), unless a forward runs on another thread
        self.publisher.flush_held()  # nothing waits for a step that may not come soon

    def _on_model_thread(self) -> bool:
        """No forward of the model can be running on another thread: we are its thread, or it never ran one."""
        model_thread = self._hooks._model_thread
        return model_thread is None or model_thread == threading.get_ident()

    def flush(self) -> None:
        """Send the decode steps held for a later burst now, instead of once they are a linger old.

            out = model.generate(...)
            session.flush()       # every captured step is on its way to the subscribers

        From any thread. A step still running keeps its captures until its end, as always."""
        if not self._closed:
            self._copy.pack_idle()
            self.publisher.flush_held()

    def sync(self) -> None:
        """Send every capture of the steps that have ended, waiting for a CUDA model's device copies to land.

            with session.context(phase="verify", ...):
                model(...)
            session.sync()        # this step's captures are on the bus before the next step

        For a consumer that needs a step's captures before the model's next step (a drafter fed by the bus).
        On a CUDA model the copies are otherwise sent at a later step boundary, once they have landed, so
        that the model's thread never waits for them; here it waits, like any read of the step's outputs.
        On the model's thread only (it owns the staging ring)."""
        if not self._closed:
            self._copy.flush_device(block=True)
            self.flush()

    def resume(self) -> None:
        """Put back the taps `pause()` took off; from any thread (see `pause`)."""
        with self._pause_lock:
            if self._paused is None or self._closed:
                return
            names, self._paused = self._paused, None
            hooks = self._hooks
            if self._muted:  # the taps never left: capture again from the next site hook on
                hooks.active.update(names)
            elif self._on_model_thread():
                hooks.change("add", names)
            else:
                # The taps are off, so the step start that applies a pending change would never run: put them back
                # now, silent (the model may be inside an unprobed forward, whose layers must not capture without
                # a step identity), and let the next forward's step start switch them on, at a step boundary.
                with hooks._lock:
                    hooks._apply("add", names)
                    hooks.active.difference_update(names)
                    hooks._pending.append(("add", names))

    @property
    def info(self) -> _discovery.SessionInfo:
        """What subscribers receive as session info (and `probe.live_sessions()` lists)."""
        cfg = getattr(self.model, "config", None)
        param = next(self.model.parameters(), None)
        return _discovery.SessionInfo(
            run=self.run, endpoint=self.endpoint, pid=os.getpid(), model=str(getattr(cfg, "name_or_path", "") or
                                                                              type(self.model).__name__),
            config_hash=self._config_hash, dtype=str(param.dtype).removeprefix("torch.") if param is not None
            else "", sites=self.sites, policy=self.policy, probebus_version=__version__, wire_version=VERSION,
            started=self._started, host=socket.gethostname(), backend="transformers")

    @property
    def stats(self) -> ProbeStats:
        pub, cp = self.publisher, self._copy
        return ProbeStats(cp.captured + cp.pending, pub.published, cp.dropped + pub.dropped, pub.bytes,
                          pub.stall_seconds, len(pub.subscribers), cp.queued, pub.degraded, cp.torn)

    def add(self, sites: str | Iterable[str]) -> list[str]:
        """Start capturing more sites; returns the concrete names added."""
        self.resume()  # a change of sites ends a pause: the new list is what runs and is announced
        names = [s for s in expand_sites(self.arch, sites) if s not in self._hooks.active]
        self._change("add", names)
        return names

    def remove(self, sites: str | Iterable[str]) -> list[str]:
        """Stop capturing sites (effective for the next capture; hooks go at the next step)."""
        self.resume()
        names = [s for s in expand_sites(self.arch, sites) if s in self._hooks.active]
        self._change("remove", names)
        return names

    def wait_for_subscribers(self, n: int = 1, timeout: float | None = 10.0) -> int:
        """Block until `n` subscribers are connected, so nothing is published into the void."""
        pub = self.publisher
        if not pub.wait_until(lambda: len(pub.subscribers) >= n, timeout):
            raise TimeoutError(f"only {len(pub.subscribers)} of {n} subscribers connected to {self.endpoint} "
                               f"within {timeout}s")
        return len(pub.subscribers)

    def wait_for(self, subscriber: Subscriber, timeout: float | None = 10.0) -> None:
        """Block until the publisher has registered this particular subscriber.

        Unlike counting (`wait_for_subscribers`), this cannot be fooled by another
        subscriber leaving at the same moment.
        """
        pub = self.publisher
        if not pub.wait_until(lambda: subscriber.presence in pub.subscribers, timeout):
            raise TimeoutError(f"the subscriber did not reach {self.endpoint} within {timeout}s")

    def new_seq_ids(self, n: int) -> torch.Tensor:
        """Reserve n sequence ids for a custom loop that passes `seq_ids` to `context()` (ids no other sequence of
        this session gets), e.g. a loop that also runs other forwards on the model between its own steps."""
        return torch.from_numpy(self._hooks.ids.new_seq_ids(n))

    @contextmanager
    def context(self, *, phase: str | None = None, seq_ids: Sequence[int] | torch.Tensor | None = None,
                positions: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> Iterator[None]:
        """Set identity explicitly for forwards run inside (custom loops, e.g. speculative verify).

        `seq_ids` [B], `positions` [B, S] and `valid` [B, S] replace what the mask and
        cache would give; `phase` is 'prefill', 'decode' or 'verify'.
        """
        if phase is not None and phase not in PHASE_CODE:
            raise ValueError(f"phase must be one of {tuple(PHASE_CODE)}, got {phase!r}")
        hooks = self._hooks
        prev = hooks.override
        hooks.override = {"phase": None if phase is None else PHASE_CODE[phase], "seq_ids": seq_ids,
                          "positions": positions, "valid": valid}
        try:
            yield
        finally:
            hooks.override = prev

    def close(self, timeout: float = 30.0) -> ProbeStats:
        """Remove every hook, hand everything staged to ZeroMQ and end the stream. Idempotent.

        Returns at once; the socket stays open in the background until every subscriber
        has read the end of stream (at most `timeout` s; `join()` waits for that).
        """
        if not self._closed:
            self._closed = True
            self._hooks.remove_all()
            at_exit = getattr(self, "_at_exit", None)
            (at_exit or _StreamEnd(self._copy, self.publisher, self.run, self._registered, self._ipc_dir)).close(
                timeout)
            if at_exit is not None:
                closed(at_exit)
        return self.stats

    def join(self, timeout: float | None = None) -> bool:
        """After close(): wait until every subscriber has the end of stream; False on timeout."""
        return self.publisher.join(timeout)

    def __enter__(self) -> ProbeSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ProbeSession({len(self._hooks.active)} sites, {self.policy}, {self.endpoint})"

    # --- hook management -----------------------------------------------------------------
    def _change(self, op: str, names: list[str]) -> None:
        if self._closed:
            raise RuntimeError("this probe session is closed")
        self._hooks.change(op, names)
        if self._announced:  # subscribers (and probe.live_sessions) learn the new site list
            info = self.info
            self.publisher.set_info(info.to_dict())
            _discovery.register(info)


class _StreamEnd:
    """Ending a session's stream: what `close()` does after taking the taps off, and what the interpreter's exit
    does for a session never closed (`_exit.py`). It holds no reference to the model."""

    def __init__(self, copy: CopyPath, publisher: Publisher, run: str, registered: object, ipc_dir: str | None) -> None:
        self.copy, self.publisher, self.run, self.registered, self.ipc_dir = copy, publisher, run, registered, ipc_dir

    def close(self, timeout: float) -> None:
        pub, cp = self.publisher, self.copy
        # From another thread the model's may hold the copy path's lock, blocked on a full pipe (`complete`, a
        # subscriber that reads nothing): that wait ends here, as it would at the end of stream, instead of this
        # thread waiting behind it for good.
        while not cp.lock.acquire(timeout=0.05):
            if pub.stalled:
                pub.give_up()
        try:
            cp.flush_device(block=True)
        finally:
            cp.lock.release()
        pub.close({"run": self.run, "captured": cp.captured, "published": pub.published,
                   "dropped": cp.dropped + pub.dropped}, timeout)  # idempotent
        _discovery.unregister(self.registered)  # type: ignore[arg-type]
        remove_private(self.ipc_dir)
        self.ipc_dir = None

    def __repr__(self) -> str:
        return f"the probe session on {self.publisher.endpoint}"


def attach(model: nn.Module, sites: str | Iterable[str], *, endpoint: str | None = None, policy: str = "complete",
           capacity_bytes: int = 64 << 20, run: str | None = None, sndhwm: int | None = None,
           allow_remote: bool = False, curve_secret_key: bytes | str | None = None, strip_finished: bool = True,
           stall_timeout: float | None = 60.0, max_delay: float = MAX_DELAY_S,
           curve_clients: Clients = None, borrow: bool = True, tune_malloc: bool = True) -> ProbeSession:
    """Attach probes to `model` and start publishing; use as a context manager.

        with probe.attach(model, ["layers.*.resid_post", "logits"]) as s:
            ...

    endpoint        where to bind; default a private `ipc://` path (0700 directory).
                    Non-loopback TCP needs allow_remote=True (use curve_secret_key).
    curve_secret_key  encrypt with CURVE; subscribers pass the matching public key
                    (`Subscriber(curve_server_key=...)`). `curve_clients`: the only clients
                    admitted (their public keys, or a folder of public certificates); without
                    it any client that knows the server's public key may read (`_curve.py`).
    policy          "complete": nothing is lost; a subscriber that stops reading makes
                    the model wait, for at most `stall_timeout` seconds (None: forever),
                    after which that subscriber loses messages instead (stats.degraded);
                    "best_effort": the model never waits, overflow is dropped and counted.
    capacity_bytes  staging memory bound for large captures (ZeroMQ's queue of small
                    ones holds at most sndhwm x 64 KiB; sndhwm defaults to capacity / 64 KiB).
    strip_finished  in decode, rows whose fed token is EOS/pad (finished in generate) are not published.
    max_delay       the most seconds a decode step's small captures may wait to leave with later
                    steps' (one wake-up of ZeroMQ's I/O thread per batch of steps) while no subscriber
                    is live (`Subscriber(live=True)`). They wait 200 ms, or longer where the machine
                    makes those wake-ups dear (100x their measured cost), up to this; 0 sends every
                    step at its end.
    borrow          a large capture (256 KiB or more, every row, contiguous, on the host) is sent from
                    the model's tensor itself, held until ZeroMQ has sent it (at most capacity_bytes of
                    them), instead of copied at its hook, as `output_hidden_states` and TransformerLens's
                    cache keep references. A model that writes into such a tensor in place before the
                    send is caught by the tensor's version counter: the capture is dropped (or, written
                    while being sent, flagged in-band: `Subscriber.torn`), stats.torn, a warning, and every
                    later capture is copied. False copies every capture at its hook.
    tune_malloc     set glibc's malloc thresholds for this process once (`_malloc.py`, as a Subscriber
                    does): freed heap up to 64 MiB an arena stays mapped. With glibc's defaults a probed
                    compiled step of the default model at batch 8 faulted ~300 fresh heap pages back in,
                    every step, in some runs (+0.6-0.9 ms of an 8 ms step), the unprobed steps none.
                    Process-wide; skipped where the user set glibc's MALLOC_*_ variables or
                    PROBEBUS_TUNE_MALLOC=0.
    """
    return ProbeSession(model, sites, endpoint=endpoint, policy=policy, capacity_bytes=capacity_bytes, run=run,
                        sndhwm=sndhwm, allow_remote=allow_remote, curve_secret_key=curve_secret_key,
                        strip_finished=strip_finished, stall_timeout=stall_timeout, max_delay=max_delay,
                        curve_clients=curve_clients, borrow=borrow, tune_malloc=tune_malloc)


__all__ = ["ProbeSession", "ProbeStats", "attach", "SiteError"]
