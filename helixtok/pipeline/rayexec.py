"""Work units as Ray tasks (`--executor ray[:ADDRESS]`): the pool's interface over a Ray cluster.

Each task reads its unit's inputs itself (no text passes through the object store), writes the
unit's shards into the build's state folder (a folder every node sees at the same path) or, for
an object-storage OUT, into a staging folder of its node's own and uploads them; it returns the
journal entry, which the driver (this process) journals, and the driver publishes the manifest.
A task whose worker dies is retried by Ray (max_retries); a unit's files are named for the run,
so a retry writes them afresh, and the bytes are those of a local build.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import Future

from ..format import errors
from ..format.errors import ConfigError, HelixtokError
from .journal import done_path, state_files, write_entry
from .publish import upload_unit
from .tokenizer import hold_bytes, release_bytes
from .unit import _init_worker, run_unit

RETRIES = 3  # a task is retried this many times when its worker process or node dies
BEAT_SECONDS = 1.0  # a running task tells the driver's watch it lives this often


class _Watch:
    """A Ray actor: when each running task last showed it lives, for the driver's stall bound (a
    task's process stopped, or stuck in a read, sends nothing; Ray itself would wait for ever)."""

    def __init__(self):
        self._seen: dict[int, float] = {}

    def beat(self, index: int) -> None:
        self._seen[index] = time.monotonic()

    def ages(self) -> dict[int, float]:
        now = time.monotonic()
        return {k: now - v for k, v in self._seen.items()}


def _beating(watch, index: int, stop: threading.Event) -> None:
    while not stop.wait(BEAT_SECONDS):
        watch.beat.remote(index)


def _task(cwd: str, key: int, watch, fn, *args):
    """On a Ray worker: one step of the build, fn(*args) -- a unit's tokenizing (_unit), a shard
    group's join -- beating into the watch under `key` (a unit's index; a join's, negative), in the
    driver's folder (relative input paths, as its command line gave them).  Errors come back as
    values (class name, message): the driver raises them as the one-line errors they are."""
    # The first beat is answered before the work starts: from then on the watch knows this task,
    # so a stop anywhere in it is found within the stall bound (a first beat only sent could be
    # stopped with the process before it left: the task then counted as not yet started).
    import ray

    with contextlib.suppress(Exception):  # a watch that does not answer: the driver's monitor says so
        ray.get(watch.beat.remote(key), timeout=BEAT_SECONDS * 30)
    stop = threading.Event()
    threading.Thread(target=_beating, args=(watch, key, stop), daemon=True).start()
    os.chdir(cwd)
    try:
        return "ok", fn(*args)
    except HelixtokError as e:
        return "error", type(e).__name__, str(e)
    except OSError as e:
        return "oserror", e.errno, e.strerror, e.filename
    finally:
        stop.set()


def _unit(config, state: str, run_id: str, remote, tokenizer: bytes, unit, info) -> dict:
    """Tokenize one unit as a pool worker would; with `remote` (URL, folder), in a staging folder of
    this node's own, then upload its files there."""
    if remote is not None:
        state = tempfile.mkdtemp(prefix="helixtok-unit-")
    sha = hold_bytes(tokenizer)  # the driver's bytes (one object in Ray's store), never a file
    try:
        if sha != info.sha256:
            raise HelixtokError(f"the tokenizer handed to the task is not the build's (sha256 {sha[:12]}...)")
        _init_worker(config, state, run_id, None)
        r = run_unit(unit, info)
        if remote is not None:
            upload_unit(state, list(state_files(r)), *remote, config.stall_seconds)
        return r
    finally:
        release_bytes(sha)
        if remote is not None:
            shutil.rmtree(state, ignore_errors=True)


def require_ray():
    """The ray module, or the one line that says how to get it."""
    try:
        import ray
    except ImportError:
        raise ConfigError('--executor ray needs Ray: pip install "helixtok[ray]"') from None
    return ray


def check_cluster(address: str) -> None:
    """Before a build writes anything: Ray is installed and something listens at the address."""
    require_ray()
    _reachable(address or os.environ.get("RAY_ADDRESS", ""))


