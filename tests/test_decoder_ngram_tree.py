"""N-gram trees (batch 1): the proposal and the continuations of its suffix's other occurrences, verified in one
forward. The index offers the right alternatives; greedy output equals plain `generate` with trees on and off;
trees are verified where the cost curve makes them free, and not where extra tokens are dear; alternatives were
accepted (the learnt acceptance of some rank rose above nothing). At T > 0 the point-mass rule keeps the target's
distribution exact, alone and in the loop, and a rule that tries candidates one by one fails the same tests."""

from __future__ import annotations

import pytest
import torch
from models import PAD, build, left_padded

from decoder import NgramDrafter, SpeculativeDecoder
from decoder.drafters import Eagle3Config, Eagle3Drafter
from decoder.drafters._ngram import NgramIndex
from decoder.drafters._tree import Tree
from decoder.schedule import CostModel
from decoder.verify import verify_tree_sampled as verify_drawn_tree

# suffixes that occurred before with several continuations: where an alternative can be right
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 11, 5, 6], [20, 21, 22, 20, 21, 23, 20, 21, 24, 25, 20, 21],
           [30, 31, 32, 33, 30, 31, 34, 30, 31, 32, 35, 30], [40, 41, 40, 42, 40, 43, 40, 41, 40]]


def _cost(step: float) -> CostModel:
    """Verifying L tokens costs 1 + step * (L - 1) ms: the scheduler's and the tree budget's choices are
    deterministic (a shared CPU's timings are noise)."""
    curve = [1e-3 * (1 + step * i) for i in range(13)]
    return CostModel("t", {"1": {"verify": curve, "verify_capturing": curve, "step": 1e-5}}, adapt=False)


def test_alternatives_are_other_occurrences_newest_first() -> None:
    idx = NgramIndex([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 1, 2, 3])
    assert idx.propose(2) == ([8, 1], 3)  # the latest occurrence of the longest suffix (1 2 3)
    # then earlier occurrences of 1 2 3, newest first, then of the shorter suffix 2 3 (none new), then of 3
    assert idx.alternatives(2) == [([9, 1], 3)]
    assert idx.alternatives(2, most=5) == [([9, 1], 3)]
    idx.extend([5, 1, 2])  # suffix 1 2 (no 5 1 2 before): followed by 3 (the newest: the proposal), 4, 3, 3
    assert idx.propose(2) == ([3, 5], 2)
    assert idx.alternatives(2) == [([4, 1], 2), ([3, 8], 2), ([3, 9], 2)]  # distinct, newest first
    assert idx.alternatives(2, most=1) == [([4, 1], 2)]
    assert idx.alternatives(1, most=5) == [([4], 2)]  # one token: 3 is the proposal's, the rest repeat it
    assert NgramIndex([4, 5, 6]).alternatives(3) == []


def test_index_keeps_only_the_newest_earlier_occurrences() -> None:
    toks = [7, 1] * 8 + [7]  # 7 followed by 1, eight times
    idx = NgramIndex(toks, max_ngram=1)
    assert len(idx.before[(7,)]) == NgramIndex.KEEP and idx.before[(7,)] == [7, 9, 11, 13]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ngram_trees_keep_greedy_output_exact(prompt: list[int]) -> None:
    model = build("llama", layers=8)
    ids, mask = left_padded([prompt])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    with SpeculativeDecoder(model, NgramDrafter(), k=4, cost=_cost(0.0)) as spec:
        tree = spec.generate(ids, mask, max_new_tokens=32, pad_token_id=PAD)
    with SpeculativeDecoder(model, NgramDrafter(), k=4, cost=_cost(0.0), ngram_tree=0) as spec:
        chain = spec.generate(ids, mask, max_new_tokens=32, pad_token_id=PAD)
    assert torch.equal(tree.sequences, want) and torch.equal(chain.sequences, want)
    assert chain.stats.tree_rounds == 0
    assert tree.stats.tree_rounds > 0  # free extra tokens: every n-gram round with an alternative widened


def test_trees_follow_the_cost_curve_and_alternatives_get_accepted() -> None:
    model = build("llama", layers=8)
    free = SpeculativeDecoder(model, NgramDrafter(), k=4, cost=_cost(0.0))
    dear = SpeculativeDecoder(model, NgramDrafter(), k=4, cost=_cost(0.3))  # each extra token: 30 % of a step
    try:
        rounds = {"free": 0, "dear": 0}
        for prompt in PROMPTS:
            ids, mask = left_padded([prompt])
            for name, spec in (("free", free), ("dear", dear)):
                out = spec.generate(ids, mask, max_new_tokens=32, pad_token_id=PAD)
                rounds[name] += out.stats.tree_rounds
        assert rounds["free"] > 0 and rounds["dear"] == 0
        calib = free.sched.alt_calib["greedy"]  # learnt across the calls: alternatives offered, and some accepted
        assert sum(calib.n) > 0 and sum(calib.acc) > 0
    finally:
        free.close()
        dear.close()


