"""The target's forwards compiled, as gpt-fast runs its target: a static KV cache and one graph per forward length.

    fwd = CompiledForward.of(model)                         # None where it does not apply
    cache = fwd.new_cache(batch=1, columns=prompt + new + slack)
    logits = fwd(ids, positions, mask, cache, "cache")      # [B, L, V]; the cache then holds L more columns
    cache.crop(-2)                                          # as the loop's GrowingCache: no copy

Why: a small model's forward is mostly per-op overhead, and the fastest thing a user runs instead of the loop is
transformers' compiled static-cache `generate`. Compiled, the loop's one-token step and its verify forwards shed
that overhead too (measured: docs/design.md, "Decoder: measurements behind the code").

How: `model.forward` compiled with `fullgraph=True` and static shapes, over a `StaticLoopCache` (transformers'
StaticCache: fixed buffers written in place at a position the cache keeps as a tensor, so no Python int of the
cache's length enters the graph). Every forward attends over the cache's whole capacity through an additive 4-D
mask built here from the loop's own mask (cached columns, holes, the new tokens' causal block, a tree's ancestry).
A forward of L tokens runs the graph of the next length in LENGTHS: the extra rows repeat the last real one's
view of the cache plus their own column, their K/V land past the real ones and are cropped at once. So a call
compiles at most len(LENGTHS) graphs per batch size (with the probes' taps in, as many again). The capacity is a
dynamic dimension of every graph (the cache's buffers and the mask, `torch._dynamo.mark_dynamic`): a call with a
longer prompt runs the graphs compiled before (capacities are rounded up to CAPACITY_STEP, buffers reused).

The compiled forward is swapped in as `model.forward` for the call only (the instance dict, as `_packed.py`
swaps its layers), so the model's own hooks (a probe session's step hooks) still run around it. Forwards whose
taps publish (a feature-fed drafter reading the bus) run graphs with the taps in them, padded as the others (the
loop labels the padding rows invalid, so they are never published); the prefill runs eagerly on the same cache.
The linear layers run over weights packed once (`_packed.packed_linear`), refreshed when they change; no Inductor
freezing, so a fine-tuned model stays right.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from ._packed import PackedLinears

# Forward lengths that get a graph (longer forwards run eagerly): every chain up to 5 drafts, then steps to the
# loop's longest (AUTO_K = 8 drafts: 9 tokens), an n-gram tree (12 nodes and the root: 13), and trees up to 64.
LENGTHS = (1, 2, 3, 4, 5, 6, 9, 13, 16, 32, 64)
CAPACITY_STEP = 256  # cache capacities are multiples of this (one graph serves them all: a dynamic dimension)
RECOMPILE_LIMIT = 64  # Dynamo's graphs per code object: LENGTHS x batch sizes x (taps in or not) must fit


_ATTR = "_probebus_compiled_forward"  # a model's CompiledForward, in its __dict__ (see `CompiledForward.of`)


def bucket(length: int) -> int | None:
    """The graph length a forward of `length` tokens runs at (None: longer than any, run it eagerly)."""
    return next((n for n in LENGTHS if n >= length), None)


class StaticLoopLayer(StaticLayer):
    """transformers' StaticLayer with the loop's bookkeeping: its length as a Python int kept outside the graph
    (`length`), a crop that only moves the write position back, and a tree's kept path moved up in place."""

    def __init__(self, max_cache_len: int, **kwargs: object) -> None:
        super().__init__(max_cache_len, **kwargs)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of columns to remove, got {tokens_to_remove}")
        n = min(-tokens_to_remove, self.length)
        if n:
            self.cumulative_length.sub_(n)
            self.length -= n

    def keep(self, start: int, columns: torch.Tensor) -> None:
        """Keep the first `start` columns, then `columns` (ascending, each >= start); drop the rest."""
        for buf in (self.keys, self.values):
            buf[..., start: start + len(columns), :] = buf.index_select(-2, columns)
        self.length = start + len(columns)
        self.cumulative_length.fill_(self.length)


