"""A tokenizer.json: where a name points (file, model folder, local HF cache), its sha256, and the
reference library's Tokenizer of it (what a dataset stores, and what its readers and the build load)."""

from __future__ import annotations

import hashlib
import os
import re

from .errors import TokenizerError


# Files that ship beside a tokenizer.json and are passed for it.
_NOT_THE_TOKENIZER = {"tokenizer_config.json": "settings (special tokens, chat template)",
                      "special_tokens_map.json": "special-token map", "config.json": "model config",
                      "generation_config.json": "generation settings"}


def resolve_tokenizer_path(spec: str) -> str:
    """A tokenizer.json path, a folder holding one, or a HF repo id already in the local cache."""
    if os.path.isfile(spec) and os.path.basename(spec) in _NOT_THE_TOKENIZER:
        beside = os.path.join(os.path.dirname(spec), "tokenizer.json")
        raise TokenizerError(f"{spec}: the tokenizer's {_NOT_THE_TOKENIZER[os.path.basename(spec)]}, not the tokenizer; "
                             + (f"pass the tokenizer.json beside it: --tokenizer {beside}" if os.path.isfile(beside)
                                else "pass the model's tokenizer.json (or the folder holding both)"))
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


def sha256_file(path: str) -> str:
    return sha256_stream(open(path, "rb"))


def sha256_stream(fh) -> str:
    """sha256 of what an open binary reader (local file or object) holds; closes it."""
    h = hashlib.sha256()
    with fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


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
