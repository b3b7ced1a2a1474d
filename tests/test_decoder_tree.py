"""Tree drafts verified in one forward (batch 1): greedy output equals plain `generate` with EAGLE-3 and Medusa
trees; the multi-draft sampling rule leaves the target distribution exact at every depth, and a biased rule
fails the same chi-square test; batch > 1 falls back to chains and says so."""

from __future__ import annotations

import logging

import pytest
import torch
from models import PAD, build, left_padded

from decoder import CostModel, Eagle3Config, Eagle3Drafter, MedusaConfig, MedusaFeeder, MedusaHeads, SpeculativeDecoder
from decoder._tree import Tree, tree_attention, verify_tree_sampling

PROMPTS = [[5, 17, 33, 9, 40, 41], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 8]]


def _free_verify(batch: int, nodes: int) -> CostModel:
    """Verifying more tokens costs nothing: every round verifies the whole tree (deterministic scheduling)."""
    curve = [1e-3] * (nodes + 1)
    return CostModel("t", {str(batch): {"verify": curve, "verify_capturing": curve, "step": 1e-5}}, adapt=False)


def _drafters(model: torch.nn.Module) -> dict[str, object]:
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(64, 128, 3))
    for block in heads.heads:
        torch.nn.init.normal_(block[0].linear.weight, std=0.05)
    return {"medusa": MedusaFeeder(heads.bind_target(model)),
            "eagle3": Eagle3Drafter(Eagle3Config.for_target(model.config)).bind_target(model)}


@pytest.mark.parametrize("method", ["medusa", "eagle3"])
def test_tree_greedy_equals_generate(method: str) -> None:
    model = build("llama", layers=8)
    for prompt in PROMPTS:
        ids, mask = left_padded([prompt])
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
        with SpeculativeDecoder(model, _drafters(model)[method], k=4, tree=16, cost=_free_verify(1, 16)) as spec:
            out = spec.generate(ids, mask, max_new_tokens=24, pad_token_id=PAD)
        assert torch.equal(out.sequences, want)
        assert out.stats.tree_rounds >= out.stats.rounds - 1 > 0 and out.stats.emitted == 24  # the last: 1 token left
        assert out.stats.drafted >= 8 * out.stats.tree_rounds  # whole trees went into the forward


def test_tree_falls_back_to_chains_at_batch_above_one(caplog) -> None:  # noqa: ANN001
    model = build("llama", layers=8)
    ids, mask = left_padded(PROMPTS)
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=PAD)
    with caplog.at_level(logging.WARNING, logger="decoder"), \
            SpeculativeDecoder(model, _drafters(model)["medusa"], k=3, tree=8) as spec:
        out = spec.generate(ids, mask, max_new_tokens=16, pad_token_id=PAD)
    assert torch.equal(out.sequences, want) and out.stats.tree_rounds == 0
    assert "batch 1 only" in caplog.text
    with pytest.raises(ValueError, match="tree drafts need EAGLE-3 or Medusa"):
        SpeculativeDecoder(model, None, tree=8)


def test_tree_attention_sees_prefix_ancestors_and_self() -> None:
    tree = Tree(tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3], probs=[0.5, 0.3, 0.4, 0.2])
    prefix = torch.tensor([[1, 0, 1]])
    m = tree_attention(prefix, tree, torch.float32)[0, 0] == 0  # [5 queries, 3 + 5 keys]
    assert m[:, :3].tolist() == [[True, False, True]] * 5
    assert m[:, 3:].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0],
                                       [1, 1, 0, 1, 1]]


# --- the multi-draft sampling rule ------------------------------------------------------------------------------------
V, N = 6, 40_000


def _dist(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(V, generator=g, dtype=torch.float64) + 0.05
    return (w / w.sum()).float()


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    exp = probs.double() * counts.sum()
    chi2 = ((counts.double() - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64), chi2 / 2))


