"""Builds on the dev corpus and on hand-made corpora: exact counts, round-trips, determinism."""

import dataclasses
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import UNIT
from helixtok.format.errors import ConfigError, InputError
from helixtok.pipeline.builder import UpToDate, build
from helixtok.pipeline.config import BuildConfig


def read_split(out, split="train"):
    m = json.load(open(os.path.join(out, "manifest.json")))
    dt = {"uint16": "<u2", "uint32": "<u4"}[m["dtype"]]
    arrs = [np.fromfile(os.path.join(out, s["path"]), dtype=dt) for s in m["splits"][split]["shards"]]
    n = m["splits"][split]["num_tokens"]  # format 2: a packed stream's last partial chunk is on disk too
    return m, np.concatenate(arrs)[:n].reshape(-1, m["seq_len"])


def test_packed_counts_equal_independent_recount(dev_packed, dev_ids, dev_docs):
    """Every document + EOS, concatenated in corpus order and cut into 512s: exactly the shards."""
    m, chunks = read_split(dev_packed)
    eos = m["tokenizer"]["eos_id"]
    stream = np.array([t for ids in dev_ids for t in ids + [eos]], dtype=np.int64)
    k = len(stream) // 512
    assert m["splits"]["train"]["num_chunks"] == k == len(chunks)
    assert m["totals"]["documents"] == len(dev_docs) > 300
    assert m["totals"]["tokens"] == len(stream)
    assert m["totals"]["dropped_tokens"] == len(stream) - k * 512
    assert np.array_equal(chunks.reshape(-1), stream[: k * 512])
    assert len(m["splits"]["train"]["shards"]) > 1  # 4 MiB shards: boundaries exercised


def test_packed_stream_decodes_to_documents(dev_packed, dev_docs, tokenizer_path):
    m, chunks = read_split(dev_packed)
    tok = Tokenizer.from_file(tokenizer_path)
    eos = m["tokenizer"]["eos_id"]
    flat = chunks.reshape(-1).tolist()
    # Split at EOS and decode the first 300 documents: the text comes back byte for byte.
    docs, cur = [], []
    for t in flat:
        if t == eos:
            docs.append(tok.decode(cur))
            cur = []
            if len(docs) == 300:
                break
        else:
            cur.append(t)
    assert docs == dev_docs[:300]


def test_document_counts_equal_independent_recount(dev_document, dev_ids):
    m, chunks = read_split(dev_document)
    L, tail, eos, pad = 512, 128, m["tokenizer"]["eos_id"], m["tokenizer"]["pad_id"]
    rows, pads, dropped, dropped_docs = [], 0, 0, 0
    for ids in dev_ids:
        d = ids + [eos]
        if len(ids) < tail:
            dropped += len(d)
            dropped_docs += 1
            continue
        full, r = divmod(len(d), L)
        rows.extend(d[i * L:(i + 1) * L] for i in range(full))
        if r >= tail:
            rows.append(d[full * L:] + [pad] * (L - r))
            pads += L - r
        else:
            dropped += r
    assert chunks.tolist() == rows
    t = m["totals"]
    assert (t["pad_tokens"], t["dropped_tokens"], t["dropped_documents"]) == (pads, dropped, dropped_docs)
    assert t["tokens"] + t["pad_tokens"] - t["dropped_tokens"] == t["chunks"] * L
    assert m["min_tail_len"] == tail


def test_workers_and_backends_byte_identical(tmp_path, dev_corpus, tokenizer_path, dev_packed):
    """workers=1 with tokenizers vs workers=2 with the auto backend (tiktoken, when installed): same bytes."""
    out = str(tmp_path / "w1")
    m = build([str(dev_corpus)], out, tokenizer_path,
              BuildConfig(seq_len=512, workers=1, shard_bytes=1 << 20, unit_bytes=UNIT, backend="hf"))
    assert m["tokenizer"]["backend"] == "hf"
    names = sorted(os.listdir(dev_packed))
    assert names == sorted(os.listdir(out))
    for n in names:
        if n == "manifest.json":
            continue  # it records which backend ran
        with open(os.path.join(out, n), "rb") as a, open(os.path.join(dev_packed, n), "rb") as b:
            assert a.read() == b.read(), n
    other = json.load(open(os.path.join(dev_packed, "manifest.json")))
    for k in ("splits", "totals", "skipped", "inputs"):
        assert m[k] == other[k]


