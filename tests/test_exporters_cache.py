"""TransformerLens-shaped reading: Recording.cache(seq_id) -> {site: [pos, d_model]}, a prompt batch ->
[batch, pos, d_model], token strings and prompt text from the recording; short reprs. The oracle is
transformers' own output_hidden_states of each unpadded prompt+generation."""

from __future__ import annotations

import pytest
import torch
from _exporters_helpers import fed_tokens, oracle, save_model_with_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import exporters
import probe

PROMPTS = [["def add(a, b):", "the quick brown fox jumps over", "import torch"], ["x = torch.zeros(3)"]]
NEW = 5


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("cache")
    save_model_with_tokenizer(base / "model", layers=3)
    model = AutoModelForCausalLM.from_pretrained(base / "model").eval()
    tok = AutoTokenizer.from_pretrained(base / "model")
    tok.padding_side = "left"
    out, gens, seq = base / "rec", [], 0
    with probe.attach(model, "layers.*.resid_pre,layers.*.resid_post,final_norm") as session:
        with exporters.ArrowRecorder(session, out, tokenizer=tok) as rec:
            for prompts in PROMPTS:
                enc = tok(prompts, return_tensors="pt", padding=True)
                with torch.no_grad():
                    g = model.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                       pad_token_id=tok.pad_token_id)
                for r, p in enumerate(prompts):
                    ids = tok(p)["input_ids"]
                    gens.append(fed_tokens(ids, g[r, enc.input_ids.shape[1]:].tolist(), set()))
                rec.add_prompts(prompts, list(range(seq, seq + len(prompts))))
                seq += len(prompts)
    return model, tok, out, gens


def test_cache_of_one_sequence_equals_hidden_states(recorded) -> None:
    model, tok, out, gens = recorded
    rec = exporters.read_recording(out)
    flat = [p for batch in PROMPTS for p in batch]
    for seq, tokens in enumerate(gens):
        cache = rec.cache(seq)
        truth = oracle(model, tokens)
        assert set(cache) == set(rec.sites) == set(truth) | {"layers.2.resid_post"}
        for site, want in truth.items():
            assert cache[site].shape == (len(tokens), 64)
            torch.testing.assert_close(cache[site], want, rtol=1e-4, atol=1e-5)
        assert cache.mask.all() and cache.token_ids.tolist() == tokens
        assert cache.tokens == [tok.decode([t]) for t in tokens]  # strings by position, as to_str_tokens
        assert cache.prompt == flat[seq] == rec.prompt(seq)


def test_cache_of_a_prompt_batch_is_batch_pos_d(recorded) -> None:
    model, tok, out, gens = recorded
    rec = exporters.read_recording(out, sites="layers.1.*")
    assert rec.batches() == [[0, 1, 2], [3]]
    batch = rec.cache(rec.batches()[0])
    longest = max(len(gens[i]) for i in range(3))
    assert set(batch) == {"layers.1.resid_pre", "layers.1.resid_post"}
    for site, t in batch.items():
        assert t.shape == (3, longest, 64)
        for row in range(3):
            n = len(gens[row])
            assert batch.mask[row].tolist() == [True] * n + [False] * (longest - n)  # right-padded, masked
            torch.testing.assert_close(t[row, :n], oracle(model, gens[row])[site], rtol=1e-4, atol=1e-5)
            assert not t[row, n:].any()
    assert batch.prompts == PROMPTS[0]
    with pytest.raises(KeyError, match="no rows for seq_id 9"):
        rec.cache(9)


def test_reprs_are_short_and_notebooks_get_html(recorded) -> None:
    _, _, out, _ = recorded
    rec = exporters.read_recording(out)
    text = repr(rec)
    assert len(text) < 200 and "rows" in text and "sites" in text  # pyarrow's own repr printed every value
    assert "<table>" in rec._repr_html_() and len(rec._repr_html_()) < 10_000
    cache = rec.cache(0)
    assert len(repr(cache)) < 200 and "<table>" in cache._repr_html_()
    assert len(repr(exporters.activations(rec, site="final_norm"))) < 200
    assert rec.num_rows == len(rec) > 0 and rec.column("site").length() == rec.num_rows  # still a Table