def test_auto_trees_with_eagle_keep_greedy_output_exact() -> None:
    """With EAGLE-3 consulted, its drafts and the n-gram proposal ride in the same tree as each other's branch."""
    model = build("llama", layers=8)
    eagle = Eagle3Drafter(Eagle3Config.for_target(model.config)).bind_target(model)
    with SpeculativeDecoder(model, "auto", model_drafter=eagle, k=4, cost=_cost(0.0)) as spec:
        trees = 0
        for prompt in PROMPTS:
            ids, mask = left_padded([prompt])
            with torch.no_grad():
                want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=PAD)
            out = spec.generate(ids, mask, max_new_tokens=32, pad_token_id=PAD)
            assert torch.equal(out.sequences, want)
            trees += out.stats.tree_rounds
            assert out.stats.model_rounds + out.stats.ngram_rounds <= out.stats.rounds
        assert trees > 0


# --- T > 0: point-mass candidates, verified by drawing from the target's p ---------------------------------------


def _biased_point(tree, p, generator):
    """A plausible bug: each child c tried in turn with probability p(c) (no residual after a rejection), the
    fallback drawn from p itself. It favours the candidates' tokens."""
    path, at = [], 0
    while True:
        kids = [i for i, par in enumerate(tree.parents) if par + 1 == at]
        for i in kids:
            if float(torch.rand((), generator=generator)) < float(p[at, tree.tokens[i]]):
                break
        else:
            return path, int(torch.multinomial(p[at], 1, generator=generator))
        path.append(i)
        at = i + 1


def _point_tree() -> Tree:
    """Root children 2, 4, 1 (a chain's first token and two alternatives); under 2, the children 0 and 5."""
    return Tree(tokens=[2, 4, 1, 0, 5], parents=[-1, -1, -1, 0, 0], depths=[1, 1, 1, 2, 2], probs=[0.5] * 5)


@pytest.mark.parametrize("rule", ["exact", "biased"])
def test_point_mass_tree_rule_keeps_every_depth_exact(rule: str) -> None:
    """The first token follows the root's p; the second, given the first is the candidate 2, follows that node's p;
    trying candidates one by one without a residual fails the same test."""
    from test_decoder_drafters import _p_value

    v, n = 6, 30_000

    def dist(seed: int) -> torch.Tensor:
        w = torch.rand(v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.05
        return (w / w.sum()).float()

    tree = _point_tree()
    p = torch.stack([dist(0)] + [dist(10 + i) for i in range(len(tree))])
    g = torch.Generator().manual_seed(1)
    verify = verify_drawn_tree if rule == "exact" else _biased_point
    first, second = [], []
    for _ in range(n):
        path, nxt = verify(tree, p, g)
        toks = [tree.tokens[i] for i in path] + [nxt]
        first.append(toks[0])
        if toks[0] == 2 and len(toks) > 1:  # (the biased rule may stop at a drawn 2)
            second.append(toks[1])
    p_first = _p_value(torch.bincount(torch.tensor(first), minlength=v), p[0])
    p_second = _p_value(torch.bincount(torch.tensor(second), minlength=v), p[1])
    if rule == "exact":
        assert p_first > 1e-3 and p_second > 1e-3
    else:
        assert min(p_first, p_second) < 1e-6


def test_sampled_ngram_trees_in_the_loop_follow_the_target_and_a_biased_rule_fails(monkeypatch) -> None:
    """Seeded batch-1 calls at T = 0.7 on an 8-token target whose prompt repeats with several continuations: n-gram
    trees are verified (the 4-D mask, positions and the branch kept in the cache take part), and the sampled
    (t2, t3) follow the target's exact joint distribution; candidates tried one by one without a residual fail."""
    from test_decoder_drafters import _exact_pair, _p_value, _tiny

    import decoder.verify as verify_module

    model = _tiny(0, layers=4)
    prompt = [1, 2, 3, 1, 2, 4, 5, 2, 6, 3, 7, 1, 4, 6, 2, 5, 7, 3, 5, 1, 6, 4, 7, 2]  # each token, several followers
    exact = _exact_pair(model, prompt)

    def pairs(calls: int) -> tuple[torch.Tensor, int]:
        counts, trees = torch.zeros(8, 8), 0
        with SpeculativeDecoder(model, NgramDrafter(), k=3, cost=_cost(0.0)) as spec:
            for i in range(calls):
                out = spec.generate(torch.tensor([prompt]), max_new_tokens=4, temperature=0.7, seed=i)
                counts[out.sequences[0, len(prompt) + 1], out.sequences[0, len(prompt) + 2]] += 1
                trees += out.stats.tree_rounds
        return counts, trees

    counts, trees = pairs(900)  # as many as the control needs to fail: the same power against the real rule
    assert trees >= 450  # tree rounds: at least one for every two calls
    assert _p_value(counts, exact) > 1e-3
    monkeypatch.setattr(verify_module, "verify_tree_sampled", _biased_point)
    biased, _ = pairs(900)
    assert _p_value(biased, exact) < 1e-6  # 7.8e-10 at 900 calls; 5.6e-6 at 700
