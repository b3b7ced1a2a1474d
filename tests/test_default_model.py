"""The shipped default model: files load, architecture as documented, held-out loss, generation.

These tests check the committed weights; they never train (see training/train_default_model.py).
"""

from __future__ import annotations

import json
import platform
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

import probebus.models as pb_models
from probebus.models import DEFAULT_MODEL_DIR, resolve_model
from probebus.models.corpus import (
    causal_lm_loss,
    degeneracy,
    degeneracy_prompts,
    heldout_degeneracy,
    heldout_eval_ids,
    is_heldout,
    load_splits,
)

EXPECTED_LAYERS = 8
LOSS_MARGIN = 0.15  # nats: allowed drift from eval.json (other interpreter patch releases, kernels)
SAME_ENV_TOLERANCE = 0.02  # nats: same Python and the same eval files -> same number up to fp noise
MIN_EVAL_TOKENS = 4096
MAX_FOLDER_BYTES = 40 * 1024 * 1024
DEGENERACY_CEILING = 0.5  # issue 9 goal; the previous model scored 0.890 (see the model card)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("default"))


@pytest.fixture(scope="module")
def model():
    m = AutoModelForCausalLM.from_pretrained(resolve_model("default"))
    m.eval()
    return m


@pytest.fixture(scope="module")
def eval_record() -> dict:
    return json.loads((DEFAULT_MODEL_DIR / "eval.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def heldout_ids(tokenizer) -> tuple[list[int], list[str]]:
    ids, files = heldout_eval_ids(tokenizer, load_splits(DEFAULT_MODEL_DIR))
    if len(ids) < MIN_EVAL_TOKENS:
        pytest.skip(f"only {len(ids)} held-out tokens found in this interpreter's stdlib")
    return ids, files


def test_resolve_model_maps_default_and_passes_others_through(tmp_path, monkeypatch):
    assert resolve_model("default") == str(DEFAULT_MODEL_DIR)
    assert resolve_model("some-org/some-model") == "some-org/some-model"
    assert resolve_model("./local/folder") == "./local/folder"
    monkeypatch.setattr(pb_models, "DEFAULT_MODEL_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        pb_models.resolve_model("default")


def test_shipped_files_are_small_safetensors():
    files = [p for p in DEFAULT_MODEL_DIR.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert not names & {"pytorch_model.bin", "model.bin"}
    assert sum(p.stat().st_size for p in files) <= MAX_FOLDER_BYTES


def test_architecture_matches_model_card(model):
    assert isinstance(model, LlamaForCausalLM)
    cfg = model.config
    assert cfg.num_hidden_layers == EXPECTED_LAYERS
    layers = cfg.num_hidden_layers
    assert len({2, layers // 2, layers - 3}) == 3  # EAGLE-3 feature layers must be distinct
    n_params = sum(p.numel() for p in model.parameters())
    assert 5_000_000 <= n_params <= 20_000_000
    card = (DEFAULT_MODEL_DIR / "README.md").read_text(encoding="utf-8")
    documented = re.search(r"\| parameters \| ([\d,]+) \|", card)
    assert documented is not None
    assert n_params == int(documented.group(1).replace(",", ""))
    assert f"{layers} decoder layers" in card
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_tokenizer_special_tokens_and_left_padding(tokenizer, model):
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and tokenizer.is_fast
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    assert None not in (bos, eos, pad) and len({bos, eos, pad}) == 3
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (bos, eos, pad)
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id) == (eos, pad)

    text = "import os\n\n\ndef main(argv):\n    return 0  # done\n"
    body = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert pad not in body and tokenizer.decode(body) == text

    tokenizer.padding_side = "left"
    try:
        batch = tokenizer(["def f(x):\n    return x", "x = 1"], padding=True, return_tensors="pt")
    finally:
        tokenizer.padding_side = "right"
    ids, mask = batch["input_ids"], batch["attention_mask"]
    short = tokenizer("x = 1", return_tensors="pt")["input_ids"][0]
    n_pad = ids.shape[1] - short.shape[0]
    assert n_pad > 0
    assert ids[1, :n_pad].tolist() == [pad] * n_pad and mask[1, :n_pad].sum() == 0
    assert ids[1, n_pad:].tolist() == short.tolist() and short[0] == bos
    with torch.no_grad():
        padded = model(**batch).logits[1, -1]
        alone = model(input_ids=short[None]).logits[0, -1]
    torch.testing.assert_close(padded, alone, atol=1e-3, rtol=1e-3)


def test_splits_are_disjoint_and_follow_the_documented_rule():
    splits = load_splits(DEFAULT_MODEL_DIR)
    train, heldout = splits["train"], splits["heldout"]
    assert heldout and train and not set(train) & set(heldout)
    assert all(is_heldout(p, splits["filters"]["heldout_percent"]) for p in heldout)
    assert not any(is_heldout(p, splits["filters"]["heldout_percent"]) for p in train)
    assert train == sorted(train) and heldout == sorted(heldout)


def test_heldout_loss_matches_recorded_value(model, heldout_ids, eval_record):
    ids, files = heldout_ids
    loss = causal_lm_loss(model, ids)
    recorded = eval_record["heldout_loss"]
    assert loss <= recorded + LOSS_MARGIN, f"held-out loss {loss:.4f} vs recorded {recorded:.4f}"
    same_env = platform.python_version() == eval_record["python_version"] and files == eval_record["eval_files"]
    if same_env and len(ids) == eval_record["eval_tokens"]:
        assert abs(loss - recorded) <= SAME_ENV_TOLERANCE, f"held-out loss {loss:.4f} vs recorded {recorded:.4f}"


def test_corrupted_weights_would_be_caught(model, heldout_ids, eval_record):
    ids = heldout_ids[0][:1024]
    damaged = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in damaged.model.layers:
            weight = layer.mlp.down_proj.weight
            weight.copy_(weight[:, torch.randperm(weight.shape[1], generator=generator)])
    assert causal_lm_loss(damaged, ids) > eval_record["heldout_loss"] + LOSS_MARGIN
    assert causal_lm_loss(model, ids) < causal_lm_loss(damaged, ids)


def test_greedy_generation_continues_code(model, tokenizer):
    prompt = "def read_lines(path):\n    "
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=32, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    assert len(new) >= 8
    assert len(set(new)) >= 4, f"degenerate continuation {new}"
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert text.strip()
    assert re.search(r"[A-Za-z_]{2,}", text), repr(text)


def test_degeneracy_counts_tokens_inside_repeated_ngrams():
    # oracle: covered positions counted by hand
    assert degeneracy([5, 6] * 48) == 1.0
    assert degeneracy(list(range(96))) == 0.0
    assert degeneracy([7] * 9) == 1.0  # two overlapping occurrences of [7] * 8 cover all 9 tokens
    block = list(range(10, 18))
    seq = block + list(range(100, 110)) + block  # the 8-gram `block` twice, 10 unique tokens between
    assert degeneracy(seq) == 16 / 26
    assert degeneracy(seq, n=9) == 0.0
    assert degeneracy([1, 2, 3]) == 0.0  # shorter than n
    with pytest.raises(ValueError, match="n must be"):
        degeneracy([1, 2], n=0)


def test_recorded_degeneracy_is_documented_and_reproduces(model, tokenizer, eval_record):
    recorded = eval_record["degeneracy"]
    assert recorded <= DEGENERACY_CEILING, f"greedy degeneracy {recorded} regressed"
    assert eval_record["degeneracy_reference"] < 0.2  # real code seldom repeats an 8-gram
    card = (DEFAULT_MODEL_DIR / "README.md").read_text(encoding="utf-8")
    assert f"{recorded:.3f}" in card and f"{eval_record['degeneracy_reference']:.3f}" in card
    # recompute three files (the whole set takes minutes); greedy near-ties may flip on other kernels
    splits = load_splits(DEFAULT_MODEL_DIR)
    files = [rel for rel, _, _ in degeneracy_prompts(tokenizer, splits)][:3]
    per_file = {r["file"]: r for r in eval_record["degeneracy_per_file"]}
    if len(files) < 3 or not all(f in per_file for f in files):
        pytest.skip("this interpreter's stdlib lacks the recorded held-out files")
    again = heldout_degeneracy(model, tokenizer, {"heldout": files})
    for row in again["files"]:
        assert row["reference"] == pytest.approx(per_file[row["file"]]["reference"], abs=1e-4)
    expected = sum(per_file[f]["model"] for f in files) / 3
    tolerance = 0.02 if platform.python_version() == eval_record["python_version"] else 0.2
    assert abs(again["model"] - expected) <= tolerance, (again["model"], expected)
