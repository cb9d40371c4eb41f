"""The CLI end to end: results on stdout, one-line errors with exit codes, help with examples."""

import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from helixtok.cli import main


def run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r


@pytest.fixture
def corpus(tmp_path):
    c = tmp_path / "corpus"
    c.mkdir()
    (c / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 30)
    with gzip.open(c / "b.jsonl.gz", "wt") as fh:
        for i in range(20):
            fh.write(json.dumps({"text": f"hello world number {i} " * 5}) + "\n")
    return c


def test_build_stats_verify_end_to_end(tmp_path, corpus, small_tok):
    out = tmp_path / "out"
    r = run("build", corpus, out, "-t", small_tok, "-L", "16", "-j", "2", "--quiet", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    m = json.load(open(out / "manifest.json"))
    assert summary["totals"] == m["totals"]
    assert m["totals"]["documents"] == 21
    r = run("stats", out, "-b", "4", "-g", "2", "--epochs", "2", "--warmup-ratio", "0.1", "--json")
    st = json.loads(r.stdout)
    n = m["splits"]["train"]["num_chunks"]
    assert st["chunks"] == n and st["batches_per_epoch"] == -(-n // 4)
    assert st["total_optimizer_steps"] == 2 * -(-st["batches_per_epoch"] // 2)
    r = run("verify", out)
    assert r.exit_code == 0 and "all shards intact" in r.stdout
    r = run("stats", out, "-b", "4")  # rich table
    assert r.exit_code == 0 and "batches_per_epoch" in r.stdout


def test_verify_detects_corruption(tmp_path, corpus, small_tok):
    out = tmp_path / "out"
    assert run("build", corpus, out, "-t", small_tok, "-L", "16", "-q").exit_code == 0
    p = out / "train-000000-0000.bin"
    data = bytearray(p.read_bytes())
    data[10] ^= 0xFF
    p.write_bytes(bytes(data))
    r = run("verify", out)
    assert r.exit_code == 1
    assert "FAIL train train-000000-0000.bin  sha256 mismatch" in r.stdout
    assert "verification FAILED" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["missing_dir"], "missing_dir: no such file or directory"),
    (["nomatch/*.jsonl"], "pattern matched no files"),
])
def test_missing_inputs(tmp_path, small_tok, args, message):
    r = run("build", *[tmp_path / a for a in args], tmp_path / "out", "-t", small_tok)
    assert r.exit_code == 1
    assert message in r.output
    # One line: the progress bar shows only once tokenizing starts, not before an early error.
    assert len(r.output.strip().splitlines()) == 1, r.output


def test_a_folder_with_nothing_to_read_names_what_it_left_out(tmp_path, small_tok, corpus):
    """A CSV-only folder, or a corpus folder whose subfolders are links to elsewhere, said only "no
    corpus files found": the error names what was left out and the fix, in one line."""
    (tmp_path / "csvs").mkdir()
    (tmp_path / "csvs" / "rows.csv").write_text("text\nhello\n")
    r = run("build", tmp_path / "csvs", tmp_path / "out", "-t", small_tok)
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert f"; left out: 1 x unsupported file, e.g. {tmp_path / 'csvs' / 'rows.csv'}. Convert it to JSON Lines" in r.output
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "part").symlink_to(corpus)
    r = run("build", tmp_path / "linked", tmp_path / "out", "-t", small_tok)
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert (f"; left out: 1 x link outside corpus, e.g. {tmp_path / 'linked' / 'part'}. A folder link that leads "
            "outside the folders given is not followed: pass its target as an input too") in r.output
    r = run("build", tmp_path / "linked", corpus, tmp_path / "out", "-t", small_tok, "-q")  # as it says
    assert r.exit_code == 0, r.output


def test_unsupported_file_type_and_json(tmp_path, small_tok):
    (tmp_path / "data.csv").write_text("a,b\n")
    r = run("build", tmp_path / "data.csv", tmp_path / "out", "-t", small_tok)
    assert r.exit_code == 1 and "data.csv: unsupported file type; supported: .txt" in r.output
    (tmp_path / "data.json").write_text('{\n  "text": "x"\n}')
    r = run("build", tmp_path / "data.json", tmp_path / "out", "-t", small_tok)
    # (issue 41: .json is read as JSON Lines or one JSON array; one object over lines is refused with the conversion)
    assert r.exit_code == 1 and "not JSON Lines" in r.output and "jq -c '.[]'" in r.output


def test_unknown_tokenizer(tmp_path, corpus):
    r = run("build", corpus, tmp_path / "out", "-t", "no-such-org/no-such-model")
    assert r.exit_code == 1
    assert "not a file or folder here, and not a repo in the local HF cache (looked in" in r.output
    assert "huggingface-cli download" in r.output
    # A mistyped relative path is a missing file, not a repo id to download.
    r = run("build", corpus, tmp_path / "out", "-t", "tokenizers/tok.json")
    assert r.exit_code == 1 and "tokenizers/tok.json: no such tokenizer file or folder" in r.output
    assert "huggingface" not in r.output
    bad = tmp_path / "tok.json"
    bad.write_text('{"not": "a tokenizer"}')
    r = run("build", corpus, tmp_path / "out", "-t", bad)
    assert r.exit_code == 1 and "not a tokenizers tokenizer.json" in r.output


def test_hf_cache_repo_id(tmp_path, corpus, small_tok, monkeypatch):
    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_text(open(small_tok).read())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    r = run("build", corpus, tmp_path / "out", "-t", "acme/tiny", "-L", "16", "-q")
    assert r.exit_code == 0, r.output


