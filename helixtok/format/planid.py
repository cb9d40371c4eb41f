"""What identifies a build's plan: the facts a resume and a merge compare, and how to name a difference."""

from __future__ import annotations

import hashlib
import json

PLAN_FILE = "build-plan.json"  # beside the manifest: the whole plan (every task of a partitioned build derives it)


def _short(v, width: int = 40) -> str:
    r = repr(v)
    return r if len(r) <= width else r[:width - 3] + "..."


def _changed_keys(old, new, path: str = "") -> list[str]:
    """Where two JSON values differ, as dotted keys (a chat template's text is named, not printed)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
                for d in _changed_keys(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))]
    return [f"{path}: {_short(old)} -> {_short(new)}"]


def describe_change(old: dict, new: dict) -> str:
    """The first difference between two plans, for one line: the options that changed (short
    values), or an input."""
    for k in ("config", "tokenizer", "helixtok", "format_version", "partition", "num_tasks"):
        if old.get(k) != new.get(k):
            diffs = _changed_keys(old.get(k), new.get(k), "" if k in ("config", "tokenizer") else k)
            return ", ".join(diffs[:4]) + (f" and {len(diffs) - 4} more" if len(diffs) > 4 else "")
    of = {f[0]: f[1:] for f in old.get("files", [])}
    nf = {f[0]: f[1:] for f in new.get("files", [])}
    added = sorted(set(nf) - set(of))
    gone = sorted(set(of) - set(nf))
    changed = sorted(k for k in set(of) & set(nf) if of[k] != nf[k])
    parts = []
    if added:
        parts.append(f"new input {added[0]}" + (f" and {len(added) - 1} more" if len(added) > 1 else ""))
    if gone:
        parts.append(f"input gone: {gone[0]}" + (f" and {len(gone) - 1} more" if len(gone) > 1 else ""))
    if changed:
        parts.append(f"input modified: {changed[0]}" + (f" and {len(changed) - 1} more" if len(changed) > 1 else ""))
    return "; ".join(parts) or "work units changed"


def whole_plan(files, units, config_identity: dict, tokenizer_identity: dict, num_tasks: int | None) -> dict:
    """The plan every task of a partitioned build must share: every input (name, size, stamp),
    every unit, every option and resolved tokenizer choice that changes bytes, the task count."""
    # The backend option is left out: every backend gives the same bytes (the check sees to it).
    config_identity = {k: v for k, v in config_identity.items() if k != "backend"}
    return {"num_tasks": num_tasks, "config": config_identity, "tokenizer": tokenizer_identity,
            "files": [[f.name, f.size, f.stamp] for f in files], "units": [u.to_json() for u in units]}


def encode_plan(plan: dict) -> bytes:
    return json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()




def plan_folder(plan: bytes) -> str:
    """Where a Ray build's tasks upload their shards in object storage: named for the whole plan,
    so the same inputs and options give the same keys (and a resumed build finds them)."""
    return "data-" + hashlib.sha256(plan).hexdigest()[:16]
