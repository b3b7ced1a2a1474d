"""CURVE for a session that leaves the machine: encryption, the server's identity, and which clients may read.

    public, secret = zmq.curve_keypair()                     # or zmq.auth.create_certificates(dir, "server")
    s = probe.attach(model, sites, endpoint="tcp://0.0.0.0:5555", allow_remote=True,
                     curve_secret_key=secret,                # subscribers need `public`
                     curve_clients=client_public_keys)       # or a folder of public certificates; None: any
    probe.Subscriber("tcp://host:5555", curve_server_key=public, curve_client_key=(c_public, c_secret))

ZeroMQ's CURVE alone encrypts and proves the server to its clients, but any client that knows the
server's public key may read. `curve_clients` closes that: pyzmq's ZAP authenticator (a thread
that only runs during handshakes, never while the model steps) admits only the listed public keys.
Keys are Z85 text (40 characters) or 32 raw bytes, as `zmq.curve_keypair()` makes them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import zmq
from zmq.utils import z85

Clients = Iterable[bytes | str] | str | os.PathLike | None


def curve_key(key: bytes | str, what: str) -> bytes:
    """A CURVE key as Z85 bytes, or a ValueError that says what a key looks like."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE (libsodium); install pyzmq's wheel from PyPI")
    raw = key.encode() if isinstance(key, str) else bytes(key)
    if len(raw) == 32:
        return z85.encode(raw)
    if len(raw) == 40:
        try:
            z85.decode(raw)
        except (ValueError, KeyError, IndexError):
            pass
        else:
            return raw
    raise ValueError(f"{what} must be a CURVE key: 40 characters of Z85 text or 32 raw bytes, as "
                     f"zmq.curve_keypair() makes them (got {len(raw)} bytes)")


def client_keys(clients: Clients) -> set[bytes] | None:
    """The admitted clients' public keys (Z85), from keys or a folder of public certificates; None: any."""
    if clients is None:
        return None
    if isinstance(clients, (str, os.PathLike)):
        folder = Path(clients)
        if not folder.is_dir():
            raise ValueError(f"curve_clients {str(folder)!r} is not a folder of public certificates "
                             "(zmq.auth.create_certificates writes them as NAME.key)")
        import zmq.auth  # here: pyzmq's auth imports asyncio (slow: docs/design.md), which `import probe` need not pay

        return {curve_key(k, f"a public key in {folder}") for k in zmq.auth.load_certificates(folder)}
    return {curve_key(k, "each of curve_clients") for k in clients}


def curve_settings(secret: bytes | str | None, clients: Clients) -> tuple[bytes | None, set[bytes] | None]:
    """A session's CURVE arguments checked: (its secret key, the admitted clients' keys or None for any);
    `subscriber_keys` is the other end's."""
    if secret is None:
        if clients is not None:
            raise ValueError("curve_clients needs curve_secret_key: only a CURVE session can tell its clients apart")
        return None, None
    return curve_key(secret, "curve_secret_key"), client_keys(clients)


def subscriber_keys(server: bytes | str | None,
                    client: tuple[bytes | str, bytes | str] | None) -> tuple[bytes, bytes, bytes] | None:
    """(our public, our secret, the server's public) for a CURVE session, or None; a one-off key pair of ours
    unless the session admits only listed clients (`client`)."""
    if server is None:
        if client is not None:
            raise ValueError("curve_client_key needs curve_server_key (the session's public key)")
        return None
    public, secret = zmq.curve_keypair() if client is None else (
        curve_key(client[0], "curve_client_key's public key"), curve_key(client[1], "curve_client_key's secret key"))
    return public, secret, curve_key(server, "curve_server_key")


def load_certificate(path: str | os.PathLike, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) from a certificate file that `zmq.auth.create_certificates` wrote, with a clear error."""
    import zmq.auth

    try:
        public, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the CURVE certificate {str(path)!r}: {exc}") from None
    if secret and sec is None:
        raise ValueError(f"{str(path)!r} holds no secret key: give the NAME.key_secret file, not NAME.key")
    return public, sec


class _Allowed:
    """pyzmq's credentials provider: admits a client whose public key is in the set."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def admit_only(ctx: zmq.Context, keys: set[bytes]) -> object:
    """Start a ZAP handler on `ctx` that admits only these clients (a `ThreadAuthenticator`); stop it
    before the context ends."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_Allowed(keys))
    return auth
