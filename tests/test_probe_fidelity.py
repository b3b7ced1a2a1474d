"""Every published activation equals the oracle: transformers' own output_hidden_states
(and plain forward hooks) on a full, unpadded forward of the same sequence."""

from __future__ import annotations

import pytest
import torch
from models import EOS, FAMILIES, PAD, build, left_padded, oracle_activations

import probe

PROMPTS = [[5, 17, 33, 9], [40, 41, 42, 43, 44, 45, 46], [7, 8]]
NEW_TOKENS = 8


def _oracle(model: torch.nn.Module, seq: list[int]) -> dict[str, torch.Tensor]:
    """Activations of one unpadded sequence (`oracle_activations`: transformers' hidden states and plain hooks)."""
    return {k: v[0] for k, v in oracle_activations(model, torch.tensor([seq])).items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_left_padded_batch_matches_oracle(family: str) -> None:
    model = build(family)
    ids, mask = left_padded(PROMPTS)
    # Pick an EOS that row 0 will really emit at its 3rd new token, so finished-row stripping is exercised.
    with torch.no_grad():
        free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    eos = int(free[0, ids.shape[1] + 2])
    model.generation_config.eos_token_id = eos
    sites = ["layers.*.resid_pre", "layers.*.resid_post", "layers.*.attn_out", "layers.*.mlp_out", "final_norm"]
    if "resid_mid" in probe.resolve_arch(model).inner:
        sites.append("layers.*.resid_mid")
    with probe.attach(model, sites) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=eos, pad_token_id=PAD)
    stats = session.stats
    caps = list(sub.iter(idle_timeout=1.0))
    sub.close()

    # The real token sequence of each row: prompt + generated up to and including EOS.
    seqs = []
    for b, p in enumerate(PROMPTS):
        new = gen[b, ids.shape[1]:].tolist()
        if eos in new:
            new = new[: new.index(eos) + 1]
        seqs.append(p + new)
    assert len(seqs[0]) <= len(PROMPTS[0]) + 3, "row 0 should have finished early"
    oracles = [_oracle(model, s) for s in seqs]
    site_names = probe.match_sites(model, sites)

    seen: dict[tuple[str, int, int], int] = {}
    seq_ids = sorted({int(s) for c in caps for s in c.seq_ids})
    assert len(seq_ids) == 3 and seq_ids == list(range(seq_ids[0], seq_ids[0] + 3)), "consecutive ids in row order"
    for cap in caps:
        assert cap.tensor.shape[1] == 64 and cap.tensor.dtype == torch.float32
        for row in range(cap.n_tokens):
            b = int(cap.seq_ids[row]) - seq_ids[0]
            pos = int(cap.positions[row])
            key = (cap.site, b, pos)
            assert key not in seen, f"duplicate capture {key}"
            seen[key] = 1
            # The last fed token is the one before the final real token; padding never appears.
            assert pos < len(seqs[b]) - 1, f"{cap.site}: position {pos} of row {b} should not be published"
            assert int(cap.token_ids[row]) == seqs[b][pos]
            want = oracles[b].get(cap.site)
            if cap.site.endswith("resid_mid"):
                layer = cap.layer
                want = oracles[b][f"layers.{layer}.resid_pre"] + oracles[b][f"layers.{layer}.attn_out"]
            torch.testing.assert_close(cap.tensor[row], want[pos], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, key=key: f"{key}: {m}")
    # Exact counts: every site x every real fed token, nothing more.
    expected = sum(len(s) - 1 for s in seqs) * len(site_names)
    assert len(seen) == expected
    assert stats.captured == stats.published == len(caps) and stats.dropped == 0
    assert sum(c.n_tokens for c in caps) == expected
    assert {c.phase for c in caps} == {"prefill", "decode"}


def test_logits_under_generate_keep_only_last_position() -> None:
    model = build("llama")
    ids, mask = left_padded(PROMPTS)
    with probe.attach(model, "logits") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                           eos_token_id=None, pad_token_id=PAD)
    caps = list(sub.iter(idle_timeout=1.0))
    prefill = [c for c in caps if c.phase == "prefill"]
    assert len(prefill) == 1 and prefill[0].positions.tolist() == [len(p) - 1 for p in PROMPTS]
    assert prefill[0].tensor.shape == (3, 128)
    with torch.no_grad():
        full = model(torch.tensor([PROMPTS[1]])).logits[0, -1]
    torch.testing.assert_close(prefill[0].tensor[1], full, atol=1e-4, rtol=1e-4)


def test_right_padded_plain_forward_strips_padding() -> None:
    model = build("qwen3")
    ids = torch.tensor([[5, 6, 7, PAD, PAD], [9, 10, 11, 12, 13]])
    mask = (torch.arange(5) < torch.tensor([[3], [5]])).long()
    with probe.attach(model, "layers.1.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        with torch.no_grad():
            model(ids, attention_mask=mask)
    (cap,) = list(sub.iter(idle_timeout=1.0))
    assert cap.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert cap.token_ids.tolist() == [5, 6, 7, 9, 10, 11, 12, 13]
    assert EOS not in cap.token_ids.tolist()


def test_large_captures_match_oracle() -> None:
    """Captures of 64 KiB or more are staged whole in the ring and sent as one zero-copy frame: every row
    equals the oracle, whether the valid rows are copied whole (no padding) or gathered (right padding)."""
    model = build("llama")  # hidden 64: 256 rows of fp32 make 64 KiB
    long_rows = [[(7 * i) % 120 + 3 for i in range(300)], [(5 * i) % 120 + 3 for i in range(200)]]
    ids = torch.full((2, 300), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(long_rows):
        ids[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = 1
    sites = ["layers.0.resid_post", "final_norm"]
    with probe.attach(model, sites) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1)
        with torch.no_grad():
            model(ids[:1])  # 300 rows, none padded: one copy of the whole tensor
            model(ids, attention_mask=mask)  # 500 of 600 rows: gathered
    caps = list(sub.iter(idle_timeout=1.0))
    assert [c.n_tokens for c in caps] == [300, 300, 500, 500]
    assert all(c.payload.nbytes >= 64 << 10 for c in caps)
    oracles = [_oracle(model, row) for row in long_rows]
    for cap in caps:
        for row in range(cap.n_tokens):
            b, pos = int(cap.seq_ids[row]) - int(cap.seq_ids[0]), int(cap.positions[row])
            assert int(cap.token_ids[row]) == long_rows[b][pos]
            torch.testing.assert_close(cap.tensor[row], oracles[b][cap.site][pos], atol=1e-4, rtol=1e-4)
    assert sorted(int(p) for p in caps[2].positions) == sorted(list(range(300)) + list(range(200)))
