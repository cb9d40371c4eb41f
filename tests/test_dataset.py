"""MemmapChunkDataset: values equal the shard bytes, masks, DataLoader workers, pickling, refusals."""

import functools
import hashlib
import json
import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from click.testing import CliRunner

from helixtok import MemmapChunkDataset
from helixtok.cli import main
from helixtok.format.errors import DatasetError


def all_chunks(out, split="train"):
    m = json.load(open(os.path.join(out, "manifest.json")))
    arrs = [np.fromfile(os.path.join(out, s["path"]), dtype="<u2") for s in m["splits"][split]["shards"]]
    n = m["splits"][split]["num_tokens"]  # format 2: a packed stream's last partial chunk is on disk too
    return np.concatenate(arrs)[:n].reshape(-1, m["seq_len"])


def test_items_equal_shard_bytes(dev_packed):
    ds = MemmapChunkDataset(dev_packed)
    raw = all_chunks(dev_packed)
    assert len(ds) == len(raw)
    for i in [0, 1, len(ds) // 2, len(ds) - 1, -1]:
        x = ds[i]
        assert x["input_ids"].dtype == torch.long and x["input_ids"].shape == (512,)
        assert x["input_ids"].tolist() == raw[i].tolist()
        assert torch.equal(x["labels"], x["input_ids"])
        assert int(x["attention_mask"].sum()) == 512
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_getitems_batches_across_shards(dev_packed):
    ds = MemmapChunkDataset(dev_packed)
    raw = all_chunks(dev_packed)
    idx = [len(ds) - 1, 0, 1023, 1024, 7, 7]
    got = ds.__getitems__(idx)
    assert [g["input_ids"].tolist() for g in got] == raw[idx].tolist()


@functools.lru_cache(maxsize=2)
def _on_disk(out: str) -> tuple[np.ndarray, np.ndarray]:
    """Every chunk of the train split as stored, and each chunk's valid length."""
    m = json.load(open(os.path.join(out, "manifest.json")))
    raw = all_chunks(out)
    if m["packing"] == "document":
        valid = np.concatenate([np.fromfile(os.path.join(out, s["valid"]["path"]), dtype="<u4")
                                for s in m["splits"]["train"]["shards"]])
    else:
        valid = np.full(len(raw), raw.shape[1])
    return raw, valid


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_every_batch_equals_the_rows_on_disk(dev_packed, dev_document, data):
    # Any list of indices (one shard or several, short or long, repeats, negatives) reads the
    # rows the shards hold; the gather takes a different path for each of those shapes.
    out = data.draw(st.sampled_from([dev_packed, dev_document]))
    packing = "document" if out == dev_document else "packed"
    shifted = packing == "packed" and data.draw(st.booleans())
    fields = ("input_ids", "labels", "attention_mask")
    if packing == "packed" and not shifted:
        fields = data.draw(st.sampled_from([fields, ("input_ids",), ("input_ids", "labels"), ("attention_mask",
                                                                                             "input_ids")]))
    ds = MemmapChunkDataset(out, shifted=shifted, fields=fields)
    raw, valid = _on_disk(out)
    n = len(raw)
    near = data.draw(st.integers(0, n - 1))  # indices around one point mostly land in one shard
    k = data.draw(st.integers(0, len(ds._starts_list) - 2))  # ... and these (shard k's chunks; tokens from) do
    L = raw.shape[1]
    index = data.draw(st.sampled_from([st.integers(-n, n - 1), st.integers(max(-n, near - 40), min(n - 1, near + 40)),
                                       st.integers(min(n - 1, ds._starts_list[k] // L),
                                                   min(n - 1, max(ds._starts_list[k] // L,
                                                                  ds._starts_list[k + 1] // L - 1)))]))
    idx = data.draw(st.lists(index, min_size=1, max_size=data.draw(st.sampled_from([8, 100]))))
    # A DataLoader's list of ints takes a path of its own; arrays and numpy ints the general one.
    form = data.draw(st.sampled_from([list, np.array, lambda x: [np.int64(i) for i in x]]))
    got = ds.collate(ds.__getitems__(form(idx)))
    want = np.array(idx) % n
    rows = raw[want].astype(np.int64)
    pad = np.arange(raw.shape[1])[None, :] >= valid[want][:, None]
    if shifted:
        labels = np.concatenate([rows[:, 1:], np.append(raw[1:, 0], -100)[want][:, None]], axis=1)
    else:
        labels = np.where(pad, -100, rows)
    assert tuple(got) == fields and np.array_equal(got["input_ids"].numpy(), rows)
    if "labels" in fields:
        assert np.array_equal(got["labels"].numpy(), labels)
    if "attention_mask" in fields:
        assert np.array_equal(got["attention_mask"].numpy(), (~pad).astype(np.int64))
    for k in set(fields) - {"input_ids"}:
        got[k][:] = 7  # the other fields are their own memory: editing them leaves input_ids alone
    assert np.array_equal(got["input_ids"].numpy(), rows)


def test_fields_are_checked(dev_packed, dev_document):
    for bad in [("labels",), ("input_ids", "input_ids"), ("input_ids", "mask")]:
        with pytest.raises(DatasetError, match="give input_ids and any of labels, attention_mask, each once"):
            MemmapChunkDataset(dev_packed, fields=bad)
    with pytest.raises(DatasetError, match="document-packed chunks end in padding; keep labels or attention_mask"):
        MemmapChunkDataset(dev_document, fields=("input_ids",))
    with pytest.raises(DatasetError, match="shifted=True makes labels"):
        MemmapChunkDataset(dev_packed, shifted=True, fields=("input_ids", "attention_mask"))
    ds = MemmapChunkDataset(dev_document, fields=("input_ids", "attention_mask"))
    assert set(ds[0]) == {"input_ids", "attention_mask"}
    dl = DataLoader(MemmapChunkDataset(dev_packed, fields=("input_ids",), position_ids=True), batch_size=4)
    assert set(next(iter(dl))) == {"input_ids", "position_ids"}  # the default collate, too


def test_out_of_range_indices_are_named(dev_packed):
    ds = MemmapChunkDataset(dev_packed)
    n = len(ds)
    for bad in ([0, n], [n + 5], [-n - 1, 3]):
        with pytest.raises(IndexError, match=f"index {bad[-1] if bad[0] == 0 else bad[0]} out of range for {n} chunks"):
            ds.__getitems__(bad)
    with pytest.raises(IndexError, match=f"index {-n - 2} out of range"):
        ds[-n - 2]
    assert ds.__getitems__([]).batch["input_ids"].shape == (0, 512)


def test_collate_fast_path_equals_default_collate(dev_document):
    ds = MemmapChunkDataset(dev_document)
    a = DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    b = DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1), collate_fn=ds.collate)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_document_mode_masks_padding(dev_document):
    ds = MemmapChunkDataset(dev_document)
    m = json.load(open(os.path.join(dev_document, "manifest.json")))
    valid = np.concatenate([np.fromfile(os.path.join(dev_document, s["valid"]["path"]), dtype="<u4")
                            for s in m["splits"]["train"]["shards"]])
    raw = all_chunks(dev_document)
    padded = np.nonzero(valid < 512)[0]
    assert len(padded) > 0
    pad_total = 0
    for i in list(padded[:50]) + [0]:
        x = ds[int(i)]
        v = int(valid[i])
        assert x["input_ids"].tolist() == raw[i].tolist()
        assert x["attention_mask"].tolist() == [1] * v + [0] * (512 - v)
        assert x["labels"][:v].tolist() == raw[i][:v].tolist()
        assert (x["labels"][v:] == -100).all()
    for i in range(len(ds)):
        pad_total += 512 - int(valid[i])
    assert pad_total == m["totals"]["pad_tokens"]


def test_shifted_pairs_borrow_next_chunk(dev_packed):
    ds = MemmapChunkDataset(dev_packed, shifted=True)
    raw = all_chunks(dev_packed)
    for i in [0, 1023, len(ds) - 2]:  # 1023 is the last chunk of the first 1 MiB shard
        x = ds[i]
        assert x["input_ids"].tolist() == raw[i].tolist()
        assert x["labels"].tolist() == raw[i][1:].tolist() + [int(raw[i + 1][0])]
    assert ds[len(ds) - 1]["labels"][-1] == -100


def test_position_ids_restart_at_documents(dev_packed, dev_ids):
    ds = MemmapChunkDataset(dev_packed, position_ids=True)
    first = len(dev_ids[0]) + 1  # document 0 with its EOS
    x = ds[0]
    if first < 512:
        assert ds.document_starts(0)[:2].tolist() == [0, first]
        assert x["position_ids"][first].item() == 0 and x["position_ids"][first - 1].item() == first - 1
    total_starts = sum(len(ds.document_starts(i)) for i in range(len(ds)))
    m = json.load(open(os.path.join(dev_packed, "manifest.json")))
    assert total_starts == sum(s["docs"]["count"] for s in m["splits"]["train"]["shards"]) == len(dev_ids)


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_with_workers_covers_epoch_once(dev_packed, ctx):
    ds = MemmapChunkDataset(dev_packed)
    raw = all_chunks(dev_packed)
    dl = DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, multiprocessing_context=ctx,
                    generator=torch.Generator().manual_seed(0))
    seen = []
    for b in dl:
        seen.append(b["input_ids"].numpy())
    got = np.concatenate(seen)
    assert len(got) == len(ds) == len(raw)
    # The same multiset of rows: sort both lexicographically and compare.
    key = lambda a: a[np.lexsort(a.T[::-1])]
    assert np.array_equal(key(got.astype(np.int64)), key(raw.astype(np.int64)))


def test_pickles_cheaply(dev_packed):
    ds = MemmapChunkDataset(dev_packed)
    ds[0]  # open the memmaps
    blob = pickle.dumps(ds)
    assert len(blob) < 20_000
    assert pickle.loads(blob)[3]["input_ids"].tolist() == ds[3]["input_ids"].tolist()


def copy_dataset(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_refuses_truncated_shard(dev_packed, tmp_path):
    out = copy_dataset(dev_packed, tmp_path / "d")
    p = os.path.join(out, "train-000001-0000.bin")
    with open(p, "r+b") as fh:
        fh.truncate(os.path.getsize(p) - 2)
    with pytest.raises(DatasetError, match=r"train-000001-0000.bin: \d+ bytes, the manifest says"):
        MemmapChunkDataset(out)


def test_refuses_unfinished_or_missing(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset folder"):
        MemmapChunkDataset(str(tmp_path / "nope"))
    os.makedirs(tmp_path / "d" / ".helixtok-partial")
    with pytest.raises(DatasetError, match="unfinished"):
        MemmapChunkDataset(str(tmp_path / "d"))


def test_refuses_other_tokenizer_and_unknown_version(dev_packed, tmp_path, small_tok, tokenizer_path):
    MemmapChunkDataset(dev_packed, tokenizer=tokenizer_path)  # the right one passes
    with pytest.raises(DatasetError, match="built with tokenizer sha256"):
        MemmapChunkDataset(dev_packed, tokenizer=small_tok)
    out = copy_dataset(dev_packed, tmp_path / "d")
    mp = os.path.join(out, "manifest.json")
    m = json.load(open(mp))
    m["format_version"] = 99
    json.dump(m, open(mp, "w"))
    with pytest.raises(DatasetError, match="format_version 99, this helixtok reads versions 1 to 5; upgrade"):
        MemmapChunkDataset(out)


def test_no_val_split_message(dev_packed):
    with pytest.raises(DatasetError, match="--val-fraction"):
        MemmapChunkDataset(dev_packed, split="val")


def test_the_dataset_says_its_vocabulary_special_ids_and_manifest(dev_packed):
    m = json.load(open(os.path.join(dev_packed, "manifest.json")))
    ds = MemmapChunkDataset(dev_packed)
    assert (ds.vocab_size, ds.eos_id, ds.pad_id, ds.bos_id) == (m["tokenizer"]["vocab_size"], m["tokenizer"]["eos_id"],
                                                                m["tokenizer"]["pad_id"], m["tokenizer"]["bos_id"])
    assert ds.manifest == m and max(int(ds[i]["input_ids"].max()) for i in range(len(ds))) < ds.vocab_size
    blob = pickle.dumps(ds)  # read once asked for, never sent to DataLoader workers
    assert len(blob) < 20_000 and pickle.loads(blob).manifest == m


def _as_version_1(src: str, dst) -> str:
    """A copy of a packed format 2 dataset as helixtok 0.1 wrote it: one shard of whole chunks
    (the stream's last partial chunk not stored), .docs offsets inside it, num_chunks per shard."""
    from helixtok.read.splitview import SplitView

    m = json.load(open(os.path.join(src, "manifest.json")))
    v = SplitView(src, m)
    n = m["splits"]["train"]["num_tokens"]
    os.makedirs(dst)
    ids = v.tokens(0, n)
    starts = v.starts_in(0, n).astype("<u8")
    ids.tofile(os.path.join(dst, "train-00000.bin"))
    starts.tofile(os.path.join(dst, "train-00000.docs"))
    for f in ("tokenizer.json", "build-plan.json"):
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    sha = {f: hashlib.sha256(open(os.path.join(dst, f), "rb").read()).hexdigest()
           for f in ("train-00000.bin", "train-00000.docs")}
    m["format_version"] = 1
    m.pop("fields", None)  # (0.1 kept no record fields)
    m["splits"]["train"]["shards"] = [{"path": "train-00000.bin", "bytes": ids.nbytes, "sha256": sha["train-00000.bin"],
                                      "num_chunks": n // m["seq_len"],
                                      "docs": {"path": "train-00000.docs", "sha256": sha["train-00000.docs"],
                                               "count": len(starts)}}]
    json.dump(m, open(os.path.join(dst, "manifest.json"), "w"))
    return str(dst)


def test_a_format_1_dataset_still_reads_alike(dev_packed, tmp_path):
    """A dataset helixtok 0.1 wrote (format 1: shards of whole chunks) reads as the format 2 one
    it was made from: every batch, document masks, stats, verify, show; merge refuses it."""
    from helixtok.pipeline.merge import merge

    old = _as_version_1(dev_packed, tmp_path / "v1")
    a, b = MemmapChunkDataset(dev_packed, document_masking=True), MemmapChunkDataset(old, document_masking=True)
    assert len(a) == len(b)
    idx = [0, 1, len(a) // 2, len(a) - 1]
    ba, bb = a.collate(a.__getitems__(idx)), b.collate(b.__getitems__(idx))
    assert all(torch.equal(torch.as_tensor(ba[k]), torch.as_tensor(bb[k])) for k in ba)
    r = CliRunner().invoke(main, ["verify", old])
    assert r.exit_code == 0, r.output
    stats = [json.loads(CliRunner().invoke(main, ["stats", d, "-b", "8", "--json"]).output) for d in (old, dev_packed)]
    assert stats[0] == stats[1]
    def shown(d):  # (a format 1 dataset has no record of where each document was read: its heads name the unit)
        return [re.sub(r": .* ---$", "", ln) for ln in CliRunner().invoke(main, ["show", d, "5", "--raw"]).output.splitlines()]
    assert shown(old) == shown(dev_packed)
    with pytest.raises(DatasetError, match="format_version 1 .*rebuild the part"):
        merge([old], str(tmp_path / "m"))


def test_a_damaged_bestfit_index_is_named_never_read(dev_bestfit, tmp_path):
    """The index is a file the readers trust: one whose bytes differ from the manifest's sha256 is
    refused when the dataset first reads it (two items swapped between chunks used to be read: it
    could be an index), and `helixtok verify` names it; one the manifest's sha256 agrees with that
    lists an item past the stream is refused by its structure.  A version 2 bestfit dataset (chunks
    packed per window) is refused by every reader in one line.  (Form: the plausible swap was
    read before the index was hashed on first read.)"""
    import hashlib

    from helixtok.inspect.verify import verify

    out = copy_dataset(dev_bestfit, tmp_path / "d")
    items = np.fromfile(os.path.join(out, "train.items"), dtype="<u8").reshape(-1, 2)
    m = json.load(open(os.path.join(out, "manifest.json")))
    bad = items.copy()
    bad[5, 0] = 1 << 40
    bad.tofile(os.path.join(out, "train.items"))
    m["splits"]["train"]["index"]["items"]["sha256"] = hashlib.sha256(bad.tobytes()).hexdigest()
    json.dump(m, open(os.path.join(out, "manifest.json"), "w"))
    with pytest.raises(DatasetError, match=r"train.items: an item lies outside the split's \d+ tokens"):
        MemmapChunkDataset(out)[0]
    swapped = items.copy()
    swapped[[0, -1]] = swapped[[-1, 0]]
    swapped.tofile(os.path.join(out, "train.items"))
    with pytest.raises(DatasetError, match=r"train.items: its sha256 is not the manifest's"):
        MemmapChunkDataset(out)[0]
    report = verify(out)
    assert not report.ok and "train.items: sha256 mismatch (corrupt or modified)" in report.problems
    assert verify(dev_bestfit).ok
    m = json.load(open(os.path.join(out, "manifest.json")))
    m["format_version"] = 2
    json.dump(m, open(os.path.join(out, "manifest.json"), "w"))
    r = CliRunner().invoke(main, ["stats", out])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1
    assert "a version 2 bestfit dataset" in r.output and "--overwrite" in r.output


def test_a_bestfit_index_that_is_not_the_lengths_placement_fails_verify(dev_bestfit, tmp_path):
    """An index whose sha256 the manifest agrees with but which is not best-fit over the documents'
    lengths (a manifest and index from another placement) is named by verify."""
    import hashlib

    from helixtok.inspect.verify import verify

    out = copy_dataset(dev_bestfit, tmp_path / "d")
    items = np.fromfile(os.path.join(out, "train.items"), dtype="<u8").reshape(-1, 2)
    chunks = np.fromfile(os.path.join(out, "train.chunks"), dtype="<u8")
    # Chunk 0's items in reverse order: every count holds, the placement rule does not.
    k = next(i for i in range(len(chunks) - 1) if chunks[i + 1] - chunks[i] >= 2)
    a, b = int(chunks[k]), int(chunks[k + 1])
    items[a:b] = items[a:b][::-1]
    items.tofile(os.path.join(out, "train.items"))
    mp = os.path.join(out, "manifest.json")
    m = json.load(open(mp))
    m["splits"]["train"]["index"]["items"]["sha256"] = hashlib.sha256(items.tobytes()).hexdigest()
    json.dump(m, open(mp, "w"))
    report = verify(out)
    assert report.problems == ["train: its index is not the one its documents' lengths give (docs/format.md); rebuild"]


@pytest.mark.parametrize("packing, damaged", [("bestfit", "items"), ("bestfit", "chunks"), ("packed", "docs"),
                                              ("document", "valid")])
def test_a_damaged_index_or_sidecar_is_named_by_every_reader_never_read(tmp_path, small_corpus, small_tok,
                                                                        packing, damaged):
    """One item of a bestfit index moved 5 tokens on (still in range, so its structure checked out)
    gave every chunk its items' tokens from the wrong place, with no error, as would a flipped byte
    in a .docs or .valid sidecar; only verify said so.  These small files are hashed as they are
    first read: the dataset and show name the file."""
    from helixtok.pipeline.builder import build
    from helixtok.pipeline.config import BuildConfig

    out = tmp_path / "out"
    build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=64, workers=1, packing=packing))
    s = json.loads((out / "manifest.json").read_text())["splits"]["train"]
    path = out / (s["index"][damaged]["path"] if damaged in ("items", "chunks") else s["shards"][0][damaged]["path"])
    data = bytearray(path.read_bytes())
    data[16 if damaged == "items" else 8 if damaged == "chunks" else 0] ^= 4
    path.write_bytes(bytes(data))
    want = f"{path}: its sha256 is not the manifest's (damaged or changed since the build)"
    ds = MemmapChunkDataset(str(out), position_ids=packing == "packed")
    with pytest.raises(DatasetError, match=re.escape(want)):
        ds[0]
    r = CliRunner().invoke(main, ["show", str(out), "0"])
    assert r.exit_code == 1 and want in r.output and "Traceback" not in r.output, r.output
