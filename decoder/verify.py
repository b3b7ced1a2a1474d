"""Every accept/reject rule of the decoder, and the sampling they draw with. Greedy keeps the target's argmax;
sampling keeps the target's distribution exactly (no lossy acceptance knob exists here).

    p = target_probs(logits, temperature=0.8, top_k=50, top_p=0.95)         # [..., V]
    n_acc, nxt = verify_chain_greedy(drafts, k_rows, logits)                 # chains, per row
    n_acc, nxt = verify_chain_sampled(drafts, k_rows, p, q, ids, d2t, sampled, gen)
    path, nxt = verify_tree_greedy(tree, logits)                             # trees, batch 1
    path, nxt = verify_tree_sampled(tree, p, gen)

Chains: row r offers its first k_rows[r] drafts. Greedy accepts the longest prefix equal to the target's argmax.
Sampled chains use the speculative-sampling rule: a deterministic draft x (a point mass: n-gram, greedy
drafters) is accepted with probability p(x), else the next token is drawn from p with x removed; a draft drawn
from the drafter's q is accepted with min(1, p(x) / q(x)), else drawn from max(p - q, 0) renormalised.
Trees: greedy follows the child equal to the target's argmax; sampled trees use SpecInfer's multi-draft rule
(each node's draws from q accepted with min(1, r(x) / q(x)) on the running residual r). Every draw goes through
`sample` (inverse CDF), which draws what `torch.multinomial` draws.

The loop calls these through the module (`verify.verify_chain_sampled(...)`), so a test that swaps one rule for a
biased one swaps it everywhere. The token-by-token reference rules the tests compare against live in
tests/_reference_rules.py, outside the product.
"""

from __future__ import annotations

from typing import Protocol

import torch


class DraftTree(Protocol):
    """What tree verification reads of a draft tree (`decoder.drafters.Tree`)."""

    tokens: list[int]
    parents: list[int]  # -1: a child of the root (the last committed token)
    draws: dict[int, tuple[torch.Tensor, list[int]]]  # sampled trees: per parent (index + 1) its q and its draws

    def children(self) -> list[list[int]]: ...


def target_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                 top_p: float | None = None) -> torch.Tensor:
    """Sampling distribution after temperature, top-k and top-p (float32)."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling; use greedy verification for temperature 0")
    x = logits.float() / temperature
    if top_k is not None and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and 0 < top_p < 1:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return x.softmax(-1)



def sample(p: torch.Tensor, generator: torch.Generator | None = None, n: int | None = None) -> torch.Tensor:
    """One draw from each distribution p [..., V] (non-negative weights, summing to anything > 0): [...]; or n
    independent draws (with replacement): [..., n].

        tok = sample(target_probs(logits, 0.8), gen)

    Inverse CDF: a uniform u scaled to the row's total lands in token i's interval [cdf[i-1], cdf[i]) with
    probability p[i] / total, the distribution `torch.multinomial(p, n, replacement=True)` draws from. Why not
    multinomial: on CPU it is several times slower than this, and the loop draws once per round and once per
    sampled draft step (measured: docs/design.md, "Decoder: measurements behind the code"). The CDF runs in
    float64 so that a vocabulary's worth of float32 terms adds up without drift; a token of zero weight has an
    empty interval and is never drawn (u * total can round up to the total itself: that clamps to the last token
    of weight > 0)."""
    cdf = p.double().cumsum(-1)
    total = cdf[..., -1:].contiguous()
    u = torch.rand((*p.shape[:-1], n or 1), generator=generator, device=p.device, dtype=torch.float64)
    idx = torch.minimum(torch.searchsorted(cdf, u * total, right=True), torch.searchsorted(cdf, total))
    return idx.squeeze(-1) if n is None else idx



def verify_chain_greedy(drafts: torch.Tensor, k_rows: list[int],
                        logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """drafts [B, n] (row r offers its first k_rows[r]), logits [B, n + 1, V] -> (drafts accepted per row, next
    token per row): the longest prefix equal to the target's argmax, then the argmax after it."""
    # batch 1: one argmax and a list walk, faster than the tensor path
    # (measured: docs/design.md, "Decoder: measurements behind the code")
    if drafts.shape[0] == 1:
        best = logits[0].argmax(-1).tolist()
        d, n = drafts[0, : max(k_rows[0], 0)].tolist(), 0
        while n < len(d) and d[n] == best[n]:
            n += 1
        return [n], [best[n]]
    best = logits.argmax(-1)  # [B, L]
    drafts = drafts.to(logits.device)
    offered = torch.arange(drafts.shape[1], device=drafts.device)[None, :] < \
        torch.tensor(k_rows, device=drafts.device)[:, None]
    n = ((drafts == best[:, :-1]) & offered).int().cumprod(-1).sum(-1)
    return n.tolist(), best.gather(1, n[:, None]).squeeze(1).tolist()


