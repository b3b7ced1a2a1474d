"""`probebus generate`, `probebus train-drafter` and `probebus serve-drafter`: the decoder package on the command line.

    probebus generate --model default --prompt "def parse(" --max-new-tokens 64     # auto: EAGLE-3 + n-gram
    probebus generate --model MY_MODEL --prompt "def parse("      # no drafter beside it: n-gram, said in one line
    probebus generate --model default --drafter medusa --prompts p.jsonl --json
    probebus generate --model default --drafter tcp://127.0.0.1:5600 --prompt "x"   # a `serve-drafter` process
    probebus train-drafter --model default --recording rec/ --out my-drafter/
    probebus serve-drafter --bind tcp://127.0.0.1:5600 --model default             # decoder.RemoteEagle(addr)

Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

#: every --drafter name `probebus generate` takes (a folder or a served drafter's address besides)
DRAFTER_NAMES = ("auto", "default", "eagle3", "eagle3-tree", "medusa", "medusa-tree", "mtp", "mtp-attn", "clustered",
                 "dspark", "draft-model", "layer-skip", "ngram", "none")
REMOTE = ("tcp://", "ipc://")
SEPARATOR = "-" * 40  # between the completions of several prompts (not --json)
REMOTE_TIMEOUT_S = 30.0  # a served drafter's answer (each call); the first waits for a server still starting
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    """One line for the user; the command exits 2."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="default (the shipped model) | PATH (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="weights dtype; auto = the checkpoint's, float32 on a CPU without native half precision "
                   "(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps (default: %(default)s)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text, optionally with speculative decoding",
                       description="Generate from a model with a drafter: auto (the default: the EAGLE-3 head "
                       "shipped beside the model plus n-gram, or n-gram alone where the model has none), default or "
                       "eagle3 (the EAGLE-3 head alone), eagle3-tree, medusa, medusa-tree (Medusa heads), mtp, "
                       "mtp-attn, clustered, dspark, draft-model (a separate small model), layer-skip (the model's "
                       "own first layers), ngram (prompt lookup), none (plain decoding), PATH (a drafter folder: "
                       "EAGLE-3 in either public layout, Medusa, MTP, DSpark, a causal LM, a layer-skip "
                       "measurement) or ADDRESS (tcp://... or ipc://...: an EAGLE-3 drafter served by `probebus "
                       "serve-drafter --bind ADDRESS`). A scheduler picks per round and row the method and draft "
                       "length from measured costs and acceptance estimates, and takes plain steps when nothing "
                       "pays. Greedy output equals plain decoding; sampling follows the target's distribution exactly.")
    _common(p)
    p.add_argument("--drafter", default="auto",
                   help=f"{' | '.join(DRAFTER_NAMES)} | PATH | tcp://HOST:PORT | ipc://PATH (a served drafter) "
                   "(default: %(default)s; a model with no trained drafter beside it drafts with n-gram)")
    p.add_argument("--tree", type=int, default=None, help="verify draft trees of up to N nodes in one forward "
                   "(batch 1, EAGLE-3 or Medusa; default: 24 for the -tree names, else 0 = chains)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", metavar="FILE", help="JSON Lines with a 'prompt' field (or a text file: one "
                     "prompt per line)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt, >= 1 "
                   "(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set with this much mass")
    p.add_argument("--k", type=int, default=None, help="longest draft per round, 1..16 (default: 8 scheduled, 5 "
                   "with --fixed)")
    p.add_argument("--fixed", action="store_true", help="draft exactly --k tokens every round (no scheduling)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per batch, >= 1 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="random seed: same seed, same output")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt: text, token_ids, stats")
    p.add_argument("--stream", dest="stream", action="store_true", default=None,
                   help="print tokens as they are accepted (default when stdout is a terminal)")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="print each text when it is complete")
    p.add_argument("--endpoint", default=None, help="bind the drafter's probe session here (e.g. "
                   "ipc:///tmp/pb.sock or tcp://127.0.0.1:5555) so `probebus top ENDPOINT` can watch it")
    p.add_argument("--plot", metavar="DIR", default=None, help="write acceptance by draft position and by round "
                   "as PNGs into DIR (needs the plot extra: pip install 'probebus[plot]')")
    p.add_argument("--refresh-cost", action="store_true", help="measure this machine's cost curve again instead "
                   "of using the cached one")
    p.set_defaults(func=_cmd_generate)

    t = sub.add_parser("train-drafter", help="train a drafter (EAGLE-3, Medusa, MTP, DSpark, layer skip) from a "
                       "recording",
                       description="Train a drafter from an Arrow recording made with `probebus record`: --method "
                       "eagle3 (record resid_pre of the feature layers; see `probebus sites MODEL`), medusa, mtp, "
                       "clustered or dspark (record final_norm), layer-skip (any site: only the token ids are "
                       "read; measures which early exit pays on this machine). Resumes from OUT if a training "
                       "state is there. Holds out some sequences and reports acceptance by draft position on them.")
    _common(t)
    t.add_argument("--method", default="eagle3",
                   choices=("eagle3", "medusa", "mtp", "clustered", "dspark", "layer-skip"),
                   help="which drafter to train (default: %(default)s)")
    t.add_argument("--heads", type=int, default=4, help="medusa: heads; mtp/clustered: unrolled depth; dspark: "
                   "parallel positions (default: %(default)s)")
    t.add_argument("--clusters", type=int, default=64, help="clustered: vocabulary clusters (default: %(default)s)")
    t.add_argument("--attention", action="store_true", help="mtp: DeepSeek-V3's block with attention (trained on "
                   "--window/--batch windows like eagle3) instead of the attention-free head")
    t.add_argument("--recording", required=True, metavar="DIR", help="folder written by probebus record")
    t.add_argument("--out", required=True, metavar="DIR", help="where the drafter (speculators layout) is written")
    t.add_argument("--steps", type=int, default=1500, help="optimizer steps (default: %(default)s)")
    t.add_argument("--ttt-steps", type=int, default=3, help="unrolled training-time-test steps (default: "
                   "%(default)s)")
    t.add_argument("--draft-vocab", type=int, default=2048, help="draft vocabulary: the most frequent recorded "
                   "tokens (default: %(default)s)")
    t.add_argument("--window", type=int, default=128, help="tokens per training window (default: %(default)s)")
    t.add_argument("--batch", type=int, default=8, help="windows per step (default: %(default)s)")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    t.add_argument("--holdout", type=float, default=0.05, help="share of sequences held out for the acceptance "
                   "report, at least one where the recording has two or more (default: %(default)s)")
    t.add_argument("--soft", action="store_true", help="eagle3: train against the target's whole next-token "
                   "distribution (EAGLE's objective; record final_norm with the feature sites) instead of the "
                   "recorded tokens: more of its sampled drafts are accepted")
    t.add_argument("--no-resume", action="store_true", help="start over even if OUT holds a training state")
    t.add_argument("--json", action="store_true", help="print the metrics as one JSON object instead of a table")
    t.set_defaults(func=_cmd_train)

    s = sub.add_parser("serve-drafter", help="serve an EAGLE-3 drafter to a loop in another process",
                       description="Load a drafter and serve it over REQ/REP; it reads the target's features from the "
                       "loop's probe bus. In the loop: SpeculativeDecoder(model, decoder.RemoteEagle(ADDR)).")
    _common(s)
    s.add_argument("--bind", default="tcp://127.0.0.1:5600", help="address to serve on: loopback TCP or ipc:// "
                   "unless --allow-remote (default: %(default)s)")
    s.add_argument("--drafter", default="default", help="default | PATH (default: %(default)s)")
    s.add_argument("--allow-remote", action="store_true", help="let --bind be a non-loopback address; without "
                   "--curve-secret anyone who reaches it may draft (exit and subscribe stay loopback-only)")
    s.add_argument("--curve-secret", metavar="FILE", help="serve with CURVE: the server's secret certificate "
                   "(zmq.auth.create_certificates' NAME.key_secret); clients pass its public key to RemoteEagle")
    s.add_argument("--curve-clients", metavar="DIR", help="with --curve-secret: admit only the clients whose public "
                   "certificates are in DIR")
    s.add_argument("--max-message-mb", type=float, default=64.0, help="drop a client that sends a bigger message "
                   "(default: %(default)s)")
    s.add_argument("--max-prepare-mb", type=float, default=1024.0, help="refuse a prepare that would allocate more "
                   "than this for features and draft cache (default: %(default)s)")
    s.set_defaults(func=_cmd_serve)


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


