"""Code laid out to fit a terminal width and still paste as the same program.

A fix's config is copied from the terminal into a recipe, so a line too long for the width must
not simply wrap: the continuation of a wrapped comment would be read as code, and a statement
cut in two is a syntax error. Here a comment continues on a line of its own that starts with
``#`` (under the comment, or hanging deeper than a comment-only line), a comment that cannot
stay beside its code goes on lines above it, and a statement is broken only between tokens,
outside any string, with a trailing backslash (an explicit line join in Python and in a shell).
What cannot be broken (one string longer than the width) is printed whole, never cropped.
"""

from __future__ import annotations

import io
import tokenize
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

HANG = 4  # a continuation is indented this much deeper than the line it continues
MIN_COMMENT_WIDTH = 24  # narrower than this beside its code, a comment goes above the code
JOIN = " \\"  # explicit line join


@dataclass(frozen=True)
class Piece:
    """One printed line: ``prefix + line[start:end] + suffix`` of a source line."""

    prefix: str
    start: int
    end: int
    suffix: str = ""


@dataclass(frozen=True)
class LineFacts:
    """Where a source line's comment starts, and the spans no break may fall inside (strings);
    ``verbatim`` for a line inside a multi-line string, which is printed as it is."""

    comment: int | None
    strings: tuple[tuple[int, int], ...]
    verbatim: bool = False


def fold_line(line: str, facts: LineFacts, width: int) -> list[Piece]:
    """``line`` as printed lines of at most ``width`` cells where it can be broken."""
    if cell_len(line) <= width or facts.verbatim:
        return [Piece("", 0, len(line))]
    indent = len(line) - len(line.lstrip(" "))
    if facts.comment is None:
        return _fold_code(line, indent, len(line.rstrip()), facts, width)
    code_end = len(line[: facts.comment].rstrip())
    words = _words(line, facts.comment + 1)
    if code_end <= indent:  # a comment on its own line
        return _fold_comment(line, words, facts.comment, indent + HANG, width)
    beside = [w for w in words if cell_len(line[: w[1]]) <= width]
    if width - cell_len(line[: facts.comment]) >= MIN_COMMENT_WIDTH and beside:
        first = Piece("", 0, beside[-1][1])
        rest = words[len(beside) :]
        return [first, *(_comment_lines(line, rest, facts.comment, width) if rest else [])]
    # the comment does not fit beside its code: it goes above, at the code's indent
    above = _fold_comment(line, words, facts.comment, indent + HANG, width, prefix=" " * indent)
    return above + _fold_code(line, indent, code_end, facts, width)


def _words(line: str, start: int) -> list[tuple[int, int]]:
    """(start, end) of each run of non-space characters from ``start`` on."""
    out, i = [], start
    while i < len(line):
        if line[i] == " ":
            i += 1
            continue
        j = line.find(" ", i)
        j = len(line) if j < 0 else j
        out.append((i, j))
        i = j
    return out


def _fold_comment(
    line: str,
    words: list[tuple[int, int]],
    hash_at: int,
    hang: int,
    width: int,
    prefix: str = "",
) -> list[Piece]:
    """A comment as lines of its own: the first keeps its ``#``, the others start one."""
    taken = 0
    while taken < len(words) and cell_len(prefix + line[hash_at : words[taken][1]]) <= width:
        taken += 1
    taken = max(taken, 1) if words else 0
    first = Piece(prefix, hash_at, words[taken - 1][1] if taken else hash_at + 1)
    rest = words[taken:]
    return [first, *(_comment_lines(line, rest, hang, width) if rest else [])]


def _comment_lines(line: str, words: list[tuple[int, int]], column: int, width: int) -> list[Piece]:
    """``words`` of a comment as continuation lines, each ``#`` at ``column``."""
    prefix = " " * column + "# "
    pieces, i = [], 0
    while i < len(words):
        j = i + 1  # at least one word a line, however long
        while j < len(words) and cell_len(prefix + line[words[i][0] : words[j][1]]) <= width:
            j += 1
        pieces.append(Piece(prefix, words[i][0], words[j - 1][1]))
        i = j
    return pieces


