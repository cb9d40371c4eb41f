"""Encode documents with the chosen backend: batches into one id array, long documents in pieces, EOS/BOS added."""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Iterable, Iterator

import numpy as np

from ..format.errors import TokenizerError
from .tokenizer import TokenizerInfo


def cut_points(text: str, max_chars: int) -> list[int]:
    """Cut positions for a long text, each just before a space that follows a non-space and
    precedes a letter: a pre-token boundary for byte-level BPE (GPT-2, Llama 3 style) and
    Metaspace tokenizers, so the pieces encode to the same ids as the whole."""
    cuts = []
    pos = 0
    n = len(text)
    while n - pos > max_chars:
        target = pos + max_chars
        cut = -1
        lo = pos + max_chars // 2
        i = text.rfind(" ", lo, target)
        while i > lo:
            if not text[i - 1].isspace() and i + 1 < n and text[i + 1].isalpha():
                cut = i
                break
            i = text.rfind(" ", lo, i)
        if cut < 0:  # no boundary in the window: look further on
            i = text.find(" ", target)
            while i != -1:
                if not text[i - 1].isspace() and i + 1 < n and text[i + 1].isalpha():
                    cut = i
                    break
                i = text.find(" ", i + 1)
        if cut < 0:
            break
        cuts.append(cut)
        pos = cut
    return cuts


class Encoder:
    """Encodes batches of documents into one id array plus per-document lengths (EOS/BOS added)."""

    def __init__(self, info: TokenizerInfo, *, max_piece_chars: int, group_chars: int | None = None):
        self.info = info
        from .backends import flat_encoder, hf_tokenizer

        # The fast libraries load the file themselves; tokenizers is needed only where it encodes.
        self.tok = hf_tokenizer(info.sha256, info.special_tokens) if info.backend in ("hf", "tiktoken") else None
        self.dtype = info.dtype
        self.max_piece_chars = max_piece_chars
        # Characters per library call.  fastokens and gigatoken answer in flat id arrays: the
        # caller's whole batch goes in one call (it is bounded: a worker's batch_chars plus one
        # document under long_doc_bytes).  tokenizers' and tiktoken's answers are per-text objects
        # (an Encoding takes ~100 bytes a character): their calls stay at max_piece_chars.
        flat = info.backend in ("fastokens", "gigatoken")
        self.group_chars = group_chars or (sys.maxsize if flat else max_piece_chars)
        # encode_batch_fast (inside hf) skips offset tracking, which we never use: ~25% faster.
        self._encode, _, why = flat_encoder(info.backend, info.sha256, info.special_tokens, self.tok)
        if self._encode is None:
            raise TokenizerError(f"{info.path}: backend {info.backend} unavailable: {why}")

    @property
    def splittable(self) -> bool:
        """The tokenizer's cut rule holds (TokenizerInfo.splittable), probed with this encoder's own
        library (checked to give tokenizers' ids) the first time a long document asks."""
        if self.info.splittable is None:
            from .tokenizer import splits_exactly

            self.info = dataclasses.replace(self.info, splittable=splits_exactly(lambda t: self._encode([t])[0]))
        return self.info.splittable

    def _pieces(self, docs: list[str]) -> Iterator[tuple[int, str]]:
        """(document index, text piece), made lazily: a huge document is never held twice."""
        for d, text in enumerate(docs):
            if len(text) > self.max_piece_chars and self.splittable:
                bounds = [0, *cut_points(text, self.max_piece_chars), len(text)]
                for a, b in zip(bounds, bounds[1:]):
                    yield d, text[a:b]
            else:
                yield d, text

    def _flat(self, texts: list[str]) -> np.ndarray:
        return self._encode(texts)[0].astype(self.dtype, copy=False)

    def encode_stream(self, pieces: Iterable[str], write: Callable[[np.ndarray], object]) -> int:
        """Encode one document given as text pieces, handing its ids (BOS/EOS included) to
        `write` a group at a time; returns how many.  The same ids as encode([joined text]):
        cuts fall only on cut_points of the text seen so far, so memory stays flat."""
        if not self.splittable:  # no exact cut rule: the whole text, as encode() does
            ids, _ = self.encode(["".join(pieces)])
            write(ids)
            return len(ids)
        n = 0

        def emit(arr: np.ndarray) -> None:
            nonlocal n
            write(arr)
            n += len(arr)

        if self.info.add_bos:
            emit(np.array([self.info.bos_id], dtype=self.dtype))
        carry = ""
        for piece in pieces:
            carry += piece
            if len(carry) > self.max_piece_chars:
                cuts = cut_points(carry, self.max_piece_chars)
                if cuts:
                    bounds = [0, *cuts]
                    emit(self._flat([carry[a:b] for a, b in zip(bounds, bounds[1:])]))
                    carry = carry[cuts[-1]:]
        emit(self._flat([carry]))
        emit(np.array([self.info.eos_id], dtype=self.dtype))
        return n

    def encode(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Returns (ids, lengths): ids of all docs concatenated, each [BOS] + text + EOS.

        Memory: the documents, plus about twice their ids (a 50 MB document: 2.4x its size
        at most), because pieces are encoded in groups of about group_chars characters —
        an Encoding costs ~100 bytes per token, so one call over 50 MB would hold GBs."""
        flats, owner, piece_lens = [], [], []
        group: list[str] = []
        size = 0

        def encode_group() -> None:
            ids, lens_ = self._encode(group)
            flats.append(ids.astype(self.dtype, copy=False))
            piece_lens.append(lens_)
            group.clear()

        for d, piece in self._pieces(docs):
            if group and size + len(piece) > self.group_chars:
                encode_group()
                size = 0
            group.append(piece)
            owner.append(d)
            size += len(piece)
        if group:
            encode_group()
        plens = np.concatenate(piece_lens) if piece_lens else np.empty(0, np.int64)
        lens = np.bincount(np.asarray(owner, dtype=np.int64), weights=plens, minlength=len(docs)).astype(np.int64)
        # One pass into the result: each document's ids land between its BOS and EOS slots
        # (np.insert, twice, cost ~3x as much: a boolean mask over every id each time).
        bos = int(self.info.add_bos)
        lens += 1 + bos
        ends = np.cumsum(lens)
        out = np.empty(int(ends[-1]) if len(ends) else 0, self.dtype)
        out[ends - 1] = self.info.eos_id
        if bos:
            out[ends - lens] = self.info.bos_id
        at = (ends - lens + bos).tolist()  # where each document's next id goes
        owners = iter(owner)
        for ids, pl in zip(flats, piece_lens):
            src = 0
            for n in pl.tolist():  # pieces in order: a document's pieces follow each other
                d = next(owners)
                out[at[d]: at[d] + n] = ids[src: src + n]
                at[d] += n
                src += n
        flats.clear()
        return out, lens
