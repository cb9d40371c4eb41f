"""Exports: HelixLM's pretraining store, checked against its published field list and layout."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from helixtok.cli import main
from helixtok.export.helixlm import FIELDS, SHARD_FIELDS, export_helixlm
from helixtok.format.errors import ConfigError
from helixtok.pipeline.builder import build
from helixtok.pipeline.config import BuildConfig

ROWS = ["  leading spaces and a tail  \n", "plain row", "\n\nnewlines around\n\n", "   ", "x y z " * 400,
        "日本語 with spaces  "]


@pytest.fixture
def helix_build(tmp_path, small_tok):
    c = tmp_path / "c"
    c.mkdir()
    (c / "rows.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ROWS * 30))
    out = tmp_path / "out"
    build([str(c)], str(out), small_tok, BuildConfig(seq_len=64, workers=1, strip=True, shard_bytes=64 * 2 * 40))
    return out


def test_helixlm_store_has_the_published_fields_layout_and_the_compilers_stream(tmp_path, helix_build, small_tok):
    r = CliRunner().invoke(main, ["export", "helixlm", str(helix_build), str(tmp_path / "store")])
    assert r.exit_code == 0, r.output
    st = json.load(open(tmp_path / "store" / "manifest.json"))
    assert tuple(st) == FIELDS and all(tuple(e) == SHARD_FIELDS for e in st["shards"])
    assert st["format_version"] == "helix.pretrain.samples.v1" and st["token_dtype"] == "<u2"
    # HelixLM's compiler, independently: strip each text, ids + one EOS, pack, drop the tail.
    tok = Tokenizer.from_file(small_tok)
    eos = tok.token_to_id("<|endoftext|>")
    texts = [t.strip() for t in ROWS * 30 if t.strip()]
    stream = [i for t in texts for i in tok.encode(t, add_special_tokens=False).ids + [eos]]
    L = 64
    n = len(stream) // L
    assert (st["seq_len"], st["eos_token_id"], st["source_rows"]) == (L, eos, len(texts))
    assert st["raw_utf8_bytes"] == sum(len(t.encode()) for t in texts)
    assert (st["encoded_tokens"], st["sample_count"], st["dropped_tail_tokens"]) == (len(stream), n, len(stream) - n * L)
    assert st["causal_target_count"] == n * (L - 1)
    # Layout: samples-NNNNN.u16 of sample_count x seq_len little-endian uint16, start_sample cumulative.
    got, start = [], 0
    for k, e in enumerate(st["shards"]):
        p = tmp_path / "store" / e["file"]
        assert e["file"] == f"samples-{k:05d}.u16" and e["start_sample"] == start
        data = p.read_bytes()
        assert len(data) == e["bytes"] == e["sample_count"] * L * 2
        assert hashlib.sha256(data).hexdigest() == e["sha256"]
        got += np.frombuffer(data, dtype="<u2").tolist()
        start += e["sample_count"]
    assert len(st["shards"]) > 1 and st["samples_per_shard"] == st["shards"][0]["sample_count"]
    assert got == stream[: n * L]
    # (Format 2's shards are per-unit streams, not whole samples: the store is written, not linked.)
    assert st["source"]["stripped"] is True
    # No host path in the store (it held the dataset's absolute path); no warning for a --strip build.
    assert str(tmp_path) not in json.dumps(st) and st["source"]["dataset"] == os.path.relpath(helix_build,
                                                                                              tmp_path / "store")
    assert "warning" not in r.output


def test_helixlm_export_of_a_build_without_strip_warns(tmp_path, dev_packed, small_tok):
    r = CliRunner().invoke(main, ["export", "helixlm", dev_packed, str(tmp_path / "store")])
    assert r.exit_code == 0, r.output
    assert "was built without --strip" in r.stderr and "rebuild with --strip" in r.stderr


def test_helixlm_export_refuses_what_the_store_cannot_hold(tmp_path, helix_build, small_tok, dev_document):
    with pytest.raises(ConfigError, match="document-packed"):
        export_helixlm(dev_document, str(tmp_path / "s1"))
    (tmp_path / "s2").mkdir()
    (tmp_path / "s2" / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not an empty folder"):
        export_helixlm(str(helix_build), str(tmp_path / "s2"))
    assert (tmp_path / "s2" / "mine.txt").read_text() == "keep"
    r = CliRunner().invoke(main, ["export", "helixlm", str(tmp_path / "nothing"), str(tmp_path / "s3")])
    assert r.exit_code == 1 and "Traceback" not in r.output
    # A BOS the tokenizer's own rule added (Llama 3's) is said as that, with the fix (issue 63.11:
    # the line said "with --bos", an option the build was never given).
    from tokenizers import processors

    from helixtok.pipeline.builder import build

    tok = Tokenizer.from_file(small_tok)
    tok.post_processor = processors.TemplateProcessing(single="<pad> $A", special_tokens=[("<pad>", tok.token_to_id("<pad>"))])
    tok.save(str(tmp_path / "bos.json"))
    (tmp_path / "bc").mkdir()
    (tmp_path / "bc" / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 30)
    for flag, said in ((None, "(the tokenizer's own rule: rebuild with --no-bos)"), (True, "(--bos)")):
        out = tmp_path / f"b{flag}"
        build([str(tmp_path / "bc")], str(out), str(tmp_path / "bos.json"), seq_len=16, add_bos=flag, bos_token="<pad>",
              workers=1)
        with pytest.raises(ConfigError, match="this build is uint16 with a BOS before each document " + said.replace(
                "(", r"\(").replace(")", r"\)")):
            export_helixlm(str(out), str(tmp_path / f"s{flag}"))


# megatron-core runs in one child process for the module: importing it costs ~130 MB that pytest
# would keep, and ~8 s, paid once.  Each request is a line [cmd, [(prefix, arg), ...]]; each job's
# answer (or its error) comes back as one line.
MEGATRON = """
import json, sys, traceback, warnings
warnings.simplefilter("ignore")  # Transformer Engine / Apex are not installed
import numpy as np, torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

