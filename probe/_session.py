"""attach(): hooks on a live model that stage captures for the publisher thread.

    with probe.attach(model, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        model.generate(**inputs, max_new_tokens=16)
    print(session.stats)

Each site is one PyTorch hook (forward hook for outputs, forward pre-hook for inputs)
plus one pre-hook and one hook on the model itself that compute the step's identity
(positions, validity, sequence ids) once and wake the publisher once. A site hook
copies the valid rows into the staging ring and enqueues a descriptor; that is all
the hot path does. Removing the last site removes every hook.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import tempfile
import threading
import uuid
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn

from ._arch import SiteError, resolve_arch
from ._context import StepContext, cache_length, positions_and_valid
from ._publisher import Publisher, Staged
from ._sites import expand_sites, site_layer
from ._staging import StagingRing
from ._subscriber import Subscriber
from ._wire import DTYPE_CODE, PHASE_CODE

POLICIES = ("complete", "best_effort")


@dataclass(frozen=True)
class ProbeStats:
    """Counters of one session. After close(): captured == published + dropped."""

    captured: int
    published: int
    dropped: int
    bytes: int
    stall_seconds: float
    subscribers: int

    @property
    def queued(self) -> int:
        return self.captured - self.published - self.dropped


def _check_endpoint(endpoint: str, allow_remote: bool) -> None:
    if not endpoint.startswith("tcp://"):
        return
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not loopback and not allow_remote:
        raise ValueError(
            f"refusing to bind {endpoint!r}: hidden states leak prompts. Bind tcp://127.0.0.1:PORT or "
            "an ipc:// path, or pass allow_remote=True (with curve_secret_key) to expose it on purpose."
        )


class ProbeSession:
    """Probes attached to one model. Create with `probe.attach`."""

    def __init__(self, model: nn.Module, sites: str | Iterable[str], *, endpoint: str | None, policy: str,
                 capacity_bytes: int, run: str | None, sndhwm: int, allow_remote: bool,
                 curve_secret_key: bytes | None, strip_finished: bool) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.model = model
        self.arch = resolve_arch(model)
        self.policy = policy
        self.run = run or uuid.uuid4().hex[:12]
        self._ipc_dir: str | None = None
        if endpoint is None:
            if os.name == "nt":
                endpoint = "tcp://127.0.0.1:*"
            else:  # mkdtemp makes a 0700 directory: only this user can connect
                self._ipc_dir = tempfile.mkdtemp(prefix="probebus-")
                endpoint = f"ipc://{self._ipc_dir}/bus"
        _check_endpoint(endpoint, allow_remote)
        if allow_remote and curve_secret_key is None and endpoint.startswith("tcp://"):
            warnings.warn("binding without CURVE: anyone who can reach this port can read activations", stacklevel=3)
        param = next(model.parameters(), None)
        self._cuda = param is not None and param.is_cuda
        self.ring = StagingRing(capacity_bytes, pinned=self._cuda)
        self._copy_stream = torch.cuda.Stream(device=param.device) if self._cuda else None
        self.publisher = Publisher(endpoint, run=self.run, policy=policy, ring=self.ring, sndhwm=sndhwm,
                                   curve_secret_key=curve_secret_key)
        self.publisher.start()
        self.captured = 0
        self.dropped = 0  # dropped before reaching the socket (ring full under best_effort)
        self._kick_bytes = self.ring.capacity // 4
        self._queued_bytes = 0
        self._handles: dict[str, object] = {}
        self._active: set[str] = set()
        self._top: list = []
        self._pending: list[tuple[str, list[str]]] = []
        self._lock = threading.RLock()
        self._model_thread: int | None = None
        self._ctx: StepContext | None = None
        self._step = 0
        self._next_seq = 0
        self._seq_ids = torch.empty(0, dtype=torch.int64)
        self._finished = torch.empty(0, dtype=torch.bool)
        self._override: dict | None = None
        self._strip_finished = strip_finished
        self._stop_ids = self._stop_tokens(model) if strip_finished else torch.empty(0, dtype=torch.int64)
        self._closed = False
        self._warned: set[str] = set()
        try:
            self.add(sites)
        except BaseException:
            self.close()
            raise

    # --- public API --------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """Where subscribers connect (`ipc://...` private to this user by default)."""
        return self.publisher.endpoint

    @property
    def step(self) -> int:
        """Number of forward steps of the attached model seen so far (the last capture's `step`)."""
        return self._step

    @property
    def sites(self) -> list[str]:
        return [s for s in self.arch.sites() if s in self._active]

    @property
    def stats(self) -> ProbeStats:
        pub = self.publisher
        return ProbeStats(self.captured, pub.published, self.dropped + pub.dropped, pub.bytes,
                          self.ring.stall_seconds, len(pub.subscribers))

    def add(self, sites: str | Iterable[str]) -> list[str]:
        """Start capturing more sites; returns the concrete names added."""
        names = [s for s in expand_sites(self.arch, sites) if s not in self._active]
        self._change("add", names)
        return names

    def remove(self, sites: str | Iterable[str]) -> list[str]:
        """Stop capturing sites (effective for the next capture; hooks go at the next step)."""
        names = [s for s in expand_sites(self.arch, sites) if s in self._active]
        self._change("remove", names)
        return names

    def wait_for_subscribers(self, n: int = 1, timeout: float | None = 10.0) -> int:
        """Block until `n` subscribers are connected, so nothing is published into the void."""
        got = self.publisher.wait_for_subscribers(n, timeout)
        if got < n:
            raise TimeoutError(f"only {got} of {n} subscribers connected to {self.endpoint} within {timeout}s")
        return got

    def wait_for(self, subscriber: Subscriber, timeout: float | None = 10.0) -> None:
        """Block until the publisher has registered this particular subscriber.

        Unlike counting (`wait_for_subscribers`), this cannot be fooled by another
        subscriber leaving at the same moment.
        """
        if not self.publisher.wait_for_presence(subscriber.presence, timeout):
            raise TimeoutError(f"the subscriber did not reach {self.endpoint} within {timeout}s")

    @contextmanager
    def context(self, *, phase: str | None = None, seq_ids: Sequence[int] | torch.Tensor | None = None,
                positions: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> Iterator[None]:
        """Set identity explicitly for forwards run inside (custom loops, e.g. speculative verify).

        `seq_ids` [B], `positions` [B, S] and `valid` [B, S] replace what the mask and
        cache would give; `phase` is 'prefill', 'decode' or 'verify'.
        """
        if phase is not None and phase not in PHASE_CODE:
            raise ValueError(f"phase must be one of {tuple(PHASE_CODE)}, got {phase!r}")
        prev = self._override
        self._override = {"phase": phase, "seq_ids": seq_ids, "positions": positions, "valid": valid}
        try:
            yield
        finally:
            self._override = prev

    def close(self, timeout: float = 30.0) -> ProbeStats:
        """Remove every hook, send everything staged, close the socket. Idempotent."""
        if not self._closed:
            self._closed = True
            with self._lock:
                self._active.clear()
                self._pending.clear()
                for h in list(self._handles.values()) + self._top:
                    h.remove()  # type: ignore[attr-defined]
                self._handles.clear()
                self._top.clear()
            if not self.publisher.close(timeout):
                warnings.warn(f"probebus: gave up flushing after {timeout}s (a subscriber stopped reading)",
                              stacklevel=2)
            self.ring.close()
            if self._ipc_dir:
                shutil.rmtree(self._ipc_dir, ignore_errors=True)
        return self.stats

    def __enter__(self) -> ProbeSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ProbeSession({len(self._active)} sites, {self.policy}, {self.endpoint})"

    # --- hook management -----------------------------------------------------------------
    def _change(self, op: str, names: list[str]) -> None:
        if self._closed:
            raise RuntimeError("this probe session is closed")
        with self._lock:
            if op == "remove":
                self._active.difference_update(names)  # the hooks stop capturing right now
            me = threading.get_ident()
            if self._model_thread is None or self._model_thread == me:
                self._apply(op, names)
            else:  # another thread may be inside forward: hook dicts change at the next step
                self._pending.append((op, names))

    def _apply(self, op: str, names: list[str]) -> None:
        if op == "add":
            for site in names:
                point = self.arch.locate(site)
                key = (site, site.encode(), site_layer(site))
                if point.kind == "pre":
                    h = point.module.register_forward_pre_hook(partial(self._pre_hook, key), with_kwargs=True)
                else:
                    h = point.module.register_forward_hook(partial(self._post_hook, key))
                self._handles[site] = h
                self._active.add(site)
        else:
            for site in names:
                h = self._handles.pop(site, None)
                if h is not None and site not in self._active:
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
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None:
            self._ctx = None
            return
        batch, seq_len = ref.shape[0], ref.shape[1]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = cache_length(cache)
        token_ids = ids.detach().to("cpu", torch.int64) if ids is not None else torch.full((batch, seq_len), -1)
        ov = self._override or {}
        positions, valid = positions_and_valid(kwargs.get("attention_mask"), batch, seq_len, past)
        if ov.get("positions") is not None:
            positions = torch.as_tensor(ov["positions"], dtype=torch.int64).cpu().expand(batch, seq_len)
        if ov.get("valid") is not None:
            valid = torch.as_tensor(ov["valid"], dtype=torch.bool).cpu().expand(batch, seq_len)
        phase = ov.get("phase") or ("prefill" if past == 0 else "decode")
        if ov.get("seq_ids") is not None:
            seq_ids = torch.as_tensor(ov["seq_ids"], dtype=torch.int64).cpu()
        elif phase == "prefill" or len(self._seq_ids) != batch:
            if phase != "prefill":
                self._warn_once("rows", f"probebus: batch changed to {batch} rows mid-generation; new seq_ids issued")
            seq_ids = torch.arange(self._next_seq, self._next_seq + batch, dtype=torch.int64)
            self._next_seq += batch
            self._finished = torch.zeros(batch, dtype=torch.bool)
        else:
            seq_ids = self._seq_ids
        self._seq_ids = seq_ids
        if self._strip_finished and phase == "decode" and len(self._finished) == batch and len(self._stop_ids):
            # generate keeps feeding finished rows (their EOS, then padding): not real tokens.
            self._finished = self._finished | torch.isin(token_ids[:, 0], self._stop_ids)
            valid = valid & ~self._finished[:, None]
        self._step += 1
        self._ctx = StepContext(self._step, PHASE_CODE[phase], batch, seq_len, valid, seq_ids, positions,
                                token_ids, ref.device)

    def _on_step_end(self, module: nn.Module, args: tuple, output: object) -> None:
        self._ctx = None
        self._queued_bytes = 0
        self.publisher.kick()

    def _pre_hook(self, key: tuple[str, bytes, int], module: nn.Module, args: tuple, kwargs: dict) -> None:
        t = args[0] if args else kwargs.get("hidden_states")
        if isinstance(t, torch.Tensor) and key[0] in self._active:
            self._capture(key, t)

    def _post_hook(self, key: tuple[str, bytes, int], module: nn.Module, args: tuple, output: object) -> None:
        t = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(t, torch.Tensor) and key[0] in self._active:
            self._capture(key, t)

    def _capture(self, key: tuple[str, bytes, int], t: torch.Tensor) -> None:
        before = self.captured
        try:
            self._stage(key[1], key[2], t)
        except Exception as exc:  # never crash the model being observed
            self.captured = before + 1
            self.dropped += 1
            self._warn_once(repr(type(exc)), f"probebus: capture of {key[0]} failed and was dropped: {exc!r}")

    def _stage(self, topic: bytes, layer: int, t: torch.Tensor) -> None:
        ctx = self._ctx
        if ctx is None:  # the layer ran outside a forward of the attached model
            ctx = self._ctx_from_shape(t)
        if t.dim() != 3:
            t = t.reshape(ctx.batch, -1, t.shape[-1])
        batch, seq_len, hidden = t.shape
        index, tokens = ctx.rows(seq_len)
        n = tokens.shape[1]
        if n == 0:
            return
        dtype = DTYPE_CODE.get(t.dtype)
        if dtype is None:
            raise TypeError(f"dtype {t.dtype} cannot be published")
        self.captured += 1
        nbytes = n * hidden * t.dtype.itemsize
        ring = self.ring
        off = ring.alloc(nbytes, block=False)
        in_ring = True
        if off is None:
            if self.policy == "best_effort":
                self.dropped += 1
                return
            self.publisher.kick()
            if nbytes > ring.capacity:  # one capture larger than the ring: wait it empty, then stage apart
                ring.wait_empty()
                in_ring = False
            else:
                off = ring.alloc(nbytes, block=True)
                if off is None:  # ring closed under us
                    self.dropped += 1
                    return
        try:
            data, event = self._copy_rows(t, ctx, index, n, off if in_ring else None)
        except BaseException:
            if in_ring:  # hand the slot back in order, or ring frees would go out of step
                self.publisher.submit(Staged(b"", 0, 0, 0, 0, 0, 0, tokens, ring.bytes_at(off, 0), True))
            raise
        self.publisher.submit(Staged(topic, layer, ctx.step, ctx.phase, dtype, hidden, n, tokens, data, in_ring, event))
        self._queued_bytes += nbytes
        if self._queued_bytes > self._kick_bytes or self._ctx is None:
            self._queued_bytes = 0
            self.publisher.kick()

    def _copy_rows(self, t: torch.Tensor, ctx: StepContext, index: np.ndarray | None, n: int,
                   off: int | None) -> tuple[np.ndarray, object]:
        """Copy the valid rows of `t` into the ring at `off` (or a one-off buffer); returns their bytes.

        On CPU the copy is a single-threaded numpy memcpy/take: torch's copy_ would use the
        intra-op thread pool, and an OpenMP region that waits on a core the subscriber or
        publisher holds costs milliseconds (measured: 13 us vs 7.8 ms for 384 KiB, 2 threads).
        """
        batch, seq_len, hidden = t.shape
        nbytes = n * hidden * t.dtype.itemsize
        if off is not None:
            data = self.ring.bytes_at(off, nbytes)
        else:
            data = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda).numpy()
        if not t.is_cuda:
            src = t.detach() if t.requires_grad else t
            if src.dtype == torch.bfloat16:  # numpy has no bf16: move the same bits as int16
                src = src.view(torch.int16)
            rows = src.numpy().reshape(batch * seq_len, -1).view(np.uint8)  # raw bytes per row
            dst = data.reshape(n, -1)
            if index is None:
                np.copyto(dst, rows)
            else:
                np.take(rows, index, axis=0, out=dst)
            return data, None
        # CUDA: gather on the device, copy to pinned memory on a side stream; the publisher waits on the event.
        src = t.detach().reshape(batch * seq_len, hidden)
        rows_t = src if index is None else src.index_select(0, ctx.device_index(seq_len))
        dst_t = torch.from_numpy(data).view(t.dtype).view(n, hidden)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            dst_t.copy_(rows_t, non_blocking=True)
            rows_t.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return data, event

    def _ctx_from_shape(self, t: torch.Tensor) -> StepContext:
        self._warn_once("noctx", "probebus: a probed module ran outside a forward of the attached model; "
                        "captures get fresh seq_ids and positions 0..S-1")
        batch, seq_len = (t.shape[0], t.shape[1]) if t.dim() == 3 else (1, t.shape[0])
        ids = torch.arange(self._next_seq, self._next_seq + batch, dtype=torch.int64)
        self._next_seq += batch
        self._step += 1
        pos = torch.arange(seq_len, dtype=torch.int64).expand(batch, seq_len)
        valid = torch.ones(batch, seq_len, dtype=torch.bool)
        tokens = torch.full((batch, seq_len), -1, dtype=torch.int64)
        return StepContext(self._step, PHASE_CODE["prefill"], batch, seq_len, valid, ids, pos, tokens, t.device)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)

    @staticmethod
    def _stop_tokens(model: nn.Module) -> torch.Tensor:
        cfg = getattr(model, "generation_config", None)
        ids: list[int] = []
        for name in ("eos_token_id", "pad_token_id"):
            v = getattr(cfg, name, None)
            if isinstance(v, int):
                ids.append(v)
            elif isinstance(v, (list, tuple)):
                ids.extend(int(x) for x in v)
        return torch.tensor(sorted(set(ids)), dtype=torch.int64)


