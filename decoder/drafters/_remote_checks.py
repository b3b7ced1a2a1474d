"""What `serve_drafter` accepts from a client: every field of a request checked before it is acted on.

    check_request("prepare", {"batch": 8, "max_len": 4096}, [], limits)   # Refused / ValueError when it is not fine
    trusted_peer(frame)                                                  # the message came from this machine

A client of the drafter server could make it allocate whatever a `prepare` asked for
(gigabytes from one request; measured: docs/design.md, 'Decoder: measurements behind the
code'), send a 1 GiB frame, stop it, or point its subscriber at any endpoint. Types, ranges
and the memory a `prepare` implies are checked here, so that a bad request gets an error reply
and the server goes on serving.
"""

from __future__ import annotations

import ipaddress
import math

import torch
import zmq

MAX_MESSAGE_BYTES = 64 << 20  # a draft request carries [batch, length] token ids: 64 MiB is 8M of them
MAX_PREPARE_BYTES = 1 << 30  # the features and draft cache a `prepare` may allocate (serve-drafter --max-prepare-mb)
OPS = ("hello", "subscribe", "prepare", "draft", "unsubscribe", "exit")


class Refused(ValueError):
    """A well-formed request this server does not take (too large, or not from a trusted peer)."""


def _int(header: dict, name: str, lo: int, hi: int) -> int:
    v = header.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise ValueError(f"{name!r} must be a whole number in [{lo}, {hi}], got {str(v)[:40]}")
    return v


def check_request(op: object, header: dict, arrays: list[torch.Tensor], limits: dict) -> None:
    """ValueError (Refused for a request that is valid but not taken) unless `op` and its fields are ones the server
    can act on safely; `limits`: max_len, prepare_bytes and row_bytes (the bytes a position costs the drafter)."""
    if op not in OPS:
        raise ValueError(f"unknown op {str(op)[:40]!r}; expected one of {', '.join(OPS)}")
    if op == "subscribe":
        endpoint = header.get("endpoint")
        if not isinstance(endpoint, str) or len(endpoint) > 1024 or not endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError("'endpoint' must be an ipc:// or tcp:// address")
    elif op == "prepare":
        batch = _int(header, "batch", 1, 1 << 16)
        max_len = _int(header, "max_len", 1, 1 << 22)
        need = batch * max_len * limits["row_bytes"] * 2  # the feature buffer, and about as much of draft cache
        if need > limits["prepare_bytes"]:
            raise Refused(f"a prepare of batch {batch} x {max_len} positions needs ~{need / 2**20:,.0f} MiB, over "
                          f"this server's {limits['prepare_bytes'] / 2**20:,.0f} MiB (serve-drafter --max-prepare-mb)")
    elif op == "draft":
        _int(header, "k", 0, 256)  # 0: the scheduler may ask for no draft this round
        t = header.get("temperature")
        if type(t) not in (int, float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"'temperature' must be a finite number >= 0, got {str(t)[:40]}")
        seed = header.get("seed")
        if seed is not None and (type(seed) is not int or not -(1 << 63) <= seed < 1 << 64):
            raise ValueError("'seed' must be null or a whole number")
        if header.get("plan") is not None and not isinstance(header["plan"], dict):
            raise ValueError("'plan' must be null or an object")
        if len(arrays) != 4 or any(a.dtype != torch.int64 for a in arrays):
            raise ValueError("a draft carries 4 int64 arrays: steps, starts, ends, tokens")
        steps, starts, ends, toks = arrays
        if steps.dim() != 1 or starts.dim() != 2 or starts.shape != ends.shape or toks.dim() != 2 or \
                starts.shape[0] != steps.shape[0] or (steps.numel() and starts.shape[1] != toks.shape[0]):
            raise ValueError("draft arrays of inconsistent shapes")


def trusted_peer(frame: zmq.Frame, bind: str) -> bool:
    """The message came from this machine: the server binds ipc (file permissions decide who connects; the peer
    "address" ZeroMQ gives there is no IP) or the peer's TCP address is loopback."""
    if not bind.startswith("tcp://"):
        return True
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):  # ipc and inproc peers have no address
        return True
    if not address:
        return True
    try:
        ip = ipaddress.ip_address(str(address).strip("[]").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return (mapped or ip).is_loopback
