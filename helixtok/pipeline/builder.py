"""Orchestrate a build: plan work units, have them tokenized, packed and written, publish, manifest last.

Data flow: files (discover.py) -> units (units.py) -> what OUT holds: up to date, or a build to
resume (resume.py) -> the pending units run (dispatch.py: in this process, pool.py's processes or
on Ray, rayexec.py), each read (sources.py), tokenized, packed and written with its journal entry
(unit.py, pack.py, format/shards.py), its ids placed at their offset in its shard group's shards (join.py) ->
the manifest from the journal entries (catalog.py; bestfit's index: format/bestfit.py) -> publish: the
shards renamed into OUT, the manifest last (outdir.py).
No step here touches a token.  The journal makes an interrupted build resumable: finished units
are never redone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import secrets
import shutil
import threading
from concurrent.futures import Future
from functools import partial
from typing import Callable

import numpy as np

from ..format.errors import ConfigError, DatasetError, HelixtokError, InputError, from_cli, python_terms, resource_error
from ..format.fields import FIELDS_FILE, write_fields
from ..format.manifest import FORMAT_VERSION, MANIFEST, write_json_atomic
from ..format.objstore import current, is_url
from ..format.planid import PLAN_FILE, encode_plan, plan_folder, whole_plan
from ..format.shards import DOCS_DTYPE
from ..format.tokenizer_file import resolve_tokenizer_path
from ..version import __version__
from . import preload
from .backend_check import choose_backend
from .backends import FAST, backend_version, forget_fast_tokenizers
from .catalog import (CHAT_TEMPLATE, Built, UpToDate, bestfit_index, build_manifest, chat_counts, join_split,  # noqa: F401
                      published, unit_counts)
from .chat import check_date
from .config import BuildConfig
from .discover import discover
from .dispatch import BackendRejected, Joins, Progress, UnitPool, run_units, verdict_for, worker_count
from .join import shard_groups
from .journal import state_files
from .merge import check_sibling_parts, partition
from .outdir import STATE, OutLock, check_out_path, publish
from .publish import remote_bytes, remote_sizes
from .resume import prepare_out, trusted_results, up_to_date
from .sources import LineRefs
from .tally import Tally
from .tokenizer import forget_handed, hold_bytes, inspect_tokenizer, read_tokenizer, release_bytes, tokenizer_bytes
from .unit import THREAD_ENV
from .units import Unit, plan_units


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
    A chat build: chat=True, with chat_template="x.jinja", loss="assistant"|"last"|"all"|"completion",
    truncate=True|"turns", chat_kwargs={...}, chat_date="YYYY-MM-DD" as the command line's options.

    Example: helixtok.build("corpus/", "out/", "tokenizer.json", seq_len=2048, val_fraction=0.01)
    """
    try:
        return _build(corpus, out, tokenizer, config, overwrite, on_progress, task, staging, remote, options)
    except HelixtokError as e:
        if from_cli.get():
            raise
        raise python_terms(e) from e.__cause__


# A chat build's choices as build() keywords (the command line's --chat-template, --loss, ...).
CHAT_KEYWORDS = {"chat_template": None, "loss": "assistant", "truncate": False, "chat_kwargs": "", "chat_date": "",
                 "chat_split": None}


