"""Ctrl-C at every stage gives one line and exit 130; the default CPU threads do not thrash and change no number."""
import json
import os
import subprocess
import sys

import pytest
import torch

import eval_drafter as ed
from conftest import ROOT, interrupt_at, refused_in_one_line

DEMO = ["--demo", "--limit", "3", "--max-new-tokens", "48"]


def stderr_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


def test_ctrl_c_while_torch_imports_is_one_line(tmp_path):
    """A Ctrl-C in the first seconds, while torch imports: one line and exit 130, not a traceback from torch's
    internals. A stand-in torch package sends the SIGINT from inside its own import, so the moment is certain."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)\n")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "eval_drafter.py"), "--demo"], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=60)
    assert run.returncode == 130, run.stderr
    assert run.stderr.strip().splitlines() == ["interrupted while starting: nothing was computed yet"]


def test_ctrl_c_while_a_drafter_loads(tmp_path, monkeypatch, capsys):
    interrupt_at(monkeypatch, "load_drafter", 1)
    assert ed.main([*DEMO, "--output", str(tmp_path / "out.json")]) == 130
    err = stderr_lines(capsys)
    assert err[-1] == "interrupted: nothing was finished yet, nothing to keep"
    assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "out.json").exists()


def test_ctrl_c_while_the_target_loads(tmp_path, monkeypatch, capsys):
    """No empty report of nothing: one line, exit 130, no JSON written over --output."""
    interrupt_at(monkeypatch, "load_target", 1)
    assert ed.main([*DEMO, "--output", str(tmp_path / "out.json")]) == 130
    captured = capsys.readouterr()
    assert captured.out == ""
    assert [line for line in captured.err.splitlines() if "interrupt" in line] == \
        ["interrupted: nothing was finished yet, nothing to keep"]
    assert not (tmp_path / "out.json").exists()


def test_ctrl_c_during_costs_measure_keeps_every_prompt(tmp_path, monkeypatch, capsys):
    """Ctrl-C while --costs measure times the forwards: the finished prompts are reported and kept (exit 130),
    and --resume measures the costs and reports what an uninterrupted run does."""
    out = tmp_path / "out.json"
    argv = [*DEMO, "--depths", "3", "--costs", "measure", "--output", str(out)]
    real, _ = interrupt_at(monkeypatch, "measure_costs", 1)
    assert ed.main(argv) == 130
    err = [line for line in stderr_lines(capsys) if "interrupted" in line]
    assert err == ["interrupted while measuring costs (none are reported): reporting the 3 prompts finished so far; "
                   "to finish, run the same command with --resume"]
    cut = json.loads(out.read_text())
    assert cut["interrupted"] and len(cut["drafters"][0]["prompts"]) == 3 and not cut["config"]["costs_used"]
    assert os.path.isfile(str(out) + ".partial.jsonl")
    monkeypatch.setattr(ed, "measure_costs", real)
    assert ed.main([*argv, "--resume"]) == 0
    resumed = json.loads(out.read_text())
    assert not resumed.get("interrupted") and resumed["config"]["costs_used"]
    assert resumed["drafters"][0]["tau"] == cut["drafters"][0]["tau"]
    assert not os.path.exists(str(out) + ".partial.jsonl")


def test_numbers_do_not_depend_on_threads(tmp_path, capsys):
    reports = []
    try:
        for threads in (1, 2):
            out = tmp_path / f"t{threads}.json"
            assert ed.main([*DEMO, "--threads", str(threads), "--output", str(out)]) == 0
            assert f"{threads} CPU thread{'s' * (threads > 1)}\n" in capsys.readouterr().err
            reports.append(json.loads(out.read_text()))
    finally:
        torch.set_num_threads(1)   # as conftest set it
    one, two = reports
    assert one["drafters"] == two["drafters"] and one["target"] == two["target"]
    assert (one["config"]["threads"], two["config"]["threads"]) == (1, 2)


def test_default_threads_are_the_cores_this_process_may_use(monkeypatch):
    """Not the machine's cores: those the process may run on (taskset, a container's cpuset), at most torch's pick,
    shared by the torchrun ranks on the machine."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(8)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        assert ed.default_threads() == 3
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert ed.default_threads() == 1
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
        assert ed.default_threads() == 4   # torch's own 8, shared by 2 ranks
    finally:
        torch.set_num_threads(before)


SPIN = """
import os, runpy, sys
sys.argv = ["eval_drafter.py", "--target", "/nonexistent"]
try:
    runpy.run_path({path!r}, run_name="__main__")
except SystemExit:
    pass
print(os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
"""


def spin_settings(env):
    code = SPIN.format(path=os.path.join(ROOT, "eval_drafter.py"))
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120).stdout.split()


def test_openmp_spins_briefly_unless_the_user_says(monkeypatch):
    """Run as a script, the tool makes torch's OpenMP threads sleep soon instead of spinning (the cause of the
    slow default on a busy box); a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is left as it is."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert spin_settings({}) == ["1000", "None"]
    assert spin_settings({"GOMP_SPINCOUNT": "50"}) == ["50", "None"]
    assert spin_settings({"OMP_WAIT_POLICY": "active"}) == ["None", "active"]


# Bad input found on the way: one line each, exit 2, where a traceback came before.

@pytest.mark.parametrize("costs", [{"target": 5}, {"target": {"1": 0.1}, "draft": [1]},
                                   {"target": {"1": 0.1}, "draft": {"3": True}}])
def test_malformed_costs_file_is_one_line(tmp_path, capsys, costs):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    refused_in_one_line(capsys, [*DEMO, "--costs", str(path)], f"--costs {path}: batch size 1 needs")


def test_compare_hidden_with_mtp_needs_the_target(tmp_path, capsys):
    refused_in_one_line(capsys, ["--compare-hidden", str(tmp_path / "a"), str(tmp_path / "b"), "--mtp"],
                        "--target is required")


def test_ctrl_c_turned_into_a_torch_runtime_error_is_an_interruption(tmp_path, monkeypatch, capsys):
    """A Ctrl-C inside torch's vmap (transformers 4.x's mask building) surfaces as an internal-assert RuntimeError
    with the KeyboardInterrupt as its context: it is an interruption like any other (exit 130, the finished
    prompts kept), not a traceback with exit 1."""
    real, calls = ed.extract_hidden, []

    def cut(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("layerId == dynamic_layer.layerId() INTERNAL ASSERT FAILED")
        return real(*args, **kwargs)

    monkeypatch.setattr(ed, "extract_hidden", cut)
    out = tmp_path / "out.json"
    assert ed.main([*DEMO, "--output", str(out)]) == 130
    assert "interrupted: reporting the 2 prompts finished so far" in capsys.readouterr().err
    assert json.loads(out.read_text())["interrupted"]
    monkeypatch.setattr(ed, "extract_hidden", real)
    assert ed.main([*DEMO, "--output", str(out), "--resume"]) == 0


def test_other_runtime_errors_are_not_taken_for_ctrl_c():
    assert not ed.ctrl_c(RuntimeError("a real bug")) and ed.ctrl_c(KeyboardInterrupt())
