"""Partitioned builds: split the work units into N tasks, and merge task outputs without copying shards."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import numpy as np

from ..format.bestfit import build_index, doc_spans, index_files, write_index
from ..format.errors import ConfigError, DatasetError, HelixtokError, from_cli, python_terms
from ..format.fields import merged_fields
from ..format.manifest import (MANIFEST, MERGEABLE, check_small_file, load_manifest, split_files, sum_sources,
                               with_paths, write_json_atomic)
from ..format.planid import PLAN_FILE, describe_change
from ..format.shards import DOCS_DTYPE
from .catalog import CHAT_TEMPLATE, chat_counts, join_split, split_totals
from .outdir import PUBLISH, STATE, OutLock, check_out_path, refuse_foreign, remove_owned
from .tally import Tally
from .units import Unit

PART_NAME = re.compile(r"part-\d{5}")  # a task's folder in OUT (the command line's layout)

ENV_INDEX = ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX")  # Slurm arrays, Kubernetes Indexed Jobs


def task_from_env(num_tasks: int | None, task_index: int | None, env=os.environ) -> tuple[int, int] | None:
    """(index, count) for a partitioned build, or None; the index falls back to scheduler variables."""
    if num_tasks is None:
        if task_index is not None:
            raise ConfigError("--task-index needs --num-tasks")
        return None
    if task_index is None:
        for var in ENV_INDEX:
            if env.get(var, "").strip():
                try:
                    task_index = int(env[var])
                except ValueError as e:
                    raise ConfigError(f"${var}={env[var]!r} is not a task index") from e
                break
        else:
            raise ConfigError("--num-tasks given without --task-index, and neither $SLURM_ARRAY_TASK_ID nor "
                              "$JOB_COMPLETION_INDEX is set")
    if not 0 <= task_index < num_tasks:
        raise ConfigError(f"task index {task_index} outside [0, {num_tasks}) of --num-tasks {num_tasks}: Slurm arrays "
                          f"start at 0 (--array=0-{num_tasks - 1}); to run one task again, requeue it (scontrol "
                          "requeue JOBID_INDEX) or submit its index alone with the same --num-tasks")
    return task_index, num_tasks


def partition(units: list[Unit], num_tasks: int, groups: list[tuple[int, int]] | None = None
              ) -> list[tuple[int, int]]:
    """Contiguous unit ranges [a, b) per task, balanced by input size; a function of the input alone.

    Contiguous, so the tasks' outputs in task order are the corpus in order; cut only between
    shard groups (join.py) when given, so that every shard is one task's (a task beyond the
    number of groups gets none).
    """
    groups = groups or [(i, i + 1) for i in range(len(units))]
    sizes = [sum(u.est_bytes for u in units[a:b]) for a, b in groups]
    total = sum(sizes) or 1
    bounds, acc, k = [0], 0, 1
    for (a, b), size in zip(groups, sizes):
        acc += size
        while k < num_tasks and acc >= k * total / num_tasks:
            bounds.append(b)
            k += 1
    bounds += [len(units)] * (num_tasks + 1 - len(bounds))
    return list(zip(bounds, bounds[1:]))


# Manifest keys that must agree between parts (everything that changes what a chunk means).
_SAME = ("format_version", "dtype", "seq_len", "packing", "min_tail_len", "chat")
# Tokenizer fields that may differ between parts: which library produced the ids (each one was
# checked against the same reference), where the check's verdict is recorded, the file's name.
_TOKENIZER_FREE = ("backend", "backend_version", "backend_check", "file")


def _merged_inputs(ms: list[dict]) -> dict:
    # A file cut into several work units can be shared by neighbouring tasks: count it once.
    seen: dict[str, int] = {}
    for m in ms:
        for f in m["inputs"]["list"]:
            seen.setdefault(f["name"], f["bytes"])
    return {"files": len(seen), "bytes": sum(seen.values()), "units": sum(m["inputs"]["units"] for m in ms),
            "list": [{"name": k, "bytes": v} for k, v in seen.items()]}


def _plan_of(part: str) -> bytes | None:
    """A part's build-plan.json (the whole plan its task derived), or None when it has none."""
    try:
        with open(os.path.join(part, PLAN_FILE), "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DatasetError(f"{part}: cannot read {PLAN_FILE} ({e.strerror}); rebuild the part") from None


def plan_mismatch(part: str, plan: bytes | None, other: str, plan0: bytes | None) -> str | None:
    """Why two parts of partitioned builds cannot belong to one dataset, or None: each records
    the whole plan (every input's name, size and stamp, the units, the options)."""
    for name, x in ((part, plan), (other, plan0)):
        if x is None:
            return (f"{name}: records no plan (built by an older helixtok), so nothing shows it was planned from "
                    "the same corpus as the others; rebuild the part")
    if plan == plan0:
        return None
    return (f"{part} was planned from other inputs or options than {other} ({_change(plan0, plan)}); the corpus "
            "changed between tasks: rebuild every part from one unchanging corpus")


def _change(old: bytes, new: bytes) -> str:
    try:
        return describe_change(json.loads(old), json.loads(new))
    except ValueError:
        return f"a {PLAN_FILE} is damaged"


def check_sibling_parts(out: str, plan: bytes) -> None:
    """A task refuses to start when finished parts beside its folder were planned otherwise."""
    parent = os.path.dirname(os.path.normpath(out))  # as the user named it, for the message
    here = os.path.basename(os.path.normpath(out))
    try:
        names = sorted(e for e in os.listdir(parent or ".") if PART_NAME.fullmatch(e) and e != here)
    except OSError:
        return
    for e in names:
        sibling = os.path.join(parent, e)
        theirs = _plan_of(sibling) if os.path.isfile(os.path.join(sibling, MANIFEST)) else None
        if theirs is not None and theirs != plan:  # (an unfinished or older part: merge will say)
            raise ConfigError(f"{out}: the corpus or options differ from those {sibling} was planned from "
                              f"({_change(theirs, plan)}); rebuild every part from one unchanging corpus, or "
                              "build into a new folder")


def _check_parts(parts: list[str], ms: list[dict]) -> None:
    first = ms[0]
    for p, m in zip(parts, ms):
        if m["format_version"] not in MERGEABLE:
            raise DatasetError(f"{p}: format_version {m['format_version']} (an older helixtok); rebuild the part "
                               "with this one to merge it")
        for k in _SAME:
            if m.get(k) != first.get(k):
                raise DatasetError(f"{p}: {k} is {m.get(k)!r}, {parts[0]} has {first.get(k)!r}; "
                                   "parts must be built with the same options")
        if m["tokenizer"]["sha256"] != first["tokenizer"]["sha256"]:
            raise DatasetError(f"{p}: built with tokenizer {m['tokenizer']['sha256'][:12]}…, {parts[0]} with "
                               f"{first['tokenizer']['sha256'][:12]}…; parts must share the tokenizer")
        tok, tok0 = m["tokenizer"], first["tokenizer"]
        for k in sorted(set(tok) | set(tok0)):
            if k not in _TOKENIZER_FREE and tok.get(k) != tok0.get(k):
                raise DatasetError(f"{p}: tokenizer {k} is {tok.get(k)!r}, {parts[0]} has {tok0.get(k)!r}; "
                                   "parts must be built with the same options")
        opts = m["options"]
        if opts != first["options"]:
            diff = [k for k in sorted(set(opts) | set(first["options"])) if opts.get(k) != first["options"].get(k)]
            raise DatasetError(f"{p}: option {diff[0]} differs from {parts[0]}; parts must be built with the same options")


def merge(parts: list[str], out: str, *, overwrite: bool = False) -> dict:
    """Join partitioned builds (or any parts of one plan) into `out`, copying no shard."""
    try:
        return _merge(parts, out, overwrite)
    except HelixtokError as e:
        if from_cli.get():
            raise
        raise python_terms(e) from e.__cause__


def _merge(parts: list[str], out: str, overwrite: bool) -> dict:
    if not parts:
        raise ConfigError("give at least one part to merge")
    ms = [load_manifest(p) for p in parts]
    _check_parts(parts, ms)
    _refuse_repeats(parts)
    tasks = [m.get("partition") for m in ms]
    if any(tasks):
        if not all(tasks) or len({t["num_tasks"] for t in tasks}) != 1:
            raise DatasetError("mix of partitioned and unpartitioned parts, or different --num-tasks")
        n = tasks[0]["num_tasks"]
        idx = sorted(t["task_index"] for t in tasks)
        missing = sorted(set(range(n)) - set(idx))
        if missing or len(idx) != n:
            raise DatasetError(f"parts of a {n}-task build: missing task(s) {missing[:10]}"
                               if missing else f"a task is given twice: {idx}")
        order = sorted(range(len(parts)), key=lambda i: tasks[i]["task_index"])
        parts, ms, tasks = [parts[i] for i in order], [ms[i] for i in order], [tasks[i] for i in order]
        plans = [_plan_of(p) for p in parts]
        for p, m, plan in zip(parts, ms, plans):  # the first with itself: a lone part's own record
            why = plan_mismatch(p, plan, parts[0], plans[0])
            if why:
                raise DatasetError(why)
            if plan is not None and m.get("plan_sha256") != hashlib.sha256(plan).hexdigest():
                raise DatasetError(f"{p}: its {PLAN_FILE} is not the plan its manifest was built from (plan_sha256 "
                                   f"{str(m.get('plan_sha256'))[:12]}...); rebuild the part")
    for p, m in zip(parts, ms):
        _check_files(p, m)
    tokenizer = _copy_of(parts[0], ms[0]["tokenizer"]["file"], ms[0]["tokenizer"]["sha256"], "tokenizer")
    chat = ms[0].get("chat")  # a chat build's template: the same in every part (_SAME)
    template = _copy_of(parts[0], chat["template_file"], chat["template_sha256"], "chat template") if chat else None
    check_out_path(out)
    os.makedirs(out, exist_ok=True)
    with OutLock(out):
        # The parts may live in OUT (part-00000, ...): they stay; anything else follows build's rules.
        inside = {os.path.basename(os.path.abspath(p)) for p in parts
                  if os.path.dirname(os.path.abspath(p)) == os.path.abspath(out)}
        shas = [_manifest_sha256(p) for p in parts]
        if os.path.isfile(os.path.join(out, MANIFEST)) and not overwrite:
            done = _merged_already(parts, shas, out)
            if done is not None:
                return done
            raise ConfigError(f"{out}: already holds a dataset; pass --overwrite to replace it")
        refuse_foreign(out, allowed=inside)
        if overwrite:
            remove_owned(out, keep=inside)
        return _merge_locked(parts, ms, out, tokenizer, template, shas)


def _manifest_sha256(part: str) -> str:
    with open(os.path.join(part, MANIFEST), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


class MergedAlready(dict):
    """What merge() returns when OUT already holds the merge of these very parts: nothing was written."""


def _merged_already(parts: list[str], shas: list[str], out: str) -> MergedAlready | None:
    """OUT's dataset, when it is the merge of these parts as they are now (a merge killed after its
    manifest landed, or the same command again) with its files all there at their sizes; else None."""
    try:
        m = load_manifest(out)
    except DatasetError:
        return None
    rel = [os.path.relpath(os.path.abspath(p), os.path.abspath(out)) for p in parts]
    if m.get("merged_from") != rel or m.get("merged_from_sha256") != shas:
        return None
    if not os.path.isfile(os.path.join(out, m["tokenizer"]["file"])):
        return None
    for sp in m["splits"].values():
        for x in split_files(sp):
            p = os.path.join(out, x["path"])
            if not (os.path.isfile(p) and os.path.getsize(p) == x["bytes"]):
                return None
    shutil.rmtree(os.path.join(out, STATE), ignore_errors=True)  # a kill after the manifest, before this
    return MergedAlready(m)


def _docs_of(out: str, d: dict) -> np.ndarray:
    """A part's .docs sidecar, which places the merged bestfit index: checked against its sha256."""
    path = os.path.normpath(os.path.join(out, d["path"]))
    with open(path, "rb") as fh:
        data = fh.read()
    check_small_file(path, data, d["sha256"])
    return np.frombuffer(data, dtype=DOCS_DTYPE)


def _refuse_repeats(parts: list[str]) -> None:
    """A dataset given twice (the same folder, or a copy: the same manifest) would be in the merged
    one twice, every chunk twice an epoch."""
    seen: dict[str, str] = {}
    for p in parts:
        with open(os.path.join(p, MANIFEST), "rb") as fh:
            keys = (os.path.realpath(p), hashlib.sha256(fh.read()).hexdigest())
        for k in keys:
            if k in seen:
                raise DatasetError(f"{p}: the same dataset as {seen[k]} (given twice, its chunks would be in the "
                                   "merged dataset twice); give each part once")
            seen[k] = p


def _check_files(part: str, m: dict) -> None:
    """Every file a part's manifest names is there with its size (stat only: no token is read)."""
    for sp in m["splits"].values():
        for x in split_files(sp):
            p = os.path.join(part, x["path"])
            size = os.path.getsize(p) if os.path.isfile(p) else None
            if size != x["bytes"]:
                raise DatasetError(f"{p}: {'missing' if size is None else f'{size} bytes'}, its manifest says "
                                   f"{x['bytes']}; rebuild the part (helixtok verify {part} says more)")


def _copy_of(part: str, name: str, sha256: str, what: str) -> bytes:
    """A part's tokenizer (or chat template) copy, read once and checked against its manifest's sha256."""
    path = os.path.join(part, name)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read it ({e.strerror}); rebuild the part") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise DatasetError(f"{path}: not the {what} the part was built with (its sha256 differs from its "
                           "manifest's); rebuild the part")
    return data


def _merge_locked(parts: list[str], ms: list[dict], out: str, tokenizer: bytes, template: bytes | None,
                  shas: list[str]) -> dict:
    first = ms[0]

    pieces: dict[str, list[dict]] = {}
    shards: dict[str, list[dict]] = {}
    rels = [os.path.relpath(os.path.abspath(p), os.path.abspath(out)) for p in parts]
    for rel, m in zip(rels, ms):
        for name, s in m["splits"].items():
            pieces.setdefault(name, []).append(s)
            shards.setdefault(name, []).extend(with_paths(s, lambda q: os.path.normpath(os.path.join(rel, q)))["shards"])
    state = os.path.join(out, STATE)
    os.makedirs(state, exist_ok=True)
    # Packed: chunks are cut over the whole stream, so only its last partial chunk is dropped, as
    # in a build that was never partitioned; bestfit: placed from all the parts' document lengths.
    indexes = {}
    if first["packing"] == "bestfit":
        for name in pieces:
            spans = doc_spans([(e["num_tokens"], _docs_of(out, e["docs"])) for e in shards.get(name, [])])
            indexes[name] = build_index(*spans, first["seq_len"], first["min_tail_len"])
    # What is about to be written is recorded first (as a build's publish.json): a merge killed
    # before its manifest leaves files a rerun knows as helixtok's, to replace or delete.
    index_names = [n for s in indexes for n in index_files(s).values()]
    copies = {"tokenizer.json": tokenizer, **({CHAT_TEMPLATE: template} if template is not None else {})}
    write_json_atomic(os.path.join(state, PUBLISH), {"files": [*copies, *index_names, MANIFEST]})
    for name, idx in indexes.items():
        idx.entry = write_index(out, name, idx)
    splits = {name: join_split(pieces[name], shards.get(name, []), first["seq_len"], first["packing"],
                               indexes.get(name))
              for name in pieces}
    if first.get("chat"):
        def read_mask(m: dict, start: int, stop: int) -> bytes:
            with open(os.path.join(out, m["path"]), "rb") as fh:
                fh.seek(start)
                return fh.read(stop - start)
        for name, s in splits.items():
            s["chat"] = chat_counts([p["chat"] for p in pieces[name]], s, s["shards"], first["packing"], read_mask)
    totals = split_totals(splits)
    totals.update({k: sum(m["totals"][k] for m in ms) for k in ("skipped_documents", "repaired_documents")})
    skipped, warnings = Tally(), Tally()
    for m in ms:
        skipped.merge(Tally.from_json(m["skipped"]))
        warnings.merge(Tally.from_json(m["warnings"]))
    merged = {**{k: first[k] for k in ("format_version", "helixtok_version", "dtype", "seq_len", "packing",
                                       "min_tail_len", "tokenizer", "options", "chat") if k in first},
              "inputs": _merged_inputs(ms),
              "merged_from": [os.path.relpath(os.path.abspath(p), os.path.abspath(out)) for p in parts],
              "merged_from_sha256": shas,  # each part's manifest.json: what a second merge compares
              "splits": splits, "totals": totals, "sources": sum_sources(m.get("sources") or {} for m in ms),
              "unit_documents": {sp: [n for m in ms for n in (m.get("unit_documents") or {}).get(sp, [])]
                                 for sp in splits},
              **({"unit_sources": [e for m in ms for e in m["unit_sources"]]}
                 if all("unit_sources" in m for m in ms) else {}),
              **({"fields": fields} if (fields := merged_fields(
                  [m.get("fields") for m in ms], [len(m.get("unit_sources") or ()) for m in ms],
                  lambda i, q: os.path.normpath(os.path.join(rels[i], q)))) else {}),
              "skipped": skipped.to_json(),
              "warnings": warnings.to_json()}
    for name, data in copies.items():
        with open(os.path.join(out, f".{name}.tmp"), "wb") as fh:
            fh.write(data)
        os.replace(os.path.join(out, f".{name}.tmp"), os.path.join(out, name))
    write_json_atomic(os.path.join(out, MANIFEST), merged)
    shutil.rmtree(state, ignore_errors=True)
    return merged
