"""Probes inside one vLLM worker: the same sites and wire format, identity from vLLM's flat batch.

Runs in the worker process (installed by `probe.vllm.WorkerExtension` through
`collective_rpc`); the caller never imports vLLM for it. vLLM runs one flat batch of
tokens per step, many requests mixed, prefills chunked. Before each forward the
model runner has already laid out, on the host, which request each token belongs to
(`query_start_loc`), how many of its tokens were computed before (`num_computed_tokens`)
and its prompt length; identity is read from there with numpy:

- a token's position is its request's computed count plus its index in the chunk;
  a prefix-cache hit starts the first chunk past the cached prefix, so those
  positions never appear, and each request's first published position is in the
  request map of the session info (`first_position`);
- phase: prefill while the position is inside the prompt, decode after it; a flat
  step with both is published as two captures per site (one per phase);
- a request that is preempted and recomputed would compute positions it already
  published: they are skipped (never duplicated) and counted (`recomputed`);
- padding tokens past the scheduled count are never published.

The common step, every running request decoding one token, takes a plain-Python path
(lists from the runner's host arrays, one bytes object for the rows): inside a running
model each numpy call costs 5-40 us because its code is cold between layers, and the
general path below makes a few dozen of them.

vLLM's decoder layers pass `(hidden_states, residual)` and fuse the residual add into
the next norm, which returns `(normed, hidden_states + residual)` (in place with vLLM's C
kernel on GPUs; the native op that 0.32's CPU build picks returns new tensors):
that second output is transformers' residual stream, so `resid_pre` and `resid_mid`
are read from the output of the norm that starts the layer / the MLP half, and
`resid_post` of layer i from the norm that starts layer i + 1 (the final norm after the
last layer), copied at once: an in-place kernel's next fused add overwrites it. No add of our own
on the model's thread (a torch op per site per step costs 5-10 us of dispatch there);
only a layer whose successor runs on another pipeline stage sums its pair itself.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from array import array
from collections import OrderedDict
from functools import partial

import numpy as np
import torch
from torch import nn

from . import _discovery
from ._arch import LAYER_SITES, ArchitectureError, SiteError
from ._copy import CopyPath
from ._curve import curve_settings
from ._endpoint import bind_address, remove_private
from ._hooks import tap
from ._identity import DECODE, PREFILL, StepIdentity
from ._placement import parent_cpus
from ._publisher import MAX_DELAY_S, ZERO_COPY_MIN, Publisher
from ._sites import SiteKey
from ._wire import REQUESTS_TOPIC, VERSION, encode_control

_MAX_REQUESTS = 10_000  # request-map entries kept in the session info (oldest dropped first)


class VllmArch:
    """Where each site lives in a vLLM Llama-family model (Llama, Mistral, Qwen2/3 ...)."""

    family = "vllm-llama-like"

    def __init__(self, model: nn.Module) -> None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise ArchitectureError(f"cannot find `model.layers` in vLLM's {type(model).__name__}; probebus on "
                                    "vLLM supports Llama-family decoders (Llama, Mistral, Qwen2, Qwen3)")
        self.model, self.inner, self.layers = model, inner, layers
        self.local = [i for i, layer in enumerate(layers) if _has(layer, "input_layernorm", "self_attn",
                                                                   "post_attention_layernorm", "mlp")]
        if not self.local and not any(type(layer).__name__ == "PPMissingLayer" for layer in layers):
            raise ArchitectureError(f"{type(layers[0]).__name__} is not a Llama-family decoder layer "
                                    "(input_layernorm, self_attn, post_attention_layernorm, mlp)")
        self.embed = getattr(inner, "embed_tokens", None)
        self.norm = getattr(inner, "norm", None)
        self.n_layers = len(layers)

    def sites(self) -> list[str]:
        """Every site of the whole model (all pipeline stages), in forward order."""
        out = ["embed"]
        out += [f"layers.{i}.{s}" for i in range(self.n_layers) for s in LAYER_SITES]
        return out + ["final_norm"]

    def local_sites(self) -> list[str]:
        """The sites this worker's pipeline stage computes."""
        out = ["embed"] if _is_module(self.embed) else []
        out += [f"layers.{i}.{s}" for i in self.local for s in LAYER_SITES]
        return out + (["final_norm"] if _is_module(self.norm) else [])

    def hook(self, site: str, fn: object) -> object:
        """Register the hook that hands `fn(key, tensor)` this site's tensor; returns its handle."""
        key = SiteKey.of(site)
        if site == "embed":
            return tap(self.embed, partial(_out, fn, key), pre=False)
        if site == "final_norm":
            return tap(self.norm, partial(_out, fn, key), pre=False)
        _, i, name = site.split(".")
        layer = self.layers[int(i)]
        if name == "resid_pre":
            return tap(layer.input_layernorm, partial(_stream, fn, key), pre=False)
        if name == "resid_post":
            nxt = int(i) + 1
            if nxt < self.n_layers and nxt in self.local:
                return tap(self.layers[nxt].input_layernorm, partial(_stream, fn, key), pre=False)
            if nxt == self.n_layers and _is_module(self.norm):
                return tap(self.norm, partial(_stream, fn, key), pre=False)
            return tap(layer, partial(_summed_out, fn, key), pre=False)  # the stage ends here
        if name == "attn_out":
            return tap(layer.self_attn, partial(_out, fn, key), pre=False)
        if name == "resid_mid":
            return tap(layer.post_attention_layernorm, partial(_stream, fn, key), pre=False)
        if name == "mlp_out":
            return tap(layer.mlp, partial(_out, fn, key), pre=False)
        raise SiteError(f"site {site!r} is not defined for vLLM models")


