"""Run the drafter in another process: features reach it over the probe bus, drafts come back
over a REQ/REP socket.

    probebus serve-drafter --bind tcp://127.0.0.1:5600 --model default --drafter default   # process A
    spec = SpeculativeDecoder(model, RemoteEagle("tcp://127.0.0.1:5600"), k=5)                   # process B

    serve_drafter("tcp://127.0.0.1:5600", drafter)   # what serve-drafter runs, given a loaded, bound drafter

Messages are a JSON header frame plus raw little-endian array frames (dtype and shape in
the header); nothing is pickled. The server holds an `EagleFeeder` subscribed to the
loop's probe session, so the only per-round traffic on this socket is small: row
bounds and token ids in, draft ids and confidences (and q when sampling) out. Both
sides implement the same `Feeder` protocol, and the stopping rule travels as a
`DraftPlan` in the JSON header, so the remote drafter stops where a local one would.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import torch
import zmq

from ._eagle import Eagle3Drafter
from ._feeder import Drafts, EagleFeeder, Feed
from ._sched import DraftPlan


def _pack(header: dict, arrays: list[torch.Tensor]) -> list[bytes]:
    arrays = [a.detach().cpu() if a.dtype in (torch.int64, torch.bool) else a.detach().float().cpu() for a in arrays]
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
    """The `Feeder` protocol, talking to `serve_drafter` in another process."""

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

    def draft(self, feeds: list[Feed], toks: torch.Tensor, k: int, temperature: float, seed: int | None,
              plan: DraftPlan | None = None) -> Drafts:
        t0 = time.perf_counter()
        b = toks.shape[0]
        steps = torch.tensor([f[0] for f in feeds], dtype=torch.long)
        starts = torch.stack([f[1] for f in feeds]) if feeds else torch.zeros(0, b, dtype=torch.long)
        ends = torch.stack([f[2] for f in feeds]) if feeds else torch.zeros(0, b, dtype=torch.long)
        width = int(ends.max()) + 2 if feeds else 1
        header = {"op": "draft", "k": k, "temperature": temperature, "seed": seed,
                  "plan": plan.to_dict() if plan is not None else None}
        reply, out = self._call(header, [steps, starts, ends, toks[:, :width]])
        q = out[3] if len(out) > 3 else None
        total = time.perf_counter() - t0
        # the socket's round trip counts as bus time: it is what running the drafter elsewhere costs
        return Drafts(out[0], out[1], out[2], q, total - reply["compute_s"], reply["compute_s"])

    def close(self) -> None:
        self._call({"op": "unsubscribe"})

    def shutdown(self) -> None:
        self._call({"op": "exit"})
        self.sock.close()


def serve_drafter(bind: str, drafter: Eagle3Drafter) -> None:
    """Serve one loop at a time until told to exit; `drafter` is loaded and bound to its target."""
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.bind(bind)
    feeder: EagleFeeder | None = None
    while True:
        try:
            header, arrays = _unpack(sock.recv_multipart())
            op, out, reply = header.get("op"), [], {}
            if op in ("prepare", "draft") and feeder is None:
                raise RuntimeError(f"{op!r} before 'subscribe': no loop is connected to this drafter")
            if op == "hello":
                reply = {"config": {"aux_layer_ids": drafter.config.aux_layer_ids}}
            elif op == "subscribe":
                feeder = EagleFeeder(drafter, header["endpoint"])
            elif op == "prepare":
                feeder.prepare(header["batch"], header["max_len"])
            elif op == "draft":
                steps, starts, ends, toks = arrays
                feeds = [(int(s), starts[i], ends[i]) for i, s in enumerate(steps.tolist())]
                plan = DraftPlan(**header["plan"]) if header.get("plan") else None
                d = feeder.draft(feeds, toks, header["k"], header["temperature"], header["seed"], plan)
                out = [d.tokens, d.ids, d.conf] + ([d.q] if d.q is not None else [])
                reply = {"compute_s": d.compute_s}
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
