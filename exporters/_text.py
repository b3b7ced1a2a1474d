"""Token text for recordings: the `token` column, `_prompts.jsonl` and `_requests.jsonl`.

    text = TokenText(tokenizer)          # any object with .decode([id]) (a transformers tokenizer)
    text(np.array([15, 7, 15]))          # pa.array(["def", " x", "def"]): decoded once per distinct id
    append_prompts(Path("rec"), "run-1", [0, 1], ["def f(", "import os"])
    append_requests(Path("rec"), "run-1", [{"seq_id": 0, "request_id": "7", "first_position": 0}])

Each id is decoded on its own, as TransformerLens' `to_str_tokens` does, so a byte-level
BPE token reads " the" and not "Ġthe". Decoding happens in the recorder's writer
thread, once per distinct id for the whole recording.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ._safe import SIDECAR_MAX, read_capped
from ._schema import PROMPTS, REQUESTS


class TokenText:
    def __init__(self, tokenizer: Any) -> None:
        if not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"tokenizer must have a decode(ids) method, got {type(tokenizer).__name__}")
        self.tokenizer = tokenizer
        self._known: dict[int, str] = {}

    def _decode(self, i: int) -> str:
        try:
            return self.tokenizer.decode([i], clean_up_tokenization_spaces=False)
        except TypeError:  # a tokenizer without that keyword
            return self.tokenizer.decode([i])
        except Exception:  # an id outside the tokenizer's vocabulary must not fail the recording
            return f"<{i}>"

    def __call__(self, ids: np.ndarray) -> pa.Array:
        uniq, inverse = np.unique(ids, return_inverse=True)
        known = self._known
        words = []
        for u in uniq.tolist():
            w = known.get(u)
            if w is None:
                w = known[u] = self._decode(u)
            words.append(w)
        return pa.array(words, pa.string()).take(pa.array(inverse.reshape(-1).astype(np.int32)))


def append_prompts(directory: Path, run: str, seq_ids: Sequence[int], prompts: Sequence[str]) -> None:
    """One JSON line per sequence ({"prompt", "seq_id", "run"}): the --prompts format, so it can be replayed."""
    if len(seq_ids) != len(prompts):
        raise ValueError(f"{len(seq_ids)} seq_ids for {len(prompts)} prompts")
    _append(directory / PROMPTS, [{"prompt": p, "seq_id": int(s), "run": run}
                                  for s, p in zip(seq_ids, prompts, strict=True)])


def read_prompts(directory: Path) -> dict[tuple[str, int], str]:
    """{(run, seq_id): prompt} from a recording's _prompts.jsonl (empty if there is none)."""
    return {key: str(d["prompt"]) for key, d in _read(Path(directory) / PROMPTS) if "prompt" in d}


def append_requests(directory: Path, run: str, entries: Sequence[dict]) -> None:
    """One JSON line per request of a vLLM session ({"run", "seq_id", "request_id", "first_position"})."""
    _append(directory / REQUESTS, [{**e, "run": run} for e in entries])


def read_requests(directory: Path) -> dict[tuple[str, int], dict]:
    """{(run, seq_id): entry} from a recording's _requests.jsonl (empty if there is none)."""
    return dict(_read(Path(directory) / REQUESTS))


def _append(path: Path, rows: list[dict]) -> None:
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    with open(path, "a", encoding="utf-8") as f:
        f.write(lines)


def _read(path: Path) -> list[tuple[tuple[str, int], dict]]:
    """((run, seq_id), the rest of the line's object) per line of a sidecar; none if there is no file."""
    try:
        text = read_capped(path, SIDECAR_MAX).decode("utf-8", errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for line in text.splitlines():
        try:
            d = json.loads(line)
            out.append(((str(d.pop("run", "")), int(d["seq_id"])), d))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue  # a line cut by a crash: the others still count
    return out
