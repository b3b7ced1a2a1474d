"""Run the drafter in another process: features reach it over the probe bus, drafts come back
over a REQ/REP socket.

    python -m decoder --bind tcp://127.0.0.1:5600 --model default --drafter default   # process A
    spec = SpeculativeDecoder(model, RemoteEagle("tcp://127.0.0.1:5600"), k=5)              # process B

Messages are a JSON header frame plus raw little-endian array frames (dtype and shape in
the header); nothing is pickled. The server holds an `EagleFeeder` subscribed to the
loop's probe session, so the only per-round traffic on this socket is small: row
bounds and token ids in, k draft ids (and q when sampling) out.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import torch
import zmq


def _pack(header: dict, arrays: list[torch.Tensor]) -> list[bytes]:
    header = dict(header, arrays=[{"dtype": str(a.dtype).removeprefix("torch."), "shape": list(a.shape)}
                                  for a in arrays])
    return [json.dumps(header).encode()] + [a.contiguous().numpy().tobytes() for a in arrays]


def _unpack(frames: list[bytes]) -> tuple[dict, list[torch.Tensor]]:
    header = json.loads(frames[0])
    specs = header.pop("arrays", [])
    if len(specs) != len(frames) - 1:
        raise ValueError(f"message announces {len(specs)} arrays but carries {len(frames) - 1}")
    out = []
    for spec, buf in zip(specs, frames[1:], strict=True):
        if spec["dtype"] not in ("int64", "float32", "bool"):
            raise ValueError(f"unsupported array dtype {spec['dtype']!r}")
        arr = np.frombuffer(buf, dtype=spec["dtype"]).reshape(spec["shape"]).copy()
        out.append(torch.from_numpy(arr))
    return header, out


class RemoteEagle:
    """A proxy with EagleFeeder's interface, talking to `serve_drafter` in another process."""

    def __init__(self, address: str, timeout: float = 60.0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        hello, _ = self._call({"op": "hello"})
        self.config = SimpleNamespace(**hello["config"])

    def _call(self, header: dict, arrays: list[torch.Tensor] | None = None) -> tuple[dict, list[torch.Tensor]]:
        self.sock.send_multipart(_pack(header, arrays or []))
        try:
            reply, out = _unpack(self.sock.recv_multipart())
        except zmq.Again:
            raise TimeoutError(f"the drafter server did not answer {header['op']!r}") from None
        if "error" in reply:
            raise RuntimeError(f"drafter server: {reply['error']}")
        return reply, out

    def connect(self, endpoint: str) -> None:
        self._call({"op": "subscribe", "endpoint": endpoint})

    def prepare(self, batch: int, max_len: int) -> None:
        self._call({"op": "prepare", "batch": batch, "max_len": max_len})

    def feed(self, step: int, start: torch.Tensor, end: torch.Tensor, toks: torch.Tensor) -> tuple[int, float]:
        reply, _ = self._call({"op": "feed", "step": step}, [start, end, toks])
        return reply["seq_base"], reply["bus_s"]

    def draft(self, k: int, temperature: float, seed: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, out = self._call({"op": "draft", "k": k, "temperature": temperature, "seed": seed})
        return out[0], (out[1] if len(out) > 1 else None)

    def close(self) -> None:
        self._call({"op": "unsubscribe"})

    def shutdown(self) -> None:
        self._call({"op": "exit"})
        self.sock.close()


def serve_drafter(bind: str, model: str, drafter: str) -> None:
    """Serve one loop at a time until told to exit."""
    from probebus._load import load_model, resolve_drafter

    from ._checkpoint import load_drafter
    from ._feeder import EagleFeeder

    target, _ = load_model(model, need_tokenizer=False)
    d = load_drafter(resolve_drafter(drafter), target)
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(bind)
    feeder: EagleFeeder | None = None
    while True:
        try:
            header, arrays = _unpack(sock.recv_multipart())
            op, out, reply = header.get("op"), [], {}
            if op in ("prepare", "feed", "draft") and feeder is None:
                raise RuntimeError(f"{op!r} before 'subscribe': no loop is connected to this drafter")
            if op == "hello":
                reply = {"config": {"aux_layer_ids": d.config.aux_layer_ids}}
            elif op == "subscribe":
                feeder = EagleFeeder(d, header["endpoint"])
            elif op == "prepare":
                feeder.prepare(header["batch"], header["max_len"])
            elif op == "feed":
                seq_base, bus_s = feeder.feed(header["step"], *arrays)
                reply = {"seq_base": seq_base, "bus_s": bus_s}
            elif op == "draft":
                drafts, q = feeder.draft(header["k"], header["temperature"], header["seed"])
                out = [drafts] + ([q] if q is not None else [])
            elif op == "unsubscribe":
                if feeder is not None:
                    feeder.close()
                feeder = None
            elif op == "exit":
                sock.send_multipart(_pack({}, []))
                break
            else:
                raise ValueError(f"unknown op {op!r}")
            sock.send_multipart(_pack(reply, out))
        except Exception as exc:  # answer with the error; the server stays up
            sock.send_multipart(_pack({"error": f"{type(exc).__name__}: {exc}"}, []))
    sock.close()
