"""The loop's attention for masked forwards of several tokens (`decoder/forward/_attention.py`) against transformers'
own SDPA attention: same logits, no K/V head copies, and the model's own setting back after each forward."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from models import build

from decoder.forward._attention import KEY, gqa_attention
from decoder.loop._run import causal_block


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_grouped_heads_are_read_in_place_with_the_same_logits(family: str, monkeypatch) -> None:
    model = build(family)
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads < 4
    copies = []
    repeat_kv = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: copies.append(n) or repeat_kv(x, n))
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    two_rows = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(5))
    pad = torch.ones_like(two_rows)
    pad[0, :3] = 0  # a padded row: transformers builds the mask from it
    with torch.no_grad():
        for kw in ({"input_ids": ids, "attention_mask": causal_block(0, 30, torch.float32)},
                   {"input_ids": two_rows, "attention_mask": pad}):
            copies.clear()
            theirs = model(**kw).logits
            assert copies, "transformers' own attention copied no K/V heads: nothing to compare"
            copies.clear()
            with gqa_attention(model.config):
                assert model.config._attn_implementation == KEY
                ours = model(**kw).logits
            assert not copies, "K/V heads were copied inside gqa_attention"
            assert model.config._attn_implementation == "sdpa"
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        with gqa_attention(model.config):  # one token, no mask: transformers' own path, as before
            model(ids[:, :1])


def test_other_attention_settings_are_left_alone() -> None:
    model = build("llama")
    model.config._attn_implementation = "eager"
    with gqa_attention(model.config):
        assert model.config._attn_implementation == "eager"
