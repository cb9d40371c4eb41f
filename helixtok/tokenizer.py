"""Load a tokenizer (file, model folder, local HF cache), pick special ids and dtype, encode to numpy."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .errors import TokenizerError

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "<|startoftext|>", "[CLS]")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


def resolve_tokenizer_path(spec: str) -> str:
    """A tokenizer.json path, a folder holding one, or a HF repo id already in the local cache."""
    if os.path.isfile(spec):
        with open(spec, "rb") as fh:
            head = fh.read(64).lstrip(b"\xef\xbb\xbf \t\r\n")
        if not head.startswith(b"{"):
            if re.match(rb"[A-Za-z0-9+/]+=* \d+\r?\n", head):  # Llama 3's original tokenizer.model
                raise TokenizerError(
                    f"{spec}: a tiktoken BPE file (lines of base64 token and rank, as Llama 3 ships its "
                    "original/tokenizer.model), not a tokenizer.json; pass the tokenizer.json from the model's HF "
                    "repo (hf download REPO tokenizer.json), or convert the model folder: pip install transformers "
                    "tiktoken blobfile, then AutoTokenizer.from_pretrained(folder).save_pretrained(folder)")
            if spec.endswith(".model"):
                raise TokenizerError(
                    f"{spec}: a SentencePiece model, not a tokenizer.json; pass the tokenizer.json that ships "
                    "beside it, or write one: pip install transformers sentencepiece, then "
                    "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)")
            raise TokenizerError(f"{spec}: not JSON, not a tokenizer.json; pass the tokenizer.json that ships beside "
                                 "it (or write one: transformers' AutoTokenizer.from_pretrained(folder)"
                                 ".save_pretrained(folder))")
        return spec
    if os.path.isdir(spec):
        p = os.path.join(spec, "tokenizer.json")
        if os.path.isfile(p):
            return p
        raise TokenizerError(f"{spec}: folder has no tokenizer.json; point --tokenizer at a tokenizer.json file")
    looks_like_path = spec.startswith((".", "/", "~")) or spec.endswith(".json") or spec.count("/") > 1
    if looks_like_path:
        raise TokenizerError(f"{spec}: no such tokenizer file or folder; pass the path of a tokenizer.json "
                             "(or of a folder holding one)")
    p = _from_hf_cache(spec)
    if p:
        return p
    tried = os.path.join(_hf_cache_dir(), "models--" + spec.replace("/", "--"))
    raise TokenizerError(
        f"tokenizer {spec!r}: not a file or folder here, and not a repo in the local HF cache (looked in "
        f"{tried}); pass the path of a tokenizer.json, or on a machine with network run "
        f"`hf download {spec} tokenizer.json` (huggingface_hub < 0.34: `huggingface-cli download {spec} "
        "tokenizer.json`) and copy the cache")


def _hf_cache_dir() -> str:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def _from_hf_cache(repo_id: str) -> str | None:
    repo = os.path.join(_hf_cache_dir(), "models--" + repo_id.replace("/", "--"))
    snaps = os.path.join(repo, "snapshots")
    if not os.path.isdir(snaps):
        return None
    order = []
    ref = os.path.join(repo, "refs", "main")
    if os.path.isfile(ref):
        with open(ref) as fh:
            order.append(fh.read().strip())
    order += sorted(os.listdir(snaps))
    for rev in order:
        p = os.path.join(snaps, rev, "tokenizer.json")
        if os.path.isfile(p):
            return p
    return None


def reference_version() -> str:
    """'tokenizers X.Y.Z': the library whose ids every backend must reproduce."""
    from importlib.metadata import version

    return f"tokenizers {version('tokenizers')}"


def sha256_file(path: str) -> str:
    return sha256_stream(open(path, "rb"))


def sha256_stream(fh) -> str:
    """sha256 of what an open binary reader (local file or object) holds; closes it."""
    h = hashlib.sha256()
    with fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


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
    splittable: bool  # long documents may be encoded piecewise without changing ids
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


def load_tokenizer(path: str):
    """A tokenizers Tokenizer from a file (a dataset's own copy: readers, not the build)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read it ({e.strerror}); copy the dataset's tokenizer.json again, "
                             "or show ids alone with --raw") from None
    return tokenizer_from_bytes(data, path)


def reference_library():
    """tokenizers' Tokenizer class, the reference every build is checked against: its 0.x Python
    API.  tokenizers 1.0's reworked bindings (1.0.0rc3: from_file, encode, decode, nothing else)
    give no vocabulary, added tokens or pipeline to inspect, so they are refused in one line."""
    import tokenizers

    if not hasattr(tokenizers.Tokenizer, "from_str"):
        raise TokenizerError(f"tokenizers {tokenizers.__version__} is installed: its reworked Python API has no "
                             "Tokenizer.from_str, token_to_id or pipeline, which helixtok inspects a tokenizer "
                             "with; install the 0.x release: pip install 'tokenizers<1'")
    return tokenizers.Tokenizer


def tokenizer_from_bytes(data: bytes, where: str):
    Tokenizer = reference_library()
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise TokenizerError(f"{where}: not a tokenizers tokenizer.json ({str(e).splitlines()[0][:200]}); "
                             "pass the tokenizer.json of a HF tokenizer") from e


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
                      sha256: str | None = None) -> TokenizerInfo:
    """What a build needs to know of a tokenizer: special ids, vocabulary size, dtype, whether long
    documents may be cut.  add_bos None: what the tokenizer's post-processor puts before a single
    sequence (Llama 3: <|begin_of_text|>; GPT-2: nothing), as tokenizer(text) does in transformers.
    sha256: the held bytes (hold_bytes) to inspect; else the file is read and its bytes held
    (the caller releases them: release_bytes(info.sha256))."""
    path = resolve_tokenizer_path(spec)
    if sha256 is None:
        sha256 = hold_bytes(read_tokenizer(path))
    tok = tokenizer_from_bytes(tokenizer_bytes(sha256), path)
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:
        raise TokenizerError(f"{path}: tokenizer has an empty vocabulary")
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]

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
        lead = _post_processor_bos(tok)
        add_bos, rule = lead is not None, "tokenizer"
        if lead is not None and bos_token is None:
            bos_token = tok.id_to_token(lead)
    bos = pick(bos_token, "bos_token", BOS_CANDIDATES, "bos", add_bos)
    pad = pick(pad_token, "pad_token", PAD_CANDIDATES, "pad", False) or eos
    info = TokenizerInfo(
        path=path, sha256=sha256, vocab_size=max(vocab.values()) + 1,
        eos_id=vocab[eos], eos_token=eos, pad_id=vocab[pad], pad_token=pad,
        bos_id=vocab[bos] if bos else None, bos_token=bos, add_bos=add_bos, bos_rule=rule,
        splittable=_splits_exactly(tok), special_tokens=special_tokens, reference_version=reference_version(),
    )
    _handed.clear()
    _handed[sha256] = tok
    return info


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
    for a, b in _PROBES:
        whole = tok.encode(a + b, add_special_tokens=False).ids
        parts = tok.encode(a, add_special_tokens=False).ids + tok.encode(b, add_special_tokens=False).ids
        if whole != parts:
            return False
    return True


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
