"""`probebus record` then `probebus train-drafter` on a small random target: the documented path works,
training lowers the loss, resumes from its saved state, and writes a loadable speculators checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from decoder import load_drafter
from decoder.drafters import ConfidenceHead
from decoder.training import load_sequences, train_confidence
from probebus.cli import main
from probebus.models import DEFAULT_MODEL_DIR


def _target(folder: Path) -> LlamaForCausalLM:
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def test_record_then_train_drafter_cli(tmp_path: Path, capsys) -> None:
    model = _target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}\n"}) + "\n"
                               for i in range(12)))
    sites = "layers.2.resid_pre,layers.4.resid_pre,layers.5.resid_pre"
    assert main(["record", "--model", str(tmp_path / "target"), "--prompts", str(prompts), "--sites", sites,
                 "--out", str(tmp_path / "rec"), "--max-new-tokens", "24", "--batch-size", "6"]) == 0
    seqs = load_sequences(tmp_path / "rec", [2, 4, 5])
    assert len(seqs) == 12 and all(f.shape[1] == 3 * 64 for _, f in seqs)
    capsys.readouterr()

    args = ["train-drafter", "--model", str(tmp_path / "target"), "--recording", str(tmp_path / "rec"), "--out",
            str(tmp_path / "drafter"), "--window", "16", "--batch", "4", "--draft-vocab", "256", "--json",
            "--holdout", "0"]  # every sequence trains: the vocabulary check below sees them all
    assert main(args + ["--steps", "20"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["resumed_from"] == 0 and first["step"] == 20 and len(first["acc"]) == 3
    # a share held out (a later --holdout wins)
    assert main(args + ["--steps", "20", "--holdout", "0.25", "--out", str(tmp_path / "held"), "--no-resume"]) == 0
    held = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert held["heldout_sequences"] == 3 and held["sequences"] == 9
    assert len(held["heldout"]["acceptance"]) == 5 and all(0 <= a <= 1 for a in held["heldout"]["acceptance"])
    acc = held["heldout"]["acceptance"]
    assert all(a >= b for a, b in zip(acc, acc[1:], strict=False))  # all of the first i+1 drafts: non-increasing
    assert main(args + ["--steps", "60"]) == 0  # resumes at step 20 from train_state.pt
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["resumed_from"] == 20 and second["step"] == 60 and second["loss"] < first["loss"]
    drafter = load_drafter(tmp_path / "drafter", model)
    assert drafter.config.draft_vocab_size == 256 and drafter.config.aux_layer_ids == [2, 4, 5]
    # every token the target generated is in the frequency-chosen draft vocabulary
    seen = torch.cat([t for t, _ in seqs]).unique()
    assert len(seen) <= 256 and bool(drafter.t2d[seen].all())


def test_confidence_head_trains_loads_and_refuses_other_weights(tmp_path: Path, caplog) -> None:
    model = _target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def g{i}(y):\n    return y * {i}\n"}) + "\n" for i in range(8)))
    sites = "layers.2.resid_pre,layers.4.resid_pre,layers.5.resid_pre"
    assert main(["record", "--model", str(tmp_path / "target"), "--prompts", str(prompts), "--sites", sites,
                 "--out", str(tmp_path / "rec"), "--max-new-tokens", "24", "--batch-size", "8"]) == 0
    assert main(["train-drafter", "--model", str(tmp_path / "target"), "--recording", str(tmp_path / "rec"),
                 "--out", str(tmp_path / "drafter"), "--window", "16", "--batch", "4", "--draft-vocab", "256",
                 "--steps", "10"]) == 0
    drafter = load_drafter(tmp_path / "drafter", model)
    assert drafter.confidence is None
    metrics = train_confidence(model, drafter, tmp_path / "rec", tmp_path / "drafter", steps=3, window=16,
                               train_steps=20, holdout=0.25, progress=False)
    assert metrics["train_examples"] > 0 and "auc" in metrics["heldout"]
    head = load_drafter(tmp_path / "drafter", model).confidence
    assert isinstance(head, ConfidenceHead)
    hn, logits = torch.randn(3, 64), torch.randn(3, 256)
    for step in (0, 2, 9):
        torch.testing.assert_close(head.score(hn, logits, step), head(head.features(hn, logits, step)))
    # retrain the drafter: the old head no longer fits its weights and is ignored, with a warning
    assert main(["train-drafter", "--model", str(tmp_path / "target"), "--recording", str(tmp_path / "rec"),
                 "--out", str(tmp_path / "drafter"), "--window", "16", "--batch", "4", "--draft-vocab", "256",
                 "--steps", "5", "--no-resume"]) == 0
    with caplog.at_level("WARNING", logger="decoder"):
        assert load_drafter(tmp_path / "drafter", model).confidence is None
    assert "trained for other drafter weights" in caplog.text


@pytest.mark.parametrize("problem", ["missing", "empty"])
def test_train_drafter_on_a_bad_recording_is_one_line(tmp_path: Path, capsys, problem: str) -> None:
    rec = tmp_path / "rec"
    if problem == "empty":
        rec.mkdir()
    assert main(["train-drafter", "--recording", str(rec), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("probebus train-drafter: --recording") and "Traceback" not in err[0]


def test_record_final_norm_then_every_head_method_on_the_command_line(tmp_path: Path, capsys) -> None:
    """`probebus record --sites final_norm`, then `train-drafter --method medusa|mtp|clustered|dspark|layer-skip` (and
    mtp --attention),
    then `probebus generate --drafter OUT` with each result: the documented path for every feature-fed method."""
    _target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def g{i}(y):\n    return y * {i}\n"}) + "\n" for i in range(8)))
    target = str(tmp_path / "target")
    assert main(["record", "--model", target, "--prompts", str(prompts), "--sites", "final_norm", "--out",
                 str(tmp_path / "rec"), "--max-new-tokens", "20", "--batch-size", "4"]) == 0
    for method in ("medusa", "mtp", "mtp --attention", "clustered", "dspark", "layer-skip"):
        out = str(tmp_path / method.replace(" --", "-"))
        assert main(["train-drafter", "--method", *method.split(), "--model", target, "--recording",
                     str(tmp_path / "rec"), "--out", out, "--steps", "5", "--holdout", "0.25", "--clusters", "8",
                     "--window", "16"]) == 0, method
        capsys.readouterr()
        assert main(["generate", "--model", target, "--drafter", out, "--prompt", "def f(x):", "--max-new-tokens",
                     "8", "--json", "--fixed"]) == 0, method
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert len(got["token_ids"]) == 8, method
    assert main(["generate", "--model", target, "--drafter", str(tmp_path / "mtp"), "--tree", "8", "--prompt", "x",
                 "--max-new-tokens", "4"]) == 2
    assert "tree drafts need EAGLE-3 or Medusa" in capsys.readouterr().err


def test_soft_targets_are_the_targets_distribution_and_bring_q_closer_to_p(tmp_path: Path, capsys) -> None:
    """`train-drafter --soft` on a recording with final_norm: each position's target is the target's own next-token
    distribution over the draft vocabulary (checked against transformers' logits of the whole sequence), and a
    drafter trained on it matches p better than one trained on the recorded tokens for as many steps (the
    overlap sum min(p, q) is what a sampled draft's acceptance is)."""
    from decoder.training._train import _draft_head, ttt_chain

    model = _target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def h{i}(z):\n    return z - {i}\n"}) + "\n" for i in range(12)))
    target = str(tmp_path / "target")
    sites = "layers.2.resid_pre,layers.4.resid_pre,layers.5.resid_pre,final_norm"
    assert main(["record", "--model", target, "--prompts", str(prompts), "--sites", sites, "--out",
                 str(tmp_path / "rec"), "--max-new-tokens", "24", "--batch-size", "6"]) == 0
    from decoder.training import load_site_sequences

    seqs = load_site_sequences(tmp_path / "rec", sites.split(","))
    toks, feats = seqs[0]
    ids = torch.arange(0, 256)
    with torch.no_grad():
        oracle = model(toks[None]).logits[0][:, ids].softmax(-1)
        ours = _draft_head(model, ids)(feats[:, 3 * 64:]).softmax(-1)
    torch.testing.assert_close(ours, oracle, atol=1e-4, rtol=1e-3)

    args = ["train-drafter", "--model", target, "--recording", str(tmp_path / "rec"), "--window", "16", "--batch",
            "4", "--draft-vocab", "256", "--steps", "40", "--lr", "0.01"]
    assert main(args + ["--out", str(tmp_path / "soft"), "--soft"]) == 0
    assert main(args + ["--out", str(tmp_path / "hard")]) == 0
    capsys.readouterr()

    def overlap(folder: Path) -> float:
        drafter = load_drafter(folder, model)
        head, got = _draft_head(model, drafter.draft_to_target_ids()), []
        with torch.no_grad():
            for t, f in seqs:
                _, _, _, logits = next(ttt_chain(drafter, model.get_input_embeddings(), t[None], f[None, :-2, :192], 1))
                p = head(f[None, 1:-1, 192:]).softmax(-1)  # the target's distribution at each drafted position
                got.append(torch.minimum(p, logits.softmax(-1)).sum(-1).mean())
        return float(torch.stack(got).mean())

    soft, hard = overlap(tmp_path / "soft"), overlap(tmp_path / "hard")
    assert soft > hard + 0.05, (soft, hard)


def test_without_prompt_labels_only_continuation_tokens_are_labels(tmp_path: Path, capsys) -> None:
    """TrainConfig(label_prompts=False), the default: each sequence's prompt length comes from its prefill rows (checked
    against the tokenizer), a training window labels exactly the tokens after the prompt, and the held-out
    report scores only chains whose drafts are continuation tokens."""
    from decoder import TrainConfig, train_drafter
    from decoder.training._train import _batch, _sequences

    model = _target(tmp_path / "target")
    tok = AutoTokenizer.from_pretrained(tmp_path / "target")
    texts = [f"def g{i}(y):\n    return y * {i}" + " + 1" * (i % 4) + "\n" for i in range(12)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    sites = "layers.2.resid_pre,layers.4.resid_pre,layers.5.resid_pre"
    assert main(["record", "--model", str(tmp_path / "target"), "--prompts", str(prompts), "--sites", sites,
                 "--out", str(tmp_path / "rec"), "--max-new-tokens", "24", "--batch-size", "6"]) == 0
    capsys.readouterr()
    seqs = _sequences(tmp_path / "rec", sites.split(","))
    want = sorted(len(tok(t).input_ids) for t in texts)
    assert sorted(n for _, _, n in seqs) == want and len(set(want)) > 1

    # windows over sequences whose token at index i is 100 * k + i (k: which sequence): a label shows its index
    lengths = (3, 10, 30)
    pool = [(torch.arange(40) + 100 * k, torch.zeros(40, 3), max(0, n - 2)) for k, n in enumerate(lengths)]
    for _ in range(20):
        toks, _, unlabelled = _batch(pool, 6, 8, torch.Generator())
        for row, mask in zip(toks, unlabelled, strict=True):
            n = lengths[int(row[0]) // 100]
            assert torch.equal(mask, row[2:] % 100 < n)  # unlabelled: exactly the prompt's tokens
            assert not bool(mask.all())  # and never a window with nothing to learn

    cfg = dict(steps=6, window=16, batch=4, draft_vocab=256, holdout=0.25)
    full = train_drafter(model, tmp_path / "rec", tmp_path / "a", TrainConfig(**cfg, label_prompts=True),
                         progress=False)
    cont = train_drafter(model, tmp_path / "rec", tmp_path / "b", TrainConfig(**cfg, label_prompts=False),
                         progress=False)
    assert torch.isfinite(torch.tensor(cont["loss"]))
    held = [(len(t), n) for t, _, n in seqs]
    assert cont["heldout"]["chains"] < full["heldout"]["chains"]
    # continuation chains are a sequence's decode rows; all chains its length - 2
    assert cont["heldout"]["chains"] in {sum(x - n for x, n in c) for c in _subsets(held, 3)}
    assert full["heldout"]["chains"] in {sum(x - 2 for x, _ in c) for c in _subsets(held, 3)}


def _subsets(items: list, k: int) -> list[list]:
    from itertools import combinations

    return [list(c) for c in combinations(items, k)]
