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


def test_held_rows_take_each_head_s_columns_from_the_buffer_as_indexing_does():
    """The engine's gather of a row's held keys (``held_rows``): one index_select over the rows of the cache's
    buffer gives what ``x[heads, columns]`` gives, on a buffer's view (room to spare past each head's rows), a
    contiguous tensor, and the layouts it leaves to indexing."""
    from backend.engine.attention import held_rows

    growing = GrowingLayer()
    for k, v in blocks([5, 1, 7, 1]):
        keys, _ = growing.update(k, v)
    assert keys.stride(1) > keys.shape[2] * keys.shape[3]  # a view of a buffer longer than what it holds
    g = torch.Generator().manual_seed(1)
    layouts = [keys[1], keys[0].contiguous(), keys[1].transpose(0, 1).contiguous().transpose(0, 1), keys[1, :, ::2]]
    for x in layouts:
        at = torch.randint(0, x.shape[1], (x.shape[0], 6), generator=g)
        at[:, -1] = x.shape[1] - 1  # the last held row of every head, next to the buffer's spare room
        assert torch.equal(held_rows(x, at), x[torch.arange(x.shape[0])[:, None], at])


def test_a_group_s_product_is_broadcasting_s_with_the_keys_copied_once():
    """``over_group``: a KV head's query heads against its keys or values, the group's rows stacked. The read-out is
    the same to the bit as broadcasting; the scores are within rounding (a single query's product takes another
    kernel), and a tensor without a group axis is multiplied as it is."""
    from backend.policies.base import over_group

    g = torch.Generator().manual_seed(2)
    for n in (1, 7):
        q, keys = torch.randn(3, 4, n, 8, generator=g), torch.randn(3, 1, 8, 11, generator=g)
        weights = torch.softmax(torch.randn(3, 4, n, 11, generator=g), -1)
        values = torch.randn(3, 1, 11, 8, generator=g)
        assert torch.equal(over_group(weights, values), weights @ values)
        torch.testing.assert_close(over_group(q, keys), q @ keys)
        assert over_group(q, keys).shape == (3, 4, n, 11)
    plain, other = torch.randn(3, 5, 8, generator=g), torch.randn(3, 8, 2, generator=g)
    assert torch.equal(over_group(plain, other), plain @ other)
