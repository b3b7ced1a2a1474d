"""The `probebus` command: one subcommand per job, each with --help.

    probebus sites default                  # every site of the shipped model
    probebus sites path/to/model --match 'layers.*.resid_post'
    probebus demo                           # the whole product on the shipped model
    probebus record / inspect / top         # see `probebus record --help`

This is the only module that may import probe, exporters and decoder together.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import types
from collections.abc import Sequence


def _cmd_sites(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    import probe
    from probebus._load import load_config

    config = load_config(args.model)
    with torch.device("meta"):  # structure only: no weights are read or allocated
        model = AutoModelForCausalLM.from_config(config)
    try:
        names = probe.match_sites(model, args.match) if args.match else probe.list_sites(model)
    except probe.SiteError as exc:
        print(f"probebus sites: {exc}", file=sys.stderr)
        return 2
    arch = probe.resolve_arch(model)
    if args.json:
        print(json.dumps({"model": args.model, "family": arch.family, "n_layers": arch.n_layers, "sites": names}))
    else:
        print(f"# {args.model}: {type(model).__name__}, {arch.family} family, {arch.n_layers} layers")
        print("\n".join(names))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from probe import __version__

    parser = argparse.ArgumentParser(prog="probebus", description="Observe LLM internals while they generate. "
                                     "Works offline: nothing is downloaded unless you pass --online (or set "
                                     "PROBEBUS_ONLINE=1).")
    parser.add_argument("--version", action="version", version=f"probebus {__version__}")
    parser.add_argument("--online", action="store_true", help="allow Hugging Face Hub downloads (off by default)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("sites", help="list the probe sites of a model", description="List the probe sites of a "
                       "model: `default`, a local folder with config.json, or a config.json file. No weights load.")
    p.add_argument("model", help="default | PATH (folder or config.json) | a hub id already in the local cache")
    p.add_argument("--match", help="only the sites a pattern selects: 'layers.*.resid_post', 'layers.0:4.mlp_out', "
                   "'layers.-1.resid_pre', a shell glob ('*.resid_post') or part of a name ('resid_post')")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_sites)

    for module in ("probebus._cmd_demo", "probebus._cmd_exporters", "probebus._cmd_decoder", "probebus._cmd_vllm"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.register(sub)
    return parser


def _quiet_broken_pipe() -> int:
    """`probebus inspect --json | head`: the reader left; stop writing, without a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout at exit: let that go nowhere
    except (OSError, ValueError):
        pass
    return 128 + 13  # what a process killed by SIGPIPE reports, as `yes | head` does


_interrupted = False  # a SIGINT arrived: what fails after it is its consequence, reported as the interruption


_command = "probebus"  # what the one line names
_own_process = False  # main() is the process's entry point: it may end the process


def _on_sigint(signum: int, frame: types.FrameType | None) -> None:
    global _interrupted
    _interrupted = True
    if _own_process and _importing(frame):
        # Raised inside an import, the KeyboardInterrupt can be lost: an importlib callback prints it as ignored,
        # C code that torch runs while it imports swallows it or aborts on it. Seen with 2-4 busy processes beside
        # a start-up: rc 0 after generating all it was asked (3 of 148 runs), rc -6 (2 of 148). Nothing of the
        # command is running yet: leave now.
        _say_interrupted()
        _exit_interrupted()
    raise KeyboardInterrupt


def _say_interrupted() -> None:
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))  # a second Ctrl-C while exiting: no traceback
    print(f"{_command}: interrupted", file=sys.stderr)


def _importing(frame: types.FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a SIGINT at any point, imports and model loading included, ends it with one line, rc 130.

    Interrupted in the middle of importing torch or numpy, a later import of the same module fails with
    `ImportError: cannot load module more than once per process`, and an uncaught KeyboardInterrupt gave a
    traceback (rc -2): both are reported as the interruption they are."""
    global _command, _own_process
    _command, _own_process = "probebus", argv is None
    try:
        words = list(sys.argv[1:] if argv is None else argv)
        _command = f"probebus {next((w for w in words if not w.startswith('-')), '')}".strip()
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when a caller set its own
            signal.signal(signal.SIGINT, _on_sigint)
        return _main(argv)
    except BaseException as exc:
        if not (_interrupted or isinstance(exc, KeyboardInterrupt)) or isinstance(exc, SystemExit):
            raise
        _say_interrupted()
        if argv is None:  # the process's own entry point (not a caller's main([...]))
            _exit_interrupted()
        return 130


def _exit_interrupted() -> None:
    """Exit 130 now, after the exit hooks (sessions still open send what they hold: `probe/_exit.py`).

    Not through the interpreter's own exit: torch runs Python snippets from C (PyRun_String) while it
    imports, and a SIGINT that lands in one marks the interrupt "unhandled" inside CPython even though
    it was handled here, which makes the interpreter kill itself with SIGINT at exit (rc -2)."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130)


def _main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from probebus._load import LoadError, go_offline

    go_offline(argv)  # before anything imports transformers / huggingface_hub
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's exit flush
        return code
    except LoadError as exc:
        print(f"probebus {args.command}: {exc.message}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # a command's own one-line usage error (printed already unless it is the code)
        if isinstance(exc.code, str):
            print(f"probebus {args.command}: {exc.code}", file=sys.stderr)
            return 2
        return int(exc.code or 0)
    except BrokenPipeError:
        return _quiet_broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
