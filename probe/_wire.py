"""Wire format: captures and control messages as ZeroMQ frames, nothing pickled.

A capture is one frame, or two, or one entry of a bundle:

    frame 0  site | 0x00 | HEADER | run | tokens [| payload]
    frame 1  payload (only when frame 0 does not carry it)

On CPU every capture carries its payload in frame 0: a large one (64 KiB or more) is
staged whole in the ring (header and tokens written just before the rows) and sent
zero-copy as one frame. A CUDA capture of 64 KiB or more sends its payload as frame 1,
zero-copy from the pinned ring the device copied it into. Subscribers accept both.

site     the site name in UTF-8, first so that ZeroMQ's prefix filter selects by site.
HEADER   little-endian struct: magic b"PBUS", version u16, phase u8, dtype u8,
         step u64, layer i32 (-1 for global sites), hidden u32, n_tokens u32,
         len(run) u16, len(site) u16, seq u64 (this site's count of published
         captures before this one: a gap means this subscriber missed some),
         sent_ns u64 (wall clock, ns since the epoch, when the hook published it).
run      the session's run id, UTF-8.
tokens   int64 little-endian [3, n_tokens]: seq_id, position, token_id rows.
payload  the activations, C-contiguous [n_tokens, hidden] in `dtype`.

A bundle is one frame that carries several small captures (of one step, or of several
held steps):

    BUNDLE_TOPIC | (length u32 | entry) ...
    entry    frame 0 of one capture (it starts with its site name, never 0x00)
             | a group: 0x00 | GROUP | run | tokens | member ...
    GROUP    magic b"PBUS", version u16, phase u8, dtype u8, step u64, hidden u32,
             n_tokens u32, len(run) u16, count u16 (members), sent_ns u64
    member   len(site) u8 | site | seq u64 | payload [n_tokens, hidden] in `dtype`

A group carries the captures of one step that share its rows, dtype and width (a decode
step's residual streams): its header and token ids once, then each site's name,
sequence number and rows. Per capture that is 9 bytes plus the name instead of a 60-byte
header and the token ids again: less to pack on the model's thread and to decode at a
subscriber (see docs/design.md, "Costs behind the code", Sending).

The publisher bundles a step's small captures only while no subscriber filters by site
(every subscription is the empty prefix), so no subscriber receives data it did not
ask for; a subscriber unpacks a bundle into the same `Capture`s, in order. One message
per step instead of one per capture: each ZeroMQ message costs a send, a receive and,
when the I/O thread sleeps, a wake-up on another core.

Control messages are one frame, `topic + JSON`, on topics that start with 0x00 (no
site does): INFO_TOPIC carries the session's description (sent again whenever a
subscriber joins, so late joiners get it), END_TOPIC the end of stream with per-site
counts, REQUESTS_TOPIC (a vLLM session) the request-map entries of requests that started
since the last one: `{"requests": {"<seq_id>": {"seq_id", "request_id", "first_position"}},
"recomputed": n}`, TORN_TOPIC a capture already sent that may mix old and new values
(`{"site", "seq"}`). seq_ids are consecutive, so a subscriber that sees one skipped lost a
message and re-announces its presence, which brings the whole map again in an info.
Subscribers never subscribe to another subscriber's PRESENCE topic, so these are the only
control messages anyone receives; a control topic a subscriber does not know is ignored.

Why not one frame per part: each ZeroMQ frame costs a send and a receive call from
Python, which dominated small decode captures; below pyzmq's
copy threshold the payload is copied anyway, so appending it to frame 0 is free. For
large captures a separate header frame also cost the receiver: libzmq allocates each
received frame, and a small allocation between 3 MiB ones made glibc hand memory back
to the kernel and fault it in again (docs/design.md, "Costs behind the code").
This module is the format and the sending side's encoders; the receiving side's validation
and decoding is `_decode.py`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import NamedTuple

import torch

MAGIC = b"PBUS"
VERSION = 4  # 3: bundles of small captures; 4: groups in bundles
HEADER = struct.Struct("<4sHBBqiIIHHQQ")

PHASES = ("prefill", "decode", "verify")
PHASE_CODE = {p: i for i, p in enumerate(PHASES)}

# Codes are part of the wire format: append, never renumber. The one dtype table of
# the project: exporters and decoder read it from here.
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

CONTROL = b"\x00probebus/"  # every control topic starts here; no site name can
PRESENCE = CONTROL + b"subscriber/"  # + a subscriber's uuid: subscribed to, never published on
LIVE_PRESENCE = PRESENCE + b"live/"  # + uuid: a subscriber that needs every step at its end (no holding)
INFO_TOPIC = CONTROL + b"info "
END_TOPIC = CONTROL + b"end "
REQUESTS_TOPIC = CONTROL + b"requests "  # new entries of a vLLM session's request map (the info has all of it)
# {"run", "site", "seq"}: a capture sent from the model's own tensor (`_borrow.py`) that the model wrote into before
# ZeroMQ had sent it all: it may mix old and new values (`Subscriber.torn`). Sent once that is known.
TORN_TOPIC = CONTROL + b"torn "
BUNDLE_TOPIC = CONTROL + b"bundle "
BUNDLE_MAX = 1 << 16  # bytes per bundle (one capture may exceed it alone): ZeroMQ's queue stays ~SNDHWM x 64 KiB
LENGTH = struct.Struct("<I")
GROUP = struct.Struct("<x4sHBBqIIHHQ")  # a group entry's start, after its length: 0x00 | GROUP
# The member count is GROUP's last field but one (sent_ns, a Q, follows it): its offset from the entry's length.
_GROUP_COUNT_AT = LENGTH.size + GROUP.size - struct.calcsize("<HQ")
SEQ = struct.Struct("<Q")

# Fixed malformed-message categories (SubscriberStats.errors keys never embed message data).
ERROR_KINDS = ("frames", "truncated", "magic", "version", "phase", "dtype", "site", "length", "utf8", "control")


class WireError(ValueError):
    """A frame that is not a valid probebus message; `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Header(NamedTuple):  # a NamedTuple: built per message, far cheaper than a frozen dataclass
    run: str
    site: str
    phase: str
    dtype: torch.dtype
    step: int
    layer: int
    hidden: int
    n_tokens: int
    seq: int
    sent_ns: int


def encode_envelope(run: bytes, site: bytes, phase: int, dtype: int, step: int, layer: int, hidden: int,
                    tokens: bytes | memoryview, payload: bytes | memoryview = b"", *, seq: int = 0,
                    sent_ns: int = 0) -> bytes:
    """Frame 0. `tokens` is int64 [3, n]; pass `payload` only when it travels in this frame."""
    n = memoryview(tokens).nbytes // 24
    return b"".join((encode_head(run, site, phase, dtype, step, layer, hidden, n, seq, sent_ns), tokens, payload))


def _head_format(site_len: int, run_len: int) -> str:
    """The layout of frame 0 up to the tokens, site | 0x00 | HEADER | run, as struct codes (no byte order)."""
    return f"{site_len}sx{HEADER.format[1:]}{run_len}s"


def encode_head(run: bytes, site: bytes, phase: int, dtype: int, step: int, layer: int, hidden: int, n: int,
                seq: int, sent_ns: int) -> bytes:
    """The start of frame 0, up to the tokens: site | 0x00 | HEADER | run."""
    return struct.pack("<" + _head_format(len(site), len(run)), site, MAGIC, VERSION, phase, dtype, step, layer,
                       hidden, n, len(run), len(site), seq, sent_ns, run)


def entry_struct(site_len: int, run_len: int) -> struct.Struct:
    """The start of one bundle entry as one struct: length u32 | site | 0x00 | HEADER | run.

    Packs (length, site, *HEADER fields, run): `LENGTH` and `encode_head`'s layout in one call
    (a capture on the model's thread is a few microseconds; the join of four parts was a tenth of it)."""
    return struct.Struct("<I" + _head_format(site_len, run_len))


def head_struct(site_len: int, run_len: int) -> struct.Struct:
    """`encode_head`'s layout as a struct, for packing in place (`pack_into` a ring slot)."""
    return struct.Struct("<" + _head_format(site_len, run_len))


def encode_bundle(frames: list[bytes]) -> bytes:
    """One frame carrying several captures' frame 0 (each with its payload inline)."""
    parts = [BUNDLE_TOPIC]
    for f in frames:
        parts += (LENGTH.pack(len(f)), f)
    return b"".join(parts)


def group_struct(run_len: int) -> struct.Struct:
    """A group entry's start as one struct: length u32 | 0x00 | GROUP | run (count and length patched at its end)."""
    return struct.Struct(f"<I{GROUP.format[1:]}{run_len}s")


class PerSite(dict):
    """A struct per site, made by `make(topic)` on first use: `structs[topic].pack(...)`, one lookup."""

    def __init__(self, make: Callable[[bytes], struct.Struct]) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, topic: bytes) -> struct.Struct:
        made = self[topic] = self.make(topic)
        return made


def member_struct(site_len: int) -> struct.Struct:
    """A group member's start: len(site) u8 | site | seq u64 (its payload follows)."""
    return struct.Struct(f"<B{site_len}sQ")


def close_group(buf: bytearray, start: int, count: int) -> None:
    """Write the length and member count of the group entry that starts at `buf[start]`."""
    LENGTH.pack_into(buf, start, len(buf) - start - LENGTH.size)
    struct.pack_into("<H", buf, start + _GROUP_COUNT_AT, count)


def encode_group(run: bytes, phase: int, dtype: int, step: int, hidden: int, tokens: bytes,
                 members: list[tuple[bytes, int, bytes]], sent_ns: int = 0) -> bytes:
    """One group entry without its length prefix (what `split_bundle` yields): members are (site, seq, payload)."""
    n = len(tokens) // 24
    parts = [GROUP.pack(MAGIC, VERSION, phase, dtype, step, hidden, n, len(run), len(members), sent_ns), run, tokens]
    for site, seq, payload in members:
        parts += (member_struct(len(site)).pack(len(site), site, seq), payload)
    return b"".join(parts)


def encode_control(topic: bytes, body: dict) -> bytes:
    return topic + json.dumps(body, separators=(",", ":")).encode()


