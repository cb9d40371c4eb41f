"""The Python snippets of README.md and docs/training.md, run as written against a real build and DataLoader."""

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import give_memory_back
from helixtok.read.sampler import ChunkSampler

ROOT = Path(__file__).resolve().parent.parent


def snippets(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)


def snippet(doc: str, marker: str) -> str:
    found = [s for s in snippets(doc) if marker in s]
    assert len(found) == 1, f"{doc}: {len(found)} python snippets contain {marker!r}"
    return found[0]


class TinyLM(torch.nn.Module):
    """What the snippets call `model`: an HF-style causal LM (model(**batch).loss, labels shifted inside).
    Its output is a plain namespace: a class made per call would keep every step's graph until a GC pass
    (2.8 GB here)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 16)
        self.head = torch.nn.Linear(16, vocab)
        self.batches = 0

    def forward(self, input_ids, labels, attention_mask, **_):
        self.batches += 1
        # The next token at every 16th position: the loops' arithmetic is under test, and the full
        # (batch, seq, vocab) logits cost ~60 ms a batch on a CPU.
        logits = self.head(self.emb(input_ids[:, :-1:16]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1::16].flatten())
        return SimpleNamespace(loss=loss)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, dev_corpus, tokenizer_path):
    """A folder laid out as the snippets assume: out/ (with a val split), tokenizer.json, web/, code/."""
    from helixtok.pipeline.builder import build
    from helixtok.pipeline.config import BuildConfig

    d = tmp_path_factory.mktemp("docs")
    build([str(dev_corpus / "txt")], str(d / "out"), tokenizer_path,
          BuildConfig(seq_len=256, workers=2, val_fraction=0.05))
    (d / "tokenizer.json").write_bytes(Path(tokenizer_path).read_bytes())
    (d / "web").symlink_to(d / "out")
    build([str(dev_corpus / "jsonl")], str(d / "code"), tokenizer_path, BuildConfig(seq_len=256, workers=2))
    return d


@pytest.fixture(scope="module")
def recipe_out(tmp_path_factory, dev_corpus, tokenizer_path) -> str:
    """A few hundred chunks: enough for partial accumulation windows and a resume, quick to train on."""
    import gzip

    from helixtok.pipeline.builder import build
    from helixtok.pipeline.config import BuildConfig

    d = tmp_path_factory.mktemp("recipes")
    with gzip.open(dev_corpus / "jsonl" / "part0.jsonl.gz", "rt", encoding="utf-8") as fh:
        (d / "some.jsonl").write_text("".join(fh.readlines()[:8]), encoding="utf-8")
    build([str(d / "some.jsonl")], str(d / "out"), tokenizer_path, BuildConfig(seq_len=128, workers=1))
    return str(d / "out")


def run(code: str, where: Path, monkeypatch, **names) -> dict:
    monkeypatch.chdir(where)
    ns = dict(names)
    exec(compile(code, "<snippet>", "exec"), ns)
    return ns


def test_readme_quick_example_and_training_loop(workdir, recipe_out, tokenizer_path, monkeypatch, tmp_path):
    """The README's loop is a complete script: it runs as written (its own tiny model, tqdm with the
    exact total) and the schedule ends on stats' last step; stopped mid-epoch and run again it goes
    on from its checkpoint and ends with the very weights of the uninterrupted run.  (It used to
    be a fragment run with a `model` handed in.)"""
    import shutil

    import tqdm

    ns = run(snippet("README.md", 'ds = MemmapChunkDataset("out/")'), workdir, monkeypatch)
    assert len(ns["ds"]) > 0
    script = snippet("README.md", "LambdaLR")
    for d in ("whole", "stopped"):  # a few hundred chunks: three runs of the script stay quick
        (tmp_path / d).mkdir()
        (tmp_path / d / "out").symlink_to(recipe_out)
        shutil.copy(tokenizer_path, tmp_path / d / "tokenizer.json")
    totals, real = [], tqdm.tqdm

    def counted(it, **kw):
        totals.append((len(it), kw.get("initial"), kw.get("total")))
        return real(it, **kw)
    monkeypatch.setattr(tqdm, "tqdm", counted)
    whole = run(script, tmp_path / "whole", monkeypatch)
    st = whole["st"]
    assert totals == [(st.batches_per_epoch, 0, st.batches_per_epoch)]  # the exact total
    assert whole["sched"].last_epoch == st.total_optimizer_steps == -(-st.batches_per_epoch // whole["G"])
    assert whole["opt"].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # the schedule ended on the last step

    class Stop(Exception):
        pass

    def stopping(it, **kw):  # the process dies after 2 optimizer steps and 1 more batch
        for k, x in enumerate(real(it, **kw)):
            if k == 2 * whole["G"] + 1:
                raise Stop
            yield x
    monkeypatch.setattr(tqdm, "tqdm", stopping)
    with pytest.raises(Stop):
        run(script, tmp_path / "stopped", monkeypatch)
    monkeypatch.setattr(tqdm, "tqdm", counted)
    totals.clear()
    resumed = run(script, tmp_path / "stopped", monkeypatch)
    # The rest of the epoch, exactly, shown from where it resumed (issue 41: the bar said 0/25, not 16/41).
    assert totals == [(st.batches_per_epoch - 2 * whole["G"], 2 * whole["G"], st.batches_per_epoch)]
    assert resumed["sched"].last_epoch == st.total_optimizer_steps
    for k, v in whole["model"].state_dict().items():
        assert torch.equal(v, resumed["model"].state_dict()[k]), k
    del ns, whole, resumed
    give_memory_back()  # three training runs in this process: ~230 MB of heap the trainer test would stack on


def test_training_md_trainer_swap_resume_and_mixture(workdir, monkeypatch):

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(workdir / "tokenizer.json")).get_vocab_size()
    model = TinyLM(vocab)
    cfg = SimpleNamespace(seed=3, batch_size=8, grad_accum=2, epochs=2, warmup_ratio=0.1)
    seen = {}

    def get_cosine_schedule_with_warmup(optimizer, warmup, total):  # what transformers' helper is given
        seen.update(warmup=warmup, total=total)

    def tqdm(total):
        seen["progress_total"] = total

    world_size = 2
    for rank in range(world_size):
        ns = run(snippet("docs/training.md", "StreamingTokenizingDataset"), workdir, monkeypatch, cfg=cfg,
                 rank=rank, world_size=world_size, optimizer=None, tqdm=tqdm,
                 get_cosine_schedule_with_warmup=get_cosine_schedule_with_warmup)
        st = ns["st"]
        assert seen == {"warmup": st.warmup_steps, "total": st.total_optimizer_steps,
                        "progress_total": st.total_optimizer_steps}
        assert len(ns["val"]) > 0
    # The two ranks' samplers cover the epoch exactly once (the train split is padded by wrap-around).
    n = len(ns["dataset"])
    per_rank = [list(ChunkSampler(ns["dataset"], seed=3, rank=r, world_size=2)) for r in range(2)]
    assert sorted(set(per_rank[0] + per_rank[1])) == list(range(n))

    # Resume: consume 3 batches, checkpoint as the doc says, restore in a "fresh" sampler.
    loader, sampler = ns["loader"], ns["sampler"]
    full = list(sampler)
    batch_in_epoch = 3
    fresh = ChunkSampler(ns["dataset"], seed=3, rank=1, world_size=2)
    run(snippet("docs/training.md", "checkpoint.pt"), workdir, monkeypatch, sampler=fresh, cfg=cfg,
        batch_in_epoch=batch_in_epoch, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        torch=torch)
    assert list(fresh) == full[batch_in_epoch * cfg.batch_size:]
    assert len(loader) == st.batches_per_epoch

    # Mixture: the global batch of B x W holds floor/ceil of weight x batch from each source.
    B, W = 4, 2
    ns = run(snippet("docs/training.md", "MixtureDataset"), workdir, monkeypatch, B=B, W=W, E=2)
    mix = ns["mix"]
    web = len(mix.datasets[0])
    for step in range(len(mix) // (B * W)):
        from_web = sum(mix.locate(i)[0] == 0 for i in range(step * B * W, (step + 1) * B * W))
        assert from_web in (int(0.8 * B * W), int(0.8 * B * W) + 1)
    assert ns["steps"] == 2 * len(ns["loader"]) and mix.counts[0] <= web


def test_training_md_document_masking_snippet(workdir, monkeypatch):
    from helixtok.read.masking import block_causal_mask

    ns = run(snippet("docs/training.md", "document_masking=True"), workdir, monkeypatch)
    b = ns["batch"]
    assert ns["mask"].shape == (8, 1, 256, 256) and torch.equal(ns["mask"], block_causal_mask(b["document_ids"]))
    assert b["cu_seqlens"][-1] == 8 * 256 and b["max_seqlen"] <= 256


def test_training_md_three_stage_mixture_runs_end_to_end(workdir, monkeypatch, tmp_path):
    """The three-stage snippet runs as written (100 steps, a checkpoint at 30 and its resume) and the
    file form beside it gives `helixtok stats --mixture` and `info --html` the same run."""
    import json as _json

    from click.testing import CliRunner

    from helixtok.cli import main

    ns = run(snippet("docs/training.md", "Stage({\"web\": 0.9"), workdir, monkeypatch)
    assert ns["step"] == 100 and ns["rest"] == 70
    spec = re.findall(r"```json\n(.*?)```", (ROOT / "docs/training.md").read_text(), flags=re.S)[-1]
    (workdir / "mix.json").write_text(spec)
    r = CliRunner().invoke(main, ["stats", "--mixture", str(workdir / "mix.json"), "-b", "8", "--json"])
    assert r.exit_code == 0, r.output
    st = _json.loads(r.output)
    assert st == ns["mix"].stats() and [s["steps"] for s in st["stages"]] == [20, 60, 20]
    page = tmp_path / "mix.html"
    r = CliRunner().invoke(main, ["info", str(workdir / "mix.json"), "--html", str(page)])
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert text.count("<rect") == 6 and "stage 2, code: 128 samples (80.0%)" in text


def test_training_md_repack_snippet(workdir, monkeypatch):
    """The repack snippet runs as written (persistent workers, two epochs) and epoch 1's chunk 0 is
    not epoch 0's."""
    ns = run(snippet("docs/training.md", "repack=True"), workdir, monkeypatch)
    a, b = ns["firsts"]
    assert len(a) == 256 and not torch.equal(a, b)


