"""Sampled draft trees at T > 0: SpecInfer's multi-draft rule with the drafter's own q.

    tree = eagle_tree_sampled(feeder, depth, top_k, temperature, verify_cost, generator)  # or medusa_tree_sampled
    path, nxt = verify_drawn_tree(tree, p, generator)    # p [n + 1, V]: the target's distributions

A deterministic top-k tree at T > 0 can only be verified with point masses (a child x is
accepted with the residual's own mass r(x)). Here each node's children are drawn from the
drafter's q at the sampling temperature instead, and each draw x is accepted with
min(1, r(x) / q(x)); after a rejection the residual becomes norm(max(r - q, 0)) (SpecInfer, Miao
et al. 2023). Every draw is an exact speculative step on the residual, so the emitted token
follows p, and a drafter whose q is close to p gets most of its draws accepted. Draws are i.i.d.
with replacement: a token drawn twice is one node, and its second draw is a certain rejection
(r(x) is 0 after the first) that still updates the residual.

What may depend on what, for the rule to stay exact: how many draws a node gets (its slots) is
decided from its q and its path's estimate before anything is drawn from that q, and nothing drawn
is pruned afterwards (pruning by drawn value would verify a filtered draw, not a draw from q).
Slots go level by level to the most probable candidates (EAGLE-2's ranking by the drafter's path
probability) while one more verified token still raises the expected tokens per second on the
measured verify-cost curve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..verify import sample
from ._tree import Tree, _rows

if TYPE_CHECKING:  # types only: the feeders stay unimported here (no import cycle)
    from ._feeder import EagleFeeder
    from ._medusa import MedusaFeeder

# expand(tokens of the new frontier, index of each one's parent in the previous frontier, depth) -> q [F, V]
Expand = Callable[[list[int], list[int], int], torch.Tensor]


def grow_sampled(root_q: torch.Tensor, expand: Expand, depth: int, top_k: int, verify_cost: list[float],
                 generator: torch.Generator | None) -> Tree:
    """A tree whose children are drawn from q. root_q [V]: the drafter's distribution after the last committed
    token; verify_cost[L - 1]: seconds to verify L tokens."""
    tree = Tree()
    est = {-1: 1.0}  # node -> the drafter's probability of its path (-1 = the root)
    gain, n = 1.0, 0  # expected tokens per round (bonus included) and slots so far
    front, q = [-1], root_q[None]
    for d in range(1, depth + 1):
        width = min(top_k, q.shape[1])
        vals = q.topk(width, dim=-1).values * torch.tensor([est[x] for x in front], device=q.device)[:, None]
        cand = vals.flatten()
        slots = [0] * len(front)
        for j in cand.argsort(descending=True)[:top_k].tolist():  # decided before anything is drawn
            e = float(cand[j])
            if n + 1 >= len(verify_cost) or (gain + e) / verify_cost[n + 1] <= gain / verify_cost[n]:
                break
            gain, n = gain + e, n + 1
            slots[j // width] += 1
        new: list[tuple[int, int]] = []  # (node, its parent's index in front)
        for f, m in enumerate(slots):
            if not m:
                continue
            drawn = sample(q[f], generator, m).tolist()
            parent = front[f]
            tree.draws[parent + 1] = (q[f], drawn)
            for x in dict.fromkeys(drawn):  # distinct tokens in the order first drawn
                i = len(tree)
                est[i] = est[parent] * float(q[f, x])
                tree.tokens.append(x)
                tree.parents.append(parent)
                tree.depths.append(d)
                tree.probs.append(est[i])
                new.append((i, f))
        if not new or d == depth:
            break
        new = sorted(new, key=lambda t: -est[t[0]])[:top_k]  # the next frontier: its q comes from the drafter
        front = [i for i, _ in new]
        q = expand([tree.tokens[i] for i in front], [f for _, f in new], d)
    return tree


@torch.no_grad()
def eagle_tree_sampled(feeder: EagleFeeder, depth: int, top_k: int, temperature: float, verify_cost: list[float],
                       generator: torch.Generator | None) -> Tree:
    """A sampled model drafter's tree for batch row 0 (an EagleFeeder after absorb()); q is drawn in the draft
    vocabulary's softmax and placed on the target's ids through d2t (no full-vocabulary softmax)."""
    d2t = feeder.d2t
    vocab = feeder.drafter.config.vocab_size

    def q_of(logits: torch.Tensor) -> torch.Tensor:
        qd = (logits.float() / temperature).softmax(-1)
        return torch.zeros(qd.shape[0], vocab, device=qd.device).index_copy_(1, d2t.to(qd.device), qd)

    pos = int(feeder.fed_end[0]) + 1
    state = {"h": feeder.h[:1], "cache": _rows(feeder.cache, [0])}

    def expand(tokens: list[int], rows: list[int], d: int) -> torch.Tensor:
        h, cache = state["h"][rows], _rows(state["cache"], rows)  # each node continues its parent's row
        toks = torch.tensor(tokens, device=h.device)[:, None]
        where = torch.full((len(tokens), 1), pos + d - 1, device=h.device)
        state["h"], _, logits = feeder.step(h, toks, where, cache, pos + d)
        state["cache"] = cache
        return q_of(logits[:, 0])

    return grow_sampled(q_of(feeder.logits[0, :1])[0], expand, depth, top_k, verify_cost, generator)


@torch.no_grad()
def medusa_tree_sampled(feeder: MedusaFeeder, depth: int, top_k: int, temperature: float, verify_cost: list[float],
                        generator: torch.Generator | None) -> Tree:
    """A sampled Medusa tree for batch row 0: head d's distribution is every depth-d node's q."""
    q = (feeder.heads(feeder.h[:1])[0].float() / temperature).softmax(-1)  # [K, V]
    depth = min(depth, q.shape[0])
    return grow_sampled(q[0], lambda tokens, rows, d: q[d].expand(len(tokens), -1), depth, top_k, verify_cost,
                        generator)
