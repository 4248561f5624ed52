"""A trace: what one policy did on one text, as arrays plus JSON metadata (docs/trace-format.md)."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
ARRAY_FIELDS = ("tokens", "evicted_at", "selected", "scored_ids", "logprobs", "top1_ids", "kl_to_full",
                "generated_ids", "attention", "keys", "rope_inv_freq")


class Trace:
    """Arrays of one policy's run (see docs/trace-format.md) plus its metadata dict."""

    def __init__(self, meta: dict, tokens, scored_ids, logprobs, top1_ids, kl_to_full, evicted_at=None, selected=None,
                 generated_ids=None, attention=None, keys=None, rope_inv_freq=None, stats=None, **stat_arrays):
        # Per-step numbers travel as ``stat_<name>`` arrays (e.g. SparQ's stat_alpha [L, T, H_q]).
        self.meta, self.tokens, self.scored_ids, self.logprobs = meta, tokens, scored_ids, logprobs
        self.top1_ids, self.kl_to_full, self.evicted_at, self.selected = top1_ids, kl_to_full, evicted_at, selected
        self.generated_ids, self.attention, self.keys, self.rope_inv_freq = generated_ids, attention, keys, rope_inv_freq
        self.stats = dict(stats or {})
        for name, values in stat_arrays.items():
            if not name.startswith("stat_"):
                raise TypeError(f"unexpected trace field {name!r}")
            self.stats[name[5:]] = values

    @property
    def spec(self) -> str:
        return self.meta["spec"]

    def reads(self, layer: int) -> np.ndarray:
        """bool [H_kv, T, T]: reads[h, t, j] is True when query t read token j in this layer."""
        if self.selected is not None:
            return self.selected[layer]
        n = len(self.tokens)
        t = np.arange(n)[:, None]
        j = np.arange(n)[None, :]
        if self.evicted_at is None:  # full attention
            return np.broadcast_to(j <= t, (self.meta["n_kv_heads"], n, n))
        gone = self.evicted_at[layer][:, None, :]
        return (j <= t)[None] & ((gone < 0) | (t[None] < gone))

    def arrays(self) -> dict[str, np.ndarray]:
        out = {name: getattr(self, name) for name in ARRAY_FIELDS if getattr(self, name) is not None}
        out.update({f"stat_{name}": values for name, values in self.stats.items()})
        if "selected" in out:
            out["selected"] = np.packbits(out["selected"], axis=-1)
        return out

    def to_bytes(self) -> bytes:
        """One .npz byte string holding the arrays and the metadata JSON (as uint8)."""
        buf = io.BytesIO()
        meta = np.frombuffer(json.dumps(self.meta).encode(), np.uint8)
        np.savez_compressed(buf, meta_json=meta, **self.arrays())
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Trace":
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(npz["meta_json"].tobytes().decode())
            return cls._from_arrays(meta, {k: npz[k] for k in npz.files if k != "meta_json"})

    @classmethod
    def _from_arrays(cls, meta: dict, arrays: dict) -> "Trace":
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"trace format {meta.get('format_version')} is not {FORMAT_VERSION}")
        if "selected" in arrays:
            n = len(arrays["tokens"])
            arrays["selected"] = np.unpackbits(arrays["selected"], axis=-1, count=n).astype(bool)
        return cls(meta=meta, **arrays)

    def npz_bytes(self) -> bytes:
        """The arrays alone, as the bytes of ``NAME.npz``."""
        buf = io.BytesIO()
        np.savez_compressed(buf, **self.arrays())
        return buf.getvalue()

    def save(self, directory: Path, stem: str) -> Path:
        """Write ``stem.npz`` (arrays) and ``stem.json`` (metadata); return the npz path."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{stem}.npz"
        path.write_bytes(self.npz_bytes())
        (directory / f"{stem}.json").write_text(json.dumps(self.meta, indent=1))
        return path

    @classmethod
    def load(cls, npz_path: Path) -> "Trace":
        npz_path = Path(npz_path)
        meta = json.loads(npz_path.with_suffix(".json").read_text())
        with np.load(npz_path, allow_pickle=False) as npz:
            return cls._from_arrays(meta, {k: npz[k] for k in npz.files})


def file_stem(index: int, spec: str) -> str:
    """A safe file name for the ``index``-th trace of a run: ``03-tova-budget-64``."""
    return f"{index:02d}-" + re.sub(r"[^A-Za-z0-9.]+", "-", spec).strip("-")
