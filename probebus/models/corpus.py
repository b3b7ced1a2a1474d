"""Corpus selection, held-out split and held-out evaluation for the default model.

Usage::

    from probebus.models import DEFAULT_MODEL_DIR
    from probebus.models.corpus import heldout_eval_ids, causal_lm_loss, load_splits

    splits = load_splits(DEFAULT_MODEL_DIR)
    ids, files = heldout_eval_ids(tokenizer, splits)
    loss = causal_lm_loss(model, ids)  # mean next-token cross-entropy in nats

The training script (``training/train_default_model.py``), the test suite and
other tools (benchmarks, drafter training) share these functions, so that the
held-out loss recorded in ``eval.json`` is computed exactly the way the test
recomputes it.

Corpus: the running interpreter's own standard-library ``.py`` files
(``sysconfig.get_paths()["stdlib"]``), with every path that has a directory
component in :data:`EXCLUDED_DIRS` removed. Paths are sorted (POSIX relative
paths) and split *by file*: a file is held out when the first 8 hex digits of
``sha256(relative_path)`` taken modulo 100 are below ``heldout_percent``.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Directory names (any path component) excluded from the corpus.
EXCLUDED_DIRS: tuple[str, ...] = (
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "pydoc_data",
    "__pycache__",
)

#: Default share of files (percent) held out from training.
DEFAULT_HELDOUT_PERCENT: int = 5

#: Held-out evaluation: at most this many tokens in total ...
EVAL_MAX_TOKENS: int = 16384
#: ... taking at most this many tokens from the start of each held-out file ...
EVAL_PER_FILE_TOKENS: int = 1024
#: ... scored in non-overlapping windows of this length.
EVAL_SEQ_LEN: int = 256

EVAL_METHOD: str = (
    "held-out files from splits.json in sorted order, read from the running "
    "interpreter's stdlib (missing files skipped); each file encoded as "
    f"[bos] + tokens + [eos] and truncated to its first {EVAL_PER_FILE_TOKENS} tokens; "
    f"concatenated and truncated to {EVAL_MAX_TOKENS} tokens (then down to a multiple "
    f"of {EVAL_SEQ_LEN}); split into non-overlapping windows of {EVAL_SEQ_LEN} tokens; "
    "loss = mean next-token cross-entropy (nats) over all predicted positions "
    "(seq_len - 1 per window), fp32, no padding."
)


def stdlib_root() -> Path:
    """Return the running interpreter's standard-library directory.

    Usage: ``files = list_corpus_files(stdlib_root())``.
    """
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path) -> list[str]:
    """Return the sorted POSIX relative paths of all corpus ``.py`` files under ``root``.

    Usage: ``rel_paths = list_corpus_files(stdlib_root())``.
    """
    rel_paths: list[str] = []
    for path in root.rglob("*.py"):
        if not path.is_file():
            continue
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        rel_paths.append(rel.as_posix())
    return sorted(rel_paths)


def is_heldout(rel_path: str, heldout_percent: int = DEFAULT_HELDOUT_PERCENT) -> bool:
    """Return True when ``rel_path`` belongs to the held-out split.

    Usage: ``is_heldout("json/decoder.py")``. Stable across machines and runs.
    """
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 100 < heldout_percent


def split_files(
    rel_paths: Sequence[str], heldout_percent: int = DEFAULT_HELDOUT_PERCENT
) -> tuple[list[str], list[str]]:
    """Split relative paths into ``(train, heldout)`` lists, both sorted.

    Usage: ``train, heldout = split_files(list_corpus_files(stdlib_root()))``.
    """
    train = sorted(p for p in rel_paths if not is_heldout(p, heldout_percent))
    heldout = sorted(p for p in rel_paths if is_heldout(p, heldout_percent))
    return train, heldout


def read_source(path: Path) -> str:
    """Read a source file as UTF-8 text (undecodable bytes replaced).

    Usage: ``text = read_source(stdlib_root() / "json/decoder.py")``.
    """
    return path.read_bytes().decode("utf-8", errors="replace")


def load_splits(model_dir: Path | str) -> dict[str, Any]:
    """Load ``splits.json`` from a model folder.

    Usage: ``heldout = load_splits(DEFAULT_MODEL_DIR)["heldout"]``.
    """
    with open(Path(model_dir) / "splits.json", encoding="utf-8") as fh:
        return json.load(fh)


def encode_document(tokenizer: Any, text: str) -> list[int]:
    """Encode one document as ``[bos] + tokens + [eos]`` (the training format).

    Usage: ``ids = encode_document(tokenizer, source_text)``.
    """
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.bos_token_id, *body, tokenizer.eos_token_id]


def heldout_eval_ids(
    tokenizer: Any,
    splits: dict[str, Any],
    *,
    root: Path | None = None,
    max_tokens: int = EVAL_MAX_TOKENS,
    per_file_tokens: int = EVAL_PER_FILE_TOKENS,
    seq_len: int = EVAL_SEQ_LEN,
) -> tuple[list[int], list[str]]:
    """Build the fixed held-out evaluation token stream (see :data:`EVAL_METHOD`).

    Usage: ``ids, used_files = heldout_eval_ids(tokenizer, load_splits(model_dir))``.
    Returns the token ids (a multiple of ``seq_len`` long, possibly empty) and the
    relative paths of the files that contributed.
    """
    root = stdlib_root() if root is None else Path(root)
    ids: list[int] = []
    used: list[str] = []
    for rel in sorted(splits["heldout"]):
        if len(ids) >= max_tokens:
            break
        path = root / rel
        if not path.is_file():
            continue
        ids.extend(encode_document(tokenizer, read_source(path))[:per_file_tokens])
        used.append(rel)
    ids = ids[:max_tokens]
    ids = ids[: len(ids) - len(ids) % seq_len]
    return ids, used


def causal_lm_loss(model: Any, ids: Sequence[int], *, seq_len: int = EVAL_SEQ_LEN, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` over ``ids``.

    Usage: ``loss = causal_lm_loss(model, ids)``. ``ids`` is cut into
    non-overlapping windows of ``seq_len`` tokens (a trailing partial window is
    dropped); every position but the first of each window is predicted.
    """
    import torch
    import torch.nn.functional as F

    n_windows = len(ids) // seq_len
    if n_windows == 0:
        raise ValueError(f"need at least {seq_len} tokens, got {len(ids)}")
    data = torch.tensor(list(ids[: n_windows * seq_len]), dtype=torch.long).view(n_windows, seq_len)
    total = 0.0
    count = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, n_windows, batch_size):
                batch = data[start : start + batch_size]
                logits = model(input_ids=batch).logits.float()
                loss = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.size(-1)),
                    batch[:, 1:].reshape(-1),
                    reduction="sum",
                )
                total += float(loss)
                count += batch[:, 1:].numel()
    finally:
        model.train(was_training)
    return total / count


