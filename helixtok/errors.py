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
