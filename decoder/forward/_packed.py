"""The target's linear layers for the loop's forwards, their weights packed once for oneDNN.

    packed = PackedLinears.of(target)          # None where it does not apply (GPU, not fp32, no oneDNN)
    with packed.active():                      # a forward of the loop: prefill, verify, plain step
        logits = target(draft_ids, ...).logits

Why: on the CPU, `F.linear` with more than one row packs the weight into the GEMM kernel's
layout on every call. For the default target's tied 8192 x 192 head that repacking is most
of the cost. The target's other large layers pay the same in proportion (small ones do not:
`MIN_ELEMENTS`), so their MLP projections are packed with the head (design notes, "Verify's linear
layers").

Every forward of the loop goes through the packed weights, one-token steps included (at batch 8 a
step's 8 rows through the 8192 x 192 head would repack it on every call). At a single row (batch 1,
one token) only the head is packed: there F.linear is a matrix-vector product with nothing to repack,
and faster than oneDNN (`MIN_ELEMENTS`).
Packed and unpacked differ by a few ulps, no more than `F.linear` itself between 1 and 6 rows: a
greedy token can differ from `generate`'s only where the target's top two logits tie to within that,
as for any verify of several tokens. `packed="none"` keeps `F.linear` for one-token steps, bit for bit
`generate`'s but slower, as greedy calls did before (README, design notes "Verify's linear layers")
(measured: docs/design.md, "Decoder: measurements behind the code").

A layer is left alone while anything else wraps or hooks it (a probe on `logits`), and repacked when its
weight changes. The packed copies cost the weights' size again in memory: past `max_bytes` (1 GiB) of
linear weights, only the LM head is packed (`which="head"` asks for that; `SpeculativeDecoder(...,
packed="head")`).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ._attention import gqa_attention

WHICH = ("all", "head", "none")
# Below this many weights oneDNN's fixed cost per call outweighs the repacking it saves: small layers keep
# F.linear. In the default target's forward of several tokens, packing the gate/up/down projections and the head
# beats packing every layer and packing the head alone (measured: docs/design.md, "Decoder: measurements behind
# the code").
MIN_ELEMENTS = 65536
# A single row is a matrix-vector product, which F.linear does without repacking anything: there the MLP's
# projections are faster on F.linear than packed, alone and in a batch-1 one-token forward of the default target.
# The LM head stays packed at one row too, where packed is the faster (measured: docs/design.md, "Decoder:
# measurements behind the code").


def _ops_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def _packable(layer: nn.Module) -> bool:
    return (isinstance(layer, nn.Linear) and layer.weight.device.type == "cpu"
            and layer.weight.dtype == torch.float32)


class PackedLinears:
    def __init__(self, layers: list[nn.Linear], kind: str, head: nn.Module | None = None,
                 config: object = None) -> None:
        self.layers, self.kind = layers, kind  # kind: "all" or "head" (what the cost curve was measured with)
        self.head = head
        self.config = config  # the target's: its attention is swapped too (`_attention.py`)
        self._packed: list[tuple[tuple, object] | None] = [None] * len(layers)  # (weight key, forward)

    @classmethod
    def of(cls, target: nn.Module, which: str = "all", max_bytes: int = 1 << 30) -> PackedLinears | None:
        if which not in WHICH:
            raise ValueError(f"packed must be one of {', '.join(WHICH)}, got {which!r}")
        if which == "none" or not _ops_available():
            return None
        get = getattr(target, "get_output_embeddings", None)
        head = get() if get is not None else None
        layers = [m for m in target.modules() if _packable(m) and m.weight.numel() >= MIN_ELEMENTS] \
            if which == "all" else []
        if sum(m.weight.numel() * 4 for m in layers) > max_bytes:
            layers = []  # a big model on the CPU: a second copy of every weight is not worth what it saves
        config = getattr(target, "config", None)
        if layers:
            return cls(layers, "all", head, config)
        return cls([head], "head", head, config) if _packable(head) else None

    def refresh(self) -> None:
        """Repack the weights that changed since they were packed, once per call of the loop, not per round:
        checking all 57 layers of the default target every round cost too much of a round (measured:
        docs/design.md, "Decoder: measurements behind the code")."""
        for i, layer in enumerate(self.layers):
            w = layer.weight
            key = (w.data_ptr(), w._version, tuple(w.shape))
            if self._packed[i] is None or self._packed[i][0] != key:
                self._packed[i] = (key, _packed_forward(layer, every_row=layer is self.head))
                if layer not in _NUMBERS:
                    _NUMBERS[layer] = next(_COUNTER)
                _PACKED[_NUMBERS[layer]] = self._packed[i][1].packed
                _EVERY_ROW[_NUMBERS[layer]] = layer is self.head

    @contextlib.contextmanager
    def traced(self, rows: int = 2) -> Iterator[None]:
        """The packed weights for a compiled forward of `rows` rows (batch x length): each layer's forward calls
        `packed_linear`, an op the graph keeps as a call. The numbers are fixed per layer, so every compiled forward
        of the model traces the same graph; `refresh` (weights that changed) updates what they name. A graph of one
        row (a batch-1 one-token step) calls the op for the head only: every other layer's single row is a
        matrix-vector product with nothing to repack (MIN_ELEMENTS), which the graph does itself, where each call of
        the op went back into Python (~6 us over `F.linear`) and the graph could not fuse across it: 0.92x the step
        time of the default target (docs/design.md, "The speculative loop on a compiled target")."""
        with self._swapped(lambda i, layer: _traced_forward(layer, _NUMBERS[layer])
                           if rows > 1 or layer is self.head else None):
            yield

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The packed weights for the forwards inside (those of fp32 activations of shape [batch, len, in]), and
        the target's attention reading grouped K/V heads in place (`_attention.py`)."""
        with (self._swapped(lambda i, layer: self._packed[i][1]) as on,
              gqa_attention(self.config) if on else contextlib.nullcontext()):
            yield

    @contextlib.contextmanager
    def _swapped(self, forward_of: Callable[[int, nn.Linear], Callable | None]) -> Iterator[bool]:
        """Each layer's forward replaced by `forward_of(index, layer)` (None: not this one) for the forwards inside,
        packed first if never yet; yields False (nothing replaced) in a forward that needs gradients."""
        if torch.is_grad_enabled():
            yield False  # a forward that needs gradients: as it is
            return
        if self._packed[0] is None:
            self.refresh()
        swapped = []
        for i, layer in enumerate(self.layers):
            own = layer.__dict__
            if "forward" in own or layer._forward_hooks or layer._forward_pre_hooks:
                continue  # someone else's tap or hook (a probe on `logits`): as it is
            forward = forward_of(i, layer)
            if forward is None:  # (this layer as it is, in this forward)
                continue
            # the instance dict itself: nn.Module.__setattr__ is slower
            # (measured: docs/design.md, "Decoder: measurements behind the code")
            own["forward"] = forward
            swapped.append(own)
        try:
            yield True
        finally:
            for own in swapped:
                del own["forward"]


