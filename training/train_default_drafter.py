"""Retrain the EAGLE-3 drafter shipped for the default model (probebus/models/default-drafter).

    nice -n 10 python training/train_default_drafter.py            # record + train + evaluate (~10 min, 2 cores)

1. Record the target's own greedy continuations of training-split prompts with probes on
   the three feature sites (the same path as `probebus record`: probe.attach +
   exporters.ArrowRecorder), into a temporary folder (not committed).
2. Train with `decoder.train_drafter` (what `probebus train-drafter` runs).
3. Measure tau and tokens per forward on held-out prompts; write the model card.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import exporters
import probe
from decoder import Eagle3Config, SpeculativeDecoder, TrainConfig, load_drafter, train_drafter
from probebus._code_prompts import code_prompts
from probebus._load import load_model

OUT = Path(__file__).resolve().parents[1] / "probebus" / "models" / "default-drafter"


def record(model, tok, prompts: list[str], folder: Path, new_tokens: int, batch: int) -> dict:  # noqa: ANN001
    sites = [f"layers.{i}.resid_pre" for i in Eagle3Config.for_target(model.config).aux_layer_ids]
    with probe.attach(model, sites) as session, exporters.ArrowRecorder(session, folder) as rec:
        for i in range(0, len(prompts), batch):
            enc = tok(prompts[i: i + batch], return_tensors="pt", padding=True)
            with torch.no_grad():
                model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            print(f"recorded {min(i + batch, len(prompts))}/{len(prompts)} prompts", flush=True)
    return {"rows": rec.summary.rows if rec.summary else None, "sites": sites}


def evaluate(model, tok, drafter, prompts: list[str], new_tokens: int, k: int) -> dict:  # noqa: ANN001
    taus, fwd, emitted = [], 0, 0
    with SpeculativeDecoder(model, drafter, k=k) as spec:
        for p in prompts:
            enc = tok([p], return_tensors="pt")
            out = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=new_tokens)
            taus.append((out.stats.tau, out.stats.row_rounds))
            fwd += out.stats.target_forwards
            emitted += out.stats.emitted
    tau = sum(t * r for t, r in taus) / sum(r for _, r in taus)
    return {"tau": round(tau, 3), "tokens_per_forward": round(emitted / fwd, 3), "prompts": len(prompts),
            "new_tokens": new_tokens, "k": k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=480)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--window", type=int, default=96)
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--recording", type=Path, default=None, help="reuse an existing recording")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model("default")
    for prm in model.parameters():
        prm.requires_grad_(False)
    t0 = time.time()
    folder = args.recording or Path(tempfile.mkdtemp(prefix="probebus-drafter-rec-"))
    rec = {"reused": str(folder)} if args.recording else record(model, tok, code_prompts("train", args.prompts),
                                                                  folder, args.new_tokens, 16)
    t_rec = time.time() - t0
    cfg = TrainConfig(steps=args.steps, batch=args.batch, draft_vocab=args.draft_vocab, window=args.window)
    metrics = train_drafter(model, folder, args.out, cfg, resume=False, target_name="default")
    (args.out / "train_state.pt").unlink(missing_ok=True)  # resumability is for interrupted runs, not shipping
    drafter = load_drafter(args.out, model)
    ev = evaluate(model, tok, drafter, code_prompts("heldout", 16), 64, 5)
    card = {"recording": rec, "record_seconds": round(t_rec), "train": {k: metrics[k] for k in
            ("sequences", "tokens", "step", "loss", "acc", "seconds")}, "train_config": cfg.__dict__,
            "heldout_eval": ev}
    (args.out / "eval.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card, indent=2))


if __name__ == "__main__":
    main()
