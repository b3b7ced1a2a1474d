"""Every script in examples/ runs offline on the shipped model, each as its own process, with small
settings; what it prints is checked, not only its exit status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

# example -> (arguments, strings its output must contain); {tmp} is the test's temporary folder
RUNS: dict[str, tuple[list[str], list[str]]] = {
    "attach_and_subscribe.py": (["--max-new-tokens", "4"], ["[subscriber] layers.7.resid_post:", "published=36"]),
    "record_and_query.py": (["--max-new-tokens", "4", "--out", "{tmp}/rec"], ["rows in", "mean_norm", "token"]),
    "speculative.py": (["--max-new-tokens", "16"], ["local drafter:  same as generate: True",
                                                    "remote drafter: same as generate: True"]),
    "every_drafter.py": (["--max-new-tokens", "16"], ["eagle3-tree", "draft-model", "layer-skip",
                                                      "same as generate: True"]),
    "train_drafter.py": (["--prompts", "4", "--steps", "3", "--new-tokens", "16", "--out", "{tmp}/drafter"],
                         ["recorded", "'step': 3", "tau with the new drafter"]),
    "serve_encrypted.py": (["--max-new-tokens", "4", "--keys", "{tmp}/keys"],
                          ["[model] serving tcp://127.0.0.1:", "[client] 32 captures", "decrypted"]),
    "watch_live.py": (["--max-new-tokens", "8"], ["also try: probebus top", "done: 72 captures"]),
    "vllm_capture.py": (["--max-tokens", "4"], ["seq_id 0, prefill rows", "decode rows 3", "published="]),
    "plots.py": (["--max-new-tokens", "8", "--out", "{tmp}/plots"],
                 ["norms_by_position.png", "norms_by_layer.png", "acceptance_by_position.png"]),
}


def test_every_example_is_run_and_short() -> None:
    assert {p.name for p in EXAMPLES} == set(RUNS)
    for p in EXAMPLES:
        assert len(p.read_text().splitlines()) <= 50, f"{p.name} is no longer short"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name: str, tmp_path: Path) -> None:
    if name == "plots.py":
        pytest.importorskip("matplotlib")
    if name == "vllm_capture.py":  # runs in vLLM's own environment (.ci/run)
        pytest.importorskip("vllm")
    if name == "record_and_query.py":
        pytest.importorskip("duckdb")
        pytest.importorskip("polars")
    args, expect = RUNS[name]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / name), *[a.format(tmp=tmp_path) for a in args]],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for e in expect:
        assert e in r.stdout, f"{name}: {e!r} not in its output:\n{r.stdout[-2000:]}"
    if name == "plots.py":
        for png in ("norms_by_position.png", "norms_by_layer.png", "acceptance_by_position.png"):
            assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"


def test_the_vllm_example_without_vllm_says_how_to_install_it(tmp_path: Path) -> None:
    """Where vLLM is not installed, one line says how to install it (it ended in a ModuleNotFoundError traceback)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: test_example_runs runs the example itself")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "vllm_capture.py")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "pip install 'probebus[vllm" in r.stderr
