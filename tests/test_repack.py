"""helixtok repack: a finished build at another sequence length or packing, nothing tokenized, equal
byte for byte to what `helixtok build` with the new options writes -- every packing from packed and
from bestfit at three lengths with a val split, text and chat -- resumable, idempotent, OUT never
touched, and one line on what it cannot do."""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from helixtok.cli import main
from helixtok.format.errors import ConfigError
from helixtok.pipeline.builder import UpToDate, build
from helixtok.pipeline.config import BuildConfig
from helixtok import repack

# Provenance: what a repack's manifest says that a build's does not (docs/format.md), and the
# backend the source's build happened to tokenize with (its check's record).
PROVENANCE = ("repacked_from",)
# Small units and shards: several groups, some cut into several pieces, so every rule shows.
BASE = dict(unit_bytes=16 << 10, shard_bytes=12 << 10, val_fraction=0.1, workers=1)
LENGTHS = (32, 64, 100)


def _manifest(out) -> dict:
    m = json.loads(Path(out, "manifest.json").read_text())
    for k in PROVENANCE:
        m.pop(k, None)
    m["tokenizer"].pop("backend_check")
    return m


def assert_same_dataset(got, want) -> None:
    """Every file byte for byte, and the manifests less their provenance."""
    names = sorted(os.listdir(got))
    assert names == sorted(os.listdir(want))
    for n in names:
        if n != "manifest.json":
            assert filecmp.cmp(os.path.join(got, n), os.path.join(want, n), shallow=False), n
    a, b = _manifest(got), _manifest(want)
    assert a == b, [k for k in a if a[k] != b.get(k)]


def _files(out) -> dict:
    return {n: hashlib.sha256(Path(out, n).read_bytes()).hexdigest() for n in sorted(os.listdir(out))}


@pytest.fixture(scope="module")
def text(tmp_path_factory, dev_corpus, tokenizer_path):
    """The corpus built packed and bestfit at 64 (the sources), and every packing at LENGTHS (the references)."""
    root = tmp_path_factory.mktemp("repack")
    corpus = root / "corpus"
    corpus.mkdir()
    for p in sorted((dev_corpus / "txt").glob("*.txt"))[:40]:  # ~250 KB of real text: builds in a blink
        (corpus / p.name).write_text(p.read_text())
    refs = {}
    for pk in ("packed", "document", "bestfit"):
        for L in LENGTHS:
            refs[pk, L] = str(root / f"{pk}-{L}")
            build([str(corpus)], refs[pk, L], tokenizer_path, BuildConfig(**BASE, seq_len=L, packing=pk))
    return root, corpus, refs


@pytest.mark.parametrize("source", ["packed", "bestfit"])
def test_repack_equals_the_build_for_every_packing_and_length(text, source, tokenizer_path):
    root, corpus, refs = text
    src = refs[source, 64]
    m = json.loads(Path(src, "manifest.json").read_text())
    assert any(e["path"].endswith("-0001.bin") for e in m["splits"]["train"]["shards"])  # groups of several pieces
    assert m["splits"]["val"]["num_chunks"] > 0
    before = _files(src)
    for pk in ("packed", "document", "bestfit"):
        for L in LENGTHS:
            new = root / f"from-{source}-to-{pk}-{L}"
            got = repack(src, str(new), seq_len=L, packing=pk)
            assert_same_dataset(new, refs[pk, L])
            if pk == "document":
                assert got.linked == 0 and got.packed >= len({e["path"][:-9] for e in m["splits"]["train"]["shards"]}) > 2
            else:  # the very files: hard links, nothing copied
                assert got.packed == 0
                for e in m["splits"]["train"]["shards"]:
                    assert os.stat(new / e["path"]).st_ino == os.stat(Path(src, e["path"])).st_ino
            assert json.loads(Path(new, "manifest.json").read_text())["repacked_from"] == {
                "manifest_sha256": hashlib.sha256(Path(src, "manifest.json").read_bytes()).hexdigest(),
                "seq_len": 64, "packing": source}
    assert _files(src) == before  # OUT only read
    # Idempotent, and a build of the same corpus and options into it finds it up to date: the same plan.
    new = root / f"from-{source}-to-bestfit-100"
    again = repack(src, str(new), seq_len=100, packing="bestfit")
    assert again.up_to_date and again["splits"] == json.loads(Path(new, "manifest.json").read_text())["splits"]
    assert isinstance(build([str(corpus)], str(new), tokenizer_path,
                            BuildConfig(**BASE, seq_len=100, packing="bestfit")), UpToDate)
    r = CliRunner().invoke(main, ["verify", str(new)])
    assert r.exit_code == 0, r.output


