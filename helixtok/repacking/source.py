"""The dataset a repack reads: its manifest, plan and options checked, and the options of the dataset asked for."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from types import SimpleNamespace

import numpy as np

from ..format.errors import ConfigError, DatasetError
from ..format.manifest import MANIFEST, load_manifest
from ..format.planid import PLAN_FILE, encode_plan
from ..format.shards import DOCS_DTYPE, MASK_DTYPE
from ..pipeline.chat import ChatSpec
from ..pipeline.config import BuildConfig
from ..pipeline.join import shard_groups

SHARD_NAME = re.compile(r"(train|val)-(\d{6})-(\d{4})\.bin")


@dataclasses.dataclass
class Source:
    """A finished local build, as a repack reads it."""

    path: str
    manifest: dict
    manifest_sha256: str
    plan: dict  # build-plan.json
    config: BuildConfig  # its options, as build() had them
    groups: list[tuple[int, int]]  # shard groups: unit ranges [a, b)
    dtype: np.dtype

    def pieces(self, split: str) -> dict[int, list[dict]]:
        """The split's shards by group, in order (manifest entries)."""
        out: dict[int, list[dict]] = {}
        for e in self.manifest["splits"][split]["shards"]:
            out.setdefault(int(SHARD_NAME.fullmatch(e["path"]).group(2)), []).append(e)
        return out

    def file(self, rel: str) -> str:
        return os.path.join(self.path, rel)

    def whole(self, x: dict, dtype) -> np.ndarray:
        """A sidecar (manifest entry `x`) read whole and checked against its sha256."""
        with open(self.file(x["path"]), "rb") as fh:
            data = fh.read()
        if len(data) != x["bytes"] or hashlib.sha256(data).hexdigest() != x["sha256"]:
            raise DatasetError(f"{self.file(x['path'])}: not the bytes its manifest lists (its sha256 differs); the "
                               f"dataset is damaged: rebuild it (helixtok verify {self.path} says more)")
        return np.frombuffer(data, dtype=dtype)

    def docs(self, e: dict) -> np.ndarray:
        return self.whole(e["docs"], DOCS_DTYPE).astype(np.int64)

    def mask(self, e: dict) -> np.ndarray:
        """A shard's .mask, mapped, checked against its sha256 (read once, here)."""
        x = e["mask"]
        mm = np.memmap(self.file(x["path"]), dtype=MASK_DTYPE, mode="r")
        if _sha256(mm, 0, len(mm)) != x["sha256"]:
            raise DatasetError(f"{self.file(x['path'])}: not the bytes its manifest lists (its sha256 differs); the "
                               f"dataset is damaged: rebuild it (helixtok verify {self.path} says more)")
        return mm

    def ids(self, e: dict) -> np.ndarray:
        """A shard's ids, mapped, each of its segments checked against its sha256 (read once, here)."""
        path = self.file(e["path"])
        ids = np.memmap(path, dtype=self.dtype.newbyteorder("<"), mode="r")
        raw, at = ids.view(np.uint8), 0
        for n, sha in e["segments"]:
            if _sha256(raw, at, at + n) != sha:
                raise DatasetError(f"{path}: bytes {at:,} to {at + n:,} are not those its manifest lists; the dataset is "
                                   f"damaged: rebuild it (helixtok verify {self.path} says more)")
            at += n
        return ids


def _sha256(raw: np.ndarray, a: int, b: int) -> str:
    h = hashlib.sha256()
    for x in range(a, b, 1 << 20):
        h.update(raw[x: min(b, x + (1 << 20))])
    return h.hexdigest()


