"""Text from traces and rule files stays text in every format, checked by rendering it as its
readers do (issue 29, "Injection into what people read").

- Markdown is rendered by cmark-gfm, GitHub's own renderer (GFM: tables, strikethrough,
  autolinks), raw HTML allowed through: an entity (``&#x202e;``) must not become a bidi
  override, a URL, a ``www.`` name or an address must not become a link, ``~~x~~`` must not
  strike text, ``_x_`` must not restyle it — for trace text (GPU name, NVTX label, file name)
  and rule-file prose alike;
- HTML is read back with an HTML parser: no raw control character, ESC, BEL or U+202E in its
  text or attributes;
- the Perfetto trace is read back with ``json.loads``: no raw ESC, OSC 8 or U+202E in any
  string, ``args.full_name`` included.

The hostile exports are CONSTRUCTED: a copy of a small real export (fixtures/) whose names are
rewritten with sqlite3; the rule folders are written here.
"""

from __future__ import annotations

import json
import re
import sqlite3
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import fixture_trace
from helpers.cli import run_cli
from helpers.files import copy_export, prefix_kernel_names

TINY = "h100_host_input_stall"
GFM_PAYLOAD = (
    "&#x202e;x&#8238; see http://evil.example/a and www.evil.example or "
    "mail@evil.example ~~struck~~ _em_ *em* "
)
# What a terminal or a browser acts on: C0 controls but newline, DEL, C1, bidi overrides and
# isolates, and line/paragraph separators; and what shows nothing: zero-width characters, the
# byte order mark, soft hyphen, tag characters.
INVISIBLE = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
    "\u00ad\u200b-\u200d\u2060-\u2064\ufeff\U000e0000-\U000e007f]"
)
CONTROL_PAYLOAD = (
    "\x1b[31m\x07\u202eevil\x1b]8;;http://evil.example\x1b\\link\x1b]8;;\x1b\\"
    "\u200b\ufeff\U000e0041\u00ad "
)
# The tags a Markdown report renders to (cmark-gfm) when nothing is injected.
REPORT_TAGS = {"h1", "h2", "h3", "p", "strong", "code", "pre", "ul", "li", "img", "br"}
REPORT_TAGS |= {"table", "thead", "tbody", "tr", "th", "td"}


def hostile_export(folder: Path, payload: str, name: str = "run.sqlite") -> Path:
    """CONSTRUCTED: every kernel name, the GPU name, the nsys version and the NVTX step labels
    of a real export start with ``payload``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = copy_export(fixture_trace(TINY), folder / name)
    with sqlite3.connect(path) as con:
        prefix_kernel_names(con, payload)
        con.execute("UPDATE TARGET_INFO_GPU SET name = ? || name", (payload,))
        con.execute(
            "UPDATE META_DATA_EXPORT SET value = ? || value WHERE name = 'EXPORT_PRODUCT_VERSION'",
            (payload,),
        )
        con.execute("UPDATE NVTX_EVENTS SET text = ? || text WHERE text LIKE 'batch %'", (payload,))
    con.close()
    return path


def yaml_quoted(text: str) -> str:
    """``text`` as a YAML double-quoted scalar, every character not printable ASCII escaped
    (YAML's \\x, \\u and \\U: a JSON string spells U+E0041 as two surrogates, which YAML
    refuses)."""

    def escaped(c: str) -> str:
        code = ord(c)
        if 0x20 <= code < 0x7F and c not in '"\\':
            return c
        if code < 0x100:
            return f"\\x{code:02x}"
        return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"

    return '"' + "".join(map(escaped, text)) + '"'


def hostile_rules(folder: Path, payload: str) -> Path:
    """A rule that always fires, and its fix, whose prose starts with ``payload``."""
    folder.mkdir(parents=True, exist_ok=True)
    text = yaml_quoted(payload)
    (folder / "mine.yaml").write_text(
        "rules:\n"
        "  - id: always\n"
        "    wall: host\n"
        "    when: 'True'\n"
        "    score: 0.99\n"
        f'    evidence: {text[:-1]} holds"\n'
        "    fixes: [hostile-fix]\n"
        "fixes:\n"
        "  - id: hostile-fix\n"
        "    wall: host\n"
        f'    title: {text[:-1]} title"\n'
        f'    why: {text[:-1]} why `a_b` stays code"\n'
        '    config: "x = 1"\n'
    )
    return folder


def gfm(markdown: str) -> str:
    """HTML as GitHub renders ``markdown`` (cmark-gfm with its extensions), raw HTML kept so
    that any that got through shows."""
    cmarkgfm = pytest.importorskip("cmarkgfm")
    from cmarkgfm.cmark import Options

    return cmarkgfm.github_flavored_markdown_to_html(markdown, options=Options.CMARK_OPT_UNSAFE)


class _Read(HTMLParser):
    """Tags, text (entities decoded, as a browser shows it) and attribute values of HTML."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        self.text += [v for k, v in attrs if v and k != "src"]  # (src: the figures' data)

    def handle_data(self, data) -> None:
        self.text.append(data)


