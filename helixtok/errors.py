"""Typed errors: every failure a user can cause is a HelixtokError with a one-line message."""


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