def test_shards_cut_by_an_older_rule_are_written_anew_with_the_same_bytes(text, monkeypatch):
    """A source whose pieces were cut where this helixtok does not cut them (helixtok < 0.4 rounded
    packed pieces to whole chunks) is packed anew, group by group: the path forced here."""
    import helixtok.repacking.run as run

    root, _, refs = text
    monkeypatch.setattr(run, "linkable", lambda *a: False)
    for pk in ("packed", "bestfit"):
        got = repack(refs["packed", 64], str(root / f"anew-{pk}"), seq_len=100, packing=pk)
        assert got.linked == 0 and got.packed > 0
        assert_same_dataset(root / f"anew-{pk}", refs[pk, 100])
        for n in os.listdir(root / f"anew-{pk}"):  # written, not linked
            assert os.stat(root / f"anew-{pk}" / n).st_nlink == 1


def test_a_chat_build_repacks_where_its_conversations_stay_whole(tmp_path, dev_docs):
    from test_chat import _write_chat_corpus, hand_conversations, llama_style_tokenizer, real_conversations

    from helixtok.pipeline.chat import load_spec

    llama = llama_style_tokenizer(tmp_path / "llama", dev_docs[:100])
    convs = [c for c in hand_conversations()[:5] + real_conversations(dev_docs, 120, seed=5)
             if "tools" not in c and not any("reasoning_content" in m for m in c["messages"])]
    corpus = _write_chat_corpus(tmp_path / "corpus", convs)

    def chat_build(out, L, pk, **kw):
        cfg = BuildConfig(seq_len=L, packing=pk, text_field="messages", workers=1, unit_bytes=1 << 14,
                          shard_bytes=1 << 13, val_fraction=0.2, **kw,
                          chat=load_spec(str(llama), None, "assistant", False, "messages"))
        return build([str(corpus)], str(out), str(llama / "tokenizer.json"), cfg)

    chat_build(tmp_path / "src", 4096, "bestfit")
    m = json.loads((tmp_path / "src" / "manifest.json").read_text())
    assert sum(s["chat"]["dropped_too_long"] for s in m["splits"].values()) == 0
    longest = max(int(x) for x in _lengths(tmp_path / "src"))
    for pk, L in (("packed", 2048), ("document", longest), ("bestfit", 8192)):
        chat_build(tmp_path / f"ref-{pk}", L, pk)
        repack(str(tmp_path / "src"), str(tmp_path / f"new-{pk}"), seq_len=L, packing=pk)
        assert_same_dataset(tmp_path / f"new-{pk}", tmp_path / f"ref-{pk}")
    # The document view of a chat build: a conversation an item, trained where its mask says.
    import numpy as np

    from helixtok import MemmapDocumentDataset

    ds = MemmapDocumentDataset(str(tmp_path / "new-bestfit"))
    train = json.loads((tmp_path / "new-bestfit" / "manifest.json").read_text())["splits"]["train"]
    mask = np.concatenate([np.fromfile(tmp_path / "new-bestfit" / e["mask"]["path"], np.uint8) for e in train["shards"]])
    assert len(ds) == train["chat"]["conversations"] and len(mask) == sum(len(ds[i]["labels"]) for i in range(len(ds)))
    at = 0
    for i in range(len(ds)):
        lab = ds[i]["labels"].numpy()
        assert np.array_equal(lab != -100, mask[at: at + len(lab)] == 1)
        at += len(lab)
    # Shorter than its longest conversation: a build would drop or cut it.
    with pytest.raises(ConfigError, match=f"holds a conversation of {longest:,} tokens, longer than --seq-len "
                                          f"{longest - 1}: a build at {longest - 1} drops or cuts it"):
        repack(str(tmp_path / "src"), str(tmp_path / "short"), seq_len=longest - 1)
    # Longer than a source that dropped conversations: a build would keep them, and OUT lacks their ids.
    chat_build(tmp_path / "src-short", longest - 1, "bestfit")
    with pytest.raises(ConfigError, match=r"its build cut or dropped conversations longer than its --seq-len "
                                          rf"{longest - 1} \(0 cut, 1 dropped\); a build at 8192 keeps more"):
        repack(str(tmp_path / "src-short"), str(tmp_path / "long"), seq_len=8192)
    with pytest.raises(ConfigError, match="--min-tail-len does not apply to --chat"):
        repack(str(tmp_path / "src"), str(tmp_path / "tail"), packing="document", min_tail_len=3)
    assert not (tmp_path / "short").exists() and not (tmp_path / "long").exists()


