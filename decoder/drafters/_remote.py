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

The server obeys whoever reaches its socket, so by default it binds loopback or ipc only
(`allow_remote` exposes it, with CURVE to authenticate clients), takes no message over
`max_message_bytes` (ZeroMQ drops the peer), checks every request's fields before acting
on them (`_remote_checks.py`: a `prepare` may not ask for more than `max_prepare_bytes`),
and takes `exit` and `subscribe` from an unauthenticated remote peer never.
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
import zmq

from probe._curve import admit_only, curve_settings, subscriber_keys
from probe._endpoint import check_endpoint

from ..schedule import DraftPlan
from ._eagle import Eagle3Drafter
from ._feeder import Drafts, EagleFeeder, Feed, feature_sites
from ._remote_checks import MAX_MESSAGE_BYTES, MAX_PREPARE_BYTES, Refused, check_request, trusted_peer


def _pack(header: dict, arrays: list[torch.Tensor]) -> list[bytes]:
    arrays = [a.detach().cpu() if a.dtype in (torch.int64, torch.bool) else a.detach().float().cpu() for a in arrays]
    header = dict(header, arrays=[{"dtype": str(a.dtype).removeprefix("torch."), "shape": list(a.shape)}
                                  for a in arrays])
    return [json.dumps(header).encode()] + [a.contiguous().numpy().tobytes() for a in arrays]


def _unpack(frames: list) -> tuple[dict, list[torch.Tensor]]:
    frames = [f if isinstance(f, bytes) else f.bytes for f in frames]
    try:
        header = json.loads(frames[0])
    except (ValueError, RecursionError):
        raise ValueError("the header frame is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("the header frame is not a JSON object")
    specs = header.pop("arrays", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise ValueError(f"message announces {len(specs) if isinstance(specs, list) else '?'} arrays but carries "
                         f"{len(frames) - 1}")
    out = []
    for spec, buf in zip(specs, frames[1:], strict=True):
        if not isinstance(spec, dict) or spec.get("dtype") not in ("int64", "float32", "bool"):
            raise ValueError(f"unsupported array {str(spec)[:80]}")
        shape = spec.get("shape")
        if not isinstance(shape, list) or len(shape) > 4 or \
                not all(type(n) is int and 0 <= n < 1 << 31 for n in shape):
            raise ValueError(f"bad array shape {str(shape)[:80]}")
        arr = np.frombuffer(buf, dtype=spec["dtype"]).reshape(shape).copy()  # ValueError when the bytes differ
        out.append(torch.from_numpy(arr))
    return header, out


class RemoteEagle:
    """The `Feeder` protocol, talking to `serve_drafter` in another process."""

    def __init__(self, address: str, timeout: float = 60.0, *, curve_server_key: bytes | str | None = None,
                 curve_client_key: tuple[bytes | str, bytes | str] | None = None) -> None:
        curve = subscriber_keys(curve_server_key, curve_client_key)  # a server started with a CURVE secret
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        if curve is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = curve
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


def serve_drafter(bind: str, drafter: Eagle3Drafter, *, allow_remote: bool = False,
                  curve_secret_key: bytes | str | None = None, curve_clients: object = None,
                  max_message_bytes: int = MAX_MESSAGE_BYTES, max_prepare_bytes: int = MAX_PREPARE_BYTES,
                  ready: object = None) -> None:
    """Serve one loop at a time until told to exit; `drafter` is loaded and bound to its target.

    `bind` must be loopback TCP or ipc unless `allow_remote` (ValueError before anything binds). With
    `curve_secret_key` clients must know the server's public key (and be among `curve_clients`, public keys or a
    folder of certificates, when given). `ready`, if given, is called once the socket is bound."""
    check_endpoint(bind, allow_remote)
    secret, clients = curve_settings(curve_secret_key, curve_clients)  # type: ignore[arg-type]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # a bigger frame: ZeroMQ drops that peer, nothing is held
    sock.setsockopt(zmq.LINGER, 0)
    auth = admit_only(ctx, clients) if secret is not None and clients is not None else None
    if secret is not None:
        sock.curve_secretkey = secret
        sock.curve_server = True
    sock.bind(bind)
    if allow_remote and secret is None and bind.startswith("tcp://"):
        print(f"probebus serve-drafter: {bind} is open to anyone who can reach it, without CURVE; 'exit' and "
              "'subscribe' are refused from peers other than this machine's loopback", file=sys.stderr, flush=True)
    if callable(ready):
        ready()
    feeder: EagleFeeder | None = None
    limits = {"max_len": getattr(drafter.config, "max_position_embeddings", 1 << 17) or 1 << 17,
              "prepare_bytes": max_prepare_bytes,
              "row_bytes": len(feature_sites(drafter)) * drafter.config.target_hidden_size *
              next(drafter.parameters()).element_size()}
    try:
        while True:
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                continue
            try:
                header, arrays = _unpack(frames)
                op = header.get("op")
                check_request(op, header, arrays, limits)
                if op in ("exit", "subscribe") and secret is None and not trusted_peer(frames[0], bind):
                    raise Refused(f"{op!r} is taken only from this machine or a CURVE client")
                if op in ("prepare", "draft") and feeder is None:
                    raise RuntimeError(f"{op!r} before 'subscribe': no loop is connected to this drafter")
                out, reply = [], {}
                if op == "hello":
                    reply = {"config": {"aux_layer_ids": drafter.config.aux_layer_ids}}
                elif op == "subscribe":
                    check_endpoint(header["endpoint"], allow_remote)
                    if feeder is not None:
                        feeder.close()
                    feeder = EagleFeeder(drafter, header["endpoint"])
                elif op == "prepare":
                    feeder.prepare(header["batch"], header["max_len"])  # type: ignore[union-attr]
                elif op == "draft":
                    steps, starts, ends, toks = arrays
                    feeds = [(int(s), starts[i], ends[i]) for i, s in enumerate(steps.tolist())]
                    plan = DraftPlan(**header["plan"]) if header.get("plan") else None
                    d = feeder.draft(feeds, toks, header["k"], header["temperature"],  # type: ignore[union-attr]
                                     header["seed"], plan)
                    out = [d.tokens, d.ids, d.conf] + ([d.q] if d.q is not None else [])
                    reply = {"compute_s": d.compute_s}
                elif op == "unsubscribe":
                    if feeder is not None:
                        feeder.close()
                    feeder = None
                elif op == "exit":
                    sock.send_multipart(_pack({}, []))
                    break
                sock.send_multipart(_pack(reply, out))
            except Exception as exc:  # answer with the error; the server stays up
                sock.send_multipart(_pack({"error": f"{type(exc).__name__}: {str(exc)[:500]}"}, []))
    finally:
        if feeder is not None:
            feeder.close()
        sock.close()
        if auth is not None:
            auth.stop()  # type: ignore[attr-defined]
