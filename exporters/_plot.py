"""PNG plots of a recording (matplotlib, the optional `plot` extra).

    paths = exporters.plot_recording("rec/", "plots/")   # [plots/norms_by_position.png, plots/norms_by_layer.png]

norms_by_position.png: a heatmap of the mean L2 norm of each site's activation (rows,
in model order) at each token position (columns), averaged over sequences; one panel and
colour scale per kind of site (resid_post, mlp_out, logits, ...), so logits' large norms
do not flatten the residual rows.
norms_by_layer.png: per kind of site (resid_post, resid_pre, ...), the mean norm by
layer with the 10-90 % band over tokens. One streaming pass over the files.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from ._reader import iter_recording
from ._recording import site_order
from ._schema import activation_values

MAX_POSITIONS = 4096  # wider recordings are binned so the heatmap stays readable


class PlotUnavailable(ImportError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("plots need matplotlib: pip install 'probebus[plot]'") from None
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def _norms(path: str | Path, sites: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, list]]:
    """Per site: sum and count of norms by position, and every norm (for quantiles)."""
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    every: dict[str, list] = defaultdict(list)
    for batch in iter_recording(path, sites=sites, columns=["site", "position", "activation"]):
        field = batch.schema.field("activation")
        flat = activation_values(field, batch.column("activation").flatten().to_numpy(zero_copy_only=False))
        norms = np.linalg.norm(flat.astype(np.float32, copy=False).reshape(batch.num_rows, -1), axis=1)
        pos = np.minimum(batch.column("position").to_numpy(), MAX_POSITIONS * 64 - 1)  # bounded memory
        col = batch.column("site")
        names = col.dictionary.to_pylist()
        codes = col.indices.to_numpy()
        for code in np.unique(codes):
            m = codes == code
            name = names[code]
            p = pos[m]
            size = int(p.max()) + 1
            s = sums.setdefault(name, np.zeros(size))
            c = counts.setdefault(name, np.zeros(size))
            if size > len(s):
                s = sums[name] = np.pad(s, (0, size - len(s)))
                c = counts[name] = np.pad(c, (0, size - len(c)))
            np.add.at(s, p, norms[m])
            np.add.at(c, p, 1)
            every[name].append(norms[m])
    return sums, counts, every


def _kind(site: str) -> str:
    """resid_post for layers.3.resid_post; the site itself for embed, final_norm, logits."""
    parts = site.split(".")
    return parts[2] if parts[0] == "layers" and len(parts) == 3 else site


def _panels(names: list[str]) -> list[tuple[str, list[int]]]:
    """(kind, row indices into names) per kind of site, in the order kinds first appear."""
    panels: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        panels.setdefault(_kind(n), []).append(i)
    return list(panels.items())


def plot_recording(path: str | Path, out_dir: str | Path, *, sites: Any = None, title: str | None = None) -> list[Path]:
    """Write norms_by_position.png and norms_by_layer.png into out_dir; returns their paths."""
    plt = _pyplot()
    sums, counts, every = _norms(path, sites)
    if not sums:
        raise ValueError(f"no rows in {path}{f' for sites {sites!r}' if sites else ''}: nothing to plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(sums, key=site_order)
    width = max(len(s) for s in sums.values())
    grid = np.full((len(names), width), np.nan)
    for i, n in enumerate(names):
        c = counts[n]
        grid[i, : len(c)] = np.where(c > 0, sums[n] / np.maximum(c, 1), np.nan)
    if width > MAX_POSITIONS:  # bin positions: mean over each bin
        step = -(-width // MAX_POSITIONS)
        grid = np.nanmean(np.pad(grid, ((0, 0), (0, -width % step)), constant_values=np.nan)
                          .reshape(len(names), -1, step), axis=2)
    label = title or str(path)
    panels = _panels(names)
    fig, axes = plt.subplots(len(panels), 1, squeeze=False, sharex=True,
                             figsize=(min(16, 4 + grid.shape[1] / 12), 1.2 + 0.28 * len(names) + 0.5 * len(panels)),
                             gridspec_kw={"height_ratios": [len(rows) + 1 for _, rows in panels]})
    for ax, (kind, rows) in zip(axes[:, 0], panels, strict=True):
        im = ax.imshow(grid[rows], aspect="auto", interpolation="nearest", cmap="viridis")  # its own scale
        ax.set_yticks(range(len(rows)), [names[r] for r in rows], fontsize=7)
        fig.colorbar(im, ax=ax, label=f"{kind} L2", pad=0.01)
    axes[-1, 0].set_xlabel("token position"
                           + (f" (bins of {-(-width // MAX_POSITIONS)})" if width > MAX_POSITIONS else ""))
    axes[0, 0].set_title(f"mean ‖activation‖ by site and position (a colour scale per kind) — {label}", fontsize=9)
    fig.tight_layout()
    first = out / "norms_by_position.png"
    fig.savefig(first, dpi=110)
    plt.close(fig)

    kinds: dict[str, list[tuple[int, np.ndarray]]] = defaultdict(list)
    for n in names:
        parts = n.split(".")
        if parts[0] == "layers" and len(parts) == 3 and parts[1].lstrip("-").isdigit():
            kinds[parts[2]].append((int(parts[1]), np.concatenate(every[n])))
    second = out / "norms_by_layer.png"
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, rows in sorted(kinds.items()):
        rows.sort(key=lambda r: r[0])
        layers = [r[0] for r in rows]
        mean = [float(r[1].mean()) for r in rows]
        lo = [float(np.quantile(r[1], 0.1)) for r in rows]
        hi = [float(np.quantile(r[1], 0.9)) for r in rows]
        ax.plot(layers, mean, marker="o", label=kind)
        ax.fill_between(layers, lo, hi, alpha=0.2)
    ax.set_xlabel("layer")
    ax.set_ylabel("‖activation‖ (mean, 10-90 % band)")
    ax.set_title(f"activation norm by layer — {label}", fontsize=9)
    if kinds:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no per-layer sites recorded", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [first, second]
