"""N-gram trees (batch 1, greedy): the proposal and the continuations of its suffix's other occurrences, verified in
one forward. The index offers the right alternatives; greedy output equals plain `generate` with trees on and off;
trees are verified where the cost curve makes them free, and not where extra tokens are dear; alternatives were
accepted (the learnt acceptance of some rank rose above nothing)."""

from __future__ import annotations

import pytest
import torch
from models import PAD, build, left_padded

from decoder import CostModel, Eagle3Config, Eagle3Drafter, NgramDrafter, SpeculativeDecoder
from decoder._ngram import NgramIndex

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
        calib = free.sched.alt_calib  # learnt across the calls: alternatives offered, and some accepted
        assert sum(calib.n) > 0 and sum(calib.acc) > 0
    finally:
        free.close()
        dear.close()


def test_auto_trees_with_eagle_keep_greedy_output_exact() -> None:
    """With EAGLE-3 consulted, its drafts and the n-gram proposal ride in the same tree as each other's branch."""
    model = build("llama", layers=8)
    eagle = Eagle3Drafter(Eagle3Config.for_target(model.config)).bind_target(model)
    with SpeculativeDecoder(model, "auto", eagle=eagle, k=4, cost=_cost(0.0)) as spec:
        trees = 0
        for prompt in PROMPTS:
            ids, mask = left_padded([prompt])
            with torch.no_grad():
                want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=PAD)
            out = spec.generate(ids, mask, max_new_tokens=32, pad_token_id=PAD)
            assert torch.equal(out.sequences, want)
            trees += out.stats.tree_rounds
            assert out.stats.eagle_rounds + out.stats.ngram_rounds <= out.stats.rounds
        assert trees > 0
