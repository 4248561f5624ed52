"""A transformers cache layer that appends in place.

``DynamicLayer`` concatenates a new tensor at every forward call, so a text read in blocks copies its whole
cache once per block: at 8k tokens in blocks of 256 that is 32 copies per layer, 9% of a five-row run.
``GrowingLayer`` writes each block into a buffer with room to spare (a quarter more, or one more block
when that is more) and returns views of what is filled, so the copies add up to a constant times the
text. A copy of the layer (``PolicyCache.fork``) shares the buffer until either side appends: that side
then moves to a buffer of its own, so neither overwrites what the other reads. ``GrowingTensor`` does the same for
one tensor (the keys before RoPE that StreamingLLM and ReAttention re-read), which a concatenation per decoding step
would copy whole every step.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with in-place appends; ``keys`` and ``values`` are views [B, H, length, d]."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length, self.shared = 0, False
        self._k = self._v = None  # the buffers, [B, H, capacity, d]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if self._k is None or end > self._k.shape[-2] or self.shared:
            capacity = end + max(end // 4, n)
            self._k, self._v = (self._moved(old, like, capacity) for old, like in ((self._k, key_states),
                                                                                     (self._v, value_states)))
            self.shared = False
        self._k[..., self.length:end, :] = key_states
        self._v[..., self.length:end, :] = value_states
        self.length = end
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values

    def _moved(self, old: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        buffer = like.new_empty(like.shape[:-2] + (capacity, like.shape[-1]))
        if old is not None:
            buffer[..., : self.length, :] = old[..., : self.length, :]
        return buffer

    def __copy__(self) -> "GrowingLayer":
        twin = object.__new__(GrowingLayer)
        twin.__dict__.update(self.__dict__)
        if self.is_initialized:
            self.shared = twin.shared = True  # copy-on-append, on both sides
        return twin

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.length = self.keys.shape[-2] if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unbuffer(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unbuffer(lambda x: x[indices, ...])

    def grow_rows(self, size: int) -> None:
        """Up to ``size`` batch rows, the new ones copies of row 0 (``PolicyCache.grow_batch``)."""
        if self.is_initialized and self.keys.shape[0] < size:
            self._unbuffer(lambda x: rows_up_to(x, size))

    def _unbuffer(self, change) -> None:
        """Batch edits make new tensors: they become the buffers, with no spare room."""
        if self.get_seq_length() > 0:
            self._k, self._v = change(self.keys).contiguous(), change(self.values).contiguous()
            self.keys, self.values = self._k, self._v
            self.shared = False



class GrowingTensor:
    """A tensor [B, H, length, d] that grows along its length in place, as ``GrowingLayer`` does (the keys before
    RoPE a policy re-reads, one block or decoding step at a time): ``append`` returns a view of what is filled.
    A copy shares the buffer until either side appends."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.length, self.shared = 0, False

    def append(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        end = self.length + n
        if self.buffer is None or end > self.buffer.shape[-2] or self.shared:
            buffer = x.new_empty(x.shape[:-2] + (end + max(end // 4, n), x.shape[-1]))
            if self.buffer is not None:
                buffer[..., : self.length, :] = self.buffer[..., : self.length, :]
            self.buffer, self.shared = buffer, False
        self.buffer[..., self.length:end, :] = x
        self.length = end
        return self.filled

    def grow_rows(self, size: int) -> None:
        """Up to ``size`` batch rows, the new ones copies of row 0, in a buffer of its own."""
        if self.buffer is not None and self.buffer.shape[0] < size:
            self.buffer, self.shared = rows_up_to(self.buffer, size), False

    @property
    def filled(self) -> torch.Tensor:
        return self.buffer[..., : self.length, :]

    def __copy__(self) -> "GrowingTensor":
        twin = object.__new__(GrowingTensor)
        twin.__dict__.update(self.__dict__)
        self.shared = twin.shared = True  # copy-on-append, on both sides
        return twin


def rows_up_to(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` [B, ...] with rows B..size-1 added as copies of its row 0 (a new tensor; ``x`` itself if B >= size)."""
    missing = size - x.shape[0]
    return x if missing <= 0 else torch.cat([x, x[:1].expand(missing, *x.shape[1:])])
