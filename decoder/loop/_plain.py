"""Handing a call, or the rest of a losing one, to plain decoding: the target's own `generate`, or on CPU the
loop's own plain rounds (`loop_plain`, measured faster there).

    out = plain_call(spec, input_ids, ...)  # the whole call (the path choice measured drafting not to pay)
    if auto and losing(spec, run, t_decode):
        hand_over(spec, run)  # the remaining tokens come from target.generate on the loop's KV cache; exact
    plain_round(spec, run)    # or, where loop_plain(...), one plain step of the loop itself per call

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

Any batch size. Rows stand at different lengths there, with masked holes in the cache; to `generate` that is
a left-padded batch (see `hand_over`), and progress is the slowest live row's. Measured at batch 8 on the
2-core VM (a call that runs speculative from its start, as the path choice's first and re-measuring calls do,
per call interleaved with plain `generate`, 3 x 3 calls of 8 prompts): third-party code at T = 0.8 ran 0.862x
-> 0.943x. Greedy calls at batch 8 moved within noise (stdlib 0.843 -> 0.881x, third-party 0.834 -> 0.865x,
prose 0.882 -> 0.838x, per-call medians unchanged), so greedy stays excluded at every batch size. Sampling
stays exact: the tokens so far are the target's samples, and `generate` samples the rest from the target.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..drafters._feeder import RoundDrafts
from ._run import SpecOutput, SpecStats, check_call, eos_list, through_eos

# generation-config fields that never change the tokens: kept as the model sets them
_GEN_KEEP = {"bos_token_id", "decoder_start_token_id", "transformers_version", "use_cache", "return_dict_in_generate"}

if TYPE_CHECKING:
    from ._decoder import SpeculativeDecoder
    from ._run import Run

HAND_OVER_AFTER = 32  # decoded tokens before a call's own rate is judged (early rounds still calibrate)
HAND_OVER_LOSS = 1.1  # seconds per token over a one-token forward (a plain step runs ~1.05x of one)
MIN_LEFT = 16  # tokens worth handing over: fewer do not repay `generate`'s start
# Devices on which a call's plain part (a whole call the path choice gave to plain decoding, or the rest of a
# sampled one that measured itself losing) runs as the loop's own plain rounds, probes off, instead of `generate`.
# On the 2-core CPU VM the loop's plain round outran `generate`'s step once the loop sampled by inverse CDF and
# `generate` by torch.multinomial (`_verify.sample`), per forward, 24 stdlib prompts, T = 0.8, 96 tokens:
# batch 1 6.53 ms against 6.64 (0.37 ms outside the forward against 0.63), batch 8 10.42 against 11.73
# (0.75 against 2.03). Greedy calls joined once their one-token forwards took the packed weights too
# (`_packed.py`): the loop with nothing drafted ran 1.09-1.12x `generate` at batch 1 and 1.03-1.06x at batch 8,
# against 1.00-1.01x and 0.92-0.93x before (3 sets x 24 prompts, 96 tokens, 2 repeats, 2026-12-04). Every
# other device keeps `generate`: not measured there, and no weights are packed there.
LOOP_PLAIN = ("cpu",)


def loop_plain(device: torch.device) -> bool:
    """Whether a call's plain part runs in the loop (see LOOP_PLAIN) rather than in `generate`."""
    return device.type in LOOP_PLAIN


def losing(spec: SpeculativeDecoder, run: Run, t_decode: float) -> bool:
    """Whether this sampled call decodes measurably slower than plain steps of its batch would.

    Progress is the least any live row has decoded: a batch finishes with its slowest row, so plain steps
    would have needed that many to bring every row this far."""
    if run.mode != "sample":
        return False
    live = [e - 1 for e, a in zip(run.emitted, run.active(), strict=True) if a]  # decoded after the prefill's
    if not live or min(live) < HAND_OVER_AFTER or spec._cost is None:
        return False
    if run.max_new - 1 - min(live) < MIN_LEFT:
        return False
    return (time.perf_counter() - t_decode) / min(live) > HAND_OVER_LOSS * spec.cost.verify(run.b, 1)


