"""Wire format of one capture: four ZeroMQ frames, nothing pickled.

    [topic, header, tokens, payload]

topic    the site name in UTF-8 (ZeroMQ prefix-filters on it).
header   fixed little-endian struct `HEADER` followed by the run id and the site:
         magic b"PBUS", version u16, phase u8, dtype u8, step u64, layer i32
         (-1 for global sites), hidden u32, n_tokens u32, len(run) u16, len(site) u16.
tokens   int64 little-endian [3, n_tokens]: seq_id, position, token_id rows.
payload  the activations, C-contiguous [n_tokens, hidden] in `dtype`.

Any receiver can validate a frame with `decode_header` and two length checks; see
`probe.Subscriber` for the reference reader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Header:
    run: str
    site: str
    phase: str
    dtype: torch.dtype
    step: int
    layer: int
    hidden: int
    n_tokens: int

    @property
    def payload_nbytes(self) -> int:
        return self.n_tokens * self.hidden * self.dtype.itemsize


def encode_header(run: bytes, site: bytes, phase: int, dtype: int, step: int, layer: int, hidden: int, n: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, phase, dtype, step, layer, hidden, n, len(run), len(site)) + run + site


def decode_header(buf: bytes | memoryview) -> Header:
    if len(buf) < HEADER.size:
        raise WireError(f"header truncated: {len(buf)} bytes, need at least {HEADER.size}")
    magic, version, phase, dtype, step, layer, hidden, n, lrun, lsite = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not a probebus capture")
    if version != VERSION:
        raise WireError(f"wire version {version} not supported (this probebus speaks {VERSION}); upgrade both ends")
    if phase >= len(PHASES):
        raise WireError(f"unknown phase code {phase}")
    if dtype not in DTYPES:
        raise WireError(f"unknown dtype code {dtype}")
    if len(buf) != HEADER.size + lrun + lsite:
        raise WireError(f"header length {len(buf)} does not match its string lengths ({lrun}+{lsite})")
    raw = bytes(buf[HEADER.size :])
    try:
        run, site = raw[:lrun].decode(), raw[lrun:].decode()
    except UnicodeDecodeError as exc:
        raise WireError(f"header strings are not UTF-8: {exc}") from None
    return Header(run, site, PHASES[phase], DTYPES[dtype], step, layer, hidden, n)
