"""Shared fixtures: a tokenizer trained here, the dev corpus read independently, and built datasets."""

from __future__ import annotations

import glob
import gzip
import json
import os
from pathlib import Path

import pytest

def _find_dev() -> Path:
    """$HELIXTOK_DEV_CORPUS, else ../shared/corpus/dev beside the checkout, else /work/shared's."""
    if os.environ.get("HELIXTOK_DEV_CORPUS"):
        return Path(os.environ["HELIXTOK_DEV_CORPUS"])
    for c in (Path(__file__).resolve().parents[2] / "shared" / "corpus" / "dev", Path("/work/shared/corpus/dev")):
        if c.is_dir():
            return c
    return Path(__file__).resolve().parents[2] / "shared" / "corpus" / "dev"


DEV = _find_dev()


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
def dev_corpus() -> Path:
    if not DEV.is_dir():
        pytest.fail(f"dev corpus not found at {DEV}; set HELIXTOK_DEV_CORPUS")
    return DEV


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory, dev_corpus) -> str:
    texts = [p.read_text() for p in sorted((dev_corpus / "txt").glob("fortunes__*.txt"))]
    return train_bpe(texts, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=2048)


def read_dev_docs(root: Path) -> list[str]:
    """The dev corpus in helixtok's documented order, read without helixtok: files sorted by path."""
    import pyarrow.parquet as pq

    docs = []
    for p in sorted(glob.glob(str(root / "**" / "*"), recursive=True)):
        if p.endswith(".txt"):
            docs.append(Path(p).read_text(encoding="utf-8"))
        elif p.endswith(".jsonl.gz"):
            with gzip.open(p, "rt", encoding="utf-8") as fh:
                docs.extend(json.loads(line)["text"] for line in fh)
        elif p.endswith(".parquet"):
            docs.extend(pq.read_table(p, columns=["text"]).column(0).to_pylist())
    return docs


@pytest.fixture(scope="session")
def dev_docs(dev_corpus) -> list[str]:
    return read_dev_docs(dev_corpus)


@pytest.fixture(scope="session")
def dev_ids(dev_docs, tokenizer_path) -> list[list[int]]:
    """Each dev document tokenized directly, the reference for every count."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    return [e.ids for e in tok.encode_batch(dev_docs, add_special_tokens=False)]


def _build(tmp_path_factory, corpus, tok, name, **kw):
    from helixtok.build import build
    from helixtok.config import BuildConfig

    out = str(tmp_path_factory.mktemp(name) / "out")
    build([str(corpus)], out, tok, BuildConfig(**kw))
    return out


@pytest.fixture(scope="session")
def dev_packed(tmp_path_factory, dev_corpus, tokenizer_path) -> str:
    # Small shards so the dataset spans several and shard boundaries get exercised.
    return _build(tmp_path_factory, dev_corpus, tokenizer_path, "packed", seq_len=512, workers=2,
                  shard_bytes=4 << 20)


@pytest.fixture(scope="session")
def dev_document(tmp_path_factory, dev_corpus, tokenizer_path) -> str:
    return _build(tmp_path_factory, dev_corpus, tokenizer_path, "document", seq_len=512, workers=2,
                  packing="document", shard_bytes=4 << 20)


@pytest.fixture
def small_tok(tmp_path) -> str:
    texts = ["the quick brown fox jumps over the lazy dog", "hello world", "pack me into chunks please"] * 20
    return train_bpe(texts, tmp_path / "small.json", vocab_size=300)
