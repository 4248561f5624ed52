"""A trace: what one policy did on one text, as arrays plus JSON metadata (docs/trace-format.md)."""
from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
ARRAY_FIELDS = ("tokens", "evicted_at", "selected", "scored_ids", "logprobs", "top1_ids", "kl_to_full",
                "generated_ids", "attention", "keys", "rope_inv_freq")


@dataclass
class Trace:
    meta: dict
    tokens: np.ndarray
    scored_ids: np.ndarray
    logprobs: np.ndarray
    top1_ids: np.ndarray
    kl_to_full: np.ndarray
    evicted_at: np.ndarray | None = None
    selected: np.ndarray | None = None  # bool [L, H_kv, T, T] in memory, packed bits on disk
    generated_ids: np.ndarray | None = None
    attention: np.ndarray | None = None  # float16 [R, H_kv, T, T] for meta["recorded_layers"]
    keys: np.ndarray | None = None  # float16 [R, H_kv, T, d], after RoPE, for meta["recorded_layers"]
    rope_inv_freq: np.ndarray | None = None  # float32 [d/2], to rotate keys back (metrics)

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
