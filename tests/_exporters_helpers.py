"""Shared pieces of the exporters tests: tiny models saved to disk, a local tokenizer, oracles, CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import probe

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog",
          "probebus records activations while the model generates", "import torch\nx = torch.zeros(3)\n"] * 4


def tiny_llama(vocab: int = 128, layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
               eos: int = 1, pad: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=pad, eos_token_id=eos, bos_token_id=2)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def save_model_with_tokenizer(directory: Path, layers: int = 2) -> Path:
    """A random Llama plus a byte-level BPE trained here (no downloads), loadable by probebus._load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    fast.padding_side = "left"
    model = tiny_llama(vocab=320, layers=layers, eos=fast.eos_token_id, pad=fast.pad_token_id)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def oracle(model: torch.nn.Module, seq: list[int]) -> dict[str, torch.Tensor]:
    """resid_pre / resid_post / final_norm of one unpadded sequence, from output_hidden_states."""
    n_layers = probe.resolve_arch(model).n_layers
    with torch.no_grad():
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    out = {}
    for i in range(n_layers):
        out[f"layers.{i}.resid_pre"] = hs[i][0]
        if i < n_layers - 1:  # the last hidden state is after the final norm
            out[f"layers.{i}.resid_post"] = hs[i + 1][0]
    out["final_norm"] = hs[n_layers][0]
    return out


def fed_tokens(prompt: list[int], generated: list[int], stop_ids: set[int]) -> list[int]:
    """Tokens the model really ran on for one row of a generate call.

    generate feeds every new token but the last one back; probe strips decode rows whose
    fed token is a stop token (the row already finished), and all rows after it.
    """
    seq = list(prompt)
    for tok in generated[:-1]:
        if tok in stop_ids:
            break
        seq.append(tok)
    return seq


def probebus_cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    """Run the real command line: `python -m probebus` once the CLI wires these commands in, else this module's main."""
    cli = (ROOT / "probebus" / "cli.py").read_text()
    wired = (ROOT / "probebus" / "__main__.py").exists() and "_cmd_exporters" in cli
    cmd = [sys.executable, "-m", "probebus"] if wired else [sys.executable, "-m", "probebus._cmd_exporters"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, cwd=ROOT, **kw)


class FaultyFile:
    """A real file whose `write` a subclass makes fail or hang: a disk fault the tests cannot cause
    on demand (the only simulated faults of the suite; a real full tmpfs is tested too)."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by pyarrow through close()
        self.closed = False

    def write(self, data: bytes) -> int:
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        self.f.close()


def record_until_rows(out: Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """`probebus record` of a long generation into `out`, returned once the manifest counts rows (or the process
    ended, or 120 s passed): a recording in progress, for tests that interrupt one."""
    cmd = [sys.executable, "-m", "probebus", "record", "--model", "default", "--prompt", "def main():\n",
           "--sites", "layers.*.resid_post", "--max-new-tokens", "900", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((out / "_manifest.json").read_text())["counts"]["rows"] > 0:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    return proc
