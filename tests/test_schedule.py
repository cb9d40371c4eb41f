"""Mixture schedules: stages on whole steps, per-batch proportions, no repeat before coverage, caps,
exact counts, resume at any position (elastic too), schedule changes after the run's position only."""

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from helixtok import MemmapChunkDataset, Mixture, Stage
from helixtok.cli import main
from helixtok.format.errors import ConfigError


class Source(list):
    """A source of `n` distinct items (name, chunk index)."""

    def __init__(self, name, n):
        super().__init__((name, j) for j in range(n))


@st.composite
def schedules(draw):
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    sizes = {n: draw(st.integers(1, 40)) for n in names}
    W = draw(st.sampled_from([1, 2, 4]))
    B = W * draw(st.integers(1, 4))
    ends, step = [], 0
    for _ in range(draw(st.integers(1, 3))):
        step += draw(st.integers(1, 12))
        ends.append(step)
    stages = []
    for end in ends:
        w = {n: draw(st.sampled_from([0, 0.1, 0.25, 1, 3])) for n in names}
        if not any(w.values()):
            w[names[0]] = 1
        stages.append(Stage(w, until_steps=end))
    return names, sizes, stages, B, W


def _build(names, sizes, stages, B, cap=None, seed=0):
    return Mixture({n: Source(n, sizes[n]) for n in names}, stages, batch_size=B, seed=seed, max_epochs=cap)


