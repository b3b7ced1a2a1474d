"""What a speculative `generate` call hands back: the sequences and where the time and tokens went.

    out = spec.generate(input_ids, max_new_tokens=64)
    out.sequences, out.stats.tau, out.stats.tokens_per_forward, out.stats.as_dict()
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    model_rounds: int = 0  # row-rounds drafted by a model drafter (by_drafter says which)
    ngram_rounds: int = 0  # row-rounds drafted by n-gram
    plain_rounds: int = 0  # rounds with nothing drafted (a plain step)
    tree_rounds: int = 0  # rounds that verified a draft tree (batch 1 with tree=N)
    by_drafter: dict[str, int] = field(default_factory=dict)  # rounds each model drafter was consulted
    path: str = "spec"  # what `PathChoice` gave the call: "spec" (every drafter), "ngram" (n-gram alone), "plain"
    delegated: bool = False  # the call ran as plain decoding (drafting measured not to pay): the target's own
    # `generate`, or on CPU the loop's own plain rounds (`_plain.LOOP_PLAIN`)
    handed_over: int = 0  # tokens plain decoding (as for `delegated`) made after the call measured itself losing
    handover_steps: int = 0  # ... in this many plain steps (one per token of the longest row)
    seconds: float = 0.0
    draft_s: float = 0.0  # the rounds' drafting (scheduling included)
    verify_s: float = 0.0  # the rounds' target forwards, acceptance and bookkeeping (a delegated call: all of it)
    prefill_s: float = 0.0  # the prompt's forward
    handover_s: float = 0.0  # plain decoding after the call handed its rest over
    bus_s: float = 0.0
    # per round: verify length, active rows, drafts offered, drafts accepted, model drafter's drafts made
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
        keys = ("batch", "path", "rounds", "target_forwards", "emitted", "drafted", "accepted", "model_rounds",
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
