"""`probebus attach` / `probebus detach`: probes on a running vLLM server, without a restart.

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --enforce-eager --worker-extension-cls probe.vllm.WorkerExtension
    probebus attach --vllm http://127.0.0.1:8000 --sites 'layers.*.resid_post'   # prints the endpoint
    probebus top ENDPOINT        # or: probebus record --endpoint ENDPOINT --out rec/
    probebus detach --vllm http://127.0.0.1:8000

The server's dev-mode `/collective_rpc` route reaches every worker; the extension
installs the hooks there and publishes on the bus like `probe.attach` does.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._curve_opts import add_bind_options, bind_keys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attach", help="attach probes to a running vLLM server",
                       description="Attach probes to every worker of a running vLLM server (started with "
                       "VLLM_SERVER_DEV_MODE=1, --enforce-eager and --worker-extension-cls "
                       "probe.vllm.WorkerExtension) and print where subscribers connect. The probes stay until "
                       "`probebus detach`.")
    p.add_argument("--vllm", required=True, metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--sites", default="layers.*.resid_post",
                   help="sites or patterns, comma-separated (default: %(default)s)")
    p.add_argument("--list", action="store_true", help="only list the model's sites")
    p.add_argument("--endpoint", help="where the workers bind (default: a private ipc:// path)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow an --endpoint other than loopback TCP (hidden states leak prompts: anyone who can "
                        "reach the port reads them); the server must have been started with "
                        "PROBEBUS_ALLOW_REMOTE=1 in its environment")
    add_bind_options(p)
    p.add_argument("--policy", choices=["complete", "best_effort"], default="best_effort",
                   help="complete: the server waits for slow subscribers; best_effort (default for a server): "
                   "it never waits, slow subscribers lose messages")
    p.add_argument("--max-delay", type=float, default=None, metavar="SECONDS",
                   help="while no subscriber is live, a decode step's captures may wait up to this long to leave "
                        "with later steps' in one send (fewer wake-ups of the bus on the model's thread; they wait "
                        "50 ms, longer where those wake-ups cost more); 0 sends every step at its end "
                        "(default: probe.attach's, 0.5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_attach)
    d = sub.add_parser("detach", help="remove the probes from a vLLM server",
                       description="Remove the probes `probebus attach` installed; prints the final counters.")
    d.add_argument("--vllm", required=True, metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.set_defaults(func=_cmd_detach)


def _cmd_attach(args: argparse.Namespace) -> int:
    import probe
    import probe.vllm

    engine = probe.vllm.HttpEngine(args.vllm)
    try:
        if args.list:
            print("\n".join(probe.vllm.list_sites(engine)))
            return 0
        held = {} if args.max_delay is None else {"max_delay": args.max_delay}
        session = probe.vllm.attach(engine, [s.strip() for s in args.sites.split(",") if s.strip()],
                                    endpoint=args.endpoint, policy=args.policy, allow_remote=args.allow_remote,
                                    **held, **bind_keys(args))
    except (RuntimeError, ValueError, probe.SiteError, AttributeError) as exc:
        print(f"probebus attach: {exc}", file=sys.stderr)
        return 2
    out = {"run": session.run, "endpoint": session.endpoint, "sites": session.sites, "policy": session.policy}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"attached run {session.run}: {len(session.sites)} site{'' if len(session.sites) == 1 else 's'}, "
              f"{session.policy}")
        print(f"endpoint: {session.endpoint}")
        keys = f" --curve-server {args.curve_secret.removesuffix('_secret')}" if args.curve_secret else ""
        print(f"watch it:  probebus top {session.endpoint}{keys}")
    return 0


def _cmd_detach(args: argparse.Namespace) -> int:
    import probe.vllm

    try:
        results = probe.vllm.HttpEngine(args.vllm).collective_rpc("probebus_detach")
    except (RuntimeError, AttributeError) as exc:
        print(f"probebus detach: {exc}", file=sys.stderr)
        return 2
    stats = [r for r in results if isinstance(r, dict) and r.get("publishing")]
    if not stats:
        print("probebus detach: no probes were attached to this server", file=sys.stderr)
        return 2
    print(json.dumps(stats[0]) if args.json else
          "detached: " + ", ".join(f"{k} {v}" for k, v in stats[0].items() if k != "publishing"))
    return 0
