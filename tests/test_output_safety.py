"""The output is the user's: a rerun without --resume never wipes finished work, --output never replaces an input of
the run, a device, FIFO or /dev/stdout is written straight, one run at a time per output, and a path that cannot be
written is refused before any model loads."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

import eval_drafter as ed
from conftest import ROOT, interrupt_at, refused_in_one_line, write_jsonl

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
FAST = ["--demo", "--limit", "3", "--max-new-tokens", "24", "--ignore-eos", "--ddtree-budgets", "8", "--quiet"]


def no_model(monkeypatch):
    """Fail the test if the target or a drafter is loaded: the refusal must come before."""
    def loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")
    monkeypatch.setattr(ed, "load_target", loading)
    monkeypatch.setattr(ed, "load_drafter", loading)


def interrupted(tmp_path, monkeypatch, out):
    """A run on `out` cut by Ctrl-C as its 3rd reference is generated: its partial file's bytes (2 prompts done)."""
    real, _ = interrupt_at(monkeypatch, "generate_reference", 3)
    assert ed.main([*FAST, "--output", str(out)]) == 130
    monkeypatch.setattr(ed, "generate_reference", real)
    partial = tmp_path / f"{out.name}.partial.jsonl"
    assert sum('"item"' in line for line in partial.read_text().splitlines()) == 2
    return partial, partial.read_bytes()


