"""Every script in examples/ runs offline on the shipped model, each as its own `__main__` in a folder of its own
(all in one process, tests/_snippet_runner.py; one that fails there runs again alone), with small settings; what
it prints is checked, not only its exit status. Every ```python block of README.md and docs/*.md runs too, as
printed, in a fresh folder (a block whose first line is `# read rec/ ...` runs in tests/test_exporters_interop.py,
beside a recording; one whose first line is `# needs: vllm` or `# needs: cuda` is skipped where that is missing)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
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


def _example_can_run(name: str) -> str | None:
    """Why an example cannot run here, or None."""
    needs = {"plots.py": ["matplotlib"], "vllm_capture.py": ["vllm"],  # vLLM: in its own environment (.ci/run)
             "record_and_query.py": ["duckdb", "polars"]}.get(name, [])
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    return f"could not import {missing[0]!r}" if missing else None


@pytest.fixture(scope="module")
def shared_examples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, Path]]:
    """name -> (exit status, stdout, stderr, its folder) of every example that can run here, all run in one process
    (tests/_snippet_runner.py), each in a folder of its own; an example missing here runs in a process of its own."""
    tmp = tmp_path_factory.mktemp("examples")
    plan = []
    for i, name in enumerate(sorted(RUNS)):
        if _example_can_run(name) is None:
            (tmp / str(i)).mkdir()
            plan.append({"name": name, "path": str(ROOT / "examples" / name), "cwd": str(tmp / str(i)),
                         "args": [a.format(tmp=tmp / str(i)) for a in RUNS[name][0]],
                         "out": str(tmp / f"{i}.out"), "err": str(tmp / f"{i}.err"), "rc": str(tmp / f"{i}.rc")})
    return _run_plan(plan, tmp)


def _run_plan(plan: list[dict], tmp: Path) -> dict:
    """Runs `plan` in one tests/_snippet_runner.py process: name -> (exit status, stdout, stderr, folder), for what
    ran to its end in a runner that then exited cleanly."""
    (tmp / "plan.json").write_text(json.dumps(plan))
    try:
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "_snippet_runner.py"), str(tmp / "plan.json")],
                           cwd=tmp, env=_env(), capture_output=True, text=True, timeout=300 * max(len(plan), 1))
    except subprocess.TimeoutExpired:
        return {}
    if r.returncode != 0 or "session is closed" in r.stderr:  # at the runner's exit: nothing to pin it on
        return {}
    return {b["name"]: (int(Path(b["rc"]).read_text()), Path(b["out"]).read_text(), Path(b["err"]).read_text(),
                        Path(b["cwd"])) for b in plan if Path(b["rc"]).exists()}


def _passes(name: str, rc: int, out: str, err: str, tmp: Path) -> bool:
    """Whether an example's run passes every check of test_example_runs."""
    expect = RUNS[name][1]
    pngs = ["norms_by_position.png", "norms_by_layer.png", "acceptance_by_position.png"] if name == "plots.py" else []
    return rc == 0 and all(e in out for e in expect) and all(
        (tmp / "plots" / png).exists() and (tmp / "plots" / png).read_bytes()[:4] == b"\x89PNG" for png in pngs)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name: str, tmp_path: Path, shared_examples) -> None:  # noqa: ANN001
    """Each example as `python examples/NAME ARGS` in a fresh folder. The examples share one process (one import of
    torch, transformers and the model); one that does not pass every check there runs again in a process of its
    own, and that run is the one judged."""
    why = _example_can_run(name)
    if why:
        pytest.skip(why)
    args, expect = RUNS[name]
    if name in shared_examples and _passes(name, *shared_examples[name]):
        rc, out, err, tmp_path = shared_examples[name]
    else:
        r = subprocess.run([sys.executable, str(ROOT / "examples" / name), *[a.format(tmp=tmp_path) for a in args]],
                           cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
        rc, out, err = r.returncode, r.stdout, r.stderr
    assert rc == 0, err[-3000:]
    for e in expect:
        assert e in out, f"{name}: {e!r} not in its output:\n{out[-2000:]}"
    if name == "plots.py":
        for png in ("norms_by_position.png", "norms_by_layer.png", "acceptance_by_position.png"):
            assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = re.compile(r"# needs: (\w+)")


def _blocks() -> list[tuple[str, str, str | None]]:
    """(id, code, what it needs) for every ```python block of the README and docs/ not run beside a recording."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            code = m.group(1)
            if code.startswith("# read rec/"):
                continue
            need = NEEDS.match(code)
            line = text[: m.start()].count("\n") + 1
            name = f"{doc.relative_to(ROOT)}:{line}" + (f"-{need.group(1)}" if need else "")
            out.append((name, code, need.group(1) if need else None))
    return out


BLOCKS = _blocks()


def test_readme_is_short_and_every_link_resolves() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "../shared" not in readme and "DESIGN.md" not in readme
    assert "from_pretrained" in readme and "resolve_model" in readme  # snippets show where the model comes from
    for doc in DOCS:
        assert "../shared" not in doc.read_text(), f"{doc.name} points outside the repository"
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"
    assert len(BLOCKS) >= 8  # README and guide: capture, record, speculative, vLLM, ...


def _can_run(need: str | None) -> str | None:
    """Why a block cannot run here, or None."""
    if need == "vllm" and importlib.util.find_spec("vllm") is None:
        return "needs vLLM (.ci/run runs it in vLLM's own environment)"
    if need == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA device"
    return None


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _run_document(doc: str, tmp: Path) -> dict[str, tuple[int, str, str]]:
    """Every block of `doc` that can run here, in one process (tests/_snippet_runner.py: each in a fresh folder,
    with fresh globals, its own stdout and stderr): name -> (exit status, stdout, stderr), for the blocks that ran
    to their end in a runner that then exited cleanly. A block missing here is run in a process of its own."""
    plan = []
    for i, (name, code, need) in enumerate(b for b in BLOCKS if b[0].split(":")[0] == doc):
        if _can_run(need) is None:
            (tmp / str(i)).mkdir()
            plan.append({"name": name, "code": code, "cwd": str(tmp / str(i)), "out": str(tmp / f"{i}.out"),
                         "err": str(tmp / f"{i}.err"), "rc": str(tmp / f"{i}.rc")})
    return {name: run[:3] for name, run in _run_plan(plan, tmp).items()}


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """name -> (exit status, stdout, stderr) of a block run beside the other blocks of its document."""
    runs: dict[str, dict[str, tuple[int, str, str]]] = {}

    def get(name: str) -> tuple[int, str, str] | None:
        doc = name.split(":")[0]
        if doc not in runs:
            runs[doc] = _run_document(doc, tmp_path_factory.mktemp("doc"))
        return runs[doc].get(name)
    return get


@pytest.mark.parametrize("name, code, need", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_doc_snippet_runs(name: str, code: str, need: str | None, tmp_path: Path, shared_runs) -> None:  # noqa: ANN001
    """Each block runs as printed, as `python -c` in a fresh folder. The blocks of a document share one process
    (one import of torch, transformers and the model); a block that does not pass cleanly there runs again in a
    process of its own, and that run is the one judged: no block fails by what another left behind (and none passes
    by another's names or files: each has its own globals and folder)."""
    why = _can_run(need)
    if why:
        pytest.skip(why)
    shared = shared_runs(name)
    ok = shared is not None and shared[0] == 0 and shared[1].strip() and "session is closed" not in shared[2]
    if ok:
        rc, out, err = shared
    else:
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=300)
        rc, out, err = r.returncode, r.stdout, r.stderr
    assert rc == 0, f"{name} failed:\n{code}\n{err[-3000:]}"
    assert out.strip(), f"{name} printed nothing"
    assert "session is closed" not in err


def test_query_tools_have_an_extra_named_where_they_are_used() -> None:
    """polars, DuckDB and datasets (the reading snippets' tools) install with `[query]`, and `[test]` keeps them."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0] for d in extras["query"]}
    assert names == {"duckdb", "polars", "datasets"}
    assert names <= {re.split(r"[<>=\[ ]", d)[0] for d in extras["test"]}
    uses = {"duckdb": "import duckdb", "polars": "import polars", "datasets": "from datasets"}
    for doc in [*DOCS, *EXAMPLES]:
        text = doc.read_text()
        if any(u in text for u in uses.values()):
            assert '.[query]"' in text, f"{doc.name} uses a query tool without naming the extra"


def test_readme_vllm_server_command_is_the_tested_one() -> None:
    """The README's server command carries every flag tests/vllm_backend/test_vllm_server.py starts vLLM with
    (--gpu-memory-utilization 0.15 above all: the default 92 % fails on a 24 GB machine), host and port aside."""
    import shlex

    tested = (ROOT / "tests" / "vllm_backend" / "test_vllm_server.py").read_text()
    cmd = re.search(r"cmd = \[(.*?)\]\n", tested, re.S).group(1)
    words = re.findall(r'"([^"]*)"|(str\([^)]*\))', cmd)
    flags: dict[str, str | None] = {}
    for i, (w, _) in enumerate(words):
        if w.startswith("--") and w not in ("--host", "--port", "--model"):
            nxt = words[i + 1][0] if i + 1 < len(words) else ""
            flags[w] = None if nxt.startswith("--") or not nxt else nxt
    assert flags["--gpu-memory-utilization"] == "0.15"
    for doc in (ROOT / "README.md", ROOT / "docs" / "guide.md"):
        block = re.search(r"```bash\n(VLLM_SERVER_DEV_MODE=1 .*?)\n[^ ]", doc.read_text(), re.S).group(1)
        argv = shlex.split(block.replace("\\\n", " ").rstrip("& \n"))
        for flag, value in flags.items():
            assert flag in argv, f"{doc.name}: the vLLM server command lacks {flag}"
            if value is not None:
                assert argv[argv.index(flag) + 1] == value, (doc.name, flag)


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