def test_trainer_recipes_run_the_steps_stats_predicts_and_lightning_resumes_exactly(recipe_out, tmp_path):
    """scripts/recipe_hf_trainer.py: transformers.Trainer with ChunkSampler; 3 does not divide the
    batches, so the epoch-end partial accumulation window counts (as stats assumes).
    scripts/recipe_lightning.py: use_distributed_sampler=False with ChunkSampler; stopped after 5
    optimizer steps and resumed from the Lightning checkpoint, it trains on exactly the samples,
    in order, of the epoch ChunkSampler deals (what an uninterrupted run trains on), and runs
    the optimizer steps `helixtok stats` predicts.  The Trainer runs while Lightning does: each
    child spends most of its time importing its framework (~6 s)."""
    import importlib.util
    import json
    import subprocess
    import sys

    for lib in ("transformers", "accelerate", "lightning"):
        if importlib.util.find_spec(lib) is None:
            pytest.skip(f"{lib} is not installed (it is in the [test] extra)")
    from helixtok import ChunkSampler, MemmapChunkDataset
    from helixtok.read.stats import stats_for

    out = recipe_out
    B = next(b for b in (8, 12, 16) if stats_for(out, batch_size=b).batches_per_epoch % 3)
    st = stats_for(out, batch_size=B, grad_accum=3)  # a partial window at the epoch end
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # two children on the cores: no intra-op threads
    hf = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "recipe_hf_trainer.py"), out, "--batch-size",
                           str(B), "--grad-accum", "3", "--output-dir", str(tmp_path / "hf")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=one_thread)

    def lightning(*extra):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "recipe_lightning.py"), out, "--batch-size",
                            str(B), "--grad-accum", "3", *map(str, extra)], capture_output=True, text=True,
                           env=one_thread)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "not resumable" not in r.stderr  # the recipe says why the exact resume needs no such warning
        return r.stdout

    try:
        lightning("--stop-after", 5, "--ckpt", tmp_path / "c.ckpt", "--seen", tmp_path / "a.json")
        resumed = lightning("--resume", tmp_path / "c.ckpt", "--seen", tmp_path / "b.json")
        hf_out, hf_err = hf.communicate(timeout=300)
    finally:
        hf.kill()
    assert hf.returncode == 0, hf_err[-3000:]
    assert f"optimizer steps: Trainer ran {st.total_optimizer_steps}, helixtok stats said " \
           f"{st.total_optimizer_steps}" in hf_out
    assert f"Lightning ran {st.total_optimizer_steps}, helixtok stats said {st.total_optimizer_steps}" in resumed
    ds = MemmapChunkDataset(out)
    epoch = ChunkSampler(ds, seed=0)  # the recipe's sampler, epoch 0: the uninterrupted run's samples
    f = [int(ds[i]["input_ids"][0]) for i in epoch]
    a, b = (json.load(open(tmp_path / n)) for n in ("a.json", "b.json"))
    assert len(a) == 5 * 3 * B and a + b == f and len(b) > 3 * B  # more than a window after the resume


