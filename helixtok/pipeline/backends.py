"""Tokenizer backends: HF tokenizers (the reference), and faster libraries used only where they give its ids."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import subprocess
import threading
from functools import lru_cache
from itertools import chain

import numpy as np

from . import preload
from .tokenizer import load_held, reference_version, tokenizer_bytes

# The pre-tokenizer regex of HF's ByteLevel(use_regex=True): GPT-2's pattern.
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Text the parity check always includes: the corners where two BPE implementations drift apart.
HOSTILE = [
    "", " ", "  \n\n\t ", "a", "\u00e9\u0301", "日本語のテキスト", "😀👍🏽👨‍👩‍👧", "\x00\x01\x7f", "\ufffd\ufeff",
    "It's they'LL we'Re I'M", "   leading", "trailing   ", "line\r\nline\rline\n", "1234567890 3.14159 1e-9",
    "<|endoftext|> inside text", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "x" * 2000 + " " * 300 + "y",
    "def f(x):\n    return {'a': [1, 2]}\n", "ÜBER straße Ωμέγα Привет مرحبا", "\u2028\u2029\u200b\u00a0",
]


# tiktoken's regex backtracks without limit on a long whitespace run (it fails near 1 MiB of
# spaces); a text holding a run this long is encoded by tokenizers instead: the same ids by definition.
WS_RUN = 100_000
_LONG_WS = re.compile(r"(?<!\s)\s{%d}|^\s{%d}" % (WS_RUN, WS_RUN))  # only run starts are tried: linear


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-unicode table, as HF's ByteLevel uses it.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def tiktoken_encoding(sha: str):
    """A tiktoken Encoding equivalent in structure to a byte-level BPE tokenizer.json (the held bytes `sha`).

    Returns (encoding, None), or (None, reason) when the tokenizer is not of that shape or
    tiktoken is not installed. Structure is necessary, not sufficient: callers check parity.
    """
    try:
        import tiktoken
    except ImportError:
        return None, "tiktoken is not installed (pip install tiktoken)"
    spec = json.loads(tokenizer_bytes(sha))
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("dropout"):
        return None, "model is not a plain BPE"
    if spec.get("normalizer"):
        return None, "tokenizer has a normalizer"
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
        return None, "pre-tokenizer is not GPT-2 style ByteLevel"
    dec = _byte_decoder()
    ranks = {}
    try:
        for tok, i in model["vocab"].items():
            ranks[bytes(dec[c] for c in tok)] = i
    except KeyError:
        return None, "vocabulary has tokens outside the byte-level alphabet"
    if len(ranks) != len(model["vocab"]) or any(bytes([b]) not in ranks for b in range(256)):
        return None, "vocabulary lacks some single bytes"
    # tiktoken merges by the rank of the merged token: that is HF's merge order only when ids
    # grow with the merges list.
    merges = model.get("merges") or []
    ids = []
    for m in merges:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        merged = model["vocab"].get(a + b)
        if merged is None:
            return None, "a merge produces a token missing from the vocabulary"
        ids.append(merged)
    if any(x >= y for x, y in zip(ids, ids[1:])):
        return None, "token ids do not follow the merge order"
    specials = {}
    for t in spec.get("added_tokens") or []:
        if not t.get("special") or t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            return None, f"added token {t['content']!r} has options tiktoken cannot mirror"
        specials[t["content"]] = t["id"]
    try:
        enc = tiktoken.Encoding(name="helixtok", pat_str=GPT2_PAT, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as e:  # noqa: BLE001 - any refusal by tiktoken means: not this backend
        return None, f"tiktoken refused the vocabulary ({e})"
    return enc, None


def hf_tokenizer(sha: str, special: str):
    """A tokenizers Tokenizer that treats special-token strings inside a document per `special`:
    "text" encodes them as ordinary characters (no hidden boundaries or control tokens from
    crawled text), "extract" turns them into their special ids (for corpora with markup)."""
    tok = load_held(sha)
    tok.encode_special_tokens = special == "text"
    return tok


def hf_ids(tok, texts: list[str], group: int | None = None) -> list[list[int]]:
    """tokenizers' ids of each text; `group` texts at a time (their Encodings take ~100 bytes a
    character, so a 1 MiB sample encoded at once would hold ~100 MB)."""
    fn = getattr(tok, "encode_batch_fast", tok.encode_batch)
    step = group or max(1, len(texts))
    return [e.ids for i in range(0, len(texts), step) for e in fn(texts[i: i + step], add_special_tokens=False)]


def tiktoken_ids(enc, texts: list[str], special: str = "text", tok=None) -> list[list[int]]:
    """tiktoken's ids under the same special-token policy; with `tok`, texts holding a long
    whitespace run go to tokenizers (see WS_RUN)."""
    out = []
    for t in texts:
        if tok is not None and len(t) >= WS_RUN and _LONG_WS.search(t):
            out.append(hf_ids(tok, [t])[0])
        elif special == "text":
            out.append(enc.encode_ordinary(t))
        else:
            out.append(enc.encode(t, allowed_special="all"))
    return out


def special_probes(tok) -> list[str]:
    """Every special and added token of the tokenizer placed inside text, as crawled text holds them."""
    toks = sorted(t.content for t in tok.get_added_tokens_decoder().values())
    return [f"x{t}y {t} z{t}" for t in toks] + [" ".join(toks)]


# Long inputs on which libraries fail or drift (regex backtracking, stack depth, chunking): the
# fast backends must match tokenizers on these too before they are used.
LONG_HOSTILE_VERSION = 1  # bump when LONG_HOSTILE changes: cached verdicts then no longer apply
LONG_HOSTILE = [" " * (1 << 20), "\n" * 300_000, "x" * (1 << 20), "7" * 200_000, "日本語" * 100_000,
                "😀" * 50_000, "a\x00b " * 50_000]

# The fast backends --backend auto tries, fastest first (measured: docs/performance.md).
FAST = ("fastokens", "gigatoken", "tiktoken")


def _flat(id_lists: list) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter(map(len, id_lists), dtype=np.int64, count=len(id_lists))
    return np.fromiter(chain.from_iterable(id_lists), dtype=np.uint32, count=int(lens.sum())), lens


def _library(name: str) -> str:
    """The PyPI package behind a backend name."""
    return {"hf": "tokenizers"}.get(name, name)


def backend_version(name: str) -> str | None:
    """'library version' of a backend, as the manifest records it; None if it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    lib = _library(name)
    try:
        return f"{lib} {version(lib)}"
    except PackageNotFoundError:
        return None


