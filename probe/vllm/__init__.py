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
and `attach` / `close()` switch them on and off (`_compiled.py`): the extension
must be there from the engine's start, which it is whenever `ENGINE_KWARGS` is. A
server started with `--worker-extension-cls probe.vllm.WorkerExtension` (and vLLM's
dev-mode `/collective_rpc` route) is attached with `probebus attach --vllm URL`.
Importing `probe` never imports vLLM; this module imports it only inside the worker.
The worker side is `_worker.py` (`_extension.py` its RPC entry); the caller's, `_client.py`.
"""

from __future__ import annotations

from .._subscriber import Subscriber
from ._client import VllmSession, attach, list_sites
from ._common import ALLOW_REMOTE_ENV, ENGINE_KWARGS, EXTENSION
from ._compiled import watch
from ._extension import WorkerExtension
from ._http import HttpEngine

# In a worker vLLM imports this package (the extension) before it builds the model: from then on a model it will
# compile gets probebus's taps before the compile (`_compiled.py`). Elsewhere this only registers a hook
# that looks at each submodule assignment and returns.
watch(WorkerExtension)

__all__ = ["ALLOW_REMOTE_ENV", "ENGINE_KWARGS", "EXTENSION", "HttpEngine", "Subscriber", "VllmSession",
           "WorkerExtension", "attach", "list_sites"]
