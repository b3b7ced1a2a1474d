"""probebus inside a real vLLM engine (CPU build): identity, fidelity against transformers, detach.

Runs only where vLLM is installed (`.ci/run` builds its own environment for it:
vLLM pins an older transformers than the main suite uses). One engine per module.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

vllm = pytest.importorskip("vllm")

import probe  # noqa: E402
import probe.vllm  # noqa: E402
from probe.vllm._common import SITES_ENV  # noqa: E402
from probebus.models import DEFAULT_MODEL_DIR  # noqa: E402

MODEL = str(DEFAULT_MODEL_DIR)
SITES = ["layers.*.resid_pre", "layers.*.resid_post", "final_norm"]


@pytest.fixture(scope="module")
def llm():
    engine = vllm.LLM(model=MODEL, dtype="float32", max_model_len=512, enforce_eager=True, seed=0,
                      gpu_memory_utilization=0.15, enable_prefix_caching=True, **probe.vllm.ENGINE_KWARGS)
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def _record(llm, prompts, max_tokens: int, sites=SITES):
    """Returns the outputs, the captures and the request map *the subscriber* received over the bus (its info
    at join plus the entries of each request as it started), checked against the worker's own map."""
    params = vllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with probe.vllm.attach(llm, sites) as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1, timeout=30)
        outs = llm.generate(prompts, params, use_tqdm=False)
        worker = session.info
        deferred = llm.collective_rpc("probebus_stats")[0]["deferred_steps"]
    caps = [c for c in sub.iter(idle_timeout=30)]
    assert sub.ended and sub.stats.missed == 0 and sub.stats.malformed == 0
    stats = session.stats
    assert stats.captured == stats.published == len(caps) and stats.dropped == 0
    assert sub.info.backend == "vllm" and sub.info.recomputed == worker["recomputed"]
    received = {str(k): v for k, v in sub.info.requests.items()}
    assert received == worker["requests"] and len(received) == len(prompts)
    assert {int(s) for c in caps for s in c.seq_ids.tolist()} <= set(sub.info.requests)
    assert sorted(e["seq_id"] for e in sub.take_requests()) == sorted(sub.info.requests)
    sub.close()
    return outs, caps, {"requests": received, "deferred_steps": deferred}


def _seq_of(info: dict, request_id: str) -> dict:
    (entry,) = [v for v in info["requests"].values() if v["request_id"] == request_id]
    return entry


def _check_against_transformers(hf, outs, caps, info) -> int:
    """Every published row equals transformers' hidden state at that token; returns rows checked."""
    n_layers = hf.config.num_hidden_layers
    checked = 0
    for o in outs:
        entry = _seq_of(info, o.request_id)
        full = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        with torch.no_grad():
            hs = hf(torch.tensor([full]), output_hidden_states=True).hidden_states
        seen: dict[str, list[int]] = collections.defaultdict(list)
        for c in caps:
            m = c.seq_ids == entry["seq_id"]
            if not m.any():
                continue
            pos = c.positions[m]
            seen[c.site] += pos.tolist()
            assert c.token_ids[m].tolist() == [full[p] for p in pos.tolist()]
            want = "prefill" if c.phase == "prefill" else "decode"
            assert all((p < len(o.prompt_token_ids)) == (want == "prefill") for p in pos.tolist())
            if c.site == "final_norm":
                ref = hs[-1][0, pos]
            else:
                i = int(c.site.split(".")[1])
                if c.site.endswith("resid_post") and i == n_layers - 1:
                    ref = None  # transformers' last hidden state is after the final norm
                else:
                    ref = hs[i + (1 if c.site.endswith("resid_post") else 0)][0, pos]
            if ref is not None:
                torch.testing.assert_close(c.tensor[m], ref, atol=1e-4, rtol=1e-4)
                checked += int(m.sum())
        # the last sampled token is never fed back, so the stream ends one before the text does
        expect = list(range(entry["first_position"], len(full) - 1))
        for site, positions in seen.items():
            assert sorted(positions) == expect, (site, positions)
    return checked


def test_sites_are_listed(llm) -> None:
    sites = probe.vllm.list_sites(llm)
    assert sites[0] == "embed" and sites[-1] == "final_norm" and "layers.7.mlp_out" in sites
    with pytest.raises(Exception, match="logits"):
        probe.vllm.attach(llm, "logits")


