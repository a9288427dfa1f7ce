"""Named polars frames handed out as pandas (the ``pandas`` extra: ``Report.to_pandas``,
``RunSet.to_pandas``, ``Trace.to_pandas``)."""

from __future__ import annotations

from traceclf.support.errors import TraceError


def to_pandas(tables: dict, table: str):
    """``tables[table]`` as pandas (the ``pandas`` extra), or a one-line error naming what is
    missing."""
    if table not in tables:
        raise TraceError(None, f"no table {table!r}; tables: {', '.join(tables)}")
    try:
        import pandas  # noqa: F401
    except ImportError:
        raise ImportError("to_pandas() needs pandas: pip install 'traceclf[pandas]'") from None
    return tables[table].to_pandas()
