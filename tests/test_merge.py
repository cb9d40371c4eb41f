"""Partitioned builds and merge: any partitioning gives the single build's bytes and counts; merge reads manifests only."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from helixtok import MemmapChunkDataset
from helixtok.cli import main
from helixtok.format.errors import ConfigError, DatasetError
from helixtok.format.manifest import write_json_atomic
from helixtok.pipeline.builder import build
from helixtok.pipeline.config import BuildConfig
from helixtok.pipeline.merge import merge, task_from_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import on_a_pool
from helixtok.inspect.verify import verify


def rows(out, split="train"):
    m = json.load(open(os.path.join(out, "manifest.json")))
    if m["packing"] == "bestfit":  # format 3: chunks gathered by the split's index
        from helixtok.read.splitview import SplitView

        view = SplitView(out, m, split)
        return m, np.stack([view.chunk(i) for i in range(view.num_chunks)])
    n = m["splits"][split]["num_tokens"]  # format 2: a packed stream's last partial chunk is on disk too
    return m, np.concatenate([np.fromfile(os.path.join(out, s["path"]), dtype="<u2")
                              for s in m["splits"][split]["shards"]])[:n].reshape(-1, m["seq_len"])


@pytest.fixture(scope="module")
def txt_corpus(dev_corpus):
    return str(dev_corpus / "txt")


@pytest.mark.parametrize("packing", ["packed", "document", "bestfit"])
def test_three_tasks_merged_equal_a_single_build(tmp_path, txt_corpus, tokenizer_path, packing):
    cfg = BuildConfig(seq_len=256, workers=1, packing=packing, unit_bytes=256 << 10, shard_bytes=1 << 20)
    single = str(tmp_path / "single")
    ms = build([txt_corpus], single, tokenizer_path, cfg)
    root = tmp_path / "parts"
    parts = []
    for k in range(3):
        p = str(root / f"part-{k:05d}")
        build([txt_corpus], p, tokenizer_path, cfg, task=(k, 3))
        parts.append(p)
    mm = merge(list(reversed(parts)), str(root))  # order given does not matter: task order is used
    assert mm["merged_from"] == ["part-00000", "part-00001", "part-00002"]
    # Each document's source is the single build's (the parts hold the whole plan; unit_documents run over all).
    from helixtok.inspect.show import document_source

    n = ms["totals"]["documents"]
    for d in (0, n // 2, n - 1):
        assert document_source(str(root), mm, "train", d) == document_source(single, ms, "train", d)
    assert document_source(str(root), mm, "train", n - 1, txt_corpus).startswith(os.path.basename(
        sorted(os.listdir(txt_corpus))[-1]))
    assert verify(str(root)).ok
    ds = MemmapChunkDataset(str(root))
    assert len(ds) == mm["splits"]["train"]["num_chunks"]
    _, single_rows = rows(single)
    _, merged_rows = rows(str(root))
    t1, t2 = ms["totals"], mm["totals"]
    assert t1["documents"] == t2["documents"] and t1["tokens"] == t2["tokens"]
    assert mm["inputs"]["files"] == ms["inputs"]["files"]
    # Every unit's output is final where it was written, and packed chunks are cut over the
    # merged stream: the merged dataset is the single one, row for row, in every packing (before
    # format 2 each packed task dropped its own remainder).
    assert np.array_equal(single_rows, merged_rows)
    assert t1 == t2 and ms["splits"] == {k: {**v, "shards": [{**e, "path": e["path"].split("/")[-1],
                                                              **{x: {**e[x], "path": e[x]["path"].split("/")[-1]}
                                                                 for x in ("docs", "valid", "src") if x in e}}
                                                             for e in v["shards"]]}
                                         for k, v in mm["splits"].items()}
    if packing == "packed":
        assert mm["splits"]["train"]["dropped_tokens"] < 256


def test_merge_refuses_mismatched_or_missing_parts(tmp_path, txt_corpus, tokenizer_path, small_tok):
    cfg = BuildConfig(seq_len=256, workers=1, unit_bytes=1 << 20)
    a, b, c = (str(tmp_path / x) for x in "abc")
    build([txt_corpus], a, tokenizer_path, cfg, task=(0, 2))
    with pytest.raises(DatasetError, match=r"missing task\(s\) \[1\]"):
        merge([a], str(tmp_path / "m"))
    build([txt_corpus], b, tokenizer_path, BuildConfig(seq_len=128, workers=1, unit_bytes=1 << 20), task=(1, 2))
    with pytest.raises(DatasetError, match="seq_len is 128"):
        merge([a, b], str(tmp_path / "m"))
    build([txt_corpus], c, small_tok, cfg, task=(1, 2))
    with pytest.raises(DatasetError, match="parts must share the tokenizer"):
        merge([a, c], str(tmp_path / "m"))


def test_task_index_from_scheduler_env():
    assert task_from_env(4, None, {"SLURM_ARRAY_TASK_ID": "2"}) == (2, 4)
    assert task_from_env(4, None, {"JOB_COMPLETION_INDEX": "3"}) == (3, 4)
    assert task_from_env(4, 1, {"SLURM_ARRAY_TASK_ID": "2"}) == (1, 4)
    assert task_from_env(None, None, {"SLURM_ARRAY_TASK_ID": "2"}) is None  # never partition by surprise
    with pytest.raises(ConfigError, match="outside"):
        task_from_env(4, None, {"SLURM_ARRAY_TASK_ID": "4"})
    with pytest.raises(ConfigError, match="neither"):
        task_from_env(4, None, {})


def test_cli_partitioned_build_and_merge(tmp_path, txt_corpus, small_tok, monkeypatch):
    out = tmp_path / "out"
    for k in range(2):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", str(k))
        r = CliRunner().invoke(main, ["build", txt_corpus, str(out), "-t", small_tok, "-L", "64", "-j", "1", "-q",
                                      "--num-tasks", "2"])
        assert r.exit_code == 0, r.output
    assert sorted(os.listdir(out)) == ["part-00000", "part-00001"]
    r = CliRunner().invoke(main, ["merge", str(out / "part-00000"), str(out / "part-00001"), str(out), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["totals"]["documents"] == len(os.listdir(txt_corpus))
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_parts_planned_from_different_corpora_are_refused(tmp_path, small_corpus, small_tok):
    """A file that lands between two tasks of an array job shifts the unit ranges: the later task
    refuses to start beside a finished part planned otherwise, and merge refuses such parts, each
    naming the input (it used to merge overlapping parts with exit 0 and verify passing)."""
    c, out = tmp_path / "c", tmp_path / "out"
    shutil.copytree(small_corpus, c)
    base = ["-t", small_tok, "-L", "16", "-j", "1", "-q", "--unit-size", "8KiB", "--num-tasks", "2"]
    assert cli("build", c, out, *base, "--task-index", "0").exit_code == 0
    (c / "0_new").mkdir()
    (c / "0_new" / "late.txt").write_text("word " * 5000)
    r = cli("build", c, out, *base, "--task-index", "1")
    assert r.exit_code == 1 and "new input 0_new/late.txt" in r.output and "part-00000" in r.output, r.output
    assert not (out / "part-00001").exists()
    # Built elsewhere (the check looks beside the task's own folder), it reaches merge: refused there.
    assert cli("build", c, tmp_path / "elsewhere", *base, "--task-index", "1").exit_code == 0
    r = cli("merge", out / "part-00000", tmp_path / "elsewhere" / "part-00001", tmp_path / "m")
    assert r.exit_code == 1 and "new input 0_new/late.txt" in r.output, r.output
    assert not (tmp_path / "m" / "manifest.json").exists()
    # The same corpus for both: merged, and equal to the single build's documents.
    shutil.rmtree(c / "0_new")
    assert cli("build", c, out, *base, "--task-index", "1").exit_code == 0
    r = cli("merge", out / "part-00000", out / "part-00001", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["totals"]["documents"] == 7


@pytest.mark.parametrize("extra, field", [(["--bos", "--bos-token", "<pad>"], "add_bos"), (["--eos-token", "o"], "eos_id"),
                                          (["--special-tokens", "extract"], "special_tokens_in_text")])
def test_merge_refuses_parts_built_with_other_tokenizer_options(tmp_path, small_corpus, small_tok, extra, field):
    """merge compares every resolved choice that changes bytes (it used to compare only the
    tokenizer's sha256 and state part 0's add_bos / eos_id / policy for all parts)."""
    base = ["-t", small_tok, "-L", "16", "-j", "1", "-q", "--unit-size", "8KiB", "--num-tasks", "2"]
    assert cli("build", small_corpus, tmp_path / "a", *base, "--task-index", "0").exit_code == 0
    r = cli("build", small_corpus, tmp_path / "b", *base, "--task-index", "1", *extra)
    assert r.exit_code == 0, r.output
    r = cli("merge", tmp_path / "a" / "part-00000", tmp_path / "b" / "part-00001", tmp_path / "m")
    assert r.exit_code == 1 and f"tokenizer {field} is" in r.output and "same options" in r.output, r.output


def test_merge_follows_builds_ownership_rules(tmp_path, small_corpus, small_tok):
    """merge never writes over a file it did not write; --overwrite removes what the previous
    dataset listed, whichever command wrote it, and a later build --overwrite takes the merged folder."""
    out = tmp_path / "out"
    base = ["-t", small_tok, "-L", "16", "-j", "1", "-q", "--unit-size", "8KiB"]
    for k in range(2):
        assert cli("build", small_corpus, out, *base, "--num-tasks", 2, "--task-index", k).exit_code == 0
    parts = [out / "part-00000", out / "part-00001"]
    (out / "tokenizer.json").write_text("the user's own")
    r = cli("merge", *parts, out)
    assert r.exit_code == 1 and "'tokenizer.json'" in r.output and "did not write" in r.output, r.output
    assert (out / "tokenizer.json").read_text() == "the user's own"
    r = cli("merge", *parts, out, "--overwrite")
    assert r.exit_code == 1 and (out / "tokenizer.json").read_text() == "the user's own"
    (out / "tokenizer.json").unlink()
    assert cli("merge", *parts, out).exit_code == 0
    assert cli("verify", out).exit_code == 0
    # A single build over the merged folder: the parts it listed go with it, nothing is called foreign.
    r = cli("build", small_corpus, out, *base, "--overwrite")
    assert r.exit_code == 0, r.output
    single = sorted(os.listdir(out))
    assert "part-00000" not in single and cli("verify", out).exit_code == 0
    # merge --overwrite over that single build: its shards are removed, not left unreferenced.
    for k in range(2):
        assert cli("build", small_corpus, tmp_path / "p", *base, "--num-tasks", 2, "--task-index", k).exit_code == 0
    r = cli("merge", tmp_path / "p" / "part-00000", tmp_path / "p" / "part-00001", out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(out)) == ["manifest.json", "tokenizer.json"]
    r = cli("build", small_corpus, out, *base, "--overwrite")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(out)) == single


def test_merge_refuses_a_part_without_a_plan(tmp_path, small_corpus, small_tok):
    base = ["-t", small_tok, "-L", "16", "-j", "1", "-q", "--unit-size", "8KiB", "--num-tasks", "2"]
    out = tmp_path / "out"
    for k in range(2):
        assert cli("build", small_corpus, out, *base, "--task-index", k).exit_code == 0
    (out / "part-00001" / "build-plan.json").unlink()  # as an older helixtok left it
    r = cli("merge", out / "part-00000", out / "part-00001", out)
    assert r.exit_code == 1 and "records no plan" in r.output, r.output


def _relative(m: dict) -> dict:
    """A manifest's splits with every shard named as in its own folder (a merge names part-NNNNN/…)."""
    def base(e):
        return {**e, "path": os.path.basename(e["path"]),
                **{x: {**e[x], "path": os.path.basename(e[x]["path"])} for x in ("docs", "valid", "src") if x in e}}
    return {k: {**v, "shards": [base(e) for e in v["shards"]]} for k, v in m["splits"].items()}


