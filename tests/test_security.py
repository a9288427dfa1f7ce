"""What traceclf writes and prints cannot be turned against its user (issue 13).

- ``-o`` writes through FIFOs and devices instead of replacing them, never replaces a symlink,
  keeps an existing file's mode and gives a new one the umask's (item 2);
- names that come from a trace, a rule file or a saved report cannot drive the terminal
  (escape sequences, rich markup) or inject into Markdown (HTML, headings, table cells)
  (items 3 and 4);
- ``-o`` onto any input, however it is spelled, is refused before anything is written (item 6);
- ``--dask`` workers read the file the user named, not one at the same relative path beside
  them (item 8).

The hostile exports here are constructed: a copy of a small real export
(h100_host_input_stall) whose names are rewritten with sqlite3.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import stat
import threading
from pathlib import Path

import pytest
from conftest import fixture_trace
from helpers.cli import CliResult, run_cli
from helpers.files import copy_export, file_state, prefix_kernel_names

TINY = "h100_host_input_stall"  # 470 KB, one rank, NVTX steps: the fastest real export
OTHER = "h100_compute_low_occupancy"  # a different run with a different verdict (compute)

# Raw control characters a terminal acts on: C0 except newline, DEL and C1 (U+0080-U+009F,
# e.g. U+009B is CSI on terminals that honour 8-bit controls).
RAW_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
# Clear screen, set the window title, a hidden OSC 8 hyperlink, rich markup that would hide a
# link or crash rich's markup parser, and an 8-bit CSI.
TERMINAL_PAYLOAD = (
    "\x1b[2J\x1b]0;owned\x07\x1b]8;;http://evil.example\x1b\\here\x1b]8;;\x1b\\"
    "[/][link=http://evil.example]k[/link]\x9b31m"
)
MARKDOWN_PAYLOAD = "x``<img src=x onerror=alert(1)>``\n# Injected heading | cell"


def tiny_copy(folder: Path, name: str = "run.sqlite") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return copy_export(fixture_trace(TINY), folder / name)


def rename_everything(path: Path, payload: str) -> Path:
    """Constructed: every kernel name, the GPU name, the nsys version and the NVTX step
    ranges of a real export start with ``payload``."""
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


def assert_inert_for_terminal(text: str) -> None:
    found = sorted({hex(ord(c)) for c in RAW_CONTROL.findall(text)})
    assert not found, f"raw control characters reached the terminal: {found}"


def assert_one_line_error(result: CliResult, *needles: str) -> None:
    assert result.code == 2, (result.code, result.stderr)
    assert len(result.stderr_lines) == 1, result.stderr
    assert result.stderr.startswith("traceclf: error: "), result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


# -- item 2: -o onto FIFOs, devices, symlinks; modes and umask ---------------------------------


def test_output_onto_a_fifo_is_written_through_not_replaced(tmp_path: Path) -> None:
    export = tiny_copy(tmp_path / "run")
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    result = run_cli("analyze", export, "-f", "json", "-o", fifo, "-q", "--no-cache")
    reader.join(10)  # a replaced FIFO is never opened for writing: the reader waits in vain
    assert result.code == 0, result.stderr
    assert stat.S_ISFIFO(fifo.lstat().st_mode), "the FIFO was replaced by a regular file"
    assert json.loads(received[0])["classification"]["bound"] == "host"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_output_onto_a_character_device_is_written_through(tmp_path: Path) -> None:
    """A private copy of /dev/null (same major/minor): as root, the old code turned the
    device into a regular file."""
    export = tiny_copy(tmp_path / "run")
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    result = run_cli("analyze", export, "-f", "json", "-o", null, "-q", "--no-cache")
    assert result.code == 0, result.stderr
    assert stat.S_ISCHR(null.lstat().st_mode), "the device was replaced by a regular file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null", "run"]


def test_output_through_a_symlink_writes_the_target_and_keeps_the_link(tmp_path: Path) -> None:
    export = tiny_copy(tmp_path / "run")
    (tmp_path / "reports").mkdir()
    target = tmp_path / "reports" / "latest.json"
    target.write_text("old\n")
    link = tmp_path / "report.json"
    link.symlink_to(target)
    result = run_cli("analyze", export, "-f", "json", "-o", link, "-q", "--no-cache")
    assert result.code == 0, result.stderr
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert json.loads(target.read_text())["classification"]["bound"] == "host"


def test_output_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    export = tiny_copy(tmp_path / "run")
    private = tmp_path / "private.md"
    private.write_text("old\n")
    private.chmod(0o600)
    result = run_cli("analyze", export, "-f", "md", "-o", private, "-q", "--no-cache")
    assert result.code == 0, result.stderr
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_text().startswith("# traceclf")


@pytest.mark.parametrize(("umask", "mode"), [(0o077, 0o600), (0o022, 0o644), (0o002, 0o664)])
def test_new_output_gets_the_mode_the_umask_allows(tmp_path: Path, umask: int, mode: int) -> None:
    export = tiny_copy(tmp_path / "run")
    output = tmp_path / "report.json"
    old = os.umask(umask)
    try:
        result = run_cli("analyze", export, "-f", "json", "-o", output, "-q", "--no-cache")
    finally:
        os.umask(old)
    assert result.code == 0, result.stderr
    assert stat.S_IMODE(output.stat().st_mode) == mode


# -- item 3: terminal injection -----------------------------------------------------------------


@pytest.fixture
def hostile_export(tmp_path: Path) -> Path:
    return rename_everything(tiny_copy(tmp_path / "run"), TERMINAL_PAYLOAD)


def test_trace_names_cannot_drive_the_terminal_in_analyze(hostile_export: Path) -> None:
    result = run_cli("analyze", hostile_export, "--step-range", r"batch \d+$", "-q", "--no-cache")
    assert result.code == 0, result.stderr
    assert_inert_for_terminal(result.stdout)
    # Markup is shown as the text it is, not interpreted (no hidden link, no MarkupError).
    assert "[/][link=http://evil.example]" in result.stdout
    assert "HOST-bound" in result.stdout


def test_rule_text_cannot_drive_the_terminal_in_rules_and_explain(tmp_path: Path) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "mine.yaml").write_text(
        "rules:\n"
        "  - id: sneaky\n"
        "    wall: host\n"
        "    when: \"gpu_name == '[/]\\e]0;t\\a'\"\n"
        "    score: 0.1\n"
        '    evidence: "[/]\\e[2J shown"\n'
        "    fixes: [sneaky-fix]\n"
        "fixes:\n"
        "  - id: sneaky-fix\n"
        "    wall: host\n"
        '    title: "[/]\\e[2J[link=http://evil.example]Title[/link]\\x9b31m"\n'
        '    why: "[bold]why\\e]8;;http://evil.example\\e\\\\x\\e]8;;\\e\\\\"\n'
        '    config: "x = 1  # \\e[2J[/]"\n'
        '    pitfalls: ["[/] \\e[31mred"]\n'
    )
    listed = run_cli("rules", "--rules", rules)
    assert listed.code == 0, listed.stderr
    assert_inert_for_terminal(listed.stdout)
    assert "[/]" in listed.stdout
    explained = run_cli("explain", "sneaky-fix", "--rules", rules)
    assert explained.code == 0, explained.stderr
    assert_inert_for_terminal(explained.stdout)
    assert "[link=http://evil.example]Title[/link]" in explained.stdout


def saved_report(folder: Path, name: str = "before.json") -> Path:
    export = tiny_copy(folder / "run")
    path = folder / name
    result = run_cli("analyze", export, "-f", "json", "-o", path, "-q", "--no-cache")
    assert result.code == 0, result.stderr
    return path


def tampered_report(source: Path, path: Path, change) -> Path:
    """Constructed: a saved JSON report edited the way a hostile or broken producer would."""
    data = json.loads(source.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


def test_saved_report_text_cannot_drive_the_terminal_in_compare(tmp_path: Path) -> None:
    before = saved_report(tmp_path)

    def hostile(data: dict) -> None:
        data["classification"]["bound"] = TERMINAL_PAYLOAD
        data["gpus"][0]["name"] = TERMINAL_PAYLOAD
        data["steps"]["label"] = TERMINAL_PAYLOAD

    after = tampered_report(before, tmp_path / "after.json", hostile)
    second = tampered_report(before, tmp_path / "\x1b[2Jsecond.json", hostile)
    for candidates in ((after,), (after, second)):  # one comparison, and the several-run table
        result = run_cli("compare", before, *candidates)
        assert result.code == 3, result.stderr  # (another GPU name and label: not comparable)
        assert_inert_for_terminal(result.stdout)
        assert "[/][link=http://evil.example]" in result.stdout


# -- item 4: Markdown injection -------------------------------------------------------------------


def rendered_markdown(text: str) -> str:
    """HTML as a GitHub-style renderer (CommonMark + tables, inline HTML allowed) makes it."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": True}).enable("table").render(text)


