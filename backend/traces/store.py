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

Size: the store is bounded by ``size_limit`` (bytes of every file of the store:
the SQLite database, its write-ahead log and index, and the value files). After
each write that goes over it, the write-ahead log is checkpointed and cut to
nothing, then least-recently-used entries are evicted one at a time, so
``volume()`` stays within ``size_limit`` plus at most one entry. A value whose
stored form is larger than ``size_limit`` is not stored at all.

Failures: the store is only a cache, so it never takes its caller down. Apart
from a bad ``size_limit`` or ``$KVLENS_STORE_MB`` (``ValueError``), nothing in it
raises for the state of the disk, and each event below logs one warning:

- A damaged store (a database SQLite cannot read, or an SQLite or empty file
  where the store directory goes) is renamed to ``<dir>.broken-<time>`` and an
  empty store is built in its place. It is moved, never deleted, and only if it
  looks like a store (see :func:`_looks_like_store`); otherwise it is left alone.
  Damage found while the store is open is handled the same way, on the call
  that finds it.
- If the store cannot be opened or rebuilt (read-only or unwritable location,
  a path that is not ours to move), it runs uncached: ``get`` misses, ``put``
  does nothing, and :attr:`TraceStore.available` is ``False``, with
  :attr:`TraceStore.disabled_reason` saying why.
- A full disk or read-only database makes ``put`` log "not cached" and return
  False (``put`` says whether it stored); ``get`` still returns stored data (it
  then skips marking the entry as used).
- Value files that no row refers to (a database cut short or deleted, a writer
  that died) are deleted when the store is opened, once they are a few minutes
  old (younger ones may be another process's write in progress).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import sqlite3
import struct
import threading
import time
from typing import Callable

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW, UNKNOWN

__all__ = ["FORMAT_VERSION", "run_key", "TraceStore", "get_or_compute", "load_trace"]

log = logging.getLogger(__name__)

from .trace import FORMAT_VERSION, Trace  # noqa: E402  one version for traces and store entries
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
_HEX_DIR = re.compile(r"[0-9a-f]{2}")
_VALUE_NAME = re.compile(r"[0-9a-f]{28}\.val")

_DB_NAME = "cache.db"  # diskcache's database file
_SIDE_FILES = ("-wal", "-shm", "-journal")  # SQLite's files beside it, counted in the size limit
_WAL_SHARE = 8  # over the limit, a log larger than 1/8 of it is checkpointed rather than entries evicted
# What a store directory holds: the database (with its WAL and journal files)
# and the two-hex-digit folders of value files.
_STORE_ENTRY = re.compile(r"cache\.db(-wal|-shm|-journal)?|[0-9a-f]{2}")
_SQLITE_MAGIC = b"SQLite format 3\x00"

# Errors from the disk or the database that a store operation turns into a miss
# or "not cached" (diskcache.Timeout: the database stayed locked, or a write
# transaction could not start).
_STORE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)

# A value file younger than this is never taken for an orphan: diskcache writes
# the file before its row, and the writer may then wait up to a minute (the
# SQLite timeout) for the database lock.
_ORPHAN_MIN_AGE_S = 300


class _Refused:
    """Returned by :meth:`_BytesOnlyDisk.fetch` for an entry it won't decode."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<refused diskcache entry>"


_REFUSED = _Refused()


class _BytesOnlyDisk(diskcache.Disk):
    """A diskcache ``Disk`` that stores and loads only ``str`` keys and ``bytes``
    values, through diskcache's raw paths; it never calls pickle."""

    def __init__(self, directory, **kwargs):
        super().__init__(directory, **kwargs)
        self._written = threading.local()

    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"store keys must be str, not {type(key).__name__}")
        return key, True  # what Disk.put returns for a str: stored raw

    def get(self, key, raw):
        # Only used when iterating keys, which TraceStore does not do.
        if not raw:
            raise TypeError("refusing to unpickle a non-raw diskcache key")
        return bytes(key) if isinstance(key, (bytes, memoryview)) else key

    def store(self, value, read, key=UNKNOWN):
        if read or type(value) is not bytes:
            raise TypeError(f"store values must be bytes, not {type(value).__name__}")
        # For bytes, Disk.store takes only MODE_RAW (small) or MODE_BINARY (file).
        size, mode, filename, db_value = super().store(value, False, key=key)
        if mode not in (MODE_RAW, MODE_BINARY):  # cannot happen for bytes in diskcache 5.6.3
            raise TypeError(f"diskcache chose mode {mode} for bytes; refusing")
        return size, mode, filename, db_value

    def filename(self, key=UNKNOWN, value=UNKNOWN):
        # Remember the value file this thread is about to write, so that a
        # failed write can remove it (see _set).
        name, full_path = super().filename(key, value)
        self._written.name = name
        return name, full_path

    def forget_written(self) -> str | None:
        """The value file this thread last started to write (None if none), forgotten."""
        name = getattr(self._written, "name", None)
        self._written.name = None
        return name

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


