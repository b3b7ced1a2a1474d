"""N-gram trees: at batch 1, greedy, the n-gram proposal and what followed its suffix's other occurrences,
verified together in one target forward.

    tree = widen(spec, run, drafts)              # None: nothing but the proposal pays; verify the chain
    if tree is not None:
        ngram_tree_round(spec, run, drafts, tree, t_round)

Why: on the CPU a target forward costs nearly the same for 3 to ~13 tokens (default model, 2-core VM:
a 6-token chain 1.12x a one-token step, trees of 9 and 13 nodes 1.26x), and where the latest
occurrence's continuation is wrong, an earlier occurrence's often is right. Replayed offline on the
default model's greedy outputs of the three held-out prompt sets (k = 5), up to three alternatives
raised tokens per round from 1.93 / 2.08 / 2.04 (stdlib / third-party / prose) to 2.08 / 2.37 / 2.44.

Which nodes go in is `Tree.budget` on the measured cost curve (expected tokens over the forward's cost):
the proposal's nodes carry the scheduler's calibrated n-gram acceptance; an alternative's first own node
carries P(its parent is reached) x the acceptance learnt for its rank (`AltCalibrator`), its next ones
the n-gram continuation calibration. The round verifies a tree only when an alternative made the cut;
otherwise the chain the scheduler chose runs as before. Greedy only: sampling from several
point-mass drafts would need its own rule (chains keep the existing one).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ._accounting import calibrate
from ._sched import ALTERNATIVES
from ._tree import Tree
from ._tree_round import verify_tree

if TYPE_CHECKING:
    from ._loop import RoundDrafts, SpeculativeDecoder
    from ._state import Run

def widen(spec: SpeculativeDecoder, run: Run, drafts: RoundDrafts) -> tuple[Tree, list[int]] | None:
    """(tree, rank of each node: 0 = the proposal's) when the round's n-gram proposal plus alternatives is
    worth more per second than the proposal alone, else None."""
    if (run.b != 1 or run.mode != "greedy" or run.ngram is None or drafts.methods[0] != "ngram"
            or not drafts.props or not drafts.props[0]):
        return None
    depth = max(run.caps(spec.k)[0], 0)
    alts = run.ngram[0].alternatives(depth, ALTERNATIVES)
    if not alts or depth == 0:
        return None
    sched, fix = run.sched, run.fix["ngram"].scale()[0]
    overlap = drafts.overlap[0] if drafts.overlap else 0.0
    calib = run.scheds[0].alt_calib

    def cont(match: int, i: int) -> float:
        return min(1.0, sched.ngram_calib(match, overlap, i) * fix)

    tree, ranks = Tree(), []
    node: dict[tuple[int, ...], int] = {}
    for rank, (seq, match) in enumerate([(drafts.props[0][:depth], drafts.match[0]), *alts]):
        prob, parent = 1.0, -1
        for i, tok in enumerate(seq):
            key = tuple(seq[: i + 1])
            if key in node:  # shared with an earlier candidate
                parent = node[key]
                prob = tree.probs[parent]
                continue
            own = parent < 0 or ranks[parent] != rank  # this candidate's first node of its own
            prob *= calib(rank) if own and rank else cont(match, i)
            node[key] = len(tree)
            tree.tokens.append(tok)
            tree.parents.append(parent)
            tree.depths.append(i + 1)
            tree.probs.append(prob)
            ranks.append(rank)
            parent = node[key]
    curve = spec.cost.curve(1, spec.ngram_tree, capturing=spec._capturing)
    top = tree.top(tree.budget(curve))
    ranks = [ranks[node[tuple(_path_tokens(top, i))]] for i in range(len(top))]
    return (top, ranks) if any(ranks) else None


def _path_tokens(tree: Tree, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(tree.tokens[i])
        i = tree.parents[i]
    return out[::-1]


def ngram_tree_round(spec: SpeculativeDecoder, run: Run, drafts: RoundDrafts, widened: tuple[Tree, list[int]],
                     tr: float) -> list[list[int]]:
    """Verify the widened proposal in one forward, commit the accepted branch, and account for the round."""
    tree, ranks = widened
    tv = time.perf_counter()
    if spec.session is not None:  # EAGLE-3 resting for a while: the probes come off meanwhile
        spec._capture(spec._awake(run))
    kept, path = verify_tree(spec, run, tree)
    now = time.perf_counter()
    n, acc = len(tree), len(path)
    on_path = set(path)
    for i in range(n):  # each alternative's own first node whose parent was reached
        p = tree.parents[i]
        if ranks[i] and (p < 0 or ranks[p] != ranks[i]) and (p < 0 or p in on_path):
            run.scheds[0].alt_calib.update(ranks[i], i in on_path)
    st = run.stats
    st.rounds += 1
    st.tree_rounds += 1
    st.target_forwards += 1
    st.row_rounds += 1
    st.drafted_row_rounds += 1
    st.ngram_rounds += 1
    st.emitted += len(kept[0])
    st.drafted += n
    st.accepted += acc
    for i in range(min(max(tree.depths), len(st.offered_at))):
        st.offered_at[i] += 1
        st.accepted_at[i] += int(acc > i)
    st.draft_s += tv - tr
    st.verify_s += now - tv
    eagle_n = drafts.eagle.tokens.shape[1] if drafts.eagle is not None else 0
    st.history.append((n + 1, 1, n, acc, eagle_n))
    calibrate(run, drafts, 0, "ngram", drafts.k_rows[0], acc)
    run.observe_rate(len(kept[0]), now - tr)
    spec.cost.observe_verify(1, n + 1, now - tv, capturing=spec._capturing)
    return kept