def verify_chain_sampled(drafts: torch.Tensor, k_rows: torch.Tensor, p: torch.Tensor, q_draft: torch.Tensor | None,
                draft_ids: torch.Tensor | None, d2t_ids: torch.Tensor | None, sampled: torch.Tensor,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling rule for a batch whose rows drafted differently; (n accepted [B], next token [B]).

    drafts [B, n] target ids, of which row r offers the first k_rows[r]; p [B, n+1, V];
    rows with sampled[r] drew draft_ids[r, i] from q_draft[r, i] over the draft vocabulary
    (target id d2t_ids[j] for draft id j); the other rows' drafts are deterministic (point
    mass). All uniforms are drawn at once: the first failure index has the distribution of
    the sequential rule, and only that position's residual (or the bonus p) is sampled, so
    the full-vocabulary q is built for at most one position per row.
    """
    b, n = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    if n == 0:
        return torch.zeros(b, dtype=torch.long, device=drafts.device), \
            sample(p[:, 0], generator)
    px = p[:, :n].gather(2, drafts[:, :, None]).squeeze(-1)  # [B, n]
    u = torch.rand((b, n), generator=generator, device=p.device)
    if q_draft is not None and bool(sampled.any()):
        qx = q_draft.gather(2, draft_ids[:, :, None]).squeeze(-1)
        qx = torch.where(sampled[:, None], qx, torch.ones_like(qx))
        ok = u * qx < px  # u < min(1, p/q) without dividing by a zero q; point mass: u < p(x)
    else:
        ok = u < px
    ok &= torch.arange(n, device=drafts.device)[None, :] < k_rows[:, None]
    n_acc = ok.int().cumprod(-1).sum(-1)
    pn = p[rows, n_acc]  # the distribution at the stop position: bonus, or residual after a rejection
    rejected = n_acc < k_rows
    if bool(rejected.any()):
        at = n_acc.clamp(max=n - 1)
        x = drafts[rows, at]
        res = pn.clone()
        det = rejected & ~sampled
        res[rows[det], x[det]] = 0.0
        smp = rejected & sampled
        if bool(smp.any()):
            q_full = torch.zeros_like(pn[smp])
            q_full[:, d2t_ids] = q_draft[rows[smp], at[smp]].to(pn.dtype)
            res[smp] = (pn[smp] - q_full).clamp_min(0.0)
        mass = res.sum(-1, keepdim=True)
        # zero residual mass only when p == q (or p is the point mass on x): x was then accepted anyway
        pn = torch.where(rejected[:, None] & (mass > 0), res / mass.clamp_min(1e-30), pn)
    return n_acc, sample(pn, generator)


def verify_tree_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """logits [n + 1, V] for [root, nodes] -> (accepted node indices root to leaf, next token)."""
    best = logits.argmax(-1).tolist()
    kids = tree.children()
    path: list[int] = []
    at = 0  # row in logits: 0 = root, i + 1 = node i
    while True:
        nxt = next((c for c in kids[at] if tree.tokens[c] == best[at]), None)
        if nxt is None:
            return path, best[at]
        path.append(nxt)
        at = nxt + 1



def verify_tree_sampled(tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
    """p [n + 1, V] target distributions for [root, nodes] -> (accepted path, next token); exact in distribution.

    A node without draws whose children are point masses (an n-gram tree's candidates, chosen without looking at
    the target's draws) is verified by drawing x from its p and following x where it is a child: child c is taken
    with probability p(c), and otherwise x is the next token, exactly as sampling token by token."""
    child = {(par + 1, tok): i for i, (tok, par) in enumerate(zip(tree.tokens, tree.parents, strict=True))}
    path: list[int] = []
    at = 0  # row of p: 0 = the root, i + 1 = node i
    while True:
        r = p[at]
        q, drawn = tree.draws.get(at, (None, []))
        rejected: set[int] = set()
        for x in drawn:
            if x not in rejected:
                u = float(torch.rand((), generator=generator, device=r.device))
                if u * float(q[x]) < float(r[x]):  # accept with probability min(1, r(x) / q(x))
                    break
                rejected.add(x)
            rest = (r - q).clamp_min(0)
            mass = float(rest.sum())
            if mass > 0:  # 0 only when r equals q up to rounding, where a rejection cannot happen
                r = rest / mass
        else:
            x = int(sample(r, generator))
            if drawn or (at, x) not in child:
                return path, x
        path.append(child[(at, x)])
        at = path[-1] + 1
