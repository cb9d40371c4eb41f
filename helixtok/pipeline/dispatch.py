"""Run a build's pending work units: in this process, on the local worker pool or on Ray (rayexec.py),
each journal entry handed on as it comes, with progress and a clean stop on a signal."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..format.errors import HelixtokError, InputError, InternalError, Interrupted
from .backends import FAST
from .config import BuildConfig, worker_bytes
from .join import close_group, join_group, join_uploaded, offsets_after, place_unit
from .journal import done_path, placed_path
from .pool import WorkerPool
from .tokenizer import TokenizerInfo
from .unit import _init_worker, _LocalCounters, _where, end_worker, prepare_worker, run_unit
from .units import Unit


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


class Interrupt:
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


class BackendRejected(Exception):
    """The backend check, run beside tokenizing, picked another library than the units used: they
    are tokenized again with it.  `verdict`: choose_backend's (TokenizerInfo, check record)."""

    def __init__(self, verdict: tuple):
        super().__init__(f"the backend check picked {verdict[0].backend}")
        self.verdict = verdict


def verdict_for(info: TokenizerInfo, verdict: Future) -> tuple:
    """The check's (TokenizerInfo, record), once it is in, if it picked the library `info` names;
    else BackendRejected (or the check's own error)."""
    got = verdict.result()
    if (got[0].backend, got[0].backend_version) != (info.backend, info.backend_version):
        raise BackendRejected(got)
    return got


class UnitPool(WorkerPool):
    """The worker processes, started before the backend check so that their start-up (and the
    load of the likeliest library's tokenizer) overlaps it."""

    def __init__(self, n: int, config: BuildConfig, state: str, run_id: str, tokenizer: bytes,
                 load_likely: bool = True):
        likely = FAST[0] if load_likely and config.backend in ("auto", FAST[0]) else None
        super().__init__(n, (_init_worker, (config, state, run_id)), config.stall_seconds,
                         prepare=(prepare_worker, (tokenizer, likely, config.chat is not None)))