def open_source(path: str) -> Source:
    """OUT checked for what a repack needs: a finished local build of this helixtok's format with
    its plan, document boundaries and every file at its size.  One line on anything else."""
    if "://" in path:
        raise ConfigError(f"{path}: repack reads a local dataset; helixtok pull it first")
    m = load_manifest(path)  # a folder without a (valid) manifest: refused in one line
    with open(os.path.join(path, MANIFEST), "rb") as fh:
        sha = hashlib.sha256(fh.read()).hexdigest()
    if m.get("merged_from") or m.get("partition"):
        raise ConfigError(f"{path}: a {'merged' if m.get('merged_from') else 'partial'} dataset; repack reads a "
                          "single build (its shards live in its parts: build the corpus without --task to repack it)")
    if m["packing"] == "document":
        raise ConfigError(f"{path}: packed with --pack document, whose chunks keep no boundary between a document that "
                          "fills whole chunks and the next, and no tail it dropped; repack reads --pack packed or "
                          "bestfit builds: build once with one of those, then repack it to any packing")
    if "unit_documents" not in m:
        raise ConfigError(f"{path}: written by an older helixtok (its manifest lacks unit_documents); rebuild it once "
                          "with this one (the same command with --overwrite), then repack")
    try:
        with open(os.path.join(path, PLAN_FILE), "rb") as fh:
            plan = json.loads(fh.read())
    except (OSError, ValueError) as e:
        raise DatasetError(f"{os.path.join(path, PLAN_FILE)}: missing or unreadable ({e}); rebuild the dataset (the "
                           "same command with --overwrite), then repack") from None
    config = _config_of(plan, path)
    if (config.seq_len, config.packing) != (m["seq_len"], m["packing"]):
        raise DatasetError(f"{path}: its {PLAN_FILE} and {MANIFEST} disagree (seq_len, packing); rebuild the dataset")
    dtype = np.dtype(m["dtype"])
    units = [SimpleNamespace(est_bytes=u["est_bytes"]) for u in plan["units"]]
    groups = shard_groups(units, config.shard_bytes, dtype.itemsize)
    src = Source(path, m, sha, plan, config, groups, dtype)
    for s, sp in m["splits"].items():
        if len(m["unit_documents"].get(s, ())) != len(units):
            raise DatasetError(f"{path}: its manifest's unit_documents does not list its {len(units)} work units; "
                               "rebuild the dataset")
        for e in sp["shards"]:
            x = SHARD_NAME.fullmatch(e["path"])
            if x is None or int(x.group(2)) >= len(groups):
                raise DatasetError(f"{path}: shard {e['path']!r} is not one of its plan's shard groups; rebuild it")
            for f in (e, *(e[k] for k in ("docs", "src", "mask") if k in e)):
                p = src.file(f["path"])
                if not os.path.isfile(p) or os.path.getsize(p) != f["bytes"]:
                    raise DatasetError(f"{p}: missing or not the {f['bytes']:,} bytes its manifest lists; the dataset "
                                       f"is damaged: rebuild it (helixtok verify {path} says more)")
    return src


def _config_of(plan: dict, path: str) -> BuildConfig:
    """The options the dataset was built with, from its plan (checked: they give its plan back)."""
    d = dict(plan["config"])
    if isinstance(d.get("chat"), dict):
        c = d["chat"]
        d["chat"] = ChatSpec(**{**c, "token_strings": tuple(tuple(x) for x in c.get("token_strings", ()))})
        d["min_tail_len"] = None  # the plan records the tail a chat build keeps; the option is refused there
    try:
        config = BuildConfig(**d)
    except (TypeError, ConfigError) as e:
        raise DatasetError(f"{os.path.join(path, PLAN_FILE)}: options this helixtok cannot read ({e}); rebuild the "
                           "dataset with it, then repack") from None
    if plan_config(config) != plan["config"]:
        raise DatasetError(f"{os.path.join(path, PLAN_FILE)}: options this helixtok reads otherwise; rebuild the "
                           "dataset with it, then repack")
    return config


def plan_config(config: BuildConfig) -> dict:
    """A config as its plan records it (JSON form)."""
    return json.loads(encode_plan({k: v for k, v in config.identity().items() if k != "backend"}))


def target(src: Source, seq_len: int | None, packing: str | None, min_tail_len: int | None) -> BuildConfig:
    """The options of the dataset asked for: the source's, with these (a None keeps the source's
    sequence length and packing; --min-tail-len is the new packing's default unless given)."""
    old = src.config
    packing = old.packing if packing is None else packing
    # Document packing keeps no sources, so no fields (the source's, linked, serve the other packings).
    new = dataclasses.replace(old, seq_len=old.seq_len if seq_len is None else seq_len, packing=packing,
                              min_tail_len=min_tail_len, keep_fields=() if packing == "document" else old.keep_fields)
    if new.chat is not None:
        _check_chat(src, new)
    return new


def _check_chat(src: Source, new: BuildConfig) -> None:
    """A chat build's stored conversations are those a build at the new length stores, whole, or
    the repack is refused: a conversation longer than it would be dropped or cut there, and one the
    source dropped or cut for its own length would be kept or cut otherwise at a longer one."""
    old, L = src.config, new.seq_len
    longest = 0
    for s in src.manifest["splits"]:
        for e in src.manifest["splits"][s]["shards"]:
            d = src.docs(e)
            if len(d):
                longest = max(longest, int(np.diff(np.append(d, e["num_tokens"])).max()))
    if longest > L:
        raise ConfigError(f"{src.path}: holds a conversation of {longest:,} tokens, longer than --seq-len {L}: a build "
                          f"at {L} drops or cuts it; repack to {longest:,} or more, or build the corpus at {L}")
    if L > old.seq_len:
        c = {k: sum(sp["chat"][k] for sp in src.manifest["splits"].values())
             for k in ("truncated", "truncated_turns", "dropped_too_long")}
        if any(c.values()):
            raise ConfigError(f"{src.path}: its build cut or dropped conversations longer than its --seq-len "
                              f"{old.seq_len} ({c['truncated'] + c['truncated_turns']:,} cut, "
                              f"{c['dropped_too_long']:,} dropped); a build at {L} keeps more of them: build the corpus "
                              f"at {L}, or repack to {old.seq_len} or less")
