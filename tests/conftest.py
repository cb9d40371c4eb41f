"""Shared fixtures: a corpus and a tokenizer made here, the corpus read independently, and built datasets.

Everything is self-contained: `dev_corpus` is real text written from Python's own standard
library.  Tests marked with `shared_dev` use the larger ../shared/corpus/dev and skip without it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import gzip
import json
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest


def _children_get_ctrl_c() -> None:
    """A suite started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored, and
    so would every process a test starts: helixtok keeps an inherited ignore (as nohup asks), so the
    tests that press Ctrl-C on a build would see it go on.  A handler here makes the children start
    with SIGINT at its default, as from a terminal."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_children_get_ctrl_c()


def _few_malloc_arenas() -> None:
    """This one process runs hundreds of builds, each with threads of its own (assembly, hashing,
    loads, the check); glibc gives threads malloc arenas of their own, and the pages freed in
    them stay resident: with two arenas the suite's peak is ~1.2 GiB instead of ~1.47 (measured
    2026-12-04).  A setting of the test process, made before any thread starts; not glibc: none."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-8, 2)  # M_ARENA_MAX


_few_malloc_arenas()

# Backend parity verdicts and seek indexes are cached per user; the tests keep theirs to this
# run, in a folder removed when it ends.
if "HELIXTOK_CACHE" not in os.environ:
    os.environ["HELIXTOK_CACHE"] = tempfile.mkdtemp(prefix="helixtok-test-cache-")
    atexit.register(shutil.rmtree, os.environ["HELIXTOK_CACHE"], ignore_errors=True)


def cache_knowing_the_tokenizers(folder: Path) -> str:
    """A cache folder of a test's own that already holds this run's verdicts on the tokenizers'
    long inputs (a test about seek indexes or samples need not spend ~2 s recomputing them)."""
    for kind in ("parity", "hf-ids"):
        src = os.path.join(os.environ["HELIXTOK_CACHE"], kind)
        if os.path.isdir(src):
            shutil.copytree(src, folder / kind)
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


@contextlib.contextmanager
def on_a_pool():
    """Builds of a few kilobytes start their --workers processes all the same: a build starts
    one per 16 MiB of input (dispatch.worker_count), so without this they tokenize in one process."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HELIXTOK_WORKER_BYTES", "1")
        yield


@pytest.fixture
def pooled():
    """on_a_pool() for a whole test (the CLI children it starts inherit it)."""
    with on_a_pool():
        yield


def _find_dev() -> Path | None:
    """The optional large tier: $HELIXTOK_DEV_CORPUS, else ../shared/corpus/dev beside the checkout."""
    if os.environ.get("HELIXTOK_DEV_CORPUS"):
        return Path(os.environ["HELIXTOK_DEV_CORPUS"])
    c = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "dev"  # never a path of one machine
    return c if c.is_dir() else None


SHARED_DEV = _find_dev()
# Units of 512 KiB: the ~5 MB test corpus spreads over a dozen work units, so two workers,
# resume and kill tests all see several.
UNIT = 512 << 10


def make_corpus(root: Path, budget: int = 5_000_000) -> Path:
    """Real text every Python install has: the standard library's own sources (PSF License),
    written as .txt files, .jsonl.gz and .jsonl files, and a parquet file with small row groups."""
    import sysconfig

    import pyarrow as pa
    import pyarrow.parquet as pq

    lib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for p in sorted(lib.glob("**/*.py")):
        rel = p.relative_to(lib).as_posix()
        if rel.startswith(("test/", "idlelib/idle_test", "site-packages", "lib2to3/tests")) or "/test" in rel:
            continue
        t = p.read_text(encoding="utf-8", errors="replace")
        if t.strip():
            texts.append(t)
            total += len(t.encode())
        if total >= budget:
            break
    q = len(texts) // 4
    (root / "txt").mkdir(parents=True)
    for i, t in enumerate(texts[:q]):
        (root / "txt" / f"doc{i:04d}.txt").write_text(t, encoding="utf-8")
    (root / "jsonl").mkdir()
    half = texts[q: 2 * q]
    for k, chunk in enumerate((half[: len(half) // 2], half[len(half) // 2:])):
        with gzip.open(root / "jsonl" / f"part{k}.jsonl.gz", "wt", encoding="utf-8") as fh:
            fh.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(chunk))
    with open(root / "jsonl" / "plain.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts[2 * q: 3 * q]))
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"text": texts[3 * q:]}), root / "parquet" / "code.parquet", row_group_size=32)
    return root