@settings(max_examples=150, deadline=None)
@given(schedules(), st.data())
def test_every_batch_every_stage_and_every_pass_hold_the_rule(sch, data):
    names, sizes, stages, B, W = sch
    mix = _build(names, sizes, stages, B)
    items = [mix[i] for i in range(len(mix))]
    assert len(mix) == stages[-1].until_steps * B  # the run ends on a whole step
    for k, p in enumerate(mix.plans):
        assert p.start % B == 0 and p.end % B == 0
        assert p.end // B == stages[k].until_steps
        for b in range(p.start, p.end, B):  # every global batch: floor or ceil of weight x B of each source
            got = {n: sum(1 for x in items[b: b + B] if x[0] == n) for n in names}
            for s, n in enumerate(names):
                assert np.floor(p.weights[s] * B + 1e-9) <= got[n] <= np.ceil(p.weights[s] * B - 1e-9)
    for n in names:  # each source's stream: every chunk once per pass, before any repeats
        seen = [j for x, j in items if x == n]
        size = sizes[n]
        for a in range(0, len(seen), size):
            part = seen[a: a + size]
            assert len(set(part)) == len(part)
        assert sum(c[n] for c in mix.counts) == len(seen)
    # stats = what the samplers and DataLoaders yield, per rank
    st_ = mix.stats(world_size=W)
    b = B // W
    loaders = [DataLoader(mix, batch_size=b, sampler=mix.sampler(r, W), collate_fn=list) for r in range(W)]
    assert all(len(dl) == st_["batches_per_rank"] and len(dl.sampler) == st_["samples_per_rank"] for dl in loaders)
    per_rank = [[x for batch in dl for x in batch] for dl in loaders]
    for step in range(len(mix) // B):  # rank r's step-k batch is its share of global batch k
        glob = sorted(x for r in range(W) for x in per_rank[r][step * b: (step + 1) * b])
        assert glob == sorted(items[step * B: (step + 1) * B])
    assert {n: s["samples"] for n, s in st_["sources"].items()} == {n: sum(x[0] == n for x in items) for n in names}


@settings(max_examples=80, deadline=None)
@given(schedules(), st.data())
def test_a_resume_at_any_position_and_world_size_gives_the_uninterrupted_run(sch, data):
    names, sizes, stages, B, W = sch
    mix = _build(names, sizes, stages, B)
    W2 = data.draw(st.sampled_from([w for w in (1, 2, 4) if B % w == 0]))
    whole = [mix[i] for i in range(len(mix))]
    steps = len(mix) // B
    at = data.draw(st.integers(0, steps))  # optimizer steps done when the checkpoint was taken
    b = B // W
    states = []
    for r in range(W):
        s = mix.sampler(r, W)
        states.append(mix.state_dict(s, samples_consumed=at * b))
    again = _build(names, sizes, stages, B)
    rest = []
    b2 = B // W2
    for r in range(W2):
        s = again.sampler(r, W2)
        again.load_state_dict(states[0], s)
        rest.append([again[i] for i in s])
    for k in range(steps - at):
        glob = sorted(x for r in range(W2) for x in rest[r][k * b2: (k + 1) * b2])
        assert glob == sorted(whole[(at + k) * B: (at + k + 1) * B])


def test_caps_refuse_what_cannot_fit_naming_the_source():
    web, math = Source("web", 900), Source("math", 50)
    stages = [Stage({"web": 1}, until_steps=90), Stage({"web": 0.5, "math": 0.5}, until_steps=150)]
    with pytest.raises(ConfigError) as e:
        Mixture({"web": web, "math": math}, stages, batch_size=8, max_epochs={"math": 4})
    assert str(e.value) == ("source 'math' has 50 chunks; the schedule asks for 240 samples of it (4.80 epochs), "
                            "max_epochs 4 allows 200: lower its weights, shorten the stages that use it, or raise "
                            "its cap")
    m = Mixture({"web": web, "math": math}, stages, batch_size=8, max_epochs={"math": 5})
    assert m.counts == [{"web": 720, "math": 0}, {"web": 240, "math": 240}]
    with pytest.raises(ConfigError, match=r"stage 1 ends at step 90, not after stage 0 \(step 90\)"):
        Mixture({"web": web}, [Stage({"web": 1}, until_steps=90), Stage({"web": 1}, until_steps=90)], batch_size=8)
    with pytest.raises(ConfigError, match=r"stage 1 ends at step 244 \(until_tokens 1.00001e\+06 / \(batch_size 8 x seq_len 512\) rounds down to step 244\), not after stage 0"):
        Mixture({"web": web}, [Stage({"web": 1}, until_tokens=1e6), Stage({"web": 1}, until_tokens=1e6 + 10)],
                batch_size=8, seq_len=512)


def test_a_changed_schedule_resumes_only_when_the_change_is_ahead():
    web, math, code = Source("web", 900), Source("math", 60), Source("code", 70)
    first = [Stage({"web": 1}, until_steps=50), Stage({"web": 3, "math": 1}, until_steps=100),
             Stage({"math": 1, "web": 1}, until_steps=120)]
    mix = Mixture({"web": web, "math": math}, first, batch_size=8)
    s = mix.sampler()
    state = mix.state_dict(s, samples_consumed=60 * 8)  # in stage 1
    # The last stage (not begun) changes and a source is added: the run goes on, its past unchanged.
    later = first[:2] + [Stage({"math": 1, "code": 1}, until_steps=130)]
    mix2 = Mixture({"web": web, "math": math, "code": code}, later, batch_size=8)
    s2 = mix2.sampler()
    mix2.load_state_dict(state, s2)
    got = [mix2[i] for i in s2]
    assert len(got) == (130 - 60) * 8 and got[: 40 * 8] == [mix[i] for i in range(60 * 8, 100 * 8)]
    # The running stage's end or weights: refused, naming the change.
    for stages, why in (([first[0], Stage({"web": 3, "math": 1}, until_steps=110), first[2]],
                         "stage 1 (begun) ends at step 100 -> 110"),
                        ([first[0], Stage({"web": 1, "math": 1}, until_steps=100), first[2]],
                         "stage 1 (begun) weights")):
        other = Mixture({"web": web, "math": math}, stages, batch_size=8)
        with pytest.raises(ConfigError, match=r"the mixture changed since the checkpoint: " + why.replace("(", r"\(")
                           .replace(")", r"\)")):
            other.load_state_dict(state, other.sampler())
    with pytest.raises(ConfigError, match="seed 0 -> 1"):
        Mixture({"web": web, "math": math}, first, batch_size=8, seed=1).load_state_dict(state, mix.sampler())


def test_repacking_sources_give_each_pass_its_own_packing_and_stats_match_the_command(dev_packed, tmp_path):
    """A source read more than once is read with the pass as its epoch (repack=True); the mixture
    file gives `helixtok stats --mixture` the counts the Python object has."""
    ds = MemmapChunkDataset(dev_packed, repack=True, seed=3)
    n = len(ds)
    mix = Mixture({"web": ds}, [Stage({"web": 1}, until_steps=-(-2 * n // 8))], batch_size=8, seed=0)
    name, epoch, j = mix.locate(n + 5)
    assert (name, epoch) == ("web", 1)
    assert mix[n + 5]["input_ids"].tolist() == ds[(1, j)]["input_ids"].tolist()
    f = tmp_path / "mix.json"
    f.write_text(json.dumps({"seed": 0, "batch_size": 8, "sources": {"web": {"path": os.path.relpath(dev_packed, tmp_path),
                                                            "max_epochs": 3}},
                             "stages": [{"until_tokens": 8 * 512 * 10, "weights": {"web": 1}},
                                        {"until_steps": 12, "weights": {"web": 2}}]}))
    r = CliRunner().invoke(main, ["stats", "--mixture", str(f), "-b", "2", "-w", "2", "-g", "2", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    assert got["optimizer_steps"] == 12 and got["samples"] == 96 and got["samples_per_rank"] == 48
    assert [s["steps"] for s in got["stages"]] == [10, 2] and got["sources"]["web"]["samples"] == 96
    r = CliRunner().invoke(main, ["stats", "--mixture", str(f), "-b", "3", "-w", "2"])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1
    assert r.output.strip() == f"Error: {f}: batch_size 8 (global), but the command gives 6 (batch size x world size x grad accum)"
    # Without -b the file's global batch is shared out: the same counts as -b 2 -w 2 -g 2.
    r = CliRunner().invoke(main, ["stats", "--mixture", str(f), "-w", "2", "-g", "2", "--json"])
    assert r.exit_code == 0 and json.loads(r.output) == got, r.output
    r = CliRunner().invoke(main, ["stats", "--mixture", str(f), "-w", "3"])
    assert r.exit_code == 1 and r.output.strip() == (f"Error: {f}: batch_size 8 (global) does not divide into "
                                                     "--grad-accum 1 x --world-size 3; give -b (per-rank batch size)")


def test_document_masks_come_through_the_mixture_and_a_yaml_file_reads_as_json(dev_packed, dev_bestfit, tmp_path):
    """Sources read with document_masking=True give each sample its position and document ids, and
    mix.collate adds the batch's cu_seqlens, as a dataset's own collate does; the YAML form of a
    mixture file is the JSON form's run."""
    a = MemmapChunkDataset(dev_packed, document_masking=True, repack=True)
    b = MemmapChunkDataset(dev_bestfit, document_masking=True)
    mix = Mixture({"a": a, "b": b}, [Stage({"a": 1, "b": 1}, until_steps=3)], batch_size=4)
    batch = next(iter(DataLoader(mix, batch_size=4, sampler=mix.sampler(), collate_fn=mix.collate)))
    assert {"position_ids", "document_ids", "cu_seqlens", "max_seqlen"} <= set(batch)
    pos = batch["position_ids"].numpy()
    starts = [np.flatnonzero(row == 0) for row in pos]
    assert batch["cu_seqlens"].tolist() == sorted({int(r * 512 + s) for r, st in enumerate(starts) for s in st}
                                                  | {4 * 512})
    yaml = pytest.importorskip("yaml")
    spec = {"seed": 1, "batch_size": 8, "sources": {"a": os.path.relpath(dev_packed, tmp_path)},
            "stages": [{"until_steps": 5, "weights": {"a": 1}}]}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "m.json").write_text(json.dumps(spec))
    from helixtok.read.schedule import load_mixture

    assert load_mixture(str(tmp_path / "m.yaml")).stats() == load_mixture(str(tmp_path / "m.json")).stats()
    (tmp_path / "bad.yaml").write_text("sources: [")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_mixture(str(tmp_path / "bad.yaml"))


def test_a_resume_refuses_a_source_that_is_another_dataset_or_read_otherwise(dev_packed, dev_document, tmp_path):
    """A source already read that changed in what decides its samples -- its repack flag, or
    another dataset of the same chunk count -- is refused, naming it (it resumed with other
    samples); the same dataset copied to another folder resumes (its manifest is the same)."""
    import shutil

    ds = MemmapChunkDataset(dev_packed)
    stages = [Stage({"web": 1}, until_steps=20)]
    mix = Mixture({"web": ds}, stages, batch_size=8)
    s = mix.sampler()
    state = json.loads(json.dumps(mix.state_dict(s, samples_consumed=5 * 8)))  # as a checkpoint stores it
    moved = tmp_path / "moved"
    shutil.copytree(dev_packed, moved)
    same = Mixture({"web": MemmapChunkDataset(str(moved))}, stages, batch_size=8)
    same.load_state_dict(state, same.sampler())
    flipped = Mixture({"web": MemmapChunkDataset(dev_packed, repack=True)}, stages, batch_size=8)
    with pytest.raises(ConfigError, match=r"source 'web' is another dataset or is read otherwise \(repack False -> "
                                          r"True, seed None -> 0\)"):
        flipped.load_state_dict(state, flipped.sampler())
    other = tmp_path / "other"
    shutil.copytree(dev_packed, other)
    m = json.loads((other / "manifest.json").read_text())
    m["sources"] = {"renamed": next(iter(m["sources"].values()))}  # other data, the same chunk count
    (other / "manifest.json").write_text(json.dumps(m))
    swapped = Mixture({"web": MemmapChunkDataset(str(other))}, stages, batch_size=8)
    with pytest.raises(ConfigError, match=r"source 'web' is another dataset or is read otherwise \(manifest "):
        swapped.load_state_dict(state, swapped.sampler())
    old = {**state, "schedule": {k: v for k, v in state["schedule"].items() if k != "identities"}}
    swapped.load_state_dict(old, swapped.sampler())  # a checkpoint from before identities: as before


def test_mixture_inputs_of_the_wrong_shape_are_one_line_each(dev_packed, tmp_path):
    """A top-level max_epochs given per source (as the Python API takes it) is read so; a cap that
    is not a number, and a checkpoint that is not a mixture's, are one ConfigError each (they were
    TypeError and KeyError tracebacks)."""
    f = tmp_path / "mix.json"
    spec = {"batch_size": 8, "sources": {"web": os.path.relpath(dev_packed, tmp_path)},
            "stages": [{"until_steps": 4, "weights": {"web": 1}}], "max_epochs": {"web": 2}}
    f.write_text(json.dumps(spec))
    r = CliRunner().invoke(main, ["stats", "--mixture", str(f), "--json"])
    assert r.exit_code == 0, r.output
    f.write_text(json.dumps({**spec, "max_epochs": {"web": "two"}}))
    r = CliRunner().invoke(main, ["stats", "--mixture", str(f)])
    assert r.exit_code == 1 and r.output.strip() == "Error: max_epochs of 'web' must be a number (epochs), got 'two'"
    mix = Mixture({"web": MemmapChunkDataset(dev_packed)}, [Stage({"web": 1}, until_steps=4)], batch_size=8)
    state = mix.state_dict(mix.sampler(), samples_consumed=8)
    del state["schedule"]["stages"]
    with pytest.raises(ConfigError, match=r"not a mixture checkpoint \(Mixture.state_dict's\): KeyError 'stages'"):
        mix.load_state_dict(state, mix.sampler())


def test_a_sequence_length_curriculum_reads_each_stage_at_its_own_length(dev_packed, tmp_path):
    """Issue 56.2: stages with their own seq_len read the packed sources at that length (no rebuild):
    each item is the source read at that length, a length's stream goes on where its last stage
    left it (no chunk twice before all were used), until_tokens counts each stage at its length,
    `helixtok stats --mixture` says the same, and a resume refuses a begun stage's length changed."""
    base = MemmapChunkDataset(dev_packed)
    long = MemmapChunkDataset(dev_packed, seq_len=1024)
    B = 8
    stages = [Stage({"web": 1}, until_steps=5), Stage({"web": 1}, until_tokens=5 * B * 512 + 3 * B * 1024, seq_len=1024),
              Stage({"web": 1}, until_steps=12)]
    mix = Mixture({"web": base}, stages, batch_size=B, seed=4)
    assert len(mix) == 12 * B and [(p.start, p.end, p.seq_len) for p in mix.plans] == [(0, 40, 512), (40, 64, 1024),
                                                                                          (64, 96, 512)]
    seen = {512: [], 1024: []}
    for i in range(len(mix)):
        L = 1024 if 40 <= i < 64 else 512
        name, epoch, j = mix.locate(i)
        x = mix[i]["input_ids"]
        assert len(x) == L and x.tolist() == (long if L == 1024 else base)[j]["input_ids"].tolist()
        seen[L].append((epoch, j))
    assert len(set(seen[512])) == 72 and len(set(seen[1024])) == 24  # one stream per length, nothing twice
    dl = DataLoader(mix, batch_size=4, sampler=mix.sampler(rank=0, world_size=2), collate_fn=mix.collate)
    assert [b["input_ids"].shape[1] for b in dl] == [512] * 5 + [1024] * 3 + [512] * 4  # 4 a rank of each 8
    st = mix.stats(world_size=2, batch_size=4)
    assert [s["tokens"] for s in st["stages"]] == [40 * 512, 24 * 1024, 32 * 512]
    assert st["tokens"] == st["sources"]["web"]["tokens"] == 72 * 512 + 24 * 1024
    assert st["stages"][1]["seq_len"] == 1024 and "seq_len" not in st["stages"][0]
    f = tmp_path / "mix.json"
    f.write_text(json.dumps({"seed": 4, "batch_size": B, "sources": {"web": os.path.relpath(dev_packed, tmp_path)},
                             "stages": [{"until_steps": 5, "weights": {"web": 1}},
                                        {"until_tokens": 5 * B * 512 + 3 * B * 1024, "seq_len": 1024, "weights": {"web": 1}},
                                        {"until_steps": 12, "weights": {"web": 1}}]}))
    r = CliRunner().invoke(main, ["stats", "--mixture", str(f), "-b", "4", "-w", "2", "--json"])
    assert r.exit_code == 0 and json.loads(r.output) == json.loads(json.dumps(st)), r.output
    # A resume: the same schedule goes on; a begun stage read at another length is refused.
    sampler = mix.sampler(rank=0, world_size=2)
    state = mix.state_dict(sampler, samples_consumed=30)
    mix.load_state_dict(state, mix.sampler(rank=0, world_size=2))
    other = Mixture({"web": base}, stages[:1] + [Stage({"web": 1}, until_steps=8, seq_len=2048), stages[2]],
                    batch_size=B, seed=4)
    with pytest.raises(ConfigError, match="stage 1 \\(begun\\) seq_len 1024 -> 2048"):
        other.load_state_dict(state, other.sampler(rank=0, world_size=2))
    # A source that cannot be read at another length: one line.
    with pytest.raises(ConfigError, match="source 'l' cannot be read at seq_len 64"):
        Mixture({"l": Source("l", 10)}, [Stage({"l": 1}, until_steps=2, seq_len=64)], batch_size=2)
