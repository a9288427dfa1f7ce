"""A stand-in ``nsys`` for tests: implements ``nsys export --type sqlite --output OUT REP``.

A fake report is a text file: a magic first line, then the path of the real SQLite export that
"exporting" it produces. Every invocation is appended to a log file, so tests can count runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPORT_MAGIC = "FAKE-NSYS-REPORT"

SCRIPT = """#!{python}
import os, shutil, sys, time
with open({log!r}, "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
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
    path: Path, log: Path, *, behaviour: str = "export", delay: float = 0.0
) -> Path:
    """Write an executable stand-in nsys at ``path``. ``behaviour``: "export" (copy the export
    the report names), "fail" (exit 3 with an error), "nofile" (exit 0, write nothing),
    "symlink" (leave OUT as a symlink to the export the report names) or "hang" (start a
    helper process, write part of OUT and both pids to OUT.pid, sleep)."""
    path.write_text(
        SCRIPT.format(
            python=sys.executable,
            log=str(log),
            behaviour=behaviour,
            magic=REPORT_MAGIC,
            delay=delay,
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