def size_limit_from_env(environ=os.environ) -> int:
    """The size limit in bytes from ``$KVLENS_STORE_MB`` (default 300 MB); ValueError names a malformed one."""
    text = environ.get(ENV_MB)
    if not text:
        return DEFAULT_SIZE_MB * 2**20
    try:
        mb = float(text)
    except ValueError:
        raise ValueError(f"{ENV_MB}={text!r} is not a number of megabytes") from None
    if not (mb > 0 and math.isfinite(mb)):
        raise ValueError(f"{ENV_MB}={text!r} must be a positive number of megabytes")
    return int(mb * 2**20)


class _Broken(Exception):
    """The store path holds something that is not a usable store."""


class _Unusable(Exception):
    """The store is broken but will not be moved aside (see _looks_like_store)."""


class TraceStore:
    """An on-disk, size-bounded, least-recently-used store of ``bytes`` values
    under ``str`` keys (from :func:`run_key`), safe to share between processes.

    Open one ``TraceStore`` per process (don't carry one across a fork); within
    a process, threads may share it. diskcache's SQLite transactions make
    concurrent writes to one key, from any number of processes, leave exactly
    one complete entry.

    It never raises for the state of the disk (see the module docstring): a
    damaged store is set aside and rebuilt, and a store that cannot be used
    runs uncached, with :attr:`available` ``False``.
    """

    def __init__(self, directory: str | os.PathLike | None = None, size_limit: int | None = None):
        """Open (creating if needed) the store in ``directory``.

        ``directory`` defaults to ``$KVLENS_STORE_DIR``, else
        ``~/.cache/kvlens/store``. ``size_limit`` is in bytes; it defaults to
        ``$KVLENS_STORE_MB`` megabytes, else 300 MB. Raises ``ValueError`` for a
        bad size limit, nothing else.
        """
        if directory is None:
            directory = _default_directory()
        self.directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
        if size_limit is None:
            size_limit = size_limit_from_env()
        if isinstance(size_limit, bool) or not isinstance(size_limit, int) or size_limit <= 0:
            raise ValueError(f"size_limit must be a positive int (bytes), not {size_limit!r}")
        self.size_limit = size_limit
        self.disabled_reason: str | None = None
        """Why the store runs uncached, or None while it works."""
        self._cache: diskcache.Cache | None = None  # None: running uncached
        self._db_id: tuple | None = None  # identity of the database file opened
        self._lock = threading.Lock()  # one thread at a time reopens the store
        self._open()

    @property
    def available(self) -> bool:
        """Whether values are cached (False: the store could not be used, see
        :attr:`disabled_reason`; ``get`` then always misses)."""
        return self._cache is not None

    @property
    def _db_path(self) -> str:
        return os.path.join(self.directory, _DB_NAME)

    # -- opening and repairing ----------------------------------------------

    def _open(self, damage: Exception | None = None) -> None:
        """(Re)open the store. If it is broken (or ``damage``, seen by the
        caller, says so), set it aside and build an empty one; if that fails
        too, run uncached. Logs one line unless it simply opened (two if it
        set the store aside and then could not build a new one)."""
        if self._cache is not None:
            _close_quietly(self._cache)
        try:
            if damage is None:
                try:
                    self._connect()
                    return
                except Exception as exc:
                    if not _is_damage(exc):
                        raise
                    damage = exc
            aside = self._set_aside()
            log.warning(
                "kvlens store: %s was damaged (%s); moved it to %s, starting an empty store",
                self.directory, _describe(damage), aside,
            )
            self._connect()
        except Exception as exc:  # opening must never stop the app: run uncached
            self._cache, self._db_id = None, None
            reason = _describe(exc)
            self.disabled_reason = reason if damage is None else f"{_describe(damage)}; {reason}"
            log.warning(
                "kvlens store: cannot use %s (%s); running uncached, results are not stored",
                self.directory, self.disabled_reason,
            )

    def _connect(self) -> None:
        if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
            raise _Broken("the store path is a file, not a directory")
        cache = diskcache.Cache(
            self.directory,
            disk=_BytesOnlyDisk,
            size_limit=self.size_limit,
            eviction_policy="least-recently-used",
            cull_limit=0,  # put() evicts itself, one entry at a time (see _evict)
            statistics=0,
            # No memory-mapped reads: if the database file is cut short while
            # mapped (by a person, a full disk), reading it kills the process (SIGBUS).
            sqlite_mmap_size=0,
        )
        try:
            db_id = _file_id(self._db_path)
            self._reclaim_orphans(cache)  # reads every row: a damaged table shows here
        except BaseException:
            _close_quietly(cache)
            raise
        self._cache, self._db_id, self.disabled_reason = cache, db_id, None

    def _set_aside(self) -> str:
        """Rename the broken store to ``<dir>.broken-<time>`` and return the new
        name. It is kept, not deleted (the user may look at it, then remove it),
        and moved only if it looks like a store: the path may point elsewhere
        by mistake."""
        if not _looks_like_store(self.directory):
            raise _Unusable(f"{self.directory} does not look like a kvlens store, so it was left as is")
        stem = f"{self.directory}.broken-{time.strftime('%Y%m%d-%H%M%S')}"
        target, n = stem, 1
        while os.path.lexists(target):
            n += 1
            target = f"{stem}-{n}"
        os.rename(self.directory, target)
        return target

    def _reclaim_orphans(self, cache: diskcache.Cache) -> None:
        """Delete value files that no row refers to (left by a database that was
        cut short or deleted, or by a writer that died): they count against no
        size limit and would never be freed. Only diskcache's own value-file
        names are considered, and only files older than _ORPHAN_MIN_AGE_S."""
        cutoff = time.time() - _ORPHAN_MIN_AGE_S
        old = [(name, size) for name, mtime, size in _value_files(self.directory) if mtime < cutoff]
        rows = cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL").fetchall()
        referenced = {name for (name,) in rows}
        orphans = [(name, size) for name, size in old if name not in referenced]
        for name, _ in orphans:
            cache.disk.remove(name)
        if orphans:
            log.warning(
                "kvlens store: removed %d value files (%d bytes) that no entry referred to from %s",
                len(orphans), sum(size for _, size in orphans), self.directory,
            )

    def _live(self) -> diskcache.Cache | None:
        """The open cache, or None when running uncached. If the database file
        was deleted or replaced since it was opened (by a person, or by another
        process that rebuilt a damaged store), reopen first: the connection
        would otherwise go on using the old, unlinked file."""
        cache = self._cache
        if cache is not None and _file_id(self._db_path) != self._db_id:
            with self._lock:
                if self._cache is cache and _file_id(self._db_path) != self._db_id:
                    log.warning("kvlens store: %s was removed or replaced; reopening", self._db_path)
                    self._open()
                cache = self._cache
        return cache

    def _failed(self, cache: diskcache.Cache, exc: Exception, message: str, *args) -> None:
        """After an operation on ``cache`` raised ``exc``: set a damaged database
        aside and start empty; for anything else (full disk, read-only, locked)
        log ``message`` and go on, the call having been a miss / not cached."""
        if not _is_damage(exc):
            log.warning("kvlens store: " + message + " (%s: %s)", *args, type(exc).__name__, exc)
            _close_quietly(cache)  # the next call starts afresh, with no half-done transaction
            return
        with self._lock:
            if self._cache is not cache:
                return  # another thread has reopened the store already
            if _file_id(self._db_path) == self._db_id:
                self._open(damage=exc)  # still the file that failed
            else:
                self._open()  # another process has replaced it already

    # -- reading ------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """Return the bytes stored under ``key``, or ``None`` if there are none
        or the entry is damaged (bad header, other format version, checksum
        mismatch, truncated, not bytes, missing file); a damaged entry is
        deleted. Marks the entry as recently used. Also ``None`` when the store
        cannot be read at all (never raises for that)."""
        _check_key(key)
        cache = self._live()
        if cache is None:
            return None
        try:
            blob = _read(cache, key)
            if blob is None:
                if key in cache:  # a row whose value file is gone
                    self._discard(key)
                return None
            payload = _unpack(blob)
            if payload is None:
                self._discard(key)
            return payload
        except _STORE_ERRORS as exc:
            self._failed(cache, exc, "could not read %s", key)
            return None

    def __contains__(self, key: str) -> bool:
        """Whether an entry exists under ``key`` (cheap: does not read or check
        it, nor mark it as used; ``get`` may still return ``None``)."""
        _check_key(key)
        cache = self._live()
        if cache is None:
            return False
        try:
            return key in cache
        except _STORE_ERRORS as exc:
            self._failed(cache, exc, "could not look up %s", key)
            return False

    def _discard(self, key: str) -> None:
        # Re-check under the store's write lock, so that a good entry another
        # process wrote meanwhile is not deleted.
        cache = self._cache
        if cache is None:
            return
        with cache.transact():
            blob = cache.get(key, default=None)
            if blob is None:
                if key not in cache:
                    return
            elif _unpack(blob) is not None:
                return
            cache.delete(key)
        log.warning("kvlens store: discarded damaged entry %s in %s", key, self.directory)

    # -- writing ------------------------------------------------------------

    def put(self, key: str, data: bytes) -> bool:
        """Store ``data`` (exactly ``bytes``; anything else raises ``TypeError``)
        under ``key``, replacing any entry, then evict least-recently-used
        entries until the store fits its size limit. Returns whether the value
        is stored: False when the store runs uncached, for a value larger than
        the size limit, and when the store cannot be written (full disk,
        read-only: logs "not cached")."""
        _check_key(key)
        if type(data) is not bytes:
            raise TypeError(f"TraceStore stores bytes only, not {type(data).__name__}")
        blob = _pack(data)
        cache = self._live()
        if cache is None:
            return False
        try:
            if len(blob) > self.size_limit:
                log.warning(
                    "kvlens store: %d-byte value exceeds the %d-byte size limit; not stored",
                    len(blob),
                    self.size_limit,
                )
                cache.delete(key)  # don't leave an older value behind
                return False
            _set(cache, key, blob)
            self._evict(cache)
        except _STORE_ERRORS as exc:
            self._failed(cache, exc, "could not store %s; not cached", key)
            return False
        return True

    def _side_bytes(self) -> int:
        """Bytes of SQLite's files beside the database (the write-ahead log and
        its index), which diskcache's volume does not count; the log grows to
        megabytes between checkpoints."""
        side = 0
        for suffix in _SIDE_FILES:
            try:
                side += os.stat(self._db_path + suffix).st_size
            except OSError:
                pass
        return side

    def _footprint(self, cache: diskcache.Cache) -> int:
        """Bytes of every file of the store: the database, the value files and SQLite's side files."""
        return cache.volume() + self._side_bytes()

    def _evict(self, cache: diskcache.Cache) -> None:
        # Over the limit, a large write-ahead log goes back into the database
        # and is cut to nothing (a checkpoint costs an fsync, so not for a
        # small one). Then the least-recently-used entry goes, one per
        # transaction, until every file fits, and the last entry left is kept
        # (diskcache's own culling removes up to ten at once, which can include
        # the value just written, and stops at its own volume, which leaves
        # the log out). Uses diskcache's internal _transact (diskcache is
        # pinned to 5.6.3 in requirements.txt).
        checkpointed = False
        for _ in range(len(cache) + 1):
            if self._footprint(cache) <= self.size_limit:
                return
            if not checkpointed and self._side_bytes() > self.size_limit // _WAL_SHARE:
                cache._sql("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                checkpointed = True
                continue
            if len(cache) <= 1:
                return
            with cache._transact() as (sql, cleanup):
                for rowid, filename in sql("SELECT rowid, filename FROM Cache ORDER BY access_time LIMIT 1").fetchall():
                    sql("DELETE FROM Cache WHERE rowid = ?", (rowid,))
                    cleanup(filename)

    def clear(self) -> int:
        """Remove every entry; return how many were removed (0 if the store
        cannot be written)."""
        cache = self._live()
        if cache is None:
            return 0
        try:
            return cache.clear()
        except _STORE_ERRORS as exc:
            self._failed(cache, exc, "could not clear %s", self.directory)
            return 0

    def volume(self) -> int:
        """Bytes on disk of every file of the store (the database, its
        write-ahead log and index, the value files); 0 when the store runs
        uncached or cannot be read."""
        cache = self._live()
        if cache is None:
            return 0
        try:
            return self._footprint(cache)
        except _STORE_ERRORS as exc:
            self._failed(cache, exc, "could not measure %s", self.directory)
            return 0

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Close the database connection (the store reopens it if used again)."""
        if self._cache is not None:
            _close_quietly(self._cache)

    def __enter__(self) -> "TraceStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        uncached = "" if self.available else ", uncached"
        return f"TraceStore({self.directory!r}, size_limit={self.size_limit}{uncached})"


# No call below passes retry=True: diskcache then retries a failed BEGIN forever,
# and a read-only or unopenable database fails it every time. SQLite itself
# waits up to a minute for a lock before diskcache raises Timeout.


def _read(cache: diskcache.Cache, key: str):
    """The value stored under ``key`` as fetched by _BytesOnlyDisk, or None.

    Cache.get marks the entry as used, which is a write; if that fails (full
    disk, read-only database, lock timeout), the row is read without marking
    it, so that a hit stays a hit. Still only through _BytesOnlyDisk.fetch."""
    try:
        return cache.get(key, default=None)
    except _STORE_ERRORS as exc:
        if _is_damage(exc):
            raise
    rows = cache._sql(
        "SELECT mode, filename, value FROM Cache WHERE key = ? AND raw = 1", (key,)
    ).fetchall()
    if not rows:
        return None
    ((mode, filename, value),) = rows
    try:
        return cache.disk.fetch(mode, filename, value, False)
    except OSError:  # the value file is gone
        return None


def _set(cache: diskcache.Cache, key: str, blob: bytes) -> None:
    """``cache.set``, without leaving a value file behind when it fails."""
    disk = cache.disk
    disk.forget_written()
    try:
        cache.set(key, blob)
    except Exception:
        # diskcache writes the value file before its row: if the write (full
        # disk) or the row (rolled back) failed, no row refers to the file and
        # it would never be counted or freed.
        name = disk.forget_written()
        if name is not None:
            disk.remove(name)
        raise


def _is_damage(exc: BaseException) -> bool:
    """Whether ``exc`` says the store itself is broken (set it aside and start
    empty), rather than the disk being full, read-only or busy (skip caching)."""
    if isinstance(exc, _Broken):
        return True
    if type(exc) is sqlite3.DatabaseError:  # "file is not a database", "... malformed"
        return True
    # Our tables are gone: the file was emptied or replaced by another database.
    return isinstance(exc, sqlite3.OperationalError) and str(exc).startswith("no such table")


def _looks_like_store(path: str) -> bool:
    """Whether ``path`` may be moved aside as a broken store: a directory that
    holds cache.db and nothing but diskcache's files and folders, or a plain file
    that is empty or an SQLite database (the store path opened as a database).
    Never a symlink, never anything else (a user's folder, a document)."""
    if os.path.islink(path):
        return False
    if os.path.isfile(path):
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
        return head in (b"", _SQLITE_MAGIC)
    if os.path.isdir(path):
        names = os.listdir(path)
        return _DB_NAME in names and all(_STORE_ENTRY.fullmatch(name) for name in names)
    return False


def _value_files(directory: str):
    """Yield ``(name, mtime, size)`` for each of diskcache's value files
    (``xx/yy/<28 hex>.val``, names relative to ``directory``); nothing else,
    and no symlinks."""
    for top in _scandir(directory):
        if not (_HEX_DIR.fullmatch(top.name) and top.is_dir(follow_symlinks=False)):
            continue
        for sub in _scandir(top.path):
            if not (_HEX_DIR.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
                continue
            for entry in _scandir(sub.path):
                if _VALUE_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    yield os.path.join(top.name, sub.name, entry.name), st.st_mtime, st.st_size


def _scandir(path: str) -> list:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError:
        return []


def _file_id(path: str) -> tuple | None:
    """(device, inode) of ``path``, or None if it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__  # diskcache.Timeout() has no message


def _close_quietly(cache: diskcache.Cache) -> None:
    with contextlib.suppress(Exception):
        cache.close()


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
    except (OSError, sqlite3.Error, diskcache.Timeout) as exc:  # from a stand-in store; TraceStore.put doesn't
        log.warning("kvlens store: could not store %s: %s", key, exc)
    return data, False


def load_trace(store: TraceStore | None, key: str) -> Trace | None:
    """The trace stored under ``key``; None when there is no store, no such entry, or it cannot be read
    despite a good checksum (the caller then computes it again)."""
    data = store.get(key) if store is not None and isinstance(key, str) else None
    if data is None:
        return None
    try:
        return Trace.from_bytes(data)
    except (ValueError, KeyError, OSError):
        return None
