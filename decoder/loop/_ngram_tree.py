"""N-gram trees: at batch 1, the round's chain and the candidates that cost nothing to have, verified together in
one target forward.

    widened = widen(run, drafts, cost, k, nodes, capturing)   # None: only the chosen chain pays; verify a chain
    if widened is not None:
        ngram_tree_round(run, target, drafts, widened, t_round, cost, k, drafters)

Why: on the CPU a target forward costs nearly the same for a few to a dozen tokens, and candidates that cost no
forward of their own are at hand: what followed the n-gram suffix's earlier occurrences (the index keeps
the last few), and, in a round where a model drafter was consulted, whichever of its drafts and the n-gram
proposal the scheduler did not choose. Replayed offline on held-out outputs, a few n-gram alternatives raised
the tokens per round (measured: docs/design.md, "Decoder: measurements behind the code").

Which nodes go in is `Tree.budget` on the measured cost curve (expected tokens over the forward's cost):
each node carries P(its path is accepted): the chain's and the other method's nodes from their
calibrated acceptance (n-gram table, the model drafter's confidence), an alternative's first own node from
P(its parent is reached) x the acceptance learnt for its rank (`AltCalibrator`), its next ones from
the n-gram table. The round verifies a tree only when something besides the chain made the cut;
otherwise the chain runs as before.

At T > 0 the tree holds the n-gram chain and its alternatives only, all point masses chosen before the
target's forward: each node draws its token from the target's p and follows it where it is a child
(`verify.verify_tree_sampled`), which takes child c with probability p(c), exactly sequential sampling. A
chain accepts its one candidate with that same probability; the tree adds the other candidates' mass. A model
drafter's sampled drafts are left out there: their own rule, min(1, p / q), accepts more than a point mass would.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..drafters import Tree
from ..schedule import ALTERNATIVES
from ._accounting import account_tree, calibrate
from ._tree_round import verify_tree

if TYPE_CHECKING:
    from ..schedule import CostModel
    from ._chain_round import RoundDrafts
    from ._drafters import ModelDrafters
    from ._run import Run
    from ._target import Target


def widen(run: Run, drafts: RoundDrafts, cost: CostModel, k: int, nodes: int,
          capturing: bool) -> tuple[Tree, list[int]] | None:
    """(tree, source of each node) when the round's chosen chain plus other candidates is worth more per second
    than the chain alone, else None. Sources: 0 the chain the scheduler chose (n-gram or the model drafter's), 1..
    the n-gram alternatives by rank, -1 the other method's proposal (the model drafter's drafts next to an n-gram
    chain, or the other way round); nodes: the most a tree may have."""
    method, greedy = drafts.methods[0], run.mode == "greedy"
    # At T > 0 a tree holds n-gram candidates only: point masses, verified by drawing from p (`verify_drawn_tree`).
    # A model drafter's sampled drafts keep their own rule, min(1, p / q), which a point mass would throw away.
    if run.b != 1 or run.ngram is None or method not in (("ngram", "model") if greedy else ("ngram",)):
        return None
    depth = max(run.caps(k)[0], 0)
    props = drafts.props[0][:depth] if drafts.props else []
    model = drafts.model.tokens[0, :depth].tolist() if drafts.model is not None and greedy else []
    alts = run.ngram[0].alternatives(depth, ALTERNATIVES) if props and depth else []
    chain, other = (props, model) if method == "ngram" else (model, props)
    if not chain or not (alts or other):
        return None
    sched, fix = run.sched, run.ngram_fix.scale()[0]
    overlap = drafts.overlap[0] if drafts.overlap else 0.0
    alt_calib, ngram_calib = run.scheds[0].alt_calib[run.mode], sched.ngram_calib[run.mode]
    match = drafts.match[0] if drafts.match else 0
    m_prob: list[float] = []
    if model:  # the model drafter's calibrated conditional acceptance per draft
        m_calib, m_fix = sched.model_calib[run.mode], run.model_fix.scale()[0]
        m_prob = [min(1.0, m_calib(c) * m_fix) for c in drafts.model.conf[0, : len(model)].tolist()]

    def chance(source: int, kind: str, i: int, own: bool, m: int) -> float:
        if kind == "model":
            return m_prob[i]
        if own and source > 0:  # an alternative's first node of its own
            return alt_calib(source)
        return min(1.0, ngram_calib(m, overlap, i) * fix)

    cands = [(chain, 0, method, match)]
    if other:
        cands.append((other, -1, "ngram" if method == "model" else "model", match))
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
    curve = cost.curve(1, nodes, capturing=capturing)
    top = tree.top(tree.budget(curve))
    sources = [sources[node[tuple(_path_tokens(top, i))]] for i in range(len(top))]
    return (top, sources) if any(sources) else None


def _path_tokens(tree: Tree, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(tree.tokens[i])
        i = tree.parents[i]
    return out[::-1]


def ngram_tree_round(run: Run, target: Target, drafts: RoundDrafts, widened: tuple[Tree, list[int]], tr: float,
                     cost: CostModel, k: int, drafters: ModelDrafters) -> list[list[int]]:
    """Verify the widened proposal in one forward, commit the accepted branch (the drafters that read this forward
    get its feed), and account for the round."""
    tree, sources = widened
    tv = time.perf_counter()
    if target.session is not None:  # a model drafter resting for a while: the probes come off meanwhile
        target.capture(target.awake(run, cost, k))
    kept, path = verify_tree(run, target, tree, drafters.readers(target.capturing))
    on_path = set(path)
    for i, p in enumerate(tree.parents):  # each n-gram alternative's own first node whose parent was reached
        if sources[i] > 0 and (p < 0 or (sources[p] != sources[i] and p in on_path)):
            run.scheds[0].alt_calib[run.mode].update(sources[i], i in on_path)
    now = time.perf_counter()
    drafted = drafts.model.tokens.shape[1] if drafts.model is not None else 0
    account_tree(run, tree, path, kept, (tr, tv, now), drafted, cost, capturing=target.capturing)
    run.stats.ngram_rounds += drafts.methods[0] == "ngram"
    run.stats.model_rounds += drafts.methods[0] == "model"
    if run.mode == "greedy":  # the committed tokens are the target's own choices: every candidate is checked
        calibrate(run, drafts, 0, drafts.methods[0], drafts.k_rows[0], len(path))
    else:  # sampled: only the chain's own nodes that were offered and how far the draws followed them
        n = 0
        while n < len(path) and sources[path[n]] == 0:
            n += 1
        calibrate(run, drafts, 0, drafts.methods[0], sources.count(0), n)
    run.observe_rate(len(kept[0]), now - tr)
    return kept