def test_tokenizers_1_0s_reworked_api_is_refused_in_one_line(tmp_path, corpus, small_tok):
    """tokenizers 1.0.0rc3 (on PyPI, a pre-release) reworked its Python bindings to Tokenizer.from_file /
    encode / decode: a build with it installed said the tokenizer "not a tokenizers tokenizer.json".
    It cannot be installed beside the 0.x reference here, so a package of its public surface stands
    in for it, first on the path of a child process."""
    fake = tmp_path / "site" / "tokenizers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        '__version__ = "1.0.0-rc.3"\n'
        "class Tokenizer:\n"
        "    @staticmethod\n"
        "    def from_file(path): raise AssertionError('not reached')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH"))
                                                       if p)}
    r = subprocess.run([sys.executable, "-m", "helixtok.cli", "build", str(corpus), str(tmp_path / "out"), "-t",
                        small_tok, "-q"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        "Error: tokenizers 1.0.0-rc.3 is installed: its reworked Python API has no Tokenizer.from_str, token_to_id "
        "or pipeline, which helixtok inspects a tokenizer with; install the 0.x release: pip install 'tokenizers<1'"]
    assert not (tmp_path / "out").exists()


def test_version_is_the_codes_and_the_projects():
    """`helixtok --version` said the version an editable install was made at (0.2.0), not the
    code's (0.4.0): it reports helixtok.__version__, which pyproject.toml states too."""
    from helixtok import __version__

    r = run("--version")
    assert r.exit_code == 0 and r.output.strip() == f"helixtok, version {__version__}"
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), encoding="utf-8") as fh:
        assert re.search(r'^version = "([^"]+)"$', fh.read(), re.M).group(1) == __version__  # (no tomllib on 3.10)


def test_non_empty_out(tmp_path, corpus, small_tok):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    r = run("build", corpus, out, "-t", small_tok)
    assert r.exit_code == 1 and "holds 'keep.txt', which helixtok did not write" in r.output
    r = run("build", corpus, out, "-t", small_tok, "--overwrite")  # --overwrite never deletes it either
    assert r.exit_code == 1 and "which helixtok did not write" in r.output
    assert sorted(os.listdir(out)) == ["keep.txt"]


def test_bad_option_is_usage_error(tmp_path, corpus, small_tok):
    r = run("build", corpus, tmp_path / "out", "-t", small_tok, "--shard-size", "lots")
    assert r.exit_code == 2 and "not a size like 1GiB" in r.output
    r = run("build", corpus, tmp_path / "out", "-t", small_tok, "--min-tail-len", "4")
    assert r.exit_code == 1 and "--min-tail-len applies only to --pack document" in r.output


@pytest.mark.parametrize("cmd", ["build", "stats", "verify", "merge", "train-tokenizer"])
def test_help_has_example(cmd):
    r = run(cmd, "--help")
    assert r.exit_code == 0 and "Example:" in r.output and f"helixtok {cmd}" in r.output


def test_train_tokenizer(tmp_path, corpus):
    out = tmp_path / "t.json"
    r = run("train-tokenizer", corpus, out, "--vocab-size", "400")
    assert r.exit_code == 0, r.output
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out))
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.decode(tok.encode("hello world").ids) == "hello world"


