"""`probebus generate` and `probebus train-drafter`: the decoder package on the command line.

    probebus generate --model default --drafter default --prompt "def parse(" --max-new-tokens 64
    probebus generate --model default --drafter ngram --prompts p.jsonl --json
    probebus train-drafter --model default --recording rec/ --out my-drafter/
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text, optionally with speculative decoding",
                       description="Generate from a model with a drafter: default (the shipped EAGLE-3 head), "
                       "PATH (an EAGLE-3 folder in either public layout), ngram (prompt lookup), auto "
                       "(EAGLE-3 or n-gram, chosen per round) or none. Output equals plain decoding.")
    p.add_argument("--model", default="default", help="default | PATH (default: %(default)s)")
    p.add_argument("--drafter", default="default", help="default | PATH | ngram | auto | none (default: %(default)s)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", help="JSON Lines with a 'prompt' field (or a text file: one prompt per line)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--k", type=int, default=5, help="draft tokens per round (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt: text, token_ids, stats")
    p.set_defaults(func=_cmd_generate)

    t = sub.add_parser("train-drafter", help="train an EAGLE-3 drafter from a recording",
                       description="Train an EAGLE-3 head from an Arrow recording made with `probebus record` "
                       "(resid_pre of the feature layers; see `probebus sites MODEL`). Resumes from OUT if a "
                       "training state is there.")
    t.add_argument("--model", default="default")
    t.add_argument("--recording", required=True, help="folder written by probebus record")
    t.add_argument("--out", required=True)
    t.add_argument("--steps", type=int, default=1500)
    t.add_argument("--ttt-steps", type=int, default=3, help="unrolled training-time-test steps (>= 3)")
    t.add_argument("--draft-vocab", type=int, default=2048)
    t.add_argument("--window", type=int, default=128)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--no-resume", action="store_true")
    t.set_defaults(func=_cmd_train)


def make_decoder(model: torch.nn.Module, drafter: str, k: int):  # noqa: ANN201 - a SpeculativeDecoder
    from decoder import NgramDrafter, SpeculativeDecoder, load_drafter
    from probebus._load import resolve_drafter

    if drafter == "none":
        return SpeculativeDecoder(model, None, k=k)
    if drafter == "ngram":
        return SpeculativeDecoder(model, NgramDrafter(), k=k)
    if drafter == "auto":
        return SpeculativeDecoder(model, "auto", eagle=load_drafter(resolve_drafter("default"), model), k=k)
    return SpeculativeDecoder(model, load_drafter(resolve_drafter(drafter), model), k=k)


def _cmd_generate(args: argparse.Namespace) -> int:
    from decoder import DrafterError
    from probebus._load import load_model
    from probebus._prompts import read_prompts

    prompts = read_prompts(args.prompt, args.prompts)
    model, tok = load_model(args.model)
    try:
        spec = make_decoder(model, args.drafter, args.k)
    except (DrafterError, FileNotFoundError) as exc:
        print(f"probebus generate: {exc}", file=sys.stderr)
        return 2
    eos = model.generation_config.eos_token_id
    with spec:
        for i in range(0, len(prompts), args.batch_size):
            chunk = prompts[i: i + args.batch_size]
            enc = tok(chunk, return_tensors="pt", padding=True)
            out = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=eos,
                                pad_token_id=tok.pad_token_id, seed=args.seed)
            stats = out.stats.as_dict()
            for r, prompt in enumerate(chunk):
                new = out.sequences[r, enc.input_ids.shape[1]:].tolist()
                if tok.pad_token_id is not None and eos != tok.pad_token_id:
                    new = [t for t in new if t != tok.pad_token_id]
                text = tok.decode(new, skip_special_tokens=True)
                if args.json:
                    print(json.dumps({"prompt": prompt, "text": text, "token_ids": new, "stats": stats}))
                else:
                    print(f"{prompt}\033[1m{text}\033[0m")
            if not args.json:
                print(f"[{args.drafter}] tau {stats['tau']:.2f}, {stats['tokens_per_forward']:.2f} tokens/forward, "
                      f"{stats['tokens_per_s']:.1f} tok/s, acceptance by position "
                      f"{[round(a, 2) for a in stats['acceptance']]}", file=sys.stderr)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from decoder import TrainConfig, train_drafter
    from probebus._load import load_model

    model, _ = load_model(args.model, need_tokenizer=False)
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = TrainConfig(steps=args.steps, ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab, window=args.window,
                      batch=args.batch, lr=args.lr)
    metrics = train_drafter(model, args.recording, args.out, cfg, resume=not args.no_resume, target_name=args.model)
    print(json.dumps({k: metrics[k] for k in ("sequences", "tokens", "resumed_from", "step", "loss", "acc",
                                                  "seconds")}))
    print(f"drafter written to {args.out} (speculators layout); try: probebus generate --model {args.model} "
          f"--drafter {args.out} --prompt '...'", file=sys.stderr)
    return 0
