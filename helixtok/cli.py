"""The helixtok command line: a thin click layer over the library; results on stdout, progress on stderr."""

from __future__ import annotations

import functools
import json
import re
import signal
import sys
import threading
import time

import click

from .config import BACKENDS, PACKINGS, SPECIAL_POLICIES  # not numpy: `build` starts loading the tokenizer first
from .errors import HelixtokError, Interrupted, resource_error

SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(ctx, param, value):
    if value is None or isinstance(value, int):
        return value
    m = SIZE_RE.match(value)
    if not m or (m.group(2) or "").lower() not in UNITS:
        raise click.BadParameter(f"{value!r} is not a size like 1GiB, 512MiB or 100000000")
    return int(float(m.group(1)) * UNITS[(m.group(2) or "").lower()])


def handle_errors(fn):
    """Library errors -> one line on stderr and exit 1; Ctrl-C -> exit 130; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        stops = _stop_on_signals()
        try:
            return fn(*a, **kw)
        except HelixtokError as e:
            raise click.ClickException(str(e)) from e
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            name = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
            click.echo(f"\ninterrupted{name}; rerun the same command to resume", err=True)
            sys.exit(128 + signum)
        except MemoryError:
            raise click.ClickException("out of memory; use fewer --workers, a smaller --unit-size, or a machine "
                                       "with more memory, then rerun the same command (a build resumes)") from None
        except OSError as e:
            if (err := resource_error(e)) is not None:
                raise click.ClickException(str(err)) from e
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from e
        finally:
            for s, old in stops.items():
                signal.signal(s, old)

    return wrapper


def _stop_on_signals() -> dict:
    """SIGTERM and SIGHUP stop a command as Ctrl-C does (a clean, resumable stop), unless they
    were ignored when it started (nohup): returns the handlers to put back."""
    def stop(signum, frame):
        raise Interrupted(signum)

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) is signal.SIG_DFL:
                old[s] = signal.signal(s, stop)
    return old


def _console(quiet=False):
    from rich.console import Console

    return Console(stderr=True, quiet=quiet)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="helixtok")
def main():
    """Pre-tokenize text corpora into memory-mappable token shards with exact counts.

    \b
    Example:
      helixtok build corpus/ out/ --tokenizer tokenizer.json --seq-len 2048
      helixtok stats out/ --batch-size 16 --grad-accum 4 --world-size 8
    """


@main.command()
@click.argument("corpus", nargs=-1, required=False)  # checked in build(): a forgotten OUT is said as such
@click.argument("out", nargs=1)
@click.option("--tokenizer", "-t", required=True,
              help="tokenizer.json, a folder holding one, or a HF repo id in the local HF cache.")
@click.option("--seq-len", "-L", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Tokens per chunk.")
@click.option("--pack", "packing", type=click.Choice(list(PACKINGS)), default="packed", show_default=True,
              help="packed: concatenate documents and cut; document: chunk each document, pad its tail; bestfit: "
                   "whole documents placed into chunks by best fit, padded (docs/packing.md).")
@click.option("--min-tail-len", type=click.IntRange(min=0), default=None,
              help="document and bestfit packing: shortest kept document / last piece [default: document seq-len // "
                   "4, bestfit none dropped].")
@click.option("--text-field", default="text", show_default=True, help="JSON field or parquet column with the text.")
@click.option("--bos/--no-bos", default=None,
              help="Prepend BOS to every document, or not [default: as the tokenizer's post-processor does for "
                   "one sequence, e.g. Llama 3 yes, GPT-2 no].")
@click.option("--eos-token", default=None, help="EOS token [default: detected from the tokenizer].")
@click.option("--bos-token", default=None, help="BOS token for --bos [default: detected].")
@click.option("--pad-token", default=None, help="Padding token for document and bestfit packing [default: the tokenizer's, else EOS].")
@click.option("--val-fraction", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Fraction of documents in a 'val' split (by content hash).")
@click.option("--split-seed", type=int, default=0, show_default=True, help="Seed of the train/val split hash.")
@click.option("--shard-size", callback=parse_size, default="1GiB", show_default=True, help="Target bytes per shard.")
@click.option("--unit-size", callback=parse_size, default="4MiB", show_default=True,
              help="Input bytes per work unit (scheduling only: the shards do not depend on it).")
@click.option("--workers", "-j", type=click.IntRange(min=0), default=0,
              help="Tokenizing processes at most [default: all cores]; no more than one per 64 MiB of input "
                   "(4 MiB with tiktoken or tokenizers).")
@click.option("--overwrite", is_flag=True, help="Replace a dataset or unfinished build in OUT.")
@click.option("--strict", is_flag=True, help="Fail instead of skipping any bad document or file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress (bar or log lines); warnings and the summary still print.")
@click.option("--log-interval", type=click.FloatRange(min=0, min_open=True), default=30, show_default=True,
              help="Off a terminal (a pipe, nohup, a Slurm log): seconds between plain progress lines.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--stall-timeout", type=click.FloatRange(min=0, min_open=True), default=600, show_default=True,
              help="Fail when no worker makes progress for this many seconds.")
@click.option("--special-tokens", type=click.Choice(list(SPECIAL_POLICIES)), default="text", show_default=True,
              help="Special-token strings inside documents (e.g. '<|endoftext|>' in crawled text): text = "
                   "encode them as ordinary characters; extract = turn them into their special ids (markup).")
@click.option("--strip", is_flag=True,
              help="Strip leading/trailing whitespace of every document before tokenizing (as HelixLM's compiler does).")
@click.option("--backend", type=click.Choice(list(BACKENDS)), default="auto", show_default=True,
              help="auto: the fastest of fastokens, gigatoken, tiktoken that gives tokenizers' ids on a corpus "
                   "sample and hostile texts, else hf (tokenizers).")
@click.option("--staging", type=click.Path(file_okay=False), default=None,
              help="With a URL as OUT: build here, then upload [default: a folder in $HELIXTOK_STAGING or the "
                   "temp dir, removed after the upload].")
@click.option("--executor", default="local", show_default=True, metavar="local|ray[:ADDRESS]",
              help="Where work units are tokenized: this machine's processes, or Ray tasks on the cluster at "
                   "ADDRESS ($RAY_ADDRESS, or a local one, without it); OUT must be a folder every node sees.")
@click.option("--num-tasks", type=click.IntRange(min=1), default=None,
              help="Build one of N partitions into OUT/part-KKKKK (then `helixtok merge`).")
@click.option("--task-index", type=click.IntRange(min=0), default=None,
              help="Which partition [default: $SLURM_ARRAY_TASK_ID or $JOB_COMPLETION_INDEX].")
@handle_errors
def build(corpus, out, tokenizer, seq_len, packing, min_tail_len, text_field, bos, eos_token, bos_token,
          pad_token, val_fraction, split_seed, shard_size, unit_size, workers, overwrite, strict, quiet, as_json,
          stall_timeout, special_tokens, strip, backend, staging, executor, num_tasks, task_index, log_interval):
    """Tokenize CORPUS (files, folders, globs) into fixed-length token shards in OUT.

    \b
    Example:
      helixtok build data/*.jsonl.gz out/ -t tokenizer.json -L 1024 --val-fraction 0.01
    """
    import functools
    import os

    started = time.monotonic()
    if not corpus:  # click gave the one path to OUT
        raise click.UsageError(f"one path given ({out}): give the corpus, then the folder to build into, "
                               f"e.g. helixtok build {out} out/ -t TOKENIZER")

    from .config import BuildConfig
    from .preload import speculate

    cfg = BuildConfig(seq_len=seq_len, packing=packing, min_tail_len=min_tail_len, text_field=text_field,
                      add_bos=bos, eos_token=eos_token, bos_token=bos_token, pad_token=pad_token,
                      val_fraction=val_fraction, split_seed=split_seed, shard_bytes=shard_size,
                      unit_bytes=unit_size, workers=workers, strict=strict, backend=backend,
                      stall_seconds=stall_timeout, special_tokens=special_tokens, strip=strip, executor=executor)
    if cfg.ray_address is None:
        speculate(list(corpus), tokenizer, cfg.num_workers, backend)  # before the imports below
    from .builder import build as run_build
    from .merge import task_from_env

    task = task_from_env(num_tasks, task_index)
    if task:
        out = os.path.join(out, f"part-{task[0]:05d}")
    con = _console(quiet)
    run_build = functools.partial(run_build, staging=staging)
    if quiet:
        m = run_build(list(corpus), out, tokenizer, cfg, overwrite=overwrite, task=task)
    else:
        show = _build_with_progress if con.is_terminal else functools.partial(_build_with_log_lines, every=log_interval)
        m = show(run_build, con, list(corpus), out, tokenizer, cfg, overwrite, task)
    from .builder import UpToDate

    if isinstance(m, UpToDate):  # this very build is already in OUT: nothing was written
        if as_json:
            _print_build_summary(m, out, as_json, _console(), up_to_date=True)
        else:
            click.echo(f"up to date: {out} ({m['totals']['chunks']:,} chunks of {m['seq_len']}; inputs and options "
                       "unchanged, nothing rewritten)")
        return
    # -q hides the progress, never the summary or its warnings
    _print_build_summary(m, out, as_json, _console(), up_to_date=False, elapsed=time.monotonic() - started,
                         reused=getattr(m, "reused_units", 0), units=getattr(m, "units", 0))


def _build_with_progress(run_build, con, corpus, out, tokenizer, cfg, overwrite, part):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    t0 = time.monotonic()
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TextColumn("{task.fields[docs]:,} docs  {task.fields[tps]} tok/s"), TimeElapsedColumn(),
                   TextColumn("ETA"), TimeRemainingColumn(), console=con, transient=False)
    task = bar.add_task("tokenize", total=None, docs=0, tps="-")

    def on_progress(p):
        if not bar.live.is_started:  # shown once tokenizing starts: an early error stays one line
            bar.start()
        dt = max(time.monotonic() - t0, 1e-9)
        # "tokenize ×N": N processes tokenize, -j being a maximum (build.worker_count).
        phase = f"tokenize ×{p.processes}" if p.phase == "tokenize" else p.phase
        bar.update(task, total=p.bytes_total, completed=p.bytes_done, docs=p.documents,
                   tps=f"{p.tokens / dt / 1e6:.2f}M", description=phase)

    try:
        return run_build(corpus, out, tokenizer, cfg, overwrite=overwrite, on_progress=on_progress, task=part)
    finally:
        bar.stop()


def _build_with_log_lines(run_build, con, corpus, out, tokenizer, cfg, overwrite, part, *, every: float):
    """Progress where stderr is not a terminal: one plain line at each phase's start and every
    `every` seconds (a bar would print nothing until the end in a log)."""
    t0, last = time.monotonic(), {"phase": None, "at": 0.0}

    def on_progress(p):
        now = time.monotonic()
        if p.phase == last["phase"] and now - last["at"] < every:
            return
        last.update(phase=p.phase, at=now)
        dt = max(now - t0, 1e-9)
        rate = p.bytes_done / dt
        pct = f" ({100 * p.bytes_done / p.bytes_total:.0f}%)" if p.bytes_total else ""
        eta = (p.bytes_total - p.bytes_done) / rate if rate > 0 and p.bytes_total else None
        eta_s = "-" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta))
        phase = f"tokenize x{p.processes}" if p.phase == "tokenize" else p.phase
        click.echo(f"helixtok: {phase}: {p.bytes_done / 1e6:,.1f} of {p.bytes_total / 1e6:,.1f} MB{pct}, "
                   f"{p.documents:,} documents, {p.tokens:,} tokens, {rate / 1e6:.1f} MB/s, "
                   f"{dt:.0f} s elapsed, ETA {eta_s}", err=True)

    return run_build(corpus, out, tokenizer, cfg, overwrite=overwrite, on_progress=on_progress, task=part)


def _print_build_summary(m, out, as_json, con, up_to_date=None, elapsed=None, reused=0, units=0):
    """The table of splits, every term of the token arithmetic, what the build did, and warnings."""
    from .summary import lines, summarize

    t, summ = m["totals"], summarize(m, out)
    if as_json:
        click.echo(json.dumps({"out": out, **({"up_to_date": up_to_date} if up_to_date is not None else {}),
                               "dtype": m["dtype"], "seq_len": m["seq_len"], "packing": m["packing"],
                               "totals": t, "splits": {k: {kk: v[kk] for kk in ("num_chunks", "num_tokens")}
                                                       for k, v in m["splits"].items()},
                               "skipped": m["skipped"], "warnings": m["warnings"], **summ,
                               **({"elapsed_s": round(elapsed, 3), "reused_units": reused}
                                  if elapsed is not None else {})}))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    tab = Table(title=escape(f"{out}  ({m['packing']}, seq_len {m['seq_len']}, {m['dtype']})"), show_header=True)
    for col in ("split", "documents", "chunks", "stored tokens", "pad", "dropped"):
        tab.add_column(col, justify="right" if col != "split" else "left")
    for name, s in m["splits"].items():
        tab.add_row(name, f"{s['documents']:,}", f"{s['num_chunks']:,}", f"{s['num_tokens']:,}",
                    f"{s['pad_tokens']:,}", f"{s['dropped_tokens']:,}")
    Console().print(tab)
    click.echo(f"documents {t['documents']:,}  skipped {t['skipped_documents']:,}  repaired {t['repaired_documents']:,}"
               f"  dropped whole (below --min-tail-len) {t.get('dropped_documents', 0):,}")
    # Every term of the arithmetic, so no token is unaccounted for.
    click.echo(f"tokens: produced {t['tokens']:,} + pad {t['pad_tokens']:,} - dropped {t['dropped_tokens']:,} "
               f"= stored {t['chunks'] * m['seq_len']:,} = {t['chunks']:,} chunks x {m['seq_len']}")
    for line in lines(summ, elapsed=elapsed, reused=reused, units=units):
        click.echo(line)
    for kind in ("skipped", "warnings"):
        for reason, v in m[kind].items():
            con.print(f"[yellow]warning[/]: {v['count']:,} x {reason.replace('_', ' ')}, e.g. "
                      + escape("; ".join(v["examples"][:3])))
    for a in summ["alerts"]:
        con.print("[yellow]warning[/]: " + escape(a))


@main.command()
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

    from .manifest import load_manifest
    from .show import chunk_segments, document_source

    m = load_manifest(out)
    tok = None
    if not raw:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(out, m["tokenizer"]["file"]))
    n = m["splits"][split]["num_chunks"] if split in m["splits"] else 0
    for i in index or (0,):
        click.echo(f"=== chunk {i} of {n:,} ({split}, {m['packing']}, seq_len {m['seq_len']}) ===")
        for seg in chunk_segments(out, m, split, i):
            if seg.document is not None:
                how = "starts" if seg.starts else "continues"
                click.echo(f"--- document {seg.document:,} {how}: {document_source(out, m, split, seg.document, corpus)}"
                           " ---")
            elif m["packing"] == "bestfit":  # items are not numbered: a document, or a seq_len piece of one
                click.echo(f"--- a document (or a piece of one), {len(seg.ids):,} tokens ---")
            click.echo(" ".join(map(str, seg.ids)) if raw else tok.decode(seg.ids, skip_special_tokens=False))
            if seg.pad:
                click.echo(f"--- {seg.pad:,} pad ({m['tokenizer']['pad_token']}) ---")


@main.command()
@click.argument("out")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--html", "html_file", default=None,
              help="Also write a self-contained HTML report: summary, tokens per source, document-length and "
                   "chunk-fill histograms, a few decoded chunks.")
@handle_errors
def info(out, as_json, html_file):
    """What a finished dataset holds, from its manifest: splits, token arithmetic, backend, BOS,
    padding and dropped shares, size on disk, tokens per source, warnings.

    \b
    Example:
      helixtok info out/
    """
    from .manifest import load_manifest

    m = load_manifest(out)
    _print_build_summary(m, out, as_json, _console())
    if html_file:
        import os

        from .report import render

        tmp = f"{html_file}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(render(out, m))
        os.replace(tmp, html_file)
        click.echo(f"report: {html_file}", err=True)


@main.command()
@click.argument("out")
@click.option("--split", default="train", show_default=True, help="Which split to count (train or val).")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=1, show_default=True, help="Per-rank batch size.")
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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@handle_errors
def stats(out, split, batch_size, grad_accum, world_size, epochs, sampler_drop_last, loader_drop_last, drop_last,
          warmup_ratio, as_json):
    """Exact chunk, batch and optimizer-step counts for a training run over OUT.

    \b
    Example:
      helixtok stats out/ -b 16 -g 4 -w 8 --epochs 2 --warmup-ratio 0.01 --json
    """
    from .stats import stats_for

    st = stats_for(out, split=split, batch_size=batch_size, grad_accum=grad_accum, world_size=world_size,
                   epochs=epochs, drop_last=drop_last, sampler_drop_last=sampler_drop_last,
                   loader_drop_last=loader_drop_last, warmup_ratio=warmup_ratio)
    if as_json:
        click.echo(json.dumps(st.to_json()))
        return
    from rich.console import Console
    from rich.table import Table

    from rich.markup import escape

    tab = Table(title=escape(f"{out} [{split}]"), show_header=False)  # "[train]" is not rich markup
    tab.add_column(style="bold")
    tab.add_column(justify="right")
    for k, v in st.to_json().items():
        tab.add_row(k, f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
    Console().print(tab)


@main.group()
def export():
    """Write a built dataset in another tool's format."""


def _export_command(name: str, dest: str):
    """`helixtok export NAME OUT DEST [--split]`: the arguments every export takes."""
    def wrap(fn):
        fn = click.option("--split", default="train", show_default=True, help="Which split to export.")(
            handle_errors(fn))
        return export.command(name)(click.argument("out")(click.argument(dest)(fn)))
    return wrap


@_export_command("helixlm", "dest")
def export_helixlm_cmd(out, dest, split):
    """Write OUT's split as HelixLM's pretraining store (helix.pretrain.samples.v1) in DEST.

    The store's shards hold whole samples, written from OUT's chunks. Build with --strip for
    HelixLM's exact token stream.

    \b
    Example:
      helixtok build corpus/ out/ -t tokenizer.json -L 1024 --strip
      helixtok export helixlm out/ helix-store/
    """
    from .helixlm import export_helixlm

    st = export_helixlm(out, dest, split=split)
    if not st["source"]["stripped"]:
        click.echo(f"warning: {out} was built without --strip; HelixLM's compiler strips each text first, so its "
                   "stream differs where a document starts or ends in whitespace (rebuild with --strip for the "
                   "identical stream)", err=True)
    click.echo(f"{dest}: {st['sample_count']:,} samples x {st['seq_len']} in {len(st['shards'])} shards, "
               f"{st['encoded_tokens']:,} tokens from {st['source_rows']:,} rows")


@_export_command("megatron", "prefix")
def export_megatron_cmd(out, prefix, split):
    """Write OUT's split as a Megatron-LM indexed dataset PREFIX.bin / PREFIX.idx (one sequence per document).

    \b
    Example:
      helixtok export megatron out/ data/my_corpus_text_document
    """
    from .megatron import export_megatron

    r = export_megatron(out, prefix, split=split)
    click.echo(f"{prefix}.bin/.idx: {r['documents']:,} documents, {r['tokens']:,} tokens, {r['dtype']} "
               f"(.bin {r['bin']})")


@_export_command("llmc", "dest")
def export_llmc_cmd(out, dest, split):
    """Write OUT's split as one llm.c token file DEST (256-int32 header, then the ids).

    \b
    Example:
      helixtok export llmc out/ fineweb_train_000001.bin
    """
    from .llmc import export_llmc

    r = export_llmc(out, dest, split=split)
    click.echo(f"{dest}: {r['tokens']:,} {r['dtype']} tokens, header magic {r['magic']} version {r['version']}")


@main.group("import")
def import_():
    """Make a helixtok dataset from data in another tool's format."""


@import_.command("megatron")
@click.argument("prefix")
@click.argument("out")
@click.option("--tokenizer", "-t", required=True, help="The tokenizer.json the Megatron dataset was made with.")
@click.option("--seq-len", "-L", type=click.IntRange(min=1), default=2048, show_default=True, help="Tokens per chunk.")
@click.option("--shard-size", callback=parse_size, default="1GiB", show_default=True, help="Target bytes per shard.")
@handle_errors
def import_megatron_cmd(prefix, out, tokenizer, seq_len, shard_size):
    """Make a packed helixtok dataset in OUT from a Megatron-LM indexed dataset PREFIX.bin / PREFIX.idx.

    \b
    Example:
      helixtok import megatron data/my_corpus_text_document out/ -t tokenizer.json -L 2048
    """
    from .megatron import import_megatron

    m = import_megatron(prefix, out, tokenizer, seq_len=seq_len, shard_bytes=shard_size)
    t = m["totals"]
    click.echo(f"{out}: {t['chunks']:,} chunks x {seq_len} from {t['documents']:,} documents, {t['tokens']:,} tokens "
               f"({t['dropped_tokens']:,} in the last partial chunk dropped)")


@main.command("bench-read")
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
    from .errors import ConfigError
    from .readbench import measure

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


@main.command()
@click.argument("out")
@click.option("--sample", type=click.IntRange(min=0), default=0, help="Also decode N random chunks.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@handle_errors
def verify(out, sample, as_json):
    """Check every shard of OUT: size, sha256, ids < vocab size, counts. Exit 1 on any problem.

    \b
    Example:
      helixtok verify out/ --sample 3
    """
    from .verify import verify as run_verify

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


@main.command()
@click.argument("out")
@click.argument("url")
@click.option("--overwrite", is_flag=True, help="Replace the dataset at URL (only files its manifest names).")
@click.option("--stall-timeout", type=click.FloatRange(min=0, min_open=True), default=600, show_default=True,
              help="Fail when the storage shows no progress for this many seconds (a stopped server).")
@handle_errors
def push(out, url, overwrite, stall_timeout):
    """Upload the finished dataset OUT to URL (s3://..., any fsspec URL), the manifest last.

    \b
    Example:
      helixtok push out/ s3://bucket/datasets/web-2048
    """
    from .objstore import redact
    from .publish import upload

    m = upload(out, url, overwrite=overwrite, stall=stall_timeout)
    click.echo(f"pushed {m['totals']['chunks']:,} chunks to {redact(url)}")


@main.command()
@click.argument("url")
@click.argument("dest")
@handle_errors
def pull(url, dest):
    """Copy the dataset at URL to the local folder DEST (sha256 checked on arrival, manifest last).

    \b
    Example:
      helixtok pull s3://bucket/datasets/web-2048 /local/web-2048 && helixtok verify /local/web-2048
    """
    from .objstore import redact
    from .publish import pull as run_pull

    m = run_pull(url, dest)
    click.echo(f"pulled {m['totals']['chunks']:,} chunks from {redact(url)} to {dest}")


@main.command()
@click.argument("parts", nargs=-1, required=True)
@click.argument("out", nargs=1)
@click.option("--overwrite", is_flag=True, help="Replace OUT's manifest.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@handle_errors
def merge(parts, out, overwrite, as_json):
    """Join task outputs (PARTS) into one dataset OUT whose manifest references their shards (no copy).

    \b
    Example:
      helixtok build corpus/ out/ -t tok.json --num-tasks 8 --task-index 3   # x8, e.g. a Slurm array
      helixtok merge out/part-* out/
    """
    from .merge import merge as run_merge

    m = run_merge(list(parts), out, overwrite=overwrite)
    _print_build_summary(m, out, as_json, _console())


@main.command("train-tokenizer")
@click.argument("corpus", nargs=-1, required=True)
@click.argument("out_json", metavar="OUT.json")
@click.option("--vocab-size", type=click.IntRange(min=260), required=True, help="Vocabulary size, special token included.")
@click.option("--text-field", default="text", show_default=True, help="JSON field or parquet column with the text.")
@click.option("--overwrite", is_flag=True, help="Replace OUT.json if it exists.")
@handle_errors
def train_tokenizer(corpus, out_json, vocab_size, text_field, overwrite):
    """Train a byte-level BPE tokenizer with <|endoftext|> on CORPUS (for research and offline use).

    \b
    Example:
      helixtok train-tokenizer corpus/ tokenizer.json --vocab-size 32000
    """
    import os

    from .errors import ConfigError
    from .discover import discover
    from .sources import UnitReader
    from .tally import Tally
    from .units import plan_units
    from .tokenizer import train_tokenizer as train

    if os.path.exists(out_json) and not overwrite:
        raise ConfigError(f"{out_json}: exists; pass --overwrite to replace it")
    files, _ = discover(list(corpus), exclude=out_json)
    units, _ = plan_units(files, unit_bytes=1 << 30, text_field=text_field)

    def texts():
        for u in units:
            yield from UnitReader(u, text_field, Tally())

    # tokenizers' own progress bars (reading, counting pairs, merges) on stderr, when a person watches.
    train(texts(), out_json, vocab_size=vocab_size, show_progress=sys.stderr.isatty())
    click.echo(out_json)


if __name__ == "__main__":
    main()
