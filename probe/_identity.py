"""Per-forward identity: which rows of a [batch, seq] activation are real tokens, and whose.

    tracker = IdentityTracker(stop_ids)
    ident = tracker.begin(input_ids, attention_mask, past, batch, seq_len, override)
    index, tokens, n = ident.rows(seq_len)     # shared by every site of the step

Computed once per top-level forward (in a pre-hook on the model) and shared by every
site of that step, so the hooks only index and copy. Positions come from the
attention mask and the KV-cache length, never from the row index, so left padding,
right padding and cached decoding all give each token its index in its own sequence.

Everything here is numpy on host arrays: a torch op on a tiny tensor costs several times
a numpy call in dispatch, and this runs on the model's thread every step (docs/design.md,
"Costs behind the code"). In decode the positions are carried forward from the previous
step instead of re-summing the whole mask.
"""

from __future__ import annotations

import ctypes
from array import array

import numpy as np
import torch

PREFILL, DECODE, VERIFY = 0, 1, 2
_byte, _int64, _string_at = ctypes.c_ubyte.from_address, ctypes.c_int64.from_address, ctypes.string_at
# The flag dtypes of a 2-D mask that `_sees_itself` reads, and their sizes in bytes
_FLAG_SIZES = {torch.int64: 8, torch.int32: 4, torch.bool: 1, torch.uint8: 1}
_FLAG_DTYPES = tuple(_FLAG_SIZES)


class StepIdentity:
    """Whose token each row of this step's activations is (shared by every site of the step)."""

    __slots__ = ("step", "phase", "batch", "seq_len", "valid", "seq_ids", "_positions", "_token_ids", "device",
                 "_rows", "_device_index", "_decode")

    def __init__(self, step: int, phase: int, batch: int, seq_len: int, valid: np.ndarray | None,
                 seq_ids: np.ndarray, positions: np.ndarray | None, token_ids: np.ndarray | None,
                 device: torch.device, rows: dict[int, tuple[np.ndarray | None, bytes, int]] | None = None,
                 decode: tuple[list[int], list[int], list[int]] | None = None) -> None:
        self.step, self.phase, self.batch, self.seq_len = step, phase, batch, seq_len
        self.valid = valid  # bool [B, S]; None: every token is real
        self.seq_ids = seq_ids  # int64 [B]
        self._positions = positions  # None: read from rows[1] (the decode fast path)
        self._token_ids = token_ids
        self.device = device
        self._rows = rows if rows is not None else {}
        self._device_index: dict[int, torch.Tensor] = {}
        # The decode fast path's (seq ids, positions, token ids) as lists, made into rows[1] when first read: a
        # step whose captures wait (`_pending.py`) builds them with its pack, whose caches are warm.
        self._decode = decode

    @property
    def settled(self) -> bool:
        """Its rows of one position are fixed already (held in this object, not read from the model's tensors
        later): captures of it may wait to be packed (`_pending.py`)."""
        return self._decode is not None or 1 in self._rows

    @property
    def positions(self) -> np.ndarray:
        """int64 [B, S], or [1, S] when every row has the same positions."""
        if self._positions is None:
            self._positions = self._decode_tokens()[1]
        return self._positions

    @property
    def token_ids(self) -> np.ndarray:
        """int64 [B, S] (-1 when the model was fed embeddings)."""
        if self._token_ids is None:
            self._token_ids = self._decode_tokens()[2]
        return self._token_ids

    def _decode_tokens(self) -> np.ndarray:
        """[3, B, 1] (seq ids, positions, token ids) of a fast-path decode step, from its row bytes."""
        return np.frombuffer(self.rows(1)[1], dtype=np.int64).reshape(3, self.batch, 1)

    def rows(self, seq_len: int) -> tuple[np.ndarray | None, bytes, int]:
        """(flat row index or None for "all rows", tokens int64 [3, n] as bytes, n).

        `seq_len` may be shorter than the step's (an LM head that only computes the
        last positions, e.g. `logits_to_keep=1` in `generate`): the last columns are used.
        """
        got = self._rows.get(seq_len)
        if got is None and seq_len == 1 and self._decode is not None:
            seq, pos, tok = self._decode
            got = self._rows[1] = (None, array("q", seq + pos + tok).tobytes(), self.batch)
        if got is None:
            cut = self.seq_len - seq_len
            if cut < 0:
                raise ValueError(f"activation has {seq_len} positions but the step has {self.seq_len}")
            valid = None if self.valid is None else self.valid[:, cut:]
            if valid is None or valid.all():
                n = self.batch * seq_len
                tokens = np.empty((3, self.batch, seq_len), dtype=np.int64)
                tokens[0] = self.seq_ids[:, None]
                tokens[1] = self.positions[:, cut:]
                tokens[2] = self.token_ids[:, cut:]
                index = None
            else:
                b, s = np.nonzero(valid)
                n = len(b)
                tokens = np.empty((3, n), dtype=np.int64)
                tokens[0] = self.seq_ids[b]
                tokens[1] = np.broadcast_to(self.positions, (self.batch, self.seq_len))[:, cut:][b, s]
                tokens[2] = self.token_ids[:, cut:][b, s]
                index = b * seq_len + s
            got = (index, tokens.tobytes(), n)
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


