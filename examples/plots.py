"""Plots: per-layer activation norms over positions (from a recording), and the drafter's acceptance by
draft position (from speculative decoding). Needs the plot extra: pip install 'probebus[plot]'.

    python examples/plots.py --model default --out plots/
"""

import argparse
import tempfile

import matplotlib
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import decoder
import exporters
import probe
from probebus.models import resolve_model

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the file-only backend

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--model", default="default")
ap.add_argument("--out", default="plots")
ap.add_argument("--max-new-tokens", type=int, default=48)
args = ap.parse_args()
model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model)).eval()
tok = AutoTokenizer.from_pretrained(resolve_model(args.model), padding_side="left")
enc = tok(["def parse_args(argv):\n", "class Stack:\n    def push(self, item):\n"], return_tensors="pt", padding=True)

recording = tempfile.TemporaryDirectory(prefix="probebus-plots-")  # only the plots are kept
rec_dir = f"{recording.name}/rec"
with probe.attach(model, "layers.*.resid_post") as session, exporters.ArrowRecorder(session, rec_dir), torch.no_grad():
    model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
for path in exporters.plot_recording(rec_dir, args.out, title=f"{args.model}, {args.max_new_tokens} new tokens"):
    print("wrote", path)  # the same as: probebus inspect REC --plot OUT
recording.cleanup()

with decoder.SpeculativeDecoder(model, decoder.load_drafter("default", target=model), k=5, schedule="fixed") as spec:
    stats = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=args.max_new_tokens).stats
fig, ax = plt.subplots(figsize=(5, 3))
ax.bar(range(1, len(stats.acceptance) + 1), stats.acceptance)
ax.set(xlabel="draft position", ylabel="accepted share", ylim=(0, 1), title=f"EAGLE-3 acceptance, tau {stats.tau:.2f}")
fig.tight_layout()
fig.savefig(f"{args.out}/acceptance_by_position.png", dpi=110)
print("wrote", f"{args.out}/acceptance_by_position.png")
