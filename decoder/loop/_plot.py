"""Pictures of a speculative run: acceptance by draft position and by round (matplotlib, optional).

    paths = plot_stats([out.stats], "plots/")   # acceptance_by_position.png, acceptance_by_round.png
"""

from __future__ import annotations

from pathlib import Path

from ._run import SpecStats


def plot_stats(stats: list[SpecStats], folder: str | Path, title: str = "") -> list[Path]:
    """Write two PNGs for one or more generate calls; raises ImportError without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'probebus[plot]'") from exc
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    k = max((len(s.offered_at) for s in stats), default=0)
    offered = [sum(s.offered_at[i] for s in stats if i < len(s.offered_at)) for i in range(k)]
    accepted = [sum(s.accepted_at[i] for s in stats if i < len(s.accepted_at)) for i in range(k)]
    rate = [a / o if o else 0.0 for a, o in zip(accepted, offered, strict=True)]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(range(1, k + 1), rate, color="#4477aa")
    for i, (r, o) in enumerate(zip(rate, offered, strict=True)):
        ax.text(i + 1, r + 0.01, f"{r:.2f}\n(n={o})", ha="center", va="bottom", fontsize=7)
    ax.set(xlabel="draft position", ylabel="accepted / offered", ylim=(0, 1.15),
           title=title or "acceptance by draft position")
    fig.tight_layout()
    paths.append(folder / "acceptance_by_position.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    rounds = [h for s in stats for h in s.history]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = range(1, len(rounds) + 1)
    per_row = [(h[3] / h[1]) if h[1] else 0.0 for h in rounds]  # accepted drafts per active row
    offered_row = [(h[2] / h[1]) if h[1] else 0.0 for h in rounds]
    ax.plot(x, offered_row, color="#bbbbbb", lw=1, label="drafts offered per row")
    ax.plot(x, per_row, color="#228833", lw=1.2, label="drafts accepted per row")
    ax.set(xlabel="round", ylabel="tokens", title=title or "acceptance by round")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    paths.append(folder / "acceptance_by_round.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