def assert_no_live_html(html: str) -> None:
    # a report written with -o links its own figures, PNG files beside it: nothing else
    html = re.sub(r'<img src="[\w.-]+\.png" alt="[\w ]+" />', "", html)
    tags = set(re.findall(r"<([a-zA-Z][a-zA-Z0-9]*)", html))
    allowed = {"h1", "h2", "h3", "p", "strong", "em", "code", "pre", "ul", "li", "table"}
    allowed |= {"thead", "tbody", "tr", "th", "td", "br"}
    assert tags <= allowed, f"live HTML: {sorted(tags - allowed)}"
    headings = re.findall(r"<h\d>(.*?)</h\d>", html)
    assert not [h for h in headings if "Injected" in h], headings


def test_trace_names_stay_literal_in_markdown(tmp_path: Path) -> None:
    export = rename_everything(tiny_copy(tmp_path / "run"), MARKDOWN_PAYLOAD)
    output = tmp_path / "report.md"
    result = run_cli(
        "analyze", export, "--step-range", r"batch \d+$", "-f", "md", "-o", output, "-q",
        "--no-cache",
    )  # fmt: skip
    assert result.code == 0, result.stderr
    text = output.read_text()
    assert_inert_for_terminal(text)
    html = rendered_markdown(text)
    assert_no_live_html(html)
    # Every top kernel is one table row whose first cell holds the whole name.
    kernels = html.split("Top kernels", 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr>\s*<td>(.*?)</td>", kernels, flags=re.S)
    assert len(rows) == 8
    assert all("# Injected heading |" in row for row in rows), rows


def test_compare_markdown_from_saved_json_escapes_what_it_copies(tmp_path: Path) -> None:
    before = saved_report(tmp_path)

    def hostile(data: dict) -> None:
        data["classification"]["bound"] = MARKDOWN_PAYLOAD
        data["gpus"][0]["name"] = "<b>GPU</b>\n## Injected heading"
        data["steps"]["label"] = "` <img src=y onerror=alert(2)> `"

    after = tampered_report(before, tmp_path / "x`<img src=z onerror=alert(3)>`.json", hostile)
    second = tampered_report(before, tmp_path / "<img src=q onerror=alert(4)>.json", hostile)
    for candidates in ((after,), (after, second)):
        result = run_cli("compare", before, *candidates, "-f", "md")
        assert result.code == 3, result.stderr  # (another GPU name and label: not comparable)
        assert_no_live_html(rendered_markdown(result.stdout))


# -- item 6: -o onto an input ---------------------------------------------------------------------


def spell(kind: str, export: Path) -> str:
    """The same file as ``export`` (cwd is its folder), named in one of the ways users do."""
    if kind == "symlink":
        link = export.with_name("alias.sqlite")
        link.symlink_to(export)
        return link.name
    if kind == "hardlink":
        os.link(export, export.with_name("hard.sqlite"))
        return "hard.sqlite"
    return {
        "same": export.name,
        "dotted": f"./././{export.name}",
        "absolute": str(export),
        "up and back": f"../{export.parent.name}/{export.name}",
    }[kind]


@pytest.mark.parametrize(
    "kind", ["same", "dotted", "absolute", "up and back", "symlink", "hardlink"]
)
def test_output_onto_the_input_is_refused_however_it_is_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    export = tiny_copy(tmp_path / "run")
    before = file_state(export)
    monkeypatch.chdir(export.parent)
    output = spell(kind, export)
    result = run_cli("analyze", export.name, "-f", "json", "-o", output, "-q", "--no-cache")
    assert_one_line_error(result, "output would overwrite input")
    assert file_state(export) == before


def test_output_onto_a_file_of_a_folder_input_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    tiny_copy(folder, "rank_0.sqlite")
    second = tiny_copy(folder, "rank_1.sqlite")
    before = file_state(second)
    result = run_cli("analyze", folder, "-f", "json", "-o", second, "-q", "--no-cache")
    assert_one_line_error(result, "output would overwrite input")
    assert file_state(second) == before


def test_output_onto_the_second_of_several_inputs_or_a_pattern_match_is_refused(
    tmp_path: Path,
) -> None:
    first = tiny_copy(tmp_path / "a", "rank_0.sqlite")
    second = tiny_copy(tmp_path / "b", "rank_1.sqlite")
    before = file_state(second)
    for inputs in ((first, second), (first, str(tmp_path / "b" / "*.sqlite"))):
        result = run_cli("analyze", *inputs, "-f", "md", "-o", second, "-q", "--no-cache")
        assert_one_line_error(result, "output would overwrite input")
        assert file_state(second) == before


def test_compare_output_onto_either_side_is_refused(tmp_path: Path) -> None:
    before = saved_report(tmp_path)
    export = tiny_copy(tmp_path / "after")
    states = file_state(before), file_state(export)
    for target in (before, export):
        result = run_cli("compare", before, export, "-f", "json", "-o", target, "-q", "--no-cache")
        assert_one_line_error(result, "output would overwrite input")
    assert (file_state(before), file_state(export)) == states


# -- item 8: --dask with relative paths -----------------------------------------------------------


def test_dask_worker_reads_the_file_the_user_named_not_the_one_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker started in another folder holding a different rank_0.sqlite must not analyse
    its own file under the user's name: inputs travel as absolute paths."""
    distributed = pytest.importorskip("distributed")
    worker_dir, user_dir = tmp_path / "worker", tmp_path / "user"
    copy_export(fixture_trace(OTHER), (worker_dir.mkdir() or worker_dir) / "rank_0.sqlite")
    mine = tiny_copy(user_dir, "rank_0.sqlite")
    monkeypatch.chdir(worker_dir)  # worker processes start here and keep this cwd
    with distributed.LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        silence_logs=logging.CRITICAL,
    ) as cluster:
        monkeypatch.chdir(user_dir)
        remote = run_cli(
            "analyze", "rank_0.sqlite", "--dask", cluster.scheduler_address, "-f", "json", "-q",
            "--no-cache",
        )  # fmt: skip
    local = run_cli("analyze", mine, "-f", "json", "-q", "--no-cache")
    assert remote.code == 0, remote.stderr
    got, want = json.loads(remote.stdout), json.loads(local.stdout)
    assert got["classification"]["bound"] == want["classification"]["bound"] == "host"
    assert got["metrics"]["kernels_per_step"] == want["metrics"]["kernels_per_step"]


def test_dask_worker_refuses_a_different_file_at_the_same_path(tmp_path: Path) -> None:
    """What a worker checks before it analyses: the file at the path it was sent has the size,
    mtime and first 64 KiB seen where the user ran traceclf (here the file is rewritten in
    between, as a worker on another machine with another file there would see it)."""
    from traceclf.pipeline.parallel import RemoteFile
    from traceclf.support.errors import TraceError

    export = tiny_copy(tmp_path / "run")
    sent = RemoteFile.of(export)
    assert sent.path.is_absolute() and sent.checked() == export
    other = copy_export(fixture_trace(OTHER), tmp_path / "other.sqlite")
    os.replace(other, export)
    with pytest.raises(TraceError, match="different file"):
        sent.checked()
