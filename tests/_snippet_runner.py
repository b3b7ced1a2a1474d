"""Runs several doc snippets or example scripts in one interpreter, one after the other, each as `python -c CODE`
(or `python PATH ARGS`) would: `python tests/_snippet_runner.py PLAN.json`. PLAN lists {"name", "code" (or "path"
and "args"), "cwd", "out", "err", "rc"}: each runs in its own folder (`cwd`), with fresh globals named `__main__`,
its file descriptors 1 and 2 sent to the files `out` and `err` (subprocesses and C code included), and its exit
status (what `python -c` would have returned) is written to `rc` once it is done and its objects are collected.
Importing torch, transformers and the model once for all of them is what this saves; tests/test_examples.py reruns
one that does not pass cleanly here in a process of its own, so none is failed by what another left behind."""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import traceback


def _run(block: dict) -> int:
    ns: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        if "path" in block:  # as `python PATH ARGS`: __main__ is the script's (so a spawned child finds it)
            sys.argv = [block["path"], *block["args"]]
            ns = runpy.run_path(block["path"], run_name="__main__")
        else:
            sys.argv = ["-c"]
            exec(compile(block["code"], block["name"], "exec"), ns)
    except SystemExit as e:  # what `python -c` makes of it
        if e.code is None or e.code == 0:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported as `python -c` reports it
        traceback.print_exc()
        return 1
    finally:
        ns.clear()  # what the interpreter's exit would drop: sessions, subscribers, threads' targets
        gc.collect()
    return 0


def main() -> None:
    plan = json.loads(open(sys.argv[1]).read())  # noqa: SIM115
    for block in plan:
        os.chdir(block["cwd"])
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(block["out"], "wb") as out, open(block["err"], "wb") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                rc = _run(block)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
        with open(block["rc"], "w") as f:
            f.write(str(rc))


if __name__ == "__main__":
    main()
