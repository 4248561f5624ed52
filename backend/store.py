"""Disk store for run results (traces), shared by processes.

A run result is one ``bytes`` value (the ``.npz`` byte string of a trace, whose
metadata JSON rides inside it; see ``docs/trace-format.md``). The store keeps
these values in a :mod:`diskcache` directory under a content-hash key from
:func:`run_key`, so a run that was computed once replays from disk.

Nothing here is ever pickled or unpickled. diskcache pickles arbitrary Python
objects by default (CVE-2025-69872 is about loading such entries), but it keeps
``str`` keys and ``bytes`` values raw: a small ``bytes`` value goes into the
SQLite ``value`` column, a large one into a ``.val`` file (diskcache's
``MODE_RAW`` and ``MODE_BINARY``). :class:`_BytesOnlyDisk` allows only those
paths: writing anything other than a ``str`` key and a ``bytes`` value raises
``TypeError``, and reading an entry stored any other way (a pickled value
planted in the directory, say) gives a refusal marker, never the object.

Every stored value starts with a header (magic tag, :data:`FORMAT_VERSION`,
payload length, sha256 of the payload). :meth:`TraceStore.get` checks all of it;
on any mismatch it deletes the entry and returns ``None``, so the caller
recomputes. It never raises on a corrupt entry.

Size: the store is bounded by ``size_limit`` (bytes, as diskcache counts them:
the SQLite file plus the value files) and evicts least-recently-used entries one
at a time after each write, so ``volume()`` stays within ``size_limit`` plus at
most one entry. A value whose stored form is larger than ``size_limit`` is not
stored at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sqlite3
import struct
import time
from typing import Callable

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW

__all__ = ["FORMAT_VERSION", "run_key", "TraceStore", "get_or_compute"]

log = logging.getLogger(__name__)

from .trace import FORMAT_VERSION  # noqa: E402  one version for traces and store entries
"""Trace-format version. It goes into every key and every stored header, so
bumping it turns every older entry into a miss."""

DEFAULT_SIZE_MB = 300
ENV_DIR = "KVLENS_STORE_DIR"
ENV_MB = "KVLENS_STORE_MB"

# Header: magic, format version (uint32), payload length (uint64), sha256(payload).
_MAGIC = b"KVLT"
_HEADER = struct.Struct(">4sIQ32s")

# diskcache names its value files "xx/yy/<28 hex>.val" (see Disk.filename); any
# other name in the table (an absolute path, "..") is refused for reads and removals.
_VALUE_FILE = re.compile(r"[0-9a-f]{2}[/\\][0-9a-f]{2}[/\\][0-9a-f]{28}\.val")


class _Refused:
    """Returned by :meth:`_BytesOnlyDisk.fetch` for an entry it won't decode."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<refused diskcache entry>"


_REFUSED = _Refused()


class _BytesOnlyDisk(diskcache.Disk):
    """A diskcache ``Disk`` that stores and loads only ``str`` keys and ``bytes``
    values, through diskcache's raw paths; it never calls pickle."""

    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"store keys must be str, not {type(key).__name__}")
        return key, True  # what Disk.put returns for a str: stored raw

    def get(self, key, raw):
        # Only used when iterating keys, which TraceStore does not do.
        if not raw:
            raise TypeError("refusing to unpickle a non-raw diskcache key")
        return bytes(key) if isinstance(key, (bytes, memoryview)) else key

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if read or type(value) is not bytes:
            raise TypeError(f"store values must be bytes, not {type(value).__name__}")
        # For bytes, Disk.store takes only MODE_RAW (small) or MODE_BINARY (file).
        size, mode, filename, db_value = super().store(value, False, key=key)
        if mode not in (MODE_RAW, MODE_BINARY):  # cannot happen for bytes in diskcache 5.6.3
            raise TypeError(f"diskcache chose mode {mode} for bytes; refusing")
        return size, mode, filename, db_value

    def fetch(self, mode, filename, value, read):
        if read:
            raise TypeError("TraceStore does not read values as file handles")
        if mode == MODE_RAW:
            if type(value) is bytes:
                return value
            if type(value) is memoryview:
                return bytes(value)
            return _REFUSED  # a str/int/float planted raw
        if mode == MODE_BINARY and isinstance(filename, str) and _VALUE_FILE.fullmatch(filename):
            # An OSError here (file gone) reads as a miss in Cache.get.
            with open(os.path.join(self._directory, filename), "rb") as reader:
                return reader.read()
        return _REFUSED  # MODE_PICKLE, MODE_TEXT, or a bad file name: never decoded

    def remove(self, file_path):
        if isinstance(file_path, str) and _VALUE_FILE.fullmatch(file_path):
            super().remove(file_path)