def test_rerun_without_resume_is_refused_and_keeps_the_partial_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.json"
    partial, before = interrupted(tmp_path, monkeypatch, out)
    report = out.read_bytes()
    capsys.readouterr()
    no_model(monkeypatch)
    refused_in_one_line(capsys, [*FAST, "--output", str(out)], "holds 2 finished prompts")
    assert partial.read_bytes() == before and out.read_bytes() == report
    assert not os.path.exists(f"{out}.lock"), "the lock stays after a refusal"
    assert ed.main([*FAST, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "--overwrite" in err


def test_resume_after_the_refusal_finishes_the_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.json"
    partial, _ = interrupted(tmp_path, monkeypatch, out)
    capsys.readouterr()
    refused_in_one_line(capsys, [*FAST, "--output", str(out)], "--resume")
    real, calls = interrupt_at(monkeypatch, "generate_reference", 10 ** 9)
    assert ed.main([*FAST, "--output", str(out), "--resume"]) == 0
    assert len(calls) == 1   # only the 3rd prompt's reference is made
    assert "interrupted" not in json.loads(out.read_text()) and not partial.exists()


def test_overwrite_starts_over_and_keeps_every_backup(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.json"
    partial, before = interrupted(tmp_path, monkeypatch, out)
    capsys.readouterr()
    assert ed.main([*FAST, "--output", str(out), "--overwrite"]) == 0
    backup = tmp_path / "out.json.partial.jsonl.bak"
    assert backup.read_bytes() == before and not partial.exists()
    assert len(json.loads(out.read_text())["drafters"][0]["prompts"]) == 3
    # a second start-over: the first backup is never written over
    partial.write_bytes(before)
    argv = [a for a in FAST if a != "--quiet"]
    assert ed.main([*argv, "--output", str(out), "--overwrite"]) == 0
    assert backup.read_bytes() == before and (tmp_path / "out.json.partial.jsonl.bak2").read_bytes() == before
    assert "out.json.partial.jsonl.bak2" in capsys.readouterr().err   # the note names it


def test_a_partial_file_without_finished_work_is_simply_replaced(tmp_path):
    out = tmp_path / "out.json"
    (tmp_path / "out.json.partial.jsonl").write_text(json.dumps({"fingerprint": {}}) + "\n")
    assert ed.main([*FAST, "--output", str(out)]) == 0
    assert json.loads(out.read_text())["drafters"] and not (tmp_path / "out.json.partial.jsonl").exists()


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    refused_in_one_line(capsys, [*FAST, "--output", str(tmp_path / "o.json"), "--resume", "--overwrite"],
                        "give one of them")


# ----------------------------------------------------------------------------------------------------
# --output never replaces an input of the run


def test_output_onto_the_prompts_file_is_refused(tmp_path, monkeypatch, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "w1 w2 w3"}])
    before = open(prompts, "rb").read()
    os.symlink(prompts, tmp_path / "link.json")
    no_model(monkeypatch)
    for spelling in (prompts, str(tmp_path / "link.json"), os.path.relpath(prompts)):
        refused_in_one_line(capsys, [*FAST, "--prompts", prompts, "--output", spelling], "the prompts file")
        assert open(prompts, "rb").read() == before
        assert os.path.islink(tmp_path / "link.json")


def test_output_onto_a_drafters_config_is_refused(tmp_path, monkeypatch, capsys):
    drafter = tmp_path / "drafter"
    shutil.copytree(os.path.join(DEMO, "drafter"), drafter)
    before = (drafter / "config.json").read_bytes()
    no_model(monkeypatch)
    refused_in_one_line(capsys, [*FAST, "--ckpt", f"mine={drafter}", "--output", str(drafter / "config.json")],
                        "checkpoint --ckpt mine=")
    assert (drafter / "config.json").read_bytes() == before


def test_an_earlier_report_inside_the_checkpoint_directory_is_no_input(tmp_path):
    """A result kept beside its drafter is an output: the second run replaces it."""
    drafter = tmp_path / "drafter"
    shutil.copytree(os.path.join(DEMO, "drafter"), drafter)
    for _ in range(2):
        assert ed.main([*FAST, "--ckpt", f"mine={drafter}", "--output", str(drafter / "eval.json")]) == 0
    assert json.loads((drafter / "eval.json").read_text())["drafters"][0]["name"] == "mine"


def test_output_onto_another_output_or_a_merge_input_is_refused(tmp_path, monkeypatch, capsys):
    no_model(monkeypatch)
    both = str(tmp_path / "x.json")
    refused_in_one_line(capsys, [*FAST, "--output", both, "--save-references", both], "the --save-references file")
    shard = tmp_path / "s1.json"
    shard.write_text("{}")
    refused_in_one_line(capsys, ["--merge", str(shard), str(shard), "--output", str(shard)], "a --merge input")
    assert shard.read_text() == "{}"


# ----------------------------------------------------------------------------------------------------
# Paths that are not regular files: written straight


def test_a_fifo_is_written_straight(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, encoding="utf-8").read()), daemon=True)
    reader.start()
    assert ed.main([*FAST, "--output", str(fifo)]) == 0
    reader.join(timeout=60)
    assert json.loads(got[0])["drafters"][0]["prompts"]
    assert sorted(os.listdir(tmp_path)) == ["pipe"]   # no partial file, lock or temporary beside it
    assert not os.path.isfile(fifo)


def device_link(tmp_path, device):
    """A link in tmp_path to a device. The tests name devices through one: code that replaces its --output (as the
    original did) then replaces the link, never the shared /dev node (root may replace /dev/null itself)."""
    link = tmp_path / "dev" / os.path.basename(device)
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(device)
    return str(link)


def test_dev_stdout_streams_the_json(tmp_path):
    stdout = device_link(tmp_path, "/dev/stdout")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval_drafter.py"), *FAST[:-1], "--output", stdout],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)   # the printed report went to stderr
    assert report["drafters"][0]["tau"] > 1 and "tau" in proc.stderr
    assert "no partial file" in proc.stderr and os.listdir(tmp_path) == ["dev"]
    assert os.listdir(tmp_path / "dev") == ["stdout"] and os.path.islink(stdout)


def test_resume_onto_a_device_is_refused(tmp_path, capsys):
    refused_in_one_line(capsys, [*FAST, "--output", device_link(tmp_path, "/dev/null"), "--resume"],
                        "not a regular file")


def test_a_link_to_a_file_stays_a_link(tmp_path):
    real = tmp_path / "results" / "real.json"
    real.parent.mkdir()
    real.write_text('{\n "config": {"old": true}}')   # an earlier report behind the link
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert ed.main([*FAST, "--output", str(link)]) == 0
    assert os.path.islink(link) and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["drafters"]
    assert sorted(os.listdir(real.parent)) == ["real.json"]


