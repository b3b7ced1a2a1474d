"""What `probebus train-drafter` prints at its end: a table like the other commands' (or the metrics as JSON).

    console.print(train_table("eagle3", metrics, "my-drafter/"))
    print(heldout_note(metrics, holdout=0.05))   # None, or why no held-out report was made
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

# metric key -> label, in the order rows are shown; other scalar keys follow under their own names
LABELS = {"sequences": "sequences trained on", "heldout_sequences": "sequences held out", "positions": "positions",
          "tokens": "tokens", "window": "window", "resumed_from": "resumed from step", "step": "steps",
          "loss": "final loss", "acc": "train accuracy by position", "seconds": "seconds"}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def train_table(method: str, metrics: dict[str, Any], out: str) -> Table:
    """One row per metric; the held-out report (acceptance by draft position, tau) last."""
    t = Table(title=f"{method} drafter -> {out}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    keys = [k for k in LABELS if k in metrics] + [k for k in metrics if k not in LABELS]
    for k in keys:
        v = metrics[k]
        if k in ("heldout", "table") or isinstance(v, dict):
            continue
        t.add_row(LABELS.get(k, k.replace("_", " ")), _fmt(v))
    held = metrics.get("heldout")
    if isinstance(held, dict):
        for k, v in held.items():
            if k == "acceptance":
                t.add_row("held-out acceptance by position", _fmt(v))
            elif not isinstance(v, dict):
                t.add_row(f"held-out {k.replace('_', ' ')}", _fmt(v))
    elif "heldout_sequences" in metrics:
        t.add_row("held-out report", "none (no sequence held out)")
    return t


def heldout_note(metrics: dict[str, Any], holdout: float) -> str | None:
    """One line when no held-out report was made, saying why and what to do."""
    if metrics.get("heldout") or "heldout_sequences" not in metrics:
        return None
    if holdout <= 0:
        return "no held-out report: --holdout 0"
    return ("no held-out report: the recording has too few usable sequences to hold one out (record more prompts, "
            "e.g. probebus record --prompts FILE)")
