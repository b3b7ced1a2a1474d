"""Handing the rest of a losing call to the target's own `generate`, on the loop's KV cache.

    if auto and losing(spec, run, t_decode):
        hand_over(spec, run)  # the remaining tokens come from target.generate; exact, like the loop

Whole calls go to `generate` when drafting measured not to pay (`PathChoice`), but that choice is learned
from earlier calls: the first calls, and each re-measurement of the speculative path, ran every round of a
call that lost (drafting at T = 0.8 runs 0.6-0.8x of plain here). A call can see for itself that it loses:
once it has decoded HAND_OVER_AFTER tokens, its seconds per token are compared with a one-token forward of
the target. Above HAND_OVER_LOSS times that, the rest of the call continues in `generate` from the cache
the loop already filled (no second prefill), so a losing call costs what its first tokens lost, not all.

Sampled calls only. A greedy call's pace picks up once its output starts repeating what n-gram lookup can
copy. Measured on third-party code at batch 1 with a stricter rule (5 % behind recent plain calls), 16 of
48 greedy calls went over and the set ran 1.24x against 1.30x without; of the three the rule here would
also have handed over, two finished faster kept (0.48 s kept, 0.86 s handed over, 0.72 s plain). At
T = 0.8 acceptance stays low through a call, and the hand-over measured +1.4 to +2.0 points there.

Batch 1 only: at batch > 1 rows stand at different lengths with masked holes in the cache, which
`generate` cannot continue from. Sampling stays exact: the tokens so far are the target's samples, and
`generate` samples the rest from the target.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ._state import through_eos

if TYPE_CHECKING:
    from ._loop import SpeculativeDecoder
    from ._state import Run

HAND_OVER_AFTER = 32  # decoded tokens before a call's own rate is judged (early rounds still calibrate)
HAND_OVER_LOSS = 1.1  # seconds per token over a one-token forward (a plain step runs ~1.05x of one)
MIN_LEFT = 16  # tokens worth handing over: fewer do not repay `generate`'s start


def losing(spec: SpeculativeDecoder, run: Run, t_decode: float) -> bool:
    """Whether this sampled batch-1 call decodes measurably slower than plain steps would."""
    if run.mode != "sample" or run.b != 1 or run.cols != run.last[0]:  # holes or padding: not one sequence
        return False
    done = run.emitted[0] - 1  # tokens decoded after the prefill's
    if done < HAND_OVER_AFTER or run.max_new - run.emitted[0] < MIN_LEFT or spec._cost is None:
        return False
    return (time.perf_counter() - t_decode) / done > HAND_OVER_LOSS * spec.cost.verify(1, 1)


class _AfterPrompt:
    """A streamer that skips `generate`'s first put (the whole sequence so far, already streamed by the loop)
    and its end (the loop ends the stream)."""

    def __init__(self, streamer: object) -> None:
        self.streamer, self.first = streamer, True

    def put(self, value: torch.Tensor) -> None:
        if self.first:
            self.first = False
            return
        self.streamer.put(value)  # type: ignore[attr-defined]

    def end(self) -> None:
        pass


def hand_over(spec: SpeculativeDecoder, run: Run) -> None:
    """Decode the rest of row 0 with `target.generate`, continuing the loop's cache; record it in `run`."""
    t0 = time.perf_counter()
    st = run.stats
    if spec.session is not None:
        spec._capture(False)  # no hooks on the target's own loop
    n = run.last[0] + 1  # the sequence so far: the cache holds all but its last token
    left = run.max_new - run.emitted[0]
    kw = spec._gen_kwargs(left, run.temperature, run.top_k, run.top_p, sorted(run.eos), None)
    seq = run.toks[:, :n].to(run.device)
    out = spec.target.generate(seq, attention_mask=torch.ones_like(seq), cache=run.cache, **kw,
                               streamer=_AfterPrompt(run.streamer) if run.streamer is not None else None)
    new = out[0, n:].tolist()
    keep = through_eos(new, run.eos)
    run.toks[0, n: n + len(keep)] = torch.tensor(keep, dtype=torch.long)
    run.emitted[0] += len(keep)
    run.done[0] = run.done[0] or (bool(keep) and keep[-1] in run.eos)
    st.handed_over = len(keep)
    st.emitted += len(keep)
    st.row_rounds += len(keep)
    st.plain_rounds += len(new)
    st.target_forwards += len(new)
    st.verify_s += time.perf_counter() - t0