# ---------------------------------------------------------------------------
# Keys


def _check_json(value, path: str, active: set) -> None:
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"run_key: {path} is {value!r}, which is not JSON-serializable")
        return
    if isinstance(value, (list, tuple, dict)):
        if id(value) in active:
            raise TypeError(f"run_key: {path} contains itself (circular reference)")
        active.add(id(value))
        if isinstance(value, dict):
            for k, v in value.items():
                if type(k) is not str:
                    raise TypeError(
                        f"run_key: {path} has a key of type {type(k).__name__} ({k!r}); "
                        "dict keys must be str"
                    )
                _check_json(v, f"{path}[{k!r}]", active)
        else:
            for i, v in enumerate(value):
                _check_json(v, f"{path}[{i}]", active)
        active.discard(id(value))
        return
    raise TypeError(
        f"run_key: {path} has type {type(value).__name__}, which is not JSON-serializable; "
        "use None/bool/int/float/str, lists and dicts with str keys "
        "(convert numpy arrays and scalars with .tolist() / .item())"
    )


def run_key(**fields) -> str:
    """Return the store key of a run: the sha256 hex digest of a canonical JSON
    of ``fields`` plus :data:`FORMAT_VERSION`.

    Pass everything that determines the result, e.g. ``model=``,
    ``model_fingerprint=``, ``token_ids=`` (a list of ints), ``policy=``,
    ``params=`` (a dict), ``mode=``, ``generation=`` (a dict of settings).
    Dict key order does not matter (keys are sorted, at every depth); list
    order does. Tuples count as lists. ``1``, ``1.0``, ``True`` and ``"1"`` give
    different keys.

    Raises ``TypeError`` naming the offending field for anything that is not
    plain JSON: numpy values, sets, bytes, objects, non-str dict keys, NaN and
    infinities, circular structures.
    """
    for name, value in fields.items():
        _check_json(value, name, set())
    doc = {"format_version": FORMAT_VERSION, "fields": fields}
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# ---------------------------------------------------------------------------
# Values


def _pack(payload: bytes) -> bytes:
    header = _HEADER.pack(_MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest())
    return header + payload


def _unpack(blob) -> bytes | None:
    """Payload of a stored value, or None if anything about it is wrong."""
    if type(blob) is not bytes or len(blob) < _HEADER.size:
        return None
    magic, version, length, digest = _HEADER.unpack_from(blob)
    if magic != _MAGIC or version != FORMAT_VERSION or length != len(blob) - _HEADER.size:
        return None
    view = memoryview(blob)[_HEADER.size :]
    if hashlib.sha256(view).digest() != digest:
        return None
    return bytes(view)


def _default_directory() -> str:
    return os.environ.get(ENV_DIR) or os.path.join("~", ".cache", "kvlens", "store")


def _default_size_limit() -> int:
    text = os.environ.get(ENV_MB)
    if not text:
        return DEFAULT_SIZE_MB * 2**20
    try:
        mb = float(text)
    except ValueError:
        raise ValueError(f"{ENV_MB}={text!r} is not a number of megabytes") from None
    if not (mb > 0 and math.isfinite(mb)):
        raise ValueError(f"{ENV_MB}={text!r} must be a positive number of megabytes")
    return int(mb * 2**20)


