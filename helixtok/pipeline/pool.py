"""A build's worker processes, fed over pipes, each watched for death and stalls.

On Linux the workers are forked from a fork server: one interpreter that imports helixtok and
loads the tokenizer once (WorkerPool's `prepare`), single-threaded, then forks every worker from
that state, so a worker's start costs a fork (milliseconds), not an interpreter, the imports and
a 100k-vocabulary load (1-3 s of CPU each).  Elsewhere ($HELIXTOK_FORK=0 too) each worker is its
own interpreter and prepares itself.  No wait on a worker is unbounded: a task's future fails
once its worker dies, or sends nothing for `stall_seconds` (a stopped process, a stuck read),
naming what the worker was doing.  No
multiprocessing: its queues' named semaphores need the resource tracker, whose death (an OOM
killer, `kill` of "the python processes") printed tracebacks, and its spawn bootstrap ran before
a worker could ignore Ctrl-C.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from ..format.errors import HelixtokError

MARK = "helixtok-worker"  # in each worker's command line: what `ps` (and the tests) look for
_LEN = struct.Struct("<Q")
_EOF = object()
# Signals sent to a whole process group (a terminal's Ctrl-C or hang-up; `scancel`, `docker stop`,
# `kill -- -PGID`): the build handles them and stops its workers; a worker that took them itself
# would print a traceback, or die first and be reported as killed.  (SIGKILL still ends a worker.)
_TERMINAL = {signal.SIGINT, signal.SIGHUP, signal.SIGTERM}
BEAT_SECONDS = 0.5  # a worker busy with a task that reports no progress says it is alive this often

_SERVE = "from helixtok.pipeline.pool import serve\nserve()\n"
_FORK_SERVER = "from helixtok.pipeline.pool import fork_server\nfork_server()\n"
# The fork server's environment: no thread pools in it to be lost across fork (numpy's BLAS).
_FORK_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _send(fh, obj, lock: threading.Lock | None = None) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if lock is None:
        fh.write(_LEN.pack(len(data)))
        fh.write(data)
        fh.flush()
        return
    with lock:
        _send(fh, obj)


def _recv(fh):
    head = fh.read(_LEN.size)
    if len(head) < _LEN.size:
        return _EOF
    n = _LEN.unpack(head)[0]
    data = fh.read(n)
    return _EOF if len(data) < n else pickle.loads(data)


# --------------------------------------------------------------------------- worker side


class Beat:
    """What a worker's task reports through: progress (bytes, documents, tokens) for the bar,
    which also proves the worker is not stuck.  Sent at most every SEND_SECONDS (a unit reports
    after each ~1 MB batch: thousands of messages a minute to decode for nothing); what is held
    back goes out before the task's answer."""

    SEND_SECONDS = 0.1

    def __init__(self, fh, lock: threading.Lock):
        self._fh, self._lock = fh, lock
        self._held = [0, 0, 0]
        self._sent = 0.0

    def bump(self, b: int, d: int, t: int) -> None:
        h = self._held
        h[0] += b
        h[1] += d
        h[2] += t
        if time.monotonic() - self._sent >= self.SEND_SECONDS:
            self.flush()

    def flush(self) -> None:
        if any(self._held):
            _send(self._fh, ("progress", *self._held), self._lock)
            self._held = [0, 0, 0]
        self._sent = time.monotonic()

    def alive(self) -> None:
        """Work went on that counts no byte yet (a conversation rendered): the stall bound's proof of life."""
        if time.monotonic() - self._sent >= self.SEND_SECONDS:
            _send(self._fh, ("alive",), self._lock)
            self._sent = time.monotonic()


def _portable(e: BaseException) -> BaseException:
    """An exception the parent can unpickle: the error itself, or one line saying what it was."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception type may refuse pickling
        return HelixtokError(f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")


def _alive(fh, lock: threading.Lock, stop: threading.Event) -> None:
    while not stop.wait(BEAT_SECONDS):
        try:
            _send(fh, ("alive",), lock)
        except OSError:
            return


def _run(fn, args, beats: bool, fh, lock):
    """fn(*args); while it runs, a thread says the process lives unless fn reports progress itself."""
    stop = threading.Event()
    if not beats:
        threading.Thread(target=_alive, args=(fh, lock, stop), daemon=True).start()
    try:
        return fn(*args)
    finally:
        stop.set()


def _ignore_terminal_signals() -> None:
    for s in _TERMINAL:  # ignored before they are unblocked: one sent meanwhile is discarded
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _TERMINAL)
    os.dup2(2, 1)  # a library printing to stdout must not mix into the build's results (--json)


def _name_process(name: bytes) -> None:
    """The process's name in ps and /proc/PID/comm (a forked worker shares the server's command line)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def serve() -> None:
    """A worker started as its own interpreter (not forked): its pipes' fds are in argv."""
    _ignore_terminal_signals()
    _serve(int(sys.argv[2]), int(sys.argv[3]))


