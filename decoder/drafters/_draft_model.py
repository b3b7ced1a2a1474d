"""Draft with a whole causal LM: a separate small model, or the target's own first layers (layer skip).

    spec = SpeculativeDecoder(target, DraftModelDrafter(small_lm), k=5)          # assisted generation
    spec = SpeculativeDecoder(target, LayerSkipDrafter(target, layers=3), k=5)   # self-speculative early exit

Both are `Feeder`s without feature sites: they need the committed token ids only, so no probe
session is attached for them. The drafter keeps its own KV cache with the loop's layout
(explicit positions, one shared column per fed token, masked-out holes where a row fed
less), so rows at different lengths draft together. Per round it feeds what was committed
since it last ran (the accepted drafts and the bonus token) in one forward, drafts one
token per further forward, then drops the drafted tokens from its cache: the next round
feeds back only those the target accepted.

Layer skip runs the target's first `layers` decoder layers, then the target's own final
norm and head (early exit; the modules are shared, not copied).
"""

from __future__ import annotations

import copy
import time
from typing import Protocol

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from ..forward._compat import cache_kw
from ..forward._kv import GrowingCache
from ..schedule import DraftPlan
from ._chain import draft_chain
from ._feeder import Drafts, Feed


class BoundRun(Protocol):
    """What `LayerSkipDrafter` reads of the loop's per-call `Run` (`bind_run`); the loop imports the drafters,
    so the drafters name the attributes they use instead of importing it."""

    device: torch.device
    cols: int  # cache columns in use
    mask: torch.Tensor  # [B, columns] 2-D attention mask over the target's cache
    last: list[int]  # per row: the position of the token that goes in next
    cache: DynamicCache  # the target's KV cache

    def inputs(self, drafts: torch.Tensor,
               block: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class DraftModelDrafter:
    """A causal LM that shares the target's tokenizer drafts for it (transformers' assisted generation,
    scheduled and verified by the probebus loop)."""

    sites: list[str] = []  # reads no features off the bus
    name = "draft-model"

    def __init__(self, model: nn.Module, *, name: str | None = None) -> None:
        self.model = model.eval()
        self.cache_kw = cache_kw(model.forward)  # how this transformers release names the KV cache (`_compat.py`)
        self.vocab = int(model.config.vocab_size)
        self.name = name or self.name
        self.source = getattr(model.config, "_name_or_path", "")

    # --- the Feeder protocol --------------------------------------------------------------
    def connect(self, endpoint: str) -> None:  # no features to subscribe to
        pass

    def close(self) -> None:
        pass

    def draft_to_target_ids(self) -> torch.Tensor:
        return torch.arange(self.vocab)

    def check_target(self, target: nn.Module) -> None:
        """A draft model must speak the target's vocabulary (ids are compared, not strings)."""
        if self.vocab != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.vocab}) differs from the target's "
                             f"({target.config.vocab_size}): a draft model must share the target's tokenizer")

    def prepare(self, batch: int, max_len: int) -> None:
        self.device = next(self.model.parameters()).device
        self.mask = torch.zeros(batch, 2 * max_len + 16, dtype=torch.long, device=self.device)
        self.cache = GrowingCache(capacity=self.mask.shape[1])  # written in place (`_kv.py`)
        self.cols = 0  # cache columns in use
        self.fed = [0] * batch  # per row: positions 0..fed-1 are in the cache
        self.last: list[int] | None = None  # per row: the newest committed position (its token is known)

    @torch.no_grad()
    def draft(self, feeds: list[Feed], toks: torch.Tensor, k: int, temperature: float, seed: int | None,
              plan: DraftPlan | None = None) -> Drafts:
        t0 = time.perf_counter()
        b = toks.shape[0]
        if feeds:
            self.last = [min(e + 1, toks.shape[1] - 1) for e in feeds[-1][2].tolist()]
        if k == 0:
            return Drafts.empty(b)
        if self.last is None:
            raise RuntimeError("draft() before any tokens were committed: nothing to draft from")
        logits = self._catch_up(toks)
        gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        base = torch.tensor(self.last, device=self.device)[:, None]
        start_cols = self.cols
        tokens, conf, q = draft_chain(logits, lambda tok, i: self._forward(tok[:, None], base + 1 + i)[:, -1],
                                      k, temperature, gen, plan)
        self._drop(start_cols)  # drafted tokens leave the cache; accepted ones come back next round
        return Drafts(tokens.cpu(), tokens, conf, q, 0.0, time.perf_counter() - t0)

    # --- the cache ---------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        n = ids.shape[1]
        if self.cols + n > self.mask.shape[1]:  # holes piled up: grow the mask
            grown = torch.zeros(self.mask.shape[0], 2 * self.mask.shape[1] + n, dtype=torch.long, device=self.device)
            grown[:, : self.cols] = self.mask[:, : self.cols]
            self.mask = grown
        self.mask[:, self.cols: self.cols + n] = 1 if valid is None else valid.long()
        self.cols += n
        return self.model(ids.to(self.device), attention_mask=self.mask[:, : self.cols], position_ids=positions,
                          **{self.cache_kw: self.cache}, use_cache=True).logits

    def _drop(self, cols: int) -> None:
        if self.cols > cols:
            self.cache.crop(cols - self.cols)  # transformers 5: crop(-n) removes the last n tokens
            self.mask[:, cols: self.cols] = 0
            self.cols = cols

    def _catch_up(self, toks: torch.Tensor) -> torch.Tensor:
        """Feed every row's committed tokens not yet in the cache; the logits after each row's newest one [B, V].
        A row with nothing new (a finished row) feeds a masked-out slot and gets logits nobody reads."""
        b = toks.shape[0]
        n = [last + 1 - fed for last, fed in zip(self.last, self.fed, strict=True)]
        width = max(max(n), 1)
        start = torch.tensor(self.fed)
        pos = start[:, None] + torch.arange(width)
        ids = toks[torch.arange(b)[:, None], pos.clamp(max=toks.shape[1] - 1)]
        valid = torch.arange(width)[None, :] < torch.tensor(n)[:, None]
        logits = self._forward(ids, pos.to(self.device), valid.to(self.device))
        self.fed = [max(fed, last + 1) for fed, last in zip(self.fed, self.last, strict=True)]
        return logits[torch.arange(b), (torch.tensor(n) - 1).clamp(min=0)]