def _build(corpus, out, tokenizer, config, overwrite, on_progress, task, staging, remote, options) -> "Built":
    chat_kw = {k: options.pop(k) for k in list(options) if k in CHAT_KEYWORDS}
    unknown = sorted(set(options) - set(BuildConfig.__dataclass_fields__))
    if unknown:
        import difflib

        near = difflib.get_close_matches(unknown[0], list(BuildConfig.__dataclass_fields__), n=1, cutoff=0.5)
        raise ConfigError(f"helixtok.build got an unknown keyword {unknown[0]!r}"
                          + (f" (did you mean {near[0]!r}?)" if near else "")
                          + f"; its options: {', '.join(sorted([*BuildConfig.__dataclass_fields__, *CHAT_KEYWORDS]))}")
    config = dataclasses.replace(config, **options) if config is not None else BuildConfig(**options)
    if chat_kw and config.chat is not True:
        raise ConfigError(f"{', '.join(chat_kw)} apply to chat=True builds only"
                          + ("; give them instead of a ChatSpec" if config.chat is not None else ""))
    if config.chat is True:  # the template beside the tokenizer (or chat_template=), as the command line does
        from .chat import load_spec

        kw = {**CHAT_KEYWORDS, **chat_kw}
        config = dataclasses.replace(config, chat=load_spec(
            resolve_tokenizer_path(tokenizer), kw["chat_template"], kw["loss"], kw["truncate"], config.text_field,
            date=kw["chat_date"], kwargs=kw["chat_kwargs"], split_turns=kw["chat_split"] == "turns"))
    if config.ray_address is not None:
        from .rayexec import check_cluster

        check_cluster(config.ray_address)  # before anything is written
    inputs = corpus_paths(corpus)
    out = os.fspath(out)
    if is_url(out):
        return _build_to_url(inputs, out, tokenizer, config, overwrite, on_progress, task, staging)
    path = resolve_tokenizer_path(tokenizer)
    check_out_path(out)
    # The one read of the tokenizer file: everything after loads these bytes (tokenizer._HELD).
    sha = hold_bytes(read_tokenizer(path))
    try:
        return _build_local(inputs, out, path, sha, config, overwrite, on_progress, task, remote)
    finally:
        release_bytes(sha)


def _build_local(inputs, out, path, sha, config, overwrite, on_progress, task, remote) -> "Built":
    """build() for a local OUT, the tokenizer's bytes held as `sha`: plan, start what tokenizes, inspect."""
    config = _pinned_chat_date(config, out, overwrite)
    files, warnings = discover(inputs, exclude=out, include_globs=config.include, exclude_globs=config.exclude,
                               code=config.code)
    units, plan_warn = plan_units(files, unit_bytes=config.unit_bytes, text_field=config.text_field,
                                  stall=config.stall_seconds, chat=config.chat is not None,
                                  any_fields=config.transform is not None)
    warnings.merge(plan_warn)
    if config.strict and warnings.first:
        raise InputError(f"{warnings.first} (--strict: fix it, or leave --strict out to skip and count it)")
    if not units:
        raise InputError(f"no documents to read in {' '.join(inputs)}")
    if config.val_size:
        config = dataclasses.replace(config, val_cut=_val_cut(units, config))
    run = Run(out=out, config=config, overwrite=overwrite, on_progress=on_progress, files=files, units=units,
              warnings=warnings, run_id=f"r{os.getpid()}x{secrets.token_hex(3)}", remote=remote)
    # Sized for the library the check most likely picks; if it picks a slower one, a pool that
    # fits that one's speed starts after the check (_tokenize).
    likely = config.backend if config.backend != "auto" else FAST[0] if backend_version(FAST[0]) else "hf"
    mine = units  # a task of a partitioned build tokenizes its share of the units
    if task is not None:
        k, n = task
        # Its exact share follows the shard groups (they need the tokenizer's dtype: _build_started);
        # this one, about as large, sizes the workers started meanwhile.
        a, b = partition(units, n)[k]
        run.part, mine = {"task_index": k, "num_tasks": n, "units": None, "units_total": len(units)}, units[a:b]
    # A finished dataset in OUT (no --overwrite) is either this very build (up to date) or refused:
    # either way nothing is tokenized, so no worker starts.
    finished = not overwrite and os.path.isfile(os.path.join(out, MANIFEST))
    # On Ray the cluster's workers tokenize; nothing starts here before the backend check.
    if finished or config.ray_address is not None:
        run.processes = (1, "nothing to tokenize here")
    else:
        run.processes = worker_count(config, mine, likely)
    n_workers = run.processes[0]
    env = {k: os.environ.get(k) for k in THREAD_ENV}
    try:
        # What tokenizing needs starts first, so that it overlaps inspecting the tokenizer
        # (0.4 s for a 100k vocabulary) and the backend check: the worker processes (forked from
        # one that loads the likeliest library's tokenizer once), or that library's load here
        # (~1.2 s for 100k).
        if n_workers > 1:
            run.workers = UnitPool(n_workers, config, run.state, run.run_id, tokenizer_bytes(sha))
        elif config.backend in ("auto", "fastokens") and not finished and config.ray_address is None:
            preload.start_bytes(tokenizer_bytes(sha))  # unless the command line started it
        info = inspect_tokenizer(path, eos_token=config.eos_token, bos_token=config.bos_token,
                                 pad_token=config.pad_token, add_bos=config.add_bos,
                                 special_tokens=config.special_tokens, sha256=sha)
        if config.chat is not None:  # BOS and turn tokens are what the template writes
            info = dataclasses.replace(info, bos_rule="chat template")
        return _build_in(run, info)
    except BaseException:
        if run.workers is not None:
            run.workers.kill()
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


