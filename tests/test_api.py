"""The Python API is the command line's equal: helixtok.build with keyword options, an HF datasets.Dataset as corpus."""

import filecmp
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

import helixtok
from helixtok.cli import main
from helixtok.format.errors import ConfigError


def test_build_takes_keywords_and_gives_what_the_command_line_gives(tmp_path, small_corpus, small_tok):
    seen = []
    m = helixtok.build(small_corpus, tmp_path / "api", small_tok, seq_len=16, workers=1, val_fraction=0.2,
                       on_progress=seen.append)
    assert isinstance(m, helixtok.pipeline.builder.Built) and m.reused_units == 0 and m["seq_len"] == 16
    assert seen and seen[-1].bytes_done == seen[-1].bytes_total
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(tmp_path / "cli"), "-t", small_tok, "-L", "16",
                                  "-j", "1", "-q", "--val-fraction", "0.2"])
    assert r.exit_code == 0, r.output
    for n in os.listdir(tmp_path / "cli"):
        assert filecmp.cmp(tmp_path / "api" / n, tmp_path / "cli" / n, shallow=False), n
    # A BuildConfig and keywords together: the keywords win.
    cfg = helixtok.BuildConfig(seq_len=8, workers=1)
    assert helixtok.build([str(small_corpus)], tmp_path / "both", small_tok, cfg, seq_len=32)["seq_len"] == 32
    with pytest.raises(ConfigError, match="seq_len must be >= 1"):
        helixtok.build(small_corpus, tmp_path / "bad", small_tok, seq_len=0)


def test_a_datasets_dataset_is_a_corpus(tmp_path, small_tok):
    """Its Arrow cache files are read (run in a child process: importing datasets costs pytest
    ~200 MB); one only in memory is refused with what to do."""
    pytest.importorskip("datasets")
    code = (
        "import json, sys, datasets, helixtok\n"
        "rows = [f'row {i} ' + 'hello world ' * (i % 5 + 1) for i in range(50)]\n"
        "mem = datasets.Dataset.from_dict({'text': rows})\n"
        "try:\n"
        "    helixtok.build(mem, sys.argv[1] + '/mem', sys.argv[2], seq_len=8, workers=1)\n"
        "except helixtok.format.errors.ConfigError as e:\n"
        "    print('refused:', e)\n"
        "mem.save_to_disk(sys.argv[1] + '/saved')\n"
        "ds = datasets.load_from_disk(sys.argv[1] + '/saved')\n"
        "m = helixtok.build(ds, sys.argv[1] + '/out', sys.argv[2], seq_len=8, workers=1)\n"
        "print(json.dumps(m['totals']))\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path), small_tok], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    refused, totals = p.stdout.splitlines()
    assert refused.startswith("refused: the datasets.Dataset is in memory only") and "save_to_disk" in refused
    assert json.loads(totals)["documents"] == 50


def test_the_readme_api_snippet_runs_as_written(tmp_path, small_corpus, small_tok, monkeypatch, capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = next(s for s in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "helixtok.build(" in s)
    (tmp_path / "corpus").symlink_to(small_corpus)
    (tmp_path / "tokenizer.json").write_bytes(open(small_tok, "rb").read())
    monkeypatch.chdir(tmp_path)
    ns = {}
    exec(compile(code.replace("seq_len=2048", "seq_len=16"), "<readme>", "exec"), ns)
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{ns['m']['totals']['chunks']} 0" and any(ln.startswith("tokenize ") for ln in out)


def test_an_unknown_keyword_is_named_with_the_nearest_option_and_the_list(tmp_path, small_corpus, small_tok):
    """helixtok.build(..., pack="bestfit") was a bare TypeError from the dataclass (issue 41)."""
    from helixtok.format.errors import ConfigError

    with pytest.raises(ConfigError, match=r"unknown keyword 'pack' \(did you mean 'packing'\?\); its options: add_bos, "):
        helixtok.build([str(small_corpus)], str(tmp_path / "o"), small_tok, pack="bestfit")
    assert not (tmp_path / "o").exists()


def test_errors_name_keywords_in_python_and_options_on_the_command_line(tmp_path, small_corpus, small_tok):
    """The same refusal says `pass overwrite=True` to a caller of helixtok.build and `pass
    --overwrite` on the command line (issue 41: the Python API spoke CLI)."""
    from helixtok.format.errors import ConfigError

    helixtok.build([str(small_corpus)], str(tmp_path / "o"), small_tok, seq_len=16, workers=1)
    with pytest.raises(ConfigError, match=r"\(seq_len: 16 -> 32\); pass overwrite=True to replace it$"):
        helixtok.build([str(small_corpus)], str(tmp_path / "o"), small_tok, seq_len=32, workers=1)
    with pytest.raises(ConfigError, match=r"^packing must be one of packed, document, bestfit, got 'best'$"):
        helixtok.build([str(small_corpus)], str(tmp_path / "p"), small_tok, packing="best")
    r = CliRunner().invoke(main, ["build", str(small_corpus), str(tmp_path / "o"), "-t", small_tok, "-L", "32", "-q"])
    assert r.exit_code == 1 and "(seq_len: 16 -> 32); pass --overwrite to replace it" in r.output, r.output


def test_a_program_beside_the_clone_imports_the_package_not_the_clones_folder(tmp_path):
    """Run in the folder that holds a clone named `helixtok`, `import helixtok` used to find the
    clone's root as a namespace package (`module 'helixtok' has no attribute 'build'`, issue 41);
    the root's __init__.py hands the import to the package inside."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.symlink(root, tmp_path / "helixtok")
    code = ("import sys; sys.path.insert(0, ''); import helixtok, helixtok.pipeline.builder; "
            "print(helixtok.build is helixtok.pipeline.builder.build, helixtok.__version__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    from helixtok import __version__

    assert r.stdout.split() == ["True", __version__]
