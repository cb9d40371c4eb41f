"""Commands that read a finished dataset: show, info, stats, verify, bench-read."""

from __future__ import annotations

import json
import sys

import click

from .common import bounded_storage, console, handle_errors, print_summary


@click.command()
@click.argument("out")
@click.argument("index", nargs=-1, type=click.IntRange(min=0))
@click.option("--split", default="train", show_default=True, help="Which split (train or val).")
@click.option("--raw", is_flag=True, help="Ids instead of decoded text.")
@click.option("--corpus", default=None,
              help="The corpus the build read (as given to build): each document's exact file:line or row.")
@handle_errors
def show(out, index, split, raw, corpus):
    """Print chunks INDEX... of OUT (default: chunk 0) decoded, cut where documents start, each
    document with where it came from.

    \b
    Example:
      helixtok show out/ 0 41 --corpus corpus/
    """
    import os

    from ..format.manifest import load_manifest
    from ..inspect.show import TRAIN_CLOSE, TRAIN_OPEN, chunk_segments, document_source, trained_runs

    m = load_manifest(out)
    tok = None
    if not raw:
        from ..format.tokenizer_file import load_tokenizer

        tok = load_tokenizer(os.path.join(out, m["tokenizer"]["file"]))
    n = m["splits"][split]["num_chunks"] if split in m["splits"] else 0
    for i in index or (0,):
        click.echo(f"=== chunk {i} of {n:,} ({split}, {m['packing']}, seq_len {m['seq_len']}) ==="
                   + (f" (tokens that train: {TRAIN_OPEN}...{TRAIN_CLOSE})" if m.get("chat") else ""))
        for seg in chunk_segments(out, m, split, i):
            if seg.document is not None:
                how = "starts" if seg.starts else "continues"
                click.echo(f"--- document {seg.document:,} {how}: {document_source(out, m, split, seg.document, corpus)}"
                           " ---")
            elif m["packing"] == "bestfit":  # items are not numbered: a document, or a seq_len piece of one
                click.echo(f"--- a document (or a piece of one), {len(seg.ids):,} tokens ---")
            # A chat build's: what trains between TRAIN_OPEN and TRAIN_CLOSE (said once per chunk above).
            runs = [(" ".join(map(str, ids)) if raw else tok.decode(ids, skip_special_tokens=False), trains)
                    for ids, trains in trained_runs(seg)]
            click.echo((" " if raw else "").join(f"{TRAIN_OPEN}{t}{TRAIN_CLOSE}" if trains else t for t, trains in runs))
            if seg.pad:
                click.echo(f"--- {seg.pad:,} pad ({m['tokenizer']['pad_token']}) ---")


@click.command()
@click.argument("out")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--html", "html_file", default=None,
              help="Also write a self-contained HTML report: summary, tokens per source, document-length and "
                   "chunk-fill histograms, a few decoded chunks.")
@bounded_storage
@handle_errors
def info(out, as_json, html_file):
    """What a finished dataset holds, from its manifest: splits, token arithmetic, backend, BOS,
    padding and dropped shares, size on disk, tokens per source, warnings.  Given a mixture file:
    its run's counts per stage and source (as `stats --mixture`), and with --html each source's
    share of every step over training.

    \b
    Example:
      helixtok info out/
      helixtok info mix.yaml --html mix.html
    """
    import os

    from ..format.manifest import load_manifest

    if os.path.isfile(out):  # a mixture file
        from ..inspect.report import render_mixture
        from ..read.schedule import load_mixture

        st = load_mixture(out).stats()
        if as_json or not html_file:
            click.echo(json.dumps(st) if as_json else
                       f"{out}: {st['optimizer_steps']:,} optimizer steps of {st['global_batch']:,} samples, "
                       f"{len(st['stages'])} stages; " + ", ".join(
                           f"{n} {v['samples']:,} samples ({v['epochs']:.2f} epochs)" for n, v in st["sources"].items()))
        def page() -> str:
            return render_mixture(out, st)
    else:
        m = load_manifest(out)
        print_summary(m, out, as_json, console())

        def page() -> str:
            from ..inspect.report import render

            return render(out, m)
    if html_file:
        tmp = f"{html_file}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(page())
        os.replace(tmp, html_file)
        click.echo(f"report: {html_file}", err=True)


@click.command()
@click.argument("out", required=False)
@click.option("--mixture", "mixture_file", default=None,
              help="Count a mixture file's run instead (JSON or YAML: sources, stages, budgets, caps; "
                   "docs/training.md): per stage and source.")
