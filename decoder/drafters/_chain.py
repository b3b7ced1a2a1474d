"""Sequential drafting with the scheduler's stopping rule, for any drafter that maps a token to next logits.

    tokens, conf, q = draft_chain(logits, step, k, temperature, gen, plan)
    # logits [B, V]: the drafter's prediction for the first draft position
    # step(tokens [B], i) -> logits [B, V] for position i + 1, given draft i

Greedy drafts take the argmax; sampled drafts draw from softmax(logits / T) over the full
vocabulary and return that q, which is what verification needs to stay lossless. The raw
acceptance estimate is the drafter's own probability of the token it proposed (the
scheduler calibrates it online). With a plan (not fixed-k) drafting stops as soon as one
more step is not worth its cost, exactly as the model drafters' feeder (`EagleFeeder`) does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..schedule import DraftPlan
from ..verify import sample


def draft_chain(logits: torch.Tensor, step: Callable[[torch.Tensor, int], torch.Tensor], k: int, temperature: float,
                gen: torch.Generator | None, plan: DraftPlan | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor | None]:
    """(tokens [B, s], raw confidences [B, s] on CPU, q [B, s, V] or None) with 1 <= s <= k."""
    b = logits.shape[0]
    tokens, confs, qs = [], [], []
    adaptive = plan is not None and not plan.fixed
    prefix = [[0.0] for _ in range(b)]
    cum = [1.0] * b
    for i in range(k):
        probs = logits.float().softmax(-1)
        if temperature > 0:
            q = (logits.float() / temperature).softmax(-1)
            tok = sample(q, gen)
            qs.append(q)
        else:
            tok = probs.argmax(-1)
        conf = probs.gather(1, tok[:, None]).squeeze(1)
        tokens.append(tok)
        confs.append(conf)
        if i + 1 == k:
            break
        if adaptive and not plan.add_step(prefix, cum, conf.tolist()):
            break
        logits = step(tok, i)
    return torch.stack(tokens, 1), torch.stack(confs, 1).cpu(), torch.stack(qs, 1) if qs else None
