"""One rule file read as data, safely: a regular UTF-8 file of bounded size, YAML whose nesting
and alias expansion are bounded before any object is built, every mapping key text, and only
the known top-level keys (docs/security.md: a rule file is data, and none may exhaust the
machine)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from traceclf.rulebook.rulefiles import MAX_RULES_BYTES
from traceclf.support.errors import TraceError
from traceclf.support.readfile import read_bounded

# Limits on rule files (docs/security.md): a rule file is data, and no rule file may exhaust
# the machine. The bundled files are ~140 KB, 8 levels deep, ~30,000 characters expanded.
MAX_RULE_FILE_BYTES = 1 << 20
MAX_RULE_VALUES = 10_000
MAX_YAML_DEPTH = 32
# Characters (scalars) plus nodes once every alias is expanded: bounds whatever walks or
# prints a document, whatever its aliases multiply ("billion laughs").
MAX_YAML_EXPANDED = 4_000_000
# libyaml's parser and composer when PyYAML has them (10-50x faster), else pure Python.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_TOP_KEYS = (
    "rules",
    "fixes",
    "definitions",
    "gpu_families",
    "host_links",
    "peer_links",
    "communicators",
    "scoring",
    "taxonomy",
    "thresholds",
    "capture",
)


def check_folder_size(folder: Path, texts: list[tuple[Path, str]]) -> None:
    """Refuse a folder whose rule files are larger than MAX_RULES_BYTES together."""
    size = sum(len(text.encode()) for _path, text in texts)
    if size > MAX_RULES_BYTES:
        raise TraceError(
            folder, f"rule files larger than {MAX_RULES_BYTES >> 20} MiB together ({size:,} bytes)"
        )


def read_yaml(
    path: Path, text: str | None = None, values: list[int] | None = None, folder: Path | None = None
) -> dict:
    """The document of one rule file; ``values``: how many more YAML values (scalars and
    collections) its folder may hold, counted down here and shared by the folder's files."""
    text = read_text(path) if text is None else text
    try:
        _check_shape(path, text, [MAX_RULE_VALUES] if values is None else values, folder)
        doc = yaml.load(text, Loader=_LOADER)  # a SafeLoader, C or Python
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        if "nesting depth" in str(e.problem):  # libyaml's own bound (1000), met before ours
            line = mark.line + 1 if mark else 0
            raise TraceError(
                path, f"line {line}: nested deeper than {MAX_YAML_DEPTH} levels"
            ) from None
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise TraceError(path, f"not valid YAML{where}: {e.problem or e.context}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        problem = " ".join(str(e).split())[:200] or type(e).__name__
        if isinstance(e, ValueError) and "digits" in problem:
            limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
            problem = f"a number longer than {limit} digits"
        raise TraceError(path, f"cannot read rule file: {problem}") from None
    _check_keys(path, doc)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise TraceError(path, f"top level must be a mapping with keys {', '.join(_TOP_KEYS)}")
    unknown = set(doc) - set(_TOP_KEYS)
    if unknown:
        raise TraceError(
            path,
            f"unknown top-level key {sorted(map(str, unknown))[0]!r} "
            f"(expected {', '.join(_TOP_KEYS)})",
        )
    return doc


def section(
    doc: dict,
    name: str,
    path: Path,
    shape: str = "a mapping",
    keys: tuple[str, ...] | None = None,
    expected: bool = False,
) -> dict | None:
    """The ``name:`` section of one rule file's ``doc`` (None when the file has none), checked
    once for every section parser: a mapping (else "``name``: must be ``shape``"), and with
    ``keys`` only those keys (the first unknown one named; with ``expected`` the keys too)."""
    raw = doc.get(name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TraceError(path, f"{name}: must be {shape}")
    unknown = set(raw) - set(keys) if keys is not None else set()
    if unknown:
        hint = f" (expected {', '.join(keys)})" if expected and keys else ""
        raise TraceError(path, f"{name}: unknown key {sorted(map(str, unknown))[0]!r}{hint}")
    return raw


def read_text(path: Path) -> str:
    """The file's text, read without blocking (a FIFO would hang a plain read) and only if it
    is a regular file of at most MAX_RULE_FILE_BYTES (``/dev/zero`` never ends)."""
    data = read_bounded(path, MAX_RULE_FILE_BYTES, "rule file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(path, f"cannot read rule file: not UTF-8 text ({e.reason})") from None


def _check_shape(path: Path, text: str, values: list[int], folder: Path | None) -> None:
    """Bound nesting, alias expansion and the values of the folder (``values``, counted down)
    from the parser's events, before any object is built: PyYAML shares an alias's object,
    but whatever walks or prints the document afterwards (a message, ``str()``) pays for
    every expansion."""
    open_nodes: list[tuple[str | None, int]] = []  # (anchor, expanded size when it opened)
    sizes: dict[str, int] = {}  # anchor -> expanded size of its node
    expanded = 0
    for event in yaml.parse(text, Loader=_LOADER):
        line = event.start_mark.line + 1 if event.start_mark else 0
        if isinstance(event, yaml.ScalarEvent | yaml.CollectionStartEvent):
            values[0] -= 1
            if values[0] < 0:
                raise TraceError(
                    folder or path,
                    f"rule files hold more than {MAX_RULE_VALUES:,} YAML values together "
                    f"(the bundled rules hold under a third of that); {path.name} line {line} is past it",
                )
        if isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes:
                raise TraceError(path, f"line {line}: alias *{event.anchor} refers to itself")
            expanded += sizes[event.anchor]
        elif isinstance(event, yaml.ScalarEvent):
            expanded += 1 + len(event.value)
            if event.anchor:
                sizes[event.anchor] = 1 + len(event.value)
        elif isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append((event.anchor, expanded))
            expanded += 1
            if len(open_nodes) > MAX_YAML_DEPTH:
                raise TraceError(path, f"line {line}: nested deeper than {MAX_YAML_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, start = open_nodes.pop()
            if anchor:
                sizes[anchor] = expanded - start
        if expanded > MAX_YAML_EXPANDED:
            raise TraceError(
                path,
                f"line {line}: aliases expand this file past {MAX_YAML_EXPANDED:,} characters "
                "(an alias bomb?); write the entries out",
            )


def _check_keys(path: Path, doc: Any) -> None:
    """Every mapping key is text: the entries compare and sort them, and YAML turns an
    unquoted ``1:``, ``yes:`` or ``~:`` into a number, a boolean or null."""
    pending = [doc]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise TraceError(path, f"mapping key {key!r} is not text (quote it)")
                pending.append(value)
        elif isinstance(node, list):
            pending.extend(node)
