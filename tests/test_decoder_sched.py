"""The scheduler's parts: the cost curve's cache, the stopping rule, the incremental n-gram index, the oracle bound."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from models import EOS, PAD, build, left_padded

from decoder import NgramDrafter, SpeculativeDecoder
from decoder.drafters import Eagle3Config, Eagle3Drafter
from decoder.loop import oracle_bound, simulated_seconds
from decoder.schedule import CostModel, DraftPlan, PathChoice


def test_cost_curve_is_measured_once_cached_and_refreshable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PROBEBUS_CACHE_DIR", str(tmp_path))
    model = build("llama", layers=2)
    cost = CostModel.for_target(model)
    cost.ensure(2, 3)
    files = list(tmp_path.glob("decoder-cost-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["batches"]["2"]["verify"]
    curve = cost.curve(2, 3)
    assert len(curve) == 4 and all(a <= b for a, b in zip(curve, curve[1:], strict=False))

    def no_measuring(*a: object, **k: object) -> dict:
        raise AssertionError("the cached curve should have been used")

    monkeypatch.setattr(CostModel, "measure", staticmethod(no_measuring))
    again = CostModel.for_target(model)
    again.ensure(2, 3)  # from the cache
    assert again.curve(2, 3, frozen=True) == cost.curve(2, 3, frozen=True)
    with pytest.raises(AssertionError, match="cached curve"):
        CostModel.for_target(model, refresh=True).ensure(2, 3)
    # online refinement scales the live curve, never the frozen one a seeded call uses
    frozen = again.curve(2, 3, frozen=True)
    for _ in range(20):
        again.observe_verify(2, 1, 10 * again.verify(2, 1, frozen=True))
    assert again.curve(2, 3)[0] > 2 * frozen[0] and again.curve(2, 3, frozen=True) == frozen
    model.config._name_or_path = "/somewhere/else/a-copy"  # the same model loaded from another folder: same curve
    CostModel.for_target(model).ensure(2, 3)
    files[0].write_text("{broken")
    with pytest.raises(AssertionError, match="cached curve"):  # a corrupt cache is measured again
        CostModel.for_target(model).ensure(2, 3)


def test_a_first_curve_times_four_lengths_and_a_refresh_times_all(tmp_path: Path, monkeypatch) -> None:
    """A machine's first call must not pay for a whole curve (it cost 0.64 s of a 0.96 s first call): it times 1,
    2, the middle and k_max + 1 and interpolates; refresh=True (the benchmark, --refresh-cost) times every
    length."""
    from decoder.schedule._cost import _interpolated, quick_lengths

    monkeypatch.setenv("PROBEBUS_CACHE_DIR", str(tmp_path))
    assert quick_lengths(8) == [1, 2, 5, 9] and quick_lengths(0) == [1]
    assert _interpolated({1: 1.0, 2: 2.0, 5: 5.0, 9: 1.0}, 9) == [1.0, 2.0, 3.0, 4.0, 5.0, 4.0, 3.0, 2.0, 1.0]
    model = build("llama", layers=2)
    timed: list[int] = []
    real = model.forward

    def forward(input_ids=None, **kw):
        timed.append(input_ids.shape[1])
        return real(input_ids=input_ids, **kw)

    model.forward = forward
    quick = CostModel.for_target(model)
    quick.ensure(1, 8, capturing=torch.no_grad)
    assert sorted(set(timed) - {32}) == [1, 2, 5, 9]  # (32: the context each measurement starts from)
    assert timed.count(9) == 3 + 3 and timed.count(5) == 3  # 3 each, and 1 and 9 again with probes publishing
    timed.clear()
    full = CostModel.for_target(model, refresh=True)
    full.ensure(1, 8, capturing=torch.no_grad)
    assert sorted(set(timed) - {32}) == list(range(1, 10)) and timed.count(5) == 2 * 6
    assert len(quick.curve(1, 8)) == len(full.curve(1, 8)) == 9


def test_stopping_rule_weighs_tokens_against_time() -> None:
    cost = [1.0, 1.1, 1.2, 1.3]  # seconds of verifying 1..4 tokens
    sure = [[0.0, 0.9, 1.7, 2.4]]  # prefix sums of P (row 0)
    plan = DraftPlan(3, cost, step_cost=0.05, rate=1.0, base=[[0.0]], caps=[3])
    assert plan.best(sure) == pytest.approx((1 + 2.4 - 1.3, 4))
    assert plan.best(None) == pytest.approx((1 - 1.0, 1))  # nothing drafted: a plain step
    dear = DraftPlan(3, [1.0, 3.0, 5.0, 7.0], step_cost=0.05, rate=1.0, base=[[0.0]], caps=[3])
    assert dear.best(sure)[1] == 1  # verifying costs more than the tokens it can bring
    assert plan.worth_another([[0.0, 0.9]], [0.9])
    assert not plan.worth_another([[0.0, 0.05]], [0.05])
    capped = DraftPlan(3, cost, step_cost=0.05, rate=1.0, base=[[0.0]], caps=[1])  # one token of budget left
    assert capped.best(sure)[1] == 2
    finished = DraftPlan(3, cost, step_cost=0.05, rate=1.0, base=[[0.0], [0.0]], caps=[-1, 3])
    assert finished.best([[0.0, 0.9, 1.7, 2.4], [0.0]])[1] == 1  # a finished row's drafts count for nothing


def test_incremental_ngram_index_matches_a_full_scan() -> None:
    def scan(tokens: list[int], k: int) -> list[int]:
        for n in range(min(3, len(tokens) - 1), 0, -1):
            tail = tokens[len(tokens) - n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []

    rng = random.Random(0)
    for _ in range(100):
        toks = [rng.randrange(5) for _ in range(rng.randrange(2, 40))]
        index = NgramDrafter().index(toks[:2])
        for i in range(2, len(toks) + 1):
            if i > 2:
                index.extend([toks[i - 1]])
            assert index.propose(4)[0] == scan(toks[:i], 4)


def test_oracle_bound_on_a_looping_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random weights loop, so in hindsight drafting wins; the bound is reported on the cost model's clock, and
    the same on a busy machine: there only the measured prefill grows (it once made `speedup` 1.188 < 1.2), so a
    prefill made 0.3 s slower (a stand-in for load, which a test cannot cause reliably) changes nothing checked."""
    model = build("llama", layers=8)
    ids, mask = left_padded([[5, 17, 33, 9, 40, 41], [40, 41, 42, 43, 44, 45, 46, 47, 48]])
    torch.manual_seed(3)
    eagle = Eagle3Drafter(Eagle3Config.for_target(model.config)).bind_target(model)
    flat = CostModel("test", {"2": {"verify": [1e-3] * 5, "verify_capturing": [1e-3] * 5, "step": 1e-5}}, adapt=False)
    with SpeculativeDecoder(model, "auto", model_drafter=eagle, k=4, cost=flat) as spec:
        res = oracle_bound(spec, ids, mask, max_new_tokens=24)
        out = spec.generate(ids, mask, max_new_tokens=24, pad_token_id=PAD)
        prefill = spec.prefill
        monkeypatch.setattr(spec, "prefill", lambda run: (time.sleep(0.3), prefill(run))[1])
        busy = oracle_bound(spec, ids, mask, max_new_tokens=24)
    assert res.tokens == busy.tokens == 48 and res.tau == busy.tau > 1.5
    assert res.decode_speedup == pytest.approx(busy.decode_speedup) and res.decode_speedup > 1.2
    assert 0 < res.prefill_seconds < res.seconds and busy.prefill_seconds >= 0.3
    assert res.speedup > 1.0 and busy.speedup > 1.0  # the measured prefill dilutes it, never reverses it
    assert sum(res.choices.values()) == res.row_rounds
    assert simulated_seconds(out.stats, flat) > 0


