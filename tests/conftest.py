import os
import sys
import tempfile

import torch

# One intra-op thread: the test models are tiny (one thread is as fast), and subscriber
# processes share the machine's cores. With two OpenMP threads and a busy second core,
# a 0.7 ms forward of a test model was measured at 600 ms (the OpenMP barrier waits for
# a thread that is not scheduled).
torch.set_num_threads(1)
# Per-user state the suite must not touch: the decoder's cost-curve cache and the live-session
# directory go to folders of this run (subprocesses inherit them).
os.environ.setdefault("PROBEBUS_CACHE_DIR", tempfile.mkdtemp(prefix="probebus-test-cache-"))
os.environ.setdefault("PROBEBUS_RUNTIME_DIR", tempfile.mkdtemp(prefix="probebus-test-run-"))
sys.path.insert(0, os.path.dirname(__file__))
