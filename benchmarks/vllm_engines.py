"""What a compiled vLLM engine pays for probebus against a clean one: engines side by side in one process.

    .venv-vllm/bin/python benchmarks/vllm_engines.py                 # 3 + 3 engines, batch 1, ~8 min
    .venv-vllm/bin/python benchmarks/vllm_engines.py --engines 2 --generates 4 --batches 1 8

`vllm_paired_steps.py --compiled` compares a probed decode step with its neighbours in the same engine,
whose "off" steps still run the dormant taps (`probe/vllm/_compiled.py`: they are compiled into the
model at its start and cannot be taken out). The clean baseline, an engine started without the
extension, is another engine, and `vllm_overhead.py` runs such engines one after the other, whole calls
seconds apart. Here `--engines N` clean engines (no extension) and N tapped ones (`ENGINE_KWARGS`) are
started alternately in this process and their generates interleaved; every decode step is timed in its
worker (`execute_model` and `sample_tokens`, the worker thread's CPU time and minor page faults, as
`vllm_paired_steps.py` does). Modes: `clean`, `dormant` (a tapped engine, no session), `probed` (a tapped
engine with a session on `layers.*.resid_post` and a draining subscriber). Two engines of one kind differ
by their memory placement and their own compile: each engine's median is printed, and the ratio of pooled
medians comes with a 90 % bootstrap interval over engines' steps. Placement: this process runs on core 0 with one
OpenMP thread, the subscriber and the session's threads on core 1. (vLLM applies
VLLM_CPU_OMP_THREADS_BIND only in a worker process of its own: in this process its matmuls ran on two
OpenMP threads, one spinning on core 1 while the step lasted, and a step's time then counted its contention
with the subscriber and the session's threads.)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # read as the OpenMP runtime loads, with torch: before the imports below
from vllm_overhead import DRAIN, prompts  # noqa: E402
from vllm_paired_steps import StepClock, in_process_on_one_core  # noqa: E402


def ratio_interval(steps: list[float], base: list[float], n: int = 1000) -> tuple[float, float]:
    """A 90 % bootstrap interval of median(steps) / median(base)."""
    r = random.Random(0)
    ratios = sorted(statistics.median(r.choices(steps, k=len(steps))) / statistics.median(r.choices(base, k=len(base)))
                    for _ in range(n))
    return ratios[int(0.05 * n)], ratios[int(0.95 * n) - 1]


def main() -> None:
    import torch
    import vllm

    import probe.vllm
    from probe._endpoint import bind_address, remove_private
    from probebus.models import DEFAULT_MODEL_DIR

    endpoint, folder = bind_address(None, allow_remote=False)  # a session's default: a 0700 folder of its own
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, endpoint, "1"])
    try:
        engines: dict[str, object] = {}
        for i in range(ARGS.engines):  # alternated, so that neither kind gets the first (or last) placements
            for kind, extra in (("clean", {}), ("dormant", probe.vllm.ENGINE_KWARGS)):
                engines[f"{kind}{i}"] = vllm.LLM(
                    model=str(DEFAULT_MODEL_DIR), dtype="float32", max_model_len=512, seed=0,
                    kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False, **extra)
        print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, vllm {vllm.__version__}; the default "
              f"model, vLLM's default compiled mode, prompt {ARGS.prompt}, {ARGS.new_tokens} new tokens, greedy; "
              f"{ARGS.engines} clean and {ARGS.engines} tapped engines in one process, {ARGS.generates} generates "
              "per engine and mode")
        params = vllm.SamplingParams(max_tokens=ARGS.new_tokens, temperature=0, ignore_eos=True)
        for batch in ARGS.batches:
            reqs = [{"prompt_token_ids": p} for p in prompts(batch)]
            clocks = {name: StepClock(llm.llm_engine.model_executor.driver_worker.worker, batch)  # type: ignore
                      for name, llm in engines.items()}
            runs = list(engines) + [f"probed{i}" for i in range(ARGS.engines)]
            steps: dict[str, list[float]] = {r: [] for r in runs}
            faults: dict[str, list[int]] = {r: [] for r in runs}  # minor page faults a step
            for llm in engines.values():
                llm.generate(reqs, params, use_tqdm=False)  # type: ignore[attr-defined]  # warm-up
            for g in range(ARGS.generates):
                for run in runs[g % len(runs):] + runs[: g % len(runs)]:
                    name = run.replace("probed", "dormant")
                    llm, clock = engines[name], clocks[name]
                    session = None
                    if run.startswith("probed"):
                        session = probe.vllm.attach(llm, "layers.*.resid_post", endpoint=endpoint)
                        session.wait_for_subscribers(1, timeout=30)
                    clock.start(lambda on: None, True)
                    llm.generate(reqs, params, use_tqdm=False)  # type: ignore[attr-defined]
                    clock.switch = None
                    steps[run] += [cpu for _, _, cpu, _ in clock.steps]
                    faults[run] += [f for _, _, _, f in clock.steps]
                    if session is not None:
                        stats = session.close()
                        assert stats.dropped == 0 and stats.captured == stats.published
                        time.sleep(0.2)  # the drain reconnects for the next session
            for clock in clocks.values():
                clock.restore()
            pooled = {kind: sum((v for r, v in steps.items() if r.startswith(kind)), []) for kind in
                      ("clean", "dormant", "probed")}
            base = statistics.median(pooled["clean"])
            print(f"batch {batch}: a decode step, worker thread CPU, median")
            for kind, v in pooled.items():
                each = ", ".join(f"{1e3 * statistics.median(steps[f'{kind}{i}']):.3f}" for i in range(ARGS.engines))
                fault = ", ".join(f"{statistics.mean(faults[f'{kind}{i}']):.1f}" for i in range(ARGS.engines))
                lo, hi = ratio_interval(v, pooled["clean"])
                print(f"  {kind:8s} {len(v):5d} steps  {1e3 * statistics.median(v):.3f} ms  x clean "
                      f"{statistics.median(v) / base:.4f} [{lo:.4f}..{hi:.4f}]   per engine: {each} ms, "
                      f"minor page faults a step {fault}")
            lo, hi = ratio_interval(pooled["probed"], pooled["dormant"])
            mid = statistics.median(pooled["probed"]) / statistics.median(pooled["dormant"])
            print(f"  probed x dormant (the same engines) {mid:.4f} [{lo:.4f}..{hi:.4f}]")
        for llm in engines.values():
            llm.llm_engine.engine_core.shutdown()  # type: ignore[attr-defined]
    finally:
        drain.kill()
        remove_private(folder)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=3, help="clean engines, and as many tapped ones (default: 3)")
    ap.add_argument("--generates", type=int, default=6, help="generate calls per engine and mode (default: 6)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ARGS = ap.parse_args()
    import vllm_overhead

    vllm_overhead.ARGS = ARGS  # its prompts() reads the prompt length from there
    in_process_on_one_core()
    main()
