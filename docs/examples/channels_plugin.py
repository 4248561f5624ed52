"""A KV Lens plugin of the channel kind (KVLENS_PLUGINS=channels_plugin, this folder on PYTHONPATH): Knorm's tokens,
with the key channels of smallest magnitude pruned. ``reforms`` and ``reform`` are all a new kind declares."""
from dataclasses import dataclass, replace

import numpy as np

from backend.policies import CacheView, Knorm, Reform, register


@register
@dataclass(frozen=True)
class QuietChannels(Knorm):
    """Knorm's tokens; then each KV head's ``share`` of key channels with the smallest mean |k| read no more.

    budget: tokens kept per KV head. share: the share of each head's key channels pruned.
    """

    name = "quiet_channels"
    summary = "Knorm's tokens, the quietest key channels pruned (a channel plugin example)"
    reforms = "channels"
    share: float = 0.25

    def whole(self):
        return replace(self, share=0.0)

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        keys = np.asarray(view.keys)
        loudness = np.abs(keys * keep[..., None]).sum(1)  # [H, d] over the kept keys
        kept = np.ones(loudness.shape, bool)
        np.put_along_axis(kept, np.argsort(loudness, 1, kind="stable")[:, : int(keys.shape[-1] * self.share)], False, 1)
        return Reform(positions=keep, keys=keys * kept[:, None], channels=kept)
