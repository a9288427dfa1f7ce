"""A condition SQLite can test on a text column that every text a regex matches meets: the
characters a match may start with (a pattern anchored at the start), tested by ``unicode()``,
and the literal strings one of which any match must contain, as ``LIKE`` tests.

Pass 1 of step sampling looks for the step ranges among the NVTX rows that keep their own
text (:mod:`traceclf.ingest.nvtx_rows`): where every op has a range (PyTorch's emit_nvtx:
millions of numbered texts), reading every text to run the step regex on it cost more than
SQLite testing ``LIKE '%step%'`` on each row. The condition only narrows what is read; the
regex still decides. It is derived only where that is sure: the pattern parses the same way
as a Rust regex (polars runs it), and texts that ASCII ``LIKE`` could miss (any byte beyond
ASCII, which Unicode case folding may match: ``(?i)s`` matches "ſ"; a NUL; a text longer than
the decoder keeps, which gains a mark) always pass.
"""

from __future__ import annotations

import re
import warnings

try:  # (Python 3.11 moved the regex parser; it is the same parser)
    from re import _constants as _c  # type: ignore[attr-defined]
    from re import _parser as _sre  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _sre  # type: ignore[no-redef]

from traceclf.ingest.utf8 import MAX_TEXT

# Alternatives one condition may test (each a LIKE per row): more, and reading every text
# costs less.
MAX_LITERALS = 8
# Characters of a literal tested at most (its start: SQLite refuses long LIKE patterns).
MAX_LIKE = 1000
# Non-ASCII characters that Unicode simple case folding (Rust's (?i)) makes ASCII letters.
_TO_ASCII = {0x17F: "sS", 0x212A: "kK"}  # long s, Kelvin sign
# Syntax Python's parser reads otherwise than Rust's: verbose mode (Rust skips Unicode white
# space, and white space and comments inside classes and counted repetitions), and a "{"
# that opens no counted repetition Python knows (Rust: one with spaces, or an error).
_VERBOSE = re.compile(r"\(\?[a-zA-Z-]*x")
_REPETITION = re.compile(r"\d+(,\d*)?\}")
# Characters a match may start with, at most, for a test of the first (past this, it picks
# most texts anyway).
MAX_FIRST = 64
_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT} | (
    {_c.POSSESSIVE_REPEAT} if hasattr(_c, "POSSESSIVE_REPEAT") else set()
)
_ATOMIC = getattr(_c, "ATOMIC_GROUP", None)


def text_condition(column: str, pattern: str) -> str | None:
    """SQL true for every value of ``column`` (quoted here) that ``pattern`` matches and false
    for most others: its first character one a match can start with (a pattern anchored at
    the start), and a literal one of which every match holds; None where neither is known
    (every text must be read). Texts that ASCII tests could misjudge always pass."""
    col = f'"{column}"'
    tests = []
    first = first_characters(pattern)
    if first is not None:
        codes = ", ".join(str(c) for c in sorted(first))
        # (unicode(): the first character's code point, read without scanning the text)
        # (NULL for a text that starts with a NUL byte)
        tests.append(
            f"(unicode({col}) IN ({codes}) OR unicode({col}) > 127 "
            f"OR (unicode({col}) IS NULL AND {col} IS NOT NULL))"
        )
    literals = required_literals(pattern)
    if literals is not None:
        # (a required literal's start is required too: SQLite refuses LIKE patterns past
        # 50,000 bytes)
        likes = [f"{col} LIKE '%{_like_escaped(lit[:MAX_LIKE])}%' ESCAPE '\\'" for lit in literals]
        # (a BLOB's length is its bytes; a TEXT's, its characters before the first NUL)
        likes.append(f"length(CAST({col} AS BLOB)) != length({col})")
        likes.append(f"length(CAST({col} AS BLOB)) > {MAX_TEXT}")
        tests.append("(" + " OR ".join(likes) + ")")
    return "(" + " AND ".join(tests) + ")" if tests else None


