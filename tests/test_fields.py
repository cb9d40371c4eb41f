"""--keep-fields (issue 56.4): each record's small fields (by default its "id") kept beside its
document's source, read back by the document view, `show` and `info`; the same per document whatever
the worker count, unit size, partitioning or form; carried by merge and repack; a damaged file is an
error, never other fields."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from helixtok.cli import main
from helixtok.format.errors import ConfigError, DatasetError
from helixtok.pipeline.builder import build
from helixtok.pipeline.config import BuildConfig

pytest.importorskip("torch")
from helixtok.read.documents import MemmapDocumentDataset  # noqa: E402


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def corpus(tmp_path, dev_docs) -> tuple[Path, dict[str, dict]]:
    """JSON lines (plain and .gz) with ids, nested labels and one oversized field; a Parquet file with an
    id column and a struct; a text file (no fields).  Returns the folder and, by text, the fields a
    build with --keep-fields id,meta.lang keeps."""
    c = tmp_path / "c"
    c.mkdir()
    texts = [t for t in dev_docs if t.strip()][:160]
    want: dict[str, dict] = {}
    rows = []
    for i, t in enumerate(texts[:60]):
        rec = {"text": t, "id": f"doc-{i}", "meta": {"lang": ["en", "de", "fr"][i % 3], "n": i}}
        if i % 7 == 3:
            del rec["id"]  # no id: only the label is kept
        if i == 10:
            rec["meta"]["lang"] = "x" * 2000  # over FIELD_BYTES: left out, counted
        rows.append(rec)
        kept = {k: v for k, v in (("id", rec.get("id")), ("meta.lang", rec["meta"]["lang"])) if v is not None}
        want[t] = {k: v for k, v in kept.items() if not (k == "meta.lang" and len(v) > 100)}
    Path(c, "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:30]))
    with gzip.open(c / "b.jsonl.gz", "wt") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows[30:])
    table = pa.table({"text": texts[60:120], "id": list(range(60, 120)),
                      "meta": [{"lang": "es", "n": i} for i in range(60, 120)]})
    pq.write_table(table, c / "p.parquet", row_group_size=11)
    for i, t in enumerate(texts[60:120]):
        want[t] = {"id": 60 + i, "meta.lang": "es"}
    Path(c, "t.txt").write_text(texts[120])
    want[texts[120]] = {}
    return c, want


def _fields_by_text(out: str, tok) -> dict[str, dict]:
    """Each document of every split, by its text (decoded), with the fields the view gives it."""
    got = {}
    for split in json.loads(Path(out, "manifest.json").read_text())["splits"]:
        ds = MemmapDocumentDataset(out, split, sources=True)
        for i in range(len(ds)):
            x = ds[i]
            got[tok.decode(x["input_ids"].tolist()[:-1])] = x["fields"]
    return got


def test_kept_fields_are_each_records_whatever_the_path(tmp_path, corpus, tokenizer_path):
    from tokenizers import Tokenizer

    c, want = corpus
    tok = Tokenizer.from_file(tokenizer_path)
    base = dict(seq_len=64, val_fraction=0.2, keep_fields=("id", "meta.lang"))
    outs = []
    for k, (packing, unit, workers) in enumerate([("packed", 4 << 20, 1), ("packed", 8 << 10, 2),
                                                  ("bestfit", 8 << 10, 1)]):
        out = str(tmp_path / f"o{k}")
        build(str(c), out, tokenizer_path, BuildConfig(packing=packing, unit_bytes=unit, workers=workers, **base))
        got = _fields_by_text(out, tok)
        assert {tok.decode(tok.encode(t).ids) for t in want} == set(got)
        assert all(got[tok.decode(tok.encode(t).ids)] == f for t, f in want.items())
        outs.append(out)
    m = json.loads(Path(outs[1], "manifest.json").read_text())
    assert m["fields"]["names"] == ["id", "meta.lang"] and m["options"]
    assert m["skipped"]["field_too_long"]["count"] == 1
    assert "a.jsonl:11 (meta.lang: 2,002 bytes as JSON, over 1,024)" in m["skipped"]["field_too_long"]["examples"][0]
    # -j 1 and -j 2 at the same unit size: the same file.
    again = str(tmp_path / "again")
    build(str(c), again, tokenizer_path, BuildConfig(packing="packed", unit_bytes=8 << 10, workers=1, **base))
    assert Path(again, "fields.jsonl").read_bytes() == Path(outs[1], "fields.jsonl").read_bytes()
    # show names the source and the fields; info says which are kept and their size.
    r = cli("show", outs[0], 0)
    assert r.exit_code == 0 and '--- document 0 starts: a.jsonl:1 {"id": "doc-0", "meta.lang": "en"} ---' in r.output
    info = json.loads(cli("info", outs[0], "--json").output)
    assert info["document_fields"] == {"names": ["id", "meta.lang"],
                                       "bytes": os.path.getsize(Path(outs[0], "fields.jsonl"))}
    # --keep-fields '': none kept, no file; a changed list is a changed plan.
    none = str(tmp_path / "none")
    build(str(c), none, tokenizer_path, BuildConfig(**{**base, "keep_fields": ""}))
    assert not Path(none, "fields.jsonl").exists() and "fields" not in json.loads(Path(none, "manifest.json").read_text())
    assert MemmapDocumentDataset(none, sources=True)[0].get("fields") is None
    r = cli("build", c, outs[0], "-t", tokenizer_path, "-L", 64, "--val-fraction", 0.2, "--keep-fields", "id")
    assert r.exit_code != 0 and "keep_fields" in r.output


def test_merge_and_repack_carry_the_fields(tmp_path, corpus, tokenizer_path):
    from tokenizers import Tokenizer

    c, want = corpus
    tok = Tokenizer.from_file(tokenizer_path)
    opts = ["-t", tokenizer_path, "-L", 64, "-j", 1, "-q", "--unit-size", "8KiB", "--keep-fields", "id,meta.lang"]
    whole = tmp_path / "whole"
    assert cli("build", c, whole, *opts).exit_code == 0
    parts = tmp_path / "parts"
    for k in range(2):
        r = cli("build", c, parts, *opts, "--num-tasks", 2, "--task-index", k)
        assert r.exit_code == 0, r.output
    merged = tmp_path / "merged"
    r = cli("merge", parts / "part-00000", parts / "part-00001", merged)
    assert r.exit_code == 0, r.output
    assert _fields_by_text(str(merged), tok) == _fields_by_text(str(whole), tok)
    assert cli("verify", merged).exit_code == 0
    # packed -> bestfit: the same file, linked; -> document: no fields (no sources there).
    bf = tmp_path / "bf"
    r = cli("repack", whole, bf, "--pack", "bestfit")
    assert r.exit_code == 0, r.output
    assert os.stat(bf / "fields.jsonl").st_ino == os.stat(whole / "fields.jsonl").st_ino
    assert _fields_by_text(str(bf), tok) == _fields_by_text(str(whole), tok)
    doc = tmp_path / "doc"
    assert cli("repack", whole, doc, "--pack", "document").exit_code == 0
    assert not (doc / "fields.jsonl").exists() and "fields" not in json.loads((doc / "manifest.json").read_text())


def test_a_damaged_fields_file_is_an_error_never_other_fields(tmp_path, corpus, tokenizer_path):
    c, _ = corpus
    out = tmp_path / "o"
    build(str(c), str(out), tokenizer_path, BuildConfig(seq_len=64, unit_bytes=8 << 10, workers=1))
    ds = MemmapDocumentDataset(str(out), sources=True)
    j = next(i for i in range(len(ds)) if ds[i]["fields"] == {"id": "doc-1"})
    data = bytearray((out / "fields.jsonl").read_bytes())
    at = data.index(b'"doc-1"')
    data[at + 5] = ord("7")  # doc-1 -> doc-7: valid JSON, another id
    (out / "fields.jsonl").write_bytes(bytes(data))
    ds = MemmapDocumentDataset(str(out), sources=True)
    assert ds[0]["fields"] == {"id": "doc-0"}  # (another unit's line: still read)
    with pytest.raises(DatasetError, match=r"fields.jsonl: bytes \d+-\d+ are not what the manifest says"):
        ds[j]
    r = cli("verify", out)
    assert r.exit_code != 0 and "fields.jsonl: sha256 differs from the manifest's" in r.output


def test_keep_fields_refuses_document_packing_in_one_line(tmp_path, corpus, tokenizer_path):
    c, _ = corpus
    with pytest.raises(ConfigError, match="--keep-fields applies to --pack packed and bestfit"):
        BuildConfig(packing="document", keep_fields="id")
    assert BuildConfig(packing="document").keep_fields == () and BuildConfig().keep_fields == ("id",)
    r = cli("build", c, tmp_path / "o", "-t", tokenizer_path, "--pack", "document", "--keep-fields", "id")
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "--keep-fields applies to" in r.output
