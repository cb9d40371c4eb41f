"""Every backend builds the same bytes as tokenizers, or is refused with one line: three tokenizer shapes."""

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap
from functools import lru_cache

import numpy as np
import pytest
from conftest import cache_knowing_the_tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from helixtok.format.errors import TokenizerError
from helixtok.pipeline.builder import build
from helixtok.pipeline.config import BuildConfig

LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _texts(dev_corpus):
    return [p.read_text() for p in sorted((dev_corpus / "txt").glob("*.txt"))[:150]]


def llama3_like(texts, path):
    """Split (Llama-3 regex) + ByteLevel BPE, with enough added tokens that ids need uint32."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1500, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    # Pad the vocabulary past 65,536 with pieces no merge produces (as large vocabularies hold
    # tokens a given corpus never uses): ids then need uint32, and the ids stay contiguous.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(65_000):
        vocab[f"<unused_{i}>"] = len(vocab)
    with open(path, "w") as fh:
        json.dump(spec, fh)
    assert Tokenizer.from_file(str(path)).get_vocab_size() > 65_536
    return str(path)


def sentencepiece_like(texts, path, metaspace=False):
    """Llama-2 / Mistral-7B shape: "▁" for spaces by a normalizer (Prepend + Replace, no
    pre-tokenizer), BPE with byte fallback (<0xNN> pieces).  Trained with a Metaspace
    pre-tokenizer (fast), then given the normalizer form the exported tokenizer.json files have;
    metaspace=True keeps the Metaspace pre-tokenizer form."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                     decoders.ByteFallback(), decoders.Fuse()])
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"],
                                                       show_progress=False))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces, as SentencePiece exports them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    if not metaspace:
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
        spec["pre_tokenizer"] = None
        spec["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    with open(path, "w") as fh:
        json.dump(spec, fh)
    return str(path)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory, dev_corpus, tokenizer_path):
    d = tmp_path_factory.mktemp("shapes")
    texts = _texts(dev_corpus)
    return {"gpt2-like": tokenizer_path, "llama3-like (uint32)": llama3_like(texts, d / "llama3.json"),
            "sentencepiece-like": sentencepiece_like(texts, d / "sp.json")}


def _shards(out):
    # build-plan.json records the options, unit cuts included: it differs where they do, as the manifest's options.
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out))
            if n not in ("manifest.json", "build-plan.json")}


def _stream(out):
    """A build's train stream and document starts, whatever its units (each unit writes its own shards)."""
    from helixtok.read.splitview import SplitView

    v = SplitView(str(out), json.load(open(os.path.join(out, "manifest.json"))))
    ids = np.concatenate(list(v.iter_stream()))
    return ids.tolist(), v.starts_in(0, len(ids)).tolist()


def _build_with_each_backend(corpus: list[str], shapes: dict, special: str, root: str) -> dict:
    """{(shape, backend): (manifest or the refusal's message, {shard: sha256})} for tokenizers,
    each fast backend forced, and auto.  Run in a child process: fifteen builds in pytest's own
    leave ~400 MB of heap it never gives back."""
    import hashlib

    got = {}
    for shape, tok in shapes.items():
        for backend in ("hf", "fastokens", "gigatoken", "tiktoken", "auto"):
            out = os.path.join(root, shape, backend)
            try:
                m = build(corpus, out, tok, BuildConfig(seq_len=256, workers=2, special_tokens=special, backend=backend))
            except TokenizerError as e:
                got[shape, backend] = (str(e), {})
                continue
            got[shape, backend] = (m, {n: hashlib.sha256(b).hexdigest() for n, b in _shards(out).items()})
    return got


