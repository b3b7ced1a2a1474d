"""Model location helpers.

Usage::

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from probebus.models import resolve_model

    path = resolve_model("default")  # the small model shipped with probebus
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

``resolve_model`` returns any other string unchanged, so a local folder or a
Hugging Face hub id can be passed straight through.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_MODEL_DIR", "DEFAULT_MODEL_NAME", "REQUIRED_FILES", "resolve_model"]

#: Name that selects the shipped model.
DEFAULT_MODEL_NAME: str = "default"

#: Folder holding the shipped default model (config, weights, tokenizer, card).
DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent / "default"

#: Files that must exist in :data:`DEFAULT_MODEL_DIR` for the model to load.
REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def resolve_model(name_or_path: str) -> str:
    """Map a model name to something ``from_pretrained`` accepts.

    Usage: ``resolve_model("default")`` returns the shipped folder as a string;
    ``resolve_model("./my-model")`` or ``resolve_model("org/model")`` is
    returned unchanged.

    Raises:
        FileNotFoundError: ``"default"`` was requested but the shipped model
            files are missing (for example a source checkout without them).
    """
    if name_or_path != DEFAULT_MODEL_NAME:
        return name_or_path
    missing = [name for name in REQUIRED_FILES if not (DEFAULT_MODEL_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the default probebus model is incomplete: {', '.join(missing)} missing in "
            f"{DEFAULT_MODEL_DIR}; reinstall probebus or retrain it with "
            "`python training/train_default_model.py`"
        )
    return str(DEFAULT_MODEL_DIR)
