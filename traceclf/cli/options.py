"""What several ``traceclf`` commands share: checks of what the user named before anything
heavy runs, the one-line failure, and the options whose help must read the same everywhere."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from traceclf.support.errors import TraceError, show_warnings


def run_inputs(named: list[str], rules_dir: Path | None) -> list[Path]:
    """Every input of the run, however it is spelled (folders and patterns expanded, the export
    beside each report, the rule files): nothing traceclf writes may land on one."""
    from traceclf.ingest.inputs import named_files

    inputs = [Path(n) for n in named if n.lower().endswith(".json")]
    inputs += named_files([n for n in named if not n.lower().endswith(".json")])
    if rules_dir is not None and rules_dir.is_dir():
        inputs += [*rules_dir.glob("*.yaml"), *rules_dir.glob("*.yml")]
    return inputs


def check_report_output(
    output: str | None, named: list[str], rules_dir: Path | None
) -> Path | None:
    """Fail before the analysis, not after it, when the report could not or must not be
    written: no folder, a folder or a disk in the way, or any input of the run."""
    if output is None:
        return None
    from traceclf.support.atomic import check_output

    check_output(output, run_inputs(named, rules_dir))
    return Path(output)


def check_exports(
    out: Path | None, export_trace: str | None, export_dir: Path | None, fmt: str
) -> None:
    """The extra files must not land on the report or on each other; --export-dir must be a
    folder (or nothing yet)."""
    if export_trace is not None and out is not None and _same(Path(export_trace), out):
        raise click.UsageError("--export-trace and -o name the same file")
    if export_dir is not None:
        try:
            there, folder = export_dir.exists(), export_dir.is_dir()
        except OSError as e:  # (a name too long for the file system, ...)
            raise TraceError(export_dir, f"--export-dir: {e.strerror}") from None
        if there and not folder:
            raise TraceError(export_dir, "--export-dir: not a folder")
        for path in (out, Path(export_trace) if export_trace else None):
            if path is not None and _same(path.parent, export_dir) and path.suffix == f".{fmt}":
                from traceclf.report.frames import TABLES

                if path.stem in TABLES:
                    raise click.UsageError(f"{path} would be overwritten by --export-dir")


def _same(a: Path, b: Path) -> bool:
    return a.absolute().resolve() == b.absolute().resolve()


def nsys_path_of(value: str | None) -> Path | None:
    """--nsys as given: a bare name is looked up on PATH, anything with a slash (./nsys) is
    that file (pathlib would turn ./nsys into nsys, which PATH lookup would then find)."""
    if value is None:
        return None
    return Path(value).absolute() if "/" in value else Path(value)


MAX_PROBLEM_LINES = 50  # a rule folder with thousands of broken entries: the first ones


def fail(*problems: str) -> None:
    """Exit 2 with one line on stderr per problem (several: every faulty rule entry at once)."""
    from traceclf.support.escape import visible
    from traceclf.support.panics import release

    release()  # (a read still running on another thread holds descriptor 2)
    for problem in problems[:MAX_PROBLEM_LINES]:
        click.echo(f"traceclf: error: {visible(problem)}", err=True)
    if len(problems) > MAX_PROBLEM_LINES:
        click.echo(f"traceclf: error: … and {len(problems) - MAX_PROBLEM_LINES} more", err=True)
    sys.exit(2)


def utf8_text(_ctx, _param, value):
    """The text given (an option's value, an argument's values), refused where it is not valid
    UTF-8: Python keeps undecodable bytes of the command line as lone surrogates, which match
    nothing a trace holds and which the libraries the text reaches cannot encode (an internal
    UnicodeEncodeError, where a usage error is due)."""
    for text in value if isinstance(value, tuple) else (value,):
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise click.BadParameter("not valid UTF-8 text") from None
    return value


# Options shared by several commands, defined once so their help reads the same everywhere.
step_range_option = click.option(
    "--step-range",
    metavar="REGEX",
    callback=utf8_text,
    help="Regular expression for the NVTX ranges that mark one training step "
    "(default: names like 'step 12', 'iteration 3', 'batch 7', 'ProfilerStep#5').",
)
nsys_option = click.option(
    "--nsys",
    "nsys_path",
    type=click.Path(path_type=str),
    help="nsys executable used to export .nsys-rep files (default: $NSYS, then nsys on PATH).",
)
rules_option = click.option(
    "--rules",
    "rules_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Extra rule/fix YAML folder, merged over the bundled rules/.",
)
no_cache_option = click.option(
    "--no-cache",
    is_flag=True,
    help="Neither read nor write the cache (each export's analysis result, and its trace "
    "model as Parquet where the whole export is read).",
)


def _cache_dir(_ctx, _param, cache_dir: Path | None) -> Path | None:
    """A cache folder that cannot be one is no reason to fail: the run goes on without a
    cache (as with any unusable cache), said once."""
    if cache_dir is not None and cache_dir.exists() and not cache_dir.is_dir():
        import warnings

        from traceclf.support.errors import TraceWarning

        warnings.warn(
            TraceWarning(f"{cache_dir}: --cache-dir is not a folder: no cache"), stacklevel=1
        )
    return cache_dir


cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(path_type=Path),
    callback=_cache_dir,
    help="Cache folder (default: $TRACECLF_CACHE_DIR, else the user cache directory, "
    "e.g. ~/.cache/traceclf). Nothing is written beside your traces unless you ask: "
    "--cache-dir . keeps the cache in the current folder.",
)
quiet_option = click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No progress on stderr (traceclf's own warnings still show, other libraries' do not).",
    callback=lambda _ctx, _param, quiet: show_warnings(quiet) or quiet,
)
all_steps_option = click.option(
    "--all-steps",
    is_flag=True,
    help="Read and analyse every step of the capture. By default a long capture is analysed "
    "on a sample of its steady-state steps (runs of consecutive steps spread evenly over the "
    "steady state, up to a budget of event rows), so that time and memory follow the steps "
    "analysed, not the capture's length; the report says how many steps were analysed.",
)


def analysis_options(command):
    """The options of every command that analyses traces."""
    for option in reversed(
        (
            step_range_option,
            all_steps_option,
            nsys_option,
            rules_option,
            no_cache_option,
            cache_dir_option,
        )
    ):
        command = option(command)
    return command