def host_array(t: torch.Tensor | np.ndarray | list | tuple, dtype: type) -> np.ndarray:
    """A host numpy array of `t` (a view when it already is one of the right dtype)."""
    if isinstance(t, torch.Tensor):
        if t.requires_grad:  # detach() alone costs a dispatch: only when needed
            t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        a = t.numpy()
    else:
        a = np.asarray(t)
    return a if a.dtype == dtype else a.astype(dtype)


def _sees_itself(mask: torch.Tensor, batch: int, past: int) -> bool:
    """Whether every row of a host mask ([B, keys] of 0/1 or [B, 1, 1, keys] of bool) lets its new token (key
    `past`) attend: each flag read at the tensor's own address, nonzero in any of its bytes. Slicing the mask in
    numpy cost the step more than the rest of its identity: each numpy call runs from cold caches between
    forwards (docs/design.md, "Costs behind the code", Decode-step identity). A plain loop, not `all()` over a
    generator: one frame fewer, from cold caches too."""
    stride = mask.stride()
    size = _FLAG_SIZES[mask.dtype]
    at = mask.data_ptr() + past * stride[-1] * size
    row = stride[0] * size
    if size == 1:
        for b in range(batch):
            if not _byte(at + b * row).value:
                return False
        return True
    zero = bytes(size)
    for b in range(batch):
        if _string_at(at + b * row, size) == zero:
            return False
    return True