def test_cli_does_not_import_torch():
    code = "import sys, helixtok.cli, helixtok.pipeline.builder, helixtok.read.stats; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_console_script_runs(tmp_path, corpus, small_tok, pooled):
    """The installed entry point, in a real subprocess with real worker processes."""
    out = tmp_path / "out"
    exe = os.path.join(os.path.dirname(sys.executable), "helixtok")  # this environment's, whatever PATH says
    p = subprocess.run([exe, "build", str(corpus), str(out), "-t", small_tok, "-L", "16", "-j", "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "train" in p.stdout and "Traceback" not in p.stderr
    # Progress goes to stderr, never stdout (off a terminal as plain lines: the bar's "docs" was asserted before).
    assert "helixtok: tokenize x" in p.stderr and " documents, " in p.stderr
    assert "helixtok: " not in p.stdout


def test_single_name_repo_id_from_the_local_hf_cache(tmp_path, corpus, small_tok, monkeypatch):
    snap = tmp_path / "hub" / "models--gpt2" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "tokenizer.json").write_bytes(open(small_tok, "rb").read())
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    r = run("build", corpus, tmp_path / "out", "-t", "gpt2", "-L", "8", "-q")
    assert r.exit_code == 0, r.output


def test_every_option_of_every_command_has_help():
    missing = [f"{name} {p.opts[0]}" for name, cmd in main.commands.items() for p in cmd.params
               if p.param_type_name == "option" and not (p.help or "").strip()]
    assert not missing, missing


def test_train_example_describes_itself():
    r = subprocess.run([sys.executable, "scripts/train_example.py", "--help"], capture_output=True, text=True,
                       cwd=os.path.join(os.path.dirname(__file__), ".."))
    assert r.returncode == 0 and "Train a tiny causal LM" in r.stdout and "--max-steps" in r.stdout


def test_dataset_without_torch_names_the_extra():
    code = "import sys; sys.modules['torch'] = None\nfrom helixtok import MemmapChunkDataset"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 1 and "pip install 'helixtok[torch]'" in r.stderr
    # ...while building and stats need no torch at all.
    code = "import sys; sys.modules['torch'] = None\nimport helixtok.cli, helixtok.pipeline.builder, helixtok.read.stats, helixtok.inspect.verify"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_quiet_hides_the_bar_not_the_warnings(tmp_path, corpus, small_tok):
    (tmp_path / "c2").mkdir()
    (tmp_path / "c2" / "a.txt").write_text("hello world " * 50)
    (tmp_path / "c2" / "notes.csv").write_text("x")
    r = run("build", tmp_path / "c2", tmp_path / "out", "-t", small_tok, "-L", "8", "-q")
    assert r.exit_code == 0 and "1 x unsupported file, e.g. notes.csv" in r.output and "tok/s" not in r.output


def test_summary_prints_every_term_of_the_token_arithmetic(tmp_path, corpus, small_tok):
    # Document packing pads tails and drops short ones: all four terms are non-zero here.
    (corpus / "c.txt").write_text("hello world")
    r = run("build", corpus, tmp_path / "out", "-t", small_tok, "-L", "64", "--pack", "document",
            "--min-tail-len", "40", "-q")
    assert r.exit_code == 0, r.output
    t = json.load(open(tmp_path / "out" / "manifest.json"))["totals"]
    assert t["pad_tokens"] and t["dropped_tokens"] and t["dropped_documents"]
    assert t["tokens"] + t["pad_tokens"] - t["dropped_tokens"] == t["chunks"] * 64
    assert (f"tokens: produced {t['tokens']:,} + pad {t['pad_tokens']:,} - dropped {t['dropped_tokens']:,} "
            f"= stored {t['chunks'] * 64:,} = {t['chunks']:,} chunks x 64") in r.output
    assert f"dropped whole (below --min-tail-len) {t['dropped_documents']:,}" in r.output


def test_bench_read_says_whether_the_loader_keeps_up(dev_packed):
    r = run("bench-read", dev_packed, "-b", "4", "--seconds", "0.3", "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["tokens_per_s"] > 0 and got["batches"] > 0 and got["seq_len"] == 512 and got["headroom"] is None
    r = run("bench-read", dev_packed, "-b", "4", "--seconds", "0.3", "--need", "1000")
    assert r.exit_code == 0 and "the model needs 1,000 tokens/s: the loader delivers" in r.output
    r = run("bench-read", dev_packed, "-b", "4", "--seconds", "0.3", "--need", "1e15", "--document-masking")
    assert r.exit_code == 1 and "less than the 1,000,000,000,000,000 the model needs" in r.output
    assert "Traceback" not in r.output


def test_build_passes_special_tokens_and_strip_to_the_build(tmp_path, corpus, small_tok):
    # --special-tokens was accepted but never reached the build (it always ran "text").
    r = run("build", corpus, tmp_path / "out", "-t", small_tok, "-L", "8", "-q", "--special-tokens", "extract",
            "--strip")
    assert r.exit_code == 0, r.output
    m = json.load(open(tmp_path / "out" / "manifest.json"))
    assert m["tokenizer"]["special_tokens_in_text"] == "extract" and m["options"]["strip"] is True


def test_small_defects_a_newcomer_met(tmp_path, corpus, small_tok, dev_packed):
    """OUT forgotten; a SentencePiece .model as --tokenizer; the stats title's [train] (rich read it as markup)."""
    r = CliRunner().invoke(main, ["build", str(corpus), "-t", small_tok])
    assert r.exit_code == 2 and f"one path given ({corpus}): give the corpus, then the folder to build into" in r.output
    (tmp_path / "tokenizer.model").write_bytes(b"\n\t\x08\x01sentencepiece")
    r = CliRunner().invoke(main, ["build", str(corpus), str(tmp_path / "o"), "-t", str(tmp_path / "tokenizer.model")])
    assert r.exit_code == 1 and "a SentencePiece model, not a tokenizer.json; pass the tokenizer.json" in r.output
    assert not (tmp_path / "o").exists()
    r = CliRunner().invoke(main, ["stats", dev_packed, "-b", "4"])
    assert r.exit_code == 0 and "[train]" in r.output, r.output


def test_progress_off_a_terminal_is_plain_lines(tmp_path, corpus, small_tok):
    """In a log (stderr not a terminal) the build says where it is: a line at each phase and every
    --log-interval seconds (it printed nothing until the end); -q prints none."""
    args = [sys.executable, "-m", "helixtok.cli", "build", str(corpus), str(tmp_path / "o"), "-t", small_tok, "-L", "8",
            "-j", "1", "--backend", "hf", "--log-interval", "0.01"]
    p = subprocess.run(args, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert lines and all(ln.startswith("helixtok: ") for ln in lines), lines
    assert any(ln.startswith("helixtok: tokenize x1: ") for ln in lines) and lines[-1].startswith("helixtok: write: ")
    assert all(re.search(r"MB \(\d+%\), [\d,]+ documents, [\d,]+ tokens, [\d.]+ MB/s, \d+ s elapsed, ETA ", ln)
               for ln in lines), lines
    p = subprocess.run(args[:5] + [str(tmp_path / "q")] + args[6:] + ["-q"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stderr == ""


def test_the_summary_says_what_happened_and_warns_with_the_fix(tmp_path, small_tok):
    """Backend and version, BOS and its rule, time and MB/s, size on disk, padding and dropped
    shares, tokens per source (also in the manifest), reused units; a warning naming the option
    when over 5% of documents or tokens were dropped or over 10% of stored tokens are padding;
    `helixtok info` says the same from the manifest alone."""
    c = tmp_path / "c"
    for src, n in (("web", 30), ("code", 10)):
        (c / src).mkdir(parents=True)
        for i in range(n):  # short documents: document packing at -L 64 drops those under 16 tokens
            (c / src / f"{i:03d}.txt").write_text("hello world " * (2 + 5 * (i % 4)))
    out = tmp_path / "out"
    args = ["build", str(c), str(out), "-t", small_tok, "-L", "64", "--pack", "document", "-j", "1", "-q"]
    r = CliRunner().invoke(main, args + ["--json"])
    assert r.exit_code == 0, r.output
    j = json.loads(r.stdout)
    m = json.load(open(out / "manifest.json"))
    assert m["sources"] == {k: {kk: v[kk] for kk in ("documents", "tokens", "text_bytes")} for k, v in j["sources"].items()}
    assert sum(v["tokens"] for v in m["sources"].values()) == m["totals"]["tokens"]
    assert (m["sources"]["web"]["documents"], m["sources"]["code"]["documents"]) == (30, 10)
    assert j["bytes_on_disk"] == sum(os.path.getsize(out / n) for n in os.listdir(out)
                                     if n not in ("manifest.json", "build-plan.json"))
    t = m["totals"]
    assert j["pad_share"] == t["pad_tokens"] / (t["chunks"] * 64) > 0.10
    assert j["dropped_document_share"] == t["dropped_documents"] / t["documents"] > 0.05
    assert j["backend_version"].startswith(j["backend"] if j["backend"] != "hf" else "tokenizers")
    assert j["elapsed_s"] > 0 and j["reused_units"] == 0 and len(j["alerts"]) == 2
    r = CliRunner().invoke(main, ["info", str(out)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "--min-tail-len 1 keeps them" in text and "--pack packed stores none" in text
    assert "no BOS (the tokenizer's rule)" in text and " on disk" in text and "took" not in text
    assert f"web {m['sources']['web']['tokens']:,} tokens" in text and "padding " in text
    assert json.loads(CliRunner().invoke(main, ["info", str(out), "--json"]).stdout)["alerts"] == j["alerts"]


def test_show_cuts_chunks_at_documents_and_names_each_documents_line(tmp_path, small_tok):
    """`helixtok show`: a chunk's ids, cut where documents start (the .docs sidecar), each document
    numbered and named by its source line (read again with --corpus; empty lines skipped as the
    build skips them), padding marked in document packing; --raw gives the ids themselves."""
    from tokenizers import Tokenizer

    c = tmp_path / "c"
    (c / "web").mkdir(parents=True)
    texts = [f"doc {i} " + "hello world " * (i % 7 + 1) for i in range(40)]
    lines = [json.dumps({"text": t}) for t in texts]
    lines.insert(5, json.dumps({"text": "   "}))  # skipped: line numbers and document numbers part ways here
    (c / "web" / "a.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert CliRunner().invoke(main, ["build", str(c), str(out), "-t", small_tok, "-L", "32", "-j", "1", "-q"]).exit_code == 0
    tok = Tokenizer.from_file(small_tok)
    eos = tok.token_to_id("<|endoftext|>")
    stream = [i for t in texts for i in tok.encode(t, add_special_tokens=False).ids + [eos]]
    starts = np.cumsum([0] + [len(tok.encode(t, add_special_tokens=False).ids) + 1 for t in texts])
    for chunk in (0, 7, len(stream) // 32 - 1):
        r = CliRunner().invoke(main, ["show", str(out), str(chunk), "--raw", "--corpus", str(c)])
        assert r.exit_code == 0, r.output
        body = r.output.splitlines()[1:]
        heads, rows = body[0::2], body[1::2]
        assert [int(x) for row in rows for x in row.split()] == stream[chunk * 32: (chunk + 1) * 32]
        for h, row in zip(heads, rows):
            d = int(re.search(r"document ([\d,]+)", h).group(1))
            line = d + 1 + (d >= 5)  # the blank line 6 holds no document
            assert h.endswith(f": a.jsonl:{line} ---"), h  # (names relative to the corpus's common root)
            assert ("starts" in h) == (starts[d] >= chunk * 32)
    r = CliRunner().invoke(main, ["show", str(out), "1"])
    # Issue 56.4: the build recorded where each document was read: the line without --corpus.
    heads = [ln for ln in r.output.splitlines() if ln.startswith("--- document")]
    assert r.exit_code == 0 and heads and all(re.search(r": a\.jsonl:\d+ ---$", h) for h in heads), r.output
    assert heads == [ln for ln in CliRunner().invoke(main, ["show", str(out), "1", "--corpus", str(c)]).output.splitlines()
                     if ln.startswith("--- document")]
    raw = CliRunner().invoke(main, ["show", str(out), "1", "--raw"]).output.splitlines()
    texts_shown = r.output.splitlines()
    assert [ln for ln in texts_shown if ln.startswith("---")] == [ln for ln in raw if ln.startswith("---")]
    for ids_line, text_line in zip(raw[2::2], texts_shown[2::2]):  # each document's ids, decoded
        assert text_line == tok.decode([int(x) for x in ids_line.split()], skip_special_tokens=False)
    doc = tmp_path / "doc"
    assert CliRunner().invoke(main, ["build", str(c), str(doc), "-t", small_tok, "-L", "32", "-j", "1", "-q",
                                     "--pack", "document", "--min-tail-len", "1"]).exit_code == 0
    r = CliRunner().invoke(main, ["show", str(doc), "0", "--raw"])
    n0 = len(tok.encode(texts[0], add_special_tokens=False).ids) + 1
    assert r.exit_code == 0 and f"--- {32 - n0} pad (" in r.output
    assert CliRunner().invoke(main, ["show", str(doc), "99999"]).exit_code == 1


def _png_rgb(path) -> np.ndarray:
    """A PNG's pixels (8-bit RGB or RGBA, not interlaced: what Chromium writes), without an image library."""
    import struct
    import zlib

    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos: pos + 8])
        body = data[pos + 8: pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + w * bpp)
    out = np.zeros((h, w * bpp), dtype=np.int32)
    prev = np.zeros(w * bpp, dtype=np.int32)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int32)
        cur = np.zeros_like(line)
        if f == 0:
            cur = line
        elif f == 2:
            cur = (line + prev) & 255
        else:
            for x in range(len(line)):
                a = cur[x - bpp] if x >= bpp else 0
                b, c = prev[x], prev[x - bpp] if x >= bpp else 0
                if f == 1:
                    pred = a
                elif f == 3:
                    pred = (a + b) // 2
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                cur[x] = (line[x] + pred) & 255
        out[y], prev = cur, cur
    return out.reshape(h, w, bpp)[:, :, :3]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_info_html_report_renders_in_a_browser(tmp_path, corpus, small_tok):
    """`helixtok info --html`: one self-contained page (no script, no file beside it) with the
    summary, tokens per source, the histograms and decoded chunks; rendered by headless Chromium,
    the screenshot shows the charts' bars."""
    out = tmp_path / "out"
    assert CliRunner().invoke(main, ["build", str(corpus), str(out), "-t", small_tok, "-L", "32", "-j", "1",
                                     "-q"]).exit_code == 0
    page = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["info", str(out), "--html", str(page)])
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert "<script" not in text and "src=" not in text and "Tokens per source" in text and "Document lengths" in text
    # (issue 41: a y axis with values, a split table; packed data has no single-bar "chunk fill" chart)
    assert "chunk 0" in text and text.count("<svg") == 2 and "Every train chunk is full" in text
    assert "<h2>Splits</h2>" in text and "<th>stored tokens</th>" in text and ">0</text>" in text
    shot = tmp_path / "shot.png"
    p = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                        "--window-size=900,1200", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.exists(), p.stderr[-2000:]
    px = _png_rgb(shot)
    bar = (np.abs(px - np.array([0x3B, 0x6E, 0xA5])).sum(axis=2) < 12).mean()  # the charts' blue
    ink = (px.sum(axis=2) < 600).mean()  # text and bars, not page
    assert bar > 0.03 and ink > 0.05, (bar, ink)


def test_the_html_report_shows_the_charts_each_packing_has(dev_bestfit, dev_document, tmp_path):
    """bestfit: document (piece) lengths and chunk fill; document packing: chunk fill alone (it keeps
    no document starts); every chart with its y axis's values."""
    import re

    for out, want in ((dev_bestfit, ["Document lengths in train", "Chunk fill in train"]),
                      (dev_document, ["Chunk fill in train"])):
        page = tmp_path / "r.html"
        r = CliRunner().invoke(main, ["info", out, "--html", str(page)])
        assert r.exit_code == 0, r.output
        text = page.read_text()
        assert [t.strip() for t in re.findall(r"<h2>([^<(]+)", text) if " in train" in t] == want
        assert text.count("<svg") == 1 + len(want) and text.count('text-anchor="end"') == 3 * (1 + len(want))
    m = json.load(open(os.path.join(dev_bestfit, "manifest.json")))
    from helixtok.read.splitview import SplitView

    lengths = SplitView(dev_bestfit, m).pieces().size  # every item's tokens: with the padding, the stored tokens
    assert lengths.min() > 0 and lengths.sum() + m["splits"]["train"]["pad_tokens"] == m["splits"]["train"]["num_tokens"]


def test_show_of_a_bestfit_chunk_marks_each_document_and_the_padding(dev_bestfit):
    from helixtok.read.splitview import SplitView

    m = json.load(open(os.path.join(dev_bestfit, "manifest.json")))
    v = SplitView(dev_bestfit, m)
    i = next(i for i in range(v.num_chunks) if v.valid(i) < m["seq_len"] and len(v.chunk_starts(i)) > 1)
    r = CliRunner().invoke(main, ["show", dev_bestfit, str(i), "--raw"])
    assert r.exit_code == 0, r.output
    # Each item: the document it lies in, whether it starts it, and where that document was read.
    marks = [line for line in r.output.splitlines() if line.startswith("--- document")]
    ids = [line for line in r.output.splitlines()[1:] if line and not line.startswith("---")]
    cuts = v.chunk_starts(i).tolist()
    assert len(marks) == len(cuts) == len(ids)
    assert [len(x.split()) for x in ids] == [b - a for a, b in zip(cuts, cuts[1:] + [v.valid(i)])]
    lay = v.pieces()
    for mark, (g, _) in zip(marks, zip(*lay.pieces(i))):
        d = v.starts_before(g + 1) - 1
        kept = v.document_fields(d)  # (its record's "id", where it has one)
        assert mark == (f"--- document {d:,} {'starts' if v.starts_before(g) == d else 'continues'}: "
                        f"{v.document_source(d)}{f' {json.dumps(kept)}' if kept else ''} ---")
    assert f"--- {512 - v.valid(i):,} pad" in r.output


def test_ctrl_c_while_the_command_line_is_imported_is_one_line_and_exit_130():
    """The console command handles Ctrl-C from its first instruction: one arriving while click and
    the commands are imported used to print a KeyboardInterrupt traceback (issue 39, 2 of 30 trials)."""
    code = """
import builtins, os, signal, sys
import helixtok.cli.entry as entry
real = builtins.__import__
def interrupted(name, *a, **k):
    if name == "click":
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *a, **k)
builtins.__import__ = interrupted
sys.argv = ["helixtok", "--help"]
entry.main()
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 130 and p.stderr.strip() == "interrupted before anything started", p.stderr


@pytest.mark.parametrize("damage", ["num_tokens", "no tokenizer", "truncated", "/dev/zero"])
def test_every_reader_names_a_damaged_dataset_in_one_line(tmp_path, small_corpus, small_tok, damage):
    """show, info --html and the exports check each shard's size as MemmapChunkDataset does (issue
    39: an IndexError traceback for a wrong num_tokens, a tokenizers traceback for a missing
    tokenizer.json, an empty chunk printed with exit 0 for a truncated last shard or a link to
    /dev/zero)."""
    from helixtok.pipeline.builder import build
    from helixtok.pipeline.config import BuildConfig

    out = tmp_path / "out"
    build([str(small_corpus)], str(out), small_tok, BuildConfig(seq_len=16, workers=1, shard_bytes=8 << 10))
    m = json.loads((out / "manifest.json").read_text())
    shards = m["splits"]["train"]["shards"]
    last = out / shards[-1]["path"]
    n = m["splits"]["train"]["num_chunks"]
    if damage == "num_tokens":
        shards[-1]["num_tokens"] += 1000
        (out / "manifest.json").write_text(json.dumps(m))
        want = f"{last}: {last.stat().st_size} bytes, the manifest says {last.stat().st_size + 2000}"
    elif damage == "no tokenizer":
        (out / "tokenizer.json").unlink()
        want = f"{out / 'tokenizer.json'}: cannot read it (No such file or directory)"
    elif damage == "truncated":
        size = last.stat().st_size
        last.write_bytes(b"")
        want = f"{last}: 0 bytes, the manifest says {size}"
    else:
        size = last.stat().st_size
        last.unlink()
        os.symlink("/dev/zero", last)
        want = f"{last}: missing or not a file, the manifest says {size}"
    runs = [["show", str(out), str(n - 1)], ["info", str(out), "--html", str(tmp_path / "r.html")]]
    if damage != "no tokenizer":  # (the exports need no tokenizer)
        runs += [["export", "llmc", str(out), str(tmp_path / "x.bin")],
                 ["export", "megatron", str(out), str(tmp_path / "meg")]]
    for args in runs:
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and want in r.output and "Traceback" not in r.output, (args, r.output)


def test_no_eta_before_a_rate_is_known_and_none_counting_start_up():
    """The ETA comes from tokenizing alone, after a second of it: start-up is not throughput
    (issue 41: 'ETA 20:42:52' for an 8 s build, the first progress line counting the start)."""
    from helixtok.cli.build import eta
    from helixtok.pipeline.dispatch import Progress

    def p(done):
        return Progress(done, 100_000_000, 0, 0, 0, 10, "tokenize")

    assert eta(p(0), 5.0, None) == (None, None)  # tokenizing has not reported yet
    assert eta(p(10_000_000), 5.5, (5.0, 0)) == (None, None)  # half a second: no rate yet
    assert eta(p(10_000_000), 30.0, (30.0, 10_000_000)) == (None, None)  # no bytes since
    # 20 MB in the 2 s since tokenizing began (30 s of start-up before it do not count): 70 MB left, 7 s.
    assert eta(p(30_000_000), 32.0, (30.0, 10_000_000)) == ("00:00:07", 10_000_000.0)


def test_hints_that_run(tmp_path, corpus, small_tok, monkeypatch):
    """Llama 3's tiktoken-format tokenizer.model is named as such with where its tokenizer.json is; a
    SentencePiece model's conversion names the packages it needs; --val-fraction that takes every
    document says so; $SLURM_ARRAY_TASK_ID without --num-tasks and a tiny --seq-len get a note
    (issue 41: each was misnamed or silent)."""
    (tmp_path / "tokenizer.model").write_bytes(b"IQ== 0\nIg== 1\nIw== 2\n")
    r = CliRunner().invoke(main, ["build", str(corpus), str(tmp_path / "o"), "-t", str(tmp_path / "tokenizer.model")])
    assert r.exit_code == 1 and "a tiktoken BPE file" in r.output and "hf download REPO tokenizer.json" in r.output
    (tmp_path / "sp.model").write_bytes(b"\n\t\x08\x01sentencepiece")
    r = CliRunner().invoke(main, ["build", str(corpus), str(tmp_path / "o"), "-t", str(tmp_path / "sp.model")])
    assert r.exit_code == 1 and "pip install transformers sentencepiece" in r.output
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text("a single document " * 50)
    r = CliRunner().invoke(main, ["build", str(one), str(tmp_path / "v"), "-t", small_tok, "-L", "8",
                                  "--val-fraction", "0.999999"])
    assert r.exit_code == 1 and "--val-fraction 0.999999 put every one of the 1 documents in the val split" in r.output
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    r = CliRunner().invoke(main, ["build", str(one), str(tmp_path / "s"), "-t", small_tok, "-L", "4", "-q"])
    assert r.exit_code == 0, r.output
    assert "$SLURM_ARRAY_TASK_ID is 3 but --num-tasks is not given" in r.output and "--seq-len 4 holds" in r.output


@pytest.mark.parametrize("case", ["chat messages", "blank"])
def test_a_corpus_of_skipped_records_says_what_was_skipped_not_seq_len(tmp_path, small_tok, case):
    """Every record skipped: the build names how many, why and where first, and the fix (it
    blamed --seq-len: 'the corpus gave 0 tokens ... lower --seq-len')."""
    c = tmp_path / "c"
    c.mkdir()
    if case == "chat messages":
        (c / "chat.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]})
                                              + "\n" for i in range(200)))
        extra, want = ["--text-field", "messages"], (r"the corpus gave no document to tokenize: 200 records whose "
                                                      r"'messages' is not text \(e\.g\. chat\.jsonl:1 \(list\)\); "
                                                      r"--text-field names the field.*build conversations with "
                                                      r"--chat")
    else:
        (c / "b.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
        extra, want = [], r"the corpus gave no document to tokenize: 2 empty or blank documents \(e\.g\. b\.jsonl:1\)"
    r = CliRunner().invoke(main, ["build", str(c), str(tmp_path / "out"), "-t", small_tok, "-L", "16", "-q", *extra])
    assert r.exit_code == 1 and re.search(want, r.output), r.output
    assert "seq-len" not in r.output and "Traceback" not in r.output
    if case == "chat messages":  # without --text-field: the field that holds the messages, and --chat
        r = CliRunner().invoke(main, ["build", str(c), str(tmp_path / "out"), "-t", small_tok, "-L", "16", "-q"])
        assert r.exit_code == 1 and "'messages' holds chat messages: build conversations with --chat" in r.output


def test_summary_alerts_say_what_is_true_of_the_packing(small_tok):
    """bestfit's padding alert no longer recommends bestfit ('about 2% padding' beside 33.7%); a
    one-token --seq-len is said; --workers' help gives the shares the build uses."""
    from helixtok.inspect.summary import alerts

    m = {"packing": "bestfit", "seq_len": 2048, "min_tail_len": 0,
         "totals": {"documents": 10, "tokens": 1000, "dropped_documents": 0, "dropped_tokens": 0,
                    "pad_tokens": 3000, "chunks": 2}}
    [line] = alerts(m)
    assert line.startswith("73.2% of the stored tokens are padding: bestfit never cuts a document") and "about 2%" not in line
    assert "--pack bestfit" not in line
    m.update(packing="document", min_tail_len=512)
    [line] = alerts(m)
    assert "--pack bestfit fills chunks with whole documents" in line and "about 2%" not in line
    m.update(packing="packed", seq_len=1, min_tail_len=None, totals={**m["totals"], "pad_tokens": 0, "chunks": 1000})
    assert alerts(m) == ["--seq-len 1: each chunk is one token, with no next-token target inside it; fine for "
                         "looking at ids, not for training: build with the context length you train at"]
    r = CliRunner().invoke(main, ["build", "--help"])
    assert "per 16 MiB of input with fastokens" in " ".join(r.output.split()) and "64 MiB" not in r.output


def test_an_earlier_output_folder_inside_the_corpus_is_left_out_with_a_note(tmp_path, small_corpus, small_tok):
    """A build into corpus/out, then another of corpus/ elsewhere: the first's dataset (and an
    unfinished build's folder) is not read as text -- it broke the build with a --text-field error
    -- but left out with a counted warning; the dataset is the corpus's own."""
    c = tmp_path / "c"
    shutil.copytree(small_corpus, c)
    ref = tmp_path / "ref"
    args = ["-t", small_tok, "-L", "16", "-q", "-j", "1"]
    assert CliRunner().invoke(main, ["build", str(c), str(ref), *args]).exit_code == 0
    assert CliRunner().invoke(main, ["build", str(c), str(c / "out"), *args]).exit_code == 0
    (c / "half" / ".helixtok-partial").mkdir(parents=True)
    (c / "half" / ".helixtok-partial" / "plan.json").write_text("{}")
    r = CliRunner().invoke(main, ["build", str(c), str(tmp_path / "again"), *args])
    assert r.exit_code == 0, r.output
    assert "2 x helixtok dataset" in r.output
    m = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert m["warnings"]["helixtok_dataset"] == {"count": 2, "examples": ["half", "out"]}
    assert m["splits"] == json.loads((ref / "manifest.json").read_text())["splits"]


def test_documents_dropped_by_default_are_the_summarys_first_line(tmp_path, small_tok):
    """--pack document drops documents shorter than --min-tail-len by default: the summary's first
    line says how many and that --pack bestfit keeps every document (it came last, after the table)."""
    c = tmp_path / "c"
    c.mkdir()
    (c / "a.jsonl").write_text("".join(json.dumps({"text": f"short document {i}"}) + "\n" for i in range(30))
                               + json.dumps({"text": "a longer one " * 200}) + "\n")
    r = CliRunner().invoke(main, ["build", str(c), str(tmp_path / "out"), "-t", small_tok, "-L", "64", "-q",
                                  "--pack", "document"])
    assert r.exit_code == 0, r.output
    assert re.match(r"warning: 96\.8% of documents \(30\) and [\d.]+% of tokens were dropped: document packing",
                    " ".join(r.output.split()))  # (the console wraps the line)
    assert "--pack bestfit keeps every document whole" in " ".join(r.output.split())


def test_the_html_reports_source_chart_names_the_top_level_files(tmp_path, small_tok):
    """Files directly in the corpus folder are the source "." in the manifest; the chart says so in
    words (its one bar was labelled '.')."""
    c = tmp_path / "c"
    c.mkdir()
    (c / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 50)
    out, page = tmp_path / "out", tmp_path / "r.html"
    assert CliRunner().invoke(main, ["build", str(c), str(out), "-t", small_tok, "-L", "16", "-q"]).exit_code == 0
    assert list(json.loads((out / "manifest.json").read_text())["sources"]) == ["."]
    r = CliRunner().invoke(main, ["info", str(out), "--html", str(page)])
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert "(top-level files)</text>" in text and ">.</text>" not in text


@pytest.mark.parametrize("how", [["-m", "helixtok.cli"], ["-m", "helixtok"]])
def test_ctrl_c_while_python_m_imports_the_command_line_is_one_line(tmp_path, how):
    """`python -m helixtok.cli` (and `python -m helixtok`) have the helixtok command's guard: a
    Ctrl-C while the command line imports exits 130 with one line (it was a 13-line traceback).
    The Ctrl-C arrives, deterministically, from inside the import of click (a stand-in package)."""
    import signal as sig

    fake = tmp_path / "fake" / "click"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), root])}
    r = subprocess.run([sys.executable, *how, "--version"], capture_output=True, text=True, env=env, timeout=60,
                       preexec_fn=lambda: sig.signal(sig.SIGINT, sig.SIG_DFL))  # as from a terminal
    assert r.returncode == 130, (r.returncode, r.stderr)
    assert r.stderr.strip() == "interrupted before anything started" and "Traceback" not in r.stderr