def flat_encoder(name: str, sha: str, special: str, tok):
    """(encode, version, None): encode(texts) -> (ids uint32 of all texts concatenated, lengths),
    for the held tokenizer bytes `sha`; or (None, None, why) when this backend cannot load the
    tokenizer or is not installed."""
    lib = _library(name)
    ver = backend_version(name)
    if ver is None:
        return None, None, f"{lib} is not installed (pip install {lib})"
    if name == "hf":
        return (lambda texts: _flat(hf_ids(tok, texts))), ver, None
    if name == "tiktoken":
        enc, why = tiktoken_encoding(sha)
        if enc is None:
            return None, None, why
        return (lambda texts: _flat(tiktoken_ids(enc, texts, special, tok))), ver, None
    try:
        if name == "fastokens":
            # One thread: a build runs one worker process per core (--workers), and its own
            # thread pool would make each worker compete with the others for cores.
            os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")
            ft = _load_fast("fastokens", sha)

            def encode(texts):
                ids, offs = ft.encode_batch_flat(texts, add_special_tokens=False,
                                                 split_special_tokens=special == "text")
                return np.frombuffer(ids, dtype="<u4"), np.diff(np.frombuffer(offs, dtype="<u8")).astype(np.int64)
        else:
            gt = _load_fast("gigatoken", sha)

            def encode(texts):
                return _flat(gt.encode_batch_list(texts, parallel=False))
    except Exception as e:  # noqa: BLE001 - any refusal to load means: not this backend
        return None, None, f"{lib} cannot load this tokenizer ({type(e).__name__}: {str(e)[:80]})"
    return encode, ver, None


_LOADING = threading.Lock()


def _load_fast(lib: str, sha: str):
    """_fast_tokenizer, one caller at a time: the check's thread and an inline build's units ask
    for the same tokenizer at once, and lru_cache would load it twice."""
    with _LOADING:
        return _fast_tokenizer(lib, sha)


