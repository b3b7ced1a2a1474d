"""Frames in: every capture, bundle and control message validated before anything is built from it.

    header, tokens, payload = decode_envelope(frame0, frame1_or_None)   # WireError on anything inconsistent
    fields = decode_fields(frame0, None)       # the same checks, fewer of them for a start seen before
    for entry in split_bundle(bundle): ...     # a bundle's captures and groups (`decode_group`)
    body = decode_control(frame, INFO_TOPIC)   # a control message's JSON object

The format is `_wire.py` (with the encoders); this is the receiving side a subscriber runs
on every message from a peer it need not trust: lengths are checked before slicing, names
against the site grammar, and the caches of names seen are bounded. `decode_envelope`
validates every length before anything is built; `decode_fields` makes the same checks,
fewer of them again for a frame start it has already validated.
"""

from __future__ import annotations

import json
import re
import struct

import torch

from ._wire import (
    BUNDLE_TOPIC,
    DTYPE_CODE,
    DTYPES,
    GROUP,
    HEADER,
    LENGTH,
    MAGIC,
    PHASES,
    SEQ,
    VERSION,
    Header,
    WireError,
    encode_envelope,
)

_MAGIC_VERSION = struct.Struct("<4sH")  # a message's first two HEADER (or GROUP) fields, read before the rest
# A concrete site name as it may appear on the wire (the grammar of probe._sites, concrete form).
_SITE_RE = re.compile(r"(?:embed|final_norm|logits|layers\.(\d{1,6})\.[a-z_]{1,32})")


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
    step at batch 1), and the full checks were most of a decode's cost (docs/design.md, "Costs behind
    the code", Sending).
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
