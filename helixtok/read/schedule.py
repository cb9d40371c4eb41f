"""Mixture: sources blended in stages of weights over one training run, with a token budget and
repetition caps; which source and chunk sample i reads is a pure function of (schedule, i)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from . import require_torch

require_torch()
from torch.utils.data import Dataset  # noqa: E402

from ..format.errors import ConfigError  # noqa: E402
from .dataset import collate  # noqa: E402
from .mixture import MixtureDataset  # noqa: E402
from .sampler import ChunkSampler, Permutation  # noqa: E402


@dataclass(frozen=True)
class Stage:
    """One stage: its weights (by source name; a source left out has weight 0) until the run has
    trained `until_tokens` tokens (rounded down to whole optimizer steps) or `until_steps` steps."""

    weights: dict[str, float]
    until_tokens: float | None = None
    until_steps: int | None = None
    seq_len: int | None = None  # its own sequence length (packed sources read at it): a curriculum


@dataclass
class _Plan:
    """A stage as planned: global samples [start, end), cumulative samples per source at each of its
    optimizer steps (blocks of batch_size), its sequence length, and where each source's stream at
    that length stands when it begins."""

    start: int
    end: int
    weights: np.ndarray
    bounds: np.ndarray = field(repr=False)  # [steps + 1, sources]
    offset: np.ndarray = field(repr=False)  # [sources]: samples each source's stream at seq_len gave before
    seq_len: int | None = None


class Mixture(Dataset):
    """Sources blended by a schedule of stages over one run of `len()` samples (no epochs: the run
    is the schedule).  Read it in order: `mix.sampler(rank, world_size)` (a ChunkSampler with
    shuffle=False) gives each rank its share of every global batch of `batch_size` consecutive
    samples, where `batch_size` is the *global* batch of one optimizer step (per-rank batch x
    world size x gradient accumulation).

    - A stage ends after floor(until_tokens / (batch_size x seq_len)) optimizer steps of the run
      (or until_steps): always on a whole step, never past a token budget; a stage that adds no
      step is refused.
    - Inside a stage every global batch holds floor or ceil of weight x batch_size samples of each
      source, and at the end of every step of the stage each source's running count is within 1 of
      weight x samples (MixtureDataset's rule; mid-step, up to that step's share).
    - Each source is read as one stream through its own seeded permutations (a new one per pass,
      source k seeded seed x 1,000,003 + k in the order given), continuing across stages: no chunk
      of a source repeats before all of its chunks were used.  A source built with repack=True is
      read with the pass number as its epoch: a new packing every pass.
    - max_epochs (one number for all, or per source name): the most passes over a source the
      whole run may make; a schedule that asks for more is refused naming the source, its size,
      what the schedule asks for and what would fit.
    - `counts[k][name]` samples of each source in stage k; `stats(world_size, per_rank_batch)`
      every count `helixtok stats --mixture` prints.
    - A stage with its own seq_len (a sequence-length curriculum) reads its sources at that length
      (MemmapChunkDataset.with_seq_len: packed data, nothing rebuilt); a source read at a length is
      its own stream (permutations as above, over its chunks at that length), continued by every
      stage of that length; until_tokens counts each stage's tokens at its own length; max_epochs
      caps the passes summed over a source's lengths.

    Example: Mixture({"web": web, "math": math}, [Stage({"web": 1}, until_steps=90),
      Stage({"web": 0.5, "math": 0.5}, until_steps=100)], batch_size=8) -> len 800: 720 web
      samples, then 40 web and 40 math, 4 + 4 in every batch of the last 10 steps.
    """

    def __init__(self, sources: dict, stages: list[Stage], *, batch_size: int, seed: int = 0,
                 max_epochs: float | dict | None = None, seq_len: int | None = None):
        if not sources:
            raise ConfigError("give at least one source")
        if not stages:
            raise ConfigError("give at least one stage")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.sources = dict(sources)
        self.names = list(self.sources)
        self.lens = np.array([len(d) for d in self.sources.values()], dtype=np.int64)
        lens = {getattr(d, "seq_len", None) for d in self.sources.values()} - {None}
        if seq_len is None:
            if len(lens) > 1:
                raise ConfigError(f"the sources have different seq_len ({sorted(lens)}); one run reads one length")
            seq_len = lens.pop() if lens else None
        self.seq_len, self.batch_size, self.seed = seq_len, int(batch_size), int(seed)
        self.stages = list(stages)
        self.max_epochs = self._caps(max_epochs)
        # Each source at each length a stage reads it at: (source number, seq_len) -> dataset.
        self._streams = {(k, seq_len): d for k, d in enumerate(self.sources.values())}
        self.plans = self._plan()
        self._n = self.plans[-1].end
        self.counts = [dict(zip(self.names, (p.bounds[-1]).tolist())) for p in self.plans]
        self._check_caps()
        self._perms: dict[tuple[int, int], Permutation] = {}

    # ------------------------------------------------------------------ the plan

    def _caps(self, max_epochs) -> np.ndarray:
        caps = np.full(len(self.names), np.inf)
        if isinstance(max_epochs, dict):
            unknown = sorted(set(max_epochs) - set(self.names))
            if unknown:
                raise ConfigError(f"max_epochs names source {unknown[0]!r}, not one of {', '.join(self.names)}")
            for k, v in max_epochs.items():
                caps[self.names.index(k)] = _number(v, f"max_epochs of {k!r}")
        elif max_epochs is not None:
            caps[:] = _number(max_epochs, "max_epochs")
        if (caps <= 0).any():
            raise ConfigError("max_epochs must be > 0")
        return caps

    def _end_step(self, k: int, st: Stage, step: int, tokens: int, L: int | None) -> int:
        """The step stage k ends at, from `step` (where it starts) and `tokens` (trained before it)."""
        if (st.until_tokens is None) == (st.until_steps is None):
            raise ConfigError(f"stage {k}: give until_tokens or until_steps (one of them)")
        if st.until_steps is not None:
            return int(st.until_steps)
        if L is None:
            raise ConfigError(f"stage {k}: until_tokens needs the sources' seq_len (give seq_len=)")
        if tokens == step * self.batch_size * L:  # one length so far: the run's steps from its start
            return int(math.floor(float(st.until_tokens) / (self.batch_size * L) + 1e-9))
        return step + int(math.floor((float(st.until_tokens) - tokens) / (self.batch_size * L) + 1e-9))

    def stream_lens(self, L: int | None) -> np.ndarray:
        """Chunks of each source read at length L (the run's own: the sources as given)."""
        out = []
        for k, (name, d) in enumerate(self.sources.items()):
            if (k, L) not in self._streams:
                if not hasattr(d, "with_seq_len"):
                    raise ConfigError(f"source {name!r} cannot be read at seq_len {L}: a stage's own seq_len needs "
                                      "MemmapChunkDataset sources of packed data")
                self._streams[(k, L)] = d.with_seq_len(L)
            out.append(len(self._streams[(k, L)]))
        return np.array(out, dtype=np.int64)

    def _plan(self) -> list[_Plan]:
        plans, step, tokens, offsets = [], 0, 0, {}
        for k, st in enumerate(self.stages):
            L = st.seq_len or self.seq_len
            lens = self.lens if L == self.seq_len else self.stream_lens(L)
            offset = offsets.setdefault(L, np.zeros(len(self.names), dtype=np.int64))
            unknown = sorted(set(st.weights) - set(self.names))
            if unknown:
                raise ConfigError(f"stage {k} weighs source {unknown[0]!r}, not one of {', '.join(self.names)}")
            w = np.array([float(st.weights.get(n, 0.0)) for n in self.names])
            if (w < 0).any() or w.sum() <= 0:
                raise ConfigError(f"stage {k}: weights must be >= 0 and not all 0, got {st.weights}")
            w = w / w.sum()
            empty = [n for n, x, size in zip(self.names, w, lens) if x > 0 and size == 0]
            if empty:
                raise ConfigError(f"stage {k} weighs source {empty[0]!r}, which has no chunks"
                                  + (f" at seq_len {L}" if L != self.seq_len else ""))
            end = self._end_step(k, st, step, tokens, L)
            if end <= step:
                how = "" if st.until_steps is not None else (
                    f" (until_tokens {st.until_tokens:g} / (batch_size {self.batch_size} x seq_len {L}) "
                    f"rounds down to step {end})")
                raise ConfigError(f"stage {k} ends at step {end}{how}, not after {'the start' if not k else f'stage {k - 1} (step {step})'}"
                                  "; give each stage a later end")
            n = (end - step) * self.batch_size
            bounds = MixtureDataset._plan(w, n, self.batch_size)
            plans.append(_Plan(step * self.batch_size, end * self.batch_size, w, bounds, offset.copy(), L))
            offset += bounds[-1]
            tokens += n * (L or 0)
            step = end
        return plans

    def _check_caps(self) -> None:
        """max_epochs: a source's passes, summed over the lengths it is read at."""
        used: dict = {}
        for p in self.plans:
            used[p.seq_len] = used.get(p.seq_len, 0) + p.bounds[-1]
        epochs = sum(u / np.maximum(self.stream_lens(L), 1) for L, u in used.items())
        for s, name in enumerate(self.names):
            if epochs[s] > self.max_epochs[s] + 1e-9:
                if len(used) == 1:
                    L = next(iter(used))
                    size, total = int(self.stream_lens(L)[s]), int(used[L][s])
                    fits = int(math.floor(self.max_epochs[s] * size))
                    raise ConfigError(
                        f"source {name!r} has {size:,} chunks; the schedule asks for {total:,} samples of it "
                        f"({total / size:.2f} epochs), max_epochs {self.max_epochs[s]:g} allows {fits:,}: lower its "
                        "weights, shorten the stages that use it, or raise its cap")
                raise ConfigError(f"source {name!r}: the schedule reads it {epochs[s]:.2f} times over (its stages' "
                                  f"lengths together), max_epochs {self.max_epochs[s]:g}: lower its weights, shorten "
                                  "the stages that use it, or raise its cap")

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return self._n

    def locate(self, i: int) -> tuple[str, int, int]:
        """(source name, pass over that source, chunk index in it) of global sample i."""
        if not 0 <= i < self._n:
            raise IndexError(f"index {i} out of range for {self._n} samples")
        k = next(j for j, p in enumerate(self.plans) if i < p.end)
        name, epoch, j, _ = self._locate(k, i)
        return name, epoch, j

    def _locate(self, k: int, i: int) -> tuple[str, int, int, object]:
        p = self.plans[k]
        b, off = divmod(i - p.start, self.batch_size)
        cum = np.cumsum(p.bounds[b + 1] - p.bounds[b])
        s = int(np.searchsorted(cum, off, side="right"))
        g = int(p.offset[s] + p.bounds[b][s] + off - (cum[s - 1] if s else 0))  # position in source s's stream
        src = self._streams[(s, p.seq_len)]
        n = len(src)
        epoch, at = divmod(g, n)
        perm = self._perms.get((s, n, epoch))
        if perm is None:
            if len(self._perms) > 64:
                self._perms.clear()
            perm = self._perms[(s, n, epoch)] = Permutation(n, seed=self.seed * 1_000_003 + s, epoch=epoch)
        return self.names[s], epoch, int(perm(np.array([at]))[0]), src

    def __getitem__(self, i):
        i = int(i)
        i += self._n if i < 0 else 0
        if not 0 <= i < self._n:
            raise IndexError(f"index {i} out of range for {self._n} samples")
        k = next(j for j, p in enumerate(self.plans) if i < p.end)
        _, epoch, j, src = self._locate(k, i)
        return src[(epoch, j)] if getattr(src, "repack", False) else src[j]

    collate = staticmethod(collate)

    def sampler(self, rank: int = 0, world_size: int = 1) -> ChunkSampler:
        """This rank's sampler: its share of every global batch, in order, resumable."""
        if self.batch_size % world_size:
            raise ConfigError(f"batch_size {self.batch_size} (global) is not a multiple of world_size {world_size}")
        return ChunkSampler(self, shuffle=False, rank=rank, world_size=world_size)

    # ------------------------------------------------------------------ counts

    def stats(self, world_size: int = 1, batch_size: int | None = None, grad_accum: int = 1) -> dict:
        """Per stage and source: samples, tokens, passes over the source, optimizer steps; and totals."""
        b = batch_size if batch_size is not None else self.batch_size // (world_size * grad_accum)
        if b * world_size * grad_accum != self.batch_size:
            raise ConfigError(f"per-rank batch {b} x world size {world_size} x grad accum {grad_accum} = "
                              f"{b * world_size * grad_accum}, but the mixture's global batch is {self.batch_size}")
        stages, so_far = [], np.zeros(len(self.names))
        tokens = np.zeros(len(self.names), dtype=np.int64)
        for k, p in enumerate(self.plans):
            got, L, lens = p.bounds[-1], p.seq_len or 0, self.stream_lens(p.seq_len)
            epochs = np.where(lens > 0, got / np.maximum(lens, 1), 0.0)
            so_far = so_far + epochs
            tokens += got * L
            stages.append({"stage": k, "first_step": p.start // self.batch_size, "steps": (p.end - p.start) // self.batch_size,
                           **({"seq_len": p.seq_len} if self.stages[k].seq_len else {}),
                           "samples": int(p.end - p.start), "tokens": int(p.end - p.start) * L,
                           "sources": {n: {"samples": int(c), "tokens": int(c) * L, "weight": float(w),
                                           "epochs_of_source": float(e), "epochs_so_far": float(u)}
                                       for n, c, w, e, u in zip(self.names, got, p.weights, epochs, so_far)}})
        total = sum(p.bounds[-1] for p in self.plans)
        per_rank = self._n // world_size
        return {"seq_len": self.seq_len, "global_batch": self.batch_size, "batch_size": b, "world_size": world_size,
                "grad_accum": grad_accum, "samples": self._n, "tokens": int(sum(s["tokens"] for s in stages)),
                "samples_per_rank": per_rank, "batches_per_rank": per_rank // b,
                "optimizer_steps": self._n // self.batch_size, "stages": stages,
                "sources": {n: {"chunks": int(size), "samples": int(c), "tokens": int(t),
                                "epochs": float(e), "max_epochs": float(cap)}
                            for n, size, c, t, e, cap in zip(self.names, self.lens, total, tokens, so_far, self.max_epochs)}}

    # ------------------------------------------------------------------ resume

    def describe(self) -> dict:
        """The schedule as it decides the samples: what a resume compares."""
        return {"seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "sources": dict(zip(self.names, self.lens.tolist())),
                "identities": {n: d.identity() if hasattr(d, "identity") else None for n, d in self.sources.items()},
                "stages": [{"start_step": p.start // self.batch_size, "end_step": p.end // self.batch_size,
                            "weights": dict(zip(self.names, p.weights.tolist())),
                            **({"seq_len": p.seq_len} if st.seq_len else {})}
                           for p, st in zip(self.plans, self.stages)]}

    def state_dict(self, sampler: ChunkSampler, samples_consumed: int) -> dict:
        """What to checkpoint: the schedule and the sampler's position (this rank's samples consumed)."""
        return {"schedule": self.describe(), "sampler": sampler.state_dict(samples_consumed)}

    def load_state_dict(self, state: dict, sampler: ChunkSampler) -> None:
        """Continue where `state` stopped.  The schedule may differ only in stages not yet begun
        (and their sources); anything else is refused, naming the change."""
        try:
            pos = int(state["sampler"]["global_consumed"])
            why = schedule_change(state["schedule"], self.describe(), pos)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise ConfigError(f"not a mixture checkpoint (Mixture.state_dict's): {type(e).__name__} {e}; pass "
                              "what state_dict returned") from None
        if why:
            raise ConfigError(f"the mixture changed since the checkpoint: {why}; a resume may change only "
                              f"stages not yet begun (the run is at step {pos // self.batch_size})")
        # The sampler checks its dataset's length; a schedule changed only ahead may be longer or
        # shorter, and its positions read so far are the same (a sampler in order, not shuffled).
        sampler.load_state_dict({**state["sampler"], "n": self._n} if pos <= self._n else state["sampler"])


def _number(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{what} must be a number (epochs), got {v!r}")
    return float(v)


def schedule_change(old: dict, new: dict, pos: int) -> str | None:
    """How schedule `new` differs from `old` in what decided samples [0, pos), or None."""
    for k in ("seed", "batch_size", "seq_len"):
        if old[k] != new[k]:
            return f"{k} {old[k]} -> {new[k]}"
    begun = [s for s in old["stages"] if s["start_step"] * old["batch_size"] < pos]  # a sample of it was read
    used = {n for s in begun for n, w in s["weights"].items() if w > 0}
    for n in sorted(used):
        if old["sources"].get(n) != new["sources"].get(n):
            return f"source {n!r} {old['sources'].get(n)} -> {new['sources'].get(n)} chunks"
        was, now = (old.get("identities") or {}).get(n), (new.get("identities") or {}).get(n)
        if was is not None and was != now:  # (a checkpoint from before identities were kept has none)
            diff = [f"{k} {was.get(k)!r} -> {(now or {}).get(k)!r}" for k in sorted(set(was) | set(now or {}))
                    if was.get(k) != (now or {}).get(k)]
            return f"source {n!r} is another dataset or is read otherwise ({', '.join(diff)})"
    if list(new["sources"])[:len(old["sources"])] != list(old["sources"]):
        return "the sources or their order (it seeds their permutations): add new ones after the others"
    for i, s in enumerate(begun):
        t = new["stages"][i] if i < len(new["stages"]) else None
        if t is None or (s["start_step"], s["end_step"]) != (t["start_step"], t["end_step"]):
            return (f"stage {i} (begun) ends at step {s['end_step']} -> "
                    f"{'no such stage' if t is None else t['end_step']}")
        if s.get("seq_len") != t.get("seq_len"):
            return f"stage {i} (begun) seq_len {s.get('seq_len')} -> {t.get('seq_len')}"
        ws = {n: w for n, w in s["weights"].items() if w > 0}
        wt = {n: w for n, w in t["weights"].items() if w > 0}
        if ws != wt:
            return f"stage {i} (begun) weights {ws} -> {wt}"
    return None


def load_mixture(path: str, *, batch_size: int | None = None, split: str = "train") -> Mixture:
    """A mixture file (JSON, or YAML with PyYAML installed): sources (dataset folders, relative to the
    file), stages, seed, batch_size (global), max_epochs, repack; see docs/training.md."""
    from .dataset import MemmapChunkDataset

    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the same as JSON") from None
        try:
            spec = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    else:
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("sources"), dict) or not isinstance(spec.get("stages"), list):
        raise ConfigError(f"{path}: a mixture file holds 'sources' (name: folder) and 'stages' (a list); "
                          "see docs/training.md")
    base = os.path.dirname(os.path.abspath(path))
    sources, caps = {}, {}
    for name, v in spec["sources"].items():
        v = {"path": v} if isinstance(v, str) else v
        if not isinstance(v, dict) or not isinstance(v.get("path"), str):
            raise ConfigError(f"{path}: source {name!r} needs a path (a dataset folder)")
        sources[name] = MemmapChunkDataset(os.path.join(base, v["path"]), split=v.get("split", split),
                                           repack=bool(v.get("repack", spec.get("repack", False))),
                                           seed=int(spec.get("seed", 0)))
        if "max_epochs" in v:
            caps[name] = v["max_epochs"]
    stages = []
    for k, st in enumerate(spec["stages"]):
        if not isinstance(st, dict) or not isinstance(st.get("weights"), dict):
            raise ConfigError(f"{path}: stage {k} needs weights (source: weight)")
        stages.append(Stage(st["weights"], until_tokens=st.get("until_tokens"), until_steps=st.get("until_steps"),
                            seq_len=st.get("seq_len")))
    given = spec.get("batch_size")
    if batch_size is not None and given is not None and int(given) != batch_size:
        raise ConfigError(f"{path}: batch_size {given} (global), but the command gives {batch_size} "
                          "(batch size x world size x grad accum)")
    B = batch_size if batch_size is not None else given
    if B is None:
        raise ConfigError(f"{path}: give batch_size (the global batch of one optimizer step)")
    default_cap = spec.get("max_epochs")
    if isinstance(default_cap, dict):  # per source, as Mixture(max_epochs={...}) takes it
        caps = {**default_cap, **caps}
    elif default_cap is not None:
        caps = {n: caps.get(n, default_cap) for n in sources}
    return Mixture(sources, stages, batch_size=int(B), seed=int(spec.get("seed", 0)), max_epochs=caps or None)
