"""What training reads is what the text says: special-token strings and whitespace runs (issue #10)."""

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helixtok.format.errors import TokenizerError
from helixtok.pipeline.backends import hf_ids, hf_tokenizer, tiktoken_encoding
from helixtok.pipeline.builder import build
from helixtok.pipeline.config import BuildConfig
from helixtok.pipeline.encode import Encoder
from helixtok.pipeline.tokenizer import inspect_tokenizer


def stream(out, split="train"):
    m = json.load(open(os.path.join(out, "manifest.json")))
    dt = "<u2" if m["dtype"] == "uint16" else "<u4"
    return m, np.concatenate([np.fromfile(os.path.join(out, e["path"]), dtype=dt) for e in m["splits"][split]["shards"]])


def reference(tok_path, text, special="text"):
    return hf_ids(hf_tokenizer(held(tok_path), special), [text])[0]


def held(tok_path) -> str:
    """The sha256 under which the tokenizer file's bytes are held for loads (as a build holds them)."""
    from helixtok.pipeline.tokenizer import hold_bytes

    with open(tok_path, "rb") as fh:
        return hold_bytes(fh.read())


DOCS = ["Crawled page says <|endoftext|> then more text.", "a<pad>b and <|endoftext|><|endoftext|>",
        "plain document with nothing special"]


@pytest.mark.parametrize("special", ["text", "extract"])
def test_special_token_text_inside_documents(tmp_path, small_tok, special):
    c = tmp_path / "c"
    c.mkdir()
    with open(c / "d.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": d}) + "\n" for d in DOCS)
    outs = {}
    for backend in ("hf", "fastokens", "tiktoken", "gigatoken"):
        out = str(tmp_path / f"o-{backend}")
        cfg = BuildConfig(seq_len=1, workers=1, backend=backend, special_tokens=special)
        if backend == "gigatoken" and special == "text":  # it always extracts them: refused, not used
            with pytest.raises(TokenizerError, match="backend gigatoken is not exact"):
                build([str(c)], out, small_tok, cfg)
            continue
        m = build([str(c)], out, small_tok, cfg)
        assert m["tokenizer"]["special_tokens_in_text"] == special and m["tokenizer"]["backend"] == backend
        outs[backend] = stream(out)[1]
    assert all(o.tolist() == outs["hf"].tolist() for o in outs.values())
    eos = m["tokenizer"]["eos_id"]
    want = [t for d in DOCS for t in reference(small_tok, d, special) + [eos]]
    assert outs["hf"].tolist() == want
    if special == "text":  # EOS appears only where helixtok put it: one per document
        assert int((outs["hf"] == eos).sum()) == len(DOCS) == m["totals"]["documents"]
    else:  # today's behaviour, on request: the markup becomes the special ids
        assert int((outs["hf"] == eos).sum()) == len(DOCS) + 3


def _whitespace_on_every_backend(tok_path: str, text: str) -> tuple[list[int], dict]:
    """tokenizers' ids of `text`, and each backend's (ids, lengths) from a build's Encoder: in a
    child process (tokenizers takes up to ~400 bytes a character of such a text)."""
    import dataclasses

    info = inspect_tokenizer(tok_path)
    got = {}
    for backend in ("hf", "tiktoken", "fastokens", "gigatoken"):
        ids, lens = Encoder(dataclasses.replace(info, backend=backend), max_piece_chars=200_000).encode([text])
        got[backend] = (ids.tolist(), lens.tolist())
    return reference(tok_path, text), got