def _reachable(address: str, timeout: float = 5.0) -> None:
    """Fail at once, with one line, when nothing listens at a cluster address: Ray's own
    connection attempt retries for minutes."""
    import socket

    if not address or address == "auto" or "://" in address:
        return  # a local cluster to start, or one Ray finds (or a Ray Client URL: it says itself)
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or address, int(port) if port.isdigit() else 6379), timeout=timeout).close()
    except (OSError, ValueError) as e:
        raise ConfigError(f"--executor ray:{address}: cannot reach the Ray cluster ({e}); start it "
                          "(ray start --head) or fix the address") from None


def _unreachable(address: str | None, e: BaseException) -> str:
    """The one line for a failed ray.init, naming token authentication where that is the cause."""
    msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    where = f"--executor ray{':' + address if address else ''}"
    if "auth" in msg.lower() or "token" in msg.lower():
        return (f"{where}: the Ray cluster refused this driver's token ({msg}); a cluster started with "
                "RAY_AUTH_MODE=token needs the same token here: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
                "~/.ray/auth_token (`ray get-auth-token` on the head prints it); see docs/scale.md")
    return f"{where}: cannot reach the Ray cluster ({msg}); start it (ray start --head) or fix the address"


def _connect(ray, address: str | None, bound: float, log: str) -> threading.Event:
    """ray.init, bounded by `bound` (start_bound): a head that dies while the driver connects left
    Ray's own connect retrying in C++ for many minutes.  It runs in a thread of its own (a daemon: one that
    never returns is left behind when the build fails), which also keeps Ray's SIGTERM handler
    (sys.exit) off the build's main thread.  Meanwhile the process's stderr goes to `log`: Ray's
    C++ client writes a warning there every few seconds it cannot connect ($HELIXTOK_RAY_LOGS=1:
    to the terminal).  Returns the event that ends that thread: set it once Ray is shut down."""
    box: list = []
    hold, answered = threading.Event(), threading.Event()

    def connect() -> None:
        try:
            ray.init(address=address or None, logging_level=logging.ERROR, log_to_driver=False,
                     configure_logging=False, include_dashboard=False if not address else None)
            box.append(None)
        except BaseException as e:  # noqa: BLE001 - said below, in one line
            box.append(e)
            return
        finally:
            answered.set()
        # Without an address ray.init starts a local cluster, whose processes die with the thread
        # that started them (Linux's parent-death signal follows the thread): this one lives as long
        # as the build uses Ray.
        hold.wait()
    quiet = logging.getLogger("ray._private.worker")  # "SIGTERM handler is not set ...": ours, on purpose
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    keep = os.environ.get("HELIXTOK_RAY_LOGS") == "1"
    if not keep:
        # Past the connect, Ray's C++ core worker in this process logs each failure of a cluster that
        # went away ("Failed to push error to driver ...", several a second) straight to fd 2: only
        # its fatal ones are kept, so the build's own line says what happened.
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    saved = None if keep else os.dup(2)
    try:
        if saved is not None:
            sys.stderr.flush()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 2)
            os.close(fd)
        t = threading.Thread(target=connect, daemon=True, name="helixtok-ray-connect")
        t.start()
        answered.wait(bound)
    finally:
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)
        quiet.setLevel(level)
    where = f"--executor ray{':' + address if address else ''}"
    if not box:
        raise ConfigError(f"{where}: no answer from the Ray cluster within {bound:g} s while connecting (its head "
                          f"stopped or is unreachable?); check `ray status` on the head (the bound: {START_HINT})"
                          + ("" if keep else f" (Ray's own messages: {log})"))
    if box[0] is not None:
        if isinstance(box[0], (ConnectionError, ValueError, RuntimeError)) or "auth" in str(box[0]).lower():
            raise ConfigError(_unreachable(address, box[0])) from None
        raise box[0]
    return hold


