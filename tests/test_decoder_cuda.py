"""The decoder on a CUDA target: greedy output equals plain `generate` with every drafter, sampling runs and a
seed reproduces it. Runs only where a GPU exists (CI is CPU-only, so it is skipped there).

A CUDA model's captures of 64 KiB or more reach the bus at a later step boundary, once their device copies have
landed; EAGLE-3 reads a forward's features before the next one, so the loop sends them first (`session.sync()`).
The prompts here are long enough for the prefill's features to take that path."""

from __future__ import annotations

import pytest
import torch
from models import PAD, build, left_padded
from test_decoder_greedy import _drafters, assert_same_or_near_tie

import probe
from decoder import SpeculativeDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[(7 * i) % 90 + 3 for i in range(n)] for n in (150, 120, 97)]  # 150 x 3 rows x 64 x 4 B > 64 KiB


def test_sync_sends_a_steps_device_copies_before_the_next_step() -> None:
    model = build("llama").cuda()
    ids = (torch.arange(512) % 100 + 3).unsqueeze(0).cuda()  # 512 x 64 x 4 B = 128 KiB a capture
    with probe.attach(model, "layers.1.resid_pre") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        with torch.no_grad(), session.context(phase="prefill"):
            want = model(ids, output_hidden_states=True).hidden_states[1][0].cpu()
        session.sync()
        cap = sub.recv(timeout=10)
        assert cap is not None and cap.step == session.step
        torch.testing.assert_close(cap.tensor, want)
    sub.close()


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_generate_on_cuda(batch: int) -> None:
    model = build("llama", layers=8).cuda()
    ids, mask = (t.cuda() for t in left_padded(PROMPTS[:batch]))
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=PAD)
    for name, drafter in _drafters(model).items():
        kw = {"model_drafter": _drafters(model)["eagle"].cuda()} if drafter == "auto" else {}
        drafter = drafter.cuda() if isinstance(drafter, torch.nn.Module) else drafter
        with SpeculativeDecoder(model, drafter, k=4, schedule="auto" if name == "auto" else "fixed", **kw) as spec:
            out = spec.generate(ids, mask, max_new_tokens=24, pad_token_id=PAD)
        assert out.sequences.device.type == "cuda"
        assert_same_or_near_tie(model, out.sequences, want, mask)
        assert out.stats.emitted == 24 * batch, name


def test_sampling_on_cuda_is_reproducible_with_a_seed() -> None:
    model = build("llama", layers=8).cuda()
    ids, mask = (t.cuda() for t in left_padded(PROMPTS))
    outs = []
    for _ in range(2):
        with SpeculativeDecoder(model, "auto", model_drafter=_drafters(model)["eagle"].cuda(), k=3) as spec:
            outs.append(spec.generate(ids, mask, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                                      pad_token_id=PAD).sequences)
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (3, ids.shape[1] + 12)
