"""The console entry point end to end on the shipped model: demo, sites, record, generate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import exporters

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "probebus", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    res = _run("demo", "--keep", str(tmp_path / "rec"), "--max-new-tokens", "16")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "recording:" in res.stdout and "layers.7.resid_post" in res.stdout
    info = exporters.summarize_recording(tmp_path / "rec")
    sites = {r["site"]: r for r in info["sites"]}
    assert len(sites) == 9 and len({r["rows"] for r in sites.values()}) == 1  # 8 resid_post + final_norm
    assert all(r["sequences"] == 4 for r in sites.values())


def _main_io(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """The same entry point in this process (each fresh interpreter costs ~6 s of imports): (code, stdout, stderr)."""
    from probebus.cli import main

    code = main(list(args))
    got = capsys.readouterr()
    return code, got.out, got.err


def _main(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`_main_io` without stdout: (code, stderr)."""
    code, _, err = _main_io(capsys, *args)
    return code, err


def test_sites_of_the_default_model(capsys: pytest.CaptureFixture) -> None:
    res = _run("sites", "default", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["n_layers"] == 8 and out["family"] == "llama-like" and "layers.5.resid_pre" in out["sites"]
    code, err = _main(capsys, "sites", "default", "--match", "layers.8.resid_post")
    assert code == 2 and "out of range; the model has 8 layers" in err


@pytest.mark.parametrize("command", ["sites", "demo", "record", "inspect", "top", "generate", "train-drafter"])
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture) -> None:
    """In this process (argparse's exit included): every subcommand also runs as `python -m probebus` in a fresh
    interpreter elsewhere in the suite, and seven more interpreters cost ~10 s of imports."""
    from probebus.cli import main

    with pytest.raises(SystemExit) as end:
        main([command, "--help"])
    assert end.value.code == 0 and "usage: probebus " + command in capsys.readouterr().out


def test_generate_json_with_the_default_drafter_matches_no_drafter(capsys: pytest.CaptureFixture) -> None:
    args = ("generate", "--model", "default", "--prompt", "def parse_args(argv):\n", "--max-new-tokens", "24",
            "--json")
    res = _run(*args, "--drafter", "default")  # one fresh process end to end; the others in this one
    assert res.returncode == 0, res.stderr[-2000:]
    outs = {"default": json.loads(res.stdout.strip().splitlines()[-1])}
    for drafter in ("none", "ngram"):
        code, out, _ = _main_io(capsys, *args, "--drafter", drafter)
        assert code == 0
        outs[drafter] = json.loads(out.strip().splitlines()[-1])
    # Whether scheduled drafting pays depends on this machine's measured costs at the moment (a loaded machine
    # may rightly take plain steps): the scheduled runs are checked for the output only, `--fixed` for the
    # drafter's work (it drafts every round, whatever the costs), and the speed-up belongs to the benchmarks.
    code, out, _ = _main_io(capsys, *args, "--drafter", "default", "--fixed")
    assert code == 0
    outs["fixed"] = json.loads(out.strip().splitlines()[-1])
    assert outs["default"]["token_ids"] == outs["none"]["token_ids"] == outs["ngram"]["token_ids"] == \
        outs["fixed"]["token_ids"]
    assert outs["default"]["text"] and outs["none"]["stats"]["tau"] == 1.0
    fixed = outs["fixed"]["stats"]
    assert fixed["model_rounds"] == fixed["rounds"] > 0 and 0 < fixed["drafted"] <= 5 * fixed["rounds"]
    assert fixed["accepted"] > 0 and fixed["tau"] > 1.0  # the shipped head's drafts are right on this prompt
    code, err = _main(capsys, "generate", "--model", "default", "--drafter", "/nonexistent", "--prompt", "x")
    assert code == 2 and "not a name" in err and "nor a folder" in err


@pytest.mark.parametrize("command", ["sites", "demo", "record", "inspect", "top"])
def test_every_option_has_help_text(command: str) -> None:
    from probebus.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    missing = [a.option_strings or a.dest for a in sub._actions if not a.help and a.dest != "help"]
    assert not missing, f"{command}: options without help text: {missing}"


@pytest.mark.parametrize("delay", [0.2, 0.6, 1.2, 2.0, 3.5])
def test_sigint_at_any_point_of_start_up_ends_with_one_line(delay: float) -> None:
    """Ctrl-C while probebus imports torch, loads the model or generates: one line, exit 130. It printed
    tracebacks (KeyboardInterrupt inside an import, rc -2 or 1, once `ImportError: cannot load module more than
    once per process`). Where the signal lands depends on the machine's speed; every point must end the same."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "probebus", "generate", "--model", "default", "--prompt", "x",
                             "--max-new-tokens", "1000", "--drafter", "none"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "Traceback" not in err, err[-3000:]
    if proc.returncode == -signal.SIGINT and not err:  # so loaded a machine that Python had not started yet:
        return  # the signal's default action ended it, silently, before any of our code could run
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert err.strip().splitlines()[-1] == "probebus generate: interrupted", err[-3000:]
