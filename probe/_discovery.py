"""Which probe sessions of this user are live, and what each one is.

    for info in probe.live_sessions():       # newest last
        print(info.endpoint, info.model, info.sites)

Every session writes one small JSON file into a per-user runtime directory (0700:
`$PROBEBUS_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/probebus`, else
`<tmp>/probebus-<uid>`) and removes it on close. Files of processes that died
without closing are pruned when listed. The same description travels on the bus as
the session-info message (`Subscriber.info`), so a subscriber of another machine
gets it too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class SessionInfo:
    """A probe session as subscribers and `probebus top` see it."""

    run: str
    endpoint: str
    pid: int
    model: str = ""
    config_hash: str = ""
    dtype: str = ""
    sites: list[str] = field(default_factory=list)
    policy: str = ""
    probebus_version: str = ""
    wire_version: int = 0
    started: float = 0.0
    host: str = ""
    backend: str = ""  # "vllm" for a vLLM engine's session
    # A vLLM session's request map: seq_id -> {"seq_id", "request_id" (vLLM's), "first_position"}; a
    # Subscriber adds the entries of requests that start after its info (REQUESTS_TOPIC).
    requests: dict[int, dict] = field(default_factory=dict)
    recomputed: int = 0  # positions a preempted vLLM request computed again (never published twice)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["requests"] = {str(k): v for k, v in self.requests.items()}  # JSON keys are strings
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SessionInfo:
        """From a session-info message or a discovery file: TypeError / ValueError when a field has the wrong
        type (it comes from another process, maybe a hostile one, and consumers use the fields as typed)."""
        if not isinstance(d, dict):
            raise TypeError("session info is not an object")
        known = {f: d[f] for f in cls.__dataclass_fields__ if f in d}
        for name, value in known.items():
            want = _FIELD_TYPES.get(name)
            if want is not None and (not isinstance(value, want) or (isinstance(value, bool) and want is not str)):
                raise TypeError(f"session info field {name!r} is a {type(value).__name__}")
        if not math.isfinite(known.get("started", 0.0)):
            raise ValueError("session info field 'started' is not finite")
        sites = known.get("sites")
        if sites is not None and (not isinstance(sites, list) or not all(isinstance(s, str) for s in sites)):
            raise TypeError("session info field 'sites' is not a list of names")
        requests = known.get("requests")
        if requests is not None:
            if not isinstance(requests, dict):
                raise TypeError("session info field 'requests' is not an object")
            known["requests"] = {seq_id_key(k): v for k, v in requests.items()}
        return cls(**known)


# The scalar fields' types (JSON gives int for a whole number, so a float field takes int too).
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "run": str, "endpoint": str, "pid": int, "model": str, "config_hash": str, "dtype": str, "policy": str,
    "probebus_version": str, "wire_version": int, "started": (int, float), "host": str, "backend": str,
    "recomputed": int}


def seq_id_key(key: object) -> int:
    """A request map's key (a JSON object's key: a string of digits) as a seq_id; ValueError otherwise."""
    if not isinstance(key, (str, int)) or isinstance(key, bool) or not str(key).isdigit() or len(str(key)) > 18:
        raise ValueError(f"{str(key)[:20]!r} is not a seq_id")
    return int(key)


def config_hash(config: object) -> str:
    """A short stable hash of a transformers config (what architecture produced the states)."""
    to_dict = getattr(config, "to_diff_dict", None) or getattr(config, "to_dict", None)
    if not callable(to_dict):
        return ""
    try:
        text = json.dumps(to_dict(), sort_keys=True, default=str)
    except (TypeError, ValueError):
        return ""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def runtime_dir() -> Path:
    """This user's private directory for live-session files (created 0700 if missing)."""
    env = os.environ.get("PROBEBUS_RUNTIME_DIR")
    if env:
        path = Path(env)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "probebus"
    else:
        uid = os.getuid() if hasattr(os, "getuid") else 0
        path = Path(tempfile.gettempdir()) / f"probebus-{uid}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if hasattr(os, "getuid"):
        st = path.stat()
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionError(f"{path} is not private to this user (owner {st.st_uid}, mode "
                                  f"{oct(stat.S_IMODE(st.st_mode))}); remove it or set PROBEBUS_RUNTIME_DIR")
    return path


def register(info: SessionInfo) -> Path | None:
    """Publish `info` for `live_sessions()`; None if the runtime directory is unusable (never fatal)."""
    try:
        folder = runtime_dir()
        path = folder / f"{info.run}.json"
        tmp = folder / f".{info.run}.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info.to_dict(), f)
        os.replace(tmp, path)
        return path
    except OSError:
        return None


def unregister(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's pid: not ours to judge
        return True
    return True


def live_sessions() -> list[SessionInfo]:
    """This user's live probe sessions on this machine, oldest first (stale files are removed)."""
    try:
        folder = runtime_dir()
    except OSError:
        return []
    out = []
    for path in folder.glob("*.json"):
        try:
            info = SessionInfo.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, RecursionError):
            continue
        if not _alive(info.pid):
            unregister(path)
            continue
        out.append(info)
    return sorted(out, key=lambda i: i.started)

