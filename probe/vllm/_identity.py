"""Which request, position, token and phase each row of vLLM's flat batch is, step by step.

    flat = FlatBatchIdentity()
    idents = flat.step(runner, args, kwargs)  # the model's forward pre-hook: one StepIdentity per phase present
    flat.new_requests()                    # request-map entries of requests that started since the last call
    flat.requests()                        # the whole map, {"<seq_id>": {"seq_id", "request_id", "first_position",
                                           #   "cached_positions", "joined"}}
    flat.watch(runner.requests)            # at attach and resume: the requests that ran before, unobserved

Before each forward the model runner has already laid out, on the host, which request each
token belongs to (`query_start_loc`), how many of its tokens were computed before
(`num_computed_tokens`) and its prompt length:

- a token's position is its request's computed count plus its index in the chunk; a
  prefix-cache hit starts the first chunk past the cached prefix, so those positions never
  appear, and each request's first published position is in the request map. Two causes
  of a first position past 0 are told apart there: `cached_positions`, the prefix-cache hit
  of a request the session saw start, and `joined`, a request already running when the
  session started watching (attach, or resume after a pause), whose earlier positions were
  computed unobserved;
- phase: prefill while the position is inside the prompt, decode after it;
- a request that is preempted and recomputed would compute positions it already published:
  they are skipped (never duplicated) and counted (`recomputed`);
- padding tokens past the scheduled count are never published.

Per-request work is C-level iteration (`map` over dicts, `dict.update`), not a Python loop:
a serving engine steps with hundreds of requests, and a loop per request cost the worker's
thread too much a step. The common step, every running request decoding one token, stays in
lists: inside a running model a numpy call runs cold between layers, where a list operation
costs far less (both: docs/design.md, "Costs behind the code").
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from itertools import compress, repeat
from operator import add, lt

import numpy as np
import torch

from .._identity import DECODE, PREFILL, StepIdentity

MAX_REQUESTS = 10_000  # request-map entries kept (oldest dropped first), and sent in the session info


class FlatBatchIdentity:
    def __init__(self) -> None:
        self.step_count = 0
        self.recomputed = 0
        self._entries: OrderedDict[str, dict] = OrderedDict()  # vLLM request id -> its request-map entry
        self._sid: dict[str, int] = {}  # vLLM request id -> seq_id (the lookups of every step)
        self._next_pos: dict[str, int] = {}  # vLLM request id -> the first position not yet published
        self._next_seq_id = 0
        self._new: dict[str, dict] = {}
        # The requests the runner held when the session started watching (attach, resume): one of them that
        # computed positions before its first observed step ran unobserved (`joined`); any other request that
        # did hit the prefix cache (`cached_positions`).
        self._before: set[str] = set()

    def watch(self, running: object) -> None:
        """The session starts (again) to see every step: `running`, the ids of the requests the runner holds now
        (`runner.requests`), may have computed positions it never saw."""
        try:
            self._before = set(running)  # type: ignore[call-overload]
        except TypeError:  # a runner without the map: every start past 0 counts as a cache hit, as before
            self._before = set()

    def step(self, runner: object, args: tuple, kwargs: dict) -> list[StepIdentity]:
        """This step's identities (one per phase present), from the runner's host arrays; `args`, `kwargs`: the
        model forward's (its rows may be padded past the scheduled tokens)."""
        ib = runner.input_batch  # type: ignore[attr-defined]
        nreq = ib.num_reqs
        qsl = runner.query_start_loc.np[: nreq + 1]  # type: ignore[attr-defined]
        n = int(qsl[nreq])
        padded = _num_tokens(args, kwargs, n)
        if n == nreq == padded and n:
            fast = self._decode(runner, ib, qsl, n)
            if fast is not None:
                return [fast]
        rids = ib.req_ids[:nreq]
        lens = np.diff(qsl)
        computed = ib.num_computed_tokens_cpu[:nreq].astype(np.int64)
        seq_ids = np.fromiter(map(self._sid.get, rids, repeat(-1)), np.int64, nreq)
        scheduled = lens > 0
        for i in np.flatnonzero(scheduled & (seq_ids < 0)).tolist():  # requests that start now
            seq_ids[i] = self._start(rids[i], int(computed[i]))
        req_index = np.repeat(np.arange(nreq), lens)
        starts = qsl[:-1]
        pos = computed[req_index] + (np.arange(n) - starts[req_index])
        # A preempted request computes again positions it published before: those rows are skipped.
        nxt = np.fromiter(map(self._next_pos.get, rids, repeat(0)), np.int64, nreq)
        keep = pos >= nxt[req_index]
        self.recomputed += n - int(np.count_nonzero(keep))
        self._next_pos.update(zip(compress(rids, scheduled.tolist()),
                                  np.maximum(nxt, computed + lens)[scheduled].tolist(), strict=True))
        tokens = runner.input_ids.np[:n].astype(np.int64, copy=False)  # type: ignore[attr-defined]
        prefill = pos < ib.num_prompt_tokens[:nreq][req_index]
        self.step_count += 1
        row_ids = seq_ids[req_index]
        out = []
        for phase, mask in ((PREFILL, prefill & keep), (DECODE, ~prefill & keep)):
            if mask.any():
                out.append(_flat(self.step_count, phase, padded, n, mask, row_ids, pos, tokens,
                                 runner.device))  # type: ignore[attr-defined]
        return out

    def _decode(self, runner: object, ib: object, qsl: np.ndarray, n: int) -> StepIdentity | None:
        """Every request decodes one token, none new, none recomputed: identity in lists (None: the general
        path). Nothing is changed before every check has passed."""
        if qsl.tolist() != list(range(n + 1)):
            return None
        rids = ib.req_ids[:n]  # type: ignore[attr-defined]
        seq_ids = list(map(self._sid.get, rids, repeat(-1)))
        if -1 in seq_ids:  # a new request
            return None
        pos = ib.num_computed_tokens_cpu[:n].tolist()  # type: ignore[attr-defined]
        if any(map(lt, pos, ib.num_prompt_tokens[:n].tolist())):  # type: ignore[attr-defined]  # in its prompt
            return None
        if any(map(lt, pos, map(self._next_pos.get, rids, repeat(0)))):  # recomputed
            return None
        self._next_pos.update(zip(rids, map(add, pos, repeat(1)), strict=True))
        tok = runner.input_ids.np[:n].tolist()  # type: ignore[attr-defined]
        self.step_count += 1
        return StepIdentity(self.step_count, DECODE, n, 1, None, np.asarray(seq_ids, dtype=np.int64), None, None,
                            runner.device, {1: (None, array("q", seq_ids + pos + tok).tobytes(), n)})  # type: ignore[attr-defined]

    def _start(self, rid: str, first: int) -> int:
        """A request's first observed step: its seq_id and request-map entry. `first` positions were computed
        before it: in steps the session did not see (a request running when it started watching), or none, and
        the prefix cache served them."""
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        joined = first > 0 and rid in self._before
        self._before.discard(rid)
        entry = self._entries[rid] = {"seq_id": seq_id, "first_position": first, "request_id": _external_id(rid),
                                      "cached_positions": 0 if joined else first, "joined": joined}
        self._sid[rid] = seq_id
        self._new[str(seq_id)] = entry
        if len(self._entries) > MAX_REQUESTS:
            old, _ = self._entries.popitem(last=False)
            self._sid.pop(old, None)
            self._next_pos.pop(old, None)
        return seq_id

    def new_requests(self) -> dict[str, dict]:
        """Entries of the requests that started since the last call, by seq_id (as text: JSON keys)."""
        new, self._new = self._new, {}
        return new

    def requests(self) -> dict[str, dict]:
        """The whole map (its last MAX_REQUESTS entries), by seq_id. list() first: one C call, so another
        thread (the bus's control thread, building an info) may call this while the model steps."""
        return {str(v["seq_id"]): v for v in list(self._entries.values())}


