"""EAGLE-3 fed over the bus drafts what the drafter module drafts from scratch.

The feeder takes the target's features off a real probe session, round by round, runs the fused step
incrementally on its own cache and proposes tokens. The oracle runs `Eagle3Drafter.step` (the module path,
not the fused step) over the whole sequence from a fresh cache, on features from transformers'
`output_hidden_states`. Batch 1 takes the feeder's slice path, batch 2 its masked path; both must agree.
"""

from __future__ import annotations

import pytest
import torch
from models import build
from transformers import DynamicCache

import probe
from decoder.drafters import Eagle3Config, Eagle3Drafter, EagleFeeder
from decoder.drafters._feeder import feature_sites
from decoder.forward._compat import cache_kw

K = 4


@torch.no_grad()
def _oracle(target: torch.nn.Module, drafter: Eagle3Drafter, seq: torch.Tensor,
            fed_end: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy drafts after positions 0..fed_end were fed (the token at fed_end + 1 known), from scratch, and the
    drafter's state (output, draft logits) the first one came from."""
    hs = target(seq[None, : fed_end + 1], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in drafter.config.aux_layer_ids], -1)  # resid_pre of layer i
    cache = drafter.new_cache(1, 64)
    pos = torch.arange(fed_end + 1)[None]
    h, _, logits = drafter.step(drafter.fuse(feats), seq[None, 1: fed_end + 2], pos, cache, fed_end + 1)
    h, lg, out = h[:, -1:], logits[:, -1], []
    first = h[0, 0], lg[0]
    for i in range(K):
        tok = drafter.to_target(lg.argmax(-1))
        out.append(int(tok))
        h, _, logits = drafter.step(h, tok[:, None], torch.tensor([[fed_end + 1 + i]]), cache, fed_end + 2 + i)
        lg = logits[:, -1]
    return out, *first


@pytest.mark.parametrize(("batch", "every_site"), [(1, True), (2, True), (1, False)])
def test_feeder_drafts_equal_the_module_run_from_scratch(batch: int, every_site: bool) -> None:
    """every_site: the feeder subscribes to everything and a step's captures come as one bundle; else one
    subscription per site, one message per capture. Both must deliver the same features."""
    target = build("llama", layers=4)
    torch.manual_seed(5)
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, aux_layer_ids=[0, 2, 3])).bind_target(target)
    for p in drafter.parameters():  # peaked draft logits: no near-ties between drafts
        p.data.normal_(0, 0.3)
    drafter.refresh_fast()
    prompts = torch.tensor([[5, 17, 33, 9, 40, 41, 7], [40, 41, 42, 43, 44, 45, 46]])[:batch]
    n = prompts.shape[1]
    seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    session = probe.attach(target, feature_sites(drafter))
    feeder = EagleFeeder(drafter, session.endpoint, every_site=every_site)
    try:
        session.wait_for_subscribers(1)
        assert session.publisher.bundling == every_site
        feeder.prepare(batch, 64)
        seq_ids, cache = session.new_seq_ids(batch), DynamicCache()
        kv = {cache_kw(target.forward): cache}  # `cache=` in newer transformers, `past_key_values=` before
        with torch.no_grad(), session.context(phase="prefill", seq_ids=seq_ids):
            target(prompts, **kv, use_cache=True)
        feeds = [(session.step, torch.zeros(batch, dtype=torch.long), torch.full((batch,), n - 1))]
        # rounds: verify 4 true tokens and keep `acc` + 1 of them (the rest is rejected, cropped)
        for acc in (None, 2, 0, 3):
            if acc is not None:
                fed = int(feeds[-1][2][0]) + 1  # the first position this verify computes
                pos = torch.arange(fed, fed + 4).expand(batch, 4)
                with torch.no_grad(), session.context(phase="verify", seq_ids=seq_ids, positions=pos):
                    target(seqs[:, fed: fed + 4], position_ids=pos, **kv, use_cache=True)
                cache.crop(-(3 - acc))
                feeds = [(session.step, torch.full((batch,), fed), torch.full((batch,), fed + acc))]
            fed_end = int(feeds[-1][2][0])
            drafts = feeder.draft(feeds, seqs, K, 0.0, None, None)
            got = drafts.tokens.tolist()
            # what one more draft costs (the scheduler's step cost) is timed apart from the intake: within the call
            assert 0 < drafts.step_s <= drafts.compute_s
            for r in range(batch):
                want, h, logits = _oracle(target, drafter, seqs[r], fed_end)
                assert got[r] == want, (batch, r, fed_end)
                torch.testing.assert_close(feeder.h[r, 0], h, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(feeder.logits[r, 0], logits, atol=1e-4, rtol=1e-4)
    finally:
        feeder.close()
        session.close()
