"""Tests for backend/traces/store.py when the disk or the database misbehaves: the
store is a cache and must never take the app or the CLI down."""

from __future__ import annotations

import errno
import glob
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import zlib

import diskcache
import numpy as np
import pytest

from backend.traces import store as store_mod
from backend.traces.store import TraceStore, get_or_compute

LIMIT = 1 * 2**20
LARGE = 150_000  # above diskcache's disk_min_file_size: stored in a .val file
SMALL = 1_000  # stored inside SQLite
ENTRY = LARGE + store_mod._HEADER.size


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def value_files(directory) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*", "*", "*.val")))


def dir_bytes(directory) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(directory)
        for name in names
    )


def set_aside(directory) -> list[str]:
    return sorted(glob.glob(f"{directory}.broken-*"))


def warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "backend.traces.store" and r.levelno >= logging.WARNING
    ]


def age(paths, seconds: float = 3600) -> None:
    """Make files look old (orphans younger than a few minutes are kept)."""
    then = time.time() - seconds
    for path in paths:
        os.utime(path, (then, then))


def fill(st: TraceStore, n: int, size: int = LARGE, prefix: str = "k") -> dict[str, bytes]:
    values = {f"{prefix}{i}": payload(size, seed=zlib.crc32(f"{prefix}{i}".encode())) for i in range(n)}
    for key, data in values.items():
        st.put(key, data)
    return values


def assert_works(st: TraceStore) -> None:
    """A working store: a fresh value round-trips, and get_or_compute replays it."""
    assert st.available and st.disabled_reason is None
    data = payload(LARGE, seed=99)
    st.put("fresh", data)
    assert st.get("fresh") == data
    assert get_or_compute(st, "fresh", lambda: b"unused") == (data, True)
    assert get_or_compute(st, "computed", lambda: b"new") == (b"new", False)
    assert get_or_compute(st, "computed", lambda: b"unused") == (b"new", True)


def assert_uncached(st: TraceStore) -> None:
    """A no-op store: misses, stores nothing, never raises."""
    assert not st.available
    assert st.disabled_reason
    assert st.put("k", b"data") is False
    assert st.get("k") is None
    assert "k" not in st
    assert st.volume() == 0
    assert st.clear() == 0
    calls = []
    for _ in range(2):
        assert get_or_compute(st, "k", lambda: calls.append(1) or b"data") == (b"data", False)
    assert calls == [1, 1]
    st.close()