def _val_cut(units, config: BuildConfig) -> int:
    """--val-size N's threshold: the N-th smallest split hash of the whole corpus, plus one (a hash
    below it is val), from a first pass that reads and hashes every document in worker processes
    (each task of a partitioned build makes the same pass over the whole corpus: the same cut)."""
    import heapq
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from itertools import repeat

    from .unit import smallest_split_hashes

    n, workers = config.val_size, min(config.num_workers, len(units))
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as ex:
            parts = list(ex.map(smallest_split_hashes, units, repeat(config), repeat(n + 1)))
    else:
        parts = [smallest_split_hashes(u, config, n + 1) for u in units]
    best = heapq.nsmallest(n + 1, heapq.merge(*parts))  # one more: a document must be left to train on
    if not best:  # no document at all: the build says what was read instead (a wrong --text-field, ...)
        return 0
    if len(best) <= n:
        raise InputError(f"--val-size {n:,} leaves no document to train on: the corpus has {len(best):,}; give a "
                         "smaller --val-size")
    return best[n - 1] + 1


@dataclasses.dataclass
class Run:
    """One local build from its planning on: what it reads, where and how it writes, who tokenizes."""

    out: str
    config: BuildConfig
    overwrite: bool
    on_progress: Callable[[Progress], None] | None
    files: list  # discover's InputFiles: the whole corpus, then this task's share
    units: list[Unit]  # likewise
    warnings: Tally
    run_id: str  # names this run's shard files in STATE: an orphan of another run never writes into them
    part: dict | None = None  # a task of a partitioned build: {task_index, num_tasks, units: [a, b], units_total}
    groups: list = dataclasses.field(default_factory=list)  # this run's shard groups: (number, units [a, b)): join.py
    copied: int = 0  # units whose ids went to their own file first (their place was not known as they ended)
    notes: list = dataclasses.field(default_factory=list)  # for the user, one line each (Built.notes)
    workers: object | None = None  # the UnitPool or RayExecutor; None: this process tokenizes
    # An object-storage OUT the Ray tasks upload to: its URL, then (URL, folder) once the plan is known.
    remote: str | tuple[str, str] | None = None
    whole: bytes = b""  # the whole plan (build-plan.json)
    processes: tuple[int, str] | None = None  # worker_count's answer: how many tokenize, and why

    @property
    def state(self) -> str:
        return os.path.join(self.out, STATE)


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


def _build_in(run: Run, info) -> dict:
    """build() from the moment its work is planned: holds the lock on OUT throughout."""
    out, state = run.out, run.state
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    lock = OutLock(out)
    # The whole plan (every input, unit, option and resolved tokenizer choice that changes bytes):
    # recorded beside the manifest, it tells a rerun that nothing changed and a merge that its
    # parts belong together.
    run.whole = encode_plan(whole_plan(run.files, run.units, run.config.identity(), info.identity(),
                                       run.part and run.part["num_tasks"]))
    if run.remote is not None:
        run.remote = (run.remote, plan_folder(run.whole))
    try:
        if not run.overwrite and os.path.isfile(os.path.join(out, MANIFEST)):
            return UpToDate(up_to_date(out, run.whole))
        return _build_started(run, info)
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