def test_calls_where_drafting_does_not_pay_run_as_plain_decoding(tmp_path: Path, monkeypatch) -> None:
    """On CPU plain decoding is the loop's own plain rounds (`loop_plain`: measured faster than `generate` there),
    elsewhere the target's own `generate` (the hand-over test runs both)."""
    monkeypatch.setenv("PROBEBUS_CACHE_DIR", str(tmp_path))
    model = build("llama", layers=2)
    ids, mask = left_padded([[5, 6, 7, 8], [9, 10]])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              eos_token_id=EOS, pad_token_id=PAD)
    spec = SpeculativeDecoder(model, NgramDrafter(), k=3)
    key = spec.path_key(2, 0.0)
    spec.cost.paths.observe(key, "spec", 100.0, 96)
    spec.cost.paths.observe(key, "plain", 200.0, 96)  # as measured: plain calls were faster
    with monkeypatch.context() as m:
        m.setattr(model, "generate", lambda *a, **k: pytest.fail("a CPU's plain call runs in the loop"))
        out = spec.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    assert out.stats.delegated and torch.equal(out.sequences, want)
    assert out.stats.emitted == sum(min(len(r[ids.shape[1]:]), (r[ids.shape[1]:] + [EOS]).index(EOS) + 1)
                                    for r in want.tolist())
    seeded = spec.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD, seed=0)
    assert not seeded.stats.delegated and torch.equal(seeded.sequences, want)  # a seed: nothing measured decides
    fixed = SpeculativeDecoder(model, NgramDrafter(), k=3, schedule="fixed", cost=spec.cost)
    assert not fixed.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD).stats.delegated
    # greedy at batch 1 on CPU the rounds alone choose: measured faster, plain decoding still gets no whole call
    one = spec.path_key(1, 0.0)
    spec.cost.paths.observe(one, "spec", 100.0, 96)
    spec.cost.paths.observe(one, "plain", 200.0, 96)
    single = spec.generate(ids[1:], mask[1:], max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    assert not single.stats.delegated and single.stats.path == "spec" and single.stats.drafted > 0
    assert torch.equal(single.sequences, want[1:])
    # sampled too: top_k=1 makes the sample the argmax, so the output must still be greedy `generate`'s, EOS and
    # padding included
    from decoder.loop import _plain as _handover

    called = []
    skey = spec.path_key(2, 0.7)
    spec.cost.paths.observe(skey, "spec", 100.0, 96)
    spec.cost.paths.observe(skey, "plain", 200.0, 96)
    with monkeypatch.context() as m:
        m.setattr(model, "generate", lambda *a, **k: called.append(1))
        out = spec.generate(ids, mask, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD, temperature=0.7,
                            top_k=1)
    st = out.stats
    assert st.delegated and not called and torch.equal(out.sequences, want)
    assert st.rounds == st.plain_rounds == st.target_forwards - 1 and st.drafted == 0 and st.handed_over == 0
    assert _handover.loop_plain(torch.device("cpu")) and not _handover.loop_plain(torch.device("meta"))

    # Both paths measured first; then the faster one, and the slower one again after FIRST_GAP calls, then after
    # twice as many while it keeps losing.
    choice, picks, key = PathChoice(), [], (1, "greedy", "x")
    gap = PathChoice.FIRST_GAP
    for _ in range(2 + gap + 2 * gap):
        path = choice.pick(key)
        picks.append(path)
        choice.observe(key, path, 100.0 if path == "spec" else 50.0)
    assert picks[:2] == ["spec", "plain"]
    assert [i for i, p in enumerate(picks) if p == "plain"] == [1, 1 + gap, 1 + 3 * gap]
    # One unlucky call does not flip the choice: the window's mean does.
    choice.observe(key, "spec", 40.0)
    assert choice.best(key) == "spec"
    for _ in range(PathChoice.WINDOW):
        choice.observe(key, "spec", 40.0)
    assert choice.best(key) == "plain"

    # The first calls: a small loss is not yet evidence (one prompt's drafts may just be accepted less), so
    # the speculative path keeps the calls until MIN_SPEC of them; a clear loss hands over at once.
    # A clear loss over a short first call (a warm-up of a few tokens) is not evidence yet either.
    n = PathChoice.CLEAR_TOKENS
    small, clear, short = PathChoice(), PathChoice(), PathChoice()
    for c, rate, tokens in ((small, 95.0, n), (clear, 100.0 / PathChoice.CLEAR - 5.0, n),
                            (short, 100.0 / PathChoice.CLEAR - 5.0, 8)):
        c.observe(key, c.pick(key), rate, tokens)
        c.observe(key, c.pick(key), 100.0, tokens)
    assert small.pick(key) == "spec" and clear.pick(key) == "plain" and short.pick(key) == "spec"
    while len(small.spt[key]["spec"]) < PathChoice.MIN_SPEC:
        small.observe(key, small.pick(key), 95.0, n)
    assert small.pick(key) == "plain"
    short.observe(key, "spec", 100.0 / PathChoice.CLEAR - 5.0, n)  # the same loss over a full call: now it counts
    assert short.pick(key) == "plain"
    # ...counted in prompts: one call at batch 8 is 8 of them, so its small loss already decides.
    batch8, key8 = PathChoice(), (8, "greedy", "x")
    batch8.observe(key8, batch8.pick(key8), 95.0)
    batch8.observe(key8, batch8.pick(key8), 100.0)
    assert batch8.pick(key8) == "plain"
    # A short call's rate is mostly its prefill and first-call costs: the window weighs calls by their tokens.
    weighed = PathChoice()
    weighed.observe(key, "spec", 20.0, tokens=8)
    weighed.observe(key, "plain", 80.0, tokens=96)
    for _ in range(2):
        weighed.observe(key, "spec", 100.0, tokens=96)
    assert weighed.best(key) == "spec"


def test_a_sampled_call_may_run_ngram_alone_with_the_probes_off(tmp_path: Path, monkeypatch) -> None:
    """Sampled calls of a decoder with EAGLE-3 and n-gram have a third path: n-gram alone, probes off. Each path
    is measured once, in order; the fastest keeps the calls and the others are re-measured in turn. On that path
    no model drafter is asked and nothing is captured, and sampling stays the target's: top_k=1 makes it the
    argmax, so the output must equal greedy `generate`."""
    monkeypatch.setenv("PROBEBUS_CACHE_DIR", str(tmp_path))
    choice, key, picks = PathChoice(), (1, "sample", "x"), []
    paths = ("spec", "ngram", "plain")
    for _ in range(3 + 3 * PathChoice.FIRST_GAP):
        path = choice.pick(key, paths)
        picks.append(path)
        choice.observe(key, path, {"spec": 100.0, "ngram": 130.0, "plain": 110.0}[path], 96)
    assert picks[:3] == ["spec", "ngram", "plain"]
    tried = [p for i, p in enumerate(picks[3:]) if p != "ngram"]
    assert tried == ["spec", "plain"] and choice.best(key) == "ngram"  # the others in turn, gaps doubling

    model = build("llama", layers=8)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                              do_sample=False, pad_token_id=PAD, eos_token_id=None)
    torch.manual_seed(0)
    eagle = Eagle3Drafter(Eagle3Config.for_target(model.config)).bind_target(model)
    flat = CostModel("test", {"1": {"verify": [1e-3] * 5, "verify_capturing": [1e-3] * 5, "step": 1e-5}}, adapt=False)
    with SpeculativeDecoder(model, "auto", model_drafter=eagle, k=3, cost=flat) as spec:
        assert spec._paths(1, 0.7) == ("spec", "ngram", "plain")
        assert spec._paths(1, 0.0) == spec._paths(8, 0.7) == ("spec", "plain")
        skey = spec.path_key(1, 0.7)
        for path, rate in (("spec", 100.0), ("ngram", 300.0), ("plain", 110.0)):
            spec.cost.paths.observe(skey, path, rate, 96)
        before = spec.session.stats.captured
        out = spec.generate(ids, max_new_tokens=24, temperature=0.7, top_k=1, pad_token_id=PAD)
        st = out.stats
        assert st.path == "ngram" and not st.delegated and torch.equal(out.sequences, want)
        assert st.model_rounds == 0 and not st.by_drafter and st.ngram_rounds > 0 and st.accepted > 0
        assert spec.session.stats.captured == before  # the probes stayed off
        assert len(spec.cost.paths.spt[skey]["ngram"]) == 2  # the call was measured on its own path
        greedy = spec.generate(ids, max_new_tokens=24, pad_token_id=PAD)
        assert greedy.stats.path == "spec" and torch.equal(greedy.sequences, want)
        assert spec.session.stats.captured > before


