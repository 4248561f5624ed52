"""Tests for backend/traces/store.py (the on-disk trace store)."""

from __future__ import annotations

import glob
import hashlib
import io
import logging
import multiprocessing
import os
import sqlite3
import time

import diskcache
import numpy as np
import pytest

from backend.traces import store as store_mod
from backend.traces.store import TraceStore, get_or_compute, run_key

SMALL = 1_000  # stored inside SQLite by diskcache (below its 32 KB file threshold)
LARGE = 200_000  # stored in a .val file


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def npz_bytes(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        evicted_at=rng.integers(-1, 512, size=(4, 2, 64), dtype=np.int32),
        logprobs=rng.standard_normal(63).astype(np.float32),
    )
    return buf.getvalue()


def rows(directory) -> list[tuple]:
    con = sqlite3.connect(os.path.join(directory, "cache.db"))
    try:
        return con.execute("SELECT key, raw, mode, filename FROM Cache").fetchall()
    finally:
        con.close()


def value_files(directory) -> list[str]:
    return glob.glob(os.path.join(directory, "*", "*", "*.val"))


BASE = dict(
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    model_fingerprint="sha256:abc123",
    token_ids=[1, 17, 42, 9000],
    policy="tova",
    params={"budget": 64, "heads": "kv", "sink": 4},
    mode="generate",
    generation={"max_new_tokens": 32, "greedy": True, "stop": ["\n\n"]},
)


# ---------------------------------------------------------------------------
# Round trip and the raw (pickle-free) storage path


@pytest.mark.parametrize("size", [0, SMALL, LARGE])
def test_round_trip(tmp_path, size):
    data = payload(size, seed=size)
    with TraceStore(tmp_path, size_limit=2**24) as st:
        assert st.get("k") is None
        assert "k" not in st
        st.put("k", data)
        assert "k" in st
        assert st.get("k") == data
    with TraceStore(tmp_path, size_limit=2**24) as st:  # persists across opens
        assert st.get("k") == data
        st.put("k", b"replaced")
        assert st.get("k") == b"replaced"
        assert st.clear() == 1
        assert st.get("k") is None


def test_npz_round_trip(tmp_path):
    data = npz_bytes()
    with TraceStore(tmp_path) as st:
        st.put(run_key(**BASE), data)
        got = st.get(run_key(**BASE))
    with np.load(io.BytesIO(got), allow_pickle=False) as z:
        with np.load(io.BytesIO(data), allow_pickle=False) as ref:
            for name in ref.files:
                np.testing.assert_array_equal(z[name], ref[name])


def test_values_take_diskcache_raw_paths(tmp_path):
    with TraceStore(tmp_path) as st:
        st.put("small", payload(SMALL))
        st.put("large", payload(LARGE))
    got = {key: (raw, mode, filename) for key, raw, mode, filename in rows(tmp_path)}
    assert set(got) == {"small", "large"}
    assert all(raw == 1 for raw, _, _ in got.values())  # str keys stored raw
    assert got["small"][1] == diskcache.core.MODE_RAW and got["small"][2] is None
    assert got["large"][1] == diskcache.core.MODE_BINARY and got["large"][2].endswith(".val")


@pytest.mark.parametrize(
    "value", [bytearray(b"x"), memoryview(b"x"), "text", 3, {"a": 1}, np.zeros(3), None]
)
def test_put_refuses_non_bytes(tmp_path, value):
    with TraceStore(tmp_path) as st:
        with pytest.raises(TypeError, match="bytes"):
            st.put("k", value)
        assert "k" not in st
    assert rows(tmp_path) == []


def test_disk_layer_refuses_non_bytes(tmp_path):
    # Even used directly, the Disk under TraceStore never falls back to pickle.
    cache = diskcache.Cache(str(tmp_path), disk=store_mod._BytesOnlyDisk)
    try:
        for value in ("text", 3, 2.5, {"a": 1}, Exploit(tmp_path / "m")):
            with pytest.raises(TypeError):
                cache.set("k", value)
        with pytest.raises(TypeError):
            cache.set(("tuple", "key"), b"x")
        with pytest.raises(TypeError):
            cache.set("k", io.BytesIO(b"x"), read=True)
        cache.set("k", b"x")
        assert cache.get("k") == b"x"
    finally:
        cache.close()
    assert [mode for _, _, mode, _ in rows(tmp_path)] == [diskcache.core.MODE_RAW]