def _num_tokens(args: tuple, kwargs: dict, n: int) -> int:
    """Rows of this forward (the scheduled tokens plus any padding vLLM added)."""
    for a in (*args[:2], kwargs.get("input_ids"), kwargs.get("positions")):
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return int(a.shape[-1] if a.dim() == 2 else a.shape[0])  # M-RoPE positions are [3, T]
    return n


def _flat(step: int, phase: int, padded: int, n: int, mask: np.ndarray, seq_ids: np.ndarray, pos: np.ndarray,
          tokens: np.ndarray, device: object) -> StepIdentity:
    """The flat batch as [padded, 1]: one row per token, each with its own request, position and id."""
    valid = np.zeros((padded, 1), dtype=bool)
    valid[:n, 0] = mask
    full_ids = np.full(padded, -1, dtype=np.int64)
    full_ids[:n] = seq_ids
    full_pos = np.zeros((padded, 1), dtype=np.int64)
    full_pos[:n, 0] = pos
    full_tok = np.full((padded, 1), -1, dtype=np.int64)
    full_tok[:n, 0] = tokens
    return StepIdentity(step, phase, padded, 1, valid, full_ids, full_pos, full_tok, device)  # type: ignore[arg-type]


def _external_id(rid: str) -> str:
    """The id the caller gave: vLLM 0.32 appends "-" and 8 random characters inside the engine."""
    head, _, tail = rid.rpartition("-")
    return head if head and len(tail) == 8 else rid
