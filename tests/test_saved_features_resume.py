"""Saved features are results too (--save-hidden with Ctrl-C, SIGTERM, a kill, and --resume).

Every finished prompt's features go to disk at once (<file>.partial.<position>.safetensors beside the cache), so an
interrupted --save-hidden run keeps them next to <output>.partial.jsonl, and --resume ends with the cache an
uninterrupted run writes: the same tensors (names, dtypes, values), the same metadata (shard names aside), the
same JSON report, and the same tau when the cache is read back with --load-hidden.
"""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import eval_drafter as ed
from conftest import ROOT, interrupt_at, interrupted_then_resumed, paused_at, pausing_program

ARGV = ["--demo", "--limit", "5", "--max-new-tokens", "24", "--ignore-eos", "--quiet"]
PROCESS = {"resume", "output", "save_hidden", "load_hidden", "hidden_cache", "quiet",   # where, not what
           "reference_generation_choice", "reference_generation_used"}   # said with the times auto measured


def argv_in(folder):
    return [*ARGV, "--save-hidden", str(folder / "h.safetensors"), "--output", str(folder / "out.json")]


def cache(path):
    """(every tensor of a --save-hidden file and its shards, its metadata without the shard names)."""
    meta = ed.read_hidden_meta(str(path))
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())
    folder = os.path.dirname(str(path))
    for shard in meta["shards"]:
        with safe_open(os.path.join(folder, shard), "pt") as f:
            names += list(f.keys())
    with ed.hidden_tensors(str(path), meta) as get:
        tensors = {name: get(name) for name in names}
    return tensors, {k: v for k, v in meta.items() if k != "shards"}


def assert_same_cache(got, want):
    (a, meta_a), (b, meta_b) = cache(got), cache(want)
    assert meta_a == meta_b
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def results(report):
    """The JSON apart from timing and the process's own facts (paths, --resume)."""
    return {**{k: v for k, v in report.items() if k not in ("timing", "elapsed_s")},
            "config": {k: v for k, v in report["config"].items() if k not in PROCESS}}


def tau_from(path, tmp_path):
    out = tmp_path / f"load_{os.path.basename(os.path.dirname(str(path)))}.json"
    assert ed.main(["--target", os.path.join(ed.DEMO_DIR, "target"), "--ckpt",
                    f"demo={os.path.join(ed.DEMO_DIR, 'drafter')}", "--load-hidden", str(path), "--quiet",
                    "--output", str(out)]) == 0
    return [d["tau"] for d in json.loads(out.read_text())["drafters"]]


def left_behind(folder):
    """Files of the run still in its folder besides the cache, its shards and the JSON."""
    meta = ed.read_hidden_meta(str(folder / "h.safetensors"))
    return sorted(set(os.listdir(folder)) - {"h.safetensors", "out.json", *meta["shards"]})


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run's folder (cache and JSON)."""
    folder = tmp_path_factory.mktemp("whole")
    assert ed.main(argv_in(folder)) == 0
    return folder


@pytest.mark.parametrize("name, n, kept", [("extract_hidden", 3, 2), ("evaluate_prompts", 4, 3)],
                         ids=["during_extraction", "during_drafting"])
def test_ctrl_c_then_resume_gives_the_uninterrupted_cache(whole, tmp_path, monkeypatch, capsys, name, n, kept):
    """Regression test; the bug was: --resume was refused with --save-hidden ("cannot add to a --save-hidden file"),
    although the interrupt message told to run it, and the finished prompts' features were thrown away."""
    argv = argv_in(tmp_path)
    report = interrupted_then_resumed(monkeypatch, argv, tmp_path / "out.json", name, n, kept)
    err = capsys.readouterr().err
    assert f"their features kept in {tmp_path / 'h.safetensors'}.partial." in err, err
    assert results(report) == results(json.loads((whole / "out.json").read_text()))
    assert_same_cache(tmp_path / "h.safetensors", whole / "h.safetensors")
    assert left_behind(tmp_path) == []   # the parts folded into the cache, the partial JSON removed
    assert tau_from(tmp_path / "h.safetensors", tmp_path) == tau_from(whole / "h.safetensors", tmp_path)


def test_extraction_resumes_from_the_saved_features(whole, tmp_path, monkeypatch):
    """The resumed run passes only the unfinished prompts through the target: the finished ones' features are read
    from their parts, not extracted again."""
    argv = argv_in(tmp_path)
    real, calls = interrupt_at(monkeypatch, "extract_hidden", 4)
    assert ed.main(argv) == 130
    monkeypatch.setattr(ed, "extract_hidden", real)
    _, again = interrupt_at(monkeypatch, "extract_hidden", 10 ** 9)   # counting only
    assert ed.main([*argv, "--resume"]) == 0
    assert len(again) == 5 - 3
    assert_same_cache(tmp_path / "h.safetensors", whole / "h.safetensors")


