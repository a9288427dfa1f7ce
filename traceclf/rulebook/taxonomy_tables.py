"""The ``taxonomy:`` section of rule files (rules/kernels.yaml): kernel families, communication
libraries and collective kinds, NVTX collective and phase names, FP8 GEMMs and CUDA-call classes,
validated into plain tables (:class:`TaxonomyTables`) that :mod:`traceclf.model.taxonomy`
turns into polars expressions.

Layers merge like the rest of the rules: a ``--rules`` folder's list entries are tried before the
bundled ones (first match wins, so a user's new kernel name takes effect), and its single
patterns replace the bundled ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traceclf.rulebook import stamp
from traceclf.rulebook.yamlfile import section
from traceclf.support.errors import TraceError
from traceclf.support.regex import regex_problem

if TYPE_CHECKING:
    import polars as pl

Table = tuple[tuple[str, str], ...]  # (label, pattern), first match wins


@dataclass(frozen=True)
class NvtxCollective:
    kind: str
    pattern: str
    domain: str | None = None  # only ranges of this NVTX domain; None: any domain
    source: str = "nvtx"  # who wrote the range (pytorch, nccl): earlier sources win


@dataclass(frozen=True)
class FamilyPattern:
    """One named pattern of a kernel family, with real kernel names it must classify so
    (checked on load: each example is matched by this entry and by no entry tried before it
    in its folder)."""

    name: str
    family: str
    pattern: str
    examples: tuple[str, ...] = ()
    source: str = ""  # the rule file that defines it


@dataclass(frozen=True)
class TaxonomyTables:
    """The ``taxonomy:`` section of every rule folder, merged: regexes by label, as data."""

    families: tuple[FamilyPattern, ...]  # first match wins
    comm_libraries: Table
    comm_kinds: Table
    nvtx_collectives: tuple[NvtxCollective, ...]
    host_activities: Table
    nvtx: dict[str, str] = field(hash=False)  # step, forward, backward, optimizer
    # NVTX range names that say which parallel dimension (ep, dp, tp, pp, cp) the
    # communication launched inside serves
    comm_dimensions: Table = ()
    fp8_gemm: str = ""
    cuda_api: dict[str, str] = field(default_factory=dict, hash=False)  # sync, launch, ...
    training: dict[str, str] = field(default_factory=dict, hash=False)  # backward_kernel, ...
    moe: dict[str, str] = field(default_factory=dict, hash=False)  # kernel, nvtx
    # the host side beyond CUDA calls (rules/hostside.yaml): OS runtime call classes, nsys's
    # diagnostic messages that matter, frame patterns, and the attribution's thresholds
    osrt_calls: Table = ()
    diagnostics: Table = ()
    host_frames: dict[str, str] = field(default_factory=dict, hash=False)
    host_attribution: dict[str, float] = field(default_factory=dict, hash=False)


MAX_PATTERN_CHARS = 2000
MAX_EXAMPLE_CHARS = 2000
# list key -> the field naming each entry's label (families: their own parser, _families)
LISTS = {
    "comm_libraries": "library",
    "comm_kinds": "kind",
    "nvtx_collectives": "kind",
    "host_activities": "activity",
    "osrt_calls": "call_class",
    "diagnostics": "kind",
    "comm_dimensions": "dimension",
}
# optional extra fields of list entries
EXTRA_FIELDS = {"nvtx_collectives": ("domain", "source")}
# single-pattern maps and the names each must define
PATTERN_MAPS = {
    "nvtx": ("step", "forward", "backward", "optimizer"),
    "cuda_api": (
        "sync",
        "wait",
        "launch",
        "alloc",
        "free",
        "host_alloc",
        "graph_launch",
        "module",
        "jit",
    ),
    "training": (
        "backward_kernel",
        "autograd_thread",
        "backward_nvtx",
        "framework_kernel",
        "optimizer_pass",
    ),
    "moe": ("kernel", "nvtx"),
    "host_frames": ("system_module", "python_library", "data_loading", "python_process"),
}
# maps of numbers and the names each must define: (lowest, highest) allowed
NUMBER_MAPS = {
    "host_attribution": {"min_samples": (1, 1e6), "data_loading_share": (0, 1)},
}
# the keys of a `taxonomy:` section
TOP_KEYS = (*LISTS, "families", *PATTERN_MAPS, *NUMBER_MAPS, "fp8_gemm")


def parse_taxonomy(layers: list[list[tuple[Path, dict]]]) -> TaxonomyTables:
    """The taxonomy of every folder's files, later folders over earlier ones."""
    lists: dict[str, list[tuple[Any, ...]]] = {key: [] for key in LISTS}
    families: list[FamilyPattern] = []
    maps: dict[str, dict[str, str]] = {key: {} for key in PATTERN_MAPS}
    numbers: dict[str, dict[str, float]] = {key: {} for key in NUMBER_MAPS}
    fp8 = ""
    for files in layers:
        layer_lists: dict[str, list[tuple[Any, ...]]] = {key: [] for key in LISTS}
        layer_families: list[FamilyPattern] = []
        for path, doc in files:
            raw = section(doc, "taxonomy", path, keys=TOP_KEYS)
            if raw is None:
                continue
            layer_families += _families(raw.get("families"), path)
            for key, label in LISTS.items():
                layer_lists[key] += _entries(raw.get(key), key, label, path)
            for key in PATTERN_MAPS:
                maps[key] |= _patterns(raw.get(key), key, path)
            for key in NUMBER_MAPS:
                numbers[key] |= _numbers(raw.get(key), key, path)
            if raw.get("fp8_gemm") is not None:
                fp8 = _pattern(raw["fp8_gemm"], "taxonomy: fp8_gemm", path)
        if stamp.CHECKING.get():  # (a stamped rule set: checked when it was stamped)
            _check_examples(layer_families)
        for key in LISTS:  # this folder's entries first: first match wins
            lists[key] = layer_lists[key] + lists[key]
        families = layer_families + families
    missing = [f"{m}.{n}" for m, names in PATTERN_MAPS.items() for n in names if n not in maps[m]]
    missing += [
        f"{m}.{n}" for m, names in NUMBER_MAPS.items() for n in names if n not in numbers[m]
    ]
    if missing or not fp8:
        what = missing[0] if missing else "fp8_gemm"
        raise TraceError(None, f"taxonomy: missing {what!r} in the rule files")
    return TaxonomyTables(
        families=tuple(families),
        comm_libraries=tuple((e[0], e[1]) for e in lists["comm_libraries"]),
        comm_kinds=tuple((e[0], e[1]) for e in lists["comm_kinds"]),
        nvtx_collectives=tuple(
            NvtxCollective(e[0], e[1], e[2].get("domain"), e[2].get("source") or "nvtx")
            for e in lists["nvtx_collectives"]
        ),
        host_activities=tuple((e[0], e[1]) for e in lists["host_activities"]),
        nvtx=maps["nvtx"],
        comm_dimensions=tuple((e[0], e[1]) for e in lists["comm_dimensions"]),
        fp8_gemm=fp8,
        cuda_api=maps["cuda_api"],
        training=maps["training"],
        moe=maps["moe"],
        osrt_calls=tuple((e[0], e[1]) for e in lists["osrt_calls"]),
        diagnostics=tuple((e[0], e[1]) for e in lists["diagnostics"]),
        host_frames=maps["host_frames"],
        host_attribution=numbers["host_attribution"],
    )