@pytest.mark.parametrize("key", [b"k", 1, ("k",), None])
def test_keys_must_be_str(tmp_path, key):
    with TraceStore(tmp_path) as st:
        with pytest.raises(TypeError, match="str"):
            st.put(key, b"x")
        with pytest.raises(TypeError, match="str"):
            st.get(key)
    assert rows(tmp_path) == []


def test_defaults_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "envdir"))
    monkeypatch.setenv("KVLENS_STORE_MB", "5")
    with TraceStore() as st:
        assert st.directory == str(tmp_path / "envdir")
        assert st.size_limit == 5 * 2**20
        st.put("k", b"v")
    assert os.path.exists(tmp_path / "envdir" / "cache.db")

    monkeypatch.delenv("KVLENS_STORE_DIR")
    monkeypatch.delenv("KVLENS_STORE_MB")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with TraceStore() as st:
        assert st.directory == str(tmp_path / "home" / ".cache" / "kvlens" / "store")
        assert st.size_limit == 300 * 2**20

    monkeypatch.setenv("KVLENS_STORE_MB", "lots")
    with pytest.raises(ValueError, match="KVLENS_STORE_MB"):
        TraceStore(tmp_path / "x")


# ---------------------------------------------------------------------------
# run_key


def test_run_key_is_a_stable_canonical_hash():
    key = run_key(**BASE)
    assert len(key) == 64 and int(key, 16) >= 0
    assert run_key(**BASE) == key
    # Reordered kwargs and reordered nested dicts give the same key.
    shuffled = {k: BASE[k] for k in reversed(list(BASE))}
    shuffled["params"] = {"sink": 4, "heads": "kv", "budget": 64}
    shuffled["generation"] = {"stop": ["\n\n"], "greedy": True, "max_new_tokens": 32}
    assert run_key(**shuffled) == key
    # Tuples count as lists.
    assert run_key(**{**BASE, "token_ids": tuple(BASE["token_ids"])}) == key
    # Pinned: the canonical text is sorted compact JSON of {format_version, fields}.
    text = (
        '{"fields":{"generation":{"greedy":true,"max_new_tokens":32,"stop":["\\n\\n"]},'
        '"mode":"generate","model":"HuggingFaceTB/SmolLM2-135M-Instruct",'
        '"model_fingerprint":"sha256:abc123","params":{"budget":64,"heads":"kv","sink":4},'
        '"policy":"tova","token_ids":[1,17,42,9000]},"format_version":%d}' % store_mod.FORMAT_VERSION
    )
    assert key == hashlib.sha256(text.encode()).hexdigest()


