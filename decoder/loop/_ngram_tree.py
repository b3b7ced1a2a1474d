"""N-gram trees: at batch 1, the round's chain and the candidates that cost nothing to have, verified together in
one target forward.

    widened = widen(spec, run, drafts)           # None: nothing but the chosen chain pays; verify it as a chain
    if widened is not None:
        ngram_tree_round(spec, run, drafts, widened, t_round)

Why: on the CPU a target forward costs nearly the same for 3 to ~13 tokens (default model, 2-core VM:
a 6-token chain 1.12x a one-token step, trees of 9 and 13 nodes 1.26x), and candidates that cost no
forward of their own are at hand: what followed the n-gram suffix's earlier occurrences (the index keeps
the last few), and, in a round where EAGLE-3 was consulted, whichever of its drafts and the n-gram
proposal the scheduler did not choose. Replayed offline on the default model's greedy outputs of the
three held-out prompt sets (k = 5), up to three n-gram alternatives raised tokens per round from
1.93 / 2.08 / 2.04 (stdlib / third-party / prose) to 2.08 / 2.37 / 2.44.

Which nodes go in is `Tree.budget` on the measured cost curve (expected tokens over the forward's cost):
each node carries P(its path is accepted): the chain's and the other method's nodes from their
calibrated acceptance (n-gram table, EAGLE-3 confidence), an alternative's first own node from
P(its parent is reached) x the acceptance learnt for its rank (`AltCalibrator`), its next ones from
the n-gram table. The round verifies a tree only when something besides the chain made the cut;
otherwise the chain runs as before.

At T > 0 the tree holds the n-gram chain and its alternatives only, all point masses chosen before the
target's forward: each node draws its token from the target's p and follows it where it is a child
(`verify_drawn_tree`), which takes child c with probability p(c), exactly sequential sampling. A chain
accepts its one candidate with that same probability; the tree adds the other candidates' mass. EAGLE-3's
sampled drafts are left out there: their own rule, min(1, p / q), accepts more than a point mass would.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..drafters._tree import Tree
from ..schedule._sched import ALTERNATIVES
from ._accounting import calibrate
from ._tree_round import count_round, verify_tree

if TYPE_CHECKING:
    from ..drafters._feeder import RoundDrafts
    from ._decoder import SpeculativeDecoder
    from ._run import Run


def widen(spec: SpeculativeDecoder, run: Run, drafts: RoundDrafts) -> tuple[Tree, list[int]] | None:
    """(tree, source of each node) when the round's chosen chain plus other candidates is worth more per second
    than the chain alone, else None. Sources: 0 the chain the scheduler chose (n-gram or EAGLE-3), 1.. the n-gram
    alternatives by rank, -1 the other method's proposal (EAGLE-3's drafts next to an n-gram chain, or the other
    way round)."""
    method, greedy = drafts.methods[0], run.mode == "greedy"
    # At T > 0 a tree holds n-gram candidates only: point masses, verified by drawing from p (`verify_drawn_tree`).
    # EAGLE-3's sampled drafts keep their own rule, min(1, p / q), which a point mass would throw away.
    if run.b != 1 or run.ngram is None or method not in (("ngram", "eagle") if greedy else ("ngram",)):
        return None
    depth = max(run.caps(spec.k)[0], 0)
    props = drafts.props[0][:depth] if drafts.props else []
    eagle = drafts.eagle.tokens[0, :depth].tolist() if drafts.eagle is not None and greedy else []
    alts = run.ngram[0].alternatives(depth, ALTERNATIVES) if props and depth else []
    chain, other = (props, eagle) if method == "ngram" else (eagle, props)
    if not chain or not (alts or other):
        return None
    sched, fix = run.sched, run.fix["ngram"].scale()[0]
    overlap = drafts.overlap[0] if drafts.overlap else 0.0
    alt_calib, ngram_calib = run.scheds[0].alt_calib[run.mode], sched.ngram_calib[run.mode]
    match = drafts.match[0] if drafts.match else 0
    e_prob: list[float] = []
    if eagle:  # EAGLE-3's calibrated conditional acceptance per draft
        e_calib, e_fix = sched.eagle_calib[run.mode], run.fix["eagle"].scale()[0]
        e_prob = [min(1.0, e_calib(c) * e_fix) for c in drafts.eagle.conf[0, : len(eagle)].tolist()]

    def chance(source: int, kind: str, i: int, own: bool, m: int) -> float:
        if kind == "eagle":
            return e_prob[i]
        if own and source > 0:  # an alternative's first node of its own
            return alt_calib(source)
        return min(1.0, ngram_calib(m, overlap, i) * fix)

    cands = [(chain, 0, method, match)]
    if other:
        cands.append((other, -1, "ngram" if method == "eagle" else "eagle", match))
    cands += [(seq, rank, "ngram", m) for rank, (seq, m) in enumerate(alts, 1)]
    tree, sources = Tree(), []
    node: dict[tuple[int, ...], int] = {}
    for seq, source, kind, m in cands:
        prob, parent = 1.0, -1
        for i, tok in enumerate(seq):
            key = tuple(seq[: i + 1])
            if key in node:  # shared with an earlier candidate
                parent = node[key]
                prob = tree.probs[parent]
                continue
            own = parent < 0 or sources[parent] != source  # this candidate's first node of its own
            prob *= chance(source, kind, i, own, m)
            node[key] = len(tree)
            tree.tokens.append(tok)
            tree.parents.append(parent)
            tree.depths.append(i + 1)
            tree.probs.append(prob)
            sources.append(source)
            parent = node[key]
    curve = spec.cost.curve(1, spec.ngram_tree, capturing=spec._capturing)
    top = tree.top(tree.budget(curve))
    sources = [sources[node[tuple(_path_tokens(top, i))]] for i in range(len(top))]
    return (top, sources) if any(sources) else None


def _path_tokens(tree: Tree, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(tree.tokens[i])
        i = tree.parents[i]
    return out[::-1]


def ngram_tree_round(spec: SpeculativeDecoder, run: Run, drafts: RoundDrafts, widened: tuple[Tree, list[int]],
                     tr: float) -> list[list[int]]:
    """Verify the widened proposal in one forward, commit the accepted branch, and account for the round."""
    tree, sources = widened
    tv = time.perf_counter()
    if spec.session is not None:  # EAGLE-3 resting for a while: the probes come off meanwhile
        spec._capture(spec._awake(run))
    kept, path = verify_tree(spec, run, tree)
    on_path = set(path)
    for i, p in enumerate(tree.parents):  # each n-gram alternative's own first node whose parent was reached
        if sources[i] > 0 and (p < 0 or (sources[p] != sources[i] and p in on_path)):
            run.scheds[0].alt_calib[run.mode].update(sources[i], i in on_path)
    now = time.perf_counter()
    eagle_drafts = drafts.eagle.tokens.shape[1] if drafts.eagle is not None else 0
    count_round(spec, run, tree, path, kept, (tr, tv, now), eagle_drafts, capturing=spec._capturing)
    run.stats.ngram_rounds += drafts.methods[0] == "ngram"
    run.stats.eagle_rounds += drafts.methods[0] == "eagle"
    if run.mode == "greedy":  # the committed tokens are the target's own choices: every candidate is checked
        calibrate(run, drafts, 0, drafts.methods[0], drafts.k_rows[0], len(path))
    else:  # sampled: only the chain's own nodes that were offered and how far the draws followed them
        n = 0
        while n < len(path) and sources[path[n]] == 0:
            n += 1
        calibrate(run, drafts, 0, drafts.methods[0], sources.count(0), n)
    run.observe_rate(len(kept[0]), now - tr)
    return kept
