"""The sampling rule preserves the target distribution exactly (chi-square, 1e5+ draws per case),
and a deliberately biased rule fails the same test (the test has power)."""

from __future__ import annotations

import pytest
import torch
from _reference_rules import accept, verify_sampling

from decoder.verify import target_probs

V = 8
N = 200_000


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; bins with zero expected mass must stay empty."""
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    expected = probs[support] * n
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2.double() / 2))


def _dist(seed: int, support: slice = slice(None)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(V, dtype=torch.float64)
    w[support] = torch.rand(V, generator=g, dtype=torch.float64)[support] + 0.05
    return (w / w.sum()).float()


def _one_hot(i: int) -> torch.Tensor:
    q = torch.zeros(V)
    q[i] = 1
    return q


CASES = {
    "random p, q": (_dist(1), _dist(2)),
    "p == q": (_dist(3), _dist(3)),
    "disjoint supports": (_dist(4, slice(0, 4)), _dist(5, slice(4, 8))),
    "one-hot q": (_dist(6), _one_hot(2)),
    "one-hot q on a zero-p token": (_dist(7, slice(0, 4)), _one_hot(6)),
}


def _run(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ok, repl = accept(p.expand(len(x), V), None if q is None else q.expand(len(x), V), x, g)
    return torch.where(ok, x, repl)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_drafts_preserve_p(case: str) -> None:
    p, q = CASES[case]
    x = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(11))
    out = _run(p, q, x, 12)
    assert _p_value(torch.bincount(out, minlength=V).double(), p.double()) > 1e-3


@pytest.mark.parametrize("draft", [0, 5])
def test_deterministic_drafts_preserve_p(draft: int) -> None:
    p = _dist(8)
    x = torch.full((N,), draft)
    out = _run(p, None, x, 13)
    assert _p_value(torch.bincount(out, minlength=V).double(), p.double()) > 1e-3


def test_chain_verification_first_token_follows_p() -> None:
    p0, p1, p2 = _dist(20), _dist(21), _dist(22)
    q0, q1 = _dist(23), _dist(24)
    g = torch.Generator().manual_seed(3)
    d0 = torch.multinomial(q0, N, replacement=True, generator=g)
    d1 = torch.multinomial(q1, N, replacement=True, generator=g)
    p = torch.stack([p0, p1, p2]).expand(N, 3, V)
    q = torch.stack([q0, q1]).expand(N, 2, V)
    n, nxt = verify_sampling(torch.stack([d0, d1], 1), p, q, g)
    first = torch.where(n >= 1, d0, nxt)
    assert _p_value(torch.bincount(first, minlength=V).double(), p0.double()) > 1e-3
    assert set(n.unique().tolist()) == {0, 1, 2}


def test_negative_controls_fail_the_same_test() -> None:
    p, q = CASES["random p, q"]
    x = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(11))
    g = torch.Generator().manual_seed(12)
    # Biased rule 1: min(1, p/q) acceptance, but resample from p instead of the residual.
    u = torch.rand(N, generator=g)
    ok = u * q[x] < p[x]
    biased = torch.where(ok, x, torch.multinomial(p, N, replacement=True, generator=g))
    assert _p_value(torch.bincount(biased, minlength=V).double(), p.double()) < 1e-6
    # Biased rule 2: a "lossy" knob that always accepts the draft.
    assert _p_value(torch.bincount(x, minlength=V).double(), p.double()) < 1e-6


def test_target_probs_top_k_top_p() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert (target_probs(logits, 1.0, top_k=2) > 0).sum() == 2
    p = target_probs(logits, 1.0, top_p=0.7)
    assert (p > 0).tolist() == [[True, True, False, False, False]]
    torch.testing.assert_close(target_probs(logits, 0.5).sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        target_probs(logits, 0.0)


def test_compact_draft_vocabulary_rule_preserves_p() -> None:
    """verify_rows as the loop runs it: EAGLE rows sample in a reduced draft vocabulary (draft id j is target id
    d2t[j]) and only the stop position's residual is built; n-gram rows are point masses. The first emitted
    token follows p exactly for both kinds of row, and building the residual without the d2t mapping fails."""
    from decoder.verify import verify_chain_sampled as verify_rows

    V_, draft = 8, torch.tensor([1, 2, 4, 6, 7])  # 5-token draft vocabulary, target ids
    p0, p1, p2 = _dist(30), _dist(31), _dist(32)
    qd0 = _dist(33)[:5] / _dist(33)[:5].sum()
    qd1 = _dist(34)[:5] / _dist(34)[:5].sum()
    g = torch.Generator().manual_seed(5)
    half = N // 2
    ids = torch.stack([torch.multinomial(qd0, N, replacement=True, generator=g),
                       torch.multinomial(qd1, N, replacement=True, generator=g)], 1)
    drafts = draft[ids]
    sampled = torch.arange(N) < half  # the other half: deterministic drafts (n-gram rows)
    drafts[~sampled] = torch.tensor([3, 5])
    p = torch.stack([p0, p1, p2]).expand(N, 3, V_)
    q = torch.stack([qd0, qd1]).expand(N, 2, 5)
    k_rows = torch.full((N,), 2)
    n, nxt = verify_rows(drafts, k_rows, p, q, ids, draft, sampled, g)
    first = torch.where(n >= 1, drafts[:, 0], nxt)
    for rows in (sampled, ~sampled):
        assert _p_value(torch.bincount(first[rows], minlength=V_).double(), p0.double()) > 1e-3
    assert set(n.unique().tolist()) == {0, 1, 2}
    # rows that offer fewer drafts stop there: k_rows = 0 is a plain step that samples p
    n0, nxt0 = verify_rows(drafts[:half], torch.zeros(half, dtype=torch.long), p[:half], q[:half], ids[:half], draft,
                           sampled[:half], g)
    assert int(n0.max()) == 0
    assert _p_value(torch.bincount(nxt0, minlength=V_).double(), p0.double()) > 1e-3
    # negative control: the residual built as if draft id j were target id j (no d2t)
    nb, nxtb = verify_rows(drafts[:half], k_rows[:half], p[:half], q[:half], ids[:half], torch.arange(5),
                           sampled[:half], g)
    biased = torch.where(nb >= 1, drafts[:half, 0], nxtb)
    assert _p_value(torch.bincount(biased, minlength=V_).double(), p0.double()) < 1e-6


def test_sample_draws_the_distribution() -> None:
    """`sample` (inverse CDF, what every draw of the decoder goes through) against the weights it is given:
    unnormalised weights, zero-weight tokens, one draw per row of a batch and n draws of one row; a draw that
    skips the interval arithmetic (a cumsum in the wrong order) fails the same test."""
    from decoder.verify import sample

    g = torch.Generator().manual_seed(21)
    w = _dist(8, slice(1, 7)) * 3.5  # tokens 0 and 7 weigh nothing; the weights sum to 3.5
    rows = sample(w.expand(N, V), g)
    assert rows.shape == (N,)
    assert _p_value(torch.bincount(rows, minlength=V), w / w.sum()) > 1e-3
    many = sample(w, g, n=N)
    assert many.shape == (N,)
    assert _p_value(torch.bincount(many, minlength=V), w / w.sum()) > 1e-3
    batch = sample(torch.rand(3, 5, 2048, generator=g), g)
    assert batch.shape == (3, 5) and int(batch.max()) < 2048
    flipped = sample(w.flip(-1), g, n=N)  # a biased draw: the weights of the reversed vocabulary
    with pytest.raises(AssertionError):
        assert _p_value(torch.bincount(flipped, minlength=V), w / w.sum()) > 1e-3
    edge = torch.zeros(V)
    edge[3] = 1.0  # all the mass on one token, zero weight after it: u * total rounding up stays on it
    assert set(sample(edge, g, n=1000).tolist()) == {3}
    assert sample(edge, g, n=1).shape == (1,)
