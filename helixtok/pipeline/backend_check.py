"""Which library a build tokenizes with: the fastest one that gives tokenizers' ids here."""

from __future__ import annotations

import dataclasses

from ..format.errors import InputError, TokenizerError
from .backends import Stopped
from .config import BuildConfig
from .longdoc import LongText
from .sources import RecordMap, StaleRange, UnitReader
from .tally import Tally
from .tokenizer import TokenizerInfo
from .units import Unit

SAMPLE_UNITS, SAMPLE_CHARS = 8, 1 << 20
SAMPLE_LINE_BYTES = 4 << 20  # longer JSON lines are not sampled (the long hostile inputs cover long text)


def sample_texts(units: list[Unit], config: BuildConfig, tok=None) -> list[str]:
    """Documents from up to SAMPLE_UNITS evenly spaced units (their first SAMPLE_CHARS / k chars);
    a chat build's: its rows rendered, the pieces between the template's special tokens (what
    its backend encodes; `tok` says which tokens are special)."""
    cheap = [u for u in units if not u.skip_bytes]  # reaching those means decompressing up to them
    picked = cheap[::max(1, len(cheap) // SAMPLE_UNITS)][:SAMPLE_UNITS]
    head = SAMPLE_CHARS // SAMPLE_UNITS  # tokenizers' Encodings take ~100 bytes a character: keep them few
    chat = None
    if config.chat is not None:
        from .chat import ChatEncoder

        chat = ChatEncoder(config.chat, tok, config.seq_len, "uint32")
    sample: list[str] = []
    mapper = RecordMap.of(config)  # a --map build tokenizes what its function gives
    for u in picked:
        got, texts = 0, []
        try:
            for row in UnitReader(u, config.text_field, Tally(), long_bytes=config.long_doc_bytes,
                                  skip_lines_over=SAMPLE_LINE_BYTES, records=chat is not None, mapper=mapper):
                new = [p[:head] for p in chat.pieces(row)] if chat is not None else \
                    [row.head(head) if isinstance(row, LongText) else row[:head]]
                texts += new
                got += sum(map(len, new))
                if got >= head:
                    break
        except (StaleRange, InputError):  # a damaged seek index or input: the unit's worker reads it again
            continue                      # and reports what is wrong, in corpus order (--strict: the first)
        sample += texts
    return sample


def choose_backend(info: TokenizerInfo, units: list[Unit], config: BuildConfig,
                   executor=None, stop=None) -> tuple[TokenizerInfo, dict]:
    """Pick the backend: the fastest library that gives tokenizers' ids on a sample of this
    corpus and the hostile sets (checked here, recorded in the manifest); else tokenizers.
    With an `executor` (the build's pool.WorkerPool), the fastest library's ids come from a worker.
    `stop` (a threading.Event): set, the check ends at its next step with Stopped."""
    from concurrent.futures import ThreadPoolExecutor

    from .backends import (FAST, NO_LONG_VERDICT, answers, backend_version, cached_verdict, digests_apart,
                           flat_encoder, hf_answers, hf_tokenizer, judge, needs_long, parity_texts, remember_verdict,
                           texts_digest)

    hf = dataclasses.replace(info, backend="hf", backend_version=backend_version("hf"))
    if config.backend == "hf":
        return hf, {"chosen": "hf", "reason": "--backend hf"}
    tok = hf_tokenizer(info.sha256, info.special_tokens)
    sample = sample_texts(units, config, tok)
    texts = parity_texts(tok, sample)
    digest = texts_digest(texts)
    names = FAST if config.backend == "auto" else (config.backend,)
    versions = {name: backend_version(name) for name in names}
    key = (info.sha256, info.special_tokens)
    verdict_key = {name: (name, ver, info.sha256, info.special_tokens, digest) for name, ver in versions.items()}
    tried, hf_long, apart, want = {}, None, [], None

    def chosen(name: str) -> tuple[TokenizerInfo, dict]:
        return dataclasses.replace(info, backend=name, backend_version=versions[name]), {
            "chosen": name, "reason": "same ids as tokenizers on the corpus sample and the hostile sets",
            "sample_documents": len(sample), "rejected": tried}

    # tokenizers' ids of the sample, the slow half of the check, are made in a thread (its encode
    # releases the GIL) while the backend answers, here or in a worker; the long inputs are
    # encoded in other processes meanwhile (see digests_apart), stopped once not needed.  A
    # verdict this machine has reached on the same texts (a rerun, a resumed build, another task
    # of the corpus) is taken as it is: none of that runs.
    with ThreadPoolExecutor(1, thread_name_prefix="helixtok-check") as side:
        try:
            for name in names:
                if stop is not None and stop.is_set():
                    raise Stopped()
                ver = versions[name]
                known = cached_verdict(*verdict_key[name]) if ver is not None else None
                if known is not None:
                    if known[0]:
                        return chosen(name)
                    tried[name] = known[1]
                    continue
                if want is None:
                    want = side.submit(hf_answers, tok, texts, stop)
                # The workers have loaded the first library's tokenizer (_warm): spare this process
                # loading it too (0.5 s for a 100k vocabulary).
                in_worker = executor is not None and name == FAST[0] and ver is not None
                if not in_worker:
                    encode, ver, why = flat_encoder(name, info.sha256, info.special_tokens, tok)
                    if encode is None:
                        tried[name] = why
                        continue
                theirs = None
                if needs_long(name, ver, info.sha256, info.special_tokens):  # started first, encoded beside the answers
                    if hf_long is None:
                        hf_long = digests_apart("hf", *key, executor, config.stall_seconds)
                        apart.append(hf_long)
                    theirs = digests_apart(name, *key, executor, config.stall_seconds)
                    apart.append(theirs)
                got = (executor.submit(worker_answers, name, info.sha256, info.special_tokens, texts,
                                       what=f"checking {name} against tokenizers", urgent=True).result()
                       if in_worker else answers(encode, texts))
                ok, why = judge(name, ver, info.sha256, info.special_tokens, texts, (got, theirs),
                                (want.result(), hf_long))
                if why != NO_LONG_VERDICT:
                    remember_verdict(*verdict_key[name], (ok, why))
                if ok:
                    return chosen(name)
                tried[name] = why
                if theirs is not None:
                    theirs.drop()  # refused on the sample: its long inputs no longer matter
        finally:
            for a in apart:
                a.drop()
    if config.backend != "auto":
        raise TokenizerError(f"{info.path}: --backend {config.backend} is not exact for this tokenizer "
                             f"({tried[config.backend]}); use --backend hf")
    return hf, {"chosen": "hf", "reason": "no faster backend is exact here", "rejected": tried,
                "sample_documents": len(sample)}


def worker_answers(name: str, sha: str, special: str, texts: list[str]):
    """A backend's answers for the check, computed in a worker process that has (or will reuse)
    its tokenizer loaded: the main process never loads it (0.5 s for a 100k vocabulary)."""
    from .backends import answers, flat_encoder

    encode, _, why = flat_encoder(name, sha, special, None)
    return answers(encode, texts) if encode is not None else why