@lru_cache(maxsize=2)
def _fast_tokenizer(lib: str, sha: str):
    """The fast library's tokenizer of the held bytes `sha`, loaded once per process (the backend
    check and an inline build's encoder use the same one; loading a 100k vocabulary takes a
    while; a forked worker inherits the fork server's), or taken from the load started ahead of
    it (preload.py), once that has ended."""
    if lib == "fastokens":
        if (early := preload.take(sha)) is not None:
            return early
        import fastokens

        return fastokens.Tokenizer.from_json_str(tokenizer_bytes(sha).decode("utf-8"))
    import gigatoken

    return gigatoken.Tokenizer.from_json(tokenizer_bytes(sha))


def forget_fast_tokenizers() -> None:
    """Free the fast tokenizers this process loaded (for a check or ahead of one) and will not use;
    a load still under way ends first (none outlives a failed build)."""
    preload.drop()
    _fast_tokenizer.cache_clear()


def _cache_file(kind: str, *key: str) -> str:
    from .config import cache_root  # config imports this module

    # Keyed by the reference tokenizers release too: a verdict against another release says nothing here.
    digest = hashlib.sha256("|".join((*key, reference_version(), str(LONG_HOSTILE_VERSION))).encode()).hexdigest()
    return os.path.join(cache_root(), kind, digest + ".json")


def _long_parity_file(name: str, version: str, sha: str, special: str) -> str:
    return _cache_file("parity", name, version, sha, special)


