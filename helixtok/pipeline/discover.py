"""Find corpus files: paths, folders (recursively), globs and URLs, into a sorted list of inputs."""

from __future__ import annotations

import fnmatch
import glob
import os
import posixpath
import stat

from ..format.errors import InputError
from ..format.objstore import filesystem, is_url, local_stamp, redact, reports_storage_errors, stamp
from .inputfile import InputFile
from .tally import Tally

SUFFIXES = {
    ".txt": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".jsonl.zstd": "jsonl.zst",
    # C4, Dolma and others name their JSON Lines files .json.gz: read as JSON Lines, and refused
    # with one line when one holds a single JSON document instead (units.py).
    ".json": "jsonl",
    ".json.gz": "jsonl.gz",
    ".json.zst": "jsonl.zst",
    ".json.zstd": "jsonl.zst",
    ".parquet": "parquet",
    ".arrow": "arrow",  # Arrow IPC (stream or file): HF datasets' save_to_disk folders and cache
}
# Metadata that HF datasets writes beside its .arrow files: part of the dataset, not text.
HF_DATASETS_METADATA = {"state.json", "dataset_info.json", "dataset_dict.json"}


def _hf_metadata(path: str) -> bool:
    """Files HF datasets keeps beside its Arrow data (info, state, and its cache's .lock files)."""
    name = posixpath.basename(path)
    return name in HF_DATASETS_METADATA or name.endswith(".lock")
SUPPORTED = ", ".join(SUFFIXES)
# --code: source files, each read as one text document (as .txt); docs/reference.md lists them.
CODE_SUFFIXES = (".py", ".pyi", ".pyx", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cu", ".cuh", ".rs", ".go",
                 ".java", ".kt", ".kts", ".scala", ".js", ".mjs", ".cjs", ".ts", ".tsx", ".jsx", ".rb", ".php", ".cs",
                 ".swift", ".m", ".mm", ".lua", ".pl", ".pm", ".r", ".jl", ".hs", ".ml", ".mli", ".ex", ".exs", ".erl",
                 ".clj", ".el", ".lisp", ".scm", ".dart", ".zig", ".nim", ".f90", ".f", ".sh", ".bash", ".zsh", ".ps1",
                 ".sql", ".html", ".css", ".scss", ".vue", ".svelte", ".rst", ".tex", ".toml", ".yaml", ".yml", ".ini",
                 ".cfg", ".proto", ".cmake", ".gradle", ".tf", ".nix")


def _hint(path: str) -> str:
    """How to turn a file of a kind helixtok does not read into one it does."""
    low = path.lower()
    if low.endswith(CODE_SUFFIXES):
        return " A source file: pass --code to read source files as text documents, one a file."
    if low.endswith((".csv", ".tsv")):
        sep = "\\t" if low.endswith(".tsv") else ","
        return (f" Convert it to JSON Lines, e.g. python -c \"import pandas as p; p.read_csv('{path}', "
                f"sep='{sep}').to_json('{path.rsplit('.', 1)[0]}.jsonl', orient='records', lines=True)\" "
                "(then --text-field names its text column)")
    if low.endswith((".jsonl.bz2", ".jsonl.xz", ".json.bz2", ".json.xz")):
        tool = "bzip2" if low.endswith(".bz2") else "xz"
        return f" Recompress it: {tool} -dc {path} | zstd -q -o {path.rsplit('.', 1)[0]}.zst"
    return ""


# What to do about a folder link discovery did not follow (for an input that gave no file at all).
_OUTSIDE_FIX = "A folder link that leads outside the folders given is not followed: pass its target as an input too"


def _left_out(warnings) -> str:
    """'; left out: ...' naming what discovery skipped (an empty corpus is seldom truly empty), with
    the fix for the first unsupported file or outside link."""
    parts = []
    for reason, n in warnings.counts.items():
        first = warnings.examples[reason][0]
        fix = (_hint(first).strip() if reason == "unsupported_file" else
               _OUTSIDE_FIX if reason == "link_outside_corpus" else "")
        parts.append(f"{n} x {reason.replace('_', ' ')}, e.g. {first}" + (f". {fix}" if fix else ""))
    return "; left out: " + "; ".join(parts) if parts else ""


_GLOB_CHARS = set("*?[")


def _is_dataset(folder: str) -> bool:
    """A helixtok dataset (its manifest.json, as every writer starts it) or an unfinished build."""
    if os.path.isdir(os.path.join(folder, ".helixtok-partial")):
        return True
    try:
        with open(os.path.join(folder, "manifest.json"), "rb") as fh:
            head = fh.read(256)
    except OSError:
        return False
    return b'"format_version"' in head and b'"helixtok_version"' in head


def file_kind(path: str, code: bool = False) -> str | None:
    """What a file is read as, by its name: a SUFFIXES kind, with --code a source file as text; None: not read."""
    low = path.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if low.endswith(suffix):
            return SUFFIXES[suffix]
    return "text" if code and low.endswith(CODE_SUFFIXES) else None


