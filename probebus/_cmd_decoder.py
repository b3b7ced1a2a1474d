"""`probebus generate`, `probebus train-drafter` and `probebus serve-drafter`: the decoder package on the command line.

    probebus generate --model default --prompt "def parse(" --max-new-tokens 64     # auto: EAGLE-3 + n-gram
    probebus generate --model MY_MODEL --prompt "def parse("      # no drafter beside it: n-gram, said in one line
    probebus generate --model default --drafter medusa --prompts p.jsonl --json
    probebus generate --model default --drafter tcp://127.0.0.1:5600 --prompt "x"   # a `serve-drafter` process
    probebus train-drafter --model default --recording rec/ --out my-drafter/
    probebus serve-drafter --bind tcp://127.0.0.1:5600 --model default             # decoder.RemoteEagle(addr)

This module holds the three commands' arguments and `serve-drafter`; `generate` is `_cmd_generate.py`,
`train-drafter` `_cmd_train.py`. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ._cmd_generate import DRAFTER_NAMES, DTYPES, SEPARATOR, UsageError, _cmd_generate, _fail, load_target
from ._cmd_train import _cmd_train

__all__ = ["DRAFTER_NAMES", "SEPARATOR", "register"]


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
    how = p.add_mutually_exclusive_group()
    how.add_argument("--compiled", action="store_true", help="run the target's forwards compiled (torch.compile "
                     "over a static KV cache) for every prompt; the first one compiles them first")
    how.add_argument("--compiled-auto", action="store_true", help="the first prompt eagerly, later batch-1 prompts "
                     "(--prompts FILE) compiled")
    how.add_argument("--eager", action="store_true", help="nothing compiled (by default, where --prompts holds "
                     "enough work to repay its compile, the plain steps of batch-1 prompts after the first run on "
                     "one compiled graph)")
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
    t.add_argument("--prompt-labels", action="store_true", help="eagle3: also train on the prompts' own next tokens "
                   "(real text, not what the target would say); by default only the recorded continuations are labels")
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
