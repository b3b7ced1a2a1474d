"""Attach to a vLLM engine from the caller's process: `attach`, `list_sites` and the session they return.

    session = attach(llm, "layers.*.resid_post")   # an LLM, or anything with collective_rpc (`HttpEngine`)
    session.endpoint, session.sites, session.stats
    session.pause(); session.resume(); session.close()

Everything here travels through the engine's `collective_rpc` to `WorkerExtension` (`_extension.py`)
as plain JSON-like values; this side never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._arch import LAYER_SITES
from .._curve import Clients, curve_settings
from .._endpoint import check_endpoint
from .._publisher import MAX_DELAY_S
from .._stats import POLICIES, ProbeStats
from ._common import new_run


class VllmSession:
    """Probes attached to a vLLM engine; the same surface as `probe.ProbeSession`."""

    def __init__(self, rpc: Any, results: list[dict], *, run: str, policy: str) -> None:
        self._rpc = rpc
        self.run = run
        self.policy = policy
        self.workers = results
        self.endpoints = [r["endpoint"] for r in results if r.get("publishing")]
        self.sites = sorted({s for r in results for s in r["sites"]}, key=_site_order)
        self._closed = False
        self._paused = False
        self._final: ProbeStats | None = None

    @property
    def endpoint(self) -> str | list[str]:
        """Where subscribers connect: one endpoint, or one per pipeline stage."""
        return self.endpoints[0] if len(self.endpoints) == 1 else list(self.endpoints)

    @property
    def stats(self) -> ProbeStats:
        if self._final is not None:
            return self._final
        return _sum_stats(self._rpc("probebus_stats"))

    @property
    def info(self) -> dict:
        """The session info of the first publishing worker (with the request map)."""
        return next((i for i in self._rpc("probebus_info") if i.get("endpoint")), {})

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Take every hook off the engine's model until `resume()`, without a detach: its steps run
        unprobed and publish nothing, subscribers stay connected, and what was held goes out now.

            session.pause()
            llm.generate(...)     # not captured, at the engine's own speed
            session.resume()
        """
        if self._closed:
            raise RuntimeError("this probe session is closed")
        self._rpc("probebus_pause")
        self._paused = True

    def resume(self) -> None:
        """Put back the hooks `pause()` took off."""
        if self._paused and not self._closed:
            self._rpc("probebus_resume")
            self._paused = False

    def wait_for_subscribers(self, n: int = 1, timeout: float | None = 10.0) -> int:
        got = self._rpc("probebus_wait_for_subscribers", n, timeout)
        counts = [c for c, w in zip(got, self.workers, strict=True) if w.get("publishing")]
        if any(c < n for c in counts):
            raise TimeoutError(f"only {min(counts)} of {n} subscribers connected to {self.endpoint} within {timeout}s")
        return min(counts) if counts else n

    def close(self, timeout: float = 30.0) -> ProbeStats:
        if not self._closed:
            self._closed = True
            self._final = _sum_stats(self._rpc("probebus_detach", timeout))
        return self.stats

    def __enter__(self) -> VllmSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VllmSession({len(self.sites)} sites, {self.policy}, {self.endpoint})"


def _site_order(site: str) -> tuple[int, int, str]:
    if site == "embed":
        return (0, 0, site)
    if site == "final_norm":
        return (2, 0, site)
    _, i, name = site.split(".")
    return (1, int(i), str(LAYER_SITES.index(name)) if name in LAYER_SITES else name)


def _sum_stats(items: list[dict]) -> ProbeStats:
    pub = [s for s in items if s.get("publishing")]
    return ProbeStats(
        captured=sum(s["captured"] for s in pub), published=sum(s["published"] for s in pub),
        dropped=sum(s["dropped"] for s in pub), bytes=sum(s["bytes"] for s in pub),
        stall_seconds=sum(s["stall_seconds"] for s in pub), subscribers=min((s["subscribers"] for s in pub),
                                                                           default=0),
        queued=sum(s.get("queued", 0) for s in pub), degraded=any(s["degraded"] for s in pub))


def _rpc_of(llm: Any) -> Any:
    """A `call(method, *args)` over the engine's workers, or a clear error without the extension."""
    def call(method: str, *args: Any) -> list:
        try:
            return llm.collective_rpc(method, args=args)
        except AttributeError as exc:
            if method in str(exc):
                raise RuntimeError(
                    "this vLLM engine has no probebus extension: create it with "
                    "LLM(..., **probe.vllm.ENGINE_KWARGS) (worker_extension_cls='probe.vllm.WorkerExtension'), "
                    "or start the server with --worker-extension-cls probe.vllm.WorkerExtension") from None
            raise
    return call


def attach(llm: Any, sites: str | Iterable[str], *, endpoint: str | None = None, policy: str = "complete",
           capacity_bytes: int = 64 << 20, stall_timeout: float | None = 60.0, run: str | None = None,
           io_cpus: Iterable[int] | None = None, max_delay: float = MAX_DELAY_S,
           allow_remote: bool = False, curve_secret_key: bytes | str | None = None,
           curve_clients: Clients = None) -> VllmSession:
    """Attach probes to every worker of a running vLLM engine (an `LLM`, or anything with
    `collective_rpc(method, args=...)`); see `probe.attach` for the other arguments.

    `io_cpus`: the cores for the bus's background threads (ZeroMQ's I/O thread and the control
    thread) in each worker. By default, the cores the engine may use but the worker is not bound
    to (a CPU worker binds itself to VLLM_CPU_OMP_THREADS_BIND); `[]` leaves them on the worker's.
    `max_delay`: as in `probe.attach` (steps held for a later send while no subscriber is live).
    `allow_remote`: as in `probe.attach`: a TCP endpoint other than loopback is refused without it (each
    worker checks too, for a server attached through its HTTP route), and the workers take it only when the
    engine was started with PROBEBUS_ALLOW_REMOTE=1 in its environment (`ALLOW_REMOTE_ENV`): any client of a
    server's HTTP route could otherwise expose every request's activations.
    `curve_secret_key`, `curve_clients`: as in `probe.attach`. The secret key travels to the workers
    through the engine's RPC (its own IPC offline; the dev-mode HTTP route for a server)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if endpoint is not None:
        check_endpoint(endpoint, allow_remote)  # here too: a clear error before any worker is asked
    secret, clients = curve_settings(curve_secret_key, curve_clients)  # as text: the RPC routes carry JSON
    secret_text = None if secret is None else secret.decode()
    client_texts = None if clients is None else sorted(k.decode() for k in clients)
    names = [sites] if isinstance(sites, str) else list(sites)
    run = run or new_run()
    rpc = _rpc_of(llm)
    model = _model_name(llm)
    cpus = None if io_cpus is None else sorted(int(c) for c in io_cpus)
    results = rpc("probebus_attach", names, endpoint, policy, run, capacity_bytes, stall_timeout, model, cpus,
                  max_delay, allow_remote, secret_text, client_texts)
    return VllmSession(rpc, results, run=run, policy=policy)


def list_sites(llm: Any) -> list[str]:
    """Every site of the engine's model."""
    return _rpc_of(llm)("probebus_sites")[0]


def _model_name(llm: Any) -> str:
    try:
        return str(llm.llm_engine.model_config.model)
    except AttributeError:
        return getattr(llm, "url", "")
