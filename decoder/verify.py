"""Lossless verification of draft tokens.

    p = target_probs(logits, temperature=0.8, top_k=50, top_p=0.95)  # [..., V]
    ok, repl = accept(p_at_x, q_or_None, x)                           # one draft position, batched
    n, nxt = verify_rows(drafts, k_rows, p, q_draft, draft_ids, d2t_ids, sampled)  # what the loop runs

Greedy keeps the longest prefix equal to the target's argmax. Sampling uses the
speculative-sampling rule, which leaves the output distribution exactly p:
deterministic drafts (q is a point mass): accept x with probability p(x), else sample
from p with x removed; sampled drafts: accept with min(1, p(x)/q(x)), else sample from
max(p - q, 0) renormalised. No lossy acceptance knob exists here. Every draw goes through
`sample` (inverse CDF), which draws what `torch.multinomial` draws, faster.
"""

from __future__ import annotations

import torch


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
    multinomial: on CPU it costs 190 us for one draw over 8192 tokens (63 us over 2048) against ~25 us here,
    and the loop draws once per round and once per sampled draft step. The CDF runs in float64 so that a
    vocabulary's worth of float32 terms adds up without drift; a token of zero weight has an empty interval and
    is never drawn (u * total can round up to the total itself: that clamps to the last token of weight > 0)."""
    cdf = p.double().cumsum(-1)
    total = cdf[..., -1:].contiguous()
    u = torch.rand((*p.shape[:-1], n or 1), generator=generator, device=p.device, dtype=torch.float64)
    idx = torch.minimum(torch.searchsorted(cdf, u * total, right=True), torch.searchsorted(cdf, total))
    return idx.squeeze(-1) if n is None else idx


def accept(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step for N rows: (accepted [N] bool, replacement token [N]).

    p: target distribution [N, V]; q: draft distribution [N, V] the draft x [N] was
    sampled from, or None when x was chosen deterministically.
    """
    rows = torch.arange(x.shape[0], device=x.device)
    px = p[rows, x]
    u = torch.rand(x.shape, generator=generator, device=p.device)
    if q is None:
        ok = u < px
        residual = p.clone()
        residual[rows, x] = 0.0
    else:
        qx = q[rows, x]
        ok = u * qx < px  # u < min(1, p/q) without dividing by a zero q
        residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # mass == 0 only when p == q (or p is the point mass on x): then x is always accepted anyway.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
    repl = sample(residual, generator)
    return ok, repl


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k], target_logits [B, k+1, V] -> (n accepted [B], next token [B])."""
    best = target_logits.argmax(-1)  # [B, k+1]
    match = (drafts == best[:, :-1]).int()
    n = match.cumprod(-1).sum(-1)
    return n, best.gather(1, n[:, None]).squeeze(1)


def verify_sampling(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k], p [B, k+1, V], q [B, k, V] or None -> (n accepted [B], next token [B])."""
    b, k = drafts.shape
    n = torch.full((b,), k, dtype=torch.long, device=drafts.device)
    nxt = sample(p[:, k], generator)  # bonus if all are accepted
    alive = torch.ones(b, dtype=torch.bool, device=drafts.device)
    for i in range(k):
        ok, repl = accept(p[:, i], None if q is None else q[:, i], drafts[:, i], generator)
        stop = alive & ~ok
        n = torch.where(stop, torch.full_like(n, i), n)
        nxt = torch.where(stop, repl, nxt)
        alive &= ok
    return n, nxt


def verify_greedy_rows(drafts: torch.Tensor, k_rows: torch.Tensor,
                       target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy check when row r offered only its first k_rows[r] drafts (the rest is padding)."""
    best = target_logits.argmax(-1)  # [B, L]
    offered = torch.arange(drafts.shape[1], device=drafts.device)[None, :] < k_rows[:, None]
    n = ((drafts == best[:, :-1]) & offered).int().cumprod(-1).sum(-1)
    return n, best.gather(1, n[:, None]).squeeze(1)


def verify_rows(drafts: torch.Tensor, k_rows: torch.Tensor, p: torch.Tensor, q_draft: torch.Tensor | None,
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
