"""Held-out evaluation of a default-model candidate: losses and greedy degeneracy.

Usage (from ``train_default_model.py``)::

    ev = full_eval(model, tokenizer, root, heldout, seq_len=512)   # what eval.json records
    quick = quick_eval(model, tokenizer, eval_ids, heldout)        # progress log during training
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

from _card import perplexity

from probebus.models import corpus


def quick_eval(model: Any, tokenizer: Any, eval_ids: list[int], heldout: list[str]) -> dict[str, float]:
    """Held-out loss and greedy degeneracy on every 4th long-enough held-out file (progress log)."""
    prompts = corpus.degeneracy_prompts(tokenizer, {"heldout": heldout})
    subset = {"heldout": [rel for rel, _, _ in prompts][::4]}
    deg = corpus.heldout_degeneracy(model, tokenizer, subset)
    return {"loss": corpus.causal_lm_loss(model, eval_ids), "degeneracy": deg["model"], "files": deg["n_files"]}


def full_eval(model: Any, tokenizer: Any, root: Path, heldout: list[str], seq_len: int) -> dict[str, Any]:
    """Everything eval.json records: held-out losses and greedy degeneracy."""
    eval_ids, eval_files = corpus.heldout_eval_ids(tokenizer, {"heldout": heldout}, root=root)
    full_ids: list[int] = []
    for rel in heldout:
        full_ids.extend(corpus.encode_document(tokenizer, corpus.read_source(root / rel)))
    full_ids = full_ids[: len(full_ids) - len(full_ids) % seq_len]
    loss = corpus.causal_lm_loss(model, eval_ids)
    deg = corpus.heldout_degeneracy(model, tokenizer, {"heldout": heldout}, root=root)
    return {
        "heldout_loss": round(loss, 5),
        "heldout_perplexity": perplexity(loss),
        "eval_tokens": len(eval_ids),
        "eval_files": eval_files,
        "eval_method": corpus.EVAL_METHOD,
        "python_version": platform.python_version(),
        "full_heldout_loss": round(corpus.causal_lm_loss(model, full_ids, seq_len=seq_len), 5),
        "full_heldout_tokens": len(full_ids),
        "degeneracy": round(deg["model"], 4),
        "degeneracy_reference": round(deg["reference"], 4),
        "degeneracy_files": deg["n_files"],
        "degeneracy_stopped_at_eos": deg["stopped_at_eos"],
        "degeneracy_method": corpus.DEGENERACY_METHOD,
        "degeneracy_per_file": [
            {"file": r["file"], "model": round(r["model"], 4), "reference": round(r["reference"], 4)}
            for r in deg["files"]
        ],
    }
