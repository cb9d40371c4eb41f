"""The large tier: the real 61 MB dev corpus (txt, jsonl.gz, parquet), when ../shared/corpus/dev exists.

Skipped with a one-line reason on a clone without it; CI has it and runs this.
"""

import itertools
import json
import os

import numpy as np
from tokenizers import Tokenizer

from conftest import iter_dev_docs
from helixtok.build import build
from helixtok.config import BuildConfig
from helixtok.verify import verify


def test_dev_corpus_stream_equals_an_independent_recount(tmp_path, shared_dev_corpus, tokenizer_path):
    """Every document of the stream decodes back to its text, in corpus order, between end-of-text
    ids; every tenth one, and those the chunking cut, has exactly tokenizers' ids.  (tokenizers
    re-encoding all 61 MB took 16 s here; decoding it takes 2-4 s.)"""
    out = str(tmp_path / "out")
    m = build([str(shared_dev_corpus)], out, tokenizer_path, BuildConfig(seq_len=512, workers=2))
    assert m["totals"]["skipped_documents"] == 0
    tok = Tokenizer.from_file(tokenizer_path)
    tok.encode_special_tokens = True
    eos = m["tokenizer"]["eos_id"]
    shards = [np.memmap(os.path.join(out, e["path"]), dtype="<u2", mode="r") for e in m["splits"]["train"]["shards"]]
    stored = np.concatenate(shards) if len(shards) > 1 else shards[0]
    ends = np.flatnonzero(stored == eos)  # special tokens in text are text: eos only ends a document
    pos = ndocs = 0
    docs = iter_dev_docs(shared_dev_corpus)  # 61 MB of text: never all of it alive at once
    while batch := list(itertools.islice(docs, 64)):
        whole = min(len(batch), len(ends) - ndocs)  # documents stored up to their eos
        starts = [0 if ndocs + i == 0 else int(ends[ndocs + i - 1]) + 1 for i in range(whole)]
        texts = tok.decode_batch([stored[a: ends[ndocs + i]].tolist() for i, a in enumerate(starts)],
                                 skip_special_tokens=False)
        for i, text in enumerate(texts):
            assert text == batch[i], f"document {ndocs + i} does not decode to its text"
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
