"""Turn an ``.nsys-rep`` into the SQLite export the loader reads, running nsys at most once.

An export already beside the report is reused: ``<stem>.sqlite`` when traceclf stamped it for
the report as it is now, or the user's own export when it is newer than the report (what
``nsys export`` or ``nsys profile --export sqlite`` leaves there). Otherwise the export goes
into the cache root (:mod:`traceclf.ingest.cachedir`, ``--cache-dir`` /
``$TRACECLF_CACHE_DIR`` / the user's cache directory), never beside the report, under a name
keyed by the report's path and identity (size, mtime, first MiB); exports of earlier versions
of that report are removed. Each export is stamped with that identity in SQLite's header, so an
unchanged report is never exported twice and a changed one always is. nsys writes into a
folder of its own (``.traceclf-export-*``, marked as traceclf's) and the export is renamed into
place, so two traceclf runs exporting one report at once both get a whole file. What nsys
leaves must be a regular SQLite export (a symlink there is never followed or stamped). Exports made by earlier traceclf versions in ``.traceclf-cache/`` beside
the report are still reused, never written.

NCCL's NVTX payload values (communicators, message sizes) reach an export only as binary blobs:
traceclf asks for them with ``--include-blobs=true`` whenever the nsys at hand knows the option
(nsys 2025.3 does; ``nsys export --help`` is asked once per nsys binary).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import tempfile
from pathlib import Path

from traceclf.ingest.cachedir import EXPORT_WORK_PREFIX, cache_root, mark
from traceclf.ingest.exportstamp import is_export_of, made_by_traceclf, stamp_for
from traceclf.ingest.schema import inspect_export, is_sqlite_file
from traceclf.support.errors import TraceError
from traceclf.support.owned import is_owned, usable_root

REPORT_SUFFIXES = (".nsys-rep", ".qdrep")  # .qdrep: reports of nsys before 2021.4
CACHE_FOLDER = ".traceclf-cache"
HEAD_BYTES = 1 << 20
TERMINATE_GRACE_S = 5.0
# NVTX extended payloads (NCCL's communicator ids and message sizes) as binary data; nsys
# leaves them out unless asked, and nsys releases before the option reject it.
BLOBS_OPTION = "--include-blobs"
# How traceclf exports, as part of an export's identity: exports made before traceclf asked for
# the blobs are made again, once.
EXPORT_OPTIONS = "blobs"
HELP_TIMEOUT_S = 60


def find_nsys(explicit: Path | None = None) -> Path | None:
    """The nsys to run: ``explicit`` (--nsys), else $NSYS, else ``nsys`` on PATH. A name with
    a folder in it (``./nsys``, ``bin/nsys``) is that file, never one found on PATH."""
    for candidate in (explicit, os.environ.get("NSYS"), "nsys"):
        if not candidate:
            continue
        found = shutil.which(str(candidate))
        if found:
            return Path(found).absolute()
        if explicit is not None:  # asked for this one: do not quietly run another
            return None
    return None


def report_key(report: Path) -> str:
    """Identity of a report's content (size, mtime and a hash of its first MiB) and of the
    options traceclf exports it with."""
    st = report.stat()
    with report.open("rb") as f:
        head = hashlib.sha256(f.read(HEAD_BYTES)).hexdigest()[:16]
    return f"{st.st_size}-{st.st_mtime_ns}-{head}-{EXPORT_OPTIONS}"


def export_options(nsys: Path) -> list[str]:
    """The options beyond ``--type sqlite`` this nsys is given: ``--include-blobs=true`` when
    its ``export --help`` lists the option."""
    try:
        st = nsys.stat()
    except OSError:
        return []
    return [f"{BLOBS_OPTION}=true"] if _knows_blobs(str(nsys), st.st_size, st.st_mtime_ns) else []


@functools.cache
def _knows_blobs(nsys: str, size: int, mtime_ns: int) -> bool:
    """Whether ``nsys export --help`` lists --include-blobs; asked once per binary (its size
    and mtime name it: a replaced nsys is asked again)."""
    del size, mtime_ns  # (the cache key only)
    try:
        done = run_interruptible([nsys, "export", "--help"], timeout=HELP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return False
    return BLOBS_OPTION in f"{done.stdout}\n{done.stderr}"


def export_report(
    report: Path, *, nsys: Path | None = None, cache_dir: Path | None = None, quiet: bool = False
) -> Path:
    """Path of an up-to-date SQLite export of ``report``, exporting it with nsys if needed."""
    try:
        key = report_key(report)
    except OSError as e:
        raise TraceError(report, f"cannot read report: {e.strerror or e}") from None
    existing = find_export(report, key, cache_dir)
    if existing is not None:
        return existing
    executable = find_nsys(nsys)
    if executable is None:
        raise TraceError(report, _nsys_missing(report, nsys))
    target = _cache_file(user_cache_dir(cache_dir), report, key)
    if not usable_root(target.parent, create=True):
        raise TraceError(
            report,
            f"cannot write its SQLite export into the cache folder {target.parent} "
            f"(pass a writable --cache-dir, or export it by hand: {by_hand(report)})",
        )
    from traceclf.support.progress import status  # (rich: only when a report is exported)

    with status(
        f"Exporting {report.name} to SQLite with nsys (once; reused next time)…", quiet=quiet
    ):
        _export(executable, report, target, key)
    _prune_older_versions(target, report)
    return target


def find_export(report: Path, key: str | None = None, cache_dir: Path | None = None) -> Path | None:
    """An existing export of this report as it is now, if any (see the module docstring)."""
    key = key or report_key(report)
    beside = beside_export(report)
    if beside.is_file() and not made_by_traceclf(beside) and _newer(beside, report):
        return beside  # the user's own export, made after the report was written
    candidates = (
        beside,
        _cache_file(report.parent / CACHE_FOLDER, report, key),
        _cache_file(user_cache_dir(cache_dir), report, key),
    )
    return next((p for p in candidates if is_export_of(p, key)), None)


def _newer(export: Path, report: Path) -> bool:
    try:
        return export.stat().st_mtime_ns >= report.stat().st_mtime_ns
    except OSError:
        return False


def beside_export(report: Path) -> Path:
    """``run.sqlite`` for ``run.nsys-rep``: where ``nsys export`` itself would put it."""
    return report.with_suffix(".sqlite")


def user_cache_dir(cache_dir: Path | None = None) -> Path:
    """The cache root: --cache-dir, else $TRACECLF_CACHE_DIR, else the user's cache directory."""
    return cache_root(cache_dir).path


