"""Hostile recording folders (issue 49.5): FIFOs, links to devices and outside the folder, huge sparse files and
crafted files make `probebus inspect` and `read_recording` give one line, never hang, read whole or traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from _exporters_helpers import ROOT, tiny_llama
from models import PAD, left_padded

import exporters
import probe

CHECK = textwrap.dedent("""
    import contextlib, io, json, os, signal, sys
    import exporters
    from probebus.cli import main

    def check(d):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = main(["inspect", d, "--json"])
        except BaseException as exc:
            rc = f"raised {type(exc).__name__}: {exc}"
        try:
            rec = exporters.read_recording(d)
            rec.request(0)  # reads _requests.jsonl
            read = f"read {rec.num_rows} rows"
        except BaseException as exc:
            read = ("ValueError " if isinstance(exc, ValueError) else "") + f"{type(exc).__name__}: {exc}"
        return {"rc": rc, "err": err.getvalue(), "read": read}

    out = {}
    for d in sys.argv[1:]:  # each in a forked child that SIGALRM kills after 20 s: a hang costs 20 s, not all
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            signal.alarm(20)  # the default action ends the process even inside a blocking open() in C
            os.write(w, json.dumps(check(d)).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            text = f.read()
        _, status = os.waitpid(pid, 0)
        out[d] = json.loads(text) if text else {"rc": None, "err": "", "read": f"hung (wait status {status})"}
    print(json.dumps(out))
""")


def _fifo(p: Path) -> None:
    p.unlink(missing_ok=True)
    os.mkfifo(p)


def _link(p: Path, target: Path | str) -> None:
    p.unlink(missing_ok=True)
    p.symlink_to(target)


def _arrow(p: Path, table: pa.Table) -> None:
    with pa.OSFile(str(p), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)


def _data(d: Path) -> Path:
    return next(f for f in sorted(d.iterdir()) if f.suffix == ".arrow")


def _variants(outside: Path) -> dict[str, Callable[[Path], None]]:
    dstr = pa.dictionary(pa.int32(), pa.string())
    ints = pa.array([0], pa.int64())
    cols = {"run": pa.array(["r"]).dictionary_encode(), "step": ints, "phase": pa.array(["decode"]).dictionary_encode(),
            "seq_id": ints, "position": ints, "token_id": ints, "site": pa.array(["embed"]).dictionary_encode(),
            "layer": pa.array([0], pa.int32()), "activation": pa.array([[1.0]], pa.list_(pa.float32()))}
    assert pa.table(cols).schema.field("site").type == dstr
    return {
        "manifest is a FIFO": lambda d: _fifo(d / "_manifest.json"),
        "data file is a FIFO": lambda d: _fifo(_data(d)),
        "in-progress file is a FIFO": lambda d: _fifo(d / "_float32x64-00009.arrow.inprogress"),
        "prompts file is a FIFO": lambda d: _fifo(d / "_prompts.jsonl"),
        "manifest links to /dev/zero": lambda d: _link(d / "_manifest.json", "/dev/zero"),
        "requests file links to /dev/zero": lambda d: _link(d / "_requests.jsonl", "/dev/zero"),
        "manifest is an 8 GB sparse file": lambda d: os.truncate(d / "_manifest.json", 8 << 30),
        "data file links outside the folder": lambda d: (shutil.move(_data(d), outside / "x.arrow"),
                                                        _link(d / "float32x64-00000.arrow", outside / "x.arrow")),
        "manifest is a list": lambda d: (d / "_manifest.json").write_text("[]"),
        "manifest nests deeply": lambda d: (d / "_manifest.json").write_text("[" * 100_000 + "]" * 100_000),
        "manifest files is a string": lambda d: (d / "_manifest.json").write_text('{"files": "x"}'),
        "manifest entry name is a number": lambda d: (d / "_manifest.json").write_text('{"files": [{"name": 5}]}'),
        "manifest counts is a list": lambda d: (d / "_manifest.json").write_text('{"counts": [1], "state": 3}'),
        "manifest entry sites are numbers": lambda d: (d / "_manifest.json").write_text(
            json.dumps({"files": [{"name": _data(d).name, "sites": [1]}]})),
        "data file is garbage": lambda d: _data(d).write_bytes(b"ARROW1\0\0" + os.urandom(300)),
        "data file is empty": lambda d: _data(d).write_bytes(b""),
        "data file is cut short": lambda d: _data(d).write_bytes(_data(d).read_bytes()[:700]),
        "data file has other columns": lambda d: _arrow(_data(d), pa.table({"x": [1, 2]})),
        "data file's site is a plain string": lambda d: _arrow(_data(d), pa.table({**cols, "site": pa.array(["e"])})),
        "data file's activation is text": lambda d: _arrow(_data(d), pa.table({**cols,
                                                                                "activation": pa.array([["a"]])})),
        "data file is a directory": lambda d: (_data(d).unlink(), (d / "float32x64-00000.arrow").mkdir()),
    }


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("folders") / "rec"
    model = tiny_llama(layers=2)
    ids, mask = left_padded([[5, 17, 33, 9], [40, 41, 42]])
    with probe.attach(model, "layers.*.resid_post") as session:
        rec = exporters.ArrowRecorder(session, out).start()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        rec.add_prompts(["a", "b"], [0, 1])
    rec.stop()
    assert exporters.read_recording(out).num_rows > 0
    return out


def test_hostile_folders_give_one_line_and_never_hang(recording: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dirs = {}
    for i, (name, make) in enumerate(_variants(outside).items()):
        d = tmp_path / f"v{i}"
        shutil.copytree(recording, d)
        make(d)
        dirs[name] = d
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", CHECK, *map(str, dirs.values())], env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout)
    wrong = {}
    for name, d in dirs.items():
        r = got[str(d)]
        lines = r["err"].strip().splitlines()
        # `inspect` does not read the prompts: there, and only there, it may succeed
        ok_rc = (0, 2) if name == "prompts file is a FIFO" else (2,)
        if r["rc"] not in ok_rc or len(lines) != (r["rc"] == 2) or "Traceback" in r["err"] or \
                not r["read"].startswith("ValueError") or "hung" in r["read"]:
            wrong[name] = r
    assert not wrong, json.dumps(wrong, indent=1)[:6000]
    assert not (outside / "x.arrow").is_symlink()  # (the outside file was never touched either way)
