"""A build's tokenizer: its special ids, dtype and BOS rule, whether it splits exactly, its bytes held for
every load of the build (so a file replaced mid-build cannot change them); and training one."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..format.errors import TokenizerError
from ..format.tokenizer_file import reference_library, resolve_tokenizer_path, tokenizer_from_bytes

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "[CLS]")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


def reference_version() -> str:
    """'tokenizers X.Y.Z': the library whose ids every backend must reproduce."""
    from importlib.metadata import version

    return f"tokenizers {version('tokenizers')}"


def dtype_for(max_id: int) -> np.dtype:
    # uint16 halves disk and page cache whenever every id fits (GPT-2's 50,257 do);
    # anything larger (Llama 3's 128,256) needs uint32.
    return np.dtype("<u2") if max_id <= 0xFFFF else np.dtype("<u4")


@dataclass(frozen=True)
class TokenizerInfo:
    path: str
    sha256: str
    vocab_size: int  # largest id + 1: every stored id is below it
    eos_id: int
    eos_token: str
    pad_id: int
    pad_token: str
    bos_id: int | None
    bos_token: str | None
    add_bos: bool
    # Long documents may be encoded piecewise without changing ids; None: not decided yet (it takes
    # encoding probes: the encoder decides when a long document first needs it).
    splittable: bool | None
    backend: str = "hf"  # "hf" (tokenizers, the reference) or a faster library checked to give its ids
    backend_version: str = ""  # the library's version: another version may give other ids
    special_tokens: str = "text"  # special-token strings inside documents: "text" or "extract"
    # The tokenizers release every backend was checked against: its ids changed between releases
    # (Unicode tables 14 -> 16), so a resume or a merge across releases could mix two tokenizations.
    reference_version: str = ""
    # Why add_bos is what it is: "tokenizer" (its post-processor's rule for one sequence), "--bos", "--no-bos".
    bos_rule: str = "--no-bos"

    @property
    def dtype(self) -> np.dtype:
        return dtype_for(self.vocab_size - 1)

    def to_json(self) -> dict:
        return {
            "sha256": self.sha256, "vocab_size": self.vocab_size, "backend": self.backend,
            "backend_version": self.backend_version, "special_tokens_in_text": self.special_tokens,
            "eos_id": self.eos_id, "eos_token": self.eos_token,
            "pad_id": self.pad_id, "pad_token": self.pad_token,
            "bos_id": self.bos_id, "bos_token": self.bos_token, "add_bos": self.add_bos, "bos_rule": self.bos_rule,
            "reference_version": self.reference_version,
        }

    def identity(self) -> dict:
        """What of to_json() decides the bytes: not which exact library produced them."""
        return {k: v for k, v in self.to_json().items() if k not in ("backend", "backend_version")}


# The bytes of the tokenizers a build uses, by sha256.  A build reads its tokenizer.json once
# (inspect_tokenizer) and every load after that -- the backend check, each worker (inherited
# from the fork server, or sent in its first message), each Ray task, the long-input helper,
# OUT's copy -- takes these bytes: a file replaced while the build runs cannot mix another
# tokenizer's ids into the shards the manifest attributes to the first.
_HELD: dict[str, list] = {}  # sha256 -> [bytes, holders]


def hold_bytes(data: bytes) -> str:
    """Keep `data` for loads by its sha256 (returned) until release_bytes."""
    sha = hashlib.sha256(data).hexdigest()
    _HELD.setdefault(sha, [data, 0])[1] += 1
    return sha


def release_bytes(sha: str) -> None:
    entry = _HELD.get(sha)
    if entry is not None:
        entry[1] -= 1
        if entry[1] <= 0:
            del _HELD[sha]


def tokenizer_bytes(sha: str) -> bytes:
    """The held bytes whose sha256 is `sha`: a process never loads a tokenizer it was not handed."""
    try:
        return _HELD[sha][0]
    except KeyError:
        raise TokenizerError(f"tokenizer sha256 {sha[:12]}...: its bytes were not handed to this process "
                             "(a helixtok bug; rerun the same command)") from None


def load_held(sha: str):
    """A tokenizers Tokenizer of the held bytes `sha` (the one inspect_tokenizer loaded, once)."""
    handed = _handed.pop(sha, None)
    return handed if handed is not None else tokenizer_from_bytes(tokenizer_bytes(sha), f"tokenizer {sha[:12]}")


# A Tokenizer inspect_tokenizer loaded and no longer uses, for the next load of the same bytes
# (the backend check): a 100k-vocabulary file takes ~0.5 s to load.  Taken once, never shared.
_handed: dict[str, object] = {}


def forget_handed() -> None:
    """Drop a Tokenizer inspect_tokenizer handed on and nothing took (a pool build with tokenizers,
    a build that failed before its check): a long-lived process keeps no ~30-100 MB of it."""
    _handed.clear()


def _config_token(tok_path: str, key: str) -> str | None:
    """eos_token / bos_token / pad_token from a tokenizer_config.json next to the tokenizer."""
    cfg = os.path.join(os.path.dirname(tok_path), "tokenizer_config.json")
    if not os.path.isfile(cfg):
        return None
    try:
        with open(cfg) as fh:
            v = json.load(fh).get(key)
    except (OSError, ValueError):
        return None
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def read_tokenizer(path: str) -> bytes:
    """The tokenizer file's bytes: the one read of it a build makes (see _HELD)."""
    from . import preload

    early = preload.take_bytes(path)
    if early is not None:
        return early
    with open(path, "rb") as fh:
        return fh.read()


