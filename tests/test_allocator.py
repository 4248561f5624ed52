"""The allocator setting that keeps a run's freed arrays from piling up in glibc's heap."""
import subprocess
import sys

import pytest

from backend.engine import allocator, runner
from backend.engine.allocator import LIBC, bound_mmap_threshold
from backend.policies import parse_spec
from tests.conftest import make_tiny

# In a fresh process: free a 4 MB array (glibc then raises its mmap threshold to 4 MB), allocate 2 MB, and
# print how many bytes glibc holds in mmapped blocks more than before (mallinfo2's hblkhd).
PROBE = """
import ctypes, sys
import numpy as np
from backend.engine.allocator import bound_mmap_threshold
if sys.argv[1] == "bound":
    assert bound_mmap_threshold(1 << 20)
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = Info
big = np.ones(4 << 20, np.uint8)
del big
before = mallinfo2().hblkhd
medium = np.ones(2 << 20, np.uint8)
print(mallinfo2().hblkhd - before)
"""


def _mmapped_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(LIBC is None, reason="the C library is not glibc")
def test_a_freed_big_block_no_longer_sends_the_next_ones_to_the_heap():
    assert _mmapped_bytes("default") < 2 << 20  # glibc's own rule: the 2 MB array came from the heap
    assert _mmapped_bytes("bound") >= 2 << 20  # bounded: from mmap, so freeing it returns it


def test_no_threshold_is_set_unless_an_operator_asks(monkeypatch):
    monkeypatch.delenv("KVLENS_MMAP_THRESHOLD", raising=False)
    assert bound_mmap_threshold() is False
    monkeypatch.setenv("KVLENS_MMAP_THRESHOLD", "0")
    assert bound_mmap_threshold() is False


def test_every_forward_call_of_a_run_gives_the_freed_pages_back(monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "give_back", lambda: calls.append(1) or True)
    lm = make_tiny()
    ids = list(range(3, 40))
    runner.compute_traces(lm, ["tova:budget=8"], [parse_spec("tova:budget=8")], ids, "generate", 3, chunk=16,
               record_layers=())
    assert len(calls) >= 3 + 3  # prompt blocks (37 tokens in blocks of 16) and the decoding steps
    assert allocator.give_back() is (LIBC is not None)
