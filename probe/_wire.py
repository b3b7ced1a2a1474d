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
header and the token ids again. Warm, at batch 1 with 8 sites, packing a step took the
model's thread 13-15 us instead of 17, and a subscriber decoded a capture in 2.2-3.4 us
instead of 3.7-4.6 (README, wire format).

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

Why not one frame per part: each ZeroMQ frame costs a send and a receive call
(~2-3 us each from Python), which dominated small decode captures; below pyzmq's
copy threshold the payload is copied anyway, so appending it to frame 0 is free. For
large captures a separate header frame also cost the receiver: libzmq allocates each
received frame, and a small allocation between 3 MiB ones made glibc hand memory back
to the kernel and fault it in again (83-103 page faults per message at a raw pyzmq
receiver, 19-30 for single frames).
`decode_envelope` validates every length before anything is built; `decode_fields` makes the same
checks, fewer of them again for a frame start it has already validated.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from typing import NamedTuple

import torch

MAGIC = b"PBUS"
VERSION = 4  # 3: bundles of small captures; 4: groups in bundles
HEADER = struct.Struct("<4sHBBqiIIHHQQ")
_MAGIC_VERSION = struct.Struct("<4sH")

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

# A concrete site name as it may appear on the wire (the grammar of probe._sites, concrete form).
_SITE_RE = re.compile(r"(?:embed|final_norm|logits|layers\.(\d{1,6})\.[a-z_]{1,32})")

# Fixed malformed-message categories (SubscriberStats.errors keys never embed message data).
ERROR_KINDS = ("frames", "truncated", "magic", "version", "phase", "dtype", "site", "length", "utf8", "control")


class WireError(ValueError):
    """A frame that is not a valid probebus message; `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Header(NamedTuple):  # a NamedTuple: built per message, 5x cheaper than a frozen dataclass
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


def split_bundle(buf: memoryview) -> list[memoryview]:
    """The captures' frames inside a bundle (views); WireError when its framing is broken."""
    at, size, out = len(BUNDLE_TOPIC), len(buf), []
    while at < size:
        if at + 4 > size:
            raise WireError("truncated", "bundle ends inside an entry's length")
        (n,) = LENGTH.unpack_from(buf, at)
        at += 4
        if n == 0 or at + n > size:
            raise WireError("length", f"bundle entry of {n} bytes at {at} does not fit its {size}-byte frame")
        out.append(buf[at : at + n])
        at += n
    if not out:
        raise WireError("length", "empty bundle")
    return out


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


_sites_seen: dict[bytes, tuple[str, int]] = {}  # validated site names -> (name, layer); bounded
_runs_seen: dict[bytes, str] = {}


def site_layer_of(site: bytes) -> tuple[str, int]:
    """(name, layer) of a valid concrete site name (layer -1 for global sites); WireError otherwise."""
    got = _sites_seen.get(site)
    if got is None:
        try:
            name = site.decode("ascii")
        except UnicodeDecodeError:
            raise WireError("site", "site name is not ASCII") from None
        m = _SITE_RE.fullmatch(name)
        if m is None:
            raise WireError("site", f"{name[:40]!r} is not a site name (embed, layers.N.NAME, final_norm, logits)")
        got = (name, int(m[1]) if m[1] is not None else -1)
        if len(_sites_seen) < 4096:  # hostile peers must not grow this without bound
            _sites_seen[site] = got
    return got


