"""What observing costs a model on a GPU: probebus (side-stream copies, sends at a later step
boundary) against plain generate and naive hooks (`.cpu()` + send inside the hook), plus a
fidelity check of every captured row against transformers' output_hidden_states.

    python benchmarks/cuda_overhead.py                 # random Llama ~1B, bf16, batch 1 and 8
    python benchmarks/cuda_overhead.py --quick
    python benchmarks/cuda_overhead.py --profile       # also: where a decode step's host time goes, plain vs probebus

Needs a CUDA device. Modes run interleaved in rotating order; a subscriber process drains
everything for probebus and for naive; decode tok/s excludes the prefill.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import zmq
from transformers import LlamaConfig, LlamaForCausalLM

import probe

sys.path.insert(0, os.path.dirname(__file__))
from overhead import DRAIN, Clock, private_ipc  # noqa: E402  (same drain and clock as the CPU benchmark)


def naive_hooks(model: LlamaForCausalLM, sock: zmq.Socket) -> list:
    def hook(module, args, output, site=b""):
        t = output[0] if isinstance(output, tuple) else output
        sock.send_multipart([site, t.detach().cpu().view(torch.int16).numpy()])  # .cpu() waits for the GPU
    return [layer.register_forward_hook(lambda m, a, o, s=f"layers.{i}.resid_post".encode(): hook(m, a, o, s))
            for i, layer in enumerate(model.model.layers)]


def fidelity(model: LlamaForCausalLM, vocab: int) -> None:
    """Captures of a left-padded generate match output_hidden_states of each unpadded sequence (bf16 over 16
    layers differs elementwise between cached decode and a full forward: compare directions, and token ids)."""
    prompts = [[5 + i for i in range(n)] for n in (12, 7, 30)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = (torch.arange(width, device="cuda")[None] >= torch.tensor([width - len(p) for p in prompts],
                                                                     device="cuda")[:, None]).long()
    with probe.attach(model, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for(sub)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
    caps = list(sub.iter(idle_timeout=2.0))
    sub.close()
    worst, rows = 1.0, 0
    t0 = time.perf_counter()
    for b, p in enumerate(prompts):
        seq = p + gen[b, width:].tolist()
        with torch.no_grad():
            hs = model(torch.tensor([seq], device="cuda"), output_hidden_states=True).hidden_states
        for cap in caps:
            sel = (cap.seq_ids == cap.seq_ids.min() + b).nonzero().flatten().tolist()
            for r in sel:
                pos = int(cap.positions[r])
                assert int(cap.token_ids[r]) == seq[pos], "token id"
                if cap.layer + 1 >= len(hs) - 1:
                    continue  # the last resid_post is only in hidden_states after the final norm
                want = hs[cap.layer + 1][0, pos].float().cpu()
                got = cap.tensor[r].float()
                worst = min(worst, float(torch.nn.functional.cosine_similarity(got, want, dim=0)))
                rows += 1
    print(f"fidelity: {rows} captured rows against output_hidden_states (cached decode vs one full forward, "
          f"bf16): lowest cosine similarity {worst:.5f}, token ids all equal; stats {session.stats}")
    assert rows > 0 and worst > 0.99, worst
    print(f"  (checked in {time.perf_counter() - t0:.1f} s)")


def profile(model: LlamaForCausalLM, new_tokens: int) -> None:
    """torch.profiler over one batch-1 generate, plain and with probebus attached: the host ops that differ are
    what the probe adds to a decode step (on an H200 the host, not the GPU, bounds a step of this model)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ids = torch.randint(3, 32000, (1, 128), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, pad_token_id=0, eos_token_id=None)
    for i, mode in enumerate(("plain", "probebus", "plain", "probebus")):  # the first pair warms up
        with torch.no_grad(), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            if mode == "plain":
                model.generate(ids, **kw)
            else:
                with probe.attach(model, "layers.*.resid_post") as session:
                    sub = probe.Subscriber(session.endpoint)
                    session.wait_for(sub)
                    model.generate(ids, **kw)
                sub.close()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        if i < 2:
            continue
        print(f"profile {mode}: {wall * 1e3:.0f} ms for {new_tokens} tokens (profiled)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="profile one plain and one probebus generate, then stop")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.hidden, args.layers, args.new_tokens = 2, 512, 4, 16
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden), num_hidden_layers=args.layers,
                      num_attention_heads=16, num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048)
    with torch.device("cuda"):  # random init on the GPU: seconds instead of a minute on the host
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    print(f"machine: {torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"Python {platform.python_version()}, pyzmq {zmq.__version__}; random Llama "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B bf16 ({args.layers} layers, hidden {args.hidden})")
    if args.profile:
        return profile(model, args.new_tokens)
    fidelity(model, cfg.vocab_size)
    eps = {"probebus": private_ipc(), "naive": private_ipc()}
    drains = [subprocess.Popen([sys.executable, "-c", DRAIN, m, e]) for m, e in eps.items()]
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.bind(eps["naive"])
    time.sleep(0.5)
    try:
        for batch in (1, 8):
            ids = torch.randint(3, 32000, (batch, 128), device="cuda")
            kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                      min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
            modes = ["plain", "probebus", "naive"]
            tok_s: dict[str, list[float]] = {m: [] for m in modes}
            for rep in range(args.repeats + 1):
                for m in modes[rep % 3:] + modes[:rep % 3]:
                    clock = Clock()
                    with torch.no_grad():
                        if m == "plain":
                            model.generate(ids, streamer=clock, **kw)
                        elif m == "probebus":
                            with probe.attach(model, "layers.*.resid_post", endpoint=eps["probebus"]) as s:
                                s.wait_for_subscribers(1, timeout=30)
                                model.generate(ids, streamer=clock, **kw)
                            assert s.stats.dropped == 0 and s.stats.published == s.stats.captured, s.stats
                            s.join(30)
                        else:
                            hs = naive_hooks(model, sock)
                            model.generate(ids, streamer=clock, **kw)
                            for h in hs:
                                h.remove()
                    if rep:  # the first round warms up
                        tok_s[m].append(clock.decode_tok_s(batch))
            base = statistics.median(tok_s["plain"])
            print(f"batch {batch}: decode tok/s, median [min..max] of {args.repeats} interleaved runs")
            for m in modes:
                med = statistics.median(tok_s[m])
                print(f"  {m:9s} {med:8.1f} [{min(tok_s[m]):8.1f}..{max(tok_s[m]):8.1f}]  "
                      f"slowdown {100 * (1 - med / base):+5.1f} %")
    finally:
        for d in drains:
            d.kill()
        sock.close(0)


if __name__ == "__main__":
    main()
