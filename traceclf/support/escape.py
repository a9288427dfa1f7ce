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
# Source" reordering), line/paragraph separators, lone surrogates (the bytes of a file name
# that is not UTF-8, which cannot even be written to a UTF-8 stream), and the characters that
# show nothing: zero-width spaces and joiners, word joiners and invisible operators, the byte
# order mark, soft hyphen, interlinear annotation marks and tag characters (which can carry
# hidden text, and make two names that read the same differ).
_INVISIBLE = (
    "\u00ad\u034f\u061c\u180e\u200b-\u200f\u2028\u2029\u202a-\u202e\u2060-\u2064"
    "\u2066-\u2069\ufeff\ufff9-\ufffb\U000e0000-\U000e007f\ud800-\udfff"
)
_UNSAFE = re.compile(f"[\x00-\x1f\x7f-\x9f{_INVISIBLE}]")
_UNSAFE_MULTILINE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_INVISIBLE}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _shown(match: re.Match[str]) -> str:
    c = match.group(0)
    code = ord(c)
    if c in _NAMED:
        return _NAMED[c]
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: the undecodable byte itself
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


_UNDECODED = re.compile("[\udc80-\udcff]")


def path_text(path: Any) -> str:
    """A file name as the report holds it: each byte that is not UTF-8 (kept by Python as a
    lone surrogate, which JSON, polars and a UTF-8 stream cannot hold) written as ``\\xff``,
    as every renderer shows it."""
    return _UNDECODED.sub(_shown, str(path))


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
# open HTML, links, images or code spans, or end a table cell; "&" would start an entity
# ("&#x202e;" is a bidi override once rendered), "*" and "~" emphasis or strikethrough (GFM)
# that restyles the text around the value, and so would "_" anywhere but between two letters
# or digits (as in "h100_comm_ep2", where it opens nothing and stays as it is).
_MD_SPECIAL = re.compile(r"([\\`*~&\[\]<|]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z]))")
_MD_SPECIAL_PROSE = re.compile(r"([\\`*~&\[\]<]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z]))")
_LINE_BREAKS = re.compile("[\r\n\u2028\u2029]+")
# GFM links bare URLs ("http://", "https://", "ftp://"), "www." names and e-mail addresses
# (autolink extension). A backslash before ":" or "." ends the first two; an address is found
# in the text after escapes are read, so an empty HTML comment (invisible where GFM renders,
# and inert) splits it after the "@".
_URL = re.compile(r"(?<=[A-Za-z])(:)(?=//)")
_WWW = re.compile(r"([Ww]{3})(\.)")
_EMAIL = re.compile(r"@(?=[A-Za-z0-9])")
# Code spans of rule prose (``config names``): literal already, left as they are. As
# CommonMark reads them: a whole run of backticks (none just before it) closed by the next run
# of the same length; a backtick outside them is escaped, so that a value's stray run (``)
# opens nothing and pairs with nothing.
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)")
# What a value could start at the beginning of a line: a heading, a quote, a list item, a
# setext underline or thematic break ("-12%" or "1.5 ms" start none of them).
_LINE_START = re.compile(r"^([#>]|[-+=](?=[-=\s]|$))|^(\d{1,9})([.)])(?=\s|$)")


def for_markdown(value: Any, *, code_spans: bool = False) -> str:
    """``value`` as literal Markdown inline text on one line: no HTML, entities, links,
    images, code spans, emphasis, headings or table-cell breaks, as GitHub (GFM) renders it.

    ``code_spans=True`` is for rule-written prose outside tables, which marks config names
    with backticks: those stay code spans (text inside a code span is literal), and the text
    between them is escaped as any other.
    """
    text = visible(_LINE_BREAKS.sub(" ", value if isinstance(value, str) else str(value)))
    if not code_spans:
        text = _literal(text, _MD_SPECIAL)
    else:
        parts, at = [], 0
        for span in _CODE_SPAN.finditer(text):
            parts += [_literal(text[at : span.start()], _MD_SPECIAL_PROSE), span.group(0)]
            at = span.end()
        text = "".join([*parts, _literal(text[at:], _MD_SPECIAL_PROSE)])
    # The value may start a line: keep it from being read as a heading, quote or list.
    return _LINE_START.sub(lambda m: f"\\{m[1]}" if m[1] else f"{m[2]}\\{m[3]}", text)


def _literal(text: str, special: re.Pattern[str]) -> str:
    text = special.sub(r"\\\1", text)
    text = _WWW.sub(r"\1\\\2", _URL.sub(r"\\\1", text))
    return _EMAIL.sub("@<!-- -->", text)


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


def for_html(value: Any, *, multiline: bool = False) -> str:
    """``value`` as HTML text: control characters, bidirectional overrides and the like
    written out as in the terminal (``\\u202e``; an entity would still reorder the text once
    rendered), then ``& < > " '`` escaped. ``multiline`` keeps newlines (config snippets)."""
    import html

    return html.escape(visible(value, multiline=multiline))


# A spreadsheet reads a cell that starts with one of these as a formula ("CSV injection"): a
# kernel or NVTX name like "=HYPERLINK(...)" must stay text. OWASP's remedy: a leading quote.
_FORMULA_START = re.compile(r"^[=+\-@]")


def for_csv(value: Any) -> str:
    """``value`` as a CSV/spreadsheet text cell: on one line with control characters written out
    (``\\n``, ``\\x1b``), and a leading ``'`` when it would start a formula. Quoting of commas,
    quotes and the like is the CSV writer's job."""
    text = visible(value)
    return "'" + text if _FORMULA_START.match(text) else text
