"""What a first day with the command line hits, on the shipped model and real recordings: plots scaled per kind of
site, site patterns as people type them, tables not clipped when stdout is not a terminal, plurals, an
interrupted recording's summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from probebus.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **extra}


def _probebus(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "probebus", *args], cwd=cwd, env=_env(**env), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`probebus record` of the default model: every resid_post and the logits (norms ~10x apart)."""
    out = tmp_path_factory.mktemp("rec") / "rec"
    r = _probebus("record", "--model", "default", "--prompt", "def parse(argv):\n", "--max-new-tokens", "6",
                  "--sites", "layers.*.resid_post,logits", "--out", str(out), cwd=out.parent)
    assert r.returncode == 0, r.stderr
    return out


def test_inspect_plot_scales_each_kind_of_site_on_its_own(recording: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    saved: dict[str, Figure] = {}
    real = Figure.savefig

    def keep(fig: Figure, fname: object, *a: object, **k: object) -> None:
        saved[Path(str(fname)).name] = fig
        real(fig, fname, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    assert main(["inspect", str(recording), "--plot", str(tmp_path / "plots")]) == 0
    fig = saved["norms_by_position.png"]
    images = [(ax, im) for ax in fig.axes for im in ax.get_images()]
    labels = {tuple(t.get_text() for t in ax.get_yticklabels()): im for ax, im in images}
    resid = next(im for names, im in labels.items() if "layers.0.resid_post" in names)
    logits = next(im for names, im in labels.items() if names == ("logits",))
    assert resid is not logits
    for im in (resid, logits):  # each panel's colours span its own rows' norms
        data = np.asarray(im.get_array(), dtype=float)
        assert im.get_clim() == pytest.approx((np.nanmin(data), np.nanmax(data)))
    assert resid.get_clim()[1] < logits.get_clim()[0] or logits.get_clim()[1] < resid.get_clim()[0]
