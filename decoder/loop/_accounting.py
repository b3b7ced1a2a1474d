"""A round's last stage: statistics, the acceptance calibrations, the cost model's online refinement.

    account(run, drafts, n_acc, kept, (t_round, t_verify), cost, capturing)      # after a chain round's commit
    account_tree(run, tree, path, kept, (t_round, t_verify, t_end), drafted, cost, capturing)  # a tree round's
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..drafters import Tree
    from ..schedule import CostModel
    from ._drafting import RoundDrafts
    from ._run import Run


def account(run: Run, drafts: RoundDrafts, n_acc: list[int], kept: list[list[int]], times: tuple[float, float],
            cost: CostModel | None, capturing: bool) -> None:
    """Statistics, calibration of the acceptance estimates, and the cost model's online refinement (None: a
    decoder with nothing to draft measures no curve to refine); times = (round start, verify start)."""
    now = time.perf_counter()
    tr, tv = times
    st = run.stats
    st.target_forwards += 1
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
            st.model_rounds += m == "model"
            st.ngram_rounds += m == "ngram"
        st.drafted += kr
        st.accepted += min(n, kr)
        offered += kr
        accepted += min(n, kr)
        for i in range(kr):
            st.offered_at[i] += 1
            st.accepted_at[i] += int(n > i)
        calibrate(run, drafts, r, m, kr, n)
    model = drafts.model
    st.history.append((length, rows, offered, accepted, model.tokens.shape[1] if model is not None else 0))
    run.observe_rate(sum(len(t) for t in kept), now - tr)
    if cost is None:
        return
    cost.observe_verify(run.b, length, now - tv, capturing=capturing)
    if model is not None and model.tokens.shape[1] > 1:
        steps = model.tokens.shape[1]  # (a drafter that does not time its steps: all of it, spread)
        cost.observe_step(run.b, model.step_s or model.compute_s / steps)
    drafting = model.bus_s + model.compute_s if model is not None else 0.0
    cost.observe_overhead(run.b, max(tv - tr - drafting, 0.0))


def calibrate(run: Run, drafts: RoundDrafts, r: int, method: str, kr: int, n: int) -> None:
    """Feed observed outcomes back into the calibrations. Greedy also learns from proposals it did not
    use: the committed tokens are the target's own choices, so any proposal's prefix can be checked."""
    sched = run.sched
    greedy = run.mode == "greedy"
    # greedy: the accepted drafts and the next token, i.e. the target's own next n + 1 choices
    truth = run.toks[r, run.last[r] - n: run.last[r] + 1].tolist() if greedy else []
    if drafts.model is not None:
        calib = sched.model_calib[run.mode]
        conf = drafts.model.conf[r].tolist()
        fix = run.model_fix
        if greedy:
            toks = drafts.model.tokens[r].tolist()
            for i in range(min(len(toks), len(truth))):
                fix.update(r, calib(conf[i]), toks[i] == truth[i])
                calib.update(conf[i], toks[i] == truth[i])
                if toks[i] != truth[i]:
                    break
        elif method == "model":
            for i in range(min(n + 1, kr)):
                fix.update(r, calib(conf[i]), i < n)
                calib.update(conf[i], i < n)
    if drafts.props is not None and drafts.props[r]:
        prop, m, o = drafts.props[r], drafts.match[r], drafts.overlap[r]
        fix, nc = run.ngram_fix, sched.ngram_calib[run.mode]
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


def account_tree(run: Run, tree: Tree, path: list[int], kept: list[list[int]], times: tuple[float, float, float],
                 drafted: int, cost: CostModel, capturing: bool) -> None:
    """A tree round's statistics and the cost model's observation of its forward; times = (round start,
    verify start, end); drafted: the model drafter's drafts made (the tree's nodes, or its chain's)."""
    t0, t1, now = times
    n = len(tree)
    st = run.stats
    st.rounds += 1
    st.tree_rounds += n > 0
    st.plain_rounds += n == 0
    st.target_forwards += 1
    st.row_rounds += 1
    st.emitted += len(kept[0])
    st.drafted += n
    st.drafted_row_rounds += n > 0
    st.accepted += len(path)
    for i in range(min(max(tree.depths, default=0), len(st.offered_at))):
        st.offered_at[i] += 1
        st.accepted_at[i] += int(len(path) > i)
    st.draft_s += t1 - t0
    st.verify_s += now - t1
    st.history.append((n + 1, 1, n, len(path), drafted))
    cost.observe_verify(1, n + 1, now - t1, capturing=capturing)