def _biased(tree: Tree, p: torch.Tensor, generator: torch.Generator) -> tuple[list[int], int]:
    """A classic bug: each child accepted with p(x) (not the running residual), the fallback drawn from p."""
    kids = tree.children()
    for c in kids[0]:
        if float(torch.rand((), generator=generator)) < float(p[0, tree.tokens[c]]):
            return [c], int(torch.multinomial(p[c + 1], 1, generator=generator))
    return [], int(torch.multinomial(p[0], 1, generator=generator))


@pytest.mark.parametrize("rule", ["exact", "biased"])
def test_multi_draft_rule_keeps_every_depth_exact(rule: str) -> None:
    # root children 1, 3, 4 (most probable first); node 0 (token 1) has children 2 and 5
    tree = Tree(tokens=[1, 3, 4, 2, 5], parents=[-1, -1, -1, 0, 0], depths=[1, 1, 1, 2, 2],
                probs=[0.5, 0.2, 0.1, 0.3, 0.2])
    p = torch.stack([_dist(i) for i in range(len(tree) + 1)])  # [root, nodes]
    g = torch.Generator().manual_seed(1)
    first, second = [], []
    verify = verify_tree_sampling if rule == "exact" else _biased
    for _ in range(N):
        path, nxt = verify(tree, p, g)
        toks = [tree.tokens[i] for i in path] + [nxt]
        first.append(toks[0])
        if len(toks) > 1 and toks[0] == 1:
            second.append(toks[1])
    p_first = _p_value(torch.bincount(torch.tensor(first), minlength=V), p[0])
    p_second = _p_value(torch.bincount(torch.tensor(second), minlength=V), p[1])  # t2 | t1 = 1 ~ node 0's p
    if rule == "exact":
        assert p_first > 1e-3 and p_second > 1e-3
    else:
        assert min(p_first, p_second) < 1e-6


def test_tree_sampling_in_the_loop_is_reproducible() -> None:
    model = build("llama", layers=8)
    ids, mask = left_padded([PROMPTS[0]])
    with SpeculativeDecoder(model, _drafters(model)["medusa"], k=3, tree=12, cost=_free_verify(1, 12)) as spec:
        a = spec.generate(ids, mask, max_new_tokens=20, temperature=0.7, seed=3)
        b = spec.generate(ids, mask, max_new_tokens=20, temperature=0.7, seed=3)
    assert torch.equal(a.sequences, b.sequences) and a.stats.tree_rounds > 0 and a.stats.emitted == 20


def test_tree_sampling_in_the_loop_follows_the_target_and_a_biased_rule_fails(monkeypatch) -> None:  # noqa: ANN001
    """Batch-1 calls with Medusa trees on an 8-token target: the sampled (t2, t3) follow the target's exact joint
    distribution (the tree's multi-draft rule, its 4-D mask, per-node positions and the branch kept in the KV
    cache all take part), and the biased rule fails the same test."""
    from test_decoder_drafters import _exact_pair, _p_value, _tiny

    import decoder._tree_round as tree_round

    model = _tiny(0, layers=2)
    torch.manual_seed(9)
    heads = MedusaHeads(MedusaConfig(32, 8, 3))
    for block in heads.heads:
        torch.nn.init.normal_(block[0].linear.weight, std=0.5)
    prompt = [1, 2, 3, 1, 2]
    exact = _exact_pair(model, prompt)

    def pairs() -> tuple[torch.Tensor, int]:
        counts, trees = torch.zeros(8, 8), 0
        with SpeculativeDecoder(model, MedusaFeeder(heads.bind_target(model)), k=2, tree=6,
                                cost=_free_verify(1, 6)) as spec:
            for i in range(CALLS):
                out = spec.generate(torch.tensor([prompt]), max_new_tokens=4, temperature=0.7, seed=i)
                counts[out.sequences[0, 6], out.sequences[0, 7]] += 1
                trees += out.stats.tree_rounds
        return counts, trees

    counts, trees = pairs()
    assert trees >= CALLS
    assert _p_value(counts, exact) > 1e-3
    monkeypatch.setattr(tree_round, "verify_tree_sampling", _biased)
    biased, _ = pairs()
    assert _p_value(biased, exact) < 1e-6


CALLS = 2500
