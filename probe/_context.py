"""Per-forward identity: which rows of a [batch, seq] activation are real tokens.

Computed once per top-level forward (in a pre-hook on the model) and shared by every
site of that step, so the hooks only index and copy. Positions come from the
attention mask and the KV-cache length, never from the row index, so left padding,
right padding and cached decoding all give each token its index in its own sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StepContext:
    step: int
    phase: int
    batch: int
    seq_len: int
    valid: torch.Tensor  # bool [B, S] on CPU
    seq_ids: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B, S]
    token_ids: torch.Tensor  # int64 [B, S] (-1 when the model was fed embeddings)
    device: torch.device
    _rows: dict[int, tuple[np.ndarray | None, np.ndarray]] = field(default_factory=dict)
    _device_index: dict[int, torch.Tensor] = field(default_factory=dict)

    def rows(self, seq_len: int) -> tuple[np.ndarray | None, np.ndarray]:
        """(flat row index, or None for "all rows", and tokens [3, n]).

        `seq_len` may be shorter than the step's (an LM head that only computes the
        last positions, e.g. `logits_to_keep=1` in `generate`): the last columns are used.
        """
        got = self._rows.get(seq_len)
        if got is None:
            cut = self.seq_len - seq_len
            if cut < 0:
                raise ValueError(f"activation has {seq_len} positions but the step has {self.seq_len}")
            valid = self.valid[:, cut:]
            b, s = torch.nonzero(valid, as_tuple=True)
            tokens = np.empty((3, b.numel()), dtype=np.int64)
            tokens[0] = self.seq_ids[b].numpy()
            tokens[1] = self.positions[:, cut:][b, s].numpy()
            tokens[2] = self.token_ids[:, cut:][b, s].numpy()
            index = None if bool(valid.all()) else (b * seq_len + s).numpy()
            got = (index, tokens)
            self._rows[seq_len] = got
        return got

    def device_index(self, seq_len: int) -> torch.Tensor:
        """The row index of `rows(seq_len)` as a tensor on the model's device (CUDA path)."""
        got = self._device_index.get(seq_len)
        if got is None:
            index = self.rows(seq_len)[0]
            assert index is not None
            got = self._device_index[seq_len] = torch.from_numpy(index).to(self.device)
        return got


def cache_length(cache: object) -> int:
    if cache is None:
        return 0
    get = getattr(cache, "get_seq_length", None)
    if callable(get):
        return int(get())
    try:  # legacy tuple-of-tuples cache: [layer][k/v] of [B, heads, T, d]
        return int(cache[0][0].shape[-2])  # type: ignore[index]
    except (TypeError, IndexError, AttributeError):
        return 0


def positions_and_valid(mask: torch.Tensor | None, batch: int, seq_len: int,
                        past: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [B, S] (0-based, padding excluded) and validity [B, S] of the new tokens."""
    if mask is not None and mask.dim() == 2 and mask.shape[0] == batch:
        m = mask.detach().to("cpu", torch.int64)
        if m.shape[1] == past + seq_len:  # full mask, as generate passes it
            cum = m.cumsum(1)
            return (cum[:, past:] - 1), m[:, past:].bool()
        if m.shape[1] == seq_len:  # mask of the new tokens only
            return past + m.cumsum(1) - 1, m.bool()
    pos = torch.arange(past, past + seq_len, dtype=torch.int64).expand(batch, seq_len)
    return pos, torch.ones(batch, seq_len, dtype=torch.bool)
