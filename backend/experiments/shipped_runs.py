"""Runs that ship with the app (``assets/runs/``), so its first screen and its lessons show finished runs at once.

A shipped run is a share link written to disk: ``<name>.json`` holds its id, its request (``api.RunRequest``'s
fields) and the store keys of its traces, and ``traces/<key>.npz`` each trace (``Trace.to_bytes``, recompressed),
once however many runs share it. At start-up the app copies them into its trace store (``seed``), so the page
opens on them, ``?run=ID`` reopens them, and the same request made with the Run button replays rather than
computes. ``benchmarks/shipped_runs.py`` writes them; a test recomputes their keys and fails when a new engine
version, model or example text has made them stale.

Nothing here is unpickled: the traces are npz arrays read with ``allow_pickle=False``, the manifests JSON.
"""
from __future__ import annotations

import io
import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..runs import Run, put_link
from ..traces.store import TraceStore
from ..traces.trace import Trace

FOLDER = Path(__file__).resolve().parents[2] / "assets" / "runs"
NAME = re.compile(r"[a-z][a-z0-9_]*")
KEY = re.compile(r"[0-9a-f]{16,128}")
MAX_TRACE_BYTES = 16 * 2**20


class ShippedRunError(ValueError):
    """A shipped run is missing or malformed; the message is one line."""


@dataclass(frozen=True)
class Manifest:
    """One shipped run: its share id, its request's fields and its traces' store keys."""

    name: str
    run_id: str
    request: dict
    keys: tuple[str, ...]
    full_key: str

    def to_json(self) -> str:
        return json.dumps({"run_id": self.run_id, "request": self.request, "keys": list(self.keys),
                           "full_key": self.full_key}, indent=1)


def names(folder: Path = FOLDER) -> list[str]:
    """The shipped runs' names, sorted."""
    return sorted(path.stem for path in folder.glob("*.json") if NAME.fullmatch(path.stem))


def manifest(name: str, folder: Path = FOLDER) -> Manifest:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ShippedRunError(f"No shipped run is named {str(name)[:40]!r}.")
    try:
        data = json.loads((folder / f"{name}.json").read_text("utf-8"))
        found = Manifest(name, str(data["run_id"]), dict(data["request"]), tuple(map(str, data["keys"])),
                         str(data["full_key"]))
    except FileNotFoundError:
        raise ShippedRunError(f"No shipped run is named {name!r}.") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ShippedRunError(f"The shipped run {name} does not read ({type(err).__name__}).") from None
    if not all(KEY.fullmatch(key) for key in (*found.keys, found.full_key)):
        raise ShippedRunError(f"The shipped run {name} names a trace by a malformed key.")
    return found


def trace_path(key: str, folder: Path = FOLDER) -> Path:
    return folder / "traces" / f"{key}.npz"


def read_trace(key: str, folder: Path = FOLDER) -> Trace:
    path = trace_path(key, folder)
    try:
        if path.stat().st_size > MAX_TRACE_BYTES:
            raise ShippedRunError(f"{path.name} is larger than {MAX_TRACE_BYTES // 2**20} MB.")
        return Trace.from_bytes(path.read_bytes())
    except FileNotFoundError:
        raise ShippedRunError(f"A shipped trace is missing: {path.name}.") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise ShippedRunError(f"A shipped trace does not read: {path.name} ({type(err).__name__}).") from None


def load(name: str, folder: Path = FOLDER, request_type=dict) -> Run:
    """The shipped run ``name`` read from its files (``request_type(**fields)`` builds its request)."""
    found = manifest(name, folder)
    specs = found.request.get("specs", [])
    traces = [read_trace(key, folder).with_spec(spec) for key, spec in zip(found.keys, specs)]
    full = read_trace(found.full_key, folder)
    return Run(traces=traces, full=full, keys=list(found.keys), full_key=found.full_key,
               replayed=[True] * len(traces), stored=False, run_id=found.run_id,
               request=request_type(**found.request), tokens=full.meta["n_prompt"])


def _compressed(data: bytes) -> bytes:
    """An npz byte string with its arrays deflated (np.load reads either; the store keeps the plain form)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as plain, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as packed:
        for item in plain.infolist():
            packed.writestr(item.filename, plain.read(item))
    return out.getvalue()


def write(name: str, run: Run, request: dict, folder: Path = FOLDER) -> Manifest:
    """Ship ``run`` under ``name``: its manifest and the traces it names (a trace already shipped is kept)."""
    if not NAME.fullmatch(name):
        raise ShippedRunError(f"A shipped run's name is lowercase letters, digits and _, got {name!r}.")
    (folder / "traces").mkdir(parents=True, exist_ok=True)
    for key, trace in zip([*run.keys, run.full_key], [*run.traces, run.full]):
        trace_path(key, folder).write_bytes(_compressed(trace.to_bytes()))
    found = Manifest(name, run.run_id, request, tuple(run.keys), run.full_key)
    (folder / f"{name}.json").write_text(found.to_json() + "\n", "utf-8")
    return found


def prune(folder: Path = FOLDER) -> list[Path]:
    """Delete shipped traces no manifest names; returns them."""
    named = {key for name in names(folder) for key in (*manifest(name, folder).keys, manifest(name, folder).full_key)}
    gone = [path for path in (folder / "traces").glob("*.npz") if path.stem not in named]
    for path in gone:
        path.unlink()
    return gone


def seed(store: TraceStore, folder: Path = FOLDER) -> list[str]:
    """Copy every shipped run into ``store`` (its traces as plain npz, its share link), so it replays and reopens
    as a run made here would. Returns the names seeded; a store that cannot write seeds nothing, silently."""
    seeded = []
    for name in names(folder):
        try:
            found = manifest(name, folder)
            for key in {*found.keys, found.full_key}:
                if key not in store:
                    store.put(key, read_trace(key, folder).to_bytes())
        except ShippedRunError:
            continue
        if put_link(store, found.run_id, found.request, found.keys, found.full_key):
            seeded.append(name)
    return seeded