def decode_envelope(buf: memoryview, payload_frame: memoryview | None) -> tuple[Header, memoryview, memoryview]:
    """(header, tokens, payload) of one capture; raises WireError on anything inconsistent."""
    size = len(buf)
    cut = bytes(buf[:64]).find(b"\x00")
    start = cut + 1
    if cut <= 0 or size < start + HEADER.size:
        if cut > 0 and size >= start + _MAGIC_VERSION.size:
            _check_magic_version(buf, start)
        raise WireError("truncated", f"envelope truncated or without a site terminator ({size} bytes)")
    magic, version, phase, dtype, step, layer, hidden, n, lrun, lsite, seq, sent_ns = HEADER.unpack_from(buf, start)
    if magic != MAGIC or version != VERSION:
        _check_magic_version(buf, start)
    if phase >= 3:
        raise WireError("phase", f"unknown phase code {phase}")
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None:
        raise WireError("dtype", f"unknown dtype code {dtype}")
    if lsite != cut:
        raise WireError("site", f"site length {lsite} does not match the topic ({cut} bytes)")
    site, site_layer = site_layer_of(bytes(buf[:cut]))
    if site_layer != layer:
        raise WireError("site", f"layer {layer} does not match the site name")
    if n == 0 or hidden == 0:
        raise WireError("length", "empty capture")
    run_at = start + HEADER.size
    tok_at = run_at + lrun
    pay_at = tok_at + 24 * n
    if pay_at > size:
        raise WireError("length", f"envelope of {size} bytes cannot hold {n} tokens and a {lrun}-byte run id")
    nbytes = n * hidden * itemsize
    if payload_frame is None:
        if size - pay_at != nbytes:
            raise WireError("length", f"payload has {size - pay_at} bytes, expected {nbytes} ({n} x {hidden})")
        payload = buf[pay_at:]
    else:
        if size != pay_at:
            raise WireError("length", f"envelope has {size - pay_at} bytes after its {n} tokens, expected 0")
        if len(payload_frame) != nbytes:
            raise WireError("length", f"payload has {len(payload_frame)} bytes, expected {nbytes} ({n} x {hidden})")
        payload = payload_frame
    run = _run_name(bytes(buf[run_at:tok_at]))
    header = Header(run, site, PHASES[phase], DTYPES[dtype], step, layer, hidden, n, seq, sent_ns)
    return header, buf[tok_at:pay_at], payload


def _run_name(run_b: bytes) -> str:
    run = _runs_seen.get(run_b)
    if run is None:
        try:
            run = run_b.decode("utf-8")
        except UnicodeDecodeError:
            raise WireError("utf8", "run id is not UTF-8") from None
        if len(_runs_seen) < 4096:  # hostile peers must not grow this without bound
            _runs_seen[run_b] = run
    return run


_ITEMSIZE = {c: d.itemsize for c, d in DTYPES.items()}
_known: dict[bytes, tuple[str, int, str, torch.dtype, int]] = {}  # validated starts; bounded like _sites_seen
_HEAD_AT = struct.Struct("<4sHBB").size  # the bytes of HEADER a start's key covers: magic, version, phase, dtype


def decode_fields(buf: memoryview, payload_frame: memoryview | None) -> tuple:
    """`Capture`'s fields (site, layer, phase, step, run, dtype, hidden, n, tokens, payload, seq, sent_ns).

    What `decode_envelope` checks, in fewer steps for a frame whose start (site | 0x00 | magic, version,
    phase, dtype) and run id it has validated before: a subscriber decodes every capture (~8 per decode
    step at batch 1), and the full checks took 3 of the 4 us a capture's decode cost (now 2.6 us).
    Anything new or inconsistent goes through `decode_envelope`, which raises the WireError."""
    peek = bytes(buf[:128])  # site, header and (usually) run id in one small copy
    cut = peek.find(b"\x00", 0, 64)
    start = cut + 1
    size = len(buf)
    if cut > 0 and size >= start + HEADER.size:  # then peek holds the whole header too (cut < 64)
        known = _known.get(peek[: start + _HEAD_AT])
        if known is not None:
            _, _, _, _, step, layer, hidden, n, lrun, lsite, seq, sent_ns = HEADER.unpack_from(peek, start)
            site, site_layer, phase, dtype, itemsize = known
            tok_at = start + HEADER.size + lrun
            pay_at = tok_at + 24 * n
            nbytes = n * hidden * itemsize
            run = _runs_seen.get(peek[tok_at - lrun : tok_at]) if tok_at <= len(peek) else None
            if (run is not None and layer == site_layer and lsite == cut and n and hidden and pay_at <= size
                    and (size - pay_at == nbytes if payload_frame is None
                         else size == pay_at and len(payload_frame) == nbytes)):
                payload = buf[pay_at:] if payload_frame is None else payload_frame
                return site, layer, phase, step, run, dtype, hidden, n, buf[tok_at:pay_at], payload, seq, sent_ns
    h, tokens, payload = decode_envelope(buf, payload_frame)
    if len(_known) < 4096:  # decode_envelope raised unless the start was found (cut > 0)
        _known[bytes(buf[: start + _HEAD_AT])] = (h.site, h.layer, h.phase, h.dtype, _ITEMSIZE[DTYPE_CODE[h.dtype]])
    return h.site, h.layer, h.phase, h.step, h.run, h.dtype, h.hidden, h.n_tokens, tokens, payload, h.seq, h.sent_ns