class _Check:
    """The backend check (backend_check.choose_backend) in a thread of its own, beside the units
    that tokenize meanwhile with the library it most likely picks: nothing waits for it before
    the first unit tokenizes.  end() stops it at its next step and waits for it."""

    def __init__(self, info, units, config, workers):
        self.stop = threading.Event()
        self.verdict: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(info, units, config, workers),
                                        name="helixtok-check")
        self._thread.start()

    def _run(self, *args) -> None:
        try:
            self.verdict.set_result(choose_backend(*args, stop=self.stop))
        except BaseException as e:  # noqa: BLE001 - the build raises it where it waits for the verdict
            self.verdict.set_exception(e)

    def end(self) -> None:
        self.stop.set()
        self._thread.join()


def _build_started(run: Run, info) -> dict:
    """_build_in once it holds the lock: check the backend (beside tokenizing where it can), resume
    or start, tokenize, publish."""
    config, out = run.config, run.out
    check = backend_check = None
    if config.backend == "auto" and config.ray_address is None and backend_version(FAST[0]) is not None:
        # Tokenize with the likeliest library while the check runs; if it picks another, the units
        # tokenized meanwhile are discarded and tokenized again with that one.
        check = _Check(info, run.units, config, run.workers)
        # The likeliest: the library an interrupted build of this OUT tokenized with (its check
        # picked it; the same command goes on with it), else the fastest.
        likely = (None if run.overwrite else _resumed_backend(run.state)) or FAST[0]
        run_info = dataclasses.replace(info, backend=likely, backend_version=backend_version(likely))
    else:
        run_info, backend_check = choose_backend(info, run.units, config, run.workers)
        if run.workers is not None:  # the workers tokenize: the main process needs no fast tokenizer now
            forget_fast_tokenizers()
    # Consecutive units whose ids make one shard of --shard-size: planned from the
    # input alone, so every task of a partitioned build draws the same groups.
    groups = shard_groups(run.units, config.shard_bytes, info.dtype.itemsize)
    if run.part is not None:
        # Every task lists the corpus afresh: a file that lands between two tasks would shift the
        # unit ranges.  Each part records the whole plan; merge compares them.
        check_sibling_parts(out, run.whole)
        a, b = partition(run.units, run.part["num_tasks"], groups)[run.part["task_index"]]
        run.part["units"] = [a, b]
        if a == b:
            if run.workers is not None:  # started for the share this task seemed to have
                run.workers.kill()
                run.workers = None
            run.notes.append(f"task {run.part['task_index']} of {run.part['num_tasks']} has nothing to do: the corpus "
                             f"makes {len(groups)} shard{'s' if len(groups) > 1 else ''} of --shard-size "
                             f"{config.shard_bytes:,} bytes, and a shard is one task's; a smaller --shard-size "
                             "shares it among more tasks")
        names = {nm for u in run.units[a:b] for nm in u.names}
        run.units = run.units[a:b]
        run.files = [f for f in run.files if f.name in names]
    # Numbered over the whole plan: a task's shards bear the names a single build gives them.
    run.groups = [(g, x, y) for g, (x, y) in enumerate(groups) if run.units and run.units[0].index <= x
                  <= run.units[-1].index]
    verdict = check.verdict if check is not None else None
    try:
        while True:
            try:
                trusted, results, joined, refs = _tokenize(run, run_info, verdict)
                if verdict is not None:
                    run_info, backend_check = verdict_for(run_info, verdict)
                break
            except BackendRejected as e:  # rare: the likeliest library is not exact here
                (run_info, backend_check), verdict = e.verdict, None
                run.overwrite = True  # this run's units (and a resumed one's) are of that library: discarded
                if run.workers is not None:
                    run.workers.kill()
                    run.workers = None
    finally:
        if check is not None:
            check.end()
    return _publish(run, run_info, backend_check, trusted, results, joined, refs)


def _pinned_chat_date(config: BuildConfig, out: str, overwrite: bool) -> BuildConfig:
    """A chat build's date (what strftime_now renders): --chat-date; else the one this OUT's build was
    planned with (unfinished or finished: a resume or a rerun the next day is the same plan, the
    same bytes); else today's, in UTC.  --overwrite plans afresh."""
    if config.chat is None or config.chat.date:
        return config
    date = None
    for p in () if overwrite else (os.path.join(out, STATE, "plan.json"), os.path.join(out, PLAN_FILE)):
        try:
            with open(p) as fh:
                date = json.load(fh)["config"]["chat"]["date"]
            check_date(date)
            break
        except (OSError, ValueError, KeyError, TypeError, HelixtokError):
            date = None
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return dataclasses.replace(config, chat=dataclasses.replace(config.chat, date=date))