CHANGES = {
    "model": ("model", "other/model"),
    "fingerprint": ("model_fingerprint", "sha256:abc124"),
    "one token": ("token_ids", [1, 17, 43, 9000]),
    "token order": ("token_ids", [17, 1, 42, 9000]),
    "one more token": ("token_ids", [1, 17, 42, 9000, 2]),
    "one token fewer": ("token_ids", [1, 17, 42]),
    "policy": ("policy", "h2o"),
    "param value": ("params", {"budget": 65, "heads": "kv", "sink": 4}),
    "param type": ("params", {"budget": 64.0, "heads": "kv", "sink": 4}),
    "param str": ("params", {"budget": "64", "heads": "kv", "sink": 4}),
    "param other": ("params", {"budget": 64, "heads": "layer", "sink": 4}),
    "param added": ("params", {"budget": 64, "heads": "kv", "sink": 4, "window": 0}),
    "param removed": ("params", {"budget": 64, "heads": "kv"}),
    "param renamed": ("params", {"budget": 64, "heads": "kv", "sinks": 4}),
    "mode": ("mode", "prompt"),
    "generation length": ("generation", {"max_new_tokens": 33, "greedy": True, "stop": ["\n\n"]}),
    "generation flag": ("generation", {"max_new_tokens": 32, "greedy": 1, "stop": ["\n\n"]}),
    "generation stop": ("generation", {"max_new_tokens": 32, "greedy": True, "stop": ["\n"]}),
    "field dropped": ("mode", None),  # handled below: the field is removed
    "field added": ("seed", 0),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_run_key_changes_with_every_field(change):
    name, value = CHANGES[change]
    fields = dict(BASE)
    if change == "field dropped":
        del fields[name]
    else:
        fields[name] = value
    assert run_key(**fields) != run_key(**BASE)


def test_run_key_includes_format_version(monkeypatch):
    before = run_key(**BASE)
    monkeypatch.setattr(store_mod, "FORMAT_VERSION", store_mod.FORMAT_VERSION + 1)
    assert run_key(**BASE) != before


def _circular():
    a = []
    a.append(a)
    return a


@pytest.mark.parametrize(
    "field, value",
    [
        ("token_ids", np.array([1, 2, 3])),
        ("token_ids", [1, np.int64(2)]),
        ("params", {"budget": {64, 65}}),
        ("params", {1: "budget"}),
        ("model_fingerprint", b"\x00\x01"),
        ("policy", object()),
        ("params", {"ratio": float("nan")}),
        ("params", {"ratio": float("inf")}),
        ("generation", _circular()),
    ],
)
def test_run_key_rejects_non_json(field, value):
    with pytest.raises(TypeError, match=field):
        run_key(**{**BASE, field: value})


# ---------------------------------------------------------------------------
# Corruption


def _bad_header_version(blob: bytes) -> bytes:
    return blob[:4] + (99).to_bytes(4, "big") + blob[8:]


CORRUPTIONS = {
    "truncated by one byte": lambda b: b[:-1],
    "truncated inside the header": lambda b: b[:20],
    "empty": lambda b: b"",
    "payload byte flipped": lambda b: b[:-7] + bytes([b[-7] ^ 0x01]) + b[-6:],
    "magic flipped": lambda b: bytes([b[0] ^ 0x20]) + b[1:],
    "checksum flipped": lambda b: b[:20] + bytes([b[20] ^ 0x80]) + b[21:],
    "length field wrong": lambda b: b[:8] + (len(b)).to_bytes(8, "big") + b[16:],
    "version field wrong": _bad_header_version,
    "extra byte appended": lambda b: b + b"\x00",
    "no header at all": lambda b: b[48:],
}


@pytest.mark.parametrize("size", [SMALL, LARGE])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_value_is_a_miss_then_recomputed(tmp_path, caplog, size, corruption):
    data = payload(size, seed=1)
    with TraceStore(tmp_path) as st:
        st.put("k", data)
        st.put("other", b"untouched")
    raw = diskcache.Cache(str(tmp_path))  # plain diskcache, bytes in, bytes out
    good = raw.get("k")
    assert type(good) is bytes and good.endswith(data)
    raw.set("k", CORRUPTIONS[corruption](good))
    raw.close()

    calls = []

    def compute():
        calls.append(1)
        return data

    with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
        with TraceStore(tmp_path) as st:
            assert st.get("k") is None
            assert "k" not in st  # the damaged entry was deleted
            assert st.get("other") == b"untouched"
            assert get_or_compute(st, "k", compute) == (data, False)
            assert get_or_compute(st, "k", compute) == (data, True)
    assert calls == [1]
    assert "damaged" in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "delete", "garbage"])