def test_asking_eagle_is_learnt_per_band_of_what_ngram_offers() -> None:
    """Consults that lose next to a likely n-gram copy back EAGLE-3 off there only: where n-gram has nothing,
    it is still asked every round. The band is the least any live row expects from its n-gram proposal."""
    from decoder.schedule._sched import Scheduler

    assert Scheduler.context([[0.0], [0.0, 0.9, 1.7]], [3, 3]) == 0  # one row has nothing to copy
    assert Scheduler.context([[0.0], [0.0, 0.9, 1.7]], [-1, 3]) == 2  # ... but it has finished
    assert Scheduler.context([[0.0, 0.6, 0.9]], [3]) == 1
    sc = Scheduler(4)
    strong, none = 2, 0
    consults = rounds = 0
    while consults < 3:
        rounds += 1
        if sc.consult_model(strong):
            sc.consulted(-1.0, strong)  # asking cost more than it gained
            consults += 1
    assert rounds == 1 + 2 + 4 and sc.backoff[strong] == 8 and not sc.consult_model(strong)
    assert all(sc.consult_model(none) for _ in range(5))
    sc.consulted(+0.5, none)
    assert sc.rest == 0 and sc.consult_model(none)
    sc.new_call()  # a new call asks again at most one backoff period later, in every band
    assert sc.wait[strong] <= sc.backoff[strong] - 1 and sc.wait[none] == 0


