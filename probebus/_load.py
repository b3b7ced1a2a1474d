"""Loading a target model for the CLI: `default`, a local folder, or a model already in the HF cache.

    go_offline()                                 # at CLI start: no Hub traffic unless --online / PROBEBUS_ONLINE=1
    model, tok = load_model("default")           # the shipped trained model, eval mode
    model, tok = load_model("path", dtype="bfloat16", device="cuda:0")
    config = load_config("path/or/config.json")
    dev = parse_device("auto")                   # cuda if there is one, else cpu

Every failure is a `LoadError`: a SystemExit carrying one line that says what is wrong
and what to do; `probebus` prints it and exits 2. No function here downloads anything
unless the user opted in to the Hub.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


class LoadError(SystemExit):
    """One line for the user (the CLI prints it and exits 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def online_requested(argv: list[str] | None = None) -> bool:
    """--online on the command line, or PROBEBUS_ONLINE=1 in the environment."""
    return "--online" in (argv or []) or os.environ.get("PROBEBUS_ONLINE", "") not in ("", "0", "false", "no")


def go_offline(argv: list[str] | None = None) -> bool:
    """Make Hugging Face libraries offline for this process unless the user opted in; True if offline.

    Must run before transformers / huggingface_hub are imported: they read these variables
    once. A value the user set explicitly is left alone.
    """
    if online_requested(argv):
        return False
    for var in _OFFLINE_VARS:
        os.environ.setdefault(var, "1")
    return True


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "no")


def resolve(name: str) -> str:
    """Map `default` to the shipped folder; anything else is returned unchanged."""
    if name == "default":
        from probebus.models import resolve_model

        try:
            return resolve_model(name)
        except FileNotFoundError as exc:
            raise LoadError(f"{exc}; reinstall probebus") from None
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


def _not_found(name: str, what: str) -> LoadError:
    path = Path(name)
    if path.exists() and path.is_dir():
        return LoadError(f"{name} is not a model folder: it has no config.json; pass a Hugging Face model folder "
                         "(config.json and weights) or `default` for the shipped model")
    if path.exists():
        return LoadError(f"{name} is a file; pass a model folder (config.json and weights) or `default`")
    if _offline():
        return LoadError(f"cannot find {what} {name!r}: no such folder, and probebus does not download (it is not "
                         "in the local Hugging Face cache); pass a local folder or `default`, or allow downloads with "
                         "--online / PROBEBUS_ONLINE=1")
    return LoadError(f"cannot find {what} {name!r}: no such folder, and the Hub did not provide it")


def load_config(name: str) -> PretrainedConfig:
    """Config of `default`, a model folder, a config JSON file (any file name), or a cached hub id."""
    from transformers import AutoConfig

    path = Path(resolve(name))
    try:
        if path.is_file():
            return AutoConfig.for_model(**json.loads(path.read_text(encoding="utf-8")))
        if path.is_dir() and not (path / "config.json").is_file():
            raise _not_found(name, "model")
        return AutoConfig.from_pretrained(str(path))
    except LoadError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoadError(f"{name}: not a JSON model config ({exc.__class__.__name__}: {exc})") from None
    except OSError:
        raise _not_found(name, "model") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise LoadError(f"{name}: not a usable model config ({_short(exc)})") from None


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cpu_has_fast_half() -> bool:
    """True if this CPU computes bf16/fp16 natively (AVX512-BF16 or AMX); else half precision is several
    times slower than float32 here."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_device(name: str) -> torch.device:
    """cpu | cuda | cuda:N | mps | auto (cuda when available, else cpu); a LoadError if it is not there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise LoadError(f"--device {name!r} is not a device; use cpu, cuda, cuda:N, mps or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LoadError(f"--device {name}: no CUDA device is available here (torch {torch.__version__}); "
                            "use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise LoadError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise LoadError("--device mps: MPS is not available on this machine")
    return dev


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype | str:
    """A torch dtype, or "auto" (the checkpoint's dtype; on a CPU without native half precision, float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return "auto"
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise LoadError(f"--dtype {dtype!r}: use auto, {', '.join(DTYPES)}")


def check_sites(name: str, sites: str | list[str]) -> list[str]:
    """The concrete sites a pattern selects on a model, from its config alone (no weights are read)."""
    from transformers import AutoModelForCausalLM

    import probe

    config = load_config(name)
    with torch.device("meta"):  # structure only
        model = AutoModelForCausalLM.from_config(config)
    try:
        return probe.match_sites(model, sites)
    except (probe.SiteError, ValueError) as exc:
        raise LoadError(str(exc)) from None


def load_model(name: str, *, dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu",
               need_tokenizer: bool = True) -> tuple[Any, Any]:
    """(model, tokenizer) in eval mode on `device`; tokenizer is None if absent and not needed.

    dtype "auto" keeps the checkpoint's dtype, as transformers does, except on a CPU that
    has no native half precision, where a bf16/fp16 checkpoint is loaded as float32.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = device if isinstance(device, torch.device) else parse_device(device)
    want = parse_dtype(dtype, dev)
    path = resolve(name)
    load_config(name)  # a folder that is not a model fails here, with its own message
    if not sys.stderr.isatty():  # a progress bar in a log file or a pipe is noise
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=want)
    except LoadError:
        raise
    except OSError as exc:
        if "safetensors" in str(exc).lower() or "weights" in str(exc).lower() or Path(path).is_dir():
            raise LoadError(f"cannot load the weights of {name!r}: {_short(exc)}; the files may be incomplete or "
                            "corrupt") from None
        raise _not_found(name, "model") from None
    except Exception as exc:  # safetensors' own errors, truncated files, shape mismatches: one line, not a trace
        raise LoadError(f"cannot load the weights of {name!r} ({type(exc).__name__}: {_short(exc)}); the files may "
                        "be incomplete or corrupt") from None
    if want == "auto" and dev.type == "cpu" and model.dtype in (torch.bfloat16, torch.float16) \
            and not cpu_has_fast_half():
        model = model.float()  # this CPU computes half precision several times slower than float32
    model = model.to(dev).eval()
    tok = None
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:  # no tokenizer files, or ones this transformers cannot read
        if need_tokenizer:
            raise LoadError(f"model {name!r} has no usable tokenizer files; text prompts need one") from None
    if tok is not None:
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    return model, tok


def read_prompts_checked(prompt: str | None, prompts_file: str | None) -> list[str]:
    """probebus._prompts.read_prompts (bad files, empty prompts and non-UTF-8 text are one-line errors there)."""
    from probebus._prompts import read_prompts

    if prompts_file is not None and Path(prompts_file).is_dir():
        raise LoadError(f"--prompts {prompts_file} is a directory; pass a JSON Lines or text file")
    return read_prompts(prompt, prompts_file)