def test_mixed_batch_matches_transformers_per_token(llm, hf) -> None:
    tok = _tokenizer()
    shared = "import os\nimport sys\n\n\ndef main(argv):\n    parser = None\n"
    texts = ["def parse(text):\n    return", shared + "    return 0\n", "class A:\n    def __init__(self):",
             shared + "    print(argv)\n", "x = 1\n" * 20]
    prompts = [{"prompt_token_ids": tok(t)["input_ids"]} for t in texts]
    outs, caps, info = _record(llm, prompts, max_tokens=10)
    assert len(info["requests"]) == len(texts)
    assert {c.phase for c in caps} == {"prefill", "decode"}
    assert info["deferred_steps"] > 0, "decode steps captured at their end are covered"
    assert _check_against_transformers(hf, outs, caps, info) > 1000


def test_prefix_cached_positions_are_absent_not_invented(llm, hf) -> None:
    tok = _tokenizer()
    block = llm.llm_engine.vllm_config.cache_config.block_size
    long = tok("\n".join(f"value_{i} = compute({i}, {i * 7})" for i in range(200)))["input_ids"]
    first = long[: 2 * block + 5]
    second = long[: 2 * block + 17]  # shares two full blocks with the first request
    _record(llm, [{"prompt_token_ids": first}], max_tokens=2)
    outs, caps, info = _record(llm, [{"prompt_token_ids": second}], max_tokens=4)
    entry = _seq_of(info, outs[0].request_id)
    assert entry["first_position"] == 2 * block, "the cached prefix is declared by where the stream starts"
    assert entry["cached_positions"] == 2 * block and entry["joined"] is False  # a cache hit, not a late start
    assert min(int(c.positions.min()) for c in caps) == 2 * block
    _check_against_transformers(hf, outs, caps, info)


def test_detach_removes_every_hook_and_reattach_works(llm) -> None:
    params = vllm.SamplingParams(max_tokens=3, temperature=0)
    before = llm.generate(["def f(x):"], params, use_tqdm=False)[0].outputs[0].token_ids
    outs, caps, _ = _record(llm, ["def f(x):"], max_tokens=3, sites="layers.0.mlp_out")
    assert list(outs[0].outputs[0].token_ids) == list(before), "observing changes nothing"
    assert len(caps) == 3 and all(c.site == "layers.0.mlp_out" for c in caps)
    assert probe.vllm.attach(llm, "embed").close().captured == 0
    assert llm.collective_rpc("probebus_hook_count") == [0]


def test_pause_takes_every_hook_off_and_resume_puts_them_back(llm) -> None:
    params = vllm.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with probe.vllm.attach(llm, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1, timeout=30)
        llm.generate(["def f(x):"], params, use_tqdm=False)
        n_before = session.stats.captured
        session.pause()
        assert session.paused and llm.collective_rpc("probebus_hook_count") == [0]
        assert session.stats.queued == 0, "what was held went out at the pause"
        llm.generate(["import os\n"], params, use_tqdm=False)
        assert session.stats.captured == n_before, "nothing is captured while paused"
        session.resume()
        assert not session.paused and llm.collective_rpc("probebus_hook_count")[0] > 0
        llm.generate(["class A:"], params, use_tqdm=False)
    caps = list(sub.iter(idle_timeout=30))
    assert sub.ended and session.stats.captured == len(caps) == 2 * n_before
    assert n_before == 8 * 4, "8 layers x (a prefill capture + 3 decode steps)"
    assert len({int(c.seq_ids[0]) for c in caps}) == 2, "the paused request published nothing"
    sub.close()