def test_a_new_call_asks_a_backed_off_drafter_again_within_a_few_rounds() -> None:
    """One prompt whose consults all lost backs the drafter off to MAX_BACKOFF rounds; the next call (another prompt)
    starts at most CALL_BACKOFF rounds into it, with the earlier calls' verdict weighed half, and one consult that
    pays brings it back to every round."""
    from decoder.schedule._sched import Scheduler

    sc = Scheduler(4)
    while sc.backoff[0] < Scheduler.MAX_BACKOFF:
        if sc.consult_model(0):
            sc.consulted(-1.0, 0)
    assert sc.backoff[0] == Scheduler.MAX_BACKOFF > Scheduler.CALL_BACKOFF
    before = sc.net[0]
    sc.new_call()
    rounds = 1
    while not sc.consult_model(0):
        rounds += 1
    assert rounds <= Scheduler.CALL_BACKOFF and sc.net[0] == 0.5 * before < 0
    sc.consulted(+4.0, 0)  # (a consult that pays well outweighs the halved verdict)
    assert sc.backoff[0] == 1 and sc.consult_model(0)


@pytest.mark.parametrize("where", ["generate", "loop"])
def test_a_call_that_measures_itself_losing_hands_the_rest_over(where: str, tmp_path: Path, monkeypatch) -> None:
    """Forced (no time margin): a sampled call continues in `generate` on the loop's own cache, or (`loop`, what
    a CPU does: `_handover.loop_plain`) as the loop's own plain rounds. Sampling with top_k=1 is the argmax, so
    output, EOS and streaming must equal greedy `generate` exactly: the continuation conditions on exactly the
    tokens so far, at any batch size (holes, padding and finished rows included). Greedy calls stay in the
    loop."""
    from decoder.loop import _plain as _handover

    monkeypatch.setattr(_handover, "LOOP_PLAIN", ("cpu",) if where == "loop" else ())
    monkeypatch.setenv("PROBEBUS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_handover, "HAND_OVER_AFTER", 5)
    monkeypatch.setattr(_handover, "MIN_LEFT", 2)
    monkeypatch.setattr(_handover, "HAND_OVER_LOSS", 0.0)  # every sampled call loses once judged
    model = build("llama", layers=2)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                              do_sample=False, pad_token_id=PAD, eos_token_id=None)

    class Collect:
        def __init__(self) -> None:
            self.puts: list[list[int]] = []
            self.ends = 0

        def put(self, value: torch.Tensor) -> None:
            self.puts.append(value.flatten().tolist())

        def end(self) -> None:
            self.ends += 1

    argmax = {"temperature": 0.7, "top_k": 1, "pad_token_id": PAD}
    spec = SpeculativeDecoder(model, NgramDrafter(), k=3)
    streamer = Collect()
    out = spec.generate(ids, max_new_tokens=30, streamer=streamer, **argmax)
    st = out.stats
    assert torch.equal(out.sequences, want) and not st.delegated
    assert 0 < st.handed_over <= 30 - 6 and st.emitted == 30
    # the call's time by part: the prefill and the handed-over rest are not rounds (nor counted twice)
    assert st.prefill_s > 0 and st.handover_s > 0 and st.draft_s > 0 and st.verify_s > 0
    assert st.prefill_s + st.draft_s + st.verify_s + st.handover_s <= st.seconds, st.as_dict()
    assert streamer.puts[0] == ids[0].tolist() and streamer.ends == 1
    assert sum(streamer.puts[1:], []) == want[0, ids.shape[1]:].tolist()  # nothing twice, nothing missing
    # an EOS inside the handed-over part stops the row there, like `generate`
    new = want[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 8 and t not in new[:i])  # first seen after the hand-over
    spec.cost.paths = PathChoice()  # each call as a first one: the speculative path runs
    with torch.no_grad():
        want_eos = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                                  do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    got = spec.generate(ids, max_new_tokens=30, eos_token_id=eos, **argmax)
    n = got.stats.emitted
    assert got.stats.handed_over > 0 and got.sequences[0, ids.shape[1] + n - 1] == eos
    assert torch.equal(got.sequences[0, : ids.shape[1] + n], want_eos[0, : ids.shape[1] + n])
    # greedy calls stay in the loop (their pace picks up later)
    spec.cost.paths = PathChoice()
    greedy = spec.generate(ids, max_new_tokens=30, pad_token_id=PAD)
    assert not greedy.stats.delegated and greedy.stats.handed_over == 0 and torch.equal(greedy.sequences, want)
    # batch > 1: rows at different lengths, masked holes in the cache and left padding go to `generate` as one
    # left-padded batch, and every row must come out as plain `generate` makes it; greedy stays in the loop
    from decoder.loop import _decoder as _loop
    holes: list[int] = []
    real = _loop.hand_over

    def watched(run, target) -> None:
        pad = [run.input_ids.shape[1] - n for n in run.lens]
        holes.append(max(run.cols - last - p for last, p in zip(run.last, pad, strict=True)))
        real(run, target)

    monkeypatch.setattr(_loop, "hand_over", watched)
    monkeypatch.setattr(_handover, "HAND_OVER_AFTER", 12)  # rows have drafted long enough to differ by then
    flat = {"verify": [1e-3] * 8, "step": 1e-5}  # drafting always looks worth it: rounds draft, rows diverge
    spec.close()
    spec = SpeculativeDecoder(model, NgramDrafter(), k=3, cost=CostModel("flat", {"1": flat, "2": flat}, adapt=False))
    two, mask = left_padded([[5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 10, 11, 12, 9, 10]])
    with torch.no_grad():
        want2 = model.generate(input_ids=two, attention_mask=mask, max_new_tokens=30, do_sample=False,
                               pad_token_id=PAD, eos_token_id=None)
    for kw in ({"pad_token_id": PAD}, argmax):
        spec.cost.paths = PathChoice()
        got = spec.generate(two, mask, max_new_tokens=30, **kw)
        assert (got.stats.handed_over > 0) == (kw is argmax) and torch.equal(got.sequences, want2)
        st = got.stats
        # on the cost model's clock (a flat 1 ms per forward) the call is its rounds plus `generate`'s steps, one
        # per token of the batch, not per row: 29 forwards at most after the prefill's token
        assert st.handover_steps <= st.handed_over and len(st.history) + st.handover_steps <= 29
        assert simulated_seconds(st, spec.cost) <= 29e-3 + sum(h[4] for h in st.history) * 1e-5 + 1e-9
    if where == "generate":
        assert max(holes) > 0  # some row had drafts rejected where another kept more: a real hole was continued
    else:
        assert not holes  # the loop's own plain rounds continue the cache it keeps, holes and all
    # EOS in one row: that row stops there, padded after, like `generate`; a row that is done leaves the batch
    row1 = want2[1, two.shape[1]:].tolist()
    for late in (True, False):  # EOS after the hand-over, or before it (row 1 finished: row 0 goes on alone)
        eos = next(t for i, t in enumerate(row1) if (i >= 16 if late else 2 <= i < 8) and t not in row1[:i]
                   and t not in want2[0].tolist())
        with torch.no_grad():
            want_eos2 = model.generate(input_ids=two, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                       pad_token_id=PAD, eos_token_id=eos)
        spec.cost.paths = PathChoice()
        got = spec.generate(two, mask, max_new_tokens=30, eos_token_id=eos, **argmax)
        assert got.stats.handed_over > 0 and torch.equal(got.sequences, want_eos2)
    # one left-padded row, sampled
    one, mask1 = left_padded([[5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 9, 10]])
    with torch.no_grad():
        want1 = model.generate(input_ids=one[:1], attention_mask=mask1[:1], max_new_tokens=30, do_sample=False,
                               pad_token_id=PAD, eos_token_id=None)
    spec.cost.paths = PathChoice()
    got = spec.generate(one[:1], mask1[:1], max_new_tokens=30, **argmax)
    assert got.stats.handed_over > 0 and torch.equal(got.sequences, want1)
    spec.close()
