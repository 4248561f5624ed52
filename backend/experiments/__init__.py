"""Experiments made of many runs: perplexity against budget (sweep.py), needle grids (needle.py), both as
grids of jobs run serially or on Ray (grid.py), the shipped results (shipped.py), and RULER's tasks as
lm-evaluation-harness makes and scores them (tasks.py) with KV Lens as its model ``kvlens`` (lm_eval_model.py)."""
