"""What probes cost a vLLM engine, side by side with the transformers backend on the same model.

    .venv-vllm/bin/python benchmarks/vllm_overhead.py              # 15 interleaved rounds, batch 1 and 8
    .venv-vllm/bin/python benchmarks/vllm_overhead.py --quick
    .venv-vllm/bin/python benchmarks/vllm_overhead.py --engines eager compiled-plain compiled \
        --default-model --skip-transformers                          # vLLM's compiled mode beside eager

Runs where vLLM is installed (see .ci/run for the environment). Model: a random Llama
(hidden 512, 8 layers, vocab 8192) saved to a temporary folder; prompts of 64 tokens,
48 new tokens each (ignore_eos), greedy; sites `layers.*.resid_post`; a Subscriber
process draining everything. Placement "spare core": vLLM's worker computes on core 0
(VLLM_CPU_OMP_THREADS_BIND=0), the transformers model's thread is pinned to core 0
with 1 torch thread, and the subscriber runs on core 1. Throughput is generated
tokens per second of the whole `generate` call, probes off vs on, interleaved; each
round's slowdown compares its own off and on runs (seconds apart, so they share the VM's
drift), and the report gives the median of those (with a 90 % bootstrap interval) next to
the ratio of the medians. `--engines eager compiled`: one engine after the other, vLLM's default
compiled mode (Dynamo + Inductor, no `enforce_eager`) beside the eager one, each with probes off and
on, and each row's throughput against the eager engine's without probes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
from _stats import bootstrap_median

DRAIN = textwrap.dedent("""
    import os, sys, probe
    os.sched_setaffinity(0, {int(sys.argv[2])})
    while True:
        sub = probe.Subscriber(sys.argv[1])
        for cap in sub:
            pass
        sub.close()