def decode_group(body: memoryview) -> list[tuple]:
    """`Capture` fields (as `decode_fields`) of each member of a group entry; WireError when anything is off."""
    size = len(body)
    if size < GROUP.size:
        if size >= 1 + _MAGIC_VERSION.size:
            _check_magic_version(body, 1)
        raise WireError("truncated", f"group of {size} bytes ends inside its header")
    magic, version, phase, dtype, step, hidden, n, lrun, count, sent_ns = GROUP.unpack_from(body)
    if magic != MAGIC or version != VERSION:
        _check_magic_version(body, 1)
    if phase >= 3:
        raise WireError("phase", f"unknown phase code {phase}")
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None:
        raise WireError("dtype", f"unknown dtype code {dtype}")
    if n == 0 or hidden == 0 or count == 0:
        raise WireError("length", "empty group")
    tok_at = GROUP.size + lrun
    at = tok_at + 24 * n
    nbytes = n * hidden * itemsize
    if at + count * (10 + nbytes) > size:  # every member has a name (1 byte at least), a seq and its rows
        raise WireError("length", f"group of {size} bytes cannot hold {count} x {n} x {hidden} values")
    run = _run_name(bytes(body[GROUP.size : tok_at]))
    tokens, phase_name, dt = body[tok_at:at], PHASES[phase], DTYPES[dtype]
    out = []
    for _ in range(count):
        if at >= size:
            raise WireError("truncated", f"group ends after {len(out)} of its {count} members")
        slen = body[at]
        pay_at = at + 9 + slen
        end = pay_at + nbytes
        if end > size:
            raise WireError("length", f"group member at {at} does not fit its {size}-byte group")
        site, layer = site_layer_of(bytes(body[at + 1 : at + 1 + slen]))
        seq = SEQ.unpack_from(body, pay_at - 8)[0]
        out.append((site, layer, phase_name, step, run, dt, hidden, n, tokens, body[pay_at:end], seq, sent_ns))
        at = end
    if at != size:
        raise WireError("length", f"group has {size - at} bytes after its {count} members")
    return out


def capture_frames(bundle: memoryview) -> list[bytes | memoryview]:
    """Each capture of a bundle as the frame 0 it would have alone (groups expanded), in order."""
    out: list[bytes | memoryview] = []
    for entry in split_bundle(bundle):
        if entry[0] != 0:
            out.append(entry)
            continue
        _, _, phase, dtype, step, hidden, _, lrun, _, sent_ns = GROUP.unpack_from(entry)
        run = bytes(entry[GROUP.size : GROUP.size + lrun])
        for site, layer, _, _, _, _, _, _, tokens, payload, seq, _ in decode_group(entry):
            out.append(encode_envelope(run, site.encode(), phase, dtype, step, layer, hidden, tokens, payload,
                                       seq=seq, sent_ns=sent_ns))
    return out


def _check_magic_version(buf: memoryview, at: int) -> None:
    magic, version = _MAGIC_VERSION.unpack_from(buf, at)
    if magic != MAGIC:
        raise WireError("magic", f"bad magic {bytes(magic)!r}: not a probebus capture")
    if version != VERSION:
        raise WireError("version", f"the publisher speaks probebus wire version {version}, this probebus speaks "
                        f"{VERSION}; install the same probebus version on both ends")


def encode_control(topic: bytes, body: dict) -> bytes:
    return topic + json.dumps(body, separators=(",", ":")).encode()


def decode_control(frame: bytes | memoryview, topic: bytes) -> dict:
    """The JSON body of a control message (WireError when it is not an object)."""
    try:
        body = json.loads(bytes(frame[len(topic):]))
    except (ValueError, UnicodeDecodeError):
        raise WireError("control", "control message is not JSON") from None
    except RecursionError:  # deep nesting: no control message of ours nests more than a few levels
        raise WireError("control", "control message nests too deeply") from None
    if not isinstance(body, dict):
        raise WireError("control", "control message is not a JSON object")
    return body
