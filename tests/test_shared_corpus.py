"""The large tier: the real 61 MB dev corpus (txt, jsonl.gz, parquet), when ../shared/corpus/dev exists.

Skipped with a one-line reason on a clone without it; CI has it and runs this.
"""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from conftest import iter_dev_docs
from helixtok.inspect.verify import verify
from helixtok.pipeline.builder import build
from helixtok.pipeline.config import BuildConfig


def byte_level_table(tok: Tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(every id's bytes concatenated, where each starts, its length), from the vocabulary and
    byte-level BPE's byte-to-character map, not from tokenizers' decoder (nor helixtok's)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in shown]  # the others are shown as 256, 257, ...
    to_byte = {chr(c): b for b, c in [*zip(shown, shown), *zip(extra, range(256, 256 + len(extra)))]}
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    vocab = tok.get_vocab(with_added_tokens=True)
    pieces = [b""] * (max(vocab.values()) + 1)
    for s, i in vocab.items():
        pieces[i] = s.encode() if s in added else bytes(to_byte[c] for c in s)
    lens = np.array([len(p) for p in pieces], dtype=np.int64)
    return np.frombuffer(b"".join(pieces), dtype=np.uint8), np.cumsum(lens) - lens, lens


def decode_bytes(ids: np.ndarray, table) -> tuple[bytes, np.ndarray]:
    """The bytes `ids` stand for, and where each id's bytes start in them (one more: the end)."""
    flat, starts, lens = table
    n = lens[ids]
    at = np.concatenate([[0], np.cumsum(n)])
    return flat[np.repeat(starts[ids] - at[:-1], n) + np.arange(at[-1])].tobytes(), at


def test_dev_corpus_stream_equals_an_independent_recount(tmp_path, shared_dev_corpus, tokenizer_path):
    """Every document of the stream decodes back to its text, in corpus order, between end-of-text
    ids; every tenth one, and those the chunking cut, has exactly tokenizers' ids.  (tokenizers
    would take 16 s here to re-encode all 61 MB and 4-5 s to decode it; the vocabulary's bytes,
    gathered with numpy, decode it in about a second.)  In a process of its own: the build and
    the recount of 61 MB would leave the test process's heap ~250 MiB higher for the whole suite."""
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); import test_shared_corpus as t; "
                        f"t.recount({str(tmp_path / 'out')!r}, {str(shared_dev_corpus)!r}, {tokenizer_path!r})"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-4000:]


def recount(out: str, shared_dev_corpus: str, tokenizer_path: str) -> None:
    shared_dev_corpus = Path(shared_dev_corpus)
    m = build([str(shared_dev_corpus)], out, tokenizer_path, BuildConfig(seq_len=512, workers=2))
    assert m["totals"]["skipped_documents"] == 0
    tok = Tokenizer.from_file(tokenizer_path)
    tok.encode_special_tokens = True
    eos = m["tokenizer"]["eos_id"]
    table = byte_level_table(tok)
    shards = [np.memmap(os.path.join(out, e["path"]), dtype="<u2", mode="r") for e in m["splits"]["train"]["shards"]]
    # The chunks' tokens (format 2: the stream's last partial chunk is on disk too, in no chunk).
    stored = (np.concatenate(shards) if len(shards) > 1 else shards[0])[: m["splits"]["train"]["num_tokens"]]
    ends = np.flatnonzero(stored == eos)  # special tokens in text are text: eos only ends a document
    pos = ndocs = 0
    docs = iter_dev_docs(shared_dev_corpus)  # 61 MB of text: never all of it alive at once
    while batch := list(itertools.islice(docs, 64)):
        whole = min(len(batch), len(ends) - ndocs)  # documents stored up to their eos
        starts = [0 if ndocs + i == 0 else int(ends[ndocs + i - 1]) + 1 for i in range(whole)]
        if whole:
            span, at = decode_bytes(stored[starts[0]: ends[ndocs + whole - 1]], table)
            for i, a in enumerate(starts):
                b = int(ends[ndocs + i])
                assert span[at[a - starts[0]]: at[b - starts[0]]] == batch[i].encode(), \
                    f"document {ndocs + i} does not decode to its text"
        if whole:
            pos = int(ends[ndocs + whole - 1]) + 1
        check = [i for i in range(len(batch)) if (ndocs + i) % 10 == 0 or i >= whole]
        for i, e in zip(check, tok.encode_batch_fast([batch[i] for i in check], add_special_tokens=False)):
            ids = np.asarray(e.ids + [eos], dtype=np.uint16)
            a = starts[i] if i < whole else pos  # past the last eos: documents the chunking cut or dropped
            assert np.array_equal(stored[a: a + len(ids)], ids[: max(0, len(stored) - a)]), f"document {ndocs + i}"
            if i >= whole:
                pos = a + len(ids)
        ndocs += len(batch)
    assert ndocs == m["totals"]["documents"] and pos == m["totals"]["tokens"] and pos - len(stored) == m["totals"]["dropped_tokens"] < 512
    assert verify(out).ok
    assert json.load(open(os.path.join(out, "manifest.json")))["tokenizer"]["special_tokens_in_text"] == "text"
