"""`probebus generate` / `serve-drafter` on the shipped model: streaming, plots, the probe endpoint, and one clear
line (exit 2) for every bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from probebus.cli import main
from probebus.models import DEFAULT_MODEL_DIR

DRAFTER = DEFAULT_MODEL_DIR.parent / "default-drafter"


def _run(argv: list[str]) -> int:
    """main's exit status, whether it returns it or raises SystemExit (usage errors may do either)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def _one_line_error(capsys, code: int, startswith: str) -> None:
    assert code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("Loading")]
    assert len(err) == 1, err
    assert err[0].startswith(startswith) and "Traceback" not in err[0], err[0]


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "-1"], "probebus generate: --max-new-tokens must be at least 1"),
    (["--max-new-tokens", "0"], "probebus generate: --max-new-tokens must be at least 1"),
    (["--batch-size", "0"], "probebus generate: --batch-size must be at least 1"),
    (["--k", "0"], "probebus generate: --k must be between 1 and 16"),
    (["--top-p", "1.5"], "probebus generate: --top-p must be in (0, 1]"),
    (["--drafter", "none", "--endpoint", "tcp://127.0.0.1:5999"], "probebus generate: --endpoint"),
])
def test_bad_generate_options(capsys, args: list[str], message: str) -> None:
    _one_line_error(capsys, _run(["generate", "--prompt", "def f(", *args]), message)


def test_bad_prompts_file_and_bad_drafter_weights(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    assert _run(["generate", "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not UTF-8 text" in err[0]
    broken = tmp_path / "drafter"
    shutil.copytree(DRAFTER, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    _one_line_error(capsys, _run(["generate", "--prompt", "x", "--drafter", str(broken)]), "probebus generate: ")
    _one_line_error(capsys, _run(["serve-drafter", "--drafter", str(broken)]), "probebus serve-drafter: ")


def test_stream_prints_the_same_text_as_it_is_accepted(capsys) -> None:
    base = ["generate", "--prompt", "def parse(line):\n", "--max-new-tokens", "24", "--drafter", "auto"]
    assert main(base + ["--no-stream"]) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--stream"]) == 0
    streamed = capsys.readouterr().out
    assert streamed == plain and streamed.startswith("def parse(line):\n") and len(streamed) > 20


def test_plot_and_endpoint(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    endpoint = f"ipc://{tmp_path}/gen.sock"
    assert main(["generate", "--prompt", "import os\n", "--max-new-tokens", "16", "--plot", str(tmp_path / "plots"),
                 "--endpoint", endpoint, "--json", "--fixed"]) == 0
    cap = capsys.readouterr()
    assert f"probe session: {endpoint}" in cap.err
    row = json.loads(cap.out.strip().splitlines()[-1])
    assert len(row["token_ids"]) == 16 and row["stats"]["model_rounds"] > 0
    for name in ("acceptance_by_position.png", "acceptance_by_round.png"):
        png = tmp_path / "plots" / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_option_has_help_text() -> None:
    from probebus.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in ("generate", "train-drafter", "serve-drafter"):
        bare = [a.option_strings for a in sub.choices[name]._actions if a.option_strings and not a.help]
        assert not bare, (name, bare)


@pytest.mark.parametrize(("flags", "prompts", "compiled"), [
    ([], 1, False), ([], 200, "plain"), (["--max-new-tokens", "8"], 200, False),
    (["--batch-size", "4"], 200, False), (["--compiled"], 1, True), (["--compiled-auto"], 1, "auto"),
    (["--eager"], 200, False)])
def test_compile_flags_reach_the_decoder(flags: list[str], prompts: int, compiled: object) -> None:
    """--compiled, --compiled-auto and --eager reach the decoder as compiled=True / "auto" / False; they exclude each
    other. Without them, the decoder's default ("plain": its plain steps compiled, from the second call) where
    the batch-1 prompts after the first hold enough tokens to repay the compile, else eager."""
    from probebus._cmd_generate import compile_mode, make_decoder
    from probebus._load import load_model
    from probebus.cli import build_parser

    args = build_parser().parse_args(["generate", *flags, "--prompt", "def f(x):"])  # (64 new tokens by default)
    model, _ = load_model("default")
    with make_decoder(model, "ngram", None, compiled=compile_mode(args, prompts)) as spec:
        assert spec.compiled == compiled and spec.compiles(1) is (compiled is True)
        spec.calls = 1  # (a second call's view)
        assert spec.compiles_plain(1) is (compiled is not False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--compiled", "--compiled-auto", "--prompt", "x"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--compiled", "--eager", "--prompt", "x"])
