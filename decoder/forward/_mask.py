"""The additive causal mask the loop gives a CPU forward of several new tokens after a dense prefix.

    mask = causal_block(cols=37, length=4, dtype=torch.float32)   # [1, 1, 4, 41]: cached columns open, new causal

transformers would build a boolean mask and every attention layer would turn it into this one; handing it over
built once saves that per layer, with the same logits (measured: docs/design.md, "Decoder: measurements behind
the code").
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def _triangle(length: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((length, length), torch.finfo(dtype).min, dtype=dtype).triu(1)


def causal_block(cols: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, length, cols + length] of one row's forward over `length` new tokens after `cols`
    cached ones: every cached column open, the new ones causal."""
    mask = torch.zeros(1, 1, length, cols + length, dtype=dtype)
    mask[0, 0, :, cols:] = _triangle(length, dtype)
    return mask