def job(cmd, prefix, arg):
    if cmd == "read":
        ds = IndexedDataset(prefix)
        return {"len": len(ds), "document_indices": ds.document_indices.tolist(), "dtype": str(ds[0].dtype),
                "tokens": int(ds.sequence_lengths.sum()),
                "docs": {str(i % len(ds)): ds[i % len(ds)].tolist() for i in arg}}
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)  # arg: [sequences, those ending a document]
    for k, sq in enumerate(arg[0]):
        b.add_item(torch.tensor(sq))
        if k in arg[1]:
            b.end_document()
    b.finalize(prefix + ".idx")
    return {}

for line in sys.stdin:
    cmd, jobs = json.loads(line)
    for prefix, arg in jobs:
        try:
            print(json.dumps(job(cmd, prefix, arg)), flush=True)
        except Exception:
            print(json.dumps({"error": traceback.format_exc()}), flush=True)
"""


@pytest.fixture(scope="module")
def megatron_core():
    """megatron_core(cmd, *jobs): megatron-core reading or writing each (prefix, arg) job."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:  # not imported here: only looked up
        pytest.skip("megatron-core is not installed (it is in the [test] extra)")
    import tempfile

    err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty child never blocks on it
    child = subprocess.Popen([sys.executable, "-c", MEGATRON], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=err, text=True)

    def ask(cmd, *jobs):
        child.stdin.write(json.dumps([cmd, [(str(p), a) for p, a in jobs]]) + "\n")
        child.stdin.flush()
        got = [json.loads(child.stdout.readline() or '{"error": "megatron-core child died"}') for _ in jobs]
        if any("error" in g for g in got):
            err.seek(0)
            pytest.fail(f"megatron-core: {got}\n{err.read()[-3000:]}")
        return got

    try:
        yield ask
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=30)
        finally:
            child.kill()
            err.close()


