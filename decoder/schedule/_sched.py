"""The round scheduler: per round and row, which method drafts and how many tokens the target verifies.

    plan = DraftPlan(k=5, cost=[...], step_cost=..., rate=..., base=[...], caps=[...], calib=[...])
    plan.best(model_prefix)             # (value, verify length L) of the best choice so far
    plan.worth_another(model, cond)     # would one more drafter step pay for itself?

Throughput is tokens over time, so a round is worth what it emits beyond what the same time
would have earned at the loop's rate R (tokens/s; renewal-reward, as in Dinkelbach's method):

    value(L) = sum over rows of (1 + sum_{i < L} P_r,i)  -  R * c(L)

c(L) is the measured cost of a target forward over L tokens at this batch (plus the
round's bookkeeping); P_r,i is the probability that row r's draft i and every draft before
it are accepted. For the n-gram proposal P comes from an online-calibrated table keyed by
suffix-match length, prompt-output overlap and position; for a model drafter from its confidence
head (or, without one, the drafter's own top-1 probability) mapped through an online
calibration of predicted versus observed acceptance. A model drafter drafts one step at a time and
stops once the expected gain of one more step is below R * (its cost): verify length and
draft length are chosen separately, and time already spent drafting is sunk, not a reason
to verify more. L = 1 is a plain step; with R at least the plain rate, a round drafts only
when the extra tokens it expects pay for its extra time at that rate, which is how
scheduling never loses to plain decoding.

A batch ends with its slowest row, and a round costs every row the same time: a token
for a row that is ahead shortens nothing, and drafting that the slowest row cannot use
only makes its rounds dearer. So at batch > 1 the tokens counted are those of the row
that would finish last, min over rows of (1 + its expected gain) * (most remaining
tokens / its remaining tokens), and R is that row's plain rate (batch 1: the row itself).

`DraftPlan` is plain data, so a drafter in another process runs the same stopping rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class Calibrator:
    """Observed acceptance per bin of a raw estimate, with a prior at the bin's centre and slow forgetting."""

    def __init__(self, bins: int = 10, prior: float = 3.0, decay: float = 0.997) -> None:
        self.bins, self.prior, self.decay = bins, prior, decay
        self.acc = [0.0] * bins
        self.n = [0.0] * bins
        self._table: list[float] | None = None

    def _bin(self, raw: float) -> int:
        return min(max(int(raw * self.bins), 0), self.bins - 1)

    def table(self) -> list[float]:
        if self._table is None:
            self._table = [(a + self.prior * (i + 0.5) / self.bins) / (n + self.prior)
                           for i, (a, n) in enumerate(zip(self.acc, self.n, strict=True))]
        return self._table

    def __call__(self, raw: float) -> float:
        i = self._bin(raw)
        return (self.acc[i] + self.prior * (i + 0.5) / self.bins) / (self.n[i] + self.prior)

    def update(self, raw: float, accepted: bool) -> None:
        i = self._bin(raw)
        self.acc[i] = self.acc[i] * self.decay + accepted
        self.n[i] = self.n[i] * self.decay + 1.0
        self._table = None


ALTERNATIVES = 3  # n-gram trees: continuations of other occurrences offered next to the proposal


class AltCalibrator:
    """P(an alternative's first own node is accepted | its parent was reached), per rank (1 = the first
    alternative), from a prior, slowly forgotten."""

    def __init__(self, prior: float = 0.2, weight: float = 2.0, decay: float = 0.997) -> None:
        self.prior, self.weight, self.decay = prior, weight, decay
        self.acc = [0.0] * (ALTERNATIVES + 1)
        self.n = [0.0] * (ALTERNATIVES + 1)

    def __call__(self, rank: int) -> float:
        return (self.acc[rank] + self.prior * self.weight) / (self.n[rank] + self.weight)

    def update(self, rank: int, accepted: bool) -> None:
        self.acc[rank] = self.acc[rank] * self.decay + accepted
        self.n[rank] = self.n[rank] * self.decay + 1.0


