"""`probebus generate`: a model and a --drafter value made into a decoder, and the command itself.

    probebus generate --model default --prompt "def parse(" --max-new-tokens 64     # auto: EAGLE-3 + n-gram
    probebus generate --model default --drafter medusa --prompts p.jsonl --json

`load_target` and `make_decoder` serve the other decoder commands (`_cmd_train.py`, `_cmd_decoder.py`) too.
Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from decoder import RemoteEagle, SpeculativeDecoder

#: every --drafter name `probebus generate` takes (a folder or a served drafter's address besides)
DRAFTER_NAMES = ("auto", "default", "eagle3", "eagle3-tree", "medusa", "medusa-tree", "mtp", "mtp-attn", "clustered",
                 "dspark", "draft-model", "layer-skip", "ngram", "none")
REMOTE = ("tcp://", "ipc://")
SEPARATOR = "-" * 40  # between the completions of several prompts (not --json)
REMOTE_TIMEOUT_S = 30.0  # a served drafter's answer (each call); the first waits for a server still starting
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    """One line for the user; the command exits 2."""


def _fail(cmd: str, exc: BaseException | str) -> int:
    print(f"probebus {cmd}: {exc}", file=sys.stderr)
    return 2


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available on this machine")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps: MPS is not available on this machine")
    return dev


def _cpu_has_half() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_target(args: argparse.Namespace,
                need_tokenizer: bool = True) -> tuple[torch.nn.Module, PreTrainedTokenizerBase | None]:
    """(model, tokenizer) with --dtype and --device applied."""
    from probebus._load import load_model

    dev = _device(args.device)
    dtype = DTYPES.get(args.dtype)
    model, tok = load_model(args.model, dtype=dtype or "auto", need_tokenizer=need_tokenizer)
    if dtype is None and dev.type == "cpu" and model.dtype in (torch.bfloat16, torch.float16) and not _cpu_has_half():
        model = model.float()  # half precision on a CPU without native support is several times slower
    return model.to(dev), tok


# Tokens of plain steps after the first prompt that repay compiling the one-token graph: its compile took 7.7 s
# with Inductor's disk cache warm (36 s cold) on the default model, and saved ~0.9 ms a plain step (docs/design.md,
# "The speculative loop on a compiled target").
PLAIN_PAYBACK = 8192


def compile_mode(args: argparse.Namespace, prompts: int = 1) -> bool | str:
    """The decoder's `compiled` for `--compiled` (True), `--compiled-auto` ("auto"), `--eager` (False), or, with
    none of them, the decoder's default ("plain") where the run is long enough to repay its compile: batch-1
    prompts after the first times --max-new-tokens at least PLAIN_PAYBACK. A shorter run stays eager (False)."""
    if args.compiled or args.compiled_auto or args.eager:
        return True if args.compiled else "auto" if args.compiled_auto else False
    batch_1 = args.batch_size == 1 and (prompts - 1) * args.max_new_tokens >= PLAIN_PAYBACK
    return "plain" if batch_1 else False


def make_decoder(model: torch.nn.Module, drafter: str, k: int | None, *, fixed: bool = False,
                 endpoint: str | None = None, refresh_cost: bool = False,
                 tree: int | None = None, compiled: bool | str = "plain") -> SpeculativeDecoder:
    """The decoder for a --drafter value; raises DrafterError for a bad drafter. `compiled`: as the decoder's
    (`--compiled` True: every call's forwards compiled; `--compiled-auto`: batch-1 calls from the second)."""
    from decoder import DrafterError, NgramDrafter, SpeculativeDecoder, load_drafter, load_named_drafter, tree_nodes

    # every decoder below: its own cost curves (eager and compiled forwards, `SpeculativeDecoder.cost_for`)
    new_decoder = functools.partial(SpeculativeDecoder, compiled=compiled, refresh_cost=refresh_cost)

    schedule = "fixed" if fixed else "auto"
    if drafter == "none":
        return new_decoder(model, None, k=k)
    if endpoint is not None and drafter == "ngram":
        raise UsageError("--endpoint: the n-gram drafter runs without a probe session; use --drafter default or "
                         "auto to get one")
    if drafter == "ngram":
        return new_decoder(model, NgramDrafter(), k=k, schedule=schedule)
    if drafter == "auto":  # with --fixed or --tree: EAGLE-3 alone, as `default` was before auto became the default
        try:
            eagle = load_drafter("default", model)
        except DrafterError:
            if tree:
                raise UsageError("--tree: this model has no trained drafter beside it to grow trees; drop --tree "
                                 "(n-gram drafts chains) or train one (probebus train-drafter)") from None
            if endpoint is not None:
                raise UsageError("--endpoint: this model has no trained drafter beside it, so --drafter auto drafts "
                                 "with n-gram and runs no probe session; train one (probebus train-drafter) or drop "
                                 "--endpoint") from None
            where = getattr(model.config, "_name_or_path", "") or "the model"
            print(f"probebus generate: no trained drafter beside {where}; drafting with n-gram (train one: probebus "
                  "train-drafter)", file=sys.stderr)
            return new_decoder(model, NgramDrafter(), k=k, schedule=schedule)
        if fixed or tree:
            return new_decoder(model, eagle, k=k, schedule=schedule, endpoint=endpoint, tree=tree or 0)
        return new_decoder(model, "auto", model_drafter=eagle, k=k, endpoint=endpoint)
    if drafter.startswith(REMOTE):
        return new_decoder(model, _remote(drafter), k=k, schedule=schedule, endpoint=endpoint, tree=0)
    if drafter not in DRAFTER_NAMES and not Path(drafter).is_dir():
        raise UsageError(f"--drafter {drafter!r}: not a name ({', '.join(DRAFTER_NAMES)}) nor a folder, nor a "
                         "served drafter's address (tcp://HOST:PORT or ipc://PATH, from probebus serve-drafter)")
    try:
        loaded = load_named_drafter(drafter, model)
    except DrafterError as exc:
        if "ships with the target" in str(exc):  # a named drafter this model has none of
            raise UsageError(f"{exc}; --drafter auto (the default) drafts with n-gram meanwhile") from None
        raise
    if endpoint is not None and getattr(loaded, "sites", None) == []:
        raise UsageError(f"--endpoint: --drafter {drafter} reads token ids only, so no probe session runs; use "
                         "--drafter default, medusa or auto to get one")
    nodes = tree_nodes(drafter) if tree is None else tree
    try:
        return new_decoder(model, loaded, k=k, schedule=schedule, endpoint=endpoint, tree=nodes)
    except ValueError as exc:  # a tree for a drafter that cannot grow one
        raise UsageError(f"--drafter {drafter}: {exc}") from None


def _remote(address: str) -> RemoteEagle:
    """A served drafter (probebus serve-drafter --bind ADDRESS), or one line saying how to start one."""
    from decoder import RemoteEagle

    try:
        return RemoteEagle(address, timeout=REMOTE_TIMEOUT_S)
    except TimeoutError:
        raise UsageError(f"--drafter {address}: no drafter answered within {REMOTE_TIMEOUT_S:g} s; start one with "
                         f"probebus serve-drafter --bind {address} --model MODEL") from None


def _check_generate(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.k is not None and not 1 <= args.k <= 16:
        raise UsageError(f"--k must be between 1 and 16, got {args.k}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.tree is not None and not 0 <= args.tree <= 64:
        raise UsageError(f"--tree must be between 0 and 64 nodes, got {args.tree}")
    if args.tree and args.drafter in ("ngram", "none"):
        raise UsageError(f"--tree needs a drafter that scores alternatives (EAGLE-3 or Medusa), not {args.drafter}")
    if args.tree and args.drafter.startswith(REMOTE):
        raise UsageError("--tree: a served drafter drafts chains; drop --tree or load the drafter here "
                         "(--drafter PATH)")
    if args.endpoint is not None and args.drafter == "none":
        raise UsageError("--endpoint: --drafter none runs without a probe session; use --drafter default or auto")


def _cmd_generate(args: argparse.Namespace) -> int:
    from decoder import DrafterError
    from probebus._prompts import read_prompts

    try:
        _check_generate(args)
        prompts = read_prompts(args.prompt, args.prompts)
        if args.plot:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:
                raise UsageError("--plot needs matplotlib: pip install 'probebus[plot]'")
        model, tok = load_target(args)
        spec = make_decoder(model, args.drafter, args.k, fixed=args.fixed, endpoint=args.endpoint,
                            refresh_cost=args.refresh_cost, tree=args.tree,
                            compiled=compile_mode(args, len(prompts)))
    except (UsageError, DrafterError, FileNotFoundError) as exc:
        return _fail("generate", exc)
    if spec.endpoint is not None:
        print(f"probe session: {spec.endpoint} (watch: probebus top {spec.endpoint})", file=sys.stderr)
    tty = sys.stdout.isatty()
    stream = (tty if args.stream is None else args.stream) and not args.json and args.batch_size == 1
    bold, plain = ("\033[1m", "\033[0m") if tty else ("", "")
    eos = model.generation_config.eos_token_id
    all_stats = []
    with spec:
        for i in range(0, len(prompts), args.batch_size):
            chunk = prompts[i: i + args.batch_size]
            enc = tok(chunk, return_tensors="pt", padding=True)
            streamer = None
            if stream:
                if i:
                    print(SEPARATOR, flush=True)
                print(chunk[0] + bold, end="", flush=True)
                streamer = _TextStream(tok)
            out = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=eos,
                                pad_token_id=tok.pad_token_id, seed=args.seed, streamer=streamer)
            all_stats.append(out.stats)
            stats = out.stats.as_dict()
            for r, prompt in enumerate(chunk):
                if i + r and not args.json and not stream:  # several prompts' completions: a rule between
                    print(SEPARATOR, flush=True)
                new = out.sequences[r, enc.input_ids.shape[1]:].tolist()
                if tok.pad_token_id is not None and eos != tok.pad_token_id:
                    new = [t for t in new if t != tok.pad_token_id]
                text = tok.decode(new, skip_special_tokens=True)
                if args.json:
                    print(json.dumps({"prompt": prompt, "text": text, "token_ids": new, "stats": stats}), flush=True)
                elif stream:
                    print(plain, flush=True)
                else:
                    print(f"{prompt}{bold}{text}{plain}", flush=True)
            if not args.json:
                print(_stats_line(args.drafter, stats), file=sys.stderr)
    if args.plot:
        from decoder.loop._plot import plot_stats

        for path in plot_stats(all_stats, args.plot, title=f"--drafter {args.drafter}"):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _stats_line(drafter: str, stats: dict) -> str:
    """One line per batch; acceptance by draft position only where some round drafted."""
    line = (f"[{drafter}] {stats['tokens_per_s']:.1f} tok/s, tau {stats['tau']:.2f}, "
            f"{stats['tokens_per_forward']:.2f} tokens/forward, rounds: {stats['model_rounds']} "
            f"{'+'.join(stats['by_drafter']) or 'model drafter'}, {stats['ngram_rounds']} n-gram, "
            f"{stats['tree_rounds']} tree, {stats['plain_rounds']} plain")
    if not stats["drafted"]:
        return line + "; no drafts made, so no acceptance"
    return line + f"; acceptance by position {[round(a, 2) for a in stats['acceptance']]}"


class _TextStream:
    """transformers' TextStreamer interface (put/end), printing decoded text as it is accepted."""

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        from transformers import TextStreamer

        self.inner = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        self.inner.on_finalized_text = self._write  # type: ignore[method-assign]

    @staticmethod
    def _write(text: str, stream_end: bool = False) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def put(self, value: torch.Tensor) -> None:
        self.inner.put(value)

    def end(self) -> None:
        self.inner.end()
