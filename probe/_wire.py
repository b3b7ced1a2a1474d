"""Wire format of one capture: one or two ZeroMQ frames, nothing pickled.

    frame 0  site | 0x00 | HEADER | run | tokens [| payload, when small]
    frame 1  payload (only when it is 64 KiB or more; sent zero-copy)

site     the site name in UTF-8, first so that ZeroMQ's prefix filter selects by site.
HEADER   little-endian struct: magic b"PBUS", version u16, phase u8, dtype u8,
         step u64, layer i32 (-1 for global sites), hidden u32, n_tokens u32,
         len(run) u16, len(site) u16.
run      the session's run id, UTF-8.
tokens   int64 little-endian [3, n_tokens]: seq_id, position, token_id rows.
payload  the activations, C-contiguous [n_tokens, hidden] in `dtype`.

Why not one frame per part: each ZeroMQ frame costs a send and a receive call
(~2-3 us each from Python), which dominated small decode captures; below pyzmq's
copy threshold the payload is copied anyway, so appending it to frame 0 is free.
`decode_envelope` validates every length before anything is built.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import torch

MAGIC = b"PBUS"
VERSION = 1
HEADER = struct.Struct("<4sHBBqiIIHH")

PHASES = ("prefill", "decode", "verify")
PHASE_CODE = {p: i for i, p in enumerate(PHASES)}

# Codes are part of the wire format: append, never renumber.
DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float64,
    5: torch.int64,
    6: torch.int32,
    7: torch.uint8,
}
DTYPE_CODE = {d: c for c, d in DTYPES.items()}
DTYPE_NAME = {c: str(d).removeprefix("torch.") for c, d in DTYPES.items()}


class WireError(ValueError):
    """A frame that is not a valid probebus capture."""


class Header(NamedTuple):  # a NamedTuple: built per message, 5x cheaper than a frozen dataclass
    run: str
    site: str
    phase: str
    dtype: torch.dtype
    step: int
    layer: int
    hidden: int
    n_tokens: int


def encode_envelope(run: bytes, site: bytes, phase: int, dtype: int, step: int, layer: int, hidden: int,
                    tokens: bytes | memoryview, payload: bytes | memoryview = b"") -> bytes:
    """Frame 0. `tokens` is int64 [3, n]; pass `payload` only when it travels in this frame."""
    tokens = memoryview(tokens).cast("B")
    n = len(tokens) // 24
    head = HEADER.pack(MAGIC, VERSION, phase, dtype, step, layer, hidden, n, len(run), len(site))
    return b"".join((site, b"\x00", head, run, tokens, payload))


def decode_envelope(buf: memoryview, payload_frame: memoryview | None) -> tuple[Header, memoryview, memoryview]:
    """(header, tokens, payload) of one message; raises WireError on anything inconsistent."""
    size = len(buf)
    cut = bytes(buf[:256]).find(b"\x00")
    if cut < 0 or size < cut + 1 + HEADER.size:
        raise WireError(f"envelope truncated or without a site terminator ({size} bytes)")
    start = cut + 1
    magic, version, phase, dtype, step, layer, hidden, n, lrun, lsite = HEADER.unpack_from(buf, start)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not a probebus capture")
    if version != VERSION:
        raise WireError(f"wire version {version} not supported (this probebus speaks {VERSION}); upgrade both ends")
    if phase >= len(PHASES):
        raise WireError(f"unknown phase code {phase}")
    if dtype not in DTYPES:
        raise WireError(f"unknown dtype code {dtype}")
    if lsite != cut:
        raise WireError(f"site length {lsite} does not match the topic ({cut} bytes)")
    if n == 0 or hidden == 0:
        raise WireError("empty capture")
    tok_at = start + HEADER.size + lrun
    pay_at = tok_at + 24 * n
    nbytes = n * hidden * DTYPES[dtype].itemsize
    inline = size - pay_at
    if payload_frame is None:
        if inline != nbytes:
            raise WireError(f"payload has {max(inline, 0)} bytes, expected {nbytes} ({n} x {hidden} {DTYPES[dtype]})")
        payload = buf[pay_at:]
    else:
        if inline != 0:
            raise WireError(f"envelope has {inline} bytes after its {n} tokens, expected 0")
        if len(payload_frame) != nbytes:
            raise WireError(f"payload has {len(payload_frame)} bytes, expected {nbytes} ({n} x {hidden} "
                            f"{DTYPES[dtype]})")
        payload = payload_frame
    try:
        site = str(buf[:cut], "utf-8")
        run = str(buf[start + HEADER.size : tok_at], "utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"header strings are not UTF-8: {exc}") from None
    header = Header(run, site, PHASES[phase], DTYPES[dtype], step, layer, hidden, n)
    return header, buf[tok_at:pay_at], payload