@pytest.mark.parametrize("shards", ["several", "one"])
def test_megatron_export_reads_back_with_megatron_core(tmp_path, dev_corpus, tokenizer_path, dev_packed, dev_ids,
                                                       megatron_core, shards):
    src = dev_packed
    if shards == "one":
        src = str(tmp_path / "one")
        build([str(dev_corpus / "txt")], src, tokenizer_path, BuildConfig(seq_len=512, workers=2, unit_bytes=1 << 30))
        docs = [d for d in _read_txt_ids(dev_corpus, tokenizer_path)]
    else:
        docs = dev_ids
    r = CliRunner().invoke(main, ["export", "megatron", src, str(tmp_path / "mg" / "corpus_text_document")])
    assert r.exit_code == 0, r.output
    m = json.load(open(os.path.join(src, "manifest.json")))
    eos = m["tokenizer"]["eos_id"]
    # Independent recount: each document's ids + EOS, every one whole (format 2 stores the
    # stream's last partial chunk too; format 1 ended the export where the last chunk did).
    want = [list(ids) + [eos] for ids in docs]
    [got] = megatron_core("read", (tmp_path / "mg" / "corpus_text_document", [0, 1, len(want) // 2, -1]))
    assert got["len"] == len(want) and got["document_indices"] == list(range(len(want) + 1))
    assert all(got["docs"][str(i % len(want))] == want[i] for i in (0, 1, len(want) // 2, -1))
    assert got["dtype"] == "uint16" and got["tokens"] == m["splits"]["train"]["tokens"]
    linked = os.stat(tmp_path / "mg" / "corpus_text_document.bin").st_ino == os.stat(
        os.path.join(src, "train-000000-0000.bin")).st_ino
    assert linked == (shards == "one") and ("(.bin linked)" in r.output) == linked


def _read_txt_ids(dev_corpus, tokenizer_path):
    tok = Tokenizer.from_file(tokenizer_path)
    for p in sorted((dev_corpus / "txt").glob("*.txt")):
        text = p.read_text()
        if text.strip():
            yield tok.encode(text, add_special_tokens=False).ids


def test_megatron_import_round_trips_and_reads_megatron_cores_own_files(tmp_path, dev_packed, tokenizer_path, small_tok,
                                                                         megatron_core):
    from helixtok import MemmapChunkDataset

    prefix = str(tmp_path / "mg" / "c")
    assert CliRunner().invoke(main, ["export", "megatron", dev_packed, prefix]).exit_code == 0
    r = CliRunner().invoke(main, ["import", "megatron", prefix, str(tmp_path / "back"), "-t", tokenizer_path,
                                  "-L", "512", "--shard-size", "1MiB"])
    assert r.exit_code == 0, r.output
    # Export then import gives back the very stream and document starts (format 2: in shards of
    # --shard-size, where the build wrote one stream per work unit).
    from helixtok.read.splitview import SplitView

    views = [SplitView(p, json.load(open(os.path.join(p, "manifest.json")))) for p in (dev_packed, tmp_path / "back")]
    (a, b) = [np.concatenate(list(v.iter_stream())) for v in views]
    assert np.array_equal(a, b) and all(v.starts[-1] == len(a) for v in views)
    assert np.array_equal(views[0].starts_in(0, len(a)), views[1].starts_in(0, len(a)))
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "back")]).exit_code == 0
    raw = (tmp_path / "back" / "manifest.json").read_text()  # no host path in it (it had the absolute prefix)
    assert str(tmp_path) not in raw and json.loads(raw)["inputs"]["megatron_prefix"] == "c"
    assert len(MemmapChunkDataset(str(tmp_path / "back"), tokenizer=tokenizer_path)) == \
        json.load(open(os.path.join(dev_packed, "manifest.json")))["splits"]["train"]["num_chunks"]
    # A dataset written by megatron-core itself: two documents of two sentences each, one of one.
    seqs = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14], [15, 16]]
    # And one holding an id outside the tokenizer's vocabulary.
    megatron_core("write", (tmp_path / "own", [seqs, [1, 3, 4]]), (tmp_path / "bad", [[[1, 2, 60000, 3, 4]], [0]]))
    assert CliRunner().invoke(main, ["import", "megatron", str(tmp_path / "own"), str(tmp_path / "o2"), "-t",
                                     small_tok, "-L", "4"]).exit_code == 0
    m = json.load(open(tmp_path / "o2" / "manifest.json"))
    stream = np.fromfile(tmp_path / "o2" / "train-000000-0000.bin", dtype="<u2").tolist()
    assert stream == [i for sq in seqs for i in sq][:12] and m["totals"]["documents"] == 3
    assert np.fromfile(tmp_path / "o2" / "train-000000-0000.docs", dtype="<u8").tolist() == [0, 5, 10]
    # Ids outside the tokenizer's vocabulary: one line, nothing written.
    r = CliRunner().invoke(main, ["import", "megatron", str(tmp_path / "bad"), str(tmp_path / "o3"), "-t",
                                  small_tok, "-L", "2"])
    assert r.exit_code == 1 and "token id 60000 is outside the vocabulary" in r.output
    assert not (tmp_path / "o3").exists()  # the folder it made is gone again


