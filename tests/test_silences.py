"""The newcomer's silences (issue 52): each bad input or slow start that said nothing, or said it late, now says
one line at once: --prompts given a directory, --watch on a directory that is not there, --help and argument errors
before torch is imported, tests/spec_engine.py runnable as docs/served.md shows it."""
import os
import subprocess
import sys

import eval_drafter as ed
from conftest import refused_in_one_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prompts_given_a_directory_says_so(tmp_path, capsys):
    refused_in_one_line(capsys, ["--demo", "--prompts", str(tmp_path)], "is a directory")


def test_watch_on_a_missing_directory_is_one_line_at_once(capsys):
    refused_in_one_line(capsys, ["--demo", "--watch", "r=/nonexistent/run", "--watch-idle", "600"],
                        "/nonexistent/run")


def test_help_and_argument_errors_come_before_torch():
    """Run as a script (__main__), --help and a bad flag answer without importing torch (it took 2-4 s)."""
    probe = ("import runpy, sys\nsys.argv = ['eval_drafter.py', sys.argv[1]]\ntry:\n"
             "    runpy.run_path('eval_drafter.py', run_name='__main__')\nexcept SystemExit as e:\n"
             "    print('exit', e.code, 'torch' in sys.modules, file=sys.stderr)\n")
    for flag, code in (("--help", 0), ("--no-such-flag", 2)):
        done = subprocess.run([sys.executable, "-c", probe, flag], cwd=REPO, capture_output=True, text=True)
        assert done.stderr.strip().splitlines()[-1] == f"exit {code} False", done.stderr
        assert ("usage:" in done.stdout) if code == 0 else ("unrecognized arguments: --no-such-flag" in done.stderr)


def test_the_spec_engine_stand_in_runs_as_a_script(tmp_path):
    for cwd in (REPO, str(tmp_path)):
        done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "spec_engine.py"), "--help"], cwd=cwd,
                              capture_output=True, text=True)
        assert done.returncode == 0 and "--port" in done.stdout, done.stderr
