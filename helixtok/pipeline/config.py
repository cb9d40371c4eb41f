"""BuildConfig: every option of a build, validated once at the edge."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from ..format import limits
from ..format.errors import ConfigError
from .chat import ChatSpec


def cache_root() -> str:
    """Per-user cache of derived facts (backend parity verdicts, gzip seek indexes): $HELIXTOK_CACHE."""
    return os.environ.get("HELIXTOK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "helixtok")


PACKINGS = ("packed", "document", "bestfit")
BACKENDS = ("auto", "hf", "fastokens", "gigatoken", "tiktoken")
SPECIAL_POLICIES = ("text", "extract")  # what special-token strings inside documents become
# Input per worker process when --workers is left to helixtok: a forked worker costs milliseconds
# to start (pool.py's fork server loads the tokenizer once), so one per ~0.1 s of tokenizing with
# each library (fastokens 75-120 MB/s a core on unseen text, gigatoken 50-80; tiktoken ~10 and tokenizers 2-4
# get WORKER_BYTES_SLOW).  Below one worker's share the build tokenizes in its own process.
WORKER_BYTES = {"fastokens": 16 << 20, "gigatoken": 16 << 20}
WORKER_BYTES_SLOW = 1 << 20


def worker_bytes(backend: str) -> int:
    """Input per worker process with `backend` when --workers is not given.  $HELIXTOK_WORKER_BYTES
    sets it for all (1: as many processes as cores and units)."""
    env = os.environ.get("HELIXTOK_WORKER_BYTES", "")
    if env and (not env.isdigit() or int(env) < 1):
        raise ConfigError(f"HELIXTOK_WORKER_BYTES must be a whole number of bytes, at least 1; got {env!r}")
    if env:
        return int(env)
    return WORKER_BYTES.get(backend, WORKER_BYTES_SLOW)

DEFAULT_SHARD_BYTES = 1 << 30
# ~4 MiB of input per work unit: big enough that per-unit overhead is noise,
# small enough that N workers stay balanced on corpora of a few dozen MB.
DEFAULT_UNIT_BYTES = 4 << 20


@dataclass(frozen=True, kw_only=True)
class BuildConfig:
    seq_len: int = 2048
    packing: str | None = None  # None: "packed", or "bestfit" for a chat build
    min_tail_len: int | None = None  # document packing: default seq_len // 4; bestfit: default 0 (drop nothing)
    text_field: str | None = None  # None: "text", or "messages" for a chat build
    include: tuple[str, ...] = ()  # --include: keep only the files found whose relative path matches one
    exclude: tuple[str, ...] = ()  # --exclude: leave out the files found whose relative path matches one
    code: bool = False  # --code: source files (discover.CODE_SUFFIXES) are read as text documents, one a file
    add_bos: bool | None = None  # None: the tokenizer's own rule (its post-processor); True/False: --bos/--no-bos
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    val_fraction: float = 0.0
    val_size: int = 0  # --val-size N: the N documents with the smallest split hashes are val (docs/format.md)
    val_cut: int = 0  # --val-size's threshold, found by the build's first pass (builder.py); part of the plan
    split_seed: int = 0
    shard_bytes: int = DEFAULT_SHARD_BYTES
    unit_bytes: int = DEFAULT_UNIT_BYTES
    workers: int = 0  # N: N tokenizing processes (at most one per unit); 0 = as many as the input keeps busy, up to all cores
    strict: bool = False
    batch_chars: int = 1 << 20  # characters per encode_batch call in a worker
    max_piece_chars: int = -1  # longer documents are encoded in pieces (-1: limits.PIECE_CHARS)
    long_doc_bytes: int = -1  # larger documents are also read in pieces, memory flat (-1: limits.LONG_DOC_BYTES)
    stall_seconds: float = 600.0  # no progress from any worker for this long: the build fails
    executor: str = "local"  # where units are tokenized: "local" (this machine's processes), "ray[:ADDRESS]"
    strip: bool = False  # str.strip() every document first (HelixLM's compiler does)
    special_tokens: str = "text"  # special-token strings in documents: "text" (as characters) or "extract"
    backend: str = "auto"  # auto: tiktoken when it reproduces HF's ids on a corpus sample, else hf
    # A chat build: rows of messages rendered with a template (chat.py); True: the template of the
    # tokenizer_config.json beside the tokenizer, --loss assistant (builder resolves it).
    chat: ChatSpec | bool | None = None
    # --map module:function (or transform=fn): each record (a JSON object, a Parquet/Arrow row as a
    # dict, a text file as {"text", "file"}) to its document's text, None or Skip(reason) to leave
    # it out (sources.RecordMap); its source's sha256 is part of the plan.
    transform: object = None
    transform_sha256: str = ""
    # --keep-fields: small fields of each record stored beside its document's source (docs/format.md,
    # "Kept fields"); None: ("id",) where sources are kept (packed, bestfit), () for document packing.
    keep_fields: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_piece_chars == -1:
            object.__setattr__(self, "max_piece_chars", limits.PIECE_CHARS)
        if self.long_doc_bytes == -1:
            object.__setattr__(self, "long_doc_bytes", limits.LONG_DOC_BYTES)
        for name in ("include", "exclude"):  # a str is one glob, not its characters
            v = getattr(self, name)
            object.__setattr__(self, name, (v,) if isinstance(v, str) else tuple(v))
        if self.chat is False:
            object.__setattr__(self, "chat", None)
        if self.packing is None:
            object.__setattr__(self, "packing", "bestfit" if self.chat is not None else "packed")
        if self.text_field is None:
            object.__setattr__(self, "text_field", "messages" if self.chat is not None else "text")
        if self.seq_len < 1:
            raise ConfigError(f"--seq-len must be >= 1, got {self.seq_len}")
        if self.packing not in PACKINGS:
            raise ConfigError(f"--pack must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
        if self.min_tail_len is not None:
            if self.packing == "packed":
                raise ConfigError("--min-tail-len applies only to --pack document and --pack bestfit")
            if not 0 <= self.min_tail_len <= self.seq_len:
                raise ConfigError(
                    f"--min-tail-len must be between 0 and --seq-len ({self.seq_len}), got {self.min_tail_len}"
                )
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.transform is not None:
            if self.chat is not None:
                raise ConfigError("--map applies to text builds (a chat build renders each row's conversation)")
            spec, sha = map_spec(self.transform)
            object.__setattr__(self, "transform", spec)
            object.__setattr__(self, "transform_sha256", sha)
        if self.keep_fields is None:
            object.__setattr__(self, "keep_fields", ("id",) if self.packing != "document" else ())
        else:
            names = (self.keep_fields,) if isinstance(self.keep_fields, str) else tuple(self.keep_fields)
            names = tuple(n.strip() for part in names for n in part.split(",") if n.strip())
            if names and self.packing == "document":
                raise ConfigError("--keep-fields applies to --pack packed and bestfit (a document-packed build keeps "
                                  "no document sources); give --keep-fields '' or another packing")
            object.__setattr__(self, "keep_fields", tuple(dict.fromkeys(names)))
        if self.val_size < 0:
            raise ConfigError(f"--val-size must be a number of documents, at least 0, got {self.val_size}")
        if self.val_size and self.val_fraction:
            raise ConfigError("give --val-fraction or --val-size, not both")
        if self.val_size and self.chat is not None:
            raise ConfigError("--val-size applies to text builds (a conversation's split hash is of its rendering); "
                              "give a chat build --val-fraction")
        if self.shard_bytes < 1:
            raise ConfigError(f"--shard-size must be positive, got {self.shard_bytes}")
        if self.workers < 0:
            raise ConfigError(f"--workers must be >= 0 (0 = all cores), got {self.workers}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.special_tokens not in SPECIAL_POLICIES:
            raise ConfigError(f"--special-tokens must be one of {', '.join(SPECIAL_POLICIES)}, "
                              f"got {self.special_tokens!r}")
        if self.unit_bytes < 1:
            raise ConfigError(f"--unit-size must be positive, got {self.unit_bytes}")
        if self.stall_seconds <= 0:
            raise ConfigError(f"--stall-timeout must be positive, got {self.stall_seconds}")
        if self.executor != "local" and self.executor.split(":", 1)[0] != "ray":
            raise ConfigError(f"--executor must be local or ray[:ADDRESS], got {self.executor!r}")
        if not self.text_field:
            raise ConfigError("--text-field must not be empty")
        if self.chat is not None:
            # The template writes BOS and end-of-turn tokens, and whole conversations are kept.
            if self.add_bos or self.strip or self.special_tokens != "text":
                raise ConfigError("--bos, --strip and --special-tokens do not apply to --chat: the template decides")
            if self.min_tail_len is not None:  # trainable_tokens counts what is stored
                raise ConfigError("--min-tail-len does not apply to --chat: every conversation that fits in --seq-len "
                                  "is kept (a longer one is dropped, counted, or cut with --truncate)")
            object.__setattr__(self, "add_bos", False)

    @property
    def tail_len(self) -> int:
        """Minimum tail kept: document packing seq_len // 4 unless given (at least 1); bestfit 0
        unless given (nothing dropped); packed has none.  A chat build keeps every conversation."""
        if self.min_tail_len is not None:
            return self.min_tail_len
        if self.packing == "document":
            return 1 if self.chat is not None else max(1, self.seq_len // 4)
        return 0

    @property
    def has_val(self) -> bool:
        """Whether the build has a val split (--val-fraction > 0 or --val-size > 0)."""
        return self.val_fraction > 0 or self.val_size > 0

    @property
    def ray_address(self) -> str | None:
        """None: not on Ray; "": Ray ($RAY_ADDRESS, or a local cluster); else the cluster's address."""
        kind, _, address = self.executor.partition(":")
        return address if kind == "ray" else None

    @property
    def num_workers(self) -> int:
        return self.workers or len(os.sched_getaffinity(0))

    def identity(self) -> dict:
        """The options that change the output bytes (workers and batch sizes do not)."""
        d = asdict(self)
        for k in ("workers", "strict", "batch_chars", "stall_seconds", "executor"):
            d.pop(k)
        if not self.val_size:  # (absent unless given: the plans of builds without it stay as they were)
            d.pop("val_size")
            d.pop("val_cut")
        if self.transform is None:
            d.pop("transform")
            d.pop("transform_sha256")
        if not self.code:  # (absent unless given, as val_size)
            d.pop("code")
        if self.packing != "packed":
            d["min_tail_len"] = self.tail_len
        return d


