"""Publish a session over TCP with CURVE, readable only by the clients you list.

    python examples/serve_encrypted.py --keys keys/            # loopback; --host 0.0.0.0 to leave the machine
    probebus top tcp://HOST:PORT --curve-server keys/server.key --curve-client keys/client.key_secret
"""

import argparse
import multiprocessing as mp
from pathlib import Path

import zmq.auth
from transformers import AutoModelForCausalLM, AutoTokenizer

import probe
from probebus.models import resolve_model


def client(endpoint: str, keys: Path) -> None:
    """Another process with the client's certificate reads everything; a stranger would read nothing."""
    server, _ = zmq.auth.load_certificate(keys / "server.key")
    caps = list(probe.Subscriber(endpoint, curve_server_key=server,
                                 curve_client_key=zmq.auth.load_certificate(keys / "client.key_secret")))
    print(f"[client] {len(caps)} captures, {sum(c.n_tokens for c in caps)} token rows, decrypted")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--keys", type=Path, default=Path("keys"), help="certificates are made here if missing")
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0: every interface (the clients still need keys)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    if not (args.keys / "server.key_secret").exists():
        args.keys.mkdir(parents=True, exist_ok=True)
        zmq.auth.create_certificates(args.keys, "server"), zmq.auth.create_certificates(args.keys, "client")
    _, secret = zmq.auth.load_certificate(args.keys / "server.key_secret")
    client_key, _ = zmq.auth.load_certificate(args.keys / "client.key")
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model)).eval()
    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    with probe.attach(model, "layers.*.resid_post", endpoint=f"tcp://{args.host}:*", allow_remote=True,
                      curve_secret_key=secret, curve_clients=[client_key]) as session:
        print("[model] serving", session.endpoint)
        child = mp.get_context("spawn").Process(target=client, args=(session.endpoint, args.keys))
        child.start()
        session.wait_for_subscribers(1, timeout=60)
        model.generate(**tok(["def parse(text):\n"], return_tensors="pt"), max_new_tokens=args.max_new_tokens,
                       do_sample=False)  # generate runs without autograd
    child.join(60)
    print("[model]", session.stats)
