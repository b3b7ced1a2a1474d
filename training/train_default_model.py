#!/usr/bin/env python3
"""Retrain probebus's small default causal LM on CPU (from scratch, or continuing a previous run).

Usage::

    nice -n 10 python training/train_default_model.py --out /tmp/pb-stage2 --init-from /tmp/pb-stage1
    nice -n 10 python training/train_default_model.py --out /tmp/pb-stage2 --init-from /tmp/pb-stage1 --resume
    # the shipped model took three such stages: see "Training history" in probebus/models/default/README.md
    python training/train_default_model.py --out /tmp/m --steps 20 --minutes 2 --eval-every 0   # smoke run
    # a smaller sibling with the default model's tokenizer (draft model for speculative decoding;
    # the exact command of the shipped one is in probebus/models/default-draft-model/README.md):
    nice -n 10 python training/train_default_model.py --out /tmp/pb-draft --tokenizer-from probebus/models/default \
        --hidden-size 128 --layers 2 --heads 2 --intermediate-size 384 --log training/logs/draft_model_train.log

Steps (all deterministic given ``--seed``, apart from floating-point
non-determinism of multi-threaded CPU kernels and the ``--minutes`` budget):

1. corpus: the running interpreter's standard-library ``.py`` files, filtered and
   split by file into train / held-out (``probebus.models.corpus``);
   the split is written to ``<out>/splits.json``;
2. tokenizer: byte-level BPE trained with ``tokenizers`` on the train files only
   (or copied from ``--init-from`` / ``--tokenizer-from``, whose split must be the same);
3. model: a stock ``transformers`` ``LlamaForCausalLM`` trained with AdamW (bf16
   autocast, fp32 weights), linear warmup + cosine decay, on packed sequences of
   ``[bos] file [eos]``, optionally with DITTO anti-repetition rows (``_ditto.py``);
   ``<out>/checkpoint.pt`` every ``--ckpt-every`` steps, ``--resume`` continues from it;
4. evaluation: held-out loss with ``probebus.models.corpus.causal_lm_loss`` on the
   fixed subset the test suite uses (``eval.json``) and on the full held-out split,
   and greedy degeneracy (``corpus.heldout_degeneracy``) against the real text;
5. model card ``<out>/README.md`` (``_card.py``) with hyper-parameters, metrics, samples.

Train into a scratch folder and copy it over ``probebus/models/default`` when it is
better. Training is never run in CI; the test suite only checks the shipped result.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from _card import greedy_samples, history_markdown, previous_history, write_card  # noqa: E402  (the script's folder)
from _ditto import DittoRows, ditto_loss  # noqa: E402
from _evaluate import full_eval, quick_eval  # noqa: E402

from probebus.models import DEFAULT_MODEL_DIR, corpus  # noqa: E402

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="output model folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--minutes",
        type=float,
        default=75.0,
        help="wall-clock budget of the optimisation loop; on a slower machine the "
        "LR schedule is compressed to end on time (see schedule_progress)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--heldout-percent", type=int, default=corpus.DEFAULT_HELDOUT_PERCENT)
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this model folder's weights and tokenizer (its architecture must match "
        "the model arguments and its splits.json this run's split) instead of random weights",
    )
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="copy this model folder's tokenizer files unchanged (its splits.json must match this run's "
        "split) and train a new model of the architecture given by the model arguments from random weights",
    )
    p.add_argument(
        "--log",
        default=None,
        help="training log recorded in eval.json's history (the script prints to stdout: tee it there); "
        "default training/logs/default_model_train_stage<N>.log",
    )
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt if present")
    p.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--baseline", type=Path, default=None, help="also evaluate this model folder for the card")
    # tokenizer
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    # model
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--intermediate-size", type=int, default=640)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    # optimisation
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=10, help="sequences per step (DITTO rows included)")
    p.add_argument("--steps", type=int, default=4000, help="maximum optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.05, help="final lr / peak lr")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument(
        "--autocast",
        choices=("bf16", "none"),
        default="bf16",
        help="bf16 autocast for the forward pass (weights, gradients and AdamW stay fp32); "
        "about 1.7x faster on CPUs with AVX512-BF16",
    )
    # anti-repetition (training/_ditto.py)
    p.add_argument("--ditto-rows", type=int, default=2, help="rows per step that are DITTO repetition rows")
    p.add_argument("--ditto-span-min", type=int, default=8)
    p.add_argument("--ditto-span-max", type=int, default=48)
    p.add_argument("--ditto-weight", type=float, default=1.0, help="weight of the DITTO loss")
    p.add_argument("--ditto-lambda", type=float, default=0.5, help="target decay of repeated-token probability")
    p.add_argument("--ditto-from-rep", type=int, default=2, help="first repetition the DITTO loss applies to")
    p.add_argument(
        "--ditto-prefix-max",
        type=int,
        default=0,
        help="0: DITTO rows repeat from their first token (the paper); N > 0: rows start with up to N "
        "tokens of real text and fall into a loop of its last span",
    )
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument(
        "--eval-every",
        type=int,
        default=400,
        help="quick held-out eval (loss + greedy degeneracy on a few files); 0 = off",
    )
    return p.parse_args(argv)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- data


def select_corpus(heldout_percent: int) -> tuple[Path, list[str], list[str]]:
    root = corpus.stdlib_root()
    files = corpus.list_corpus_files(root)
    train, heldout = corpus.split_files(files, heldout_percent)
    return root, train, heldout


def write_splits(out: Path, root: Path, train: list[str], heldout: list[str], pct: int) -> None:
    splits = {
        "stdlib_root_hint": str(root),
        "python_version": platform.python_version(),
        "filters": {
            "source": 'sysconfig.get_paths()["stdlib"], recursive *.py, sorted POSIX relative paths',
            "excluded_dir_components": list(corpus.EXCLUDED_DIRS),
            "split": f"held out iff int(sha256(relative_path)[:8], 16) % 100 < {pct}",
            "heldout_percent": pct,
        },
        "train": train,
        "heldout": heldout,
    }
    (out / "splits.json").write_text(json.dumps(splits, indent=1) + "\n", encoding="utf-8")


def train_tokenizer(root: Path, train: list[str], vocab_size: int, min_frequency: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (corpus.read_source(root / rel) for rel in train)
    tok.train_from_iterator(texts, trainer=trainer, length=len(train))
    bos_id = tok.token_to_id(BOS)
    # tokenizer(text) prepends <|bos|> (as at the start of every training document);
    # use add_special_tokens=False for raw pieces.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=None,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.model_max_length = 1024
    fast.save_pretrained(out)
    # Name the generic class (an alias of transformers 5's TokenizersBackend) so the
    # folder is not tied to one transformers release's class name.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    return fast


def build_stream(tokenizer: Any, root: Path, train: list[str]) -> list[int]:
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # files longer than model_max_length are expected here
    try:
        ids: list[int] = []
        for rel in train:
            ids.extend(corpus.encode_document(tokenizer, corpus.read_source(root / rel)))
    finally:
        hf_logging.set_verbosity(previous)
    return ids


class PackedBatches:
    """Packed fixed-length blocks; each epoch uses a new random offset and order."""

    def __init__(self, stream: Any, seq_len: int, batch_size: int, seed: int) -> None:
        import torch

        self.torch = torch
        self.stream = stream
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.tokens_per_epoch = len(stream)
        self._queue: list[Any] = []

    def _new_epoch(self) -> None:
        torch = self.torch
        offset = 0 if self.epoch == 0 else int(torch.randint(self.seq_len, (1,), generator=self.gen))
        n = (len(self.stream) - offset) // self.seq_len
        blocks = self.stream[offset : offset + n * self.seq_len].view(n, self.seq_len)
        order = torch.randperm(n, generator=self.gen)
        self._queue = [
            blocks[order[i : i + self.batch_size]] for i in range(0, n - self.batch_size + 1, self.batch_size)
        ]
        self._queue.reverse()
        self.epoch += 1

    def next(self) -> Any:
        if not self._queue:
            self._epoch_start_state = self.gen.get_state()
            self._new_epoch()
        return self._queue.pop()

    def state_dict(self) -> dict[str, Any]:
        """Enough to rebuild the current epoch's order and position (checkpoints)."""
        return {
            "epoch": self.epoch,
            "epoch_start_state": getattr(self, "_epoch_start_state", None),
            "remaining": len(self._queue),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: replay the epoch's shuffle, drop the batches already used."""
        if state["epoch"] == 0:
            return
        self.gen.set_state(state["epoch_start_state"])
        self._epoch_start_state = state["epoch_start_state"]
        self.epoch = state["epoch"] - 1
        self._new_epoch()
        del self._queue[state["remaining"] :]  # next() pops from the end


# --------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace, tokenizer: Any):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=args.max_positions,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = build_model_generation_config(tokenizer)
    return model


def build_model_generation_config(tokenizer: Any):  # a transformers GenerationConfig
    """Greedy, 64 new tokens, the tokenizer's special ids (shipped as generation_config.json)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )


def schedule_progress(step: int, elapsed: float, args: argparse.Namespace) -> float:
    """Fraction of training done: the larger of the step and the wall-clock fractions.

    On a machine fast enough to finish ``--steps`` within ``--minutes`` the schedule
    is purely step-based (deterministic); on a slower or busy machine the cosine
    decay is compressed so that it still completes when the time budget runs out.
    """
    return max(step / args.steps, elapsed / (args.minutes * 60.0))


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup (in steps) to ``--lr``, then cosine decay to ``lr * min_lr_ratio``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    warm = args.warmup_steps / args.steps
    frac = min(1.0, max(0.0, (progress - warm) / max(1e-9, 1.0 - warm)))
    cosine = 0.5 * (1.0 + math.cos(math.pi * frac))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


def make_optimizer(model: Any, args: argparse.Namespace):
    import torch

    decay, no_decay = [], []
    for _name, param in model.named_parameters():
        (decay if param.dim() >= 2 else no_decay).append(param)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=1e-8,
    )


# --------------------------------------------------------------------------- training


def check_splits(flag: str, src: Path, train: list[str], heldout: list[str]) -> None:
    """Refuse a source folder (``--init-from`` / ``--tokenizer-from``) whose split differs from this run's."""
    src_splits = corpus.load_splits(src)
    if src_splits["train"] != train or src_splits["heldout"] != heldout:
        raise SystemExit(f"{flag} {src}: its splits.json differs from this run's split; refusing, "
                         "held-out files could have been trained on")


def copy_tokenizer(src: Path, out: Path) -> Any:
    """Copy ``src``'s tokenizer files (byte for byte) into ``out`` and load them from there."""
    import shutil

    from transformers import AutoTokenizer

    if src.resolve() != out.resolve():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / name, out / name)
    return AutoTokenizer.from_pretrained(out)


