"""Analyses of traces (metrics, what each query read, parts of speech, t-SNE of keys): they read traces and
never run the model."""
