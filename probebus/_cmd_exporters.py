"""`probebus record | inspect | top`: the exporters' command line.

    probebus record --model default --prompts p.jsonl --sites 'layers.*.resid_post' --out rec/
    probebus record --endpoint ipc:///tmp/probebus-abc/bus --out rec/     # someone else's session
    probebus inspect rec/ [--json]
    probebus top ipc:///tmp/probebus-abc/bus [--duration 10] [--json]

`register(subparsers)` adds the three subcommands to the main parser; `main(argv)`
runs them standalone (python -m probebus._cmd_exporters ...).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

EPILOG_RECORD = ("Files: {dtype}x{hidden}-NNNNN.arrow|parquet (complete) and *.arrow.inprogress (being written), "
                 "plus manifest.json. Read them with exporters.read_recording, DuckDB, polars or HF datasets.")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "record", help="record activations to Arrow/Parquet while a model generates",
        description="Run generate on prompts with probes attached and record every capture (long format, one row "
                    "per token and site), or record a running session from its --endpoint.", epilog=EPILOG_RECORD)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model folder, hub id in the local cache, or 'default'")
    src.add_argument("--endpoint", help="record someone else's running probe session instead of loading a model")
    p.add_argument("--prompt", help="one prompt (with --model)")
    p.add_argument("--prompts", metavar="FILE", help="prompts file: JSON Lines with a 'prompt' field, or one per line")
    p.add_argument("--sites", default=None,
                   help="site pattern(s), comma separated (default with --model: layers.*.resid_post; "
                        "with --endpoint: every site the session publishes)")
    p.add_argument("--out", required=True, metavar="DIR", help="recording directory (created)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--format", choices=("arrow", "parquet"), default="arrow")
    p.add_argument("--policy", choices=("complete", "best_effort"), default="complete",
                   help="complete: never lose a capture (the model waits); best_effort: never wait (drops counted)")
    p.add_argument("--rotate-mb", type=float, default=256.0, help="start a new file after this many MB")
    p.add_argument("--overwrite", action="store_true", help="replace a recording already in DIR")
    p.add_argument("--duration", type=float, help="with --endpoint: stop after this many seconds")
    p.add_argument("--idle-timeout", type=float,
                   help="with --endpoint: stop once no capture arrived for this many seconds (after the first); "
                        "recording always stops when the session closes")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    p.set_defaults(func=cmd_record)

    p = subparsers.add_parser("inspect", help="per-site statistics of a recording",
                              description="Rows, sequences, tokens, bytes, dtype and activation norms per site, "
                                          "plus the manifest's state (complete, failed, or killed mid-recording).")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = subparsers.add_parser("top", help="live per-site view of a running probe session",
                              description="Subscribe to ENDPOINT and show per-site capture rate, tokens/s, MB/s, "
                                          "detected drops and lag (in steps) until Ctrl-C or --duration.")
    p.add_argument("endpoint", metavar="ENDPOINT")
    p.add_argument("--sites", default=None, help="only these site patterns")
    p.add_argument("--interval", type=float, default=1.0, help="refresh every this many seconds")
    p.add_argument("--duration", type=float, help="exit after this many seconds")
    p.add_argument("--json", action="store_true", help="no live view; print final totals as JSON")
    p.set_defaults(func=cmd_top)


# --- record --------------------------------------------------------------------------------------
class _Stop:
    """SIGINT/SIGTERM while recording: stop the work, then always finish the files and the manifest.

    With `interrupt=True` the first signal raises KeyboardInterrupt in the main thread
    (it is running `generate`); otherwise it only sets `requested`. Signals that arrive
    while the files are being finished are noted and ignored: finishing is bounded.
    """

    def __init__(self, interrupt: bool = False) -> None:
        self.interrupt = interrupt
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0

    def __enter__(self) -> _Stop:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a test thread)
                pass
        return self

    def finishing(self) -> None:
        """From here on signals no longer interrupt: the files are being finished."""
        self.interrupt = False

    def _handle(self, signum: int, frame: object) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if first and self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _finish(rec: Any, args: argparse.Namespace, console: Any, stop: _Stop) -> int:
    from exporters._console import summary_table

    stop.finishing()
    if stop.requested:
        rec.mark_interrupted(signal.Signals(stop.signum).name)
    s = rec.stop(timeout=10.0, finish_timeout=30.0, raise_on_error=False)
    if args.json:
        print(json.dumps(s.as_dict(), indent=1))
    else:
        console.print(summary_table(s))
    if s.error:
        console.print(f"[red]probebus record: {s.error}")
        return 1
    if stop.requested:
        console.print(f"[yellow]probebus record: stopped by {signal.Signals(stop.signum).name}; the files and the "
                      "manifest are complete up to there")
        return stop.exit_code
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    if args.endpoint is not None:
        if args.prompt is not None or args.prompts is not None:
            console.print("[red]--prompt/--prompts need --model; --endpoint records a session that is already running")
            return 2
        with _Stop() as stop:
            return _record_endpoint(args, console, stop)
    from probebus._prompts import read_prompts

    prompts = read_prompts(args.prompt, args.prompts)
    with _Stop(interrupt=True) as stop:
        try:
            return _record_model(args, prompts, console, stop)
        except KeyboardInterrupt:  # before the recorder existed (loading the model): nothing to finish
            console.print("[yellow]probebus record: interrupted before recording started")
            return stop.exit_code or 130


def _record_endpoint(args: argparse.Namespace, console: Any, stop: _Stop) -> int:
    import exporters
    from exporters._console import RecordProgress

    try:
        rec = exporters.ArrowRecorder(args.endpoint, args.out, sites=args.sites, format=args.format,
                                      rotate_bytes=int(args.rotate_mb * (1 << 20)), overwrite=args.overwrite)
        rec.start()
    except (exporters.RecorderError, ValueError) as exc:
        console.print(f"[red]probebus record: {exc}")
        return 2
    t0 = time.monotonic()
    last_rx, last_n = t0, 0
    with RecordProgress(console, None, unit="row") as bar:
        while not stop.requested and rec.running and not rec.source_ended:
            time.sleep(0.1)
            s = rec.stats
            now = time.monotonic()
            if s.received != last_n:
                last_rx, last_n = now, s.received
            bar.update(s.rows, s, description=f"recording {args.endpoint}")
            if args.duration is not None and now - t0 >= args.duration:
                break
            if args.idle_timeout is not None and last_n and now - last_rx >= args.idle_timeout:
                break
        bar.update(rec.stats.rows, rec.stats, force=True)
    return _finish(rec, args, console, stop)


def _record_model(args: argparse.Namespace, prompts: list[str], console: Any, stop: _Stop) -> int:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    import exporters
    import probe
    from exporters._console import RecordProgress
    from probebus._load import load_model

    model, tok = load_model(args.model)
    sites = args.sites or "layers.*.resid_post"
    total = len(prompts) * args.max_new_tokens
    try:
        session = probe.attach(model, sites, policy=args.policy)
    except (probe.SiteError, ValueError) as exc:
        console.print(f"[red]probebus record: {exc}")
        return 2
    with session:
        try:
            rec = exporters.ArrowRecorder(session, args.out, format=args.format, overwrite=args.overwrite,
                                          rotate_bytes=int(args.rotate_mb * (1 << 20)), model=model,
                                          metadata={"model_arg": args.model})
            rec.start()
        except exporters.RecorderError as exc:
            console.print(f"[red]probebus record: {exc}")
            return 2
        done = 0
        try:
            with RecordProgress(console, total) as bar:

                class Count(StoppingCriteria):  # called once per decode step: advance the bar, never stop
                    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
                        nonlocal done
                        done += input_ids.shape[0]
                        bar.update(done, rec.stats)
                        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

                for i in range(0, len(prompts), args.batch_size):
                    chunk = prompts[i : i + args.batch_size]
                    enc = tok(chunk, return_tensors="pt", padding=True)
                    with torch.no_grad():
                        model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                       max_new_tokens=args.max_new_tokens, do_sample=False,
                                       pad_token_id=tok.pad_token_id, stopping_criteria=StoppingCriteriaList([Count()]))
                    done = min(total, (i + len(chunk)) * args.max_new_tokens)
                    bar.update(done, rec.stats, force=True)
                    if not rec.running:  # the recorder failed: the error is reported below
                        break
        except KeyboardInterrupt:
            stop.finishing()
            console.print("[yellow]interrupted: finishing the files")
        stop.finishing()
        session.close()  # everything staged reaches the recorder before it drains and stops
    return _finish(rec, args, console, stop)


# --- inspect / top ----------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.console import Console

    import exporters
    from exporters._console import inspect_view

    try:
        info = exporters.summarize_recording(args.dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"probebus inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        Console().print(inspect_view(info))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    import exporters
    from exporters._console import top_table

    try:
        mon = exporters.TopMonitor(args.endpoint, args.sites)
    except Exception as exc:  # bad endpoint or pattern: zmq/probe raise various types
        print(f"probebus top: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with mon, _Stop() as stop:
        def running() -> bool:
            return not stop.requested and (args.duration is None or time.monotonic() - t0 < args.duration)

        try:
            if args.json:
                while running():
                    mon.poll(min(args.interval, 0.25))
            else:
                with Live(top_table(mon.totals()), console=Console(), refresh_per_second=4) as live:
                    while running():
                        mon.poll(args.interval)
                        live.update(top_table(mon.totals()))
        except KeyboardInterrupt:
            pass
        if args.json:
            print(json.dumps(mon.totals(), indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="probebus", description="probebus exporters: record, inspect, top")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
