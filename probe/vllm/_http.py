"""A vLLM server's workers over HTTP: its dev-mode `/collective_rpc` route as an engine `attach` takes.

    engine = HttpEngine("http://127.0.0.1:8000")     # the server: VLLM_SERVER_DEV_MODE=1, the extension
    session = probe.vllm.attach(engine, "layers.*.resid_post")
    probe.vllm.list_sites(engine)

`probebus attach --vllm URL` is this from the command line (`probebus/_cmd_vllm.py`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request


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
