"""GrowingLayer and GrowingTensor (backend/engine/cache_layer.py): appends in place, reads like DynamicLayer's
concatenation, and a copy never sees what the other side appends."""
import copy

import torch
from transformers.cache_utils import DynamicLayer

from backend.engine.cache_layer import GrowingLayer


def blocks(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)) for n in sizes]


def test_appends_read_like_concatenation_and_grow_by_a_constant_factor():
    growing, dynamic = GrowingLayer(), DynamicLayer()
    moves, buffer = 0, None
    for k, v in blocks([5, 1, 1, 7, 64, 1, 1, 200]):
        keys, values = growing.update(k, v)
        ref_k, ref_v = dynamic.update(k, v)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        moves += growing._k is not buffer
        buffer = growing._k
    assert growing.get_seq_length() == 280 and growing._k.shape[-2] < 2 * 280
    assert moves < 8  # not one per block


def test_a_copy_and_its_original_never_see_each_others_appends():
    layer = GrowingLayer()
    for k, v in blocks([10, 3]):
        layer.update(k, v)
    before = layer.keys.clone()
    twin = copy.copy(layer)
    (k1, v1), (k2, v2) = blocks([2, 2], seed=1)
    twin_keys, _ = twin.update(k1, v1)
    keys, _ = layer.update(k2, v2)
    assert torch.equal(twin_keys[..., :13, :], before) and torch.equal(twin_keys[..., 13:, :], k1)
    assert torch.equal(keys[..., :13, :], before) and torch.equal(keys[..., 13:, :], k2)


def test_crop_and_batch_edits_keep_the_length_right():
    layer = GrowingLayer()
    for k, v in blocks([6, 4]):
        layer.update(k, v)
    layer.crop(-3)
    assert layer.get_seq_length() == 7
    (k, v), = blocks([2], seed=2)
    assert torch.equal(layer.update(k, v)[0][..., 7:, :], k) and layer.get_seq_length() == 9
    layer.batch_select_indices(torch.tensor([1]))
    k, v = (x[1:] for x in blocks([1], seed=3)[0])
    keys, _ = layer.update(k, v)
    assert keys.shape == (1, 3, 10, 4) and torch.equal(keys[..., 9:, :], k)


def test_a_growing_tensor_holds_what_was_appended_and_a_copy_appends_apart():
    from backend.engine.cache_layer import GrowingTensor

    blocks = [torch.randn(2, 3, n, 4) for n in (5, 1, 1, 7, 1)]
    grown = GrowingTensor()
    for i, block in enumerate(blocks[:3]):
        torch.testing.assert_close(grown.append(block), torch.cat(blocks[: i + 1], 2))
    buffer = grown.buffer
    twin = copy.copy(grown)
    torch.testing.assert_close(twin.append(blocks[3]), torch.cat(blocks[:4], 2))
    torch.testing.assert_close(grown.append(blocks[4]), torch.cat([*blocks[:3], blocks[4]], 2))  # not the twin's
    torch.testing.assert_close(twin.filled, torch.cat(blocks[:4], 2))
    assert grown.buffer is not buffer or twin.buffer is not buffer
    # In place: a decoding step's append copies nothing while there is room.
    before = grown.buffer
    grown.append(torch.randn(2, 3, 1, 4))
    assert grown.buffer is before
