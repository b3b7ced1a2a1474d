"""exporters: record a probe session's activations to Arrow/Parquet, read them back anywhere.

    import probe, exporters
    with probe.attach(model, "layers.*.resid_post") as session:
        with exporters.ArrowRecorder(session, "rec/", tokenizer=tok) as rec:
            model.generate(**inputs, max_new_tokens=32)
    print(rec.summary.rows, rec.summary.files)

    rec = exporters.read_recording("rec/", sites="layers.*.resid_post")   # Recording (a Table + views)
    rec.cache(0)["layers.3.resid_post"]                                   # [pos, d_model] of sequence 0
    acts = exporters.activations("rec/", site="layers.3.resid_post")      # torch [N, hidden] + identity

Files are long format, one row per (token, site): run, step, phase, seq_id, position,
token_id, token, site, layer, activation (a list of float32 -- bf16/fp16 widened
exactly -- or the captured dtype when wider). Arrow IPC files (or Parquet) that
DuckDB, polars, pyarrow.dataset and Hugging Face `datasets` open as they are.
`probebus record | inspect | top` is the CLI.
"""

from __future__ import annotations

from ._inspect import summarize_recording
from ._manifest import RecordingSummary
from ._plot import PlotUnavailable, plot_recording
from ._reader import iter_recording, open_dataset, read_table, recording_files, recording_info, recording_reader
from ._recorder import ArrowRecorder, RecorderError
from ._recording import ActivationCache, Activations, Recording, activations, read_recording
from ._repair import repair_recording
from ._schema import FORMAT, FORMAT_VERSION, MANIFEST, activation_dtype, recording_schema
from ._top import SiteRates, TopMonitor

__all__ = [
    "ActivationCache", "Activations", "ArrowRecorder", "FORMAT", "FORMAT_VERSION", "MANIFEST", "PlotUnavailable",
    "Recording", "RecorderError", "RecordingSummary", "SiteRates", "TopMonitor", "activation_dtype", "activations",
    "iter_recording", "open_dataset", "plot_recording", "read_recording", "read_table", "recording_files",
    "recording_info", "recording_reader", "recording_schema", "repair_recording", "summarize_recording",
]