class NgramCalibrator:
    """Conditional acceptance of an n-gram draft by (suffix-match length, prompt-output overlap, position)."""

    PRIOR = {1: 0.25, 2: 0.4, 3: 0.55}

    def __init__(self, prior: float = 2.0, decay: float = 0.997) -> None:
        self.prior, self.decay = prior, decay
        self.stats: dict[tuple[int, int, int], list[float]] = {}

    @staticmethod
    def key(match: int, overlap: float, pos: int) -> tuple[int, int, int]:
        return min(match, 3), int(overlap >= 0.5), min(pos, 7)

    def __call__(self, match: int, overlap: float, pos: int) -> float:
        k = self.key(match, overlap, pos)
        a, n = self.stats.get(k, (0.0, 0.0))
        return (a + self.prior * self.PRIOR[k[0]]) / (n + self.prior)

    def update(self, match: int, overlap: float, pos: int, accepted: bool) -> None:
        s = self.stats.setdefault(self.key(match, overlap, pos), [0.0, 0.0])
        s[0] = s[0] * self.decay + accepted
        s[1] = s[1] * self.decay + 1.0


@dataclass
class DraftPlan:
    """Everything the stopping rule needs, as plain numbers (it also travels to a remote drafter)."""

    k: int  # most drafts per row
    cost: list[float]  # seconds of a round verifying L = 1..k+1 tokens (bookkeeping included)
    step_cost: float  # seconds of one drafter step
    rate: float  # tokens/s (all rows) that time is worth: max(plain rate, the loop's recent rate)
    base: list[list[float]]  # per row: prefix sums of the n-gram proposal's P (base[r][0] == 0)
    caps: list[int]  # per row: most useful drafts (remaining budget - 1); -1 = finished row
    calib: list[float] = field(default_factory=list)  # the model drafter: raw confidence bin -> acceptance
    fixed: bool = False  # draft exactly k, verify k+1: the classic fixed-k loop
    ahead: list[float] = field(default_factory=list)  # per row: most remaining tokens / its remaining (>= 1)
    margin: float = 0.1  # drafting must beat a plain step by this share of a step's tokens (estimates are noisy)
    row_scale: list[float] = field(default_factory=list)  # per row: observed / predicted model drafter acceptance

    def to_dict(self) -> dict:
        return asdict(self)

    def conditional(self, raw: float, row: int = 0) -> float:
        p = raw if not self.calib else self.calib[min(max(int(raw * len(self.calib)), 0), len(self.calib) - 1)]
        return min(1.0, p * self.row_scale[row]) if self.row_scale else p

    def best(self, model: list[list[float]] | None) -> tuple[float, int]:
        """(value, verify length) of the best L given the model drafter's prefix sums per row (or None)."""
        top_value, top_len = float("-inf"), 1
        ahead = self.ahead
        for length in range(1, len(self.cost) + 1):
            tokens = float("inf")  # progress of the row that finishes last, in its own tokens
            for r, cap in enumerate(self.caps):
                if cap < 0:
                    continue
                m = min(length - 1, cap)
                g = self.base[r]
                gain = g[min(m, len(g) - 1)]
                if model is not None:
                    e = model[r]
                    gain = max(gain, e[min(m, len(e) - 1)])
                tokens = min(tokens, (1.0 + gain) * (ahead[r] if ahead else 1.0))
            if tokens == float("inf"):
                return 0.0, 1
            value = tokens - self.rate * self.cost[length - 1]
            if length == 1:
                plain = value + self.margin * tokens  # what drafting has to beat
                top_value = value
            elif value > max(top_value, plain) + 1e-12:
                top_value, top_len = value, length
        return top_value, top_len

    def add_step(self, prefix: list[list[float]], cum: list[float], raw: list[float]) -> bool:
        """Fold one drafter step's raw acceptance estimates (one per row) into the rows' running products `cum`
        and prefix sums `prefix` (both updated in place); True if one more step would pay for itself."""
        cond = [self.conditional(c, r) for r, c in enumerate(raw)]
        for r, c in enumerate(cond):
            cum[r] *= c
            prefix[r].append(prefix[r][-1] + cum[r])
        return self.worth_another(prefix, cond)

    def worth_another(self, model: list[list[float]], cond: list[float]) -> bool:
        """Would one more model drafter step gain more than its cost, if its conditional acceptance matched the last
        one?"""
        now, _ = self.best(model)
        longer = [e + [e[-1] + (e[-1] - e[-2]) * c] if len(e) > 1 else e for e, c in zip(model, cond, strict=True)]
        nxt, _ = self.best(longer)
        return nxt - now > self.rate * self.step_cost


