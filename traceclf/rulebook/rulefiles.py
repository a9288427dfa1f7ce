"""Which files make a rule set, and a digest of them without reading them (no YAML: a cached
report is checked against its rules in a fraction of a parse)."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

from traceclf.support.errors import TraceError
from traceclf.support.version import PACKAGE

MAX_RULE_FILES = 200  # per folder
# Per folder, all its files together: what parsing and checking costs grows with the bytes
# and with the entries and values (each expression ~0.1-0.2 ms to parse and check). The
# bundled rules hold ~2,900 values in ~140 KB; at both limits a folder loads in seconds
# (docs/security.md), where 44,000 definitions in 1 MiB took 339 s before (issue 29).
MAX_RULES_BYTES = 1 << 20


def bundled_rules_dir() -> Path:
    """The rules shipped with traceclf: inside the wheel, else the checkout's rules/."""
    for folder in (
        PACKAGE / "rules",
        Path(__file__).resolve().parents[2] / "rules",
    ):
        if folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    raise TraceError(None, "bundled rules not found (reinstall traceclf)")


def yaml_files(folder: Path) -> list[Path]:
    found = sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")])
    if len(found) > MAX_RULE_FILES:
        raise TraceError(folder, f"more than {MAX_RULE_FILES} rule files in this folder")
    return found


def rules_digest(rules_dir: Path | str | None) -> str:
    """A digest of the rule files a rule set is read from (bundled, then ``rules_dir``'s):
    each one's name, device, inode, size and modification time, what a cached report was
    judged by. Not their text: a rule file is read once per analysis, so the rules checked
    are the rules applied; an edit changes the time, and a file that changed while it was
    read files its report under a key that no later run has."""
    digest = hashlib.sha256()
    folders = [bundled_rules_dir(), *([Path(rules_dir)] if rules_dir is not None else [])]
    for folder in folders:
        with contextlib.suppress(OSError, TraceError):  # (reading the rules says what is wrong)
            for path in yaml_files(folder):
                st = path.stat()
                digest.update(
                    f"{path.name}\0{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}\0".encode(
                        errors="surrogateescape"
                    )
                )
        digest.update(b"\1")
    return digest.hexdigest()[:32]
