"""ArrowRecorder: a subscriber that writes captures to Arrow/Parquet while the model runs.

    with probe.attach(model, "layers.*.resid_post") as session:
        with exporters.ArrowRecorder(session, "rec/", format="arrow") as rec:
            model.generate(**inputs, max_new_tokens=64)
    print(rec.summary)        # rows, bytes, files, dropped ...

`endpoint` is a ProbeSession (same process: model name, config hash and publisher
drops come from it, and start() waits until the publisher sees the recorder) or an
endpoint string (any process: `probebus record --endpoint ...`). Two threads: the
receiver copies each capture once into a column slab; the writer turns full slabs
into record batches and appends them to files. Neither ever calls into the model;
if the disk fails the recorder disconnects (so `complete` cannot stall the model on
a dead reader), keeps what it wrote, and stop() raises `RecorderError`.
The summary and `_manifest.json`, kept current while it runs, are `_manifest.py`.
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import zmq

import probe

from ._batch import BatchBuilder, Batcher, Dictionaries, Slab, SlabPool
from ._files import FileSet, existing_recording
from ._gaps import GapCounter
from ._manifest import RecordingSummary, Reporting, utc_now
from ._schema import (
    REQUESTS,
    file_metadata,
)
from ._text import TokenText, append_prompts, append_requests

FORMATS = ("arrow", "parquet")


class RecorderError(RuntimeError):
    """The recording failed (unwritable directory, disk full, ...). `.summary` says what was kept."""

    def __init__(self, message: str, summary: RecordingSummary | None = None) -> None:
        super().__init__(message)
        self.summary = summary


class ArrowRecorder(Reporting):
    def __init__(self, endpoint: str | probe.ProbeSession, out_dir: str | Path, *, sites: Any = None,
                 format: str = "arrow", rotate_bytes: int = 256 << 20, flush_bytes: int = 8 << 20,
                 flush_seconds: float = 0.25, max_pending_bytes: int = 64 << 20, model: Any = None,
                 metadata: dict[str, str] | None = None, drain_idle: float = 0.5, overwrite: bool = False,
                 curve_server_key: bytes | str | None = None, manifest_interval: float = 0.5, tokenizer: Any = None,
                 info_timeout: float = 2.0, require_session: bool = False,
                 curve_client_key: tuple[bytes | str, bytes | str] | None = None) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        if rotate_bytes <= 0 or flush_bytes <= 0 or flush_seconds <= 0:
            raise ValueError("rotate_bytes, flush_bytes and flush_seconds must be positive")
        self._session = endpoint if isinstance(endpoint, probe.ProbeSession) else None
        self.endpoint = self._session.endpoint if self._session is not None else str(endpoint)
        if model is None and self._session is not None:
            model = self._session.model
        probe.SiteMatcher(sites)  # a bad pattern fails here, not in a thread
        self.sites = sites
        self.format = format
        self.path = Path(out_dir)
        self.drain_idle = drain_idle
        self.overwrite = overwrite
        self.manifest_interval = manifest_interval
        if curve_server_key is None and self._session is not None:  # our own CURVE session: its keys
            curve_server_key = self._session.curve_public_key
            curve_client_key = curve_client_key or self._session.curve_local_client
        self._curve = curve_server_key
        self._curve_client = curve_client_key
        self._model, self._extra_meta = model, metadata
        self._token_text = TokenText(tokenizer) if tokenizer is not None else None
        self.info_timeout = info_timeout
        self.require_session = require_session
        self.session_info: Any = None  # the observed session's description (probe.SessionInfo) once known
        self._meta = file_metadata(model, metadata)
        self._files = FileSet(self.path, format, rotate_bytes=rotate_bytes, meta=self._meta)
        self._pool = SlabPool(max_pending_bytes)
        self._dicts = Dictionaries()
        self._queue: queue.SimpleQueue[Slab | None] = queue.SimpleQueue()
        self._batcher = Batcher(self._pool, flush_bytes=flush_bytes, flush_seconds=flush_seconds, emit=self._emit)
        self._gaps = GapCounter()
        self._sub: probe.Subscriber | None = None
        self._threads: list[threading.Thread] = []
        self._failed = threading.Event()
        self._ended = threading.Event()  # set by stop() and by a failure: releases a receiver at end of stream
        self._stop_at: float | None = None
        self._deadline = float("inf")
        self._error: str | None = None
        self._state = "new"
        self._received = self._written = self._rows = self._unwritten = 0
        self._last: tuple[int, int] = (-1, -1)
        self._truncated = False
        self._t0 = self._t1 = 0.0
        self._started_at = ""
        self._saved_at = 0.0
        self._summary: RecordingSummary | None = None
        self._interrupted: str | None = None
        self._abandoned = False
        self._manifest_lock = threading.Lock()

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> ArrowRecorder:
        """Connect, prepare the directory, and start the receiver and writer threads.

        Recording an endpoint string, start() waits up to `info_timeout` s for the
        session's description (model, config hash, sites) for the manifest; it records
        anyway if none comes (`session_info` stays None: maybe nobody serves it yet),
        unless `require_session`: then it raises RecorderError and touches no file.
        """
        if self._state != "new":
            raise RuntimeError("an ArrowRecorder records once; create a new one")
        try:
            self._sub = probe.Subscriber(self.endpoint, self.sites, curve_server_key=self._curve,
                                         curve_client_key=self._curve_client)
        except zmq.ZMQError as exc:
            raise RecorderError(f"{self.endpoint!r} is not an endpoint ({exc}); expected e.g. "
                                "ipc:///path/to/socket or tcp://127.0.0.1:5555 (`probebus top` lists live "
                                "sessions)") from None
        try:
            self._describe_source()
            self._prepare_dir()
        except BaseException:
            self._sub.close()
            raise
        self._state = "recording"
        self._t0 = time.monotonic()
        for name, fn in (("probebus-recorder-recv", self._receive), ("probebus-recorder-write", self._write)):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if self._session is not None:  # so the first forward is not published before we listen
            self._wait_seen(10.0)
        return self

    def _describe_source(self) -> None:
        """Seed the file dictionaries with what the session will send, and learn its model for the manifest."""
        session = self._session
        if session is not None:
            info = getattr(session, "info", None)
            run, sites = getattr(session, "run", ""), list(session.sites)
        else:
            wait = getattr(self._sub, "wait_info", None)
            info = wait(self.info_timeout) if wait is not None and self.info_timeout > 0 else None
            run, sites = (info.run, list(info.sites)) if info is not None else ("", [])
            if info is None and self.require_session:
                raise RecorderError(f"nobody serves {self.endpoint} (no probe session answered within "
                                    f"{self.info_timeout:g} s); `probebus top` lists this user's live sessions")
        self.session_info = info
        matcher = probe.SiteMatcher(self.sites)
        self._dicts = Dictionaries(runs=(run,) if run else (), phases=tuple(probe.PHASES),
                                   sites=tuple(x for x in sites if matcher.matches(x)))
        if info is not None and self._model is None and getattr(info, "model", ""):
            self._meta = file_metadata(info.model, self._extra_meta)
            self._meta["probebus.config_hash"] = getattr(info, "config_hash", "") or ""
            self._files.meta = self._meta
            self._files.schemas.clear()

    def add_prompts(self, prompts: list[str], seq_ids: list[int], run: str | None = None) -> None:
        """Store the text of these sequences' prompts (_prompts.jsonl), e.g. right after their generate call.

        `run` defaults to the observed session's run.
        """
        if run is None:
            run = getattr(self._session, "run", None) or getattr(self.session_info, "run", "") or ""
        append_prompts(self.path, run, seq_ids, prompts)

    def _wait_seen(self, timeout: float) -> None:
        """Block until the session's publisher has registered *this* subscriber (a count would race)."""
        self._session.wait_for(self._sub, timeout=timeout)  # type: ignore[union-attr]

    def stop(self, timeout: float = 60.0, *, raise_on_error: bool = True,
             finish_timeout: float = 60.0) -> RecordingSummary:
        """Drain what is in flight (until `drain_idle` s of silence), finish files, write the manifest.

        Under the `complete` policy nothing published before the session went quiet
        is lost. Always returns within about `timeout + finish_timeout` seconds: past
        `timeout` the receiver gives up on what is still arriving (`truncated`), and a
        writer stuck in the file system past `finish_timeout` is abandoned with the
        manifest marked `failed`. Raises RecorderError (with `.summary`) if writing failed.
        """
        if self._summary is None:
            if self._state == "new":
                self._state = "complete"
            else:
                now = time.monotonic()
                self._deadline = now + timeout
                self._stop_at = now
                self._ended.set()
                self._join(finish_timeout)
            self._t1 = time.monotonic()
            self._summary = self._snapshot(final=True)
        if self._error is not None and raise_on_error:
            raise RecorderError(self._error, self._summary)
        return self._summary

    def _join(self, finish_timeout: float) -> None:
        receiver, writer = self._threads
        receiver.join(max(0.0, self._deadline - time.monotonic()) + 1.0)
        if receiver.is_alive():  # e.g. waiting for slab memory behind a slow disk: give up what is left
            self._truncated = True
            self._pool.abort()
            receiver.join(5.0)
        writer.join(finish_timeout)
        if writer.is_alive() or receiver.is_alive():
            self._fail(TimeoutError(f"the {'writer' if writer.is_alive() else 'receiver'} did not finish within "
                                    f"{finish_timeout:g} s of stop()"), "stopping")
            self._abandoned = True  # a thread that wakes up later must not overwrite the final manifest
            self._state = "failed"
            self._save_manifest(force=True, final=True)

    def mark_interrupted(self, reason: str) -> None:
        """Record in the manifest that the recording was cut short on purpose (e.g. "SIGTERM")."""
        self._interrupted = reason

    def __enter__(self) -> ArrowRecorder:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop(raise_on_error=exc_type is None)  # never mask the body's own exception

    @property
    def running(self) -> bool:
        return self._state == "recording" and not self._failed.is_set()

    @property
    def source_ended(self) -> bool:
        """True once the observed session closed and everything it published was received."""
        return bool(getattr(self._sub, "ended", False))

    @property
    def error(self) -> str | None:
        return self._error

    @property
    def summary(self) -> RecordingSummary | None:
        """The final summary once stopped (None before)."""
        return self._summary

    @property
    def stats(self) -> RecordingSummary:
        """A live snapshot (safe to poll from another thread, e.g. for a progress bar)."""
        return self._summary or self._snapshot(final=False)

    def _prepare_dir(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            ours = existing_recording(self.path)
            if ours and not self.overwrite:
                files = f"{len(ours)} file{'' if len(ours) == 1 else 's'}"
                raise RecorderError(f"{self.path} already holds a recording ({files}); record into a new "
                                    "directory, or replace it with --overwrite (overwrite=True in Python)")
            for p in ours:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            self._started_at = utc_now()
            self._state = "recording"
            self._save_manifest(force=True)
        except OSError as exc:
            self._state = "new"
            raise RecorderError(f"cannot record into {self.path}: {exc.strerror or exc} "
                                f"({type(exc).__name__}{', ' + exc.filename if exc.filename else ''}); "
                                "pick a writable directory") from exc

    # --- receiver thread ------------------------------------------------------------------
    def _emit(self, slab: Slab) -> None:
        slab.dicts = self._dicts.snapshot()
        self._queue.put(slab)

    def _receive(self) -> None:
        sub, batcher, dicts, gaps = self._sub, self._batcher, self._dicts, self._gaps
        assert sub is not None
        last_msg = time.monotonic()
        try:
            while not self._failed.is_set():
                now = time.monotonic()
                stopping = self._stop_at is not None
                if stopping and now > self._deadline:
                    self._truncated = True
                    break
                wait = self.drain_idle if stopping else 0.1
                due = batcher.next_due(now)
                cap = sub.recv(timeout=wait if due is None else min(wait, max(due, 0.001)))
                now = time.monotonic()
                new = sub.take_requests()  # a vLLM session's new requests: seq_id -> request id, as they start
                if new:
                    self._save_requests(sub, new)
                if cap is None:
                    if getattr(sub, "ended", False):  # the session closed: we hold all it published
                        batcher.flush_all()
                        self._ended.wait()  # nothing more can arrive; wait for stop()
                        break
                    batcher.flush_due(now)
                    quiet = now - max(last_msg, self._stop_at or now)
                    if stopping and quiet >= self.drain_idle and self._publisher_idle():
                        break
                    continue
                last_msg = now
                self._received += 1
                gaps.observe(cap.run, cap.step, cap.site)
                if not batcher.add(cap, *dicts.codes3(cap.run, cap.phase, cap.site), now):
                    self._unwritten += 1
                batcher.flush_due(now)
        except BaseException as exc:  # a bug here must not leave the writer waiting forever
            self._fail(exc, "receiving")
        finally:
            batcher.flush_all()
            self._queue.put(None)
            new = sub.take_requests()
            if new and not self._failed.is_set():
                self._save_requests(sub, new)
            sub.close()  # disconnect: a failed recorder must not hold back a `complete` publisher

    def _save_requests(self, sub: probe.Subscriber, new: list[dict]) -> None:
        """Append the request-map entries that arrived to _requests.jsonl (`Recording.request`)."""
        info = sub.info or self.session_info
        try:
            append_requests(self.path, getattr(info, "run", "") or "", new)
        except OSError as exc:
            self._fail(exc, f"writing {REQUESTS}")

    def _publisher_idle(self) -> bool:
        s = self._session
        return s is None or s.stats.queued <= 0

    # --- writer thread -------------------------------------------------------------------
    def _write(self) -> None:
        builder = BatchBuilder(self._token_text)
        files = self._files
        while True:
            slab = self._queue.get()
            if slab is None:
                break
            written = False
            try:
                if self._failed.is_set():
                    self._unwritten += slab.captures
                    continue
                key = (slab.dtype, slab.hidden)
                info = slab.describe()
                files.write(slab, info, builder)
                written = True
                self._rows += slab.rows
                self._written += info.captures
                self._last = info.last
                self._save_manifest(force=files.rotate_if_full(key))
            except BaseException as exc:
                if not written:
                    self._unwritten += slab.captures
                self._fail(exc, "writing")
            finally:
                self._pool.release(slab)
        if not self._failed.is_set():
            try:
                files.finish_all()
            except BaseException as exc:
                self._fail(exc, "finishing files")
        if self._failed.is_set():
            files.abandon()
        if self._abandoned:  # stop() gave up on this thread and wrote the final manifest itself
            return
        self._state = "failed" if self._failed.is_set() else "complete"
        self._t1 = time.monotonic()
        try:
            self._save_manifest(force=True)
        except OSError as exc:
            if self._error is None:
                self._fail(exc, "writing the manifest")

    def _fail(self, exc: BaseException, doing: str) -> None:
        if self._error is None:
            where = f" {exc.filename}" if isinstance(exc, OSError) and exc.filename else ""
            what = f"{exc.strerror} (errno {exc.errno})" if isinstance(exc, OSError) and exc.strerror else repr(exc)
            self._error = (f"recording into {self.path} failed while {doing}{where}: {what}. The recorder stopped "
                           f"and disconnected; {self._rows} rows already written stay readable; the observed "
                           "model was not affected.")
            warnings.warn(f"probebus: {self._error}", RuntimeWarning, stacklevel=2)
        self._failed.set()
        self._ended.set()
        self._pool.abort()