# --map / transform=: the function a build's records go through (sources.RecordMap applies it).


def map_spec(fn) -> tuple[str, str]:
    """(module:qualname, sha256 of its module's source file) of a --map / transform= function: what
    the plan records (a changed module is a changed plan) and each process imports."""
    import hashlib
    import inspect

    if isinstance(fn, str):
        spec = fn
        fn = load_map(spec)
    else:
        spec = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', '')}"
        if "<" in spec or getattr(fn, "__module__", None) is None or _resolve(spec) is not fn:
            raise ConfigError(f"transform {fn!r}: give a function defined at the top level of a module (importable as "
                              "module:name), not a lambda, a closure or a method")
    # The whole module's source: a helper it calls changed is a changed function too.
    try:
        with open(inspect.getsourcefile(fn), "rb") as fh:
            src = fh.read()
    except (OSError, TypeError):
        import marshal

        src = marshal.dumps(fn.__code__)
    return spec, hashlib.sha256(src).hexdigest()


def _resolve(spec: str):
    import importlib
    import os
    import sys

    mod, _, name = spec.partition(":")
    try:
        m = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if os.getcwd() in sys.path or e.name != mod.split(".")[0]:
            raise
        sys.path.append(os.getcwd())  # `--map clean:fn` beside the command, as `python -m` would find it
        m = importlib.import_module(mod)
    obj = m
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def load_map(spec: str):
    """The function `module:name` names, imported; one line when it is not there."""
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"--map {spec!r}: give it as module:function (e.g. clean:keep_english)")
    try:
        fn = _resolve(spec)
    except ImportError as e:
        raise ConfigError(f"--map {spec}: cannot import {spec.split(':')[0]!r} ({e}); run from its folder or put it on "
                          "PYTHONPATH") from None
    except AttributeError:
        raise ConfigError(f"--map {spec}: the module has no {spec.split(':')[1]!r}") from None
    if not callable(fn):
        raise ConfigError(f"--map {spec}: not a function")
    return fn
