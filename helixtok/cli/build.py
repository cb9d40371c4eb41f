"""Commands that read a corpus: build (with its progress, as a bar or log lines, and summary) and train-tokenizer."""

from __future__ import annotations

import sys
import time

import click

from ..pipeline.config import (  # not numpy: `build` starts loading the tokenizer first
    BACKENDS,
    PACKINGS,
    SPECIAL_POLICIES,
)
from .common import console, handle_errors, parse_size, print_summary


@click.command()
@click.argument("corpus", nargs=-1, required=False)  # checked in build(): a forgotten OUT is said as such
@click.argument("out", nargs=1)
@click.option("--tokenizer", "-t", required=True,
              help="tokenizer.json, a folder holding one, or a HF repo id in the local HF cache.")
@click.option("--seq-len", "-L", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Tokens per chunk.")
@click.option("--pack", "packing", type=click.Choice(list(PACKINGS)), default=None,
              help="packed: concatenate documents and cut; document: chunk each document, pad its tail; bestfit: "
                   "whole documents placed into chunks by best fit, padded (docs/packing.md) [default: packed; "
                   "with --chat, bestfit].")
@click.option("--min-tail-len", type=click.IntRange(min=0), default=None,
              help="document and bestfit packing: shortest kept document / last piece [default: document seq-len // "
                   "4, bestfit none dropped].")
@click.option("--text-field", default=None,
              help="JSON field or parquet column with the text [default: text; with --chat, messages].")
@click.option("--keep-fields", "keep_fields", default=None, metavar="A,B",
              help="Fields of each record (JSON key or Parquet column; a dotted path reaches into nested ones) kept "
                   "beside its document's source, for `show`, `info` and the document view; '' for none "
                   "[default: id; packed and bestfit].")
@click.option("--code", is_flag=True,
              help="Also read source files (.py, .c, .rs, .go, .js, ... : docs/reference.md lists them) as text "
                   "documents, one a file, as code corpora are built.")
@click.option("--include", "include", multiple=True, metavar="GLOB",
              help="Keep only the files found in a folder (or by a pattern) whose path relative to it matches "
                   "GLOB ('*' crosses folders; repeatable): e.g. --include '*.jsonl.gz'.")
@click.option("--exclude", "exclude", multiple=True, metavar="GLOB",
              help="Leave out the files found whose relative path matches GLOB (repeatable): e.g. "
                   "--exclude 'drafts/*'. Files named on the command line are always read.")
@click.option("--chat", is_flag=True,
              help="Rows are conversations (a list of {role, content} messages, and 'tools' where given): each "
                   "rendered with the model's chat template and tokenized once, with a loss mask (docs/training.md, "
                   "\"Chat data\"; docs/format.md, \"Chat builds\").")
@click.option("--chat-template", type=click.Path(dir_okay=False), default=None,
              help="--chat: a .jinja template [default: chat_template of the tokenizer_config.json beside the "
                   "tokenizer].")
@click.option("--loss", type=click.Choice(["assistant", "all", "last", "completion"]), default="assistant",
              show_default=True,
              help="--chat: which tokens train: the template's {% generation %} spans (assistant), every token, "
                   "the last assistant turn, or the completion of TRL's prompt/completion rows (completion: any "
                   "template; such rows train their completion under assistant and last too).")
@click.option("--truncate", type=click.Choice(["tokens", "turns"]), is_flag=False, flag_value="tokens", default=None,
              help="--chat: a conversation longer than --seq-len is cut to its first --seq-len tokens (--truncate, "
                   "--truncate tokens), or loses its earliest user/assistant exchanges until it fits, the system "
                   "message kept (--truncate turns) [default: drop it, counted].")
@click.option("--chat-kwargs", default=None, metavar="JSON",
              help="--chat: more variables for the template, as apply_chat_template(**kwargs) passes them, e.g. "
                   "'{\"enable_thinking\": false}'; a row's own chat_template_kwargs object adds to them.")
@click.option("--chat-split", type=click.Choice(["turns"]), default=None,
              help="--chat: one sample per assistant turn, rendered up to it with only that turn trained "
                   "[default: one sample per conversation].")
@click.option("--chat-date", default=None, metavar="YYYY-MM-DD",
              help="--chat: the day the template's strftime_now() renders (at 00:00:00) [default: the day this "
                   "OUT's build was first planned, kept by every resume and rerun].")
@click.option("--bos/--no-bos", default=None,
              help="Prepend BOS to every document, or not [default: as the tokenizer's post-processor does for "
                   "one sequence, e.g. Llama 3 yes, GPT-2 no].")
@click.option("--eos-token", default=None, help="EOS token [default: detected from the tokenizer].")
@click.option("--bos-token", default=None, help="BOS token for --bos [default: detected].")
@click.option("--pad-token", default=None, help="Padding token for document and bestfit packing [default: the tokenizer's, else EOS].")
@click.option("--val-fraction", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="Fraction of documents in a 'val' split (by content hash).")
@click.option("--map", "record_map", default=None, metavar="MODULE:FUNCTION",
              help="Each record (a JSON object, a Parquet/Arrow row as a dict, a text file as {text, file}) through "
                   "this function: it returns the document's text, or None / helixtok.Skip(reason) to leave it out "
                   "(counted). Run in the workers; its source is part of the plan.")
@click.option("--val-size", type=click.IntRange(min=0), default=0,
              help="Exactly this many documents in the 'val' split: those with the smallest content hashes "
                   "(one more pass over the corpus, reading and hashing; text builds).")
@click.option("--split-seed", type=int, default=0, show_default=True, help="Seed of the train/val split hash.")
@click.option("--shard-size", callback=parse_size, default="1GiB", show_default=True, help="Bytes of ids per shard file (about; never over twice it).")
@click.option("--unit-size", callback=parse_size, default="4MiB", show_default=True,
              help="Input bytes per work unit. The token stream does not depend on it; where shard files "
                   "begin and end does (shard groups close on unit boundaries).")
@click.option("--workers", "-j", type=click.IntRange(min=0), default=0,
              help="Tokenizing processes (at most one per work unit) [default: all cores, but no more than one "
                   "per 16 MiB of input with fastokens or gigatoken, 1 MiB with tiktoken or tokenizers].")
@click.option("--overwrite", is_flag=True, help="Replace a dataset or unfinished build in OUT.")
@click.option("--strict", is_flag=True, help="Fail instead of skipping any bad document or file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress (bar or log lines); warnings and the summary still print.")
@click.option("--log-interval", type=click.FloatRange(min=0, min_open=True), default=30, show_default=True,
              help="Off a terminal (a pipe, nohup, a Slurm log): seconds between plain progress lines.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--stall-timeout", type=click.FloatRange(min=0, min_open=True), default=600, show_default=True,
              help="Fail when no worker makes progress for this many seconds. A worker's start-up and a "
                   "resume's re-hashing count, and both slow down on a loaded machine: keep it generous. "
                   "(--executor ray: the cluster's start-up is bounded by the larger of this and "
                   "$HELIXTOK_RAY_START_SECONDS, 60 by default.)")
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
def build(corpus, out, tokenizer, seq_len, packing, min_tail_len, text_field, keep_fields, code, include, exclude, chat, chat_template, loss, truncate,
          chat_kwargs, chat_split, chat_date, bos, eos_token, bos_token,
          pad_token, record_map, val_fraction, val_size, split_seed, shard_size, unit_size, workers, overwrite, strict, quiet, as_json,
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

    from ..pipeline.config import BuildConfig
    from ..pipeline.preload import speculate

    spec = None
    if chat:
        from ..format.tokenizer_file import resolve_tokenizer_path
        from ..pipeline.chat import load_spec

        spec = load_spec(resolve_tokenizer_path(tokenizer), chat_template, loss, truncate or False,
                         text_field or "messages",
                         date=chat_date or "", kwargs=chat_kwargs or "", split_turns=chat_split == "turns")
    elif chat_template or truncate or loss != "assistant" or chat_date or chat_kwargs or chat_split:
        raise click.UsageError("--chat-template, --loss, --truncate, --chat-kwargs, --chat-split and --chat-date "
                               "apply to --chat builds only")
    cfg = BuildConfig(seq_len=seq_len, packing=packing, min_tail_len=min_tail_len, text_field=text_field, chat=spec,
                      keep_fields=keep_fields, code=code,
                      include=include, exclude=exclude,
                      add_bos=bos, eos_token=eos_token, bos_token=bos_token, pad_token=pad_token,
                      val_fraction=val_fraction, val_size=val_size, split_seed=split_seed, transform=record_map, shard_bytes=shard_size,
                      unit_bytes=unit_size, workers=workers, strict=strict, backend=backend,
                      stall_seconds=stall_timeout, special_tokens=special_tokens, strip=strip, executor=executor)
    if cfg.ray_address is None:
        speculate(list(corpus), tokenizer, cfg.num_workers, backend)  # before the imports below
    from ..pipeline.builder import build as run_build
    from ..pipeline.merge import task_from_env

    task = task_from_env(num_tasks, task_index)
    if task is None and os.environ.get("SLURM_ARRAY_TASK_ID", "").strip():
        click.echo(f"note: $SLURM_ARRAY_TASK_ID is {os.environ['SLURM_ARRAY_TASK_ID']} but --num-tasks is not given: "
                   "this task builds the whole corpus (pass --num-tasks N to build one partition per task)", err=True)
    if seq_len < 8:
        click.echo(f"note: --seq-len {seq_len} holds very few tokens per chunk (EOS included); a language model's "
                   "context is usually 512-8192", err=True)
    if task:
        out = os.path.join(out, f"part-{task[0]:05d}")
    con = console(quiet)
    run_build = functools.partial(run_build, staging=staging)
    if quiet:
        m = run_build(list(corpus), out, tokenizer, cfg, overwrite=overwrite, task=task)
    else:
        show = _build_with_progress if con.is_terminal else functools.partial(_build_with_log_lines, every=log_interval)
        m = show(run_build, con, list(corpus), out, tokenizer, cfg, overwrite, task)
    from ..pipeline.builder import UpToDate

    if isinstance(m, UpToDate):  # this very build is already in OUT: nothing was written
        if as_json:
            print_summary(m, out, as_json, console(), up_to_date=True)
        else:
            click.echo(f"up to date: {out} ({m['totals']['chunks']:,} chunks of {m['seq_len']}; inputs and options "
                       "unchanged, nothing rewritten)")
        return
    # -q hides the progress, never the summary or its warnings
    print_summary(m, out, as_json, console(), up_to_date=False, elapsed=time.monotonic() - started,
                  reused=getattr(m, "reused_units", 0), units=getattr(m, "units", 0),
                  processes=getattr(m, "processes", None), notes=getattr(m, "notes", ()),
                  copied=getattr(m, "copied", None))


def _build_with_progress(run_build, con, corpus, out, tokenizer, cfg, overwrite, part):
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

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
    since = {}  # the first progress of tokenizing: (time, bytes done then), where the rate is measured from

    def on_progress(p):
        now = time.monotonic()
        if p.phase == "tokenize":
            since.setdefault("at", (now, p.bytes_done))
        if p.phase == last["phase"] and now - last["at"] < every:
            return
        last.update(phase=p.phase, at=now)
        dt = max(now - t0, 1e-9)
        pct = f" ({100 * p.bytes_done / p.bytes_total:.0f}%)" if p.bytes_total else ""
        eta_s, rate = eta(p, now, since.get("at"))
        eta_s = eta_s or "-"
        phase = f"tokenize x{p.processes}" if p.phase == "tokenize" else p.phase
        click.echo(f"helixtok: {phase}: {p.bytes_done / 1e6:,.1f} of {p.bytes_total / 1e6:,.1f} MB{pct}, "
                   f"{p.documents:,} documents, {p.tokens:,} tokens, {(rate or p.bytes_done / dt) / 1e6:.1f} MB/s, "
                   f"{dt:.0f} s elapsed, ETA {eta_s}", err=True)

    return run_build(corpus, out, tokenizer, cfg, overwrite=overwrite, on_progress=on_progress, task=part)


RATE_AFTER_SECONDS = 1.0  # of tokenizing before a rate, and so an ETA, is given


def eta(p, now: float, since: tuple[float, int] | None) -> tuple[str | None, float | None]:
    """(ETA as H:MM:SS, bytes/s), measured from the first progress of tokenizing: start-up (planning,
    the tokenizer's load) is not throughput.  None until a second of tokenizing has moved bytes."""
    if since is None or now - since[0] < RATE_AFTER_SECONDS or p.bytes_done <= since[1] or not p.bytes_total:
        return None, None
    rate = (p.bytes_done - since[1]) / (now - since[0])
    left = max(0, p.bytes_total - p.bytes_done) / rate
    return time.strftime("%H:%M:%S", time.gmtime(left)), rate


@click.command("train-tokenizer")
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

    from ..format.errors import ConfigError
    from ..pipeline.discover import discover
    from ..pipeline.sources import UnitReader
    from ..pipeline.tally import Tally
    from ..pipeline.tokenizer import train_tokenizer as train
    from ..pipeline.units import plan_units

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