def test_existing_subscribers_work_unchanged(llm, tmp_path) -> None:
    import exporters

    params = vllm.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with probe.vllm.attach(llm, "layers.*.resid_post") as session:
        with exporters.ArrowRecorder(session.endpoint, tmp_path / "rec"):
            session.wait_for_subscribers(1, timeout=30)
            llm.generate(["def a():", "import re\n"], params, use_tqdm=False)
            outs = llm.generate(["def b():", "import os\n"], params, use_tqdm=False)
    rec = exporters.read_recording(tmp_path / "rec")
    assert rec.num_rows == 2 * 8 * (2 * 4 + 2 * 5), "8 layers x (2 prompts of 4 tokens + 5 decode steps of 2 rows)"
    # Which vLLM request each recorded sequence is (_requests.jsonl, written as the requests started).
    first = min(seq for _, seq in rec.sequences())
    assert [rec.request(first + 2 + i)["request_id"] for i in range(2)] == [o.request_id for o in outs]
    assert [rec.request(seq)["seq_id"] for _, seq in rec.sequences()] == [seq for _, seq in rec.sequences()]
    assert exporters.summarize_recording(tmp_path / "rec")["requests"] == 4  # `probebus inspect` says so too


def test_a_curve_session_admits_only_its_listed_clients(llm) -> None:
    import zmq

    server_pub, server_sec = zmq.curve_keypair()
    me = zmq.curve_keypair()
    params = vllm.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with probe.vllm.attach(llm, "layers.0.resid_post", endpoint="tcp://127.0.0.1:*", curve_secret_key=server_sec,
                           curve_clients=[me[0]]) as session:
        stranger = probe.Subscriber(session.endpoint, curve_server_key=server_pub)
        sub = probe.Subscriber(session.endpoint, curve_server_key=server_pub, curve_client_key=me)
        session.wait_for_subscribers(1, timeout=30)
        llm.generate(["def f(x):"], params, use_tqdm=False)
    caps = list(sub.iter(idle_timeout=30))
    assert sub.ended and [c.phase for c in caps] == ["prefill", "decode", "decode"]
    assert list(stranger.iter(idle_timeout=0.5)) == [] and stranger.stats.received == 0


@pytest.fixture(scope="module")
def compiled_llm():
    """vLLM's default mode (no enforce_eager): the model compiled by Dynamo + Inductor at start-up, with the
    extension's dormant taps in it (`probe/vllm/_compiled.py`) for the sites these tests attach to (`SITES_ENV`;
    unset, every site). A step of at most 32 tokens chunks prefills."""
    before = os.environ.get(SITES_ENV)
    os.environ[SITES_ENV] = ",".join(SITES + ["layers.0.mlp_out"])  # the engine's processes inherit it
    try:
        engine = vllm.LLM(model=MODEL, dtype="float32", max_model_len=512, seed=0, gpu_memory_utilization=0.15,
                          enable_prefix_caching=True, max_num_batched_tokens=32, max_num_seqs=8,
                          **probe.vllm.ENGINE_KWARGS)
    finally:
        if before is None:
            del os.environ[SITES_ENV]
        else:
            os.environ[SITES_ENV] = before
    assert int(engine.llm_engine.vllm_config.compilation_config.mode) != 0, "the engine compiles its model"
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_a_site_a_compiled_engine_has_no_tap_for_is_refused_by_name(compiled_llm) -> None:
    """Taps go into the compiled model at its start: a site left out of them is an error naming the setting."""
    with pytest.raises(Exception, match=f"no taps for layers.1.mlp_out.*{SITES_ENV}"):
        probe.vllm.attach(compiled_llm, "layers.1.mlp_out")
    with probe.vllm.attach(compiled_llm, "layers.0.mlp_out") as session:  # the engine is fine and attachable
        assert session.sites == ["layers.0.mlp_out"]


