"""Commands that join, move or convert datasets: merge, repack, push, pull, export, import."""

from __future__ import annotations

import click

from .common import bounded_storage, console, handle_errors, parse_size, print_summary


@click.command()
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
    from ..format.objstore import redact
    from ..pipeline.publish import upload

    m = upload(out, url, overwrite=overwrite, stall=stall_timeout)
    click.echo(f"pushed {m['totals']['chunks']:,} chunks to {redact(url)}")


@click.command()
@click.argument("url")
@click.argument("dest")
@bounded_storage
@handle_errors
def pull(url, dest):
    """Copy the dataset at URL to the local folder DEST (sha256 checked on arrival, manifest last).

    \b
    Example:
      helixtok pull s3://bucket/datasets/web-2048 /local/web-2048 && helixtok verify /local/web-2048
    """
    from ..format.objstore import redact
    from ..pipeline.publish import pull as run_pull

    m = run_pull(url, dest)
    click.echo(f"pulled {m['totals']['chunks']:,} chunks from {redact(url)} to {dest}")


@click.command()
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
    from ..pipeline.merge import MergedAlready
    from ..pipeline.merge import merge as run_merge

    m = run_merge(list(parts), out, overwrite=overwrite)
    if isinstance(m, MergedAlready) and not as_json:  # these very parts are merged in OUT already
        click.echo(f"up to date: {out} ({m['totals']['chunks']:,} chunks of {m['seq_len']}; merged from these "
                   "parts as they are, nothing rewritten)")
        return
    print_summary(m, out, as_json, console(), up_to_date=isinstance(m, MergedAlready))


@click.command()
@click.argument("out")
@click.argument("new")
@click.option("--seq-len", "-L", type=click.IntRange(min=1), default=None,
              help="Tokens per training sequence [default: OUT's].")
@click.option("--pack", "packing", type=click.Choice(["packed", "document", "bestfit"]), default=None,
              help="How documents fill sequences [default: OUT's].")
@click.option("--min-tail-len", type=click.IntRange(min=0), default=None,
              help="document and bestfit: as build's [default: the new packing's own, not OUT's].")
@click.option("--overwrite", is_flag=True, help="Replace a dataset or unfinished build in NEW.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@handle_errors
def repack(out, new, seq_len, packing, min_tail_len, overwrite, as_json):
    """Write OUT's documents into NEW at another --seq-len or --pack, tokenizing nothing: NEW holds what
    `helixtok build` with those options writes. A packed or bestfit NEW links OUT's shards (hard links:
    it costs about the index); a document NEW is written from them. OUT is only read.

    \b
    Example:
      helixtok repack out/ out-4096/ --seq-len 4096 --pack bestfit
    """
    from ..repacking import repack as run_repack

    m = run_repack(out, new, seq_len=seq_len, packing=packing, min_tail_len=min_tail_len, overwrite=overwrite)
    up = bool(getattr(m, "up_to_date", False))
    if up and not as_json:  # NEW already holds this very dataset
        click.echo(f"up to date: {new} ({m['totals']['chunks']:,} chunks of {m['seq_len']}, {m['packing']}; "
                   "nothing rewritten)")
        return
    if not as_json:
        click.echo(f"repacked {out} into {new}: {m.linked} shard group{'s' if m.linked != 1 else ''} linked, "
                        f"{m.packed} written anew; nothing tokenized")
    print_summary(m, new, as_json, console(), up_to_date=up)


@click.group()
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
    from ..export.helixlm import export_helixlm

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
    from ..export.megatron import export_megatron

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
    from ..export.llmc import export_llmc

    r = export_llmc(out, dest, split=split)
    click.echo(f"{dest}: {r['tokens']:,} {r['dtype']} tokens, header magic {r['magic']} version {r['version']}")


@click.group("import")
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
    from ..export.megatron import import_megatron

    m = import_megatron(prefix, out, tokenizer, seq_len=seq_len, shard_bytes=shard_size)
    t = m["totals"]
    click.echo(f"{out}: {t['chunks']:,} chunks x {seq_len} from {t['documents']:,} documents, {t['tokens']:,} tokens "
               f"({t['dropped_tokens']:,} in the last partial chunk dropped)")