def _shaped(a: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return a if a.shape == shape else np.broadcast_to(a, shape)


def cache_length(cache: object) -> int:
    if cache is None:
        return 0
    get = getattr(cache, "get_seq_length", None)
    if callable(get):
        n = get()
        return n if type(n) is int else _tensor_int(n)
    try:  # legacy tuple-of-tuples cache: [layer][k/v] of [B, heads, T, d]
        return int(cache[0][0].shape[-2])  # type: ignore[index]
    except (TypeError, IndexError, AttributeError):
        return 0


# The last 0-d length tensor read at its address: (tensor, its c_int64, the address), replaced whole (threads)
_length_at: tuple = (None, None, 0)


def _tensor_int(n: object) -> int:
    """`int(n)` of a cache's length. A static cache's is a 0-d int64 tensor updated in place each step
    (transformers' `StaticLayer.cumulative_length`): read at its address, which stays while its storage does,
    instead of through `item()`'s dispatch (docs/design.md, "Costs behind the code", Decode-step identity)."""
    global _length_at
    memo = _length_at
    if n is memo[0] and n.data_ptr() == memo[2]:  # type: ignore[attr-defined]
        return memo[1].value
    if isinstance(n, torch.Tensor) and n.dtype == torch.int64 and n.dim() == 0 and n.is_cpu:
        at = n.data_ptr()
        memo = _length_at = (n, _int64(at), at)
        return memo[1].value
    return int(n)  # type: ignore[call-overload]


class IdentityTracker:
    """Issues sequence ids and carries positions from one forward step to the next."""

    def __init__(self, stop_ids: np.ndarray) -> None:
        self.stop_ids = stop_ids  # generate keeps feeding finished rows their EOS / pad: not real tokens
        self.step = 0
        self.next_seq = 0
        self._seq_ids = np.empty(0, dtype=np.int64)
        self._finished = np.empty(0, dtype=bool)
        # Python mirrors for the decode fast path: inside a running model every numpy call runs cold
        # between layers and costs microseconds; list and set operations do not.
        self._seq_list: list[int] = []
        self._any_finished = False
        self._stop_set = set(stop_ids.tolist())
        self._count: np.ndarray | list[int] | None = None  # real tokens per row so far (mask-derived positions)
        self._expect_width = -1  # mask width at which the carried counts are valid
        self.warnings: list[str] = []

    def new_seq_ids(self, batch: int) -> np.ndarray:
        ids = np.arange(self.next_seq, self.next_seq + batch, dtype=np.int64)
        self.next_seq += batch
        return ids

    def begin(self, ids: torch.Tensor | None, mask: torch.Tensor | None, past: int, batch: int, seq_len: int,
              override: dict | None, device: torch.device) -> StepIdentity:
        if (override is None and seq_len == 1 and past > 0 and ids is not None and ids.is_cpu
                and (mask is None or mask.is_cpu)):
            fast = self._decode_step(ids, mask, past, batch, device)
            if fast is not None:
                return fast
        ov = override or {}
        positions, valid = self._positions(mask, batch, seq_len, past)
        if ov.get("positions") is not None:
            positions = _shaped(host_array(ov["positions"], np.int64), (batch, seq_len))
        if ov.get("valid") is not None:
            valid = _shaped(host_array(ov["valid"], np.bool_), (batch, seq_len))
        phase = PREFILL if past == 0 else DECODE
        if ov.get("phase") is not None:
            phase = ov["phase"]
        if ov.get("seq_ids") is not None:
            seq_ids = host_array(ov["seq_ids"], np.int64)
        elif phase == PREFILL or len(self._seq_ids) != batch:
            if phase != PREFILL:
                self.warnings.append(f"probebus: batch changed to {batch} rows mid-generation; new seq_ids issued")
            seq_ids = self.new_seq_ids(batch)
            self._finished = np.zeros(batch, dtype=bool)
            self._any_finished = False
        else:
            seq_ids = self._seq_ids
        if seq_ids is not self._seq_ids:
            self._seq_ids, self._seq_list = seq_ids, seq_ids.tolist()
        token_ids = host_array(ids, np.int64) if ids is not None else np.full((batch, seq_len), -1, dtype=np.int64)
        if phase == DECODE and len(self.stop_ids) and len(self._finished) == batch:
            first = token_ids[:, 0]
            self._finished |= (first[:, None] == self.stop_ids[None, :]).any(1)
            self._any_finished = bool(self._finished.any())
            if self._any_finished:
                keep = ~self._finished[:, None]
                valid = keep if valid is None else valid & keep
        self.step += 1
        if valid is not None and valid.all():
            valid = None
        return StepIdentity(self.step, phase, batch, seq_len, valid, seq_ids, positions, token_ids, device)

    def _decode_step(self, ids: torch.Tensor, mask: torch.Tensor | None, past: int, batch: int,
                     device: torch.device) -> StepIdentity | None:
        """The common decode step in plain Python (None: take the general path).

        One new token per row, every row real and none finished; positions are the cache
        length (no mask) or last step's counts carried (a mask one column wider than last
        step's). Inside a running generate it costs a fraction of the general path, or of the same
        logic in numpy, whose calls run cold between the model's layers (docs/design.md, "Costs
        behind the code", Decode-step identity).
        """
        seq = self._seq_list
        if len(seq) != batch or self._any_finished:
            return None
        if mask is not None:
            count = self._count
            if count is None or len(count) != batch or past != self._expect_width:
                return None
            shape = mask.shape
            if len(shape) == 4:  # a static cache's [B, 1, 1, keys]: the new token sees itself unless it is padding
                if shape[0] != batch or shape[1] != 1 or shape[2] != 1 or shape[3] <= past \
                        or mask.dtype != torch.bool or not _sees_itself(mask, batch, past):
                    return None
            elif (shape != (batch, past + 1) or mask.dtype not in _FLAG_DTYPES
                  or not _sees_itself(mask, batch, past)):
                return None
        tok = [row[0] for row in ids.tolist()]
        if self._stop_set and not self._stop_set.isdisjoint(tok):
            return None  # a row finishes here: the general path strips it (nothing changed yet)
        if mask is None:
            self._count = None
            pos = [past] * batch
        else:
            pos = count if isinstance(count, list) else count.tolist()
            self._count = [c + 1 for c in pos]
            self._expect_width = past + 1
        self.step += 1
        return StepIdentity(self.step, DECODE, batch, 1, None, self._seq_ids, None, None, device, None, (seq, pos, tok))

    def _positions(self, mask: torch.Tensor | None, batch: int, seq_len: int,
                   past: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Positions [B, S] (0-based, padding excluded) and validity [B, S] (None: all valid)."""
        if mask is not None and mask.dim() == 2 and mask.shape[0] == batch:
            width = mask.shape[1]
            if width == past + seq_len:  # the full mask, as generate passes it
                new = host_array(mask[:, past:], np.int64)
                if self._count is not None and past > 0 and width - seq_len == self._expect_width \
                        and len(self._count) == batch:
                    start = np.asarray(self._count)  # carried from the previous step: no re-sum of the history
                else:
                    start = host_array(mask[:, :past], np.int64).sum(1)
                return self._advance(start, new, width)
            if width == seq_len:  # a mask of the new tokens only
                new = host_array(mask, np.int64)
                return self._advance(np.full(batch, past, dtype=np.int64), new, -1)
        if (mask is not None and mask.dim() == 4 and mask.shape[0] == batch and mask.shape[2] == seq_len
                and mask.shape[3] >= past + seq_len):
            return self._positions_4d(mask, batch, seq_len, past)
        self._count = None
        return np.arange(past, past + seq_len, dtype=np.int64)[None, :], None

    def _positions_4d(self, mask: torch.Tensor, batch: int, seq_len: int,
                      past: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The same from a 4-D mask [B, 1, S, keys] (generate passes one with a static cache): a token is real
        where it may attend to itself (padding sees nothing); the real tokens before this step are what the
        step's first token may attend to among the cached keys, unless carried from the previous step."""
        allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        diag = torch.arange(seq_len)
        new = host_array(allowed[:, diag, past + diag], np.int64)
        if self._count is not None and past > 0 and past == self._expect_width and len(self._count) == batch:
            start = np.asarray(self._count)
        else:
            start = host_array(allowed[:, 0, :past], np.int64).sum(1)
        return self._advance(start, new, past + seq_len)

    def _advance(self, start: np.ndarray, new: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray | None]:
        if new.shape[1] == 1:  # decode: one token per row
            col = new[:, 0]
            positions = (start + col - 1)[:, None]
            self._count = start + col
            valid = None if col.all() else col.astype(bool)[:, None]
        else:
            cum = new.cumsum(1)
            positions = start[:, None] + cum - 1
            self._count = start + cum[:, -1]
            valid = None if new.all() else new.astype(bool)
        self._expect_width = width
        return positions, valid


def stop_tokens(model: torch.nn.Module) -> np.ndarray:
    """Token ids that `generate` keeps feeding a finished row (EOS, pad): those rows are not published."""
    cfg = getattr(model, "generation_config", None)
    ids: list[int] = []
    for name in ("eos_token_id", "pad_token_id"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, (list, tuple)):
            ids.extend(int(x) for x in v)
    return np.array(sorted(set(ids)), dtype=np.int64)
