"""OUT belongs to one build at a time, and helixtok touches only what it wrote (issue #9)."""

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import helixtok.pipeline.builder as hb
from helixtok import MemmapChunkDataset
from helixtok.cli import main
from helixtok.format.errors import ConfigError, DatasetError, InputError, InternalError
from helixtok.pipeline.builder import build
from helixtok.pipeline.config import BuildConfig
from helixtok.pipeline.discover import discover
from helixtok.pipeline.outdir import LOCK_INFO, STATE
from helixtok.pipeline.unit import done_path


def shards_of(out):
    return {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out) if n.endswith((".bin", ".docs"))}


def interrupt_after_plan(monkeypatch):
    monkeypatch.setattr(hb, "run_units", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))


def start(corpus, out, tok, *extra):
    return subprocess.Popen([sys.executable, "-m", "helixtok.cli", "build", str(corpus), str(out), "-t", tok,
                             "-L", "512", "-j", "2", "-q", "--shard-size", "1MiB", "--unit-size", "512KiB", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_second_build_into_the_same_out_fails_at_once_naming_the_holder(tmp_path, dev_corpus, tokenizer_path,
                                                                       dev_packed):
    out = tmp_path / "out"
    first = start(dev_corpus, out, tokenizer_path)
    t = time.time()
    while not (out / LOCK_INFO).exists():
        assert first.poll() is None and time.time() - t < 60
        time.sleep(0.01)
    # Stopped while it holds the lock (as a build stalled on a slow disk): it stays the holder
    # however long the others take, and they must not touch what it wrote.
    os.kill(first.pid, signal.SIGSTOP)
    try:
        for extra in ([], ["--overwrite"]):
            t = time.time()
            r = subprocess.run([sys.executable, "-m", "helixtok.cli", "build", str(dev_corpus), str(out), "-t",
                                tokenizer_path, "-L", "512", "-q", *extra], capture_output=True, text=True)
            assert r.returncode == 1 and time.time() - t < 30
            assert f"another helixtok process (pid {first.pid} on " in r.stderr, r.stderr
            assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait() == 0, first.communicate()
    assert shards_of(out) == shards_of(dev_packed)  # the first build's data is untouched by the others
    assert not (out / LOCK_INFO).exists()


def test_lock_is_released_by_kill_9(tmp_path, small_corpus, small_tok):
    out = tmp_path / "out"
    p = start(small_corpus, out, small_tok, "--backend", "hf")
    while not (out / LOCK_INFO).exists():
        time.sleep(0.01)
    p.kill()
    p.wait()
    # The same options: whether the kill came before or after the plan was written (a race the
    # test used to lose now and then, refused as "other inputs or options"), the lock is free.
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(out), "-t", small_tok, "-L", "512", "-q",
                                  "-j", "2", "--unit-size", "512KiB", "--shard-size", "1MiB", "--backend", "hf"])
    assert r.exit_code == 0, r.output


