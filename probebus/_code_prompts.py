"""Code prompts from the default model's train or held-out split (stdlib files of this interpreter).

    code_prompts("heldout", 16)   # 16 prompts: a few lines of context ending in a `def` line

Deterministic: files in sorted order, `def` lines in file order, a seeded shuffle.
Used by the speculative benchmark (held-out) and the drafter's recording (train).
"""

from __future__ import annotations

import random

from probebus.models import DEFAULT_MODEL_DIR
from probebus.models.corpus import load_splits, read_source, stdlib_root


def code_prompts(split: str, n: int, *, context_lines: int = 6, seed: int = 0, per_file: int = 4) -> list[str]:
    splits = load_splits(DEFAULT_MODEL_DIR)
    if split not in ("train", "heldout"):
        raise ValueError("split must be 'train' or 'heldout'")
    root = stdlib_root()
    found: list[str] = []
    for rel in splits[split]:
        path = root / rel
        if not path.is_file():
            continue
        lines = read_source(path).splitlines()
        starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ") and ln.rstrip().endswith(":")]
        for i in starts[:per_file]:
            found.append("\n".join(lines[max(0, i - context_lines): i + 1]) + "\n")
    random.Random(seed).shuffle(found)
    if len(found) < n:
        raise ValueError(f"only {len(found)} prompts available in the {split} split, asked for {n}")
    return found[:n]