def test_every_backend_gives_tokenizers_bytes_or_is_refused(tmp_path, dev_corpus, shapes):
    """Both special-token policies, each in a process of its own, side by side: most of the time
    goes to the long hostile inputs (1 MiB each) the check encodes for every new tokenizer."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    lines, size = [], 0
    for line in open(dev_corpus / "jsonl" / "plain.jsonl", encoding="utf-8"):  # ~300 KB of its documents
        lines.append(line)
        size += len(line)
        if size > 300_000:
            break
    (tmp_path / "c.jsonl").write_text("".join(lines), encoding="utf-8")
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as ex:
        runs = {special: ex.submit(_build_with_each_backend, [str(tmp_path / "c.jsonl")], shapes, special,
                                   str(tmp_path / special)) for special in ("text", "extract")}
        for special, run in runs.items():
            _assert_every_backend(run.result(), shapes, special)


def _assert_every_backend(got: dict, shapes: dict, special: str) -> None:
    table = {}
    for shape in shapes:
        ref, want = got[shape, "hf"]
        assert want and ref["dtype"] == ("uint32" if shape.startswith("llama3") else "uint16")
        for backend in ("fastokens", "gigatoken", "tiktoken", "auto"):
            m, shards = got[shape, backend]
            if isinstance(m, str):
                assert backend != "auto" and f"backend {backend} is not exact for this tokenizer" in m
                table[shape, backend] = "refused: " + m.split("(", 1)[1][:50]
                continue
            assert shards == want, (special, shape, backend)  # byte-identical to tokenizers
            assert m["totals"] == ref["totals"]
            assert backend == "auto" or m["tokenizer"]["backend"] == backend
            table[shape, backend] = "identical" if backend != "auto" else m["tokenizer"]["backend"]
    print(special, table)
    # fastokens is exact on all three shapes, so auto uses it for all of them.
    assert all(table[s, "fastokens"] == "identical" and table[s, "auto"] == "fastokens" for s in shapes), table
    # tiktoken mirrors only GPT-2-style byte-level BPE.
    assert table["gpt2-like", "tiktoken"] == "identical"
    assert all(table[s, "tiktoken"].startswith("refused") for s in shapes if s != "gpt2-like")


def test_the_tokenizer_inspect_loaded_is_handed_on_once_and_a_replaced_file_is_never_loaded(tmp_path, small_tok):
    """inspect_tokenizer's Tokenizer saves the backend check a second load; it is taken by one
    caller only (hf_tokenizer sets options on it).  Every later load is of the bytes inspect read
    (held by their sha256): a file replaced meanwhile is never loaded.  (Form changed with the
    loads by sha256: a file replaced after the inspection used to be loaded afresh.)"""
    import shutil

    from helixtok.format.errors import TokenizerError
    from helixtok.pipeline.tokenizer import inspect_tokenizer, load_held, release_bytes

    own = tmp_path / "own.json"  # bytes no other test holds (held bytes are shared by sha256)
    own.write_bytes(open(small_tok, "rb").read() + b"\n  \n")  # trailing whitespace: the same tokenizer
    small_tok = str(own)
    info = inspect_tokenizer(small_tok)
    a, b = load_held(info.sha256), load_held(info.sha256)
    assert a is not b and a.get_vocab() == b.get_vocab()
    vocab = a.get_vocab()
    other = tmp_path / "other.json"
    Tokenizer(models.WordLevel({"x": 0, "<|endoftext|>": 1}, unk_token="x")).save(str(other))
    info = inspect_tokenizer(small_tok)
    shutil.copyfile(other, small_tok)  # replaced between the inspection and the load
    assert load_held(info.sha256).get_vocab() == vocab
    release_bytes(info.sha256)
    release_bytes(info.sha256)
    with pytest.raises(TokenizerError, match="its bytes were not handed to this process"):
        load_held(info.sha256)


def test_workers_load_the_likely_backend_early_and_drop_it_when_another_is_chosen(shapes):
    """Pool workers load fastokens' tokenizer while the main process checks backends; the Encoder
    reuses it when fastokens is chosen, and it is freed when another backend is."""

    from helixtok.pipeline import backends
    from helixtok.pipeline import unit as hb
    from helixtok.pipeline.tokenizer import inspect_tokenizer

    tok = shapes["llama3-like (uint32)"]
    info = inspect_tokenizer(tok)
    saved = dict(hb._here.__dict__)

    def fresh_worker():
        backends._fast_tokenizer.cache_clear()
        hb.end_worker()
        hb._here.worker = hb.Worker(BuildConfig(), "", "", None)
        hb.prepare_worker(open(tok, "rb").read(), "fastokens")
    try:
        fresh_worker()
        loaded = backends._fast_tokenizer("fastokens", info.sha256)
        fast = dataclasses.replace(info, backend="fastokens", backend_version="x")
        assert any(c.cell_contents is loaded
                   for c in hb._encoder(hb._here.worker, fast)._encode.__closure__)  # the one preloaded
        fresh_worker()  # another worker, where the check chose tokenizers
        hb._encoder(hb._here.worker, dataclasses.replace(info, backend="hf", backend_version="y"))
        assert backends._fast_tokenizer.cache_info().currsize == 0
    finally:
        hb.end_worker()
        hb._here.__dict__.update(saved)


def test_a_pool_build_checks_the_backend_in_a_worker(tmp_path, dev_corpus, shapes, monkeypatch, pooled):
    """With worker processes the main process never loads the fast library's tokenizer, even
    where no verdict on the long inputs is cached: a worker sends its ids of the corpus sample
    and digests of its ids of the long inputs, compared here with tokenizers'.  The choice and
    the bytes are those of a build that checked everything itself."""
    from helixtok.pipeline import backends

    lines = open(dev_corpus / "jsonl" / "plain.jsonl").read().split()
    short = tmp_path / "short.jsonl"  # many short documents: the corpus sample is hundreds of texts
    short.write_text("".join(json.dumps({"text": " ".join(lines[i: i + 30])}) + "\n" for i in range(0, len(lines), 30)))
    corpus = [str(dev_corpus / "jsonl" / "plain.jsonl"), str(short)]
    tok = shapes["llama3-like (uint32)"]
    here = build(corpus, str(tmp_path / "inline"), tok, BuildConfig(seq_len=256, workers=1, unit_bytes=1 << 16))
    loads, real = [], backends._fast_tokenizer

    def counted(*key):
        loads.append(key)
        return real(*key)
    counted.cache_clear = real.cache_clear
    monkeypatch.setattr(backends, "_fast_tokenizer", counted)  # in this process only: workers are spawned
    batches, longest, hf_tokenizer = [], [], backends.hf_tokenizer

    class Counted:  # tokenizers' Encodings take ~100 bytes a character: never the whole sample at once
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def encode_batch_fast(self, texts, **kw):
            batches.append(len(texts))
            longest.append(max(map(len, texts)))
            return self.tok.encode_batch_fast(texts, **kw)
    monkeypatch.setattr(backends, "hf_tokenizer", lambda sha, special: Counted(hf_tokenizer(sha, special)))
    monkeypatch.setenv("HELIXTOK_CACHE", str(tmp_path / "fresh-cache"))  # nothing known about the long inputs
    pool = build(corpus, str(tmp_path / "pool"), tok, BuildConfig(seq_len=256, workers=2, unit_bytes=1 << 16))
    assert len(os.listdir(tmp_path / "fresh-cache" / "parity")) == 1  # the verdict, judged from the worker's digests
    assert pool["inputs"]["units"] > 2 and loads == []
    assert sum(batches) > 64 and max(batches) <= 64
    # tokenizers' ids of the 1 MiB inputs (~400 bytes a character) were made in a worker too
    assert max(longest) < 40_000
    assert pool["tokenizer"]["backend"] == here["tokenizer"]["backend"] == "fastokens"
    assert pool["tokenizer"]["backend_check"]["sample_documents"] == here["tokenizer"]["backend_check"][
        "sample_documents"] > 0
    assert _shards(tmp_path / "pool") == _shards(tmp_path / "inline")


def test_an_inline_build_tokenizes_with_the_library_its_check_loaded(tmp_path, dev_corpus, shapes, monkeypatch):
    """Without worker processes the backend check and the encoder share one loaded tokenizer,
    whichever fast library is chosen (only a tokenizer a worker preloaded for nothing is freed),
    until the build ends."""
    from helixtok.pipeline import backends

    loads, real = [], backends._fast_tokenizer

    def counted(*key):
        loads.append(key[0])
        return real(*key)
    counted.cache_clear = real.cache_clear
    backends._fast_tokenizer.cache_clear()
    monkeypatch.setattr(backends, "_fast_tokenizer", lru_cache(maxsize=2)(counted))
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.setenv("FASTOKENS_BPE_THREADS", "4")
    corpus = [str(dev_corpus / "jsonl" / "plain.jsonl")]
    m = build(corpus, str(tmp_path / "out"), shapes["gpt2-like"],
              BuildConfig(seq_len=256, workers=1, backend="gigatoken", special_tokens="extract"))
    assert m["tokenizer"]["backend"] == "gigatoken" and loads == ["gigatoken"]
    # ... and freed when build() returns: a notebook that builds keeps no tokenizer (~100 MB for
    # a 100k vocabulary) alive, in the encoder or the cache; nor its one-core settings, which
    # would slow the notebook's own tokenizers.
    from helixtok.pipeline import unit as hu
    assert real.cache_info().currsize == 0 and hu._here.__dict__ == {}
    assert [os.environ.get(k) for k in hu.THREAD_ENV] == [None, "4"]


def test_an_inline_build_loads_the_likely_library_ahead_and_a_failure_meanwhile_exits_cleanly(
        tmp_path, dev_corpus, shapes, monkeypatch):
    """A build that tokenizes in its own process starts loading fastokens' tokenizer in a thread
    before it inspects the tokenizer (the load releases the GIL): loaded once, in that thread, and
    used.  A build that fails while the load runs exits with its one-line error: it waits for the
    load, since a thread stopped at exit inside the library aborts the process."""
    import threading

    import fastokens

    from helixtok.pipeline import backends, preload

    where, real = [], fastokens.Tokenizer

    class Counted:  # every load, wherever it happens
        @staticmethod
        def from_json_str(text, *a, **kw):  # (form: the bytes read once are loaded, not the file)
            where.append(threading.current_thread().name)
            return real.from_json_str(text, *a, **kw)
    backends._fast_tokenizer.cache_clear()
    monkeypatch.setattr(fastokens, "Tokenizer", Counted)
    corpus = str(tmp_path / "c.txt")  # what is tested happens before any tokenizing
    with open(dev_corpus / "txt" / sorted(os.listdir(dev_corpus / "txt"))[0], encoding="utf-8") as fh:
        open(corpus, "w", encoding="utf-8").write(fh.read(20_000))
    tok = shapes["llama3-like (uint32)"]
    m = build([corpus], str(tmp_path / "out"), tok, BuildConfig(seq_len=256, workers=1))
    assert m["tokenizer"]["backend"] == "fastokens" and where == ["helixtok-preload"]  # the check's and the encoder's

    with pytest.raises(TokenizerError, match="eos token 'nope' is not in the vocabulary"):
        build([corpus], str(tmp_path / "bad"), tok, BuildConfig(seq_len=256, workers=1, eos_token="nope"))
    assert where[1:] == ["helixtok-preload"]  # refused while it loaded ...
    assert not [t for t in threading.enumerate() if t.name == "helixtok-preload"] and preload._early == {}  # ... ended
    p = subprocess.run([sys.executable, "-m", "helixtok.cli", "build", corpus, str(tmp_path / "bad"), "-t", tok,
                        "-j", "1", "-q", "--eos-token", "nope"], capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.splitlines() == [f"Error: {tok}: eos token 'nope' is not in the vocabulary"]
    assert not (tmp_path / "bad").exists()


def test_a_backend_wrong_only_on_a_long_input_is_refused_and_the_references_are_cached(tmp_path, small_tok,
                                                                                      monkeypatch):
    """The long hostile inputs are checked against digests of tokenizers' ids, computed once per
    tokenizer file (in a child process: never in the build's own) and reused for every backend
    and build; a changed file is checked again."""
    from helixtok.pipeline import backends

    monkeypatch.setenv("HELIXTOK_CACHE", str(tmp_path / "cache"))
    real_encoder, real_hf_ids = backends.flat_encoder, backends.hf_ids
    long_hf = []

    def off_on_long_x(name, *args):
        encode, ver, why = real_encoder(name, *args)
        if name != "fastokens" or encode is None:
            return encode, ver, why

        def wrong(texts):
            ids, lens = encode(texts)
            if texts == ["x" * (1 << 20)]:
                ids = ids.copy()
                ids[-1] += 1
            return ids, lens
        return wrong, ver, why

    def counted(tok, texts, group=None):
        long_hf.extend(len(t) for t in texts if len(t) >= 40_000)
        return real_hf_ids(tok, texts, group)
    monkeypatch.setattr(backends, "flat_encoder", off_on_long_x)
    # The long inputs are encoded in a child process: it gets the same fault.
    fault = inspect.getsource(off_on_long_x)
    monkeypatch.setattr(backends, "_LONG_CHILD", "import helixtok.pipeline.backends as b\nreal_encoder = b.flat_encoder\n"
                        + textwrap.dedent(fault) + "b.flat_encoder = off_on_long_x\n" + backends._LONG_CHILD)
    monkeypatch.setattr(backends, "hf_ids", counted)
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 50)
    cfg = dict(seq_len=8, workers=1, special_tokens="extract")  # where gigatoken is exact too
    with pytest.raises(TokenizerError, match=r"backend fastokens is not exact for this tokenizer \(ids differ on 'xxxx"):
        build([str(corpus)], str(tmp_path / "o1"), small_tok, BuildConfig(backend="fastokens", **cfg))
    def made():
        d = tmp_path / "cache" / "hf-ids"
        return {n: os.stat(d / n).st_ino for n in os.listdir(d)}  # a new inode when written again
    first = made()
    assert len(first) == 1 and long_hf == []  # tokenizers' ids of the long inputs, once, in a child
    m = build([str(corpus)], str(tmp_path / "o2"), small_tok, BuildConfig(**cfg))
    assert m["tokenizer"]["backend"] == "gigatoken"
    assert m["tokenizer"]["backend_check"]["rejected"]["fastokens"].startswith("ids differ on 'xxxx")
    assert made() == first  # the next backends compared with the same digests
    with open(small_tok) as fh:
        spec = json.load(fh)
    with open(small_tok, "w") as fh:  # other bytes (the same tokenizer): no verdict or digest applies
        json.dump(spec, fh, indent=1)
    with pytest.raises(TokenizerError, match="ids differ on 'xxxx"):
        build([str(corpus)], str(tmp_path / "o3"), small_tok, BuildConfig(backend="fastokens", **cfg))
    assert len(made()) == 2 and long_hf == []
    # A child that fails (no memory, say): the digests are made in this process instead.
    monkeypatch.setattr(backends, "_LONG_CHILD", "raise SystemExit(3)")
    with open(small_tok, "w") as fh:
        json.dump(spec, fh, indent=2)
    with pytest.raises(TokenizerError, match="ids differ on 'xxxx"):
        build([str(corpus)], str(tmp_path / "o4"), small_tok, BuildConfig(backend="fastokens", **cfg))
    assert len(made()) == 3 and len(long_hf) == len(backends.LONG_HOSTILE)


def test_a_rebuild_of_the_same_corpus_takes_the_cached_verdict_and_writes_the_same_manifest(
        tmp_path, dev_corpus, small_tok, monkeypatch):
    """The check's verdict on the same parity texts (same tokenizer file, policy, library version
    and corpus sample) is cached: a rerun, a resumed build or another task of the corpus encodes
    nothing for the check, and its manifest (backend_check included) is the checked build's.  A
    changed sample, or a damaged entry, is checked again."""
    from helixtok.pipeline import backends

    monkeypatch.setenv("HELIXTOK_CACHE", cache_knowing_the_tokenizers(tmp_path / "cache"))
    checked, real = [], backends.hf_answers

    def hf_answers(tok, texts, stop=None):  # tokenizers' side of the check: computed only when checking
        checked.append("hf_answers")
        return real(tok, texts, stop)
    monkeypatch.setattr(backends, "hf_answers", hf_answers)
    corpus = [str(dev_corpus / "jsonl" / "plain.jsonl")]
    cfg = BuildConfig(seq_len=64, workers=1, unit_bytes=1 << 18, val_fraction=0.1)

    def manifest(name, corpus=corpus):
        checked.clear()
        build(corpus, str(tmp_path / name), small_tok, cfg)
        return open(tmp_path / name / "manifest.json", "rb").read()

    first = manifest("a")
    assert checked == ["hf_answers"] and b'"chosen": "fastokens"' in first
    verdicts = os.listdir(tmp_path / "cache" / "verdict")
    assert len(verdicts) == 1
    assert manifest("b") == first and checked == []  # taken from the cache: the same bytes
    for damage in ("", '{"value": {"ok": true, "why": ""}, "sha256": "0"}'):
        (tmp_path / "cache" / "verdict" / verdicts[0]).write_text(damage)
        assert manifest(f"damaged{len(damage)}") == first and checked == ["hf_answers"]  # checked again
    other = tmp_path / "other.jsonl"  # another sample: another verdict
    other.write_text("".join(json.dumps({"text": json.loads(line)["text"][::-1]}) + "\n" for line in open(corpus[0])))
    manifest("other", [str(other)])
    assert checked == ["hf_answers"] and len(os.listdir(tmp_path / "cache" / "verdict")) == 2


def test_a_damaged_or_foreign_verdict_cache_entry_is_ignored_and_removed(tmp_path, monkeypatch):
    """Cached verdicts carry the sha256 of their value: a torn or edited entry (an unsealed
    {"ok": true} included) is never believed; and they are kept per reference tokenizers release."""
    from helixtok.pipeline import backends

    monkeypatch.setenv("HELIXTOK_CACHE", str(tmp_path / "cache"))
    key = ("fastokens", "fastokens 9", "ab" * 32, "text")
    path = backends._long_parity_file(*key)
    backends.long_parity(*key, ["x"], ["y"])  # a refusal, cached
    assert backends.cached_long_parity(*key) == (False, f"ids differ on {backends.LONG_HOSTILE[0][:40]!r}")
    for damage in ('{"ok": true, "why": ""}', open(path).read().replace("false", "true"), open(path).read()[:-9], ""):
        with open(path, "w") as fh:
            fh.write(damage)
        assert backends.cached_long_parity(*key) is None and not os.path.exists(path), damage
        backends.long_parity(*key, ["x"], ["y"])
    monkeypatch.setattr(backends, "reference_version", lambda: "tokenizers 0.0.1")
    assert backends._long_parity_file(*key) != path and backends.cached_long_parity(*key) is None


def test_the_long_input_processes_of_a_refused_backend_are_stopped(tmp_path, small_tok, monkeypatch):
    """A backend refused on the sample has no use for its digests of the long inputs, nor the
    build for tokenizers': the processes making them are killed, not left to take cores from
    the build (or from the next backend's check) for seconds."""
    from helixtok.pipeline import backends, children

    monkeypatch.setenv("HELIXTOK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(backends, "_LONG_CHILD", "import time\ntime.sleep(60)\n" + backends._LONG_CHILD)
    started, real = [], children.start_helper
    monkeypatch.setattr(children, "start_helper", lambda *a, **k: started.append(real(*a, **k)) or started[-1])
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox <|endoftext|> jumps over the lazy dog " * 50)
    cfg = BuildConfig(seq_len=8, workers=1, special_tokens="text", backend="gigatoken")  # inexact there
    with pytest.raises(TokenizerError, match="backend gigatoken is not exact for this tokenizer"):
        build([str(corpus)], str(tmp_path / "o"), small_tok, cfg)
    assert len(started) == 2 and [p.returncode for p in started] == [-9, -9]  # tokenizers' and gigatoken's

    # --backend auto: fastokens (made wrong on the sample) is refused, and its process is gone
    # before the next backend's starts; that one and tokenizers' answer at once, alike.
    monkeypatch.setattr(backends, "_LONG_CHILD", "import json, sys, time\nif sys.argv[1] == 'fastokens':\n"
                        "    time.sleep(60)\nprint(json.dumps(['d'] * 7))\n")
    real_encoder = backends.flat_encoder

    def wrong_fastokens(name, *args):
        encode, ver, why = real_encoder(name, *args)
        if name == "fastokens" and encode is not None:
            def off_by_one(texts):
                ids, lens = encode(texts)
                return ids + 1, lens
            return off_by_one, ver, why
        return encode, ver, why
    monkeypatch.setattr(backends, "flat_encoder", wrong_fastokens)
    alive_at_start = []
    monkeypatch.setattr(children, "start_helper", lambda *a, **k: alive_at_start.append(
        [p.poll() is None for p in started]) or started.append(real(*a, **k)) or started[-1])
    started.clear()
    m = build([str(corpus)], str(tmp_path / "o2"), small_tok, dataclasses.replace(
        cfg, backend="auto", special_tokens="extract"))
    assert m["tokenizer"]["backend"] == "gigatoken" and "fastokens" in m["tokenizer"]["backend_check"]["rejected"]
    # Started: tokenizers', fastokens' and gigatoken's children; fastokens' (asleep) was killed
    # before gigatoken's began.
    assert len(started) == 3 and alive_at_start[2][1] is False and started[1].returncode == -9


def test_the_check_refuses_a_backend_that_answers_for_fewer_texts(small_tok):
    """Ids and lengths that cover only some of the texts are refused, not compared as a prefix."""
    from helixtok.pipeline import backends

    from helixtok.pipeline.tokenizer import hold_bytes

    sha = hold_bytes(open(small_tok, "rb").read())
    tok = backends.hf_tokenizer(sha, "text")
    texts = ["hello world", "the quick brown fox", "pack me"]
    encode, ver, _ = backends.flat_encoder("fastokens", sha, "text", tok)
    ids, lens = encode(texts)
    want = (backends.hf_answers(tok, texts), None)
    # Judged as tiktoken's answers: those are not checked on the long inputs.
    for got in ((ids[: lens[0]], lens[:1]), (ids[:-1], lens)):  # one text answered; one id missing
        ok, why = backends.judge("tiktoken", ver, "sha", "text", texts, (got, None), want)
        assert not ok and why.startswith("gave ")
    assert backends.judge("tiktoken", ver, "sha", "text", texts, ((ids, lens), None), want) == (True, "")
    # The first text whose ids differ is named: one id changed, or the same ids cut otherwise.
    wrong = ids.copy()
    wrong[lens[0]] += 1
    assert backends.judge("tiktoken", ver, "sha", "text", texts, ((wrong, lens), None), want) == (
        False, "ids differ on 'the quick brown fox'")
    moved = lens.copy()
    moved[1] -= 1
    moved[2] += 1
    assert backends.judge("tiktoken", ver, "sha", "text", texts, ((ids, moved), None), want) == (
        False, "ids differ on 'the quick brown fox'")


def test_the_command_line_loads_fastokens_while_it_imports_and_the_build_takes_that_load(
        tmp_path, dev_corpus, shapes, monkeypatch):
    """`helixtok build` starts loading fastokens' tokenizer before it imports numpy and the rest
    (preload.speculate) when the build will likely tokenize in its own process: loaded once, in
    that thread, and used.  A wrong guess (the build starts workers after all) and a build that
    fails while the load runs leave nothing loaded, and the bytes are a library build's."""
    import threading

    import fastokens
    from click.testing import CliRunner

    from helixtok.cli import main
    from helixtok.pipeline import backends, preload

    real, where = fastokens.Tokenizer, []

    class Counted:
        @staticmethod
        def from_json_str(text, *a, **kw):  # (form: the bytes read once are loaded, not the file)
            where.append(threading.current_thread().name)
            return real.from_json_str(text, *a, **kw)
    monkeypatch.setattr(fastokens, "Tokenizer", Counted)
    corpus = str(tmp_path / "c.jsonl")  # 40 KB in lines: several units at --unit-size 8KiB
    with open(dev_corpus / "txt" / sorted(os.listdir(dev_corpus / "txt"))[0], encoding="utf-8") as fh:
        text = (fh.read(40_000) * 40)[:40_000]
    open(corpus, "w").write("".join(json.dumps({"text": text[i: i + 2000]}) + "\n" for i in range(0, len(text), 2000)))
    tok = shapes["llama3-like (uint32)"]
    backends._fast_tokenizer.cache_clear()

    def cli(out, *extra):
        return CliRunner().invoke(main, ["build", corpus, str(tmp_path / out), "-t", tok, "-L", "256", "-q",
                                         "--json", *extra])
    r = cli("cli", "-j", "2")
    assert r.exit_code == 0, r.output
    assert where == ["helixtok-preload"] and preload._early == {}
    assert backends._fast_tokenizer.cache_info().currsize == 0  # freed when the build ended
    build([corpus], str(tmp_path / "lib"), tok, BuildConfig(seq_len=256, workers=1))
    assert _shards(tmp_path / "cli") == _shards(tmp_path / "lib")

    # A wrong guess: loaded for nothing, dropped; the workers load their own.
    from helixtok.pipeline import builder as hb

    where.clear()
    pools, pool_cls = [], hb.UnitPool
    monkeypatch.setattr(hb, "UnitPool", lambda n, *a, **kw: pools.append(n) or pool_cls(n, *a, **kw))
    monkeypatch.setattr(preload, "_fits_one_process", lambda corpus: True)
    monkeypatch.setenv("HELIXTOK_WORKER_BYTES", "8192")
    r = cli("pool", "-j", "2", "--unit-size", "8KiB")
    assert r.exit_code == 0, r.output
    assert pools == [2]
    assert json.loads(r.output)["totals"] == json.loads(open(tmp_path / "lib" / "manifest.json").read())["totals"]
    assert where == ["helixtok-preload"] and preload._early == {}
    assert backends._fast_tokenizer.cache_info().currsize == 0
    # (cut into other units: the same stream and document starts, in other shards; format 2)
    assert _stream(tmp_path / "pool") == _stream(tmp_path / "lib")

    # Too much input for one process, or not fastokens: no load is started.
    where.clear()
    monkeypatch.undo()
    monkeypatch.setattr(fastokens, "Tokenizer", Counted)
    monkeypatch.setattr(preload, "start", lambda path: where.append("guessed"))
    monkeypatch.setenv("HELIXTOK_WORKER_BYTES", str(os.path.getsize(corpus)))  # one process's share
    assert preload._fits_one_process([corpus]) and not preload._fits_one_process([corpus, corpus])
    preload.speculate([corpus, corpus], tok, 2, "auto")
    preload.speculate([corpus], tok, 2, "hf")
    preload.speculate([corpus], str(tmp_path / "missing.json"), 1, "auto")
    assert where == []
    preload.speculate([corpus, corpus], tok, 1, "auto")  # --workers 1: always tokenizes in its own process
    assert where == ["guessed"]
    monkeypatch.undo()

    # A build failing while the load runs says so in one line and leaves no load behind.
    r = cli("bad", "-j", "1", "--eos-token", "nope")
    assert r.exit_code == 1 and "eos token 'nope' is not in the vocabulary" in r.output
    assert preload._early == {} and backends._fast_tokenizer.cache_info().currsize == 0
    # The overlap is real only while the command line's own imports leave numpy out.
    p = subprocess.run([sys.executable, "-c", "import sys, helixtok.cli; print('numpy' in sys.modules)"],
                       capture_output=True, text=True)
    assert p.stdout.strip() == "False", p.stderr


def test_a_build_whose_check_rejected_fastokens_resumes(tmp_path, small_corpus, small_tok, monkeypatch):
    """fastokens (made wrong) is rejected by the check, the build goes on with the library it picked,
    and is interrupted: the same command resumes with that library (it refused for ever: 'holds an
    unfinished build with other inputs or options (backend: ... -> 'fastokens')'), reuses what it
    had, and gives the uninterrupted build's dataset."""
    import helixtok.pipeline.dispatch as hdisp
    from helixtok.pipeline import backends

    real_encoder = backends.flat_encoder

    def wrong_fastokens(name, *args):
        encode, ver, why = real_encoder(name, *args)
        if name == "fastokens" and encode is not None:
            return (lambda texts: (lambda r: (r[0] + 1, r[1]))(encode(texts))), ver, why
        return encode, ver, why
    monkeypatch.setattr(backends, "flat_encoder", wrong_fastokens)
    monkeypatch.setenv("HELIXTOK_CACHE", str(tmp_path / "cache"))
    cfg = BuildConfig(seq_len=16, workers=1, unit_bytes=1)
    ref = build([str(small_corpus)], str(tmp_path / "ref"), small_tok, cfg)
    assert ref["tokenizer"]["backend"] != "fastokens" and "fastokens" in ref["tokenizer"]["backend_check"]["rejected"]
    real_run, seen = hdisp.run_unit, []

    def stop_after_two(unit, info, *where):  # two units with the picked library, then Ctrl-C
        if info.backend != "fastokens":
            if len(seen) == 2:
                raise KeyboardInterrupt
            seen.append(unit.index)
        return real_run(unit, info, *where)
    monkeypatch.setattr(hdisp, "run_unit", stop_after_two)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        build([str(small_corpus)], str(out), small_tok, cfg)
    monkeypatch.setattr(hdisp, "run_unit", real_run)
    m = build([str(small_corpus)], str(out), small_tok, cfg)
    assert m.reused_units == 2 and m["tokenizer"]["backend"] == ref["tokenizer"]["backend"]
    for n in sorted(os.listdir(tmp_path / "ref")):
        assert (out / n).read_bytes() == (tmp_path / "ref" / n).read_bytes(), n


def _post_processed(tmp_path, name, post_processor, model="BPE"):
    """A small tokenizer with the given post-processor (and model kind), as a tokenizer.json."""
    from tokenizers import AddedToken, processors

    if model == "WordPiece":
        tok = Tokenizer(models.WordPiece({"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "a": 5},
                                         unk_token="[UNK]"))
    elif model == "Unigram":
        tok = Tokenizer(models.Unigram([("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0), ("a", -1.0), ("hello", -2.0),
                                        ("world", -2.0), (" ", -3.0)], unk_id=0, byte_fallback=False))
    else:
        tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "a": 5},
                                         unk_token="<unk>"))
    from tokenizers import pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = ["[CLS]", "[SEP]"] if model == "WordPiece" else ["<s>", "</s>"]
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.add_tokens(["<extra>"])  # an added token that is not special
    if post_processor is not None:
        tok.post_processor = post_processor(processors, tok)
    p = tmp_path / f"{name}.json"
    tok.save(str(p))
    return str(p)


def test_the_tokenizer_read_from_its_json_is_what_tokenizers_loads(tmp_path, shapes, small_tok, dev_docs):
    """Issue 58.1: a build inspects its tokenizer from the JSON (vocabulary, added and special
    tokens, the post-processor's BOS) without loading it into tokenizers: the TokenizerInfo equals
    the one tokenizers' load gives for every tokenizer the suite has -- published Qwen, byte-level,
    Llama-3-like, SentencePiece-like, WordPiece with BertProcessing, Unigram, RobertaProcessing,
    templates with a BOS, an EOS after, two specials before -- and the cut rule the encoder probes
    when a long document first needs it is the one tokenizers' probes give."""
    from test_chat import QWEN, llama_style_tokenizer

    from helixtok.pipeline.encode import Encoder
    from helixtok.pipeline.tokenizer import _splits_exactly, from_json, inspect_tokenizer, tokenizer_from_bytes

    toks = {**shapes, "small": small_tok, "qwen (published)": str(QWEN / "tokenizer.json"),
            "llama-style chat": str(llama_style_tokenizer(tmp_path / "ll", dev_docs[:50]) / "tokenizer.json"),
            "bert": _post_processed(tmp_path, "bert", lambda p, t: p.BertProcessing(("[SEP]", 2), ("[CLS]", 1)),
                                    "WordPiece"),
            "roberta": _post_processed(tmp_path, "roberta", lambda p, t: p.RobertaProcessing(("</s>", 2), ("<s>", 1))),
            "unigram": _post_processed(tmp_path, "unigram", None, "Unigram"),
            "bos": _post_processed(tmp_path, "bos", lambda p, t: p.TemplateProcessing(single="<s> $A", special_tokens=[
                ("<s>", 1)])),
            "bos+eos": _post_processed(tmp_path, "bose", lambda p, t: p.Sequence([p.ByteLevel(), p.TemplateProcessing(
                single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])])),
            "eos after": _post_processed(tmp_path, "eos", lambda p, t: p.TemplateProcessing(
                single="$A </s>", special_tokens=[("</s>", 2)])),
            "two before": _post_processed(tmp_path, "two", lambda p, t: p.TemplateProcessing(
                single="<s> </s> $A", special_tokens=[("<s>", 1), ("</s>", 2)]))}
    leads = {}
    for name, path in toks.items():
        data = open(path, "rb").read()
        assert from_json(data) is not None, name  # read from the file, not loaded
        for add_bos in (None, False):
            kw = dict(add_bos=add_bos, eos_token=None if name not in ("bos", "eos after", "two before", "roberta",
                                                                      "unigram", "bos+eos") else "</s>")
            a = inspect_tokenizer(path, via="json", **kw)
            b = inspect_tokenizer(path, via="tokenizers", **kw)
            assert a.splittable is None and b.splittable is not None
            assert dataclasses.replace(a, splittable=b.splittable) == b, name
            if add_bos is None:
                leads[name] = a.bos_token if a.add_bos else None
        enc = Encoder(dataclasses.replace(a, backend="hf"), max_piece_chars=1 << 20)
        assert enc.splittable == _splits_exactly(tokenizer_from_bytes(data, path)), name
    assert leads["bos"] == leads["bos+eos"] == "<s>" and leads["bert"] == "[CLS]" and leads["roberta"] == "<s>"
    assert leads["eos after"] is None and leads["two before"] is None and leads["llama-style chat"] is None
    # What the JSON cannot tell is loaded: an unknown post-processor, a model kind it does not read.
    spec = json.loads(open(toks["bos"]).read())
    spec["post_processor"] = {"type": "SomethingNew"}
    assert from_json(json.dumps(spec).encode()) is None
    assert from_json(b"not json") is None
