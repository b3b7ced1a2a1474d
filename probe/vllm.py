"""probebus on a vLLM engine: the same sites, wire format and subscribers, captured in vLLM's workers.

    from vllm import LLM
    import probe.vllm

    llm = LLM(model=path, **probe.vllm.ENGINE_KWARGS)  # compiled (vLLM's default) or enforce_eager=True
    with probe.vllm.attach(llm, "layers.*.resid_post") as session:
        sub = probe.Subscriber(session.endpoint)       # or probebus record --endpoint / probebus top
        session.wait_for_subscribers(1)
        llm.generate(prompts, params)
    for cap in sub:                                    # per token, while requests run
        cap.seq_ids, cap.positions, cap.phase          # seq_id -> request: sub.info requests map

`ENGINE_KWARGS` enables `WorkerExtension` in every worker; `attach` then installs the
hooks through `llm.collective_rpc` and `close()` removes them, without a restart. In vLLM's
default compiled mode the extension puts dormant taps in the model before vLLM compiles it,
and `attach` / `close()` switch them on and off (`probe/_vllm_compiled.py`): the extension
must be there from the engine's start, which it is whenever `ENGINE_KWARGS` is. A
server started with `--worker-extension-cls probe.vllm.WorkerExtension` (and vLLM's
dev-mode `/collective_rpc` route) is attached with `probebus attach --vllm URL`.
Importing `probe` never imports vLLM; this module imports it only inside the worker.
The worker side is `probe/_vllm_worker.py`.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

from ._curve import Clients, curve_settings
from ._endpoint import check_endpoint
from ._publisher import MAX_DELAY_S
from ._session import POLICIES, ProbeStats
from ._subscriber import Subscriber
from ._vllm_compiled import EXTENSION, watch

# In a worker vLLM imports this module (the extension) before it builds the model: from then on a model it will
# compile gets probebus's taps before the compile (`_vllm_compiled.py`). Elsewhere this only registers a hook
# that looks at each submodule assignment and returns.
watch()
# Set to 1 in the engine's environment (a server's, at its start) to let `attach(allow_remote=True)` bind a
# non-loopback endpoint in its workers; without it a worker refuses, whoever asks (the HTTP route has no auth).
ALLOW_REMOTE_ENV = "PROBEBUS_ALLOW_REMOTE"
ENGINE_KWARGS: dict[str, Any] = {"worker_extension_cls": EXTENSION}


class WorkerExtension:
    """Mixed into each vLLM worker class; every method is a `collective_rpc` target.

    Names start with `probebus_` so they never collide with the worker's own attributes.
    Arguments and results are plain JSON-like values (vLLM serializes them with msgpack).
    """

    def probebus_attach(self, sites: list[str], endpoint: str | None, policy: str, run: str,
                        capacity_bytes: int, stall_timeout: float | None, model_name: str,
                        io_cpus: list[int] | None = None, max_delay: float = MAX_DELAY_S,
                        allow_remote: bool = False, curve_secret_key: str | None = None,
                        curve_clients: list[str] | None = None) -> dict:
        from ._sites import expand_sites
        from ._vllm_worker import VllmArch, VllmProbe

        if allow_remote and os.environ.get(ALLOW_REMOTE_ENV) != "1":
            # The caller may be any client of a server's HTTP route: exposing the activations (other clients'
            # prompts) beyond this machine is the operator's decision, made when the engine starts.
            raise PermissionError(f"this vLLM engine does not let a client bind a non-loopback endpoint "
                                  f"(allow_remote): its operator allows that by starting it with {ALLOW_REMOTE_ENV}=1")
        if getattr(self, "_probebus", None) is not None:
            raise RuntimeError("probebus is already attached to this engine; close that session first")
        arch = VllmArch(self.model_runner.get_model())  # type: ignore[attr-defined]
        wanted = expand_sites(_SiteView(arch), sites)
        probe = VllmProbe(self, wanted, endpoint=endpoint, policy=policy, run=run, capacity_bytes=capacity_bytes,
                          stall_timeout=stall_timeout, model_name=model_name, io_cpus=io_cpus,
                          max_delay=max_delay, allow_remote=allow_remote, curve_secret_key=curve_secret_key,
                          curve_clients=curve_clients)
        self._probebus = probe
        return {"endpoint": probe.endpoint, "sites": probe.sites, "tp_rank": probe.tp_rank,
                "pp_rank": probe.pp_rank, "publishing": probe.publishing}

    def probebus_attach_json(self, spec: str) -> dict:
        """`probebus_attach` with its arguments as one JSON object: vLLM's HTTP `/collective_rpc`
        route (a server in dev mode) passes only strings."""
        a = json.loads(spec)
        return self.probebus_attach(a["sites"], a.get("endpoint"), a.get("policy", "complete"), a["run"],
                                    int(a.get("capacity_bytes", 64 << 20)), a.get("stall_timeout", 60.0),
                                    a.get("model_name", ""), a.get("io_cpus"), float(a.get("max_delay", MAX_DELAY_S)),
                                    bool(a.get("allow_remote", False)), a.get("curve_secret_key"),
                                    a.get("curve_clients"))

    def probebus_detach(self, timeout: float = 30.0) -> dict:
        probe = getattr(self, "_probebus", None)
        self._probebus = None
        return probe.close(timeout) if probe is not None else {}

    def probebus_pause(self) -> None:
        probe = getattr(self, "_probebus", None)
        if probe is not None:
            probe.pause()

    def probebus_resume(self) -> None:
        probe = getattr(self, "_probebus", None)
        if probe is not None:
            probe.resume()

    def probebus_stats(self) -> dict:
        probe = getattr(self, "_probebus", None)
        return probe.stats() if probe is not None else {}

    def probebus_info(self) -> dict:
        probe = getattr(self, "_probebus", None)
        return probe.info() if probe is not None else {}

    def probebus_wait_for_subscribers(self, n: int, timeout: float | None) -> int:
        probe = getattr(self, "_probebus", None)
        return probe.wait_for_subscribers(n, timeout) if probe is not None else 0

    def probebus_hook_count(self) -> int:
        """Hooks and taps on the model's modules (0 once detached from an eager engine; a compiled engine keeps its
        dormant taps, `_vllm_compiled.py`)."""
        from ._hooks import tapped

        return tapped(self.model_runner.get_model())  # type: ignore[attr-defined]

    def probebus_sites(self) -> list[str]:
        from ._vllm_worker import VllmArch

        return VllmArch(self.model_runner.get_model()).sites()  # type: ignore[attr-defined]


class _SiteView:
    """What `expand_sites` needs of an architecture, for a vLLM model."""

    def __init__(self, arch: object) -> None:
        self._arch = arch
        self.family = arch.family  # type: ignore[attr-defined]
        self.n_layers = arch.n_layers  # type: ignore[attr-defined]

    def sites(self) -> list[str]:
        return self._arch.sites()  # type: ignore[attr-defined]

    def layer_site_names(self) -> tuple[str, ...]:
        from ._arch import LAYER_SITES

        return LAYER_SITES

    def describe(self) -> str:
        from ._arch import LAYER_SITES

        return (f"available sites: embed, layers.{{0..{self.n_layers - 1}}}.{{{', '.join(LAYER_SITES)}}}, "
                "final_norm (logits are computed outside vLLM's model forward and are not offered)")


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
    from ._arch import LAYER_SITES

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


class HttpEngine:
    """A vLLM server seen through its dev-mode `/collective_rpc` route (VLLM_SERVER_DEV_MODE=1),
    with the `collective_rpc` surface `attach` needs: `attach(HttpEngine(url), sites)`."""

    def __init__(self, url: str, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if method == "probebus_attach":  # the route passes strings only
            keys = ("sites", "endpoint", "policy", "run", "capacity_bytes", "stall_timeout", "model_name", "io_cpus",
                    "max_delay", "allow_remote", "curve_secret_key", "curve_clients")
            method, args = "probebus_attach_json", (json.dumps(dict(zip(keys, args, strict=True))),)
        elif method in ("probebus_detach", "probebus_wait_for_subscribers"):
            args = ()  # defaults on the worker side (strings would not do for numbers)
        body = json.dumps({"method": method, "args": list(args), "timeout": self.timeout}).encode()
        req = urllib.request.Request(f"{self.url}/collective_rpc", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}").get("results", [])
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            if exc.code == 404:
                raise RuntimeError(f"{self.url} has no /collective_rpc route: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                                   "and --worker-extension-cls probe.vllm.WorkerExtension") from None
            if "probebus_" in detail and "attribute" in detail:
                raise AttributeError(f"{method}: {detail}") from None
            raise RuntimeError(f"{self.url}/collective_rpc answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise RuntimeError(f"cannot reach the vLLM server at {self.url}: {exc}") from None


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
    from ._vllm_worker import new_run

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


__all__ = ["ALLOW_REMOTE_ENV", "ENGINE_KWARGS", "EXTENSION", "HttpEngine", "Subscriber", "VllmSession",
           "WorkerExtension", "attach", "list_sites"]