class TraceStore:
    """An on-disk, size-bounded, least-recently-used store of ``bytes`` values
    under ``str`` keys (from :func:`run_key`), safe to share between processes.

    Open one ``TraceStore`` per process (don't carry one across a fork); within
    a process, threads may share it. diskcache's SQLite transactions make
    concurrent writes to one key, from any number of processes, leave exactly
    one complete entry.
    """

    def __init__(self, directory: str | os.PathLike | None = None, size_limit: int | None = None):
        """Open (creating if needed) the store in ``directory``.

        ``directory`` defaults to ``$KVLENS_STORE_DIR``, else
        ``~/.cache/kvlens/store``. ``size_limit`` is in bytes; it defaults to
        ``$KVLENS_STORE_MB`` megabytes, else 300 MB.
        """
        if directory is None:
            directory = _default_directory()
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
        if size_limit is None:
            size_limit = _default_size_limit()
        if isinstance(size_limit, bool) or not isinstance(size_limit, int) or size_limit <= 0:
            raise ValueError(f"size_limit must be a positive int (bytes), not {size_limit!r}")
        self.size_limit = size_limit
        self._cache = diskcache.Cache(
            self.directory,
            disk=_BytesOnlyDisk,
            size_limit=size_limit,
            eviction_policy="least-recently-used",
            cull_limit=0,  # put() evicts itself, one entry at a time (see _evict)
            statistics=0,
        )

    # -- reading ------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """Return the bytes stored under ``key``, or ``None`` if there are none
        or the entry is damaged (bad header, other format version, checksum
        mismatch, truncated, not bytes, missing file); a damaged entry is
        deleted. Marks the entry as recently used."""
        _check_key(key)
        blob = self._cache.get(key, default=None, retry=True)
        if blob is None:
            if key in self._cache:  # a row whose value file is gone
                self._discard(key)
            return None
        payload = _unpack(blob)
        if payload is None:
            self._discard(key)
        return payload

    def __contains__(self, key: str) -> bool:
        """Whether an entry exists under ``key`` (cheap: does not read or check
        it, nor mark it as used; ``get`` may still return ``None``)."""
        _check_key(key)
        return key in self._cache

    def _discard(self, key: str) -> None:
        # Re-check under the store's write lock, so that a good entry another
        # process wrote meanwhile is not deleted.
        with self._cache.transact(retry=True):
            blob = self._cache.get(key, default=None, retry=True)
            if blob is None:
                if key not in self._cache:
                    return
            elif _unpack(blob) is not None:
                return
            self._cache.delete(key, retry=True)
        log.warning("kvlens store: discarded damaged entry %s in %s", key, self.directory)

    # -- writing ------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` (exactly ``bytes``; anything else raises ``TypeError``)
        under ``key``, replacing any entry, then evict least-recently-used
        entries until the store fits its size limit. A value larger than the
        size limit is not stored."""
        _check_key(key)
        if type(data) is not bytes:
            raise TypeError(f"TraceStore stores bytes only, not {type(data).__name__}")
        blob = _pack(data)
        if len(blob) > self.size_limit:
            log.warning(
                "kvlens store: %d-byte value exceeds the %d-byte size limit; not stored",
                len(blob),
                self.size_limit,
            )
            self._cache.delete(key, retry=True)  # don't leave an older value behind
            return
        self._cache.set(key, blob, retry=True)
        self._evict()

    def _evict(self) -> None:
        # diskcache's own culling removes up to ten entries at once (which can
        # include the value just written when few large entries fit); here the
        # least-recently-used entry goes, one per transaction, until the volume
        # fits, and the last entry left is kept. Uses diskcache's internal
        # _transact/_cull (diskcache is pinned to 5.6.3 in requirements.txt).
        cache = self._cache
        for _ in range(len(cache) + 1):
            if cache.volume() <= self.size_limit or len(cache) <= 1:
                return
            with cache._transact(True) as (sql, cleanup):
                cache._cull(time.time(), sql, cleanup, limit=1)

    def clear(self) -> int:
        """Remove every entry; return how many were removed."""
        return self._cache.clear(retry=True)

    def volume(self) -> int:
        """Estimated bytes on disk (SQLite file plus value files)."""
        return self._cache.volume()

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Close the database connection (the store reopens it if used again)."""
        self._cache.close()

    def __enter__(self) -> "TraceStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TraceStore({self.directory!r}, size_limit={self.size_limit})"


def _check_key(key) -> None:
    if type(key) is not str:
        raise TypeError(f"store keys must be str, not {type(key).__name__}")


def get_or_compute(store: TraceStore, key: str, compute: Callable[[], bytes]) -> tuple[bytes, bool]:
    """Return ``(data, replayed)``: the stored bytes and ``True`` if ``key`` is in
    ``store`` and intact, else ``compute()``'s bytes (stored for next time) and
    ``False``. ``compute`` must return ``bytes``. A failure to write the store
    (disk full, database locked) is logged, not raised: the result is returned
    anyway."""
    data = store.get(key)
    if data is not None:
        return data, True
    data = compute()
    if type(data) is not bytes:
        raise TypeError(f"compute() must return bytes, not {type(data).__name__}")
    try:
        store.put(key, data)
    except (OSError, sqlite3.Error, diskcache.Timeout) as exc:
        log.warning("kvlens store: could not store %s: %s", key, exc)
    return data, False
