"""Crashes and faults: kill -9 and resume, Ctrl-C, a dead worker, a full disk. Nothing half-written."""

import contextlib
import errno
import filecmp
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import helixtok.pipeline.builder as hb
import helixtok.pipeline.dispatch as hdisp
from conftest import UNIT
from helixtok.format import limits
from helixtok.cli import main
from helixtok.format.errors import ConfigError, HelixtokError
from helixtok.pipeline.builder import STATE, build
from helixtok.pipeline.config import BuildConfig
from helixtok.pipeline.journal import write_entry

# Kilobyte corpora with --workers 2 still start a pool: these tests are about its processes.
pytestmark = pytest.mark.usefixtures("pooled")


def same_folder(a, b, ignore=()):
    names = sorted(n for n in os.listdir(a) if n not in ignore)
    assert names == sorted(os.listdir(b))
    for n in names:
        assert filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False), n


def start_cli(corpus, out, tok, *extra):
    return subprocess.Popen([sys.executable, "-m", "helixtok.cli", "build", str(corpus), str(out), "-t", tok,
                             "-L", "512", "-j", "2", "-q", "--shard-size", "1MiB", "--unit-size", "512KiB", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def unit_ids(out, i: int, split: str = "train") -> tuple[str, int, int]:
    """Where unit i's ids are in STATE (path, byte offset, bytes): its own .bin, or (once placed) its
    segment of its group's shard."""
    own = glob.glob(os.path.join(out, STATE, f"u{i:06d}.*.{split}.0000.bin"))
    if own:
        return own[0], 0, os.path.getsize(own[0])
    with open(os.path.join(out, STATE, f"u{i:06d}.placed.json")) as fh:
        p = json.load(fh)
    (k, off, n, _), = p["segments"][split]
    return os.path.join(out, STATE, f"g{p['group']:06d}.{split}.{k:04d}.bin"), off, n


def wait_for(pattern, proc, timeout=120):
    t = time.time()
    while not glob.glob(pattern):
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t < timeout
        time.sleep(0.05)


def test_kill_9_then_resume_is_byte_identical(tmp_path, dev_corpus, tokenizer_path, dev_packed):
    out = tmp_path / "out"
    p = start_cli(dev_corpus, out, tokenizer_path)
    wait_for(str(out / STATE / "u*.done.json"), p)
    p.kill()
    p.wait()
    done = sorted(glob.glob(str(out / STATE / "u*.done.json")))
    assert done and not (out / "manifest.json").exists()
    mtimes = {d: os.stat(d).st_mtime_ns for d in done}
    from helixtok import MemmapChunkDataset
    from helixtok.format.errors import DatasetError

    with pytest.raises(DatasetError, match="unfinished"):
        MemmapChunkDataset(str(out))
    time.sleep(0.3)  # orphaned workers notice their parent is gone and exit
    p = start_cli(dev_corpus, out, tokenizer_path)
    assert p.wait() == 0, p.communicate()
    # Finished units were not redone: their journal entries were not rewritten... and are gone now.
    assert all(not os.path.exists(d) for d in mtimes)
    same_folder(out, dev_packed)


def test_a_build_stopped_before_publishing_resumes_identically(tmp_path, dev_corpus, tokenizer_path, dev_packed,
                                                                monkeypatch):
    """Every unit's ids are placed in its group's shard where a worker wrote them (in STATE until
    published; the unit's own .bin is gone once placed): a build stopped before publishing shows
    nothing in OUT, and the rerun tokenizes nothing."""
    def stop(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(hb, "publish", stop)
    out = str(tmp_path / "out")
    cfg = BuildConfig(seq_len=512, workers=2, shard_bytes=1 << 20, unit_bytes=UNIT)
    with pytest.raises(KeyboardInterrupt):
        build([str(dev_corpus)], out, tokenizer_path, cfg)
    assert os.path.isfile(os.path.join(out, STATE, "u000000.placed.json"))
    assert os.path.isfile(os.path.join(out, STATE, "g000000.train.0000.bin"))
    assert not glob.glob(os.path.join(out, STATE, "u000000.*.train.0000.bin"))
    assert os.listdir(out) == [STATE]
    monkeypatch.undo()
    seen = []
    build([str(dev_corpus)], out, tokenizer_path, cfg, on_progress=lambda p: seen.append(p.units_done))
    assert min(seen) == max(seen)  # every unit was already journaled: none re-tokenized
    same_folder(out, dev_packed)


def _stopped_after(n_units: int, monkeypatch):
    """Make an inline build stop (Ctrl-C) when it starts its n-th unit; returns the list of the
    units the build tokenizes (all of its runs)."""
    ran, real = [], hdisp.run_unit
    stop = [True]

    def counted(unit, info, *where):
        if len(ran) == n_units and stop and stop.pop():  # once
            raise KeyboardInterrupt
        ran.append(unit.index)
        return real(unit, info, *where)
    monkeypatch.setattr(hdisp, "run_unit", counted)
    return ran


SMALL_SHARDS = dict(seq_len=512, workers=1, shard_bytes=1 << 18, unit_bytes=UNIT)


@pytest.mark.parametrize("options", [dict(val_fraction=0.2), dict(packing="document", val_fraction=0.2),
                                     dict(packing="bestfit", val_fraction=0.2)],
                         ids=["packed+val", "document+val", "bestfit+val"])
def test_a_stopped_build_resumes_from_its_finished_units(tmp_path, dev_corpus, tokenizer_path, options, monkeypatch):
    """A resumed build takes the units journaled before the stop as they are (their shards) and
    tokenizes only the others: the dataset of an undisturbed build, byte for byte.  (Form changed
    with format 2: this resumed an assembly from its checkpoint.)"""
    cfg = BuildConfig(**SMALL_SHARDS, **options)
    ref = str(tmp_path / "ref")
    build([str(dev_corpus)], ref, tokenizer_path, cfg)
    out = str(tmp_path / "out")
    ran = _stopped_after(5, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        build([str(dev_corpus)], out, tokenizer_path, cfg)
    covered = list(range(5))  # in corpus order, without workers
    assert ran == covered and len(glob.glob(os.path.join(out, STATE, "u*.done.json"))) == 5
    ran.clear()
    m = build([str(dev_corpus)], out, tokenizer_path, cfg)
    assert ran and not set(ran) & set(covered) and len(ran) == m["inputs"]["units"] - 5
    same_folder(out, ref)


@pytest.mark.parametrize("damage", ["cut short", "gone", "sidecar gone"])
def test_a_unit_whose_shards_do_not_match_its_entry_is_tokenized_again(tmp_path, dev_corpus, tokenizer_path, damage,
                                                                       monkeypatch):
    """A finished unit's shard (or sidecar) is shorter than its journal entry says, or gone: the
    resume tokenizes that unit again, takes the others as they are; the dataset is still exact."""
    cfg = BuildConfig(**SMALL_SHARDS)
    ref = str(tmp_path / "ref")
    build([str(dev_corpus)], ref, tokenizer_path, cfg)
    out = str(tmp_path / "out")
    ran = _stopped_after(5, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        build([str(dev_corpus)], out, tokenizer_path, cfg)
    shard = unit_ids(out, 2)[0] if "sidecar" not in damage else \
        glob.glob(os.path.join(out, STATE, "u000002.*.train.0000.docs"))[0]
    if damage == "cut short":
        with open(shard, "r+b") as fh:
            fh.truncate(os.path.getsize(shard) - 2)
    else:
        os.remove(shard)
    ran.clear()
    build([str(dev_corpus)], out, tokenizer_path, cfg)
    assert ran[0] == 2 and not set(ran) & {0, 1, 3, 4}
    same_folder(out, ref)


def test_a_build_stopped_while_publishing_publishes_without_tokenizing_again(tmp_path, dev_corpus, tokenizer_path,
                                                                              dev_packed, monkeypatch):
    """A build stopped after some shards moved into OUT (publish.json names them) finds them there
    and publishes, tokenizing nothing."""
    cfg = BuildConfig(seq_len=512, workers=1, shard_bytes=1 << 20, unit_bytes=UNIT)
    out = str(tmp_path / "out")
    real, moved = os.replace, []

    def stop_after_two(a, b):  # into OUT: two files, then Ctrl-C
        if os.path.dirname(b) == out:
            if len(moved) == 2:
                raise KeyboardInterrupt
            moved.append(b)
        real(a, b)
    with monkeypatch.context() as mp:
        mp.setattr(hb.os, "replace", stop_after_two)
        with pytest.raises(KeyboardInterrupt):
            build([str(dev_corpus)], out, tokenizer_path, cfg)
    assert len(glob.glob(os.path.join(out, "train-*"))) == 2 and not os.path.exists(os.path.join(out, "manifest.json"))
    ran = _stopped_after(-1, monkeypatch)
    build([str(dev_corpus)], out, tokenizer_path, cfg)
    assert ran == []
    same_folder(out, dev_packed)


def test_changed_option_or_input_refuses_resume(tmp_path, small_tok, monkeypatch):
    c = tmp_path / "c"
    c.mkdir()
    (c / "a.txt").write_text("hello world " * 100)
    out = str(tmp_path / "out")
    cfg = BuildConfig(seq_len=4, workers=1)
    # Leave an unfinished build: interrupt right after the plan is journaled.
    monkeypatch.setattr(hb, "run_units", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        build([str(c)], out, small_tok, cfg)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"unfinished build .*seq_len: 4 -> 8"):
        build([str(c)], out, small_tok, BuildConfig(seq_len=8, workers=1))
    # Another tokenizers release as the reference (its ids may differ): refused like another backend version.
    import helixtok.pipeline.tokenizer as ht
    monkeypatch.setattr(ht, "reference_version", lambda: "tokenizers 0.0.1")
    with pytest.raises(ConfigError, match=r"unfinished build .*reference_version: 'tokenizers [\d.]+' -> "
                                          r"'tokenizers 0.0.1'"):
        build([str(c)], out, small_tok, cfg)
    monkeypatch.undo()
    # Rewritten with the same size and its mtime put back (cp -p, rsync -t, touch -r): still another file.
    st = os.stat(c / "a.txt")
    (c / "a.txt").write_text("HELLO WORLD " * 100)
    os.utime(c / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ConfigError, match=r"input modified: a.txt"):
        build([str(c)], out, small_tok, cfg)
    (c / "a.txt").write_text("hello world " * 101)
    with pytest.raises(ConfigError, match=r"input modified: a.txt"):
        build([str(c)], out, small_tok, cfg)
    (c / "b.txt").write_text("new")
    with pytest.raises(ConfigError, match=r"new input b.txt"):
        build([str(c)], out, small_tok, cfg)
    build([str(c)], out, small_tok, cfg, overwrite=True)


def test_ctrl_c_exits_130_and_resumes(tmp_path, dev_corpus, tokenizer_path, dev_packed):
    out = tmp_path / "out"
    p = start_cli(dev_corpus, out, tokenizer_path)
    wait_for(str(out / STATE / "plan.json"), p)  # units are being tokenized
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted; rerun the same command to resume" in err and "Traceback" not in err
    assert not (out / "manifest.json").exists()
    p = start_cli(dev_corpus, out, tokenizer_path)
    assert p.wait() == 0
    same_folder(out, dev_packed)


def _children(pid) -> list[int]:
    """pid's child processes, from /proc (those of each of its threads: a pool starts workers from
    a thread).  Not pgrep: a process started per look, every 20 ms, took a core from the build
    under test."""
    kids = []
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError):
            with open(f) as fh:
                kids += [int(k) for k in fh.read().split()]
    return kids


def _descendants(pid) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def test_dead_worker_fails_promptly_with_location(tmp_path, dev_corpus, tokenizer_path):
    out = tmp_path / "out"
    p = start_cli(dev_corpus, out, tokenizer_path, "--backend", "hf")  # slow enough to be caught mid-build
    wait_for(str(out / STATE / "plan.json"), p)  # units are being tokenized
    victim = None
    while victim is None and p.poll() is None:  # one at work (the other may still be starting)
        victim = next((k for k in _workers_of(p.pid) if _open_input(k, dev_corpus)), None)
    assert victim
    os.kill(victim, signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "a worker process died while tokenizing" in err and str(dev_corpus) in err
    assert "Traceback" not in err
    assert not (out / "manifest.json").exists()


def _open_input(pid, corpus):
    with contextlib.suppress(OSError):  # the process, or one of its files, may be gone by now
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(str(corpus)):
                    return target
    return None


def test_dead_worker_message_names_the_file_that_worker_was_reading(tmp_path, dev_corpus, tokenizer_path):
    # Kill one worker while it holds a .jsonl(.gz) open; the message must name that very file.
    out, corpus = tmp_path / "out", tmp_path / "corpus"
    corpus.mkdir()
    plain = (dev_corpus / "jsonl" / "plain.jsonl").read_bytes()
    for name in ("a", "b", "c"):  # enough text that the workers are caught mid-file
        (corpus / f"{name}.jsonl").write_bytes(plain * 10)
    # Units of several encode batches: a worker holds its file open while it tokenizes most of one.
    p = start_cli(corpus, out, tokenizer_path, "--unit-size", "8MiB", "--backend", "hf")
    wait_for(str(out / STATE / "plan.json"), p)  # units are being tokenized
    victim = reading = None
    while victim is None and p.poll() is None:
        for k in _workers_of(p.pid):
            os.kill(k, signal.SIGSTOP)  # frozen: it cannot move on to another file
            reading = _open_input(k, corpus)
            if reading:
                victim = k
                break
            os.kill(k, signal.SIGCONT)
    assert victim, "no worker was caught reading an input"
    os.kill(victim, signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "Traceback" not in err
    assert f"a worker process died while tokenizing {reading}" in err, (reading, err)


def test_hung_worker_fails_promptly_with_location(tmp_path, dev_corpus, tokenizer_path):
    out, corpus = tmp_path / "out", tmp_path / "corpus"
    corpus.mkdir()
    plain = (dev_corpus / "jsonl" / "plain.jsonl").read_bytes()
    for name in ("a", "b", "c"):  # units long enough that each worker is caught mid-unit
        (corpus / f"{name}.jsonl").write_bytes(plain * 10)
    p = start_cli(corpus, out, tokenizer_path, "--stall-timeout", "3", "--unit-size", "8MiB", "--backend", "hf")
    wait_for(str(out / STATE / "plan.json"), p)
    # Each worker stopped while it reads a unit (one still starting would be named as starting).
    stopped = set()
    while len(stopped) < 2 and p.poll() is None:
        for k in set(_workers_of(p.pid)) - stopped:
            os.kill(k, signal.SIGSTOP)  # a worker that neither works nor dies
            if _open_input(k, corpus):
                stopped.add(k)
            else:
                os.kill(k, signal.SIGCONT)
    assert len(stopped) == 2, p.communicate()
    t = time.time()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and time.time() - t < 30
    assert "no progress for 3 s: a worker seems hung while tokenizing" in err and str(corpus) in err
    assert not (out / "manifest.json").exists()


def test_disk_full_is_a_clear_error_and_publishes_nothing(tmp_path, small_tok, monkeypatch):
    from helixtok.format import shards

    def full(self, arr):
        raise OSError(errno.ENOSPC, "No space left on device", self.tmp)

    monkeypatch.setattr(shards.HashedFile, "write", full)
    c = tmp_path / "c"
    c.mkdir()
    (c / "a.txt").write_text("hello world " * 100)
    r = CliRunner().invoke(main, ["build", str(c), str(tmp_path / "out"), "-t", small_tok, "-L", "4", "-j", "1", "-q"])
    assert r.exit_code == 1
    assert f"{tmp_path / 'out'}: disk full while building" in r.output
    assert "rerun the same command to resume" in r.output
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not glob.glob(str(tmp_path / "out" / "*.bin"))


def test_a_one_process_build_stops_at_a_failed_write_and_leaves_nothing_half_written(tmp_path, small_tok,
                                                                                   monkeypatch):
    """-j 1: a write error in the third unit stops the build there (no later unit is tokenized),
    with the disk-full line; nothing is published and no temp file is left open or behind.
    (Form changed with format 2: this was about the assembly thread behind the tokenizing.)"""
    from helixtok.format import shards

    c = tmp_path / "c"
    c.mkdir()
    for f in range(4):
        (c / f"{f}.jsonl").write_text("".join(json.dumps({"text": f"hello world {i} " * 20}) + "\n" for i in range(300)))
    ran, real_write = [], shards.HashedFile.write

    def write(self, arr):
        if "u000002." in self.tmp:
            raise OSError(errno.ENOSPC, "No space left on device", self.tmp)
        real_write(self, arr)

    def run_unit(unit, info, *where):
        ran.append(unit.index)
        return real_run(unit, info, *where)

    real_run = hdisp.run_unit
    monkeypatch.setattr(shards.HashedFile, "write", write)
    monkeypatch.setattr(hdisp, "run_unit", run_unit)
    out = tmp_path / "out"
    with pytest.raises(HelixtokError, match="disk full while building"):
        build([str(c)], str(out), small_tok, BuildConfig(seq_len=16, workers=1, unit_bytes=4096))
    assert ran == [0, 1, 2]
    assert not (out / "manifest.json").exists() and not glob.glob(str(out / "*.bin"))
    assert not glob.glob(str(out / STATE / ".*.tmp"))


def test_too_many_open_files_is_one_line_with_the_fix(tmp_path, small_corpus, small_tok, monkeypatch):
    from helixtok.pipeline.sources import UnitReader

    def emfile(self):
        raise OSError(errno.EMFILE, "Too many open files", self.unit.files[0])

    monkeypatch.setattr(UnitReader, "_text", emfile)
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(tmp_path / "out"), "-t", small_tok, "-L", "4",
                                  "-j", "1", "-q"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert (f"too many open files ({small_corpus / 'a.txt'}); raise the limit (ulimit -n 4096) or use fewer "
            "--workers, then rerun the same command to resume") in r.output


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pids, seconds):
    t = time.time()
    while any(_alive(p) for p in pids):
        if time.time() - t > seconds:
            return False
        time.sleep(0.05)
    return True


def test_kill_9_leaves_no_process_behind_and_the_rerun_succeeds_first_time(tmp_path, dev_corpus, tokenizer_path,
                                                                           dev_packed):
    out = tmp_path / "out"
    p = start_cli(dev_corpus, out, tokenizer_path)
    wait_for(str(out / STATE / "u*.done.json"), p)
    kids = _descendants(p.pid)
    assert len(kids) >= 2  # the workers (and the resource tracker)
    p.kill()
    t = time.time()
    p.communicate(timeout=10)  # returns only once no process holds its stdout/stderr: a `| cat` would end
    assert time.time() - t < 2 and _gone_within(kids, 2)
    p = start_cli(dev_corpus, out, tokenizer_path)
    stdout, err = p.communicate()
    assert p.returncode == 0, err
    assert re.search(r"resumed: [1-9][\d,]* of [\d,]+ work units reused from an interrupted run", stdout), stdout
    same_folder(out, dev_packed)


def _journaled_since(out, start: float) -> int:
    n = 0
    for j in glob.glob(str(out / STATE / "u*.done.json")):
        with contextlib.suppress(OSError):  # removed as the build finishes
            n += os.path.getmtime(j) >= start
    return n


def test_stress_random_kills_and_concurrent_builds(tmp_path, dev_corpus, tokenizer_path):
    """8 kill -9 at random moments, each followed by a rerun; then 8 builds at once into one OUT.
    Every other killed build is killed from its first journal entries on (unit shards being
    committed, journal writes, publishing).  Every published dataset equals an uninterrupted
    build; reruns went on from journaled units; no process outlives its build by 2 s."""
    import random

    corpus = dev_corpus / "txt"
    args = ["-L", "128", "-q", "--shard-size", "64KiB", "--unit-size", "64KiB", "--val-fraction", "0.1"]
    def cli(out, *extra):
        return subprocess.Popen([sys.executable, "-m", "helixtok.cli", "build", str(corpus), str(out), "-t",
                                 tokenizer_path, *args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    ref = tmp_path / "ref"
    assert cli(ref, "-j", "2").wait() == 0
    rng = random.Random(9)
    out = tmp_path / "out"
    published = leftovers = journaled = 0
    for cycle in range(6):
        late = cycle % 2 == 1
        start = time.time()
        p = cli(out, "-j", "21"[cycle // 2 % 2])
        deadline = None if late else start + rng.uniform(0.3, 1.2)
        entries = rng.randint(1, 4)  # killed once this run has journaled that many units
        kids = []
        while (deadline is None or time.time() < deadline) and p.poll() is None:
            kids = set(kids) | set(_descendants(p.pid))
            if deadline is None and _journaled_since(out, start) >= entries:
                deadline = time.time() + rng.uniform(0, 0.1)
            time.sleep(0.01)
        p.kill()
        _, err = p.communicate(timeout=30)
        leftovers += not _gone_within(kids, 2)
        assert p.returncode in (0, -9), err
        journaled += bool(glob.glob(str(out / STATE / "u*.done.json")))
        if (out / "manifest.json").exists():  # published (the kill came after the manifest, or none came)
            same_folder(out, ref, ignore=(STATE, ".helixtok-lock"))
            published += 1
            shutil.rmtree(out)
    assert leftovers == 0 and journaled >= 2
    last = cli(out, "-j", "2")
    assert last.wait() == 0, last.communicate()
    same_folder(out, ref)

    out2 = tmp_path / "out2"
    procs = [cli(out2, "-j", "1", *(["--overwrite"] if i % 2 else [])) for i in range(8)]
    codes, errs = [], []
    for p in procs:
        _, e = p.communicate(timeout=120)
        codes.append(p.returncode)
        errs.append(e)
    assert 0 in codes and set(codes) <= {0, 1}, errs
    for c, e in zip(codes, errs):
        if c == 1:
            assert ("another helixtok process (pid" in e or "already holds a finished dataset" in e), e
    same_folder(out2, ref)
    print(f"stress: 8 kill cycles ({published} finished before the kill, {journaled} left journaled units), "
          f"leftover processes {leftovers}; concurrent: {codes.count(0)} of 8 published, {codes.count(1)} refused")


def test_a_pool_that_breaks_while_starting_is_one_line_and_leaves_no_worker(tmp_path, small_corpus, small_tok,
                                                                            monkeypatch):
    """Workers that die before they are ready (here: at once) fail the build with one line, from
    the backend check's wait on them; none is left running.  (Form changed with the pool: it was
    a ProcessPoolExecutor whose submit raised BrokenProcessPool.)"""
    import helixtok.pipeline.pool as hp

    made = []
    real_init = hb.UnitPool.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        made.extend(self.procs)
    monkeypatch.setattr(hp, "_SERVE", "import os\nos._exit(3)\n")
    monkeypatch.setattr(hp, "_FORK_SERVER", "import os\nos._exit(3)\n")  # (form: workers are forked from it)
    monkeypatch.setattr(hb.UnitPool, "__init__", init)
    with pytest.raises(HelixtokError, match="a worker process died while starting") as e:
        build([str(small_corpus)], str(tmp_path / "out"), small_tok, BuildConfig(seq_len=16, workers=2, unit_bytes=1))
    assert made and all(p.poll() is not None for p in made)
    if hp.FORK:  # the process that died is named (issue 47 item 11)
        assert "the fork server (the process that loads the tokenizer and forks the workers) died" in str(e.value)


def test_a_failed_pool_build_leaves_no_traceback_from_the_pool_thread(tmp_path, small_tok, monkeypatch):
    """A build that stops on an error kills its workers; the pool's threads then see them gone
    and fail what was pending, printing nothing (with concurrent.futures the order of the kill and
    the shutdown printed InvalidStateError once in six --strict runs)."""
    import threading

    from helixtok.format.errors import InputError

    c = tmp_path / "c"
    c.mkdir()
    (c / "a.jsonl").write_text('{"text": "the quick brown fox"}\n{bad\n')
    for k in range(30):
        (c / f"b{k:02d}.jsonl").write_text('{"text": "hello world"}\n' * 200)
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda a: errors.append(a.exc_value))
    with pytest.raises(InputError, match=r"a\.jsonl:2 .*malformed json \(strict=True: fix it, or leave strict=True out to skip and count such records\)"):
        build([str(c)], str(tmp_path / "o"), small_tok, BuildConfig(seq_len=8, workers=2, strict=True))
    time.sleep(0.5)  # the pool's threads see the workers' pipes close
    assert errors == []


def test_kill_9_while_a_gz_is_indexed_leaves_no_indexer_behind(tmp_path, dev_docs):
    """The process that builds a large .gz's seek index beside the planner dies with the build."""
    import gzip

    (tmp_path / "big.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n"
                                                                  for t in dev_docs[:200]).encode()))
    code = f"""
import helixtok.pipeline.compressed as hc
import helixtok.pipeline.discover as hd
import helixtok.pipeline.units as hu
import helixtok.format.limits as hl
hl.SPLIT_BYTES = hl.RANGE_MIN_BYTES = 1
hc._GZ_INDEXER = hc._GZ_INDEXER.replace("import indexed_gzip", "import time; time.sleep(60); import indexed_gzip")
files, _ = hd.discover([{str(tmp_path / "big.jsonl.gz")!r}])
hu.plan_units(files, unit_bytes=1 << 16, text_field="text")
"""
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "HELIXTOK_CACHE": str(tmp_path / "cache")})
    deadline, kids = time.time() + 30, []
    while not kids and time.time() < deadline:
        kids = _descendants(p.pid)
        time.sleep(0.05)
    assert kids, "the indexer never started"
    time.sleep(0.5)  # past its start-up: asleep where the index is built
    p.kill()
    p.wait()
    assert _gone_within(kids, 2)


def _workers_of(pid) -> list[int]:
    """The build's tokenizing processes: forked by its fork server, named helixtok-worker (form
    changed with the fork server: they were the build's own children, found by command line)."""
    found = []
    for k in _descendants(pid):
        with contextlib.suppress(OSError):
            if open(f"/proc/{k}/comm").read().strip() == "helixtok-worker":
                found.append(k)
    return found


def test_a_stopped_worker_ends_the_build_within_the_stall_timeout(tmp_path, dev_corpus, tokenizer_path):
    """SIGSTOP of a worker (a stuck network read, a swapped-out process) at random moments: while
    it starts, during the backend check, mid-unit, after the last unit was handed out.  Every
    build ends within --stall-timeout + 5 s, with the dataset or one line naming what the worker
    was doing (it used to wait for ever in the pool's shutdown or the check's Future.result).
    Two at a time: most of each is the wait for the stall timeout."""
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor

    stall = 2
    one_cli = threading.Lock()  # CliRunner swaps sys.stdout for the whole process

    def trial(i: int) -> int:
        rng = random.Random(i)
        out = tmp_path / f"o{i}"
        # tokenizers itself (--backend hf: slow enough that most stops land while there is work)
        # every other run; the backend check's tasks the others.
        p = subprocess.Popen([sys.executable, "-m", "helixtok.cli", "build", str(dev_corpus / "txt"), str(out), "-t",
                              tokenizer_path, "-L", "64", "-j", "2", "-q", "--unit-size", "64KiB", "--stall-timeout",
                              str(stall), *(["--backend", "hf"] if i % 2 else [])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        victim, deadline = None, time.monotonic() + rng.uniform(0.1, 1.2) if i else 0  # the first: at once
        while victim is None and p.poll() is None:
            ws = _workers_of(p.pid)
            if ws and time.monotonic() >= deadline:
                victim = rng.choice(ws)
                os.kill(victim, signal.SIGSTOP)
            time.sleep(0.01)
        t = time.monotonic()
        try:
            _, err = p.communicate(timeout=stall + 5)
        finally:
            if victim:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
            p.kill()
        assert time.monotonic() - t <= stall + 5
        if p.returncode == 0:
            with one_cli:
                assert err == "" and CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
        else:
            assert p.returncode == 1 and len(err.splitlines()) == 1, err
            assert f"no progress for {stall} s: a worker seems hung while " in err, err
            assert not (out / "manifest.json").exists()
        return p.returncode

    with ThreadPoolExecutor(2) as ex:
        outcomes = list(ex.map(trial, range(6)))
    assert 1 in outcomes  # the stop caught a worker at work at least once (the first: while it started)


def test_ctrl_c_at_any_moment_is_one_line(tmp_path, small_corpus, small_tok):
    """Ctrl-C (SIGINT to the whole foreground group, as a terminal sends it) at random moments,
    the workers' start-up included: exit 130 with one line, or a finished build; never a
    worker's KeyboardInterrupt traceback (3 of 20 tries printed 40-58 lines).  Two at a time."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(1)
    delays = [rng.uniform(0.2, 1.5) for _ in range(12)]  # after the interpreter's own start-up

    def trial(i: int):
        out = tmp_path / f"o{i}"
        p = subprocess.Popen([sys.executable, "-m", "helixtok.cli", "build", str(small_corpus), str(out), "-t", small_tok,
                              "-L", "16", "-j", "2", "-q", "--unit-size", "8KiB"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        time.sleep(delays[i])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
        return out, p.returncode, err

    with ThreadPoolExecutor(2) as pool:
        for out, code, err in pool.map(trial, range(12)):
            if code == -signal.SIGINT and err == "\ninterrupted; rerun the same command to resume\n":
                # Seen rarely for a Ctrl-C within ~0.25 s of the start (before this session's change
                # too): the one line, then the interpreter ends itself by SIGINT instead of exit 130.
                # A shell reports 130 for both; the cause (strace: Python kills itself with SIGINT,
                # as for a KeyboardInterrupt that reached the top) is not found yet.
                continue
            if code == 130 and err == "\ninterrupted before anything started\n":
                # On a loaded machine the signal can land while Python still imports the command
                # line (cli/entry.py): nothing was started, nothing written; the documented line.
                assert not out.exists()
                continue
            if code in (0, -signal.SIGINT):
                # Finished; or finished and then ended by the signal while the interpreter shut down
                # (Python restores the default handler then): the dataset is whole either way.
                assert err == "" and CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
            else:
                # (the newline first ends the terminal's "^C" line)
                assert code == 130 and err == "\ninterrupted; rerun the same command to resume\n", err


def test_no_resource_tracker_so_killing_processes_prints_nothing(tmp_path, dev_corpus, tokenizer_path):
    """The pool uses no named semaphores: no multiprocessing resource tracker is started, so kill -9
    of "the python processes" prints no KeyError tracebacks and no "leaked semaphore" warning."""
    out = tmp_path / "out"
    p = start_cli(dev_corpus, out, tokenizer_path, "--backend", "hf")
    wait_for(str(out / STATE / "plan.json"), p)  # units are being tokenized
    kids = _descendants(p.pid)
    cmdlines = []
    for k in kids:
        with contextlib.suppress(OSError):
            cmdlines.append(open(f"/proc/{k}/cmdline").read())
    assert cmdlines and not any("resource_tracker" in c for c in cmdlines), cmdlines
    p.kill()
    _, err = p.communicate(timeout=10)
    assert err == "" and _gone_within(kids, 2)


@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGHUP, True), (signal.SIGTERM, True)])
def test_sigterm_and_sighup_stop_like_ctrl_c_and_the_rerun_resumes(tmp_path, dev_corpus, tokenizer_path, dev_packed,
                                                                   sig, group):
    """kill (SIGTERM), a closed terminal (SIGHUP), and either sent to the whole process group
    (scancel, docker stop) end the build cleanly, resumably, with one line and exit 128 + signum
    (they used to end it with Python's default: no message, exit -15; a worker took them too)."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "helixtok.cli", "build", str(dev_corpus), str(out), "-t",
                          tokenizer_path, "-L", "512", "-j", "2", "-q", "--shard-size", "1MiB", "--unit-size", "512KiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(str(out / STATE / "plan.json"), p)  # units are being tokenized
    os.killpg(p.pid, sig) if group else p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, err
    assert err == f"\ninterrupted ({signal.Signals(sig).name}); rerun the same command to resume\n"
    assert not (out / "manifest.json").exists()
    p = start_cli(dev_corpus, out, tokenizer_path)
    assert p.wait() == 0
    same_folder(out, dev_packed)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_a_build_started_with_a_signal_ignored_keeps_ignoring_it(tmp_path, dev_corpus, tokenizer_path, sig):
    """nohup (SIGHUP), a script's background job (SIGINT): ignored when the build started, they
    stay ignored while it tokenizes (SIGINT used to be obeyed from then on)."""
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "helixtok.cli", "build", str(dev_corpus / "txt"), str(out), "-t",
                          tokenizer_path, "-L", "16", "-j", "2", "-q", "--unit-size", "64KiB", "--backend", "hf"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(sig, signal.SIG_IGN))
    wait_for(str(out / STATE / "u*.done.json"), p)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0 and err == "" and (out / "manifest.json").exists()


def test_file_size_limit_and_open_files_and_a_dangling_out_are_one_line_with_the_fix(tmp_path, small_corpus,
                                                                                   small_tok, monkeypatch):
    import resource

    out = tmp_path / "out"
    args = [sys.executable, "-m", "helixtok.cli", "build", str(small_corpus), str(out), "-t", small_tok, "-L", "16",
            "-j", "1", "-q", "--shard-size", "1MiB"]
    p = subprocess.run(args, capture_output=True, text=True,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)))
    assert p.returncode == 1 and p.stderr.splitlines() == [
        f"Error: {out}: larger than this process may write (ulimit -f); raise the limit (ulimit -f unlimited) or "
        "use a smaller --shard-size, then rerun the same command to resume"], p.stderr
    assert subprocess.run(args, capture_output=True).returncode == 0  # the limit lifted: it resumes
    # Too many open files met before the build's own handler (listing the corpus): the same line.
    import helixtok.pipeline.builder as hbuild

    def emfile(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files", str(small_corpus / "c.txt"))
    monkeypatch.setattr(hbuild, "discover", emfile)
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(tmp_path / "o2"), "-t", small_tok, "-q"])
    assert r.exit_code == 1 and r.output == (f"Error: too many open files ({small_corpus / 'c.txt'}); raise the "
                                             "limit (ulimit -n 4096) or use fewer --workers, then rerun the same "
                                             "command to resume\n")
    monkeypatch.undo()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(tmp_path / "dangling"), "-t", small_tok, "-q"])
    assert r.exit_code == 1 and "a symbolic link to" in r.output and "which does not exist" in r.output, r.output


def test_a_stopped_helper_process_fails_its_phase_within_the_stall_timeout(tmp_path, dev_docs, small_corpus,
                                                                          small_tok, monkeypatch):
    """The processes a build waits on besides its workers — the .gz seek indexer while planning,
    the one-process check's long-input helper — are waited for while they compute: stopped, one
    line within --stall-timeout (they used to be waited for without any bound)."""
    import gzip

    import helixtok.pipeline.backends as hbk
    import helixtok.pipeline.compressed as hc
    from helixtok.pipeline.discover import discover
    from helixtok.pipeline.units import plan_units

    stop_self = "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\n"
    monkeypatch.setenv("HELIXTOK_CACHE", str(tmp_path / "cache"))
    (tmp_path / "big.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n"
                                                                  for t in dev_docs[:200]).encode()))
    monkeypatch.setattr(limits, "SPLIT_BYTES", 1)
    monkeypatch.setattr(limits, "RANGE_MIN_BYTES", 1)
    monkeypatch.setattr(hc, "_GZ_INDEXER", stop_self + hc._GZ_INDEXER)
    files, _ = discover([str(tmp_path / "big.jsonl.gz")])
    t = time.monotonic()
    with pytest.raises(HelixtokError, match=r"no progress for 1 s from the process indexing .*big\.jsonl\.gz"):
        plan_units(files, unit_bytes=1 << 16, text_field="text", stall=1)
    assert time.monotonic() - t < 6
    monkeypatch.setattr(hbk, "_LONG_CHILD", stop_self + hbk._LONG_CHILD)
    t = time.monotonic()
    with pytest.raises(HelixtokError, match="no progress for 1 s from the process checking fastokens on the long"):
        build([str(small_corpus)], str(tmp_path / "o"), small_tok,
              BuildConfig(seq_len=16, workers=1, backend="fastokens", stall_seconds=1))
    assert time.monotonic() - t < 10