def test_corrupt_value_file_is_a_miss_then_recomputed(tmp_path, damage):
    data = payload(LARGE, seed=2)
    with TraceStore(tmp_path) as st:
        st.put("k", data)
    (path,) = value_files(tmp_path)
    blob = open(path, "rb").read()
    if damage == "truncate":
        open(path, "wb").write(blob[: len(blob) // 2])
    elif damage == "flip":
        open(path, "wb").write(blob[:1000] + bytes([blob[1000] ^ 0xFF]) + blob[1001:])
    elif damage == "empty":
        open(path, "wb").close()
    elif damage == "delete":
        os.remove(path)
    else:
        open(path, "wb").write(os.urandom(len(blob)))

    with TraceStore(tmp_path) as st:
        assert st.get("k") is None
        assert "k" not in st
        assert value_files(tmp_path) == []  # the damaged file went with its entry
        assert get_or_compute(st, "k", lambda: data) == (data, False)
        assert get_or_compute(st, "k", lambda: data) == (data, True)


def test_repaired_entry_is_not_deleted(tmp_path):
    # The delete is re-checked under the lock: if the entry is good again by
    # then (another process rewrote it), it stays.
    data = payload(SMALL)
    with TraceStore(tmp_path) as st:
        st.put("k", data)
        st._discard("k")
        assert st.get("k") == data


# A pickled object that, when unpickled, creates a marker file.
def _touch(path, padding):
    open(path, "w").close()
    return "unpickled"


class Exploit:
    def __init__(self, marker, padding=b""):
        self.marker = str(marker)
        self.padding = padding

    def __reduce__(self):
        return (_touch, (self.marker, self.padding))


@pytest.mark.parametrize("size", [0, LARGE])  # pickle kept in SQLite / in a file
def test_planted_pickle_is_never_unpickled(tmp_path, size):
    marker = tmp_path / "marker"
    directory = str(tmp_path / "store")
    with TraceStore(directory) as st:
        st.put("k", b"good")
    raw = diskcache.Cache(directory)  # default Disk pickles non-bytes values
    raw.set("k", Exploit(marker, b"p" * size))
    raw.close()
    assert {mode for _, _, mode, _ in rows(directory)} == {diskcache.core.MODE_PICKLE}

    with TraceStore(directory) as st:
        assert st.get("k") is None
        assert not marker.exists()
        assert "k" not in st  # refused entry deleted
        st.clear()
    assert not marker.exists()

    # Control: the same planted entry does run code when plain diskcache reads it.
    raw = diskcache.Cache(directory)
    raw.set("k", Exploit(marker, b"p" * size))
    assert raw.get("k") == "unpickled"
    raw.close()
    assert marker.exists()


@pytest.mark.parametrize("planted", ["short text", "long text " * 10_000, 7, 2.5])
def test_planted_non_bytes_value_is_a_miss(tmp_path, planted):
    raw = diskcache.Cache(str(tmp_path))
    raw.set("k", planted)
    raw.close()
    with TraceStore(tmp_path) as st:
        assert st.get("k") is None
        assert "k" not in st
    assert value_files(tmp_path) == []


def test_planted_file_path_is_neither_read_nor_deleted(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"not the store's")
    directory = tmp_path / "store"
    with TraceStore(directory) as st:
        st.put("k", payload(LARGE))
    (path,) = value_files(directory)
    con = sqlite3.connect(directory / "cache.db")
    with con:
        con.execute("UPDATE Cache SET filename = ? WHERE key = 'k'", (str(victim),))
    con.close()
    with TraceStore(directory) as st:
        assert st.get("k") is None
        assert "k" not in st
    assert victim.read_bytes() == b"not the store's"


def test_format_version_change_makes_old_entries_misses(tmp_path, monkeypatch):
    data = npz_bytes()
    old_key = run_key(**BASE)
    with TraceStore(tmp_path) as st:
        st.put(old_key, data)
        st.put("literal", data)
        monkeypatch.setattr(store_mod, "FORMAT_VERSION", store_mod.FORMAT_VERSION + 1)
        new_key = run_key(**BASE)
        assert new_key != old_key
        assert st.get(new_key) is None
        # Same key, old header: the version check alone makes it a miss.
        assert st.get("literal") is None
        assert "literal" not in st
        assert get_or_compute(st, new_key, lambda: data) == (data, False)
        assert st.get(new_key) == data


# ---------------------------------------------------------------------------
# Size bound and LRU


def test_size_bound_and_lru(tmp_path):
    limit = 2 * 2**20
    size = 100_000
    with TraceStore(tmp_path, size_limit=limit) as st:
        for i in range(10):
            st.put(f"k{i}", payload(size, seed=i))
        assert st.volume() < limit  # nothing evicted yet
        assert all(f"k{i}" in st for i in range(10))
        assert st.get("k0") == payload(size, seed=0)  # k0 now most recently used
        for i in range(10, 60):
            st.put(f"k{i}", payload(size, seed=i))
            assert st.volume() <= limit
            assert st.get(f"k{i}") == payload(size, seed=i)  # the new entry stays
            if i < 25:
                st.get("k0")  # keep k0 in use for a while
        present = [i for i in range(60) if f"k{i}" in st]
        total_files = sum(os.path.getsize(p) for p in value_files(tmp_path))
    assert total_files <= limit
    # The newest entries are kept, a contiguous run up to k59; everything older is gone.
    assert present[-1] == 59
    assert present == list(range(present[0], 60))
    assert len(present) >= limit // (size + 48) - 3
    assert present[0] > 25


def test_lru_keeps_used_entry(tmp_path):
    limit = 1 * 2**20
    size = 150_000
    with TraceStore(tmp_path, size_limit=limit) as st:
        for i in range(5):
            st.put(f"k{i}", payload(size, seed=i))
        st.get("k0")
        for i in range(5, 8):
            st.put(f"k{i}", payload(size, seed=i))
        assert "k0" in st  # used recently, kept
        assert "k1" not in st  # least recently used, evicted first
        assert st.volume() <= limit


def test_few_large_values_are_not_wiped_at_once(tmp_path):
    # diskcache's own culling drops ten entries at a time, which here would
    # include the value just written.
    limit = 1 * 2**20
    with TraceStore(tmp_path, size_limit=limit) as st:
        for i in range(6):
            st.put(f"k{i}", payload(400_000, seed=i))
            assert st.get(f"k{i}") == payload(400_000, seed=i)
            assert st.volume() <= limit
        assert "k4" in st


def test_value_larger_than_limit_is_not_stored(tmp_path):
    limit = 1 * 2**20
    with TraceStore(tmp_path, size_limit=limit) as st:
        st.put("small", payload(SMALL))
        st.put("huge", b"old")
        st.put("huge", payload(limit))  # header makes it exceed the limit
        assert st.get("huge") is None
        assert st.get("small") == payload(SMALL)
        data, replayed = get_or_compute(st, "huge", lambda: payload(limit))
        assert (data, replayed) == (payload(limit), False)
        assert st.volume() <= limit


# ---------------------------------------------------------------------------
# get_or_compute


def test_get_or_compute(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return npz_bytes(len(calls))

    with TraceStore(tmp_path) as st:
        first = get_or_compute(st, "k", compute)
        assert first == (npz_bytes(1), False)
        assert get_or_compute(st, "k", compute) == (npz_bytes(1), True)
        assert calls == [1]
        with pytest.raises(TypeError, match="bytes"):
            get_or_compute(st, "other", lambda: "not bytes")
        assert "other" not in st


def test_get_or_compute_survives_a_failed_write(tmp_path, monkeypatch):
    with TraceStore(tmp_path) as st:

        def failing_put(key, data):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(st, "put", failing_put)
        assert get_or_compute(st, "k", lambda: b"data") == (b"data", False)
        assert "k" not in st


# ---------------------------------------------------------------------------
# Concurrency

N_WRITES = 15
BIG = 1_500_000


def concurrent_value(writer: int, i: int) -> bytes:
    return np.random.default_rng(1000 * writer + i).bytes(BIG)


def _writer(directory: str, writer: int, barrier, times) -> None:
    values = [concurrent_value(writer, i) for i in range(N_WRITES)]
    with TraceStore(directory, size_limit=2**28) as st:
        barrier.wait(timeout=60)
        start = time.perf_counter()
        i = 0
        # At least N_WRITES writes, and for at least half a second, so that the
        # two writers (and the reader) overlap even on a loaded machine.
        while i < N_WRITES or time.perf_counter() - start < 0.5:
            st.put("shared", values[i % N_WRITES])
            i += 1
        times.put((start, time.perf_counter()))


def test_concurrent_writers_leave_one_good_entry(tmp_path, caplog):
    directory = str(tmp_path)
    valid = {concurrent_value(w, i) for w in (1, 2) for i in range(N_WRITES)}
    with TraceStore(directory, size_limit=2**28):
        pass  # create the database before the race
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    times = ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(directory, w, barrier, times), daemon=True)
        for w in (1, 2)
    ]
    seen = 0
    try:
        for p in procs:
            p.start()
        with caplog.at_level(logging.WARNING, logger="backend.traces.store"):
            with TraceStore(directory, size_limit=2**28) as st:
                barrier.wait(timeout=60)
                while any(p.is_alive() for p in procs):
                    got = st.get("shared")
                    if got is not None:
                        assert got in valid
                        seen += 1
                for p in procs:
                    p.join(timeout=60)
                    assert p.exitcode == 0
                spans = [times.get(timeout=10) for _ in procs]
                final = st.get("shared")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert final in valid
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # the writers did overlap
    assert "damaged" not in caplog.text  # no reader ever saw a torn value
    assert seen > 0
    assert len(rows(directory)) == 1
    assert len(value_files(directory)) == 1  # replaced files were all cleaned up


def test_the_suite_never_opens_the_users_store():
    """A test's writes would evict the user's traces down to the default size limit (tests/conftest.py)."""
    from tests.conftest import TEST_STORE

    with TraceStore() as st:
        assert st.directory == TEST_STORE != os.path.expanduser(os.path.join("~", ".cache", "kvlens", "store"))
