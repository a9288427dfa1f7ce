"""Ingest: what the user named (files, folders, ``.nsys-rep``) → validated SQLite exports →
the :class:`~traceclf.model.trace.Trace` model, through the caches (docs/architecture.md)."""
