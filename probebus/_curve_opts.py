"""The CURVE options of the commands that bind (`attach`) or connect (`record --endpoint`, `top`).

    python -c "import zmq.auth as a; a.create_certificates('keys', 'server'); a.create_certificates('keys', 'me')"
    probebus attach --vllm URL --endpoint tcp://0.0.0.0:5555 --allow-remote \\
        --curve-secret keys/server.key_secret --curve-clients clients/   # clients/ holds me.key
    probebus top tcp://host:5555 --curve-server keys/server.key --curve-client keys/me.key_secret

Keys come from certificate files, never from the command line, where other users see them.
"""

from __future__ import annotations

import argparse
from typing import Any

from ._load import LoadError


def add_connect_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curve-server", metavar="FILE",
                   help="the session's public CURVE certificate (NAME.key, from zmq.auth.create_certificates): "
                        "connect encrypted")
    p.add_argument("--curve-client", metavar="FILE",
                   help="this client's secret certificate (NAME.key_secret), for a session that admits only "
                        "listed clients")


def add_bind_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curve-secret", metavar="FILE",
                   help="bind encrypted with this secret CURVE certificate (NAME.key_secret, from "
                        "zmq.auth.create_certificates); subscribers need its NAME.key")
    p.add_argument("--curve-clients", metavar="DIR",
                   help="with --curve-secret: admit only the clients whose public certificates are in DIR")


def connect_keys(args: argparse.Namespace) -> dict[str, Any]:
    """Subscriber keyword arguments from --curve-server / --curve-client (LoadError for a bad file)."""
    from probe._curve import load_certificate

    if args.curve_server is None:
        if args.curve_client is not None:
            raise LoadError("--curve-client needs --curve-server (the session's public certificate)")
        return {}
    try:
        server, _ = load_certificate(args.curve_server, secret=False)
        client = None if args.curve_client is None else load_certificate(args.curve_client, secret=True)
    except ValueError as exc:
        raise LoadError(str(exc)) from None
    return {"curve_server_key": server, "curve_client_key": client}


def bind_keys(args: argparse.Namespace) -> dict[str, Any]:
    """`attach` keyword arguments from --curve-secret / --curve-clients (LoadError for a bad file)."""
    from probe._curve import load_certificate

    if args.curve_secret is None:
        if args.curve_clients is not None:
            raise LoadError("--curve-clients needs --curve-secret")
        return {}
    try:
        _, secret = load_certificate(args.curve_secret, secret=True)
    except ValueError as exc:
        raise LoadError(str(exc)) from None
    return {"curve_secret_key": secret, "curve_clients": args.curve_clients}