def load_init(args: argparse.Namespace, out: Path, train: list[str], heldout: list[str]):
    """``(model, tokenizer)`` from ``--init-from``, after checking it fits this run."""
    from transformers import LlamaForCausalLM

    src: Path = args.init_from
    check_splits("--init-from", src, train, heldout)
    model = LlamaForCausalLM.from_pretrained(src, dtype="float32")
    c = model.config
    got = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
           c.intermediate_size, c.max_position_embeddings, c.vocab_size)
    want = (args.hidden_size, args.layers, args.heads, args.kv_heads, args.intermediate_size,
            args.max_positions, args.vocab_size)
    if got != want:
        raise SystemExit(f"--init-from {src}: architecture {got} differs from the arguments {want}")
    return model, copy_tokenizer(src, out)


def retrain_command(args: argparse.Namespace, out: Path) -> str:
    """The command line that repeats this run (arguments that differ from the defaults)."""
    defaults = vars(parse_args([]))
    parts = ["nice -n 10 python training/train_default_model.py"]
    if Path(out).resolve() != DEFAULT_MODEL_DIR.resolve():
        parts.append(f"--out {out}")
    parts += [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
              if k not in ("out", "resume", "baseline") and v != defaults[k]]
    return " ".join(parts)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomic ``torch.save`` (a kill mid-write leaves the previous checkpoint intact)."""
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_loop(args, model, optimizer, batches, ditto, eval_ids, tokenizer, heldout, ckpt_path) -> dict[str, Any]:
    """Optimise until ``--steps`` or ``--minutes``; checkpoint every ``--ckpt-every`` steps."""
    import torch
    import torch.nn.functional as F

    st: dict[str, Any] = {"step": 0, "losses": [], "ditto_losses": [], "tokens_seen": 0, "seconds": 0.0,
                          "evals": [], "stopped_by_time": False}
    if args.resume and ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        batches.load_state_dict(ck["batches"])
        if ditto is not None:
            ditto.load_state_dict(ck["ditto"])
        torch.set_rng_state(ck["rng"])
        st = ck["state"]
        log(f"resumed from {ckpt_path} at step {st['step']} ({st['seconds'] / 60:.1f} min done)")

    def checkpoint() -> None:
        save_checkpoint(ckpt_path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "batches": batches.state_dict(), "rng": torch.get_rng_state(),
                                    "ditto": ditto.state_dict() if ditto is not None else None, "state": st})

    model.train()
    autocast = args.autocast == "bf16"
    t0, base = time.time(), st["seconds"]
    while st["step"] < args.steps:
        step = st["step"]
        st["seconds"] = base + time.time() - t0
        progress = schedule_progress(step, st["seconds"], args)
        if progress >= 1.0:
            st["stopped_by_time"] = True
            log(f"time budget of {args.minutes} min reached at step {step}; stopping")
            break
        lr = lr_at(step, progress, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        lm = batches.next()
        inp = lm
        if ditto is not None:
            drows, spans, loop_starts = ditto.sample(args.ditto_rows)
            inp = torch.cat([lm, drows])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=inp).logits
        n_lm = lm.shape[0]
        lm_logits = logits[:n_lm, :-1].float()
        lm_loss = F.cross_entropy(lm_logits.reshape(-1, lm_logits.size(-1)), lm[:, 1:].reshape(-1))
        loss = lm_loss
        if ditto is not None:
            d_loss = ditto_loss(logits[n_lm:], drows, spans, args.ditto_lambda, args.ditto_from_rep, loop_starts)
            loss = lm_loss + args.ditto_weight * d_loss
            st["ditto_losses"].append(d_loss.item())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        st["losses"].append(lm_loss.item())
        st["tokens_seen"] += lm.numel()
        st["step"] = done = step + 1
        st["seconds"] = base + time.time() - t0
        if done % args.log_every == 0 or done == args.steps:
            recent = st["losses"][-args.log_every :]
            d_recent = st["ditto_losses"][-args.log_every :]
            frac = schedule_progress(done, st["seconds"], args)
            eta = st["seconds"] / frac * (1.0 - frac)
            log(
                f"step {done}/{args.steps} ({100 * frac:.0f}%) loss {sum(recent) / len(recent):.3f}"
                + (f" ditto {sum(d_recent) / len(d_recent):.3f}" if d_recent else "")
                + f" lr {lr:.2e} {st['tokens_seen'] / max(st['seconds'], 1e-9):,.0f} tok/s epoch {batches.epoch} "
                f"elapsed {st['seconds'] / 60:.1f}m eta {eta / 60:.1f}m"
            )
        if args.eval_every and done % args.eval_every == 0 and done < args.steps:
            t_eval = time.time()
            ev = quick_eval(model, tokenizer, eval_ids, heldout)
            model.train()
            t0 += time.time() - t_eval  # evaluation time is not training time
            st["evals"].append({"step": done, **ev})
            log(f"step {done}: held-out loss {ev['loss']:.4f}, greedy degeneracy {ev['degeneracy']:.3f} "
                f"({ev['files']} files)")
        if done % args.ckpt_every == 0:
            checkpoint()
    if st["stopped_by_time"] or st["step"] >= args.steps:
        checkpoint()  # the final state survives a crash in the evaluation below
    return st


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.ditto_rows >= args.batch_size:
        raise SystemExit("--ditto-rows must be smaller than --batch-size")
    if args.init_from and args.tokenizer_from:
        raise SystemExit("--init-from already brings its tokenizer; drop --tokenizer-from")

    root, train, heldout = select_corpus(args.heldout_percent)
    log(f"corpus: {root} -> {len(train)} train / {len(heldout)} held-out files")
    if args.init_from:
        model, tokenizer = load_init(args, out, train, heldout)
        log(f"initialised from {args.init_from}")
    elif args.tokenizer_from:
        check_splits("--tokenizer-from", args.tokenizer_from, train, heldout)
        tokenizer = copy_tokenizer(args.tokenizer_from, out)
        if len(tokenizer) != args.vocab_size:
            raise SystemExit(f"--tokenizer-from {args.tokenizer_from}: vocabulary {len(tokenizer)}, "
                             f"not --vocab-size {args.vocab_size}")
        model = build_model(args, tokenizer)
        log(f"tokenizer copied from {args.tokenizer_from}; random initialisation")
    else:
        tokenizer = train_tokenizer(root, train, args.vocab_size, args.min_frequency, out)
        model = build_model(args, tokenizer)
    write_splits(out, root, train, heldout, args.heldout_percent)
    log(f"tokenizer: vocab {len(tokenizer)}")
    stream_list = build_stream(tokenizer, root, train)
    train_chars = sum(len(corpus.read_source(root / rel)) for rel in train)
    stream = torch.tensor(stream_list, dtype=torch.long)
    del stream_list
    log(f"train stream: {len(stream):,} tokens, {train_chars / len(stream):.2f} chars/token")

    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params:,} parameters")
    optimizer = make_optimizer(model, args)
    batches = PackedBatches(stream, args.seq_len, args.batch_size - args.ditto_rows, args.seed)
    ditto = None
    if args.ditto_rows:
        special = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
        ditto = DittoRows(stream, args.seq_len, args.ditto_span_min, args.ditto_span_max, args.seed, special,
                          args.ditto_prefix_max)

    eval_ids, eval_files = corpus.heldout_eval_ids(tokenizer, {"heldout": heldout}, root=root)
    log(f"held-out eval subset: {len(eval_ids)} tokens from {len(eval_files)} files")
    st = train_loop(args, model, optimizer, batches, ditto, eval_ids, tokenizer, heldout, out / "checkpoint.pt")
    log(f"training done: {st['step']} steps, {st['tokens_seen']:,} tokens, {st['seconds'] / 60:.1f} min")

    model.eval()
    model.generation_config = build_model_generation_config(tokenizer)
    ev = full_eval(model, tokenizer, root, heldout, args.seq_len)
    log(f"held-out loss: eval subset {ev['heldout_loss']:.4f}, full {ev['full_heldout_loss']:.4f}; greedy "
        f"degeneracy {ev['degeneracy']:.3f} (real text {ev['degeneracy_reference']:.3f}, "
        f"{ev['degeneracy_files']} files)")
    model.save_pretrained(out)
    history = previous_history(args)
    ev["history"] = [*history, {
        "command": retrain_command(args, out),
        "steps": st["step"],
        "lm_tokens": st["tokens_seen"],
        "train_minutes": round(st["seconds"] / 60, 1),
        "heldout_loss": ev["heldout_loss"],
        "degeneracy": ev["degeneracy"],
        "log": args.log or f"training/logs/default_model_train_stage{len(history) + 1}.log",
    }]
    (out / "eval.json").write_text(json.dumps(ev, indent=1) + "\n", encoding="utf-8")

    baseline = None
    if args.baseline:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        bmodel = AutoModelForCausalLM.from_pretrained(args.baseline)
        baseline = {"path": str(args.baseline), **full_eval(bmodel, AutoTokenizer.from_pretrained(args.baseline),
                                                            root, heldout, args.seq_len)}
        log(f"baseline {args.baseline}: loss {baseline['heldout_loss']:.4f}, degeneracy {baseline['degeneracy']:.3f}")

    samples = greedy_samples(model, tokenizer, root, heldout)
    for s in samples:
        log(f"sample from {s['source']}:\n{s['prompt']}{s['continuation']}\n---")

    window = min(100, len(st["losses"]))
    info = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "retrain_command": ev["history"][-1]["command"],
        "init_from": str(args.init_from) if args.init_from else None,
        "tokenizer_from": str(args.tokenizer_from) if args.tokenizer_from else None,
        "params": params,
        "python_version": platform.python_version(),
        "n_train": len(train),
        "n_heldout": len(heldout),
        "train_tokens": len(stream),
        "train_chars": train_chars,
        "vocab_size": len(tokenizer),
        "steps_done": st["step"],
        "stopped_by_time": st["stopped_by_time"],
        "tokens_seen": st["tokens_seen"],
        "epochs": st["tokens_seen"] / len(stream),
        "train_seconds": st["seconds"],
        "total_seconds": time.time() - t_start,
        "threads": args.threads,
        "cpu": f"{platform.machine()}, {os.cpu_count()} logical CPUs",
        "final_train_loss": sum(st["losses"][-window:]) / max(1, window),
        "train_loss_window": window,
        "eval": ev,
        "baseline": baseline,
        "degeneracy_files": ev["degeneracy_per_file"],
        "samples": samples,
        "weights_mb": (out / "model.safetensors").stat().st_size / 1e6,
        "history_md": history_markdown(ev["history"]),
    }
    write_card(out, info)
    (out / "checkpoint.pt").unlink(missing_ok=True)
    log(f"wrote {out} in {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
