"""DistributedDataLoader: two ranks of a data-parallel group, built without a process group."""

import pytest
import torch
from torch.utils.data import TensorDataset

from shardspeed.runtime.dataloader import DistributedDataLoader


def dataset(n):
    return TensorDataset(torch.arange(n))


def ids(loader):
    """Sample ids of one pass, batch by batch."""
    return [batch[0].tolist() for batch in loader]


def test_two_ranks_cover_the_dataset_disjointly():
    ds = dataset(12)
    rank0, rank1 = (DistributedDataLoader(ds, 2, r, 2) for r in range(2))
    a, b = ids(rank0), ids(rank1)
    # 12 samples over 2 ranks: 6 each, in 3 micro-batches of 2.
    assert [len(x) for x in a] == [2, 2, 2] and [len(x) for x in b] == [2, 2, 2]
    flat_a = [i for batch in a for i in batch]
    flat_b = [i for batch in b for i in batch]
    assert set(flat_a).isdisjoint(flat_b)
    assert sorted(flat_a + flat_b) == list(range(12))
    assert len(rank0) == len(rank1) == 3


def test_unshuffled_ranks_interleave():
    ds = dataset(8)
    # Without shuffling the sampler deals sample k to rank k % 2.
    assert ids(DistributedDataLoader(ds, 3, 0, 2, shuffle=False)) == [[0, 2, 4], [6]]
    assert ids(DistributedDataLoader(ds, 3, 1, 2, shuffle=False)) == [[1, 3, 5], [7]]


def test_uneven_dataset_is_padded_so_ranks_match():
    ds = dataset(9)
    a = ids(DistributedDataLoader(ds, 5, 0, 2, shuffle=False))
    b = ids(DistributedDataLoader(ds, 5, 1, 2, shuffle=False))
    # 9 samples -> 5 per rank; rank 1's fifth sample wraps around to sample 0.
    assert a == [[0, 2, 4, 6, 8]]
    assert b == [[1, 3, 5, 7, 0]]


@pytest.mark.parametrize(
    ("drop_last", "expected_len", "sizes"), [(False, 3, [4, 4, 2]), (True, 2, [4, 4])]
)
def test_drop_last_and_len(drop_last, expected_len, sizes):
    # 20 samples over 2 ranks -> 10 per rank; micro-batch 4 leaves a partial batch of 2.
    loader = DistributedDataLoader(dataset(20), 4, 1, 2, drop_last=drop_last)
    assert len(loader) == expected_len
    assert [len(x) for x in ids(loader)] == sizes


def test_exhausted_pass_keeps_raising_until_iter_again():
    loader = DistributedDataLoader(dataset(4), 2, 0, 1, shuffle=False)
    it = iter(loader)
    assert it is loader
    assert next(loader)[0].tolist() == [0, 1]
    assert next(loader)[0].tolist() == [2, 3]
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(loader)
    assert ids(loader) == [[0, 1], [2, 3]]


def test_next_without_iter_starts_the_first_pass():
    loader = DistributedDataLoader(dataset(4), 2, 0, 1, shuffle=False)
    assert next(loader)[0].tolist() == [0, 1]


def test_each_pass_reshuffles_unless_epoch_is_set():
    ds = dataset(64)
    loader = DistributedDataLoader(ds, 64, 0, 1, seed=7)
    first, second = ids(loader), ids(loader)
    assert sorted(first[0]) == sorted(second[0]) == list(range(64))
    assert first != second
    assert loader.data_sampler.epoch == 1
    # Choosing the epoch replays that epoch's order, through either spelling.
    loader.set_epoch(0)
    assert ids(loader) == first
    loader.data_sampler.set_epoch(1)
    assert ids(loader) == second
    # The same seed on a fresh loader gives the same first pass.
    assert ids(DistributedDataLoader(ds, 64, 0, 1, seed=7)) == first


def test_collate_fn_is_used():
    loader = DistributedDataLoader(
        dataset(6), 3, 0, 1, shuffle=False, collate_fn=lambda items: sum(int(x[0]) for x in items)
    )
    assert list(loader) == [0 + 1 + 2, 3 + 4 + 5]


def test_rejects_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        DistributedDataLoader(dataset(4), 0, 0, 1)
