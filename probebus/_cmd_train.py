"""`probebus train-drafter`: train a drafter (EAGLE-3, or the final-norm heads) from a recording of the target.

    probebus train-drafter --model default --recording rec/ --out my-drafter/
    probebus train-drafter --model default --recording rec/ --method medusa --out my-medusa/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ._cmd_generate import UsageError, _fail, load_target


def _cmd_train(args: argparse.Namespace) -> int:
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
                      batch=args.batch, lr=args.lr, holdout=args.holdout, soft=args.soft,
                      label_prompts=args.prompt_labels)
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


def _train_other(args: argparse.Namespace, model: torch.nn.Module, rec: Path) -> int:
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