class StaticLoopCache(StaticCache):
    """A StaticCache of `StaticLoopLayer`s sized for one call (`capacity` columns)."""

    def __init__(self, config: object, capacity: int) -> None:
        super().__init__(config=config, max_cache_len=capacity)
        self.layers = [StaticLoopLayer(capacity) for _ in self.layers]
        self.capacity = capacity
        self.dynamic = False  # its buffers' capacity dimension marked dynamic for Dynamo (`dynamic_capacity`)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def grow(self, columns: int) -> None:
        """Room for at least `columns` (a batch whose masked holes piled up): larger buffers, the filled part
        copied over; the next forwards run the same graphs (the capacity is a dynamic dimension)."""
        capacity = capacity_for(columns)
        for layer in self.layers:
            if layer.is_initialized:
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    new = old.new_zeros((*old.shape[:2], capacity, old.shape[-1]))
                    new[..., : layer.length, :] = old[..., : layer.length, :]
                    torch._dynamo.mark_static_address(new)
                    setattr(layer, name, new)
            layer.max_cache_len = capacity
        self.capacity = self.max_cache_len = capacity
        self.dynamic = False

    def dynamic_capacity(self) -> None:
        """Mark the buffers' capacity dimension dynamic (once per set of buffers): the graphs Dynamo traces on them
        serve every capacity. Measured on the default model: the same step times as graphs specialised to one
        capacity (docs/design.md, "The speculative loop on a compiled target")."""
        if self.dynamic or not all(layer.is_initialized for layer in self.layers):
            return
        for layer in self.layers:
            torch._dynamo.mark_dynamic(layer.keys, 2)
            torch._dynamo.mark_dynamic(layer.values, 2)
        self.dynamic = True

    def load(self, other: object) -> None:
        """The filled columns of another cache of the same model and batch (the eager loop's GrowingCache), copied
        in: the rest of a call runs compiled on this one."""
        for src, dst in zip(other.layers, self.layers, strict=True):  # type: ignore[attr-defined]
            n = src.get_seq_length()
            if not dst.is_initialized:  # (a cache no forward ran on yet: buffers shaped as the source's)
                dst.lazy_initialization(src.keys, src.values)
            if n > dst.max_cache_len:
                raise ValueError(f"a cache of {n} columns does not fit this one's {dst.max_cache_len}")
            dst.keys[..., :n, :] = src.keys[..., :n, :]
            dst.values[..., :n, :] = src.values[..., :n, :]
            dst.length = n
            dst.cumulative_length.fill_(n)

    def grew(self, columns: int) -> None:
        """`columns` more were written by a forward (the graph moved each layer's tensor position itself)."""
        for layer in self.layers:
            layer.length += columns


