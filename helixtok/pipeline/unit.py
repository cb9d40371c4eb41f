"""One work unit in a tokenizing process: read it, tokenize it, pack it and write its final shards; what every
worker (or a build without workers) runs, with the journal entry that makes it resumable."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
from functools import partial

import numpy as np

from ..format import limits
from ..format.errors import HelixtokError, InputError, InternalError, memory_error
from ..format.manifest import SOURCE_COUNTS
from ..format.objstore import expired
from .backends import forget_fast_tokenizers
from .compressed import drop_index
from .config import BuildConfig
from .encode import Encoder
from .join import known_offsets, place_unit
from .journal import done_path, write_entry
from .longdoc import LongText, stripped, utf8_len
from .pack import PACKERS
from .sources import RecordMap, StaleRange, UnitReader
from .tally import Tally
from .tokenizer import TokenizerInfo, hold_bytes, load_held, tokenizer_bytes
from .units import Unit


@dataclasses.dataclass
class Worker:
    """What a tokenizing process works with: set once per worker process (_init_worker), or by a
    build without workers in its caller's thread."""

    config: BuildConfig
    state: str  # the build's STATE folder, where a unit writes its files
    run: str  # the run id its files are named for
    counters: object  # pool.Beat (a worker), _LocalCounters (no workers) or None (a Ray task)
    encoder: Encoder | None = None
    encoder_info: TokenizerInfo | None = None  # what `encoder` was made for
    offsets: dict = dataclasses.field(default_factory=dict)  # join.known_offsets' cache
    chat_encoder: object = None  # chat.ChatEncoder of a chat build
    chat_encoder_info: TokenizerInfo | None = None


# Per thread, not per process: two builds without workers in two threads of one program must never
# tokenize with each other's options or write into each other's folders.  .worker: the Worker;
# .preloaded: the library prepare_worker loaded the tokenizer into (the fork server's thread, which
# its forked workers continue).
_here = threading.local()
# What a build sets to keep each tokenizing process on one core (here and in backends.flat_encoder).
THREAD_ENV = ("TOKENIZERS_PARALLELISM", "FASTOKENS_BPE_THREADS")


def prepare_worker(tokenizer: bytes, likely: str | None, chat: bool = False) -> None:
    """What the fork server does once for all its workers (or a worker started as its own
    interpreter for itself), while the main process checks backends: hold the tokenizer's
    bytes (the build's one read of the file: no worker reads it) and load them into the library
    the check most likely picks (a 100k vocabulary takes fastokens ~1 s; the Encoder finds it in
    the library's cache, or it is dropped unused); for a chat build, what the chat encoder reads
    of the vocabulary, which the forked workers then share."""
    from . import backends

    _one_thread()
    sha = hold_bytes(tokenizer)
    if likely is not None:
        with contextlib.suppress(Exception):  # the check will say why this library cannot be used
            backends.flat_encoder(likely, sha, "", None)
            _here.preloaded = likely
    if chat:
        with contextlib.suppress(Exception):  # a worker meets the same failure again, and says it
            _chat_vocabulary(sha)


# A chat build's chat.Vocabulary, by the tokenizer's sha256: read once in the fork server, before
# it forks.  One entry: a long-lived program that builds with several tokenizers keeps the last.
_vocabulary: dict[str, object] = {}


def _chat_vocabulary(sha: str):
    from .chat import Vocabulary

    if sha not in _vocabulary:
        _vocabulary.clear()
        _vocabulary[sha] = Vocabulary.of(tokenizer_bytes(sha))
    return _vocabulary[sha]


def _one_thread() -> None:
    # One process per core: rayon threads inside each would oversubscribe the cores
    # (and --workers 1 means one core).  In the build's own process, build() restores it.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")


def _init_worker(config: BuildConfig, state_dir: str, run_id: str, counters) -> None:
    """Set up a tokenizing process: a worker (counters: its pool.Beat), or the build's own."""
    _one_thread()
    _here.worker = Worker(config, state_dir, run_id, counters)


def end_worker() -> None:
    """A build without workers is done: its encoder (its tokenizer: ~100 MB for a 100k vocabulary)
    goes with this thread's Worker, and a chat build's vocabulary with it."""
    _here.__dict__.clear()
    _vocabulary.clear()