def test_stale_unit_shards_and_journal_entries_are_never_trusted(tmp_path, small_corpus, small_tok, monkeypatch):
    out = str(tmp_path / "out")
    cfg = BuildConfig(seq_len=16, workers=1, unit_bytes=1)  # one unit per file
    ref = build([str(small_corpus)], str(tmp_path / "ref"), small_tok, cfg)
    # A finished build to steal journal entries from, then an unfinished one.
    real_run = hb.run_units
    calls = {}

    def half(units, pending, *a, **k):
        res = real_run(units, pending[: len(pending) // 2], *a, **k)
        calls["done"] = res
        raise KeyboardInterrupt

    monkeypatch.setattr(hb, "run_units", half)
    with pytest.raises(KeyboardInterrupt):
        build([str(small_corpus)], out, small_tok, cfg)
    monkeypatch.undo()
    state = os.path.join(out, STATE)
    done = calls["done"]
    assert len(done) >= 2
    # What an orphan of the killed run could leave: one finished unit's token file cut short
    # (as a rerun's truncation would), and a late journal entry naming files that do not exist.
    # (Format 4: a placed unit's ids are its segment of its group's shard; that segment is damaged.)
    victim = done[0]
    with open(os.path.join(state, f"u{victim['index']:06d}.placed.json")) as fh:
        placed = json.load(fh)
    (k, off, n, _), = placed["segments"]["train"]
    with open(os.path.join(state, f"g{placed['group']:06d}.train.{k:04d}.bin"), "r+b") as fh:
        fh.seek(off + n // 2)
        fh.write(bytes(n - n // 2))
    ghost_shard = {**done[1]["shards"]["train"][0], "state": "u999999.rX.train.0000.bin"}
    ghost = dict(done[1], shards={"train": [ghost_shard]})
    with open(done_path(state, done[1]["index"]), "w") as fh:
        json.dump(ghost, fh)
    m = build([str(small_corpus)], out, small_tok, cfg)
    assert m["splits"] == ref["splits"]
    assert shards_of(out) == shards_of(str(tmp_path / "ref"))
    # The two damaged units were tokenized again, the rest reused (this read the first progress
    # report's units_done, which now comes within the first unit, as it is read).
    assert m.reused_units == len(done) - 2 and m.units == ref["inputs"]["units"]


def test_resume_refuses_a_changed_special_token_choice(tmp_path, small_corpus, small_tok, monkeypatch):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok = tok_dir / "tokenizer.json"
    tok.write_bytes(open(small_tok, "rb").read())
    out = str(tmp_path / "out")
    cfg = BuildConfig(seq_len=16, workers=1)
    interrupt_after_plan(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        build([str(small_corpus)], out, str(tok), cfg)
    monkeypatch.undo()
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<pad>"}))
    with pytest.raises(ConfigError, match=r"unfinished build .*eos_id: 0 -> 1.*eos_token: '<\|endoftext\|>' -> '<pad>'"):
        build([str(small_corpus)], out, str(tok), cfg)
    with pytest.raises(ConfigError, match=r"backend: 'auto' -> '(hf|tiktoken)'"):
        (tok_dir / "tokenizer_config.json").unlink()
        build([str(small_corpus)], out, str(tok), BuildConfig(seq_len=16, workers=1,
                                                               backend="tiktoken" if _auto_is_hf(out) else "hf"))


def _auto_is_hf(out):
    return json.load(open(os.path.join(out, STATE, "plan.json")))["tokenizer"]["backend"] == "hf"


def test_a_dataset_made_before_overwrite_refuses_the_new_files(tmp_path, small_corpus, small_tok):
    out = str(tmp_path / "out")
    build([str(small_corpus)], out, small_tok, BuildConfig(seq_len=16, workers=1))
    ds = MemmapChunkDataset(out)
    first = ds[0]["input_ids"].tolist()
    blob = pickle.dumps(MemmapChunkDataset(out))  # what a DataLoader sends each worker
    build([str(small_corpus)], out, small_tok, BuildConfig(seq_len=16, workers=1, add_bos=False,
                                                            split_seed=1, val_fraction=0.3), overwrite=True)
    assert ds[0]["input_ids"].tolist() == first  # already-open maps keep the old (unlinked) files
    with pytest.raises(DatasetError, match="changed since this MemmapChunkDataset was created"):
        pickle.loads(blob)[0]
    assert len(MemmapChunkDataset(out)) != len(ds)  # a new dataset object sees the new build


def test_overwrite_never_deletes_what_helixtok_did_not_write(tmp_path, small_corpus, small_tok):
    out = tmp_path / "proj"
    build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=16, workers=1))
    (out / "pytorch_model.bin").write_bytes(b"weights")
    (out / "notes.tmp").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds 'notes.tmp' and 1 more, which helixtok did not write"):
        build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=16, workers=1), overwrite=True)
    assert (out / "pytorch_model.bin").read_bytes() == b"weights" and (out / "manifest.json").exists()
    (out / "pytorch_model.bin").unlink()
    (out / "notes.tmp").unlink()
    # The tokenizer given is the dataset's own copy: --overwrite must not delete its input.
    with pytest.raises(ConfigError, match=r"tokenizer.json: is one of this build's inputs"):
        build([str(small_corpus)], str(out), str(out / "tokenizer.json"), BuildConfig(seq_len=8, workers=1),
              overwrite=True)
    assert (out / "tokenizer.json").exists() and (out / "manifest.json").exists()
    m = build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=8, workers=1), overwrite=True)
    assert m["seq_len"] == 8 and sorted(os.listdir(out)) == ["build-plan.json", "manifest.json", "tokenizer.json",
                                                             "train-000000-0000.bin", "train-000000-0000.docs",
                                                             "train-000000-0000.src"]