def _cache_file(folder: Path, report: Path, key: str) -> Path:
    return folder / f"{_cache_prefix(report)}{_digest(key)}.sqlite"


def _cache_prefix(report: Path) -> str:
    """Start of the cache names of every version of the report at this path."""
    return f"{report.stem}-{_digest(str(report.resolve()))}-"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _prune_older_versions(target: Path, report: Path) -> None:
    """Delete cached exports of earlier versions of ``report`` beside ``target``: a report
    re-profiled under the same name must not leave a multi-GB export behind each time. Only
    regular files of ours that traceclf stamped are removed."""
    prefix = _cache_prefix(report)
    with contextlib.suppress(OSError):
        for old in target.parent.iterdir():
            if (
                old != target
                and old.name.startswith(prefix)
                and old.suffix == ".sqlite"
                and is_owned(old, "file")
                and made_by_traceclf(old)
            ):
                with contextlib.suppress(OSError):
                    old.unlink()


def _export(nsys: Path, report: Path, target: Path, key: str) -> None:
    """Run ``nsys export`` into a folder of its own beside ``target`` (marked as traceclf's,
    so a dead export's is recognised and cleared), stamp the export, rename it into place."""
    options = export_options(nsys)  # (asked before the folder is made: nothing to clear)
    try:
        work = Path(
            tempfile.mkdtemp(prefix=f"{EXPORT_WORK_PREFIX}{os.getpid()}-", dir=target.parent)
        )
        mark(work)
    except OSError as e:
        raise TraceError(report, f"cannot export into {target.parent}: {e.strerror or e}") from None
    tmp = work / "export.sqlite"
    # Absolute paths: a report named "-x.nsys-rep" must reach nsys as a file, not an option.
    cmd = [
        str(nsys),
        "export",
        "--type",
        "sqlite",
        "--output",
        str(tmp.absolute()),
        *options,
        str(report.absolute()),
    ]
    try:
        try:
            done = run_interruptible(cmd)
        except OSError as e:
            raise TraceError(report, f"cannot run {nsys}: {e.strerror or e}") from None
        if done.returncode != 0:
            raise TraceError(
                report,
                f"nsys export failed (exit {done.returncode}): "
                f"{_first_line(done.stderr, done.stdout)}",
            )
        if tmp.is_symlink():  # stamping it would write into whatever file it points to
            raise TraceError(
                report,
                f"nsys export left a symbolic link at its output, not a file ({nsys}): "
                "traceclf does not follow links it did not make",
            )
        if not tmp.is_file() or tmp.stat().st_size == 0:
            raise TraceError(
                report,
                f"nsys export produced no SQLite file ({_first_line(done.stderr, done.stdout)})",
            )
        if not is_sqlite_file(tmp):
            raise TraceError(
                report,
                f"nsys export wrote a file that is not an SQLite database ({nsys}: "
                f"{_first_line(done.stderr, done.stdout)})",
            )
        try:  # an SQLite file that is no export is the report's problem, never filed as one
            inspect_export(tmp)
        except TraceError as e:
            raise TraceError(report, f"nsys export wrote an unusable file: {e.problem}") from None
        try:
            _stamp_export(tmp, key)
        except sqlite3.DatabaseError as e:
            raise TraceError(report, f"nsys export wrote a damaged SQLite file ({e})") from None
        os.replace(tmp, target)
    finally:  # a failed export leaves nothing behind (rmtree follows no link nsys left)
        shutil.rmtree(work, ignore_errors=True)


