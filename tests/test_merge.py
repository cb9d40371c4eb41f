"""Partitioned builds and merge: exact counts, the packed difference is exactly the per-task remainders."""

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from helixtok import MemmapChunkDataset
from helixtok.build import build
from helixtok.cli import main
from helixtok.config import BuildConfig
from helixtok.errors import ConfigError, DatasetError
from helixtok.merge import merge, task_from_env
from helixtok.verify import verify


def rows(out, split="train"):
    m = json.load(open(os.path.join(out, "manifest.json")))
    return m, np.concatenate([np.fromfile(os.path.join(out, s["path"]), dtype="<u2")
                              for s in m["splits"][split]["shards"]]).reshape(-1, m["seq_len"])


@pytest.fixture(scope="module")
def txt_corpus(dev_corpus):
    return str(dev_corpus / "txt")


@pytest.mark.parametrize("packing", ["packed", "document"])
def test_three_tasks_merged_equal_a_single_build(tmp_path, txt_corpus, tokenizer_path, packing):
    cfg = BuildConfig(seq_len=256, workers=1, packing=packing, unit_bytes=256 << 10, shard_bytes=1 << 20)
    single = str(tmp_path / "single")
    ms = build([txt_corpus], single, tokenizer_path, cfg)
    root = tmp_path / "parts"
    parts = []
    for k in range(3):
        p = str(root / f"part-{k:05d}")
        build([txt_corpus], p, tokenizer_path, cfg, task=(k, 3))
        parts.append(p)
    mm = merge(list(reversed(parts)), str(root))  # order given does not matter: task order is used
    assert mm["merged_from"] == ["part-00000", "part-00001", "part-00002"]
    assert verify(str(root)).ok
    ds = MemmapChunkDataset(str(root))
    assert len(ds) == mm["splits"]["train"]["num_chunks"]
    _, single_rows = rows(single)
    _, merged_rows = rows(str(root))
    t1, t2 = ms["totals"], mm["totals"]
    assert t1["documents"] == t2["documents"] and t1["tokens"] == t2["tokens"]
    assert mm["inputs"]["files"] == ms["inputs"]["files"]
    if packing == "document":
        # Documents are chunked on their own: the merged dataset is the single one, row for row.
        assert np.array_equal(single_rows, merged_rows)
        assert t1 == t2
    else:
        # Each task cuts its own contiguous slice of the stream and drops its own remainder.
        L = 256
        stream = single_rows.reshape(-1)
        off = 0
        for p in parts:
            pm, pr = rows(p)
            n = pm["splits"]["train"]["num_chunks"] * L
            assert np.array_equal(pr.reshape(-1), stream[off: off + n]) or off + n > len(stream)
            off += pm["totals"]["tokens"]
        remainders = [json.load(open(os.path.join(p, "manifest.json")))["totals"]["dropped_tokens"] for p in parts]
        assert t2["dropped_tokens"] == sum(remainders)
        assert t2["chunks"] * L + t2["dropped_tokens"] == t2["tokens"]
        assert t1["chunks"] - t2["chunks"] == (sum(remainders) - t1["dropped_tokens"]) // L


def test_merge_refuses_mismatched_or_missing_parts(tmp_path, txt_corpus, tokenizer_path, small_tok):
    cfg = BuildConfig(seq_len=256, workers=1, unit_bytes=1 << 20)
    a, b, c = (str(tmp_path / x) for x in "abc")
    build([txt_corpus], a, tokenizer_path, cfg, task=(0, 2))
    with pytest.raises(DatasetError, match=r"missing task\(s\) \[1\]"):
        merge([a], str(tmp_path / "m"))
    build([txt_corpus], b, tokenizer_path, BuildConfig(seq_len=128, workers=1, unit_bytes=1 << 20), task=(1, 2))
    with pytest.raises(DatasetError, match="seq_len is 128"):
        merge([a, b], str(tmp_path / "m"))
    build([txt_corpus], c, small_tok, cfg, task=(1, 2))
    with pytest.raises(DatasetError, match="parts must share the tokenizer"):
        merge([a, c], str(tmp_path / "m"))


def test_task_index_from_scheduler_env():
    assert task_from_env(4, None, {"SLURM_ARRAY_TASK_ID": "2"}) == (2, 4)
    assert task_from_env(4, None, {"JOB_COMPLETION_INDEX": "3"}) == (3, 4)
    assert task_from_env(4, 1, {"SLURM_ARRAY_TASK_ID": "2"}) == (1, 4)
    assert task_from_env(None, None, {"SLURM_ARRAY_TASK_ID": "2"}) is None  # never partition by surprise
    with pytest.raises(ConfigError, match="outside"):
        task_from_env(4, None, {"SLURM_ARRAY_TASK_ID": "4"})
    with pytest.raises(ConfigError, match="neither"):
        task_from_env(4, None, {})


def test_cli_partitioned_build_and_merge(tmp_path, txt_corpus, small_tok, monkeypatch):
    out = tmp_path / "out"
    for k in range(2):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(k))
        r = CliRunner().invoke(main, ["build", txt_corpus, str(out), "-t", small_tok, "-L", "64", "-j", "1", "-q",
                                      "--num-tasks", "2"])
        assert r.exit_code == 0, r.output
    assert sorted(os.listdir(out)) == ["part-00000", "part-00001"]
    r = CliRunner().invoke(main, ["merge", str(out / "part-00000"), str(out / "part-00001"), str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["totals"]["documents"] == len(os.listdir(txt_corpus))
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
