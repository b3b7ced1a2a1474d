"""What both sides of probebus on vLLM name: the caller's `attach` and the worker's extension.

    LLM(model=path, **ENGINE_KWARGS)           # = worker_extension_cls=EXTENSION, the class path vLLM imports
    os.environ[ALLOW_REMOTE_ENV] = "1"         # in the engine's environment: workers may bind beyond loopback
    os.environ[SITES_ENV] = "layers.*.resid_post"   # a compiled engine's taps: these sites only (default: all)
    run = new_run()                            # a session's run id

The class path is the public one (`probe.vllm.WorkerExtension`): `probe/vllm/__init__.py`
hands the class on from `_extension.py`, and vLLM resolves the path in each worker.
"""

from __future__ import annotations

import uuid
from typing import Any

EXTENSION = "probe.vllm.WorkerExtension"
# Set to 1 in the engine's environment (a server's, at its start) to let `attach(allow_remote=True)` bind a
# non-loopback endpoint in its workers; without it a worker refuses, whoever asks (the HTTP route has no auth).
ALLOW_REMOTE_ENV = "PROBEBUS_ALLOW_REMOTE"
ENGINE_KWARGS: dict[str, Any] = {"worker_extension_cls": EXTENSION}
# In the engine's environment: the sites a compiled model gets taps for (site patterns, comma-separated, as
# `attach` takes them; unset: every site). Each tap is an output of the compiled graph at every step, attached or not.
SITES_ENV = "PROBEBUS_VLLM_SITES"


def new_run() -> str:
    return uuid.uuid4().hex[:12]