def _has(m: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Module) for n in names)


def _is_module(m: object) -> bool:
    return isinstance(m, nn.Module) and type(m).__name__ != "PPMissingLayer"


def _out(fn, key, module, args, output) -> None:  # noqa: ANN001
    fn(key, output[0] if isinstance(output, tuple) else output)


def _summed_out(fn, key, module, args, output) -> None:  # noqa: ANN001
    hidden, residual = output
    fn(key, hidden if residual is None else hidden + residual)


def _stream(fn, key, module, args, output) -> None:  # noqa: ANN001
    """A norm's view of the residual stream: its fused add's sum, or its input when it had no residual."""
    if isinstance(output, tuple):
        fn(key, output[1])
    elif args and isinstance(args[0], torch.Tensor):  # layer 0 on the first stage: the embedding output
        fn(key, args[0])


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
        if not cfg.model_config.enforce_eager:
            raise RuntimeError("probebus hooks need vLLM in eager mode: torch.compile and CUDA graphs run the "
                               "model without Python hooks. Create the engine with enforce_eager=True.")
        self.runner = runner
        self.arch = VllmArch(runner.get_model())
        self.tp_rank = get_tensor_model_parallel_rank()
        self.pp_rank = get_pp_group().rank_in_group
        self.run = run
        self.policy = policy
        self.model_name = model_name
        self.started = time.time()
        # Once: to_diff_dict + JSON + sha256 of the config cost ~1 ms, and `info()` runs at every step that brings
        # a new request (1.2-1.8 ms a call timed in the worker, once per generate call at batch 1 and 8).
        self._config_hash = _discovery.config_hash(cfg.model_config.hf_config)
        self.step = 0
        self.sites = [s for s in self.arch.local_sites() if s in set(sites)]
        self.publishing = self.tp_rank == 0 and bool(self.sites)
        self._ipc_dir: str | None = None
        self._handles: list = []
        self._idents: list[StepIdentity] = []
        self._seq: OrderedDict[str, dict] = OrderedDict()  # vLLM request id -> {"seq_id", "first_position"}
        self._next_pos: dict[str, int] = {}
        self._next_seq_id = 0
        self._new_requests: dict[str, dict] = {}  # entries of requests that started since the last step's end
        self.recomputed = 0
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
        model = self.arch.model
        self._handles = [tap(model, self._step_start, pre=True), tap(model, self._step_end, pre=False)]
        self._handles += [self.arch.hook(site, self._capture) for site in self.sites]
        self.publisher.set_info(self.info)  # built when an info goes out (a new subscriber), never per step
        self._registered = _discovery.register(_discovery.SessionInfo.from_dict(self.info()))

    # --- identity from the model runner's flat batch ------------------------------------------
    def _step_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        r = self.runner
        ib = r.input_batch
        nreq = ib.num_reqs
        qsl = r.query_start_loc.np[: nreq + 1]
        n = int(qsl[nreq])
        padded = _num_tokens(args, kwargs, n)
        if n == nreq == padded and n:
            fast = self._decode_step(r, ib, qsl, n)
            if fast is not None:
                self._idents = [fast]
                return
        req_index = np.repeat(np.arange(nreq), np.diff(qsl))
        pos = ib.num_computed_tokens_cpu[:nreq][req_index] + (np.arange(n) - qsl[:-1][req_index])
        tokens = r.input_ids.np[:n].astype(np.int64, copy=False)
        keep = np.ones(n, dtype=bool)
        seq_ids = np.empty(nreq, dtype=np.int64)
        for i, rid in enumerate(ib.req_ids[:nreq]):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            if hi == lo:
                seq_ids[i] = -1
                continue
            seq_ids[i] = self._seq_id(rid, int(pos[lo]))
            nxt = self._next_pos.get(rid, 0)
            if pos[lo] < nxt:  # preempted and recomputed: these positions were published already
                dup = pos[lo:hi] < nxt
                keep[lo:hi] &= ~dup
                self.recomputed += int(dup.sum())
            self._next_pos[rid] = max(nxt, int(pos[hi - 1]) + 1)
        prefill = pos < ib.num_prompt_tokens[:nreq][req_index]
        self.step += 1
        self._idents = []
        for phase, mask in ((PREFILL, prefill & keep), (DECODE, ~prefill & keep)):
            if mask.any():
                self._idents.append(_flat_identity(self.step, phase, padded, n, mask, seq_ids[req_index], pos,
                                                   tokens, r.device))

    def _decode_step(self, r: object, ib: object, qsl: np.ndarray, n: int) -> StepIdentity | None:
        """Every request decodes one token, none new, none recomputed: identity in plain Python (None: the
        general path). Nothing is changed before every check has passed."""
        if qsl.tolist() != list(range(n + 1)):
            return None
        pos = ib.num_computed_tokens_cpu[:n].tolist()  # type: ignore[attr-defined]
        prompt = ib.num_prompt_tokens[:n].tolist()  # type: ignore[attr-defined]
        rids = ib.req_ids[:n]  # type: ignore[attr-defined]
        seq, nxt = self._seq, self._next_pos
        seq_ids = []
        for rid, p, lim in zip(rids, pos, prompt, strict=True):
            got = seq.get(rid)
            if got is None or p < lim or p < nxt.get(rid, 0):  # new, still in its prompt, or recomputed
                return None
            seq_ids.append(got["seq_id"])
        for rid, p in zip(rids, pos, strict=True):
            nxt[rid] = p + 1
        tok = r.input_ids.np[:n].tolist()  # type: ignore[attr-defined]
        self.step += 1
        return StepIdentity(self.step, DECODE, n, 1, None, np.asarray(seq_ids, dtype=np.int64), None, None,
                            r.device, {1: (None, array("q", seq_ids + pos + tok).tobytes(), n)})  # type: ignore[attr-defined]

    def _seq_id(self, rid: str, first: int) -> int:
        got = self._seq.get(rid)
        if got is None:
            got = self._seq[rid] = {"seq_id": self._next_seq_id, "first_position": first,
                                    "request_id": _external_id(rid)}
            self._new_requests[str(self._next_seq_id)] = got
            self._next_seq_id += 1
            if len(self._seq) > _MAX_REQUESTS:
                old, _ = self._seq.popitem(last=False)
                self._next_pos.pop(old, None)
        return got["seq_id"]

    def _capture(self, key: SiteKey, t: torch.Tensor) -> None:
        try:
            for ident in self._idents:
                self._copy.capture(key, t, ident)
        except Exception:  # never crash the engine being observed (the copy path counted it dropped)
            pass

    def _step_end(self, module: nn.Module, args: tuple, output: object) -> None:
        self._idents = []
        pub = self.publisher
        assert pub is not None
        try:
            if self._new_requests:  # only the new entries (the info, which has them all, goes to new subscribers)
                new, self._new_requests = self._new_requests, {}
                pub.send_control(encode_control(REQUESTS_TOPIC, {"run": self.run, "requests": new,
                                                                 "recomputed": self.recomputed}), hold=True)
            self._copy.flush_device(block=False)  # the step's small captures, in one burst
        except Exception:  # never crash the engine being observed
            pass
        pub.step_done()

    # --- control (called through collective_rpc) ----------------------------------------------
    def info(self) -> dict:
        cfg = self.runner.vllm_config.model_config
        return _discovery.SessionInfo(
            run=self.run, endpoint=self.endpoint, pid=os.getpid(), model=self.model_name,
            config_hash=self._config_hash, dtype=str(cfg.dtype).removeprefix("torch."),
            sites=self.sites, policy=self.policy, probebus_version=_version(), wire_version=VERSION,
            started=self.started, host=socket.gethostname(), backend="vllm",
        ).to_dict() | {"tp_rank": self.tp_rank, "pp_rank": self.pp_rank,
                       # list() first: one C call, so the control thread may build this while the model steps
                       "requests": {str(v["seq_id"]): v for v in list(self._seq.values())},
                       "recomputed": self.recomputed}

    def stats(self) -> dict:
        if self.publisher is None:
            return {"captured": 0, "published": 0, "dropped": 0, "bytes": 0, "stall_seconds": 0.0,
                    "subscribers": 0, "degraded": False, "publishing": False, "queued": 0}
        pub, cp = self.publisher, self._copy
        return {"captured": cp.captured, "published": pub.published, "dropped": cp.dropped + pub.dropped,
                "bytes": pub.bytes, "stall_seconds": pub.stall_seconds, "subscribers": len(pub.subscribers),
                "degraded": pub.degraded, "publishing": True, "recomputed": self.recomputed, "queued": cp.queued}

    def wait_for_subscribers(self, n: int, timeout: float | None) -> int:
        pub = self.publisher
        if pub is None:
            return n
        pub.wait_until(lambda: len(pub.subscribers) >= n, timeout)
        return len(pub.subscribers)

    def close(self, timeout: float) -> dict:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.publisher is not None:
            self._copy.flush_device(block=True)
        out = self.stats()
        if self.publisher is not None:
            self.publisher.close({"run": self.run, "captured": out["captured"], "published": out["published"],
                                  "dropped": out["dropped"]}, timeout)
            _discovery.unregister(self._registered)
        remove_private(self._ipc_dir)
        return out


