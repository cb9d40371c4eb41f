"""Typed errors: every failure a user can cause is a HelixtokError with a one-line message."""

import contextvars

# Set while the command line runs a command: its errors name options (--overwrite); a caller of
# the Python API reads keywords (overwrite=True).
from_cli: contextvars.ContextVar[bool] = contextvars.ContextVar("helixtok_from_cli", default=False)


class HelixtokError(Exception):
    """Base class; the CLI prints the message (no traceback) and exits 1."""


class InputError(HelixtokError):
    """A corpus file is missing, unreadable, of an unknown type, or malformed."""


class TokenizerError(HelixtokError):
    """The tokenizer cannot be found or loaded, or lacks a needed special token."""


class ConfigError(HelixtokError):
    """Options that contradict each other or the output folder's state."""


class DatasetError(HelixtokError):
    """A built dataset is missing, unfinished, corrupt or incompatible."""


class InternalError(HelixtokError):
    """A bug in helixtok or a library it calls, not a fault of the input: said so, with where its
    traceback was kept for the report."""


class StorageError(HelixtokError):
    """Object storage that stopped answering (past the stall bound), or refused a request."""


class Interrupted(KeyboardInterrupt):
    """A stop asked for by a signal (Ctrl-C, SIGTERM, SIGHUP): the CLI exits 128 + signum, resumably."""

    def __init__(self, signum: int = 2):
        super().__init__(signum)
        self.signum = signum


def resource_error(e: OSError, where: str = "") -> HelixtokError | None:
    """One line with the fix for an OSError a machine's limits cause (disk full, open files,
    file size), whichever phase met it; None for any other.  `where`: the folder being built."""
    import errno

    name = e.filename or where
    if e.errno == errno.ENOSPC:
        said = f"{where}: disk full while building" if where else f"disk full while writing {name or 'output'}"
        return HelixtokError(f"{said}; no dataset was published. Free space and rerun the same command to resume")
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return HelixtokError(f"too many open files{f' ({name})' if name else ''}; raise the limit (ulimit -n 4096) "
                             "or use fewer --workers, then rerun the same command to resume")
    if e.errno == errno.EFBIG:
        return HelixtokError(f"{name or 'a file'}: larger than this process may write (ulimit -f); raise the limit "
                             "(ulimit -f unlimited) or use a smaller --shard-size, then rerun the same command to resume")
    return None


_NO_THREAD = ("can't start new thread", "Failed to launch worker thread", "Resource temporarily unavailable",
              "Cannot allocate memory")


def memory_error(e: BaseException, doing: str) -> HelixtokError | None:
    """One line with the fix for running out of memory (or of the address space `ulimit -v` allows)
    while `doing` something: a MemoryError (pyarrow's ArrowMemoryError is one), or a library that
    could not start a thread or allocate (pyarrow, CPython say so in their messages); None for
    any other error.  Names the limit when one is set, since that is then what ran out."""
    import resource

    if not (isinstance(e, MemoryError) or any(s in str(e) for s in _NO_THREAD)):
        return None
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    limit = (f"; this process may use {soft / (1 << 30):.2f} GiB of address space (ulimit -v): a tokenizing "
             "process needs about 1 GiB (more with a larger tokenizer), so raise it") if soft != resource.RLIM_INFINITY \
        else ""
    return HelixtokError(f"out of memory while {doing} ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"
                         f"{limit}; or use fewer --workers or a smaller --unit-size, then rerun the same command "
                         "to resume")


# Messages name command-line options; a caller of the Python API reads keywords instead
# (python_terms, at the API's edge).  Longest first: --bos must not eat --bos-token.
_KEYWORDS = {
    "--overwrite": "overwrite=True", "--pack": "packing", "--seq-len": "seq_len", "--min-tail-len": "min_tail_len",
    "--val-fraction": "val_fraction", "--val-size": "val_size", "--map": "transform", "--split-seed": "split_seed", "--shard-size": "shard_bytes",
    "--unit-size": "unit_bytes", "--workers": "workers", "--backend": "backend",
    "--special-tokens": "special_tokens", "--stall-timeout": "stall_seconds", "--executor": "executor",
    "--text-field": "text_field", "--keep-fields": "keep_fields", "--code": "code=True", "--strict": "strict=True", "--eos-token": "eos_token",
    "--bos-token": "bos_token", "--pad-token": "pad_token", "--no-bos": "add_bos=False", "--bos": "add_bos=True",
    "--staging": "staging", "--strip": "strip=True", "--num-tasks": "task=(k, n)", "--task-index": "task=(k, n)",
    "--chat-template": "chat_template", "--chat-kwargs": "chat_kwargs", "--chat-date": "chat_date",
    "--chat-split": "chat_split",
    "--truncate": "truncate", "--loss": "loss", "--chat": "chat=True",
}


def python_terms(e: HelixtokError) -> HelixtokError:
    """The same error for a caller of the Python API: its command-line options named as keywords."""
    import re

    pattern = "|".join(re.escape(k) for k in sorted(_KEYWORDS, key=len, reverse=True))
    msg = re.sub(rf"(?<![\w-])({pattern})(?![\w-])", lambda m: _KEYWORDS[m.group(1)], str(e))
    if msg == str(e):
        return e
    out = type(e)(msg)
    out.__cause__ = e.__cause__
    return out
