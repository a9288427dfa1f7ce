"""A stand-in ``nsys`` for tests: implements ``nsys export --type sqlite --output OUT REP``,
with ``--include-blobs=true`` before REP when it plays an nsys that has the option (2025.3
does), and ``nsys export --help``.

A fake report is a text file: a magic first line, then the path of the real SQLite export that
"exporting" it produces. Every export is appended to a log file, so tests can count runs; each
``export --help`` to the log's ``.help`` file beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPORT_MAGIC = "FAKE-NSYS-REPORT"

SCRIPT = """#!{python}
import os, shutil, sys, time
args = sys.argv[1:]
blobs = {blobs!r}
if args == ["export", "--help"]:
    with open({log!r} + ".help", "a") as log:
        log.write("export --help\\n")
    if {behaviour!r} == "hang_help":
        import subprocess
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open({log!r} + ".help.pid", "w") as f:
            f.write(f"{{os.getpid()}} {{helper.pid}}")
        time.sleep(600)
    print("usage: nsys export [<args>] [nsys-rep-file]")
    print("  --type <format>  sqlite, ...")
    if blobs:
        print("  --include-blobs=<true|false>  Controls if NVTX extended payloads are exported")
    sys.exit(0)
with open({log!r}, "a") as log:
    log.write(" ".join(args) + "\\n")
if "--include-blobs=true" in args:
    if not blobs:
        print("unrecognised option '--include-blobs=true'", file=sys.stderr)
        sys.exit(1)
    args.remove("--include-blobs=true")
if args[:4] != ["export", "--type", "sqlite", "--output"] or len(args) != 6:
    sys.exit("usage: nsys export --type sqlite --output OUT REP")
out, rep = args[4], args[5]
behaviour = {behaviour!r}
if behaviour == "fail":
    print("Importer error: the report file is damaged (status 0x17)", file=sys.stderr)
    print("second line that traceclf should not show", file=sys.stderr)
    sys.exit(3)
if behaviour == "hang":
    import subprocess
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(out, "wb") as f:
        f.write(b"SQLite format 3\\0half-written")
    with open(out + ".pid", "w") as f:
        f.write(f"{{os.getpid()}} {{helper.pid}}")
    time.sleep(600)
lines = open(rep, "rb").read().decode("utf-8", "replace").splitlines()
if not lines or lines[0] != {magic!r}:
    print("Error: cannot open report file " + rep + ": wrong file format", file=sys.stderr)
    sys.exit(1)
if behaviour == "symlink":  # --output left as a link to another SQLite file
    os.symlink(lines[1], out)
    sys.exit(0)
if behaviour == "nofile":
    print("Export completed.")
    sys.exit(0)
time.sleep({delay})
shutil.copyfile(lines[1], out)
"""


def write_fake_nsys(
    path: Path,
    log: Path,
    *,
    behaviour: str = "export",
    delay: float = 0.0,
    blobs: bool = True,
) -> Path:
    """Write an executable stand-in nsys at ``path``. ``behaviour``: "export" (copy the export
    the report names), "fail" (exit 3 with an error), "nofile" (exit 0, write nothing),
    "symlink" (leave OUT as a symlink to the export the report names), "hang" (start a
    helper process, write part of OUT and both pids to OUT.pid, sleep) or "hang_help" (the
    same in ``export --help``, both pids to the log's ``.help.pid``). ``blobs``: it knows
    --include-blobs (its help lists it), as nsys 2025.3 does; an older one does not and
    rejects it."""
    path.write_text(
        SCRIPT.format(
            python=sys.executable,
            log=str(log),
            behaviour=behaviour,
            magic=REPORT_MAGIC,
            delay=delay,
            blobs=blobs,
        )
    )
    path.chmod(0o755)
    return path


def write_fake_report(path: Path, export: Path) -> Path:
    """A fake ``.nsys-rep`` that the stand-in exports as a copy of ``export``."""
    path.write_text(f"{REPORT_MAGIC}\n{export}\n")
    return path


def invocations(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def help_calls(log: Path) -> int:
    """How often ``nsys export --help`` was asked."""
    helps = log.with_name(log.name + ".help")
    return len(helps.read_text().splitlines()) if helps.exists() else 0