def train_bpe(texts, path, vocab_size=1024):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, tr)
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def dev_corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "dev")


@pytest.fixture(scope="session")
def shared_dev_corpus() -> Path:
    if SHARED_DEV is None or not SHARED_DEV.is_dir():
        pytest.skip("no ../shared/corpus/dev (set HELIXTOK_DEV_CORPUS to run the large-corpus tier)")
    return SHARED_DEV


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, dev_corpus) -> str:
    texts = [p.read_text() for p in sorted((dev_corpus / "txt").glob("*.txt"))]
    return train_bpe(texts, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=2048)


def iter_dev_docs(root: Path):
    """The dev corpus in helixtok's documented order, read without helixtok: files sorted by path."""
    import pyarrow.parquet as pq

    for p in sorted(glob.glob(str(root / "**" / "*"), recursive=True)):
        if p.endswith(".txt"):
            yield Path(p).read_text(encoding="utf-8")
        elif p.endswith((".jsonl.gz", ".jsonl")):
            with (gzip.open(p, "rt", encoding="utf-8") if p.endswith(".gz") else open(p, encoding="utf-8")) as fh:
                yield from (json.loads(line)["text"] for line in fh)
        elif p.endswith(".parquet"):
            yield from pq.read_table(p, columns=["text"]).column(0).to_pylist()


def read_dev_docs(root: Path) -> list[str]:
    return list(iter_dev_docs(root))


@pytest.fixture(scope="session")
def dev_docs(dev_corpus) -> list[str]:
    return read_dev_docs(dev_corpus)


@pytest.fixture(scope="session")
def dev_ids(dev_docs, tokenizer_path) -> list[list[int]]:
    """Each dev document tokenized directly, the reference for every count."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    ids = []
    for i in range(0, len(dev_docs), 64):  # Encodings are ~100 bytes a token: keep few alive at once
        ids += [e.ids for e in tok.encode_batch(dev_docs[i: i + 64], add_special_tokens=False)]
    return ids


def _build(tmp_path_factory, corpus, tok, name, **kw):
    from helixtok.pipeline.builder import build
    from helixtok.pipeline.config import BuildConfig

    out = str(tmp_path_factory.mktemp(name) / "out")
    with on_a_pool():  # the reference datasets come from a pool: the other builds compare with them
        build([str(corpus)], out, tok, BuildConfig(**{"unit_bytes": UNIT, **kw}))
    return out


@pytest.fixture(scope="session")
def dev_packed(tmp_path_factory, dev_corpus, tokenizer_path) -> str:
    # Small shards so the dataset spans several and shard boundaries get exercised.
    return _build(tmp_path_factory, dev_corpus, tokenizer_path, "packed", seq_len=512, workers=2,
                  shard_bytes=1 << 20)


@pytest.fixture(scope="session")
def dev_document(tmp_path_factory, dev_corpus, tokenizer_path) -> str:
    return _build(tmp_path_factory, dev_corpus, tokenizer_path, "document", seq_len=512, workers=2,
                  packing="document", shard_bytes=1 << 20)


@pytest.fixture(scope="session")
def dev_bestfit(tmp_path_factory, dev_corpus, tokenizer_path) -> str:
    return _build(tmp_path_factory, dev_corpus, tokenizer_path, "bestfit", seq_len=512, workers=2,
                  packing="bestfit", shard_bytes=1 << 20)


@pytest.fixture
def small_tok(tmp_path) -> str:
    texts = ["the quick brown fox jumps over the lazy dog", "hello world", "pack me into chunks please"] * 20
    return train_bpe(texts, tmp_path / "small.json", vocab_size=300)


@pytest.fixture
def small_corpus(tmp_path, dev_corpus) -> Path:
    """Seven real text files (~40 KB) from the test corpus: a.txt first, then b.txt..."""
    c = tmp_path / "small"
    c.mkdir()
    srcs = sorted((dev_corpus / "txt").glob("*.txt"))[:7]
    for name, src in zip("abcdefg", srcs):
        (c / f"{name}.txt").write_text(src.read_text()[:6000])
    return c


@pytest.fixture(scope="module")
def apart():
    """A spawned process, one per module that asks, for work whose heap pytest would keep for the
    rest of the run (glibc does not give it back): many builds, tokenizers' buffers for 1 MiB."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        yield ex


def give_memory_back() -> None:
    """Hand freed heap memory back to the OS: glibc keeps it otherwise, and the next test's peak
    would stack on top (the suite runs in 1.5 GB)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back():
    """After each test module (a test that leaves hundreds of MB behind calls it itself)."""
    yield
    give_memory_back()