# --------------------------------------------------------------------------- discovery


_NOT_REGULAR = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                stat.S_IFSOCK: "a socket"}


def _fixed_prefix(pattern: str) -> str:
    """The folders of a glob before its first wildcard ("data/*/x.jsonl" -> "data")."""
    parts = pattern.split(os.sep)
    k = next(i for i, part in enumerate(parts) if _GLOB_CHARS & set(part))
    return os.sep.join(parts[:k]) or "."


def discover(paths: list[str], *, exclude: str | None = None, include_globs: tuple[str, ...] = (),
             exclude_globs: tuple[str, ...] = (), code: bool = False) -> tuple[list[InputFile], Tally]:
    """Expand files, directories (recursively, following links) and globs into a sorted file list.

    `exclude`: the output folder (never read).  include_globs / exclude_globs (--include, --exclude):
    a file found inside a folder or by a pattern is kept when its path relative to that corpus
    argument matches an include glob (if any is given) and no exclude glob (fnmatch: `*` crosses
    folders); what they leave out is counted (`left_out_by_pattern`).  A file named itself is kept.

    A path or pattern that names nothing is an error; unsupported files and ones that are not
    regular files (FIFOs, devices, sockets) met inside a directory are left out and counted
    (named explicitly, they are an error).  Every folder is read once (by device and inode), a
    directory link that leads outside the folders given is not followed, and a file reached
    twice (hard or symbolic link) is read once.
    """
    urls = [p for p in paths if is_url(p)]
    if urls:
        if len(urls) != len(paths):
            raise InputError(f"{urls[0]}: local paths and URLs in one build; build each separately "
                             "(docs/scale.md shows how to merge builds)")
        return _discover_urls(urls, code)
    warnings = Tally()
    found: dict[tuple[int, int], str] = {}  # (dev, inode) -> path as found
    visited: set[tuple[int, int]] = set()
    skip_real = os.path.realpath(exclude) if exclude else None
    roots: list[str] = []
    base = [""]  # the corpus argument being expanded: what the globs are matched against

    def wanted(p: str) -> bool:
        rel = os.path.relpath(p, base[0]).replace(os.sep, "/") if base[0] else p
        keep = (not include_globs or any(fnmatch.fnmatchcase(rel, g) for g in include_globs)) and not any(
            fnmatch.fnmatchcase(rel, g) for g in exclude_globs)
        if not keep:
            warnings.add("left_out_by_pattern", os.path.abspath(p))
        return keep

    def inside(real: str, top: str) -> bool:
        return real == top or real.startswith(top.rstrip(os.sep) + os.sep)

    def add_file(p: str, st: os.stat_result, explicit: bool) -> None:
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the build, a device never end
            what = _NOT_REGULAR.get(stat.S_IFMT(st.st_mode), "a special file")
            if explicit:
                raise InputError(f"{p}: {what}, not a regular file; name the corpus files themselves")
            warnings.add("not_a_regular_file", f"{os.path.abspath(p)} ({what})")
            return
        if not explicit and _hf_metadata(p):  # (state.json, dataset_info.json: not text, though named .json)
            return
        if not explicit and not wanted(p):
            return
        kind = file_kind(p, code)
        if kind is None:
            if explicit:
                raise InputError(f"{p}: unsupported file type; supported: {SUPPORTED}.{_hint(p)}")
            warnings.add("unsupported_file", os.path.abspath(p))
            return
        key = (st.st_dev, st.st_ino)
        if key in found:
            warnings.add("duplicate_file", f"{os.path.abspath(p)} (same file as {os.path.abspath(found[key])})")
            return
        found[key] = p

    def walk(d: str) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except PermissionError as e:
            raise InputError(f"{d}: cannot list directory ({e.strerror}); fix its permissions or leave it out") from e
        for e in entries:
            p = os.path.join(d, e.name)
            real = os.path.realpath(p)
            if skip_real and inside(real, skip_real):
                continue
            try:
                st = os.stat(p)
            except FileNotFoundError as err:
                raise InputError(f"{p}: broken symbolic link; fix it or remove it") from err
            except OSError as err:
                if err.errno == 40:  # ELOOP: a link that points at itself
                    warnings.add("symlink_loop", os.path.abspath(p))
                    continue
                raise InputError(f"{p}: cannot stat ({err.strerror})") from err
            if stat.S_ISDIR(st.st_mode):
                if e.is_symlink() and not any(inside(real, r) for r in roots):
                    warnings.add("link_outside_corpus", os.path.abspath(p))
                    continue
                if _is_dataset(p):  # an earlier build's output: ids and JSON, not text
                    warnings.add("helixtok_dataset", os.path.abspath(p))
                    continue
                enter_dir(p, st)
            else:
                add_file(p, st, explicit=False)

    def enter_dir(p: str, st: os.stat_result) -> None:
        key = (st.st_dev, st.st_ino)
        if key in visited:  # a link loop, or a second way into a folder already read
            warnings.add("symlink_loop", os.path.abspath(p))
            return
        visited.add(key)
        walk(p)

    def check_not_in_out(arg: str) -> None:
        if skip_real and inside(os.path.realpath(arg), skip_real):
            raise InputError(f"{arg}: is inside the output folder {exclude}; move the corpus out of it "
                             "or choose another output folder")

    for arg in paths:
        if os.path.isdir(arg):
            check_not_in_out(arg)
            roots.append(os.path.realpath(arg))
        elif not os.path.exists(arg) and _GLOB_CHARS & set(arg):
            roots.extend(os.path.realpath(m) for m in glob.glob(arg, recursive=True) if os.path.isdir(m))
    for arg in paths:
        base[0] = arg if os.path.isdir(arg) else _fixed_prefix(arg) if _GLOB_CHARS & set(arg) else ""
        if os.path.isdir(arg):
            enter_dir(arg, os.stat(arg))
        elif os.path.exists(arg):
            check_not_in_out(arg)
            add_file(arg, os.stat(arg), explicit=True)
        elif os.path.lexists(arg):
            raise InputError(f"{arg}: broken symbolic link; fix it or remove it")
        elif _GLOB_CHARS & set(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise InputError(f"{arg}: pattern matched no files")
            for m in matches:
                if skip_real and inside(os.path.realpath(m), skip_real):
                    continue
                if os.path.isdir(m):
                    enter_dir(m, os.stat(m))
                else:
                    add_file(m, os.stat(m), explicit=False)
        else:
            raise InputError(f"{arg}: no such file or directory")

    if not found:
        raise InputError(f"no corpus files found in {' '.join(paths)} (supported: {SUPPORTED}){_left_out(warnings)}")
    ordered = sorted(found.values())
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in ordered])
    files = []
    for p in ordered:
        if not os.access(p, os.R_OK):
            raise InputError(f"{p}: permission denied; make it readable or leave it out")
        st = os.stat(p)
        files.append(InputFile(p, os.path.relpath(os.path.abspath(p), root), file_kind(p, code), st.st_size,
                               local_stamp(st)))
    # The manifest keeps warning locations relative to the corpus root, never host paths.
    top = os.path.commonpath([root] + [os.path.abspath(a) for a in paths if os.path.isdir(a)])
    prefix = top.rstrip(os.sep) + os.sep
    for reason, ex in warnings.examples.items():
        warnings.examples[reason] = [x.replace(prefix, "") for x in ex]
    return files, warnings


