"""Utilities every stage may use, importing nothing else of traceclf: errors, atomic writes,
JSON text, progress on stderr, inert text."""
