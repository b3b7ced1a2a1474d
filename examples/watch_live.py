"""Watch a run live: the model generates in one thread while a monitor (a bus subscriber) prints per-site
rates every second. From another terminal, `probebus top ENDPOINT` shows the same as a live table.

    python examples/watch_live.py --model default --max-new-tokens 200
"""

import argparse
import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import exporters
import probe
from probebus.models import resolve_model

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--model", default="default")
ap.add_argument("--max-new-tokens", type=int, default=200)
args = ap.parse_args()
model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model)).eval()
tok = AutoTokenizer.from_pretrained(resolve_model(args.model), padding_side="left")
enc = tok(["def main(argv):\n", "class Queue:\n"], return_tensors="pt", padding=True)

with probe.attach(model, "layers.*.resid_post,logits") as session:
    print(f"session {session.endpoint}; also try: probebus top {session.endpoint}")
    monitor = exporters.TopMonitor(session.endpoint)
    session.wait_for_subscribers(1)
    def run() -> None:  # grad mode is per thread: no_grad inside the worker
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)

    worker = threading.Thread(target=run)
    worker.start()
    while worker.is_alive():
        monitor.poll(1.0)
        t = monitor.totals()
        logits = next((r for r in t["sites"] if r["site"] == "logits"), None)
        print(f"step {t['max_step']:4d}  {t['captures_per_s']:7.1f} captures/s  {t['bytes_per_s'] / 1e6:6.2f} MB/s  "
              f"{logits['tokens_per_s'] if logits else 0:6.1f} tok/s  missed {t['gaps']}  busy {t['busy']:.0%}")
    worker.join()
monitor.poll(0.5)  # the tail and the end of stream
print(f"done: {monitor.totals()['captures']} captures, session: {session.stats}")
monitor.close()
