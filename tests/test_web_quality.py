"""The long-task figures of benchmarks.web_quality, by hand (the measurement itself is a benchmark, not a test)."""
from benchmarks.web_quality import blocking


def test_blocking_time_counts_each_task_past_50_ms():
    # 120 ms blocks 70, 50 ms blocks nothing, 300 ms blocks 250: 320 in all; the longest is 300.
    assert blocking([120.0, 50.0, 300.0]) == (300.0, 320.0)
    assert blocking([]) == (0.0, 0.0)