@pytest.mark.parametrize("workers", [1, 2])
def test_a_tokenizer_replaced_while_the_build_runs_changes_nothing_the_build_writes(
        tmp_path, small_corpus, small_tok, tokenizer_path, monkeypatch, workers):
    """The tokenizer file is read once, at the start; the backend check, every worker (forked from
    the fork server or not) and OUT's copy use those bytes.  Replaced the moment the build has
    inspected it -- while the workers start, the check runs and units tokenize -- the file's new
    content changes nothing: the same shards, OUT/tokenizer.json the bytes read, and one note
    saying the path now holds another file.  (Issue 39: shards held the other tokenizer's ids
    while the manifest named the first, exit 0.)"""
    cfg = BuildConfig(seq_len=16, workers=workers, unit_bytes=1)
    ref = tmp_path / "ref"
    build([str(small_corpus)], str(ref), small_tok, cfg)
    tok = tmp_path / "tok.json"
    shutil.copyfile(small_tok, tok)
    real = hb.inspect_tokenizer

    def replaced_after_inspection(*a, **k):
        info = real(*a, **k)
        shutil.copyfile(tokenizer_path, tok)  # another tokenizer (another vocabulary) at the path from now on
        return info
    monkeypatch.setattr(hb, "inspect_tokenizer", replaced_after_inspection)
    out = tmp_path / "out"
    m = build([str(small_corpus)], str(out), str(tok), cfg)
    shards = sorted(n for n in os.listdir(ref) if n.endswith((".bin", ".docs")))
    assert shards and sorted(n for n in os.listdir(out) if n.endswith((".bin", ".docs"))) == shards
    assert all((out / n).read_bytes() == (ref / n).read_bytes() for n in shards)
    assert (out / "tokenizer.json").read_bytes() == open(small_tok, "rb").read()
    assert m["tokenizer"] == json.loads((ref / "manifest.json").read_text())["tokenizer"]
    assert len(m.notes) == 1 and m.notes[0].startswith(f"{tok} changed while the build ran")