def test_two_builds_in_threads_of_one_program_keep_to_their_own_options(tmp_path, small_corpus, small_tok,
                                                                       monkeypatch):
    """A build without workers tokenizes in its caller's thread: two at once in one program (a
    notebook, a thread pool) each tokenize with their own options into their own folder, and
    give the bytes they give alone.  A barrier makes both set up before either tokenizes: where
    that set-up was process-wide, the second's options and folder were used by the first."""
    import threading

    from helixtok.pipeline import unit as hb

    def config(k):  # options that change the bytes (the split, stripping); tokenizers: no backend check
        return BuildConfig(seq_len=64, workers=1, val_fraction=0.3 * k, strip=k == 0, backend="hf")

    def files(out):
        return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out)) if n != "manifest.json"}
    alone = []
    for k in (0, 1):
        build([str(small_corpus)], str(tmp_path / f"alone{k}"), small_tok, config(k))
        alone.append(files(str(tmp_path / f"alone{k}")))
    barrier, first, real = threading.Barrier(2, timeout=60), threading.local(), hb._run_unit

    def both_set_up(unit, info, *where):
        if not getattr(first, "passed", False):
            first.passed = True
            barrier.wait()
        return real(unit, info, *where)
    monkeypatch.setattr(hb, "_run_unit", both_set_up)
    errors = []

    def run(k):
        try:
            build([str(small_corpus)], str(tmp_path / f"thread{k}"), small_tok, config(k))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
            barrier.abort()
    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [files(str(tmp_path / f"thread{k}")) for k in (0, 1)] == alone
    assert alone[0] != alone[1]


