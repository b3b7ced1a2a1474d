"""Plain decoding for a whole call, or for the rest of a losing one: the target's own `generate`, or on CPU the
loop's own plain rounds (`loop_plain`, measured faster there).

    out = plain_call(target, input_ids, ...)   # the whole call (the path choice measured drafting not to pay)
    if auto and losing(run, t_decode, cost):
        hand_over(run, target)                 # the remaining tokens from target.generate on the loop's KV cache
    plain_round(run, target)                   # or, where loop_plain(...), one plain step of the loop itself

Whole calls go to plain decoding when drafting measured not to pay (`PathChoice`), but that choice is learned
from earlier calls: the first calls, and each re-measurement of the speculative path, ran every round of a call
that lost. A call can see for itself that it loses: once it has decoded HAND_OVER_AFTER tokens, its seconds per
token are compared with a one-token forward of the target. Above HAND_OVER_LOSS times that, the rest of the call
continues as plain decoding from the cache the loop already filled (no second prefill), so a losing call costs
what its first tokens lost, not all.

Sampled calls only: a greedy call's pace picks up once its output starts repeating what n-gram lookup can copy,
and handing greedy calls over lost more than it won. Any batch size: rows stand at different lengths there, with
masked holes in the cache; to `generate` that is a left-padded batch (see `hand_over`), and progress is the
slowest live row's. Sampling stays exact: the tokens so far are the target's samples, and `generate` samples the
rest from the target. (Measured: docs/design.md, "Decoder: measurements behind the code".)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..forward._compiled import StaticLoopCache
from ._chain_round import RoundDrafts, verify_round
from ._run import Run, check_call, eos_list, through_eos
from ._stats import SpecOutput, SpecStats

if TYPE_CHECKING:
    from ..schedule import CostModel
    from ._target import Target

# generation-config fields that never change the tokens: kept as the model sets them
_GEN_KEEP = {"bos_token_id", "decoder_start_token_id", "transformers_version", "use_cache", "return_dict_in_generate"}
HAND_OVER_AFTER = 32  # decoded tokens before a call's own rate is judged (early rounds still calibrate)
HAND_OVER_LOSS = 1.1  # seconds per token over a one-token forward (a plain step runs ~1.05x of one)
MIN_LEFT = 16  # tokens worth handing over: fewer do not repay `generate`'s start
# Devices on which a call's plain part (a whole call the path choice gave to plain decoding, or the rest of a
# sampled one that measured itself losing) runs as the loop's own plain rounds, probes off, instead of
# `generate`: on the CPU the loop's plain round measured faster than `generate`'s step, greedy and sampled. Every
# other device keeps `generate`: not measured there, and no weights are packed there.
LOOP_PLAIN = ("cpu",)


def loop_plain(device: torch.device) -> bool:
    """Whether a call's plain part runs in the loop (see LOOP_PLAIN) rather than in `generate`."""
    return device.type in LOOP_PLAIN


def losing(run: Run, t_decode: float, cost: CostModel, plain_s: float | None = None) -> bool:
    """Whether this sampled call decodes measurably slower than plain steps of its batch would: a one-token
    forward of the cost curve, or `plain_s`, a compiled plain round as measured (where the rest would run so),
    whichever is less.

    Progress is the least any live row has decoded: a batch finishes with its slowest row, so plain steps
    would have needed that many to bring every row this far."""
    if run.mode != "sample":
        return False
    live = [e - 1 for e, a in zip(run.emitted, run.active(), strict=True) if a]  # decoded after the prefill's
    if not live or min(live) < HAND_OVER_AFTER:
        return False
    if run.max_new - 1 - min(live) < MIN_LEFT:
        return False
    step = cost.verify(run.b, 1) if plain_s is None else min(plain_s, cost.verify(run.b, 1))
    return (time.perf_counter() - t_decode) / min(live) > HAND_OVER_LOSS * step