def test_a_full_device_is_one_line_and_no_wrote(tmp_path, capsys):
    """Never "wrote": the failed write is the one line, exit 2."""
    full = device_link(tmp_path, "/dev/full")
    assert ed.main([*FAST, "--output", full]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot write {full}") and "space" in err[0], err
    assert os.path.islink(full) and os.listdir(tmp_path / "dev") == ["full"]
    assert "tau" in captured.out   # the report is still shown


# ----------------------------------------------------------------------------------------------------
# One run at a time per output


def lock_of(out, pid, host=None):
    with open(os.path.realpath(out) + ".lock", "w") as f:
        json.dump({"pid": pid, "host": host or socket.gethostname()}, f)
    return os.path.realpath(out) + ".lock"


def test_a_second_run_on_the_same_output_is_refused_at_once(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.json"
    out.write_text("the first run's result")
    first = subprocess.Popen(["sleep", "60"])
    try:
        lock = lock_of(out, first.pid)
        held = open(lock).read()
        no_model(monkeypatch)
        refused_in_one_line(capsys, [*FAST, "--output", str(out)], f"process {first.pid}")
        assert out.read_text() == "the first run's result" and open(lock).read() == held
    finally:
        first.kill()
        first.wait()


def test_a_stale_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "out.json"
    ended = subprocess.Popen(["true"])
    ended.wait()
    lock = lock_of(out, ended.pid)
    assert ed.main([*FAST[:-1], "--output", str(out)]) == 0
    assert f"process {ended.pid}, which has ended" in capsys.readouterr().err
    assert json.loads(out.read_text())["drafters"] and not os.path.exists(lock)


def test_the_lock_is_gone_after_ctrl_c_and_held_during_the_run(tmp_path, monkeypatch):
    out = tmp_path / "out.json"
    seen = []
    real = ed.load_target

    def loading(settings):
        seen.append(json.load(open(f"{out}.lock")))
        return real(settings)

    monkeypatch.setattr(ed, "load_target", loading)
    interrupted(tmp_path, monkeypatch, out)
    assert seen == [{"pid": os.getpid(), "host": socket.gethostname()}]
    assert not os.path.exists(f"{out}.lock")


# ----------------------------------------------------------------------------------------------------
# Unwritable places, before any model loads


@pytest.mark.parametrize("flag", ["--output", "--save-hidden", "--save-references", "--export-vllm-synthetic"])
def test_a_read_only_directory_is_refused_before_the_target_loads(tmp_path, monkeypatch, capsys, flag):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:   # root writes anywhere chmod forbids: stand in for the kernel's answer on this directory
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(ro) else access(p, mode))
    no_model(monkeypatch)
    try:
        refused_in_one_line(capsys, [*FAST, flag, str(ro / "x.out")], "is not writable")
    finally:
        ro.chmod(0o755)
    assert not os.listdir(ro)


def test_torchrun_ranks_refuse_together(tmp_path):
    """Under torchrun each rank checks its own partial file: rank 1's kept reference alone stops every rank, said
    once, and rank 0 leaves no lock behind."""
    def torchrun():
        port = socket.socket()
        port.bind(("127.0.0.1", 0))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
               "--master_addr=127.0.0.1", f"--master_port={port.getsockname()[1]}",
               os.path.join(ROOT, "eval_drafter.py"), *FAST, "--output", str(out)]
        port.close()
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    out = tmp_path / "out.json"
    rank1 = tmp_path / "out.json.partial.rank1.jsonl"
    rank1.write_text(json.dumps({"fingerprint": {}}) + "\n" + json.dumps({"reference": {"index": 1}}) + "\n")
    before = rank1.read_bytes()
    proc = torchrun()
    assert proc.returncode != 0 and proc.stderr.count("holds 0 finished prompts and 1 references") == 1, proc.stderr
    assert rank1.read_bytes() == before and not os.path.exists(f"{out}.lock") and not out.exists()
