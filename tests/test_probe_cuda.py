"""CUDA path: rows gathered on the device, copied to pinned memory on a side stream, gated by an
event. Runs only where a GPU exists (CI is CPU-only, so it is skipped there)."""

from __future__ import annotations

import pytest
import torch
from models import PAD, build, left_padded

import probe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_captures_equal_hidden_states() -> None:
    model = build("llama").cuda()
    ids, mask = left_padded([[5, 6, 7, 8], [9, 10]])
    with probe.attach(model, "layers.*.resid_pre") as session:
        assert session.ring.buffer.is_pinned()
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        with torch.no_grad():
            out = model(ids.cuda(), attention_mask=mask.cuda(), output_hidden_states=True)
    caps = {c.site: c for c in sub}
    for i in range(3):
        cap = caps[f"layers.{i}.resid_pre"]
        want = out.hidden_states[i][mask.cuda().bool()].cpu()
        torch.testing.assert_close(cap.tensor, want)
    assert caps["layers.0.resid_pre"].positions.tolist() == [0, 1, 2, 3, 0, 1]
    assert PAD not in caps["layers.0.resid_pre"].token_ids.tolist()


def test_a_failed_cuda_capture_frees_its_ring_slot(monkeypatch) -> None:
    """As on CPU: a capture that fails after taking its pinned ring slot must not block the ring. Here the slot
    is freed at the step's event, after any copy already queued into it."""
    from test_probe_hardening import check_ring_survives_a_failed_capture, fail_first_copy

    model = build("llama").cuda()
    ids = (torch.arange(512) % 100 + 3).unsqueeze(0).cuda()  # 512 x 64 x 4 B = 128 KiB a capture
    from probe import _device_copy

    fail_first_copy(monkeypatch, _device_copy, "_device_rows")

    def forward() -> None:
        with torch.no_grad():
            model(ids)

    check_ring_survives_a_failed_capture(model, forward)


def test_a_reduce_overhead_compiled_generate_publishes_what_eager_computes() -> None:
    """CUDA graphs (`torch.compile(mode="reduce-overhead")`): a staged site tensor is a graph output in the graphs'
    memory pool, which the next replay overwrites. Every capture must still be its own step's rows, as in eager
    mode: prefill and decode, a left-padded batch, against the eager oracle (issue 46)."""
    from test_probe_compiled import NEW_TOKENS, PROMPTS, SITES, _check_against_oracle

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.reset()
    model = build("llama", layers=2).cuda()
    ids, mask = left_padded(PROMPTS)
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    with probe.attach(model, SITES) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        with torch.no_grad():
            gen = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=PAD, do_sample=False, cache_implementation="static")
    caps = list(sub.iter(idle_timeout=5.0))
    sub.close()
    stats = session.stats
    assert stats.captured == stats.published == len(caps) and stats.dropped == 0
    _check_against_oracle(model.cpu(), gen.cpu(), caps)
    torch._dynamo.reset()
