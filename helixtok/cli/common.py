"""What every command shares: sizes like 1GiB, library errors as one line (no traceback), signals as a clean stop, the console, a dataset's summary."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading

import click

from ..format.errors import ConfigError, HelixtokError, Interrupted, from_cli, memory_error, resource_error
from ..read.sizes import parse_bytes


def _fix(reason: str, examples: list[str]) -> str:
    """What to do about a counted warning, where there is one thing to do."""
    from ..pipeline.discover import CODE_SUFFIXES

    if reason == "unsupported_file" and any(x.lower().endswith(CODE_SUFFIXES) for x in examples):
        return " (source files: --code reads them as text documents)"
    return ""


def parse_size(ctx, param, value):
    if value is None:
        return value
    try:
        return parse_bytes(value)
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None


def bounded_storage(fn):
    """--stall-timeout for a command that may read object storage (a URL for OUT): each of its storage
    calls waits at most that long for a sign of life (reads asked again within it), then fails."""
    from ..format.objstore import READ_STALL_SECONDS, stall_bound

    @functools.wraps(fn)
    def wrapper(*a, stall_timeout, **kw):
        with stall_bound(stall_timeout):
            return fn(*a, **kw)
    return click.option("--stall-timeout", type=click.FloatRange(min=0, min_open=True), default=READ_STALL_SECONDS,
                        show_default=True, help="When OUT is a URL: fail when the storage shows no life for this "
                                                "many seconds (a stopped server).")(wrapper)


def handle_errors(fn):
    """Library errors -> one line on stderr and exit 1; Ctrl-C -> exit 130; never a traceback."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        stops = _stop_on_signals()
        speaking = from_cli.set(True)
        try:
            return fn(*a, **kw)
        except HelixtokError as e:
            raise click.ClickException(str(e)) from e
        except KeyboardInterrupt as e:
            signum = getattr(e, "signum", signal.SIGINT)
            name = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
            click.echo(f"\ninterrupted{name}; rerun the same command to resume", err=True)
            sys.exit(128 + signum)
        except BrokenPipeError:
            # Whoever read stdout stopped (`helixtok show OUT | head`): nothing is wrong; stop as a
            # Unix tool does, quietly, with stdout pointed at /dev/null so its flush at exit is quiet too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(128 + signal.SIGPIPE)
        except Exception as e:  # noqa: BLE001 - only memory's failures become a line; any other is a bug
            if isinstance(e, OSError) and (err := resource_error(e)) is not None:
                raise click.ClickException(str(err)) from e
            if (err := memory_error(e, "running the command")) is not None:
                raise click.ClickException(str(err)) from None
            if not isinstance(e, OSError):
                raise
            where = f"{e.filename}: " if e.filename else ""
            raise click.ClickException(f"{where}{e.strerror or e}") from e
        finally:
            from_cli.reset(speaking)
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


def console(quiet=False):
    from rich.console import Console

    return Console(stderr=True, quiet=quiet)


def print_summary(m, out, as_json, con, up_to_date=None, elapsed=None, reused=0, units=0, processes=None,
                  notes=(), copied=None):
    """The table of splits, every term of the token arithmetic, what the build did, and warnings."""
    from ..inspect.summary import lines, summarize

    t, summ = m["totals"], summarize(m, out)
    if as_json:
        click.echo(json.dumps({"out": out, **({"up_to_date": up_to_date} if up_to_date is not None else {}),
                               "dtype": m["dtype"], "seq_len": m["seq_len"], "packing": m["packing"],
                               "totals": t, "splits": {k: {kk: v[kk] for kk in ("num_chunks", "num_tokens")}
                                                       for k, v in m["splits"].items()},
                               "skipped": m["skipped"], "warnings": m["warnings"], **summ,
                               **({"elapsed_s": round(elapsed, 3), "reused_units": reused}
                                  if elapsed is not None else {}),
                               **({"processes": {"count": processes[0], "why": processes[1]}} if processes else {}),
                               **({"notes": list(notes)} if notes else {})}))
        for n in notes:
            con.print("[yellow]note[/]: " + n)
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    for a in summ["alerts"]:  # first: documents dropped or chunks mostly padding decide whether to train on it
        con.print("[yellow]warning[/]: " + escape(a))
    tab = Table(title=escape(f"{out}  ({m['packing']}, seq_len {m['seq_len']}, {m['dtype']})"), show_header=True)
    for col in ("split", "documents", "chunks", "stored tokens", "pad", "dropped"):
        tab.add_column(col, justify="right" if col != "split" else "left")
    for name, s in m["splits"].items():
        tab.add_row(name, f"{s['documents']:,}", f"{s['num_chunks']:,}", f"{s['num_tokens']:,}",
                    f"{s['pad_tokens']:,}", f"{s['dropped_tokens']:,}")
    Console().print(tab)
    click.echo(f"documents {t['documents']:,}  skipped {t['skipped_documents']:,}  repaired {t['repaired_documents']:,}"
               + ("" if m.get("chat") else f"  dropped whole (below --min-tail-len) {t.get('dropped_documents', 0):,}"))
    # Every term of the arithmetic, so no token is unaccounted for.
    click.echo(f"tokens: produced {t['tokens']:,} + pad {t['pad_tokens']:,} - dropped {t['dropped_tokens']:,} "
               f"= stored {t['chunks'] * m['seq_len']:,} = {t['chunks']:,} chunks x {m['seq_len']}")
    for line in lines(summ, elapsed=elapsed, reused=reused, units=units):
        click.echo(line)
    if processes:
        click.echo(f"tokenizing processes: {processes[0]} ({processes[1]})")
    if copied is not None and units > reused:
        click.echo(f"work units written once, straight into their shards: {units - reused - copied:,} of "
                   f"{units - reused:,} (the others' ids went to a file first, then copied into place)")
    for kind in ("skipped", "warnings"):
        for reason, v in m[kind].items():
            con.print(f"[yellow]warning[/]: {v['count']:,} x {reason.replace('_', ' ')}, e.g. "
                      + escape("; ".join(v["examples"][:3])) + _fix(reason, v["examples"]))
    for n in notes:
        con.print("[yellow]note[/]: " + escape(n))