def _fold_code(line: str, indent: int, end: int, facts: LineFacts, width: int) -> list[Piece]:
    """``line[:end]`` broken at spaces outside strings, each broken line ending in ``JOIN``."""
    breaks = [
        i
        for i in range(indent + 1, end)
        if line[i] == " " and line[i - 1] != " " and not _inside(i, facts.strings)
    ]
    pieces, start, prefix = [], 0, ""
    while cell_len(prefix + line[start:end]) > width:
        fitting = [
            b for b in breaks if b > start and cell_len(prefix + line[start:b] + JOIN) <= width
        ]
        later = [b for b in breaks if b > start]
        cut = fitting[-1] if fitting else (later[0] if later else None)
        if cut is None:
            break  # nothing to break at: printed whole
        pieces.append(Piece(prefix, start, cut, JOIN))
        start = cut
        while start < end and line[start] == " ":
            start += 1
        prefix = " " * (indent + HANG)
    pieces.append(Piece(prefix, start, end))
    return pieces


def _inside(i: int, spans: tuple[tuple[int, int], ...]) -> bool:
    return any(a < i < b for a, b in spans)


def line_facts(code: str) -> list[LineFacts]:
    """Comments and strings of each line of ``code``: from Python's tokenizer when ``code`` is
    Python, else from quotes (a shell command line)."""
    lines = code.split("\n")
    try:
        return _python_facts(code, len(lines))
    except (tokenize.TokenError, SyntaxError):
        return [_quoted_facts(line) for line in lines]


def _python_facts(code: str, n: int) -> list[LineFacts]:
    comments: dict[int, int] = {}
    strings: dict[int, list[tuple[int, int]]] = {}
    verbatim: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        (row, col), (end_row, end_col) = tok.start, tok.end
        if tok.type == tokenize.COMMENT:
            comments[row - 1] = col
        elif tok.type == tokenize.STRING:
            if end_row == row:
                strings.setdefault(row - 1, []).append((col, end_col))
            else:  # a multi-line string: its lines stay as they are
                verbatim.update(range(row - 1, end_row))
    return [LineFacts(comments.get(i), tuple(strings.get(i, ())), i in verbatim) for i in range(n)]


def _quoted_facts(line: str) -> LineFacts:
    """A ``#`` that starts a word outside quotes starts a comment (shell rules)."""
    spans, quote, opened, comment = [], None, 0, None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote and line[i - 1] != "\\":
                spans.append((opened, i + 1))
                quote = None
        elif ch in "'\"":
            quote, opened = ch, i
        elif ch == "#" and (i == 0 or line[i - 1] == " "):
            comment = i
            break
    if quote:
        spans.append((opened, len(line)))
    return LineFacts(comment, tuple(spans))


class CodeBlock:
    """Code shown syntax-highlighted, each line folded to the width (:func:`fold_line`) and
    indented by ``indent`` columns; nothing is cropped."""

    def __init__(
        self, code: str, language: str = "python", theme: str = "ansi_dark", indent: int = 0
    ) -> None:
        self.code = code
        self.language = language
        self.theme = theme
        self.indent = indent

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.syntax import Syntax

        width = max(options.max_width - self.indent, HANG + 8)
        if console.color_system is None:  # plain text (piped, NO_COLOR): no lexer to build
            highlighted = Text(self.code)
        else:
            syntax = Syntax(self.code, self.language, theme=self.theme, background_color="default")
            highlighted = syntax.highlight(self.code)
        highlighted.rstrip()
        lines = highlighted.split("\n", allow_blank=True)
        margin = " " * self.indent
        for line, facts in zip(lines, line_facts(highlighted.plain), strict=True):
            for piece in fold_line(line.plain, facts, width):
                # a comment's continuation: its "#" styled as the comment it continues
                style = (
                    line.get_style_at_offset(console, piece.start) if piece.prefix.strip() else ""
                )
                text = (
                    Text(margin) + Text(piece.prefix, style=style) + line[piece.start : piece.end]
                )
                text.append(piece.suffix)
                text.no_wrap, text.overflow = True, "ignore"  # whole, never cropped
                yield text