def inspect_tokenizer(spec: str, *, eos_token: str | None = None, bos_token: str | None = None,
                      pad_token: str | None = None, add_bos: bool | None = False, special_tokens: str = "text",
                      sha256: str | None = None, via: str = "json") -> TokenizerInfo:
    """What a build needs to know of a tokenizer: special ids, vocabulary size, dtype, whether long
    documents may be cut.  add_bos None: what the tokenizer's post-processor puts before a single
    sequence (Llama 3: <|begin_of_text|>; GPT-2: nothing), as tokenizer(text) does in transformers.
    sha256: the held bytes (hold_bytes) to inspect; else the file is read and its bytes held
    (the caller releases them: release_bytes(info.sha256)).  via "tokenizers": loaded into it, not
    read from the JSON (the reference the JSON reading is tested against)."""
    path = resolve_tokenizer_path(spec)
    if sha256 is None:
        sha256 = hold_bytes(read_tokenizer(path))
    # From the file's JSON, without loading it into tokenizers (~0.5-1 s of a core for a 100k
    # vocabulary): what it says is what tokenizers reads (tests/test_backends.py holds the two
    # equal for every tokenizer the suite has); a file it cannot read so is loaded.
    reference_library()  # (the reference every backend is checked against: refused here, before OUT is touched)
    got = None if via == "tokenizers" else from_json(tokenizer_bytes(sha256))
    tok = None
    if got is None:
        tok = tokenizer_from_bytes(tokenizer_bytes(sha256), path)
        vocab = tok.get_vocab(with_added_tokens=True)
        specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    else:
        vocab, specials, json_lead = got
    if not vocab:
        raise TokenizerError(f"{path}: tokenizer has an empty vocabulary")

    def pick(given, key, candidates, what, required):
        if given is not None:
            if given not in vocab:
                raise TokenizerError(f"{path}: {what} token {given!r} is not in the vocabulary")
            return given
        c = _config_token(path, key)
        if c is not None and c in vocab:
            return c
        for cand in candidates:
            if cand in vocab and (cand in specials or not specials):
                return cand
        if required:
            raise TokenizerError(f"{path}: cannot tell the {what} token (special tokens: "
                                 f"{', '.join(specials[:8]) or 'none'}); pass --{what}-token")
        return None

    eos = pick(eos_token, "eos_token", EOS_CANDIDATES, "eos", True)
    rule = "--bos" if add_bos else "--no-bos"
    if add_bos is None:
        lead = _post_processor_bos(tok) if tok is not None else json_lead
        add_bos, rule = lead is not None, "tokenizer"
        if lead is not None and bos_token is None:
            bos_token = next(t for t, i in vocab.items() if i == lead) if tok is None else tok.id_to_token(lead)
    bos = pick(bos_token, "bos_token", BOS_CANDIDATES, "bos", add_bos)
    pad = pick(pad_token, "pad_token", PAD_CANDIDATES, "pad", False) or eos
    info = TokenizerInfo(
        path=path, sha256=sha256, vocab_size=max(vocab.values()) + 1,
        eos_id=vocab[eos], eos_token=eos, pad_id=vocab[pad], pad_token=pad,
        bos_id=vocab[bos] if bos else None, bos_token=bos, add_bos=add_bos, bos_rule=rule,
        splittable=_splits_exactly(tok) if tok is not None else None, special_tokens=special_tokens,
        reference_version=reference_version(),
    )
    _handed.clear()
    if tok is not None:
        _handed[sha256] = tok
    return info


_MODELS = ("BPE", "WordPiece", "WordLevel", "Unigram")


