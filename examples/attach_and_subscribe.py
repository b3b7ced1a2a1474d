"""Attach probes to a model and read its captures in another process.

    python examples/attach_and_subscribe.py --model default --max-new-tokens 16
"""

import argparse
import multiprocessing as mp

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import probe
from probebus.models import resolve_model


def subscriber(endpoint: str) -> None:
    """Runs in its own process: one line per capture site with what arrived, until the session closes."""
    seen = {}
    for cap in probe.Subscriber(endpoint, sites="layers.*.resid_post"):  # ends at the session's end of stream
        n, norm = seen.get(cap.site, (0, 0.0))
        seen[cap.site] = (n + cap.n_tokens, norm + cap.tensor.float().norm(dim=-1).sum().item())
    for site, (n, norm) in seen.items():
        print(f"[subscriber] {site}: {n} tokens, mean norm {norm / n:.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model)).eval()
    tok = AutoTokenizer.from_pretrained(resolve_model(args.model))
    print(probe.list_sites(model)[:8], "...")
    with probe.attach(model, ["layers.*.resid_post", "logits"]) as session:
        child = mp.get_context("spawn").Process(target=subscriber, args=(session.endpoint,))
        child.start()
        session.wait_for_subscribers(1, timeout=60)  # nothing is published before the child listens
        with torch.no_grad():
            model.generate(**tok(["def fibonacci(n):\n"], return_tensors="pt"), max_new_tokens=args.max_new_tokens,
                           do_sample=False)
    child.join(60)  # the session closed: the child's loop ended
    print("[model]", session.stats)
