"""Train the confidence head of the default drafter (probebus/models/default-drafter/confidence.*).

    nice -n 10 python training/train_default_confidence.py                 # record + label + train (~5 min, 2 cores)
    python training/train_default_confidence.py --recording /tmp/rec      # reuse a recording (e.g. the drafter's)
    python training/train_default_confidence.py --model M --drafter D     # any model folder and its drafter

Rerun it whenever the default model or its drafter is retrained: the head reads the
drafter's hidden state, so it is tied to those weights (confidence.json stores the
drafter's fingerprint, and a head trained for other weights is ignored with a warning).

1. Record the target's own greedy continuations of training-split prompts with probes on
   the drafter's three feature sites (as `probebus record` does), into a temporary folder.
2. `decoder.train_confidence`: unroll the drafter's chain over each recorded sequence as in
   training-time test, label each on-policy step by whether it equals the target's greedy
   token, and fit the small head; 10 % of the sequences are held out for the metrics
   (AUC and Brier score against the drafter's own top-1 probability) written to confidence.json.
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
from decoder import load_drafter
from decoder.training import train_confidence
from probebus._code_prompts import code_prompts
from probebus._load import load_model


def record(model, tok, sites: list[str], prompts: list[str], folder: Path, new_tokens: int, batch: int) -> None:
    with probe.attach(model, sites) as session, exporters.ArrowRecorder(session, folder):
        for i in range(0, len(prompts), batch):
            enc = tok(prompts[i: i + batch], return_tensors="pt", padding=True)
            with torch.no_grad():
                model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            print(f"recorded {min(i + batch, len(prompts))}/{len(prompts)} prompts", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default | model folder (default: %(default)s)")
    ap.add_argument("--drafter", default="default", help="default (shipped next to the model) | drafter folder")
    ap.add_argument("--prompts", type=int, default=240, help="training-split prompts to record")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens recorded per prompt")
    ap.add_argument("--recording", type=Path, default=None, help="reuse an existing recording of the feature sites")
    ap.add_argument("--steps", type=int, default=6, help="draft steps to unroll and label (default: %(default)s)")
    ap.add_argument("--train-steps", type=int, default=600, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help="where confidence.* go (default: the drafter's folder)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    for prm in model.parameters():
        prm.requires_grad_(False)
    drafter = load_drafter(args.drafter, model)
    out = args.out or Path(drafter.source)
    t0 = time.time()
    folder = args.recording
    if folder is None:
        folder = Path(tempfile.mkdtemp(prefix="probebus-confidence-rec-"))
        sites = [f"layers.{i}.resid_pre" for i in drafter.config.aux_layer_ids]
        record(model, tok, sites, code_prompts("train", args.prompts, seed=1), folder, args.new_tokens, 16)
    t_rec = time.time() - t0
    metrics = train_confidence(model, drafter, folder, out, steps=args.steps, train_steps=args.train_steps)
    metrics["record_seconds"] = round(t_rec)
    metrics["recording"] = str(folder) if args.recording else f"{args.prompts} train-split prompts x {args.new_tokens}"
    meta = json.loads((out / "confidence.json").read_text())
    meta["metrics"] = metrics
    (out / "confidence.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
