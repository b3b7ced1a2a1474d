"""Recorder benchmark: write throughput against raw pyarrow, and decode slowdown with recording on.

    python benchmarks/recorder.py                 # full run (quiet machine, ~5 min on 2 cores)
    python benchmarks/recorder.py --quick         # smoke run: small model, one repeat

Part 1, sustained write: a probe session on a pass-through model (embedding + 12
identity layers, so the bus, not matmuls, is the source) publishes layers.*.resid_post
captures; two capture sizes, decode-like (8 rows x 768 fp32 = 24 KiB) and
prefill-like (8 x 128 rows = 3 MiB). "pipeline": the ArrowRecorder (both threads,
real files) fed those captures from memory, i.e. its own cost without transport,
from start() until stop() returned with every file complete. "raw": pyarrow writing
the very same record batches from memory with the same settings to the same disk
(target: pipeline >= 80 % of raw). "e2e": session -> ZeroMQ -> in-process recorder;
"bus": the same with a bare draining probe.Subscriber, the ceiling for e2e on this box.
Sustained means more than the kernel's dirty-page allowance: at 200 MB raw pyarrow
only fills the page cache (~3 GB/s here), at 1000 MB writeback sets the pace (~0.8 GB/s).

Part 2, end-to-end: a random Llama of ~110M parameters (hidden 768, 12 layers, fp32,
torch 2 threads), prompt 128 random tokens, 128 new tokens (min_new_tokens pins the
length), batch 1 and 8, sites layers.*.resid_post; modes off / bus (probes and a bare
draining Subscriber, no files) / arrow / parquet (in-process recorder) run interleaved
per repeat; medians of generate() wall time, tokens/s, and the ratio to off.
Not a test: it prints numbers, it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import exporters  # noqa: E402
import probe  # noqa: E402


def machine_info() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import zmq

    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    return (f"{platform.platform()} | {cpu} | {os.cpu_count()} cpus | load {load[0]:.2f} | python "
            f"{platform.python_version()} | torch {torch.__version__} ({torch.get_num_threads()} threads) | "
            f"pyarrow {pa.__version__} | pyzmq {zmq.__version__} | probebus {exporters._schema.package_version()}")


# --- part 1: sustained write -----------------------------------------------------------------------
class PassThrough(nn.Module):
    """Embedding + identity-like layers: every forward stages n_layers x [B*S, hidden] almost for free."""

    def __init__(self, hidden: int, n_layers: int, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Identity() for _ in range(n_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return h


class _Replay:
    """Stands in for probe.Subscriber: hands out captures received earlier, then ends the stream."""

    def __init__(self, caps: list) -> None:
        self.caps, self.i, self.ended, self.stats = caps, 0, False, probe.SubscriberStats()

    def recv(self, timeout: float | None = None) -> object:
        if self.i < len(self.caps):
            self.i += 1
            return self.caps[self.i - 1]
        self.ended = True
        return None

    def close(self) -> None:
        pass


def _source(batch: int, seq: int, total_mb: float, hidden: int, n_layers: int) -> tuple[nn.Module, torch.Tensor, int]:
    model = PassThrough(hidden, n_layers).eval()
    ids = torch.randint(0, 1000, (batch, seq))
    return model, ids, max(1, int(total_mb * 1e6 / (batch * seq * hidden * 4 * n_layers)))


def _publish(model: nn.Module, ids: torch.Tensor, forwards: int, sink: str, out: Path,
             fmt: str) -> tuple[float, object]:
    """Run `forwards` through a probe session; sink: 'recorder' | 'drain' (bare Subscriber) | 'collect'."""
    got: list = []
    with probe.attach(model, "layers.*.resid_post", capacity_bytes=256 << 20) as session:
        if sink == "recorder":
            rec = exporters.ArrowRecorder(session, out, format=fmt).start()
        else:
            sub = probe.Subscriber(session.endpoint, rcvhwm=0 if sink == "collect" else 1000)
            session.wait_for_subscribers(1)
            keep = got.append if sink == "collect" else (lambda c: None)
            th = threading.Thread(target=lambda: [keep(c) for c in sub], daemon=True)
            th.start()
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(forwards):
                model(ids)
    if sink == "recorder":
        result: object = rec.stop()  # the session closed first: end of stream, no idle wait
    else:
        th.join()
        sub.close()
        result = got
    return time.perf_counter() - t0, result


def _pipeline(caps: list, rec_dir: Path, fmt: str) -> tuple[float, exporters.RecordingSummary]:
    """The recorder (both threads, real files) fed `caps` from memory: start() .. stop() returned."""
    shutil.rmtree(rec_dir, ignore_errors=True)
    replay = _Replay(caps)
    with mock.patch.object(probe, "Subscriber", lambda *a, **k: replay):
        t0 = time.perf_counter()
        rec = exporters.ArrowRecorder("ipc://replay", rec_dir, format=fmt).start()
        while not rec.source_ended:
            time.sleep(0.0005)
        summary = rec.stop()
        return time.perf_counter() - t0, summary


def _load_batches(rec_dir: Path, fmt: str) -> list[pa.RecordBatch]:
    """The recording's record batches as owned in-memory copies (nothing is read from disk while timing)."""
    batches = [b for f in sorted(rec_dir.glob(f"*.{fmt}")) for b in
               (pq.ParquetFile(f).iter_batches(batch_size=1 << 30) if fmt == "parquet"
                else pa.ipc.open_file(pa.memory_map(str(f))).read_all().to_batches())]
    batches = [pa.RecordBatch.from_arrays([pa.concat_arrays([c]) for c in b.columns], schema=b.schema) for b in batches]
    # One dictionary for all: each recorded file has its own, and one IPC file allows only one.
    return pa.Table.from_batches(batches).unify_dictionaries().to_batches()


