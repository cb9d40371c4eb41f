"""helixtok stats must equal what torch's DataLoader and DistributedSampler really yield."""

import itertools

import pytest
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from helixtok.read.stats import batches_per_epoch, compute_stats


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
    """Every combination of the two independent torch settings: DistributedSampler(drop_last=SD)
    and DataLoader(drop_last=LD)."""
    from helixtok.format.errors import ConfigError

    ds = Sized(n)
    for B, W, SD, LD in itertools.product([1, 3, 16], [1, 2, 3, 8], [False, True], [False, True]):
        if W == 1:
            if SD:
                continue  # no DistributedSampler at world size 1
            want = len(DataLoader(ds, batch_size=B, shuffle=True, drop_last=LD))
        else:
            lens = {len(DataLoader(ds, batch_size=B, drop_last=LD,
                                   sampler=DistributedSampler(ds, num_replicas=W, rank=r, shuffle=True, drop_last=SD)))
                    for r in range(W)}
            assert len(lens) == 1
            want = lens.pop()
        assert batches_per_epoch(n, B, W, sampler_drop_last=SD, loader_drop_last=LD) == want, (n, B, W, SD, LD)
        for G in (1, 4):
            kw = dict(batch_size=B, grad_accum=G, world_size=W, sampler_drop_last=SD, loader_drop_last=LD, epochs=3,
                      warmup_ratio=0.1)
            if want == 0:
                with pytest.raises(ConfigError, match=f"split 'train' has {n} samples.*0 optimizer steps"):
                    compute_stats(manifest(n), **kw)
                continue
            st = compute_stats(manifest(n), **kw)
            assert st.batches_per_epoch == want
            assert st.optimizer_steps_per_epoch == -(-want // G)
            assert st.total_optimizer_steps == 3 * st.optimizer_steps_per_epoch


def test_the_measured_13_vs_12_case_and_zero_steps_on_the_cli(tmp_path, small_corpus, small_tok):
    """n=101, W=8, B=1: sampler pads to 13 per rank; with sampler drop_last only, 12."""
    import json

    from click.testing import CliRunner

    from helixtok.cli import main

    assert batches_per_epoch(101, 1, 8, sampler_drop_last=False, loader_drop_last=True) == 13
    assert batches_per_epoch(101, 1, 8, sampler_drop_last=True, loader_drop_last=False) == 12
    out = tmp_path / "out"
    assert CliRunner().invoke(main, ["build", str(small_corpus), str(out), "-t", small_tok, "-L", "64", "-q"]).exit_code == 0
    n = json.load(open(out / "manifest.json"))["splits"]["train"]["num_chunks"]
    r = CliRunner().invoke(main, ["stats", str(out), "-b", str(n + 1), "--loader-drop-last"])
    assert r.exit_code == 1 and f"split 'train' has {n} samples" in r.output and "0 optimizer steps" in r.output
    r = CliRunner().invoke(main, ["stats", str(out), "-b", "1", "-w", "2", "--sampler-drop-last", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["samples_per_rank"] == n // 2


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
    from helixtok.read.stats import stats_for

    ds = MemmapChunkDataset(dev_packed)
    st = stats_for(dev_packed, batch_size=16, world_size=3, drop_last=True)
    s = DistributedSampler(ds, num_replicas=3, rank=2, shuffle=True, drop_last=True)
    assert st.batches_per_epoch == len(DataLoader(ds, batch_size=16, sampler=s, drop_last=True))
    assert st.chunks == len(ds)
    assert st.tokens_per_optimizer_step == 16 * 3 * 512
