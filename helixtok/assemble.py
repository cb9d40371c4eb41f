"""Assembly: the units' spill files, fed in unit order while later units still tokenize, into shards."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading

import numpy as np

from .config import BuildConfig
from .errors import HelixtokError
from .manifest import write_json_atomic
from .pack import PackCounts, StreamPacker, document_chunks
from .shards import ShardWriter
from .tokenizer import TokenizerInfo

ASSEMBLY_TOKENS = 1 << 22  # tokens per slice when assembling: memory stays flat (16 MiB at uint32)
# Assembled tokens between checkpoints (64 MiB at uint32); each costs a flush and a small JSON,
# and lets the spill files of the units it covers go.
CHECKPOINT_TOKENS = 1 << 24
CHECKPOINT = "assembly.json"
IN_FLIGHT = 4  # results handed to the assembly thread and not yet taken


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

    def mark(self) -> dict:
        return {"writer": self.writer.mark(), "packer": self.packer.mark(), "counts": vars(self.counts).copy(),
                "produced": self.produced, "documents": self.documents, "text_bytes": self.text_bytes}

    def reopen(self, mark: dict) -> bool:
        if not self.writer.reopen(mark["writer"]):
            return False
        self.packer.reopen(mark["packer"])
        self.counts = PackCounts(**mark["counts"])
        self.produced, self.documents, self.text_bytes = mark["produced"], mark["documents"], mark["text_bytes"]
        return True


class Assembler:
    """Packs units' spill files into shards in `dest` (inside STATE until published).

    `add` takes journal entries in any order and assembles the finished prefix in unit order, so
    the copy into shards overlaps the tokenizing of later units instead of following it.  With
    `background`, it assembles in a thread of its own: for a build that tokenizes in this very
    process, whose thread is busy (the copies, hashing and writes release the GIL).

    Every CHECKPOINT_TOKENS it records where it stands in STATE/assembly.json and deletes the
    spill files of the units assembled: a resumed build goes on from there (`resumed`), and the
    spill files' pages are reused for the shards' instead of the page cache holding every token twice.
    """

    def __init__(self, dest: str, info: TokenizerInfo, config: BuildConfig, state: str, indices: list[int],
                 *, background: bool = False):
        self.info, self.config, self.state = info, config, state
        names = ("train", "val") if config.val_fraction > 0 else ("train",)
        self.splits = {s: _Split(dest, s, info, config) for s in names}
        self.indices = indices  # the units, in the order their tokens go into the shards
        self.done = 0  # how many of them are assembled
        self.waiting: dict[int, dict] = {}
        self.assembled_before: set[int] = set()  # the units a resumed assembly had assembled
        self._spent: list[dict] = []  # units assembled since the last checkpoint
        self._since = 0  # their tokens
        self._queue = self._thread = None
        self._error: BaseException | None = None
        self._stop = False  # the build is failing: assemble nothing more
        if background:
            self._start()

    def _start(self) -> None:
        # The build waits while the thread has IN_FLIGHT results to take: tokens handed over in
        # memory never pile up (the thread takes every result in turn, so this cannot deadlock).
        self._in_flight = threading.Semaphore(IN_FLIGHT)
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._behind, name="helixtok-assembly", daemon=True)
        self._thread.start()

    @classmethod
    def resumed(cls, dest: str, info: TokenizerInfo, config: BuildConfig, state: str, indices: list[int],
                *, background: bool = False) -> "Assembler | None":
        """The assembly a stopped build checkpointed in `state`, reopened; None if there is none
        or its files do not hold what it records (after a power loss): then assemble afresh."""
        try:
            with open(os.path.join(state, CHECKPOINT)) as fh:
                mark = json.load(fh)
            if mark["units"] != len(indices) or not 0 <= mark["done"] <= len(indices):
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self = cls(dest, info, config, state, indices)
        if set(mark["splits"]) != set(self.splits):
            return None
        try:
            ok = all(sp.reopen(mark["splits"][name]) for name, sp in self.splits.items())
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            self._stop_writers()
            return None
        self.done = mark["done"]
        self.assembled_before = set(indices[:self.done])
        if background:
            self._start()
        return self

    def add(self, result: dict) -> None:
        """Assemble what `result` completes; in the background, raise the assembly's error at
        the next unit, so a failed write stops the build early."""
        if self._thread is None:
            return self._take(result)
        if self._error is not None:
            raise self._error
        self._in_flight.acquire()
        self._queue.put(result)

    def _behind(self) -> None:
        while (r := self._queue.get()) is not None:
            if self._error is None and not self._stop:
                try:
                    self._take(r)
                except BaseException as e:  # noqa: BLE001 - raised in the build's thread
                    self._error = e
            self._in_flight.release()

    def _join(self) -> None:
        """Wait until the thread has stopped: nothing writes into `dest` after this."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _take(self, result: dict) -> None:
        if result["index"] in self.assembled_before:
            return  # assembled before this build resumed
        self.waiting[result["index"]] = result
        while self.done < len(self.indices) and self.indices[self.done] in self.waiting:
            r = self.waiting.pop(self.indices[self.done])
            try:
                for name, sp in self.splits.items():
                    self._add_split(sp, r, name)
                r.pop("memory", None)  # the build keeps its results: not their tokens
                self.done += 1
                self._spent.append(r)
                self._since += sum(r["tokens"].values())
                if self._since >= CHECKPOINT_TOKENS:
                    self._checkpoint()
            except BaseException:
                self._stop_writers()
                raise

    def _checkpoint(self) -> None:
        """Record where the assembly stands (its files flushed), then delete the spill files it
        no longer needs.  Not fsynced, like the spill files: after a power loss `resumed`
        finds the shard being written shorter than recorded, or other bytes, and refuses it."""
        write_json_atomic(os.path.join(self.state, CHECKPOINT), {
            "done": self.done, "units": len(self.indices),  # which units: plan.json's, the same on resume
            "splits": {name: sp.mark() for name, sp in self.splits.items()}}, durable=False)
        for r in self._spent:
            for files in r["spill"].values():
                for n, *_ in files:
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(self.state, n))
        self._spent, self._since = [], 0

    def _add_split(self, sp: _Split, r: dict, split: str) -> None:
        cfg, dtype, L = self.config, self.info.dtype, self.config.seq_len
        sp.text_bytes += r["text_bytes"][split]
        if split in r.get("memory", ()):  # tokenized in this process: the arrays themselves
            held_ids, held_lens = r["memory"][split]
            if not held_lens:
                return
            ids = np.concatenate(held_ids) if len(held_ids) > 1 else held_ids[0]
            lens_all = np.concatenate(held_lens) if len(held_lens) > 1 else held_lens[0]

            def window(a: int, b: int) -> np.ndarray:
                return ids[a:b]
            tok_size = ids.nbytes
        else:
            tok_path, len_path = (os.path.join(self.state, n) for n, *_ in r["spill"][split])
            if os.path.getsize(len_path) == 0:
                return
            lens_all = np.fromfile(len_path, dtype="<i8")
            tok_size = os.path.getsize(tok_path)

            # Mapped, not read: the packer hands the writer views of the spill file, so a token is
            # copied once on its way into a shard.  One slice of ~ASSEMBLY_TOKENS is mapped at a
            # time (packed: any token range; document packing: whole documents): memory stays flat.
            def window(a: int, b: int) -> np.ndarray:
                return np.memmap(tok_path, dtype=dtype, mode="r", offset=a * dtype.itemsize,
                                 shape=(b - a,)).view(np.ndarray)
        ends = np.cumsum(lens_all)
        sp.documents += len(lens_all)
        sp.produced += int(ends[-1])
        total = int(ends[-1])
        if tok_size != total * dtype.itemsize:
            raise HelixtokError(f"unit {r['index']}: its tokens are not the size its journal says (spill file "
                                "changed during the build?); rerun")

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
        # Every shard is committed: a build stopped while publishing them goes on from here.
        self._checkpoint()
        return out

    def abort(self) -> None:
        """Stop: what is written stays, for a resumed build to go on from the last checkpoint."""
        self._stop = True
        self._join()
        self._stop_writers()

    def _stop_writers(self) -> None:
        for sp in self.splits.values():
            sp.writer.stop()
