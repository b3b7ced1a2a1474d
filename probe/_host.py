"""Host-memory views of a capture's bytes, for the copy paths (`_copy.py`, `_held.py`).

    dtype, itemsize = dtype_info(t.dtype)        # the wire's dtype code; TypeError if it has none
    data = host_bytes(t.data_ptr(), t.nbytes)    # a contiguous CPU tensor's own bytes, no numpy view
    rows = host_rows(t)                          # a numpy view (bf16 as int16)

Between a model's layers every Python operation runs from cold caches, so these are as
few operations as the job allows (their costs: docs/design.md, "Costs behind the code").
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ._wire import DTYPE_CODE

_DTYPE_INFO = {d: (c, d.itemsize) for d, c in DTYPE_CODE.items()}
_CHARS: dict[int, type] = {}  # nbytes -> ctypes char array type (bounded: small captures come in few sizes)


def dtype_info(dt: torch.dtype) -> tuple[int, int]:
    """(wire dtype code, item size); TypeError for a dtype the wire has no code for."""
    got = _DTYPE_INFO.get(dt)
    if got is None:
        raise TypeError(f"dtype {dt} cannot be published")
    return got


def known_dtype(dt: torch.dtype) -> tuple[int, int] | None:
    """`dtype_info`, or None where the wire has no code for `dt`."""
    return _DTYPE_INFO.get(dt)


def chars(nbytes: int) -> type:
    """The ctypes type of `nbytes` raw bytes (cached: small captures come in few sizes)."""
    got = _CHARS.get(nbytes)
    if got is None:
        got = ctypes.c_char * nbytes
        if len(_CHARS) < 256:
            _CHARS[nbytes] = got
    return got


def host_bytes(address: int, nbytes: int) -> ctypes.Array:
    """The `nbytes` at `address` in this process as a buffer, for one copy while the tensor is alive.

    A numpy view of a tensor (`t.numpy()`) costs a tenth of a decode-step capture's whole hook; this
    less than half of that. Only for contiguous CPU tensors, whose bytes are exactly [data_ptr, +nbytes)."""
    return chars(nbytes).from_address(address)


def host_rows(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bf16 as int16: numpy has no bf16, the bits move unchanged)."""
    src = t.detach() if t.requires_grad else t  # detach alone costs a dispatch per call
    if src.dtype == torch.bfloat16:
        src = src.view(torch.int16)
    return src.numpy()