def spare_cpus() -> set[int] | None:
    """Cores this process may use but its threads are not bound to, or None when there are none.

    vLLM's CPU worker binds itself, and every thread it starts later, to its OpenMP cores
    (VLLM_CPU_OMP_THREADS_BIND), so without this ZeroMQ's I/O thread would run on the
    model's core. The cores the engine process (our parent) may use are the ones vLLM left."""
    allowed = parent_cpus() or set(range(os.cpu_count() or 1))
    return (allowed - os.sched_getaffinity(0)) or None


def _num_tokens(args: tuple, kwargs: dict, n: int) -> int:
    """Rows of this forward (the scheduled tokens plus any padding vLLM added)."""
    for a in (*args[:2], kwargs.get("input_ids"), kwargs.get("positions")):
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return int(a.shape[-1] if a.dim() == 2 else a.shape[0])  # M-RoPE positions are [3, T]
    return n


def _flat_identity(step: int, phase: int, padded: int, n: int, mask: np.ndarray, seq_ids: np.ndarray,
                   pos: np.ndarray, tokens: np.ndarray, device: torch.device) -> StepIdentity:
    """The flat batch as [padded, 1]: one row per token, each with its own request, position and id."""
    valid = np.zeros((padded, 1), dtype=bool)
    valid[:n, 0] = mask
    full_ids = np.full(padded, -1, dtype=np.int64)
    full_ids[:n] = seq_ids
    full_pos = np.zeros((padded, 1), dtype=np.int64)
    full_pos[:n, 0] = pos
    full_tok = np.full((padded, 1), -1, dtype=np.int64)
    full_tok[:n, 0] = tokens
    return StepIdentity(step, phase, padded, 1, valid, full_ids, full_pos, full_tok, device)


def _external_id(rid: str) -> str:
    """The id the caller gave: vLLM 0.32 appends "-" and 8 random characters inside the engine."""
    head, _, tail = rid.rpartition("-")
    return head if head and len(tail) == 8 else rid


def new_run() -> str:
    return uuid.uuid4().hex[:12]


def _version() -> str:
    from . import __version__

    return __version__