def _stamp_export(path: Path, key: str) -> None:
    user_version, application_id = stamp_for(key)
    con = sqlite3.connect(path)
    try:
        con.execute(f"PRAGMA application_id = {application_id}")
        con.execute(f"PRAGMA user_version = {user_version}")
    finally:
        con.close()


def _first_line(*texts: str) -> str:
    lines = (line.strip() for text in texts for line in (text or "").splitlines())
    return next((line for line in lines if line), "no output")


def run_interruptible(
    cmd: list[str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to completion (no timeout by default: big reports export for minutes),
    capturing its output, yet stop it and everything it started when we are interrupted or
    ``timeout`` passes (then subprocess.TimeoutExpired).

    The child gets its own session, so a terminal's Ctrl-C reaches only us; we then end its
    whole process group ourselves (nsys runs helper processes that would outlive it).
    """
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _terminate_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _terminate_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(TERMINATE_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _nsys_missing(report: Path, explicit: Path | None) -> str:
    where = f"{explicit} is not an executable" if explicit else "nsys not found ($NSYS, PATH)"
    return f"{where}; export it by hand: {by_hand(report)} (or pass --nsys / set NSYS)"


def by_hand(report: Path) -> str:
    """The command that exports ``report`` beside it as traceclf would, keeping the blobs that
    hold NCCL's message sizes (an nsys too old for the option refuses it: there, without it),
    with the paths as the user named them."""
    return (
        f"nsys export --type sqlite {BLOBS_OPTION}=true "
        f"-o {shlex.quote(str(beside_export(report)))} {shlex.quote(str(report))}"
    )