def load_target(args: argparse.Namespace, need_tokenizer: bool = True):  # noqa: ANN201
    """(model, tokenizer) with --dtype and --device applied."""
    from probebus._load import load_model

    dev = _device(args.device)
    dtype = DTYPES.get(args.dtype)
    model, tok = load_model(args.model, dtype=dtype or "auto", need_tokenizer=need_tokenizer)
    if dtype is None and dev.type == "cpu" and model.dtype in (torch.bfloat16, torch.float16) and not _cpu_has_half():
        model = model.float()  # half precision on a CPU without native support is several times slower
    return model.to(dev), tok


def make_decoder(model: torch.nn.Module, drafter: str, k: int | None, *, fixed: bool = False,
                 endpoint: str | None = None, refresh_cost: bool = False, tree: int | None = None):  # noqa: ANN201 - a SpeculativeDecoder
    """The decoder for a --drafter value; raises DrafterError for a bad drafter."""
    from decoder import DrafterError, NgramDrafter, SpeculativeDecoder, load_drafter, load_named_drafter, tree_nodes
    from decoder.schedule import CostModel

    schedule = "fixed" if fixed else "auto"
    if drafter == "none":
        return SpeculativeDecoder(model, None, k=k)
    cost = CostModel.for_target(model, refresh=refresh_cost)
    if endpoint is not None and drafter == "ngram":
        raise UsageError("--endpoint: the n-gram drafter runs without a probe session; use --drafter default or "
                         "auto to get one")
    if drafter == "ngram":
        return SpeculativeDecoder(model, NgramDrafter(), k=k, schedule=schedule, cost=cost)
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
            return SpeculativeDecoder(model, NgramDrafter(), k=k, schedule=schedule, cost=cost)
        if fixed or tree:
            return SpeculativeDecoder(model, eagle, k=k, schedule=schedule, endpoint=endpoint, cost=cost,
                                      tree=tree or 0)
        return SpeculativeDecoder(model, "auto", model_drafter=eagle, k=k, endpoint=endpoint, cost=cost)
    if drafter.startswith(REMOTE):
        return SpeculativeDecoder(model, _remote(drafter), k=k, schedule=schedule, endpoint=endpoint, cost=cost,
                                  tree=0)
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
        return SpeculativeDecoder(model, loaded, k=k, schedule=schedule, endpoint=endpoint, cost=cost, tree=nodes)
    except ValueError as exc:  # a tree for a drafter that cannot grow one
        raise UsageError(f"--drafter {drafter}: {exc}") from None