# --- inside a compiled forward (`_compiled.py`) ----------------------------------------------------------------
# Inductor calls `aten::mm` for a linear layer, which repacks the weight on every call of more than one row, as
# F.linear does: a compiled verify forward gained little over the eager loop's packed one. A packed weight is an
# opaque oneDNN tensor that Dynamo cannot trace, so the graph calls this op instead, with the layer's own weight
# (its shape, for the fake) and a number naming the packed copy, which the op looks up when it runs.
_PACKED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # number -> packed weight (while packed)
_EVERY_ROW: dict[int, bool] = {}  # number -> whether a single row takes the packed weight too (the head)
_NUMBERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> its number (a constant of the graph)
_COUNTER = itertools.count()


@torch.library.custom_op("probebus::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, number: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over the weight packed under `number` (a single row of a layer that is not the
    head: F.linear itself, see MIN_ELEMENTS)."""
    packed = _PACKED.get(number)
    if packed is not None and x.dim() == 3 and (_EVERY_ROW[number] or x.shape[0] * x.shape[1] > 1):
        return _pointwise_op()(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, number: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _traced_forward(layer: nn.Linear, number: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, layer.weight, layer.bias, number)
    return forward


def _pointwise_op() -> Callable[..., torch.Tensor]:
    """oneDNN's linear over a packed weight (looked up when a layer is packed: a test can watch it)."""
    return torch.ops.mkldnn._linear_pointwise


def _packed_forward(layer: nn.Linear, every_row: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's forward over its weight packed now: oneDNN for fp32 [batch, len, in], else F.linear. With
    `every_row` False a single row (a batch-1 one-token step) takes F.linear (see MIN_ELEMENTS)."""
    packed, weight, bias = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 8), layer.weight, layer.bias
    pointwise = _pointwise_op()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.dtype == torch.float32 and (every_row or x.shape[0] * x.shape[1] > 1):
            return pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)

    forward.packed = packed  # the compiled forwards' op reads it (`packed_linear`)
    return forward