def capacity_for(columns: int) -> int:
    return -(-columns // CAPACITY_STEP) * CAPACITY_STEP


def full_mask(mask: torch.Tensor | None, b: int, cols: int, length: int, rows: int, capacity: int,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [B, 1, rows, capacity] of a forward of `length` new tokens after `cols` cached columns, from the
    loop's mask: None (every cached column open, the new ones causal), [B, cols + length] of 0/1 (holes and left
    padding closed, the new ones causal), or a 4-D additive or boolean [B or 1, 1, length, cols + length] (a
    tree's). Rows past `length` (a graph's padding) see what the last real row sees, and themselves."""
    neg = torch.finfo(dtype).min
    out = torch.full((b, 1, rows, capacity), neg, dtype=dtype)
    tri = torch.full((length, length), neg, dtype=dtype).triu(1)
    if mask is None:
        out[:, 0, :length, :cols] = 0
        out[:, 0, :length, cols: cols + length] = tri
    elif mask.dim() == 2:
        open_ = mask[:, : cols + length].cpu().bool()
        view = torch.zeros(b, length, cols + length, dtype=dtype)
        view[:, :, cols:] = tri
        out[:, 0, :length, : cols + length] = view.masked_fill(~open_[:, None, :], neg)
    else:
        m = mask.cpu()
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=dtype).masked_fill(~m, neg)
        out[:, :, :length, : cols + length] = m.to(dtype)
    if rows > length:
        out[:, :, length:, :] = out[:, :, length - 1: length, :]
        idx = torch.arange(length, rows)
        out[:, 0, idx, cols + idx] = 0
    return out.to(device)


class CompiledForward:
    """`model.forward` compiled per forward length over a `StaticLoopCache` (see the module's docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        forward = type(model).forward.__get__(model)  # the class's: never a wrapper someone set on the instance
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        self.fn = torch.compile(forward, fullgraph=True, dynamic=False)
        self.dtype = next(model.parameters()).dtype
        # the graphs call oneDNN's linear over weights packed once (`_packed.py`, `packed_linear`), where it applies
        self.packed = PackedLinears.of(model, "all")
        self._warm: set[tuple[int, int, bool]] = set()  # (batch, graph length, tapped) compiled
        self._caches: dict[tuple[int, int], StaticLoopCache] = {}  # (batch, capacity): reused call after call

    def warm(self, batch: int, capacity: int, lengths: list[int], cache_kw: str, tapped: bool = False) -> None:
        """Compile the graphs a call will run before it runs them (a call's first rounds would otherwise pay
        their compile, and judge drafting by it): forwards on the call's cache, emptied after. `tapped`: the
        model's probe taps are on (another graph of each length; the caller marks their captures invalid)."""
        todo = sorted({n for n in map(bucket, lengths)
                       if n is not None and (batch, n, tapped) not in self._warm})
        if not todo:
            return
        device = next(self.model.parameters()).device
        cache = self.new_cache(batch, capacity)
        ids = torch.full((batch, 1), 3, dtype=torch.long, device=device)
        self(ids, torch.zeros_like(ids), None, cache, cache_kw, compiled=False)
        for n in todo:
            x = ids.expand(batch, n)
            self._warm.add((batch, n, tapped))
            self(x, torch.arange(1, n + 1, device=device)[None].expand(batch, n), None, cache, cache_kw)
            cache.crop(-n)
        cache.crop(-cache.get_seq_length())

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copy of the model (`copy.deepcopy`) compiles its own forwards when it needs them

    def __reduce__(self) -> tuple:
        return type(None), ()  # nor is it saved with the model (`torch.save(model)`, pickle): it loads as None

    @classmethod
    def of(cls, model: nn.Module) -> CompiledForward | None:
        """The model's (one per model: every decoder of it shares the caches, so the graphs compiled for their
        buffers), or None where the model cannot use a static cache (transformers: `_can_compile_fullgraph`)."""
        if not getattr(model, "_can_compile_fullgraph", False):
            return None
        # Kept on the model, not in a weak map keyed by it: it holds the model (its compiled forward is bound to
        # it), so a map's entry never let the model go; a reference cycle with the model is freed with it.
        own = model.__dict__.get(_ATTR)
        if own is None:
            own = cls(model)
            model.__dict__[_ATTR] = own
        return own

    def refresh(self) -> None:
        """Weights changed since they were packed are packed again (once per call, as the eager loop's)."""
        if self.packed is not None:
            self.packed.refresh()

    def new_cache(self, batch: int, columns: int) -> StaticLoopCache:
        """An empty cache of at least `columns` for `batch` rows: the one the last call of this shape used (its
        buffers reused, not allocated again)."""
        key = (batch, capacity_for(columns))
        cache = self._caches.get(key)
        if cache is None or cache.capacity != key[1]:  # (a cache that grew in a call is replaced)
            cache = self._caches[key] = StaticLoopCache(self.model.config, key[1])
        cache.crop(-cache.get_seq_length())
        return cache

    @contextlib.contextmanager
    def _swapped(self) -> Iterator[None]:
        own = self.model.__dict__
        had = own.get("forward")
        own["forward"] = self.fn
        try:
            yield
        finally:
            if had is None:
                del own["forward"]
            else:
                own["forward"] = had

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache: StaticLoopCache, cache_kw: str, compiled: bool = True) -> torch.Tensor:
        """Logits [B, L, V] of the forward of `ids` [B, L] after the cache's columns; the cache then holds L more.
        `compiled` False (the prefill), or a forward longer than any graph: eagerly. Else the graph of
        `bucket(L)` rows (a probe session labels the padding rows invalid: `loop/_target.py`)."""
        b, length = ids.shape
        cols = cache.get_seq_length()
        rows = bucket(length) if compiled else None
        if cols + (rows or length) > cache.capacity:
            cache.grow(cols + (rows or length))
        full = full_mask(mask, b, cols, length, rows or length, cache.capacity, self.dtype, ids.device)
        if rows is not None:  # fresh dense tensors: Dynamo guards on strides (a slice, an expand: a new graph)
            cache.dynamic_capacity()
            torch._dynamo.mark_dynamic(full, 3)
            extra = rows - length
            ids = torch.cat([ids, ids[:, -1:].expand(b, extra)], 1)  # (a new tensor even where extra is 0)
            positions = torch.cat([positions, positions[:, -1:].expand(b, extra)], 1)
        kw = {cache_kw: cache}
        with contextlib.ExitStack() as stack:
            if rows is not None:
                stack.enter_context(self._swapped())
                if self.packed is not None:
                    stack.enter_context(self.packed.traced(rows=b * rows))
            logits = self.model(ids, attention_mask=full, position_ids=positions, use_cache=True, **kw).logits
        cache.grew(ids.shape[1])
        if ids.shape[1] > length:
            cache.crop(length - ids.shape[1])
            logits = logits[:, :length]
        return logits
