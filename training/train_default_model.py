#!/usr/bin/env python3
"""Retrain probebus's small default causal LM from scratch, on CPU.

Usage::

    nice -n 10 python training/train_default_model.py            # defaults = shipped model
    python training/train_default_model.py --out /tmp/m --steps 20 --minutes 2   # smoke run

Steps (all deterministic given ``--seed``, apart from floating-point
non-determinism of multi-threaded CPU kernels):

1. corpus: the running interpreter's standard-library ``.py`` files, filtered and
   split by file into train / held-out (``probebus.models.corpus``);
   the split is written to ``<out>/splits.json``;
2. tokenizer: byte-level BPE trained with ``tokenizers`` on the train files only;
3. model: a stock ``transformers`` ``LlamaForCausalLM`` trained with AdamW, fp32,
   linear warmup + cosine decay, on packed sequences of ``[bos] file [eos]``;
4. evaluation: held-out loss with ``probebus.models.corpus.causal_lm_loss`` on the
   fixed subset the test suite uses (``eval.json``) and on the full held-out split;
5. model card ``<out>/README.md`` with hyper-parameters, metrics and greedy samples.

Training is never run in CI; the test suite only checks the shipped result.
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

from probebus.models import DEFAULT_MODEL_DIR, corpus  # noqa: E402

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2
SAMPLE_NEW_TOKENS = 64


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
        default=36.0,
        help="wall-clock budget of the optimisation loop; on a slower machine the "
        "LR schedule is compressed to end on time (see schedule_progress)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--heldout-percent", type=int, default=corpus.DEFAULT_HELDOUT_PERCENT)
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
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=12, help="sequences per step")
    p.add_argument("--steps", type=int, default=1800, help="maximum optimizer steps")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=500, help="quick held-out eval; 0 = off")
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
            self._new_epoch()
        return self._queue.pop()


# --------------------------------------------------------------------------- model


def build_model(args: argparse.Namespace, tokenizer: Any):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

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
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )
    return model


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


def greedy_samples(model: Any, tokenizer: Any, root: Path, heldout: list[str]) -> list[dict[str, str]]:
    """Greedy continuations of the first top-level ``def`` line (+ next line) of held-out files

    (sorted, skipping ``encodings/``), three prompts.
    """
    import torch

    prompts: list[tuple[str, str]] = []
    for rel in heldout:
        path = root / rel
        if rel.startswith("encodings/") or not path.is_file():
            continue  # generated codec tables make dull prompts
        lines = corpus.read_source(path).splitlines(keepends=True)
        for i, line in enumerate(lines):
            if line.startswith("def ") and i + 1 < len(lines) and lines[i + 1].strip():
                prompts.append((rel, line + lines[i + 1]))
                break
        if len(prompts) == 3:
            break
    samples = []
    model.eval()
    for rel, prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=SAMPLE_NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
        cont = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        samples.append({"source": rel, "prompt": prompt, "continuation": cont})
    return samples


# --------------------------------------------------------------------------- card


def write_card(out: Path, info: dict[str, Any]) -> None:
    a = info["args"]
    retrain = "nice -n 10 python training/train_default_model.py"
    non_default = info["non_default_args"]
    if non_default:
        retrain += " " + " ".join(non_default)
    hp_rows = "\n".join(f"| `{k}` | {v} |" for k, v in a.items() if k not in ("out",))
    sample_md = "\n\n".join(
        f"**Prompt** (first top-level `def` of held-out `{s['source']}`):\n\n```python\n{s['prompt']}```\n\n"
        f"**Greedy continuation** ({SAMPLE_NEW_TOKENS} new tokens):\n\n```python\n{s['continuation']}\n```"
        for s in info["samples"]
    )
    stopped = (
        f"\n> The `--minutes` budget, not `--steps`, ended training: {info['steps_done']} of "
        f"{a['steps']} steps were done, with the cosine decay compressed to finish on time "
        "(see `schedule_progress` in the script).\n"
        if info["stopped_by_time"]
        else ""
    )
    ev = info["eval"]
    model_rows = "\n".join(
        [
            f"| architecture | `LlamaForCausalLM`, hidden {a['hidden_size']}, {a['layers']} layers, "
            f"{a['heads']} heads (head dim {a['hidden_size'] // a['heads']}), KV heads {a['kv_heads']}, "
            f"MLP {a['intermediate_size']}, RoPE θ={a['rope_theta']:g}, tied embeddings, "
            f"max positions {a['max_positions']} |",
            f"| parameters | {info['params']:,} |",
            f"| weights | fp32 safetensors, {info['weights_mb']:.1f} MB |",
            f"| optimizer | AdamW (β=({a['beta1']}, {a['beta2']}), weight decay {a['weight_decay']} on matrices), "
            f"grad clip {a['grad_clip']} |",
            f"| schedule | linear warmup {a['warmup_steps']} steps to {a['lr']:g}, cosine decay to "
            f"{a['lr'] * a['min_lr_ratio']:g} at progress 1, progress = max(step / {a['steps']}, "
            f"elapsed / {a['minutes']:g} min) |",
            f"| batch | {a['batch_size']} × {a['seq_len']} = {a['batch_size'] * a['seq_len']:,} tokens/step |",
            f"| steps done | {info['steps_done']} |",
            f"| tokens seen | {info['tokens_seen']:,} (≈ {info['epochs']:.2f} epochs) |",
            f"| training wall time | {info['train_seconds'] / 60:.1f} min optimisation loop, "
            f"{info['total_seconds'] / 60:.1f} min end to end, {info['threads']} CPU threads ({info['cpu']}) |",
            f"| final train loss | {info['final_train_loss']:.3f} (mean of last {info['train_loss_window']} steps) |",
        ]
    )
    eval_rows = "\n".join(
        [
            f"| held-out, fixed eval subset (`eval.json`, checked by the tests) | {ev['heldout_loss']:.4f} | "
            f"{math.exp(ev['heldout_loss']):.2f} | {ev['eval_tokens']:,} |",
            f"| held-out, all {info['n_heldout']} files | {info['full_heldout_loss']:.4f} | "
            f"{math.exp(info['full_heldout_loss']):.2f} | {info['full_heldout_tokens']:,} |",
        ]
    )
    card = f"""# probebus default model

