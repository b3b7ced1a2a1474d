"""Speculative decoding with the EAGLE-3 drafter as a probe-bus subscriber: in this process, then served
from another process (`probebus serve-drafter`). Greedy output equals plain generate both times.

    python examples/speculative.py --model default --max-new-tokens 48
"""

import argparse
import shutil
import subprocess
import sys
import tempfile

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
enc = tok(["def parse_args(argv):\n"], return_tensors="pt")
eos = model.generation_config.eos_token_id
plain = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False)

drafter = decoder.load_drafter("default", target=model)  # the EAGLE-3 head shipped next to the model
with decoder.SpeculativeDecoder(model, drafter, k=5) as spec:  # it reads the target's features off the bus
    out = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
print(f"local drafter:  same as generate: {torch.equal(out.sequences, plain)}, tau {out.stats.tau:.2f}, "
      f"acceptance by draft position {[round(a, 2) for a in out.stats.acceptance]}")

socket_dir = tempfile.mkdtemp(prefix="probebus-drafter-")  # a private folder: hidden states leak prompts
address = f"ipc://{socket_dir}/drafter.sock"
server = subprocess.Popen([sys.executable, "-m", "probebus", "serve-drafter", "--bind", address, "--model", args.model])
try:  # the first request waits in ZeroMQ until the server is up
    with decoder.SpeculativeDecoder(model, decoder.RemoteEagle(address), k=5) as spec:
        out = spec.generate(enc.input_ids, enc.attention_mask, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
    print(f"remote drafter: same as generate: {torch.equal(out.sequences, plain)}, tau {out.stats.tau:.2f}")
finally:
    server.terminate()
    server.wait(30)
    shutil.rmtree(socket_dir, ignore_errors=True)
print(tok.decode(plain[0], skip_special_tokens=True))
