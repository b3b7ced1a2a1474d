"""What a first day with the command line hits, on the shipped model and real recordings: plots scaled per kind of
site, site patterns as people type them, tables not clipped when stdout is not a terminal, plurals. An
interrupted recording's status line is checked in tests/test_exporters_hardening.py, on the one it interrupts."""

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


def _sites(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    """`probebus sites default --json ARGS`: exit status, the selected site names, stderr."""
    try:
        code = main(["sites", "default", "--json", *args])
    except SystemExit as exc:
        code = int(exc.code or 0)
    cap = capsys.readouterr()
    import json

    return code, (json.loads(cap.out)["sites"] if code == 0 else []), cap.err


RESID_POST = [f"layers.{i}.resid_post" for i in range(8)]


@pytest.mark.parametrize("pattern, want", [
    ("layers.*.resid_post", RESID_POST),                      # the strict grammar, unchanged
    ("layers.0:8.mlp_out", [f"layers.{i}.mlp_out" for i in range(8)]),
    ("layers.-3.resid_pre", ["layers.5.resid_pre"]),
    ("resid_post", RESID_POST),                               # part of a name
    ("*.resid_post", RESID_POST),                             # a shell glob
    ("layers.[12].mlp_out", ["layers.1.mlp_out", "layers.2.mlp_out"]),
    ("layers.3", [f"layers.3.{n}" for n in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")]),
    ("final", ["final_norm"]),
])
def test_sites_match_accepts_patterns_people_type(pattern: str, want: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, listing, err = _sites(capsys, "--match", pattern)
    assert code == 0, err
    assert listing == want


def test_a_pattern_that_selects_nothing_explains_the_grammar(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _sites(capsys, "--match", "residual_post")
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("Loading")]
    assert code == 2 and len(lines) == 1, err
    for part in ("'residual_post'", "layers.SEL.NAME", "shell glob", "part of a name", "available sites"):
        assert part in lines[0], lines[0]


def test_a_subscriber_takes_loose_patterns_too() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import probe
    from probebus.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("default")).eval()
    tok = AutoTokenizer.from_pretrained(resolve_model("default"))
    with probe.attach(model, "*.resid_post,logits") as session:
        sub = probe.Subscriber(session.endpoint, sites="resid_post")
        session.wait_for_subscribers(1)
        with torch.no_grad():
            model.generate(**tok(["import os\n"], return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert {cap.site for cap in sub} == set(RESID_POST)
    with pytest.raises(probe.SiteError, match="part of a name"):
        probe.SiteMatcher("residual_post")


def test_tables_are_not_clipped_when_stdout_is_not_a_terminal(tmp_path: Path) -> None:
    """Piped (a log, CI, tee): rich's 80 columns wrapped the summary's rows; every row stays on one line."""
    r = _probebus("record", "--model", "default", "--prompt", "import os\n", "--max-new-tokens", "3", "--sites",
                  "layers.0.resid_post", "--out", str(tmp_path / "rec"), cwd=tmp_path, COLUMNS="")  # (pytest-xdist's
    # workers have COLUMNS set, which wins over the pipe's width)
    assert r.returncode == 0, r.stderr
    lost = [ln for ln in r.stderr.splitlines() if "lost" in ln]
    assert len(lost) == 1 and "malformed frames ignored)" in lost[0], r.stderr
    assert "in 1 file " in r.stderr and "1 files" not in r.stderr  # one site, one shape: one file
    r = _probebus("inspect", str(tmp_path / "rec"), cwd=tmp_path, COLUMNS="")
    assert r.returncode == 0 and "\x1b[" not in r.stdout
    assert any("model" in ln and "(config " in ln and ln.rstrip().endswith(")") for ln in r.stdout.splitlines())


def test_train_drafter_on_a_small_recording_holds_one_out_and_ends_with_a_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The recording and the --holdout 0 run in this process (`record` runs in a fresh one in the fixture above),
    the run that prints the table in a fresh one."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\nimport os\nclass Queue:\nfor i in range(10):\n")
    monkeypatch.chdir(tmp_path)
    assert main(["record", "--model", "default", "--prompts", str(prompts), "--sites",
                 "layers.2.resid_pre,layers.4.resid_pre,layers.5.resid_pre", "--max-new-tokens", "24", "--out",
                 str(tmp_path / "rec")]) == 0, capsys.readouterr().err
    r = _probebus("train-drafter", "--model", "default", "--recording", str(tmp_path / "rec"), "--out",
                  str(tmp_path / "drafter"), "--steps", "3", "--window", "16", "--batch", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not r.stdout.lstrip().startswith("{")  # a table, not a raw dict
    rows = {ln.split("│")[1].strip(): ln.split("│")[2].strip() for ln in r.stdout.splitlines() if ln.count("│") >= 3}
    assert rows["sequences held out"] == "1" and rows["sequences trained on"] == "3", r.stdout
    assert rows["held-out acceptance by position"].startswith("["), r.stdout
    assert "no held-out report" not in r.stderr
    capsys.readouterr()
    code = main(["train-drafter", "--model", "default", "--recording", str(tmp_path / "rec"), "--out",
                 str(tmp_path / "d0"), "--steps", "2", "--window", "16", "--batch", "2", "--holdout", "0", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    import json

    assert json.loads(out.strip().splitlines()[-1])["heldout_sequences"] == 0
    assert "probebus train-drafter: no held-out report: --holdout 0" in err  # said, not silently skipped


def test_a_recording_into_datasets(recording: Path) -> None:
    """datasets.Dataset wants a pyarrow.Table: `recording.table` works, and passing the Recording itself fails with
    an error that says to pass `recording.table` (datasets prints what it got)."""
    datasets = pytest.importorskip("datasets")
    import exporters

    rec = exporters.read_recording(recording)
    ds = datasets.Dataset(rec.table)
    assert ds.num_rows == rec.num_rows and set(ds["site"]) == set(rec.sites)
    with pytest.raises(TypeError, match=r"pass recording\.table"):
        datasets.Dataset(rec)
    assert "1 sequence," in repr(rec) and "1 sequences" not in repr(rec)
