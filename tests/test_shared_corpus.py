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
    out = str(tmp_path / "out")
    m = build([str(shared_dev_corpus)], out, tokenizer_path, BuildConfig(seq_len=512, workers=2))
    assert m["totals"]["skipped_documents"] == 0
    tok = Tokenizer.from_file(tokenizer_path)
    tok.encode_special_tokens = True
    eos = m["tokenizer"]["eos_id"]
    shards = [np.memmap(os.path.join(out, e["path"]), dtype="<u2", mode="r") for e in m["splits"]["train"]["shards"]]
    stored = np.concatenate(shards) if len(shards) > 1 else shards[0]
    pos = ndocs = 0
    docs = iter_dev_docs(shared_dev_corpus)  # 61 MB of text: never all of it alive at once
    while batch := list(itertools.islice(docs, 64)):  # the stream, recomputed batch by batch
        ids = [t for e in tok.encode_batch_fast(batch, add_special_tokens=False) for t in e.ids + [eos]]
        n = min(len(ids), len(stored) - pos)
        assert np.array_equal(stored[pos: pos + n], np.asarray(ids[:n], dtype=np.uint16)), f"documents {ndocs}.."
        pos += len(ids)
        ndocs += len(batch)
    assert ndocs == m["totals"]["documents"] and pos == m["totals"]["tokens"] and pos - len(stored) == m["totals"]["dropped_tokens"] < 512
    assert verify(out).ok
    assert json.load(open(os.path.join(out, "manifest.json")))["tokenizer"]["special_tokens_in_text"] == "text"
