"""Traces: what a run recorded (trace.py, with its spans and recorded attention) and the disk store that keeps
them (store.py). Plain data: nothing here imports the engine."""