def _sealed(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _read_cache(path: str):
    """A cached value, or None when absent or damaged (a torn write, an edit): each entry carries
    the sha256 of its value, and a damaged one is removed so that it is worked out again."""
    try:
        with open(path) as fh:
            got = json.load(fh)
    except OSError:
        return None
    except ValueError:
        got = None
    if isinstance(got, dict) and set(got) == {"value", "sha256"} and got["sha256"] == _sealed(got["value"]):
        return got["value"]
    with contextlib.suppress(OSError):
        os.remove(path)
    return None


def _write_cache(path: str, value) -> None:
    with contextlib.suppress(OSError):  # no writable cache: work it out again next time
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump({"value": value, "sha256": _sealed(value)}, fh)
        os.replace(tmp, path)


def _read_verdict(path: str) -> tuple[bool, str] | None:
    got = _read_cache(path)
    if isinstance(got, dict) and isinstance(got.get("ok"), bool) and isinstance(got.get("why"), str):
        return got["ok"], got["why"]
    return None


def _write_verdict(path: str, verdict: tuple[bool, str]) -> None:
    _write_cache(path, {"ok": verdict[0], "why": verdict[1]})


def cached_long_parity(name: str, version: str, sha: str, special: str) -> tuple[bool, str] | None:
    """long_parity's verdict when this machine has it, else None (`sha`: the tokenizer file's sha256)."""
    return _read_verdict(_long_parity_file(name, version, sha, special))


def _ids_digest(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<u4").tobytes()).hexdigest()


def _hf_long_file(sha: str, special: str) -> str:
    return _cache_file("hf-ids", sha, special)  # (per tokenizers release: _cache_file keys every entry by it)


def _cached_hf_long(sha: str, special: str) -> list[str] | None:
    got = _read_cache(_hf_long_file(sha, special))
    return got if isinstance(got, list) and len(got) == len(LONG_HOSTILE) and all(isinstance(d, str) for d in got) \
        else None


def hf_long_digests(tok, sha: str, special: str) -> list[str]:
    """A digest of tokenizers' ids for each LONG_HOSTILE text: the same for every backend checked
    against this tokenizer, so computed (~1 s) once per tokenizers version, file and policy."""
    got = _cached_hf_long(sha, special)
    if got is not None:
        return got
    # One text at a time: tokenizers' Encodings take ~100 bytes a character.
    digests = [_ids_digest(hf_ids(tok, [t])[0]) for t in LONG_HOSTILE]
    _write_cache(_hf_long_file(sha, special), digests)
    return digests


def long_digests(name: str, sha: str, special: str) -> list[str]:
    """`name`'s digest of its ids of each LONG_HOSTILE text, or why it failed on one (tokenizers'
    cached): what digests_apart has another process compute."""
    if name == "hf":
        return hf_long_digests(hf_tokenizer(sha, special), sha, special)
    encode, _, why = flat_encoder(name, sha, special, None)
    out = []
    for t in LONG_HOSTILE:
        got = answers(encode, [t]) if encode is not None else f"failed: {why}"
        out.append(got if isinstance(got, str) else _ids_digest(got[0]))
    return out


# The tokenizer's bytes come on stdin: the helper never reads the user's file.
_LONG_CHILD = """
import json, sys
from helixtok.pipeline.backends import long_digests
from helixtok.pipeline.tokenizer import hold_bytes
sha = hold_bytes(sys.stdin.buffer.read())
assert sha == sys.argv[2], "not the tokenizer handed"
print(json.dumps(long_digests(*sys.argv[1:4])))
"""


class Apart:
    """long_digests(name, ...) being computed in another process: call it for them (made here
    if that process failed), or drop() it when they are no longer wanted."""

    def __init__(self, args: tuple, child=None, future=None, value: list[str] | None = None, stall: float = 600):
        self._args, self._child, self._future, self._value, self._stall = args, child, future, value, stall

    def __call__(self) -> list[str]:
        if self._value is None:
            self._value = (self._future.result() if self._future is not None
                           else self._from_child() or long_digests(*self._args))
        return self._value

    def _from_child(self) -> list[str] | None:
        if self._child is None:
            return None
        from .children import communicate_while_alive

        self._child.feeder.join(self._stall)  # the child reads its input first
        if self._child.feeder.is_alive():  # stopped before reading it: computed here instead
            self._child.kill()
            self._child.feeder.join()
            self._child.communicate()
            return None
        out = communicate_while_alive(self._child, self._stall, f"checking {self._args[0]} on the long inputs")[0]
        with contextlib.suppress(ValueError):
            got = json.loads(out)
            if self._child.returncode == 0 and isinstance(got, list) and len(got) == len(LONG_HOSTILE) and all(
                    isinstance(d, str) for d in got):
                return got
        return None

    def drop(self) -> None:
        """Stop the other process's work if it is still going: a refused backend's digests would
        take a core from the build for seconds.  (Called afterwards, it computes them here.)"""
        if self._value is None and self._future is not None:
            self._future.cancel()  # a worker that already started it finishes it
        elif self._value is None and self._child is not None:
            self._child.kill()  # nothing if it has exited
            self._child.feeder.join()
            self._child.communicate()  # reaped, its pipe closed
        self._child = self._future = None


def digests_apart(name: str, sha: str, special: str, executor=None, stall: float = 600) -> Apart:
    """long_digests(name, ...), computed meanwhile in another process: a library takes up to
    ~400 bytes a character of the 1 MiB inputs, heap that a build's main process would keep.
    In a worker of `executor`, else in a child process (here if none can start or it fails).
    Call it from the thread that runs the build: the child dies with the thread that started it
    (children.die_with_parent)."""
    args = (name, sha, special)
    if name == "hf" and (got := _cached_hf_long(sha, special)) is not None:
        return Apart(args, value=got)
    if executor is not None:
        return Apart(args, future=executor.submit(long_digests, *args, what=f"checking {name} on the long inputs",
                                                  urgent=True))
    from .children import start_helper

    try:
        child = start_helper(_LONG_CHILD, *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
    except OSError:  # no interpreter to start (embedded Python)
        return Apart(args)
    child.feeder = threading.Thread(target=_feed, args=(child, tokenizer_bytes(sha)), daemon=True)
    child.feeder.start()
    return Apart(args, child=child, stall=stall)


def _feed(child: subprocess.Popen, data: bytes) -> None:
    """Write the tokenizer's bytes to a helper's stdin (a thread: the pipe holds 64 KiB at a time)."""
    try:
        with contextlib.suppress(OSError, ValueError):
            child.stdin.write(data)
    finally:
        with contextlib.suppress(OSError, ValueError):
            child.stdin.close()
        child.stdin = None  # communicate() must not flush it


def long_parity(name: str, version: str, sha: str, special: str, digests: list[str], want: list[str]
                ) -> tuple[bool, str]:
    """The verdict on LONG_HOSTILE from a backend's `digests` of it (see long_digests) against
    tokenizers' (`want`): it does not depend on the corpus, so it is cached per library
    version, tokenizer file and policy."""
    ok, why = True, ""
    for text, got, w in zip(LONG_HOSTILE, digests, want):
        if got != w:
            ok, why = False, (got if got.startswith("failed") else f"ids differ on {text[:40]!r}")
            break
    _write_verdict(_long_parity_file(name, version, sha, special), (ok, why))
    return ok, why


def texts_digest(texts: list[str]) -> str:
    """sha256 of a list of texts (each length-prefixed: ["ab"] and ["a", "b"] differ)."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _verdict_file(name: str, version: str, sha: str, special: str, digest: str) -> str:
    return _cache_file("verdict", name, version, sha, special, digest)


def cached_verdict(name: str, version: str, sha: str, special: str, digest: str) -> tuple[bool, str] | None:
    """judge's verdict on the parity texts whose texts_digest is `digest`, when this machine has it:
    a rerun, a resumed build or another task of the same corpus skips the check's encoding."""
    return _read_verdict(_verdict_file(name, version, sha, special, digest))


def remember_verdict(name: str, version: str, sha: str, special: str, digest: str, verdict: tuple[bool, str]) -> None:
    _write_verdict(_verdict_file(name, version, sha, special, digest), verdict)


def parity_texts(tok, sample: list[str]) -> list[str]:
    """What the parity check compares: HOSTILE, every special token inside text, the sample."""
    return HOSTILE + special_probes(tok) + sample


def answers(encode, texts: list[str]):
    """A backend's side of the check, computed where it is loaded: encode(texts), that is its
    (flat ids, lengths) of `texts`, or why it failed."""
    try:
        return encode(texts)
    except Exception as e:  # noqa: BLE001 - a backend that fails on some text is not exact
        return f"failed on a text ({type(e).__name__}: {str(e)[:80]})"


class Stopped(Exception):
    """The backend check was told to stop (the build it runs beside has ended)."""


def hf_answers(tok, texts: list[str], stop=None) -> tuple[np.ndarray, np.ndarray]:
    """tokenizers' side of the check, as answers() gives a backend's: (flat ids, lengths) of
    `texts`, made 64 at a time (their Encodings take ~100 bytes a character).  `stop` (an Event)
    set: ends between two groups with Stopped."""
    out = []
    for i in range(0, len(texts), 64):
        if stop is not None and stop.is_set():
            raise Stopped()
        out += hf_ids(tok, texts[i: i + 64], 64)
    return _flat(out)


NO_LONG_VERDICT = "no verdict on the long inputs"  # its cached verdict went meanwhile: not a verdict to keep


def judge(name: str, version: str, sha: str, special: str, texts: list[str], got: tuple, want: tuple
          ) -> tuple[bool, str]:
    """(True, "") when a backend's (answers, long_digests or None) in `got` are tokenizers' (`want`,
    the same from hf_answers and long_digests): for each of `texts` and, unless the verdict is
    cached (per the tokenizer file's `sha`), for LONG_HOSTILE.  The digests are functions
    (digests_apart), waited for only when the sample agrees."""
    encoded, digests = got
    if isinstance(encoded, str):
        return False, encoded
    ids, lens = encoded
    if len(lens) != len(texts) or int(np.sum(lens)) != len(ids):  # a prefix must not pass for the whole
        return False, f"gave {len(lens)} lengths and {len(ids)} ids for {len(texts)} texts"
    (want_ids, want_lens), want_digests = want
    if not (np.array_equal(lens, want_lens) and np.array_equal(ids, want_ids)):
        a, b = np.cumsum(lens) - lens, np.cumsum(want_lens) - want_lens
        for t, i, j, n, m in zip(texts, a, b, lens, want_lens):
            if not np.array_equal(ids[i: i + n], want_ids[j: j + m]):
                return False, f"ids differ on {t[:40]!r}"
    if name == "tiktoken":  # its BPE is quadratic on a 1 MiB word: long runs go to tokenizers (WS_RUN)
        return True, ""
    if digests is None:
        return cached_long_parity(name, version, sha, special) or (False, NO_LONG_VERDICT)
    return long_parity(name, version, sha, special, digests(), want_digests())


def needs_long(name: str, version: str, sha: str, special: str) -> bool:
    """Whether a backend's long_digests must be compared (no cached verdict on LONG_HOSTILE)."""
    return name != "tiktoken" and cached_long_parity(name, version, sha, special) is None
