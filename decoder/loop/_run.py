"""The state of one speculative `generate` call, declared in one place: its options, its rows (tokens by
position, the target's mask with holes, the KV cache), the scheduler state it uses, the drafters' unread feeds.

    run = Run(input_ids, mask, max_new_tokens=64, k=5, eos=[2], device=dev, scheds=[Scheduler(5)])
    inp, positions, mask = run.inputs(drafts)              # [last, d1..dn] per row
    kept = run.keep(n_acc, nxt, drafts, feed_step)         # commit, feed the drafters, index, stream

Rows accept independently: rejected slots stay in the shared target KV cache as masked-out
holes and every row carries explicit positions, so no row waits for another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..forward._kv import GrowingCache
from ..forward._mask import causal_block
from ..schedule import RowFix, Scheduler
from ._stats import SpecStats

if TYPE_CHECKING:
    from ..drafters import NgramIndex


def through_eos(tokens: list[int], eos: set[int] | list[int]) -> list[int]:
    """A row's tokens up to and including its first EOS (all of them without one)."""
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    return tokens if stop is None else tokens[: stop + 1]


def check_call(input_ids: torch.Tensor, max_new_tokens: int, streamer: object) -> None:
    """The arguments both paths of a call (the loop, or the target's own `generate`) refuse alike."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch >= 1, length >= 1], got {tuple(input_ids.shape)}")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("a streamer needs batch size 1 (as in transformers)")


def eos_list(eos: int | list[int] | None) -> list[int]:
    return [eos] if isinstance(eos, int) else list(eos or [])


class Run:
    """Per-call state. Per-row scalars live in Python lists (a round touches each a few times).

    scheds: one scheduler state per model drafter (at least one), the decoder's own or, in a seeded call, fresh
    ones (a seeded call depends on nothing learned in earlier calls)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, max_new_tokens: int, k: int,
                 eos: list[int], device: torch.device, scheds: list[Scheduler], dtype: torch.dtype = torch.float32,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, streamer: object = None, drafting: bool = True,
                 model_drafters: bool = True) -> None:
        # the call's options
        self.temperature, self.top_k, self.top_p, self.streamer = temperature, top_k, top_p, streamer
        self.mode = "sample" if temperature > 0 else "greedy"
        self.seeded = seed is not None  # a seeded schedule depends on nothing timed or learned in earlier calls
        self.gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        # the call's path
        self.drafting = drafting  # False: plain rounds only (no cost curve, drafter buffers or n-gram index)
        self.model_drafters = drafting and model_drafters  # False: no model drafter is asked, the probes stay off
        self.handed = False  # the rest of a call that measured itself losing runs as plain rounds
        self.plain_graph = False  # ...on the compiled one-token graph (`SpeculativeDecoder.compiles_plain`)
        self.setup_s = 0.0  # seconds spent measuring costs and packing weights (once per model: not drafting's)
        # scheduling: one state per model drafter (slot); `cur` is the one this round consults
        self.scheds = scheds
        self.cur = 0
        b, p_len = input_ids.shape
        self.fixes = [RowFix(b) for _ in scheds]
        self.ngram_fix = RowFix(b)
        self.tried: set[int] = set()  # slots consulted in this call (a seeded call's own record)
        self.feeds_by: list[list[tuple]] = [[] for _ in scheds]  # forwards each model drafter has not read yet
        self.ngram: list[NgramIndex] | None = None  # per row, when n-gram lookup drafts
        self.seq_ids: list[int] | None = None  # the probe session's sequence ids of the rows
        # the rows
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        self.b, self.device, self.max_new, self.eos = b, device, max_new_tokens, set(eos)
        self.input_ids = input_ids
        self.lens = mask.sum(1).tolist()
        self.cap = p_len + max_new_tokens + 2 * k + 4  # a row may overshoot its budget by k, then draft k
        self.toks = torch.zeros(b, self.cap, dtype=torch.long)  # each row's real tokens by position (CPU)
        ids_cpu, mask_cpu = input_ids.cpu(), mask.cpu()
        for r in range(b):
            self.toks[r, : self.lens[r]] = ids_cpu[r, mask_cpu[r].bool()]
        self.mask = torch.zeros(b, p_len + 4 * (k + 1) + max_new_tokens, dtype=torch.long, device=device)
        self.mask[:, :p_len] = mask.to(device)
        self.cols = p_len
        # One row without padding: no mask at all (its mask stays all ones: a batch-1 round leaves no holes), and
        # a CPU forward of several tokens gets the additive mask built once (`causal_block`). Both give the same
        # logits, cheaper (measured: docs/design.md, "Decoder: measurements behind the code").
        self.dense = b == 1 and bool(mask.all())
        self.block_dtype = dtype if self.dense and torch.device(device).type == "cpu" else None
        self.prompt_mask = mask.to(device)
        self.last = list(self.lens)  # position of the token that goes in next (its id is known)
        self.emitted = [0] * b
        self.done = [False] * b
        self.n_eff = [0] * b  # drafts each row accepted in the last round (-1: the row had finished)
        self.cache = GrowingCache(capacity=self.mask.shape[1] + 64)  # a tree's nodes fit too (`forward/_kv.py`)
        self.stats = SpecStats(batch=b, accepted_at=[0] * k, offered_at=[0] * k)
        self._tokens_ema = self._seconds_ema = 0.0
        self.no_drafts = torch.zeros(b, 0, dtype=torch.long)
        self.row_rounds = [1] * b  # rounds each row took part in (the prefill counts one)

    def add_feed(self, feed: tuple, readers: list[bool] | None = None) -> None:
        """A forward the model drafters may read (each takes it when it next drafts); `readers`: per drafter,
        whether it reads this one (default: every one)."""
        for j, feeds in enumerate(self.feeds_by):
            if readers is None or readers[j]:
                feeds.append(feed)

    def take_feeds(self) -> list[tuple]:
        """The current drafter's unread forwards; its list starts over."""
        feeds, self.feeds_by[self.cur] = self.feeds_by[self.cur], []
        return feeds

    @property
    def sched(self) -> Scheduler:
        """The current model drafter's scheduler state (every slot's shares the n-gram calibration)."""
        return self.scheds[self.cur]

    @property
    def model_fix(self) -> RowFix:
        """The current model drafter's per-row correction of its acceptance estimates."""
        return self.fixes[self.cur]

    def draft_seed(self) -> int:
        """A seed for the drafter's draws of this round, from the call's generator (on the target's device: a
        CUDA generator draws only into CUDA tensors), or from torch's global one in an unseeded call."""
        gen = self.gen
        return int(torch.randint(2**31 - 1, (1,), generator=gen, device=None if gen is None else gen.device))

    def observe_rate(self, tokens: int, seconds: float, alpha: float = 0.1) -> None:
        """The loop's recent throughput (tokens/s over all rows), as a ratio of moving averages."""
        self._tokens_ema += alpha * (tokens - self._tokens_ema)
        self._seconds_ema += alpha * (seconds - self._seconds_ema)

    def rate(self) -> float:
        return self._tokens_ema / self._seconds_ema if self._seconds_ema > 0 else 0.0

    def active(self) -> list[bool]:
        return [not d and e < self.max_new for d, e in zip(self.done, self.emitted, strict=True)]

    def any_active(self) -> bool:
        return any(self.active())

    def caps(self, k: int) -> list[int]:
        """Most drafts worth offering per row: the remaining budget minus the bonus token (-1: finished)."""
        return [min(k, self.max_new - e - 1) if a else -1
                for a, e in zip(self.active(), self.emitted, strict=True)]

    def ahead(self) -> list[float]:
        """Per row: the most remaining tokens of any row / this row's remaining (1.0 for the last row)."""
        rem = [self.max_new - e if a else 0 for a, e in zip(self.active(), self.emitted, strict=True)]
        top = max(rem, default=0)
        return [top / x if x else 0.0 for x in rem]

    def prefill_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions from the mask, so left padding never shifts a row."""
        pos = (self.prompt_mask.cumsum(1) - 1).clamp_min(0)
        return self.prompt_mask, pos

    def start(self, first: list[int]) -> None:
        """The prefill's token for each row."""
        for r, t in enumerate(first):
            self.toks[r, self.last[r]] = t
            self.emitted[r] = 1
            self.done[r] = t in self.eos

    def reserve(self, length: int) -> None:
        """Room for `length` more mask columns (holes pile up over a long call)."""
        if self.cols + length > self.mask.shape[1]:
            grown = torch.zeros(self.b, 2 * self.mask.shape[1] + length, dtype=torch.long, device=self.device)
            grown[:, : self.cols] = self.mask[:, : self.cols]
            self.mask = grown

    def inputs(self, drafts: torch.Tensor,
               block: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input ids [B, L], positions [B, L], attention mask [B, cols + L]) for a verify forward; where `dense`,
        None, or with `block` the additive [1, 1, L, cols + L] of a forward of several tokens on the CPU
        (`causal_block`). `self.mask` is kept either way (trees and hand-overs read it)."""
        b, n = drafts.shape
        length = n + 1
        if b == 1:  # slices, not index tensors (measured: docs/design.md, "Decoder: measurements behind the code")
            p = self.last[0]
            inp = torch.cat([self.toks[:, p: p + 1], drafts.cpu()], 1)
            positions = torch.arange(p, p + length)[None]
        else:
            last = torch.tensor(self.last)
            inp = torch.cat([self.toks[torch.arange(b), last][:, None], drafts.cpu()], 1)
            positions = last[:, None] + torch.arange(length)
        self.reserve(length)
        self.mask[:, self.cols: self.cols + length] = 1
        if not self.dense:
            mask = self.mask[:, : self.cols + length]
        elif block and self.block_dtype is not None and length > 1:
            mask = causal_block(self.cols, length, self.block_dtype)
        else:
            mask = None
        return inp.to(self.device), positions.to(self.device), mask

    def commit(self, n_acc: list[int], nxt: list[int], drafts: torch.Tensor) -> list[list[int]]:
        """Write each active row's accepted drafts and next token; rejected slots become masked holes.

        Returns the tokens kept per row (after the budget and EOS), for streaming and n-gram indices.
        """
        b, n = drafts.shape
        length = n + 1
        active = self.active()
        d_rows = drafts.tolist()
        kept: list[list[int]] = [[] for _ in range(b)]
        n_eff = []
        for r in range(b):
            if not active[r]:
                n_eff.append(-1)
                continue
            acc = n_acc[r]
            new = d_rows[r][:acc] + [nxt[r]]
            budget = self.max_new - self.emitted[r]
            keep = min(len(new), budget)
            for i, t in enumerate(new[:keep]):
                if t in self.eos:
                    keep = i + 1
                    self.done[r] = True
                    break
            start = self.last[r] + 1
            self.toks[r, start: start + keep] = torch.tensor(new[:keep])
            if acc + 1 > keep:  # the overshoot still sits at these positions for the drafter's inputs
                self.toks[r, start + keep: start + acc + 1] = torch.tensor(new[keep:])
            kept[r] = new[:keep]
            self.emitted[r] += keep
            self.row_rounds[r] += 1
            n_eff.append(acc)
        # slots past each row's accepted ones are masked out; the cache keeps the widest row
        cols = self.cols
        # columns past the widest row are cropped below, and the next round's inputs overwrite them: only
        # rows that kept fewer than the widest need holes (none at batch 1)
        if min(n_eff) < max(n_eff):
            ne = torch.tensor(n_eff, device=self.device)
            self.mask[:, cols: cols + length] *= (torch.arange(length, device=self.device)[None, :] <= ne[:, None])
        keep_cols = cols + max(n_eff) + 1
        if self.cache.get_seq_length() > keep_cols:  # transformers 5: crop(-n) removes the last n tokens
            self.cache.crop(keep_cols - self.cache.get_seq_length())
        self.cols = keep_cols
        self.n_eff = n_eff
        return kept

    def keep(self, n_acc: list[int], nxt: list[int], drafts: torch.Tensor, feed_step: int | None,
             readers: list[bool] | None = None, remap: tuple[int, torch.Tensor] | None = None) -> list[list[int]]:
        """Commit a verified round and pass it on: each row's accepted drafts and next token (`commit`), the
        forward's feed for the model drafters (`feed_step`: the probe session's step of it, None when no drafter
        reads it; `readers`: which do; `remap`: a tree forward's (base, real position of each node)), the n-gram
        indices and the streamer. Returns the tokens kept per row."""
        kept = self.commit(n_acc, nxt, drafts)
        span = self.advance(feed_step is not None)
        if span is not None:
            self.add_feed((feed_step, *span) if remap is None else (feed_step, *span, remap), readers)
        if self.ngram is not None:
            for r, t in enumerate(kept):
                if t:
                    self.ngram[r].extend(t)
        if self.streamer is not None and kept[0]:
            self.streamer.put(torch.tensor(kept[0]))
        return kept

    def advance(self, feed: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Move each row past its accepted positions; (start, end) of the positions the drafter may read
        (None when no drafter reads this forward: three small tensors a round saved)."""
        before = self.last
        self.last = [p + n + 1 for p, n in zip(before, self.n_eff, strict=True)]
        if not feed:
            return None
        start = torch.tensor(before)
        return start, torch.maximum(torch.tensor(self.last) - 1, start)

    def sequences(self, pad: int | None) -> torch.Tensor:
        """Like `generate`: the (padded) prompt, then new tokens, padded after a row finishes, on the prompt's
        device (`torch.equal(out.sequences, model.generate(...))` holds on a GPU too)."""
        width = max(self.emitted)
        out = torch.full((self.b, width), pad if pad is not None else 0, dtype=torch.long)
        for r in range(self.b):
            out[r, : self.emitted[r]] = self.toks[r, self.lens[r]: self.lens[r] + self.emitted[r]]
        return torch.cat([self.input_ids.cpu(), out], 1).to(self.input_ids.device)
