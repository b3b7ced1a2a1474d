"""exporters: record a probe session's activations to Arrow/Parquet, read them back anywhere.

    import probe, exporters
    with probe.attach(model, "layers.*.resid_post") as session:
        with exporters.ArrowRecorder(session, "rec/", format="parquet") as rec:
            model.generate(**inputs, max_new_tokens=32)
    print(rec.summary.rows, rec.summary.files)

    table = exporters.read_recording("rec/", sites="layers.3.resid_post", phase="decode")
    acts = exporters.activations("rec/", site="layers.3.resid_post")   # torch [N, hidden] + identity

Files are long format, one row per (token, site): run, step, phase, seq_id, position,
token_id, site, layer, activation (fixed-size list in the captured dtype; bfloat16 as
raw uint16 bits, restored by `activations`). They open as they are in DuckDB,
polars and Hugging Face `datasets`. `probebus record | inspect | top` is the CLI.
"""

from __future__ import annotations

from ._inspect import summarize_recording
from ._reader import (
    Activations,
    activations,
    iter_recording,
    open_dataset,
    read_recording,
    recording_files,
    recording_info,
    recording_reader,
)
from ._recorder import ArrowRecorder, RecorderError, RecordingSummary
from ._schema import FORMAT, FORMAT_VERSION, MANIFEST, activation_dtype, recording_schema
from ._top import SiteRates, TopMonitor

__all__ = [
    "Activations", "ArrowRecorder", "FORMAT", "FORMAT_VERSION", "MANIFEST", "RecorderError", "RecordingSummary",
    "SiteRates", "TopMonitor", "activation_dtype", "activations", "iter_recording", "open_dataset",
    "read_recording", "recording_files", "recording_info", "recording_reader", "recording_schema",
    "summarize_recording",
]
