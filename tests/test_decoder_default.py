"""On the shipped model with the shipped drafter: greedy speculative output equals `generate`
(batch 1 and batch 4, held-out prompts), and the trained drafter really is accepted."""

from __future__ import annotations

import pytest
import torch
from test_decoder_greedy import assert_same_or_near_tie

from decoder import NgramDrafter, SpeculativeDecoder, load_drafter
from probebus._code_prompts import code_prompts
from probebus._load import load_model, resolve_drafter


@pytest.fixture(scope="module")
def target():
    return load_model("default")


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_generate_on_the_default_model(target, batch: int) -> None:
    model, tok = target
    prompts = code_prompts("heldout", batch, seed=batch)
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        want = model.generate(**enc, max_new_tokens=40, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.pad_token_id)
    drafter = load_drafter(resolve_drafter("default"), model)
    for name, spec in (("eagle", SpeculativeDecoder(model, drafter, k=5, schedule="fixed")),
                       ("eagle scheduled", SpeculativeDecoder(model, drafter, k=5)),
                       ("auto", SpeculativeDecoder(model, "auto", model_drafter=drafter, k=5)),
                       ("ngram", SpeculativeDecoder(model, NgramDrafter(), k=5))):
        with spec:
            out = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=40,
                                pad_token_id=tok.pad_token_id)
        assert_same_or_near_tie(model, out.sequences, want, enc.attention_mask)
        if name == "eagle":  # fixed k: a trained head on its own target, far above the 1.0 of a useless drafter
            assert out.stats.tau > 1.8, out.stats.as_dict()


@pytest.mark.parametrize("name", ["eagle3-tree", "medusa", "medusa-tree", "mtp", "mtp-attn", "clustered",
                                  "draft-model", "layer-skip"])
def test_every_shipped_drafter_is_lossless_on_the_default_model(target, name: str) -> None:
    """Each --drafter name loads the files shipped next to the default model, reproduces greedy `generate` on
    held-out prompts, and (all but layer skip, whose early exit is untrained) is really accepted."""
    from decoder import load_named_drafter, tree_nodes

    model, tok = target
    enc = tok(code_prompts("heldout", 2, seed=7), return_tensors="pt", padding=True)
    with torch.no_grad():
        want = model.generate(**enc, max_new_tokens=32, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.pad_token_id)
    drafter = load_named_drafter(name, model)
    accepted = drafted = 0
    for r in range(2):  # batch 1: trees need it
        row = enc.attention_mask[r].bool()
        ids = enc.input_ids[r][row][None]
        with SpeculativeDecoder(model, drafter, k=4, schedule="fixed", tree=tree_nodes(name)) as spec:
            out = spec.generate(ids, max_new_tokens=32, pad_token_id=tok.pad_token_id)
        assert torch.equal(out.sequences[0, ids.shape[1]:], want[r, enc.input_ids.shape[1]:]), name
        accepted, drafted = accepted + out.stats.accepted, drafted + out.stats.drafted
        if name.endswith("-tree"):
            assert out.stats.tree_rounds > 0
    if name != "layer-skip":
        assert accepted > 0.2 * drafted if not name.endswith("-tree") else accepted > 20, (accepted, drafted)
