"""A rule set validated once, remembered in the cache: re-analysing an unchanged export needs
the rules (the result's cache key, the verdict), and validating their regexes, like running
them, takes polars' engine — whose import costs more than the rest of a cached re-analysis.

The stamp ``rules-<32 hex>.json`` in the cache root is keyed by traceclf's version, the source
of the code that validates rules and defines their names (rulebook, judge, measures) and every
rule file's path and bytes. It holds the names rules may use (the measures and context
names) and the answers of the GPU family and host link patterns for the names seen so far.
Its presence means the rule set with that key passed every check; a damaged or foreign stamp
is ignored (the rules are then checked again), and a tampered one can only skip checks of
patterns, which polars then still refuses when it runs them.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from traceclf.support.owned import is_owned, read_head, usable_root
from traceclf.support.version import PACKAGE, __version__

# Whether patterns are checked with polars as they are read (not when the stamp vouches).
CHECKING: contextvars.ContextVar[bool] = contextvars.ContextVar("checking", default=True)
PREFIX = "rules-"
STAMP_MARK = "rules stamp"  # the first key's value: what STAMP_HEAD reads
# The first bytes of a rule stamp: a file named like one without them is not traceclf's.
STAMP_HEAD = b'{"traceclf": "rules stamp"'
CODE = ("rulebook", "judge", "measures")


@contextlib.contextmanager
def checked(check: bool) -> Iterator[None]:
    token = CHECKING.set(check)
    try:
        yield
    finally:
        CHECKING.reset(token)


def key(files: list[tuple[Path, str]]) -> str:
    """The stamp's key: version, code that validates and names, rule files' paths and text.
    Raises OSError when traceclf's own source cannot be read (then: no stamp)."""
    digest = hashlib.sha256(__version__.encode())
    for name in CODE:
        source = PACKAGE / name
        for file in sorted(source.glob("*.py")) if source.is_dir() else [source]:
            digest.update(file.read_bytes())
    for file, text in files:
        digest.update(str(file.resolve()).encode(errors="surrogateescape") + b"\0")
        digest.update(text.encode(errors="surrogateescape") + b"\0")
    return digest.hexdigest()[:32]


class Stamp:
    """The stamp of one rule set in one cache root: what it remembers, and remembering more."""

    def __init__(self, root: Path, key: str) -> None:
        self.file = root / f"{PREFIX}{key}.json"
        self.data: dict | None = None
        with contextlib.suppress(OSError, ValueError):
            if is_owned(self.file, "file"):
                data = json.loads(self.file.read_text(encoding="utf-8"))
                if _well_formed(data):
                    self.data = data

    @property
    def names(self) -> frozenset[str] | None:
        """The names rules may use, when the stamp vouches for the rule set."""
        return frozenset(self.data["names"]) if self.data else None

    def write(self, names: frozenset[str]) -> None:
        """Remember that the rule set passed its checks (best effort: no cache, no stamp).
        Its first key marks it as traceclf's (``traceclf cache clear`` deletes no other)."""
        self.data = {"traceclf": STAMP_MARK, "names": sorted(names), "matches": {}}
        self._save()

    def match(self, pattern: str, text: str) -> bool | None:
        if not self.data:
            return None
        return self.data["matches"].get(pattern, {}).get(text)

    def remember(self, pattern: str, text: str, found: bool) -> None:
        if self.data is not None:
            self.data["matches"].setdefault(pattern, {})[text] = found
            self._save()

    def _save(self) -> None:
        from traceclf.support.atomic import write_atomic

        with contextlib.suppress(OSError):
            # (a file of that name that is not a stamp of ours is left as it is)
            ours = is_rules_stamp(self.file) or not os.path.lexists(self.file)
            if ours and usable_root(self.file.parent, create=True):
                write_atomic(self.file, json.dumps(self.data).encode())


def _well_formed(data: object) -> bool:
    if not isinstance(data, dict) or not isinstance(data.get("names"), list):
        return False
    if next(iter(data), None) != "traceclf" or data["traceclf"] != STAMP_MARK:
        return False
    matches = data.get("matches")
    return (
        all(isinstance(n, str) for n in data["names"])
        and isinstance(matches, dict)
        and all(
            isinstance(by_text, dict) and all(isinstance(v, bool) for v in by_text.values())
            for by_text in matches.values()
        )
    )


def is_rules_stamp(file: Path) -> bool:
    """A rule stamp traceclf wrote: a file of ours that starts with its mark."""
    return is_owned(file, "file") and read_head(file, len(STAMP_HEAD)) == STAMP_HEAD


# The stamp of the rule set in use by this process (load_rules sets it), for pattern answers.
ACTIVE: Stamp | None = None
