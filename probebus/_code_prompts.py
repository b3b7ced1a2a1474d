"""Code prompts from the default model's train or held-out split (stdlib files of this interpreter).

    code_prompts("heldout", 16)   # 16 prompts: a few lines of context ending in a `def` line

Deterministic: files in sorted order, `def` lines in file order, a seeded shuffle.
Used by the speculative benchmark (held-out) and the drafter's recording (train).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from probebus.models import DEFAULT_MODEL_DIR
from probebus.models.corpus import load_splits, read_source, stdlib_root


def _sources(split: str) -> Iterator[str]:
    """The text of each file of the split that this interpreter has, in the split's order."""
    if split not in ("train", "heldout"):
        raise ValueError("split must be 'train' or 'heldout'")
    root = stdlib_root()
    for rel in load_splits(DEFAULT_MODEL_DIR)[split]:
        path = root / rel
        if path.is_file():
            yield read_source(path)


def code_prompts(split: str, n: int, *, context_lines: int = 6, seed: int = 0, per_file: int = 4) -> list[str]:
    found: list[str] = []
    for text in _sources(split):
        lines = text.splitlines()
        starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ") and ln.rstrip().endswith(":")]
        for i in starts[:per_file]:
            found.append("\n".join(lines[max(0, i - context_lines): i + 1]) + "\n")
    random.Random(seed).shuffle(found)
    if len(found) < n:
        raise ValueError(f"only {len(found)} prompts available in the {split} split, asked for {n}")
    return found[:n]


def file_window_prompts(split: str, n: int, tokenizer: Any, *, per_file: int = 1, min_tokens: int = 48,
                        max_tokens: int = 256, seed: int = 0) -> list[str]:
    """Whole lines of the split's files, each prompt cut after a seeded length drawn from [min_tokens,
    max_tokens] tokens. A file's first prompt starts at its top (imports, docstring, first definitions: the
    kind of prompt the speculative benchmark asks with, the first ~200 tokens of unseen files, which `def`
    contexts are not); its other per_file - 1 start at seeded random lines (class and function bodies).

        file_window_prompts("train", 2000, tok, per_file=4)
    """
    rng = random.Random(seed)
    found: list[str] = []
    for text in _sources(split):
        lines = text.splitlines(keepends=True)
        starts = [0] + [rng.randrange(len(lines)) for _ in range(per_file - 1)] if lines else []
        for start in starts:
            want, count = rng.randint(min_tokens, max_tokens), 0
            for end in range(start, len(lines)):
                count += len(tokenizer(lines[end], add_special_tokens=False).input_ids)
                if count >= want:
                    found.append("".join(lines[start: end + 1]))
                    break
    random.Random(seed).shuffle(found)
    return found[:n]