# --------------------------------------------------------------------------- degeneracy

#: Greedy-degeneracy evaluation: prompt = the first this many tokens of a held-out file
#: (``[bos]`` included) ...
DEGENERACY_PROMPT_TOKENS: int = 200
#: ... continued greedily by this many new tokens ...
DEGENERACY_NEW_TOKENS: int = 96
#: ... scored with n-grams of this length.
DEGENERACY_NGRAM: int = 8

DEGENERACY_METHOD: str = (
    "held-out files from splits.json in sorted order that encode ([bos] + tokens + [eos]) to at "
    f"least {DEGENERACY_PROMPT_TOKENS} + {DEGENERACY_NEW_TOKENS} tokens; prompt = the first "
    f"{DEGENERACY_PROMPT_TOKENS} tokens; {DEGENERACY_NEW_TOKENS} new tokens by greedy decoding "
    "(fp32, batch 1, stopping early only at <|eos|>); score = fraction of the new tokens that lie "
    f"inside some {DEGENERACY_NGRAM}-gram occurring at least twice in the new tokens (the prompt is "
    "not counted); reported as the mean over files. The reference applies the same score to the "
    "file's real next tokens."
)


def degeneracy(token_ids: Sequence[int], n: int = DEGENERACY_NGRAM) -> float:
    """Fraction of ``token_ids`` that lie inside an ``n``-gram occurring at least twice in them.

    Usage: ``degeneracy(generated_ids)`` -> 0.0 for text without a repeated 8-gram, 1.0 for
    a loop such as ``[5, 6] * 48``. Occurrences may overlap (``[7] * 9`` holds the 8-gram
    ``[7] * 8`` twice, so all 9 tokens count). Sequences shorter than ``n`` score 0.0.
    Only the given tokens are looked at, so pass the continuation without its prompt.
    """
    ids = list(token_ids)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(ids) < n:
        return 0.0
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    counts: dict[tuple[int, ...], int] = {}
    for g in grams:
        counts[g] = counts.get(g, 0) + 1
    covered = [False] * len(ids)
    for i, g in enumerate(grams):
        if counts[g] >= 2:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(ids)


