"""What a kernel, a CUDA call or an NVTX range is: the taxonomy of rules/kernels.yaml as polars
expressions (family, communication library and collective kind of a kernel; sync/launch/alloc
class of a CUDA call; step and phase ranges), plus theoretical occupancy from a launch config.

The taxonomy is data: rules/kernels.yaml holds the bundled one, and a ``taxonomy:`` section in
a ``--rules`` folder is merged over it by :mod:`traceclf.rulebook.layers` (``RuleSet.taxonomy``,
plain tables that :meth:`Taxonomy.of` makes this module's).
Patterns run in polars (Rust ``regex``: linear time), once per distinct name, never per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from traceclf.rulebook.taxonomy_tables import FamilyPattern, Table, TaxonomyTables, callee

if TYPE_CHECKING:  # polars is imported where an expression is built: a cached re-analysis
    # reads the taxonomy (the rule set's) without building any
    from collections.abc import Callable, Iterable, Sequence

    import numpy as np
    import polars as pl


@dataclass(frozen=True)
class Taxonomy(TaxonomyTables):
    """The rule files' taxonomy tables (:mod:`traceclf.rulebook.taxonomy_tables`) as polars
    expressions: what a kernel, CUDA call or NVTX range is."""

    # each kernel name's LABELS, kept by :meth:`classify` for the process (not a table: left
    # out of comparisons, hashes and the repr)
    _labels_of_name: dict[str, tuple] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )

    @classmethod
    def of(cls, tables: TaxonomyTables) -> Taxonomy:
        return cls(**{f.name: getattr(tables, f.name) for f in fields(TaxonomyTables)})

    # (kernel names are matched without their parameter list: taxonomy_tables.callee)
    def family(self, col: str = "name") -> pl.Expr:
        families = tuple((p.family, p.pattern) for p in self.families)
        return first_match(col, families, "other", callee)

    def family_patterns(self, name: str) -> list[FamilyPattern]:
        """Every family entry that matches the kernel name ``name``, in the order they are
        tried: the first decides its family (``traceclf kernels`` shows why)."""
        import polars as pl

        text = callee(pl.Series([name], dtype=pl.String))
        return [p for p in self.families if text.str.contains(p.pattern)[0]]

    def comm_library(self, col: str = "name") -> pl.Expr:
        return first_match(col, self.comm_libraries, None, callee)

    def comm_kind(self, col: str = "name") -> pl.Expr:
        return first_match(col, self.comm_kinds, "other", callee)

    @property
    def collective_sources(self) -> tuple[str, ...]:
        """Sources of collective NVTX ranges, strongest first."""
        return tuple(dict.fromkeys(e.source for e in self.nvtx_collectives))

    def nvtx_collective(self, source: str, text: str = "text", domain: str = "domain") -> pl.Expr:
        """Collective kind that an NVTX range of ``source`` names (null when it names none)."""
        import polars as pl

        expr = pl.lit(None, dtype=pl.String)
        for entry in reversed(self.nvtx_collectives):
            if entry.source != source:
                continue
            cond = pl.col(text).cast(pl.String).str.contains(entry.pattern)
            if entry.domain is not None:
                cond = cond & (pl.col(domain) == entry.domain)
            expr = pl.when(cond).then(pl.lit(entry.kind)).otherwise(expr)
        return expr

    def comm_dimension(self, col: str = "text") -> pl.Expr:
        """The parallel dimension an NVTX range's name says the communication inside it
        serves (ep, dp, tp, pp, cp; null: it says none)."""
        return first_match(col, self.comm_dimensions, None)

    def host_activity(self, col: str = "text") -> pl.Expr:
        """What an NVTX range says the host was doing (compile, data, ...; null: unknown)."""
        return first_match(col, self.host_activities, None)

    def step_or_phase(self) -> str:
        """One regex for the NVTX ranges that name a step or a forward, backward or optimizer
        phase: being in one says nothing of what the host was doing ("in step 7")."""
        return any_of(self.nvtx[k] for k in ("step", "forward", "backward", "optimizer"))

    def host_activity_of(self, texts: pl.Series) -> pl.Series:
        """:meth:`host_activity` of each of ``texts`` (NVTX texts, maybe each numbered:
        :func:`first_match_of`)."""
        return first_match_of(texts, self.host_activities, None)

    def osrt_class(self, col: str = "name") -> pl.Expr:
        """What an OS runtime call does to its thread (io, poll, lock, sleep, ...; "other")."""
        return first_match(col, self.osrt_calls, "other")

    def diagnostic_kind(self, col: str = "text") -> pl.Expr:
        """Which kind of trouble an nsys diagnostic message reports (dropped, cupti_error,
        truncated, ...; null: none that matters)."""
        return first_match(col, self.diagnostics, None)

    def is_api(self, kind: str, col: str = "name") -> pl.Expr:
        """Whether a CUDA call is of ``kind`` (a key of ``cuda_api``: sync, launch, alloc...)."""
        import polars as pl

        return pl.col(col).cast(pl.String).str.contains(self.cuda_api[kind])

    def classify(self, kernels: pl.DataFrame) -> pl.DataFrame:
        """Add ``family``, ``is_comm``, ``comm_library`` and ``comm_kind`` columns
        (Categoricals: a label per kernel costs 4 bytes, not a string).

        The regexes run once per distinct name (a few hundred), not once per kernel (millions).
        """
        import polars as pl

        names = kernels.select("name").unique()
        text = names["name"].cast(pl.String)
        # A rank's measures classify the same few hundred names several times: each name's
        # labels are kept, up to MEMO_NAMES of them (a trace may name every kernel differently).
        memo = self._labels_of_name
        if text.null_count() or len(memo) + len(text) > MEMO_NAMES:
            return by_name(kernels, self._labelled(names))
        listed = text.to_list()
        new = [n for n in listed if n not in memo]
        if new:
            found = self._labelled(pl.DataFrame({"name": new}, schema={"name": pl.String}))
            memo.update(zip(new, found.select(LABELS).iter_rows(), strict=True))
        rows = [memo[n] for n in listed]
        labels = {c: [r[i] for r in rows] for i, c in enumerate(LABELS)}
        return by_name(
            kernels,
            names.with_columns(
                family=pl.Series(labels["family"], dtype=pl.String).cast(pl.Categorical),
                is_comm=pl.Series(labels["is_comm"], dtype=pl.Boolean),
                comm_library=pl.Series(labels["comm_library"], dtype=pl.String).cast(
                    pl.Categorical
                ),
                comm_kind=pl.Series(labels["comm_kind"], dtype=pl.String).cast(pl.Categorical),
            ),
        )

    def _labelled(self, names: pl.DataFrame) -> pl.DataFrame:
        """``names`` (distinct, column ``name``) with the columns of :data:`LABELS`."""
        import polars as pl

        communication = pl.col("family") == "communication"
        return (
            names.with_columns(family=self.family())
            .with_columns(
                is_comm=communication,
                comm_library=pl.when(communication).then(self.comm_library()),
                comm_kind=pl.when(communication).then(self.comm_kind()),
            )
            .with_columns(pl.col("family", "comm_library", "comm_kind").cast(pl.Categorical))
        )


# What :meth:`Taxonomy.classify` adds to each kernel, in this order.
LABELS = ("family", "is_comm", "comm_library", "comm_kind")
MEMO_NAMES = 100_000  # kernel names whose labels a Taxonomy keeps


def by_name(df: pl.DataFrame, per_name: pl.DataFrame, col: str = "name") -> pl.DataFrame:
    """``df`` with the other columns of ``per_name`` (one row per distinct ``col``) attached
    to each row by its ``col``: a left join, done as a lookup on the Categorical's codes when
    ``col`` is one, so that no column of ``df`` is copied (millions of rows, a few hundred
    names)."""
    import numpy as np  # here: a cached result's re-analysis imports this module, not numpy
    import polars as pl

    extra = [c for c in per_name.columns if c != col]
    if df.is_empty() or per_name.is_empty() or df[col].dtype != pl.Categorical:
        return df.join(per_name, on=col, how="left", maintain_order="left")
    codes = df[col].to_physical()
    keys = per_name[col].cast(pl.Categorical).to_physical()
    top = int(max(codes.max() or 0, keys.max() or 0))  # type: ignore[arg-type]
    slot = np.full(top + 1, len(per_name), dtype=np.uint32)  # len(per_name): no match
    slot[keys.to_numpy()] = np.arange(len(per_name), dtype=np.uint32)
    if not codes.null_count():
        at = slot[codes.to_numpy()]
        if not bool((at == len(per_name)).any()):  # every row's name listed: plain gathers
            return df.with_columns(
                _lookup(per_name[c], len(df), lambda v: _gather(v, at)) for c in extra
            )
    index = pl.Series(slot).gather(codes)
    padded = pl.concat([per_name.select(extra), per_name.select(extra).clear(1)])
    return df.with_columns(_lookup(padded[c], len(df), lambda v: v.gather(index)) for c in extra)


def _lookup(values: pl.Series, n: int, gather: Callable[[pl.Series], pl.Series]) -> pl.Series:
    """``gather(values)``, or ``n`` nulls when no name has a value (no communication kernel:
    no library): a fresh null column is never written, so never resident."""
    import polars as pl

    if values.null_count() < len(values):
        return gather(values)
    return pl.repeat(None, n, dtype=values.dtype, eager=True).alias(values.name)


def _gather(values: pl.Series, at: np.ndarray) -> pl.Series:
    """``values`` at rows ``at``; flags through numpy (a gather of bits row by row costs
    ~5x more: three flags over 11 M CUDA calls)."""
    import polars as pl

    if values.dtype == pl.Boolean and not values.null_count():
        return pl.Series(values.name, values.to_numpy()[at])
    return values.gather(pl.Series(at))


MATCH_PROBE = 1000  # rows whose distinct texts say whether a text repeats


def any_of(patterns: Iterable[str]) -> str:
    """One regex that matches where any of ``patterns`` does (each in a group of its own, so
    that its flags stay its own)."""
    return "|".join(f"(?:{pattern})" for pattern in patterns)


def numbered(values: pl.Series) -> bool:
    """Whether the texts of ``values`` number their rows (nearly each differs), as the first
    :data:`MATCH_PROBE` say."""
    return values.head(MATCH_PROBE).n_unique() * 2 > MATCH_PROBE


def matches(values: pl.Series, pattern: str) -> pl.Series:
    """``values.str.contains(pattern)`` for a column of text or a Categorical, the regex run
    once per distinct value: NVTX texts repeat each step (a 2 GB export: 850 k ranges, 18
    texts), and a regex over every row cost 5x a lookup (null stays null)."""
    import polars as pl

    if numbered(values):
        return values.cast(pl.String).str.contains(pattern)
    distinct = values.unique().drop_nulls()
    hits = distinct.filter(distinct.cast(pl.String).str.contains(pattern))
    return values.is_in(hits.implode()).alias(values.name)


def match_counts(values: pl.Series, patterns: Sequence[str]) -> list[int]:
    """How many of ``values`` each of ``patterns`` matches (``matches(values, p).sum()``):
    where texts number their rows, the patterns' alternation picks in one pass the rows any
    of them matches, and each pattern runs on those alone."""
    import polars as pl

    if not numbered(values):
        return [int(matches(values, pattern).sum()) for pattern in patterns]
    text = values.cast(pl.String)
    hits = text.filter(text.str.contains(any_of(patterns)).fill_null(False))
    return [int(hits.str.contains(pattern).sum()) for pattern in patterns]


def first_match(
    col: str, table: Table, default: str | None, text: Callable[[pl.Expr], pl.Expr] | None = None
) -> pl.Expr:
    """The label of the first of ``table``'s patterns that the text of ``col`` matches (as
    ``text`` makes it from the column, when given), else ``default``."""
    import polars as pl

    subject = text(pl.col(col)) if text is not None else pl.col(col).cast(pl.String)
    expr = pl.lit(default, dtype=pl.String)
    for label, pattern in reversed(table):
        expr = pl.when(subject.str.contains(pattern)).then(pl.lit(label)).otherwise(expr)
    return expr


def first_match_of(values: pl.Series, table: Table, default: str | None) -> pl.Series:
    """What :func:`first_match` labels each of ``values`` (text or a Categorical), the table's
    regexes run only on the texts that one of them matches, which their alternation finds in
    one pass (each pattern in a group of its own, so that its flags stay its own): the texts
    of NVTX ranges that PyTorch numbers (``aten::mm, seq = 7``) each differ, and every regex
    of the table over each of 0.4 M of them took 20x the alternation. Texts that repeat are
    labelled once each; texts that number their rows, row by row (finding the distinct
    ones among 4.4 M took longer than the alternation over all of them)."""
    import polars as pl

    text = values.cast(pl.String)
    if not table:
        return pl.repeat(default, len(text), dtype=pl.String, eager=True).alias(values.name)
    anyone = any_of(pattern for _label, pattern in table)
    each = numbered(text)
    candidates = text if each else text.unique().drop_nulls()
    hit = candidates.str.contains(anyone).fill_null(False)
    hits = pl.DataFrame({"t": candidates.filter(hit)})
    labels = hits.select(first_match("t", table, default)).to_series()
    if each:
        labelled = pl.repeat(default, len(text), dtype=pl.String, eager=True)
        return labelled.scatter(hit.arg_true(), labels).alias(values.name)
    labelled = text.replace_strict(hits["t"], labels, default=default, return_dtype=pl.String)
    # (a missing text: no regex matches it, so the default, as first_match gives it)
    return (labelled if default is None else labelled.fill_null(default)).alias(values.name)


def bundled() -> Taxonomy:
    """The taxonomy of the bundled rules/ (for API users who pass none)."""
    from traceclf.rulebook.layers import bundled_taxonomy

    return Taxonomy.of(bundled_taxonomy())


def theoretical_occupancy(gpu: dict | None) -> pl.Expr:
    """Warps resident per SM over the SM's maximum, from the launch config and the GPU limits
    (the CUDA occupancy calculator's block limits: warps, registers, shared memory, blocks)."""
    import polars as pl

    if not gpu or not gpu.get("max_warps_per_sm"):
        return pl.lit(None, dtype=pl.Float64)
    warp = gpu.get("threads_per_warp") or 32
    max_warps = gpu["max_warps_per_sm"]
    max_blocks = gpu.get("max_blocks_per_sm") or 32
    max_regs = gpu.get("max_registers_per_sm") or 65536
    max_smem = gpu.get("max_shmem_per_sm") or 233472
    warps_per_block = (pl.col("block_threads") + warp - 1) // warp
    # Registers are allocated per warp in units of 256.
    regs_per_warp = ((pl.col("registers").fill_null(0) * warp + 255) // 256) * 256
    by_warps = max_warps // warps_per_block
    by_regs = (
        pl.when(regs_per_warp > 0)
        .then((max_regs // regs_per_warp.clip(lower_bound=1)) // warps_per_block)
        .otherwise(max_blocks)
    )
    # The driver reserves 1 KiB of shared memory per resident block.
    by_smem = (
        pl.when(pl.col("smem_per_block") > 0)
        .then(max_smem // (pl.col("smem_per_block") + 1024))
        .otherwise(max_blocks)
    )
    blocks = pl.min_horizontal(by_warps, by_regs, by_smem, pl.lit(max_blocks))
    return ((blocks * warps_per_block) / max_warps).clip(0.0, 1.0).cast(pl.Float64)