def test_output_cut_short_by_its_reader_ends_quietly(dev_packed):
    """`helixtok show OUT | head -1`: the reader going away is no error (it printed 'Error: Broken
    pipe'): exit 141 as Unix tools do, and nothing on stderr."""
    import subprocess
    import sys

    # 100 chunks of 512 tokens: far more than a pipe holds, so show writes after head has gone
    chunks = " ".join(map(str, range(100)))
    p = subprocess.run(f"set -o pipefail; {sys.executable} -m helixtok show {dev_packed} {chunks} | head -c 10",
                       shell=True, capture_output=True, text=True, executable="/bin/bash")
    assert p.stdout == "=== chunk " and p.stderr == "" and p.returncode == 141


def test_a_ctrl_c_inside_a_finalizer_still_stops_the_command_in_one_line(tmp_path):
    """Python drops a KeyboardInterrupt raised inside a __del__ with a traceback ('Exception ignored
    in: <function ZipFile.__del__ ...>', seen under load in the Ctrl-C stress test, the build then
    going on to the end).  The command sends it again: it stops with the one line and exit 130.
    The Ctrl-C lands in a finalizer deterministically: a command whose work drops such an object."""
    code = ("import sys, time, click\n"
            "from helixtok.cli import entry, common\n"
            "class Finalized:\n"
            "    def __del__(self):\n"
            "        raise KeyboardInterrupt  # as a SIGINT arriving while it runs\n"
            "@click.command()\n"
            "@common.handle_errors\n"
            "def work():\n"
            "    Finalized()\n"
            "    time.sleep(10)\n"
            "    print('went on')\n"
            "entry.keep_interrupts()\n"
            "work()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout == "" and r.stderr == "\ninterrupted; rerun the same command to resume\n", r.stderr
    assert r.returncode == 130


@pytest.mark.parametrize("how", [["-m", "helixtok.cli"], ["-m", "helixtok"]])
def test_ctrl_c_while_the_interpreter_shuts_down_after_a_command_is_no_traceback(tmp_path, how):
    """A Ctrl-C that arrives once the command has ended, while Python shuts down (joining threads,
    atexit), ends it by the signal: no 'Exception ignored in ... KeyboardInterrupt' traceback from
    Python's own shutdown code (seen under load in the Ctrl-C stress test).  The Ctrl-C comes,
    deterministically, from an atexit callback (a sitecustomize registers it first: it runs last)."""
    import signal as sig

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import atexit, os, signal\n"
                                          "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), root])}
    r = subprocess.run([sys.executable, *how, "--version"], capture_output=True, text=True, env=env, timeout=60,
                       preexec_fn=lambda: sig.signal(sig.SIGINT, sig.SIG_DFL))  # as from a terminal
    assert "helixtok, version" in r.stdout
    assert r.returncode == -sig.SIGINT and r.stderr == "", (r.returncode, r.stderr)


def test_a_tokenizer_config_passed_for_the_tokenizer_and_an_export_into_a_new_folder(tmp_path, small_corpus, small_tok):
    """Issue 63.11: -t tokenizer_config.json is one line naming the tokenizer.json beside it; `export
    llmc` into a folder that does not exist yet makes it, as the other exports do."""
    import shutil

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(small_tok, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(tmp_path / "o"), "-t",
                                  str(folder / "tokenizer_config.json"), "-L", "16", "-q"])
    assert r.exit_code == 1 and r.stderr.strip() == (
        f"Error: {folder / 'tokenizer_config.json'}: the tokenizer's settings (special tokens, chat template), not the "
        f"tokenizer; pass the tokenizer.json beside it: --tokenizer {folder / 'tokenizer.json'}")
    assert CliRunner().invoke(main, ["build", str(small_corpus), str(tmp_path / "o"), "-t", str(folder), "-L", "16",
                                     "-q"]).exit_code == 0
    r = CliRunner().invoke(main, ["export", "llmc", str(tmp_path / "o"), str(tmp_path / "new" / "sub" / "train.bin")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "new" / "sub" / "train.bin").stat().st_size > 1024


def test_a_text_build_imports_nothing_heavy_it_does_not_use(tmp_path, small_tok):
    """Issue 58.4: `helixtok build` of text files with -j 1 loads no torch, pyarrow, fsspec, ray,
    jinja2, transformers or datasets in its process (measured: `python -X importtime -m helixtok
    build ...`: numpy, tokenizers' and fastokens' modules, rich and orjson are what it imports)."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("hello world " * 200)
    code = ("import sys\nfrom helixtok.cli.entry import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "heavy = ('torch', 'pyarrow', 'fsspec', 'ray', 'jinja2', 'transformers', 'datasets', 's3fs')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code, "build", str(tmp_path / "c"), str(tmp_path / "out"), "-t", small_tok,
                        "-L", "16", "-j", "1", "-q"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_the_summary_and_the_html_report_name_sources_alike(tmp_path, small_corpus, small_tok):
    """Issue 63.11: the files directly in the corpus folder are one source, named "(top-level files)"
    by the build's summary, `info` and the HTML report alike (the manifest's key is ".")."""
    sub = small_corpus / "more"
    sub.mkdir()
    (small_corpus / "a.txt").rename(sub / "a.txt")
    out, page = tmp_path / "out", tmp_path / "r.html"
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(out), "-t", small_tok, "-L", "16", "-j", "1"])
    assert r.exit_code == 0, r.output
    said = [line for line in r.stdout.splitlines() if line.startswith("sources: ")]  # (the summary: a result)
    assert said and said[0].startswith("sources: (top-level files) ") and "; more " in said[0]
    assert json.loads((out / "manifest.json").read_text())["sources"].keys() == {".", "more"}
    r = CliRunner().invoke(main, ["info", str(out), "--html", str(page)])
    assert r.exit_code == 0 and "sources: (top-level files) " in r.output
    assert "(top-level files)" in page.read_text() and ">.<" not in page.read_text()
