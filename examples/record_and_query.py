"""Record activations to Arrow while generating, then query the folder with DuckDB and polars.

    pip install -e ".[query]"      # DuckDB and polars (and datasets)
    python examples/record_and_query.py --model default --out /tmp/rec
"""

import argparse
import tempfile

import duckdb
import polars as pl
import pyarrow.dataset as ds
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import exporters
import probe
from probebus.models import resolve_model

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--model", default="default")
ap.add_argument("--out", default=None, help="recording folder (default: a new temporary one)")
ap.add_argument("--max-new-tokens", type=int, default=16)
args = ap.parse_args()
out = args.out or tempfile.mkdtemp(prefix="probebus-rec-") + "/rec"
model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model)).eval()
tok = AutoTokenizer.from_pretrained(resolve_model(args.model), padding_side="left")
prompts = ["def add(a, b):\n", "import os\n\ndef walk(path):\n"]

with probe.attach(model, "layers.*.resid_post") as session, exporters.ArrowRecorder(session, out, tokenizer=tok) as rec:
    rec.add_prompts(prompts, seq_ids=[0, 1])  # the session numbers sequences in batch-row order
    with torch.no_grad():
        model.generate(**tok(prompts, return_tensors="pt", padding=True), max_new_tokens=args.max_new_tokens,
                       do_sample=False, pad_token_id=tok.pad_token_id)
print(rec.summary.rows, "rows in", out)

recording = ds.dataset(out, format="ipc")  # DuckDB scans the pyarrow dataset in place
duckdb.sql("""SELECT layer, round(avg(sqrt(list_dot_product(activation, activation))), 2) AS mean_norm
              FROM recording GROUP BY layer ORDER BY layer""").show()
df = pl.scan_ipc(f"{out}/*.arrow").filter((pl.col("seq_id") == 0) & (pl.col("layer") == 7)).collect()
print(df.select("position", "token", pl.col("activation").list.max().alias("max")).head(8))
