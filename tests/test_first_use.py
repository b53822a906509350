"""What a new user trips on (issue 59's list): each refusal one line, exit 2, naming the real cause; each warning says
what to do; nothing already there is overwritten. Files here are made in the test (random bytes, a GGUF cut short from
the SmolLM2 fixture where it is present)."""
import json
import os
import shutil

import pytest
import torch

import eval_drafter as ed
from conftest import refused_in_one_line

DEMO = os.path.join(os.path.dirname(__file__), "fixtures", "demo")
TARGET, DRAFTER, PROMPTS = (os.path.join(DEMO, name) for name in ("target", "drafter", "prompts.jsonl"))
GGUF = os.path.join(os.path.dirname(__file__), "fixtures", "real", "SmolLM2-135M-Instruct.Q4_1.gguf")
HAVE_GGUF = all(__import__("importlib").util.find_spec(p) for p in ("gguf", "accelerate"))


def argv(target=TARGET, ckpt=DRAFTER, *extra):
    return ["--target", target, "--ckpt", ckpt, "--prompts", PROMPTS, "--limit", "1", "--max-new-tokens", "16",
            "--ddtree-budgets", "none", "--quiet", *extra]


@pytest.mark.skipif(not HAVE_GGUF, reason="the gguf and accelerate packages")
def test_a_gguf_of_random_bytes_is_refused_in_one_line(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(os.urandom(4096))
    refused_in_one_line(capsys, argv(str(bad)), "is not a readable GGUF file")


@pytest.mark.skipif(not HAVE_GGUF or not os.path.isfile(GGUF), reason="the SmolLM2 GGUF and the gguf package")
def test_a_gguf_cut_short_is_refused_in_one_line(tmp_path, capsys):
    cut = tmp_path / "cut.gguf"
    with open(GGUF, "rb") as f:
        cut.write_bytes(f.read(2_000_000))
    refused_in_one_line(capsys, argv(str(cut)), "damaged or cut short")


def test_a_target_that_is_a_file_is_named_as_one(capsys):
    refused_in_one_line(capsys, argv(os.path.join(TARGET, "config.json")), "is a file: pass the model's directory")


def test_target_and_drafter_swapped_are_named_swapped(capsys):
    refused_in_one_line(capsys, argv(DRAFTER, TARGET), "--target and --ckpt look swapped")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="a Linux /proc")
def test_an_output_directory_that_takes_no_files_is_named(capsys):
    refused_in_one_line(capsys, argv(TARGET, DRAFTER, "--output", "/proc/out.json"),
                        "its directory /proc takes no new files")


def test_output_over_a_file_that_is_not_a_report_is_refused_and_kept(tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text('{"my": "notes"}\n')
    refused_in_one_line(capsys, argv(TARGET, DRAFTER, "--output", str(notes)), "is not one of this tool's reports")
    assert notes.read_text() == '{"my": "notes"}\n'
    report = tmp_path / "report.json"
    assert ed.main(argv(TARGET, DRAFTER, "--output", str(report))) == 0
    assert ed.main(argv(TARGET, DRAFTER, "--output", str(report))) == 0   # its own earlier report: replaced, as ever
    assert json.loads(report.read_text())["drafters"][0]["tau"] is not None


def test_threads_past_the_cores_and_float16_on_a_cpu_are_warned(capsys, monkeypatch):
    monkeypatch.setattr(ed, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    assert ed.main(argv(TARGET, DRAFTER, "--threads", "64", "--dtype", "float16", "--limit", "1")) == 0
    assert torch.get_num_threads() == before   # main() from Python gives its caller's threads back
    err = capsys.readouterr().err
    assert "warning: --threads 64 is more than the 2 cores" in err and "give --threads 2 or fewer" in err
    assert "warning: --dtype float16 on a CPU" in err and "use float32" in err


def test_a_target_dir_with_a_drafter_config_and_a_tokenizer_is_not_called_swapped(tmp_path, capsys):
    """Swapped only where the drafter has the tokenizer the target lacks: a target without one keeps its own line."""
    bare = tmp_path / "bare"
    shutil.copytree(TARGET, bare)
    for name in os.listdir(bare):
        if name.startswith(("tokenizer", "vocab", "merges", "special")):
            os.remove(bare / name)
    refused_in_one_line(capsys, argv(str(bare)), "has no tokenizer")


def test_a_config_edited_to_another_width_names_the_config_not_the_target(tmp_path, capsys):
    drafter = tmp_path / "drafter"
    shutil.copytree(DRAFTER, drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    refused_in_one_line(capsys, argv(TARGET, str(drafter)),
                        f"its config says hidden_size {2 * cfg['hidden_size']} but its weights are "
                        f"{cfg['hidden_size']} wide (fc.weight)")


def test_demo_on_a_box_with_only_the_script_says_what_it_needs(tmp_path):
    import subprocess
    import sys
    shutil.copy(ed.__file__, tmp_path / "eval_drafter.py")
    run = subprocess.run([sys.executable, str(tmp_path / "eval_drafter.py"), "--demo"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=300)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "copy the repository's tests/fixtures/demo folder" in lines[0] and "Traceback" not in run.stderr


def on_one_screen(command, cwd):
    """Run `command` with stdout and stderr on one pseudo-terminal, as a person at a shell sees it; its text."""
    import pty
    import subprocess
    main, side = pty.openpty()
    proc = subprocess.Popen(command, stdout=side, stderr=side, stdin=subprocess.DEVNULL, cwd=cwd)
    os.close(side)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:   # the other end closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=300)
    os.close(main)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(not os.path.isdir("/dev/pts"), reason="pseudo-terminals")
def test_a_drafters_warning_shows_once_on_one_screen(tmp_path):
    import sys
    other = tmp_path / "other"
    shutil.copytree(DRAFTER, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "target_model_path": "/models/Qwen3-8B"}))
    base = [sys.executable, ed.__file__, *argv(TARGET, f"o={other}")]
    rc, screen = on_one_screen(base, tmp_path)
    assert rc == 0 and screen.count("names its target /models/Qwen3-8B") == 1, screen
    rc, screen = on_one_screen([*base, "--output", "/dev/stdout"], tmp_path)   # the JSON on stdout, the report on stderr
    assert rc == 0 and screen.count("names its target /models/Qwen3-8B") == 2   # the report's line, and the JSON's


def test_a_log_holds_lines_not_carriage_returns(tmp_path):
    """stderr a file (nohup, a job scheduler): every long step's progress comes as lines, transformers' loading bars
    included."""
    import subprocess
    import sys
    with open(tmp_path / "log.txt", "w") as log:
        run = subprocess.run([sys.executable, ed.__file__, *argv()[:-1]], stdout=subprocess.DEVNULL, stderr=log,
                             stdin=subprocess.DEVNULL, cwd=tmp_path, timeout=300)
    text = (tmp_path / "log.txt").read_text()
    assert run.returncode == 0 and "\r" not in text and "progress: target" in text
