"""The oracle bound: the best method and draft length per round, known in hindsight.

    res = oracle_bound(spec, input_ids, mask, max_new_tokens=96)   # spec: a SpeculativeDecoder with "auto"
    res.speedup, res.tau, res.choices                             # against plain steps, on the cost model's clock
    simulated_seconds(out.stats, spec.cost)                       # the same clock for a real run

Each round, the model drafter drafts k and n-gram proposes k; the target verifies each proposal in
its own forward (not counted), so the accepted length of every method is known; the round
then takes the verify length and per-row method with the most tokens per second on the
measured cost curve ("oracle combine", as in "Speculative Decoding: Performance or
Illusion?"). A final forward commits the chosen tokens (not counted) so both drafters see
the sequence they would have seen. At T > 0 picking the better of two random outcomes
biases the output: this is a bound on speed, not a sampler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..schedule import CostModel
from ..verify import sample, target_probs, verify_chain_greedy, verify_chain_sampled
from ._stats import SpecStats
from ._target import then_sync

if TYPE_CHECKING:
    from ._decoder import SpeculativeDecoder


@dataclass
class OracleResult:
    tokens: int = 0
    rounds: int = 0
    seconds: float = 0.0  # simulated: prefill (measured) + the chosen rounds on the cost curve
    plain_seconds: float = 0.0  # simulated plain decoding of the same tokens
    prefill_seconds: float = 0.0  # the measured prefill inside both (the only wall-clock time in them)
    accepted: int = 0
    row_rounds: int = 0
    choices: dict[str, int] = field(default_factory=lambda: {"model": 0, "ngram": 0, "none": 0})

    @property
    def speedup(self) -> float:
        return self.plain_seconds / max(self.seconds, 1e-12)

    @property
    def decode_speedup(self) -> float:
        """`speedup` without the measured prefill: on the cost model's clock alone, so the same on a busy machine."""
        return (self.plain_seconds - self.prefill_seconds) / max(self.seconds - self.prefill_seconds, 1e-12)

    @property
    def tau(self) -> float:
        return (self.accepted + self.row_rounds) / max(self.row_rounds, 1)


def simulated_seconds(stats: SpecStats, cost: CostModel, prefill: float = 0.0) -> float:
    """A run's decode time on the cost model's clock: verify forwards by length, plus drafter steps."""
    b = stats.batch
    total = prefill
    for h in stats.history:
        total += cost.verify(b, h[0], frozen=True) + h[4] * cost.step(b, frozen=True)  # catch-up ~ one step
    return total + stats.handover_steps * cost.verify(b, 1, frozen=True)  # the rest, as `generate`'s plain steps


