"""Greedy samples and the model card (README.md) of the default model.

Usage (from ``train_default_model.py``)::

    samples = greedy_samples(model, tokenizer, root, heldout)
    write_card(out, info)   # info: the dict main() assembles (args, metrics, samples, ...)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from probebus.models import corpus

SAMPLE_NEW_TOKENS = 64


def greedy_samples(model: Any, tokenizer: Any, root: Path, heldout: list[str]) -> list[dict[str, str]]:
    """Greedy continuations of the first top-level ``def`` line (+ next line) of held-out files.

    Usage: ``greedy_samples(model, tok, stdlib_root(), splits["heldout"])`` -> three samples
    (files in sorted order, ``encodings/`` skipped: generated codec tables make dull prompts).
    """
    import torch

    prompts: list[tuple[str, str]] = []
    for rel in heldout:
        path = root / rel
        if rel.startswith("encodings/") or not path.is_file():
            continue
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


def _model_rows(info: dict[str, Any]) -> str:
    a = info["args"]
    init = (
        f"| initialisation | weights of `{info['init_from']}` (the previous stage, see *Training history*) |"
        if info["init_from"]
        else "| initialisation | random (normal, std 0.02) |"
    )
    ditto = (
        f"| anti-repetition | DITTO rows: {a['ditto_rows']} of {a['batch_size']} rows per step repeat one "
        f"train span of {a['ditto_span_min']}-{a['ditto_span_max']} tokens, loss weight {a['ditto_weight']}, "
        f"λ={a['ditto_lambda']}, from repetition {a['ditto_from_rep']} on (`training/_ditto.py`) |"
        if a["ditto_rows"]
        else "| anti-repetition | none (plain maximum likelihood) |"
    )
    return "\n".join(
        [
            f"| architecture | `LlamaForCausalLM`, hidden {a['hidden_size']}, {a['layers']} layers, "
            f"{a['heads']} heads (head dim {a['hidden_size'] // a['heads']}), KV heads {a['kv_heads']}, "
            f"MLP {a['intermediate_size']}, RoPE θ={a['rope_theta']:g}, tied embeddings, "
            f"max positions {a['max_positions']} |",
            f"| parameters | {info['params']:,} |",
            f"| weights | fp32 safetensors, {info['weights_mb']:.1f} MB |",
            init,
            "| precision | "
            + ("bf16 autocast (fp32 master weights and optimizer) |" if a["autocast"] == "bf16" else "fp32 |"),
            f"| optimizer | AdamW (β=({a['beta1']}, {a['beta2']}), weight decay {a['weight_decay']} on matrices), "
            f"grad clip {a['grad_clip']} |",
            f"| schedule | linear warmup {a['warmup_steps']} steps to {a['lr']:g}, cosine decay to "
            f"{a['lr'] * a['min_lr_ratio']:g} at progress 1, progress = max(step / {a['steps']}, "
            f"elapsed / {a['minutes']:g} min) |",
            f"| batch | {a['batch_size']} × {a['seq_len']} = {a['batch_size'] * a['seq_len']:,} tokens/step |",
            ditto,
            f"| steps done | {info['steps_done']} |",
            f"| tokens seen | {info['tokens_seen']:,} language-modelling tokens (≈ {info['epochs']:.2f} epochs) |",
            f"| training wall time | {info['train_seconds'] / 60:.1f} min optimisation loop, "
            f"{info['total_seconds'] / 60:.1f} min end to end, {info['threads']} CPU threads ({info['cpu']}) |",
            f"| final train loss | {info['final_train_loss']:.3f} (language-modelling rows, mean of last "
            f"{info['train_loss_window']} steps) |",
        ]
    )


def _eval_rows(info: dict[str, Any]) -> str:
    ev, base = info["eval"], info.get("baseline")
    rows = [
        "| | this model | " + (f"previous model (`{base['path']}`) |" if base else "|"),
        "|---|---|" + ("---|" if base else ""),
    ]

    def row(label: str, key: str, fmt: str) -> str:
        cur = format(ev[key], fmt)
        return f"| {label} | {cur} |" + (f" {format(base[key], fmt)} |" if base else "")

    tested = "" if info.get("tokenizer_from") else ", checked by the tests"
    rows.append(row(f"held-out loss, fixed subset ({ev['eval_tokens']:,} tokens{tested})", "heldout_loss", ".4f"))
    rows.append(row("held-out perplexity, fixed subset", "heldout_perplexity", ".2f"))
    rows.append(row(f"held-out loss, all {info['n_heldout']} files ({ev['full_heldout_tokens']:,} tokens)",
                    "full_heldout_loss", ".4f"))
    rows.append(row(f"greedy degeneracy, {ev['degeneracy_files']} held-out files (goal ≤ 0.5)",
                    "degeneracy", ".3f"))
    rows.append(f"| same score on the files' real continuations (reference) | {ev['degeneracy_reference']:.3f} |"
                + (f" {base['degeneracy_reference']:.3f} |" if base else ""))
    return "\n".join(rows)


def _intro(info: dict[str, Any]) -> str:
    """Title, summary and usage: the default model, or a draft model sharing ``--tokenizer-from``'s tokenizer."""
    a, src = info["args"], info.get("tokenizer_from")
    summary = (
        f"A tiny Llama-architecture causal language model (stock `transformers`\n"
        f"`LlamaForCausalLM`, {info['params']:,} parameters, {a['layers']} decoder layers) trained\n"
        "from scratch, on CPU, on the Python standard library's own source code."
    )
    if not src:
        return f"""# probebus default model

{summary} It ships with
probebus so every command works offline; it is a test fixture and demo model, **not** a
useful code assistant.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
from probebus.models import resolve_model

path = resolve_model("default")
model = AutoModelForCausalLM.from_pretrained(path)
tokenizer = AutoTokenizer.from_pretrained(path)
```"""
    return f"""# probebus draft model for `{src}`

The draft model for the model in `{src}`: a small sibling for speculative decoding
(`transformers` assisted generation, `generate(..., assistant_model=draft)`).
{summary}
It uses `{src}`'s tokenizer files unchanged (`tokenizer.json` is byte-identical, copied by
`--tokenizer-from`), so both models share token ids, and the same train / held-out split
(checked against `{src}/splits.json`). Its weights are its own (random initialisation, not
distilled from the target). A test fixture and demo model, **not** a useful code assistant.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

DRAFT_DIR = "path/to/this/folder"
target = AutoModelForCausalLM.from_pretrained("{src}")
draft = AutoModelForCausalLM.from_pretrained(DRAFT_DIR)
tokenizer = AutoTokenizer.from_pretrained("{src}")
enc = tokenizer("def parse(source):", return_tensors="pt")
out = target.generate(**enc, assistant_model=draft, max_new_tokens=64, do_sample=False)
```"""


