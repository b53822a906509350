"""Every demo command the README and docs/ show runs, and prints the figures the page shows (issue 45).

A command is an indented line `python eval_drafter.py --demo ...` (or the tail of one after `&&`), its continuation
lines joined; the indented lines after it, up to the next paragraph, are its output as the page shows it. Each
shown line, cut at its elisions ("..." and "(...)"), must be in the run's printed output, fragment by fragment,
whitespace aside. Only timings may differ: under `--costs measure` a line with milliseconds, a speedup or the
ranking the timings make (best, leaders) is not compared. What the commands need is made here: `DIR` is a folder of the demo's benchmark copies
(tests/bench_data.py), the server at 127.0.0.1:8000 is tests/spec_engine.py's engine feeding the drafter the layers
one lower, as docs/served.md says.

Not run here: commands on models that are not in the repository (`/models/...`, `QWEN_DIR`, `...`). `--demo real`
(three minutes on 2 cores) runs with EVAL_DRAFTER_DOC_REAL=1, which .ci/run sets in its newest-transformers lane.
"""
import glob
import os
import re
import shlex

import pytest

import bench_data as bd
import eval_drafter as ed
from spec_engine import load_demo, start_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def shown_commands(name):
    """(command, the output lines shown under it) for each runnable demo command of a page."""
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        lines = f.read().split("\n")
    found, i = [], 0
    while i < len(lines):
        line = lines[i]
        at = line.find("python eval_drafter.py --demo")
        if not line.startswith("    ") or at < 0:
            i += 1
            continue
        cmd = line[at:].rstrip()
        while cmd.endswith("\\"):
            i += 1
            cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        while i < len(lines) and not lines[i].strip():
            i += 1
        shown = []
        while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
            if lines[i].strip().startswith("python "):
                break
            shown.append(lines[i].strip())
            i += 1
        if "..." not in cmd and (" real" not in cmd or os.environ.get("EVAL_DRAFTER_DOC_REAL")):
            found.append((cmd, [s for s in shown if s]))
    return found


CASES = [(name, cmd, shown) for name in PAGES for cmd, shown in shown_commands(name)]


def squeeze(text):
    return " ".join(text.split())


def test_the_pages_show_demo_commands():
    """The collection itself: the README's four demo commands, each with its output, and the manual's."""
    readme = [shown for name, _, shown in CASES if name == "README.md"]
    assert len(readme) == 4 and all(readme) and len(CASES) >= 10 + bool(os.environ.get("EVAL_DRAFTER_DOC_REAL"))


@pytest.mark.parametrize("name, cmd, shown", CASES, ids=[f"{n}:{c[30:70]}" for n, c, _ in CASES])
def test_a_shown_command_prints_what_the_page_shows(name, cmd, shown, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    engine = None
    if "DIR" in cmd:
        bench = tmp_path / "bench_data"
        bd.demo_copies(str(bench))
        cmd = cmd.replace("DIR", str(bench))
    if "http://127.0.0.1:8000" in cmd:
        engine = start_engine(*load_demo()[:2])
        engine.reset(layers=[0, 2, 3])
        cmd = cmd.replace("http://127.0.0.1:8000", engine.url)
    argv = [os.path.join(ROOT, a) if a.startswith("tests/") else a.replace("=tests/", f"={ROOT}/tests/")
            for a in shlex.split(cmd)[2:]]
    try:
        assert ed.main(argv) == 0, cmd
    finally:
        if engine:
            engine.shutdown()
    printed = squeeze(capsys.readouterr().out.replace(str(tmp_path) + os.sep, "").replace(ROOT + os.sep, ""))
    timed = "--costs measure" in cmd
    for line in shown:
        if timed and re.search(r"\d ms\b|speedup|best|leader|indistinguishable", line):   # the timed ranking
            continue
        for fragment in re.split(r"\(\.\.\.\)|\.\.\.", line):
            assert squeeze(fragment) in printed, (name, cmd, fragment)