# A chat build's counts per split (docs/format.md): conversations kept, cut to --seq-len
# (--truncate), longer than --seq-len and dropped, with no token to train on (dropped), and the
# tokens that train.
CHAT_COUNTS = ("conversations", "turn_samples", "truncated", "truncated_turns", "dropped_too_long", "no_trainable",
               "trainable_tokens")


def _chat_encoder(w: Worker, info: TokenizerInfo):
    """This process's ChatEncoder: ids from the build's backend, the vocabulary read once per build
    (_chat_vocabulary), and tokenizers' Tokenizer loaded only where byte lengths cannot give offsets."""
    from .chat import ChatEncoder

    if w.chat_encoder_info != info:
        w.chat_encoder = ChatEncoder(w.config.chat, partial(load_held, info.sha256), w.config.seq_len, info.dtype,
                                     ids_fn=_encoder(w, info)._encode, vocab=_chat_vocabulary(info.sha256))
        w.chat_encoder_info = info
    return w.chat_encoder


def _encoder(w: Worker, info: TokenizerInfo) -> Encoder:
    """The Encoder for `info` of this process (the backend is chosen after the workers start)."""
    if w.encoder_info != info:
        if _here.__dict__.pop("preloaded", info.backend) != info.backend:  # loaded for nothing
            forget_fast_tokenizers()
        w.encoder, w.encoder_info = Encoder(info, max_piece_chars=w.config.max_piece_chars), info
    return w.encoder


def _bump(counters, b: int, d: int, t: int) -> None:
    if counters is not None:
        counters.bump(b, d, t)


def _alive(counters) -> None:
    """Proof of life for the stall bound between batches (each conversation rendered: a slow
    template's batch may take longer than --stall-timeout, each render bounded by limits)."""
    if (alive := getattr(counters, "alive", None)) is not None:
        alive()


_HASH_STEP = 1 << 20
UNIT_FILE_TOKENS = 1 << 60  # a unit's output stays one file per split, whatever its size


def split_cut(cfg: BuildConfig) -> float | int:
    """A document goes to val when its split hash is below this: --val-fraction's share of the 2^64
    hashes (a double, as docs/format.md says), or --val-size's threshold (val_threshold)."""
    return cfg.val_cut if cfg.val_size else cfg.val_fraction * 2.0**64


def _split_of(text: str, cut: float | int, seed: int) -> int:
    # Content hash: identical documents always land in the same split, so none is in both.
    return int(split_hash((text[i: i + _HASH_STEP] for i in range(0, len(text), _HASH_STEP)), seed) < cut)


