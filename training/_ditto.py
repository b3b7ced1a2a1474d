"""DITTO rows: a training signal against self-reinforcing repetition loops (greedy degeneracy).

Usage (inside the training loop)::

    ditto = DittoRows(stream, seq_len=512, span_min=8, span_max=48, seed=0, special_ids={0, 1, 2})
    rows, spans, starts = ditto.sample(2)              # (2, 512) ids, span lengths, loop starts
    logits = model(input_ids=rows).logits
    loss = ditto_loss(logits, rows, spans, lam=0.5, loop_starts=starts)  # add to the LM loss

Method: Xu et al., "Learning to Break the Loop: Analyzing and Mitigating Repetitions for
Neural Text Generation" (NeurIPS 2022), DITTO. A row is one span of training text
repeated until the row is full. A language model trained by maximum likelihood alone
learns that the more often something has repeated, the likelier it repeats again; that
is the loop greedy decoding falls into. DITTO's loss asks that the probability of each
token in repetition ``n`` be ``lam`` times the (stop-gradient) probability of the same
token in repetition ``n - 1``:

    loss_j = -log(1 - |p_j - lam * sg(p_{j - L})|)     for tokens j of repetitions 2, 3, ...

so the probability of continuing a loop decays with every repetition instead of
growing. The rows use train-split text only (spans are cut from the packed train stream).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F


class DittoRows:
    """Rows that fall into a loop: one random train-stream span repeated to ``seq_len`` tokens.

    Usage: ``rows, spans, loop_starts = DittoRows(stream, 512, 8, 48, seed=0).sample(2)``.
    With ``prefix_max = 0`` (the paper's construction) a row is the span repeated from its
    first token. With ``prefix_max > 0`` a row starts with ``P`` tokens of real text
    (``span_max <= P <= prefix_max``) whose last ``L`` tokens are the span, and the loop
    follows: the situation greedy decoding is in when it starts repeating after a prompt.
    ``loop_starts[i]`` is the index of the first token of the span's second copy.
    Text containing a special token (``<|bos|>``, ``<|eos|>``, ``<|pad|>``) is redrawn,
    so a row never crosses a document boundary.
    """

    def __init__(
        self,
        stream: torch.Tensor,
        seq_len: int,
        span_min: int,
        span_max: int,
        seed: int,
        special_ids: Iterable[int] = (0, 1, 2),
        prefix_max: int = 0,
    ) -> None:
        if not 2 <= span_min <= span_max <= seq_len // 2:
            raise ValueError(f"need 2 <= span_min <= span_max <= seq_len/2, got {span_min}, {span_max}, {seq_len}")
        if prefix_max and not span_max <= prefix_max <= seq_len - 2 * span_max:
            raise ValueError(f"need span_max <= prefix_max <= seq_len - 2*span_max, got {prefix_max}")
        self.stream = stream
        self.seq_len = seq_len
        self.span_min = span_min
        self.span_max = span_max
        self.prefix_max = prefix_max
        self.gen = torch.Generator().manual_seed(seed + 7919)  # independent of the block order
        self.special = torch.tensor(sorted(set(special_ids)), dtype=stream.dtype)

    def _randint(self, low: int, high: int) -> int:
        return int(torch.randint(low, high, (1,), generator=self.gen))

    def sample(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return ``(rows, spans, loop_starts)``: ``n`` rows of ``seq_len`` ids, periods, loop starts."""
        rows, spans, starts = [], [], []
        while len(rows) < n:
            length = self._randint(self.span_min, self.span_max + 1)
            prefix_len = self._randint(self.span_max, self.prefix_max + 1) if self.prefix_max else length
            start = self._randint(0, len(self.stream) - prefix_len)
            prefix = self.stream[start : start + prefix_len]
            if torch.isin(prefix, self.special).any():
                continue
            span = prefix[prefix_len - length :]
            reps = -(-(self.seq_len - prefix_len) // length)
            rows.append(torch.cat([prefix, span.repeat(reps)])[: self.seq_len])
            spans.append(length)
            starts.append(prefix_len)
        return torch.stack(rows), torch.tensor(spans), torch.tensor(starts)

    def state_dict(self) -> dict:
        """Generator state, for checkpoints: ``ditto.load_state_dict(ditto.state_dict())``."""
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (resuming an interrupted run)."""
        self.gen.set_state(state["gen"])


def ditto_loss(
    logits: torch.Tensor,
    rows: torch.Tensor,
    spans: torch.Tensor,
    lam: float,
    from_rep: int = 2,
    loop_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean DITTO loss over the tokens of repetition ``from_rep`` and later of each row.

    Usage: ``ditto_loss(model(input_ids=rows).logits, rows, spans, lam=0.5, loop_starts=starts)``.
    ``logits`` is ``(n, T, V)`` for ``rows`` ``(n, T)``; ``spans[i]`` is row ``i``'s period and
    ``loop_starts[i]`` the index of the first token of its second copy (default: ``spans``,
    a row that repeats from its first token). ``from_rep=2`` is the paper's rule;
    ``from_rep=3`` leaves a single copy of a span unpenalised (code often repeats a line
    once) and only damps the loop that follows.
    """
    if from_rep < 2:
        raise ValueError(f"from_rep must be >= 2, got {from_rep}")
    starts = spans if loop_starts is None else loop_starts
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    # p[:, j - 1] = probability of token j given tokens < j
    p = logp.gather(-1, rows[:, 1:, None]).squeeze(-1).exp()
    terms = []
    for i, (period, loop) in enumerate(zip(spans.tolist(), starts.tolist(), strict=True)):
        # first penalised token j0; its previous copy j0 - period needs a probability, so j0 - period >= 1
        j0 = max(loop + (from_rep - 2) * period, period + 1)
        cur = p[i, j0 - 1 :]
        prev = p[i, j0 - 1 - period : p.shape[1] - period].detach()  # the same tokens one repetition earlier
        gap = (cur - lam * prev).abs()
        terms.append(-torch.log((1.0 - gap).clamp_min(1e-5)))
    return torch.cat(terms).mean()