@pytest.mark.parametrize("packing", ["packed", "bestfit"])
@pytest.mark.parametrize("damage", ["zeros", "another unit's bytes", "docs offsets + 1"])
def test_a_resumed_build_rehashes_the_shards_it_trusts_and_redoes_a_damaged_unit(
        tmp_path, small_corpus, small_tok, monkeypatch, damage, packing):
    """A journaled unit is trusted only if its files hold the sha256 its worker recorded while
    writing them: a shard replaced by other bytes of the same size before the rerun is not
    published; that unit is tokenized again and the dataset is the uninterrupted build's.
    (Issue 39: the sizes alone were checked, and such a build published the damage, exit 0.)"""
    import numpy as np

    cfg = BuildConfig(seq_len=16, workers=1, unit_bytes=1, packing=packing)
    ref = tmp_path / "ref"
    build([str(small_corpus)], str(ref), small_tok, cfg)

    def stop(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(hb, "publish", stop)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        build([str(small_corpus)], str(out), small_tok, cfg)
    monkeypatch.undo()
    state = out / STATE
    # (Format 4: a placed unit's ids are its segment of its group's shard; they were its own .bin.)
    path, off, n = unit_ids(str(out), 2)
    data = bytearray(open(path, "rb").read())
    if damage == "zeros":
        data[off: off + n] = bytes(n)
    elif damage == "another unit's bytes":
        o_path, o_off, o_n = next(x for x in map(lambda i: unit_ids(str(out), i), range(7)) if x[2] != n)
        other = open(o_path, "rb").read()[o_off: o_off + o_n]
        data[off: off + n] = (other * 64)[:n]
    else:
        path = sorted(state.glob("u*.train.*.docs"))[2]
        offsets = np.fromfile(path, dtype="<u8")
        data = (offsets + 1).astype("<u8").tobytes()
    assert n > 0 and len(data) == os.path.getsize(path)
    open(path, "wb").write(data)
    m = build([str(small_corpus)], str(out), small_tok, cfg)
    assert (m.reused_units, m.units) == (6, 7)
    for n in sorted(os.listdir(ref)):
        assert (out / n).read_bytes() == (ref / n).read_bytes(), n


def test_stress_a_tokenizer_replaced_at_random_moments_never_gives_a_wrong_dataset(
        tmp_path, small_corpus, small_tok, tokenizer_path):
    """Ten builds (-j 2, 7 units; three at a time, in threads of one program) while another thread
    replaces the tokenizer file at a random moment and puts another back at another: each dataset
    is exactly the build of the tokenizer its manifest names (the one its single read found), and
    OUT's copy is that tokenizer."""
    import hashlib
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor

    cfg = BuildConfig(seq_len=16, workers=2, unit_bytes=1)
    refs = {}
    for name, src in (("a", small_tok), ("b", tokenizer_path)):
        build([str(small_corpus)], str(tmp_path / f"ref-{name}"), src, cfg)
        refs[hashlib.sha256(open(src, "rb").read()).hexdigest()] = tmp_path / f"ref-{name}"
    rng = random.Random(39)
    delays = [(rng.uniform(0, 0.4), rng.uniform(0, 0.4)) for _ in range(10)]

    def trial(k: int) -> str:
        tok = tmp_path / f"tok{k}.json"
        # One trial in three finds the replacement already there; the others see it land meanwhile.
        shutil.copyfile(tokenizer_path if k % 3 == 0 else small_tok, tok)

        def swapper():
            time.sleep(delays[k][0])
            shutil.copyfile(tokenizer_path if k % 3 else small_tok, str(tok) + ".new")
            os.replace(str(tok) + ".new", tok)
            time.sleep(delays[k][1])
            shutil.copyfile(small_tok, str(tok) + ".new")
            os.replace(str(tok) + ".new", tok)
        t = threading.Thread(target=swapper)
        t.start()
        out = tmp_path / f"o{k}"
        m = build([str(small_corpus)], str(out), str(tok), cfg)
        t.join()
        ref = refs[m["tokenizer"]["sha256"]]
        shards = sorted(n for n in os.listdir(ref) if n.endswith((".bin", ".docs")))
        assert sorted(n for n in os.listdir(out) if n.endswith((".bin", ".docs"))) == shards
        assert all((out / n).read_bytes() == (ref / n).read_bytes() for n in shards), (k, ref)
        assert hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == m["tokenizer"]["sha256"]
        return ref.name

    with ThreadPoolExecutor(3) as ex:
        seen = list(ex.map(trial, range(10)))
    print(f"stress: 10 builds with the tokenizer replaced at random moments, each its manifest's tokenizer's "
          f"dataset ({seen.count('ref-a')} built with the first tokenizer, {seen.count('ref-b')} with the other)")


def test_a_unit_file_changed_before_its_join_stops_the_build_and_the_rerun_is_right(tmp_path, small_corpus, small_tok,
                                                                                     monkeypatch):
    """Placing copies a unit's output into its group's shard: a file that no longer hashes to what
    its unit recorded (changed in STATE between the two) stops the build in one line, never a
    dataset of its bytes; the same command then tokenizes that unit again and gives the build
    an undisturbed run gives.  (Form: the join's GroupWriter.append became join.place_unit, which
    places the units that wrote their ids to a file: none is held in memory here.)"""
    from helixtok.format.errors import HelixtokError

    monkeypatch.setattr(limits, "HOLD_BYTES", 0)

    cfg = BuildConfig(seq_len=16, workers=1, unit_bytes=1, shard_bytes=1 << 20)
    clean = build([str(small_corpus)], str(tmp_path / "clean"), small_tok, cfg)
    real = hdisp.place_unit
    hit = []

    def tampered(r, *a, **kw):  # the last unit's: those before it are placed by then
        if not hit and r["index"] == clean.units - 1:
            e = r["shards"]["train"][0]
            p = os.path.join(str(tmp_path / "out" / STATE), e["state"])
            data = bytearray(open(p, "rb").read())
            data[3] ^= 1
            open(p, "wb").write(bytes(data))
            hit.append(e["state"])
        return real(r, *a, **kw)

    monkeypatch.setattr(hdisp, "place_unit", tampered)
    with pytest.raises(HelixtokError, match=r"changed since its work unit wrote it \(sha256 differs\); rerun the same"):
        build([str(small_corpus)], str(tmp_path / "out"), small_tok, cfg)
    assert hit and not os.path.exists(tmp_path / "out" / "manifest.json")
    monkeypatch.setattr(hdisp, "place_unit", real)
    again = build([str(small_corpus)], str(tmp_path / "out"), small_tok, cfg)
    assert again.reused_units == again.units - 1  # the tampered unit was tokenized again
    assert again["splits"] == clean["splits"]


def test_a_build_needs_about_the_datasets_size_on_disk(tmp_path, dev_corpus, tokenizer_path):
    """Each unit's ids are deleted from STATE once placed in its group's shard, so a build fits in
    a disk of 1.15x the dataset plus one unit's ids (the join that copied them needed twice the
    dataset): built into a tmpfs of that size, it gives the very files of an unlimited build."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    ref = tmp_path / "ref"
    cfg = BuildConfig(seq_len=512, workers=2, unit_bytes=UNIT)  # one shard group, several units in it
    build([str(dev_corpus)], str(ref), tokenizer_path, cfg)
    m = json.loads((ref / "manifest.json").read_text())
    [shard] = m["splits"]["train"]["shards"]
    assert len(shard["segments"]) > 4
    size = sum(f.stat().st_size for f in ref.iterdir() if f.is_file())
    limit = int(1.15 * size) + max(n for n, _ in shard["segments"])
    assert limit < 1.5 * size
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        build([str(dev_corpus)], str(disk / "out"), tokenizer_path, cfg)
        same_folder(disk / "out", ref)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_units_placed_as_they_end_write_their_ids_once(tmp_path, dev_corpus, tokenizer_path, dev_packed,
                                                       monkeypatch):
    """Without workers every unit's offset is known as it ends: its ids go from memory straight to
    their place in the group's shard, never into a file of their own; the dataset is the pool's."""
    import helixtok.format.shards as hs

    spilled, real = [], hs.HeldIds.spill
    monkeypatch.setattr(hs.HeldIds, "spill", lambda self: spilled.append(self.final) or real(self))
    opened, real_open = [], hs.HashedFile.__init__
    monkeypatch.setattr(hs.HashedFile, "__init__", lambda self, final, *a: opened.append(final) or real_open(
        self, final, *a))
    out = str(tmp_path / "out")
    build([str(dev_corpus)], out, tokenizer_path, BuildConfig(seq_len=512, workers=1, shard_bytes=1 << 20,
                                                              unit_bytes=UNIT))
    assert spilled == [] and opened and not [f for f in opened if f.endswith(".bin")]
    same_folder(out, dev_packed)


@pytest.mark.parametrize("packing", ["packed", "document", "bestfit"])
def test_units_too_large_to_hold_are_written_then_placed(tmp_path, dev_corpus, tokenizer_path, monkeypatch, packing):
    """A unit whose ids pass the memory it may hold writes them to its own file and is placed from
    there (checked against its sha256 as it is copied), its file then deleted: the same dataset."""

    cfg = BuildConfig(seq_len=512, workers=1, shard_bytes=1 << 20, unit_bytes=UNIT, packing=packing,
                      val_fraction=0.1)
    ref = str(tmp_path / "ref")
    build([str(dev_corpus)], ref, tokenizer_path, cfg)
    monkeypatch.setattr(limits, "HOLD_BYTES", 1000)
    placed, real = [], hdisp.place_unit
    monkeypatch.setattr(hdisp, "place_unit", lambda r, *a, **kw: placed.append(r["index"]) or real(r, *a, **kw))
    out = str(tmp_path / "out")
    m = build([str(dev_corpus)], out, tokenizer_path, cfg)
    assert sorted(placed) == list(range(m["inputs"]["units"]))
    same_folder(out, ref)


@pytest.mark.parametrize("damage", ["placed elsewhere", "sizes of its entry"])
def test_a_placement_that_disagrees_with_the_units_before_it_is_refused_then_redone(
        tmp_path, dev_corpus, tokenizer_path, monkeypatch, damage):
    """A unit's placement records where its process put its ids (from the journal entries of the
    units before it): one that disagrees with the build's own count (a damaged journal) stops the
    build in one line, never a dataset; the same command then tokenizes that unit again."""
    cfg = BuildConfig(**{**SMALL_SHARDS, "shard_bytes": 1 << 30})  # one group: offsets matter
    ref = str(tmp_path / "ref")
    build([str(dev_corpus)], ref, tokenizer_path, cfg)
    out = str(tmp_path / "out")
    ran = _stopped_after(4, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        build([str(dev_corpus)], out, tokenizer_path, cfg)
    state = os.path.join(out, STATE)
    if damage == "placed elsewhere":
        path = os.path.join(state, "u000002.placed.json")
        p = json.load(open(path))
        p["at"]["train"] += 1
    else:
        path = os.path.join(state, "u000002.done.json")
        p = json.load(open(path))
        p["shards"]["train"][0]["num_tokens"] += 1
    del p["entry_sha256"]
    write_entry(path, p)  # damaged before its digest was taken: a worker's bad read, not a bad disk
    with pytest.raises(HelixtokError, match=r"work unit 2: its journal entry or placement in shard 0 disagrees with "
                                            r"the units before it \(damaged\); rerun the same command"):
        build([str(dev_corpus)], out, tokenizer_path, cfg)
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    ran.clear()
    build([str(dev_corpus)], out, tokenizer_path, cfg)
    assert ran[0] == 2 and not set(ran) & {0, 1, 3}
    same_folder(out, ref)


@pytest.mark.parametrize("packing", ["packed", "document", "bestfit"])
def test_the_builds_own_process_never_reads_or_writes_a_token(tmp_path, dev_corpus, tokenizer_path, dev_packed,
                                                              monkeypatch, packing):
    """With workers, every id is read, hashed and written by them (tokenized, placed, its group
    closed): the build's own process opens no unit's or shard's .bin at all -- it only moves them
    into OUT -- so its CPU does not grow with the corpus (issue 46)."""
    import builtins

    opened = []
    real_open, real_os_open = builtins.open, os.open

    def watch(path, *a, **kw):
        if str(path).endswith(".bin"):
            opened.append(str(path))
        return real_open(path, *a, **kw)

    def watch_os(path, *a, **kw):
        if str(path).endswith(".bin"):
            opened.append(str(path))
        return real_os_open(path, *a, **kw)
    monkeypatch.setattr(builtins, "open", watch)
    monkeypatch.setattr(os, "open", watch_os)
    out = str(tmp_path / "out")
    m = build([str(dev_corpus)], out, tokenizer_path, BuildConfig(seq_len=512, workers=2, shard_bytes=1 << 20,
                                                                  unit_bytes=UNIT, packing=packing))
    monkeypatch.undo()
    assert m["inputs"]["units"] > 4 and opened == []
    if packing == "packed":
        same_folder(out, dev_packed)
