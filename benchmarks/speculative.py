"""Speculative decoding on the shipped default model: probebus EAGLE-3, n-gram and auto against
plain `generate`, HF prompt lookup and (when an assistant is given) HF assisted generation.

    python benchmarks/speculative.py                       # held-out prompts, batch 1 and 8
    python benchmarks/speculative.py --quick               # smoke run

Greedy decoding, fp32, 2 threads. Every method runs the same held-out prompts in the same
process; repeats are interleaved (rotating order) and the median wall time is reported.
tau = mean tokens per verification round (bonus included); tokens/forward counts target
forwards with a hook (prefill included), so HF methods get the same measure.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from decoder import NgramDrafter, RemoteEagle, SpeculativeDecoder, load_drafter
from probebus._code_prompts import code_prompts
from probebus._load import load_model, resolve_drafter


class ForwardCounter:
    def __init__(self, model: torch.nn.Module) -> None:
        self.n = 0
        self.h = model.register_forward_pre_hook(self._hook)

    def _hook(self, *args: object) -> None:
        self.n += 1

    def close(self) -> None:
        self.h.remove()


def run_method(name: str, model, tok, prompts: list[str], batch: int, k: int, assistant) -> dict:  # noqa: ANN001
    new_tokens, forwards, rounds_tau = 0, 0, []
    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        enc = tok(prompts[i: i + batch], return_tensors="pt", padding=True)
        kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  pad_token_id=tok.pad_token_id, eos_token_id=None)
        if name.startswith("hf") or name == "plain generate":
            counter = ForwardCounter(model)
            if name == "hf prompt lookup":
                kw["prompt_lookup_num_tokens"] = k
            if name == "hf assisted":
                kw["assistant_model"] = assistant
            with torch.no_grad():
                seq = model.generate(**enc, **kw)
            counter.close()
            forwards += counter.n
            new = seq[:, enc.input_ids.shape[1]:]
        else:
            out = SPECS[name].generate(enc.input_ids, enc.attention_mask, max_new_tokens=args.new_tokens,
                                       pad_token_id=tok.pad_token_id)
            forwards += out.stats.target_forwards
            rounds_tau.append((out.stats.tau, out.stats.row_rounds))
            new = out.sequences[:, enc.input_ids.shape[1]:]
        new_tokens += new.numel()
        outs.extend(new.tolist())
    secs = time.perf_counter() - t0
    tau = sum(t * r for t, r in rounds_tau) / max(sum(r for _, r in rounds_tau), 1) if rounds_tau else None
    return {"seconds": secs, "tokens": new_tokens, "forwards": forwards, "tau": tau, "outs": outs}


def main() -> None:
    torch.set_num_threads(args.threads)
    model, tok = load_model("default")
    prompts = code_prompts("heldout", args.prompts)
    drafter = load_drafter(resolve_drafter(args.drafter), model)
    global SPECS
    server = subprocess.Popen([sys.executable, "-m", "decoder", "--bind", "tcp://127.0.0.1:47920",
                               "--drafter", args.drafter])
    remote = RemoteEagle("tcp://127.0.0.1:47920", timeout=120)
    SPECS = {
        "probebus n-gram": SpeculativeDecoder(model, NgramDrafter(), k=args.k),
        "probebus EAGLE-3": SpeculativeDecoder(model, drafter, k=args.k),
        "EAGLE-3 remote": SpeculativeDecoder(model, remote, k=args.k),
        "probebus auto": SpeculativeDecoder(model, "auto", eagle=drafter, k=args.k),
    }
    assistant = load_model(args.assistant)[0] if args.assistant else None
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"machine: {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"target: default ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, fp32), drafter "
          f"{args.drafter}, k={args.k}, {len(prompts)} held-out prompts, {args.new_tokens} new tokens, greedy")
    for batch in args.batches:
        methods = ["plain generate", "probebus n-gram", "probebus EAGLE-3", "EAGLE-3 remote", "probebus auto"]
        if batch == 1:
            methods.insert(1, "hf prompt lookup")
            if assistant is not None:
                methods.insert(2, "hf assisted")
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        run_method("plain generate", model, tok, prompts[:batch], batch, args.k, assistant)  # warm-up
        for rep in range(args.repeats):
            for m in methods[rep % len(methods):] + methods[: rep % len(methods)]:
                runs[m].append(run_method(m, model, tok, prompts, batch, args.k, assistant))
        base = statistics.median(r["seconds"] for r in runs["plain generate"])
        ref = runs["plain generate"][0]["outs"]
        print(f"\nbatch {batch}: median of {args.repeats} interleaved repeats")
        print(f"  {'method':18s} {'tau':>5s} {'tok/fwd':>8s} {'tok/s':>8s} {'speedup':>8s} {'same as plain':>14s}")
        for m in methods:
            r = runs[m][0]
            secs = statistics.median(x["seconds"] for x in runs[m])
            tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
            same = sum(a == b for a, b in zip(r["outs"], ref, strict=True))
            print(f"  {m:18s} {tau:>5s} {r['tokens'] / max(r['forwards'] * batch, 1):8.2f} "
                  f"{r['tokens'] / secs:8.1f} {base / secs:7.2f}x {same:>8d}/{len(ref)}")
        if batch != 1:
            print("  (HF prompt lookup and assisted generation support batch size 1 only)")
    for s in SPECS.values():
        s.close()
    remote.shutdown()
    server.wait(30)
    print("EAGLE-3 remote = the same drafter in its own process (features over the bus, drafts over REQ/REP)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--assistant", default=None, help="a smaller model folder for HF assisted generation")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.repeats, args.batches = 4, 24, 1, [1, 4]
    SPECS: dict = {}
    sys.exit(main())
