"""What a round costs on this machine: the target's forward over L tokens at batch B, a drafter step.

    cost = CostModel.for_target(target)                   # cached per model and machine
    cost.ensure(8, k_max=5, drafter=d)                    # measures batch 8 now if not cached
    cost.verify(8, 3), cost.step(8), cost.overhead(8)     # seconds
    cost.observe_verify(8, 3, 0.0041)                     # refine online from real rounds

The curve is measured once per (model, dtype, device, threads) and machine (CPU model,
torch version) and cached as JSON under the per-user cache directory
(`$PROBEBUS_CACHE_DIR`, else `$XDG_CACHE_HOME/probebus`, else `~/.cache/probebus`).
`refresh=True` measures again. During generation the loop feeds real timings back: an
exponential moving average of observed/predicted scales the whole curve (its shape stays
the measured one), so a machine that drifts is followed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..forward._compat import cache_kw
from ..forward._compiled import CompiledForward, bucket
from ..forward._kv import GrowingCache
from ..forward._mask import causal_block
from ..forward._packed import PackedLinears
from ._paths import PathChoice

if TYPE_CHECKING:
    from collections.abc import Callable

# The cost cache's format version, part of every cache file's name (`CostModel.for_target`): a file of an older
# version is never read, so its curve is measured again. Bump it whenever what `measure` times changes the way
# the loop's forwards run (which weights are packed, the masks, the KV cache, attention, inference mode): a curve
# cached before such a change measured forwards the loop no longer runs. What each bump was for:
# docs/design.md, 'Decoder: measurements behind the code'.
CACHE_VERSION = 5


def cache_dir() -> Path:
    base = os.environ.get("PROBEBUS_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "probebus"


def _machine_key() -> str:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}|{platform.machine()}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def _model_key(target: nn.Module) -> str:
    """The architecture, size, dtype and device: what a forward's time depends on. Not where the weights were
    loaded from (the config's `_name_or_path`): two copies of a model share one curve, and a copy does not keep a
    curve of its own that nobody refreshes."""
    p = next(target.parameters())
    if hasattr(target, "config"):
        cfg = target.config.to_dict()
        cfg.pop("_name_or_path", None)
        cfg = json.dumps(cfg, sort_keys=True, default=str)
    else:
        cfg = type(target).__name__
    n = sum(x.numel() for x in target.parameters())
    return hashlib.sha256(f"{cfg}|{n}|{p.dtype}|{p.device}".encode()).hexdigest()[:16]


def quick_lengths(k_max: int) -> list[int]:
    """The forward lengths a first measurement times: 1, 2, the middle and k_max + 1. The curve between them is
    close to straight where it was measured at every length, so the others are interpolated (measured:
    docs/design.md, 'Decoder: measurements behind the code')."""
    return sorted({1, min(2, k_max + 1), (k_max + 3) // 2, k_max + 1})


def _interpolated(points: dict[int, float], n: int) -> list[float]:
    """Values for lengths 1..n from measured `points` (1 and n among them), linear in between."""
    known = sorted(points)
    out = []
    for length in range(1, n + 1):
        lo = max(k for k in known if k <= length)
        hi = min(k for k in known if k >= length)
        w = 0.0 if hi == lo else (length - lo) / (hi - lo)
        out.append(points[lo] + w * (points[hi] - points[lo]))
    return out


class CostModel:
    def __init__(self, key: str, data: dict | None = None, path: Path | None = None, *, adapt: bool = True) -> None:
        self.key, self.path = key, path
        self.paths = PathChoice()  # shared by every decoder that shares this cost model
        self.data: dict[str, dict] = data or {}  # str(batch) -> {"verify": [s for L=1..], "step": s}
        self.initial = json.loads(json.dumps(self.data))  # as loaded or measured: what seeded calls use
        self._overhead: dict[int, float] = {}
        # observed / measured forward time, per (batch, probes capturing): hooks that publish cost extra
        self._scale: dict[tuple[int, bool], float] = {}
        self.adapt = adapt
        self._target: nn.Module | None = None  # the model `ensure` measures (set by `for_target`)
        self._packed = "none"  # which of the target's weights the loop's multi-token forwards use packed
        self._compiled: CompiledForward | None = None  # the loop's forwards compiled: the curve measures those
        self.full = False  # measure every length (refresh=True: the benchmark, --refresh-cost), else `quick_lengths`

    @classmethod
    def for_target(cls, target: nn.Module, *, refresh: bool = False, path: Path | None = None,
                   packed: str = "all", compiled: CompiledForward | None = None) -> CostModel:
        """`packed`: the loop's forwards use `PackedLinears` ("all" by default), so their curve does. `compiled`:
        the loop's forwards run compiled (`forward/_compiled.py`), and the curve is measured on them, apart."""
        have = PackedLinears.of(target, packed)
        packed = have.kind if have is not None else "none"
        # "+CACHE_VERSION": the cache format (see CACHE_VERSION for when to bump it)
        # (compiled2: the curve with the probes publishing measured on the compiled forwards too, not eagerly)
        mode = "|compiled2" if compiled is not None else ""
        key = hashlib.sha256(f"{_model_key(target)}|{_machine_key()}|packed={packed}{mode}+{CACHE_VERSION}"
                             .encode()).hexdigest()[:20]
        path = path or cache_dir() / f"decoder-cost-{key}.json"
        data = None
        if not refresh and path.is_file():
            try:
                data = json.loads(path.read_text()).get("batches")
            except (OSError, ValueError, AttributeError):
                data = None  # a corrupt cache is measured again
        model = cls(key, data, path)
        model._target = target
        model._packed = packed
        model._compiled = compiled
        model.full = refresh
        return model

    # --- queries ---------------------------------------------------------------------
    def has(self, batch: int, k_max: int) -> bool:
        d = self.data.get(str(batch))
        return d is not None and len(d["verify"]) >= k_max + 1

    def _scale_of(self, batch: int, capturing: bool) -> float:
        own = self._scale.get((batch, capturing))
        return own if own is not None else self._scale.get((batch, not capturing), 1.0)

    def _base(self, batch: int, frozen: bool, capturing: bool) -> list[float]:
        d = (self.initial if frozen else self.data)[str(batch)]
        return d.get("verify_capturing", d["verify"]) if capturing else d["verify"]

    def capture_tax(self, batch: int, length: int) -> float:
        """Seconds a forward of `length` tokens costs more while probes publish the drafter's features."""
        return max(self.verify(batch, length, capturing=True) - self.verify(batch, length), 0.0)

    def verify(self, batch: int, length: int, frozen: bool = False, capturing: bool = False) -> float:
        scale = 1.0 if frozen else self._scale_of(batch, capturing)
        return self._base(batch, frozen, capturing)[length - 1] * scale

    def curve(self, batch: int, k_max: int, frozen: bool = False, capturing: bool = False) -> list[float]:
        """verify + per-round overhead, for L = 1..k_max+1; `frozen`: the values as loaded, no online refinement
        (seeded calls schedule from these, so a seed reproduces the output)."""
        o = self.overhead(batch, frozen)
        scale = 1.0 if frozen else self._scale_of(batch, capturing)
        out = [v * scale + o for v in self._base(batch, frozen, capturing)[: k_max + 1]]
        for i in range(1, len(out)):
            out[i] = max(out[i], out[i - 1])
        return out

    def step(self, batch: int, frozen: bool = False) -> float:
        return (self.initial if frozen else self.data)[str(batch)]["step"]

    def overhead(self, batch: int, frozen: bool = False) -> float:
        """Seconds a round spends outside the target forward and drafting (bookkeeping, verification)."""
        return 1.5e-4 if frozen else self._overhead.get(batch, 1.5e-4)

    # --- measuring -----------------------------------------------------------------------
    def ensure(self, batch: int, k_max: int, drafter: nn.Module | None = None,
               context: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
               capturing: Callable[[], contextlib.AbstractContextManager[object]] | None = None) -> None:
        """Measure batch `batch` if it is not known yet, once per model and machine: the fastest of 3 forwards
        per length at the lengths `quick_lengths` names (1, 2, the middle and k_max + 1; with `capturing`, a
        context in which probes publish, 1 and k_max + 1 again), the lengths between them interpolated, and the
        online refinement (`observe_verify`) correcting each length the loop uses. With `full` (a model made
        with refresh=True: the benchmark, `--refresh-cost`) the fastest of 6 at every length in both probe
        states. Measured whole, the curve was most of a machine's first call with a drafter; the quick curve
        brings that first call close to one without (measured: docs/design.md, 'Decoder: measurements behind
        the code')."""
        if self.has(batch, k_max) and (capturing is None or "verify_capturing" in self.data[str(batch)]):
            return
        if str(batch) in self.data and self._target is None:
            return  # a curve given by hand (tests, a fixed clock) is used as given: shorter only bounds trees
        quick = None if self.full else quick_lengths(k_max)
        reps = 6 if quick is None else 3
        if not self.has(batch, k_max):
            self.data[str(batch)] = self.measure(self._target, batch, k_max, drafter, context,
                                                 packed=self._packed, lengths=quick, reps=reps,
                                                 compiled=self._compiled)
        if capturing is not None:
            on = self.measure(self._target, batch, k_max, None, capturing, packed=self._packed,
                              lengths=None if quick is None else [1, k_max + 1], reps=reps,
                              compiled=self._compiled)["verify"]
            plain = self.data[str(batch)]["verify"]
            self.data[str(batch)]["verify_capturing"] = [max(a, b) for a, b in zip(on, plain, strict=False)]
        self.initial[str(batch)] = json.loads(json.dumps(self.data[str(batch)]))
        self._save()

    @staticmethod
    @torch.no_grad()
    def measure(target: nn.Module, batch: int, k_max: int, drafter: nn.Module | None = None,
                context: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
                ctx_len: int = 32, reps: int = 6, packed: str = "none", lengths: list[int] | None = None,
                compiled: CompiledForward | None = None) -> dict:
        """Seconds of a forward over L = 1..k_max+1 new tokens after ctx_len cached ones, and of a drafter step.

        The fastest of `reps` interleaved runs (the first run of a shape pays one-time costs; on a
        shared machine the slow runs measure the neighbours, not the model). `context()` (if given)
        wraps each forward, e.g. a probe context that publishes nothing. `packed`: every forward uses these
        packed weights ("all", "head"), as the loop's do (`_packed.py`). `lengths`: measure only these (1 and
        k_max + 1 among them), the others interpolated linearly. `compiled`: the forwards run compiled over a
        static cache, as the loop's then do; a length costs what its graph's length costs (`bucket`), so those
        lengths are the ones measured.
        """
        if compiled is not None:
            return CostModel._measure_compiled(compiled, target, batch, k_max, drafter, context, ctx_len, reps)
        p = next(target.parameters())
        vocab = target.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, vocab, (batch, ctx_len + k_max + 1), generator=gen).to(p.device)
        cache = GrowingCache(capacity=ctx_len + k_max + 1)  # as the loop's (`_kv.py`)
        times: list[list[float]] = [[] for _ in range(k_max + 1)]
        todo = sorted(set(lengths)) if lengths else list(range(1, k_max + 2))
        weights = PackedLinears.of(target, packed)
        block = batch == 1 and p.device.type == "cpu"
        with (context() if context is not None else torch.no_grad(),
              weights.active() if weights is not None else contextlib.nullcontext()):
            kv = cache_kw(target.forward)
            target(ids[:, :ctx_len], **{kv: cache}, use_cache=True)
            for _ in range(reps):
                for length in todo:  # interleaved: drift hits every length alike
                    t0 = time.perf_counter()
                    mask = causal_block(ctx_len, length, p.dtype) if block and length > 1 else None  # as `Run.inputs`
                    target(ids[:, ctx_len: ctx_len + length], attention_mask=mask, **{kv: cache}, use_cache=True)
                    if p.device.type == "cuda":
                        torch.cuda.synchronize(p.device)
                    times[length - 1].append(time.perf_counter() - t0)
                    cache.crop(-length)
        verify = _interpolated({n: min(times[n - 1]) for n in todo}, k_max + 1)
        for i in range(1, len(verify)):  # never cheaper than a shorter forward, never dearer than i+1 single ones
            verify[i] = min(max(verify[i], verify[i - 1]), verify[0] * (i + 1))
        step = verify[0] * 0.15
        if drafter is not None and hasattr(drafter, "step"):
            step = CostModel._measure_step(drafter, batch, reps)
        return {"verify": verify, "step": step}

    @staticmethod
    @torch.inference_mode()  # as the loop's calls: a graph compiled under no_grad is another graph
    def _measure_compiled(compiled: CompiledForward, target: nn.Module, batch: int, k_max: int,
                          drafter: nn.Module | None, context: Callable[[], contextlib.AbstractContextManager[object]]
                          | None, ctx_len: int, reps: int) -> dict:
        """`measure` on the compiled forwards: each graph length up to k_max + 1's, the first run of each (its
        compile) left out, then every length gets its graph's time."""
        p = next(target.parameters())
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, target.config.vocab_size, (batch, ctx_len + k_max + 1), generator=gen).to(p.device)
        cache = compiled.new_cache(batch, ctx_len + k_max + 1)  # the calls' own (reused: the same graphs)
        todo = sorted({bucket(n) or n for n in range(1, k_max + 2)})
        times: dict[int, list[float]] = {n: [] for n in todo}
        kv = cache_kw(target.forward)
        pos = torch.arange(ctx_len + k_max + 1, device=p.device)[None].expand(batch, -1)
        with context() if context is not None else torch.no_grad():
            compiled(ids[:, :ctx_len], pos[:, :ctx_len], None, cache, kv, compiled=False)
            for _ in range(reps + 1):
                for length in todo:  # interleaved: drift hits every length alike
                    t0 = time.perf_counter()
                    compiled(ids[:, ctx_len: ctx_len + length], pos[:, ctx_len: ctx_len + length], None, cache, kv)
                    if p.device.type == "cuda":
                        torch.cuda.synchronize(p.device)
                    times[length].append(time.perf_counter() - t0)
                    cache.crop(-length)
        cache.crop(-cache.get_seq_length())  # the calls' cache: empty again
        at = {n: min(ts[1:]) for n, ts in times.items()}
        verify = [at[bucket(n) or n] for n in range(1, k_max + 2)]
        step = CostModel._measure_step(drafter, batch, reps) if drafter is not None and hasattr(drafter, "step") \
            else verify[0] * 0.15
        return {"verify": verify, "step": step}

    @staticmethod
    @torch.no_grad()
    def _measure_step(drafter: nn.Module, batch: int, reps: int) -> float:
        p = next(drafter.parameters())
        cache = drafter.new_cache(batch, 96)
        h = torch.zeros(batch, 1, drafter.config.hidden_size, dtype=p.dtype, device=p.device)
        ids = torch.zeros(batch, 1, dtype=torch.long, device=p.device)
        ts = []
        for i in range(reps + 2):
            pos = torch.full((batch, 1), i, dtype=torch.long, device=p.device)
            t0 = time.perf_counter()
            h, hn, logits = drafter.step(h, ids, pos, cache, i + 1)
            ids = drafter.to_target(logits[:, -1].argmax(-1))[:, None]
            ts.append(time.perf_counter() - t0)
        return min(ts[2:])

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".cost-")
            with os.fdopen(fd, "w") as f:
                json.dump({"machine": _machine_key(), "batches": self.data}, f)
            os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old or the new file
        except OSError:
            pass  # a read-only home only costs a measurement next time

    # --- online refinement -----------------------------------------------------------------
    def observe_verify(self, batch: int, length: int, seconds: float, capturing: bool = False, alpha: float = 0.05,
                       shape_alpha: float = 0.02) -> None:
        """Follow the machine: an exponential moving average of observed/measured scales the whole curve (one per
        probe state); each length used also corrects its own point slowly (a noisy measurement at load is not
        kept forever)."""
        if not self.adapt:
            return
        v = self.data[str(batch)]["verify"]
        if length <= len(v):
            key = (batch, capturing)
            old = self._scale_of(batch, capturing)
            ratio = min(max(seconds / v[length - 1], 0.5 * old), 2 * old)
            self._scale[key] = old + alpha * (ratio - old)
            if not capturing:
                v[length - 1] *= 1 + shape_alpha * (ratio / self._scale[key] - 1)

    def observe_step(self, batch: int, seconds: float, alpha: float = 0.05) -> None:
        if not self.adapt:
            return
        d = self.data[str(batch)]
        d["step"] += alpha * (min(max(seconds, 0.5 * d["step"]), 2 * d["step"]) - d["step"])

    def observe_overhead(self, batch: int, seconds: float, alpha: float = 0.1) -> None:
        if not self.adapt:
            return
        old = self._overhead.get(batch, seconds)
        self._overhead[batch] = old + alpha * (min(max(seconds, 0.0), 3 * old + 1e-4) - old)
