"""The engine: runs a model with an instrumented cache in which every policy decides what each query reads
(attention.py), fed by the runner (runner.py); models and what differs between their families (models.py,
features.py)."""
