"""Tensor parallelism and preemption inside a real vLLM engine (CPU build, TP=2 on two cores), eager and compiled.

Every tensor-parallel rank holds the same residual stream after the all-reduce: only
rank 0 publishes. A KV cache of 6 blocks makes the scheduler preempt and recompute
requests: positions already published are skipped and counted, never duplicated.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

vllm = pytest.importorskip("vllm")

import probe  # noqa: E402
import probe.vllm  # noqa: E402
from probebus.models import DEFAULT_MODEL_DIR  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tp-model")
    torch.manual_seed(0)  # 4 heads, 2 KV heads: divisible by TP=2
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=8192, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["eager", "compiled"])
def llm(model_dir, request):
    """Eager, and vLLM's default compiled mode (each rank's model compiled with probebus's dormant taps in it)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("TP=2 on the CPU backend needs two cores")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (one NUMA node here)
    engine = vllm.LLM(model=model_dir, dtype="float32", max_model_len=512, enforce_eager=request.param == "eager",
                      seed=0, tensor_parallel_size=2, gpu_memory_utilization=0.1, num_gpu_blocks_override=6,
                      enable_prefix_caching=False, **probe.vllm.ENGINE_KWARGS)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_tp2_publishes_once_preemption_never_duplicates_and_rows_match(llm, model_dir) -> None:
    from transformers import AutoModelForCausalLM

    base = list(range(10, 1000, 3))
    prompts = [{"prompt_token_ids": base[i * 7: i * 7 + 150]} for i in range(6)]  # 6 x 270 tokens > 6 x 128 slots
    params = vllm.SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    with probe.vllm.attach(llm, ["layers.1.resid_post", "final_norm"]) as session:
        assert [w["publishing"] for w in session.workers] == [True, False]
        assert [w["tp_rank"] for w in session.workers] == [0, 1]
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1, timeout=30)
        outs = llm.generate(prompts, params, use_tqdm=False)
        info = session.info
    caps = list(sub.iter(idle_timeout=30))
    assert sub.ended and sub.stats.missed == 0 and session.stats.captured == len(caps)
    assert info["recomputed"] > 0, "the 6-block cache must have preempted a request"
    assert sub.info.recomputed == info["recomputed"], "the count reaches subscribers with the request entries"
    assert {str(k): v for k, v in sub.info.requests.items()} == info["requests"]
    rows = collections.Counter()
    for c in caps:
        rows.update((c.site, s, p) for s, p in zip(c.seq_ids.tolist(), c.positions.tolist(), strict=True))
    assert max(rows.values()) == 1, "a recomputed position was published twice"
    assert len(rows) == 2 * 6 * (150 + 119)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seq = {v["request_id"]: v["seq_id"] for v in info["requests"].values()}
    for o in outs[:2]:
        full = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        with torch.no_grad():
            hs = hf(torch.tensor([full]), output_hidden_states=True).hidden_states
        for c in caps:
            m = c.seq_ids == seq[o.request_id]
            if m.any():
                ref = hs[2] if c.site == "layers.1.resid_post" else hs[-1]
                torch.testing.assert_close(c.tensor[m], ref[0, c.positions[m]], atol=1e-4, rtol=1e-4)