def test_sigterm_keeps_the_features(whole, tmp_path, monkeypatch):
    """A real SIGTERM as the 3rd prompt is extracted: the two finished prompts' features are on disk, and --resume
    completes the cache."""
    argv, real = argv_in(tmp_path), ed.extract_hidden
    calls = []

    def terminated(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(ed, "extract_hidden", terminated)
    assert ed.main(argv) == 130
    parts = [n for n in os.listdir(tmp_path) if n.startswith("h.safetensors.partial.")]
    assert sorted(parts) == ["h.safetensors.partial.0.safetensors", "h.safetensors.partial.1.safetensors"]
    monkeypatch.setattr(ed, "extract_hidden", real)
    assert ed.main([*argv, "--resume"]) == 0
    assert_same_cache(tmp_path / "h.safetensors", whole / "h.safetensors")


def test_a_kill_that_cut_the_files_resumes_equal(whole, tmp_path, monkeypatch):
    """What a hard kill can leave: the partial JSON's last line cut short, a part cut short, a temporary of a part
    being written. The cut part's prompt and every one after it are done again; the result is the same."""
    argv = argv_in(tmp_path)
    real, _ = interrupt_at(monkeypatch, "extract_hidden", 5)
    assert ed.main(argv) == 130
    monkeypatch.setattr(ed, "extract_hidden", real)
    partial = tmp_path / "out.json.partial.jsonl"
    text = partial.read_text()
    partial.write_text(text[:len(text) - 40])   # the 4th record cut mid-line
    part = tmp_path / "h.safetensors.partial.1.safetensors"
    part.write_bytes(part.read_bytes()[:100])   # the 2nd prompt's features cut short
    (tmp_path / "h.safetensors.partial.3.safetensors.tmp99999").write_bytes(b"half a part")
    assert ed.main([*argv, "--resume"]) == 0
    assert results(json.loads((tmp_path / "out.json").read_text())) == \
        results(json.loads((whole / "out.json").read_text()))
    assert_same_cache(tmp_path / "h.safetensors", whole / "h.safetensors")
    assert left_behind(tmp_path) == []


KILLED_MID_WRITE = """import os, signal, sys
sys.path.insert(0, {root!r})
import safetensors.torch
import eval_drafter
real, calls = safetensors.torch.save_file, []

def killed(tensors, filename, metadata=None):   # the 4th prompt's part: half of it on disk, then SIGKILL
    calls.append(filename)
    if len(calls) == 4:
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    real(tensors, filename, metadata=metadata)

safetensors.torch.save_file = killed
sys.exit(eval_drafter.main(sys.argv[1:]))
"""


def test_a_real_kill_mid_write_resumes_equal(whole, tmp_path):
    """SIGKILL while the 4th prompt's part is half written (no handler runs): the three finished prompts' records
    and features are on disk, and --resume completes the uninterrupted run's cache and JSON."""
    argv = argv_in(tmp_path)
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE.format(root=ROOT), *argv], cwd=str(tmp_path),
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [n for n in os.listdir(tmp_path) if ".tmp" in n], "the kill left no cut temporary"
    assert ed.main([*argv, "--resume"]) == 0
    assert results(json.loads((tmp_path / "out.json").read_text())) == \
        results(json.loads((whole / "out.json").read_text()))
    assert_same_cache(tmp_path / "h.safetensors", whole / "h.safetensors")
    assert left_behind(tmp_path) == []


def test_interrupted_after_shards_resumes_equal(tmp_path, monkeypatch):
    """Past SAVE_SHARD_BYTES every prompt's part becomes a shard of the cache (renamed, not written again): an
    interruption after some were written resumes to a cache equal to an uninterrupted sharded one."""
    monkeypatch.setattr(ed, "SAVE_SHARD_BYTES", 1)
    (tmp_path / "whole").mkdir()
    (tmp_path / "cut").mkdir()
    assert ed.main(argv_in(tmp_path / "whole")) == 0
    report = interrupted_then_resumed(monkeypatch, argv_in(tmp_path / "cut"), tmp_path / "cut" / "out.json",
                                      "extract_hidden", 4, 3)
    assert results(report) == results(json.loads((tmp_path / "whole" / "out.json").read_text()))
    meta = ed.read_hidden_meta(str(tmp_path / "cut" / "h.safetensors"))
    assert len(meta["shards"]) == 5
    assert_same_cache(tmp_path / "cut" / "h.safetensors", tmp_path / "whole" / "h.safetensors")
    assert left_behind(tmp_path / "cut") == []
    assert tau_from(tmp_path / "cut" / "h.safetensors", tmp_path) == \
        tau_from(tmp_path / "whole" / "h.safetensors", tmp_path)