def _start_watch(ray):
    """The stall watch, on the driver's own node (a lost worker node must not take it along: the
    build Ray would finish would fail for it), restarted by Ray if its process dies."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options = dict(num_cpus=0, max_restarts=-1, max_task_retries=-1)
    try:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                        soft=False)
    except Exception:  # noqa: BLE001 - a driver on no node of the cluster (Ray Client): anywhere
        pass
    return ray.remote(**options)(_Watch).remote()


# The cluster's start-up -- the connect, the stall watch's actor, the first task's first beat (each
# a process's start on some node) -- is bounded apart from --stall-timeout: a one-off start, not a
# stall, it takes seconds on a loaded machine, more than a short stall bound.
START_SECONDS = 60.0
START_HINT = f"the larger of --stall-timeout and $HELIXTOK_RAY_START_SECONDS (default {START_SECONDS:g})"


def start_bound(stall: float) -> float:
    """How long the cluster's start-up may take: the larger of the stall bound and START_SECONDS
    ($HELIXTOK_RAY_START_SECONDS; the tests lower it to see a silent head fail fast)."""
    try:
        start = float(os.environ.get("HELIXTOK_RAY_START_SECONDS", START_SECONDS))
    except ValueError:
        raise ConfigError("$HELIXTOK_RAY_START_SECONDS must be a number of seconds") from None
    return max(stall, start)


class RayExecutor:
    """submit(fn=run_unit, unit, info) -> Future of the journal entry, on a Ray cluster: the one at
    ADDRESS, the one $RAY_ADDRESS names, or a local one started for this build."""

    remote_joins = True  # a shard group's join is a task of the cluster too (dispatch.Joins)

    def __init__(self, address: str | None, config, state: str, run_id: str, tokenizer: bytes,
                 remote: tuple[str, str] | None = None):
        self.ray = ray = require_ray()
        self._started = not ray.is_initialized()
        self._hold = None
        self.stall, self.start = config.stall_seconds, start_bound(config.stall_seconds)
        if self._started:
            self._hold = _connect(ray, address, self.start, os.path.join(state, "ray-driver.log"))
        self.n = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.counters = [0, 0, 0]  # bytes, documents, tokens of the units finished
        self._watch = _start_watch(ray)
        self._await_watch()
        self._since = time.monotonic()
        # The tokenizer's bytes go into the object store once; each task gets them from there.
        self._cwd, self._state = os.getcwd(), os.path.abspath(state)
        self._unit_args = (config, self._state, run_id, remote, ray.put(tokenizer))
        self._running: dict[int, tuple[Future, str, object]] = {}  # unit index -> (future, what, ref)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._monitor, daemon=True, name="helixtok-ray-watch")
        self._watcher.start()
        # The driver's object-storage settings (endpoint, credentials) travel with its tasks.
        env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "HELIXTOK_"))}
        self._task = ray.remote(num_cpus=1, max_retries=RETRIES, retry_exceptions=False)(_task).options(
            runtime_env={"env_vars": env} if env else None)
        self._calls = 0
        self._refs: list = []
        self._uploads = remote is not None  # the tasks journal on their own nodes: the driver journals too

    def _await_watch(self) -> None:
        """The watch's first answer, before any task goes out: its start is a worker process's start,
        seconds on a loaded node and longer than a short --stall-timeout, and a task stopped while
        its own worker started would hold the node's worker start-up (and so the watch's) for ever."""
        try:
            self.ray.get(self._watch.ages.remote(), timeout=self.start)
        except Exception as e:  # noqa: BLE001 - GetTimeoutError, or the actor could not be placed
            what = (str(e).strip().splitlines() or [""])[0][:160]
            self._disconnect()
            raise HelixtokError(f"the Ray cluster did not start helixtok's stall watch within {self.start:g} s "
                                f"({type(e).__name__}: {what}); check `ray status` (the bound: {START_HINT}), "
                                "then rerun the same command") from None

    def submit(self, fn, *args, what: str, beats: bool = False, urgent: bool = False) -> Future:
        """fn(*args) on the cluster: run_unit(unit, info) as a unit's task, anything else (a join) as itself."""
        if fn is run_unit:
            unit = args[0]
            key = unit.index
            ref = self._task.remote(self._cwd, key, self._watch, _unit, *self._unit_args, *args)
        else:
            unit, self._calls = None, self._calls + 1
            key = -self._calls
            ref = self._task.remote(self._cwd, key, self._watch, fn, *args)
        self._refs.append(ref)
        out: Future = Future()
        with self._lock:
            self._running[key] = (out, what, ref)

        def done(f) -> None:
            with self._lock:
                self._running.pop(key, None)
                if out.done():  # failed by the watch already
                    return
            self._done(f, out, unit, what)

        ref.future().add_done_callback(done)
        return out

    def _monitor(self) -> None:
        """Every second: a task that has started and not beaten for `stall` s fails its unit's
        future (the build then stops, cancelling every task); so does a watch that does not answer."""
        answered = time.monotonic()
        while not self._closed.wait(min(1.0, self.stall / 4)):
            try:
                ages = self.ray.get(self._watch.ages.remote(), timeout=self.stall)
                answered = time.monotonic()
            except Exception as e:  # noqa: BLE001 - GetTimeoutError, the actor or the cluster gone
                if self._closed.is_set():
                    return
                if time.monotonic() - answered < self.stall:  # the watch restarting: asked again
                    continue
                what = (str(e).strip().splitlines() or [""])[0][:160]
                err = HelixtokError(f"no answer from the Ray cluster's stall watch for {self.stall:g} s "
                                    f"({type(e).__name__}: {what}); the cluster or the driver's node went away? "
                                    "rerun the same command to resume")
                with self._lock:
                    stuck = list(self._running.values())
                    self._running.clear()
                for fut, _, _ in stuck:
                    if not fut.done():
                        fut.set_exception(err)
                return
            with self._lock:
                stuck = [(i, v) for i, v in self._running.items() if ages.get(i, 0.0) > self.stall]
                # A task stopped before its first beat has no age; nor has one still queued.  So also:
                # no beat from any task for `stall` s while units are pending -- nothing moves.  Until
                # the build's first beat that is the workers' start-up, bounded as the watch's own.
                newest = min(ages.values(), default=None)
                idle, idle_bound = ((time.monotonic() - self._since, self.start)
                                    if newest is None else (newest, self.stall))
                why, bound = "a Ray task seems hung while {what}", self.stall
                if not stuck and self._running and idle > idle_bound:
                    stuck, bound = [min(self._running.items())], idle_bound
                    why = (f"no Ray task shows it works ({len(self._running)} units pending, the first "
                           "{what}): one is stopped or stuck, or the cluster has no free CPU")
                for i, _ in stuck:
                    del self._running[i]
            for _, (fut, what, ref) in stuck:
                with contextlib.suppress(Exception):
                    self.ray.cancel(ref, force=True)
                if not fut.done():
                    fut.set_exception(HelixtokError(
                        f"no progress for {bound:g} s: {why.format(what=what)}; rerun the same command to "
                        "resume (or raise --stall-timeout)"))

    def _done(self, f, out: Future, unit, what: str) -> None:
        try:
            kind, *rest = f.result()
        except BaseException as e:  # noqa: BLE001 - Ray's own: the worker or node died past its retries
            msg = (str(e).strip().splitlines() or [""])[-1][:200]
            out.set_exception(HelixtokError(f"{what} failed on the Ray cluster: {type(e).__name__}: {msg}"))
            return
        try:
            if kind == "oserror":
                raise OSError(*rest)
            if kind != "ok":
                raise getattr(errors, rest[0], HelixtokError)(rest[1])
            r = rest[0]
            if self._uploads and unit is not None:  # for a resume
                write_entry(done_path(self._state, r["index"]), r)
        except BaseException as e:  # noqa: BLE001 - this runs in Ray's thread: the build's waits on `out`
            out.set_exception(e)
            return
        if unit is None:
            out.set_result(r)
            return
        self.counters[0] += unit.est_bytes
        self.counters[1] += sum(r["documents"].values())
        self.counters[2] += sum(r["tokens"].values())
        out.set_result(r)

    def kill(self) -> None:
        # Only while connected: any Ray call after ray.shutdown() starts a new local Ray to answer it
        # (2-3 s, and its own warnings on stderr) -- a second kill() came after the first's close().
        if not self._closed.is_set() and self.ray.is_initialized():
            for ref in self._refs:
                try:
                    self.ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - finished already, or the cluster is gone
                    pass
        self.close()

    def close(self) -> None:
        self._closed.set()
        if threading.current_thread() is not self._watcher:  # its last call to Ray ends before the shutdown
            self._watcher.join(self.stall + 1)
        self._disconnect()

    def _disconnect(self) -> None:
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()
        if self._hold is not None:
            self._hold.set()
