"""Small things a new user trips over (issue 14): `python -m traceclf`, fix ids, `explain`
without a trace, the multi-file API from a plain script, shell completion."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import FIXTURES, fixture_trace

from traceclf import __version__
from traceclf.judge.vocabulary import load_rules
from traceclf.render.rules import template_without_trace

FAMILIES = ("ampere", "ada", "hopper", "blackwell")


def test_python_dash_m_runs_the_cli(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "traceclf", "--version"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"traceclf, version {__version__}"


def test_measures_defines_every_name_a_rule_may_use(cli, monkeypatch) -> None:
    """docs/rules.md sends rule writers to `traceclf measures` for every name: the measures,
    then the facts about the run (CONTEXT_NAMES), each with its definition."""
    from traceclf.judge.vocabulary import CONTEXT_NAMES, known_names

    monkeypatch.setenv("COLUMNS", "400")
    code, out, err = cli("measures")
    assert code == 0, err
    defined = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert known_names() <= defined
    line = next(line for line in out.splitlines() if line.split()[:1] == ["ranks_share_gpu"])
    assert CONTEXT_NAMES["ranks_share_gpu"] in line


@pytest.mark.parametrize("asked", ["deepep", "DeepEP", "DEEPEP", " deepep "])
def test_fix_ids_are_case_insensitive(cli, asked: str) -> None:
    code, out, err = cli("explain", asked)
    assert code == 0, err
    assert "DeepEP token dispatcher" in out and "[deepep · communication]" in out


@pytest.mark.parametrize(
    ("asked", "meant"),
    [("deeep", "deepep"), ("fused_optimiser", "fused-optimizer"), ("CUDA-GRAPH", "cuda-graphs")],
)
def test_unknown_fix_id_suggests_the_closest(cli, asked: str, meant: str) -> None:
    code, out, err = cli("explain", asked)
    assert code == 2 and out == ""
    (line,) = err.splitlines()
    assert f"unknown fix {asked!r}; did you mean {meant}?" in line


def test_explain_renders_templates_without_a_trace(cli) -> None:
    """A field only a trace can fill is left out with the parentheses it is the whole of,
    rather than printed as a placeholder ("(your GPU)", "(‹idle_top_nvtx›)")."""
    code, out, _ = cli("explain", "deepep")
    assert code == 0
    assert "{gpu_name}" not in out and "your GPU" not in out
    assert "the first choice on H100/H200/B200." in " ".join(out.split())
    compile_ahead = " ".join(cli("explain", "compile-ahead").stdout.split())
    assert "JIT-compiling. Compilation belongs" in compile_ahead and "‹" not in compile_ahead
    for fix in load_rules(None).fixes.values():
        text = template_without_trace(fix.why)
        assert "{" not in text.replace("{{", ""), fix.id


def test_explain_deepep_names_one_set_of_gpus(cli) -> None:
    """Its text, preconditions and `requires` agree on the hardware DeepEP needs."""
    out = " ".join(cli("explain", "deepep").stdout.split()).lower()
    assert "ampere" not in out
    assert "hopper or blackwell" in out and 'gpu_family in ["hopper", "blackwell"]' in out


def test_no_fix_contradicts_its_gpu_requirement() -> None:
    for fix in load_rules(None).fixes.values():
        required = fix.requires.source if fix.requires else ""
        if "gpu_family" not in required:
            continue
        allowed = set(re.findall(r'"([a-z0-9]+)"', required))
        named = {f for f in FAMILIES for p in fix.premises if f in p.text.lower()}
        assert named <= allowed, (fix.id, named - allowed)


def test_multi_file_api_from_a_script_without_main_guard(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(
        textwrap.dedent(f"""
            import traceclf
            print("top-level ran")
            runs = traceclf.analyze({str(fixture_trace("h100_comm_ep2"))!r},
                                    {str(fixture_trace("h100_memory_offload"))!r}, jobs=2)
            print([r.bound for r in runs.runs])
        """)
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"TRACECLF_CACHE_DIR": str(tmp_path / "cache")},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["top-level ran", "['communication', 'memory']"]


def test_shell_completion_via_click() -> None:
    env = os.environ | {
        "_TRACECLF_COMPLETE": "bash_complete",
        "COMP_WORDS": "traceclf explain dee",
        "COMP_CWORD": "2",
    }
    done = subprocess.run(
        [sys.executable, "-m", "traceclf"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0 and done.stdout.split() == ["plain,deepep"]
    env |= {"_TRACECLF_COMPLETE": "bash_source"}
    source = subprocess.run(
        [sys.executable, "-m", "traceclf"], capture_output=True, text=True, env=env, check=False
    )
    assert "_traceclf_completion()" in source.stdout


@pytest.mark.parametrize("args", [(), ("cache",)], ids=["traceclf", "traceclf-cache"])
def test_a_command_group_alone_prints_its_help(cli, args: tuple[str, ...]) -> None:
    """`traceclf` (or `traceclf cache`) with nothing else prints the help as --help does, one
    item a line, not squashed into one "error:" line."""
    code, out, err = cli(*args)
    assert (code, err) == (0, "")
    assert out == cli(*args, "--help").stdout
    lines = out.splitlines()
    assert lines[0].startswith(f"Usage: traceclf {' '.join(args)}".rstrip())
    assert "Commands:" in lines and "error" not in out
    commands = lines[lines.index("Commands:") + 1 :]
    expected = ("analyze", "compare", "explain", "rules") if not args else ("clear", "info")
    for command in expected:
        assert any(line.split()[:1] == [command] for line in commands), command


@pytest.mark.parametrize("fmt", ["terminal", "json"])
def test_output_closed_early_by_a_pipe_exits_0(fmt: str) -> None:
    """`traceclf analyze … | head -1`: the reader stopping early is not an error (exit 0,
    nothing on stderr); the report of every fixture is far longer than a pipe's buffer, so the
    write after the reader has gone fails."""
    command = [sys.executable, "-m", "traceclf", "analyze", str(FIXTURES), "-q", "-f", fmt]
    done = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert done.stdout is not None and done.stderr is not None
    first = done.stdout.readline()
    done.stdout.close()
    err = done.stderr.read()
    assert (done.wait(timeout=300), err) == (0, "")
    assert first.strip()


@pytest.mark.parametrize(
    ("candidate", "code"),
    [("h100_host_launch_gpumetrics_trimmed", 1), ("h100_compute_low_occupancy", 3)],
)
def test_compare_keeps_its_exit_code_when_the_reader_stops_early(
    tmp_path: Path, candidate: str, code: int
) -> None:
    """`traceclf compare … | head -1` in CI: the verdict gates whatever the reader of stdout
    does (it had exited 0 on a regression). The reader is gone before anything is written. Real
    traces: the CUDA-graph run against the launch-bound one (a regression, 4.5 ms → ~200 ms
    steps) and against one without steps (inconclusive)."""
    command = [
        sys.executable,
        "-m",
        "traceclf",
        "compare",
        str(fixture_trace("h100_host_cudagraph")),
        str(fixture_trace(candidate)),
        "-q",
        "--cache-dir",
        str(tmp_path),
    ]
    done = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert done.stdout is not None and done.stderr is not None
    done.stdout.close()
    err = done.stderr.read()
    assert done.wait(timeout=300) == code, err
    assert "Error" not in err and "Exception" not in err


@pytest.mark.parametrize("order", [("--runs", "--job"), ("--job", "--runs")])
def test_job_and_runs_together_are_refused(cli, order: tuple[str, str]) -> None:
    code, out, err = cli("analyze", fixture_trace("h100_comm_ep2"), *order, "-q")
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert "--job" in line and "--runs" in line and "contradict" in line


@pytest.mark.parametrize(("given", "seen"), [(None, "1"), ("4", "4")])
def test_the_command_keeps_openblas_to_one_thread_unless_told(given: str | None, seen: str):
    """numpy's OpenBLAS starts a spinning thread per core, and traceclf calls no BLAS routine:
    the command asks for one before numpy is imported (a user's own setting stays)."""
    code = (
        "import os, sys\n"
        "from traceclf.cli import main\n"
        "assert 'numpy' not in sys.modules\n"
        "sys.argv = ['traceclf', '--version']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(os.environ.get('OPENBLAS_NUM_THREADS'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split()[-1] == seen