def _families(raw: Any, path: Path) -> list[FamilyPattern]:
    """``families`` entries: ``family`` and ``match``, and (optional for a user's folder,
    present on every bundled one) a ``name`` and real kernel names as ``examples``."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise TraceError(path, "taxonomy: families must be a list of entries")
    out = []
    for i, entry in enumerate(raw):
        where = f"taxonomy: families #{i + 1}"
        if (
            not isinstance(entry, dict)
            or set(entry) - {"name", "family", "match", "examples"}
            or not {"family", "match"} <= set(entry)
        ):
            raise TraceError(path, f"{where}: must be a mapping with 'family' and 'match'")
        family, name = entry["family"], entry.get("name", entry["family"])
        for key, value in (("family", family), ("name", name)):
            if not isinstance(value, str) or not value.isidentifier():
                raise TraceError(path, f"{where}: {key!r} must be an identifier")
        examples = entry.get("examples") or []
        if not isinstance(examples, list) or not all(
            isinstance(e, str) and 0 < len(e) <= MAX_EXAMPLE_CHARS for e in examples
        ):
            raise TraceError(path, f"{where} ({name}): 'examples' must be a list of kernel names")
        pattern = _pattern(entry["match"], f"{where} ({name})", path)
        out.append(FamilyPattern(name, family, pattern, tuple(examples), str(path)))
    return out


# A demangled kernel name's parameter list: the last parenthesised group, at the end, with
# parentheses nested one deep inside it (``(ArgsStorage<(unsigned long)4096>)``). Families are
# matched on what comes before it, the function and its template arguments: parameter types
# name what a kernel takes, not what it does (TensorRT's copyVectorizedKernel takes an
# ``ArrayNWithReducedDivisors``, cuDNN's FFT a ``cudnn::reduced_divisor``: no reduction).
PARAMETER_LIST = r"\((?:[^()]|\([^()]*\))*\)$"


def callee(names: pl.Expr | pl.Series) -> pl.Expr | pl.Series:
    """The kernel names ``names`` (an expression, or the names themselves) without their
    parameter list (:data:`PARAMETER_LIST`)."""
    import polars as pl

    return names.cast(pl.String).str.replace(PARAMETER_LIST, "")


def _check_examples(entries: list[FamilyPattern]) -> None:
    """Each example of one folder's family entries is classified by its own entry: matched by
    it and by none tried before it (an entry of another folder may still override it)."""
    import polars as pl

    examples = [(i, e) for i, entry in enumerate(entries) for e in entry.examples]
    if not examples:
        return
    names = callee(pl.Series([e for _, e in examples], dtype=pl.String))
    hits = [names.str.contains(entry.pattern).to_list() for entry in entries]
    for k, (i, example) in enumerate(examples):
        first = next((j for j in range(len(entries)) if hits[j][k]), None)
        if first == i:
            continue
        entry = entries[i]
        if first is None or first > i:
            problem = "is not matched by its 'match'"
        else:
            winner = entries[first]
            problem = f"is taken by the earlier entry {winner.name!r} ({winner.family})"
        raise TraceError(
            Path(entry.source),
            f"taxonomy: families ({entry.name}): example {_short(example)!r} {problem}",
        )


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _entries(raw: Any, key: str, label: str, path: Path) -> list[tuple[Any, ...]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise TraceError(path, f"taxonomy: {key} must be a list of entries")
    out = []
    for i, entry in enumerate(raw):
        where = f"taxonomy: {key} #{i + 1}"
        extra = EXTRA_FIELDS.get(key, ())
        allowed = {label, "match", *extra}
        if (
            not isinstance(entry, dict)
            or set(entry) - allowed
            or not {label, "match"} <= set(entry)
        ):
            raise TraceError(path, f"{where}: must be a mapping with {label!r} and 'match'")
        name = entry[label]
        if not isinstance(name, str) or not name.isidentifier():
            raise TraceError(path, f"{where}: {label!r} must be an identifier")
        fields = {f: entry.get(f) for f in extra}
        if any(v is not None and not isinstance(v, str) for v in fields.values()):
            raise TraceError(path, f"{where}: {', '.join(map(repr, extra))} must be text")
        out.append((name, _pattern(entry["match"], f"{where} ({name})", path), fields))
    return out


def _patterns(raw: Any, key: str, path: Path) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TraceError(path, f"taxonomy: {key} must be a mapping of name: pattern")
    known = PATTERN_MAPS[key]
    out = {}
    for name, pattern in raw.items():
        if name not in known:
            raise TraceError(path, f"taxonomy: {key}: unknown name {name!r} ({', '.join(known)})")
        out[name] = _pattern(pattern, f"taxonomy: {key}.{name}", path)
    return out


def _numbers(raw: Any, key: str, path: Path) -> dict[str, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TraceError(path, f"taxonomy: {key} must be a mapping of name: number")
    known = NUMBER_MAPS[key]
    out = {}
    for name, value in raw.items():
        if name not in known:
            raise TraceError(path, f"taxonomy: {key}: unknown name {name!r} ({', '.join(known)})")
        lo, hi = known[name]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not lo <= value <= hi:
            raise TraceError(path, f"taxonomy: {key}.{name} must be a number from {lo:g} to {hi:g}")
        out[name] = float(value)
    return out


def _pattern(raw: Any, where: str, path: Path) -> str:
    """A regex polars can run (Rust ``regex``: linear time, so no input can make it hang)."""
    if not isinstance(raw, str) or not raw:
        raise TraceError(path, f"{where}: the pattern must be non-empty text")
    if len(raw) > MAX_PATTERN_CHARS:
        raise TraceError(path, f"{where}: pattern longer than {MAX_PATTERN_CHARS} characters")
    if not stamp.CHECKING.get():  # a stamped rule set: checked when it was stamped
        return raw
    import polars as pl

    try:
        pl.Series([""]).str.contains(raw)
    except pl.exceptions.PolarsError as e:
        raise TraceError(path, f"{where}: not a usable regex ({regex_problem(e)})") from None
    return raw
