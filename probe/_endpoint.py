"""Where a session binds: a private ipc:// path by default, and never a reachable TCP port by accident.

    endpoint, private_dir = bind_address(None, allow_remote=False)   # ipc://<0700 temp dir>/bus
    bind_address("tcp://0.0.0.0:5555", allow_remote=False)          # ValueError: hidden states leak prompts
    remove_private(private_dir)                                      # at close; the bound socket keeps working
    bind_address("ipc:///tmp/x.sock", allow_remote=False)   # ValueError while another session serves that path

Hidden states leak prompts, so a session binds to loopback or to a path only its user can
open, unless the caller says otherwise. ZeroMQ binds an ipc:// path by unlinking whatever is
there, so a second session on a path in use would silently take it from the first: a path where
a socket answers is refused (a stale socket file, nobody listening, is reused).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import stat
import tempfile
import warnings


def bind_address(endpoint: str | None, *, allow_remote: bool, curve: bool = False,
                 prefix: str = "probebus-") -> tuple[str, str | None]:
    """(the endpoint to bind, the private directory made for it or None); refuses a non-loopback TCP endpoint
    unless `allow_remote`, and warns when one is exposed without CURVE (`curve`)."""
    private = None
    if endpoint is None:
        if os.name == "nt":
            endpoint = "tcp://127.0.0.1:*"
        else:  # mkdtemp makes a 0700 directory: only this user can connect
            private = tempfile.mkdtemp(prefix=prefix)
            endpoint = f"ipc://{private}/bus"
    check_endpoint(endpoint, allow_remote)
    if private is None:
        check_ipc_free(endpoint)
    if allow_remote and not curve and endpoint.startswith("tcp://"):
        warnings.warn("binding without CURVE: anyone who can reach this port can read activations", stacklevel=4)
    return endpoint, private


def check_endpoint(endpoint: str, allow_remote: bool) -> None:
    """ValueError for a TCP endpoint other than loopback, unless `allow_remote`."""
    if not endpoint.startswith("tcp://"):
        return
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not loopback and not allow_remote:
        raise ValueError(
            f"refusing to bind {endpoint!r}: hidden states leak prompts. Bind tcp://127.0.0.1:PORT or "
            "an ipc:// path, or pass allow_remote=True (with curve_secret_key) to expose it on purpose."
        )


def check_ipc_free(endpoint: str) -> None:
    """ValueError when an ipc:// endpoint's path is in use: a socket that answers (another session, or any
    server), or a file that is not a socket. Abstract (ipc://@name) and non-ipc endpoints pass."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return
    path = endpoint[len("ipc://"):]
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # nothing there: free
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"refusing to bind {endpoint!r}: {path} exists and is not a socket; pick another path")
    probe_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe_sock.settimeout(1.0)
        probe_sock.connect(path)
    except OSError:
        return  # a stale socket file nobody listens on: ZeroMQ replaces it
    finally:
        probe_sock.close()
    raise ValueError(f"refusing to bind {endpoint!r}: another session (or server) is bound there and would lose "
                     "its subscribers; close it, pick another path, or leave endpoint unset for a private one")


def remove_private(private: str | None) -> None:
    """Remove the private directory `bind_address` made (the bound socket keeps working after its path is gone)."""
    if private:
        shutil.rmtree(private, ignore_errors=True)