def test_megatron_import_killed_halfway_is_rerun_by_the_same_command(tmp_path, dev_packed, tokenizer_path):
    """A killed import leaves only its state folder: the same command starts again and gives the
    dataset an uninterrupted import gives; a dataset there already, or a file helixtok did not
    write, is refused in one line and left as it was."""
    prefix, out, clean = str(tmp_path / "mg" / "c"), tmp_path / "back", tmp_path / "clean"
    assert CliRunner().invoke(main, ["export", "megatron", dev_packed, prefix]).exit_code == 0
    args = [prefix, "-t", tokenizer_path, "-L", "512", "--shard-size", "256KiB"]
    # Killed (os._exit: no handler runs) after the shards are written, before they are published.
    code = ("import os, sys; import helixtok.format.shards as s; close = s.ShardFiles.close\n"
            "def killed(self):\n    close(self); os._exit(9)\n"
            "s.ShardFiles.close = killed\n"
            "from helixtok.cli import main; sys.argv = ['helixtok'] + sys.argv[1:]; main()")
    p = subprocess.run([sys.executable, "-c", code, "import", "megatron", prefix, str(out), *args[1:]],
                       capture_output=True, text=True)
    assert p.returncode == 9, p.stderr
    assert sorted(os.listdir(out)) == [".helixtok-lock", ".helixtok-partial"] and any(n.endswith(".bin") for n in os.listdir(out / ".helixtok-partial"))
    for o in (out, clean):
        r = CliRunner().invoke(main, ["import", "megatron", prefix, str(o), *args[1:]])
        assert r.exit_code == 0, r.output
    assert sorted(os.listdir(out)) == sorted(os.listdir(clean))
    for n in os.listdir(clean):
        assert (out / n).read_bytes() == (clean / n).read_bytes(), n
    r = CliRunner().invoke(main, ["import", "megatron", prefix, str(out), *args[1:]])
    assert r.exit_code == 1 and f"{out}: already holds a dataset; give a new path" in r.output
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    r = CliRunner().invoke(main, ["import", "megatron", prefix, str(mine), *args[1:]])
    assert r.exit_code == 1 and "holds 'notes.txt'" in r.output and os.listdir(mine) == ["notes.txt"]


