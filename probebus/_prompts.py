"""Reading prompts for every command that takes them.

    read_prompts(prompt="def f(", prompts_file=None)      # ["def f("]
    read_prompts(prompt=None, prompts_file="p.jsonl")     # one {"prompt": ...} per line

A `.jsonl`/`.json` file (or any file whose first non-blank line starts with `{`) is
JSON Lines with a `prompt` field; any other file is one prompt per line.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    if (prompt is None) == (prompts_file is None):
        raise SystemExit("give exactly one of --prompt TEXT or --prompts FILE")
    if prompt is not None:
        return [prompt]
    path = Path(prompts_file)  # type: ignore[arg-type]
    if not path.is_file():
        raise SystemExit(f"--prompts: no such file {path}")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    as_json = path.suffix in (".jsonl", ".json") or (bool(lines) and lines[0].lstrip().startswith("{"))
    out = []
    for i, ln in enumerate(lines, 1):
        if not as_json:
            out.append(ln)
            continue
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"{path}:{i}: not valid JSON ({exc.msg}); expected {{\"prompt\": \"...\"}}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise SystemExit(f"{path}:{i}: expected an object with a string \"prompt\" field")
        out.append(obj["prompt"])
    if not out:
        raise SystemExit(f"--prompts: {path} holds no prompt")
    return out