A tiny Llama-architecture causal language model (stock `transformers`
`LlamaForCausalLM`, {info["params"]:,} parameters, {a["layers"]} decoder layers) trained
from scratch, on CPU, on the Python standard library's own source code. It ships with
probebus so every command works offline; it is a test fixture and demo model, **not** a
useful code assistant.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from probebus.models import resolve_model

path = resolve_model("default")
model = AutoModelForCausalLM.from_pretrained(path)
tokenizer = AutoTokenizer.from_pretrained(path)
```

## Retrain

```bash
{retrain}
```

Seed `{a["seed"]}`, `--threads {a["threads"]}`. This rewrites every file in
`probebus/models/default/` (config, weights, tokenizer, `splits.json`, `eval.json`,
this card). Multi-threaded CPU kernels are not bit-reproducible, so a retrain gives a
close but not identical model. Training is never run in CI.

## Data

* Source: the `.py` files of the training interpreter's standard library
  (`sysconfig.get_paths()["stdlib"]`, Python {info["python_version"]}), sorted by POSIX
  relative path.
* Filters: drop any file with a directory component in
  `{", ".join(corpus.EXCLUDED_DIRS)}` (tests, IDLE, lib2to3, generated pydoc data, installed
  packages).
* Split by file: held out iff `int(sha256(relative_path)[:8], 16) % 100 < {a["heldout_percent"]}`.
  {info["n_train"]} train files, {info["n_heldout"]} held-out files (never trained on, not
  used for the tokenizer). The lists are in `splits.json`.
* Documents are encoded as `<|bos|> file <|eos|>` and concatenated; training uses packed
  blocks of {a["seq_len"]} tokens (documents may span blocks); each epoch starts at a new
  random offset and visits blocks in a new random order.
* Train stream: {info["train_tokens"]:,} tokens ({info["train_chars"]:,} characters,
  {info["train_chars"] / info["train_tokens"]:.2f} characters/token).

## Tokenizer

Byte-level BPE trained with `tokenizers` on the train files only: vocabulary
{info["vocab_size"]} (special tokens `<|pad|>`=0, `<|bos|>`=1, `<|eos|>`=2), min
frequency {a["min_frequency"]}, GPT-2 byte-level pre-tokenisation without prefix space.
`tokenizer(text)` prepends `<|bos|>` (as at the start of every training document);
`AutoTokenizer.from_pretrained` returns a fast tokenizer. `<|pad|>` is a dedicated
token, so `tokenizer.padding_side = "left"; tokenizer(batch, padding=True)` works.

## Model and training

| | |
|---|---|
{model_rows}
{stopped}
All hyper-parameters (`training/train_default_model.py` arguments):

| argument | value |
|---|---|
{hp_rows}

## Evaluation

| | loss (nats/token) | perplexity | tokens |
|---|---|---|---|
{eval_rows}

Method (`probebus.models.corpus.causal_lm_loss` / `heldout_eval_ids`, shared with
`tests/test_default_model.py`): {corpus.EVAL_METHOD} The full held-out row uses the same
method with no per-file or total cap. Perplexities are per BPE token of this tokenizer,
so they are not comparable with other tokenizers.

## Greedy samples

{sample_md}

## Limitations

Tiny, trained for minutes on a few MB of one project's code: it produces Python-looking
text with plausible local syntax and identifiers, but not correct programs. No safety
tuning. Only for testing and demonstrating probebus.
"""
    (out / "README.md").write_text(card, encoding="utf-8")


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

    root, train, heldout = select_corpus(args.heldout_percent)
    log(f"corpus: {root} -> {len(train)} train / {len(heldout)} held-out files")
    write_splits(out, root, train, heldout, args.heldout_percent)

    tokenizer = train_tokenizer(root, train, args.vocab_size, args.min_frequency, out)
    log(f"tokenizer: vocab {len(tokenizer)}")
    stream_list = build_stream(tokenizer, root, train)
    train_chars = sum(len(corpus.read_source(root / rel)) for rel in train)
    stream = torch.tensor(stream_list, dtype=torch.long)
    del stream_list
    log(f"train stream: {len(stream):,} tokens, {train_chars / len(stream):.2f} chars/token")

    model = build_model(args, tokenizer)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params:,} parameters")
    model.train()
    optimizer = make_optimizer(model, args)
    batches = PackedBatches(stream, args.seq_len, args.batch_size, args.seed)

    eval_ids, eval_files = corpus.heldout_eval_ids(tokenizer, {"heldout": heldout}, root=root)
    log(f"held-out eval subset: {len(eval_ids)} tokens from {len(eval_files)} files")
    t_train = time.time()
    losses: list[float] = []
    tokens_seen = 0
    stopped_by_time = False
    for step in range(args.steps):
        elapsed = time.time() - t_train
        progress = schedule_progress(step, elapsed, args)
        if progress >= 1.0:
            stopped_by_time = True
            log(f"time budget of {args.minutes} min reached at step {step}; stopping")
            break
        lr = lr_at(step, progress, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = batches.next()
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        tokens_seen += batch.numel()
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            elapsed = time.time() - t_train
            recent = sum(losses[-args.log_every :]) / len(losses[-args.log_every :])
            frac = schedule_progress(done, elapsed, args)
            eta = elapsed / frac * (1.0 - frac)
            log(
                f"step {done}/{args.steps} ({100 * frac:.0f}%) loss {recent:.3f} "
                f"lr {lr:.2e} {tokens_seen / elapsed:,.0f} tok/s epoch {batches.epoch} "
                f"elapsed {elapsed / 60:.1f}m eta {eta / 60:.1f}m"
            )
        if args.eval_every and done % args.eval_every == 0 and done < args.steps:
            log(f"step {done}: held-out eval loss {corpus.causal_lm_loss(model, eval_ids):.4f}")
    steps_done = len(losses)
    train_seconds = time.time() - t_train
    log(f"training done: {steps_done} steps, {tokens_seen:,} tokens, {train_seconds / 60:.1f} min")

    model.eval()
    heldout_loss = corpus.causal_lm_loss(model, eval_ids)
    full_ids: list[int] = []
    for rel in heldout:
        full_ids.extend(corpus.encode_document(tokenizer, corpus.read_source(root / rel)))
    full_ids = full_ids[: len(full_ids) - len(full_ids) % args.seq_len]
    full_loss = corpus.causal_lm_loss(model, full_ids, seq_len=args.seq_len)
    log(f"held-out loss: eval subset {heldout_loss:.4f} ({len(eval_ids)} tokens), full {full_loss:.4f}")

    model.save_pretrained(out)
    eval_info = {
        "heldout_loss": round(heldout_loss, 5),
        "heldout_perplexity": round(math.exp(heldout_loss), 3),
        "eval_tokens": len(eval_ids),
        "eval_files": eval_files,
        "eval_method": corpus.EVAL_METHOD,
        "python_version": platform.python_version(),
        "full_heldout_loss": round(full_loss, 5),
        "full_heldout_tokens": len(full_ids),
    }
    (out / "eval.json").write_text(json.dumps(eval_info, indent=1) + "\n", encoding="utf-8")

    samples = greedy_samples(model, tokenizer, root, heldout)
    for s in samples:
        log(f"sample from {s['source']}:\n{s['prompt']}{s['continuation']}\n---")

    defaults = vars(parse_args([]))
    non_default = [
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out",) and v != defaults[k]
    ]
    if Path(out).resolve() != DEFAULT_MODEL_DIR.resolve():
        non_default.insert(0, f"--out {out}")
    window = min(100, len(losses))
    info = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "non_default_args": non_default,
        "params": params,
        "python_version": platform.python_version(),
        "n_train": len(train),
        "n_heldout": len(heldout),
        "train_tokens": len(stream),
        "train_chars": train_chars,
        "vocab_size": len(tokenizer),
        "steps_done": steps_done,
        "stopped_by_time": stopped_by_time,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / len(stream),
        "train_seconds": train_seconds,
        "total_seconds": time.time() - t_start,
        "threads": args.threads,
        "cpu": f"{platform.machine()}, {os.cpu_count()} logical CPUs",
        "final_train_loss": sum(losses[-window:]) / max(1, window),
        "train_loss_window": window,
        "eval": eval_info,
        "full_heldout_loss": full_loss,
        "full_heldout_tokens": len(full_ids),
        "samples": samples,
        "weights_mb": (out / "model.safetensors").stat().st_size / 1e6,
    }
    write_card(out, info)
    log(f"wrote {out} in {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
