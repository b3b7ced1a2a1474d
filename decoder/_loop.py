"""Speculative decoding as a subscriber of the probe bus.

    with SpeculativeDecoder(target, load_drafter(path, target), k=5) as spec:
        out = spec.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    out.sequences, out.stats.tau

Per round: the target runs over [last, d1..dk] with probes on the drafter's feature
sites (phase `verify`); the drafter subscriber takes the features of the accepted
positions from the bus; it drafts k tokens; the loop verifies them losslessly and
crops the target's KV cache. Rows of a batch accept independently: rejected slots stay
in the shared cache as masked-out holes and every row carries its own positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

import probe

from ._eagle import Eagle3Drafter
from ._feeder import EagleFeeder
from ._ngram import NgramDrafter
from ._remote import RemoteEagle
from ._verify import target_probs, verify_greedy, verify_sampling


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
    row_rounds: int = 0
    ngram_rounds: int = 0
    seconds: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    bus_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification round and row, bonus token included."""
        return (self.accepted + self.row_rounds) / max(self.row_rounds, 1)

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per row per target forward (prefill included)."""
        return self.emitted / max(self.target_forwards * self.batch, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / max(self.seconds, 1e-9)

    @property
    def acceptance(self) -> list[float]:
        return [a / o if o else 0.0 for a, o in zip(self.accepted_at, self.offered_at, strict=True)]

    def as_dict(self) -> dict:
        keys = ("batch", "rounds", "target_forwards", "emitted", "drafted", "accepted", "ngram_rounds", "seconds",
                "draft_s", "verify_s", "bus_s")
        d = {k: getattr(self, k) for k in keys}
        d.update(tau=self.tau, tokens_per_forward=self.tokens_per_forward, tokens_per_s=self.tokens_per_s,
                 acceptance=self.acceptance)
        return d


@dataclass
class SpecOutput:
    sequences: torch.Tensor
    stats: SpecStats


class SpeculativeDecoder:
    """drafter: an Eagle3Drafter, an NgramDrafter, "auto" (both, chosen per round), or None."""

    def __init__(self, target: nn.Module, drafter: Eagle3Drafter | RemoteEagle | NgramDrafter | str | None = None,
                 *, k: int = 5, ngram: NgramDrafter | None = None, eagle: Eagle3Drafter | RemoteEagle | None = None,
                 endpoint: str | None = None) -> None:
        self.target, self.k = target, k
        if drafter == "auto":
            if eagle is None:
                raise ValueError("drafter='auto' needs eagle=Eagle3Drafter(...)")
            self.eagle, self.ngram = eagle, ngram or NgramDrafter()
        else:
            self.eagle = drafter if isinstance(drafter, (Eagle3Drafter, RemoteEagle)) else None
            self.ngram = drafter if isinstance(drafter, NgramDrafter) else None
        self.session = None
        self.feeder: EagleFeeder | RemoteEagle | None = None
        if self.eagle is not None:
            ids = self.eagle.config.aux_layer_ids
            self.session = probe.attach(target, [f"layers.{i}.resid_pre" for i in ids], endpoint=endpoint)
            if isinstance(self.eagle, RemoteEagle):
                self.feeder = self.eagle
                self.feeder.connect(self.session.endpoint)
            else:
                self.feeder = EagleFeeder(self.eagle, self.session.endpoint)
            self.session.wait_for_subscribers(1)

    def close(self) -> None:
        if self.session is not None:
            self.feeder.close()  # first: the session then has no one to wait for at its end of stream
            self.session.close()
            self.session = None

    def __enter__(self) -> SpeculativeDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the loop ---------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 32, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, seed: int | None = None) -> SpecOutput:
        t0 = time.perf_counter()
        st = SpecStats(batch=input_ids.shape[0], accepted_at=[0] * self.k, offered_at=[0] * self.k)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        sample = temperature > 0
        b, p_len = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        lens = mask.sum(1)
        max_len = p_len + max_new_tokens + 2 * self.k + 4  # a row may overshoot its budget by k, then drafts k
        toks = torch.zeros(b, max_len, dtype=torch.long)  # each row's real tokens by position
        for r in range(b):
            toks[r, : lens[r]] = input_ids[r, mask[r].bool()]
        emitted = torch.zeros(b, dtype=torch.long)
        done = torch.zeros(b, dtype=torch.bool)
        self._prepare(b, max_len)

        # Prefill: positions from the mask, so left padding never shifts a row.
        cache = DynamicCache()
        pos_ids = (mask.cumsum(1) - 1).clamp_min(0)
        tv = time.perf_counter()
        with self._context("prefill"):
            logits = self.target(input_ids, attention_mask=mask, position_ids=pos_ids, cache=cache,
                                 use_cache=True).logits[:, -1:]
        nxt = self._choose(logits, temperature, top_k, top_p, gen)[:, 0]
        st.verify_s += time.perf_counter() - tv
        st.target_forwards += 1
        last_pos = lens.clone()  # position of the token that goes in next
        toks[torch.arange(b), last_pos] = nxt
        emitted += 1
        done |= torch.isin(nxt, eos)
        self._feed(st, start=torch.zeros_like(lens), end=lens - 1, toks=toks)

        while not bool((done | (emitted >= max_new_tokens)).all()):
            td = time.perf_counter()
            drafts, q, used_ngram = self._draft(toks, last_pos, temperature, gen)
            st.draft_s += time.perf_counter() - td
            k = drafts.shape[1]
            inp = torch.cat([toks[torch.arange(b), last_pos][:, None], drafts], 1)
            positions = last_pos[:, None] + torch.arange(k + 1)
            cols = mask.shape[1]
            mask = torch.cat([mask, torch.ones(b, k + 1, dtype=torch.long)], 1)
            tv = time.perf_counter()
            with self._context("verify", positions):
                logits = self.target(inp, attention_mask=mask, position_ids=positions, cache=cache,
                                     use_cache=True).logits
            if sample:
                p = target_probs(logits, temperature, top_k, top_p)
                n_acc, nxt = verify_sampling(drafts, p, q, gen)
            else:
                n_acc, nxt = verify_greedy(drafts, logits)
            st.verify_s += time.perf_counter() - tv
            st.target_forwards += 1
            active = ~done & (emitted < max_new_tokens)
            for r in range(b):
                if not active[r]:
                    continue
                n = int(n_acc[r])
                new = torch.cat([drafts[r, :n], nxt[r: r + 1]])
                budget = max_new_tokens - int(emitted[r])
                hit = torch.isin(new, eos).nonzero()
                keep = min(len(new), budget, int(hit[0]) + 1 if len(hit) else len(new))
                toks[r, last_pos[r] + 1: last_pos[r] + 1 + keep] = new[:keep]
                emitted[r] += keep
                done[r] |= bool(len(hit)) and int(hit[0]) < keep
                st.row_rounds += 1
                st.accepted += n
                st.drafted += k
                for i in range(k):
                    st.offered_at[i] += 1
                    st.accepted_at[i] += int(n > i)
            st.rounds += 1
            st.ngram_rounds += int(used_ngram)
            # Rejected slots become masked holes; rows that were already finished keep nothing.
            n_eff = torch.where(active, n_acc, torch.full_like(n_acc, -1))
            mask[:, cols:] *= (torch.arange(k + 1)[None, :] <= n_eff[:, None]).long()
            keep_cols = cols + int(n_eff.max()) + 1
            if cache.get_seq_length() > keep_cols:  # transformers 5: crop(-n) removes the last n tokens
                cache.crop(keep_cols - cache.get_seq_length())
            mask = mask[:, :keep_cols]
            start = last_pos.clone()
            last_pos = last_pos + n_eff + 1
            self._feed(st, start=start, end=torch.maximum(last_pos - 1, start), toks=toks)

        st.emitted = int(emitted.sum())
        st.seconds = time.perf_counter() - t0
        return SpecOutput(self._sequences(input_ids, toks, lens, emitted, pad_token_id), st)

    # --- pieces ---------------------------------------------------------------------------
    def _prepare(self, batch: int, max_len: int) -> None:
        self._seq_ids = None
        if self.feeder is not None:
            self.feeder.prepare(batch, max_len)

    def _context(self, phase: str, positions: torch.Tensor | None = None):  # noqa: ANN202
        if self.session is None:
            return torch.no_grad()
        if phase == "prefill":
            return self.session.context(phase="prefill")
        b = positions.shape[0]
        return self.session.context(phase="verify", seq_ids=self._seq_ids, positions=positions,
                                    valid=torch.ones(b, positions.shape[1], dtype=torch.bool))

    def _feed(self, st: SpecStats, *, start: torch.Tensor, end: torch.Tensor, toks: torch.Tensor) -> None:
        """Hand the drafter this forward's accepted positions; it reads their features off the bus."""
        if self.feeder is None:
            return
        t0 = time.perf_counter()
        seq_base, bus_s = self.feeder.feed(self.session.step, start, end, toks)
        if self._seq_ids is None:
            self._seq_ids = torch.arange(seq_base, seq_base + start.shape[0])
        st.bus_s += bus_s
        st.draft_s += time.perf_counter() - t0 - bus_s

    def _draft(self, toks: torch.Tensor, last_pos: torch.Tensor, temperature: float,
               gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        b, k = toks.shape[0], self.k
        if self.ngram is not None:
            props = [self.ngram.propose(toks[r, : last_pos[r] + 1].tolist(), k) for r in range(b)]
            confident = all(len(p) == k and self.ngram.match_length(toks[r, : last_pos[r] + 1].tolist()) >= 2
                            for r, p in enumerate(props))
            if self.eagle is None or confident:  # `auto`: a long exact match beats the learned drafter
                width = max(len(p) for p in props)
                d = torch.tensor([p + [p[-1] if p else 0] * (width - len(p)) for p in props], dtype=torch.long)
                q = None
                if temperature > 0 and width:
                    q = torch.zeros(b, width, self.target.config.vocab_size)
                    q.scatter_(2, d[:, :, None], 1.0)  # a point mass: the min(1, p/q) rule becomes p(x)
                return d.view(b, width), q, True
        if self.eagle is None:
            return torch.zeros(b, 0, dtype=torch.long), None, False
        seed = int(torch.randint(2**31 - 1, (1,), generator=gen)) if temperature > 0 else None
        drafts, q = self.feeder.draft(k, temperature, seed)
        return drafts, q, False

    @staticmethod
    def _choose(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                gen: torch.Generator | None) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        p = target_probs(logits, temperature, top_k, top_p)
        return torch.multinomial(p.view(-1, p.shape[-1]), 1, generator=gen).view(p.shape[:-1])

    @staticmethod
    def _sequences(input_ids: torch.Tensor, toks: torch.Tensor, lens: torch.Tensor, emitted: torch.Tensor,
                   pad: int | None) -> torch.Tensor:
        """Like `generate`: the (padded) prompt, then new tokens, padded after a row finishes."""
        width = int(emitted.max())
        out = torch.full((input_ids.shape[0], width), pad if pad is not None else 0, dtype=torch.long)
        for r in range(input_ids.shape[0]):
            out[r, : emitted[r]] = toks[r, lens[r]: lens[r] + emitted[r]]
        return torch.cat([input_ids, out], 1)