def fork_server() -> None:
    """The fork server: prepare once -- (fn, args) from the control pipe: imports, the tokenizer's
    bytes held and loaded into the likeliest library -- then fork one worker per pair of pipe
    fds in argv.  It keeps its workers unreaped (their pids cannot be reused while the build may
    signal them) until the build closes the control pipe, then reaps them and exits; a worker
    still alive dies with it (PR_SET_PDEATHSIG)."""
    _ignore_terminal_signals()
    _name_process(b"helixtok-fork")
    ctrl_fd, fds = int(sys.argv[2]), [int(x) for x in sys.argv[3:]]
    pairs = list(zip(fds[::2], fds[1::2]))
    ctrl = os.fdopen(ctrl_fd, "rb")
    msg = _recv(ctrl)
    if msg is _EOF:
        return
    try:
        msg[0](*msg[1])
    except BaseException as e:  # noqa: BLE001 - told to the build through every worker's pipe
        for _, w in pairs:
            with open(w, "wb", closefd=False) as fh:
                _send(fh, ("fatal", _portable(e)))
        return
    from .children import die_with_parent

    me = os.getpid()
    for i, (r, w) in enumerate(pairs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for x in (ctrl_fd, *(fd for r2, w2 in pairs[i + 1:] for fd in (r2, w2))):
                    os.close(x)  # a sibling's pipe held open here would hide that sibling's death
                die_with_parent(me)
                _name_process(b"helixtok-worker")
                _serve(r, w, forked=True)
                code = 0
            finally:
                os._exit(code)  # never back into the server's loop
        os.close(r)
        os.close(w)
    while _recv(ctrl) is not _EOF:
        pass
    # The build has let its workers go: reap them (their CPU time then counts as the build's), or
    # die trying -- the build kills a server still here after a second.
    with contextlib.suppress(ChildProcessError):
        while True:
            os.wait()


def _serve(rfd: int, wfd: int, forked: bool = False) -> None:
    """A worker's main loop: an init call, then tasks, each answered, until the parent closes the pipe."""
    rf, wf, lock = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb"), threading.Lock()
    beat = Beat(wf, lock)
    if forked:
        _send(wf, ("pid", os.getpid()), lock)
    msg = _recv(rf)
    if msg is _EOF:
        return
    fn, args = msg
    try:
        _run(fn, (*args, beat), False, wf, lock)
    except BaseException as e:  # noqa: BLE001 - told to the parent, which stops the build
        _send(wf, ("fatal", _portable(e)), lock)
        return
    _send(wf, ("ready",), lock)
    while (msg := _recv(rf)) is not _EOF:
        fn, args, beats = msg  # one task at a time: its answer needs no id
        try:
            out = ("done", True, _run(fn, args, beats, wf, lock))
        except BaseException as e:  # noqa: BLE001 - the parent decides what an error means
            out = ("done", False, _portable(e))
        beat.flush()  # the task's progress is all in before its answer
        try:
            _send(wf, out, lock)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            _send(wf, ("done", False, _portable(e)), lock)


# --------------------------------------------------------------------------- parent side

# Forked workers need the kernel to end them with the server (PR_SET_PDEATHSIG): Linux only.
FORK = sys.platform == "linux" and os.environ.get("HELIXTOK_FORK", "1") != "0"


def _exited(proc: subprocess.Popen, within: float) -> bool:
    """Whether `proc` has exited, or does within `within` s (its pipes close before it is reaped)."""
    try:
        proc.wait(within)
        return True
    except subprocess.TimeoutExpired:
        return False


def _nothing() -> None:
    pass


def _send_quietly(fh, msg) -> None:
    """Send one message; a pipe closed meanwhile (the pool stopped) is no error."""
    with contextlib.suppress(OSError, ValueError):
        _send(fh, msg)


def _prepared(prepare, init, beat) -> None:
    """A worker started as its own interpreter prepares itself, then makes the init call."""
    prepare[0](*prepare[1])
    init[0](*init[1], beat)


class _Forked:
    """A worker forked by the fork server, as much of subprocess.Popen as the pool uses: its pid
    comes in its first message, its death is the end of its pipe."""

    def __init__(self, server: subprocess.Popen):
        self.server, self.pid, self.returncode = server, None, None
        self._gone = threading.Event()

    def poll(self):
        return self.returncode

    def ended(self) -> None:
        if self.returncode is None:
            self.returncode = -1
        self._gone.set()

    def kill(self) -> None:
        # Only while the server holds it unreaped: its pid is then still its own.
        if self.pid is not None and self.returncode is None and self.server.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass

    def wait(self, timeout: float | None = None):
        if not self._gone.wait(timeout):
            raise subprocess.TimeoutExpired("helixtok-worker", timeout)
        return self.returncode


class _Worker:
    def __init__(self, events: queue.Queue, init: tuple, proc, task_w: int, reply_r: int):
        self.proc = proc
        self.tx, self.rx = os.fdopen(task_w, "wb"), os.fdopen(reply_r, "rb")
        self.outbox: queue.Queue = queue.Queue()
        self.task: tuple[Future, str] | None = None
        self.ready = False
        self.alive = True
        self.since = time.monotonic()  # when it last showed it works
        self.outbox.put(init)
        threading.Thread(target=self._send_loop, daemon=True, name="helixtok-pool-io").start()
        threading.Thread(target=self._recv_loop, args=(events,), daemon=True, name="helixtok-pool-io").start()

    def _send_loop(self) -> None:
        # Writes may block (a stopped worker, a large task): never in the thread that manages the pool.
        while (msg := self.outbox.get()) is not None:
            try:
                _send(self.tx, msg)
            except (OSError, ValueError):
                break  # the worker is gone: its reader reports that
        try:
            self.tx.close()
        except OSError:
            pass

    def _recv_loop(self, events: queue.Queue) -> None:
        while True:
            try:
                msg = _recv(self.rx)
            except Exception:  # noqa: BLE001 - a garbled reply: the worker is no longer trusted
                msg = _EOF
            if msg is _EOF and isinstance(self.proc, _Forked):
                self.proc.ended()
            events.put((self, msg))
            if msg is _EOF:
                return

    def kill(self) -> None:
        """SIGKILL: also ends a stopped process, which SIGTERM would not."""
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass

    def reap(self) -> None:
        """Wait for the killed process, but not for ever: one in an uninterruptible read (a dead
        NFS server) dies only when the read returns, and the build must not wait for that."""
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


class WorkerPool:
    """n worker processes; submit(fn, *args, what=...) returns a Future, FIFO over idle workers
    (urgent=True: ahead of the queue).

    `prepare` = (fn, args): called once, in the fork server before it forks the workers (or in
    each worker where there is no fork server); `init` = (fn, args): each worker then calls
    fn(*args, beat).  A task either reports progress itself (beats=True: it calls beat.bump,
    and silence means stuck) or gets a thread that reports the process alive.  On a worker's
    death or stall, every unfinished future fails with one error naming what that worker was
    doing, and the pool stops.
    """

    def __init__(self, n: int, init: tuple, stall_seconds: float, prepare: tuple | None = None):
        self.n, self.stall = n, stall_seconds
        self.counters = [0, 0, 0]  # bytes, documents, tokens reported by the workers' tasks
        self.failure: HelixtokError | None = None
        self._events: queue.Queue = queue.Queue()
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._stopped = False
        self._workers: list[_Worker] = []
        self._server: subprocess.Popen | None = None
        self._ctrl = None
        # Blocked while the workers start: they inherit the mask and ignore these before unblocking.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _TERMINAL)
        try:
            self._start(n, init, prepare or (_nothing, ()))
        except BaseException:
            self.kill()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        self._manager = threading.Thread(target=self._manage, daemon=True, name="helixtok-pool")
        self._manager.start()

    def _start(self, n: int, init: tuple, prepare: tuple) -> None:
        from .children import start_helper

        pipes = [(*os.pipe(), *os.pipe()) for _ in range(n)]  # task_r, task_w, reply_r, reply_w
        theirs = [fd for tr, _, _, rw in pipes for fd in (tr, rw)]
        try:
            if FORK:
                ctrl_r, ctrl_w = os.pipe()
                try:
                    self._server = start_helper(_FORK_SERVER, MARK, str(ctrl_r), *map(str, theirs),
                                                pass_fds=(ctrl_r, *theirs), env_extra=_FORK_ENV)
                finally:
                    os.close(ctrl_r)
                self._ctrl = os.fdopen(ctrl_w, "wb")
                # The preparation carries the tokenizer's bytes (MBs): written while the server
                # starts, not in this thread (a pipe holds 64 KiB until the server reads).
                threading.Thread(target=_send_quietly, args=(self._ctrl, prepare), daemon=True,
                                 name="helixtok-pool-io").start()
                procs = [_Forked(self._server) for _ in range(n)]
            else:
                procs = [start_helper(_SERVE, MARK, str(tr), str(rw), pass_fds=(tr, rw)) for tr, _, _, rw in pipes]
                init = (_prepared, (prepare, init))
        finally:
            for fd in theirs:
                os.close(fd)
        for proc, (_, tw, rr, _) in zip(procs, pipes):
            self._workers.append(_Worker(self._events, init, proc, tw, rr))

    @property
    def procs(self) -> list:
        return [w.proc for w in self._workers] + ([self._server] if self._server is not None else [])

    def submit(self, fn, *args, what: str, beats: bool = False, urgent: bool = False) -> Future:
        f: Future = Future()
        with self._lock:
            if self._stopped:
                f.set_exception(self.failure or HelixtokError("the worker processes were stopped"))
                return f
            task = (f, fn, args, what, beats)
            self._pending.appendleft(task) if urgent else self._pending.append(task)
            self._dispatch()
        return f

    def _dispatch(self) -> None:
        for w in self._workers:
            if not self._pending:
                return
            if w.alive and w.task is None:
                while self._pending:
                    f, fn, args, what, beats = self._pending.popleft()
                    if f.set_running_or_notify_cancel():
                        w.task, w.since = (f, what), time.monotonic()
                        w.outbox.put((fn, args, beats))
                        break

    def _manage(self) -> None:
        while True:
            try:
                w, msg = self._events.get(timeout=0.2)
            except queue.Empty:
                w = msg = None
            with self._lock:
                if w is not None:
                    self._handle(w, msg)
                self._check_stalls()
                self._dispatch()
                if self._stopped and not any(x.alive for x in self._workers):
                    return

    def _handle(self, w: _Worker, msg) -> None:
        if msg is _EOF:
            w.alive = False
            if not self._stopped:
                what = "starting" if not w.ready else w.task[1] if w.task else "waiting for work"
                who = f"a worker process died while {what}"
                if self._server is not None and _exited(self._server, 1.0):
                    who += ": the fork server (the process that loads the tokenizer and forks the workers) died"
                self._break(HelixtokError(f"{who}; it was killed (out of memory?); rerun the same command to resume"))
            return
        w.since = time.monotonic()
        kind = msg[0]
        if kind == "pid" and isinstance(w.proc, _Forked):
            w.proc.pid = msg[1]
        elif kind == "progress":
            for i in range(3):
                self.counters[i] += msg[1 + i]
        elif kind == "ready":
            w.ready = True
        elif kind == "fatal":
            err = msg[1]
            self._break(err if isinstance(err, HelixtokError) else
                        HelixtokError(f"a worker process failed while starting: {type(err).__name__}: {err}"))
        elif kind == "done" and w.task is not None:
            f, _ = w.task
            w.task = None
            if msg[1]:
                f.set_result(msg[2])
            else:
                f.set_exception(msg[2])

    def _check_stalls(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            if w.alive and (w.task is not None or not w.ready) and now - w.since > self.stall:
                what = "starting" if not w.ready else w.task[1]
                self._break(HelixtokError(f"no progress for {self.stall:g} s: a worker seems hung while {what}; "
                                          "rerun the same command to resume (or raise --stall-timeout for huge "
                                          "documents)"))
                return

    def _break(self, err: HelixtokError) -> None:
        """Stop: every unfinished future fails with `err` (the first failure is what the build says)."""
        if self.failure is None:
            self.failure = err
        self._stopped = True
        for w in self._workers:
            w.kill()
            if w.task is not None:
                w.task[0].set_exception(self.failure)
                w.task = None
            w.outbox.put(None)
        if self._server is not None:  # after the workers it holds unreaped: a forked worker dies with it
            with contextlib.suppress(OSError):
                self._server.kill()
        while self._pending:
            f = self._pending.popleft()[0]
            if f.set_running_or_notify_cancel():
                f.set_exception(self.failure)

    def kill(self) -> None:
        """Stop now (Ctrl-C, a failed unit); returns once every worker has exited (or 5 s after its kill)."""
        with self._lock:
            if not self._stopped:
                self._break(HelixtokError("the build stopped"))
        for w in self._workers:
            w.kill()
        self._end_server(kill=True)  # a forked worker not yet known by its pid dies with it
        for w in self._workers:
            w.reap()

    def _end_server(self, kill: bool) -> None:
        """Close the fork server's control pipe (it exits) or kill it; either way its workers end."""
        if self._ctrl is not None:
            with contextlib.suppress(OSError, ValueError):
                self._ctrl.close()
        if self._server is None:
            return
        if kill:
            with contextlib.suppress(OSError):
                self._server.kill()
        try:
            self._server.wait(1.0 if not kill else 5.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                self._server.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._server.wait(5.0)

    def close(self, timeout: float = 1.0) -> None:
        """Every task answered: let the workers exit (they read the end of their pipe), killing
        any that does not within `timeout` (a stopped one never would; one that is still
        shutting down has nothing left to write: its results are all in)."""
        with self._lock:
            self._stopped = True
            for w in self._workers:
                w.outbox.put(None)
            while self._pending:  # submitted and never to run: failed, not left waiting for ever
                f = self._pending.popleft()[0]
                if f.set_running_or_notify_cancel():
                    f.set_exception(HelixtokError("the worker processes were stopped"))
        deadline = time.monotonic() + timeout
        for w in self._workers:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
                w.reap()
        self._end_server(kill=False)
