"""A trace: what one policy did on one text, as arrays plus JSON metadata (docs/trace-format.md)."""
from __future__ import annotations

import copy
import io
import json
import re
from pathlib import Path

import numpy as np

from .recorded import TopAttention
from .rope import KeyRope
from .spans import ReadSpans

FORMAT_VERSION = 3
ARRAY_FIELDS = ("tokens", "evicted_at", "scored_ids", "logprobs", "top1_ids", "kl_to_full", "generated_ids",
                "keys", "key_positions", "rope_freq", "rope_partner", "rope_scaling", "rope_inv_freq")


class Trace:
    """Arrays of one policy's run (see docs/trace-format.md) plus its metadata dict.

    ``spans`` (selection policies) says what each query read; ``attention`` (recorded layers) is a
    ``TopAttention``; ``keys`` are the recorded layers' keys before RoPE at ``key_positions``, and
    ``rope_freq``, ``rope_partner``, ``rope_scaling`` how each recorded layer rotates them (``rope``). For tests
    and small texts, ``selected`` (bool [L, H, T, T]) and a dense ``attention`` [R, H, T, T] are accepted
    and converted.
    """

    def __init__(self, meta: dict, tokens, scored_ids, logprobs, top1_ids, kl_to_full, evicted_at=None, spans=None,
                 selected=None, generated_ids=None, attention=None, keys=None, key_positions=None,
                 rope_freq=None, rope_partner=None, rope_scaling=None, rope_inv_freq=None, stats=None, **arrays):
        self.meta, self.tokens, self.scored_ids, self.logprobs = meta, tokens, scored_ids, logprobs
        self.top1_ids, self.kl_to_full, self.evicted_at = top1_ids, kl_to_full, evicted_at
        self.generated_ids, self.keys = generated_ids, keys
        self.rope_freq, self.rope_partner, self.rope_scaling = rope_freq, rope_partner, rope_scaling
        # A stored trace may keep one model-wide rotation instead, in rotate_half's layout (``rope``).
        self.rope_inv_freq = rope_inv_freq
        if selected is not None:
            spans = ReadSpans.from_masks(np.asarray(selected, bool))
        self.spans: ReadSpans | None = spans
        if attention is not None and not isinstance(attention, TopAttention):
            attention = TopAttention.from_dense(attention)
        self.attention: TopAttention | None = attention
        if keys is not None and key_positions is None:
            key_positions = np.arange(keys.shape[2], dtype=np.int32)
        self.key_positions = key_positions
        # Per-step numbers travel as ``stat_<name>`` arrays (e.g. SparQ's stat_alpha [L, T, H_q]), the held
        # forms of a policy that reforms its tokens as ``form_<name>`` (e.g. form_key_error [L, H, T]).
        self.stats = dict(stats or {})
        self.forms: dict[str, np.ndarray] = {}
        for name, values in arrays.items():
            if name.startswith("stat_"):
                self.stats[name[5:]] = values
            elif name.startswith("form_"):
                self.forms[name[5:]] = values
            elif not name.startswith(("span_", "attn_")):
                raise TypeError(f"unexpected trace field {name!r}")

    @property
    def spec(self) -> str:
        return self.meta["spec"]

    def with_spec(self, spec: str) -> "Trace":
        """The same arrays under the spec a request named them by (one stored trace answers every spelling)."""
        twin = copy.copy(self)
        twin.meta = {**self.meta, "spec": spec}
        return twin

    @property
    def selected(self) -> np.ndarray | None:
        """bool [L, H_kv, T, T] of a selection trace (T * T bits per head: small texts only)."""
        return None if self.spans is None else self.spans.dense()

    def reads(self, layer: int, steps: slice = slice(None), positions: slice = slice(None)) -> np.ndarray:
        """bool [H_kv, s, p]: ``[h, i, k]`` is True when query ``steps.start + i`` read token ``positions.start + k``
        in this layer. The default is the whole [H_kv, T, T]; at 8k ask for a window."""
        n = len(self.tokens)
        s0, s1, _ = steps.indices(n)
        p0, p1, _ = positions.indices(n)
        if self.spans is not None:
            return self.spans.window(layer, slice(s0, s1), slice(p0, p1))
        t = np.arange(s0, max(s0, s1))[:, None]
        j = np.arange(p0, max(p0, p1))[None, :]
        visible = j <= t
        window = self.window(layer)
        if window is not None:  # the model's own eviction: a sliding-window layer reads its latest keys only
            visible = visible & (j > t - window)
        if self.evicted_at is None:  # full attention
            return np.broadcast_to(visible, (self.meta["n_kv_heads"], t.shape[0], j.shape[1]))
        gone = self.evicted_at[layer][:, None, p0:max(p0, p1)]
        return visible[None] & ((gone < 0) | (t[None] < gone))

    def window(self, layer: int) -> int | None:
        """The layer's sliding window (Gemma's local layers), None where it reads every key its policy keeps."""
        windows = self.meta.get("layer_windows")
        return None if not windows else windows[layer]

    def rope(self, layer: int) -> KeyRope | None:
        """How recorded ``layer`` rotated its keys; None when the trace recorded no RoPE for it."""
        recorded = self.meta.get("recorded_layers") or []
        if layer not in recorded:
            return None
        if self.rope_freq is not None:
            r = recorded.index(layer)
            return KeyRope(self.rope_freq[r], self.rope_partner[r], float(self.rope_scaling[r]))
        if self.rope_inv_freq is not None:
            return KeyRope.halves(self.rope_inv_freq, self.meta.get("rope_attention_scaling", 1.0))
        return None

    def reads_at(self, layer: int, step: int) -> np.ndarray:
        """bool [H_kv, T]: the tokens query ``step`` read in this layer."""
        if self.spans is not None:
            return self.spans.at(layer, step)
        return self.reads(layer, slice(step, step + 1))[:, 0]

    def arrays(self) -> dict[str, np.ndarray]:
        out = {name: getattr(self, name) for name in ARRAY_FIELDS if getattr(self, name) is not None}
        out.update({f"stat_{name}": values for name, values in self.stats.items()})
        out.update({f"form_{name}": values for name, values in self.forms.items()})
        if self.spans is not None:
            out.update(self.spans.arrays())
        if self.attention is not None:
            out.update(self.attention.arrays())
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
        if "span_counts" in arrays:
            arrays["spans"] = ReadSpans.from_arrays(arrays, meta["n_layers"], meta["n_kv_heads"], len(arrays["tokens"]))
        if "attn_pos" in arrays:
            arrays["attention"] = TopAttention.from_arrays(arrays.pop("attn_pos"), arrays.pop("attn_val"))
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
