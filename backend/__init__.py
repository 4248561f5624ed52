"""KV Lens's backend: the front door (api.py), the command line, and the packages below them."""
import os

# A row's numbers must not depend on which rows share its batch (a shared prefill is the row's own to the bit,
# tests/test_shared_prefill.py). MKL's matrix products on an AVX-512 machine round a row otherwise as the batch's
# row count changes (a row's log-probabilities 3e-6 apart); its strict reproducible mode rounds alike, at no cost
# (benchmarks/mkl_modes.py). MKL reads the setting at its first product, so it holds wherever no product ran before
# this import; an operator's own MKL_CBWR stays. On AMD's processors the strict mode does not hold for products of
# fewer than 4 rows; the engine makes none where sharing Full's prefill would change a row's batch (engine/attention.py).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