def test_workers_are_what_j_says_or_as_many_as_the_input_keeps_busy(tmp_path, small_corpus, small_tok, monkeypatch):
    """-j N means N tokenizing processes whenever there are N work units (a forked worker costs
    milliseconds to start).  Without -j, a build starts one per 16 MiB of input with fastokens
    (up to that it tokenizes in its own process) and one per 1 MiB with tokenizers, up to all
    cores; if the check picks tokenizers after such a build started fewer, the pool it needs
    starts then.  The bytes never depend on it.  (Rule changed by issue 38: -j used to be a
    maximum that the input's size and the tokenizer file's size cut down.)"""

    import helixtok.pipeline.builder as hb
    import helixtok.pipeline.config
    from helixtok.pipeline.discover import discover
    from helixtok.pipeline.units import plan_units

    made = []

    class Counted(hb.UnitPool):
        def __init__(self, n, *a, **k):
            made.append((n, k.get("load_likely", True)))
            super().__init__(n, *a, **k)

    monkeypatch.setattr(hb, "UnitPool", Counted)
    monkeypatch.delenv("HELIXTOK_WORKER_BYTES", raising=False)
    cfg = BuildConfig(seq_len=64, workers=0, unit_bytes=1, shard_bytes=1 << 10)  # 18 KB of text, one unit (and shard) per file (7)

    def run(name, task=None, **kw):
        made.clear()
        seen = set()  # what the progress bar shows as "tokenize ×N"
        m = build([str(small_corpus)], str(tmp_path / name), small_tok, dataclasses.replace(cfg, **kw), task=task,
                  on_progress=lambda p: seen.add(p.processes) if p.phase == "tokenize" else None)
        assert seen == {made[-1][0] if made else 1}
        return m, list(made), {n: (tmp_path / name / n).read_bytes() for n in os.listdir(tmp_path / name)
                               if n != "manifest.json"}

    m, pools, shards = run("fast")
    assert (m["tokenizer"]["backend"], pools) == ("fastokens", [])  # 18 KB: this process tokenizes
    m, pools, got = run("j3", workers=3)
    assert (m["tokenizer"]["backend"], pools, got) == ("fastokens", [(3, True)], shards)  # -j 3: three, whatever the size
    units, _ = plan_units(discover([str(small_corpus)])[0], unit_bytes=cfg.unit_bytes, text_field="text")
    assert len(units) == 7
    assert hb.worker_count(dataclasses.replace(cfg, workers=64), units, "fastokens") == (7, "--workers 64, 7 work units")
    assert hb.worker_count(dataclasses.replace(cfg, workers=5), units, "hf")[0] == 5
    monkeypatch.setenv("HELIXTOK_WORKER_BYTES", str(8 << 10))  # three processes' worth
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    n, why = hb.worker_count(cfg, units, "fastokens")
    assert (n, why) == (3, "auto: 4 cores, 7 work units, one process per 0.0078125 MiB of input with fastokens")
    monkeypatch.setenv("HELIXTOK_WORKER_BYTES", "1")
    assert hb.worker_count(cfg, units, "fastokens")[0] == 4  # the cores
    monkeypatch.setenv("HELIXTOK_WORKER_BYTES", "64KiB")
    with pytest.raises(ConfigError, match="HELIXTOK_WORKER_BYTES must be a whole number of bytes"):
        hb.worker_count(cfg, units, "fastokens")
    monkeypatch.delenv("HELIXTOK_WORKER_BYTES")
    total = sum(u.est_bytes for u in units)
    monkeypatch.setattr(helixtok.pipeline.config, "WORKER_BYTES", {"fastokens": -(-total // 2)})  # the corpus: two workers' worth
    assert run("share", task=(1, 3))[1] == []  # one task of three (the last two files): sized for its share
    monkeypatch.setattr(helixtok.pipeline.config, "WORKER_BYTES", {"fastokens": 1 << 30})  # kilobytes stand for MiB
    monkeypatch.setattr(helixtok.pipeline.config, "WORKER_BYTES_SLOW", 16 << 10)
    m, pools, got = run("hf", backend="hf")
    assert (m["tokenizer"]["backend"], pools, got) == ("hf", [(2, True)], shards)  # sized for tokenizers at once
    real = hb.choose_backend
    monkeypatch.setattr(hb, "choose_backend", lambda info, units, config, ex, **kw: real(
        info, units, dataclasses.replace(config, backend="hf"), ex, **kw))  # the check finds only tokenizers exact
    m, pools, got = run("late")
    assert (m["tokenizer"]["backend"], pools, got) == ("hf", [(2, False)], shards)  # started after the check
    monkeypatch.setattr(helixtok.pipeline.config, "WORKER_BYTES", {"fastokens": -(-total // 2)})  # two workers for fastokens,
    monkeypatch.setattr(helixtok.pipeline.config, "WORKER_BYTES_SLOW", -(-total // 3))  # three for tokenizers
    m, pools, got = run("larger")
    assert (m["tokenizer"]["backend"], pools, got) == ("hf", [(2, True), (3, False)], shards)  # replaced


def test_auto_backend_is_the_fastest_exact_one_and_says_why(tmp_path, tokenizer_path, small_tok, monkeypatch):
    from tokenizers import normalizers

    import helixtok.pipeline.backends as hbk
    from helixtok.format.errors import TokenizerError

    write(tmp_path / "c" / "a.txt", "hello world, It's 2026! 日本語 😀 <|endoftext|> " * 20)
    m = build([str(tmp_path / "c")], str(tmp_path / "o1"), tokenizer_path, BuildConfig(seq_len=4, workers=1))
    assert m["tokenizer"]["backend"] == "fastokens" and m["tokenizer"]["backend_version"].startswith("fastokens ")
    assert m["tokenizer"]["backend_check"]["sample_documents"] == 1
    # gigatoken turns special-token text into control ids whatever it is asked: not exact under "text".
    with pytest.raises(TokenizerError, match="backend gigatoken is not exact for this tokenizer .ids differ on"):
        build([str(tmp_path / "c")], str(tmp_path / "o2"), tokenizer_path, BuildConfig(seq_len=4, workers=1,
                                                                                     backend="gigatoken"))
    # Without the faster ones, tiktoken is next; a normalizer (lowercasing) it cannot mirror: tokenizers.
    monkeypatch.setattr(hbk, "FAST", ("tiktoken",))
    m = build([str(tmp_path / "c")], str(tmp_path / "o3"), tokenizer_path, BuildConfig(seq_len=4, workers=1))
    assert m["tokenizer"]["backend"] == "tiktoken"
    tok = Tokenizer.from_file(small_tok)
    tok.normalizer = normalizers.Lowercase()
    lower = str(tmp_path / "lower.json")
    tok.save(lower)
    m = build([str(tmp_path / "c")], str(tmp_path / "o4"), lower, BuildConfig(seq_len=4, workers=1))
    assert m["tokenizer"]["backend"] == "hf"
    assert m["tokenizer"]["backend_check"]["rejected"] == {"tiktoken": "tokenizer has a normalizer"}
    with pytest.raises(TokenizerError, match="backend tiktoken is not exact for this tokenizer"):
        build([str(tmp_path / "c")], str(tmp_path / "o5"), lower, BuildConfig(seq_len=4, workers=1, backend="tiktoken"))


def write(p, text):
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def test_hand_made_jsonl_exact(tmp_path, small_tok):
    tok = Tokenizer.from_file(small_tok)
    texts = ["hello world", "the lazy dog", "  leading and trailing  ", "fox"]
    write(tmp_path / "c" / "a.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = str(tmp_path / "out")
    m = build([str(tmp_path / "c")], out, small_tok, BuildConfig(seq_len=4, workers=1))
    eos = tok.token_to_id("<|endoftext|>")
    stream = [t for x in texts for t in tok.encode(x, add_special_tokens=False).ids + [eos]]
    _, chunks = read_split(out)
    assert chunks.reshape(-1).tolist() == stream[: len(stream) // 4 * 4]
    assert m["totals"]["dropped_tokens"] == len(stream) % 4
    # Text is tokenized as stored: the leading spaces survive.
    assert tok.decode(stream).startswith("hello world")
    assert "  leading and trailing  " in tok.decode(stream, skip_special_tokens=True)


@pytest.mark.parametrize("strip", [False, True])
def test_text_bytes_are_the_utf8_bytes_of_the_documents_as_tokenized(tmp_path, small_tok, strip):
    """Per split and in total; non-ASCII text, a lone surrogate escape (repaired), and a document
    long enough to be read and encoded in pieces."""
    texts = ["hello world", "  Ωμέγα straße  ", "日本語のテキスト 😀👍🏽", "x\ud800y", "plain ascii " * 40]
    lines = [json.dumps({"text": t}) for t in texts] + ['{"text": "' + "naïve café " * 30_000 + '"}']
    write(tmp_path / "c" / "a.jsonl", "\n".join(lines) + "\n")
    m = build([str(tmp_path / "c")], str(tmp_path / "out"), small_tok,
              BuildConfig(seq_len=4, workers=1, strip=strip, val_fraction=0.4, long_doc_bytes=100_000))
    docs = [t.replace("\ud800", "\ufffd") for t in texts] + ["naïve café " * 30_000]
    want = sum(len((d.strip() if strip else d).encode()) for d in docs)
    got = {s: v["text_bytes"] for s, v in m["splits"].items()}
    assert m["totals"]["text_bytes"] == sum(got.values()) == want and all(got.values()), got


def test_bos_and_document_padding_with_pad_equal_eos(tmp_path, small_tok):
    write(tmp_path / "c" / "a.txt", "hello world hello world")
    write(tmp_path / "c" / "b.txt", "fox")
    out = str(tmp_path / "out")
    m = build([str(tmp_path / "c")], out, small_tok,
              BuildConfig(seq_len=8, workers=1, packing="document", min_tail_len=1, add_bos=True,
                          bos_token="<pad>", pad_token="<|endoftext|>"))
    assert m["tokenizer"]["pad_id"] == m["tokenizer"]["eos_id"]
    valid = np.fromfile(os.path.join(out, "train-000000-0000.valid"), dtype="<u4")
    _, chunks = read_split(out)
    assert len(valid) == len(chunks)
    bos = m["tokenizer"]["bos_id"]
    starts = [r[0] for r, v in zip(chunks.tolist(), valid) if True]
    assert starts[0] == bos
    # Padding is recorded per chunk, so it is maskable even though pad == eos.
    assert sum(8 - int(v) for v in valid) == m["totals"]["pad_tokens"]


def test_uint32_when_vocab_exceeds_uint16(tmp_path):
    from tokenizers import Tokenizer as T
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70000)}
    vocab["<|endoftext|>"] = 70000
    tok = T(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tp = str(tmp_path / "big.json")
    tok.save(tp)
    write(tmp_path / "c" / "a.txt", "w69999 w65536 w1 w65535 w70000")
    out = str(tmp_path / "out")
    m = build([str(tmp_path / "c")], out, tp, BuildConfig(seq_len=3, workers=1))
    assert m["dtype"] == "uint32"
    _, chunks = read_split(out)
    assert chunks.reshape(-1).tolist() == [69999, 65536, 1, 65535, 0, 70000]  # w70000 is unknown -> w0


def test_val_split_is_document_level_and_deterministic(tmp_path, small_tok):
    texts = [f"hello world {i} " * (i % 7 + 1) for i in range(200)]
    write(tmp_path / "c" / "a.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts + texts[:20]))
    cfg = BuildConfig(seq_len=4, workers=1, val_fraction=0.2)
    m = build([str(tmp_path / "c")], str(tmp_path / "o1"), small_tok, cfg)
    m2 = build([str(tmp_path / "c")], str(tmp_path / "o2"), small_tok, BuildConfig(seq_len=4, workers=2, val_fraction=0.2))
    assert m["splits"] == m2["splits"]
    tr, va = m["splits"]["train"]["documents"], m["splits"]["val"]["documents"]
    assert tr + va == 220 and 20 < va < 80
    # The split is docs/format.md's hash, computed here without helixtok: a duplicate goes where
    # its first copy goes, so no document is in both.
    want_val = sum(_spec_hash(t, 0) < 0.2 * 2.0**64 for t in texts + texts[:20])
    assert va == want_val


def _spec_hash(text: str, seed: int) -> int:
    """docs/format.md's split hash: BLAKE2b, 8-byte digest, keyed by the seed, read little-endian."""
    import hashlib

    h = hashlib.blake2b(text.encode(), digest_size=8, key=seed.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def test_val_size_takes_the_n_smallest_hashes_whatever_the_partitioning(tmp_path, small_tok):
    """Issue 63.3: --val-size N puts exactly the N documents with the smallest split hashes in val
    (docs/format.md, recomputed here), the same bytes at -j 1 and -j 2, any unit size and as two
    merged tasks; a val split that ends empty is a warning; what cannot be is one line."""
    from click.testing import CliRunner

    from helixtok.cli import main

    texts = [f"hello world {i} " * (i % 7 + 1) for i in range(300)]
    write(tmp_path / "c" / "a.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts[:150]))
    write(tmp_path / "c" / "b.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts[150:]))
    N = 37
    cut = sorted(_spec_hash(t, 5) for t in texts)[N - 1]
    want = sorted(t for t in texts if _spec_hash(t, 5) <= cut)
    assert len(want) == N
    outs = []
    for k, kw in enumerate(({"workers": 1}, {"workers": 2, "unit_bytes": 2048}, {"workers": 2, "unit_bytes": 700})):
        out = str(tmp_path / f"o{k}")
        m = build([str(tmp_path / "c")], out, small_tok, BuildConfig(seq_len=4, val_size=N, split_seed=5, **kw))
        assert m["splits"]["val"]["documents"] == N and m["splits"]["train"]["documents"] == 300 - N
        assert m["options"]["val_size"] == N
        outs.append(out)
    tok = Tokenizer.from_file(small_tok)
    val_stream = np.concatenate([np.fromfile(os.path.join(outs[0], e["path"]), np.uint16)
                                 for e in json.load(open(os.path.join(outs[0], "manifest.json")))["splits"]["val"]["shards"]])
    want_ids = [i for t in texts if _spec_hash(t, 5) <= cut for i in tok.encode(t).ids + [tok.token_to_id("<|endoftext|>")]]
    assert val_stream.tolist() == want_ids  # those documents, in corpus order
    for o in outs[1:]:
        for s in ("train", "val"):
            a = [open(os.path.join(outs[0], e["path"]), "rb").read() for e in json.load(open(os.path.join(outs[0], "manifest.json")))["splits"][s]["shards"]]
            b = [open(os.path.join(o, e["path"]), "rb").read() for e in json.load(open(os.path.join(o, "manifest.json")))["splits"][s]["shards"]]
            assert b"".join(a) == b"".join(b)
    # Two tasks of a partitioned build, merged: the single build's splits.
    base = ["-t", small_tok, "-L", "4", "--val-size", str(N), "--split-seed", "5", "-q", "--unit-size", "2KiB",
            "--shard-size", "1KiB"]
    for t in (0, 1):
        r = CliRunner().invoke(main, ["build", str(tmp_path / "c"), str(tmp_path / "parts"), *base,
                                      "--num-tasks", "2", "--task-index", str(t)])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["merge", str(tmp_path / "parts" / "part-00000"), str(tmp_path / "parts" / "part-00001"),
                                  str(tmp_path / "parts"), "--json"])
    assert r.exit_code == 0, r.output
    merged = json.load(open(tmp_path / "parts" / "manifest.json"))
    assert merged["splits"]["val"]["documents"] == N
    single = json.load(open(os.path.join(outs[0], "manifest.json")))
    assert merged["splits"]["val"]["num_tokens"] == single["splits"]["val"]["num_tokens"]
    # What cannot be: one line each.
    for args, line in ((["--val-size", "300"], "--val-size 300 leaves no document to train on: the corpus has 300"),
                       (["--val-size", "3", "--val-fraction", "0.1"], "give --val-fraction or --val-size, not both"),
                       (["--val-size", "3", "--text-field", "body"], "a.jsonl:1: record has no field 'body' "
                                                                      "(fields: text)")):
        r = CliRunner().invoke(main, ["build", str(tmp_path / "c"), str(tmp_path / "x"), "-t", small_tok, "-L", "4",
                                      *args])
        assert r.exit_code != 0 and line in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "x").exists()
    # A val fraction too small for the corpus: built, with a warning saying so.
    r = CliRunner().invoke(main, ["build", str(tmp_path / "c"), str(tmp_path / "y"), "-t", small_tok, "-L", "4",
                                  "--val-fraction", "0.000001"])
    assert r.exit_code == 0 and "empty val split" in r.output and "give --val-size N for exactly N" in r.output


def test_refuses_non_empty_out_and_finished_dataset(tmp_path, small_tok):
    write(tmp_path / "c" / "a.txt", "hello world " * 50)
    out = tmp_path / "out"
    write(out / "other.txt", "x")
    with pytest.raises(ConfigError, match="which helixtok did not write"):
        build([str(tmp_path / "c")], str(out), small_tok, BuildConfig(seq_len=4, workers=1))
    (out / "other.txt").unlink()
    build([str(tmp_path / "c")], str(out), small_tok, BuildConfig(seq_len=4, workers=1))
    # The same build again is up to date (#30: idempotent tasks); another option is refused.
    assert isinstance(build([str(tmp_path / "c")], str(out), small_tok, BuildConfig(seq_len=4, workers=1)), UpToDate)
    with pytest.raises(ConfigError, match=r"other inputs or options \(seq_len: 4 -> 8\); pass overwrite=True"):
        build([str(tmp_path / "c")], str(out), small_tok, BuildConfig(seq_len=8, workers=1))
    build([str(tmp_path / "c")], str(out), small_tok, BuildConfig(seq_len=8, workers=1), overwrite=True)
    assert json.load(open(out / "manifest.json"))["seq_len"] == 8


def test_too_small_corpus_fails_clearly(tmp_path, small_tok):
    write(tmp_path / "c" / "a.txt", "fox")
    with pytest.raises(InputError, match="lower seq_len"):
        build([str(tmp_path / "c")], str(tmp_path / "o"), small_tok, BuildConfig(seq_len=4096, workers=1))
    assert not os.path.exists(tmp_path / "o" / "manifest.json")


def test_long_document_split_encoding_is_exact(tmp_path, tokenizer_path, dev_docs):
    """A document far above max_piece_chars is encoded in pieces; the ids equal a whole encode."""
    big = "\n".join(dev_docs[:60])  # ~1 MB: a whole-text reference encode costs ~100 bytes per token
    write(tmp_path / "c" / "big.txt", big)
    out = str(tmp_path / "o")
    m = build([str(tmp_path / "c")], out, tokenizer_path, BuildConfig(seq_len=1, workers=1, max_piece_chars=3000))
    tok = Tokenizer.from_file(tokenizer_path)
    want = tok.encode(big, add_special_tokens=False).ids + [m["tokenizer"]["eos_id"]]
    _, chunks = read_split(out)
    assert chunks.reshape(-1).tolist() == want


def test_schedule_puts_costly_units_first_then_corpus_order():
    from helixtok.pipeline.dispatch import schedule
    from helixtok.pipeline.units import Unit

    U = 1000
    units = [Unit(0, "jsonl", ("a",), ("a",), est_bytes=1010), Unit(1, "jsonl", ("a",), ("a",), est_bytes=990),
             Unit(2, "text", ("b",), ("b",), est_bytes=5 * U), Unit(3, "jsonl", ("c",), ("c",), est_bytes=1500),
             Unit(4, "text", ("d",), ("d",), est_bytes=3 * U),
             # a .zst range 12 U into its frame: it decompresses and discards those first (cost ~ 1 + 12/6 U)
             Unit(5, "jsonl.zst", ("e",), ("e",), start=12 * U, stop=13 * U, est_bytes=U, seek=(0, 0)),
             Unit(6, "jsonl", ("f",), ("f",), est_bytes=200)]
    assert [u.index for u in schedule(units[::-1], U)] == [2, 4, 5, 0, 1, 3, 6]
    assert [u.index for u in schedule(units[::-1], U, in_order=True)] == list(range(7))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_build_keeps_no_tokenizer_in_the_callers_process(tmp_path, small_tok, small_corpus, pooled, workers):
    """A notebook that builds keeps none of the build's tokenizers: the one inspect_tokenizer
    handed on for the backend check is dropped even where nothing took it (a pool build with
    tokenizers: the workers encode), as are those of a build that failed."""
    from helixtok.pipeline import tokenizer as ht

    build([str(small_corpus)], str(tmp_path / f"o{workers}"), small_tok,
          BuildConfig(seq_len=64, workers=workers, backend="hf", unit_bytes=1 << 12))  # 7+ units
    assert ht._handed == {}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n' * 3)
    with pytest.raises(InputError, match="bad.jsonl:2"):
        build([str(bad)], str(tmp_path / "bad"), small_tok,
              BuildConfig(seq_len=64, workers=workers, backend="hf", strict=True, unit_bytes=16))
    assert ht._handed == {}


def test_the_same_command_on_a_finished_out_is_up_to_date_and_rewrites_nothing(tmp_path, small_corpus, small_tok):
    """A Slurm requeue or a Ray retry of a finished build or task: exit 0, one line, every file
    untouched (same inode and mtime); a changed input is refused naming it; a damaged dataset is
    not called up to date."""
    from click.testing import CliRunner

    from helixtok.cli import main

    out = tmp_path / "out"
    args = ["build", str(small_corpus), str(out), "-t", small_tok, "-L", "16", "-j", "1", "-q"]
    for extra in ([], ["--num-tasks", "2", "--task-index", "1"]):
        assert CliRunner().invoke(main, args + extra).exit_code == 0
        folder = out / "part-00001" if extra else out
        before = {n: (os.stat(folder / n).st_ino, os.stat(folder / n).st_mtime_ns) for n in os.listdir(folder)}
        r = CliRunner().invoke(main, args + extra)
        assert r.exit_code == 0 and r.output.startswith(f"up to date: {folder} (") and len(r.output.splitlines()) == 1
        assert {n: (os.stat(folder / n).st_ino, os.stat(folder / n).st_mtime_ns) for n in os.listdir(folder)} == before
        r = CliRunner().invoke(main, args + extra + ["--json"])
        assert r.exit_code == 0 and json.loads(r.output)["up_to_date"] is True
    (small_corpus / "h.txt").write_text("a new file")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "other inputs or options (new input h.txt); pass --overwrite" in r.output
    (small_corpus / "h.txt").unlink()
    shard = next(p for p in out.iterdir() if p.suffix == ".bin")
    shard.write_bytes(shard.read_bytes()[:-2])
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and f"{shard.name} is missing or has another size" in r.output


def test_bos_follows_the_tokenizers_own_rule_unless_told(tmp_path, small_tok):
    """Llama 3's tokenizer adds <|begin_of_text|> through its post-processor (what tokenizer(text)
    gives in transformers): by default a build does the same, GPT-2's adds nothing; --bos/--no-bos
    override; the manifest says which rule gave add_bos."""
    from tokenizers import Tokenizer, processors

    spec = Tokenizer.from_file(small_tok)
    spec.add_special_tokens(["<|begin_of_text|>"])
    bos = spec.token_to_id("<|begin_of_text|>")
    spec.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", bos)])
    llama_like = str(tmp_path / "llama_like.json")
    spec.save(llama_like)
    write(tmp_path / "c" / "a.txt", "hello world " * 20)
    write(tmp_path / "c" / "b.txt", "the quick brown fox " * 20)
    got = {}
    for name, tok, add_bos in (("llama", llama_like, None), ("llama-no", llama_like, False), ("gpt2", small_tok, None),
                               ("gpt2-bos", small_tok, True)):
        kw = {} if add_bos is None else {"add_bos": add_bos}
        cfg = BuildConfig(seq_len=4, workers=1, bos_token="<pad>" if name == "gpt2-bos" else None, **kw)
        m = build([str(tmp_path / "c")], str(tmp_path / name), tok, cfg)
        stream = np.fromfile(tmp_path / name / "train-000000-0000.bin", dtype="<u2")
        starts = np.fromfile(tmp_path / name / "train-000000-0000.docs", dtype="<u8")
        got[name] = (m["tokenizer"]["add_bos"], m["tokenizer"]["bos_rule"], stream[starts[starts < len(stream)]])
    assert got["llama"][:2] == (True, "tokenizer") and (got["llama"][2] == bos).all()
    assert got["llama-no"][:2] == (False, "--no-bos") and not (got["llama-no"][2] == bos).any()
    assert got["gpt2"][:2] == (False, "tokenizer")
    pad = Tokenizer.from_file(small_tok).token_to_id("<pad>")
    assert got["gpt2-bos"][:2] == (True, "--bos") and (got["gpt2-bos"][2] == pad).all()


def test_a_workers_progress_is_sent_coalesced_and_complete():
    """A worker reports progress after every batch; it sends at most one message per
    Beat.SEND_SECONDS, and flush() (before each task's answer) sends what was held: the sums
    the parent sees are exact."""
    import io
    import threading

    from helixtok.pipeline import pool

    buf = io.BytesIO()
    beat = pool.Beat(buf, threading.Lock())
    for i in range(5000):
        beat.bump(10, 1, i % 7)
    beat.flush()
    buf.seek(0)
    msgs = []
    while (m := pool._recv(buf)) is not pool._EOF:
        msgs.append(m)
    assert 1 <= len(msgs) <= 5 and all(m[0] == "progress" for m in msgs)
    assert [sum(m[k] for m in msgs) for k in (1, 2, 3)] == [50000, 5000, sum(i % 7 for i in range(5000))]
    beat.flush()  # nothing held: nothing sent
    assert buf.read() == b""


@pytest.mark.parametrize("picked", ["fastokens", "hf"])
@pytest.mark.parametrize("workers", [1, 2])
def test_units_tokenize_while_the_backend_check_runs_and_a_rejected_librarys_units_are_redone(
        tmp_path, small_corpus, small_tok, monkeypatch, picked, workers):
    """Nothing waits for the backend check: units tokenize with the likeliest library meanwhile
    (here the check returns only once a unit is journaled).  If the check picks that library the
    build goes on; if it picks another, every unit is tokenized again with it, and the bytes are
    that library's build's (issue 38: the check ran alone first, ~half of a first 16-core build)."""
    import dataclasses
    import threading

    import helixtok.pipeline.builder as hb

    cfg = BuildConfig(seq_len=16, workers=workers, unit_bytes=1)
    ref = tmp_path / "ref"
    build([str(small_corpus)], str(ref), small_tok, dataclasses.replace(cfg, backend=picked))
    journaled, real = threading.Event(), hb.choose_backend

    def slow_check(info, units, config, ex, **kw):
        got = real(info, units, dataclasses.replace(config, backend=picked), ex, **kw)
        journaled.wait(60)
        return got
    monkeypatch.setattr(hb, "choose_backend", slow_check)
    out = tmp_path / "out"
    m = build([str(small_corpus)], str(out), small_tok, cfg,
              on_progress=lambda p: journaled.set() if p.units_done else None)
    assert journaled.is_set() and m["tokenizer"]["backend"] == picked
    shards = sorted(n for n in os.listdir(ref) if n.endswith((".bin", ".docs")))
    assert sorted(n for n in os.listdir(out) if n.endswith((".bin", ".docs"))) == shards
    assert all((out / n).read_bytes() == (ref / n).read_bytes() for n in shards)
    assert not os.path.exists(out / ".helixtok-partial")


def test_shards_hold_about_the_size_asked_for_whatever_the_unit_size(tmp_path, dev_corpus, tokenizer_path):
    """Issue 40 item 6: every 64 KiB work unit used to be a shard file of its own; the units of a
    shard group are joined into shards of about --shard-size (never over twice it), the same files
    byte for byte on one worker or two, and the dataset reads the same stream as ever."""
    cfg = BuildConfig(seq_len=256, unit_bytes=64 << 10, shard_bytes=256 << 10)
    m1 = build([str(dev_corpus)], str(tmp_path / "j1"), tokenizer_path, dataclasses.replace(cfg, workers=1))
    m2 = build([str(dev_corpus)], str(tmp_path / "j2"), tokenizer_path, dataclasses.replace(cfg, workers=2))
    shards = m1["splits"]["train"]["shards"]
    stream = sum(e["bytes"] for e in shards)
    units = m1["inputs"]["units"]
    assert units >= 30 and len(shards) <= stream // (256 << 10) * 2 + 2 and len(shards) < units // 2
    assert all(e["bytes"] <= 2 * (256 << 10) for e in shards)
    names = sorted(n for n in os.listdir(tmp_path / "j1") if n.endswith((".bin", ".docs")))
    assert names == sorted(n for n in os.listdir(tmp_path / "j2") if n.endswith((".bin", ".docs")))
    assert all((tmp_path / "j1" / n).read_bytes() == (tmp_path / "j2" / n).read_bytes() for n in names)
    assert m1["splits"] == m2["splits"]
    # The stream is the units' streams in order: the one a build of one unit per shard gives.
    m3 = build([str(dev_corpus)], str(tmp_path / "small"), tokenizer_path,
               dataclasses.replace(cfg, workers=2, shard_bytes=1 << 10))
    assert len(m3["splits"]["train"]["shards"]) > units
    assert np.array_equal(read_split(str(tmp_path / "j1"))[1], read_split(str(tmp_path / "small"))[1])
