"""`python -m decoder --bind ADDR --model FOLDER [--drafter default|FOLDER]`: serve a drafter to a loop elsewhere.

Takes a model *folder* (no names: `decoder` does not know `probebus`'s shipped models;
`probebus serve-drafter --model default` does). `--drafter default` is the drafter shipped
next to the model folder.
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from decoder import DrafterError, load_drafter, serve_drafter
from probe._endpoint import check_endpoint

ap = argparse.ArgumentParser(prog="python -m decoder", description="Serve an EAGLE-3 drafter over REQ/REP; it reads "
                             "the target's features from the loop's probe bus.")
ap.add_argument("--bind", default="tcp://127.0.0.1:5600", help="address to serve on: loopback TCP or ipc:// unless "
                "--allow-remote (default: %(default)s)")
ap.add_argument("--allow-remote", action="store_true", help="let --bind be a non-loopback address (anyone who "
                "reaches it may draft; exit and subscribe stay loopback-only)")
ap.add_argument("--model", required=True, help="the target model's folder (for its embedding and layer count)")
ap.add_argument("--drafter", default="default", help="default (shipped next to the model) | FOLDER")
a = ap.parse_args()
torch.set_num_threads(1)
try:  # before the model loads: a refused address should not cost a minute
    check_endpoint(a.bind, a.allow_remote)
except ValueError:
    print(f"python -m decoder: refusing to serve on {a.bind!r}: anyone who reaches it could use or stop this "
          "drafter. Bind tcp://127.0.0.1:PORT or ipc://PATH, or pass --allow-remote", file=sys.stderr)
    sys.exit(2)
if not (Path(a.model) / "config.json").is_file():
    print(f"python -m decoder: {a.model} is not a model folder (no config.json); pass the target's folder",
          file=sys.stderr)
    sys.exit(2)
try:
    target = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    drafter = load_drafter(a.drafter, target)
except (OSError, DrafterError) as exc:
    print(f"python -m decoder: {exc}", file=sys.stderr)
    sys.exit(2)
serve_drafter(a.bind, drafter, allow_remote=a.allow_remote)
