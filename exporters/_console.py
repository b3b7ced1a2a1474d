"""rich renderings for the CLI: recording progress, `inspect` tables, the `top` live view.

    with RecordProgress(console, total_tokens=256) as bar:
        bar.update(tokens=8, stats=recorder.stats)
    console.print(summary_table(recorder.summary))
    console.print(inspect_view(exporters.summarize_recording("rec/")))
    console.print(top_table(monitor.totals()))
"""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ._manifest import RecordingSummary

_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}


#: columns when the stream is not a terminal (a log, CI, `tee`): wide enough that no table or progress line is
#: clipped or wrapped; COLUMNS, when set, wins
PIPE_WIDTH = 200


def make_console(*, stderr: bool = False) -> Console:
    """A rich Console that writes plain text when the stream is not a terminal, and honours NO_COLOR; not a
    terminal, it is PIPE_WIDTH columns wide instead of rich's 80, so tables keep their numbers."""
    import os
    import sys

    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    width = None if tty or os.environ.get("COLUMNS") else PIPE_WIDTH
    return Console(file=stream, stderr=stderr, force_terminal=tty, no_color=bool(os.environ.get("NO_COLOR")) or not tty,
                   highlight=tty, emoji=False, width=width)


def plural(n: int, word: str) -> str:
    """'1 file', '2 files'."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


class RecordProgress:
    """A progress bar with tokens/s, captures/s, MB/s written and drops (total None: no bar, counts only)."""

    def __init__(self, console: Console, total_tokens: int | None, *, unit: str = "tok") -> None:
        self.unit = unit
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[tok_s]:>8.1f} " + unit + "/s"), TextColumn("{task.fields[cap_s]:>8.1f} cap/s"),
            TextColumn("{task.fields[mb_s]:>7.2f} MB/s"), TextColumn("drops {task.fields[drops]}"),
            TimeElapsedColumn(), console=console, transient=False, refresh_per_second=4)
        self.task = self.progress.add_task("recording", total=total_tokens, tok_s=0.0, cap_s=0.0, mb_s=0.0, drops=0)
        self.t0 = time.monotonic()
        self._last = 0.0

    def __enter__(self) -> RecordProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, tokens: int, stats: RecordingSummary, *, force: bool = False,
               description: str | None = None) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.2:  # called every decode step: keep it cheap
            return
        self._last = now
        dt = max(now - self.t0, 1e-9)
        drops = stats.dropped + (stats.publisher_dropped or 0)
        kw: dict[str, Any] = {"completed": tokens, "tok_s": tokens / dt, "cap_s": stats.received / dt,
                              "mb_s": stats.bytes / dt / 1e6, "drops": drops}
        if description is not None:
            kw["description"] = description
        self.progress.update(self.task, **kw)


def summary_table(s: RecordingSummary, *, interrupted_by: str | None = None) -> Table:
    """A recording's summary; `interrupted_by` (a signal's name) when it was cut short on purpose."""
    t = Table(title=f"recording {s.path}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    status = "[green]complete" if s.clean else ("[red]failed" if s.error else "[yellow]incomplete")
    if interrupted_by and not s.error:
        status = f"[yellow]stopped by {interrupted_by}[/] (files and manifest complete up to there)"
    rows = [("status", status), ("rows", f"{s.rows:,}"), ("captures", f"{s.captures:,} of {s.received:,} received"),
            ("bytes", f"{_mb(s.bytes)} MB in {plural(len(s.files), 'file')}"), ("seconds", f"{s.seconds:.2f}"),
            ("lost", f"{s.dropped} (missed on the bus {s.missed}, unwritten {s.unwritten}; "
                     f"{plural(s.malformed, 'malformed frame')} ignored)")]
    if s.publisher_dropped is not None:
        rows.append(("publisher dropped", str(s.publisher_dropped)))
    if s.truncated:
        rows.append(("truncated", "stop timed out while captures were still arriving"))
    if s.error:
        rows.append(("error", Text(s.error, style="red")))
    for k, v in rows:
        t.add_row(k, v)
    return t


def inspect_view(info: dict[str, Any]) -> Group:
    head = Table(show_header=False, box=None)
    head.add_column(style="bold")
    head.add_column()
    state = info["state"]
    color = "green" if info.get("clean") else ("red" if state == "failed" else "yellow")
    head.add_row("recording", Text(info["path"]))
    head.add_row("state", f"[{color}]{state}")
    head.add_row("model", Text(f"{info.get('model') or '?'}  (config {info.get('config_hash') or '?'})"))
    head.add_row("probebus", f"{info.get('probebus_version') or '?'}, {info.get('file_format') or '?'} files")
    head.add_row("files", f"{len(info['files'])} complete, {len(info['partial_files'])} in progress "
                          f"({plural(info['salvaged_rows'], 'row')} readable in them)")
    head.add_row("total", f"{plural(info['rows'], 'row')}, {_mb(info['bytes'])} MB of activations")
    if info.get("requests"):
        head.add_row("requests", f"{info['requests']:,} vLLM requests mapped to seq_ids (Recording.request)")
    if info.get("lost") not in (None, "nothing"):
        head.add_row("lost", Text(str(info["lost"]), style="yellow"))
    if info.get("interrupted_by"):
        head.add_row("interrupted", f"by {info['interrupted_by']} (files and manifest complete up to there)")
    if info.get("error"):
        head.add_row("error", Text(str(info["error"]), style="red"))
    # Compact enough for an 80-column pipe; the site name already says the layer.
    t = Table(title="per site", title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col in ("site", "rows", "seqs", "tokens", "MB", "dtype", "mean‖a‖", "max‖a‖"):
        t.add_column(col, justify="left" if col in ("site", "dtype") else "right", no_wrap=col == "site")
    for r in info["sites"]:
        t.add_row(Text(r["site"]), f"{r['rows']:,}", f"{r['sequences']:,}", f"{r['tokens']:,}", _mb(r["bytes"]),
                  f"{_SHORT.get(r['dtype'], r['dtype'])}×{r['hidden']}", f"{r['norm_mean']:.4g}",
                  f"{r['norm_max']:.4g}")
    return Group(head, t)


def top_table(totals: dict[str, Any]) -> Table:
    busy = totals["busy"]
    note = " [red](monitor saturated: numbers trail the session)" if busy > 0.9 else ""
    ended = " [yellow](session ended)" if totals.get("ended") else ""
    t = Table(title=f"probebus top  {escape(totals['endpoint'])}  runs {escape(', '.join(totals['runs']) or '-')}  "
                    f"max step {totals['max_step']}  busy {busy:.0%}{note}{ended}", title_justify="left",
              box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col in ("site", "cap/s", "tok/s", "MB/s", "captures", "MB", "missed", "lag ms", "lag steps", "idle s"):
        t.add_column(col, justify="left" if col == "site" else "right", no_wrap=col == "site")
    for r in totals["sites"]:
        drops = Text(str(r["gaps"]), style="red" if r["gaps"] else "")
        lag = "-" if r.get("lag_s") is None else f"{r['lag_s'] * 1000:.1f}"
        t.add_row(Text(r["site"]), f"{r['captures_per_s']:.1f}", f"{r['tokens_per_s']:.1f}",
                  f"{r['bytes_per_s'] / 1e6:.2f}", f"{r['captures']:,}", _mb(r["bytes"]), drops, lag,
                  str(r["lag_steps"]), f"{r['idle_s']:.1f}")
    t.caption = (f"{totals['captures']:,} captures, {_mb(totals['bytes'])} MB, {totals['captures_per_s']:.1f} cap/s, "
                 f"{totals['bytes_per_s'] / 1e6:.2f} MB/s, missed {totals['gaps']}, malformed {totals['malformed']}")
    return t
