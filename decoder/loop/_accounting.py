"""A round's bookkeeping: statistics, the acceptance calibrations, the cost model's online refinement.

    account(spec, run, drafts, n_acc, kept, t_round, t_verify)   # after each round's commit

Kept apart from the loop so `_loop.py` reads as the round itself (schedule, draft, verify, commit).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..drafters._feeder import RoundDrafts
    from ._decoder import SpeculativeDecoder
    from ._run import Run


def account(spec: SpeculativeDecoder, run: Run, drafts: RoundDrafts, n_acc: list[int], kept: list[list[int]],
            tr: float, tv: float) -> None:
    """Statistics, calibration of the acceptance estimates, and the cost model's online refinement."""
    now = time.perf_counter()
    st = run.stats
    st.draft_s += tv - tr
    st.verify_s += now - tv
    st.rounds += 1
    length = drafts.tokens.shape[1] + 1
    st.plain_rounds += length == 1
    offered = accepted = rows = 0
    active = [m for m in run.n_eff]
    for r, m in enumerate(drafts.methods):
        if active[r] < 0:
            continue
        rows += 1
        kr, n = drafts.k_rows[r], n_acc[r]
        st.row_rounds += 1
        st.emitted += len(kept[r])
        if kr:
            st.drafted_row_rounds += 1
            st.eagle_rounds += m == "eagle"
            st.ngram_rounds += m == "ngram"
        st.drafted += kr
        st.accepted += min(n, kr)
        offered += kr
        accepted += min(n, kr)
        for i in range(kr):
            st.offered_at[i] += 1
            st.accepted_at[i] += int(n > i)
        calibrate(run, drafts, r, m, kr, n)
    st.history.append((length, rows, offered, accepted,
                       drafts.eagle.tokens.shape[1] if drafts.eagle is not None else 0))
    run.observe_rate(sum(len(t) for t in kept), now - tr)
    if spec._cost is not None and run.b > 0:
        spec.cost.observe_verify(run.b, length, now - tv, capturing=spec._capturing)
        if drafts.eagle is not None and drafts.eagle.tokens.shape[1] > 1:
            steps = drafts.eagle.tokens.shape[1]  # (a drafter that does not time its steps: all of it, spread)
            spec.cost.observe_step(run.b, drafts.eagle.step_s or drafts.eagle.compute_s / steps)
        drafting = drafts.eagle.bus_s + drafts.eagle.compute_s if drafts.eagle is not None else 0.0
        spec.cost.observe_overhead(run.b, max(tv - tr - drafting, 0.0))

def calibrate(run: Run, drafts: RoundDrafts, r: int, method: str, kr: int, n: int) -> None:
    """Feed observed outcomes back into the calibrations. Greedy also learns from proposals it did not
    use: the committed tokens are the target's own choices, so any proposal's prefix can be checked."""
    sched = run.sched
    greedy = run.mode == "greedy"
    # greedy: the accepted drafts and the next token, i.e. the target's own next n + 1 choices
    truth = run.toks[r, run.last[r] - n: run.last[r] + 1].tolist() if greedy else []
    if drafts.eagle is not None:
        calib = sched.eagle_calib[run.mode]
        conf = drafts.eagle.conf[r].tolist()
        fix = run.fix["eagle"]
        if greedy:
            toks = drafts.eagle.tokens[r].tolist()
            for i in range(min(len(toks), len(truth))):
                fix.update(r, calib(conf[i]), toks[i] == truth[i])
                calib.update(conf[i], toks[i] == truth[i])
                if toks[i] != truth[i]:
                    break
        elif method == "eagle":
            for i in range(min(n + 1, kr)):
                fix.update(r, calib(conf[i]), i < n)
                calib.update(conf[i], i < n)
    if drafts.props is not None and drafts.props[r]:
        prop, m, o = drafts.props[r], drafts.match[r], drafts.overlap[r]
        fix, nc = run.fix["ngram"], sched.ngram_calib[run.mode]
        if greedy:
            for i in range(min(len(prop), len(truth))):
                fix.update(r, nc(m, o, i), prop[i] == truth[i])
                nc.update(m, o, i, prop[i] == truth[i])
                if prop[i] != truth[i]:
                    break
        elif method == "ngram":
            for i in range(min(n + 1, kr)):
                fix.update(r, nc(m, o, i), i < n)
                nc.update(m, o, i, i < n)
