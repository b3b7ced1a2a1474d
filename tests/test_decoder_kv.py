"""The loop's KV cache (`decoder/forward/_kv.py`) against transformers' own DynamicCache, the same operations on both:
forwards of 1 and several tokens, crops, a tree's kept path, a batch select, and `generate` continuing it."""

from __future__ import annotations

import pytest
import torch
from models import build
from transformers import DynamicCache

from decoder.drafters._tree import keep_path
from decoder.forward._compat import cache_kw
from decoder.forward._kv import GrowingCache, GrowingLayer


def _forward(model: torch.nn.Module, cache: DynamicCache, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, **{cache_kw(model.forward): cache}, use_cache=True).logits


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "gpt-neox"])
@pytest.mark.parametrize("capacity", [0, 64])
def test_growing_cache_gives_dynamic_caches_logits(family: str, capacity: int) -> None:
    model = build(family)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 40), generator=gen)
    ours, theirs = GrowingCache(capacity), DynamicCache()
    steps = [("fwd", 7), ("fwd", 1), ("fwd", 4), ("crop", 2), ("fwd", 3), ("fwd", 1), ("select", [1]),
             ("fwd", 5), ("keep", [0, 2, 3]), ("fwd", 1), ("crop", 1), ("fwd", 6)]
    at = 0
    with torch.no_grad():
        for op, arg in steps:
            if op == "fwd":
                chunk = ids[:, at: at + arg]
                a, b = _forward(model, ours, chunk), _forward(model, theirs, chunk)
                assert torch.equal(a, b), f"{family}: logits differ after {op} {arg}"
                at += arg
            elif op == "crop":
                ours.crop(-arg)
                theirs.crop(-arg)
                at -= arg
            elif op == "select":
                ours.batch_select_indices(torch.tensor(arg))
                theirs.batch_select_indices(torch.tensor(arg))
                ids = ids[arg]
            else:  # the last 5 columns were a tree's nodes; keep the path `arg` among them (batch 1)
                cols = ours.get_seq_length() - 6
                keep_path(ours, cols, arg)
                keep_path(theirs, cols, arg)
                ids = torch.cat([ids[:, : cols + 1], ids[:, [cols + 1 + i for i in arg]], ids[:, at:]], 1)
                at = cols + 1 + len(arg)
            assert ours.get_seq_length() == theirs.get_seq_length()
            for mine, ref in zip(ours.layers, theirs.layers, strict=True):
                assert isinstance(mine, GrowingLayer)
                assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)


def test_growing_cache_writes_in_place_within_its_capacity_and_grows_beyond() -> None:
    model = build("llama")
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(2))
    cache, ref = GrowingCache(capacity=24), DynamicCache()
    with torch.no_grad():
        _forward(model, cache, ids[:, :10])
        _forward(model, ref, ids[:, :10])
        buffers = [layer._k.data_ptr() for layer in cache.layers]
        for t in range(10, 24):
            assert torch.equal(_forward(model, cache, ids[:, t: t + 1]), _forward(model, ref, ids[:, t: t + 1]))
        cache.crop(-4)
        ref.crop(-4)
        assert [layer._k.data_ptr() for layer in cache.layers] == buffers, "a write within capacity reallocated"
        assert torch.equal(_forward(model, cache, ids[:, 20:30]), _forward(model, ref, ids[:, 20:30]))  # grows
        assert all(layer._k.shape[-2] >= 30 for layer in cache.layers)
        assert [layer._k.data_ptr() for layer in cache.layers] != buffers


def test_generate_continues_a_growing_cache_as_it_does_its_own() -> None:
    """The loop hands the rest of a call to `generate` with its cache (`decoder/loop/_plain.py`)."""
    model = build("qwen2")
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    outs = []
    for cache in (GrowingCache(16), DynamicCache()):
        with torch.no_grad():
            _forward(model, cache, ids[:, :-1])
        outs.append(model.generate(ids, attention_mask=mask, **{cache_kw(model.forward): cache}, do_sample=False,
                                   max_new_tokens=12, min_new_tokens=12, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])