def _remote(address: str):  # noqa: ANN202 - a decoder.RemoteEagle
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
                            refresh_cost=args.refresh_cost, tree=args.tree)
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

    def __init__(self, tok) -> None:  # noqa: ANN001
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


def _cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from decoder import TrainConfig, train_drafter

    rec = Path(args.recording)
    try:
        if not rec.is_dir():
            raise UsageError(f"--recording {rec}: no such folder (make one with probebus record)")
        if not any(rec.iterdir()):
            raise UsageError(f"--recording {rec} is empty (make one with probebus record)")
        if not 0 <= args.holdout < 1:
            raise UsageError(f"--holdout must be in [0, 1), got {args.holdout}")
        if args.steps < 1 or args.batch < 1 or args.window < 2 or args.ttt_steps < 1 or args.draft_vocab < 1:
            raise UsageError("--steps, --batch, --ttt-steps and --draft-vocab must be >= 1 and --window >= 2")
        model, _ = load_target(args, need_tokenizer=False)
    except UsageError as exc:
        return _fail("train-drafter", exc)
    for p in model.parameters():
        p.requires_grad_(False)
    if args.method != "eagle3":
        return _train_other(args, model, rec)
    cfg = TrainConfig(steps=args.steps, ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab, window=args.window,
                      batch=args.batch, lr=args.lr, holdout=args.holdout, soft=args.soft)
    try:
        metrics = train_drafter(model, rec, args.out, cfg, resume=not args.no_resume, target_name=args.model,
                                progress=sys.stderr.isatty())
    except (ValueError, FileNotFoundError, KeyError) as exc:  # unreadable, incomplete or foreign recordings
        return _fail("train-drafter", f"{rec}: {exc}" if str(rec) not in str(exc) else exc)
    keys = ("sequences", "heldout_sequences", "tokens", "resumed_from", "step", "loss", "acc", "seconds", "heldout")
    _report(args, {k: metrics[k] for k in keys if k in metrics}, "eagle3")
    print(f"drafter written to {args.out} (speculators layout); try: probebus generate --model {args.model} "
          f"--drafter {args.out} --prompt '...'", file=sys.stderr)
    return 0


def _report(args: argparse.Namespace, metrics: dict, method: str) -> None:
    """The metrics as a table (or one JSON line with --json), and a line when no held-out report was made."""
    from exporters._console import make_console
    from probebus._train_view import heldout_note, train_table

    if args.json:
        print(json.dumps(metrics))
    else:
        make_console().print(train_table(method, metrics, args.out))
    note = heldout_note(metrics, args.holdout)
    if note:
        print(f"probebus train-drafter: {note}", file=sys.stderr)


