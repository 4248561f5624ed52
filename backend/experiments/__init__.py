"""Experiments made of many runs: perplexity against budget (sweep.py), needle grids (needle.py), both as
grids of jobs run serially or on Ray (grid.py), and the shipped results (shipped.py)."""