def write_card(out: Path, info: dict[str, Any]) -> None:
    """Write ``out/README.md`` from the run's ``info`` (see ``train_default_model.main``)."""
    a = info["args"]
    retrain = info["retrain_command"]
    hp_rows = "\n".join(f"| `{k}` | {v} |" for k, v in a.items() if k not in ("out", "resume", "baseline"))
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
    degen_files = "\n".join(
        f"| `{r['file']}` | {r['model']:.2f} | {r['reference']:.2f} |" for r in info["degeneracy_files"]
    )
    tok_source = f" (the files of `{info['tokenizer_from']}`, copied unchanged)" if info.get("tokenizer_from") else ""
    trained_for = (
        f"trained for {info['total_seconds'] / 60:.0f} minutes" if info.get("tokenizer_from")
        else "trained for about two hours"
    )
    card = f"""{_intro(info)}

## Retrain

```bash
{retrain}
```

Seed `{a["seed"]}`, `--threads {a["threads"]}`. The run writes into `--out` (config, weights,
tokenizer, `splits.json`, `eval.json`, this card), keeps `checkpoint.pt` there every
{a["ckpt_every"]} steps (`--resume` continues an interrupted run) and deletes it when done.
Multi-threaded CPU kernels are not bit-reproducible, and a `--minutes`-bounded schedule
depends on the machine's speed, so a retrain gives a close but not identical model.
Training is never run in CI. Logs: `training/logs/`.
{info.get("history_md", "")}
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

Byte-level BPE{tok_source} trained with `tokenizers` on the train files only: vocabulary
{info["vocab_size"]} (special tokens `<|pad|>`=0, `<|bos|>`=1, `<|eos|>`=2), min
frequency {a["min_frequency"]}, GPT-2 byte-level pre-tokenisation without prefix space.
`tokenizer(text)` prepends `<|bos|>` (as at the start of every training document);
`AutoTokenizer.from_pretrained` returns a fast tokenizer. `<|pad|>` is a dedicated
token, so `tokenizer.padding_side = "left"; tokenizer(batch, padding=True)` works.

## Model and training

| | |
|---|---|
{_model_rows(info)}
{stopped}
All hyper-parameters (`training/train_default_model.py` arguments):

| argument | value |
|---|---|
{hp_rows}

## Evaluation

{_eval_rows(info)}

Held-out loss (`probebus.models.corpus.causal_lm_loss` / `heldout_eval_ids`, shared with
`tests/test_default_model.py`): {corpus.EVAL_METHOD} The full held-out row uses the same
method with no per-file or total cap. Perplexities are per BPE token of this tokenizer,
so they are not comparable with other tokenizers.

Greedy degeneracy (`probebus.models.corpus.degeneracy` / `heldout_degeneracy`):
{corpus.DEGENERACY_METHOD} 0 means no repeated 8-gram at all, 1 a pure loop.

| held-out file | this model | real continuation |
|---|---|---|
{degen_files}

## Greedy samples

{sample_md}

## Limitations

Tiny, {trained_for} of a shared 2-core CPU on a few MB of one project's code: it produces
Python-looking text with plausible local syntax and identifiers, but not correct programs,
and greedy decoding still repeats itself (see the degeneracy above). No safety tuning.
Only for testing and demonstrating probebus.
"""
    (out / "README.md").write_text(card, encoding="utf-8")


