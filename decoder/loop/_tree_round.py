"""One tree round of the speculative loop (batch 1): draft a tree, verify it in one forward, keep one branch.

    kept = tree_round(run, target, feeder, cost, k, nodes=16, top_k=4)   # SpeculativeDecoder(..., tree=16)
    kept, path = verify_tree(run, target, tree, feed)                     # also n-gram trees (`_ngram_tree.py`)

The node count is chosen per round from the measured cost of verifying L tokens and the tree's
path probabilities (`Tree.budget`); zero nodes is a plain step. At T > 0 the children are drawn
from the drafter's q and verified with SpecInfer's rule (`decoder.verify`). The target's forward carries a
4-D attention mask (prefix + ancestors) and per-node positions (root position + depth), the
probes label node j with position root + j, and the feed handed to the drafter maps those
labels back to real positions of the accepted branch, so the drafter reads exactly the
features of the tokens that were kept.
"""

from __future__ import annotations

import time

import torch

from .. import verify
from ..drafters import (
    EagleFeeder,
    Feeder,
    Tree,
    eagle_tree,
    eagle_tree_sampled,
    keep_path,
    medusa_tree,
    medusa_tree_sampled,
    tree_attention,
)
from ..schedule import CostModel
from ._accounting import account_tree
from ._run import Run
from ._target import Target


def supports_tree(feeder: object) -> bool:
    return isinstance(feeder, EagleFeeder) or getattr(feeder, "tree", False)


@torch.no_grad()
def tree_round(run: Run, target: Target, feeder: Feeder, cost: CostModel, k: int, nodes: int,
               top_k: int) -> list[list[int]]:
    t0 = time.perf_counter()
    eagle = isinstance(feeder, EagleFeeder)
    if eagle:
        run.stats.bus_s += feeder.absorb(run.take_feeds(), run.toks)
    else:
        feeder.absorb(run.take_feeds())
    depth = max(run.caps(k)[0], 0)
    curve = cost.curve(1, nodes, capturing=True)
    if run.mode == "sample":  # children drawn from q, sized before drawing (nothing drawn is pruned)
        grow = eagle_tree_sampled if eagle else medusa_tree_sampled
        tree = grow(feeder, depth, top_k, run.temperature, curve, run.gen)
    else:
        tree = (eagle_tree if eagle else medusa_tree)(feeder, k, top_k).within(depth)
        tree = tree.top(tree.budget(curve))
    t1 = time.perf_counter()
    target.capture(True)
    kept, path = verify_tree(run, target, tree, readers=[True])  # one drafter, its probes on
    account_tree(run, tree, path, kept, (t0, t1, time.perf_counter()), len(tree), cost, capturing=True)
    return kept


def verify_tree(run: Run, target: Target, tree: Tree,
                readers: list[bool] | None) -> tuple[list[list[int]], list[int]]:
    """One target forward over [last, tree nodes] (batch 1), then keep the accepted branch: its K/V, its tokens
    (streamer and n-gram index too) and, for the model drafters that read this forward (`readers`, None: none),
    the feed of its real positions. Returns (tokens kept, accepted node indices)."""
    n, last, cols = len(tree), run.last[0], run.cols
    run.reserve(n + 1)
    dev = run.device
    ids = torch.tensor([[int(run.toks[0, last])] + tree.tokens], device=dev)
    pos = torch.tensor([[last] + [last + d for d in tree.depths]], device=dev)
    mask = tree_attention(run.mask[:, :cols], tree, next(target.model.parameters()).dtype)
    labels = (last + torch.arange(n + 1))[None].to(dev)
    logits = target.forward(run, ids, pos, mask, labels=labels)[0]
    if run.mode == "greedy":
        path, nxt = verify.verify_tree_greedy(tree, logits)
    else:
        p = verify.target_probs(logits, run.temperature, run.top_k, run.top_p)
        path, nxt = verify.verify_tree_sampled(tree, p, run.gen)
    keep_path(run.cache, cols, path)
    run.mask[:, cols: cols + len(path) + 1] = 1
    remap = None
    if readers:  # the probes labelled node j with last + j: map the kept ones back to their real positions
        real = torch.full((n + 1,), -1, dtype=torch.long)
        real[0] = last
        for j, i in enumerate(path):
            real[i + 1] = last + 1 + j
        remap = (last, real)
    kept = run.keep([len(path)], [nxt], torch.tensor([[tree.tokens[i] for i in path]], dtype=torch.long),
                    target.step if readers else None, readers, remap=remap)
    return kept, path