def test_a_compiled_engine_publishes_what_eager_computes(compiled_llm, hf) -> None:
    """Prefill (chunked) and decode rows of a mixed batch, then a request whose prefix is cached: each equals
    transformers' hidden state within 1e-4; nothing is captured while paused, and attach needed no enforce_eager."""
    tok = _tokenizer()
    shared = "import os\nimport sys\n\n\ndef main(argv):\n    parser = None\n"
    texts = ["def parse(text):\n    return", shared + "    return 0\n", shared + "    print(argv)\n", "x = 1\n" * 20]
    prompts = [{"prompt_token_ids": tok(t)["input_ids"]} for t in texts]
    outs, caps, info = _record(compiled_llm, prompts, max_tokens=8)
    assert {c.phase for c in caps} == {"prefill", "decode"}
    longest = _seq_of(info, outs[-1].request_id)["seq_id"]  # 81 prompt tokens: at least 3 steps of 32
    assert len({c.step for c in caps if c.phase == "prefill" and (c.seq_ids == longest).any()}) >= 3
    assert _check_against_transformers(hf, outs, caps, info) > 1000

    block = compiled_llm.llm_engine.vllm_config.cache_config.block_size
    long = tok("\n".join(f"item_{i} = fetch({i}, {i * 3})" for i in range(200)))["input_ids"]
    _record(compiled_llm, [{"prompt_token_ids": long[: 2 * block + 3]}], max_tokens=2)
    outs, caps, info = _record(compiled_llm, [{"prompt_token_ids": long[: 2 * block + 11]}], max_tokens=4)
    assert _seq_of(info, outs[0].request_id)["first_position"] == 2 * block, "the cached prefix is not recomputed"
    _check_against_transformers(hf, outs, caps, info)

    params = vllm.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with probe.vllm.attach(compiled_llm, "layers.0.mlp_out") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1, timeout=30)
        compiled_llm.generate(["def f(x):"], params, use_tqdm=False)
        session.pause()
        compiled_llm.generate(["import os\n"], params, use_tqdm=False)
        session.resume()
        compiled_llm.generate(["class A:"], params, use_tqdm=False)
    caps = list(sub.iter(idle_timeout=30))
    assert sub.ended and len(caps) == session.stats.captured == 2 * 3, "2 requests x (a prefill + 2 decode steps)"
    assert len({int(c.seq_ids[0]) for c in caps}) == 2, "the paused request published nothing"
    sub.close()


def test_a_compiled_engine_without_the_extension_is_refused_by_name(monkeypatch) -> None:
    """Taps added after vLLM compiled the model would never run: a compiled engine started without the extension
    (here `WorkerExtension.probebus_attach` sent in by hand, which vLLM sends only with insecure serialization on)
    is an error naming the fix, not a silent session. Dynamo's trace without Inductor (backend "eager")."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    engine = vllm.LLM(model=MODEL, dtype="float32", max_model_len=512, seed=0, gpu_memory_utilization=0.15,
                      compilation_config={"backend": "eager"})
    try:
        with pytest.raises(Exception, match="without probebus's taps.*ENGINE_KWARGS.*enforce_eager=True"):
            engine.collective_rpc(probe.vllm.WorkerExtension.probebus_attach,
                                  args=(["layers.0.resid_post"], None, "complete", "norun", 1 << 20, 5.0, MODEL))
    finally:
        engine.llm_engine.engine_core.shutdown()


def test_a_request_running_at_attach_is_marked_joined_not_cached(llm) -> None:
    """A request already running when the session attaches starts its stream past 0 too, but not because of the
    prefix cache: its entry says `joined` (cached_positions 0), a request started after the attach does not, and
    `first_position` is where each stream starts. They used to be told apart by nothing."""
    tok = _tokenizer()
    engine = llm.llm_engine
    params = vllm.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    early = tok("def early(a, b):\n    return")["input_ids"]
    engine.add_request("early", {"prompt_token_ids": early}, params)
    for _ in range(3):  # its prefill and two decode steps, unobserved
        engine.step()
    with probe.vllm.attach(llm, "final_norm") as session:
        sub = probe.Subscriber(session.endpoint)
        session.wait_for_subscribers(1, timeout=30)
        engine.add_request("late", {"prompt_token_ids": tok("class Late:\n    pass")["input_ids"]}, params)
        while engine.has_unfinished_requests():
            engine.step()
    caps = list(sub.iter(idle_timeout=30))
    entries = {e["request_id"]: e for e in sub.info.requests.values()}
    sub.close()
    assert entries["early"]["joined"] is True and entries["early"]["cached_positions"] == 0
    assert entries["early"]["first_position"] > len(early)  # its prefill (and a decode or two) ran before the attach
    assert entries["late"]["joined"] is False and entries["late"]["first_position"] == 0
    first = {}
    for c in caps:
        for s, p in zip(c.seq_ids.tolist(), c.positions.tolist(), strict=True):
            first[s] = min(p, first.get(s, p))
    assert first == {e["seq_id"]: e["first_position"] for e in entries.values()}
