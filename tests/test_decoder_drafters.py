"""Every drafting method in the same loop (a draft model, layer skip, Medusa heads; EAGLE-3 and n-gram too for the
sampling check): greedy output equals plain `generate`; sampled output follows the target's distribution
(chi-square over many rows), and a deliberately biased verification rule fails the same test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from models import PAD, build, left_padded
from transformers import LlamaConfig, LlamaForCausalLM

import decoder.verify as verify_module
import exporters
import probe
from decoder import DrafterError, NgramDrafter, SpeculativeDecoder, load_named_drafter
from decoder.drafters import (
    DraftModelDrafter,
    DSparkConfig,
    DSparkFeeder,
    DSparkHead,
    Eagle3Config,
    Eagle3Drafter,
    LayerSkipDrafter,
    MedusaConfig,
    MedusaFeeder,
    MedusaHeads,
    MTPAttnDrafter,
    MTPConfig,
    MTPFeeder,
    MTPHead,
    fit_layer_skip,
    load_medusa,
    save_medusa,
)
from decoder.training import HeadsTrainConfig, kmeans_clusters, train_medusa
from decoder.verify import verify_chain_sampled as verify_rows

PROMPTS = [[5, 17, 33, 9, 40, 41], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 8]]


def _heads(model: torch.nn.Module, seed: int, std: float) -> dict[str, object]:
    """Untrained (random, not zero) feature-fed heads of every kind for `model`: drafts that often disagree."""
    torch.manual_seed(seed)
    h, v = model.config.hidden_size, model.config.vocab_size
    medusa = MedusaHeads(MedusaConfig(h, v, 3))
    for block in medusa.heads:
        torch.nn.init.normal_(block[0].linear.weight, std=std)
    mtp = MTPHead(MTPConfig(h, 2 * h, v))
    clustered = MTPHead(MTPConfig(h, 2 * h, v, clusters=4))
    clustered.cluster_of.copy_(kmeans_clusters(model.get_output_embeddings().weight, 4))
    dspark = DSparkHead(DSparkConfig(h, v, 3, rank=8))
    for block in dspark.blocks:
        torch.nn.init.normal_(block.linear.weight, std=std)
    torch.nn.init.normal_(dspark.markov_up.weight, std=std)
    mtp_attn = MTPAttnDrafter.for_target(model.config).bind_target(model)
    return {"medusa": MedusaFeeder(medusa.bind_target(model)), "mtp": MTPFeeder(mtp.bind_target(model)),
            "mtp-attn": mtp_attn,
            "clustered": MTPFeeder(clustered.bind_target(model)), "dspark": DSparkFeeder(dspark.bind_target(model))}


def _methods(model: torch.nn.Module) -> dict[str, object]:
    return {"draft-model": DraftModelDrafter(build("llama", seed=1, layers=2)),
            "layer-skip": LayerSkipDrafter(model, 5), **_heads(model, 4, 0.3)}


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_generate_for_every_method(batch: int) -> None:
    model = build("llama", layers=8)
    ids, mask = left_padded(PROMPTS[:batch])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    for name, drafter in _methods(model).items():
        for schedule in ("fixed", "auto"):
            with SpeculativeDecoder(model, drafter, k=4, schedule=schedule) as spec:
                out = spec.generate(ids, mask, max_new_tokens=24, pad_token_id=PAD)
            assert torch.equal(out.sequences, want), (name, schedule)
            assert out.stats.emitted == 24 * batch
            if schedule == "fixed":
                assert out.stats.drafted > 0, name


def test_the_target_as_its_own_draft_model_has_every_draft_accepted() -> None:
    """A draft model identical to the target proposes the target's own greedy tokens: with its cache kept right
    (ragged rows, drafted tokens dropped and re-fed) every draft is accepted, k + 1 tokens per round."""
    model = build("llama", layers=4)
    ids, mask = left_padded(PROMPTS)
    with SpeculativeDecoder(model, DraftModelDrafter(model), k=4, schedule="fixed") as spec:
        out = spec.generate(ids, mask, max_new_tokens=21, pad_token_id=PAD)
    assert out.stats.accepted == out.stats.drafted > 0
    assert out.stats.tau == 5.0 and out.stats.target_forwards == 1 + 4


def test_a_draft_model_drafts_in_every_call_of_a_decoder() -> None:
    """A drafter that reads token ids (no probe session) learns each call's committed tokens whatever the probes'
    state: the second call of a decoder once found nothing committed and raised ("draft() before any tokens were
    committed", `probebus generate --drafter draft-model --prompts` on its third prompt)."""
    model = build("llama", layers=4)
    with SpeculativeDecoder(model, DraftModelDrafter(model), k=4, schedule="fixed") as spec:
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=13,
                                  do_sample=False, eos_token_id=None, pad_token_id=PAD)
            out = spec.generate(ids, max_new_tokens=13, pad_token_id=PAD)
            assert torch.equal(out.sequences, want)
            assert out.stats.accepted == out.stats.drafted > 0 and out.stats.tau == 5.0


