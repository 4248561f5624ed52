"""A KV Lens plugin of the merge kind (KVLENS_PLUGINS=merge_plugin, this folder on PYTHONPATH): Knorm's tokens, each
evicted token's value averaged into the held token whose key is most like its own. ``reforms`` and ``reform`` are all
a new kind declares."""
from dataclasses import dataclass

import numpy as np

from backend.policies import CacheView, Knorm, Reform, register


@register
@dataclass(frozen=True)
class NearestMerge(Knorm):
    """Knorm's tokens; each evicted value averaged into the held token of the most similar key (cosine).

    budget: tokens kept per KV head.
    """

    name = "nearest_merge"
    summary = "Knorm's tokens, each evicted value averaged into the held token of the nearest key (a merge plugin)"
    reforms = "merge"

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        gone_now = view.kept & ~keep
        if not gone_now.any():
            return None
        keys, values = np.asarray(view.keys), np.asarray(view.values)
        unit = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-12)
        merged, count = values.copy(), np.ones(keep.shape)
        into = np.full(keep.shape, -1)
        for h in range(len(keep)):
            held, gone = np.flatnonzero(keep[h]), np.flatnonzero(gone_now[h])
            into[h, gone] = held[(unit[h, gone] @ unit[h, held].T).argmax(1)]
            np.add.at(merged[h], into[h, gone], values[h, gone])
            np.add.at(count[h], into[h, gone], 1)
        weight = np.where(into >= 0, 1 / np.take_along_axis(count, np.maximum(into, 0), 1), 0.0)
        return Reform(positions=keep & (count > 1), values=merged / count[..., None], merged_into=into,
                      merge_weight=weight)
