"""Runs several doc snippets in one interpreter, each as `python -c CODE` would run it, one after the other:
`python tests/_snippet_runner.py PLAN.json`. PLAN lists {"name", "code", "cwd", "out", "err", "rc"}: each snippet
runs in its own folder (`cwd`), with fresh globals named `__main__`, its file descriptors 1 and 2 sent to the files
`out` and `err` (subprocesses and C code included), and its exit status (what `python -c` would have returned) is
written to `rc` once it is done and its objects are collected. Importing torch, transformers and the model once
for a whole document is what this saves; tests/test_examples.py reruns a snippet that fails here in a process of
its own, so a snippet is never failed by what another left behind."""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback


def _run(code: str, name: str) -> int:
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, name, "exec"), ns)
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
        sys.argv = ["-c"]
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(block["out"], "wb") as out, open(block["err"], "wb") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                rc = _run(block["code"], block["name"])
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
