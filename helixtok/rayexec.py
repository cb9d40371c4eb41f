"""Work units as Ray tasks (`--executor ray[:ADDRESS]`): the pool's interface over a Ray cluster.

Each task reads its unit's inputs itself (no text passes through the object store), writes the
unit's shards into the build's state folder (a folder every node sees at the same path) or, for
an object-storage OUT, into a staging folder of its node's own and uploads them; it returns the
journal entry, which the driver (this process) journals, and the driver publishes the manifest.
A task whose worker dies is retried by Ray (max_retries); a unit's files are named for the run,
so a retry writes them afresh, and the bytes are those of a local build.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from concurrent.futures import Future

from . import errors
from .errors import ConfigError, HelixtokError
from .manifest import write_json_atomic
from .publish import upload_unit
from .tokenizer import hold_bytes, release_bytes
from .unit import _init_worker, done_path, run_unit, state_files

RETRIES = 3  # a task is retried this many times when its worker process or node dies


def _task(cwd: str, config, state: str, run_id: str, remote, tokenizer: bytes, unit, info):
    """On a Ray worker: tokenize one unit as a pool worker would; with `remote` (URL, folder), in a
    staging folder of this node's own, then upload its shards there.  Errors come back as values
    (class name, message): the driver raises them as the one-line errors they are."""
    os.chdir(cwd)  # relative input paths, as the driver's command line gave them
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
        return "ok", r
    except HelixtokError as e:
        return "error", type(e).__name__, str(e)
    except OSError as e:
        return "oserror", e.errno, e.strerror, e.filename
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


class RayExecutor:
    """submit(fn=run_unit, unit, info) -> Future of the journal entry, on a Ray cluster: the one at
    ADDRESS, the one $RAY_ADDRESS names, or a local one started for this build."""

    def __init__(self, address: str | None, config, state: str, run_id: str, tokenizer: bytes,
                 remote: tuple[str, str] | None = None):
        self.ray = ray = require_ray()
        self._started = not ray.is_initialized()
        if self._started:
            try:
                ray.init(address=address or None, logging_level=logging.ERROR, log_to_driver=False,
                         configure_logging=False, include_dashboard=False if not address else None)
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise ConfigError(f"--executor ray{':' + address if address else ''}: cannot reach the Ray cluster "
                                  f"({str(e).splitlines()[0][:200]}); start it (ray start --head) or fix the address"
                                  ) from None
        self.n = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.counters = [0, 0, 0]  # bytes, documents, tokens of the units finished
        # The tokenizer's bytes go into the object store once; each task gets them from there.
        self._args = (os.getcwd(), config, os.path.abspath(state), run_id, remote, ray.put(tokenizer))
        # The driver's object-storage settings (endpoint, credentials) travel with its tasks.
        env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "HELIXTOK_"))}
        self._task = ray.remote(num_cpus=1, max_retries=RETRIES, retry_exceptions=False)(_task).options(
            runtime_env={"env_vars": env} if env else None)
        self._refs: list = []
        self._uploads = remote is not None  # the tasks journal on their own nodes: the driver journals too

    def submit(self, fn, unit, info, *, what: str, beats: bool = False) -> Future:
        ref = self._task.remote(*self._args, unit, info)
        self._refs.append(ref)
        out: Future = Future()

        def done(f) -> None:
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
                if self._uploads:  # for a resume
                    write_json_atomic(done_path(self._args[2], r["index"]), r, durable=False)
            except BaseException as e:  # noqa: BLE001 - this runs in Ray's thread: the build's waits on `out`
                out.set_exception(e)
                return
            self.counters[0] += unit.est_bytes
            self.counters[1] += sum(r["documents"].values())
            self.counters[2] += sum(r["tokens"].values())
            out.set_result(r)

        ref.future().add_done_callback(done)
        return out

    def kill(self) -> None:
        for ref in self._refs:
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 - finished already, or the cluster is gone
                pass
        self.close()

    def close(self) -> None:
        if self._started and self.ray.is_initialized():
            self.ray.shutdown()
