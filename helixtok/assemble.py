"""Assembly: the units' spill files, fed in unit order while later units still tokenize, into shards."""

from __future__ import annotations

import os
import queue
import threading

import numpy as np

from .config import BuildConfig
from .errors import HelixtokError
from .pack import PackCounts, StreamPacker, document_chunks
from .shards import ShardWriter
from .tokenizer import TokenizerInfo

ASSEMBLY_TOKENS = 1 << 22  # tokens per slice when assembling: memory stays flat (16 MiB at uint32)


class _Split:
    """One split's writer, packer and counts."""

    def __init__(self, dest: str, split: str, info: TokenizerInfo, config: BuildConfig):
        L = config.seq_len
        chunks_per_shard = max(1, config.shard_bytes // (L * info.dtype.itemsize))
        self.writer = ShardWriter(dest, split, info.dtype, L, chunks_per_shard,
                                  "valid" if config.packing == "document" else "docs")
        self.packer = StreamPacker(self.writer, L, info.dtype)
        self.counts = PackCounts()
        self.produced = self.documents = self.text_bytes = 0


class Assembler:
    """Packs units' spill files into shards in `dest` (inside STATE until published).

    `add` takes journal entries in any order and assembles the finished prefix in unit order, so
    the copy into shards overlaps the tokenizing of later units instead of following it.  With
    `background`, it assembles in a thread of its own: for a build that tokenizes in this very
    process, whose thread is busy (the copies, hashing and writes release the GIL).
    """

    def __init__(self, dest: str, info: TokenizerInfo, config: BuildConfig, state: str, indices: list[int],
                 *, background: bool = False):
        self.info, self.config, self.state = info, config, state
        names = ("train", "val") if config.val_fraction > 0 else ("train",)
        self.splits = {s: _Split(dest, s, info, config) for s in names}
        self.indices = indices  # the units, in the order their tokens go into the shards
        self.done = 0  # how many of them are assembled
        self.waiting: dict[int, dict] = {}
        self._queue = self._thread = None
        self._error: BaseException | None = None
        self._stop = False  # the build is failing: assemble nothing more
        if background:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._behind, name="helixtok-assembly", daemon=True)
            self._thread.start()

    def add(self, result: dict) -> None:
        """Assemble what `result` completes; in the background, raise the assembly's error at
        the next unit, so a failed write stops the build early."""
        if self._thread is None:
            return self._take(result)
        if self._error is not None:
            raise self._error
        self._queue.put(result)

    def _behind(self) -> None:
        while (r := self._queue.get()) is not None:
            if self._error is None and not self._stop:
                try:
                    self._take(r)
                except BaseException as e:  # noqa: BLE001 - raised in the build's thread
                    self._error = e

    def _join(self) -> None:
        """Wait until the thread has stopped: nothing writes into `dest` after this."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _take(self, result: dict) -> None:
        self.waiting[result["index"]] = result
        while self.done < len(self.indices) and self.indices[self.done] in self.waiting:
            r = self.waiting.pop(self.indices[self.done])
            try:
                for name, sp in self.splits.items():
                    self._add_split(sp, r, name)
            except BaseException:
                self._abort_writers()
                raise
            self.done += 1

    def _add_split(self, sp: _Split, r: dict, split: str) -> None:
        cfg, dtype, L = self.config, self.info.dtype, self.config.seq_len
        sp.text_bytes += r["text_bytes"][split]
        tok_path, len_path = (os.path.join(self.state, n) for n, *_ in r["spill"][split])
        if os.path.getsize(len_path) == 0:
            return
        lens_all = np.fromfile(len_path, dtype="<i8")
        ends = np.cumsum(lens_all)
        sp.documents += len(lens_all)
        sp.produced += int(ends[-1])
        total = int(ends[-1])
        if os.path.getsize(tok_path) != total * dtype.itemsize:
            raise HelixtokError(f"{tok_path}: not the size its journal says (changed during the build?); rerun")
        # Mapped, not read: the packer hands the writer views of the spill file, so a token is
        # copied once on its way into a shard.  One slice of ~ASSEMBLY_TOKENS is mapped at a time
        # (packed: any token range; document packing: whole documents): memory stays flat.
        def window(a: int, b: int) -> np.ndarray:
            return np.memmap(tok_path, dtype=dtype, mode="r", offset=a * dtype.itemsize, shape=(b - a,)).view(np.ndarray)

        if cfg.packing == "packed":
            doc_starts = sp.packer.pos + np.concatenate(([0], ends[:-1]))
            for t in range(0, total, ASSEMBLY_TOKENS):
                sp.packer.add(window(t, min(total, t + ASSEMBLY_TOKENS)), doc_starts)
        else:
            d0 = 0
            while d0 < len(lens_all):
                base = int(ends[d0 - 1]) if d0 else 0
                d1 = max(d0 + 1, int(np.searchsorted(ends, base + ASSEMBLY_TOKENS, side="right")))
                chunks, valid, c = document_chunks(window(base, int(ends[d1 - 1])), lens_all[d0:d1], L, cfg.tail_len,
                                                   self.info.pad_id)
                sp.counts.add(c)
                sp.writer.write(chunks, valid=valid)
                d0 = d1

    def finish(self) -> dict:
        """Close the last shards; returns the manifest's `splits`."""
        self._join()
        if self._error is not None:
            raise self._error
        if self.waiting or self.done != len(self.indices):
            self.abort()
            raise HelixtokError(f"internal error: assembled {self.done} of {len(self.indices)} units")
        out = {}
        for name, sp in self.splits.items():
            try:
                shards = sp.writer.finish()
            except BaseException:
                self.abort()
                raise
            if self.config.packing == "packed":
                sp.counts.dropped_tokens = len(sp.packer.carry)  # only the final remainder (< seq_len) is lost
            out[name] = {
                "num_chunks": sp.writer.num_chunks, "num_tokens": sp.writer.num_chunks * self.config.seq_len,
                "documents": sp.documents, "tokens": sp.produced, "pad_tokens": sp.counts.pad_tokens,
                "text_bytes": sp.text_bytes, "dropped_tokens": sp.counts.dropped_tokens,
                "dropped_documents": sp.counts.dropped_documents, "shards": shards,
            }
        return out

    def abort(self) -> None:
        self._stop = True
        self._join()
        self._abort_writers()

    def _abort_writers(self) -> None:
        for sp in self.splits.values():
            sp.writer.abort()