# --- sampling: a target with 8 tokens, many rows, exact distribution by enumeration ----------------------------------
V = 8
ROWS = 6000
T = 0.7


def _tiny(seed: int, layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0,
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(6.0)  # peaked distributions: drafts are accepted and rejected often enough
    return m


@torch.no_grad()
def _exact_pair(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """P(t2, t3) of the sampled continuation (t1 summed out), [V, V], by enumerating every prefix."""
    pr = torch.tensor(prompt)
    p1 = (model(pr[None]).logits[0, -1] / T).softmax(-1)
    x2 = torch.cat([pr.expand(V, -1), torch.arange(V)[:, None]], 1)
    p2 = (model(x2).logits[:, -1] / T).softmax(-1)  # [t1, t2]
    x3 = torch.cat([x2.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
    p3 = (model(x3).logits[:, -1] / T).softmax(-1).view(V, V, V)  # [t1, t2, t3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).double()


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square; cells expected below 5 are pooled into one."""
    n = counts.sum()
    exp = probs.flatten() * n
    obs = counts.flatten().double()
    small = exp < 5
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    chi2 = ((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum()
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2))


def _sample_pairs(model: torch.nn.Module, drafter: object, prompt: list[int], seed: int) -> tuple[torch.Tensor, object]:
    ids = torch.tensor(prompt).expand(ROWS, -1).contiguous()
    with SpeculativeDecoder(model, drafter, k=2, schedule="fixed") as spec:
        out = spec.generate(ids, max_new_tokens=3, temperature=T, seed=seed)
    t2, t3 = out.sequences[:, len(prompt) + 1], out.sequences[:, len(prompt) + 2]
    return torch.bincount(t2 * V + t3, minlength=V * V).view(V, V), out.stats


def _biased_verify_rows(drafts, k_rows, p, q_draft, draft_ids, d2t_ids, sampled, generator=None):
    """A classic bug: the right acceptance test, but a rejected draft is replaced by a draw from p instead of
    from the residual max(p - q, 0), which over-weights the tokens the drafter proposes."""
    n, nxt = verify_rows(drafts, k_rows, p, q_draft, draft_ids, d2t_ids, sampled, generator)
    rows = torch.arange(len(n), device=n.device)
    redraw = torch.multinomial(p[rows, n], 1, generator=generator).squeeze(-1)
    return n, torch.where(n < k_rows, redraw, nxt)


@pytest.mark.parametrize("method", ["draft-model", "layer-skip", "medusa", "mtp", "mtp-attn", "clustered", "dspark",
                                    "eagle3", "ngram"])
def test_sampling_follows_the_target_and_a_biased_rule_fails(method: str, monkeypatch) -> None:
    model = _tiny(0, layers=6)
    drafter = {"draft-model": lambda: DraftModelDrafter(_tiny(1, layers=1)),
               "layer-skip": lambda: LayerSkipDrafter(model, 1),
               "medusa": lambda: _heads(model, 9, 0.5)["medusa"],
               "mtp": lambda: _heads(model, 9, 0.5)["mtp"],
               "mtp-attn": lambda: _heads(model, 9, 0.5)["mtp-attn"],
               "clustered": lambda: _heads(model, 9, 0.5)["clustered"],
               "dspark": lambda: _heads(model, 9, 0.5)["dspark"],
               "eagle3": lambda: Eagle3Drafter(Eagle3Config.for_target(model.config, aux_layer_ids=[1, 2, 3]))
               .bind_target(model),
               "ngram": lambda: NgramDrafter()}[method]()
    prompt = [1, 2, 3, 1, 2]  # n-gram drafts "3 1" from the prompt
    exact = _exact_pair(model, prompt)
    counts, stats = _sample_pairs(model, drafter, prompt, seed=1)
    assert 0 < stats.accepted < stats.drafted, "the test must see drafts both accepted and rejected"
    assert _p_value(counts, exact) > 1e-3
    monkeypatch.setattr(verify_module, "verify_chain_sampled", _biased_verify_rows)
    biased, _ = _sample_pairs(model, drafter, prompt, seed=1)
    assert _p_value(biased, exact) < 1e-6, "the chi-square test has no power against a biased rule"


# --- checkpoints, training, selection ------------------------------------------------------------------------------
def test_medusa_public_layout_round_trip_and_clear_errors(tmp_path: Path) -> None:
    model = build("llama", layers=3)
    torch.manual_seed(0)
    own = MedusaHeads(MedusaConfig(64, 128, 2, shared_lm_head=False))  # per-head vocabulary projections
    save_medusa(own, tmp_path / "own")
    keys = set(__import__("safetensors.torch").torch.load_file(str(tmp_path / "own" / "medusa_lm_head.safetensors")))
    assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "1.1.weight"} <= keys  # FasterDecoding's names
    back = load_medusa(tmp_path / "own", model)
    h = torch.randn(5, 64)
    torch.testing.assert_close(back(h), own(h))
    assert isinstance(load_named_drafter(str(tmp_path / "own"), model), MedusaFeeder)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"medusa_num_heads": 3}))
    with pytest.raises(DrafterError, match="no medusa_lm_head.safetensors"):
        load_named_drafter(str(tmp_path / "bad"), model)
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"something": 1}))
    with pytest.raises(DrafterError, match="names no drafting method"):
        load_named_drafter(str(tmp_path / "bad"), model)
    with pytest.raises(DrafterError, match="no medusa drafter ships with the target"):
        load_named_drafter("medusa", model)
    small = build("llama", layers=2)
    small.config.vocab_size = 64
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        SpeculativeDecoder(model, DraftModelDrafter(small))


def test_train_medusa_from_a_recording_resumes_and_loads(tmp_path: Path) -> None:
    model = build("llama", layers=3)
    gen = torch.Generator().manual_seed(0)
    with probe.attach(model, ["final_norm"]) as session, exporters.ArrowRecorder(session, tmp_path / "rec"):
        for _ in range(3):
            ids = torch.randint(3, 128, (4, 12), generator=gen)
            model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    cfg = HeadsTrainConfig(heads=3, steps=30, batch=64, save_every=15, holdout=0.25)
    first = train_medusa(model, tmp_path / "rec", tmp_path / "m", cfg, progress=False)
    assert first["step"] == 30 and first["heldout"]["positions"] > 0 and len(first["acc"]) == 3
    again = train_medusa(model, tmp_path / "rec", tmp_path / "m", cfg, progress=False)  # nothing left to do
    assert again["resumed_from"] == 30
    heads = load_medusa(tmp_path / "m", model)
    ids, mask = left_padded(PROMPTS)
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=PAD)
    with SpeculativeDecoder(model, MedusaFeeder(heads), k=3) as spec:
        assert torch.equal(spec.generate(ids, mask, max_new_tokens=12, pad_token_id=PAD).sequences, want)


def test_layer_skip_is_chosen_from_a_measurement(tmp_path: Path) -> None:
    model = build("llama", layers=4)
    seqs = [torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    result = fit_layer_skip(model, seqs, tmp_path / "ls", k_max=3, reps=2)
    assert 1 <= result["layers"] <= 3 and 1 <= result["k"] <= 3
    assert [r["layers"] for r in result["table"]] == [1, 2, 3]
    drafter = load_named_drafter(str(tmp_path / "ls"), model)
    assert isinstance(drafter, LayerSkipDrafter) and drafter.layers == result["layers"]
    with pytest.raises(DrafterError, match="measured on a 4-layer target"):
        load_named_drafter(str(tmp_path / "ls"), build("llama", layers=6))


def test_layer_skip_verification_starts_where_the_draft_left_off() -> None:
    """LayerSkip's second reuse: the draft's K/V and exit states of the kept layers feed the verify forward, so after
    the prefill the kept layers see each verified token once (in the draft, or one token-wide pass for the last
    draft) while the later layers see the whole verify window; the output still equals plain greedy decoding."""
    model = build("llama", layers=8)
    ids, mask = left_padded(PROMPTS)
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=PAD)
    seen: dict[int, list[tuple[int, int]]] = {0: [], 3: []}
    with SpeculativeDecoder(model, LayerSkipDrafter(model, 3), k=4, schedule="fixed") as spec:
        spec.generate(ids, mask, max_new_tokens=2, pad_token_id=PAD)  # measures the cost curve first
        hooks = [model.model.layers[i].register_forward_pre_hook(
            lambda _m, args, i=i: seen[i].append(tuple(args[0].shape[:2]))) for i in seen]
        try:
            out = spec.generate(ids, mask, max_new_tokens=20, pad_token_id=PAD)
        finally:
            for h in hooks:
                h.remove()
    assert torch.equal(out.sequences, want)
    early, late = seen[0][1:], seen[3][1:]  # after the prefill
    assert early and all(q == 1 for _, q in early), "a kept layer ran a multi-token verify"
    assert any(q == 5 for _, q in late), "the later layers verify k + 1 tokens at once"
    assert sum(b * q for b, q in early) == sum(b * q for b, q in late) - sum(b for b, q in late if q == 1), \
        "each verified token runs through the kept layers exactly once (drafts, then the last draft's pass)"


@pytest.mark.parametrize("method", ["mtp", "mtp-attn", "clustered", "dspark"])
def test_mtp_clustered_and_dspark_train_from_a_recording_and_load(tmp_path: Path, method: str) -> None:
    from decoder.training import DSparkTrainConfig, MTPTrainConfig, train_dspark, train_mtp

    model = build("llama", layers=3)
    gen = torch.Generator().manual_seed(0)
    with probe.attach(model, ["final_norm"]) as session, exporters.ArrowRecorder(session, tmp_path / "rec"):
        for _ in range(3):
            ids = torch.randint(3, 128, (4, 12), generator=gen)
            model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    if method == "dspark":
        m = train_dspark(model, tmp_path / "rec", tmp_path / "m", DSparkTrainConfig(steps=20, batch=64,
                                                                                     holdout=0.25), progress=False)
        assert len(m["heldout"]["confidence"]) == 4
    else:
        m = train_mtp(model, tmp_path / "rec", tmp_path / "m", MTPTrainConfig(steps=20, batch=64, holdout=0.25,
                      clusters=8 if method == "clustered" else 0, attention=method == "mtp-attn"), progress=False)
    assert m["step"] == 20 and len(m["heldout"]["acceptance"]) == (4 if method == "dspark" else 3)
    drafter = load_named_drafter(str(tmp_path / "m"), model)
    assert drafter.name == ("dspark" if method == "dspark" else "mtp")
    assert isinstance(drafter, MTPAttnDrafter) == (method == "mtp-attn")
    ids, mask = left_padded(PROMPTS)
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=PAD)
    with SpeculativeDecoder(model, drafter, k=3, schedule="fixed") as spec:
        assert torch.equal(spec.generate(ids, mask, max_new_tokens=12, pad_token_id=PAD).sequences, want)


def test_clustered_head_scores_one_cluster_and_its_q_is_a_distribution() -> None:
    model = build("llama", layers=2)
    head = _heads(model, 0, 0.3)["clustered"].heads
    hn = torch.randn(5, 64)
    q = head.probs(hn)
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    best = head.cluster_head(hn).argmax(-1)
    for r in range(5):  # support: exactly the best cluster's tokens
        assert set(q[r].nonzero().flatten().tolist()) <= set((head.cluster_of == best[r]).nonzero().flatten().tolist())


def _flat(batch: int, k: int) -> object:
    from decoder.schedule import CostModel

    curve = [1e-3] * (k + 1)  # verifying more tokens is free: drafting always pays (deterministic scheduling)
    return CostModel("t", {str(batch): {"verify": curve, "verify_capturing": curve, "step": 1e-5}}, adapt=False)


@pytest.mark.parametrize("batch", [1, 3])
def test_several_model_drafters_one_scheduler(batch: int) -> None:
    """The round scheduler weighs several model drafters (and n-gram): greedy output still equals `generate`, every
    drafter is tried, and the one whose drafts pay (the target itself as a draft model) is consulted most."""
    model = build("llama", layers=4)
    ids, mask = left_padded(PROMPTS[:batch])
    want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=80, do_sample=False,
                          eos_token_id=None, pad_token_id=PAD)
    drafters = [_heads(model, 4, 0.3)["mtp"], DraftModelDrafter(model, name="perfect"),
                _heads(model, 4, 0.3)["medusa"]]
    with SpeculativeDecoder(model, "auto", model_drafter=drafters, k=4, cost=_flat(batch, 4)) as spec:
        assert spec.endpoint is not None  # one probe session serves the feature-fed drafters
        for seed in (None, 0):  # unseeded: what it learns is kept; seeded: a call of its own (never handed over)
            out = spec.generate(ids, mask, max_new_tokens=80, pad_token_id=PAD, seed=seed)
            assert torch.equal(out.sequences, want)
    used = out.stats.by_drafter
    assert set(used) == {"mtp", "perfect", "medusa"}  # each tried in the call
    assert used["perfect"] > used["mtp"] + used["medusa"], used


def test_several_model_drafters_sample_the_target_distribution(monkeypatch) -> None:
    """Batch-1 calls whose rounds go to different drafters (each with its own q and vocabulary map) still sample
    the target's exact joint of two tokens, and the biased rule fails the same test."""
    model = _tiny(0, layers=6)
    eagle = Eagle3Drafter(Eagle3Config.for_target(model.config, aux_layer_ids=[1, 2, 3])).bind_target(model)
    with torch.no_grad():  # a peaked q, far from p: the biased rule shows in fewer draws
        eagle.lm_head.weight.mul_(4.0)
    drafters = [eagle, DraftModelDrafter(_tiny(1, layers=1)), _heads(model, 9, 0.5)["medusa"]]
    prompt = [1, 2, 3, 1, 2]
    exact = _exact_pair(model, prompt)

    def pairs(calls: int) -> tuple[torch.Tensor, dict]:
        counts, used = torch.zeros(V, V), {}
        with SpeculativeDecoder(model, drafters, k=2, cost=_flat(1, 2)) as spec:
            for i in range(calls):
                out = spec.generate(torch.tensor([prompt]), max_new_tokens=4, temperature=T, seed=i)
                counts[out.sequences[0, 6], out.sequences[0, 7]] += 1
                for name, n in out.stats.by_drafter.items():
                    used[name] = used.get(name, 0) + n
        return counts, used

    counts, used = pairs(300)  # as many draws as the biased rule's control below (1300, then 600 before)
    assert len(used) == 3 and min(used.values()) > 100, used  # every drafter drafted many rounds
    assert _p_value(counts, exact) > 1e-3
    monkeypatch.setattr(verify_module, "verify_chain_sampled", _biased_verify_rows)
    assert _p_value(pairs(300)[0], exact) < 1e-6  # (p = 1e-10 at 300 draws with EAGLE-3's peaked head)


def test_a_decoders_probes_publish_only_during_its_calls() -> None:
    """A decoder's probe session is on the model from its construction; other forwards of the model before its first
    call (a plain `generate`, another decoder's) are not its to publish: a second subscriber of its bus reads
    nothing of them, and reads the decoder's own forwards once it runs."""
    model = build("llama", layers=4)
    torch.manual_seed(3)
    eagle = Eagle3Drafter(Eagle3Config.for_target(model.config, aux_layer_ids=[1, 2, 3])).bind_target(model)
    ids = torch.tensor([[5, 9, 11, 4, 7]])
    with SpeculativeDecoder(model, eagle, k=2, schedule="fixed", cost=_flat(1, 2)) as spec:
        session = spec.drafters.session
        sub = probe.Subscriber(session.endpoint)
        try:
            session.wait_for_subscribers(2)
            with torch.no_grad():
                model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
            assert sub.recv(timeout=1.0) is None, "a plain generate before the decoder's first call was published"
            spec.generate(ids, max_new_tokens=4)
            assert sub.recv(timeout=5.0) is not None
        finally:
            sub.close()