def read_html(html: str) -> _Read:
    parser = _Read()
    parser.feed(html)
    parser.close()
    return parser


def assert_literal_gfm(markdown: str, *shown: str) -> None:
    page = read_html(gfm(markdown))
    assert set(page.tags) <= REPORT_TAGS, sorted(set(page.tags) - REPORT_TAGS)
    text = "".join(page.text)
    assert not INVISIBLE.findall(text), sorted({hex(ord(c)) for c in INVISIBLE.findall(text)})
    for needle in shown:  # the text itself is there, as text
        assert needle in text, needle


def test_trace_text_is_literal_where_github_renders_it(tmp_path: Path) -> None:
    """Constructed: GPU name, NVTX labels, kernel names, nsys version and the file name carry
    an entity, links, strikethrough and emphasis. "&" was not escaped: "&#x202e;" became a
    bidi override, URLs live links, "~~x~~" struck text."""
    export = hostile_export(tmp_path / "run", GFM_PAYLOAD, "www.evil.example ~~x~~ &#x202e;.sqlite")
    output = tmp_path / "report.md"
    result = run_cli(
        "analyze", export, "--step-range", r"batch \d+$", "-f", "md", "-o", output, "-q",
        "--no-cache",
    )  # fmt: skip
    assert result.code == 0, result.stderr
    markdown = output.read_text()
    assert_literal_gfm(markdown, "http://evil.example/a", "~~struck~~", "_em_", "&#x202e;x")
    assert "www.evil.example ~~x~~ &#x202e;.sqlite" in "".join(read_html(gfm(markdown)).text)


def test_rule_prose_is_literal_where_github_renders_it(tmp_path: Path) -> None:
    """Constructed: a rule's evidence and its fix's title and why carry the same payload; rule
    prose keeps its `config names` as code spans."""
    export = copy_export(fixture_trace(TINY), tmp_path / "run.sqlite")
    rules = hostile_rules(tmp_path / "rules", GFM_PAYLOAD)
    output = tmp_path / "report.md"
    result = run_cli(
        "analyze", export, "--rules", rules, "-f", "md", "-o", output, "-q", "--no-cache"
    )
    assert result.code == 0, result.stderr
    markdown = output.read_text()
    shown = "http://evil.example/a and www.evil.example or mail@evil.example ~~struck~~ _em_ *em*"
    assert_literal_gfm(markdown, shown)
    assert "<code>a_b</code>" in gfm(markdown)