def plain_round(spec: SpeculativeDecoder, run: Run) -> None:
    """One plain step of every live row, probes off and no drafter asked: a call that the path choice gave to
    plain decoding, or the rest of a sampled one that measured itself losing (`loop_plain`)."""
    t0 = time.perf_counter()
    spec._capture(False)
    drafts = RoundDrafts(run.no_drafts, [0] * run.b, ["none"] * run.b)
    inp, positions, mask = run.inputs(drafts.tokens)
    with spec._context("verify", run, positions), spec.packed_weights():
        logits = spec.target(inp, attention_mask=mask, position_ids=positions,
                             **{spec.cache_kw: run.cache}, use_cache=True).logits
    n_acc, nxt = spec._accept(run, drafts, logits)
    n = sum(len(t) for t in spec._commit(run, drafts, n_acc, nxt))
    st, dt = run.stats, time.perf_counter() - t0
    st.emitted += n
    st.row_rounds += n
    st.plain_rounds += 1
    if run.handed:  # counted as handed over, as the rest of a call in `generate` would be
        st.handed_over += n
        st.handover_steps += 1
        st.handover_s += dt
    else:
        st.rounds += 1
        st.verify_s += dt


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
    """Decode the rest of every live row with `target.generate`, continuing the loop's cache; record it in `run`.

    The cache holds `run.cols` columns, holes and left padding masked, and every row's next token (known, not
    yet forwarded) goes in the column after them: that is a left-padded batch to `generate`, whose positions
    come from the mask's running count, as the loop's do. Rows that are done leave the batch first."""
    t0 = time.perf_counter()
    st = run.stats
    if spec.session is not None:
        spec._capture(False)  # no hooks on the target's own loop
    rows = [r for r, a in enumerate(run.active()) if a]
    ids = torch.zeros(len(rows), run.cols + 1, dtype=torch.long)  # cached columns: their ids are not read again
    ids[:, -1] = torch.tensor([int(run.toks[r, run.last[r]]) for r in rows])
    mask = torch.cat([run.mask[rows, : run.cols], torch.ones(len(rows), 1, dtype=torch.long, device=run.device)], 1)
    if len(rows) < run.b:
        run.cache.batch_select_indices(torch.tensor(rows, device=run.device))
    left = [run.max_new - run.emitted[r] for r in rows]
    eos = sorted(run.eos)
    kw = gen_kwargs(spec.target, max(left), run.temperature, run.top_k, run.top_p, eos, eos[0] if eos else None)
    out = spec.target.generate(ids.to(run.device), attention_mask=mask, **{spec.cache_kw: run.cache}, **kw,
                               streamer=_AfterPrompt(run.streamer) if run.streamer is not None else None)
    new = out[:, run.cols + 1:].tolist()
    steps = len(new[0]) if new else 0
    for i, r in enumerate(rows):
        keep = through_eos(new[i][: left[i]], run.eos)
        start = run.last[r] + 1
        run.toks[r, start: start + len(keep)] = torch.tensor(keep, dtype=torch.long)
        run.emitted[r] += len(keep)
        run.done[r] = run.done[r] or (bool(keep) and keep[-1] in run.eos)
        st.handed_over += len(keep)
        st.emitted += len(keep)
        st.row_rounds += len(keep)
    st.plain_rounds += steps
    st.handover_steps += steps
    st.target_forwards += steps
    st.handover_s += time.perf_counter() - t0


def plain_call(spec: SpeculativeDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
               eos: int | list[int] | None, pad: int | None, streamer: object) -> SpecOutput:
    """The call as the target's own `generate`, probes off: the same output (greedy) or distribution."""
    check_call(input_ids, max_new_tokens, streamer)
    if spec.session is not None:
        spec._capture(False)  # no hooks on the target's own loop; the next speculative call puts them back
    t0 = time.perf_counter()
    eos_ids = eos_list(eos)
    kw = gen_kwargs(spec.target, max_new_tokens, temperature, top_k, top_p, eos_ids, pad)
    device = next(spec.target.parameters()).device
    mask = attention_mask.to(device) if attention_mask is not None else torch.ones_like(input_ids, device=device)
    seq = spec.target.generate(input_ids.to(device), attention_mask=mask, streamer=streamer, **kw).cpu()
    b, new = input_ids.shape[0], seq.shape[1] - input_ids.shape[1]
    emitted = sum(len(through_eos(row, eos_ids)) for row in seq[:, input_ids.shape[1]:].tolist())
    stats = SpecStats(batch=b, rounds=new, target_forwards=new, emitted=emitted, row_rounds=emitted,
                      plain_rounds=new, delegated=True, path="plain")
    stats.seconds = stats.verify_s = time.perf_counter() - t0
    return SpecOutput(seq.to(input_ids.device), stats)  # on the prompt's device, as `Run.sequences`

def gen_kwargs(target: torch.nn.Module, max_new_tokens: int, temperature: float, top_k: int | None,
               top_p: float | None, eos_ids: list[int], pad: int | None) -> dict:
    """Keyword arguments for the target's own `generate` that decode as this loop does (greedy, or
    sampling as given), and nothing else.

    Keywords, not a GenerationConfig: given a config, `generate` fills each unset field from the model's
    own config, so "no EOS" can only be an empty list, which still adds a stopping check and a padding
    step to every token (2 % of a T = 0.8 call on the default model, in a same-run A/B). With keywords
    the model's config is the base, so every field it sets that would change the tokens (a top-k, an
    EOS, a repetition penalty, a minimum length) is unset here, and this call's values go on top."""
    base = target.generation_config.to_diff_dict()
    kw: dict = {k: None for k in base if k not in _GEN_KEEP and not k.startswith(("output_", "_"))}
    kw.update(max_new_tokens=max_new_tokens, do_sample=temperature > 0, num_beams=1,
              eos_token_id=eos_ids or None, pad_token_id=pad if pad is not None else 0)
    if temperature > 0:  # sampling fields only when sampling: on a greedy call transformers warns about them
        kw.update(temperature=temperature, top_k=top_k or None, top_p=top_p)
    return kw
