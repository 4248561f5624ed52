"""The engine: runs a model with an instrumented cache in which every policy decides what each query reads
(attention.py), fed by the runner (runner.py); models and what differs between their families (models.py,
features.py)."""

# The runner's block sizes, here so that the front ends and the limits read them without importing the engine's
# modules (and transformers with them).
DEFAULT_CHUNK = 256  # prompt tokens per forward call
LM_HEAD_CHUNK = 64  # positions per lm-head call: bounds the [rows, positions, vocab] logits tensor
