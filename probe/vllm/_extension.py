"""The worker side's entry: vLLM mixes `WorkerExtension` into each worker class, and every method is an RPC target.

    LLM(model=path, worker_extension_cls="probe.vllm.WorkerExtension")   # = **probe.vllm.ENGINE_KWARGS
    llm.collective_rpc("probebus_attach", args=(sites, endpoint, ...))    # what `probe.vllm.attach` sends
    llm.collective_rpc("probebus_detach")                                 # what `close()` sends

Each method runs in a worker and hands on to its `VllmProbe` (`_worker.py`); the class is public
as `probe.vllm.WorkerExtension` (the path vLLM imports, `_common.EXTENSION`).
"""

from __future__ import annotations

import json
import os

from .._hooks import tapped
from .._publisher import MAX_DELAY_S
from .._sites import expand_sites
from ._arch import SiteView, VllmArch
from ._common import ALLOW_REMOTE_ENV
from ._worker import VllmProbe


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
        if allow_remote and os.environ.get(ALLOW_REMOTE_ENV) != "1":
            # The caller may be any client of a server's HTTP route: exposing the activations (other clients'
            # prompts) beyond this machine is the operator's decision, made when the engine starts.
            raise PermissionError(f"this vLLM engine does not let a client bind a non-loopback endpoint "
                                  f"(allow_remote): its operator allows that by starting it with {ALLOW_REMOTE_ENV}=1")
        if getattr(self, "_probebus", None) is not None:
            raise RuntimeError("probebus is already attached to this engine; close that session first")
        arch = VllmArch(self.model_runner.get_model())  # type: ignore[attr-defined]
        wanted = expand_sites(SiteView(arch), sites)
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
        dormant taps, `_compiled.py`)."""
        return tapped(self.model_runner.get_model())  # type: ignore[attr-defined]

    def probebus_sites(self) -> list[str]:
        return VllmArch(self.model_runner.get_model()).sites()  # type: ignore[attr-defined]
