"""`python -m decoder --bind ADDR --model M --drafter D`: serve a drafter to a loop in another process."""

import argparse

import torch

from decoder import serve_drafter

ap = argparse.ArgumentParser(prog="python -m decoder", description="Serve an EAGLE-3 drafter over REQ/REP; it reads "
                             "the target's features from the loop's probe bus.")
ap.add_argument("--bind", default="tcp://127.0.0.1:5600")
ap.add_argument("--model", default="default")
ap.add_argument("--drafter", default="default")
a = ap.parse_args()
torch.set_num_threads(1)
serve_drafter(a.bind, a.model, a.drafter)