def _resumed_backend(state: str) -> str | None:
    """The library an unfinished build in STATE planned with, if this environment has the very
    version it used (its plan names both)."""
    try:
        with open(os.path.join(state, "plan.json")) as fh:
            t = json.load(fh)["tokenizer"]
        name, version = t["backend"], t["backend_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if name in FAST + ("hf",) and backend_version(name) == version else None


def _tokenize(run: Run, info, verdict: Future | None) -> tuple[dict, list[dict], list[dict], LineRefs]:
    """Resume or start in OUT, then tokenize the units not journaled yet, each shard group closed as
    soon as its units are: (trusted entries, every unit's entry in unit order, every group's entry
    in order, the line references).  `verdict`: the check's, still coming."""
    config, out, state, units = run.config, run.out, run.state, run.units
    plan = {
        "partition": run.part,
        "helixtok": __version__, "format_version": FORMAT_VERSION, "config": config.identity(),
        # Every resolved choice that changes bytes: special ids, vocabulary, backend and its version.
        "tokenizer": info.to_json(),
        "files": [[f.name, f.size, f.stamp] for f in run.files],
        "units": [u.to_json() for u in units],
    }
    # In its JSON form, as plan.json holds it (tuples become lists): what a resume compares.
    plan = json.loads(encode_plan(plan))
    resume = prepare_out(out, plan, run.overwrite, protect=[f.path for f in run.files] + [info.path])
    os.makedirs(state, exist_ok=True)
    if not resume:
        write_json_atomic(os.path.join(state, "plan.json"), plan)
    remote = run.remote  # (URL, folder) by now: see _build_in
    trusted, placed = trusted_results(out, state, units, run.groups,
                                      remote and remote_sizes(*remote, config.stall_seconds)) if resume else ({}, {})
    pending = [u for u in units if u.index not in trusted]
    done_bytes = sum(u.est_bytes for u in units if u.index in trusted)
    refs = LineRefs(units)
    for u in units:
        if u.index in trusted:
            refs.record(u.index, trusted[u.index]["lines"])
    if config.ray_address is not None and pending:
        from .rayexec import RayExecutor

        run.workers = RayExecutor(config.ray_address, config, state, run.run_id, tokenizer_bytes(info.sha256), remote)
        run.processes = (run.workers.n, f"Ray: the cluster's {run.workers.n} CPUs")
    elif (want := worker_count(config, pending, info.backend))[0] > (run.workers.n if run.workers else 1):
        # Sized for a faster library than the check found exact: this one needs more processes.
        if run.workers is not None:
            run.workers.kill()
        run.processes = want
        run.workers = UnitPool(want[0], config, state, run.run_id, tokenizer_bytes(info.sha256), load_likely=False)
    elif run.workers is None:
        run.processes = want
    joins = Joins(run.groups, trusted, placed, run.workers, state, run.run_id, info.dtype, config, remote)

    def done(r: dict) -> None:
        refs.record(r["index"], r["lines"])
        joins.unit_done(r)

    try:
        # Locally each unit may place its own ids as it ends (its group known); Ray tasks never do.
        where = {} if not joins.local else {i: (g, a) for g, a, b in run.groups for i in range(a, b)}
        fresh = run_units(units, pending, info, config, state, run.run_id, run.on_progress, done_bytes, done,
                          run.workers, verdict, where)
    except BaseException as e:
        joins.abort()
        if isinstance(e, InputError):  # a worker names a .jsonl line by its place in the unit
            raise InputError(refs.resolve(str(e))) from None
        raise
    joined = joins.finish()
    run.copied = joins.copied
    by_index = {**trusted, **{r["index"]: r for r in fresh}}
    return trusted, [by_index[u.index] for u in units], joined, refs


def _publish(run: Run, info, backend_check: dict, trusted: dict, results: list[dict], joined: list[dict],
             refs: LineRefs) -> "Built":
    """The manifest from the units' journal entries and their groups' shards (`joined`); the shards,
    tokenizer and plan moved into OUT, the manifest last."""
    config, units, state = run.config, run.units, run.state
    if run.on_progress:
        total = sum(u.est_bytes for u in units)
        run.on_progress(Progress(total, total, sum(sum(r["documents"].values()) for r in results),
                                 sum(sum(r["tokens"].values()) for r in results), len(units), len(units), "write"))
    names = ("train", "val") if config.has_val else ("train",)
    indexes = {s: bestfit_index([e for j in joined for e in j["shards"][s]], s, config, partial(_read_docs, run),
                                run.state) for s in names} \
        if config.packing == "bestfit" else {}
    splits = {s: join_split([unit_counts(r, s) for r in results], [published(e) for j in joined for e in j["shards"][s]],
                            config.seq_len, config.packing, indexes.get(s)) for s in names}
    if config.chat:
        for s in names:
            splits[s]["chat"] = chat_counts([r["chat"][s] for r in results], splits[s],
                                            [e for j in joined for e in j["shards"][s]], config.packing,
                                            partial(_read_mask, run))
    tally = Tally()
    for r in results:
        tally.merge(Tally.from_json(r["skipped"]))
    tally = refs.resolve_tally(tally)
    if "val" in splits and splits["val"]["documents"] == 0 and splits["train"]["documents"] and run.part is None:
        run.warnings.add("empty_val_split", f"{_val_option(config)} of {splits['train']['documents']:,} documents "
                         "gave the val split none: raise it, or give --val-size N for exactly N")
    if splits["train"]["num_chunks"] == 0 and run.part is None:
        val = splits.get("val", {}).get("documents", 0)
        if splits["train"]["documents"] == 0 and val:
            raise InputError(f"{_val_option(config)} put every one of the {val:,} documents in the "
                             "val split, leaving none to train on; lower it or add documents")
        if splits["train"]["documents"] == 0 and (why := _nothing_read(tally, config.text_field)):
            raise InputError(why)
        if config.chat and splits["train"]["documents"] == 0 and (why := _no_conversation(splits, config)):
            raise InputError(why)
        raise InputError(f"the corpus gave {splits['train']['tokens']} tokens, not one chunk of "
                         f"--seq-len {config.seq_len}; lower --seq-len or add text")
    _check_unchanged(run.files)
    with open(os.path.join(state, "tokenizer.json"), "wb") as fh:  # the bytes the build used, not the file now
        fh.write(tokenizer_bytes(info.sha256))
    extra = []
    if config.chat:  # the template the build rendered with, beside the tokenizer
        with open(os.path.join(state, CHAT_TEMPLATE), "w", encoding="utf-8") as fh:
            fh.write(config.chat.template)
        extra.append((CHAT_TEMPLATE,) * 2)
    with open(os.path.join(state, PLAN_FILE), "wb") as fh:
        fh.write(run.whole)
    fields = write_fields(state, config.keep_fields, [r.get("fields") for r in results])
    manifest = build_manifest(config, info, backend_check, run.files, units, run.part, splits, results, tally,
                              run.warnings, fields)
    if run.part is not None:  # merge checks the part's build-plan.json by it
        manifest["plan_sha256"] = hashlib.sha256(run.whole).hexdigest()
    # The units' shards (unless uploaded), the tokenizer and the plan move into OUT; the manifest last.
    moves = [] if run.remote is not None else [(n, p) for j in joined for n, p, _ in state_files(j)]
    moves += [(x["path"],) * 2 for i in indexes.values() for x in i.entry.values()]
    extra += [(FIELDS_FILE,) * 2] if fields else []
    publish(run.out, moves + [("tokenizer.json",) * 2, (PLAN_FILE,) * 2, *extra], manifest)
    built = Built(manifest)
    built.reused_units, built.units = len(trusted), len(units)
    built.notes = run.notes + _tokenizer_moved(info)
    built.processes = run.processes
    built.copied = run.copied
    return built


# Why a record gave no document, as the one line a build that read none says (with the fix).
_SKIPPED = {
    "non_string_text": ("records whose {f!r} is not text", "--text-field names the field holding each "
                        "document's text; a list of chat messages is not text: build conversations with --chat"),
    "missing_text": ("records without a {f!r} field", "--text-field names the field holding each document's text"),
    "null_text": ("records whose {f!r} is null", "fill the field, or give --text-field another one"),
    "empty": ("empty or blank documents", "give files that hold text"),
    "malformed_json": ("lines that are not JSON", "give JSON lines (one object per line)"),
    "not_an_object": ("JSON values that are not objects", "give one JSON object per line"),
}


def _val_option(config: BuildConfig) -> str:
    return f"--val-size {config.val_size:,}" if config.val_size else f"--val-fraction {config.val_fraction:g}"


def _no_conversation(splits: dict, config: BuildConfig) -> str | None:
    """Why a chat build kept no conversation to train on, in its own terms (not "lower --seq-len")."""
    c = {k: sum(s["chat"][k] for s in splits.values()) for k in ("dropped_too_long", "no_trainable")}
    if c["no_trainable"] and not c["dropped_too_long"]:
        return (f"no conversation has a token to train on under --loss {config.chat.loss} ({c['no_trainable']:,} "
                "read: no assistant turn the template marks with {% generation %}, or every turn marked "
                "\"train\": false); check the template and --loss")
    if c["dropped_too_long"] and not c["no_trainable"]:
        return (f"every conversation ({c['dropped_too_long']:,}) is longer than --seq-len {config.seq_len} tokens "
                "and was dropped; raise --seq-len, or keep them cut with --truncate (or --truncate turns)")
    if c["dropped_too_long"]:
        return (f"no conversation was kept: {c['dropped_too_long']:,} longer than --seq-len {config.seq_len}, "
                f"{c['no_trainable']:,} with no token to train on under --loss {config.chat.loss}")
    return None


def _nothing_read(tally: Tally, field: str) -> str | None:
    """The line for a corpus that gave no document at all, naming what was skipped, how often and
    where first (the likeliest fix last); None when nothing was skipped."""
    got = sorted(((n, r) for r, n in tally.counts.items() if r in _SKIPPED), reverse=True)
    if not got:
        return None
    parts = [f"{n:,} {_SKIPPED[r][0].format(f=field)} (e.g. {tally.examples[r][0]})" for n, r in got]
    return f"the corpus gave no document to tokenize: {'; '.join(parts)}; {_SKIPPED[got[0][1]][1]}"


def _read_mask(run: Run, m: dict, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a shard's .mask sidecar: in STATE, or uploaded by its join's Ray task."""
    if run.remote is not None:
        return remote_bytes(*run.remote, m["path"], run.config.stall_seconds, start=start, end=stop)
    with open(os.path.join(run.state, m["state"]), "rb") as fh:
        fh.seek(start)
        return fh.read(stop - start)


def _read_docs(run: Run, d: dict) -> np.ndarray:
    """A shard's .docs sidecar: in STATE, or uploaded by its join's Ray task."""
    if run.remote is not None:
        data = remote_bytes(*run.remote, d["path"], run.config.stall_seconds)
    else:
        with open(os.path.join(run.state, d["state"]), "rb") as fh:
            data = fh.read()
    if len(data) != d["bytes"] or hashlib.sha256(data).hexdigest() != d["sha256"]:
        raise DatasetError(f"{d['path']}: not the bytes its join wrote (its sha256 differs); rerun the same command")
    return np.frombuffer(data, dtype=DOCS_DTYPE)


def _tokenizer_moved(info) -> list[str]:
    """A note when the tokenizer file no longer holds the bytes the build read (replaced while it
    ran): the dataset and OUT's copy are of the bytes read, which the manifest names."""
    try:
        with open(info.path, "rb") as fh:
            now = hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        now = None
    if now == info.sha256:
        return []
    return [f"{info.path} changed while the build ran: the dataset was tokenized with the file as first read "
            f"(sha256 {info.sha256[:12]}..., copied to OUT/tokenizer.json), not with what the path holds now"]


def _check_unchanged(files) -> None:
    """An input modified while it was read would give a dataset matching neither version."""
    for f in files:
        if current(f.path) != (f.size, f.stamp):
            raise InputError(f"{f.path}: changed while the build read it; rerun when the corpus is stable")
