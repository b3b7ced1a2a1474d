"""`probebus record`: run a model with probes and record it, or record a session already running.

    probebus record --model default --prompts p.jsonl --sites 'layers.*.resid_post' --out rec/
    probebus record --endpoint ipc:///tmp/probebus-abc/bus --out rec/ [--duration 10] [--idle-timeout 5]

`cmd_record(args)` is what the parser `_cmd_exporters.register` builds runs. A first
SIGINT/SIGTERM stops the work; the files and the manifest are always finished (`Stop`,
which `probebus top` uses for Ctrl-C too). Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

from probebus._curve_opts import connect_keys
from probebus._load import LoadError


class Stop:
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

    def __enter__(self) -> Stop:
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


def _check_record(args: argparse.Namespace) -> None:
    """Every argument problem, before anything is loaded or created on disk."""
    if args.model is None and args.endpoint is None:
        raise LoadError("give --model M (load it and generate) or --endpoint E (record a running session)")
    if args.model is None and (args.prompt is not None or args.prompts is not None):
        raise LoadError("--prompt/--prompts need --model; --endpoint alone records a session that is already running")
    if args.model is not None:
        if args.prompt is None and args.prompts is None:
            raise LoadError("give --prompt TEXT or --prompts FILE")
        if args.max_new_tokens < 1:
            raise LoadError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        if args.batch_size < 1:
            raise LoadError(f"--batch-size must be at least 1, got {args.batch_size}")
        if args.duration is not None or args.idle_timeout is not None:
            raise LoadError("--duration/--idle-timeout apply to recording a running session (--endpoint alone)")
        if args.curve_server is not None or args.curve_client is not None:
            raise LoadError("--curve-server/--curve-client apply to recording a running session (--endpoint alone)")
    if args.rotate_mb <= 0:
        raise LoadError(f"--rotate-mb must be positive, got {args.rotate_mb}")
    for name in ("duration", "idle_timeout"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise LoadError(f"--{name.replace('_', '-')} must be positive, got {v}")
    from exporters._files import existing_recording

    found = existing_recording(args.out)
    if found and not args.overwrite:
        from exporters._console import plural

        raise LoadError(f"{args.out} already holds a recording ({plural(len(found), 'file')}); record into a new "
                        "directory, or replace it with --overwrite")


def _finish(rec: Any, args: argparse.Namespace, console: Any, stop: Stop) -> int:
    from exporters._console import summary_table

    stop.finishing()
    if stop.requested:
        rec.mark_interrupted(signal.Signals(stop.signum).name)
    s = rec.stop(timeout=10.0, finish_timeout=30.0, raise_on_error=False)
    if args.json:
        print(json.dumps(s.as_dict(), indent=1))
    else:
        console.print(summary_table(s, interrupted_by=signal.Signals(stop.signum).name if stop.requested else None))
    if s.error:
        print(f"probebus record: {s.error}", file=sys.stderr)
        return 1
    if stop.requested:
        print(f"probebus record: stopped by {signal.Signals(stop.signum).name}; the files and the manifest are "
              "complete up to there", file=sys.stderr)
        return stop.exit_code
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    from exporters._console import make_console

    _check_record(args)
    console = make_console(stderr=True)
    if args.model is None:
        with Stop() as stop:
            return _record_endpoint(args, console, stop)
    from probebus._load import read_prompts_checked

    prompts = read_prompts_checked(args.prompt, args.prompts)
    with Stop(interrupt=True) as stop:
        try:
            return _record_model(args, prompts, console, stop)
        except KeyboardInterrupt:  # before the recorder existed (loading the model): nothing to finish
            print("probebus record: interrupted before recording started", file=sys.stderr)
            return stop.exit_code or 130


def _record_endpoint(args: argparse.Namespace, console: Any, stop: Stop) -> int:
    import exporters
    from exporters._console import RecordProgress

    try:  # one subscriber from the start: a probe-then-reconnect would miss what is published in between
        rec = exporters.ArrowRecorder(args.endpoint, args.out, sites=args.sites, format=args.format,
                                      rotate_bytes=int(args.rotate_mb * (1 << 20)), overwrite=args.overwrite,
                                      info_timeout=3.0, require_session=True, **connect_keys(args))
        rec.start()
    except (exporters.RecorderError, ValueError) as exc:
        raise LoadError(str(exc)) from None
    info = rec.session_info
    print(f"recording {args.endpoint} ({info.model or 'model ?'}, run {info.run}) into {args.out}", file=sys.stderr)
    t0 = time.monotonic()
    last_rx, last_n = t0, 0
    with RecordProgress(console, None, unit="row") as bar:
        while not stop.requested and rec.running and not rec.source_ended:
            time.sleep(0.1)
            s = rec.stats
            now = time.monotonic()
            if s.received != last_n:
                last_rx, last_n = now, s.received
            bar.update(s.rows, s, description="recording")
            if args.duration is not None and now - t0 >= args.duration:
                break
            if args.idle_timeout is not None and last_n and now - last_rx >= args.idle_timeout:
                break
        bar.update(rec.stats.rows, rec.stats, force=True)
    return _finish(rec, args, console, stop)


def _record_model(args: argparse.Namespace, prompts: list[str], console: Any, stop: Stop) -> int:
    import torch
    import zmq
    from transformers import StoppingCriteria, StoppingCriteriaList

    import exporters
    import probe
    from exporters._console import RecordProgress
    from probebus._load import check_sites, load_model

    sites = args.sites or "layers.*.resid_post"
    check_sites(args.model, sites)  # a bad pattern fails before gigabytes of weights load
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    total = len(prompts) * args.max_new_tokens
    try:
        session = probe.attach(model, sites, policy=args.policy, endpoint=args.endpoint)
    except (probe.SiteError, ValueError, zmq.ZMQError) as exc:
        raise LoadError(f"{exc}" if not isinstance(exc, zmq.ZMQError) else
                        f"cannot bind --endpoint {args.endpoint!r}: {exc}") from None
    with session:
        try:
            rec = exporters.ArrowRecorder(session, args.out, format=args.format, overwrite=args.overwrite,
                                          rotate_bytes=int(args.rotate_mb * (1 << 20)), model=model, tokenizer=tok,
                                          metadata={"model_arg": args.model})
            rec.start()
        except exporters.RecorderError as exc:
            raise LoadError(str(exc)) from None
        print(f"probe session {session.endpoint}  (watch it: probebus top {session.endpoint})", file=sys.stderr,
              flush=True)
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
                    enc = tok(chunk, return_tensors="pt", padding=True).to(model.device)
                    # The session issues seq_ids in batch-row order per prefill, from 0: prompt i is seq_id i.
                    rec.add_prompts(chunk, list(range(i, i + len(chunk))))
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
            print("probebus record: interrupted, finishing the files", file=sys.stderr)
        stop.finishing()
        session.close()  # everything staged reaches the recorder before it drains and stops
    return _finish(rec, args, console, stop)