def test_kill_during_overwrite_leaves_the_rest_known_as_helixtoks(tmp_path, small_corpus, small_tok, monkeypatch):
    out = tmp_path / "out"
    build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=16, workers=1, shard_bytes=64))
    n_shards = len([n for n in os.listdir(out) if n.endswith(".bin")])
    assert n_shards > 2
    real_remove, calls = os.remove, {"n": 0}

    def dying_remove(p):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real_remove(p)

    monkeypatch.setattr(os, "remove", dying_remove)
    with pytest.raises(KeyboardInterrupt):
        build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=8, workers=1), overwrite=True)
    monkeypatch.undo()
    assert not (out / "manifest.json").exists()  # the manifest went first
    m = build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=8, workers=1), overwrite=True)
    assert m["seq_len"] == 8 and not any(n.startswith("train-00002") for n in os.listdir(out))


def test_failed_builds_leave_out_so_the_corrected_command_works(tmp_path, small_corpus, small_tok):
    out = tmp_path / "out"
    # No chunk at all: the message says lower --seq-len; doing so just works.
    with pytest.raises(InputError, match="lower seq_len"):
        build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=10**7, workers=1))
    assert not out.exists()
    # A corrupt file found mid-build: fix it and rerun the same command.
    bad = small_corpus.parent / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text('{"text": "fine text here"}\n{"text": "x"}\n')
    import gzip

    import random

    rng = random.Random(0)
    lines = [json.dumps({"text": " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(400))})
             for _ in range(600)]
    blob = gzip.compress(("\n".join(lines) + "\n").encode())
    (bad / "b.jsonl.gz").write_bytes(blob[: len(blob) // 2])
    import zlib

    d = zlib.decompressobj(31)
    complete = d.decompress(blob[: len(blob) // 2]).count(b"\n")
    assert 100 < complete < 500
    with pytest.raises(InputError, match=rf"b.jsonl.gz: truncated or corrupt after line {complete}, its last complete"):
        build([str(bad)], str(out), small_tok, BuildConfig(seq_len=4, workers=1))
    (bad / "b.jsonl.gz").write_bytes(blob)
    build([str(bad)], str(out), small_tok, BuildConfig(seq_len=4, workers=1))
    # A kill before plan.json was written leaves only helixtok's own state: a rerun needs no flag.
    out2 = tmp_path / "out2"
    (out2 / STATE).mkdir(parents=True)
    (out2 / STATE / "u000000.r1x1.train.tok.part").write_bytes(b"\0" * 10)
    (out2 / LOCK_INFO).write_text("{}")
    build([str(small_corpus)], str(out2), small_tok, BuildConfig(seq_len=16, workers=1))
    assert not (out2 / STATE).exists() and not (out2 / LOCK_INFO).exists()


def test_link_to_an_ancestor_does_not_escape_the_corpus(tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("not corpus")
    c = tmp_path / "corpus"
    (c / "d").mkdir(parents=True)
    (c / "d" / "a.txt").write_text("a")
    os.symlink("..", c / "up")  # corpus/up -> tmp_path
    os.symlink(".", c / "d" / "self")
    os.link(c / "d" / "a.txt", c / "hard.txt")  # a hard link: the same file, read once
    files, warn = discover([str(c)])
    assert [f.path for f in files] == [str(c / "d" / "a.txt")]
    assert warn.counts == {"link_outside_corpus": 1, "symlink_loop": 1, "duplicate_file": 1}
    assert all(not x.startswith("/") for ex in warn.examples.values() for x in ex)  # relative, never host paths


def test_a_lattice_of_links_is_walked_once(tmp_path):
    c = tmp_path / "c"
    dirs = [c / f"d{i:02d}" for i in range(18)]
    for d in dirs:
        d.mkdir(parents=True)
        (d / "x.txt").write_text(d.name)
    for a, b in zip(dirs, dirs[1:]):
        os.symlink(b, a / "l1")
        os.symlink(b, a / "l2")
    t = time.time()
    files, warn = discover([str(c)])
    assert len(files) == 18 and time.time() - t < 5
    assert sum(warn.counts.values()) == 2 * 17  # each link to a folder already read, once


def test_corpus_inside_out_is_named(tmp_path, small_tok):
    (tmp_path / "out" / "c").mkdir(parents=True)
    (tmp_path / "out" / "c" / "a.txt").write_text("hello")
    with pytest.raises(InputError, match=r"c: is inside the output folder"):
        build([str(tmp_path / "out" / "c")], str(tmp_path / "out"), small_tok, BuildConfig(seq_len=4, workers=1))


BAD_MANIFESTS = {
    "a list": ([], "not a helixtok manifest (a JSON list)"),
    # (Form: version 4 shards check by their segments' sha256, no longer one sha256.)
    "no segments": (lambda m: m["splits"]["train"]["shards"][0].pop("segments"), "shards[0].segments: missing"),
    "segments short of the shard": (lambda m: m["splits"]["train"]["shards"][0]["segments"][0].__setitem__(
        0, m["splits"]["train"]["shards"][0]["segments"][0][0] - 2), "shards[0].segments: [["),
    "string seq_len": (lambda m: m.update(seq_len="512"), "seq_len: '512' is not a positive integer"),
    "splits list": (lambda m: m.update(splits=[]), "splits: [] is not a non-empty object"),
    "shards null": (lambda m: m["splits"]["train"].update(shards=None), "splits.train.shards: None is not a list"),
    "absolute path": (lambda m: m["splits"]["train"]["shards"][0].update(path="/etc/passwd"),
                      "shards[0].path: '/etc/passwd' is not a relative path"),
    # Outside the dataset by '..' (issue 39: verify read it), unless under a part it was merged from.
    "dotdot path": (lambda m: m["splits"]["train"]["shards"][0].update(path="../../etc/passwd"),
                    "shards[0].path: '../../etc/passwd' is not a relative path inside the dataset"),
    "dotdot beside merged_from": (lambda m: m.update(merged_from=["../p/part-00000"]) or m["splits"]["train"][
        "shards"][0].update(path="../p/secret.bin"), "shards[0].path: '../p/secret.bin' is not a relative path inside"),
    "tokenizer file in a folder": (lambda m: m["tokenizer"].update(file="../tokenizer.json"),
                                   "tokenizer.file: '../tokenizer.json' is not a relative path inside the dataset"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_manifest_of_the_wrong_shape_is_one_clear_error_everywhere(tmp_path, small_corpus, small_tok, case):
    out = tmp_path / "out"
    build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=16, workers=1))
    m = json.load(open(out / "manifest.json"))
    change, want = BAD_MANIFESTS[case]
    if callable(change):
        change(m)
    else:
        m = change
    (out / "manifest.json").write_text(json.dumps(m))
    for cmd in (["verify", str(out)], ["stats", str(out)]):
        r = CliRunner().invoke(main, cmd)
        assert r.exit_code == 1 and want in r.output and "Traceback" not in r.output, r.output
    with pytest.raises(DatasetError, match=want.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        MemmapChunkDataset(str(out))


def test_verify_checks_the_tokenizer_copy_and_document_counts(tmp_path, small_corpus, small_tok):
    out = tmp_path / "out"
    build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=16, workers=1))
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    m = json.load(open(out / "manifest.json"))
    m["splits"]["train"]["documents"] += 1000
    (out / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "document starts for" in r.output
    m["splits"]["train"]["documents"] -= 1000
    (out / "manifest.json").write_text(json.dumps(m))
    with open(out / "tokenizer.json", "a") as fh:
        fh.write(" ")
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "tokenizer.json: sha256 differs" in r.output


def test_strict_stops_at_the_first_bad_input_in_corpus_order(tmp_path, small_tok):
    c = tmp_path / "c"
    c.mkdir()
    lines = ['{"text": "good document number %d"}' % i for i in range(4000)]
    early, late = lines.copy(), lines.copy()
    early[2500] = '{"text": 5}'
    late[10] = "{broken"
    (c / "a.jsonl").write_text("\n".join(early) + "\n")
    (c / "b.jsonl").write_text("\n".join(late) + "\n")
    for workers in (1, 2):
        with pytest.raises(InputError, match=r"a.jsonl:2501 \(int\): non string text \(strict=True: fix it"):
            build([str(c)], str(tmp_path / f"o{workers}"), small_tok,
                  BuildConfig(seq_len=4, workers=workers, strict=True, unit_bytes=8 << 10))
        assert not (tmp_path / f"o{workers}").exists()
    m = build([str(c)], str(tmp_path / "o"), small_tok, BuildConfig(seq_len=4, workers=1))
    assert m["skipped"]["malformed_json"]["examples"] == [
        "b.jsonl:11 (Expecting property name enclosed in double quotes at column 2)"]


def test_a_panic_inside_the_tokenizer_is_one_line_naming_the_unit(tmp_path, small_corpus, small_tok, monkeypatch):
    class PanicException(BaseException):  # what pyo3 raises on a Rust panic: not an Exception
        pass

    def panic(self, docs):
        raise PanicException("called `Result::unwrap()` on an `Err` value")

    from helixtok.pipeline.encode import Encoder

    monkeypatch.setattr(Encoder, "encode", panic)
    out = tmp_path / "out"
    with pytest.raises(InternalError, match=r"^internal error while tokenizing .*a.txt.* \(work unit 0\): "
                                            r"PanicException: called .*not a fault of the input: please report it, "
                                            r"with the traceback kept in (\S+)$") as e:
        build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=16, workers=1))
    log = str(e.value).rsplit(" ", 1)[1]
    assert log == str(out / STATE / "u000000.error.log")
    assert "Traceback" in open(log).read() and "def panic" not in open(log).read() and "in panic" in open(log).read()


def test_a_bug_is_said_to_be_one_not_blamed_on_the_input(tmp_path, small_corpus, small_tok, monkeypatch):
    """Issue 62.11: an exception that is no HelixtokError (here a KeyError inside a placement, as
    the val split's bug gave) says it is internal, names the unit and keeps its traceback: the
    command prints that one line and exits 1, and the rerun (the bug gone) builds the dataset."""
    import helixtok.pipeline.join as hj

    real = hj._place_all

    def broken(r, *a, **kw):
        raise KeyError("train")
    monkeypatch.setattr(hj, "_place_all", broken)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(out), "-t", small_tok, "-L", "16", "-j", "1", "-q"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    line, = r.stderr.strip().splitlines()
    assert re.fullmatch(r"Error: internal error while tokenizing .*a.txt.* \(work unit 0\): KeyError: 'train'; not a "
                        r"fault of the input: please report it, with the traceback kept in .*u000000.error.log", line)
    assert "KeyError: 'train'" in (out / STATE / "u000000.error.log").read_text()
    monkeypatch.setattr(hj, "_place_all", real)
    assert CliRunner().invoke(main, ["build", str(small_corpus), str(out), "-t", small_tok, "-L", "16", "-j", "1",
                                     "-q"]).exit_code == 0
    assert not (out / STATE).exists()


def test_a_shard_whose_bytes_disagree_with_its_tokens_is_refused_on_load(tmp_path, small_corpus, small_tok):
    """A manifest whose last shard's num_tokens was halved: `helixtok show OUT LAST` says the
    manifest is damaged in one line (it raised an IndexError traceback)."""
    out = tmp_path / "out"
    m = build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=16, workers=1))
    e = m["splits"]["train"]["shards"][-1]
    e["num_tokens"] //= 2
    (out / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["show", str(out), str(m["splits"]["train"]["num_chunks"] - 1)])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert re.search(r"Error: .*out: its train shards hold [\d,]+ tokens, fewer than its [\d,]+ chunks of 16 need: "
                     r"the manifest is damaged", " ".join(r.output.split())), r.output


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_helixtok_partial_folder_helixtok_did_not_write_is_left_alone(tmp_path, small_corpus, small_tok, overwrite):
    """OUT/.helixtok-partial/ holding a file of the user's and no record of a build (plan.json): the
    build refuses in one line and leaves it as it was (it emptied it), --overwrite too."""
    out = tmp_path / "out"
    (out / ".helixtok-partial").mkdir(parents=True)
    (out / ".helixtok-partial" / "notes.txt").write_text("mine")
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(out), "-t", small_tok, "-L", "16", "-q",
                                  *(["--overwrite"] if overwrite else [])])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "holds 'notes.txt', and no record of a helixtok build (plan.json); helixtok did not write it" in \
        " ".join(r.output.split())
    assert (out / ".helixtok-partial" / "notes.txt").read_text() == "mine"