class RowFix:
    """Per row of one call: observed / predicted acceptance, shrunk towards 1. A calibration learned over many
    rows over-promises for a row that keeps rejecting (and in a batch those rows are the ones everyone waits for)."""

    def __init__(self, batch: int, prior: float = 4.0) -> None:
        self.prior = prior
        self.obs = [0.0] * batch
        self.pred = [0.0] * batch

    def update(self, row: int, predicted: float, accepted: bool) -> None:
        self.obs[row] += accepted
        self.pred[row] += predicted

    def scale(self) -> list[float]:
        return [(o + self.prior) / (p + self.prior) for o, p in zip(self.obs, self.pred, strict=True)]


@dataclass
class Choice:
    """What a round verifies: L, and per row the method ('model', 'ngram' or 'none') and drafts offered."""

    length: int
    methods: list[str]
    k_rows: list[int]


class Scheduler:
    """Per-decoder state: calibration (kept across calls, slowly forgotten) and the model drafter's consult backoff.

    Whether asking the model drafter pays depends on what n-gram lookup already offers that round: next to a long,
    likely copy its drafts add little, where n-gram has nothing they may be all the round gains. One average
    over all rounds let the first kind back the model drafter off in the second. So the backoff is kept per context,
    the n-gram's expected accepted drafts in bands (`context`), and each context learns on its own."""

    MAX_BACKOFF = 64
    # A new call starts at most this far into a backoff: whether consulting pays differs more between prompts than
    # between rounds of one. Kept across calls, one prompt whose drafts were all rejected backed EAGLE-3 (alone,
    # scheduled) off to 64 rounds for the calls after it; each of their rare consults then lost again (a consult's
    # fixed costs, the drafter's catch-up and the bus, against one or two drafts), so the later calls drafted
    # almost nothing where a fixed k ran 1.25x the plain loop (third-party code: 5 of 24 calls drafting).
    CALL_BACKOFF = 4
    CALL_KEEP = 0.5  # ...and weighs the verdict of earlier calls (other prompts) by this
    # Each consult's verdict moves the running one by 1 - VERDICT_KEEP. A consult's net swings with the round (its
    # drafts' confidence; one draft or five), so at 0.5 two low-confidence rounds backed EAGLE-3 off through the
    # good ones after them; A/B in docs/benchmarks.md ("The scheduler's give-up").
    VERDICT_KEEP = 0.8
    BANDS = (0.5, 1.5)  # expected accepted n-gram drafts of the round's slowest row: < 0.5, < 1.5, more

    def __init__(self, k: int, *, fixed: bool = False) -> None:
        self.k, self.fixed = k, fixed
        self.model_calib = {"greedy": Calibrator(), "sample": Calibrator()}
        # per mode, as the model drafter's: a greedy call's n-gram drafts are accepted far more often than a sampled
        # one's
        self.ngram_calib = {"greedy": NgramCalibrator(), "sample": NgramCalibrator()}
        self.alt_calib = {"greedy": AltCalibrator(), "sample": AltCalibrator()}  # n-gram trees' alternatives
        self.reset()

    def reset(self) -> None:
        """Forget everything: consult the model drafter at once."""
        n = len(self.BANDS) + 1  # unknown: the first consult in each context decides
        self.backoff, self.wait, self.net = [1] * n, [0] * n, [0.0] * n

    @classmethod
    def context(cls, base: list[list[float]], caps: list[int]) -> int:
        """The round's band: the least any live row expects to gain from its n-gram proposal."""
        least = min((g[-1] for g, c in zip(base, caps, strict=True) if c >= 0), default=0.0)
        return sum(least >= b for b in cls.BANDS)

    @property
    def rest(self) -> int:
        """Rounds until the model drafter is asked again in the context that asks soonest."""
        return min(self.wait)

    def new_call(self) -> None:
        """A new generate call keeps what earlier calls learned about whether consulting pays, weighed by CALL_KEEP
        (another prompt), and starts at most CALL_BACKOFF rounds into its backoff."""
        self.net = [self.CALL_KEEP * net for net in self.net]
        self.backoff = [min(b, self.CALL_BACKOFF) for b in self.backoff]
        self.wait = [0 if net > 0 else min(w, b - 1) for net, w, b in zip(self.net, self.wait, self.backoff,
                                                                             strict=True)]

    def consult_model(self, ctx: int = 0) -> bool:
        if self.fixed or self.wait[ctx] <= 0:
            return True
        self.wait[ctx] -= 1
        return False

    def consulted(self, net: float, ctx: int = 0) -> None:
        """After a consult: `net` = tokens the round gained from the model drafter's drafts minus what its time would
        have earned. While that pays on average, ask every round; otherwise back off exponentially."""
        self.net[ctx] = self.VERDICT_KEEP * self.net[ctx] + (1.0 - self.VERDICT_KEEP) * net
        self.backoff[ctx] = 1 if self.net[ctx] > 0 else min(2 * self.backoff[ctx], self.MAX_BACKOFF)
        self.wait[ctx] = self.backoff[ctx] - 1

    def ngram_prefix(self, props: list[list[int]], match: list[int], overlap: list[float],
                     scale: list[float], mode: str) -> list[list[float]]:
        calib = self.ngram_calib[mode]
        out = []
        for prop, m, o, f in zip(props, match, overlap, scale, strict=True):
            pref, cum = [0.0], 1.0
            for i in range(len(prop)):
                cum *= min(1.0, calib(m, o, i) * f)
                pref.append(pref[-1] + cum)
            out.append(pref)
        return out

    def choose(self, plan: DraftPlan, model: list[list[float]] | None, props: list[list[int]],
               n_model: int) -> Choice:
        caps = plan.caps
        if self.fixed:
            length = plan.k + 1
        else:
            _, length = plan.best(model)
        methods, k_rows = [], []
        for r, cap in enumerate(caps):
            m = max(min(length - 1, cap), 0)
            g = plan.base[r][min(m, len(plan.base[r]) - 1)]
            e = model[r][min(m, len(model[r]) - 1)] if model is not None else -1.0
            if cap < 0 or m == 0 or (e <= 0 and not props[r]):
                methods.append("none")
                k_rows.append(0)
            elif model is not None and (e >= g or not props[r]):
                methods.append("model")
                k_rows.append(min(m, n_model))
            else:
                methods.append("ngram")
                k_rows.append(min(m, len(props[r])))
        if self.fixed:  # the classic loop offers every draft it made
            k_rows = [0 if c < 0 else (n_model if mt == "model" else len(p) if mt == "ngram" else 0)
                      for c, mt, p in zip(caps, methods, props, strict=True)]
            length = max(k_rows, default=0) + 1
        else:
            length = max(k_rows, default=0) + 1  # never verify slots no row offers
        return Choice(length, methods, k_rows)
