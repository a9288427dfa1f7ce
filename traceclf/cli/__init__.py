"""The ``traceclf`` command line."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import click

from traceclf.cli.options import (
    analysis_options,
    cache_dir_option,
    check_exports,
    check_report_output,
    fail,
    nsys_path_of,
    quiet_option,
    rules_option,
    run_inputs,
    utf8_text,
)
from traceclf.support.errors import TraceError, TraceErrors, show_warnings
from traceclf.support.version import __version__

FORMATS = ("terminal", "json", "md", "html", "csv")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="traceclf")
def cli() -> None:
    """Say what bounds a GPU training run (memory, communication, host or compute), with
    evidence and fixes, from Nsight Systems traces.

    Exit codes: 0 done; 1 `compare` found a regression; 2 bad input or usage; 3 `compare`
    could not compare (a run without steps, one traceclf abstained on, or runs not comparable).
    """


@cli.command()
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option(
    "-f",
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default="terminal",
    show_default=True,
    help="Report format: rich terminal text, the JSON report contract, Markdown for tickets "
    "(with -o, its figures are written beside it as PNG files), one self-contained HTML file "
    "with figures, or csv: the per-rank table (every measure; --export-dir for all tables).",
)
@click.option(
    "-o",
    "--output",
    metavar="FILE",
    help="Write the report to this file (atomically; a FIFO or device is written through; "
    "never onto an input) instead of stdout. Required for html.",
)
@click.option(
    "--export-dir",
    type=click.Path(path_type=Path),
    metavar="DIR",
    help="Also write every table of the report into DIR, one file each: steps, ranks, kernels "
    "(like nsys cuda_gpu_kern_sum), idle_gaps (one row per gap, the longest, with its time "
    "in nsys), idle_gap_bins (every gap by length and cause), collectives, phases, "
    "host_attribution, communicators, late_arrivals.",
)
@click.option(
    "--export-format",
    type=click.Choice(("csv", "parquet")),
    default="csv",
    show_default=True,
    help="File type of the --export-dir tables.",
)
@click.option(
    "--export-trace",
    metavar="FILE.json",
    help="Also write the steady-state window as a Chrome/Perfetto trace-event file (one track "
    "per rank and CUDA stream, NVTX and CUDA API calls per host thread, launch arrows, GPU "
    "metrics; open it in ui.perfetto.dev). Holistic Trace Analysis reads it too; with several "
    "ranks, one file per rank also goes into FILE.hta/.",
)
@analysis_options
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Files analysed in parallel (default: number of CPUs, at most 4). Inside one file, "
    "ranks are measured two at a time where two CPUs are free, one after another with "
    "--all-steps.",
)
@click.option(
    "--dask",
    "dask_address",
    metavar="ADDRESS",
    help="Run the per-file analysis on a Dask distributed cluster at ADDRESS "
    "(e.g. tcp://scheduler:8786) instead of local processes.",
)
@click.option(
    "--job",
    "as_job",
    is_flag=True,
    help="Treat all inputs as ranks of one job (one report), whatever the evidence says.",
)
@click.option(
    "--runs",
    "as_runs",
    is_flag=True,
    help="Treat each input file as a separate run (one report each, plus a summary table).",
)
@quiet_option
def analyze(
    inputs: tuple[str, ...],
    fmt: str,
    output: str | None,
    export_dir: Path | None,
    export_format: str,
    export_trace: str | None,
    step_range: str | None,
    all_steps: bool,
    nsys_path: str | None,
    rules_dir: Path | None,
    no_cache: bool,
    cache_dir: Path | None,
    jobs: int | None,
    dask_address: str | None,
    as_job: bool,
    as_runs: bool,
    quiet: bool,
) -> None:
    """Analyse INPUT... and report the bound, the evidence and the fixes.

    INPUT is a .sqlite export, a .nsys-rep (exported once with `nsys export --type sqlite`
    into the cache), several per-rank files, or a folder of them. Every rank is analysed
    over its steady state (warm-up steps dropped). Several files are merged into one report
    only when they look like ranks of one job (same session or overlapping captures or
    rank-numbered names, and the same GPU, step anchor and step time); otherwise each run gets
    its own report plus a summary table. --job or --runs overrides the guess. Of several
    files, one with no GPU work to judge (a launcher's) is left out with a warning.
    """
    from traceclf.support.process import check_address_space

    check_address_space()
    from traceclf.pipeline.analysis import AnalysisOptions, analyze_inputs, chosen_inputs
    from traceclf.render import render, render_json_text
    from traceclf.support.atomic import written_together

    if fmt == "html" and output is None:
        raise click.UsageError("--format html needs -o/--output FILE")
    if as_job and as_runs:  # (one flag silently winning over the other hides a mistake)
        raise click.UsageError(
            "--job (all inputs are one job) and --runs (each file its own run) contradict "
            "each other: give one"
        )
    given = click.get_current_context().get_parameter_source("export_format")
    if export_dir is None and given is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--export-format names the file type of --export-dir: give both")
    out = check_report_output(output, list(inputs), rules_dir)
    trace_out = check_report_output(export_trace, list(inputs), rules_dir)
    check_exports(out, export_trace, export_dir, export_format)
    opts = AnalysisOptions(
        step_regex=step_range,
        all_steps=all_steps,
        nsys=nsys_path_of(nsys_path),
        rules_dir=rules_dir,
        use_cache=not no_cache,
        cache_dir=cache_dir,
        jobs=jobs,
        dask_address=dask_address,
        quiet=quiet,
        grouping="job" if as_job else "runs" if as_runs else "auto",
    )
    chosen = chosen_inputs(list(inputs), opts)
    written = run_inputs(list(inputs), rules_dir)
    report = None
    if fmt == "json" and export_dir is None and trace_out is None:
        text = chosen.cached_json(opts)  # (an unchanged run: its report as filed)
        if text is None:
            report = analyze_inputs(list(inputs), opts, chosen)
            text = chosen.cached_json(opts)  # (filed just now: encoded once, not twice)
        if text is not None:
            render_json_text(text, out, written)
            return
    if report is None:
        report = analyze_inputs(list(inputs), opts, chosen)
    # The report, its tables and its trace file appear together or not at all: a run that
    # exits 2 leaves none of them, nor a report on stdout (printed once the rest is staged).
    with written_together(written):
        if export_dir is not None:
            from traceclf.export.files import export_tables

            export_tables(report, export_dir, export_format, written)
        if trace_out is not None:
            from traceclf.export.perfetto import write_trace
            from traceclf.report.runset import RunSet

            runs = report.runs if isinstance(report, RunSet) else [report]
            write_trace(
                runs, trace_out, inputs=written, use_cache=not no_cache, cache_dir=cache_dir
            )
        render(report, fmt, out, written)


@cli.command()
@click.argument("before", metavar="BASELINE")
@click.argument("after", metavar="CANDIDATE...", nargs=-1, required=True)
@click.option(
    "--threshold",
    type=float,
    default=0.05,
    show_default=True,
    help="Step-time increase (fraction) beyond the noise band that counts as a regression.",
)
@click.option(
    "-f",
    "--format",
    "fmt",
    type=click.Choice(("terminal", "md", "html", "json")),
    default="terminal",
    show_default=True,
    help="Output format: rich terminal text, Markdown for a ticket, one self-contained HTML "
    "file with a waterfall of the step change (needs -o), or the JSON comparison contract.",
)
@click.option(
    "-o",
    "--output",
    metavar="FILE",
    help="Write to this file (atomically; never onto BASELINE or a CANDIDATE) instead of "
    "stdout. "
    "Required for html.",
)
@click.option(
    "--allow-inconclusive",
    is_flag=True,
    help="Exit 0, not 3, when a comparison cannot be made (a run without steps, one "
    "traceclf abstained on, or runs not comparable: different GPUs, step anchors, rank counts "
    "or CUDA-graph tracing levels), with nothing on stderr; the output still says why.",
)
@analysis_options
@quiet_option
def compare(
    before: str,
    after: tuple[str, ...],
    threshold: float,
    fmt: str,
    output: str | None,
    allow_inconclusive: bool,
    step_range: str | None,
    all_steps: bool,
    nsys_path: str | None,
    rules_dir: Path | None,
    no_cache: bool,
    cache_dir: Path | None,
    quiet: bool,
) -> None:
    """Compare runs: BASELINE and each CANDIDATE are traces (any `analyze` input; use a
    folder for several ranks) or saved JSON reports (report_version 1 or 2). Says what
    changed inside the step (kernel by kernel, NVTX phase by phase, idle by cause, exposed
    communication by kind, launch shapes, peak memory, and how they add up to the step change)
    and what explains it (measures that moved, fixes that became applied, CUDA-graph tracing
    mode). With several candidates, prints one row each against the baseline. Exits 1 if any
    candidate regresses beyond --threshold; otherwise 3 if a comparison cannot be made (a run
    without steps, one traceclf abstained on, or runs whose step times measure different
    things: other GPUs, step anchors, rank counts or CUDA-graph tracing levels), with one line
    on stderr saying why."""
    from traceclf.support.process import check_address_space

    check_address_space()
    from traceclf.compare.regression import MultiComparison, compare_many
    from traceclf.pipeline.analysis import AnalysisOptions
    from traceclf.render.compared import render_comparison
    from traceclf.support.escape import visible

    opts = AnalysisOptions(
        step_regex=step_range,
        all_steps=all_steps,
        nsys=nsys_path_of(nsys_path),
        rules_dir=rules_dir,
        use_cache=not no_cache,
        cache_dir=cache_dir,
        quiet=quiet,
    )
    if fmt == "html" and output is None:
        raise click.UsageError("--format html needs -o/--output FILE")
    out = check_report_output(output, [before, *after], rules_dir)
    result = compare_many(before, list(after), threshold=threshold, opts=opts)
    try:
        render_comparison(result, fmt, out)
    except BrokenPipeError:  # (`| head`: the reader stopped early; the verdict still gates)
        _reader_gone()
    comparisons = result.comparisons if isinstance(result, MultiComparison) else [result]
    for c in comparisons:
        if not (c.conclusive or allow_inconclusive):  # (its summary says why, in one line)
            click.echo(f"traceclf: {visible(c.summary)}", err=True)
    if result.regression:
        sys.exit(1)
    sys.exit(0 if result.conclusive or allow_inconclusive else 3)


@cli.command("measures")
def measures_cmd() -> None:
    """Define every measure in the report (all for the steady-state window; *_frac are
    fractions of wall time unless stated), then the facts about the run that rules may use
    besides them."""
    from rich.table import Table

    from traceclf.judge.vocabulary import CONTEXT_NAMES
    from traceclf.measures import MEASURES
    from traceclf.render.fit import new_console

    def definitions(title: str, names: dict[str, str]) -> Table:
        table = Table(title, "definition", show_edge=False, box=None)
        for name, definition in names.items():
            table.add_row(name, definition)
        return table

    console = new_console()
    console.print(definitions("measure", MEASURES))
    console.print()
    console.print(definitions("fact about the run", CONTEXT_NAMES))


@cli.command("rules")
@rules_option
def rules_cmd(rules_dir: Path | None) -> None:
    """List the classification rules and the fixes they can propose."""
    from traceclf.render.rules import list_rules

    list_rules(rules_dir)


@cli.command("kernels")
@click.argument("names", nargs=-1, required=True, metavar="NAME...", callback=utf8_text)
@rules_option
def kernels_cmd(names: tuple[str, ...], rules_dir: Path | None) -> None:
    """Say which kernel family each kernel NAME falls in, and why: the taxonomy entry that
    matches it first (its name, rule file and pattern), the entries further down that would
    have matched too, and for a communication kernel its library and collective kind. Quote
    demangled names: they hold spaces and brackets."""
    from traceclf.render.rules import explain_kernels

    explain_kernels(list(names), rules_dir)


def _complete_fix_ids(_ctx, _param, incomplete: str) -> list[str]:
    """Shell completion of fix ids (bundled rules)."""
    from traceclf.judge.vocabulary import load_rules

    try:
        ids = load_rules(None).fixes
    except TraceError:
        return []
    return [i for i in sorted(ids) if i.startswith(incomplete.lower())]


@cli.command()
@click.argument("fix_id", shell_complete=_complete_fix_ids)
@rules_option
def explain(fix_id: str, rules_dir: Path | None) -> None:
    """Print one fix in full: why, the config to paste, preconditions, pitfalls and the gain
    ceiling with what it assumes.
    FIX_ID is case-insensitive (`traceclf rules` lists them)."""
    from traceclf.render.rules import explain_fix

    explain_fix(fix_id, rules_dir)


@cli.group("cache")
def cache_group() -> None:
    """Show or clear traceclf's cache (trace models, analysis results, exports of
    .nsys-rep reports). It lives in --cache-dir, else $TRACECLF_CACHE_DIR, else the user
    cache directory. Only what traceclf created and marked as its own there is ever deleted."""


@cache_group.command("info")
@cache_dir_option
def cache_info(cache_dir: Path | None) -> None:
    """Where the cache is, why there, and what it holds."""
    from traceclf.ingest.cachedir import usage
    from traceclf.support.units import fmt_bytes

    u = usage(cache_dir)
    click.echo(f"cache folder: {u.root.path} (from {u.root.origin})")
    click.echo(
        f"holds: {u.slots} export{'s' * (u.slots != 1)} cached ({u.models} trace model"
        f"{'s' * (u.models != 1)}, {u.results} result set{'s' * (u.results != 1)}), "
        f"{u.exports} nsys export{'s' * (u.exports != 1)}; {fmt_bytes(u.bytes)}"
    )


@cache_group.command("clear")
@cache_dir_option
def cache_clear(cache_dir: Path | None) -> None:
    """Delete everything traceclf cached in the cache folder (only what traceclf created and
    marked as its own there; anything else in the folder stays, whatever its name)."""
    from traceclf.ingest.cachedir import cache_root, clear
    from traceclf.support.units import fmt_bytes

    removed, freed = clear(cache_dir)
    click.echo(
        f"removed {removed} item{'s' * (removed != 1)} ({fmt_bytes(freed)}) "
        f"from {cache_root(cache_dir).path}"
    )


# A group run without a command: click 8.2+ raises this (a UsageError) where 8.1 printed the
# help and exited 0; both now print the help, as --help does.
NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def main() -> None:
    from traceclf.support.process import (
        Terminated,
        end_on_sigterm,
        escape_unencodable_output,
        exit_without_collecting,
    )

    # numpy's OpenBLAS starts a thread per core that spins a while after start-up; traceclf
    # calls no BLAS routine, and on two cores that thread took CPU from polars and connectorx
    # (0.1-0.2 s of a 4.5 s kernel-dense run). Before numpy is imported; workers inherit it.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    show_warnings()
    escape_unencodable_output()
    end_on_sigterm()
    exit_without_collecting()
    try:
        try:
            cli.main(standalone_mode=False, prog_name="traceclf")
        finally:  # (a write to stdout that fails is one line below, not an error at exit)
            sys.stdout.flush()
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except NO_ARGS_IS_HELP as e:  # `traceclf`, `traceclf cache`: asking what there is
        click.echo(e.ctx.get_help())
        sys.exit(0)
    except click.UsageError as e:  # one line, like every other error
        command = e.ctx.command_path if e.ctx else "traceclf"
        fail(f"{' '.join(e.format_message().split())} (see: {command} --help)")
    except click.ClickException as e:
        fail(" ".join(e.format_message().split()))
    except click.Abort as e:
        _stopped(isinstance(e.__cause__, Terminated))
    except TraceErrors as e:  # every faulty entry of a rule folder, one line each
        fail(*(str(error) for error in e.errors))
    except TraceError as e:
        fail(str(e))
    except BrokenPipeError:
        sys.exit(0)
    except OSError as e:
        if e.filename is not None or e.errno not in STREAM_WRITE_ERRORS:
            _internal(e)
        fail(f"standard output: cannot write the report: {e.strerror}")
    except MemoryError:
        fail("out of memory (the analysis needs more than this machine or its limits allow)")
    except ImportError as e:  # a library that cannot load: memory limits or a broken install
        fail(f"cannot load {e.name or 'a library'}: {' '.join(str(e).split())[:200]}")
    except Exception as e:  # a bug, not bad input: keep the traceback one env var away
        if (interrupt := _interrupt_behind(e)) is not None:
            # (Ctrl-C or SIGTERM while a class is being made, in an import: Python 3.11 wraps
            # it in "RuntimeError: Error calling __set_name__", which is no bug of ours)
            _stopped(isinstance(interrupt, Terminated))
        _internal(e)


# Errors of a write to an open stream (stdout redirected to a full disk, a device): the
# user's environment, not a bug
STREAM_WRITE_ERRORS = {errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT}


def _internal(e: BaseException) -> None:
    """A bug, not bad input: one line, the traceback one env var away."""
    if os.environ.get("TRACECLF_DEBUG"):
        from traceclf.support.panics import release

        release()  # (the traceback goes to descriptor 2, which a running read may hold)
        raise e
    from traceclf.support.errors import internal_problem

    fail(internal_problem(e))


def _reader_gone() -> None:
    """stdout's reader has gone: what is left to print goes nowhere (no second error when the
    interpreter flushes it at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (or SIGTERM, a subclass) an exception was raised from, if any."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:  # (a chain can loop back on itself)
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _stopped(terminated: bool) -> None:
    """End a run that SIGTERM or Ctrl-C stopped, its cleanup done: one line, 143 or 130."""
    from traceclf.support.panics import release
    from traceclf.support.process import TERMINATED_EXIT

    release()  # (a read still running on another thread holds descriptor 2)
    click.echo(f"traceclf: {'terminated' if terminated else 'aborted'}", err=True)
    sys.exit(TERMINATED_EXIT if terminated else 130)


if __name__ == "__main__":
    main()
