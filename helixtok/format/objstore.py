"""Object storage through fsspec (s3://, gs://, hf://, any fsspec URL): recognise, open and stamp objects."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import threading
import time

from .errors import ConfigError, HelixtokError, InputError, StorageError

READ_BLOCK = 8 << 20  # bytes per ranged GET when streaming an object
# Local files are read through a 1 MiB buffer: with the default 8 KiB one, iterating the lines
# of a .jsonl (documents of ~10 KB) took 0.66 s per 615 MB instead of 0.16 s (measured).
LOCAL_BUFFER = 1 << 20
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Metadata fields that change when an object's content does, in order of preference:
# S3 and compatible servers (ETag), GCS (generation, etag), HF Hub (blob id), then time.
_STAMP_KEYS = ("ETag", "etag", "generation", "blob_id", "md5Hash", "mtime", "LastModified", "last_modified",
               "updated", "created")


# How long a storage call may show no life before it fails (reads are first asked again: see
# Watched).  A build's and push's --stall-timeout set it for their calls; the reading side (pull,
# verify URL, info URL, MemmapChunkDataset over a URL) takes it from stall_bound() or this default.
READ_STALL_SECONDS = 120.0
_stall: contextvars.ContextVar[float] = contextvars.ContextVar("helixtok_stall", default=READ_STALL_SECONDS)
# Calls that only read: asked again (in a new thread) when one shows no life for its share of the bound.
IDEMPOTENT = frozenset(("cat_file", "info", "ls", "exists", "isfile", "isdir", "find", "size", "read", "readinto",
                        "get_file", "_fetch_range"))
READ_TRIES = 3


@contextlib.contextmanager
def stall_bound(seconds: float | None):
    """Storage calls in this block (this thread) wait at most `seconds` for a sign of life (None: as is)."""
    token = _stall.set(seconds) if seconds is not None else None
    try:
        yield
    finally:
        if token is not None:
            _stall.reset(token)


def current_stall() -> float:
    return _stall.get()


class Watched:
    """An fsspec filesystem (or a file it opened) whose every call runs in a thread of its own and is
    waited for while it shows life (an answer; a part of a transfer done): a server that stops
    answering fails the call after `stall` s, naming the URL, instead of holding a command or a
    training job's DataLoader for ever.  A call that only reads (IDEMPOTENT) is asked again, in a
    fresh thread, after stall / READ_TRIES s of silence, up to READ_TRIES times in all: a lost
    request costs a third of the bound, a dead server the whole bound, then one StorageError.  The
    abandoned thread is a daemon: it cannot hold up the exit."""

    def __init__(self, obj, url: str, stall: float | None = None):
        self._obj, self._url, self._stall = obj, url, current_stall() if stall is None else stall

    def __getattr__(self, name: str):
        value = getattr(self._obj, name)
        return (lambda *a, **kw: self._call(name, value, a, kw)) if callable(value) else value

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._call("close", self._obj.close, (), {})

    def _call(self, name, fn, a, kw):
        from fsspec.callbacks import Callback

        tries = READ_TRIES if name in IDEMPOTENT else 1
        wait = self._stall / tries
        last = [time.monotonic()]
        if name in ("put_file", "get_file"):
            class Beat(Callback):
                def call(self, *_, **__):
                    last[0] = time.monotonic()
            kw = {**kw, "callback": Beat()}
        for attempt in range(tries):
            box: dict = {}

            def run() -> None:
                try:
                    box["value"] = fn(*a, **kw)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    box["error"] = e
            t = threading.Thread(target=run, daemon=True, name="helixtok-storage")
            last[0] = time.monotonic()
            t.start()
            while t.is_alive() and time.monotonic() - last[0] <= wait:
                t.join(min(0.2, wait))
            if not t.is_alive():
                break
        else:
            raise StorageError(f"{redact(self._url)}: no answer from the storage for {self._stall:g} s ({name}"
                               f"{f', asked {tries} times' if tries > 1 else ''}); check the server, then rerun "
                               "(or raise --stall-timeout / stall_timeout=)")
        if "error" in box:
            raise box["error"]
        value = box.get("value")
        if name == "open":  # its reads are storage calls too
            return Watched(value, self._url, self._stall)
        return value


def watched_filesystem(url: str, stall: float | None = None):
    """(Watched fsspec filesystem, path without protocol): filesystem() with every call bounded."""
    fs, root = filesystem(url)
    return Watched(fs, url, stall), root


def is_url(path: str) -> bool:
    """A remote location (a protocol other than file://); plain paths and file:// stay local."""
    return isinstance(path, str) and bool(_URL.match(path)) and not path.startswith("file://")


def redact(url: str) -> str:
    """The URL without user:password@: messages and manifests never carry credentials."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@", r"\1", url)


def filesystem(url: str):
    """(fsspec filesystem, path without protocol) for a URL; one clear line when its driver is missing."""
    try:
        import fsspec
    except ImportError as e:  # pragma: no cover - fsspec is a dependency
        raise ConfigError("object storage needs fsspec: pip install fsspec") from e
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        proto = url.split("://", 1)[0]
        pkg = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
               "hf": "huggingface_hub"}.get(proto, f"the fsspec driver for {proto}://")
        raise ConfigError(f"{redact(url)}: reading {proto}:// needs {pkg}: pip install {pkg}") from e
    except ValueError as e:
        raise ConfigError(f"{redact(url)}: not a usable URL ({e})") from e


_DRIVERS = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "huggingface_hub", "adlfs", "azure",
            "requests", "urllib3")


@contextlib.contextmanager
def storage_errors(url: str):
    """A storage driver's own exceptions (no credentials, endpoint unreachable, access denied) as one line."""
    try:
        yield
    except HelixtokError:
        raise
    except Exception as e:
        if not any(type(c).__module__.split(".")[0] in _DRIVERS for c in _chain(e)) and not isinstance(
                e, PermissionError):
            raise
        name = type(e).__name__
        msg = (str(e).splitlines() or [""])[0][:200]
        if name == "NoCredentialsError" or "credentials" in msg.lower():
            fix = "set credentials the usual way for this storage (for S3: AWS_ACCESS_KEY_ID and " \
                  "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)"
        elif isinstance(e, PermissionError) or "denied" in msg.lower() or "forbidden" in msg.lower():
            fix = "check that these credentials may read (and, for OUT, write) there"
        else:
            fix = "check the URL, the endpoint (AWS_ENDPOINT_URL) and the network, then rerun"
        raise ConfigError(f"{redact(url)}: {name}: {msg}; {fix}") from None


def reports_storage_errors(fn):
    """Run fn under storage_errors() for the first URL among its arguments (or a list of them)."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        urls = [x for x in a if isinstance(x, str) and is_url(x)]
        urls += [x[0] for x in a if isinstance(x, list) and x and is_url(x[0])]
        if not urls:
            return fn(*a, **kw)
        with storage_errors(urls[0]):
            return fn(*a, **kw)

    return wrapper


def _chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def open_input(path: str):
    """A binary reader for a local path or a URL (streamed in READ_BLOCK ranged reads)."""
    if not is_url(path):
        return open(path, "rb", buffering=LOCAL_BUFFER)
    fs, p = filesystem(path)
    try:
        return fs.open(p, "rb", block_size=READ_BLOCK)
    except FileNotFoundError as e:
        raise InputError(f"{redact(path)}: object not found (deleted during the build?); rerun") from e


def expired(e: BaseException) -> bool:
    """The object changed while it was being read (s3fs reads every range If-Match its first ETag)."""
    return type(e).__name__ == "FileExpired"


def size_of(fh) -> int:
    """Size of an open input (local file or fsspec file)."""
    size = getattr(fh, "size", None)
    return size if isinstance(size, int) else os.fstat(fh.fileno()).st_size


def stamp(info: dict) -> str:
    """A value that changes when the object does (ETag, generation, ...), from fsspec's info()."""
    for k in _STAMP_KEYS:
        v = info.get(k)
        if v:
            return str(v)
    return ""


def local_stamp(st: os.stat_result) -> str:
    """A local file's stamp: mtime and ctime.  A file replaced, or rewritten with its old size and
    mtime put back (cp -p, rsync -t, touch -r), has a new ctime, which no one can set (git's
    index compares it too).  A chmod changes it as well: reported as a change, the safe side.
    Not the inode: FUSE mounts number files afresh each time, and a resume after a remount
    would be refused for nothing."""
    return f"{st.st_mtime_ns}.{st.st_ctime_ns}"


@reports_storage_errors
def current(path: str) -> tuple[int, str] | None:
    """(size, stamp) of a file or object as it is now (None if gone): what discovery recorded, read
    again.  Locally see local_stamp; an object's (its ETag or the like) bypasses fsspec's listing cache."""
    if not is_url(path):
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_size, local_stamp(st)
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    try:
        info = fs.info(p)
    except FileNotFoundError:
        return None
    return int(info.get("size") or 0), stamp(info)


class Folder:
    """Files under a local folder or a URL prefix, by relative path (what verify reads); `stall`
    bounds each storage call (default: the watched filesystem's)."""

    def __init__(self, root: str, stall: float | None = None):
        self.root = root
        self.fs = watched_filesystem(root, stall)[0] if is_url(root) else None

    def _path(self, rel: str) -> str:
        return f"{self.root.rstrip('/')}/{rel}" if self.fs else os.path.join(self.root, rel)

    def size(self, rel: str) -> int | None:
        """Bytes in the file, or None when it is missing."""
        p = self._path(rel)
        if self.fs is None:
            return os.path.getsize(p) if os.path.isfile(p) else None
        try:
            return int(self.fs.info(p)["size"])
        except FileNotFoundError:
            return None

    def open(self, rel: str):
        if self.fs is None:
            return open_input(self._path(rel))
        return self.fs.open(self._path(rel), "rb", block_size=READ_BLOCK)

    def read_range(self, rel: str, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of a file (one ranged GET from object storage)."""
        if self.fs is not None:
            return self.fs.cat_file(self._path(rel), start=offset, end=offset + n)
        with open(self._path(rel), "rb") as fh:
            fh.seek(offset)
            return fh.read(n)