def damage_db(directory, how: str) -> None:
    db = os.path.join(directory, "cache.db")
    size = os.path.getsize(db)
    if how == "garbage":  # overwritten in place
        with open(db, "r+b") as f:
            f.write(os.urandom(max(size, 4096)))
    elif how == "half":
        os.truncate(db, size // 2)
    elif how == "zero":
        os.truncate(db, 0)
    elif how == "delete":
        os.remove(db)
    elif how == "replace":  # a new file renamed over it
        with open(db + ".tmp", "wb") as f:
            f.write(os.urandom(size))
        os.replace(db + ".tmp", db)
    else:
        raise ValueError(how)


# ---------------------------------------------------------------------------
# 1. Opening never raises


@pytest.mark.parametrize("how", ["garbage", "half"])
def test_damaged_database_is_set_aside_and_rebuilt(tmp_path, caplog, how):
    directory = tmp_path / "store"
    with TraceStore(directory, size_limit=LIMIT) as st:
        fill(st, 3, SMALL, "s")
        fill(st, 3)
    damage_db(directory, how)
    damaged = (directory / "cache.db").read_bytes()

    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(directory, size_limit=LIMIT)
    (log_line,) = warnings(caplog)
    (aside,) = set_aside(directory)
    assert "damaged" in log_line and aside in log_line
    # Moved, not deleted: the old database and value files are all there.
    assert open(os.path.join(aside, "cache.db"), "rb").read() == damaged
    assert len(value_files(aside)) == 3
    # The new store is empty and works.
    assert st.get("k0") is None and st.get("s0") is None
    assert value_files(directory) == []
    assert_works(st)
    st.close()


def test_database_cut_to_zero_bytes_opens_empty(tmp_path, caplog):
    directory = tmp_path / "store"
    with TraceStore(directory, size_limit=LIMIT) as st:
        fill(st, 3, SMALL)
    damage_db(directory, "zero")  # an empty file is a valid, empty SQLite database
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        with TraceStore(directory, size_limit=LIMIT) as st:
            assert st.get("k0") is None
            assert_works(st)
    assert warnings(caplog) == []
    assert set_aside(directory) == []


# Named ids: pytest-xdist's workers each collect the tests, and their ids must agree (the bytes differ).
@pytest.mark.parametrize("content", [b"", b"SQLite format 3\x00" + os.urandom(200)], ids=["empty", "sqlite-header"])
def test_store_file_in_place_of_the_directory_is_set_aside(tmp_path, caplog, content):
    # An empty or SQLite file at the store path: the store path itself was
    # opened as a database (or touched) by mistake.
    path = tmp_path / "store"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(path, size_limit=LIMIT)
    (log_line,) = warnings(caplog)
    (aside,) = set_aside(path)
    assert "damaged" in log_line and aside in log_line
    assert open(aside, "rb").read() == content
    assert path.is_dir()
    assert_works(st)
    st.close()


def test_other_file_at_the_store_path_is_left_alone(tmp_path, caplog):
    # Anything else there is not ours to move (the path may be set wrong).
    path = tmp_path / "notes.txt"
    path.write_text("a user's file")
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(path, size_limit=LIMIT)
    (log_line,) = warnings(caplog)
    assert "uncached" in log_line and str(path) in log_line
    assert "does not look like a kvlens store" in st.disabled_reason
    assert path.read_text() == "a user's file"
    assert set_aside(path) == []
    assert_uncached(st)


def test_damaged_database_among_other_files_is_left_alone(tmp_path, caplog):
    directory = tmp_path / "mine"
    directory.mkdir()
    (directory / "cache.db").write_bytes(os.urandom(8192))
    (directory / "thesis.tex").write_text("not a cache")
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(directory, size_limit=LIMIT)
    assert len(warnings(caplog)) == 1
    assert sorted(os.listdir(directory)) == ["cache.db", "thesis.tex"]
    assert set_aside(directory) == []
    assert_uncached(st)


UNWRITABLE = {
    "read-only database": sqlite3.OperationalError("attempt to write a readonly database"),
    "read-only file system": OSError(errno.EROFS, "Read-only file system"),
    "permission denied": OSError(errno.EACCES, "Permission denied"),  # chmod 0o500, not root
    "cannot open": sqlite3.OperationalError("unable to open database file"),
    "locked": diskcache.Timeout(),
}


@pytest.mark.parametrize("error", list(UNWRITABLE))
def test_unwritable_store_runs_uncached(tmp_path, caplog, monkeypatch, error):
    # Root ignores chmod, so the errors an unwritable or read-only location
    # gives are raised where diskcache opens the database.
    directory = tmp_path / "store"
    with TraceStore(directory, size_limit=LIMIT) as st:
        st.put("k", b"kept")
    before = sorted(os.listdir(directory))

    def refuse(self, *args, **kwargs):
        raise UNWRITABLE[error]

    monkeypatch.setattr(diskcache.Cache, "__init__", refuse)
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(directory, size_limit=LIMIT)
    (log_line,) = warnings(caplog)
    assert "uncached" in log_line
    assert_uncached(st)
    monkeypatch.undo()
    assert sorted(os.listdir(directory)) == before  # nothing moved or deleted
    assert set_aside(directory) == []
    with TraceStore(directory, size_limit=LIMIT) as st:
        assert st.get("k") == b"kept"


def test_unopenable_database_runs_uncached(tmp_path, caplog, monkeypatch):
    # sqlite3.connect itself failing, as on a directory SQLite may not write.
    def refuse(*args, **kwargs):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(sqlite3, "connect", refuse)
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(tmp_path / "store", size_limit=LIMIT)
    assert len(warnings(caplog)) == 1
    assert_uncached(st)


def test_damaged_store_that_cannot_be_moved_runs_uncached(tmp_path, caplog, monkeypatch):
    directory = tmp_path / "store"
    with TraceStore(directory, size_limit=LIMIT) as st:
        fill(st, 2)
    damage_db(directory, "garbage")

    def refuse(src, dst):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "rename", refuse)
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(directory, size_limit=LIMIT)
    assert len(warnings(caplog)) == 1
    assert_uncached(st)
    assert len(value_files(directory)) == 2