def attach(model: nn.Module, sites: str | Iterable[str], *, endpoint: str | None = None, policy: str = "complete",
           capacity_bytes: int = 64 << 20, run: str | None = None, sndhwm: int = 1000, allow_remote: bool = False,
           curve_secret_key: bytes | None = None, strip_finished: bool = True) -> ProbeSession:
    """Attach probes to `model` and start publishing; use as a context manager.

        with probe.attach(model, ["layers.*.resid_post", "logits"]) as s:
            ...

    endpoint        where to bind; default a private `ipc://` path (0700 directory).
                    Non-loopback TCP needs allow_remote=True (use curve_secret_key).
    policy          "complete": nothing is lost, a full ring blocks the model;
                    "best_effort": the model never waits, overflow is dropped and counted.
    capacity_bytes  staging memory bound (one capture larger than it is staged alone).
    strip_finished  in decode, rows whose fed token is EOS/pad (finished in generate) are not published.
    """
    return ProbeSession(model, sites, endpoint=endpoint, policy=policy, capacity_bytes=capacity_bytes, run=run,
                        sndhwm=sndhwm, allow_remote=allow_remote, curve_secret_key=curve_secret_key,
                        strip_finished=strip_finished)


__all__ = ["ProbeSession", "ProbeStats", "attach", "SiteError"]
