"""The target's KV cache for the loop: transformers' DynamicCache, whose layers write in place.

    cache = GrowingCache(capacity=prompt_len + max_new_tokens + k + 1)
    target(ids, cache=cache, use_cache=True)           # as with DynamicCache()
    cache.crop(-3)                                       # drops the last 3 columns: no copy

`DynamicLayer.update` concatenates: every forward copies each layer's whole K and V to add one
token, and a crop slices. On the default target that is 16 `torch.cat` a step over the full
context, a visible share of a one-token forward (measured: docs/design.md, "Decoder: measurements
behind the code"). A `GrowingLayer` keeps one buffer per layer with room ahead, writes the new columns
into it, and hands attention a view of the filled part; a crop only moves the length back (the next forward
writes over the dropped columns). Same logits bit for bit (the same values at the same places).

Anything that assigns `layer.keys` / `layer.values` (transformers' batch select and offloading)
replaces the buffer with that tensor, full, and the next update grows it again, so the rest of
transformers' Cache API keeps working on it, `generate` included. A tree verify's kept path moves
up in place (`GrowingLayer.keep`, from `_tree.keep_path`).
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Room added when a layer's buffer is full: at least this many columns, or half the length again.
_GROW_MIN = 256


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that writes new columns into a buffer with room ahead instead of concatenating."""

    def __init__(self, capacity: int = 0) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._n = self._nv = 0  # filled columns of keys, of values (the same but while one is being assigned)
        self.capacity = capacity  # the first buffer's length if that is enough (else: what is needed, plus room)
        super().__init__()

    # The filled part, as transformers' layers expose it; assigning replaces that buffer (keys and values are
    # assigned one after the other: each keeps its own length until both are written).
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[..., : self._n, :]

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        self._k = t
        self._n = 0 if t is None else t.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[..., : self._nv, :]

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        self._v = t
        self._nv = 0 if t is None else t.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self._n, key_states.shape[-2]
        if n + q > self._k.shape[-2]:
            self._grow(n + q, key_states, value_states)
        self._k[..., n: n + q, :] = key_states
        self._v[..., n: n + q, :] = value_states
        self._n = self._nv = n + q
        return self._k[..., : n + q, :], self._v[..., : n + q, :]

    def _grow(self, need: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        n = self._n
        cap = self.capacity if self.capacity >= need else need + max(_GROW_MIN, need // 2)
        k = key_states.new_empty((*key_states.shape[:-2], cap, key_states.shape[-1]))
        v = value_states.new_empty((*value_states.shape[:-2], cap, value_states.shape[-1]))
        k[..., :n, :] = self._k[..., :n, :]
        v[..., :n, :] = self._v[..., :n, :]
        self._k, self._v = k, v
        self.capacity = 0  # a hint for the first buffer only

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """As DynamicLayer's (a negative count removes that many columns), without a copy."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of columns to remove, got {tokens_to_remove}")
        if self.is_initialized:
            self._n = self._nv = max(0, self._n + tokens_to_remove)

    def keep(self, start: int, columns: torch.Tensor) -> None:
        """Keep the first `start` columns, then `columns` (indices, ascending, each >= start) in that order; drop
        the rest. In place: a tree verify keeps its accepted path this way."""
        for buf in (self._k, self._v):
            buf[..., start: start + len(columns), :] = buf.index_select(-2, columns)
        self._n = self._nv = start + len(columns)


class GrowingCache(DynamicCache):
    """DynamicCache of `GrowingLayer`s; `capacity` (prompt + new tokens + a round's drafts) sizes the first
    buffer of each layer so that a call never grows it."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.layer_class_to_replicate = functools.partial(GrowingLayer, capacity)  # made at each layer's first update