def _lengths(out):
    import numpy as np

    m = json.loads(Path(out, "manifest.json").read_text())
    for s in m["splits"].values():
        for e in s["shards"]:
            d = np.fromfile(Path(out, e["docs"]["path"]), dtype="<u8").astype(np.int64)
            yield from np.diff(np.append(d, e["num_tokens"]))


def test_what_a_repack_cannot_do_is_one_line(text, tmp_path):
    root, corpus, refs = text
    src = refs["packed", 64]

    def cli(*args):
        return CliRunner().invoke(main, ["repack", *map(str, args)])

    cases = [
        ((refs["document", 64], tmp_path / "a"), "packed with --pack document, whose chunks keep no boundary"),
        ((src, src), "is OUT itself; repack writes a new dataset into another folder"),
        ((tmp_path / "nothing", tmp_path / "b"), "no such dataset folder"),
        ((src, tmp_path / "c", "--pack", "packed", "--min-tail-len", "3"),
         "--min-tail-len applies only to --pack document and --pack bestfit"),
        ((src, refs["bestfit", 64], "-L", "100"), "already holds a finished dataset built from other inputs or "
                                                  "options (min_tail_len: 0 -> None, packing: 'bestfit' -> 'packed', "
                                                  "seq_len: 64 -> 100); pass --overwrite"),
    ]
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    cases.append(((src, tmp_path / "foreign"), "holds 'notes.txt', which helixtok did not write"))
    for args, line in cases:
        r = cli(*args)
        assert r.exit_code != 0 and line in r.output and "Traceback" not in r.output, (args, r.output)
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    # A build running in OUT (its exclusive lock) refuses the repack, and the reverse.
    import fcntl

    fd = os.open(src, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        r = cli(src, tmp_path / "d")
        assert r.exit_code != 0 and "a helixtok build is writing it; wait for it to finish" in r.output
    finally:
        os.close(fd)
    # An older dataset (no unit_documents), and damaged ones: one line, nothing written.
    import shutil

    old = tmp_path / "old"
    shutil.copytree(src, old)
    m = json.loads((old / "manifest.json").read_text())
    del m["unit_documents"]
    (old / "manifest.json").write_text(json.dumps(m))
    r = cli(old, tmp_path / "e")
    assert r.exit_code != 0 and "written by an older helixtok (its manifest lacks unit_documents)" in r.output
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    m = json.loads((bad / "manifest.json").read_text())
    shard = bad / m["splits"]["train"]["shards"][1]["path"]
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    r = cli(bad, tmp_path / "f", "--pack", "document")
    assert r.exit_code != 0 and f"{shard}: bytes 0 to " in r.output and "are not those its manifest lists" in r.output
    assert not (tmp_path / "f").exists()
    docs = bad / m["splits"]["train"]["shards"][0]["docs"]["path"]
    docs.write_bytes(docs.read_bytes()[:-8])
    r = cli(bad, tmp_path / "g", "--pack", "bestfit")
    assert r.exit_code != 0 and f"{docs}: missing or not the" in r.output
    # The command's summary, and --json.
    r = cli(src, tmp_path / "h", "-L", "100", "--pack", "bestfit")
    assert r.exit_code == 0 and "shard groups linked, 0 written anew; nothing tokenized" in r.output
    r = cli(src, tmp_path / "h", "-L", "100", "--pack", "bestfit")
    assert r.exit_code == 0 and r.output.startswith(f"up to date: {tmp_path / 'h'} (") and "nothing rewritten" in r.output
    r = cli(src, tmp_path / "h", "-L", "100", "--pack", "bestfit", "--json")
    j = json.loads(r.output)
    assert j["up_to_date"] is True and j["seq_len"] == 100 and j["packing"] == "bestfit"


def test_a_repack_killed_in_each_step_finishes_on_the_same_command(text):
    """SIGKILL as it starts writing NEW, as it publishes, and once its manifest is there: the same
    command then gives the very dataset, and OUT is never touched."""
    import shutil

    root, _, refs = text
    src = refs["bestfit", 64]
    before = _files(src)
    new = root / "killed"
    cmd = [sys.executable, "-m", "helixtok", "repack", src, str(new), "--pack", "document", "-L", "100"]
    killed = []
    for mark in (new / ".helixtok-partial", new / ".helixtok-partial" / "publish.json", new / "manifest.json"):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while p.poll() is None and not mark.exists():
            time.sleep(0.0005)
        p.send_signal(signal.SIGKILL)
        killed.append(p.wait() == -signal.SIGKILL)
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert_same_dataset(new, refs["document", 100])
        assert _files(src) == before
        shutil.rmtree(new)
    assert any(killed)  # (a kill that came after the end is harmless, and proves nothing)
