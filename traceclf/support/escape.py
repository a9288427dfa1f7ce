"""Make text from traces, rule files and saved reports inert before it is shown.

Kernel, GPU and NVTX names, nsys versions and file names come from whoever produced the
trace; rule text from whoever wrote the ``--rules`` folder; saved reports from anyone. None
of it may drive the user's terminal (escape sequences: clear screen, window title, hidden
OSC 8 hyperlinks), be read as rich markup (``[link=...]``, or ``[/]``, which crashes rich's
parser), or become live Markdown (inline HTML, a fence that ends early, a newline that starts
a heading, a pipe that splits a table cell). Every renderer goes through this module.
"""

from __future__ import annotations

import re
from typing import Any

# What a terminal may act on or that hides text: C0 controls, DEL, C1 controls (U+009B is CSI
# on terminals that honour 8-bit controls), bidirectional overrides and isolates ("Trojan
# Source" reordering), line/paragraph separators, and lone surrogates (the bytes of a file
# name that is not UTF-8, which cannot even be written to a UTF-8 stream).
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_UNSAFE_MULTILINE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
    "\ud800-\udfff]"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _shown(match: re.Match[str]) -> str:
    c = match.group(0)
    code = ord(c)
    if c in _NAMED:
        return _NAMED[c]
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: the undecodable byte itself
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def visible(value: Any, *, multiline: bool = False) -> str:
    """``value`` as text with every control character written out (``\\x1b``, ``\\n``), so
    it reads as what it is and cannot act on a terminal. ``multiline`` keeps newlines and
    tabs (config snippets)."""
    text = value if isinstance(value, str) else str(value)
    return (_UNSAFE_MULTILINE if multiline else _UNSAFE).sub(_shown, text)


def for_terminal(value: Any, style: str = "", *, multiline: bool = False):
    """A rich ``Text`` of ``value``: control characters written out, and never parsed as
    markup (rich parses plain strings given to ``print``, ``Table.add_row`` and panel titles)."""
    from rich.text import Text

    return Text(visible(value, multiline=multiline), style=style)


# Outside code spans a backslash makes any ASCII punctuation literal (CommonMark 2.4). These
# open HTML, links, images or code spans, or end a table cell; "*" is escaped too so that a
# name cannot restyle the text around it. "_", "~" and ">" stay: emphasis inside a word and
# ">=" are common in names and rule text, and cannot inject anything.
_MD_SPECIAL = re.compile(r"([\\`*\[\]<|])")
_MD_SPECIAL_PROSE = re.compile(r"([\\*\[\]<])")
_LINE_BREAKS = re.compile("[\r\n\u2028\u2029]+")


def for_markdown(value: Any, *, code_spans: bool = False) -> str:
    """``value`` as literal Markdown inline text on one line: no HTML, links, images, code
    spans, headings or table-cell breaks.

    ``code_spans=True`` is for rule-written prose outside tables, which marks config names
    with backticks: those stay code spans. That is safe too: text inside a code span is
    literal, and outside one every ``<`` is escaped, so no HTML can go live either way.
    """
    text = visible(_LINE_BREAKS.sub(" ", value if isinstance(value, str) else str(value)))
    text = (_MD_SPECIAL_PROSE if code_spans else _MD_SPECIAL).sub(r"\\\1", text)
    # The value may start a line: keep it from being read as a heading or a quote.
    return re.sub(r"^([#>])", r"\\\1", text)


def markdown_code(value: Any) -> str:
    """``value`` as an inline code span, whatever backticks it holds (the fence is longer
    than any run of backticks inside), safe in a table cell (pipes escaped, which GFM
    tables honour even inside code spans)."""
    text = visible(value).replace("|", "\\|")
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def markdown_fence(code: str, language: str = "") -> str:
    """A fenced code block that ``code`` cannot end early (the fence is longer than any run
    of backticks inside); control characters written out, newlines kept."""
    text = visible(code, multiline=True)
    longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * (longest + 1)
    return f"{fence}{visible(language)}\n{text}\n{fence}"


# A spreadsheet reads a cell that starts with one of these as a formula ("CSV injection"): a
# kernel or NVTX name like "=HYPERLINK(...)" must stay text. OWASP's remedy: a leading quote.
_FORMULA_START = re.compile(r"^[=+\-@]")


def for_csv(value: Any) -> str:
    """``value`` as a CSV/spreadsheet text cell: on one line with control characters written out
    (``\\n``, ``\\x1b``), and a leading ``'`` when it would start a formula. Quoting of commas,
    quotes and the like is the CSV writer's job."""
    text = visible(value)
    return "'" + text if _FORMULA_START.match(text) else text