def required_literals(pattern: str) -> list[str] | None:
    """ASCII strings one of which every match of ``pattern`` contains (compared without
    case), as few as cover it; None where none can be said: the pattern does not parse,
    may parse otherwise in Rust's syntax (:func:`_rust_only`), or some way of matching it
    needs no literal."""
    tree = _parsed(pattern)
    found = None if tree is None else _sequence(list(tree))
    if not found:
        return None
    # a literal containing another is redundant: a text holding it holds the shorter one
    lower = sorted({lit.lower() for lit in found}, key=lambda lit: (len(lit), lit))
    kept = [lit for i, lit in enumerate(lower) if not any(k in lit for k in lower[:i])]
    return kept if len(kept) <= MAX_LITERALS else None


def _parsed(pattern: str):
    """Python's parse of ``pattern``; None where it may not be the parse Rust makes of it, or
    Python refuses it."""
    if _rust_only(pattern):
        return None
    try:
        with warnings.catch_warnings():  # (Python's hints about syntax it may change)
            warnings.simplefilter("ignore")
            return _sre.parse(pattern)
    except Exception:  # (any syntax Python's parser refuses: not derived)
        return None


def _rust_only(pattern: str) -> bool:
    """Whether Python may read ``pattern`` otherwise than Rust: a class holding ``[`` or a class
    set operation (``&&``, ``--``, ``~~``: nested classes in Rust, literal characters in
    Python), word boundaries ``\\<``, ``\\>``, ``\\b{start}``, verbose mode, or a ``{`` that
    opens no repetition Python knows."""
    if _VERBOSE.search(pattern):
        return True
    escaped, opened, previous = False, "", ""
    for i, ch in enumerate(pattern):
        if escaped:
            if ch in "<>" or (ch in "bB" and pattern[i + 1 : i + 2] == "{"):
                return True
            escaped, previous = False, "\\"
            opened += ("\\" + ch) if opened else ""
            continue
        if ch == "\\":
            escaped = True
            continue
        if opened:
            if ch == "[" or (ch in "&-~" and previous == ch):
                return True
            # (a "]" first in a class, after "[" or "[^", is a literal)
            if ch == "]" and opened not in ("[", "[^"):
                opened = ""
            else:
                opened += ch
        elif ch == "[":
            opened = "["
        elif ch == "{" and not _REPETITION.match(pattern, i + 1):
            return True
        previous = ch
    return False


def _sequence(items: list) -> list[str] | None:
    """What a sequence of parsed items requires: of the literal runs and the requirements of
    its items, the one whose shortest alternative is longest."""
    options: list[list[str]] = []
    run = ""
    for op, av in items:
        if op is _c.LITERAL and 0 < av < 128:
            run += chr(av)
            continue
        if run:
            options.append([run])
        run = ""
        need = _item(op, av)
        if need:
            options.append(need)
    if run:
        options.append([run])
    if not options:
        return None
    return max(options, key=lambda lits: (min(map(len, lits)), -len(lits)))


def _item(op, av) -> list[str] | None:
    """What one parsed item (not a literal) requires of a text it matches."""
    if op is _c.SUBPATTERN:
        return _sequence(list(av[-1]))
    if op in _REPEATS:
        low, _high, body = av
        return _sequence(list(body)) if low >= 1 else None
    if op is _c.BRANCH:
        alternatives = [_sequence(list(branch)) for branch in av[1]]
        if any(not alt for alt in alternatives):
            return None
        return [lit for alt in alternatives for lit in alt]  # type: ignore[union-attr]
    if _ATOMIC is not None and op is _ATOMIC:
        return _sequence(list(av))
    return None  # classes, anchors, any character, assertions: no literal required


