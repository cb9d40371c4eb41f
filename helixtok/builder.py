"""Orchestrate a build: plan work units, have them tokenized, packed and written, publish, manifest last.

Data flow: files (discover.py) -> units (units.py) -> worker: read (sources.py) + tokenize +
pack + write the unit's final shards, and its journal entry (unit.py, pack.py; in pool.py's
processes, on Ray (rayexec.py) or in this one) -> publish: rename the shards into OUT,
manifest.json from the journal entries (catalog.py; atomic, last).
No step here touches a token.  The journal makes an interrupted build resumable: finished units
are never redone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import secrets
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from . import __version__, preload
from .backend_check import choose_backend
from .backends import FAST, backend_version, forget_fast_tokenizers
from .catalog import join_split, published, split_totals, unit_counts
from .config import BuildConfig, worker_bytes
from .discover import discover
from .errors import ConfigError, HelixtokError, InputError, Interrupted, resource_error
from .manifest import (DOC_SKIPS, FORMAT_VERSION, MANIFEST, REPAIRS, load_manifest, manifest_files, sum_sources,
                       write_json_atomic)
from .merge import check_sibling_parts, partition
from .objstore import current, is_url
from .outdir import PUBLISH, STATE, OutLock, check_out_path, read_list, refuse_foreign, remove_owned
from .pack import BESTFIT_WINDOW
from .planid import PLAN_FILE, describe_change, encode_plan, plan_folder, whole_plan
from .pool import WorkerPool
from .publish import remote_sizes
from .shards import fsync_dir
from .sources import LineRefs
from .tally import Tally
from .tokenizer import TokenizerInfo, forget_handed, inspect_tokenizer, resolve_tokenizer_path
from .unit import THREAD_ENV, _init_worker, _LocalCounters, _W, _where, done_path, run_unit, state_files
from .units import Unit, plan_units


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
    processes: int = 1  # tokenizing (worker processes, or this one)




def _prepare_out(out: str, plan: dict, overwrite: bool, protect: list[str]) -> bool:
    """Make the locked OUT ready; returns True when an unfinished build with the same plan can resume.
    (A finished dataset without --overwrite never gets here: _up_to_date says what it is.)"""
    state = os.path.join(out, STATE)
    refuse_foreign(out)
    if overwrite:
        remove_owned(out, protect=protect)
        return False
    plan_path = os.path.join(state, "plan.json")
    if os.path.isfile(plan_path):
        try:
            with open(plan_path) as fh:
                old = json.load(fh)
        except ValueError:
            old = None
        if old == plan:
            return True
        if old is not None:
            raise ConfigError(f"{out}: holds an unfinished build with other inputs or options "
                              f"({describe_change(old, plan)}); pass --overwrite to discard it")
    # Leftovers that no plan describes (a kill before plan.json was written) are ours and useless.
    remove_owned(out)
    return False


def _trusted_results(out: str, state: str, units: list[Unit], uploaded: dict[str, int] | None = None
                     ) -> dict[int, dict]:
    """Journal entries of finished units whose shards are all there with the sizes recorded: in
    STATE, or already moved into OUT by a build stopped while publishing (publish.json names
    those), or (uploaded: object name -> size) in object storage.  Shards are fsynced before
    their entry is written (uploaded: their upload checked), so a size that matches is the data.

    Read once, at start: the lock guarantees no other build writes here, and an orphan that
    journals late only ever names its own run's files, which this run then does not use.
    """
    moved = set(read_list(os.path.join(state, PUBLISH)))
    trusted: dict[int, dict] = {}
    for u in units:
        try:
            with open(done_path(state, u.index)) as fh:
                r = json.load(fh)
            ok = r["index"] == u.index and "lines" in r and "sources" in r and "counts" in r and all(
                uploaded.get(p) == size if uploaded is not None else
                _has(os.path.join(state, n), size) or (p in moved and _has(os.path.join(out, p), size))
                for n, p, size in state_files(r))
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if ok:
            trusted[u.index] = r
    keep = {n for r in trusted.values() for n, _, _ in state_files(r)}
    for e in os.listdir(state):  # shards of runs that did not finish their unit
        if e.startswith("u") and e not in keep and not e.endswith(".done.json"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(state, e))
    return trusted


def _has(path: str, size: int) -> bool:
    return not os.path.islink(path) and os.path.isfile(path) and os.path.getsize(path) == size


class _Interrupt:
    """A stop signal while workers run (Ctrl-C; SIGTERM or SIGHUP where the command line asked to
    stop on them): note it and stop at the next poll (raised at an arbitrary point inside a wait
    on futures it could be swallowed).  A signal that is ignored, or left to its default action,
    stays so: a build started with Ctrl-C ignored (a script's background job) keeps ignoring it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.hit = 0  # the signal's number
        self._old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                if signal.getsignal(s) not in (signal.SIG_IGN, signal.SIG_DFL, None):
                    self._old[s] = signal.signal(s, lambda signum, _: setattr(self, "hit", signum))
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


class _Pool(WorkerPool):
    """The worker processes, started before the backend check so that their start-up (and the
    load of the likeliest library's tokenizer) overlaps it."""

    def __init__(self, n: int, config: BuildConfig, state: str, run_id: str, tokenizer: str, load_likely: bool = True):
        likely = (FAST[0], tokenizer) if load_likely and config.backend in ("auto", FAST[0]) else None
        super().__init__(n, (_init_worker, (config, state, run_id, likely)), config.stall_seconds)


def _run_units(units: list[Unit], pending: list[Unit], info: TokenizerInfo, config: BuildConfig, state: str,
               run_id: str, on_progress: Callable[[Progress], None] | None, done_bytes: int,
               on_result: Callable[[dict], None], workers: _Pool | None) -> list[dict]:
    """Tokenize the pending units; each journal entry goes to `on_result` as soon as it is in."""
    total_bytes = sum(u.est_bytes for u in units)
    # One process: corpus order (a bad input is found where a reader expects it, and nothing is gained
    # by another order).
    order = schedule(pending, config.unit_bytes, config.strict or workers is None)
    units_done = len(units) - len(pending)
    t_last = 0.0
    results = []

    def report(counters, units_done, force=False):
        nonlocal t_last
        now = time.monotonic()
        if on_progress and (force or now - t_last > 0.1):
            t_last = now
            on_progress(Progress(done_bytes + counters[0], total_bytes, counters[1], counters[2],
                                 units_done, len(units), "tokenize", workers.n if workers else 1))

    if workers is None:  # inline: no pool, easy to debug and profile
        counters = _LocalCounters([0, 0, 0])
        counters.hook = lambda: report(counters, units_done)  # progress within a unit, as it is read
        _init_worker(config, state, run_id, None, counters)
        try:
            for u in order:
                results.append(run_unit(u, info))
                on_result(results[-1])
                units_done += 1
                report(counters, units_done, force=True)
        finally:
            _W.clear()  # this process's encoder (its tokenizer: ~100 MB for a 100k vocabulary) goes
        return results

    counters = workers.counters
    try:
        with _Interrupt() as interrupt:
            # The pool bounds every wait: a unit's future fails once its worker dies or stalls
            # (config.stall_seconds without progress), naming that unit.
            futures = {workers.submit(run_unit, u, info, what=f"tokenizing {_where(u)}", beats=True): u
                       for u in order}
            # Each future reports itself done into one queue: a wait costs the same for 10 units as
            # for 10,000 (concurrent.futures.wait installs a waiter on every pending future, each
            # time: quadratic in the units).
            done_q: queue.SimpleQueue = queue.SimpleQueue()
            for f in futures:
                f.add_done_callback(done_q.put)
            remaining = set(futures)
            bad: tuple[int, InputError] | None = None  # the first bad input in corpus order
            while remaining:
                finished = _take_done(done_q, 0.2) & remaining
                remaining -= finished
                if interrupt.hit:
                    raise Interrupted(interrupt.hit)
                for f in sorted(finished, key=lambda f: futures[f].index):
                    try:
                        results.append(_result(f, futures[f]))
                    except InputError as e:
                        if bad is None or futures[f].index < bad[0]:
                            bad = (futures[f].index, e)
                    else:
                        on_result(results[-1])
                    units_done += 1
                if bad is not None:
                    # Only units before the bad one can hold an earlier error: wait for those alone.
                    remaining = {f for f in remaining if futures[f].index < bad[0]}
                    if not remaining:
                        raise bad[1]
                report(counters, units_done, force=bool(finished))
    except BaseException:
        workers.kill()
        raise
    workers.close()
    return results


def _take_done(q: queue.SimpleQueue, timeout: float) -> set:
    """The futures done by now: one waited for up to `timeout` s, then all others already in."""
    try:
        got = {q.get(timeout=timeout)}
    except queue.Empty:
        return set()
    while True:
        try:
            got.add(q.get_nowait())
        except queue.Empty:
            return got


def schedule(pending: list[Unit], unit_bytes: int, in_order: bool = False) -> list[Unit]:
    """The order units go to the workers (the output's order does not depend on it).

    Units costing over twice unit_bytes (a large text file or row group, a .zst range that
    discards what precedes it in its frame) go first, costliest first, so that none of them is
    the last to finish; then corpus order.  in_order: corpus order only (--strict, to stop at
    the first bad input soon; one process).
    """
    pending = sorted(pending, key=lambda u: u.index)
    if in_order:
        return pending

    def cost(u: Unit) -> int:  # discarding decompressed bytes runs ~6x faster than tokenizing them
        return u.est_bytes + u.skip_bytes // 6

    big = sorted((u for u in pending if cost(u) > 2 * unit_bytes), key=lambda u: (-cost(u), u.index))
    return big + [u for u in pending if cost(u) <= 2 * unit_bytes]


def _result(f, u: Unit) -> dict:
    """A finished future's journal entry, or one clear error naming the unit that failed."""
    try:
        return f.result()
    except (HelixtokError, OSError):
        raise
    except Exception as e:  # noqa: BLE001
        raise HelixtokError(f"tokenizing {_where(u)} failed: {type(e).__name__}: {e}") from None


def build(corpus, out: str, tokenizer: str, config: BuildConfig | None = None, *, overwrite: bool = False,
          on_progress: Callable[[Progress], None] | None = None, task: tuple[int, int] | None = None,
          staging: str | None = None, remote: str | None = None, **options) -> "Built":
    """Build a dataset in `out`; returns its manifest (also written to out/manifest.json) as a
    Built, which also says how the run went (reused_units; UpToDate when OUT already held it).

    corpus: a file, folder, glob or URL, a list of them, or an HF `datasets.Dataset` (its Arrow
    cache files are read).  tokenizer: a tokenizer.json, a folder holding one, or a repo id in
    the local HF cache.  Options are a BuildConfig, or its fields as keywords (seq_len=2048,
    packing="packed", workers=8, ...), or both (keywords win).  on_progress receives a Progress
    now and then.  task=(k, n) builds only the k-th of n contiguous partitions of the work units
    (see merge.py).  Holds an exclusive lock on `out` throughout: a second build into it fails at
    once.  An `out` URL is built in a local staging folder first, then uploaded, its manifest
    last (publish.py).  Several threads of one program may build at once (into different folders).

    Example: helixtok.build("corpus/", "out/", "tokenizer.json", seq_len=2048, val_fraction=0.01)
    """
    config = dataclasses.replace(config, **options) if config is not None else BuildConfig(**options)
    if config.ray_address is not None:
        from .rayexec import check_cluster

        check_cluster(config.ray_address)  # before anything is written
    inputs = corpus_paths(corpus)
    out = os.fspath(out)
    if is_url(out):
        return _build_to_url(inputs, out, tokenizer, config, overwrite, on_progress, task, staging)
    path = resolve_tokenizer_path(tokenizer)
    check_out_path(out)
    files, warnings = discover(inputs, exclude=out)
    units, plan_warn = plan_units(files, unit_bytes=config.unit_bytes, text_field=config.text_field,
                                  stall=config.stall_seconds)
    warnings.merge(plan_warn)
    if config.strict and warnings.first:
        raise InputError(f"{warnings.first} (--strict)")
    if not units:
        raise InputError(f"no documents to read in {' '.join(inputs)}")
    run_id = f"r{os.getpid()}x{secrets.token_hex(3)}"
    # Sized for the library the check most likely picks; if it picks a slower one, a pool that
    # fits that one's speed starts after the check (_build_started).
    likely = config.backend if config.backend != "auto" else FAST[0] if backend_version(FAST[0]) else "hf"
    part, mine = None, units  # a task of a partitioned build tokenizes its share of the units
    if task is not None:
        k, n = task
        a, b = partition(units, n)[k]
        part, mine = {"task_index": k, "num_tasks": n, "units": [a, b], "units_total": len(units)}, units[a:b]
    # A finished dataset in OUT (no --overwrite) is either this very build (up to date) or refused:
    # either way nothing is tokenized, so no worker starts.
    finished = not overwrite and os.path.isfile(os.path.join(out, MANIFEST))
    # On Ray the cluster's workers tokenize; nothing starts here before the backend check.
    n_workers = 1 if finished or config.ray_address is not None else worker_count(config, mine, likely)
    workers = None
    env = {k: os.environ.get(k) for k in THREAD_ENV}
    try:
        # What tokenizing needs starts first, so that it overlaps inspecting the tokenizer
        # (0.4 s for a 100k vocabulary) and the backend check: the worker processes, which load
        # the likeliest library's tokenizer, or that library's load here (~1.2 s for 100k).
        if n_workers > 1:
            workers = _Pool(n_workers, config, os.path.join(out, STATE), run_id, path)
        elif config.backend in ("auto", "fastokens") and not finished and config.ray_address is None:
            preload.start(path)  # unless the command line started it
        info = inspect_tokenizer(path, eos_token=config.eos_token, bos_token=config.bos_token,
                                 pad_token=config.pad_token, add_bos=config.add_bos,
                                 special_tokens=config.special_tokens)
        return _build_in(out, info, config, overwrite, on_progress, part, files, units, warnings, run_id, workers,
                         remote)
    except BaseException:
        if workers is not None:
            workers.kill()
        raise
    finally:
        # A load ahead still under way ends before build() returns or raises, and the tokenizers
        # loaded for this build are freed: a caller that builds again reloads them.
        forget_fast_tokenizers()
        forget_handed()
        for k, v in env.items():  # the caller's own tokenizers run with its own settings again
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def corpus_paths(corpus) -> list[str]:
    """build()'s corpus as paths: one path or URL, several, or an HF datasets.Dataset's cache files."""
    if isinstance(corpus, (str, os.PathLike)):
        return [os.fspath(corpus)]
    files = getattr(corpus, "cache_files", None)
    if files is not None and hasattr(corpus, "column_names"):  # a datasets.Dataset
        if not files:
            raise ConfigError("the datasets.Dataset is in memory only (no Arrow cache files to read): save it with "
                              "ds.save_to_disk(path) and pass that folder, or load it from disk first")
        return [f["filename"] for f in files]
    return [os.fspath(p) for p in corpus]


def worker_count(config: BuildConfig, units: list[Unit], backend: str) -> int:
    """How many processes tokenize with `backend`: --workers at most, and only as many as the
    input keeps busy for about a second each, which is what one costs to start (interpreter,
    imports, the tokenizer's load: 0.5-1.7 s): one per 64 MiB with fastokens or gigatoken, one
    per 4 MiB with tiktoken or tokenizers (config.worker_bytes).  One means none: the build's own
    process tokenizes."""
    per = worker_bytes(backend)
    return max(1, min(config.num_workers, len(units), -(-sum(u.est_bytes for u in units) // per)))


def _build_in(out, info, config, overwrite, on_progress, part, files, units, warnings, run_id, workers,
              remote: str | None = None) -> dict:
    """build() from the moment its work is planned: holds the lock on `out` throughout."""
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    lock = OutLock(out)
    state = os.path.join(out, STATE)
    # The whole plan (every input, unit, option and resolved tokenizer choice that changes bytes):
    # recorded beside the manifest, it tells a rerun that nothing changed and a merge that its
    # parts belong together.
    plan = encode_plan(whole_plan(files, units, config.identity(), info.identity(), part and part["num_tasks"]))
    try:
        if not overwrite and os.path.isfile(os.path.join(out, MANIFEST)):
            return _up_to_date(out, plan)
        return _build_started(out, info, config, overwrite, on_progress, part, files, units, warnings, state,
                              run_id, workers, plan, remote and (remote, plan_folder(plan)))
    except InputError:
        # Bad input: the corrected command has other inputs or options, so nothing here can be
        # resumed; leave OUT as it was before (or absent) so that command just works.
        if os.path.isdir(state) and not os.path.isfile(os.path.join(out, MANIFEST)):
            shutil.rmtree(state, ignore_errors=True)
        raise
    except OSError as e:
        if (err := resource_error(e, out)) is not None:
            raise err from None
        raise
    finally:
        lock.release()
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out)  # only if the build left nothing: a failed first build leaves no trace


class Built(dict):
    """What build() returns: the manifest, and how the run went (not part of the dataset)."""

    reused_units = 0  # work units an interrupted run had finished, taken as they were
    units = 0


class UpToDate(Built):
    """The manifest build() returns when OUT already held this very build: nothing was written."""


def _up_to_date(out: str, plan: bytes) -> UpToDate:
    """The finished dataset in OUT, when it was built from this very plan and its files are all
    there with their sizes (a Slurm requeue, a Ray retry of a finished task); else why not, as
    the refusal to build over it."""
    m = load_manifest(out)  # checked: a damaged manifest is refused, never called up to date
    try:
        with open(os.path.join(out, PLAN_FILE), "rb") as fh:
            theirs = fh.read()
    except FileNotFoundError:  # built by an older helixtok: nothing tells what it was built from
        raise ConfigError(f"{out}: already holds a finished dataset; pass --overwrite to replace it") from None
    if theirs != plan:
        try:
            change = describe_change(json.loads(theirs), json.loads(plan))
        except ValueError:
            change = f"its {PLAN_FILE} is unreadable"
        raise ConfigError(f"{out}: already holds a finished dataset built from other inputs or options ({change}); "
                          "pass --overwrite to replace it")
    sizes = {x["path"]: x["bytes"] for sp in m["splits"].values() for e in sp["shards"]
             for x in (e, e.get("docs"), e.get("valid")) if x and "bytes" in x}
    for rel in manifest_files(m):
        p = os.path.join(out, rel)
        if not (os.path.isfile(p) and (rel not in sizes or os.path.getsize(p) == sizes[rel])):
            raise ConfigError(f"{out}: holds this build's manifest but {rel} is missing or has another size; "
                              "pass --overwrite to build it again")
    shutil.rmtree(os.path.join(out, STATE), ignore_errors=True)  # an interrupted last step (cleanup)
    return UpToDate(m)


def _build_to_url(inputs, url, tokenizer, config, overwrite, on_progress, task, staging) -> dict:
    from .publish import check_target, publish_uploaded, staging_dir, upload

    if task is not None:
        raise ConfigError(f"{url}: partitioned builds write local parts; merge them, then `helixtok push` the result")
    check_target(url, overwrite, config.stall_seconds)  # before any work: the command would fail at the end anyway
    stage = staging_dir(url, staging)
    # Our own staging folder may hold a finished build whose upload failed: build again (resume
    # only covers unfinished builds); a --staging folder the user named is only replaced with --overwrite.
    finished = os.path.isfile(os.path.join(stage, MANIFEST))
    on_ray = config.ray_address is not None  # each task uploads its unit's shards; no shared folder needed
    build(inputs, stage, tokenizer, config, overwrite=overwrite or (finished and staging is None),
          on_progress=on_progress, remote=url if on_ray else None)
    publish = publish_uploaded if on_ray else upload
    remote = publish(stage, url, overwrite=overwrite, stall=config.stall_seconds)
    if staging is None:
        shutil.rmtree(stage, ignore_errors=True)
    return remote


def _build_started(out, info, config, overwrite, on_progress, part, files, units, warnings, state, run_id,
                   workers, whole: bytes, remote: tuple[str, str] | None = None) -> dict:
    """_build_in once it holds the lock: check the backend, resume or start, tokenize, publish."""
    info, backend_check = choose_backend(info, units, config, workers)
    if workers is not None:  # the workers tokenize: the main process needs no fast tokenizer now
        forget_fast_tokenizers()
    if part is not None:
        # Every task lists the corpus afresh: a file that lands between two tasks would shift the
        # unit ranges.  Each part records the whole plan; merge compares them.
        check_sibling_parts(out, whole)
        a, b = part["units"]
        names = {nm for u in units[a:b] for nm in u.names}
        units = units[a:b]
        files = [f for f in files if f.name in names]
    plan = {
        "partition": part,
        "helixtok": __version__, "format_version": FORMAT_VERSION, "config": config.identity(),
        # Every resolved choice that changes bytes: special ids, vocabulary, backend and its version.
        "tokenizer": info.to_json(),
        "files": [[f.name, f.size, f.stamp] for f in files],
        "units": [u.to_json() for u in units],
    }
    resume = _prepare_out(out, plan, overwrite, protect=[f.path for f in files] + [info.path])
    os.makedirs(state, exist_ok=True)
    if not resume:
        write_json_atomic(os.path.join(state, "plan.json"), plan)

    trusted = _trusted_results(out, state, units, remote and remote_sizes(*remote, config.stall_seconds)) \
        if resume else {}
    pending = [u for u in units if u.index not in trusted]
    done_bytes = sum(u.est_bytes for u in units if u.index in trusted)
    refs = LineRefs(units)
    for u in units:
        if u.index in trusted:
            refs.record(u.index, trusted[u.index]["lines"])
    if config.ray_address is not None and pending:
        from .rayexec import RayExecutor

        workers = RayExecutor(config.ray_address, config, state, run_id, remote)
    elif (n := worker_count(config, pending, info.backend)) > (workers.n if workers else 1):
        # Sized for a faster library than the check found exact: this one needs more processes.
        if workers is not None:
            workers.kill()
        workers = _Pool(n, config, state, run_id, info.path, load_likely=False)
    try:
        fresh = _run_units(units, pending, info, config, state, run_id, on_progress, done_bytes,
                           lambda r: refs.record(r["index"], r["lines"]), workers)
    except InputError as e:  # a worker names a .jsonl line by its place in the unit
        raise InputError(refs.resolve(str(e))) from None
    by_index = {**trusted, **{r["index"]: r for r in fresh}}
    results = [by_index[u.index] for u in units]
    if on_progress:
        on_progress(Progress(sum(u.est_bytes for u in units), sum(u.est_bytes for u in units),
                             sum(sum(r["documents"].values()) for r in results),
                             sum(sum(r["tokens"].values()) for r in results), len(units), len(units), "write"))
    names = ("train", "val") if config.val_fraction > 0 else ("train",)
    splits = {s: join_split([unit_counts(r, s) for r in results], [published(e) for r in results for e in r["shards"][s]],
                            config.seq_len, config.packing) for s in names}

    tally = Tally()
    for r in results:
        tally.merge(Tally.from_json(r["skipped"]))
    tally = refs.resolve_tally(tally)
    if splits["train"]["num_chunks"] == 0 and part is None:
        raise InputError(f"the corpus gave {splits['train']['tokens']} tokens, not one chunk of "
                         f"--seq-len {config.seq_len}; lower --seq-len or add text")
    _check_unchanged(files)
    shutil.copyfile(info.path, os.path.join(state, "tokenizer.json"))
    with open(os.path.join(state, PLAN_FILE), "wb") as fh:
        fh.write(whole)

    totals = split_totals(splits)
    totals["skipped_documents"] = sum(tally.counts.get(r, 0) for r in DOC_SKIPS)
    totals["repaired_documents"] = sum(tally.counts.get(r, 0) for r in REPAIRS)
    manifest = {
        "format_version": FORMAT_VERSION,
        "helixtok_version": __version__,
        "dtype": "uint16" if info.dtype.itemsize == 2 else "uint32",
        "seq_len": config.seq_len,
        "packing": config.packing,
        "min_tail_len": config.tail_len if config.packing != "packed" else None,
        **({"bestfit_window": BESTFIT_WINDOW} if config.packing == "bestfit" else {}),
        "tokenizer": {**info.to_json(), "file": "tokenizer.json", "backend_check": backend_check},
        "options": {"text_field": config.text_field, "val_fraction": config.val_fraction,
                    "split_seed": config.split_seed, "shard_bytes": config.shard_bytes,
                    "unit_bytes": config.unit_bytes, "max_piece_chars": config.max_piece_chars,
                    "strip": config.strip},
        "inputs": {"files": len(files), "bytes": sum(f.size for f in files), "units": len(units),
                   "list": [{"name": f.name, "bytes": f.size} for f in files]},
        **({"partition": part} if part else {}),
        "splits": splits,
        "totals": totals,
        "sources": sum_sources(r["sources"] for r in results),
        # Documents per work unit and split, in unit order: where a document came from (show.py).
        "unit_documents": {sp: [r["documents"].get(sp, 0) for r in results] for sp in splits},
        "skipped": tally.to_json(),
        "warnings": warnings.to_json(),
    }
    _publish(out, state, results, manifest, uploaded=remote is not None)
    built = Built(manifest)
    built.reused_units, built.units = len(trusted), len(units)
    return built


def _check_unchanged(files) -> None:
    """An input modified while it was read would give a dataset matching neither version."""
    for f in files:
        if current(f.path) != (f.size, f.stamp):
            raise InputError(f"{f.path}: changed while the build read it; rerun when the corpus is stable")


def _publish(out: str, state: str, results: list[dict], manifest: dict, uploaded: bool = False) -> None:
    """Move the units' shards (and the tokenizer and plan) from STATE into OUT, then the manifest,
    last and atomically.  (uploaded: the shards are in object storage already.)

    publish.json names the files first, so a kill halfway leaves them known as helixtok's (a
    rerun finds the moved shards there and publishes again; --overwrite removes them).
    """
    moves = [] if uploaded else [(n, p) for r in results for n, p, _ in state_files(r)]
    moves += [("tokenizer.json",) * 2, (PLAN_FILE,) * 2]
    write_json_atomic(os.path.join(state, PUBLISH), {"files": [p for _, p in moves]})
    for n, p in moves:
        if os.path.exists(os.path.join(state, n)):  # else moved by a build stopped while publishing
            os.replace(os.path.join(state, n), os.path.join(out, p))
    fsync_dir(out)  # shard renames are durable before the manifest says they exist
    write_json_atomic(os.path.join(state, MANIFEST), manifest)
    os.replace(os.path.join(state, MANIFEST), os.path.join(out, MANIFEST))
    fsync_dir(out)
    shutil.rmtree(state)
