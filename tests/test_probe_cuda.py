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