def run_units(units: list[Unit], pending: list[Unit], info: TokenizerInfo, config: BuildConfig, state: str,
               run_id: str, on_progress: Callable[[Progress], None] | None, done_bytes: int,
               on_result: Callable[[dict], None], workers: UnitPool | None, verdict: Future | None = None,
               where: dict[int, tuple[int, int]] | None = None) -> list[dict]:
    """Tokenize the pending units; each journal entry goes to `on_result` as soon as it is in.
    `verdict`: the backend check's, coming while they tokenize; one that picks another library than
    `info` names stops them (BackendRejected).  `where`: unit -> (its shard group, the group's first
    unit), for the units that place their own ids as they end (run_unit)."""
    where = where or {}

    def args(u: Unit) -> tuple:
        return (u, info, where[u.index]) if u.index in where else (u, info)
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
        _init_worker(config, state, run_id, counters)
        try:
            for u in order:
                if verdict is not None and verdict.done():
                    verdict_for(info, verdict)
                results.append(run_unit(*args(u)))
                on_result(results[-1])
                units_done += 1
                report(counters, units_done, force=True)
        except Exception:
            _judged_by(verdict, info)
            raise
        finally:
            end_worker()
        return results

    counters = workers.counters
    try:
        with Interrupt() as interrupt:
            # The pool bounds every wait: a unit's future fails once its worker dies or stalls
            # (config.stall_seconds without progress), naming that unit.
            futures = {workers.submit(run_unit, *args(u), what=f"tokenizing {_where(u)}", beats=True): u
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
                finished = take_done(done_q, 0.2) & remaining
                remaining -= finished
                if interrupt.hit:
                    raise Interrupted(interrupt.hit)
                if verdict is not None and verdict.done():
                    verdict_for(info, verdict)
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
            if verdict is not None:  # the check may still need a worker: the pool closes after it
                verdict_for(info, verdict)
    except BaseException as e:
        if isinstance(e, Exception):
            _judged_by(verdict, info)  # before the kill: the check may need a worker
        workers.kill()
        raise
    return results  # the workers stay: the last joins may still run (Joins.finish closes them)


class Joins:
    """Every shard group's shards (join.py).  Locally a unit's process places it as it ends when the
    units before it in its group are journaled (its result then carries its placement); else it is
    placed as soon as they are (its offset is then known): a task for any worker, ahead of the units
    still to tokenize.  A group is closed, a task too, once all of its units are placed.  This
    process only keeps count and checks each placement's offset (in a thread of it, so that no
    pool callback waits on the pool).  On Ray
    a group's join is one task of the cluster, once its last unit is done.  Without workers it all
    runs here, in turn.  groups: (number, units [a, b)); `done`: the journal entries finished
    before (a resume), `placed`: their placements that are still good."""

    def __init__(self, groups: list[tuple[int, int, int]], done: dict[int, dict], placed: dict[int, dict], workers,
                 state: str, run_id: str, dtype, config: BuildConfig, remote: tuple[str, str] | None):
        self.groups, self.workers, self.remote = groups, workers, remote
        self._args = (state, run_id, dtype, config)
        self.results, self.placed = dict(done), dict(placed)
        self.local = not getattr(workers, "remote_joins", False)
        self.units = {g: (a, b) for g, a, b in groups}
        self.group = {i: g for g, a, b in groups for i in range(a, b)}
        self.next = {g: a for g, a, _ in groups}  # the first unit of g whose offset is not known yet
        self.pos: dict[int, dict[str, int]] = {g: {} for g, _, _ in groups}  # ... and that offset, per split
        self.futures = {g: Future() for g, _, _ in groups}  # each group's entry
        self.started: set[int] = set()
        self.copied = 0  # units of this run placed from their own file (their place was not known as they ended)
        self._before = set(done)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        if workers is not None:
            self._thread = threading.Thread(target=self._serve, daemon=True, name="helixtok-joins")
            self._thread.start()
        for g, _, _ in groups:
            self._later(self._advance, g)

    def _later(self, fn, *args) -> None:
        """fn(*args) in the joins' thread (or now, without workers)."""
        if self._thread is None:
            fn(*args)
        else:
            self._events.put((fn, args))

    def _serve(self) -> None:
        while (ev := self._events.get()) is not None:
            try:
                ev[0](*ev[1])
            except BaseException as e:  # noqa: BLE001 - every group still open fails with it
                for f in self.futures.values():
                    _settle(f, error=e)

    def unit_done(self, r: dict) -> None:
        self._later(self._unit_done, r)

    def _unit_done(self, r: dict) -> None:
        i = r["index"]
        self.results[i] = r
        if (p := r.pop("placed", None)) is not None:  # its process placed it as it ended
            self.placed[i] = p
        if (g := self.group.get(i)) is not None:
            self._advance(g)

    def _advance(self, g: int) -> None:
        a, b = self.units[g]
        if g in self.started or self.futures[g].done():
            return
        if not self.local:  # Ray: one task per group, once all of its units are in
            if all(i in self.results for i in range(a, b)):
                self.started.add(g)
                self._chain(g, self._ray_join(g))
            return
        state, run_id, dtype, config = self._args
        item = np.dtype(dtype).itemsize
        while self.next[g] < b and self.next[g] in self.results:
            i = self.next[g]
            r = self.results[i]
            if any(e["bytes"] != e["num_tokens"] * item for es in r["shards"].values() for e in es) or (
                    i in self.placed and (self.placed[i]["at"] != {s: self.pos[g].get(s, 0) for s in r["shards"]} or
                                          any(sum(x[2] for x in self.placed[i]["segments"].get(s, [])) !=
                                              sum(e["bytes"] for e in es) for s, es in r["shards"].items()))):
                # Damaged (the offsets a unit's process read from the journal, or a journal entry itself):
                # forgotten, so that the same command tokenizes the unit again.
                for path in (placed_path(state, i), done_path(state, i)):
                    with contextlib.suppress(OSError):
                        os.remove(path)
                raise HelixtokError(f"work unit {i}: its journal entry or placement in shard {g} disagrees with the "
                                    "units before it (damaged); rerun the same command: it is tokenized again")
            if i not in self.placed:
                self.copied += i not in self._before
                if self.workers is None:
                    self.placed[i] = place_unit(r, g, self.pos[g], state, dtype, config)
                else:
                    f = self.workers.submit(place_unit, r, g, self.pos[g], state, dtype, config, urgent=True,
                                            what=f"placing work unit {i} in shard {g}")
                    f.add_done_callback(lambda f, g=g, i=i: self._later(self._placed, g, i, f))
            self.pos[g] = offsets_after(r, self.pos[g])
            self.next[g] += 1
        if self.next[g] == b and all(i in self.placed for i in range(a, b)):
            self.started.add(g)
            args = (g, [self.results[i] for i in range(a, b)], [self.placed[i] for i in range(a, b)], state, run_id,
                    dtype, config)
            if self.workers is None:
                _settle(self.futures[g], close_group(*args))
            else:
                self._chain(g, self.workers.submit(close_group, *args, urgent=True, what=f"closing shard {g}"))

    def _placed(self, g: int, i: int, f: Future) -> None:
        try:
            self.placed[i] = _result(f, None)
        except BaseException as e:  # noqa: BLE001 - the group's entry says it
            _settle(self.futures[g], error=e)
            return
        self._advance(g)

    def _chain(self, g: int, f: Future) -> None:
        def done(f: Future) -> None:
            try:
                r = _result(f, None)
            except BaseException as e:  # noqa: BLE001 - raised by finish()
                _settle(self.futures[g], error=e)
            else:
                _settle(self.futures[g], r)
        f.add_done_callback(done)

    def _ray_join(self, g: int) -> Future:
        a, b = self.units[g]
        state, run_id, dtype, config = self._args
        rs = [self.results[i] for i in range(a, b)]
        # In the state folder, the units an interrupted build placed are placed (their files gone).
        placed = {i: self.placed[i] for i in range(a, b) if i in self.placed}
        fn, args = ((join_uploaded, (g, rs, run_id, dtype, config, self.remote)) if self.remote else
                    (join_group, (g, rs, state, run_id, dtype, config, None, placed)))
        return self.workers.submit(fn, *args, what=f"joining work units {a}-{b - 1} into shard {g}")

    def finish(self) -> list[dict]:
        """Every group's entry, in order, once all are joined; then the workers end."""
        try:
            out = [self.futures[g].result() for g, _, _ in self.groups]
        except BaseException:
            self.abort()
            raise
        self._stop()
        if self.workers is not None:
            self.workers.close()
        return out

    def abort(self) -> None:
        """Stop keeping count (the tasks it handed out end with the workers: the caller kills them)."""
        self._stop()

    def _stop(self) -> None:
        if self._thread is not None:
            self._events.put(None)
            self._thread.join()
            self._thread = None


def _settle(f: Future, result=None, error: BaseException | None = None) -> None:
    """A group's outcome, unless it has one: a failure in the joins' thread fails every open group
    while a close may still be running in a worker, whose end then changes nothing (the first
    outcome stands; setting it again would raise InvalidStateError in a pool callback thread)."""
    try:
        if error is not None:
            f.set_exception(error)
        else:
            f.set_result(result)
    except InvalidStateError:
        pass


def _judged_by(verdict: Future | None, info: TokenizerInfo) -> None:
    """A unit failed while the check still judges the library it used (a library that cannot
    even load the tokenizer fails at once): wait for the verdict; if it picks another library,
    that is what happened (BackendRejected), else the failure stands.  Interrupts never wait."""
    if verdict is None:
        return
    try:
        verdict_for(info, verdict)
    except BackendRejected:
        raise
    except Exception:  # noqa: BLE001 - the check failed too: the unit's own error says more
        pass


def take_done(q: queue.SimpleQueue, timeout: float) -> set:
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


def _result(f, u: Unit | None) -> dict:
    """A finished future's result, or one clear error naming the unit (or the join) that failed."""
    try:
        return f.result()
    except (HelixtokError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - a bug: the input's faults arrive as HelixtokErrors
        raise InternalError(f"internal error while {f'tokenizing {_where(u)}' if u else 'joining a shard'}: "
                            f"{type(e).__name__}: {e}; not a fault of the input: please report it") from e


def worker_count(config: BuildConfig, units: list[Unit], backend: str) -> tuple[int, str]:
    """How many processes tokenize with `backend`, and why.  --workers N: N, one per unit at most.
    Not given: one per worker_bytes of input (about 0.1 s of work; a forked worker starts in
    milliseconds), up to all cores.  One means none: the build's own process tokenizes."""
    if config.workers:
        n = max(1, min(config.workers, len(units)))
        return n, f"--workers {config.workers}" + (f", {_units(units)}" if n < config.workers else "")
    per, cores = worker_bytes(backend), config.num_workers
    n = max(1, min(cores, len(units), -(-sum(u.est_bytes for u in units) // per)))
    return n, f"auto: {cores} cores, {_units(units)}, one process per {per / (1 << 20):g} MiB of input with {backend}"


def _units(units: list[Unit]) -> str:
    return f"{len(units)} work unit" + ("s" if len(units) != 1 else "")
