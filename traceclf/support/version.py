"""traceclf's version and its package folder: what its caches are keyed on and where the
bundled rules are found. Any stage may read them without importing the public API, which
``traceclf/__init__.py`` does (the wheel's version is read from this file: pyproject.toml)."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

__version__ = "0.1.0"

PACKAGE = Path(__file__).parent.parent  # (as traceclf.__file__ names it: not resolved)


def sources_digest(digest: hashlib._Hash, names: tuple[str, ...]) -> str:
    """``digest`` updated with the source of each module ``names`` lists (relative to the
    package; a folder: each of its modules), as hex: an edit to any of them changes it."""
    for name in names:
        source = PACKAGE / name
        for file in sorted(source.glob("*.py")) if source.is_dir() else [source]:
            with contextlib.suppress(OSError):  # no source shipped: version must do
                digest.update(file.read_bytes())
    return digest.hexdigest()
