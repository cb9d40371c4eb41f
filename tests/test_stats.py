"""helixtok stats must equal what torch's DataLoader and DistributedSampler really yield."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from helixtok.stats import batches_per_epoch, compute_stats


class Sized(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def manifest(n, L=8):
    return {"seq_len": L, "splits": {"train": {"num_chunks": n, "num_tokens": n * L, "pad_tokens": 0}}}


@pytest.mark.parametrize("n", [1, 7, 64, 101, 1000])
def test_batches_equal_len_dataloader_grid(n):
    ds = Sized(n)
    for B, W, D in itertools.product([1, 3, 16], [1, 2, 3, 8], [False, True]):
        if W == 1:
            want = len(DataLoader(ds, batch_size=B, shuffle=True, drop_last=D))
        else:
            lens = {len(DataLoader(ds, batch_size=B, drop_last=D,
                                   sampler=DistributedSampler(ds, num_replicas=W, rank=r, shuffle=True, drop_last=D)))
                    for r in range(W)}
            assert len(lens) == 1
            want = lens.pop()
        assert batches_per_epoch(n, B, W, D) == want, (n, B, W, D)
        for G in (1, 4):
            st = compute_stats(manifest(n), batch_size=B, grad_accum=G, world_size=W, drop_last=D, epochs=3,
                               warmup_ratio=0.1)
            assert st.batches_per_epoch == want
            assert st.optimizer_steps_per_epoch == -(-want // G)
            assert st.total_optimizer_steps == 3 * st.optimizer_steps_per_epoch


def test_steps_count_a_real_accumulation_loop():
    """The HelixLM-style loop: step every G batches and once more for a partial window at epoch end."""
    n, B, G = 103, 4, 3
    steps = 0
    for i, _ in enumerate(DataLoader(Sized(n), batch_size=B), 1):
        if i % G == 0:
            steps += 1
    if i % G:
        steps += 1
    assert compute_stats(manifest(n), batch_size=B, grad_accum=G).optimizer_steps_per_epoch == steps


def test_stats_on_real_dataset_match_dataloader(dev_packed):
    from helixtok import MemmapChunkDataset
    from helixtok.stats import stats_for

    ds = MemmapChunkDataset(dev_packed)
    st = stats_for(dev_packed, batch_size=16, world_size=3, drop_last=True)
    s = DistributedSampler(ds, num_replicas=3, rank=2, shuffle=True, drop_last=True)
    assert st.batches_per_epoch == len(DataLoader(ds, batch_size=16, sampler=s, drop_last=True))
    assert st.chunks == len(ds)
    assert st.tokens_per_optimizer_step == 16 * 3 * 512