def perplexity(loss: float) -> float:
    """``exp(loss)``, rounded for the card: ``perplexity(3.0) == 20.086``."""
    return round(math.exp(loss), 3)


#: The first stage (the default model of commit 9ae5b29), for models continued with ``--init-from``
#: from it: its folder has no ``history`` in eval.json, so its entry is written here.
STAGE1 = {
    "command": "nice -n 10 python training/train_default_model.py --out /tmp/pb-stage1 --minutes 36 "
    "--seq-len 256 --batch-size 12 --steps 1800 --lr 0.002 --min-lr-ratio 0.1 --autocast none --ditto-rows 0",
    "note": "random init, fp32, no DITTO; stopped by its 36-min budget at step 748 of 1800 (schedule compressed)",
    "steps": 748,
    "lm_tokens": 2_297_856,
    "train_minutes": 36.0,
    "heldout_loss": 3.0861,
    "degeneracy": 0.890,
    "log": "training/logs/default_model_train.log",
}


def previous_history(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The stages that produced ``--init-from`` (its eval.json ``history``), oldest first."""
    if not args.init_from:
        return []
    ev = json.loads((args.init_from / "eval.json").read_text(encoding="utf-8"))
    return list(ev.get("history") or [STAGE1])


def history_markdown(history: list[dict[str, Any]]) -> str:
    """Card section listing the stages of a continued run; empty for a single run from scratch."""
    if len(history) < 2:
        return ""
    rows = "\n".join(
        f"| {i} | `{h['command']}` | {h['steps']:,} | {h['lm_tokens'] / 1e6:.1f}M | {h['train_minutes']:.0f} | "
        f"{h['heldout_loss']:.4f} | {h['degeneracy']:.3f} | `{h['log']}` |"
        + (f"\n| | {h['note']} | | | | | | |" if h.get("note") else "")
        for i, h in enumerate(history, 1)
    )
    return f"""
### Training history

This model was trained in {len(history)} stages; each stage after the first loads the previous
stage's weights and tokenizer with `--init-from` (the split is checked to be identical, so no
held-out file is ever trained on) and warms its learning rate up again. To retrain, run the
commands in order, each stage's `--init-from` pointing at the previous stage's `--out`.
Degeneracy is the greedy degeneracy on the held-out files (see *Evaluation*).

| stage | command | steps | LM tokens | minutes | held-out loss | degeneracy | log |
|---|---|---|---|---|---|---|---|
{rows}
"""