def degeneracy_prompts(
    tokenizer: Any,
    splits: dict[str, Any],
    *,
    root: Path | None = None,
    prompt_tokens: int = DEGENERACY_PROMPT_TOKENS,
    new_tokens: int = DEGENERACY_NEW_TOKENS,
) -> list[tuple[str, list[int], list[int]]]:
    """Held-out ``(relative_path, prompt_ids, real_next_ids)`` for the degeneracy evaluation.

    Usage: ``for rel, prompt, real in degeneracy_prompts(tok, load_splits(model_dir)): ...``.
    Files too short for ``prompt_tokens + new_tokens`` tokens or missing here are skipped.
    """
    root = stdlib_root() if root is None else Path(root)
    out: list[tuple[str, list[int], list[int]]] = []
    for rel in sorted(splits["heldout"]):
        path = root / rel
        if not path.is_file():
            continue
        ids = encode_document(tokenizer, read_source(path))
        if len(ids) >= prompt_tokens + new_tokens:
            out.append((rel, ids[:prompt_tokens], ids[prompt_tokens : prompt_tokens + new_tokens]))
    return out


def heldout_degeneracy(
    model: Any,
    tokenizer: Any,
    splits: dict[str, Any],
    *,
    root: Path | None = None,
    prompt_tokens: int = DEGENERACY_PROMPT_TOKENS,
    new_tokens: int = DEGENERACY_NEW_TOKENS,
    n: int = DEGENERACY_NGRAM,
) -> dict[str, Any]:
    """Greedy degeneracy of ``model`` on held-out files, and of the real text (see DEGENERACY_METHOD).

    Usage: ``r = heldout_degeneracy(model, tok, load_splits(model_dir)); r["model"], r["reference"]``.
    Returns the means (``model``, ``reference``), the per-file scores and continuations
    (``files``), and how many continuations stopped at ``<|eos|>`` before ``new_tokens``.
    """
    import torch

    rows = []
    was_training = model.training
    model.eval()
    try:
        for rel, prompt, real in degeneracy_prompts(
            tokenizer, splits, root=root, prompt_tokens=prompt_tokens, new_tokens=new_tokens
        ):
            ids = torch.tensor([prompt], dtype=torch.long)
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            gen = out[0, len(prompt) :].tolist()
            rows.append({"file": rel, "model": degeneracy(gen, n), "reference": degeneracy(real, n),
                         "new_tokens": len(gen), "continuation": tokenizer.decode(gen, skip_special_tokens=True)})
    finally:
        model.train(was_training)
    if not rows:
        raise ValueError("no held-out file is long enough for the degeneracy evaluation")
    return {
        "model": sum(r["model"] for r in rows) / len(rows),
        "reference": sum(r["reference"] for r in rows) / len(rows),
        "n_files": len(rows),
        "stopped_at_eos": sum(r["new_tokens"] < new_tokens for r in rows),
        "files": rows,
    }
