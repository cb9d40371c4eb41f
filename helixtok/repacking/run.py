"""repack(): OUT's documents at another sequence length or packing in NEW, nothing tokenized: NEW holds
what `helixtok build` with the new options writes, published as a build publishes (manifest last)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil

import numpy as np

from ..format.errors import ConfigError, DatasetError, HelixtokError
from ..format.manifest import FORMAT_VERSION, MANIFEST
from ..format.planid import PLAN_FILE, encode_plan
from ..format.shards import DOCS_DTYPE
from ..pipeline.catalog import CHAT_TEMPLATE, Built, bestfit_index, chat_counts, join_split, published, split_totals
from ..pipeline.journal import state_files
from ..pipeline.outdir import (STATE, OutLock, check_out_path, publish, refuse_foreign, refuse_foreign_state,
                               remove_owned, unpublish)
from ..pipeline.resume import up_to_date
from ..version import __version__
from .groups import link, link_group, linkable, pack_group
from .source import Source, open_source, plan_config, target


class Repacked(Built):
    """What repack() returns: the new manifest, and how many shard groups were linked or packed anew."""

    linked = 0
    packed = 0
    up_to_date = False  # NEW already held this very dataset: nothing was written


def repack(out: str, new: str, *, seq_len: int | None = None, packing: str | None = None,
           min_tail_len: int | None = None, overwrite: bool = False) -> Repacked:
    """The dataset in `out` at another `seq_len` and/or `packing` (and --min-tail-len), written into
    `new`: byte for byte what `helixtok build` with those options writes (docs/format.md names the
    manifest keys that tell the two apart), without tokenizing.  A packed or bestfit NEW links
    OUT's shards; a document NEW is packed anew from them.  OUT is only read (held against a build
    starting in it meanwhile); NEW is written as a build writes its OUT: locked, manifest last,
    the same command again finishing a stopped repack (or saying NEW is up to date)."""
    if os.path.realpath(out) == os.path.realpath(new):
        raise ConfigError(f"{new}: is OUT itself; repack writes a new dataset into another folder")
    with _held(out):
        src = open_source(out)
        config = target(src, seq_len, packing, min_tail_len)
        whole = encode_plan({**src.plan, "config": plan_config(config)})
        check_out_path(new)
        created = not os.path.exists(new)
        os.makedirs(new, exist_ok=True)
        try:
            with OutLock(new):
                if not overwrite and os.path.isfile(os.path.join(new, MANIFEST)):
                    got = Repacked(up_to_date(new, whole))
                    got.up_to_date = True
                    return got
                try:
                    return _write(src, config, whole, new, overwrite)
                except HelixtokError:
                    # Refused (OUT damaged, changed meanwhile): what it wrote is worth nothing to a
                    # rerun, which starts over; NEW is left as it was.
                    if not os.path.isfile(os.path.join(new, STATE, "plan.json")):
                        shutil.rmtree(os.path.join(new, STATE), ignore_errors=True)
                    raise
        finally:
            if created:
                with contextlib.suppress(OSError):
                    os.rmdir(new)  # only if nothing was left: a refused first repack leaves no trace


@contextlib.contextmanager
def _held(out: str):
    """A shared flock on OUT while it is read: a build starting in OUT meanwhile is refused (its
    exclusive lock fails), one running in it refuses this.  Nothing is written into OUT."""
    try:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        raise ConfigError(f"{out}: no such dataset folder") from None
    except NotADirectoryError:
        raise ConfigError(f"{out}: not a folder") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{out}: a helixtok build is writing it; wait for it to finish, then repack") from None
        yield
    finally:
        os.close(fd)


def _write(src: Source, config, whole: bytes, new: str, overwrite: bool) -> Repacked:
    state = os.path.join(new, STATE)
    refuse_foreign_state(new)
    if os.path.isdir(state):
        unpublish(new)  # a repack or build stopped while publishing: its files back into STATE
    if os.path.isfile(os.path.join(state, "plan.json")) and not overwrite:
        raise ConfigError(f"{new}: holds an unfinished build; rerun that build to finish it, or pass --overwrite to "
                          "replace it with this repack")
    if overwrite:
        remove_owned(new)
    refuse_foreign(new)
    # A stopped repack's STATE holds nothing worth keeping: nothing was tokenized, so it starts over.
    shutil.rmtree(state, ignore_errors=True)
    os.makedirs(state)
    run = f"r{os.getpid()}x{secrets.token_hex(3)}"
    names = list(src.manifest["splits"])
    m = src.manifest
    got = Repacked()
    joined, pads = [], {s: {"pad_tokens": 0, "dropped_tokens": 0, "dropped_documents": 0} for s in names}
    for g in range(len(src.groups)):
        if linkable(src, config, g):
            joined.append(link_group(src, g, state, run))
            got.linked += 1
        else:
            j, counts = pack_group(src, config, g, state, run, m["tokenizer"]["pad_id"])
            joined.append(j)
            got.packed += 1
            for s, c in counts.items():
                for k in pads[s]:
                    pads[s][k] += getattr(c, k)

    def docs_of(x: dict):
        with open(os.path.join(state, x["state"]), "rb") as fh:  # linked or written here: checked as read
            data = fh.read()
        if hashlib.sha256(data).hexdigest() != x["sha256"]:
            raise DatasetError(f"{os.path.join(src.path, x['path'])}: changed while being repacked; rerun the repack")
        return np.frombuffer(data, dtype=DOCS_DTYPE)

    def read_mask(x: dict, a: int, b: int) -> bytes:
        with open(os.path.join(state, x["state"]), "rb") as fh:
            fh.seek(a)
            return fh.read(b - a)

    shards = {s: [e for j in joined for e in j["shards"][s]] for s in names}
    indexes = {s: bestfit_index(shards[s], s, config, docs_of, state) for s in names} \
        if config.packing == "bestfit" else {}
    splits = {}
    for s in names:
        piece = {k: m["splits"][s][k] for k in ("documents", "tokens", "text_bytes")} | pads[s]
        splits[s] = join_split([piece], [published(e) for e in shards[s]], config.seq_len, config.packing,
                               indexes.get(s))
        if config.chat:
            splits[s]["chat"] = chat_counts([m["splits"][s]["chat"]], splits[s], shards[s], config.packing, read_mask)
    totals = split_totals(splits)
    totals.update({k: m["totals"][k] for k in ("skipped_documents", "repaired_documents")})
    manifest = {**m, "format_version": FORMAT_VERSION, "helixtok_version": __version__, "seq_len": config.seq_len,
                "packing": config.packing, "min_tail_len": config.tail_len if config.packing != "packed" else None,
                "splits": splits, "totals": totals,
                "repacked_from": {"manifest_sha256": src.manifest_sha256, "seq_len": m["seq_len"],
                                  "packing": m["packing"]}}
    if config.packing == "document":  # its rows keep no document starts, nor where each was read
        manifest.pop("unit_sources", None)
        manifest.pop("fields", None)
    # The tokenizer (checked: the very bytes the manifest names), the template and the new plan.
    with open(src.file(m["tokenizer"]["file"]), "rb") as fh:
        tok = fh.read()
    if hashlib.sha256(tok).hexdigest() != m["tokenizer"]["sha256"]:
        raise DatasetError(f"{src.file(m['tokenizer']['file'])}: not the tokenizer its manifest names; the dataset is "
                           "damaged: rebuild it")
    extra = [("tokenizer.json", m["tokenizer"]["file"]), (PLAN_FILE,) * 2]
    with open(os.path.join(state, "tokenizer.json"), "wb") as fh:
        fh.write(tok)
    with open(os.path.join(state, PLAN_FILE), "wb") as fh:
        fh.write(whole)
    if config.chat:
        shutil.copyfile(src.file(m["chat"]["template_file"]), os.path.join(state, CHAT_TEMPLATE))
        extra.append((CHAT_TEMPLATE, m["chat"]["template_file"]))
    for x in (manifest.get("fields") or {}).get("files", ()):  # the records' kept fields: the same file
        with contextlib.suppress(FileNotFoundError):  # (a resumed repack's)
            os.remove(os.path.join(state, x["path"]))
        link(src.file(x["path"]), os.path.join(state, x["path"]))
        extra.append((x["path"],) * 2)
    moves = [(n, p) for j in joined for n, p, _ in state_files(j)]
    moves += [(x["path"],) * 2 for i in indexes.values() for x in i.entry.values()]
    publish(new, moves + extra, json.loads(json.dumps(manifest)))
    got.update(manifest)
    return got
