"""Train an EAGLE-3 drafter from a recording: record the target's feature sites while it generates, train
on the recording, then draft with the result.

    python examples/train_drafter.py --model default --prompts 32 --steps 300 --out /tmp/my-drafter
"""

import argparse
import shutil
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import decoder
import exporters
import probe
from probebus._code_prompts import code_prompts
from probebus.models import resolve_model

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--model", default="default")
ap.add_argument("--prompts", type=int, default=32, help="training prompts (stdlib code)")
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated (and recorded) per prompt")
ap.add_argument("--out", default=None, help="drafter folder (default: a new temporary one)")
args = ap.parse_args()
work = tempfile.mkdtemp(prefix="probebus-train-")
model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model)).eval()
tok = AutoTokenizer.from_pretrained(resolve_model(args.model), padding_side="left")
sites = [f"layers.{i}.resid_pre" for i in decoder.default_aux_layers(model.config.num_hidden_layers)]

prompts = code_prompts("train", args.prompts)
with probe.attach(model, sites) as session, exporters.ArrowRecorder(session, f"{work}/rec") as rec, torch.no_grad():
    for i in range(0, len(prompts), 8):
        model.generate(**tok(prompts[i:i + 8], return_tensors="pt", padding=True), max_new_tokens=args.new_tokens,
                       do_sample=False, pad_token_id=tok.pad_token_id)
print(f"recorded {rec.summary.rows} rows of {sites}")

for p in model.parameters():
    p.requires_grad_(False)
metrics = decoder.train_drafter(model, f"{work}/rec", args.out or f"{work}/drafter",
                                decoder.TrainConfig(steps=args.steps, holdout=0.1), progress=False)
print({k: metrics[k] for k in ("sequences", "step", "loss", "acc") if k in metrics})
print("held-out acceptance by draft position:", (metrics.get("heldout") or {}).get("acceptance"))

drafter = decoder.load_drafter(args.out or f"{work}/drafter", target=model)
with decoder.SpeculativeDecoder(model, drafter, k=5) as spec:
    out = spec.generate(**tok(["def main(argv):\n"], return_tensors="pt"), max_new_tokens=32)
shutil.rmtree(work if args.out else f"{work}/rec")  # the recording was only for training
print(f"tau with the new drafter: {out.stats.tau:.2f} (drafter in {args.out or work + '/drafter'})")