def from_json(data: bytes) -> tuple[dict, list, int | None] | None:
    """(vocabulary with added tokens, special tokens, the id the post-processor puts before one
    sequence or None) as tokenizers reads them from a tokenizer.json; None where it cannot be told
    from the file alone (an unknown model or post-processor): then tokenizers loads it."""
    try:
        import orjson

        d = orjson.loads(data)
    except Exception:  # noqa: BLE001 - not JSON (or no orjson): tokenizers' load says what is wrong
        return None
    model = d.get("model") if isinstance(d, dict) else None
    added = d.get("added_tokens") if isinstance(d, dict) else None
    if not isinstance(model, dict) or model.get("type") not in _MODELS or not isinstance(added, list):
        return None
    v = model.get("vocab")
    if model["type"] == "Unigram":
        if not isinstance(v, list):
            return None
        vocab = {p[0]: i for i, p in enumerate(v)}
    elif isinstance(v, dict):
        vocab = v  # (parsed for this call only: extended in place)
    else:
        return None
    try:
        for t in added:
            vocab[t["content"]] = t["id"]
        specials = [t["content"] for t in sorted(added, key=lambda t: t["id"]) if t.get("special")]
    except (KeyError, TypeError):
        return None
    lead = _template_lead(d.get("post_processor"), {t["id"] for t in added if t.get("special")})
    return (vocab, specials, lead) if lead is not _UNKNOWN else None


_UNKNOWN = object()


def _template_lead(pp, special_ids: set) -> int | None | object:
    """_post_processor_bos from the post-processor's JSON: the one special id a single sequence
    gets before it, or None; _UNKNOWN for a post-processor this does not read."""
    if pp is None:
        return None
    kind = pp.get("type") if isinstance(pp, dict) else None
    if kind == "Sequence":
        leads = [_template_lead(x, special_ids) for x in pp.get("processors") or []]
        adding = [x for x, p in zip(leads, pp.get("processors") or []) if p.get("type") != "ByteLevel"]
        if _UNKNOWN in leads or len(adding) > 1:
            return _UNKNOWN
        return adding[0] if adding else None
    if kind == "ByteLevel":
        return None
    if kind in ("BertProcessing", "RobertaProcessing"):
        cls = pp.get("cls")
        return cls[1] if isinstance(cls, list) and len(cls) == 2 and cls[1] in special_ids else None
    if kind == "TemplateProcessing":
        single, toks = pp.get("single"), pp.get("special_tokens") or {}
        if not isinstance(single, list) or not single:
            return _UNKNOWN
        first = single[0]
        if "Sequence" in first:
            return None
        name = (first.get("SpecialToken") or {}).get("id")
        ids = (toks.get(name) or {}).get("ids")
        if not isinstance(ids, list) or len(single) < 2 or "Sequence" not in single[1]:
            return None if isinstance(ids, list) else _UNKNOWN
        return ids[0] if len(ids) == 1 and ids[0] in special_ids else None
    return _UNKNOWN


def _post_processor_bos(tok) -> int | None:
    """The one special id the tokenizer's post-processor puts before a single sequence, or None."""
    lead = None
    for probe in ("a", "hello world"):
        with_ = tok.encode(probe, add_special_tokens=True).ids
        bare = tok.encode(probe, add_special_tokens=False).ids
        k = next((k for k in range(len(with_) - len(bare) + 1) if with_[k: k + len(bare)] == bare), None)
        if k != 1 or (lead is not None and with_[0] != lead):
            return None
        lead = with_[0]
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return lead if lead in specials else None


# Probe texts with a cut point: encode(a + b) must equal encode(a) + encode(b) for a
# tokenizer whose pieces are independent at "non-space | space letter" boundaries.
_PROBES = [("hello", " world"), ("x = f(1)", " return"), ("3.14", " pi"), ("Über", " straße"),
           ("end.", " Next"), ("a\n", "b"), ("日本", " 語")]


def _splits_exactly(tok) -> bool:
    return splits_exactly(lambda t: tok.encode(t, add_special_tokens=False).ids)


def splits_exactly(ids_of) -> bool:
    """Whether encoding at "non-space | space letter" cuts gives the same ids (ids_of(text): a
    text's ids, no special tokens added), by _PROBES."""
    return all(list(ids_of(a + b)) == list(ids_of(a)) + list(ids_of(b)) for a, b in _PROBES)


def train_tokenizer(texts: Iterable[str], out_path: str, *, vocab_size: int, min_frequency: int = 2,
                    show_progress: bool = False) -> None:
    """Train a GPT-2-style byte-level BPE with <|endoftext|>, written as tokenizer.json."""
    reference_library()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress)
    tok.train_from_iterator(texts, trainer)
    tmp = out_path + ".tmp"
    tok.save(tmp)
    os.replace(tmp, out_path)