def test_scripts_import_only_what_helixtok_has():
    """The benchmark and recipe scripts run outside the suite: a helixtok name they import that
    was renamed or moved would only fail when someone runs them."""
    import ast
    import importlib

    missing = []
    for path in sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "helixtok":
                module = importlib.import_module(node.module)
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                            if not hasattr(module, a.name) and not _submodule(f"{node.module}.{a.name}")]
    assert missing == []


def _submodule(name: str) -> bool:
    """`from helixtok.pipeline import builder` names a module, which is an attribute only once imported."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_docs_name_files_and_keys_that_exist():
    """Issue 57.5: every docs/NAME.md the docs, the README or a command's help name exists, and every
    trainable-token key the docs name is one the manifest or `helixtok stats --json` has."""
    from helixtok.pipeline.unit import CHAT_COUNTS
    from helixtok.read.stats import Stats

    texts = {p: p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                                         *(ROOT / "helixtok").rglob("*.py")]}
    named = {(m, p.name) for p, t in texts.items() for m in re.findall(r"docs/([A-Za-z0-9_-]+\.md)", t)}
    assert named and not [(m, where) for m, where in named if not (ROOT / "docs" / m).is_file()]
    keys = set(Stats.__dataclass_fields__) | set(CHAT_COUNTS) | {"dropped_trainable_tokens"}
    said = {k for p, t in texts.items() if p.suffix == ".md" for k in re.findall(r"`([a-z_]*trainable[a-z_]*)`", t)}
    assert said and said <= keys, said - keys


def _commands() -> dict[str, set[str]]:
    """Every helixtok command ('export llmc' for a group's) -> its long options."""
    import click

    from helixtok.cli.app import main

    def opts(cmd) -> set[str]:
        return {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts
                if o.startswith("--")} | {"--help"}

    out = {}
    for name, c in main.commands.items():
        subs = c.commands if isinstance(c, click.Group) else {}
        out.update({f"{name} {s}": opts(sc) for s, sc in subs.items()})
        out[name] = set().union(*map(opts, subs.values())) if subs else opts(c)
    return out


def _doc_code() -> list[tuple[str, str]]:
    """(file, text) of each line of the docs' code blocks and each inline code span."""
    found = []
    for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        inside, prose = False, []
        for line in p.read_text().splitlines():
            if line.lstrip().startswith("```"):
                inside = not inside
            elif inside:
                found.append((p.name, line))
            else:
                prose.append(line)
        found += [(p.name, s) for s in re.findall(r"`([^`]+)`", "\n".join(prose))]
    return found


OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# Tools the docs show beside helixtok: their options are theirs.
FOREIGN = re.compile(r"^\W*(sbatch|pip|ray|torchrun|jq|git|scontrol|kubectl|\S*python -m pip)\b")
SLURM = {"--dependency"}  # sbatch's, named in prose


def test_docs_name_only_commands_and_options_that_exist():
    """Issue 63.13: every `helixtok CMD` the README and docs show is a command, every option after it
    is that command's, every other option they name is some command's or a script's (scripts/NAME
    lines are checked against that script's text; one named alone, a command's or a script's)."""
    cmds = _commands()
    every = set().union(*cmds.values())
    scripts = {p.name: p.read_text() for p in (ROOT / "scripts").iterdir()}
    bad, checked = [], 0
    for where, code in _doc_code():
        for m in re.finditer(r"\bhelixtok ((?:export|import) [a-z]+|[a-z][a-z-]*)((?:[^|;&`]|\|\|)*)", code):
            cmd, rest = m[1], m[2]
            if cmd not in cmds:
                # prose in a span ("helixtok is ..."): only a word at the start of a span is a command
                if code.lstrip("$ ").startswith(f"helixtok {cmd}"):
                    bad.append((where, f"no command {cmd!r}", code))
                continue
            checked += 1
            bad += [(where, f"{cmd} has no {o}", code) for o in OPTION.findall(rest) if o not in cmds[cmd]]
            code = code.replace(m[0], " ")
        for m in re.finditer(r"scripts/([\w.]+)((?:[^|;&`])*)", code):
            text = scripts.get(m[1])
            if text is None:
                bad.append((where, f"no script {m[1]}", code))
                continue
            checked += 1
            bad += [(where, f"{m[1]} has no {o}", code) for o in OPTION.findall(m[2]) if o not in text]
            code = code.replace(m[0], " ")
        if not FOREIGN.search(code):
            bad += [(where, f"no command or script has {o}", code) for o in OPTION.findall(code)
                    if o not in every | SLURM and not any(re.search(rf"['\"\s]{o}\b", t) for t in scripts.values())]
    assert checked > 40 and not bad, bad


def test_docs_name_only_json_keys_that_exist(workdir):
    """Issue 63.13: a key the docs name beside `--json` is one `stats --json` or `info --json` prints."""
    import json
    import subprocess
    import sys

    def keys(v) -> set[str]:
        if isinstance(v, dict):
            return set(v) | {k for x in v.values() for k in keys(x)}
        return {k for x in v for k in keys(x)} if isinstance(v, list) else set()

    printed = set()
    for args in (["stats", "--json"], ["stats", "--json", "--max-tokens", "1024", "--max-len", "256"],
                 ["info", "--json"]):
        r = subprocess.run([sys.executable, "-m", "helixtok", args[0], str(workdir / "out"), *args[1:]],
                           capture_output=True, text=True, cwd=workdir, check=True)
        printed |= keys(json.loads(r.stdout))
    named = set()
    for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for sentence in re.split(r"(?<=[.;:])\s|\n\n", p.read_text()):
            after = sentence.partition("--json")[2]
            named |= {(p.name, k) for k in re.findall(r"`([a-z][a-z0-9]*_[a-z0-9_]+)`", after)}
    # Python arguments named beside a key: DataLoader's drop_last, collate_varlen's pad_to.
    named = {(w, k) for w, k in named if k not in ("drop_last", "pad_to")}
    assert len(named) >= 3 and not [(w, k) for w, k in named if k not in printed], sorted(printed)