def first_characters(pattern: str) -> set[int] | None:
    """The ASCII code points a match of ``pattern`` may start with, where it is anchored at
    the start of the text (``^`` without multi-line mode, or ``\\A``) and they are few; None
    otherwise. A text starting beyond ASCII is left to the regex (Unicode case folding:
    ``(?i)k`` matches the Kelvin sign)."""
    tree = _parsed(pattern)
    if tree is None or tree.state.flags & _c.SRE_FLAG_MULTILINE:
        return None
    items = list(tree)
    if not items or items[0] not in ((_c.AT, _c.AT_BEGINNING), (_c.AT, _c.AT_BEGINNING_STRING)):
        return None
    first, empty = _first(items[1:], bool(tree.state.flags & _c.SRE_FLAG_IGNORECASE))
    return None if first is None or empty or len(first) > MAX_FIRST else first


def _first(items: list, fold: bool) -> tuple[set[int] | None, bool]:
    """The ASCII characters a sequence's match may start with (None: any) and whether it may
    match nothing."""
    out: set[int] = set()
    for op, av in items:
        chars, empty = _first_of(op, av, fold)
        if chars is None:
            return None, False
        out |= chars
        if not empty:
            return out, False
    return out, True


def _first_of(op, av, fold: bool) -> tuple[set[int] | None, bool]:
    if op is _c.LITERAL:
        return _folded({av}, fold), False
    if op is _c.IN:
        return _class(av, fold), False
    if op in _REPEATS:
        low, _high, body = av
        chars, empty = _first(list(body), fold)
        return chars, empty or low == 0
    if op is _c.SUBPATTERN:
        _group, add, remove, body = av
        if add & _c.SRE_FLAG_MULTILINE:
            return None, False
        fold = bool(add & _c.SRE_FLAG_IGNORECASE) or (fold and not remove & _c.SRE_FLAG_IGNORECASE)
        return _first(list(body), fold)
    if op is _c.BRANCH:
        out: set[int] = set()
        empty = False
        for branch in av[1]:
            chars, nothing = _first(list(branch), fold)
            if chars is None:
                return None, False
            out |= chars
            empty = empty or nothing
        return out, empty
    if op in (_c.AT, _c.ASSERT, _c.ASSERT_NOT):  # (zero width: what follows starts it)
        return set(), True
    return None, False  # any character, a character not, a back reference: any start


_CATEGORIES = {
    _c.CATEGORY_DIGIT: set(range(48, 58)),
    _c.CATEGORY_SPACE: {9, 10, 11, 12, 13, 32},
    _c.CATEGORY_WORD: set(range(48, 58)) | set(range(65, 91)) | set(range(97, 123)) | {95},
}


def _class(items, fold: bool) -> set[int] | None:
    """The ASCII characters of a parsed class (None for a negated one or an unknown part)."""
    out: set[int] = set()
    for op, av in items:
        if op is _c.LITERAL:
            out.add(av)
        elif op is _c.RANGE:
            out |= set(range(av[0], min(av[1], 127) + 1))
            out |= {c for c in _TO_ASCII if av[0] <= c <= av[1]}
        elif op is _c.CATEGORY and av in _CATEGORIES:
            out |= _CATEGORIES[av]
        else:  # (NEGATE, a negated category)
            return None
    return _folded(out, fold)


def _folded(chars: set[int], fold: bool) -> set[int]:
    """``chars`` within ASCII, with the other case of each letter where case is ignored."""
    ascii_chars = {c for c in chars if c < 128}
    if fold:
        ascii_chars |= {ord(x) for c in chars for x in _TO_ASCII.get(c, "")}
        ascii_chars |= {ord(chr(c).swapcase()) for c in ascii_chars if chr(c).isalpha()}
    return ascii_chars


def _like_escaped(literal: str) -> str:
    """``literal`` inside a LIKE pattern with ESCAPE '\\', quoted for SQL."""
    for special in ("\\", "%", "_"):
        literal = literal.replace(special, "\\" + special)
    return literal.replace("'", "''")