def test_without_output_the_interrupt_says_nothing_is_kept(tmp_path, monkeypatch, capsys):
    """--resume needs --output (the partial JSON says which run the features belong to): without it an interrupted
    --save-hidden run says that nothing, features included, is kept, and leaves no parts behind."""
    interrupt_at(monkeypatch, "extract_hidden", 3)
    assert ed.main([*ARGV, "--save-hidden", str(tmp_path / "h.safetensors")]) == 130
    err = capsys.readouterr().err
    assert "without --output nothing is kept for later (nor the features)" in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("at", ["part", "cache"])
def test_a_failed_write_of_features_is_one_line(whole, tmp_path, monkeypatch, capsys, at):
    """Regression test; the bug was: an OSError writing the features (disk full) came out as a traceback at the very
    end of the run. Now: one error line naming the file, exit 2, no temporary left, the finished prompts kept (their
    records and features): a prompt's part (the 3rd) or the cache at the end fails, and --resume then completes."""
    import safetensors.torch
    real, calls = safetensors.torch.save_file, []

    def full(tensors, filename, metadata=None):
        calls.append(filename)
        if (len(calls) == 3) if at == "part" else os.path.basename(filename).startswith("h.safetensors.tmp"):
            with open(filename, "wb") as f:
                f.write(b"half")
            raise OSError(28, "No space left on device")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert ed.main(argv_in(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot write ") and "No space left on device" in err[0], err
    assert str(tmp_path / "h.safetensors") in err[0]
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n]
    with open(tmp_path / "out.json.partial.jsonl") as f:
        assert sum("results" in json.loads(line) for line in f) == (2 if at == "part" else 5)
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert ed.main([*argv_in(tmp_path), "--resume"]) == 0
    assert_same_cache(tmp_path / "h.safetensors", whole / "h.safetensors")


def torchrun(folder, *argv, script=os.path.join(ROOT, "eval_drafter.py")):
    """`torchrun --nproc_per_node=2 eval_drafter.py argv` in folder (gloo on CPU), started: its process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={port}", script, *argv]
    return subprocess.Popen(cmd, cwd=str(folder), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_torchrun_ranks_keep_their_features_and_resume(tmp_path):
    """Under torchrun every rank writes its own parts beside its own cache (<file>.rank<R>-of-2.safetensors): Ctrl-C
    once each rank has a finished prompt's features, then the same torchrun command with --resume: both caches,
    read together, give the uninterrupted run's numbers."""
    long = [*ARGV[:1], "--limit", "10", "--max-new-tokens", "128", "--quiet"]   # long enough to stop in the middle
    assert ed.main([*long, "--output", str(tmp_path / "want.json")]) == 0
    argv = [*long, "--save-hidden", str(tmp_path / "h.safetensors"), "--output", str(tmp_path / "out.json")]
    # each rank pauses once its second prompt's features are written (its first prompt is finished by then)
    proc = torchrun(tmp_path, *argv, script=pausing_program(tmp_path, "keep_hidden", "len(calls) == 2"))
    paused_at(tmp_path, proc, 2)
    assert all((tmp_path / f"h.rank{r}-of-2.safetensors.partial.{i}.safetensors").exists() for r in (0, 1) for i in (0, 1))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and json.loads((tmp_path / "out.json").read_text()).get("interrupted"), err
    proc = torchrun(tmp_path, *argv, "--resume")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    caches = [str(tmp_path / f"h.rank{r}-of-2.safetensors") for r in (0, 1)]
    assert not [n for n in os.listdir(tmp_path) if ".partial." in n or ".tmp" in n]
    out = tmp_path / "loaded.json"
    assert ed.main(["--target", os.path.join(ed.DEMO_DIR, "target"), "--ckpt",
                    f"demo={os.path.join(ed.DEMO_DIR, 'drafter')}", "--load-hidden", *caches, "--quiet",
                    "--output", str(out)]) == 0
    assert json.loads(out.read_text())["drafters"] == json.loads((tmp_path / "want.json").read_text())["drafters"]
