"""The speculative benchmark's three prompt sets, none of them used to train or tune anything.

    python benchmarks/_prompt_sets.py            # rebuild benchmarks/prompts/*.jsonl from this machine
    load_sets(["stdlib", "thirdparty", "prose"]) # {name: [prompt, ...]} from the committed files

- stdlib: the first ~200 tokens (whole lines) of the default model's held-out stdlib files
  (splits.json "heldout": never trained on).
- thirdparty: the first ~200 tokens of .py files of installed third-party packages (rich,
  pyzmq, pyarrow, duckdb, click, flask): the default model trained on the stdlib only.
- prose: English paragraphs from the long descriptions (README text) in installed
  packages' *.dist-info/METADATA, markdown links and code removed; not code.

The sets are committed as JSON Lines (with each prompt's source) so every machine
measures the same prompts; rebuilding only matters when the default model's held-out
split changes.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import re
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent / "prompts"
SETS = ("stdlib", "thirdparty", "prose")
THIRD_PARTY = ("rich", "zmq", "pyarrow", "duckdb", "click", "flask")
N_PROMPTS = 24
PROMPT_TOKENS = 200


def load_sets(names: list[str] | tuple[str, ...] = SETS) -> dict[str, list[str]]:
    out = {}
    for name in names:
        path = HERE / f"{name}.jsonl"
        if not path.is_file():
            raise SystemExit(f"no prompt set {path}; rebuild with: python benchmarks/_prompt_sets.py")
        out[name] = [json.loads(ln)["prompt"] for ln in path.read_text().splitlines() if ln.strip()]
    return out


def _h(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def _head_lines(text: str, tok, n_tokens: int) -> str | None:
    """Whole lines from the start of `text` until about n_tokens tokens; None if the text is too short."""
    out, count = [], 0
    for line in text.splitlines(keepends=True):
        out.append(line)
        count += len(tok(line, add_special_tokens=False).input_ids)
        if count >= n_tokens:
            return "".join(out)
    return None


def stdlib_set(tok) -> list[dict]:
    from probebus.models import DEFAULT_MODEL_DIR
    from probebus.models.corpus import load_splits, read_source, stdlib_root

    root = stdlib_root()
    rows = []
    for rel in sorted(load_splits(DEFAULT_MODEL_DIR)["heldout"], key=_h):
        path = root / rel
        if path.is_file() and (p := _head_lines(read_source(path), tok, PROMPT_TOKENS)):
            rows.append({"prompt": p, "source": f"stdlib/{rel}"})
    return rows[:N_PROMPTS]


def thirdparty_set(tok) -> list[dict]:
    import importlib.util

    rows = []
    per = -(-N_PROMPTS // len(THIRD_PARTY))
    for pkg in THIRD_PARTY:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        base = Path(list(spec.submodule_search_locations)[0])
        files = sorted((f for f in base.rglob("*.py") if not {"tests", "test", "testing"} & set(f.parts)),
                       key=lambda f: _h(str(f.relative_to(base))))
        got = 0
        for f in files:
            p = _head_lines(f.read_text(errors="replace"), tok, PROMPT_TOKENS)
            if p and len(p) > 400:
                rows.append({"prompt": p, "source": f"{pkg}/{f.relative_to(base)}"})
                got += 1
            if got == per:
                break
    return rows[:N_PROMPTS]


_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_CODE = re.compile(r"`+([^`]*)`+")


def _prose_paragraphs(body: str) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", body):
        lines = para.strip().splitlines()
        starts = ("    ", "\t", "```", "|", "#", ">>>", "$", "<", "..", ":", "=", "-", "*", "+")
        if not lines or any(ln.startswith(starts) for ln in lines):
            continue
        text = _CODE.sub(r"\1", _LINK.sub(r"\1", " ".join(ln.strip() for ln in lines)))
        words = text.split()
        letters = sum(c.isalpha() or c.isspace() for c in text) / max(len(text), 1)
        if len(words) >= 40 and letters > 0.9 and ". " in text and "http" not in text:
            out.append(text)
    return out


def prose_set(tok) -> list[dict]:
    rows = []
    dists = sorted(metadata.distributions(), key=lambda d: _h(d.metadata["Name"] or ""))
    seen = set()
    for dist in dists:
        name = dist.metadata["Name"]
        raw = dist.read_text("METADATA")
        if not name or name in seen or not raw or name == "probebus":  # not our own README
            continue
        seen.add(name)
        msg = email.parser.Parser().parsestr(raw)
        body = msg.get_payload() if not msg.is_multipart() else ""
        paras = _prose_paragraphs(body or msg.get("Description", "") or "")
        text = ""
        for para in paras:  # consecutive paragraphs of one package up to ~200 tokens
            text = f"{text}\n\n{para}" if text else para
            if len(tok(text, add_special_tokens=False).input_ids) >= PROMPT_TOKENS:
                break
        if len(tok(text, add_special_tokens=False).input_ids) >= PROMPT_TOKENS // 2:
            ids = tok(text, add_special_tokens=False).input_ids[:PROMPT_TOKENS]
            rows.append({"prompt": tok.decode(ids), "source": f"{name} {dist.version} METADATA"})
        if len(rows) == N_PROMPTS:
            break
    return rows


def main() -> None:
    from probebus._load import load_model

    _, tok = load_model("default", need_tokenizer=True)
    HERE.mkdir(exist_ok=True)
    for name, build in (("stdlib", stdlib_set), ("thirdparty", thirdparty_set), ("prose", prose_set)):
        rows = build(tok)
        if len(rows) < 20:
            print(f"warning: only {len(rows)} prompts for {name}", file=sys.stderr)
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{name}: {len(rows)} prompts -> {HERE / (name + '.jsonl')}")


if __name__ == "__main__":
    main()
