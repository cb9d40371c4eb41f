"""Object storage for real: an S3-compatible server (moto's server mode) on loopback, s3fs as the client.

Upload the test corpus, build from s3://, compare bytes with the local build; resume and change
detection; publish to s3:// (manifest last), stats/verify remotely, pull to local disk.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import UNIT
from helixtok.format import limits
from helixtok.cli import main
from helixtok.format.errors import ConfigError, DatasetError, InputError
from helixtok.pipeline.builder import STATE, build
from helixtok.pipeline.config import BuildConfig

pytest.importorskip("s3fs")
pytest.importorskip("moto")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from s3_loopback import start_moto  # noqa: E402

KEY_ID, SECRET = "AKIAHELIXTOKTEST0001", "helixtok-secret-never-in-output-7f3a"

# Kilobyte corpora with --workers 2 still start a pool: its workers read the objects themselves.
pytestmark = pytest.mark.usefixtures("pooled")


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    proc, url = start_moto(log)
    yield url
    proc.terminate()
    proc.wait()
    log.close()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """An s3fs filesystem on the loopback server; credentials only in the environment, as in production."""
    for k, v in {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": s3_server,
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    return fs


_bucket_n = [0]


def new_bucket(fs) -> str:
    _bucket_n[0] += 1
    b = f"helix-{os.getpid()}-{_bucket_n[0]}"
    fs.mkdir(b)
    return b


def upload_tree(fs, local: Path, url: str) -> None:
    for p in sorted(local.rglob("*")):
        if p.is_file():
            fs.put_file(str(p), f"{url}/{p.relative_to(local).as_posix()}")


def same_files(a: str, b: str) -> None:
    # build-plan.json records each input's stamp: an object's ETag, a local file's mtime.
    names = sorted(str(p.relative_to(a)) for p in Path(a).rglob("*") if p.is_file() and p.name != "build-plan.json")
    assert names == sorted(str(p.relative_to(b)) for p in Path(b).rglob("*") if p.is_file() and p.name != "build-plan.json")
    for n in names:
        assert filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False), n


def cfg(**kw):
    return BuildConfig(**{"seq_len": 512, "workers": 2, "unit_bytes": UNIT, "shard_bytes": 1 << 20, **kw})


@pytest.fixture(scope="module")
def s3_corpus(s3_server, dev_corpus, tmp_path_factory):
    """The test corpus uploaded once: txt, jsonl, jsonl.gz and parquet objects under one prefix."""
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": s3_server,
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("corpus")
        upload_tree(fs, dev_corpus, "corpus/dev")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return "s3://corpus/dev"


def test_build_from_s3_is_byte_identical_to_the_local_build_and_leaks_no_credentials(
        s3, s3_corpus, dev_packed, tmp_path, tokenizer_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "helixtok.cli", "build", s3_corpus + "/", str(out), "-t", tokenizer_path,
                        "-L", "512", "-j", "2", "--shard-size", "1MiB", "--unit-size", "512KiB"],
                       capture_output=True, text=True, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    same_files(str(out), dev_packed)  # manifest included: names are relative to the corpus prefix
    logs = r.stdout + r.stderr
    for p in out.rglob("*"):
        if p.is_file():
            logs += p.read_bytes().decode("latin-1")
    assert SECRET not in logs and KEY_ID not in logs


def test_glob_and_single_object_urls(s3, s3_corpus, tmp_path, tokenizer_path, dev_corpus):
    out = tmp_path / "g"
    m = build([s3_corpus + "/**/*.jsonl*"], str(out), tokenizer_path, cfg())
    names = [f["name"] for f in m["inputs"]["list"]]
    assert names and all(".jsonl" in n for n in names)
    local = tmp_path / "local"
    ml = build([str(p) for p in sorted(dev_corpus.rglob("*.jsonl*"))], str(local), tokenizer_path, cfg())
    assert m["totals"] == ml["totals"] and m["splits"]["train"]["shards"] == ml["splits"]["train"]["shards"]
    one = sorted(dev_corpus.rglob("*.parquet"))[0].relative_to(dev_corpus).as_posix()
    m1 = build([f"{s3_corpus}/{one}"], str(tmp_path / "one"), tokenizer_path, cfg(seq_len=64))
    assert m1["inputs"]["files"] == 1 and m1["totals"]["documents"] > 0


def test_missing_prefix_bad_credentials_and_mixed_inputs_are_one_line(s3, s3_corpus, tmp_path, tokenizer_path,
                                                                    dev_corpus, monkeypatch):
    runner = CliRunner()
    r = runner.invoke(main, ["build", "s3://corpus/no-such-prefix/", str(tmp_path / "o"), "-t", tokenizer_path])
    assert r.exit_code == 1 and "s3://corpus/no-such-prefix" in r.output and "no such object" in r.output
    r = runner.invoke(main, ["build", s3_corpus, str(dev_corpus), str(tmp_path / "o"), "-t", tokenizer_path])
    assert r.exit_code == 1 and "local paths and URLs" in r.output
    r = runner.invoke(main, ["build", "gcs://bucket/x", str(tmp_path / "o"), "-t", tokenizer_path])
    assert r.exit_code == 1 and "pip install gcsfs" in r.output
    assert not (tmp_path / "o").exists()
    # An output bucket that does not exist fails before any tokenizing (no staging folder made).
    stage = tmp_path / "stage"
    r = runner.invoke(main, ["build", str(dev_corpus), "s3://no-such-bucket-x/out", "-t", tokenizer_path,
                             "--staging", str(stage)])
    assert r.exit_code == 1 and "s3://no-such-bucket-x/out: FileNotFoundError" in r.output and not stage.exists()
    # No credentials: one line naming the fix, in a fresh process (a process keeps its client).
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    r = subprocess.run([sys.executable, "-m", "helixtok.cli", "stats", "s3://corpus/dev"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("Error: s3://corpus/dev: NoCredentialsError") and "AWS_ACCESS_KEY_ID" in r.stderr


def test_object_changed_between_runs_or_during_the_build_is_detected(s3, tmp_path, tokenizer_path, dev_corpus):
    b = new_bucket(s3)
    src = sorted(dev_corpus.rglob("*.jsonl"))[0]
    s3.put_file(str(src), f"{b}/c/a.jsonl")
    s3.put_file(str(sorted(dev_corpus.rglob("*.txt"))[0]), f"{b}/c/b.txt")
    out = tmp_path / "out"

    def changer(p):  # another writer replaces an object while the build reads
        if p.phase == "write" and not changed:
            changed.append(1)
            s3.pipe_file(f"{b}/c/b.txt", b"replaced while building\n")

    changed: list = []
    with pytest.raises(InputError, match=r"c/b\.txt: changed while the build read it"):
        build([f"s3://{b}/c"], str(out), tokenizer_path, cfg(seq_len=16), on_progress=changer)
    assert not (out / "manifest.json").exists()
    # An unfinished build whose object then changes: the rerun refuses to mix the two versions.
    state_plan = tmp_path / "resume"
    import helixtok.pipeline.builder as hb

    real = hb._check_unchanged

    def die(*a, **kw):
        raise KeyboardInterrupt

    hb._check_unchanged = die
    try:
        with pytest.raises(KeyboardInterrupt):
            build([f"s3://{b}/c"], str(state_plan), tokenizer_path, cfg(seq_len=16))
    finally:
        hb._check_unchanged = real
    s3.pipe_file(f"{b}/c/a.jsonl", src.read_bytes() + b'{"text": "one more line"}\n')
    with pytest.raises(ConfigError, match=r"input modified: a\.jsonl"):
        build([f"s3://{b}/c"], str(state_plan), tokenizer_path, cfg(seq_len=16))


def test_kill_9_during_an_s3_build_then_resume_is_byte_identical(s3, s3_corpus, dev_packed, tmp_path,
                                                                 tokenizer_path):
    import glob

    out = tmp_path / "out"
    args = [sys.executable, "-m", "helixtok.cli", "build", s3_corpus, str(out), "-t", tokenizer_path, "-L", "512",
            "-j", "2", "-q", "--shard-size", "1MiB", "--unit-size", "512KiB"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy())
    t = time.time()
    while not glob.glob(str(out / STATE / "u*.done.json")):
        assert p.poll() is None, p.communicate()
        assert time.time() - t < 120
        time.sleep(0.05)
    p.kill()
    p.wait()
    assert not (out / "manifest.json").exists()
    time.sleep(0.3)
    r = subprocess.run(args, capture_output=True, text=True, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    same_files(str(out), dev_packed)


def test_publish_to_s3_manifest_last_then_stats_verify_and_pull(s3, dev_packed, small_corpus, small_tok, tmp_path,
                                                                tokenizer_path, s3_corpus):
    from helixtok import MemmapChunkDataset
    from helixtok.inspect.verify import verify
    from helixtok.pipeline.publish import upload

    b = new_bucket(s3)
    s3.pipe_file(f"{b}/ds/NOTES.md", b"the user's own file\n")
    url = f"s3://{b}/ds"
    # Upload a finished build; watch the server while it happens: no manifest before every file is there.
    import helixtok.pipeline.publish as hp

    seen = []
    real_put = hp.ThreadPoolExecutor

    class Watch(real_put):
        def map(self, fn, items):
            items = list(items)
            out = list(super().map(fn, items))
            seen.append(s3.exists(f"{b}/ds/manifest.json"))
            return out

    hp.ThreadPoolExecutor = Watch
    try:
        remote = upload(dev_packed, url, overwrite=False)
    finally:
        hp.ThreadPoolExecutor = real_put
    assert seen == [False]
    local = json.loads(Path(dev_packed, "manifest.json").read_text())
    assert remote["totals"] == local["totals"]
    folder = remote["tokenizer"]["file"].split("/")[0]
    assert folder.startswith("data-") and s3.cat_file(f"{b}/ds/NOTES.md") == b"the user's own file\n"

    runner = CliRunner()
    r = runner.invoke(main, ["stats", url, "-b", "4", "--json"])
    rl = runner.invoke(main, ["stats", dev_packed, "-b", "4", "--json"])
    assert r.exit_code == 0 and json.loads(r.output) == json.loads(rl.output)
    rep = verify(url, sample=2)
    assert rep.ok and len(rep.samples) == 2
    # Damage one object on the server: verify names it.
    shard = remote["splits"]["train"]["shards"][1]["path"]
    data = bytearray(s3.cat_file(f"{b}/ds/{shard}"))
    data[100] ^= 1
    s3.pipe_file(f"{b}/ds/{shard}", bytes(data))
    r = runner.invoke(main, ["verify", url])
    assert r.exit_code == 1 and f"FAIL train {shard}  sha256 mismatch" in r.output
    # pull refuses the damaged object (sha256 on arrival) and publishes nothing
    dest = tmp_path / "pulled"
    with pytest.raises(DatasetError, match="another sha256"):
        hp.pull(url, str(dest))
    assert not (dest / "manifest.json").exists()
    s3.put_file(os.path.join(dev_packed, shard.split("/", 1)[1]), f"{b}/ds/{shard}")  # repaired
    r = runner.invoke(main, ["pull", url, str(dest)])
    assert r.exit_code == 0, r.output
    assert runner.invoke(main, ["verify", str(dest)]).exit_code == 0
    # DEST is laid out as the pushed dataset (issue 63.10): its files where the build put them, no data-… folder.
    assert sorted(os.listdir(dest)) == sorted(n for n in os.listdir(dev_packed) if n != "build-plan.json")
    assert json.loads((dest / "manifest.json").read_text())["splits"] == json.loads(
        open(os.path.join(dev_packed, "manifest.json")).read())["splits"]
    a, c = MemmapChunkDataset(str(dest)), MemmapChunkDataset(dev_packed)
    assert len(a) == len(c) and all((a[i]["input_ids"] == c[i]["input_ids"]).all() for i in (0, len(a) // 2, len(a) - 1))
    with pytest.raises(DatasetError, match="pull"):
        MemmapChunkDataset(url)

    # A second dataset into the same URL: refused without --overwrite; with it, the old files go,
    # the user's file stays.
    with pytest.raises(ConfigError, match="already holds a finished dataset"):
        build([str(small_corpus)], url, small_tok, BuildConfig(seq_len=32, workers=1))
    m2 = build([str(small_corpus)], url, small_tok, BuildConfig(seq_len=32, workers=1), overwrite=True,
               staging=str(tmp_path / "stage"))
    keys = sorted(k.split("/", 2)[2] for k in s3.find(f"{b}/ds"))
    new_folder = m2["tokenizer"]["file"].split("/")[0]
    assert not any(k.startswith(folder) for k in keys)
    assert "NOTES.md" in keys and "manifest.json" in keys and all(
        k in ("NOTES.md", "manifest.json") or k.startswith(new_folder) for k in keys)
    assert verify(url).ok


def test_a_gz_object_split_into_ranges_reads_like_the_local_file(s3, s3_corpus, tmp_path, tokenizer_path, dev_corpus,
                                                                 monkeypatch):
    """A large .jsonl.gz object is cut into ranges like a local file; its seek index is built in
    this process (the indexer process reads only local files): the same units and bytes."""
    import helixtok.pipeline.compressed as hc

    monkeypatch.setattr(limits, "SPLIT_BYTES", 1)
    monkeypatch.setattr(limits, "RANGE_MIN_BYTES", 1)
    monkeypatch.setattr(hc, "GZ_INDEX_SPACING", 64 << 10)
    gz = sorted(p.relative_to(dev_corpus).as_posix() for p in dev_corpus.rglob("*.jsonl.gz"))
    m = build([f"{s3_corpus}/{p}" for p in gz], str(tmp_path / "s3"), tokenizer_path, cfg(unit_bytes=128 << 10, workers=1))
    ml = build([str(dev_corpus / p) for p in gz], str(tmp_path / "local"), tokenizer_path, cfg(unit_bytes=128 << 10, workers=1))
    assert m["inputs"]["units"] == ml["inputs"]["units"] > len(gz)
    assert m["totals"] == ml["totals"] and m["splits"]["train"]["shards"] == ml["splits"]["train"]["shards"]


def test_a_stopped_storage_server_fails_the_upload_within_the_stall_timeout(s3_server, dev_packed, tmp_path,
                                                                           monkeypatch):
    """A server that stops answering (SIGSTOP: it still accepts connections, then says nothing)
    while a dataset is pushed: one line naming the URL within --stall-timeout and a few seconds,
    not minutes of the driver's own timeouts and retries; nothing is published; once the server
    answers again the same command publishes."""
    import signal

    import s3fs

    server, endpoint = start_moto(subprocess.DEVNULL)  # a server of its own: this one is stopped
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
            monkeypatch.setenv(k, env[k])
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir("stalled")
        server.send_signal(signal.SIGSTOP)
        t = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "helixtok.cli", "push", dev_packed, "s3://stalled/ds",
                            "--stall-timeout", "2"], capture_output=True, text=True, env=env, timeout=120)
        took = time.monotonic() - t
        assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
        assert "s3://stalled/ds: no answer from the storage for 2 s" in p.stderr and took < 2 + 8, (took, p.stderr)
        server.send_signal(signal.SIGCONT)
        assert not fs.exists("stalled/ds/manifest.json")
        p = subprocess.run([sys.executable, "-m", "helixtok.cli", "push", dev_packed, "s3://stalled/ds"],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        fs.invalidate_cache()
        assert fs.exists("stalled/ds/manifest.json")
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