def test_llmc_file_is_what_llm_c_and_nanogpt_read(tmp_path, dev_packed):
    r = CliRunner().invoke(main, ["export", "llmc", dev_packed, str(tmp_path / "train.bin")])
    assert r.exit_code == 0, r.output
    data = (tmp_path / "train.bin").read_bytes()
    header = np.frombuffer(data[:1024], dtype="<i4")  # llm.c's dataloader: 256 int32, then uint16 ids
    assert (header[0], header[1]) == (20240520, 1) and header[3:].tolist() == [0] * 253
    ids = np.frombuffer(data[1024:], dtype="<u2")
    assert len(ids) == header[2]
    m = json.load(open(os.path.join(dev_packed, "manifest.json")))
    # The stream is the shards in order: what nanoGPT's np.memmap(train.bin, uint16) reads from the shards themselves.
    shards = np.concatenate([np.memmap(os.path.join(dev_packed, e["path"]), dtype="<u2", mode="r")
                             for e in m["splits"]["train"]["shards"]])
    assert header[2] == m["splits"]["train"]["num_tokens"] and np.array_equal(ids, shards[: header[2]])
    r = CliRunner().invoke(main, ["export", "llmc", dev_packed, str(tmp_path / "train.bin")])
    assert r.exit_code == 1 and "exists; give a new file name" in r.output


def test_megatron_export_of_bestfit_is_one_sequence_per_item(tmp_path, dev_bestfit, dev_ids, megatron_core):
    """bestfit: one sequence per item, padding left out: every document of at most seq_len
    tokens whole, a longer one as its seq_len pieces; megatron-core reads them unchanged.  A
    document-packed build is refused with one line; HelixLM's store refuses bestfit too."""
    from helixtok.export.helixlm import export_helixlm
    from helixtok.read.splitview import SplitView

    r = CliRunner().invoke(main, ["export", "megatron", dev_bestfit, str(tmp_path / "mg" / "bf")])
    assert r.exit_code == 0, r.output
    m = json.load(open(os.path.join(dev_bestfit, "manifest.json")))
    L, eos = m["seq_len"], m["tokenizer"]["eos_id"]
    pieces = sorted(tuple((ids + [eos])[a: a + L]) for ids in dev_ids for a in range(0, len(ids) + 1, L))
    view = SplitView(dev_bestfit, m)
    stored = []
    for i in range(view.num_chunks):
        v, row = view.valid(i), view.chunk(i).tolist()
        cuts = view.chunk_starts(i).tolist()
        stored += [tuple(row[a:b]) for a, b in zip(cuts, cuts[1:] + [v])]
    assert sorted(stored) == pieces  # every piece of every document, once
    picks = [0, 1, len(stored) // 2, len(stored) - 1]
    [got] = megatron_core("read", (tmp_path / "mg" / "bf", picks))
    assert got["len"] == len(stored) and got["tokens"] == m["totals"]["tokens"]
    assert all(tuple(got["docs"][str(i % len(stored))]) == stored[i] for i in picks)
    with pytest.raises(ConfigError, match="HelixLM's store is a packed stream; this build is bestfit-packed"):
        export_helixlm(dev_bestfit, str(tmp_path / "store"))
    r = CliRunner().invoke(main, ["export", "llmc", dev_bestfit, str(tmp_path / "bf.bin")])
    assert r.exit_code == 1 and not os.path.exists(tmp_path / "bf.bin")
    assert r.output.strip() == (f"Error: {dev_bestfit}: llm.c reads one token stream; this build is bestfit-packed "
                                "(rebuild with --pack packed)")


@pytest.mark.parametrize("fmt", ["megatron", "llmc"])
def test_an_export_of_a_damaged_shard_is_refused_and_leaves_nothing(tmp_path, small_corpus, small_tok, fmt):
    """A one-shard dataset whose shard is 2 bytes short: the Megatron export (which hard-links
    that shard) and the llm.c export refuse it in one line, and leave no file behind (a .tmp
    included) in the user's folder."""
    out = tmp_path / "out"
    m = build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=16, workers=1))
    [shard] = m["splits"]["train"]["shards"]
    with open(out / shard["path"], "r+b") as fh:
        fh.truncate(shard["bytes"] - 2)
    dest = tmp_path / "exported"
    dest.mkdir()
    r = CliRunner().invoke(main, ["export", fmt, str(out), str(dest / ("m" if fmt == "megatron" else "t.bin"))])
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    assert "bytes" in r.output and shard["path"] in r.output, r.output
    assert os.listdir(dest) == []
