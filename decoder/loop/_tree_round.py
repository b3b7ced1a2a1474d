"""One tree round of the speculative loop (batch 1): draft a tree, verify it in one forward, keep one branch.

    kept = tree_round(decoder, run)      # what SpeculativeDecoder.generate runs per round with tree=N

The node count is chosen per round from the measured cost of verifying L tokens and the tree's
path probabilities (`Tree.budget`); zero nodes is a plain step. At T > 0 the children are drawn
from the drafter's q and verified with SpecInfer's rule (`_tree_sample.py`). The target's forward carries a
4-D attention mask (prefix + ancestors) and per-node positions (root position + depth), the
probes label node j with position root + j, and the feed handed to the drafter maps those
labels back to real positions of the accepted branch, so the drafter reads exactly the
features of the tokens that were kept.
"""

from __future__ import annotations

import time

import torch

from ..drafters._feeder import EagleFeeder
from ..drafters._tree import Tree, eagle_tree, keep_path, medusa_tree, tree_attention, verify_tree_greedy
from ..drafters._tree_sample import eagle_tree_sampled, medusa_tree_sampled, verify_drawn_tree
from ..verify import target_probs
from ._run import Run


def supports_tree(feeder: object) -> bool:
    return isinstance(feeder, EagleFeeder) or getattr(feeder, "tree", False)


@torch.no_grad()
def tree_round(dec, run: Run) -> list[list[int]]:  # noqa: ANN001 - a SpeculativeDecoder
    t0 = time.perf_counter()
    f = dec.feeder
    eagle = isinstance(f, EagleFeeder)
    if eagle:
        run.stats.bus_s += f.absorb(run.take_feeds(), run.toks)
    else:
        f.absorb(run.take_feeds())
    depth = max(run.caps(dec.k)[0], 0)
    curve = dec.cost.curve(1, dec.tree, capturing=True)
    if run.mode == "sample":  # children drawn from q, sized before drawing (nothing drawn is pruned)
        grow = eagle_tree_sampled if eagle else medusa_tree_sampled
        tree = grow(f, depth, dec.tree_top_k, run.temperature, curve, run.gen)
    else:
        tree = (eagle_tree if eagle else medusa_tree)(f, dec.k, dec.tree_top_k).within(depth)
        tree = tree.top(tree.budget(curve))
    t1 = time.perf_counter()
    dec._capture(True)
    kept, path = verify_tree(dec, run, tree)
    count_round(dec, run, tree, path, kept, (t0, t1, time.perf_counter()), len(tree), capturing=True)
    return kept


def verify_tree(dec, run: Run, tree: Tree) -> tuple[list[list[int]], list[int]]:  # noqa: ANN001
    """One target forward over [last, tree nodes] (batch 1), then keep the accepted branch: its K/V, its tokens
    (streamer and n-gram index too) and, for a drafter that reads features, the feed of its real positions.
    Returns (tokens kept, accepted node indices)."""
    n, last, cols = len(tree), run.last[0], run.cols
    run.reserve(n + 1)
    dev = run.device
    ids = torch.tensor([[int(run.toks[0, last])] + tree.tokens], device=dev)
    pos = torch.tensor([[last] + [last + d for d in tree.depths]], device=dev)
    mask = tree_attention(run.mask[:, :cols], tree, next(dec.target.parameters()).dtype)
    with dec._context("verify", run, (last + torch.arange(n + 1))[None].to(dev)), dec.packed_weights():
        logits = dec.target(ids, attention_mask=mask, position_ids=pos, **{dec.cache_kw: run.cache},
                            use_cache=True).logits[0]
    if run.mode == "greedy":
        path, nxt = verify_tree_greedy(tree, logits)
    else:
        p = target_probs(logits, run.temperature, run.top_k, run.top_p)
        path, nxt = verify_drawn_tree(tree, p, run.gen)
    keep_path(run.cache, cols, path)
    run.mask[:, cols: cols + len(path) + 1] = 1
    kept = run.commit([len(path)], [nxt], torch.tensor([[tree.tokens[i] for i in path]], dtype=torch.long))
    step = dec.session.step if dec.session is not None else 0
    span = run.advance(dec.feeder is not None and dec._capturing)
    if span is not None:  # the probes labelled node j with position last + j: map the kept ones back
        real = torch.full((n + 1,), -1, dtype=torch.long)
        real[0] = last
        for j, i in enumerate(path):
            real[i + 1] = last + 1 + j
        run.add_feed((step, *span, (last, real)))
    if run.ngram is not None and kept[0]:
        run.ngram[0].extend(kept[0])
    if run.streamer is not None and kept[0]:
        run.streamer.put(torch.tensor(kept[0]))
    return kept, path


def count_round(dec, run: Run, tree: Tree, path: list[int], kept: list[list[int]],  # noqa: ANN001
                times: tuple[float, float, float], eagle_drafts: int, capturing: bool) -> None:
    """A tree round's statistics and the cost model's observation of its forward; times = (round start,
    verify start, end)."""
    t0, t1, now = times
    n = len(tree)
    st = run.stats
    st.rounds += 1
    st.tree_rounds += n > 0
    st.plain_rounds += n == 0
    st.target_forwards += 1
    st.row_rounds += 1
    st.emitted += len(kept[0])
    st.drafted += n
    st.drafted_row_rounds += n > 0
    st.accepted += len(path)
    for i in range(min(max(tree.depths, default=0), len(st.offered_at))):
        st.offered_at[i] += 1
        st.accepted_at[i] += int(len(path) > i)
    st.draft_s += t1 - t0
    st.verify_s += now - t1
    st.history.append((n + 1, 1, n, len(path), eagle_drafts))
    dec.cost.observe_verify(1, n + 1, now - t1, capturing=capturing)