def _raw(batches: list[pa.RecordBatch], path: Path, fmt: str, hidden: int) -> float:
    """pyarrow alone writing `batches` with the recorder's settings."""
    t0 = time.perf_counter()
    sink = pa.OSFile(str(path), "wb")
    if fmt == "parquet":
        cols = [c for c in batches[0].schema.names if c != "activation"]
        w = pq.ParquetWriter(sink, batches[0].schema, compression={c: "zstd" for c in cols} | {"activation": "none"},
                             use_dictionary=["run", "phase", "site"], write_statistics=cols)
        w.write_table(pa.Table.from_batches(batches), row_group_size=max(1, (64 << 20) // (hidden * 4)))
    else:
        w = pa.ipc.new_file(sink, batches[0].schema)
        for b in batches:
            w.write_batch(b)
    w.close()
    sink.close()
    t = time.perf_counter() - t0
    path.unlink()
    return t


def write_bench(fmt: str, shape: tuple[int, int], total_mb: float, out: Path, hidden: int, n_layers: int,
                reps: int) -> dict:
    model, ids, forwards = _source(*shape, total_mb, hidden, n_layers)
    rec_dir = out / f"rec-{fmt}"
    _, caps = _publish(model, ids, forwards, "collect", out, fmt)
    t_pipe, t_raw, t_e2e, t_bus = [], [], [], []
    batches: list[pa.RecordBatch] = []
    for _ in range(reps):  # interleaved, medians: the disk and the page cache are noisy
        t, summary = _pipeline(caps, rec_dir, fmt)
        t_pipe.append(t)
        batches = batches or _load_batches(rec_dir, fmt)
        shutil.rmtree(rec_dir, ignore_errors=True)
        t_raw.append(_raw(batches, out / f"raw.{fmt}", fmt, hidden))
    caps.clear()
    batches.clear()
    dropped = summary.dropped
    for _ in range(reps):
        t, s2 = _publish(model, ids, forwards, "recorder", rec_dir, fmt)
        t_e2e.append(t)
        dropped += s2.dropped  # type: ignore[attr-defined]
        shutil.rmtree(rec_dir, ignore_errors=True)
        t_bus.append(_publish(model, ids, forwards, "drain", out, fmt)[0])
    mb = summary.rows * hidden * 4 / 1e6
    med = statistics.median
    return {"fmt": fmt, "capture": f"{shape[0]}x{shape[1]}x{hidden}", "captures": summary.captures, "mb": mb,
            "pipe": mb / med(t_pipe), "raw": mb / med(t_raw), "e2e": mb / med(t_e2e), "bus": mb / med(t_bus),
            "dropped": dropped}


# --- part 2: decode slowdown --------------------------------------------------------------------------
def build_llama(quick: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if quick:
        cfg = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                          tie_word_embeddings=True)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                          num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
                          tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def decode_once(model: nn.Module, ids: torch.Tensor, new: int, mode: str, out: Path) -> tuple[float, float, str]:
    """(generate seconds, seconds until the recording is complete on disk, note)."""
    mask = torch.ones_like(ids)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0)
    if mode == "off":
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(**kw)
        t = time.perf_counter() - t0
        return t, t, ""
    if mode == "bus":  # probes + publisher + a bare draining Subscriber: the bus's share of the cost
        with probe.attach(model, "layers.*.resid_post") as session:
            sub = probe.Subscriber(session.endpoint)
            session.wait_for_subscribers(1)
            th = threading.Thread(target=lambda: sum(1 for _ in sub), daemon=True)
            th.start()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(**kw)
            t_gen = time.perf_counter() - t0
        th.join()
        return t_gen, time.perf_counter() - t0, ""
    rec_dir = out / f"dec-{mode}"
    shutil.rmtree(rec_dir, ignore_errors=True)
    with probe.attach(model, "layers.*.resid_post") as session:
        rec = exporters.ArrowRecorder(session, rec_dir, format=mode).start()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(**kw)
        t_gen = time.perf_counter() - t0
    s = rec.stop()
    t_all = time.perf_counter() - t0
    shutil.rmtree(rec_dir, ignore_errors=True)
    return t_gen, t_all, f"{s.rows} rows {s.bytes / 1e6:.0f} MB drops {s.dropped}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: small model, short prompt, one repeat")
    ap.add_argument("--repeats", type=int, default=None,
                    help="interleaved repeats (default 5, write part at most 3; 1 with --quick)")
    ap.add_argument("--write-mb", type=float, default=None, help="MB per write measurement (default 1000)")
    ap.add_argument("--skip-write", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--dir", default=None, help="where files go (default: a temp dir, removed afterwards)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 5)
    write_mb = args.write_mb or (200 if args.quick else 1000)
    out = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="probebus-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"# recorder benchmark{' (--quick)' if args.quick else ''}\n# {machine_info()}\n# files in {out}")
    try:
        if not args.skip_write:
            print(f"\n## sustained write, layers.*.resid_post of a 12-layer pass-through model, "
                  f"~{write_mb:.0f} MB each")
            print("#  pipeline = ArrowRecorder fed captures from memory (receiver copy + Arrow + files; no transport)")
            print("#  raw      = pyarrow writing the same record batches from memory, same settings, same disk")
            print("#  e2e      = probe session -> ZeroMQ -> in-process ArrowRecorder -> files complete")
            print("#  bus      = the same session with a bare draining probe.Subscriber (the ceiling for e2e)")
            print(f"{'format':8} {'capture':>12} {'captures':>9} {'MB':>6} {'pipeline':>9} {'raw':>7} {'ratio':>6} "
                  f"{'e2e':>7} {'bus':>7} {'e2e/bus':>8} {'drops':>6}   (MB/s)")
            for fmt in ("arrow", "parquet"):
                for shape in ((8, 1), (8, 128)):
                    r = write_bench(fmt, shape, write_mb, out, 768, 12, max(1, min(repeats, 3)))
                    print(f"{r['fmt']:8} {r['capture']:>12} {r['captures']:>9} {r['mb']:>6.0f} {r['pipe']:>9.0f} "
                          f"{r['raw']:>7.0f} {r['pipe'] / r['raw']:>6.2f} {r['e2e']:>7.0f} {r['bus']:>7.0f} "
                          f"{r['e2e'] / r['bus']:>8.2f} {r['dropped']:>6}")
        if not args.skip_decode:
            model = build_llama(args.quick)
            n_params = sum(p.numel() for p in model.parameters())
            prompt, new = (32, 16) if args.quick else (128, 128)
            print(f"\n## decode: random Llama {n_params / 1e6:.0f}M params fp32, prompt {prompt}, {new} new tokens, "
                  f"sites layers.*.resid_post, {repeats} interleaved repeats, medians")
            modes = ("off", "bus", "arrow", "parquet")
            for batch in (1, 8):
                ids = torch.randint(3, model.config.vocab_size, (batch, prompt))
                decode_once(model, ids, 4, "off", out)  # warm-up (allocator, kernels)
                times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
                notes = {}
                for _ in range(repeats):
                    for m in modes:
                        t_gen, t_all, note = decode_once(model, ids, new, m, out)
                        times[m].append((t_gen, t_all))
                        notes[m] = note
                base = statistics.median(t for t, _ in times["off"])
                print(f"batch {batch}:")
                print(f"  {'mode':8} {'generate s':>11} {'tok/s':>8} {'vs off':>7} {'to disk s':>10}  recording")
                for m in modes:
                    t = statistics.median(t for t, _ in times[m])
                    t_all = statistics.median(a for _, a in times[m])
                    print(f"  {m:8} {t:>11.3f} {batch * new / t:>8.1f} {t / base:>7.3f} {t_all:>10.3f}  {notes[m]}")
    finally:
        if not args.dir:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
