"""Tree drafts (EAGLE-2-style dynamic trees) and their lossless verification in one target forward.

    tree = eagle_tree(feeder, depth=5, top_k=4)       # or medusa_tree(feeder, depth=4, top_k=4)
    n = tree.budget(verify_cost)                      # how many nodes pay, from measured forward costs
    tree = tree.top(n)
    logits = target(root + tree.tokens, attention_mask=tree_attention(...), position_ids=last + depth)
    path, nxt = verify_tree_greedy(tree, logits)      # T > 0: trees drawn from q, see _tree_sample.py
    keep_path(cache, cols, path)                      # the KV cache keeps the accepted branch only

A model drafter's trees grow depth by depth: each frontier node is one row of a batched drafter step
(its own copy of the drafter's KV cache, gathered from its parent's), its children are the
best `top_k` of all frontier children by cumulative draft probability, and every candidate
seen is kept for the final rerank. Medusa trees take the Cartesian product of the heads'
top tokens best-first (cumulative probability = product of the heads' probabilities). In
both, the nodes kept are the most probable ones, so a node's parent is always kept too, and
the expected accepted length of the top n nodes is 1 + (sum of their path probabilities)
when the draft probabilities are calibrated: `budget` weighs that against the forward's cost.

Greedy verification walks from the root and follows the child equal to the target's argmax.
At T > 0 the children are drawn from the drafter's q instead and verified with SpecInfer's rule
(_tree_sample.py), so `top`/`within` refuse a sampled tree: nothing drawn may be pruned.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from ..forward._compiled import StaticLoopLayer
from ..forward._kv import GrowingLayer

if TYPE_CHECKING:  # types only: the feeders stay unimported here (no import cycle)
    from ._eagle import DraftCache
    from ._feeder import EagleFeeder
    from ._medusa import MedusaFeeder


@dataclass
class Tree:
    """Nodes in parent-before-child order; `parents[i]` = -1 for a child of the root (the last committed token)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    probs: list[float] = field(default_factory=list)  # cumulative draft probability of the path to the node
    # sampled trees (_tree_sample.py): per parent (index + 1; 0 = the root) its q [V] and the tokens drawn from it
    draws: dict[int, tuple[torch.Tensor, list[int]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tokens)

    def top(self, n: int) -> Tree:
        """The n most probable nodes (parents before children, ancestors always included)."""
        self._prunable()
        order = sorted(range(len(self)), key=lambda i: -self.probs[i])[:n]
        keep = set(order)
        for i in order:  # ties could rank a child above its parent
            p = self.parents[i]
            while p >= 0 and p not in keep:
                keep.add(p)
                p = self.parents[p]
        kept = sorted(keep, key=lambda i: (self.depths[i], -self.probs[i]))
        index = {old: new for new, old in enumerate(kept)}
        return Tree([self.tokens[i] for i in kept], [index.get(self.parents[i], -1) for i in kept],
                    [self.depths[i] for i in kept], [self.probs[i] for i in kept])

    def within(self, depth: int) -> Tree:
        """The nodes at most `depth` deep (a row near its token budget cannot use deeper ones)."""
        self._prunable()
        keep = [i for i in range(len(self)) if self.depths[i] <= depth]
        index = {old: new for new, old in enumerate(keep)}
        return Tree([self.tokens[i] for i in keep], [index.get(self.parents[i], -1) for i in keep],
                    [self.depths[i] for i in keep], [self.probs[i] for i in keep])

    def _prunable(self) -> None:
        if self.draws:
            raise ValueError("a sampled tree cannot be pruned after its draws: verification would see a filtered "
                             "draw from q (decide each node's draws before drawing, as grow_sampled does)")

    def budget(self, verify_cost: list[float], draft_cost: float = 0.0) -> int:
        """Nodes that maximise expected tokens per second: (1 + sum of the top n path probabilities) over the cost
        of verifying n + 1 tokens (verify_cost[L - 1] = seconds for L tokens) plus drafting."""
        probs = sorted(self.probs, reverse=True)
        best_n, best = 0, 1.0 / verify_cost[0]
        gain = 1.0
        for n in range(1, min(len(probs), len(verify_cost) - 1) + 1):
            gain += probs[n - 1]
            rate = gain / (verify_cost[n] + draft_cost)
            if rate > best:
                best_n, best = n, rate
        return best_n

    def children(self) -> list[list[int]]:
        """Per node (index + 1; 0 = the root): its children, most probable first."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i in sorted(range(len(self)), key=lambda i: -self.probs[i]):
            out[self.parents[i] + 1].append(i)
        return out


@torch.no_grad()
def eagle_tree(feeder: EagleFeeder, depth: int, top_k: int) -> Tree:
    """Grow a model drafter's draft tree for batch row 0 from the feeder's newest state (after `absorb()`)."""
    d2t = feeder.d2t
    logp = feeder.logits[0, 0].float().log_softmax(-1)  # the root's children
    val, ids = logp.topk(top_k)
    tree = Tree(d2t[ids].tolist(), [-1] * top_k, [1] * top_k, val.exp().tolist())
    front = list(range(top_k))  # tree indices of the frontier nodes (one drafter row each)
    front_lp = val
    cache = _rows(feeder.cache, [0] * top_k)
    h = feeder.h[:1].expand(top_k, -1, -1)
    pos = int(feeder.fed_end[0]) + 1
    span = pos + 1
    for d in range(1, depth):
        toks = torch.tensor([tree.tokens[i] for i in front], device=h.device)[:, None]  # target ids
        where = torch.full((len(front), 1), pos + d - 1, device=h.device)
        h, _, logits = feeder.step(h, toks, where, cache, span + d - 1)
        child = logits[:, 0].float().log_softmax(-1) + front_lp[:, None]  # [F, Vd] cumulative
        val, flat = child.flatten().topk(min(top_k * top_k, child.numel()))
        rows, ids = flat // child.shape[1], flat % child.shape[1]
        first = len(tree)
        tree.tokens += d2t[ids].tolist()
        tree.parents += [front[r] for r in rows.tolist()]
        tree.depths += [d + 1] * len(val)
        tree.probs += val.exp().tolist()
        pick = list(range(min(top_k, len(val))))  # the best top_k candidates are the next frontier
        front = [first + j for j in pick]
        front_lp = val[: len(pick)]
        cache = _rows(cache, rows[: len(pick)].tolist())
        h = h[rows[: len(pick)]]
    return tree


def _rows(cache: DraftCache, rows: list[int]) -> DraftCache:
    """A copy of the drafter cache holding the given rows (a frontier node's copy of its parent's cache)."""
    out = object.__new__(type(cache))
    idx = torch.tensor(rows, device=cache.k.device)
    out.k, out.v, out.valid = cache.k[idx], cache.v[idx], cache.valid[idx]
    return out


@torch.no_grad()
def medusa_tree(feeder: MedusaFeeder, depth: int, top_k: int, limit: int = 64) -> Tree:
    """Best-first product of the Medusa heads' top tokens for batch row 0, at most `limit` nodes."""
    probs = feeder.heads(feeder.h[:1])[0].float().softmax(-1)  # [K, V]
    depth = min(depth, probs.shape[0])
    top = [probs[d].topk(top_k) for d in range(depth)]
    tree = Tree()
    heap: list[tuple[float, int, int, int]] = [(-float(top[0].values[j]), -1, 0, j) for j in range(top_k)]
    heapq.heapify(heap)
    while heap and len(tree) < limit:
        neg, parent, d, j = heapq.heappop(heap)
        tree.tokens.append(int(top[d].indices[j]))
        tree.parents.append(parent)
        tree.depths.append(d + 1)
        tree.probs.append(-neg)
        me = len(tree) - 1
        if d + 1 < depth:
            for c in range(top_k):
                heapq.heappush(heap, (neg * float(top[d + 1].values[c]), me, d + 1, c))
    return tree


def tree_attention(prefix: torch.Tensor, tree: Tree, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D mask [1, 1, n + 1, cols + n + 1]: every query sees the valid prefix columns, the root, its
    ancestors and itself."""
    n = len(tree)
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for i in range(n):
        allowed[i + 1, i + 1] = True
        p = tree.parents[i]
        while p >= 0:
            allowed[i + 1, p + 1] = True
            p = tree.parents[p]
    full = torch.cat([prefix.bool().cpu().expand(n + 1, -1), allowed], 1)
    mask = torch.zeros(full.shape, dtype=dtype)
    mask.masked_fill_(~full, torch.finfo(dtype).min)
    return mask[None, None].to(prefix.device)


def keep_path(cache: DynamicCache, cols: int, path: list[int]) -> None:
    """Keep the prefix, the root and the accepted nodes' K/V (batch 1); drop every other tree column."""
    idx = torch.tensor([*range(cols + 1), *(cols + 1 + i for i in path)])
    for layer in cache.layers:
        if isinstance(layer, GrowingLayer | StaticLoopLayer):  # the loop's caches: the path moved up in place
            layer.keep(cols + 1, idx[cols + 1:].to(layer.device))
            continue
        keys = layer.keys
        ix = idx.to(keys.device)
        layer.keys = keys.index_select(-2, ix)
        layer.values = layer.values.index_select(-2, ix)
