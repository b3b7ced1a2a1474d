import os
import sys

import torch

# One intra-op thread: the test models are tiny (one thread is as fast), and subscriber
# processes share the machine's cores. With two OpenMP threads and a busy second core,
# a 0.7 ms forward of a test model was measured at 600 ms (the OpenMP barrier waits for
# a thread that is not scheduled).
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