""")


def build(path: str) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from probebus.models import DEFAULT_MODEL_DIR

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=8192, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR).save_pretrained(path)


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, 8192, (ARGS.prompt,), generator=g).tolist() for _ in range(batch)]


def bench_vllm(path: str, endpoint: str, engine: str = "eager") -> dict[int, dict[str, list[float]]]:
    """`engine`: "eager" (enforce_eager), "compiled" (vLLM's default mode, with the extension's taps), or
    "compiled-plain" (the default mode without the extension: no taps at all, probes off only)."""
    import vllm

    import probe.vllm

    plain = engine == "compiled-plain"
    llm = vllm.LLM(model=path, dtype="float32", max_model_len=512, enforce_eager=engine == "eager", seed=0,
                   gpu_memory_utilization=0.15, enable_prefix_caching=False,
                   **({} if plain else probe.vllm.ENGINE_KWARGS))
    params = vllm.SamplingParams(max_tokens=ARGS.new_tokens, temperature=0, ignore_eos=True)
    out: dict[int, dict[str, list[float]]] = {}
    for batch in ARGS.batches:
        reqs = [{"prompt_token_ids": p} for p in prompts(batch)]
        llm.generate(reqs, params, use_tqdm=False)  # warm-up
        res: dict[str, list[float]] = {"off": [], "on": []}
        for rep in range(ARGS.repeats):
            for mode in ["off"] if plain else (["off", "on"] if rep % 2 == 0 else ["on", "off"]):
                session = probe.vllm.attach(llm, "layers.*.resid_post", endpoint=endpoint) if mode == "on" else None
                if session is not None:
                    session.wait_for_subscribers(1, timeout=30)
                t0 = time.perf_counter()
                llm.generate(reqs, params, use_tqdm=False)
                res[mode].append(batch * ARGS.new_tokens / (time.perf_counter() - t0))
                if session is not None:
                    stats = session.close()
                    assert stats.dropped == 0 and stats.captured == stats.published
                    time.sleep(0.2)  # the drain reconnects for the next session
        out[batch] = res
    llm.llm_engine.engine_core.shutdown()
    return out


def bench_transformers(path: str, endpoint: str) -> dict[int, dict[str, list[float]]]:
    from transformers import AutoModelForCausalLM

    import probe

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rest = set(os.sched_getaffinity(0))
    out: dict[int, dict[str, list[float]]] = {}
    for batch in ARGS.batches:
        ids = torch.tensor(prompts(batch))
        kw = dict(max_new_tokens=ARGS.new_tokens, min_new_tokens=ARGS.new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids))
        res: dict[str, list[float]] = {"off": [], "on": []}
        with torch.no_grad():
            model.generate(ids, **kw)
            for rep in range(ARGS.repeats):
                for mode in (["off", "on"] if rep % 2 == 0 else ["on", "off"]):
                    session = probe.attach(model, "layers.*.resid_post", endpoint=endpoint) if mode == "on" else None
                    if session is not None:
                        session.wait_for_subscribers(1, timeout=30)
                    os.sched_setaffinity(0, {0})  # this thread only: the model's core
                    t0 = time.perf_counter()
                    model.generate(ids, **kw)
                    res[mode].append(batch * ARGS.new_tokens / (time.perf_counter() - t0))
                    os.sched_setaffinity(0, rest)
                    if session is not None:
                        session.close()
                        session.join(30)
        out[batch] = res
    return out


def report(name: str, results: dict[int, dict[str, list[float]]],
           base: dict[int, dict[str, list[float]]] | None = None) -> None:
    for batch, res in results.items():
        off = statistics.median(res["off"])
        if base is not None:
            ref = statistics.median(base[batch]["off"])
            on_ratio = f", on {statistics.median(res['on']) / ref:.2f}x" if res["on"] else ""
            print(f"  {name:12s} batch {batch}: against the eager engine without probes: probes off "
                  f"{off / ref:.2f}x{on_ratio}")
        if not res["on"]:
            print(f"  {name:12s} batch {batch}: {off:7.1f} tok/s [{min(res['off']):.1f}..{max(res['off']):.1f}]")
            continue
        on = statistics.median(res["on"])
        pairs = [100 * (1 - b / a) for a, b in zip(res["off"], res["on"], strict=True)]
        lo, hi = bootstrap_median(pairs)
        print(f"  {name:12s} batch {batch}: off {off:7.1f} tok/s [{min(res['off']):.1f}..{max(res['off']):.1f}]"
              f"  on {on:7.1f} tok/s [{min(res['on']):.1f}..{max(res['on']):.1f}]"
              f"  slowdown {100 * (1 - on / off):+5.1f} %, median of rounds {statistics.median(pairs):+5.1f} %"
              f" (90 % interval {lo:+.1f}..{hi:+.1f}; per-round {min(pairs):+.1f}..{max(pairs):+.1f} %)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 repeats, 12 tokens: a smoke run")
    ap.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="concurrent requests (default: 1 8)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (default: %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens per request (default: %(default)s)")
    ap.add_argument("--engines", nargs="+", choices=("eager", "compiled", "compiled-plain"), default=["eager"])
    ap.add_argument("--default-model", action="store_true", help="the shipped default model, not a random one")
    ap.add_argument("--skip-transformers", action="store_true")
    ARGS = ap.parse_args()
    if ARGS.quick:
        ARGS.repeats, ARGS.new_tokens = 2, 12
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    import vllm

    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, vllm {vllm.__version__}; "
          f"prompt {ARGS.prompt}, {ARGS.new_tokens} new tokens, {ARGS.repeats} interleaved rounds")
    folder = tempfile.mkdtemp(prefix="probebus-vllm-bench-")
    if ARGS.default_model:
        from probebus.models import DEFAULT_MODEL_DIR as model_dir
    else:
        build(folder)
        model_dir = folder
    endpoint = f"ipc://{folder}/bus"
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, endpoint, "1"])
    try:
        v = {e: bench_vllm(str(model_dir), endpoint, e) for e in ARGS.engines}
        t = None if ARGS.skip_transformers else bench_transformers(str(model_dir), endpoint)
    finally:
        drain.kill()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{'the default model' if ARGS.default_model else 'random Llama'}: decode throughput with probes "
          "off/on (layers.*.resid_post, a draining subscriber on core 1):")
    for e, res in v.items():
        report(f"vLLM {e}", res, v.get("eager"))
    if t is not None:
        report("transformers", t)
