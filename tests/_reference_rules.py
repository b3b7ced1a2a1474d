"""Token-by-token reference rules of speculative sampling, the oracle the tests hold `decoder.verify` against.

    ok, repl = accept(p_at_x, q_or_None, x)           # one draft position for N rows
    n, nxt = verify_sampling(drafts, p, q)            # a chain, position by position

Written the textbook way (Leviathan et al. 2023; Chen et al. 2023): one position at a time, each with its own
uniform and its own residual. The product's rules (`decoder.verify`) draw all uniforms at once and build one
residual per row; tests/test_decoder_sampling.py checks both against the target distribution.
"""

from __future__ import annotations

import torch

from decoder.verify import sample


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