@torch.inference_mode()  # as the loop's calls (`_decoder.inference`): it writes the buffers they made
def oracle_bound(spec: SpeculativeDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = 0) -> OracleResult:
    if len(spec.drafters) == 0 or spec.ngram is None:
        raise ValueError("the oracle compares one model drafter and n-gram: build the decoder with drafter='auto'")
    k, first, model, cache_kw = spec.k, spec.drafters.slots[0], spec.target.model, spec.target.cache_kw
    run = spec.new_run(input_ids, attention_mask, max_new_tokens, temperature, top_k, top_p, None, seed, None)
    t0 = time.perf_counter()
    spec.prefill(run)
    res = OracleResult(seconds=time.perf_counter() - t0)
    res.plain_seconds = res.prefill_seconds = res.seconds
    b, cost = run.b, spec.cost
    curve = [cost.verify(b, length, frozen=True) for length in range(1, k + 2)]
    step = cost.step(b, frozen=True)
    dev = run.device
    while run.any_active():
        active = run.active()
        caps = run.caps(k)
        drafted = first.feeder.draft(run.take_feeds(), run.toks, k, temperature,
                                    None if seed is None else seed + res.rounds, None)
        props = [run.ngram[r].propose(k)[0] if active[r] else [] for r in range(b)]
        ngram = torch.zeros(b, k, dtype=torch.long)
        for r, p in enumerate(props):
            ngram[r, : len(p)] = torch.tensor(p, dtype=torch.long)
        outcome = {}
        for name, drafts, k_rows in (("model", drafted.tokens.cpu(), [k] * b),
                                     ("ngram", ngram, [len(p) for p in props])):
            inp, positions, mask = run.inputs(drafts)
            with spec.session.context(phase="verify", positions=positions, valid=torch.zeros(1, 1, dtype=torch.bool)):
                logits = model(inp, attention_mask=mask, position_ids=positions, **{cache_kw: run.cache},
                               use_cache=True).logits
            run.cache.crop(-inp.shape[1])
            if temperature <= 0:
                n, _ = verify_chain_greedy(drafts, k_rows, logits)
                p = None
            else:
                p = target_probs(logits, temperature, top_k, top_p)
                sampled = torch.full((b,), name == "model", device=dev)
                q = drafted.q.to(dev) if name == "model" else None
                d2t = first.d2t.to(dev)
                n, _ = verify_chain_sampled(drafts.to(dev), torch.tensor(k_rows, device=dev), p, q,
                                            drafted.ids.to(dev), d2t, sampled, run.gen)
                n = n.tolist()
            outcome[name] = (drafts, n, logits, p)
        # hindsight: the verify length and per-row method with the most tokens per second
        best = (-1.0, 1, None)
        for length in range(1, k + 2):
            for allow_model in (False, True):
                tokens, used, steps = 0, [], 0
                for r in range(b):
                    if not active[r]:
                        used.append(("none", 0))
                        continue
                    m = min(length - 1, caps[r])
                    cand = [("none", 0), ("ngram", min(outcome["ngram"][1][r], m))]
                    if allow_model:
                        cand.append(("model", min(outcome["model"][1][r], m)))
                    name, acc = max(cand, key=lambda c: c[1])
                    used.append((name, acc))
                    tokens += 1 + acc
                    if name == "model":
                        steps = max(steps, acc)
                secs = curve[length - 1] + (step * steps if allow_model and steps else 0.0)
                if tokens / secs > best[0]:
                    best = (tokens / secs, length, used, secs)
        _, length, used, secs = best
        # commit: the chosen accepted drafts, then the target's own next token at that slot
        n_use = max((a for _, a in used), default=0)
        chosen = torch.zeros(b, n_use, dtype=torch.long)
        nxt = []
        for r, (name, acc) in enumerate(used):
            src = outcome["ngram" if name == "none" else name]
            chosen[r, :acc] = src[0][r, :acc]
            slot = src[2][r, acc] if src[3] is None else src[3][r, acc]
            nxt.append(int(slot.argmax()) if src[3] is None else int(sample(slot, run.gen)))
            if active[r]:
                res.choices[name if acc else "none"] += 1
                res.accepted += acc
                res.row_rounds += 1
        inp, positions, mask = run.inputs(chosen)
        # the committed forward's features, sent at once on a CUDA model for the next round's drafts
        ctx = spec.session.context(phase="verify", positions=positions, valid=torch.ones(1, 1, dtype=torch.bool))
        with then_sync(ctx, spec.session, dev.type == "cuda"):
            model(inp, attention_mask=mask, position_ids=positions, **{cache_kw: run.cache}, use_cache=True)
        kept = run.commit([a for _, a in used], nxt, chosen)
        start, end = run.advance()
        run.add_feed((spec.session.step, start, end))
        for r, t in enumerate(kept):
            if t:
                run.ngram[r].extend(t)
        res.tokens += sum(len(t) for t in kept)
        res.rounds += 1
        res.seconds += secs
    res.tokens += b  # the prefill's tokens
    res.plain_seconds += (max(run.emitted) - 1) * curve[0]
    return res