@pytest.mark.parametrize("run", [" ", "\n", " \n\t"])
def test_a_mebibyte_of_whitespace_encodes_on_every_backend(tmp_path, small_tok, run, apart):
    text = "start " + run * ((1 << 20) // len(run)) + " end"
    want, got = apart.submit(_whitespace_on_every_backend, small_tok, text).result()
    assert want and set(got) == {"hf", "tiktoken", "fastokens", "gigatoken"}
    for backend, (ids, lens) in got.items():
        assert ids[:-1] == want and lens == [len(want) + 1], backend


FRAGMENTS = st.one_of(
    st.sampled_from(["<|endoftext|>", "<pad>", "<|endoftext", "endoftext|>", "<", "|>", "日本語", "😀👍🏽", "\x00",
                     "don't", " x = f(1)", "3.14159", "Ωμέγα", "\ufffd"]),
    st.text(min_size=1, max_size=30),
    st.builds(lambda ch, n: ch * n, st.sampled_from([" ", "\n", "\t", " \n", "!", "7", "語"]),
              st.integers(1, 5000)),
)
# At most one run past backends.WS_RUN per text, where it goes: each costs tokenizers ~0.1 s.
LONG_RUN = st.one_of(st.none(), st.tuples(st.sampled_from([" ", "\n"]), st.integers(0, 12)))
_ENCODERS: dict = {}


def encoder(tok_path, special, backend):
    import dataclasses

    key = (tok_path, special, backend)
    if key not in _ENCODERS:
        info = dataclasses.replace(inspect_tokenizer(tok_path, special_tokens=special), backend=backend)
        _ENCODERS[key] = Encoder(info, max_piece_chars=1000)
    return _ENCODERS[key]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(parts=st.lists(FRAGMENTS, min_size=1, max_size=12), long_run=LONG_RUN,
       special=st.sampled_from(["text", "extract"]))
def test_any_text_gets_tokenizers_ids_on_every_backend(tokenizer_path, parts, long_run, special):
    """Special-token strings and whitespace runs inserted at random: every backend gives HF's ids
    under the documented policy, also where long documents are cut into pieces."""
    if long_run is not None:
        parts.insert(long_run[1], long_run[0] * 120_000)
    text = "".join(parts)
    want = encoder(tokenizer_path, special, "hf").tok.encode(text, add_special_tokens=False).ids
    assert tiktoken_encoding(held(tokenizer_path))[0] is not None
    for backend in ("hf", "tiktoken", "fastokens") + (("gigatoken",) if special == "extract" else ()):
        ids, lens = encoder(tokenizer_path, special, backend).encode([text])
        assert ids[:-1].tolist() == want, backend


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(st.one_of(st.text(max_size=40), st.builds(lambda w, n: w * n, st.sampled_from(["ab ", "x y\n"]),
                                                                 st.integers(300, 1500))), max_size=12),
       add_bos=st.booleans(), piece=st.sampled_from([50, 1000, 200_000]))
def test_a_batch_is_each_document_bos_ids_eos_in_order(tokenizer_path, docs, add_bos, piece):
    """Encoder.encode: documents (long ones cut into pieces that may span encode groups) come
    back as [BOS] + their ids + EOS each, in order, with those lengths."""
    import dataclasses

    info = inspect_tokenizer(tokenizer_path)
    info = dataclasses.replace(info, backend="fastokens", add_bos=add_bos, bos_id=info.eos_id + 1 if add_bos else None)
    ids, lens = Encoder(info, max_piece_chars=piece, group_chars=piece).encode(docs)
    ref = encoder(tokenizer_path, "text", "hf").tok
    want = [[info.bos_id] * add_bos + ref.encode(d, add_special_tokens=False).ids + [info.eos_id] for d in docs]
    assert lens.tolist() == [len(w) for w in want]
    assert ids.tolist() == [t for w in want for t in w] and ids.dtype == info.dtype


def test_the_fast_libraries_take_a_whole_batch_per_call_and_tokenizers_stays_in_pieces(tokenizer_path):
    """A library that returns flat id arrays is called once per batch (five calls of 200 K
    characters cost a build ~5% more than one of 1 MiB); tokenizers, whose Encodings take ~100
    bytes a character, keeps its calls to max_piece_chars.  The ids are the same either way."""
    import dataclasses

    info = inspect_tokenizer(tokenizer_path)
    docs = ["the quick brown fox jumps over the lazy dog " * 100] * 200  # 880 K characters
    got = {}
    for backend in ("fastokens", "hf"):
        enc = Encoder(dataclasses.replace(info, backend=backend), max_piece_chars=200_000)
        calls, real = [], enc._encode
        enc._encode = lambda texts, real=real: calls.append(sum(map(len, texts))) or real(texts)
        ids, lens = enc.encode(docs)
        got[backend] = (ids.tolist(), lens.tolist(), calls)
    assert got["fastokens"][:2] == got["hf"][:2]
    assert got["fastokens"][2] == [880_000]
    assert len(got["hf"][2]) == 5 and max(got["hf"][2]) <= 200_000
    # A worker's batch ends with the document that took it past batch_chars (1 MiB): still one call.
    enc = Encoder(dataclasses.replace(info, backend="fastokens"), max_piece_chars=200_000)
    calls, real = [], enc._encode
    enc._encode = lambda texts: calls.append(sum(map(len, texts))) or real(texts)
    enc.encode(docs + docs[:40])
    assert calls == [1_056_000]
