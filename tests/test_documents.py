"""The document view (issue 56.3): MemmapDocumentDataset's items are the build's documents, exactly
as tokenizers encodes them (or pieces of max_len); TokenBudgetSampler's batches hold at most
max_tokens, cover the epoch on every rank, resume exactly, and `helixtok stats --max-tokens` counts
them; read from object storage, the items are the local ones."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from torch.utils.data import DataLoader

from helixtok import MemmapDocumentDataset, TokenBudgetSampler, collate_varlen
from helixtok.cli import main
from helixtok.format.errors import ConfigError, DatasetError


@pytest.mark.parametrize("which", ["packed", "bestfit"])
def test_each_item_is_a_document_as_tokenizers_encodes_it(which, dev_packed, dev_bestfit, dev_ids):
    out = dev_packed if which == "packed" else dev_bestfit
    ds = MemmapDocumentDataset(out)
    eos = ds.eos_id
    want = [d + [eos] for d in dev_ids if d]
    assert len(ds) == len(want) == json.load(open(f"{out}/manifest.json"))["splits"]["train"]["documents"]
    for i in range(0, len(ds), 7):
        x = ds[i]
        assert x["input_ids"].tolist() == want[i] and x["labels"].tolist() == want[i]
    # Pieces: every document cut at 100 tokens, in order, each piece whole again when joined.
    cut = MemmapDocumentDataset(out, max_len=100)
    assert len(cut) == sum(-(-len(d) // 100) for d in want)
    got, k = [], 0
    for d in want[:300]:
        parts = []
        while sum(map(len, parts)) < len(d):
            parts.append(cut[k]["input_ids"].tolist())
            k += 1
        assert all(len(p) <= 100 for p in parts) and sum(parts, []) == d
        got.append(parts)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_token_budget_batches_cover_each_rank_resume_and_stats_counts_them(dev_packed):
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = MemmapDocumentDataset(dev_packed, max_len=1024)
    sizes = ds.item_sizes()
    M = 4096
    seen = []
    for rank in (0, 1):
        s = TokenBudgetSampler(ds, M, seed=3, rank=rank, world_size=2)
        s.set_epoch(1)
        dl = DataLoader(ds, batch_sampler=s, collate_fn=ds.collate, num_workers=2)
        n = 0
        for b in dl:
            T = b["input_ids"].shape[1]
            assert T <= M and b["cu_seqlens"][-1] == T and b["labels"].shape == b["input_ids"].shape
            assert (b["position_ids"][0, b["cu_seqlens"][:-1].long()] == 0).all()
            n += 1
        assert n == len(dl) == len(s)
        order = [i for batch in s for i in batch]
        seen += order
        r = CliRunner().invoke(main, ["stats", dev_packed, "--max-tokens", M, "--max-len", 1024, "-w", 2, "--json"])
        j = json.loads(r.output)
        assert j["batches_per_rank"] == len(s) and j["batches_per_epoch"] == s.num_batches
        assert j["tokens"] == int(sizes.sum()) and j["items"] == len(ds)
    # Both ranks: every item of the epoch at least once; only a wrapped-around batch twice.
    assert set(seen) == set(range(len(ds)))
    assert len(seen) - len(ds) <= max(map(len, TokenBudgetSampler(ds, M, seed=3)))
    # Another epoch: another order of the same batches.
    a, b = TokenBudgetSampler(ds, M, seed=3), TokenBudgetSampler(ds, M, seed=3)
    b.set_epoch(1)
    assert list(a) != list(b) and sorted(map(tuple, a)) == sorted(map(tuple, b))
    # StatefulDataLoader: stopped after 5 batches, resumed from its own state.
    def loader(state=None):
        s = TokenBudgetSampler(ds, M, seed=3, rank=1, world_size=2)
        dl = StatefulDataLoader(ds, batch_sampler=s, collate_fn=ds.collate, num_workers=2)
        if state is not None:
            dl.load_state_dict(state)
        return dl
    want = [b["input_ids"] for b in loader()]
    dl, got = loader(), []
    for k, b in enumerate(dl):
        got.append(b["input_ids"])
        if k == 4:
            state = dl.state_dict()
            break
    del dl  # its workers stop now, not when the collector finds it (10 s of waiting at the module's end)
    got += [b["input_ids"] for b in loader(state)]
    assert len(got) == len(want) and all((x == y).all() for x, y in zip(got, want))
    # A document longer than the budget is said, with the fix.
    with pytest.raises(ConfigError, match="does not fit max_tokens 100: raise max_tokens, or cut documents with max_len"):
        TokenBudgetSampler(MemmapDocumentDataset(dev_packed), 100)


def test_collate_varlen_pads_to_one_shape():
    import torch

    items = [{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, -100, 7])},
             {"input_ids": torch.tensor([8, 9]), "labels": torch.tensor([8, 9])}]
    b = collate_varlen(items, pad_to=8, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert b["labels"].tolist() == [[5, -100, 7, 8, 9, -100, -100, -100]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 8] and b["max_seqlen"] == 3
    with pytest.raises(ConfigError, match="holds 5 tokens, more than pad_to=4"):
        collate_varlen(items, pad_to=4)


def test_a_document_packed_build_has_no_document_view(dev_document):
    with pytest.raises(DatasetError, match="keep no boundary between a document that fills whole chunks"):
        MemmapDocumentDataset(dev_document)
    r = CliRunner().invoke(main, ["stats", dev_document, "--max-tokens", 4096])
    assert r.exit_code != 0 and "keeps no document boundaries past whole chunks" in r.output


def _record_at(corpus, where: str) -> dict:
    """The record a source names, read without helixtok: `file:line` of JSON lines (.gz too), `file row N`
    of Parquet, a text file ({"text": ...})."""
    import gzip

    import pyarrow.parquet as pq

    if " row " in where:
        name, row = where.rsplit(" row ", 1)
        return pq.read_table(corpus / name).slice(int(row), 1).to_pylist()[0]
    if where.endswith(".txt"):
        return {"text": (corpus / where).read_text(encoding="utf-8")}
    name, line = where.rsplit(":", 1)
    with (gzip.open(corpus / name, "rt", encoding="utf-8") if name.endswith(".gz") else open(corpus / name)) as fh:
        for k, x in enumerate(fh, 1):
            if k == int(line):
                return json.loads(x)


@pytest.mark.parametrize("which", ["packed", "bestfit"])
def test_each_document_says_where_it_was_read(which, dev_packed, dev_bestfit, dev_corpus, tokenizer_path):
    """Issue 56.4: the build records each document's source (.src beside .docs, the manifest's
    unit_sources): for every 3rd document of the split, the text at the `file:line` / `file row N` /
    file it names, tokenized by tokenizers, is the document's ids; `show` prints it without the
    corpus, for packed and bestfit chunks alike."""
    from tokenizers import Tokenizer

    from helixtok.inspect.show import chunk_segments, document_source

    out = dev_packed if which == "packed" else dev_bestfit
    tok = Tokenizer.from_file(tokenizer_path)
    ds = MemmapDocumentDataset(out, sources=True)
    kinds, ids = set(), 0
    for i in range(0, len(ds), 3):
        x = ds[i]
        where = x["source"]
        kinds.add(where.rsplit(".", 1)[-1].split(" ")[0].split(":")[0])
        rec = _record_at(dev_corpus, where)
        assert x["input_ids"].tolist() == tok.encode(rec["text"]).ids + [ds.eos_id], (i, where)
        # Its record's "id" (--keep-fields' default), kept where the record has one.
        assert x["fields"] == ({"id": rec["id"]} if "id" in rec else {}), (i, where)
        ids += "id" in rec
    assert kinds >= {"txt", "gz", "jsonl", "parquet"} and ids > 50
    m = json.load(open(f"{out}/manifest.json"))
    segs = [s for s in chunk_segments(out, m, "train", 7) if s.document is not None]
    assert segs and all(document_source(out, m, "train", s.document).startswith(ds.source(s.document)) for s in segs)
    r = CliRunner().invoke(main, ["info", out, "--json"])
    got = json.loads(r.output)
    assert r.exit_code == 0 and got["document_sources"] == "recorded"
    assert got["document_fields"] == {"names": ["id"], "bytes": os.path.getsize(f"{out}/fields.jsonl")}
    # A dataset written before sources were kept: None, and the view still reads.
    import shutil

    old = tmp = f"{out}-old"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(out, old)
    del m["unit_sources"]
    json.dump(m, open(f"{old}/manifest.json", "w"))
    assert MemmapDocumentDataset(old).source(0) is None and len(MemmapDocumentDataset(old)) == len(ds)
    assert json.loads(CliRunner().invoke(main, ["info", old, "--json"]).output)["document_sources"].startswith("unknown")
    shutil.rmtree(old)