def split_hash(pieces, seed: int) -> int:
    """The split hash of a text given in pieces (the hash of the pieces' bytes is the text's)."""
    h = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little"))
    for p in pieces:
        h.update(p.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def kept(text: str, cfg: BuildConfig) -> tuple[str, int | None]:
    """A document as tokenized (stripped with --strip) and its split (0 train, 1 val); split None:
    skipped, being empty.  (A LongText is split by kept_long.)"""
    if cfg.strip:
        text = text.strip()
    if not text or text.isspace():
        return text, None
    return text, _split_of(text, split_cut(cfg), cfg.split_seed) if cfg.has_val else 0


def kept_long(text: LongText, cfg: BuildConfig):
    """kept() for a document read in pieces: (a function giving its pieces as tokenized, its split)."""
    pieces = (lambda: stripped(text.pieces())) if cfg.strip else text.pieces
    return pieces, int(split_hash(pieces(), cfg.split_seed) < split_cut(cfg)) if cfg.has_val else 0


def smallest_split_hashes(unit: Unit, cfg: BuildConfig, n: int) -> list[int]:
    """The n smallest split hashes of a unit's documents, as the build would split them (--val-size's
    first pass: read and hashed, nothing tokenized)."""
    import heapq

    plain = dataclasses.replace(cfg, val_size=0, val_fraction=0.0)  # kept() as the build keeps, unsplit

    def hashes():
        for text in UnitReader(unit, cfg.text_field, Tally(), long_bytes=cfg.long_doc_bytes, mapper=RecordMap.of(cfg)):
            if isinstance(text, LongText):
                yield split_hash(kept_long(text, plain)[0](), cfg.split_seed)
                continue
            text, s = kept(text, plain)
            if s is not None:
                yield split_hash((text,), cfg.split_seed)
    return heapq.nsmallest(n, hashes())


def run_unit(unit: Unit, info: TokenizerInfo, where: tuple[int, int] | None = None) -> dict:
    """Tokenize one unit into its shards, named for this run; returns (and journals) what they hold.
    where: (its shard group, the group's first unit): when every unit before it in the group is
    journaled as it ends, its ids go straight from memory to their place in the group's shards
    (its entry then carries the placement as "placed"); else they are written to its own file,
    and placed from there later (join.place_unit).

    Every failure leaves as a HelixtokError naming the unit: a Rust panic or MemoryError could
    not even be pickled back to the parent.
    """
    try:
        try:
            return _run_unit(unit, info, where)
        except StaleRange:
            if not unit.aux:
                raise
            # The cached seek index led elsewhere than planned: drop it and read the range again
            # without it (decompressing up to it); what the first reading wrote is replaced.
            drop_index(unit.aux)
            return _run_unit(dataclasses.replace(unit, aux=""), info, where)
    except StaleRange:
        raise InputError(f"{_where(unit)}: changed while the build read it (the range read does not match "
                         "the plan); rerun when the corpus is stable") from None
    except OSError as e:
        if expired(e):
            raise InputError(f"{_where(unit)}: changed while the build read it; rerun when the corpus is "
                             "stable") from None
        raise
    except (HelixtokError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - includes pyo3's PanicException
        if (err := memory_error(e, f"tokenizing {_where(unit)}")) is not None:
            raise err from None
        # Not a fault of the input (those are InputErrors, or counted skips): a bug, here or in a
        # library.  Said so, with where its traceback is kept to be reported.
        msg = (str(e).splitlines() or [""])[0][:200]
        log = _keep_traceback(unit)
        raise InternalError(f"internal error while tokenizing {_where(unit)} (work unit {unit.index}): "
                            f"{type(e).__name__}: {msg}; not a fault of the input: please report it"
                            + (f", with the traceback kept in {log}" if log else "")) from None


def _run_unit(unit: Unit, info: TokenizerInfo, where: tuple[int, int] | None) -> dict:
    w: Worker = _here.worker
    enc = _encoder(w, info)
    cfg, state, counters, run = w.config, w.state, w.counters, w.run
    splits = ("train", "val") if cfg.has_val else ("train",)
    L = cfg.seq_len
    # The unit's output, one file per split (and sidecar), named for this run (an orphan of an
    # earlier run can never write into it); its ids are placed into its shard group's shards
    # (join.py), from memory when they can be.  `path` names it apart from those ("u..."): where a
    # Ray task uploads it.
    outs = {s: PACKERS[cfg.packing](os.path.join(state, f"u{unit.index:06d}.{run}.{s}"), f"u{unit.index:06d}-{s}",
                                    info.dtype, L, UNIT_FILE_TOKENS // L * L, cfg.tail_len, info.pad_id,
                                    hold=limits.HOLD_BYTES if where else 0, chat=cfg.chat is not None)
            for s in splits}
    docs = {s: 0 for s in splits}
    tokens = {s: 0 for s in splits}
    text_bytes = {s: 0 for s in splits}  # UTF-8 bytes of the documents as tokenized
    tally = Tally(strict=cfg.strict)
    reader = UnitReader(unit, cfg.text_field, tally, long_bytes=None if cfg.chat else cfg.long_doc_bytes,
                        records=cfg.chat is not None, mapper=RecordMap.of(cfg), keep=cfg.keep_fields)
    fields: dict[str, dict] = {}  # --keep-fields: a document's place in the unit -> its record's fields

    def keep_fields() -> None:  # of the document last read, once it is kept
        if reader.kept:
            fields[str(reader.offset())] = reader.kept
    batch = {s: [] for s in splits}
    batch_src = {s: [] for s in splits}  # each batched document's source (UnitReader.source)
    batch_off = {s: [] for s in splits}  # and its place in the unit (UnitReader.offset: its .src entry)
    sources: dict[str, list[int]] = {}  # source -> [documents, tokens, text bytes]
    chars = 0
    last_consumed = 0

    def count(src: str, d: int, t: int, b: int) -> None:
        c = sources.setdefault(src, [0, 0, 0])
        c[0] += d
        c[1] += t
        c[2] += b

    def flush(report_bytes: bool = True) -> None:
        nonlocal chars, last_consumed
        ntok = ndoc = 0
        for s in splits:
            if not batch[s]:
                continue
            ids, lens = enc.encode(batch[s])
            outs[s].add(ids, lens, src=np.array(batch_off[s], np.uint32))
            batch_off[s].clear()
            # Counted once encoded: the libraries have (mostly) cached each text's UTF-8 by then.
            sizes = list(map(utf8_len, batch[s]))
            text_bytes[s] += sum(sizes)
            for src, n, b in zip(batch_src[s], lens.tolist(), sizes):
                count(src, 1, n, b)
            batch_src[s].clear()
            docs[s] += len(lens)
            tokens[s] += len(ids)
            ntok += len(ids)
            ndoc += len(lens)
            batch[s].clear()
        if report_bytes:
            _bump(counters, reader.consumed - last_consumed, ndoc, ntok)
            last_consumed = reader.consumed
        else:
            _bump(counters, 0, ndoc, ntok)
        chars = 0

    def read_all() -> None:
        nonlocal last_consumed, chars
        for text in reader:
            if isinstance(text, LongText):  # read, hashed and encoded in pieces: memory stays flat
                pieces, s = kept_long(text, cfg)
                s = splits[s]
                flush(report_bytes=False)  # the documents before it go first; the bytes read go below
                nbytes = [0]
                read = reader.consumed - last_consumed  # its record (and the few batched before it)
                told = [0, 0]  # bytes and tokens reported while it is encoded

                def counted(ps):  # the text's UTF-8 size, taken in the encoding pass, not a third read
                    for p in ps:
                        b = utf8_len(p)
                        nbytes[0] += b
                        step = min(b, read - told[0])  # progress (and proof of life) piece by piece
                        told[0] += step
                        _bump(counters, step, 0, 0)
                        yield p

                def write(ids) -> None:
                    outs[s].write_long(ids)
                    told[1] += len(ids)
                    _bump(counters, 0, 0, len(ids))

                outs[s].start_long(reader.offset())
                keep_fields()
                n = enc.encode_stream(counted(pieces()), write)
                outs[s].end_long(n)
                docs[s] += 1
                tokens[s] += n
                text_bytes[s] += nbytes[0]
                count(reader.source(), 1, n, nbytes[0])
                _bump(counters, read - told[0], 1, n - told[1])
                last_consumed = reader.consumed
                continue
            text, s = kept(text, cfg)
            if s is None:
                tally.add("empty", reader.where())
                continue
            batch[splits[s]].append(text)
            batch_src[splits[s]].append(reader.source())
            batch_off[splits[s]].append(reader.offset())
            keep_fields()
            chars += len(text)
            if chars >= cfg.batch_chars:
                flush()
        flush()

    chat = {s: dict.fromkeys(CHAT_COUNTS, 0) for s in splits} if cfg.chat else None

    def read_chats() -> None:
        """Chat rows: each rendered with the template and tokenized once (chat.py), its mask beside."""
        nonlocal chars, last_consumed
        enc_chat = _chat_encoder(w, info)
        pend = {s: ([], [], [], [], []) for s in splits}  # ids, masks, sources, text bytes, places in the unit

        def add_sample(got) -> None:
            nonlocal chars
            s = splits[_split_of(got.whole or got.text, split_cut(cfg), cfg.split_seed) if cfg.has_val
                       else 0]
            c = chat[s]
            if got.too_long:
                c["dropped_too_long"] += 1
                return
            trainable = int(got.mask.sum())
            if not trainable:
                c["no_trainable"] += 1
                return
            c["conversations"] += 1
            c["truncated"] += got.truncated
            c["truncated_turns"] += got.dropped_turns > 0
            c["turn_samples"] += got.whole is not None
            c["trainable_tokens"] += trainable
            nb = utf8_len(got.text)
            text_bytes[s] += nb
            pend[s][0].append(got.ids)
            pend[s][1].append(got.mask)
            pend[s][2].append(reader.source())
            pend[s][3].append(nb)
            pend[s][4].append(reader.offset())
            keep_fields()
            chars += len(got.text)

        def flush_chats() -> None:
            nonlocal chars, last_consumed
            ntok = ndoc = 0
            for s in splits:
                ids, masks, srcs, nbytes, offs = pend[s]
                if not ids:
                    continue
                lens = np.fromiter(map(len, ids), np.int64, len(ids))
                outs[s].add(np.concatenate(ids), lens, mask=np.concatenate(masks), src=np.array(offs, np.uint32))
                for src, n, b in zip(srcs, lens.tolist(), nbytes):
                    count(src, 1, n, b)
                docs[s] += len(ids)
                tokens[s] += int(lens.sum())
                ntok += int(lens.sum())
                ndoc += len(ids)
                ids.clear(), masks.clear(), srcs.clear(), nbytes.clear(), offs.clear()
            _bump(counters, reader.consumed - last_consumed, ndoc, ntok)
            last_consumed = reader.consumed
            chars = 0

        for record in reader:
            got = enc_chat.samples(record)
            _alive(counters)
            if isinstance(got, str):
                tally.add("not_a_conversation", f"{reader.where()} ({got})")
                continue
            for sample in got:  # one, or one per assistant turn (--chat-split turns)
                add_sample(sample)
            if chars >= cfg.batch_chars:
                flush_chats()
        flush_chats()

    try:
        read_chats() if cfg.chat else read_all()
        shards = {s: outs[s].close() for s in splits}
        placed = _place_or_spill(unit, shards, {s: o.files.held for s, o in outs.items() if o.files.held}, where,
                                 w, info)
    except BaseException as e:
        for o in outs.values():
            o.abort()  # closed now: a retry of this unit writes the same paths afresh
        if isinstance(e, StaleRange):  # read again: what this reading counted is taken back
            _bump(counters, -last_consumed, -sum(docs.values()), -sum(tokens.values()))
        raise
    _bump(counters, unit.est_bytes - last_consumed, 0, 0)  # close the gap of estimated sizes
    # The entry records each file's size and sha256: a resume trusts a file only when it still
    # hashes to it (after a power loss, too: the unit's files are not fsynced, the shards are).
    result = {"index": unit.index, "run": run, "shards": shards,
              "counts": {s: vars(outs[s].counts) for s in splits}, "documents": docs, "tokens": tokens,
              "text_bytes": text_bytes, "lines": reader.lines, "skipped": tally.to_json(),
              "sources": {k: dict(zip(SOURCE_COUNTS, v)) for k, v in sources.items()}}
    if chat is not None:
        result["chat"] = chat
    if fields:
        result["fields"] = fields
    write_entry(done_path(state, unit.index), result)
    return {**result, "placed": placed} if placed else result


def _place_or_spill(unit: Unit, shards: dict, held: dict, where, w: Worker, info: TokenizerInfo) -> dict | None:
    """The unit's ids still in memory (`held`: split -> HeldIds) written once: into its group's
    shards if its offsets are known now (its placement), else into its own files (None)."""
    if not held:
        return None
    pos = known_offsets(w.state, where[0], where[1], unit.index, w.offsets) if where else None
    if pos is not None:
        # Each split on its own: one may be held while the other went to its file (past limits.HOLD_BYTES).
        return place_unit({"index": unit.index, "shards": shards}, where[0], pos, w.state, info.dtype, w.config,
                          held=held)
    for s, ids in held.items():
        shards[s][-1].update(ids.spill())
    return None


def _keep_traceback(unit: Unit) -> str | None:
    """The traceback being handled, written to uNNNNNN.error.log in the state folder: its path."""
    import traceback

    w = getattr(_here, "worker", None)
    if w is None:
        return None
    path = os.path.join(w.state, f"u{unit.index:06d}.error.log")
    try:
        with open(path, "w") as fh:
            fh.write(traceback.format_exc())
    except OSError:
        return None
    return path


def _where(u: Unit) -> str:
    return u.files[0] + (f" (+{len(u.files) - 1} files)" if len(u.files) > 1 else "")


class _LocalCounters(list):
    """The inline run's progress counters: bytes, documents, tokens; `hook` is told of each change."""

    hook = None

    def bump(self, b: int, d: int, t: int) -> None:
        self[0] += b
        self[1] += d
        self[2] += t
        if self.hook is not None:
            self.hook()
