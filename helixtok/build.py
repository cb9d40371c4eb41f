"""Orchestrate a build: plan work units, tokenize them in worker processes, pack, shard, manifest last.

Data flow: files -> units -> worker: read + tokenize -> spill files + journal entry per unit
-> ordered assembly: pack + shard -> manifest.json (atomic, last).  The journal makes an
interrupted build resumable: finished units are never redone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import __version__
from .config import BuildConfig
from .errors import ConfigError, HelixtokError, InputError
from .manifest import DOC_SKIPS, FORMAT_VERSION, MANIFEST, REPAIRS, write_json_atomic
from .pack import PackCounts, document_chunks, packed_chunks
from .shards import ShardWriter, fsync_dir
from .sources import Tally, Unit, UnitReader, discover, plan_units
from .tokenizer import Encoder, TokenizerInfo, inspect_tokenizer

STATE = ".helixtok-partial"
OWN_FILES = (".bin", ".docs", ".valid", ".tmp")
ASSEMBLY_TOKENS = 1 << 24  # tokens per slice when assembling: keeps memory flat


@dataclass
class Progress:
    """What the progress callback receives: bytes of input done out of total, and counts."""

    bytes_done: int
    bytes_total: int
    documents: int
    tokens: int
    units_done: int
    units_total: int
    phase: str


# --------------------------------------------------------------------------- worker side

_W: dict = {}


def _init_worker(info: TokenizerInfo, config: BuildConfig, state_dir: str, counters, inline: bool) -> None:
    if not inline:
        # The parent handles Ctrl-C and stops us; a KeyboardInterrupt traceback per worker helps nobody.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One process per core: rayon threads inside each would oversubscribe the cores
    # (and --workers 1 means one core).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _W.update(encoder=Encoder(info, max_piece_chars=config.max_piece_chars), config=config,
              state=state_dir, counters=counters, parent=os.getppid() if not inline else None)


def _bump(counters, b: int, d: int, t: int) -> None:
    if counters is None:
        return
    with counters.get_lock():
        counters[0] += b
        counters[1] += d
        counters[2] += t


def _split_of(text: str, fraction: float, seed: int) -> int:
    # Content hash: identical documents always land in the same split, so none is in both.
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=seed.to_bytes(8, "little"))
    return int(int.from_bytes(h.digest(), "little") < fraction * 2.0**64)


def unit_paths(state: str, index: int, split: str) -> tuple[str, str]:
    stem = os.path.join(state, f"u{index:06d}.{split}")
    return stem + ".tok", stem + ".len"


def run_unit(unit: Unit) -> dict:
    """Tokenize one unit into spill files; the journal entry (u*.done.json) is written last."""
    enc: Encoder = _W["encoder"]
    cfg: BuildConfig = _W["config"]
    state, counters = _W["state"], _W["counters"]
    splits = ("train", "val") if cfg.val_fraction > 0 else ("train",)
    files = {s: [open(p + ".part", "wb") for p in unit_paths(state, unit.index, s)] for s in splits}
    docs = {s: 0 for s in splits}
    tokens = {s: 0 for s in splits}
    tally = Tally()
    reader = UnitReader(unit, cfg.text_field, tally)
    batch = {s: [] for s in splits}
    chars = 0
    last_consumed = 0

    def flush() -> None:
        nonlocal chars, last_consumed
        if _W["parent"] is not None and os.getppid() != _W["parent"]:
            os._exit(1)  # the build was killed: an orphan must not race the resumed build's files
        ntok = ndoc = 0
        for s in splits:
            if not batch[s]:
                continue
            ids, lens = enc.encode(batch[s])
            files[s][0].write(ids.data)
            files[s][1].write(lens.astype("<i8").data)
            docs[s] += len(lens)
            tokens[s] += len(ids)
            ntok += len(ids)
            ndoc += len(lens)
            batch[s].clear()
        _bump(counters, reader.consumed - last_consumed, ndoc, ntok)
        last_consumed = reader.consumed
        chars = 0

    for text in reader:
        if not text or text.isspace():
            tally.add("empty", reader.where())
            continue
        s = _split_of(text, cfg.val_fraction, cfg.split_seed) if cfg.val_fraction > 0 else 0
        batch[splits[s]].append(text)
        chars += len(text)
        if chars >= cfg.batch_chars:
            flush()
    flush()
    _bump(counters, unit.est_bytes - last_consumed, 0, 0)  # close the gap of estimated sizes
    for s in splits:
        for fh in files[s]:
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        for p in unit_paths(state, unit.index, s):
            os.replace(p + ".part", p)
    result = {"index": unit.index, "documents": docs, "tokens": tokens, "skipped": tally.to_json()}
    write_json_atomic(os.path.join(state, f"u{unit.index:06d}.done.json"), result)
    return result


# --------------------------------------------------------------------------- main side


def _prepare_out(out: str, plan: dict, overwrite: bool) -> bool:
    """Make OUT ready; returns True when an unfinished build with the same plan can resume."""
    state = os.path.join(out, STATE)
    if not os.path.exists(out):
        os.makedirs(out)
        return False
    if not os.path.isdir(out):
        raise ConfigError(f"{out}: exists and is not a folder")
    entries = os.listdir(out)
    if not entries:
        return False
    if overwrite:
        for e in entries:
            p = os.path.join(out, e)
            if e == STATE:
                shutil.rmtree(p)
            elif e in (MANIFEST, "tokenizer.json") or e.endswith(OWN_FILES):
                os.remove(p)
        return False
    if os.path.isfile(os.path.join(out, MANIFEST)):
        raise ConfigError(f"{out}: already holds a finished dataset; pass --overwrite to replace it")
    plan_path = os.path.join(state, "plan.json")
    if os.path.isfile(plan_path):
        with open(plan_path) as fh:
            old = json.load(fh)
        if old == plan:
            return True
        raise ConfigError(f"{out}: holds an unfinished build with other inputs or options "
                          f"({_describe_change(old, plan)}); pass --overwrite to discard it")
    raise ConfigError(f"{out}: folder is not empty ({len(entries)} entries); choose an empty or new folder, "
                      "or pass --overwrite")


def _describe_change(old: dict, new: dict) -> str:
    for k in ("config", "tokenizer_sha256", "helixtok"):
        if old.get(k) != new.get(k):
            if isinstance(old.get(k), dict):
                diffs = [f"{kk}: {old[k].get(kk)!r} -> {new[k].get(kk)!r}"
                         for kk in sorted(set(old[k]) | set(new[k])) if old[k].get(kk) != new[k].get(kk)]
                return ", ".join(diffs)
            return f"{k} changed"
    of = {f[0]: f[1:] for f in old.get("files", [])}
    nf = {f[0]: f[1:] for f in new.get("files", [])}
    added = sorted(set(nf) - set(of))
    gone = sorted(set(of) - set(nf))
    changed = sorted(k for k in set(of) & set(nf) if of[k] != nf[k])
    parts = []
    if added:
        parts.append(f"new input {added[0]}" + (f" and {len(added) - 1} more" if len(added) > 1 else ""))
    if gone:
        parts.append(f"input gone: {gone[0]}" + (f" and {len(gone) - 1} more" if len(gone) > 1 else ""))
    if changed:
        parts.append(f"input modified: {changed[0]}" + (f" and {len(changed) - 1} more" if len(changed) > 1 else ""))
    return "; ".join(parts) or "work units changed"


def _run_units(units: list[Unit], pending: list[Unit], info: TokenizerInfo, config: BuildConfig, state: str,
               on_progress: Callable[[Progress], None] | None, done_bytes: int) -> None:
    total_bytes = sum(u.est_bytes for u in units)
    # Largest first, so the last unit to finish is a small one (output order does not depend on this).
    order = sorted(pending, key=lambda u: (-u.est_bytes * (4 if u.kind in ("jsonl.gz", "jsonl.zst") else 1), u.index))
    n_workers = min(config.num_workers, max(1, len(order)))
    units_done = len(units) - len(pending)
    t_last = 0.0

    def report(counters, units_done, force=False):
        nonlocal t_last
        now = time.monotonic()
        if on_progress and (force or now - t_last > 0.1):
            t_last = now
            on_progress(Progress(done_bytes + counters[0], total_bytes, counters[1], counters[2],
                                 units_done, len(units), "tokenize"))

    if n_workers == 1:  # inline: no pool, easy to debug and profile
        counters = _LocalCounters([0, 0, 0])
        _init_worker(info, config, state, counters, inline=True)
        for u in order:
            run_unit(u)
            units_done += 1
            report(counters, units_done, force=True)
        return

    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # never fork a process that may hold tokenizer threads
    counters = ctx.Array("q", 3)
    pool = ProcessPoolExecutor(n_workers, mp_context=ctx, initializer=_init_worker,
                               initargs=(info, config, state, counters, False))
    futures = {}
    try:
        futures = {pool.submit(run_unit, u): u for u in order}
        remaining = set(futures)
        last, last_change = None, time.monotonic()
        while remaining:
            finished, remaining = wait(remaining, timeout=0.2, return_when=FIRST_COMPLETED)
            for f in finished:
                try:
                    f.result()
                except BrokenProcessPool as e:
                    u = futures[f]
                    raise HelixtokError(
                        f"a worker process died while tokenizing {_where(u)}; "
                        "it was killed (out of memory?); rerun the same command to resume") from e
                units_done += 1
            report(counters, units_done, force=bool(finished))
            # A hung worker (deadlock, stuck network file system) must not hang the build.
            now_state = (tuple(counters[:]), units_done)
            if now_state != last:
                last, last_change = now_state, time.monotonic()
            elif time.monotonic() - last_change > config.stall_seconds:
                running = [futures[f] for f in remaining if f.running()]
                where = _where(running[0]) if running else "its input"
                raise HelixtokError(f"no progress for {config.stall_seconds:g} s: a worker seems hung while "
                                    f"tokenizing {where}; rerun the same command to resume "
                                    "(or raise --stall-timeout for huge documents)")
    except BaseException:
        for f in futures:
            f.cancel()
        # Stop workers now rather than after their current unit (Ctrl-C, a failed or hung unit);
        # SIGKILL also ends a stopped process, which SIGTERM would not.
        for p in list(getattr(pool, "_processes", {}).values()):
            p.kill()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _where(u: Unit) -> str:
    return u.files[0] + (f" (+{len(u.files) - 1} files)" if len(u.files) > 1 else "")


class _LocalCounters(list):
    """The inline run's progress counters: the shared Array's interface, without a lock."""

    def get_lock(self):
        return contextlib.nullcontext()


def _assemble(out: str, units: list[Unit], info: TokenizerInfo, config: BuildConfig, state: str) -> dict:
    L = config.seq_len
    dtype = info.dtype
    chunks_per_shard = max(1, config.shard_bytes // (L * dtype.itemsize))
    splits = ("train", "val") if config.val_fraction > 0 else ("train",)
    out_splits = {}
    for split in splits:
        writer = ShardWriter(out, split, dtype, L, chunks_per_shard,
                             "valid" if config.packing == "document" else "docs")
        counts = PackCounts()
        produced = documents = 0
        carry = np.empty(0, dtype)
        pending_starts = np.empty(0, np.int64)
        pos = 0  # tokens of this split's stream seen so far (packed)
        try:
            for u in units:
                tok_path, len_path = unit_paths(state, u.index, split)
                if os.path.getsize(len_path) == 0:
                    continue
                ids_all = np.memmap(tok_path, dtype=dtype, mode="r")
                lens_all = np.fromfile(len_path, dtype="<i8")
                ends = np.cumsum(lens_all)
                documents += len(lens_all)
                produced += int(ends[-1])
                d0 = 0
                while d0 < len(lens_all):  # slices of whole documents, ~ASSEMBLY_TOKENS each
                    base = int(ends[d0 - 1]) if d0 else 0
                    d1 = max(d0 + 1, int(np.searchsorted(ends, base + ASSEMBLY_TOKENS, side="right")))
                    ids = np.asarray(ids_all[base: int(ends[d1 - 1])])
                    lens = lens_all[d0:d1]
                    if config.packing == "packed":
                        starts = pos + np.concatenate(([0], np.cumsum(lens)[:-1]))
                        written = writer.num_chunks * L
                        chunks, carry = packed_chunks(carry, ids, L)
                        all_starts = np.concatenate((pending_starts, starts)) - written
                        cut = np.searchsorted(all_starts, len(chunks) * L)
                        writer.write(chunks, doc_starts=all_starts[:cut])
                        pending_starts = all_starts[cut:] + written
                        pos += len(ids)
                    else:
                        chunks, valid, c = document_chunks(ids, lens, L, config.tail_len, info.pad_id)
                        counts.add(c)
                        writer.write(chunks, valid=valid)
                    d0 = d1
                del ids_all
            shards = writer.finish()
        except BaseException:
            writer.abort()
            raise
        if config.packing == "packed":
            counts.dropped_tokens = len(carry)  # only the final remainder (< seq_len) is lost
        counts.chunks = writer.num_chunks
        out_splits[split] = {
            "num_chunks": writer.num_chunks, "num_tokens": writer.num_chunks * L,
            "documents": documents, "tokens": produced, "pad_tokens": counts.pad_tokens,
            "dropped_tokens": counts.dropped_tokens, "dropped_documents": counts.dropped_documents,
            "shards": shards,
        }
    return out_splits


SAMPLE_UNITS, SAMPLE_CHARS = 8, 1 << 20


def _choose_backend(info: TokenizerInfo, units: list[Unit], config: BuildConfig) -> tuple[TokenizerInfo, dict]:
    """Pick the backend: tiktoken only where it gives HF's ids on a sample of this corpus."""
    import dataclasses

    from .backends import parity, tiktoken_encoding
    from .errors import TokenizerError
    from .tokenizer import load_tokenizer

    if config.backend == "hf":
        return info, {"chosen": "hf", "reason": "--backend hf"}
    enc, why = tiktoken_encoding(info.path)
    sample_docs = 0
    if enc is not None:
        # Documents from up to SAMPLE_UNITS evenly spaced units (their first SAMPLE_CHARS / k chars).
        step = max(1, len(units) // SAMPLE_UNITS)
        sample: list[str] = []
        for u in units[::step][:SAMPLE_UNITS]:
            got = 0
            for text in UnitReader(u, config.text_field, Tally()):
                sample.append(text[: SAMPLE_CHARS // SAMPLE_UNITS])
                got += len(sample[-1])
                if got >= SAMPLE_CHARS // SAMPLE_UNITS:
                    break
        sample_docs = len(sample)
        ok, why = parity(load_tokenizer(info.path), enc, sample)
        if ok:
            return dataclasses.replace(info, backend="tiktoken"), {
                "chosen": "tiktoken", "reason": "same ids as tokenizers on the sample", "sample_documents": sample_docs}
    if config.backend == "tiktoken":
        raise TokenizerError(f"{info.path}: --backend tiktoken is not exact for this tokenizer ({why}); use --backend hf")
    return info, {"chosen": "hf", "reason": why, "sample_documents": sample_docs}


def build(inputs: list[str], out: str, tokenizer: str, config: BuildConfig, *, overwrite: bool = False,
          on_progress: Callable[[Progress], None] | None = None, task: tuple[int, int] | None = None) -> dict:
    """Build a dataset in `out` from corpus paths; returns the manifest (also written to out/manifest.json).

    task=(k, n) builds only the k-th of n contiguous partitions of the work units (see merge.py).
    """
    info = inspect_tokenizer(tokenizer, eos_token=config.eos_token, bos_token=config.bos_token,
                             pad_token=config.pad_token, add_bos=config.add_bos)
    files, warnings = discover(inputs, exclude=out)
    units, plan_warn = plan_units(files, unit_bytes=config.unit_bytes, text_field=config.text_field)
    warnings.merge(plan_warn)
    if config.strict and warnings.counts:
        reason = sorted(warnings.counts)[0]
        raise InputError(f"{warnings.examples[reason][0]}: {reason.replace('_', ' ')} (--strict)")
    if not units:
        raise InputError(f"no documents to read in {' '.join(inputs)}")
    info, backend_check = _choose_backend(info, units, config)
    partition_info = None
    if task is not None:
        from .merge import partition

        k, n = task
        a, b = partition(units, n)[k]
        partition_info = {"task_index": k, "num_tasks": n, "units": [a, b], "units_total": len(units)}
        names = {nm for u in units[a:b] for nm in u.names}
        units = units[a:b]
        files = [f for f in files if f.name in names]
    plan = {
        "partition": partition_info,
        "helixtok": __version__, "format_version": FORMAT_VERSION, "config": config.identity(),
        "tokenizer_sha256": info.sha256, "backend": info.backend, "files": [[f.name, f.size, f.mtime_ns] for f in files],
        "units": [u.to_json() for u in units],
    }
    resume = _prepare_out(out, plan, overwrite)
    state = os.path.join(out, STATE)
    os.makedirs(state, exist_ok=True)
    if not resume:
        write_json_atomic(os.path.join(state, "plan.json"), plan)

    def done_path(u: Unit) -> str:
        return os.path.join(state, f"u{u.index:06d}.done.json")

    pending = [u for u in units if not os.path.isfile(done_path(u))]
    if not units:  # a task with nothing to do (more tasks than work units) still leaves a valid, empty part
        pending = []
    done_bytes = sum(u.est_bytes for u in units if u not in pending)
    _run_units(units, pending, info, config, state, on_progress, done_bytes)

    results = []
    tally = Tally()
    for u in units:
        with open(done_path(u)) as fh:
            r = json.load(fh)
        results.append(r)
        unit_tally = Tally.from_json(r["skipped"])
        if config.strict and unit_tally.counts:
            reason = sorted(unit_tally.counts)[0]
            raise InputError(f"{unit_tally.examples[reason][0]}: {reason.replace('_', ' ')} (--strict)")
        tally.merge(unit_tally)
    if on_progress:
        on_progress(Progress(sum(u.est_bytes for u in units), sum(u.est_bytes for u in units),
                             sum(sum(r["documents"].values()) for r in results),
                             sum(sum(r["tokens"].values()) for r in results), len(units), len(units), "write"))

    splits = _assemble(out, units, info, config, state)
    if splits["train"]["num_chunks"] == 0 and task is None:
        raise InputError(f"the corpus gave {splits['train']['tokens']} tokens, not one chunk of "
                         f"--seq-len {config.seq_len}; lower --seq-len or add text")
    shutil.copyfile(info.path, os.path.join(out, ".tokenizer.json.tmp"))
    os.replace(os.path.join(out, ".tokenizer.json.tmp"), os.path.join(out, "tokenizer.json"))

    totals = {k: sum(s[k] for s in splits.values())
              for k in ("documents", "tokens", "pad_tokens", "dropped_tokens", "dropped_documents", "num_chunks")}
    totals["chunks"] = totals.pop("num_chunks")
    totals["stored_tokens"] = totals["chunks"] * config.seq_len
    totals["skipped_documents"] = sum(tally.counts.get(r, 0) for r in DOC_SKIPS)
    totals["repaired_documents"] = sum(tally.counts.get(r, 0) for r in REPAIRS)
    manifest = {
        "format_version": FORMAT_VERSION,
        "helixtok_version": __version__,
        "dtype": "uint16" if info.dtype.itemsize == 2 else "uint32",
        "seq_len": config.seq_len,
        "packing": config.packing,
        "min_tail_len": config.tail_len if config.packing == "document" else None,
        "tokenizer": {**info.to_json(), "file": "tokenizer.json", "backend_check": backend_check},
        "options": {"text_field": config.text_field, "val_fraction": config.val_fraction,
                    "split_seed": config.split_seed, "shard_bytes": config.shard_bytes,
                    "unit_bytes": config.unit_bytes, "max_piece_chars": config.max_piece_chars},
        "inputs": {"files": len(files), "bytes": sum(f.size for f in files), "units": len(units),
                   "list": [{"name": f.name, "bytes": f.size} for f in files]},
        **({"partition": partition_info} if partition_info else {}),
        "splits": splits,
        "totals": totals,
        "skipped": tally.to_json(),
        "warnings": warnings.to_json(),
    }
    fsync_dir(out)  # shard renames are durable before the manifest says they exist
    write_json_atomic(os.path.join(out, MANIFEST), manifest)
    fsync_dir(out)
    shutil.rmtree(state)
    return manifest
