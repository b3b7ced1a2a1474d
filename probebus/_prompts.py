"""Reading prompts for every command that takes them.

    read_prompts(prompt="def f(", prompts_file=None)      # ["def f("]
    read_prompts(prompt=None, prompts_file="p.jsonl")     # one {"prompt": ...} per line

A `.jsonl`/`.json` file (or any file whose first non-blank line starts with `{`) is
JSON Lines with a `prompt` field; any other file is one prompt per line. Bad input
raises `PromptError`: one line on stderr, exit status 2, no traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class PromptError(SystemExit):
    """A usage error in the prompts: prints one line and exits with status 2."""

    def __init__(self, message: str) -> None:
        print(f"probebus: {message}", file=sys.stderr)
        super().__init__(2)
        self.message = message


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    if (prompt is None) == (prompts_file is None):
        raise PromptError("give exactly one of --prompt TEXT or --prompts FILE")
    if prompt is not None:
        if not prompt:
            raise PromptError("--prompt is empty; give some text to continue")
        return [prompt]
    path = Path(prompts_file)  # type: ignore[arg-type]
    if not path.is_file():
        raise PromptError(f"--prompts: no such file {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"--prompts: {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise PromptError(f"--prompts: cannot read {path}: {exc.strerror}") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    as_json = path.suffix in (".jsonl", ".json") or (bool(lines) and lines[0].lstrip().startswith("{"))
    out = []
    for i, ln in enumerate(lines, 1):
        if not as_json:
            out.append(ln)
            continue
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{path}:{i}: not valid JSON ({exc.msg}); expected {{\"prompt\": \"...\"}}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise PromptError(f"{path}:{i}: expected an object with a string \"prompt\" field")
        out.append(obj["prompt"])
    if not out:
        raise PromptError(f"--prompts: {path} holds no prompt")
    return out
