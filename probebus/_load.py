"""Loading a target model for the CLI: `default`, a local folder, or a hub id.

    model, tok = load_model("default")          # the shipped trained model, fp32, eval
    config = load_config("path/or/config.json")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def resolve(name: str) -> str:
    """Map `default` to the shipped folder; anything else is returned unchanged."""
    if name == "default":
        from probebus.models import resolve_model

        return resolve_model(name)
    return name


def resolve_drafter(name: str) -> str:
    """Map `default` to the drafter shipped for the default model; anything else unchanged."""
    if name != "default":
        return name
    from probebus.models import DEFAULT_MODEL_DIR

    folder = DEFAULT_MODEL_DIR.parent / "default-drafter"
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the shipped drafter is missing from {folder}; reinstall probebus or pass "
                                "--drafter PATH / ngram / none")
    return str(folder)


def load_config(name: str):  # noqa: ANN201 - a transformers PretrainedConfig
    """Config of `default`, a model folder, or a config JSON file (any file name)."""
    from transformers import AutoConfig

    path = Path(resolve(name))
    try:
        if path.is_file():
            return AutoConfig.for_model(**json.loads(path.read_text()))
        return AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"cannot read a model config from {name!r}: {exc}") from None


def load_model(name: str, *, dtype: torch.dtype = torch.float32, need_tokenizer: bool = True):  # noqa: ANN201
    """(model, tokenizer) in eval mode; tokenizer is None if absent and not needed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as exc:
        raise SystemExit(f"cannot load model {name!r}: {exc}\nPass a local folder with config.json and "
                         "weights, or `default` for the shipped model (no downloads happen here).") from None
    model.eval()
    tok = None
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        if need_tokenizer:
            raise SystemExit(f"model {name!r} has no tokenizer files; text prompts need one") from None
    if tok is not None:
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    return model, tok
