import os
import sys

import torch

# Tests build small models; keep them deterministic and off the second core's toes.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
sys.path.insert(0, os.path.dirname(__file__))
