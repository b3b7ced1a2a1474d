"""`probebus record | inspect | top`: the exporters' command line.

    probebus record --model default --prompts p.jsonl --sites 'layers.*.resid_post' --out rec/
    probebus record --model default --prompt 'def f(' --endpoint ipc:///tmp/pb.sock --out rec/   # bind there
    probebus record --endpoint ipc:///tmp/probebus-abc/bus --out rec/     # record someone else's session
    probebus inspect rec/ [--json] [--plot plots/]
    probebus top                            # this user's live sessions
    probebus top ipc:///tmp/probebus-abc/bus [--duration 10] [--json]

Bad input is one line on stderr and exit status 2. `register(subparsers)` adds the
three subcommands to the main parser; `main(argv)` runs them standalone. What `record`
runs is `_cmd_record.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from probebus._cmd_record import Stop, cmd_record
from probebus._curve_opts import add_connect_options, connect_keys
from probebus._load import LoadError

EPILOG_RECORD = ("Files: {dtype}x{hidden}-NNNNN.arrow (Arrow IPC files) or .parquet, plus _manifest.json, "
                 "_prompts.jsonl and, while recording, _*.arrow.inprogress. Read them with exporters.read_recording, "
                 "DuckDB, polars, pyarrow.dataset or HF datasets (see docs/reading.md).")


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="weights dtype; auto = the checkpoint's (float32 on a CPU without native half precision) "
                        "(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps | auto (default: %(default)s)")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "record", help="record activations to Arrow/Parquet while a model generates",
        description="Run generate on prompts with probes attached and record every capture (long format, one row "
                    "per token and site), or record a session that is already running (--endpoint without "
                    "--model).", epilog=EPILOG_RECORD)
    p.add_argument("--model", help="default | PATH | a hub id in the local cache: load it and generate")
    p.add_argument("--endpoint", help="with --model: bind the probe session here (ipc://PATH or "
                   "tcp://127.0.0.1:PORT) so `probebus top ENDPOINT` can watch; without --model: record the "
                   "session already running there")
    p.add_argument("--prompt", help="one prompt (with --model)")
    p.add_argument("--prompts", metavar="FILE", help="prompts file: JSON Lines with a 'prompt' field, or one per line")
    p.add_argument("--sites", default=None,
                   help="site pattern(s), comma separated (default with --model: layers.*.resid_post; "
                        "with --endpoint: every site the session publishes)")
    p.add_argument("--out", required=True, metavar="DIR", help="recording directory (created)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt, >= 1 "
                   "(default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call, >= 1 (default: %(default)s)")
    p.add_argument("--format", choices=("arrow", "parquet"), default="arrow",
                   help="Arrow IPC files (fast, memory-mappable) or Parquet (compressed ids) (default: %(default)s)")
    p.add_argument("--policy", choices=("complete", "best_effort"), default="complete",
                   help="complete: never lose a capture (the model waits); best_effort: never wait (drops counted)")
    p.add_argument("--rotate-mb", type=float, default=256.0, help="start a new file after this many MB "
                   "(default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace a recording already in DIR")
    p.add_argument("--duration", type=float, help="recording a running session: stop after this many seconds")
    p.add_argument("--idle-timeout", type=float,
                   help="recording a running session: stop once no capture arrived for this many seconds (after "
                        "the first); recording always stops when the session closes")
    add_connect_options(p)
    _model_options(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=cmd_record)

    p = subparsers.add_parser("inspect", help="per-site statistics of a recording",
                              description="Rows, sequences, tokens, bytes, dtype and activation norms per site, "
                                          "plus the manifest's state (complete, failed, interrupted, or killed "
                                          "mid-recording).")
    p.add_argument("dir", metavar="DIR", help="recording folder (or one of its .arrow / .parquet files)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="OUTDIR", help="also write PNGs of activation norms per site and position and "
                   "per layer into OUTDIR (needs matplotlib: pip install 'probebus[plot]')")
    p.add_argument("--sites", default=None, help="with --plot: only these site patterns")
    p.add_argument("--repair", action="store_true", help="first finish the in-progress files a killed recorder "
                   "left (their whole batches become complete files), so that DuckDB, polars and pyarrow.dataset "
                   "read their rows too")
    p.set_defaults(func=cmd_inspect)

    p = subparsers.add_parser("top", help="live per-site view of a running probe session",
                              description="Without ENDPOINT: list this user's live probe sessions. With it: show "
                                          "per-site capture rate, tokens/s, MB/s, missed captures and lag until the "
                                          "session ends, Ctrl-C or --duration.")
    p.add_argument("endpoint", metavar="ENDPOINT", nargs="?", help="the session's endpoint (see `probebus top`)")
    p.add_argument("--sites", default=None, help="only these site patterns")
    p.add_argument("--interval", type=float, default=1.0, help="refresh every this many seconds "
                   "(default: %(default)s)")
    p.add_argument("--duration", type=float, help="exit after this many seconds")
    p.add_argument("--wait", type=float, default=3.0, help="seconds to wait for the session to answer before "
                   "giving up on ENDPOINT (default: %(default)s)")
    add_connect_options(p)
    p.add_argument("--json", action="store_true", help="no live view; print final totals as JSON")
    p.set_defaults(func=cmd_top)


def cmd_inspect(args: argparse.Namespace) -> int:
    import pyarrow as pa

    import exporters
    from exporters._console import inspect_view, make_console

    try:
        if args.repair:
            for d in exporters.repair_recording(args.dir):
                print(f"repaired: {d['from']} -> {d['file'] or 'removed (no whole batch in it)'} ({d['rows']:,} rows)",
                      file=sys.stderr)
        info = exporters.summarize_recording(args.dir)
        paths = exporters.plot_recording(args.dir, args.plot, sites=args.sites) if args.plot else []
    except exporters.PlotUnavailable as exc:
        raise LoadError(f"--plot: {exc}") from None
    except (FileNotFoundError, NotADirectoryError, ValueError, pa.ArrowInvalid) as exc:
        raise LoadError(str(exc)) from None
    except OSError as exc:
        raise LoadError(f"cannot read {args.dir}: {exc.strerror or exc}") from None
    except (KeyError, TypeError, AttributeError, IndexError, RecursionError, pa.ArrowException) as exc:
        # A damaged or crafted file the checks above did not name (`exporters/_safe.py`): one line, no traceback.
        raise LoadError(f"{args.dir} is not a readable probebus recording ({type(exc).__name__}: "
                        f"{str(exc)[:200]})") from None
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        make_console().print(inspect_view(info))
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _list_sessions() -> int:
    import probe

    sessions = probe.live_sessions()
    if not sessions:
        print("no live probe sessions of this user on this machine (start one: probebus demo, probebus record "
              "--model default --prompt ..., or probe.attach in Python)", file=sys.stderr)
        return 0
    print(f"{len(sessions)} live probe session(s); watch one with: probebus top ENDPOINT")
    for s in sessions:
        age = time.time() - s.started if s.started else 0.0
        sites = f"{len(s.sites)} site{'' if len(s.sites) == 1 else 's'}" if s.sites else "sites ?"
        print(f"  {s.endpoint}  pid {s.pid}  {s.model or 'model ?'}  {sites}  {s.policy}  up {age:.0f} s")
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    if args.endpoint is None:
        return _list_sessions()
    if args.interval <= 0 or (args.duration is not None and args.duration <= 0) or args.wait <= 0:
        raise LoadError("--interval, --duration and --wait must be positive")
    import zmq
    from rich.live import Live

    import exporters
    from exporters._console import make_console, top_table

    try:
        mon = exporters.TopMonitor(args.endpoint, args.sites, **connect_keys(args))
    except zmq.ZMQError as exc:
        raise LoadError(f"{args.endpoint!r} is not an endpoint ({exc}); expected e.g. ipc:///path/to/socket or "
                        "tcp://127.0.0.1:5555 (`probebus top` lists live sessions)") from None
    except ValueError as exc:  # a bad site pattern
        raise LoadError(str(exc)) from None
    t0 = time.monotonic()
    with mon, Stop() as stop:
        if mon.wait_info(args.wait) is None:
            raise LoadError(f"nobody serves {args.endpoint} (no probe session answered within {args.wait:g} s); "
                            "`probebus top` lists this user's live sessions")

        def running() -> bool:
            return not stop.requested and not mon.ended and \
                (args.duration is None or time.monotonic() - t0 < args.duration)

        if args.json:
            while running():
                mon.poll(min(args.interval, 0.25))
        else:
            console = make_console()
            with Live(top_table(mon.totals()), console=console, refresh_per_second=4,
                      auto_refresh=console.is_terminal) as live:
                while running():
                    mon.poll(args.interval)
                    live.update(top_table(mon.totals()))
                live.update(top_table(mon.totals()))
        if args.json:
            print(json.dumps(mon.totals(), indent=1))
        elif mon.ended:
            print("probebus top: the session ended", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from probebus.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