def early_exit_view(target: nn.Module, layers: int) -> nn.Module:
    """The target's first `layers` decoder layers with its final norm and head, as a causal LM of its own.

    Shares every module and weight with the target (nothing is copied); only the module tree and the
    config's layer count differ. Works for models whose decoder keeps its layers in `model.layers`
    (Llama, Mistral, Qwen2/3 and most current decoders)."""
    inner = getattr(target, "model", None)
    blocks = getattr(inner, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"layer skip needs a decoder with `model.layers` (Llama-style); {type(target).__name__} "
                         "has none: use a draft model or EAGLE-3 instead")
    n = len(blocks)
    if not 1 <= layers < n:
        raise ValueError(f"layer skip drafts with 1..{n - 1} of the target's {n} layers, got {layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)
    view_inner._modules["layers"] = nn.ModuleList(list(blocks[:layers]))
    view_inner.config = config
    view = copy.copy(target)
    view._modules = dict(target._modules)
    view._modules["model"] = view_inner
    view.config = config
    return view


class LayerSkipDrafter(DraftModelDrafter):
    """Self-speculative decoding: the target drafts with its first `layers` layers (early exit).

    Both sides reuse each other's states (LayerSkip's self-speculation). Drafting attends to the target's own
    KV cache of the kept layers (the loop hands it the call's `Run` through `bind_run`), so no committed token
    runs twice through the early layers. Verification starts at layer `layers`: the draft's K/V of the kept
    layers stay in the target's cache, and its hidden states after the last kept layer are the input of the
    remaining ones (`verify_from_draft`), so the drafted tokens never run through the early layers a second time either.
    Without a bound run (a caller of its own) it keeps a cache of its own like any draft model."""

    name = "layer-skip"

    def __init__(self, target: nn.Module, layers: int) -> None:
        super().__init__(early_exit_view(target, layers), name="layer-skip")
        self.target = target
        self.layers = layers
        self.run: BoundRun | None = None
        self._pending: tuple[int, torch.Tensor, list[torch.Tensor]] | None = None  # cols, drafts, exit states

    def bind_run(self, run: BoundRun | None) -> None:
        """The loop's `Run` of this call (None: draft with a cache of its own)."""
        self._release()
        self.run = run

    @torch.no_grad()
    def draft(self, feeds: list[Feed], toks: torch.Tensor, k: int, temperature: float, seed: int | None,
              plan: DraftPlan | None = None) -> Drafts:
        run = self.run
        if run is None:
            return super().draft(feeds, toks, k, temperature, seed, plan)
        self._release()
        t0 = time.perf_counter()
        b = toks.shape[0]
        if k == 0:
            return Drafts.empty(b)
        dev, cols = run.device, run.cols
        prefix = run.mask[:, :cols]
        base = torch.tensor(run.last, device=dev)[:, None]
        states: list[torch.Tensor] = []  # the exit layer's output per drafted forward: verification's input

        def forward(tok: torch.Tensor, i: int) -> torch.Tensor:
            mask = torch.cat([prefix, torch.ones(b, len(states) + 1, dtype=prefix.dtype, device=dev)], 1)
            return self.model(tok[:, None].to(dev), attention_mask=mask, position_ids=base + i,
                              **{self.cache_kw: run.cache}, use_cache=True).logits[:, -1]

        exit_layer = self.model.model.layers[self.layers - 1]
        hook = exit_layer.register_forward_hook(lambda _m, _a, out: states.append(out[0] if isinstance(out, tuple)
                                                                                   else out))
        gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
        self._pending = (cols, torch.empty(b, 0, dtype=torch.long), states)  # `verify_from_draft` or `_release` ends it
        try:
            first = forward(toks[torch.arange(b), torch.tensor(run.last)], 0)  # the newest committed token
            tokens, conf, q = draft_chain(first, lambda tok, i: forward(tok, i + 1), k, temperature, gen, plan)
        except BaseException:
            self._release()
            raise
        finally:
            hook.remove()
        self._pending = (cols, tokens, states)
        return Drafts(tokens.cpu(), tokens, conf, q, 0.0, time.perf_counter() - t0)

    @torch.no_grad()
    def verify_from_draft(self, run: BoundRun, drafts: torch.Tensor, reuse: bool = True) -> torch.Tensor | None:
        """The round's verify logits [B, L, V] for [last, drafts], computed from layer `layers` on with the draft's
        states, or None (after taking the draft's columns off the cache) when the round verifies other tokens
        than the ones drafted, or `reuse` is off (the caller's probes must see every layer)."""
        pending = self._pending
        if pending is None:
            return None
        cols, drafted, states = pending
        n = drafts.shape[1]
        if not reuse or n == 0 or n > drafted.shape[1] or run.cols != cols or \
                not torch.equal(drafts.cpu(), drafted[:, :n].cpu()):
            self._release()
            return None
        self._pending = None
        inner, length = self.target.model, n + 1
        inp, positions, mask = run.inputs(drafts, block=False)  # `_layers` builds its mask per layer group
        if len(states) < length:  # the last draft never ran through the kept layers: only that token does now
            states.append(_layers(inner, 0, self.layers, inner.embed_tokens(inp[:, -1:]), positions[:, -1:], mask,
                                  run.cache))
        self._crop_kept(cols + length)  # drafted beyond what this round verifies
        hidden = torch.cat(states[:length], 1)
        hidden = _layers(inner, self.layers, len(inner.layers), hidden, positions, mask, run.cache)
        return self.target.get_output_embeddings()(inner.norm(hidden))

    def _release(self) -> None:
        """Take a draft's columns off the target's cache of the kept layers (it is not verified from them)."""
        if self._pending is None:
            return
        cols = self._pending[0]
        self._pending = None
        self._crop_kept(cols)

    def _crop_kept(self, length: int) -> None:
        """The target's cache of the kept layers back to `length` columns (the other layers never held more)."""
        for layer in self.run.cache.layers[: self.layers]:
            if layer.get_seq_length() > length:
                layer.crop(length - layer.get_seq_length())


def _layers(inner: nn.Module, lo: int, hi: int, hidden: torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Run decoder layers lo..hi-1 of a Llama-style `inner` model on `hidden` [B, L, H] at `positions`, with the
    2-D attention mask over layer lo's cache columns plus these L (sized against layer lo: mid-round the kept
    layers hold the draft's columns and the others do not)."""
    causal = create_causal_mask(config=inner.config, inputs_embeds=hidden, attention_mask=mask,
                                **{cache_kw(create_causal_mask): cache}, position_ids=positions, layer_idx=lo)
    rope = inner.rotary_emb(hidden, position_ids=positions)
    kv = cache_kw(inner.layers[lo].forward)  # one decoder layer class per model
    for layer in inner.layers[lo:hi]:
        hidden = layer(hidden, attention_mask=causal, position_embeddings=rope, position_ids=positions,
                       **{kv: cache}, use_cache=True)
    return hidden
