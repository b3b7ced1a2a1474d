"""`probebus demo`: the whole product on the shipped model, offline, in well under a minute.

    probebus demo                      # default model, 4 held-out code prompts
    probebus demo --keep out/          # keep the recording instead of a temp folder

Attaches probes to every layer's residual stream, generates while a live view (a bus
subscriber) shows per-site rates and an Arrow recorder (another subscriber) writes to
disk, then prints an `inspect` summary of the files and where they are.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="probe, watch and record the shipped model (offline, < 1 min)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | PATH (default: %(default)s)")
    p.add_argument("--sites", default="layers.*.resid_post,final_norm",
                   help="site patterns to probe, comma separated (default: %(default)s; see `probebus sites MODEL`)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens to generate per prompt, >= 1 "
                   "(default: %(default)s)")
    p.add_argument("--keep", metavar="DIR", help="write the recording here instead of a temporary folder")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="weights dtype; auto = the checkpoint's (float32 on a CPU without native half precision) "
                        "(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps | auto (default: %(default)s)")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from rich.live import Live
    from rich.panel import Panel
    from rich.text import Text

    import exporters
    import probe
    from exporters._console import inspect_view, make_console, plural, top_table
    from probebus._load import LoadError, load_model

    if args.max_new_tokens < 1:
        raise LoadError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.keep and exporters._files.existing_recording(args.keep):
        raise LoadError(f"{args.keep} already holds a recording; pick a new --keep folder")
    console = make_console()
    t_start = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
    try:
        from probebus._code_prompts import code_prompts

        prompts = code_prompts("heldout", 4)
    except (ValueError, OSError):  # another interpreter's stdlib: fall back to fixed prompts
        prompts = ["def fibonacci(n):\n", "class Stack:\n    def push(self, item):\n", "import os\n\ndef walk(",
                   "def parse_args(argv):\n"]
    out_dir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="probebus-demo-"))
    console.print(f"[bold]probebus demo[/]: {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
                  f"params, {str(model.dtype).removeprefix('torch.')}, {model.device}), sites [cyan]{args.sites}[/], "
                  f"{len(prompts)} prompts x {args.max_new_tokens} tokens", highlight=False)
    enc = tok(prompts, return_tensors="pt", padding=True).to(model.device)
    done = threading.Event()
    result: dict = {}

    def run() -> None:
        try:
            result["seq"] = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                           pad_token_id=tok.pad_token_id)
        except BaseException as exc:  # surfaced below, in the main thread
            result["error"] = exc
        finally:
            done.set()

    try:
        session = probe.attach(model, args.sites)
    except (probe.SiteError, ValueError) as exc:
        raise LoadError(str(exc)) from None
    with session:
        recorder = exporters.ArrowRecorder(session, out_dir, tokenizer=tok).start()
        recorder.add_prompts(prompts, list(range(len(prompts))))
        console.print(f"probe session {session.endpoint}  (another terminal: probebus top {session.endpoint})",
                      highlight=False, markup=False)
        monitor = exporters.TopMonitor(session.endpoint)
        session.wait_for_subscribers(2)
        worker = threading.Thread(target=run, name="generate")
        worker.start()
        with Live(top_table(monitor.totals()), console=console, refresh_per_second=4) as live:
            while not done.is_set():
                monitor.poll(0.25)
                live.update(top_table(monitor.totals()))
            monitor.poll(0.3)
            live.update(top_table(monitor.totals()))
        worker.join()
    summary = recorder.stop()
    monitor.close()
    if "error" in result:
        raise result["error"]
    stats = session.stats
    for r, prompt in enumerate(prompts[:2]):
        new = result["seq"][r, enc.input_ids.shape[1]:]
        text = Text(prompt)
        text.append(tok.decode(new, skip_special_tokens=True), style="bold green")
        console.print(Panel(text, title=f"sample {r + 1}", title_align="left"))
    console.print(inspect_view(exporters.summarize_recording(out_dir)))
    console.print(f"bus: {stats.captured} captured, {stats.published} published, {stats.dropped} dropped, "
                  f"{stats.bytes / 1e6:.1f} MB, producer stall {stats.stall_seconds * 1000:.0f} ms; "
                  f"recorder: {plural(summary.rows, 'row')} in {plural(len(summary.files), 'file')}")
    console.print(f"[bold]recording:[/] {out_dir}   (read it: exporters.read_recording('{out_dir}'), "
                  f"`probebus inspect {out_dir}`, DuckDB or polars)")
    console.print(f"next: probebus generate --model {args.model} --drafter default --prompt 'def parse(' "
                  f"   [dim](done in {time.perf_counter() - t_start:.1f} s)[/]")
    return 0
