"""The target's LM head for the loop's multi-token forwards, its weight packed once for oneDNN.

    head = PackedHead.of(target)        # None where it does not apply (GPU, not fp32, no oneDNN)
    with head.active():                 # the verify forward of a round
        logits = target(draft_ids, ...).logits

Why: on the CPU, `F.linear` with more than one row packs the weight into the GEMM kernel's
layout on every call. For the default target's tied 8192 x 192 head that repacking is most
of the cost: measured on the 2-core VM (1 thread, median of 200), one row 272 us, but 2 rows
478 us, 6 rows 1100 us, 25 rows 2709 us; with the weight packed once, 170, 234 and 1070 us.
A round's verify forward of 6 tokens thus paid ~0.9 ms for the head alone, about a third of
what makes a verify dearer than a one-token step (design notes, "Verify's LM head").

Only forwards of more than one position per row go through the packed weight (a verify, a
tree); a one-token step, as plain `generate` runs it, keeps `F.linear`, so the loop's plain
rounds compute exactly what `generate` does. Acceptance only compares argmaxes or
probabilities of each position, so the few-ulp differences between kernels at 2-5 rows (at
6 and more rows the two agree bit for bit here) matter no more than those `F.linear`
already has between 1 and 6 rows. The head is left alone while anything else wraps or hooks
it (a probe on `logits`), and repacked when its weight changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def _ops_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


class PackedHead:
    def __init__(self, head: nn.Linear) -> None:
        self.head = head
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    @classmethod
    def of(cls, target: nn.Module) -> PackedHead | None:
        get = getattr(target, "get_output_embeddings", None)
        head = get() if get is not None else None
        if (not isinstance(head, nn.Linear) or head.weight.device.type != "cpu"
                or head.weight.dtype != torch.float32 or not _ops_available()):
            return None
        return cls(head)

    def _weight(self) -> torch.Tensor:
        w = self.head.weight
        key = (w.data_ptr(), w._version, tuple(w.shape))
        if key != self._key or self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)
            self._key = key
        return self._packed

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        head = self.head
        if "forward" in head.__dict__ or head._forward_hooks or head._forward_pre_hooks or torch.is_grad_enabled():
            yield  # someone else's tap or hook on the head, or a forward that needs gradients: as it is
            return
        packed, weight, bias = self._weight(), head.weight, head.bias
        pointwise = torch.ops.mkldnn._linear_pointwise

        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 3 and x.shape[1] > 1 and x.dtype == torch.float32:
                return pointwise(x, packed, bias, "none", [], "")
            return F.linear(x, weight, bias)

        head.forward = forward
        try:
            yield
        finally:
            del head.forward