_singles: dict = {}


@pytest.fixture(scope="module")
def mixed_small(tmp_path_factory, dev_corpus):
    """~100 KB of the test corpus in 13 files of three formats: a dozen work units at 8 KiB."""
    c = tmp_path_factory.mktemp("mixed")
    for i, src in enumerate(sorted((dev_corpus / "txt").glob("*.txt"))[:12]):
        (c / f"{i:02d}.txt").write_text(src.read_text()[:8000])
    with open(c / "rows.jsonl", "w") as fh:
        for i in range(200):
            fh.write(json.dumps({"text": f"row {i} " + "some words " * (i % 37)}) + "\n")
    return str(c)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 4), workers=st.sampled_from([1, 2]), packing=st.sampled_from(["packed", "document", "bestfit"]),
       val=st.sampled_from([0.0, 0.3]), shard=st.sampled_from([1 << 10, 1 << 20]))
def test_any_partitioning_merged_is_the_single_build(tmp_path_factory, mixed_small, tokenizer_path, n, workers, packing,
                                                     val, shard):
    """N tasks (each on -j 1 or a pool of 2) merged: every split's stream, chunks, sidecars and
    counts, the totals, the sources and the documents per unit are the single build's; every
    shard file is byte for byte the single build's file of that name; the datasets read alike."""
    corpus = mixed_small
    cfg = BuildConfig(seq_len=64, workers=workers, packing=packing, val_fraction=val, unit_bytes=8 << 10,
                      shard_bytes=shard)
    key = (packing, val, shard)
    if key not in _singles:
        out = str(tmp_path_factory.mktemp("single") / "out")
        _singles[key] = (out, build([corpus], out, tokenizer_path, dataclasses.replace(cfg, workers=1)))
    single, ms = _singles[key]
    root = tmp_path_factory.mktemp("parts")
    parts = [str(root / f"part-{k:05d}") for k in range(n)]
    with on_a_pool():
        for k, p in enumerate(parts):
            build([corpus], p, tokenizer_path, cfg, task=(k, n))
    mm = merge(parts, str(root))
    assert _relative(mm) == _relative(ms)
    for k in ("totals", "sources", "unit_documents", "unit_sources", "skipped"):
        assert mm.get(k) == ms.get(k), k
    assert ("unit_sources" in ms) == (packing != "document")
    for sp in ms["splits"].values():
        for e in sp["shards"]:
            for x in (e, *(e[s] for s in ("docs", "valid", "src") if s in e)):
                owner = next(p for p in parts if os.path.exists(os.path.join(p, x["path"])))
                assert open(os.path.join(owner, x["path"]), "rb").read() == open(os.path.join(single, x["path"]),
                                                                                 "rb").read()
    a, b = MemmapChunkDataset(single), MemmapChunkDataset(str(root))
    idx = sorted({0, len(a) // 3, len(a) // 2, len(a) - 1})
    assert len(a) == len(b) and all(np.array_equal(a[i]["input_ids"], b[i]["input_ids"]) for i in idx)


def _two_parts(tmp_path, corpus, tok, out):
    base = ["-t", tok, "-L", "16", "-j", "1", "-q", "--unit-size", "8KiB", "--shard-size", "2KiB", "--num-tasks", "2"]
    for k in range(2):
        r = cli("build", corpus, out, *base, "--task-index", k)
        assert r.exit_code == 0, r.output
    return [out / "part-00000", out / "part-00001"]


@pytest.mark.parametrize("damage", ["a sibling's build-plan.json", "another tokenizer.json", "a shard shortened"])
def test_merge_checks_what_lies_beside_each_part(tmp_path, small_corpus, small_tok, tokenizer_path, damage):
    """merge reads only manifests and stats files, but checks each part's build-plan.json against
    the plan_sha256 its manifest records, the tokenizer copy it ships against the manifest's
    sha256, and every shard's size.  (Issue 39: a part from another corpus with its sibling's
    plan copied in, a swapped tokenizer copy, a shortened shard: each merged with exit 0.)"""
    other = tmp_path / "other"
    shutil.copytree(small_corpus, other)
    (other / "h.txt").write_text("another corpus " * 400)
    parts = _two_parts(tmp_path, small_corpus, small_tok, tmp_path / "a")
    theirs = _two_parts(tmp_path, other, small_tok, tmp_path / "b")
    if damage == "a sibling's build-plan.json":
        shutil.copyfile(parts[0] / "build-plan.json", theirs[1] / "build-plan.json")
        parts = [parts[0], theirs[1]]
        want = "part-00001: its build-plan.json is not the plan its manifest was built from"
    elif damage == "another tokenizer.json":
        shutil.copyfile(tokenizer_path, parts[0] / "tokenizer.json")
        want = "tokenizer.json: not the tokenizer the part was built with"
    else:
        shard = sorted(parts[1].glob("train-*.bin"))[0]
        shard.write_bytes(shard.read_bytes()[:-2])
        want = f"{shard.name}: {shard.stat().st_size} bytes, its manifest says {shard.stat().st_size + 2}"
    r = cli("merge", *parts, tmp_path / "m")
    assert r.exit_code == 1 and want in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "m" / "manifest.json").exists()


def test_a_merge_killed_before_its_manifest_is_finished_by_the_rerun(tmp_path, small_corpus, small_tok, monkeypatch):
    """merge records what it is about to write before writing it: one stopped after its tokenizer
    copy and before its manifest leaves files a rerun knows as its own (issue 39: every later
    merge refused them as 'not written by helixtok', --overwrite included)."""
    import helixtok.pipeline.merge as hm

    parts = _two_parts(tmp_path, small_corpus, small_tok, tmp_path / "a")
    out = tmp_path / "m"

    def killed(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(hm, "write_json_atomic", lambda path, obj, **k: killed() if path.endswith("manifest.json")
                        else write_json_atomic(path, obj, **k))
    with pytest.raises(KeyboardInterrupt):
        merge([str(p) for p in parts], str(out))
    assert (out / "tokenizer.json").exists() and not (out / "manifest.json").exists()
    monkeypatch.undo()
    m = merge([str(p) for p in parts], str(out))
    assert m["totals"]["documents"] == 7 and sorted(os.listdir(out)) == ["manifest.json", "tokenizer.json"]
    assert verify(str(out)).ok


def test_a_dataset_given_twice_is_refused(tmp_path, txt_corpus, tokenizer_path):
    """`merge A A OUT` (or A and a copy of it) would put every chunk in the merged dataset twice:
    refused in one line, nothing written; two independent builds merge (data appended)."""
    cfg = BuildConfig(seq_len=256, workers=1, shard_bytes=1 << 20)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    build([txt_corpus], a, tokenizer_path, cfg)
    shutil.copytree(a, str(tmp_path / "copy"))
    for parts in ([a, a], [a, str(tmp_path / "copy")]):
        with pytest.raises(DatasetError, match=r"the same dataset as .*a \(given twice, its chunks would be in the "
                                               r"merged dataset twice\); give each part once"):
            merge(parts, str(tmp_path / "out"))
        assert not os.path.exists(tmp_path / "out")
    r = CliRunner().invoke(main, ["merge", a, a, str(tmp_path / "out")])
    assert r.exit_code != 0 and "given twice" in r.output and "Traceback" not in r.output
    build([os.path.join(txt_corpus, sorted(os.listdir(txt_corpus))[0])], b, tokenizer_path, cfg)
    m = merge([a, b], str(tmp_path / "both"))
    ma, mb = (json.load(open(os.path.join(x, "manifest.json"))) for x in (a, b))
    assert m["totals"]["documents"] == ma["totals"]["documents"] + mb["totals"]["documents"]


def test_a_bestfit_merge_refuses_a_damaged_docs_sidecar(tmp_path, txt_corpus, tokenizer_path):
    """The merged bestfit index is placed from the parts' .docs: one whose bytes are not its
    manifest's (an offset moved) stops the merge in one line, never a wrong index."""
    cfg = BuildConfig(seq_len=256, workers=1, packing="bestfit", unit_bytes=64 << 10, shard_bytes=64 << 10)
    root = tmp_path / "parts"
    parts = [str(root / f"part-{k:05d}") for k in range(2)]
    for k, p in enumerate(parts):
        build([txt_corpus], p, tokenizer_path, cfg, task=(k, 2))
    m = json.load(open(os.path.join(parts[1], "manifest.json")))
    assert m["splits"]["train"]["shards"]
    docs = os.path.join(parts[1], m["splits"]["train"]["shards"][0]["docs"]["path"])
    offsets = np.fromfile(docs, dtype="<u8")
    offsets[1:] += 7  # still sorted and in range
    offsets.tofile(docs)
    with pytest.raises(DatasetError, match=r"train-\d+-0000\.docs: its sha256 is not the manifest's"):
        merge(parts, str(root))
    assert not os.path.exists(root / "manifest.json")


def test_the_same_merge_again_is_up_to_date_and_a_changed_part_is_not(tmp_path, txt_corpus, tokenizer_path):
    """A merge run again on the same parts (or killed after its manifest landed, STATE left behind)
    says "up to date", exit 0, rewriting nothing (it said "already holds a dataset; pass
    --overwrite"); once a part's manifest is not the one merged, it is refused as before."""
    cfg = BuildConfig(seq_len=256, workers=1, unit_bytes=256 << 10, shard_bytes=1 << 20)
    root = tmp_path / "parts"
    parts = [str(root / f"part-{k:05d}") for k in range(2)]
    for k, p in enumerate(parts):
        build([txt_corpus], p, tokenizer_path, cfg, task=(k, 2))
    first = merge(parts, str(root))
    stamp = os.stat(root / "manifest.json").st_mtime_ns
    (root / ".helixtok-partial").mkdir()  # what a merge killed after its manifest leaves
    (root / ".helixtok-partial" / "publish.json").write_text('{"files": []}')
    r = CliRunner().invoke(main, ["merge", *parts, str(root)])
    assert r.exit_code == 0 and r.output.startswith(f"up to date: {root} ("), r.output
    assert os.stat(root / "manifest.json").st_mtime_ns == stamp and not (root / ".helixtok-partial").exists()
    assert merge(parts, str(root)) == first
    m1 = json.load(open(os.path.join(parts[1], "manifest.json")))  # a part whose manifest is not the one merged
    write_json_atomic(os.path.join(parts[1], "manifest.json"), {**m1, "helixtok_version": "0.3.1"})
    with pytest.raises(ConfigError, match=r"already holds a dataset; pass overwrite=True to replace it"):
        merge(parts, str(root))


def test_the_slurm_script_takes_the_task_count_and_passes_build_options(tmp_path):
    """Issue 63.13: scripts/slurm_build.sbatch takes N as an argument (a task resubmitted alone,
    `--array=3`, is still task 3 of N; it took N from the array's size, refusing it with a hint that
    replaced a good part) and passes the options after the tokenizer to every task; a task index
    outside N says to requeue."""
    import subprocess

    from helixtok.pipeline.merge import task_from_env

    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "slurm_build.sbatch")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text('#!/bin/sh\necho "$@"\n')  # what the step would run, said
    (bin_ / "srun").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_CPUS_PER_TASK": "8",
           "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "1"}
    r = subprocess.run(["bash", script, "16", "c/", "out/", "tok.json", "-L", "4096", "--shard-size", "256MiB"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["helixtok", "build", "c/", "out/", "--tokenizer", "tok.json",
                                                      "--workers", "8", "--num-tasks", "16", "-L", "4096",
                                                      "--shard-size", "256MiB"]
    r = subprocess.run(["bash", script, "c/", "out/", "tok.json"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "usage: sbatch --array=0-<N-1>" in r.stderr
    assert task_from_env(16, None, {"SLURM_ARRAY_TASK_ID": "3"}) == (3, 16)
    with pytest.raises(ConfigError, match=r"task index 5 outside \[0, 2\) of --num-tasks 2: .*scontrol requeue"):
        task_from_env(2, None, {"SLURM_ARRAY_TASK_ID": "5"})
