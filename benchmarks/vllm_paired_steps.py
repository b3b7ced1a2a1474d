"""What a probe costs one vLLM decode step, measured step against neighbouring step.

    .venv-vllm/bin/python benchmarks/vllm_paired_steps.py            # batch 1 and 8, 12 generates per mode
    .venv-vllm/bin/python benchmarks/vllm_paired_steps.py --quick
    .venv-vllm/bin/python benchmarks/vllm_paired_steps.py --compiled --default-model --modes a/a probebus

`vllm_overhead.py` compares whole `generate` calls seconds apart; on this shared VM their
per-round spread (20-40 points) hides a 3 % effect. Here, as `paired_steps.py` does for
transformers, the probe is switched off and on between the decode steps of one `generate`
(`pause()`: every hook off the model, so an "off" step runs as plain vLLM) and each "on"
step is compared with the mean of its two "off" neighbours. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the worker's step can be timed and the switch
made between steps: a step is the worker's `execute_model` and `sample_tokens` (the forward,
with the probe's step identity, hooks and step end inside it, and the sampling). The switch
happens between the timestamps, so it is not counted. `a/a` switches nothing: the method's
own bias. `probebus-hooks` copies every capture inside its hook (no decode step deferred to
its end, `probe/vllm/_defer.py`): what the deferral gains, in the same run. vLLM's worker
computes on core 0: this process runs there with one OpenMP thread (vLLM applies
VLLM_CPU_OMP_THREADS_BIND only in a worker process of its own: until 2026-12-07 this process's
matmuls ran two OpenMP threads, one spinning on core 1); the draining subscriber and the
session's threads (ZeroMQ's I/O thread, the control thread) run on the other cores.
The engine's own work between steps (scheduling, output processing) is untouched by a
probe, so the cost is also printed as a share of the engine's cycle (one decode step's
start to the next, in the a/a runs): what vLLM's throughput loses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # read as the OpenMP runtime loads, with torch: before the imports below
from paired_steps import minor_faults, report  # noqa: E402
from vllm_overhead import DRAIN, build, prompts  # noqa: E402

MODES = ["a/a", "probebus", "probebus-hooks"]


def in_process_on_one_core() -> None:
    """The engine in this process (so that its worker's steps can be timed), on the first core with one OpenMP
    thread (set with the imports, at the top); the session's threads and the subscriber on the others."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("needs 2 cores: the engine on core 0, the subscriber and the session's threads on the others")
    os.sched_setaffinity(0, {cores[0]})  # the session puts its threads on the cores left (`spare_cpus`)


class StepClock:
    """Times each step of the in-process worker (`execute_model` to `sample_tokens`, or to `execute_model`'s end
    when it samples itself) and switches the probe for the next decode step between the timestamps."""

    def __init__(self, worker, batch: int) -> None:
        self.worker, self.batch = worker, batch
        self.switch = None
        self.state = True
        self.steps: list[tuple[bool, float, float, int]] = []  # (probed, wall s, cpu s, minor faults)
        self.starts: list[float] = []  # each decode step's start: the engine's cycle, step to step
        self._t: tuple[float, float, int] | None = None
        self._decode = False
        self._orig = (worker.execute_model, worker.sample_tokens)
        worker.execute_model, worker.sample_tokens = self._execute, self._sample

    def restore(self) -> None:
        """Give the worker its own methods back."""
        self.worker.execute_model, self.worker.sample_tokens = self._orig

    def start(self, switch, first_on: bool) -> None:
        self.switch, self.state, self.steps, self.starts = switch, first_on, [], []
        switch(first_on)

    def _execute(self, scheduler_output, *args, **kwargs):
        self._decode = scheduler_output.total_num_scheduled_tokens == self.batch  # every request decoding
        self._t = (time.perf_counter(), time.thread_time(), minor_faults())
        out = self._orig[0](scheduler_output, *args, **kwargs)
        if out is not None:
            self._ended()
        return out

    def _sample(self, *args, **kwargs):
        out = self._orig[1](*args, **kwargs)
        self._ended()
        return out

    def _ended(self) -> None:
        if self._t is None:
            return
        wall, cpu = time.perf_counter() - self._t[0], time.thread_time() - self._t[1]
        faults = minor_faults() - self._t[2]
        self._t = None
        if self._decode and self.switch is not None:
            self.steps.append((self.state, wall, cpu, faults))
            self.starts.append(time.perf_counter() - wall)
            self.state = not self.state
            self.switch(self.state)


def main() -> None:
    import torch
    import vllm

    import probe.vllm

    folder = tempfile.mkdtemp(prefix="probebus-vllm-paired-")
    model = folder
    if ARGS.default_model:
        from probebus.models import DEFAULT_MODEL_DIR

        model = str(DEFAULT_MODEL_DIR)
    else:
        build(folder)
    endpoint = f"ipc://{folder}/bus"
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, endpoint, "1"])
    try:
        llm = vllm.LLM(model=model, dtype="float32", max_model_len=512, enforce_eager=not ARGS.compiled, seed=0,
                       gpu_memory_utilization=0.15, enable_prefix_caching=False, **probe.vllm.ENGINE_KWARGS)
        worker = llm.llm_engine.model_executor.driver_worker.worker
        params = vllm.SamplingParams(max_tokens=ARGS.new_tokens, temperature=0, ignore_eos=True)
        what = "the default model" if ARGS.default_model else "random Llama (hidden 512, 8 layers)"
        mode = "compiled (vLLM's default mode)" if ARGS.compiled else "enforce_eager"
        print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, vllm {vllm.__version__}; {what}, {mode}, "
              f"prompt {ARGS.prompt}, {ARGS.new_tokens} new tokens, greedy, sites "
              f"layers.*.resid_post, a draining subscriber on core 1; {ARGS.generates} generates per mode, the "
              "probe off and on every decode step")
        for batch in ARGS.batches:
            clock = StepClock(worker, batch)
            reqs = [{"prompt_token_ids": p} for p in prompts(batch)]
            llm.generate(reqs, params, use_tqdm=False)  # warm-up
            steps: dict[str, list[list]] = {m: [] for m in ARGS.modes}
            cycles: list[float] = []  # start to start of consecutive decode steps, unprobed (a/a)
            for g in range(ARGS.generates):
                for mode in ARGS.modes[g % len(ARGS.modes):] + ARGS.modes[: g % len(ARGS.modes)]:
                    session = probe.vllm.attach(llm, "layers.*.resid_post", endpoint=endpoint)
                    session.wait_for_subscribers(1, timeout=30)
                    vp = worker._probebus
                    if mode == "probebus-hooks":
                        vp._defer.enabled = False  # every capture copied in its hook, as before deferral

                    def switch(on: bool, vp=vp, mode=mode) -> None:
                        if mode != "a/a":
                            vp.resume() if on else vp.pause(flush=False)  # held steps wait, as they would
                    clock.start(switch, g % 2 == 0)
                    llm.generate(reqs, params, use_tqdm=False)
                    clock.switch = None
                    stats = session.close()
                    assert stats.dropped == 0 and stats.captured == stats.published
                    steps[mode].append(clock.steps)
                    if mode == "a/a":
                        cycles += [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)]
                    time.sleep(0.2)  # the drain reconnects for the next session
            clock.restore()
            cycle = statistics.median(cycles) if cycles else float("nan")
            report(batch, steps, cycle)
            print(f"  the engine's cycle (one decode step's start to the next, unprobed): {1e3 * cycle:.2f} ms")
        llm.llm_engine.engine_core.shutdown()
    finally:
        drain.kill()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run")
    ap.add_argument("--compiled", action="store_true", help="vLLM's default compiled mode (no enforce_eager)")
    ap.add_argument("--default-model", action="store_true", help="the shipped default model, not a random one")
    ap.add_argument("--generates", type=int, default=12, help="generate calls per mode and batch (default: 12)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ARGS = ap.parse_args()
    if ARGS.quick:
        ARGS.generates, ARGS.new_tokens = 2, 12
    import vllm_overhead

    vllm_overhead.ARGS = ARGS  # its prompts() reads the prompt length from there
    in_process_on_one_core()
    main()