def _train_other(args: argparse.Namespace, model: torch.nn.Module, rec) -> int:  # noqa: ANN001
    """--method medusa | mtp | clustered | dspark | layer-skip."""
    from decoder.drafters import fit_layer_skip
    from decoder.training import (
        DSparkTrainConfig,
        HeadsTrainConfig,
        MTPTrainConfig,
        load_site_sequences,
        train_dspark,
        train_medusa,
        train_mtp,
    )
    from exporters import read_table

    kw = {"resume": not args.no_resume, "progress": sys.stderr.isatty()}
    try:
        if args.heads < 1 or args.clusters < 2:
            raise UsageError(f"--heads must be >= 1 and --clusters >= 2, got {args.heads}, {args.clusters}")
        common = {"steps": args.steps, "lr": args.lr, "holdout": args.holdout}
        if args.method == "medusa":
            metrics = train_medusa(model, rec, args.out, HeadsTrainConfig(heads=args.heads, **common),
                                   target_name=args.model, **kw)
        elif args.method in ("mtp", "clustered"):
            clusters = args.clusters if args.method == "clustered" else 0
            if args.attention and clusters:
                raise UsageError("--attention trains the flat MTP block; --method clustered has no attention")
            metrics = train_mtp(model, rec, args.out, MTPTrainConfig(depth=args.heads, clusters=clusters,
                                                                     attention=args.attention, window=args.window,
                                                                     sequences=args.batch, **common), **kw)
        elif args.method == "dspark":
            metrics = train_dspark(model, rec, args.out, DSparkTrainConfig(positions=args.heads, **common), **kw)
        else:
            sites = sorted(set(read_table(rec, columns=["site"]).column("site").to_pylist()))
            if not sites:
                raise UsageError(f"--recording {rec} holds no captures")
            seqs = [t for t, _ in load_site_sequences(rec, sites[:1])][:64]
            metrics = fit_layer_skip(model, seqs, args.out)
    except UsageError as exc:
        return _fail("train-drafter", exc)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        return _fail("train-drafter", f"{rec}: {exc}" if str(rec) not in str(exc) else exc)
    _report(args, {k: v for k, v in metrics.items() if k != "table"}, args.method)
    print(f"{args.method} drafter written to {args.out}; try: probebus generate --model {args.model} "
          f"--drafter {args.out} --prompt '...'", file=sys.stderr)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import zmq

    from decoder import DrafterError, load_drafter, serve_drafter
    from probe._curve import load_certificate
    from probe._endpoint import check_endpoint

    try:  # before the model loads: a refused address should not cost a minute
        check_endpoint(args.bind, args.allow_remote)
        secret = load_certificate(args.curve_secret, secret=True)[1] if args.curve_secret else None
    except ValueError as exc:
        if "refusing to bind" not in str(exc):
            return _fail("serve-drafter", exc)
        return _fail("serve-drafter", f"refusing to serve on {args.bind!r}: anyone who reaches it could use or stop "
                     "this drafter. Bind tcp://127.0.0.1:PORT or ipc://PATH, or pass --allow-remote (with "
                     "--curve-secret) to expose it on purpose")
    if args.curve_clients and not secret:
        return _fail("serve-drafter", "--curve-clients needs --curve-secret")
    if args.max_message_mb <= 0 or args.max_prepare_mb <= 0:
        return _fail("serve-drafter", "--max-message-mb and --max-prepare-mb must be positive")
    try:
        model, _ = load_target(args, need_tokenizer=False)
        drafter = load_drafter(args.drafter, model)
    except (UsageError, DrafterError) as exc:
        return _fail("serve-drafter", exc)
    torch.set_num_threads(1)  # the loop's process needs the cores more
    try:
        serve_drafter(args.bind, drafter, allow_remote=args.allow_remote, curve_secret_key=secret,
                      curve_clients=args.curve_clients, max_message_bytes=int(args.max_message_mb * 2**20),
                      max_prepare_bytes=int(args.max_prepare_mb * 2**20),
                      ready=lambda: print(f"serving drafter {drafter.source} on {args.bind}", file=sys.stderr,
                                          flush=True))
    except (ValueError, RuntimeError, zmq.ZMQError) as exc:  # the address is taken, a bad certificate folder
        return _fail("serve-drafter", exc)
    return 0
