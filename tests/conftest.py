import atexit
import os
import shutil
import sys
import tempfile

# The same for every process the tests start (examples, doc snippets, the CLI, subscribers): OpenMP reads this
# when torch loads. Measured on 2 busy cores: a README snippet ran in 12-20 s with two threads, 6.5 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# One intra-op thread: the test models are tiny (one thread is as fast), and subscriber
# processes share the machine's cores. With two OpenMP threads and a busy second core,
# a 0.7 ms forward of a test model was measured at 600 ms (the OpenMP barrier waits for
# a thread that is not scheduled).
torch.set_num_threads(1)
# Per-user state the suite must not touch: the decoder's cost-curve cache and the live-session
# directory go to folders of this run (subprocesses inherit them).
# The process that makes a folder removes it when it exits: left behind, they pile up in /tmp on a
# machine that runs the suite many times (282 pairs were found on one).
for _name, _prefix in (("PROBEBUS_CACHE_DIR", "probebus-test-cache-"), ("PROBEBUS_RUNTIME_DIR", "probebus-test-run-")):
    if _name not in os.environ:
        os.environ[_name] = tempfile.mkdtemp(prefix=_prefix)
        atexit.register(shutil.rmtree, os.environ[_name], ignore_errors=True)
sys.path.insert(0, os.path.dirname(__file__))