def test_compare_markdown_is_literal_where_github_renders_it(tmp_path: Path) -> None:
    """Constructed: a saved report edited to carry the payload in its bound, GPU and label."""
    export = copy_export(fixture_trace(TINY), tmp_path / "run.sqlite")
    before = tmp_path / "before.json"
    assert run_cli("analyze", export, "-f", "json", "-o", before, "-q", "--no-cache").code == 0
    data = json.loads(before.read_text())
    data["gpus"][0]["name"] = GFM_PAYLOAD
    data["steps"]["label"] = GFM_PAYLOAD
    after = tmp_path / "after ~~x~~ www.evil.example.json"
    after.write_text(json.dumps(data))
    result = run_cli("compare", before, after, "-f", "md")
    assert result.code == 3, result.stderr  # (another GPU name and step label: not comparable)
    assert_literal_gfm(result.stdout, "http://evil.example/a")


@pytest.mark.parametrize("where", ["trace", "rules"])
def test_html_holds_no_raw_control_or_bidi_character(tmp_path: Path, where: str) -> None:
    """Constructed: names and rule prose with ESC, BEL, U+202E and an OSC 8 link. HTML kept
    them raw (escaping <, > and & is not enough: U+202E reorders what the page shows)."""
    if where == "trace":
        export = hostile_export(tmp_path / "run", CONTROL_PAYLOAD)
        extra: tuple[str, ...] = ("--step-range", r"batch \d+$")
    else:
        export = copy_export(fixture_trace(TINY), tmp_path / "run.sqlite")
        extra = ("--rules", str(hostile_rules(tmp_path / "rules", CONTROL_PAYLOAD)))
    output = tmp_path / "report.html"
    result = run_cli("analyze", export, *extra, "-f", "html", "-o", output, "-q", "--no-cache")
    assert result.code == 0, result.stderr
    page = read_html(output.read_text())
    text = "".join(page.text)
    assert not INVISIBLE.findall(text), sorted({hex(ord(c)) for c in INVISIBLE.findall(text)})
    assert "\\x1b[31m\\x07\\u202eevil" in text  # shown, written out
    assert not {"script", "a", "iframe"} & set(page.tags)


def strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def test_perfetto_trace_holds_no_raw_control_or_bidi_character(tmp_path: Path) -> None:
    """Constructed: kernel names (short and full) and NVTX labels with ESC, OSC 8 and U+202E.
    args.full_name kept them raw."""
    export = hostile_export(tmp_path / "run", CONTROL_PAYLOAD)
    output = tmp_path / "window.json"
    result = run_cli(
        "analyze", export, "--step-range", r"batch \d+$", "--export-trace", output, "-q",
        "--no-cache", "-f", "json",
    )  # fmt: skip
    assert result.code == 0, result.stderr
    events = json.loads(output.read_text())
    found = [s for s in strings(events) if INVISIBLE.search(s)]
    assert not found, found[:3]
    full = [
        e["args"]["full_name"] for e in events["traceEvents"] if "full_name" in e.get("args", {})
    ]
    assert full and all(name.startswith("\\x1b[31m") for name in full)


@pytest.mark.parametrize(
    "value",
    [
        "``<img src=x onerror=alert(1)>`",
        'data_wait ``<a href="https://evil.example">click</a>`',
        "Z!``<<img src=x onerror=1>`a",
        "Z[``--><img src=x onerror=1>\\`",
    ],
)
def test_a_stray_backtick_run_in_prose_opens_no_html(value: str) -> None:
    """A trace value in rule prose (evidence names frames and NVTX ranges) with a run of two
    backticks then one: a code span was found from the run's second backtick, kept raw, and
    GitHub read the run as text and the tag inside as HTML (an adversarial review's find).
    (The value's odd backtick may still pair with the rule's own code span: literal text
    either way.)"""
    from traceclf.support.escape import for_markdown

    prose = for_markdown(f"GPU idle while in {value} (a.py): set `cfg.x = 1`", code_spans=True)
    page = read_html(gfm(f"- {prose}\n"))
    assert set(page.tags) <= {"ul", "li", "code"}, page.tags
    assert "onerror" not in value or "onerror=" in "".join(page.text)  # shown as text
