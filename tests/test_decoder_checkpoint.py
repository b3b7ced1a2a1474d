"""EAGLE-3 checkpoints in both public layouts load to the same drafter; every mismatch is a clear error."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from decoder import DrafterError, load_drafter
from decoder.drafters import Eagle3Config, Eagle3Drafter, save_drafter


def _target(layers: int = 8, hidden: int = 64, vocab: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab)
    return LlamaForCausalLM(cfg).eval()


def _drafter(target: LlamaForCausalLM, draft_vocab: int = 48) -> Eagle3Drafter:
    torch.manual_seed(1)
    d = Eagle3Drafter(Eagle3Config.for_target(target.config, draft_vocab_size=draft_vocab))
    for prm in d.parameters():  # non-trivial norms, so a mis-mapped weight changes the output
        torch.nn.init.normal_(prm, std=0.2)
    # a reduced vocabulary: draft id i -> target id 2*i+1, stored as offsets
    d.d2t.copy_(torch.arange(draft_vocab) + 1)
    d.t2d.zero_()
    d.t2d[torch.arange(draft_vocab) * 2 + 1] = True
    return d


def _write_safeailab(d: Eagle3Drafter, folder: Path) -> Path:
    folder.mkdir(parents=True)
    c = d.config
    save_file({k: v.contiguous() for k, v in d.state_dict().items()}, str(folder / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
           "draft_vocab_size": c.draft_vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": c.aux_layer_ids}}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _draft_outputs(d: Eagle3Drafter, target: LlamaForCausalLM) -> torch.Tensor:
    d.bind_target(target)
    torch.manual_seed(5)
    feats = torch.randn(2, 6, 3 * 64)
    ids = torch.randint(0, 128, (2, 6))
    pos = torch.arange(6).expand(2, 6)
    h, logits = d(d.fuse(feats), ids, pos, d.new_cache(2, 32))
    return torch.cat([h.flatten(), logits.flatten(), d.to_target(logits.argmax(-1)).float().flatten()])


def test_both_layouts_load_to_the_same_drafter(tmp_path: Path) -> None:
    target = _target()
    d = _drafter(target)
    ref = _draft_outputs(d, target)
    spec = load_drafter(save_drafter(d, tmp_path / "speculators"), target)
    safe = load_drafter(_write_safeailab(d, tmp_path / "safeailab"), target)
    assert json.loads((tmp_path / "speculators" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    keys = set(__import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(tmp_path / "speculators" / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in keys and not any(k.startswith("midlayer") for k in keys)
    for loaded in (spec, safe):
        assert loaded.config.aux_layer_ids == [2, 4, 5]
        torch.testing.assert_close(_draft_outputs(loaded, target), ref, rtol=0, atol=0)
    # d2t offsets: draft id i is target id 2i+1
    assert spec.to_target(torch.tensor([0, 3])).tolist() == [1, 7]


def test_mismatches_are_clear_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = _target()
    d = _drafter(target)
    folder = save_drafter(d, tmp_path / "ok")
    with pytest.raises(DrafterError, match="target hidden size 64, target has 96"):
        load_drafter(folder, _target(hidden=96))
    with pytest.raises(DrafterError, match="vocabulary 128 != target vocabulary 256"):
        load_drafter(folder, _target(vocab=256))
    with pytest.raises(DrafterError, match="not three layers of a 4-layer target"):
        load_drafter(folder, _target(layers=4))

    def edited(name: str, change) -> Path:
        out = tmp_path / name
        out.mkdir()
        (out / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
        cfg = json.loads((folder / "config.json").read_text())
        change(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
        return out

    # SafeAILab's published heads name no feature layers: EAGLE-3's default (2, L//2, L-3), logged
    noids = edited("noids", lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    with caplog.at_level(logging.INFO, logger="decoder"):
        assert load_drafter(noids, target).config.aux_layer_ids == [2, 4, 5]
    assert "using EAGLE-3's default [2, 4, 5]" in caplog.text
    with pytest.raises(DrafterError, match="names no eagle_aux_hidden_state_layer_ids and a target with 4 layers"):
        load_drafter(noids, _target(layers=4))
    bad = edited("corrupt", lambda c: None)
    (bad / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(DrafterError, match="cannot read the drafter weights"):
        load_drafter(bad, target)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(DrafterError, match="not valid JSON"):
        load_drafter(bad, target)
    with pytest.raises(DrafterError, match="lm_head has 48 rows but draft_vocab_size is 64"):
        load_drafter(edited("vocab", lambda c: c.update(draft_vocab_size=64)), target)
    with pytest.raises(DrafterError, match="only 'eagle3' is supported"):
        load_drafter(edited("kind", lambda c: c.update(speculators_model_type="eagle")), target)
    with pytest.raises(DrafterError, match="fc takes 192 inputs but target_hidden_size is 32"):
        load_drafter(edited("fc", lambda c: c.update(target_hidden_size=32)), target)
    with pytest.raises(DrafterError, match="no config.json"):
        load_drafter(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(DrafterError, match="no model.safetensors"):
        load_drafter(tmp_path / "empty")
    with pytest.raises(ValueError, match="wrong target for this drafter"):
        d.bind_target(_target(hidden=96))


def test_default_drafter_is_found_next_to_the_target_from_any_directory(tmp_path: Path) -> None:
    """load_drafter("default", target) finds '<model>-drafter' next to the model folder; the shipped default model
    finds its drafter from another working directory, without decoder importing probebus."""
    target = _target()
    target.save_pretrained(tmp_path / "mymodel")
    save_drafter(_drafter(target), tmp_path / "mymodel-drafter")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mymodel")
    assert load_drafter("default", loaded).source == str((tmp_path / "mymodel-drafter").resolve())
    (tmp_path / "other").mkdir()
    other = _target()
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(DrafterError, match="no drafter ships with the target"):
        load_drafter("default", AutoModelForCausalLM.from_pretrained(tmp_path / "other"))
    with pytest.raises(DrafterError, match="needs target="):
        load_drafter("default")
    code = ("import sys\nfrom transformers import AutoModelForCausalLM\nimport decoder\n"
            "from probebus.models import resolve_model\n"
            "m = AutoModelForCausalLM.from_pretrained(resolve_model('default'))\n"
            "d = decoder.load_drafter('default', m)\nprint(d.source)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(os.path.join("models", "default-drafter"))