def plain_round(run: Run, target: Target) -> None:
    """One plain step of every live row, probes off and no drafter asked: a call that the path choice gave to
    plain decoding, or the rest of a sampled one that measured itself losing (`loop_plain`)."""
    t0 = time.perf_counter()
    target.capture(False)
    drafts = RoundDrafts.plain(run)
    inp, positions, mask = run.inputs(drafts.tokens)
    logits = target.forward(run, inp, positions, mask)
    n_acc, nxt = verify_round(run, drafts, logits, None)
    n = sum(len(t) for t in run.keep(n_acc, nxt, drafts.tokens, None))
    st, dt = run.stats, time.perf_counter() - t0
    if isinstance(run.cache, StaticLoopCache):  # a compiled step: what `losing` compares a call with
        was = target.plain_s.get(run.b)
        target.plain_s[run.b] = dt if was is None else was + 0.05 * (dt - was)
    st.target_forwards += 1
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


def hand_over(run: Run, target: Target) -> None:
    """Decode the rest of every live row with `target.generate`, continuing the loop's cache; record it in `run`.

    The cache holds `run.cols` columns, holes and left padding masked, and every row's next token (known, not
    yet forwarded) goes in the column after them: that is a left-padded batch to `generate`, whose positions
    come from the mask's running count, as the loop's do. Rows that are done leave the batch first."""
    t0 = time.perf_counter()
    st = run.stats
    if target.session is not None:
        target.capture(False)  # no hooks on the target's own loop
    rows = [r for r, a in enumerate(run.active()) if a]
    ids = torch.zeros(len(rows), run.cols + 1, dtype=torch.long)  # cached columns: their ids are not read again
    ids[:, -1] = torch.tensor([int(run.toks[r, run.last[r]]) for r in rows])
    mask = torch.cat([run.mask[rows, : run.cols], torch.ones(len(rows), 1, dtype=torch.long, device=run.device)], 1)
    if len(rows) < run.b:
        run.cache.batch_select_indices(torch.tensor(rows, device=run.device))
    left = [run.max_new - run.emitted[r] for r in rows]
    eos = sorted(run.eos)
    kw = gen_kwargs(target.model, max(left), run.temperature, run.top_k, run.top_p, eos, eos[0] if eos else None)
    out = target.model.generate(ids.to(run.device), attention_mask=mask, **{target.cache_kw: run.cache}, **kw,
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


def plain_call(target: Target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
               eos: int | list[int] | None, pad: int | None, streamer: object) -> SpecOutput:
    """The call as the target's own `generate`, probes off: the same output (greedy) or distribution."""
    check_call(input_ids, max_new_tokens, streamer)
    if target.session is not None:
        target.capture(False)  # no hooks on the target's own loop; the next speculative call puts them back
    t0 = time.perf_counter()
    eos_ids = eos_list(eos)
    kw = gen_kwargs(target.model, max_new_tokens, temperature, top_k, top_p, eos_ids, pad)
    device = target.device
    mask = attention_mask.to(device) if attention_mask is not None else torch.ones_like(input_ids, device=device)
    seq = target.model.generate(input_ids.to(device), attention_mask=mask, streamer=streamer, **kw).cpu()
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
    step to every token (measured: docs/design.md, "Decoder: measurements behind the code"). With keywords
    the model's config is the base, so every field it sets that would change the tokens (a top-k, an
    EOS, a repetition penalty, a minimum length) is unset here, and this call's values go on top."""
    base = target.generation_config.to_diff_dict()
    kw: dict = {k: None for k in base if k not in _GEN_KEEP and not k.startswith(("output_", "_"))}
    kw.update(max_new_tokens=max_new_tokens, do_sample=temperature > 0, num_beams=1,
              eos_token_id=eos_ids or None, pad_token_id=pad if pad is not None else 0)
    if temperature > 0:  # sampling fields only when sampling: on a greedy call transformers warns about them
        kw.update(temperature=temperature, top_k=top_k or None, top_p=top_p)
    return kw
