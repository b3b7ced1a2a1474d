"""Every drafting method shipped for the default model, one after another in the same lossless loop:
EAGLE-3 (chain and tree), Medusa (chain and tree), MTP, clustered MTP, DSpark, a separate draft model,
self-speculative layer skip and n-gram. Each reproduces plain greedy generate; tau and speed differ.

    python examples/every_drafter.py --max-new-tokens 48
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import decoder
from probebus.models import resolve_model

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--model", default="default")
ap.add_argument("--max-new-tokens", type=int, default=48)
args = ap.parse_args()
model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model)).eval()
tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
ids = tok(["def parse_args(argv):\n    parser = argparse.ArgumentParser("], return_tensors="pt").input_ids
t0 = time.perf_counter()
plain = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None)
print(f"{'plain generate':14s} {args.max_new_tokens / (time.perf_counter() - t0):6.1f} tok/s")

for name in ["eagle3", "eagle3-tree", "medusa", "medusa-tree", "mtp", "mtp-attn", "clustered", "dspark",
             "draft-model", "layer-skip", "ngram"]:
    drafter = decoder.load_named_drafter(name, model)  # files shipped next to the model (`--drafter NAME`)
    with decoder.SpeculativeDecoder(model, drafter, k=4, schedule="fixed", tree=decoder.tree_nodes(name)) as spec:
        out = spec.generate(ids, max_new_tokens=args.max_new_tokens)
    st = out.stats
    print(f"{name:14s} {st.tokens_per_s:6.1f} tok/s  tau {st.tau:.2f}  same as generate: "
          f"{torch.equal(out.sequences, plain)}")
print(tok.decode(plain[0], skip_special_tokens=True))
