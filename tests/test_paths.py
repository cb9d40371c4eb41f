"""Every code path a size threshold chooses gives the same bytes: the thresholds lowered
(format/limits.py) so that small data takes the paths only big builds take -- ids held in memory
or spilled to a file first, both in one unit, compressed files read in ranges, Parquet row groups
as units, long documents read in pieces -- and every input form, -j, unit size and val split
compared with one reference build, data file by data file."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helixtok.format import limits
from helixtok.pipeline.builder import STATE, build
from helixtok.pipeline.config import BuildConfig

LOWERED = dict(HOLD_BYTES=3000, SPLIT_BYTES=1, RANGE_MIN_BYTES=1, LONG_DOC_BYTES=16_000, PIECE_BYTES=4096,
               QUEUED_BYTES=1 << 16)
FORMS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet-1", "parquet-many")


def lower(monkeypatch, **values) -> None:
    """The thresholds lowered here (this process, an inline build) and for every process a build
    starts (the fork server, spawned helpers: they read $HELIXTOK_TEST_LIMITS as they import)."""
    for k, v in values.items():
        monkeypatch.setattr(limits, k, v)
    monkeypatch.setenv("HELIXTOK_TEST_LIMITS", ",".join(f"{k}={v}" for k, v in values.items()))


@pytest.fixture(scope="module")
def docs(dev_docs) -> list[str]:
    """~150 KB of real documents of every size, one of them longer than the lowered LONG_DOC_BYTES."""
    picked = [d[:3000] for d in dev_docs if d.strip()]
    long = "\n\n".join(picked[100:])[:40_000]
    assert len(long) == 40_000
    return picked[:30] + [long] + picked[30:60]


def write_form(root: Path, form: str, docs: list[str]) -> str:
    """The same documents, in corpus order, as one input form."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True)
    lines = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode()
    if form == "txt":
        for i, d in enumerate(docs):
            (root / f"d{i:04d}.txt").write_text(d, encoding="utf-8")
        return str(root)
    if form == "jsonl":
        (root / "c.jsonl").write_bytes(lines)
    elif form == "jsonl.gz":
        (root / "c.jsonl.gz").write_bytes(gzip.compress(lines))
    elif form == "jsonl.zst":
        (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    else:
        pq.write_table(pa.table({"text": docs}), root / "c.parquet",
                       row_group_size=len(docs) if form == "parquet-1" else 7)
    return str(root)


def data_files(out: str) -> dict[str, bytes]:
    """Every file a dataset's data is in (shards and sidecars), by name.  Not `.src`: it names each
    document's place in its work unit, which the form and the unit cuts decide (a .txt file vs a
    JSON line vs a Parquet row); the resumes below compare it file for file, and test_documents.py
    checks that every place it names holds the document's text."""
    return {n: Path(out, n).read_bytes() for n in sorted(os.listdir(out)) if n.rsplit(".", 1)[-1] in
            ("bin", "docs", "valid", "idx", "mask")}


# Each (packing, val) case builds the reference and one form of the six, rotating, so that over
# the nine cases every form runs, at -j 1 and -j 2, at two unit sizes.
CASES = [(p, v) for p in ("packed", "bestfit", "document") for v in (0.0, 0.01, 0.9)]


@pytest.mark.parametrize("packing, val", CASES, ids=[f"{p}-val{v}" for p, v in CASES])
def test_every_form_and_path_gives_the_same_bytes(tmp_path, docs, tokenizer_path, monkeypatch, packing, val):
    k = CASES.index((packing, val))
    cfg = dict(seq_len=64, packing=packing, val_fraction=val, shard_bytes=1 << 30)
    ref = str(tmp_path / "ref")
    m = build([write_form(tmp_path / "ref-in", "jsonl", docs)], ref, tokenizer_path,
              BuildConfig(workers=1, unit_bytes=1 << 30, **cfg))
    want = data_files(ref)
    assert want and m["totals"]["documents"] == len(docs)
    lower(monkeypatch, **LOWERED)
    form = FORMS[k % 6]
    out = str(tmp_path / form)
    got = build([write_form(tmp_path / f"{form}-in", form, docs)], out, tokenizer_path,
                BuildConfig(workers=1 + k % 2, unit_bytes=(8 << 10, 32 << 10)[k // 3 % 2], **cfg))
    # The lowered thresholds cut every form into units (a row group is never cut).
    assert got["inputs"]["units"] > (form != "parquet-1"), form
    assert data_files(out) == want, (form, sorted(set(data_files(out)) ^ set(want)))
    for split, sp in got["splits"].items():  # the counts (the shards' segments follow the units)
        assert {k: v for k, v in sp.items() if k != "shards"} == \
               {k: v for k, v in m["splits"][split].items() if k != "shards"}


def test_a_unit_with_one_split_held_and_the_other_spilled_is_placed(tmp_path, docs, tokenizer_path, monkeypatch):
    """Issue 62.1: a unit whose train ids pass HOLD_BYTES while its val ids are held (and the
    reverse) is placed split by split, from its file and from memory: the build succeeds with
    the bytes of one whose units all spill, at -j 1 (always the case) and -j 2."""
    corpus = write_form(tmp_path / "in", "jsonl.gz", docs)
    for val in (0.01, 0.9):
        cfg = dict(seq_len=64, val_fraction=val, unit_bytes=1 << 30)
        lower(monkeypatch, HOLD_BYTES=0)
        spilled = str(tmp_path / f"spilled{val}")
        build([corpus], spilled, tokenizer_path, BuildConfig(workers=1, **cfg))
        sizes = {s: sum(e["bytes"] for e in sp["shards"]) for s, sp in json.loads(
            Path(spilled, "manifest.json").read_text())["splits"].items()}
        small, big = sorted(sizes.values())
        lower(monkeypatch, HOLD_BYTES=(small + big) // 2)  # the small split held, the big one spilled
        for workers in (1, 2):
            out = str(tmp_path / f"mixed{val}-{workers}")
            build([corpus], out, tokenizer_path, BuildConfig(workers=workers, **cfg))
            assert data_files(out) == data_files(spilled)


def test_the_issues_reproducer_builds_on_the_command_line(tmp_path, docs, tokenizer_path):
    """Issue 62.1 as a user meets it: `helixtok build X.jsonl.gz OUT --val-fraction` with a unit
    whose ids pass what a worker holds (lowered through the environment, read by every process)."""
    corpus = write_form(tmp_path / "in", "jsonl.gz", docs)
    outs = []
    for env, workers in (({}, "1"), ({"HELIXTOK_TEST_LIMITS": "HOLD_BYTES=3000"}, "1"),
                         ({"HELIXTOK_TEST_LIMITS": "HOLD_BYTES=3000"}, "2")):
        out = str(tmp_path / f"o{len(outs)}")
        r = subprocess.run([sys.executable, "-m", "helixtok.cli", "build", corpus, out, "-t", tokenizer_path, "-L",
                            "64", "--val-fraction", "0.01", "-j", workers, "-q"], capture_output=True, text=True,
                           env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        outs.append(data_files(out))
    assert outs[0] == outs[1] == outs[2]


def test_a_bad_limits_value_is_refused_naming_the_names(monkeypatch):
    with pytest.raises(ValueError, match="'HOLD=1' is not NAME=WHOLE_NUMBER with NAME one of HOLD_BYTES, "):
        limits.lowered("HOLD=1")
    assert limits.lowered(" HOLD_BYTES=5, PIECE_BYTES=7") == {"HOLD_BYTES": 5, "PIECE_BYTES": 7}


def test_an_edited_journal_entry_is_redone_not_published(tmp_path, docs, tokenizer_path, monkeypatch):
    """Issue 62.3: after a stop, a unit's journal entry edited (still valid JSON: text_bytes + 2) or
    bit-flipped is not trusted: its unit is tokenized again and the manifest's counts are the
    undisturbed build's."""
    import helixtok.pipeline.dispatch as hdisp

    corpus = write_form(tmp_path / "in", "jsonl", docs)
    cfg = BuildConfig(seq_len=64, workers=1, unit_bytes=16 << 10, val_fraction=0.1)
    ref = build([corpus], str(tmp_path / "ref"), tokenizer_path, cfg)
    ran, real = [], hdisp.run_unit

    def stopping(unit, *a):
        if len(ran) == 4 and not stopped:
            stopped.append(1)
            raise KeyboardInterrupt
        ran.append(unit.index)
        return real(unit, *a)
    stopped: list = []
    monkeypatch.setattr(hdisp, "run_unit", stopping)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        build([corpus], str(out), tokenizer_path, cfg)
    entry = out / STATE / "u000001.done.json"
    e = json.loads(entry.read_text())
    e["text_bytes"]["train"] += 2
    entry.write_text(json.dumps(e))
    raw = bytearray((out / STATE / "u000002.done.json").read_bytes())
    at = raw.index(b'"documents"') + len(b'"documents": {"train": ')
    raw[at] = ord("9") if raw[at] != ord("9") else ord("8")  # a digit flipped: valid JSON still
    (out / STATE / "u000002.done.json").write_bytes(bytes(raw))
    ran.clear()
    m = build([corpus], str(out), tokenizer_path, cfg)
    assert sorted(ran[:2]) == [1, 2] and 0 not in ran and 3 not in ran
    for k in ("totals", "sources", "splits", "unit_documents"):
        assert m[k] == ref[k], k
    assert data_files(str(out)) == data_files(str(tmp_path / "ref"))
    assert np.array_equal(np.fromfile(out / "train-000000-0000.bin", np.uint16),
                          np.fromfile(tmp_path / "ref" / "train-000000-0000.bin", np.uint16))


@pytest.fixture(scope="module")
def kinds(tmp_path_factory, docs, dev_docs):
    """Each build kind's inputs: text (jsonl, with a val split) and chat (Llama-3-style template)."""
    from test_chat import _write_chat_corpus, llama_style_tokenizer, real_conversations

    from helixtok.pipeline.chat import load_spec

    root = tmp_path_factory.mktemp("kinds")
    text = write_form(root / "text", "jsonl", docs[:60])
    llama = llama_style_tokenizer(root / "llama", dev_docs[:200])
    chats = str(_write_chat_corpus(root / "chat", real_conversations(dev_docs, 80, seed=11)))
    spec = load_spec(str(llama), None, "assistant", False, "messages")
    # Records through a --map function, with ids kept (--keep-fields' default) and --val-size's first pass.
    (root / "records").mkdir()
    (root / "records" / "a.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "body": d, "n": i}) + "\n"
                                                      for i, d in enumerate(docs[:60])))
    (root / "kindsmap.py").write_text("def body(rec):\n    return None if rec['n'] % 7 == 3 else rec['body']\n")
    import sys

    sys.path.insert(0, str(root))  # (a --map module: importable by name, here and in the build's processes)
    return {"text": (text, None), "chat": (chats, (str(llama / "tokenizer.json"), spec)),
            "records": (str(root / "records"), None)}


KINDS = [("text", "packed"), ("text", "document"), ("text", "bestfit"), ("chat", "bestfit"), ("chat", "packed"),
         ("records", "packed")]


@pytest.mark.parametrize("kind, packing", KINDS, ids=[f"{k}-{p}" for k, p in KINDS])
def test_every_build_kind_stopped_at_each_step_resumes_to_the_same_bytes(tmp_path, kinds, tokenizer_path, monkeypatch,
                                                                          kind, packing):
    """Issue 62.2 and 62.13: a build of each kind stopped after its plan, before its last unit, and
    half way through publishing, is resumed by the same call (never refused as
    "other inputs or options": a chat plan's template tuples compared in their JSON form), and the
    result is the undisturbed build's folder, byte for byte (the manifest included)."""
    import helixtok.pipeline.builder as hb
    import helixtok.pipeline.dispatch as hdisp

    corpus, chat = kinds[kind]
    tok = chat[0] if chat else tokenizer_path
    cfg = BuildConfig(seq_len=128, packing=packing, workers=1, unit_bytes=8 << 10, shard_bytes=16 << 10,
                      val_fraction=0.2, chat=chat[1] if chat else None) if kind != "records" else \
        BuildConfig(seq_len=128, packing=packing, workers=1, unit_bytes=8 << 10, shard_bytes=16 << 10, val_size=6,
                    transform="kindsmap:body")
    ref = str(tmp_path / "ref")
    m = build([corpus], ref, tok, cfg)
    if kind == "records":  # (what this kind adds is there to be compared)
        assert m["splits"]["val"]["documents"] == 6 and m["fields"]["names"] == ["id"] and m["skipped"]["map:none"]
    n = m["inputs"]["units"]
    assert n >= 4 and len(m["splits"]["train"]["shards"]) >= 2
    real_run, real_replace = hdisp.run_unit, hb.os.replace
    for stop in ("plan", n - 1, "publish"):
        out = str(tmp_path / f"out-{stop}")
        ran: list[int] = []

        def counted(unit, *a):
            if stop != "publish" and len(ran) == (0 if stop == "plan" else stop):
                raise KeyboardInterrupt
            ran.append(unit.index)
            return real_run(unit, *a)

        moved: list[str] = []

        def replace(a, b):  # into OUT: one file, then the stop
            if stop == "publish" and os.path.dirname(b) == out:
                if moved:
                    raise KeyboardInterrupt
                moved.append(b)
            real_replace(a, b)
        with monkeypatch.context() as mp:
            mp.setattr(hdisp, "run_unit", counted)
            mp.setattr(hb.os, "replace", replace)
            with pytest.raises(KeyboardInterrupt):
                build([corpus], out, tok, cfg)
        assert not os.path.exists(os.path.join(out, "manifest.json"))
        assert os.path.isfile(os.path.join(out, STATE, "plan.json")), stop
        with monkeypatch.context() as mp:
            again: list[int] = []
            mp.setattr(hdisp, "run_unit", lambda unit, *a: again.append(unit.index) or real_run(unit, *a))
            build([corpus], out, tok, cfg)
        assert sorted(again) == [i for i in range(n) if i not in ran], stop  # each unit tokenized once in all
        assert sorted(os.listdir(out)) == sorted(os.listdir(ref)), stop
        for name in os.listdir(ref):
            assert Path(out, name).read_bytes() == Path(ref, name).read_bytes(), (stop, name)


@pytest.mark.parametrize("packing", ["packed", "bestfit"])
def test_stats_trainable_tokens_are_what_an_epochs_labels_train_on(tmp_path, kinds, packing):
    """Issue 62.9: a packed chat build drops its stream's last partial chunk, and the 1s of its mask
    there with it: `helixtok stats` (and a merge of its parts) says the trainable tokens the labels
    of a DataLoader epoch hold, not the 1s of the .mask files (which `verify` still checks)."""
    from click.testing import CliRunner

    from helixtok import MemmapChunkDataset
    from helixtok.cli import main
    from helixtok.inspect.verify import verify
    from helixtok.pipeline.merge import merge

    corpus, (tok, spec) = kinds["chat"]
    cfg = BuildConfig(seq_len=97, packing=packing, workers=1, unit_bytes=8 << 10, shard_bytes=16 << 10, chat=spec)
    out = str(tmp_path / "out")
    m = build([corpus], out, tok, cfg)
    parts = [str(tmp_path / "parts" / f"part-{k:05d}") for k in range(2)]
    for k, p in enumerate(parts):
        build([corpus], p, tok, cfg, task=(k, 2))
    merged = merge(parts, str(tmp_path / "parts"))
    c = m["splits"]["train"]["chat"]
    assert merged["splits"]["train"]["chat"] == c
    ds = MemmapChunkDataset(out)
    trained = sum(int((ds[i]["labels"] != -100).sum()) for i in range(len(ds)))
    stored = sum(int(np.fromfile(Path(out, e["mask"]["path"]), np.uint8).sum()) for e in m["splits"]["train"]["shards"])
    assert stored == c["trainable_tokens"] and verify(out).ok
    assert trained == c["trainable_tokens"] - c["dropped_trainable_tokens"]
    if packing == "packed":
        assert c["dropped_trainable_tokens"] > 0  # this corpus's tail ends in an assistant turn
    else:
        assert c["dropped_trainable_tokens"] == 0
    for where in (out, str(tmp_path / "parts")):
        r = CliRunner().invoke(main, ["stats", where, "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["trainable_tokens_per_epoch"] == trained


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_deeply_nested_row_is_a_counted_bad_line(tmp_path, kinds, tokenizer_path, kind):
    """Issue 62.6: a JSON line nested 100,000 levels (and, in a chat build, a conversation nested
    ~900 levels, which json reads but no walk of it can) is a bad row at file:line, counted, or
    one line with --strict: never a RecursionError traceback."""
    from click.testing import CliRunner

    from helixtok.cli import main

    corpus, chat = kinds[kind]
    good = json.dumps({"text": "a good line"}) if kind == "text" else \
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    deep = '{"text": "x", "m": ' + "[" * 100_000 + "]" * 100_000 + "}"
    rows = [good, deep]
    if kind == "chat":
        rows.append('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": '
                    + "[" * 900 + "]" * 900 + "}]}")
    (tmp_path / "c.jsonl").write_text("\n".join(rows) + "\n")
    args = ["build", str(tmp_path / "c.jsonl"), "-t", chat[0] if chat else tokenizer_path, "-L", "64" if chat else "4", "-q",
            *(["--chat"] if chat else [])]
    r = CliRunner().invoke(main, [*args[:2], str(tmp_path / "out"), *args[2:]])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["skipped"]["malformed_json"]["examples"] == [
        "c.jsonl:2 (nested too deeply: more levels of arrays and objects than a JSON reader follows)"]
    if kind == "chat":
        assert m["skipped"]["not_a_conversation"]["examples"] == [
            "c.jsonl:3 (nested too deeply: more levels of arrays and objects than a JSON reader follows)"]
    r = CliRunner().invoke(main, [*args[:2], str(tmp_path / "strict"), *args[2:], "--strict"])
    assert r.exit_code == 1 and r.stderr.strip().splitlines()[-1] == (
        "Error: c.jsonl:2 (nested too deeply: more levels of arrays and objects than a JSON reader follows): "
        "malformed json (--strict: fix it, or leave --strict out to skip and count such records)")


def test_a_damaged_placement_found_while_closes_run_is_one_line(tmp_path, docs, tokenizer_path, monkeypatch):
    """Issue 62.4: a resumed -j 2 build that finds a placement disagreeing with the units before it
    (journaled as written, digest and all: a worker's bad read) while other groups' closes are in
    flight stops with that one line -- no InvalidStateError traceback from the closes that end
    after it -- and the next run builds the undisturbed dataset."""
    import helixtok.pipeline.dispatch as hdisp
    from helixtok.pipeline.journal import read_entry, write_entry

    corpus = write_form(tmp_path / "in", "jsonl", docs)
    args = ["-L", "64", "--unit-size", "8KiB", "--shard-size", "8KiB"]
    cfg = BuildConfig(seq_len=64, workers=1, unit_bytes=8 << 10, shard_bytes=8 << 10)
    ref = build([corpus], str(tmp_path / "ref"), tokenizer_path, cfg)
    n = ref["inputs"]["units"]
    ran, real = [], hdisp.run_unit

    def stopping(unit, *a):
        if len(ran) == n - 1:
            raise KeyboardInterrupt
        ran.append(unit.index)
        return real(unit, *a)
    with monkeypatch.context() as mp:
        mp.setattr(hdisp, "run_unit", stopping)
        with pytest.raises(KeyboardInterrupt):
            build([corpus], str(tmp_path / "out"), tokenizer_path, cfg)
    victim = n - 3
    path = str(tmp_path / "out" / STATE / f"u{victim:06d}.placed.json")
    p = read_entry(path)
    p["at"]["train"] += 1
    write_entry(path, p)
    cmd = [sys.executable, "-m", "helixtok.cli", "build", corpus, str(tmp_path / "out"), "-t", tokenizer_path, "-j", "2",
           "-q", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"Error: work unit {victim}: its journal entry or placement in shard {p['group']} disagrees with the units "
        "before it (damaged); rerun the same command: it is tokenized again"], r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert data_files(str(tmp_path / "out")) == data_files(str(tmp_path / "ref"))


@pytest.mark.parametrize("then", ["rerun", "overwrite"])
def test_a_publish_stopped_half_way_that_lost_its_record_is_still_ours(tmp_path, docs, tokenizer_path, monkeypatch,
                                                                      then):
    """Issue 62.5: a build stopped after moving two files into OUT, whose publish.json was then lost:
    the plan and journal vouch for the shards' names, so the rerun moves them back and publishes
    (tokenizing nothing), and --overwrite removes them -- never "files helixtok did not write"."""
    import helixtok.pipeline.builder as hb
    import helixtok.pipeline.dispatch as hdisp

    corpus = write_form(tmp_path / "in", "jsonl", docs)
    cfg = BuildConfig(seq_len=64, workers=1, unit_bytes=8 << 10, shard_bytes=8 << 10, packing="bestfit",
                      val_fraction=0.1)
    build([corpus], str(tmp_path / "ref"), tokenizer_path, cfg)
    out = tmp_path / "out"
    real, moved = os.replace, []

    def stop_after_two(a, b):
        if os.path.dirname(b) == str(out):
            if len(moved) == 2:
                raise KeyboardInterrupt
            moved.append(b)
        real(a, b)
    with monkeypatch.context() as mp:
        mp.setattr(hb.os, "replace", stop_after_two)
        with pytest.raises(KeyboardInterrupt):
            build([corpus], str(out), tokenizer_path, cfg)
    assert len(moved) == 2 and all(Path(m).name.endswith((".bin", ".docs")) for m in moved)
    (out / STATE / "publish.json").unlink()
    ran: list[int] = []
    monkeypatch.setattr(hdisp, "run_unit", lambda unit, *a, real=hdisp.run_unit: ran.append(unit.index) or real(unit, *a))
    if then == "overwrite":
        build([corpus], str(out), tokenizer_path, cfg, overwrite=True)
    else:
        build([corpus], str(out), tokenizer_path, cfg)
        assert ran == []
    assert data_files(str(out)) == data_files(str(tmp_path / "ref"))


def test_running_out_of_memory_is_one_line_naming_the_limit(tmp_path, docs, tokenizer_path):
    """Issue 62.8: an allocation that fails (a MemoryError, pyarrow's ArrowMemoryError, a thread
    that cannot start under `ulimit -v`) in a worker or in the command's own process is one line:
    out of memory, while doing what, the address-space limit when one is set, what to lower."""
    import pyarrow as pa

    from helixtok.format.errors import memory_error

    assert isinstance(pa.ArrowMemoryError("x"), MemoryError)
    err = memory_error(pa.ArrowException("Unknown error: Failed to launch worker thread: Resource temporarily "
                                          "unavailable"), "tokenizing c.parquet")
    assert str(err).startswith("out of memory while tokenizing c.parquet (ArrowException: Unknown error: Failed to "
                               "launch worker thread: Resource temporarily unavailable); or use fewer --workers")
    assert memory_error(KeyError("train"), "x") is None
    corpus = write_form(tmp_path / "in", "parquet-many", docs)
    # Every process of the build (the fork server's workers are started afresh) fails its encodes.
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import resource\nresource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))\n"
        "import helixtok.pipeline.encode as e\n"
        "def encode(self, docs):\n    raise MemoryError\ne.Encoder.encode = encode\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    for workers in ("1", "2"):
        r = subprocess.run([sys.executable, "-m", "helixtok.cli", "build", corpus, str(tmp_path / f"o{workers}"), "-t",
                            tokenizer_path, "-L", "64", "-q", "-j", workers, "--unit-size", "8KiB", "--backend", "hf"],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 1, r.stderr
        line, = r.stderr.strip().splitlines()
        assert re.fullmatch(r"Error: out of memory while tokenizing \S+c\.parquet \(MemoryError: \); this process may "
                            r"use 8\.00 GiB of address space \(ulimit -v\): a tokenizing process needs about 1 GiB "
                            r"\(more with a larger tokenizer\), so raise it; or use fewer --workers or a smaller "
                            r"--unit-size, then rerun the same command to resume", line), line


HOSTILE = ("{% if messages[0]['content'] == 'loop' %}{% for a in range(99999) %}{% for b in range(99999) %}"
           "{% for c in range(99999) %}{% endfor %}{% endfor %}{% endfor %}{% endif %}"
           "{% if messages[0]['content'] == 'grow' %}{% set ns = namespace(s='xy') %}{% for i in range(60) %}"
           "{% set ns.s = ns.s + ns.s %}{% endfor %}{% endif %}"
           "{% if messages[0]['content'] == 'repeat' %}{{ 'x' * 10000000000 }}{% endif %}"
           "{% if messages[0]['content'] == 'power' %}{{ 7 ** 100000000 }}{% endif %}")


def test_a_hostile_template_or_row_is_bounded_and_counted(tmp_path, kinds):
    """Issue 62.7: a template that loops (without output) or grows a string past any context, on
    some rows, rendered in the build's own process (the backend check's sample) and in workers
    (-j 2): each such row is stopped at the render bounds (lowered here to 1 s) and counted as
    not_a_conversation with why; the others build as always, and nothing hangs."""
    from test_chat import TEMPLATES

    corpus, (tok, _) = kinds["chat"]
    template = tmp_path / "hostile.jinja"
    template.write_text(HOSTILE + (TEMPLATES / "llama3_training.jinja").read_text())
    rows = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": "ok"}]}
            for w in ("loop", "fine", "grow", "repeat", "power")]
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "h.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "HELIXTOK_TEST_LIMITS": "RENDER_SECONDS=1,RENDER_CHARS=1000000"}
    r = subprocess.run([sys.executable, "-m", "helixtok.cli", "build", str(tmp_path / "c"), str(tmp_path / "out"), "-t",
                        tok, "-L", "64", "-q", "-j", "2", "--chat", "--chat-template", str(template),
                        "--stall-timeout", "30"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["splits"]["train"]["chat"]["conversations"] == 1
    why = "the template's rendering was stopped: "
    assert m["skipped"]["not_a_conversation"]["examples"] == [
        f"h.jsonl:1 ({why}it took over 1 s)", f"h.jsonl:3 ({why}its output passed 1,000,000 characters)",
        f"h.jsonl:4 ({why}its output passed 1,000,000 characters)", f"h.jsonl:5 ({why}a power of 100000000 in the "
                                                                    "template)"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=40),
       st.lists(st.tuples(st.integers(0, 60), st.integers(0, 8)), max_size=8), st.sampled_from(["assistant", "last"]))
def test_the_mask_of_tokens_in_order_is_transformers_rule(steps, spans, loss):
    """loss_mask's linear path (tokens in text order: two binary searches a span) marks exactly
    the tokens of transformers' rule, token_end > span_start and token_start < span_end, spans
    empty, overlapping or between tokens included; zero-width tokens too."""
    from helixtok.pipeline.chat import loss_mask

    offsets, pos = [], 0
    for gap, width in steps:
        offsets.append((pos + gap, pos + gap + width))
        pos += gap + width
    offsets = np.array(offsets, np.int64).reshape(-1, 2)
    spans = [(a, a + w) for a, w in spans]
    want = np.zeros(len(offsets), np.uint8)
    for a, b in (spans[-1:] if loss == "last" else spans):
        want[(offsets[:, 1] > a) & (offsets[:, 0] < b)] = 1
    assert loss_mask(offsets, spans, loss).tolist() == want.tolist()


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_packed_data_read_at_another_seq_len_is_a_build_at_it(tmp_path, kinds, tokenizer_path, kind):
    """Issue 56.2: MemmapChunkDataset(out, seq_len=L) over a packed build of another length gives the
    items and len() of a packed text build at L, and `helixtok stats --seq-len L` says so exactly; a
    chat build is its stream cut at L (the conversations its own length dropped stay dropped), with
    the trainable tokens stats gives what the labels hold; other packings are refused."""
    from click.testing import CliRunner

    from helixtok import MemmapChunkDataset
    from helixtok.cli import main
    from helixtok.format.errors import DatasetError

    corpus, chat = kinds[kind]
    tok = chat[0] if chat else tokenizer_path
    cfg = dict(packing="packed", workers=1, unit_bytes=8 << 10, shard_bytes=16 << 10, chat=chat[1] if chat else None)
    built = 600 if chat else 96  # most conversations fit in 600
    build([corpus], str(tmp_path / "at96"), tok, BuildConfig(seq_len=built, **cfg))
    for L in (40, 257):
        got = MemmapChunkDataset(str(tmp_path / "at96"), seq_len=L)
        r = CliRunner().invoke(main, ["stats", str(tmp_path / "at96"), "--seq-len", str(L), "--json"])
        assert r.exit_code == 0 and json.loads(r.stdout)["chunks"] == len(got) > 10 and got.seq_len == L
        if not chat:
            build([corpus], str(tmp_path / f"at{L}"), tok, BuildConfig(seq_len=L, **cfg))
            ref = MemmapChunkDataset(str(tmp_path / f"at{L}"))
            assert len(got) == len(ref)
            for i in [*range(0, len(ref), 5), len(ref) - 1]:
                a, b = ref[i], got[i]
                assert all(np.array_equal(a[k], b[k]) for k in a), (L, i)
            want = CliRunner().invoke(main, ["stats", str(tmp_path / f"at{L}"), "--json"])
            assert json.loads(r.stdout) == json.loads(want.stdout)
        else:
            trained = sum(int((got[i]["labels"] != -100).sum()) for i in range(len(got)))
            assert json.loads(r.stdout)["trainable_tokens_per_epoch"] == trained
    build([corpus], str(tmp_path / "bf"), tok, BuildConfig(seq_len=built, **{**cfg, "packing": "bestfit"}))
    with pytest.raises(DatasetError, match=f"a bestfit-packed dataset holds chunks placed for seq_len {built}; "
                                           "reading it at 40 needs a packed build"):
        MemmapChunkDataset(str(tmp_path / "bf"), seq_len=40)
