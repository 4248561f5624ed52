"""What a prefill compression's attention rows cost: a run of SnapKV and Expected Attention at budget 256 (and Full)
over the shipped inaugural addresses, generate mode, one new token, with the engine computing the attention row of
only the queries a compression reads (its window), and of every query.

    python -m benchmarks.prefill_rows [TOKENS]      # default 2048; process CPU time, one torch thread
"""
import sys
import time

import numpy as np
import torch

from backend.engine import attention
from backend.engine.models import load_model
from backend.engine.runner import compute_traces
from backend.policies import parse_spec

from .scaling import long_text

SPECS = ["snapkv:budget=256", "expected_attention:budget=256"]


def main() -> None:
    torch.set_num_threads(1)
    lm = load_model()
    ids = lm.tokenizer(long_text()).input_ids[:int(sys.argv[1]) if len(sys.argv) > 1 else 2048]

    def run() -> float:
        start = time.process_time()
        compute_traces(lm, SPECS, [parse_spec(s) for s in SPECS], ids, mode="generate", max_new_tokens=1,
                       record_layers=())
        return time.process_time() - start

    run()  # warm-up
    window = run()
    read = attention.RowLayerState._rows_read
    attention.RowLayerState._rows_read = lambda self, first, n, n_prompt: np.ones(n, bool)
    try:
        every = run()
    finally:
        attention.RowLayerState._rows_read = read
    with torch.inference_mode():
        start = time.process_time()
        lm.model(torch.tensor([ids]))
        plain = time.process_time() - start
    print(f"{len(ids)} tokens, {' and '.join(SPECS)} + Full, generate mode, 1 new token: every query's attention row "
          f"{every:.1f} s CPU, the window's only {window:.1f} s; one plain forward {plain:.2f} s")


if __name__ == "__main__":
    main()