@reports_storage_errors
def _discover_urls(urls: list[str], code: bool = False) -> tuple[list[InputFile], Tally]:
    """discover() for object storage: prefixes (every object below), globs and single objects.

    Names are relative to the common prefix of the objects found, as local names are to the
    common folder; an object's stamp is its ETag (or the like), checked again before publishing.
    """
    warnings = Tally()
    found: dict[str, dict] = {}  # fs path -> info
    fs = None
    for url in urls:
        fs_u, path = filesystem(url)
        fs_u.invalidate_cache()  # listings are cached per process: a rerun must see objects as they are now
        if fs is None:
            fs = fs_u
        elif type(fs_u) is not type(fs):
            raise InputError(f"{redact(url)}: inputs on two kinds of storage; build each separately")
        try:
            if _GLOB_CHARS & set(path):
                matches = fs.glob(path, detail=True)
                if not matches:
                    raise InputError(f"{redact(url)}: pattern matched no objects")
                entries = {}
                for p, info in matches.items():
                    entries.update(fs.find(p, detail=True) if info.get("type") == "directory" else {p: info})
                explicit = False
            elif fs.isdir(path):
                entries, explicit = fs.find(path, detail=True), False
            else:
                entries, explicit = {path: fs.info(path)}, True
        except FileNotFoundError as e:
            raise InputError(f"{redact(url)}: no such object or prefix") from e
        except PermissionError as e:
            raise InputError(f"{redact(url)}: access denied ({e}); check the credentials in the environment") from e
        for p, info in sorted(entries.items()):
            if info.get("type") == "directory":
                continue
            if not explicit and _hf_metadata(p):
                continue
            kind = file_kind(p, code)
            if kind is None:
                if explicit:
                    raise InputError(f"{redact(url)}: unsupported file type; supported: {SUPPORTED}")
                warnings.add("unsupported_file", p)
                continue
            found[p] = info
    if not found:
        raise InputError(f"no corpus files found in {' '.join(map(redact, urls))} (supported: {SUPPORTED})")
    ordered = sorted(found)
    root = posixpath.commonpath([posixpath.dirname(p) for p in ordered])
    files = [InputFile(redact(fs.unstrip_protocol(p)), posixpath.relpath(p, root), file_kind(p, code),
                       int(found[p].get("size") or 0), stamp(found[p])) for p in ordered]
    for reason, ex in warnings.examples.items():
        warnings.examples[reason] = [posixpath.relpath(x, root) if x.startswith(root) else x for x in ex]
    return files, warnings