@click.option("--split", default="train", show_default=True, help="Which split to count (train or val).")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=None,
              help="Per-rank batch size [default: 1; with --mixture, the file's batch_size / (grad accum x world size)].")
@click.option("--grad-accum", "-g", type=click.IntRange(min=1), default=1, show_default=True,
              help="Micro-batches per optimizer step (a partial window is flushed at epoch end).")
@click.option("--world-size", "-w", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data-parallel ranks (DistributedSampler num_replicas).")
@click.option("--epochs", "-e", type=click.IntRange(min=1), default=1, show_default=True, help="Passes over the split.")
@click.option("--sampler-drop-last/--no-sampler-drop-last", default=None,
              help="DistributedSampler(drop_last=...): drop the tail that does not divide by world size "
                   "[default: as --drop-last].")
@click.option("--loader-drop-last/--no-loader-drop-last", default=None,
              help="DataLoader(drop_last=...): drop each rank's last partial batch [default: as --drop-last].")
@click.option("--drop-last/--no-drop-last", default=False, show_default=True,
              help="Shorthand: sets both --sampler-drop-last and --loader-drop-last.")
@click.option("--warmup-ratio", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Share of optimizer steps for LR warmup (rounded up).")
@click.option("--seq-len", "-L", type=click.IntRange(min=1), default=None,
              help="Packed data: count chunks of this length, as MemmapChunkDataset(out, seq_len=L) reads them "
                   "[default: the build's].")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Count the document view's token-budget batches instead (MemmapDocumentDataset + "
                   "TokenBudgetSampler(max_tokens=N)): per epoch and per rank.")
@click.option("--max-len", type=click.IntRange(min=1), default=None,
              help="With --max-tokens: documents cut into pieces of at most this many tokens (max_len=).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@handle_errors
def stats(out, mixture_file, split, batch_size, grad_accum, world_size, epochs, sampler_drop_last, loader_drop_last,
          drop_last, warmup_ratio, seq_len, max_tokens, max_len, as_json):
    """Exact chunk, batch and optimizer-step counts for a training run over OUT (or a mixture).

    \b
    Example:
      helixtok stats out/ -b 16 -g 4 -w 8 --epochs 2 --warmup-ratio 0.01 --json
      helixtok stats out/ -b 16 --seq-len 4096     # packed data read at another length
      helixtok stats --mixture mix.yaml -b 16 -g 4 -w 8
      helixtok stats out/ --max-tokens 16384 --max-len 4096 -w 8   # the document view's batches
    """
    from ..format.errors import ConfigError
    from ..read.stats import stats_for

    if (out is None) == (mixture_file is None):
        raise ConfigError("give a dataset folder or --mixture FILE (one of them)")
    if mixture_file:
        return _mixture_stats(mixture_file, split, batch_size, grad_accum, world_size, as_json)

    if max_tokens is not None:
        from ..read.budget import budget_for

        b = budget_for(out, split, max_tokens, max_len, world_size, drop_last)
        click.echo(json.dumps(b) if as_json else "\n".join(f"{k}: {v:,}" if isinstance(v, int) and v is not None
                                                           and not isinstance(v, bool) else f"{k}: {v}"
                                                           for k, v in b.items()))
        return
    if max_len is not None:
        raise ConfigError("--max-len goes with --max-tokens (the document view's pieces)")
    st = stats_for(out, split=split, batch_size=batch_size or 1, grad_accum=grad_accum, world_size=world_size,
                   epochs=epochs, drop_last=drop_last, sampler_drop_last=sampler_drop_last,
                   loader_drop_last=loader_drop_last, warmup_ratio=warmup_ratio, seq_len=seq_len)
    if as_json:
        click.echo(json.dumps(st.to_json()))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    tab = Table(title=escape(f"{out} [{split}]"), show_header=False)  # "[train]" is not rich markup
    tab.add_column(style="bold")
    tab.add_column(justify="right")
    for k, v in st.to_json().items():
        tab.add_row(k, f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
    Console().print(tab)


def _mixture_stats(path: str, split: str, b: int | None, g: int, w: int, as_json: bool) -> None:
    from ..format.errors import ConfigError
    from ..read.schedule import load_mixture

    mix = load_mixture(path, batch_size=b * g * w if b else None, split=split)
    if b is None:  # the file's global batch, shared out over the ranks and accumulation steps
        if mix.batch_size % (g * w):
            raise ConfigError(f"{path}: batch_size {mix.batch_size} (global) does not divide into --grad-accum {g} x "
                              f"--world-size {w}; give -b (per-rank batch size)")
        b = mix.batch_size // (g * w)
    st = mix.stats(world_size=w, batch_size=b, grad_accum=g)
    if as_json:
        click.echo(json.dumps(st))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    tab = Table(title=escape(f"{path}: {st['optimizer_steps']:,} optimizer steps of {st['global_batch']:,} samples "
                             f"({st['tokens']:,} tokens); per rank {st['samples_per_rank']:,} samples, "
                             f"{st['batches_per_rank']:,} batches"))
    # Narrow headers: the counts must fit an 80-column terminal whole ("epochs": passes over the source).
    for c in ("stage: steps", "source", "weight", "samples", "tokens", "epochs", "so far"):
        tab.add_column(c, justify="left" if c in ("source", "stage: steps") else "right", no_wrap=c != "source")
    for s in st["stages"]:
        for k, (name, v) in enumerate(s["sources"].items()):
            label = f"{s['stage']}: {s['first_step']:,}-{s['first_step'] + s['steps']:,}" + (
                f" L{s['seq_len']}" if "seq_len" in s else "")
            tab.add_row(label if not k else "", name,
                        f"{v['weight']:.2f}", f"{v['samples']:,}", f"{v['tokens']:,}", f"{v['epochs_of_source']:.2f}",
                        f"{v['epochs_so_far']:.2f}")
    for name, v in st["sources"].items():
        tab.add_row("total", name, "", f"{v['samples']:,}", f"{v['tokens']:,}", f"{v['epochs']:.2f}",
                    f"cap {v['max_epochs']:g}" if v["max_epochs"] != float("inf") else "")
    Console().print(tab)


@click.command("bench-read")
@click.argument("out")
@click.option("--split", default="train", show_default=True, help="Which split to read.")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=8, show_default=True, help="Per-rank batch size.")
@click.option("--num-workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="DataLoader worker processes.")
@click.option("--seconds", type=click.FloatRange(min=0.1), default=3.0, show_default=True, help="How long to read.")
@click.option("--need", "need", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Tokens/s the model consumes per rank (its measured training throughput): exit 1 if the "
                   "loader is slower.")
@click.option("--document-masking", is_flag=True, help="Read with document_masking=True (what training will use).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@handle_errors
def bench_read(out, split, batch_size, num_workers, seconds, need, document_masking, as_json):
    """Measure the loader's tokens/s on OUT and say whether a model consuming --need tokens/s will wait.

    \b
    Example (a model that trains at 48k tokens/s per GPU):
      helixtok bench-read out/ -b 16 --num-workers 0 --need 48000
    """
    from ..format.errors import ConfigError
    from ..inspect.readbench import measure

    r = measure(out, split=split, batch_size=batch_size, num_workers=num_workers, seconds=seconds,
                need_tokens_per_s=need, document_masking=document_masking)
    if as_json:
        click.echo(json.dumps(r.to_json()))
    else:
        click.echo(f"{r.tokens_per_s:,.0f} tokens/s (batch {r.batch_size} x seq_len {r.seq_len}, "
                   f"num_workers {r.num_workers}, {r.batches} batches in {r.seconds:.1f} s)")
        if need:
            click.echo(f"the model needs {need:,.0f} tokens/s: the loader delivers {r.headroom:,.1f}x that")
    if need and r.tokens_per_s < need:
        raise ConfigError(f"the loader delivers {r.tokens_per_s:,.0f} tokens/s, less than the {need:,.0f} the model "
                          "needs: the GPU would wait on data; try --num-workers 2, a larger batch, or node-local disk")


@click.command()
@click.argument("out")
@click.option("--sample", type=click.IntRange(min=0), default=0, help="Also decode N random chunks.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@bounded_storage
@handle_errors
def verify(out, sample, as_json):
    """Check every shard of OUT: size, sha256, ids < vocab size, counts. Exit 1 on any problem.

    \b
    Example:
      helixtok verify out/ --sample 3
    """
    from ..inspect.verify import verify as run_verify

    rep = run_verify(out, sample=sample)
    if as_json:
        click.echo(json.dumps(rep.to_json()))
    else:
        for s in rep.shards:
            click.echo(f"{'ok  ' if s.ok else 'FAIL'} {s.split:5} {s.path}" + ("" if s.ok else "  " + "; ".join(s.problems)))
        for p in rep.problems:
            click.echo(f"FAIL {p}")
        for smp in rep.samples:
            click.echo(f"chunk {smp['chunk']}: {smp['text']!r}")
        click.echo("verified: all shards intact" if rep.ok else "verification FAILED")
    if not rep.ok:
        sys.exit(1)