@pytest.mark.parametrize("where", ["under /proc", "under a file"])
def test_real_unusable_locations_run_uncached(tmp_path, caplog, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    if where == "under /proc" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    path = "/proc/kvlens-test-store" if where == "under /proc" else blocker / "store"
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(path, size_limit=LIMIT)
    assert len(warnings(caplog)) == 1
    assert_uncached(st)
    assert blocker.read_text() == "in the way"


def test_real_unwritable_directory_runs_uncached(tmp_path, caplog):
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions (the monkeypatched tests cover this)")
    directory = tmp_path / "store"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
            st = TraceStore(directory, size_limit=LIMIT)
        assert len(warnings(caplog)) == 1
        assert_uncached(st)
    finally:
        directory.chmod(0o700)


# ---------------------------------------------------------------------------
# 2. Damage while the store is open


DAMAGE_WHILE_OPEN = [
    *[(how, True) for how in ("garbage", "half", "zero", "delete", "replace")],
    # Truncation under an open connection runs in a subprocess (see
    # test_truncated_database_does_not_kill_the_process): a crash there would end the test run.
    *[(how, False) for how in ("garbage", "delete", "replace")],
]


@pytest.mark.parametrize(
    "how, fresh_connection",
    DAMAGE_WHILE_OPEN,
    ids=[f"{how}-{'new' if fresh else 'same'} connection" for how, fresh in DAMAGE_WHILE_OPEN],
)
def test_damage_while_open_is_survived(tmp_path, caplog, how, fresh_connection):
    directory = tmp_path / "store"
    st = TraceStore(directory, size_limit=4 * LIMIT)
    values = {**fill(st, 4, SMALL, "s"), **fill(st, 4)}
    damage_db(directory, how)
    if fresh_connection:
        st.close()  # as a new thread would: a fresh connection reads the damaged file

    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        for _ in range(2):
            for key, data in values.items():  # each a hit or a miss, never an error
                assert st.get(key) in (None, data)
                assert isinstance(key in st, bool)
            st.put("after", b"after the damage")  # stored, or logged and not
            assert st.get("after") in (None, b"after the damage")
            assert st.volume() >= 0
            st.close()  # the next round on a fresh connection, which sees the damage
        # The store has recovered, without a restart.
        assert_works(st)
        for key, data in values.items():
            assert st.get(key) in (None, data)
    assert len(set_aside(directory)) <= 1
    assert dir_bytes(directory) <= 4 * LIMIT + ENTRY
    st.close()


def test_second_store_does_not_set_aside_the_rebuilt_one(tmp_path, caplog):
    # Two processes share a store; the first to hit the damage rebuilds it, the
    # other one then just reopens the new database.
    directory = tmp_path / "store"
    first = TraceStore(directory, size_limit=LIMIT)
    second = TraceStore(directory, size_limit=LIMIT)
    fill(first, 2)
    assert second.get("k0") is not None
    first.close()
    second.close()
    damage_db(directory, "garbage")
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        assert first.get("k0") is None
        first.put("shared", b"from the first")
        assert second.get("shared") == b"from the first"
        second.put("other", b"from the second")
        assert first.get("other") == b"from the second"
    assert len(set_aside(directory)) == 1
    assert sum("damaged" in line for line in warnings(caplog)) == 1


def test_damage_found_by_another_thread(tmp_path, caplog):
    # Threads have their own connections; the one that finds the damage
    # rebuilds the store, and the others go on with the new one.
    directory = tmp_path / "store"
    st = TraceStore(directory, size_limit=LIMIT)
    fill(st, 2)
    damage_db(directory, "garbage")
    found = []
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        worker = threading.Thread(target=lambda: found.append(st.get("k0")))
        worker.start()
        worker.join()
        assert found == [None]
        assert st.get("k1") is None
        assert_works(st)
    assert len(set_aside(directory)) == 1
    assert sum("damaged" in line for line in warnings(caplog)) == 1
    st.close()


TRUNCATE_WHILE_OPEN = """
import os, sys
sys.path.insert(0, sys.argv[1])
from backend.traces.store import TraceStore
for cut in ("zero", "half"):
    st = TraceStore(os.path.join(sys.argv[2], cut), size_limit=2**24)
    for i in range(40):
        st.put(f"k{i}", os.urandom(1000))
    db = os.path.join(st.directory, "cache.db")
    os.truncate(db, 0 if cut == "zero" else os.path.getsize(db) // 2)
    for i in range(40):
        st.get(f"k{i}")
        st.put(f"n{i}", os.urandom(1000))
    st.close()
    for i in range(40):  # a fresh connection: the damage shows, and is repaired
        st.get(f"k{i}")
    st.put("fresh", b"fresh")
    assert st.get("fresh") == b"fresh"
    st.close()
print("survived")
"""


def test_truncated_database_does_not_kill_the_process(tmp_path):
    # Reading a memory-mapped file past its new end raises SIGBUS; in a
    # subprocess, so that a crash fails this test rather than the test run.
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", TRUNCATE_WHILE_OPEN, repo, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "survived" in result.stdout


# ---------------------------------------------------------------------------
# 3. Full disk, read-only database


def _fail_midway(self, full_path, iterator, mode, encoding=None):
    with open(full_path, "wb") as f:  # a partial file, as a full disk leaves
        f.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")


def _full_row(self, *args):
    raise sqlite3.OperationalError("database or disk is full")


FULL_DISK = {
    "value file: ENOSPC": (store_mod._BytesOnlyDisk, "_write", _fail_midway),
    "row insert: disk full": (diskcache.Cache, "_row_insert", _full_row),
    "row update: disk full": (diskcache.Cache, "_row_update", _full_row),
}


@pytest.mark.parametrize(
    "failure, size",
    [("value file: ENOSPC", LARGE)] + [(f, size) for f in list(FULL_DISK)[1:] for size in (SMALL, LARGE)],
)
def test_full_disk_put_is_not_cached(tmp_path, caplog, monkeypatch, failure, size):
    directory = tmp_path / "store"
    st = TraceStore(directory, size_limit=LIMIT)
    before = fill(st, 2, size)
    files = value_files(directory)
    owner, name, replacement = FULL_DISK[failure]
    monkeypatch.setattr(owner, name, replacement)

    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        assert st.put("k0" if "update" in failure else "new", payload(size, seed=7)) is False  # no raise
    (log_line,) = warnings(caplog)
    assert "not cached" in log_line
    assert value_files(directory) == files  # no partial or unreferenced file left behind
    assert "new" not in st
    for key, data in before.items():  # still readable while the disk is full
        assert st.get(key) == data
    assert get_or_compute(st, "other", lambda: b"computed") == (b"computed", False)

    monkeypatch.undo()  # space again
    assert st.put("new", payload(size, seed=7)) is True
    assert_works(st)
    st.close()


def _read_only_connect(real_connect):
    def connect(database, *args, **kwargs):
        return real_connect(f"file:{database}?mode=ro", *args, uri=True, **kwargs)

    return connect


def test_read_only_database_still_serves_reads(tmp_path, caplog, monkeypatch):
    # A real read-only SQLite connection: Cache.get's access-time update fails
    # with SQLITE_READONLY, and the value must still come back.
    directory = tmp_path / "store"
    st = TraceStore(directory, size_limit=LIMIT)
    values = {**fill(st, 2, SMALL, "s"), **fill(st, 2)}
    monkeypatch.setattr(sqlite3, "connect", _read_only_connect(sqlite3.connect))
    st.close()  # reconnects read-only

    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        for key, data in values.items():
            assert st.get(key) == data
        assert warnings(caplog) == []
        assert st.put("new", payload(LARGE, seed=5)) is False
        assert sum("not cached" in line for line in warnings(caplog)) == 1
    assert st.get("new") is None
    assert len(value_files(directory)) == 2  # the refused value's file was removed
    assert get_or_compute(st, "s0", lambda: b"unused") == (values["s0"], True)
    monkeypatch.undo()
    st.close()
    assert_works(st)
    st.close()


@pytest.mark.parametrize(
    "error",
    [sqlite3.OperationalError("database or disk is full"), diskcache.Timeout()],
    ids=["disk full", "lock timeout"],
)
def test_get_falls_back_to_a_plain_read(tmp_path, monkeypatch, error):
    st = TraceStore(tmp_path / "store", size_limit=LIMIT)
    values = {**fill(st, 2, SMALL, "s"), **fill(st, 2)}

    def failing_get(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(diskcache.Cache, "get", failing_get)
    for key, data in values.items():
        assert st.get(key) == data
    assert st.get("missing") is None
    st.close()


# Real full and read-only file systems: a small tmpfs (needs root and mount).


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def mount(size: str) -> str:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root and mount(8)")
        point = tmp_path / f"tmpfs{len(mounted)}"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here: {result.stderr.strip()}")
        mounted.append(point)
        return str(point)

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def test_real_full_disk(tmpfs, caplog):
    point = tmpfs("2m")
    filler = os.path.join(point, "filler")  # something else fills the disk
    with open(filler, "wb") as f:
        f.write(b"\0" * (1200 * 2**10))
    directory = os.path.join(point, "store")
    st = TraceStore(directory, size_limit=8 * LIMIT)  # larger than the disk
    stored = {}
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        for i in range(12):
            data = payload(100_000, seed=i)
            st.put(f"k{i}", data)  # never raises
            if st.get(f"k{i}") == data:
                stored[f"k{i}"] = data
    assert 0 < len(stored) < 12
    assert any("not cached" in line for line in warnings(caplog))
    for key, data in stored.items():  # the disk is still full
        assert st.get(key) == data
    # No partial or unreferenced value file was left behind.
    rows = st._cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL").fetchall()
    assert sorted(os.path.relpath(p, directory) for p in value_files(directory)) == sorted(n for n, in rows)
    os.remove(filler)
    assert_works(st)
    st.close()


def test_real_read_only_file_system(tmpfs, caplog):
    point = tmpfs("4m")
    directory = os.path.join(point, "store")
    with TraceStore(directory, size_limit=LIMIT) as st:
        fill(st, 2)
    del st
    result = subprocess.run(["mount", "-o", "remount,ro", point], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot remount read-only: {result.stderr.strip()}")
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(directory, size_limit=LIMIT)
    assert len(warnings(caplog)) == 1
    assert_uncached(st)
    assert len(value_files(directory)) == 2


# ---------------------------------------------------------------------------
# 4. Orphaned value files, 5. the size bound


def test_orphaned_value_files_are_reclaimed(tmp_path, caplog):
    directory = tmp_path / "store"
    with TraceStore(directory, size_limit=LIMIT) as st:
        assert LARGE >= st._cache.disk.min_file_size  # these go to .val files
        fill(st, 5)
    orphans = value_files(directory)
    assert len(orphans) == 5
    damage_db(directory, "zero")  # every row gone, every file orphaned
    age(orphans)
    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        st = TraceStore(directory, size_limit=LIMIT)
    (log_line,) = warnings(caplog)
    assert "removed 5 value files" in log_line
    assert value_files(directory) == []
    assert st.volume() <= LIMIT
    assert dir_bytes(directory) <= LIMIT
    assert_works(st)
    st.close()


def test_only_old_unreferenced_value_files_are_reclaimed(tmp_path):
    directory = tmp_path / "store"
    with TraceStore(directory, size_limit=LIMIT) as st:
        fill(st, 2)
    referenced = value_files(directory)
    age(referenced)
    young = directory / "ab" / "cd" / ("0" * 28 + ".val")  # another process's write in progress
    young.parent.mkdir(parents=True, exist_ok=True)
    young.write_bytes(b"being written")
    others = [
        directory / "ab" / "cd" / "notes.val",  # not diskcache's name pattern
        directory / "ab" / ("1" * 28 + ".val"),  # wrong depth
        directory / "zz" / "cd" / ("2" * 28 + ".val"),  # not a hex folder
        directory / "readme.txt",
    ]
    for path in others:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not ours")
    age(others)
    # A linked folder is not followed, though what it leads to looks like value files.
    outside = tmp_path / "elsewhere" / "cd" / ("3" * 28 + ".val")
    outside.parent.mkdir(parents=True)
    outside.write_bytes(b"outside")
    age([outside])
    # diskcache names its folders at random: link under a hex name it has not used.
    link = next(directory / f"{i:02x}" for i in range(256) if not (directory / f"{i:02x}").exists())
    os.symlink(tmp_path / "elsewhere", link)

    with TraceStore(directory, size_limit=LIMIT) as st:
        assert st.get("k0") is not None and st.get("k1") is not None
    kept = sorted([*referenced, str(young), str(link / "cd" / outside.name)])
    assert [p for p in value_files(directory) if store_mod._VALUE_FILE.search(p)] == kept
    assert all(path.read_bytes() == b"not ours" for path in others)
    assert outside.read_bytes() == b"outside"


def test_size_limit_counts_every_file_of_the_store(tmp_path):
    directory = tmp_path / "store"
    st = TraceStore(directory, size_limit=LIMIT)
    for i in range(1200):  # small entries live in the database: SQLite's write-ahead log grows with them
        st.put(f"s{i}", payload(SMALL, seed=i))
    fill(st, 12)
    assert dir_bytes(directory) <= LIMIT + ENTRY
    assert st.volume() <= LIMIT + ENTRY
    assert_works(st)
    assert dir_bytes(directory) <= LIMIT + ENTRY
    st.close()


def test_size_bound_holds_through_damage_and_rebuild(tmp_path):
    directory = tmp_path / "store"
    bound = LIMIT + ENTRY  # every file, the write-ahead log included

    def check(st):
        assert st.volume() <= LIMIT + ENTRY
        assert dir_bytes(directory) <= bound

    st = TraceStore(directory, size_limit=LIMIT)
    for round_ in range(3):
        fill(st, 12, prefix=f"r{round_}-")  # about twice the limit
        check(st)
        st.close()
        if round_ == 0:
            damage_db(directory, "garbage")  # set aside and rebuilt on the next call
        elif round_ == 1:
            files = value_files(directory)
            damage_db(directory, "zero")  # orphans every value file
            age(files)
            st = TraceStore(directory, size_limit=LIMIT)  # reclaims them on open
            check(st)
    assert_works(st)
    check(st)
    st.close()
