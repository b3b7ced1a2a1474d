"""`probebus generate` with default flags on a model that ships no drafter (a random Qwen2 saved with a tokenizer):
it drafts with n-gram and says so in one line; a drafter served by `probebus serve-drafter` is used by address."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from probebus.cli import main
from probebus.models import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def my_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Qwen2 with the default model's tokenizer, saved as a user's own model folder."""
    out = tmp_path_factory.mktemp("models") / "my-model"
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _gen(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(["generate", *argv])
    except SystemExit as exc:
        code = int(exc.code or 0)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.parametrize("drafter", [[], ["--drafter", "auto"]])
def test_default_flags_work_on_a_model_without_a_drafter(my_model: Path, drafter: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _gen(["--model", str(my_model), "--prompt", "def f(x):\n", "--max-new-tokens", "12",
                           "--no-stream", *drafter], capsys)
    assert code == 0, err
    note = [ln for ln in err.splitlines() if "n-gram" in ln and "drafting with" in ln]
    assert len(note) == 1 and "no trained drafter beside" in note[0], err
    assert "Traceback" not in err and out.startswith("def f(x):\n")
    code, plain, _ = _gen(["--model", str(my_model), "--prompt", "def f(x):\n", "--max-new-tokens", "12",
                           "--no-stream", "--drafter", "none"], capsys)
    assert code == 0 and plain == out  # greedy n-gram drafts are lossless


def test_a_named_drafter_the_model_lacks_points_at_auto(my_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _gen(["--model", str(my_model), "--prompt", "x", "--drafter", "default"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "--drafter auto" in lines[0], err


def test_old_spelling_default_still_names_the_eagle3_head(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _gen(["--prompt", "import os\n", "--max-new-tokens", "12", "--no-stream", "--drafter",
                           "default", "--json"], capsys)
    assert code == 0, err
    assert '"model_rounds": 0' not in out and "drafting with n-gram" not in err


def test_unknown_drafter_lists_every_choice(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _gen(["--prompt", "x", "--drafter", "eagle4"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    for word in ("auto", "none", "ngram", "medusa", "tcp://", "serve-drafter"):
        assert word in lines[0], lines[0]


def test_help_lists_every_drafter(capsys: pytest.CaptureFixture[str]) -> None:
    from probebus._cmd_decoder import DRAFTER_NAMES

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in DRAFTER_NAMES:
        assert name in text, name
    assert "tcp://" in text and "serve-drafter" in text


def test_served_drafter_by_address(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    address = f"ipc://{tmp_path}/drafter.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "probebus", "serve-drafter", "--bind", address, "--model",
                               "default"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "drafter.sock").exists():  # bound: the server is up
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read() if server.stderr else ""
            time.sleep(0.2)
        code, out, err = _gen(["--prompt", "def parse(argv):\n", "--max-new-tokens", "16", "--no-stream", "--json",
                               "--drafter", address], capsys)
        assert code == 0, err
    finally:
        server.terminate()
        server.wait(30)
    import json

    row = json.loads(out.strip().splitlines()[-1])
    assert row["stats"]["model_rounds"] > 0  # the served head drafted
    code, plain, _ = _gen(["--prompt", "def parse(argv):\n", "--max-new-tokens", "16", "--no-stream", "--json",
                           "--drafter", "none"], capsys)
    assert json.loads(plain.strip().splitlines()[-1])["token_ids"] == row["token_ids"]


def test_several_prompts_without_streaming_are_separated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from probebus._cmd_decoder import SEPARATOR

    prompts = ["def add(a, b):\n", "import os\n", "class Queue:\n"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": {p!r}}}\n'.replace("'", '"') for p in prompts))
    for extra in (["--no-stream"], ["--no-stream", "--batch-size", "2"], ["--stream"]):
        code, out, err = _gen(["--prompts", str(path), "--max-new-tokens", "6", "--drafter", "none", *extra], capsys)
        assert code == 0, err
        parts = out.split(SEPARATOR + "\n")
        assert len(parts) == 3, (extra, out)
        for part, prompt in zip(parts, prompts, strict=True):
            assert part.startswith(prompt) and len(part) > len(prompt) + 1, (extra, part)


def test_no_acceptance_printed_when_nothing_drafted(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _gen(["--prompt", "import os\n", "--max-new-tokens", "6", "--no-stream", "--drafter", "none"],
                        capsys)
    assert code == 0 and "acceptance by position" not in err and "no drafts made" in err, err
    code, _, err = _gen(["--prompt", "import os\n", "--max-new-tokens", "12", "--no-stream", "--drafter", "default"],
                        capsys)
    assert code == 0 and "acceptance by position [" in err, err


def test_tree_with_default_flags_keeps_working(my_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--tree N` without --drafter grew EAGLE-3 trees when the default was `default`; with `auto` it still does."""
    code, out, err = _gen(["--prompt", "def parse(argv):\n", "--max-new-tokens", "16", "--tree", "8", "--json"],
                          capsys)
    assert code == 0, err
    import json

    assert json.loads(out.strip().splitlines()[-1])["stats"]["tree_rounds"] > 0
    code, _, err = _gen(["--model", str(my_model), "--prompt", "x", "--tree", "8"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "--tree" in lines[0], err
