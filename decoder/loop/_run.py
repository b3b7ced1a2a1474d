"""Bookkeeping of one speculative `generate` call: rows, the target's mask and cache, statistics.

    run = Run(input_ids, mask, max_new_tokens=64, k=5, eos=[2], device=dev)
    inp, positions, mask = run.inputs(drafts)          # [last, d1..dn] per row
    kept = run.commit(n_acc, nxt, drafts)              # per-row tokens, holes for rejected slots, cache crop

Rows accept independently: rejected slots stay in the shared target KV cache as masked-out
holes and every row carries explicit positions, so no row waits for another.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..target._kv import GrowingCache


@dataclass
class SpecStats:
    batch: int = 1
    rounds: int = 0
    target_forwards: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position: rows that accepted it
    offered_at: list[int] = field(default_factory=list)
    row_rounds: int = 0  # (row, round) pairs of active rows
    drafted_row_rounds: int = 0  # ... that offered at least one draft
    eagle_rounds: int = 0  # row-rounds drafted by the model drafter (EAGLE-3 or any other; by_drafter says which)
    ngram_rounds: int = 0  # row-rounds drafted by n-gram
    plain_rounds: int = 0  # rounds with nothing drafted (a plain step)
    tree_rounds: int = 0  # rounds that verified a draft tree (batch 1 with tree=N)
    by_drafter: dict[str, int] = field(default_factory=dict)  # rounds each model drafter was consulted
    path: str = "spec"  # what `PathChoice` gave the call: "spec" (every drafter), "ngram" (n-gram alone), "plain"
    delegated: bool = False  # the call ran as plain decoding (drafting measured not to pay): the target's own
    # `generate`, or on CPU the loop's own plain rounds (`_handover.LOOP_PLAIN`)
    handed_over: int = 0  # tokens plain decoding (as for `delegated`) made after the call measured itself losing
    handover_steps: int = 0  # ... in this many plain steps (one per token of the longest row)
    seconds: float = 0.0
    draft_s: float = 0.0  # the rounds' drafting (scheduling included)
    verify_s: float = 0.0  # the rounds' target forwards, acceptance and bookkeeping (a delegated call: all of it)
    prefill_s: float = 0.0  # the prompt's forward
    handover_s: float = 0.0  # plain decoding after the call handed its rest over
    bus_s: float = 0.0
    # per round: verify length, active rows, drafts offered, drafts accepted, EAGLE-3 drafts made
    history: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification round and row, bonus token included (plain steps count 1)."""
        return (self.accepted + self.row_rounds) / max(self.row_rounds, 1)

    @property
    def tau_drafted(self) -> float:
        """Like tau, over the row-rounds that drafted."""
        return (self.accepted + self.drafted_row_rounds) / max(self.drafted_row_rounds, 1)

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per row per target forward (prefill included)."""
        return self.emitted / max(self.target_forwards * self.batch, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / max(self.seconds, 1e-9)

    @property
    def acceptance(self) -> list[float]:
        """Per draft position: the share of rows that offered it and had it accepted."""
        return [a / o if o else 0.0 for a, o in zip(self.accepted_at, self.offered_at, strict=True)]

    def as_dict(self) -> dict:
        keys = ("batch", "path", "rounds", "target_forwards", "emitted", "drafted", "accepted", "eagle_rounds",
                "ngram_rounds", "plain_rounds", "tree_rounds", "seconds", "draft_s", "verify_s", "prefill_s",
                "handover_s", "bus_s")
        d = {k: getattr(self, k) for k in keys}
        d.update(tau=self.tau, tau_drafted=self.tau_drafted, tokens_per_forward=self.tokens_per_forward,
                 tokens_per_s=self.tokens_per_s, acceptance=self.acceptance, by_drafter=dict(self.by_drafter))
        return d


@dataclass
class SpecOutput:
    sequences: torch.Tensor
    stats: SpecStats


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


@functools.lru_cache(maxsize=64)
def _triangle(length: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((length, length), torch.finfo(dtype).min, dtype=dtype).triu(1)


def causal_block(cols: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, length, cols + length] of one row's forward over `length` new tokens after `cols`
    cached ones: every cached column open, the new ones causal."""
    mask = torch.zeros(1, 1, length, cols + length, dtype=dtype)
    mask[0, 0, :, cols:] = _triangle(length, dtype)
    return mask


class Run:
    """Per-call state. Per-row scalars live in Python lists (a round touches each a few times)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, max_new_tokens: int, k: int,
                 eos: list[int], device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.setup_s = 0.0  # seconds the call spent measuring the cost curve (the first call per machine)
        b, p_len = input_ids.shape
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
        # One row, no padding: its mask stays all ones (a batch-1 round leaves no holes), so the target's forwards
        # go without one: transformers then builds its causal mask alone, bit for bit the same logits, 0.17-0.21 ms
        # less of a 5.4-6.1 ms verify forward of 2-6 tokens (default target, 2-core VM, median of 100 interleaved,
        # 3 trials; 0.01-0.05 ms at 1 token). On the CPU a forward of several tokens gets the additive 4-D mask
        # itself (`causal_block`): transformers' boolean one is turned into that by every layer's attention,
        # 0.13-0.17 ms more of a 5.9-6.2 ms forward of 2-6 tokens (median of 150 interleaved), same logits.
        self.dense = b == 1 and bool(mask.all())
        self.block_dtype = dtype if self.dense and torch.device(device).type == "cpu" else None
        self.prompt_mask = mask.to(device)
        self.last = list(self.lens)  # position of the token that goes in next (its id is known)
        self.emitted = [0] * b
        self.done = [False] * b
        self.cache = GrowingCache(capacity=self.mask.shape[1] + 64)  # a tree's nodes fit too (`_kv.py`)
        self.stats = SpecStats(batch=b, accepted_at=[0] * k, offered_at=[0] * k)
        self.feeds: list[tuple] = []  # forwards the current model drafter has not read yet (feeds_by[cur])
        self.feeds_by: list[list[tuple]] = [self.feeds]  # per model drafter (slot)
        self.cur = 0
        self.ngram: list | None = None
        self._tokens_ema = self._seconds_ema = 0.0
        self.no_drafts = torch.zeros(b, 0, dtype=torch.long)
        self.row_rounds = [1] * b  # rounds each row took part in (the prefill counts one)

    def add_feed(self, feed: tuple) -> None:
        """A forward every model drafter may read (each takes it when it next drafts)."""
        for feeds in self.feeds_by:
            feeds.append(feed)

    def take_feeds(self) -> list[tuple]:
        """The current drafter's unread forwards; its list starts over."""
        feeds = self.feeds_by[self.cur]
        self.feeds_by[self.cur] = self.feeds = []
        return feeds

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
        if b == 1:  # slices instead of index tensors: a third of this method's time at batch 1
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
