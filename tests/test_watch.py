"""--watch RUN_DIR: a training run followed step by step into a JSONL series (issue 30, item 1).

A live watch (a subprocess) sees step checkpoints appear in its run directory: an HF checkpoint-N/ directory, a
SpecForge <run>-stepN/training_state.pt, a step_N.pt written in two halves, and one that stays corrupt. Every
complete step is evaluated exactly once, with the numbers a single-checkpoint --ckpt run of the same file gives;
the half-written file is retried and then evaluated, the corrupt one is named once and the watch goes on. Ctrl-C
keeps the finished steps and the same command evaluates only the missing ones. The target-pass form (--prompts)
gives the --load-hidden form's numbers; refusals are one line; --tensorboard holds each step's tau at its step.

The steps are the demo drafter with noise on its matrices, less at later steps (a training run's shape), so the
steps' numbers differ and equality with the single-checkpoint runs means something.
"""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import eval_drafter as ed
from conftest import ROOT, interrupt_at, refused_in_one_line

SCRIPT = os.path.join(ROOT, "eval_drafter.py")
TARGET = os.path.join(ed.DEMO_DIR, "target")
DRAFTER = os.path.join(ed.DEMO_DIR, "drafter")
PROMPTS = os.path.join(ed.DEMO_DIR, "prompts.jsonl")
SLICE = ["--limit", "4", "--max-new-tokens", "32"]            # the saved features' prompts and references
NOISE = {100: 0.9, 200: 0.7, 300: 0.6, 400: 0.5, 500: 0.4}    # x each matrix's std, added at that step
# a step's line holds these as the single-checkpoint JSON's drafters[0] does (the list)
SAME_AS_REPORT = ("tau", "tau_ci95", "per_position", "ddtree", "depths", "engine_metrics", "by_context",
                  "feature_check", "warnings", "histogram", "rounds", "anchors", "tau_prompt_mean", "checkpoint",
                  "hash")
LINE_KEYS = {"series", "step", "checkpoint", "tau", "tau_ci95", "first_position_acceptance", "per_position", "ddtree",
             "engine_metrics", "by_context", "feature_check", "warnings", "histogram", "rounds", "anchors",
             "tau_prompt_mean", "prompts", "seconds"}   # and "depths" with --depths
DEPTHS = ("--depths", "3")   # the live watch's lines hold depths too
STEP_LINE = re.compile(r"^step\s+(\d+)\s+tau ")


# ---------------------------------------------------------------------------------------------------- checkpoints

def step_weights(step):
    """The demo drafter's tensors with step-dependent noise on every matrix (norms kept)."""
    g = torch.Generator().manual_seed(step)
    return {k: v + NOISE[step] * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v
            for k, v in load_file(os.path.join(DRAFTER, "model.safetensors")).items()}


def new_run(folder):
    """An empty run directory with the drafter's config.json at its top (where SpecForge keeps it)."""
    os.makedirs(folder)
    shutil.copy(os.path.join(DRAFTER, "config.json"), folder)
    return str(folder)


def write_hf(run, step):
    """HF Trainer's checkpoint-N/: config.json + model.safetensors."""
    path = os.path.join(run, f"checkpoint-{step}")
    os.makedirs(path)
    shutil.copy(os.path.join(DRAFTER, "config.json"), path)
    save_file({k: v.contiguous() for k, v in step_weights(step).items()}, os.path.join(path, "model.safetensors"))
    return path


def write_specforge(run, step):
    """SpecForge's <run>-stepN/training_state.pt: the weights under draft_state_dict beside training counters."""
    path = os.path.join(run, f"run-step{step}")
    os.makedirs(path)
    torch.save({"draft_state_dict": step_weights(step), "epoch": 0, "global_step": step},
               os.path.join(path, ed.TRAINING_STATE))
    return path


def pt_bytes(step):
    """A step_N.pt's bytes (a plain state dict, torch.save's zip form)."""
    buffer = io.BytesIO()
    torch.save(step_weights(step), buffer)
    return buffer.getvalue()


def write_pt(run, step, data=None):
    path = os.path.join(run, f"step_{step}.pt")
    with open(path, "wb") as f:
        f.write(pt_bytes(step) if data is None else data)
    return path


def read_series(path):
    """(header, [step lines]) of a --watch --output; every line must be whole JSON."""
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    assert "watch" in lines[0] and all("step" in line for line in lines[1:]), lines[0]
    return lines[0]["watch"], lines[1:]


def same(a, b):
    """Equal as JSON (NaN included)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


# ---------------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The demo's features saved once (H) and that run's ordinary JSON report (X)."""
    folder = tmp_path_factory.mktemp("saved")
    hidden, report = str(folder / "H.safetensors"), str(folder / "X.json")
    assert ed.main(["--demo", *SLICE, "--save-hidden", hidden, "--output", report, "--quiet"]) == 0
    return {"hidden": hidden, "report": report}


@pytest.fixture(scope="module")
def single(saved, tmp_path_factory):
    """single(name, checkpoint, *flags): drafters[0] of the ordinary --ckpt NAME=PATH --load-hidden run's JSON."""
    folder, done = tmp_path_factory.mktemp("single"), {}

    def run(name, path, *flags):
        if (name, path, flags) not in done:
            out = str(folder / f"{len(done)}.json")
            assert ed.main(["--target", TARGET, "--ckpt", f"{name}={path}", "--load-hidden", saved["hidden"],
                            "--output", out, "--quiet", *flags]) == 0
            done[name, path, flags] = json.loads(open(out).read())["drafters"][0]
        return done[name, path, flags]
    return run


def assert_as_single(line, single, series, *flags):
    """A step's line holds every key, with the numbers of the single-checkpoint run (same flags) of its file."""
    assert LINE_KEYS <= set(line), LINE_KEYS - set(line)
    d = single(series, line["checkpoint"], *flags)
    assert line["series"] == series
    for key in SAME_AS_REPORT:
        assert (key in line) == (key in d) and same(line.get(key), d.get(key)), \
            (line["step"], key, line.get(key), d.get(key))
    assert line["first_position_acceptance"] == d["per_position"]["acceptance"][0]
    assert line["prompts"] == len(d["prompts"]) == 4


@pytest.fixture(scope="module")
def series(saved, tmp_path_factory):
    """A finished in-process watch from saved features over an HF step and a SpecForge step, with --tensorboard:
    (its run directory, its argv, its --output, its TensorBoard directory)."""
    folder = tmp_path_factory.mktemp("series")
    run = new_run(folder / "run")
    write_hf(run, 100)
    write_specforge(run, 200)
    out, board = str(folder / "series.jsonl"), str(folder / "board")
    argv = ["--target", TARGET, "--load-hidden", saved["hidden"], "--watch", f"w={run}", "--output", out,
            "--watch-interval", "0.05", "--watch-until", "200", "--quiet"]
    assert ed.main([*argv, "--tensorboard", board]) == 0
    return {"run": run, "argv": argv, "out": out, "board": board}


class Watch:
    """eval_drafter.py --watch in a subprocess, its stdout and stderr lines gathered as they come."""

    def __init__(self, argv):
        self.proc = subprocess.Popen([sys.executable, SCRIPT, *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self.read, args=(s, lines), daemon=True)
                        for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    @staticmethod
    def read(stream, lines):
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for(self, lines, pattern, timeout=90):
        """The first line matching `pattern`, waiting for it while the watch runs."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            hit = next((line for line in list(lines) if re.search(pattern, line)), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None:
                for t in self.readers:
                    t.join(5)
                if not any(re.search(pattern, line) for line in lines):
                    pytest.fail(f"the watch ended ({self.proc.returncode}) without {pattern!r}:\n" + self.text())
            time.sleep(0.02)
        pytest.fail(f"no {pattern!r} within {timeout} s:\n" + self.text())

    def finish(self, timeout=90):
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail("the watch did not end:\n" + self.text())
        for t in self.readers:
            t.join(5)
        return rc

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def text(self):
        return "\n".join(["-- stdout", *self.out, "-- stderr", *self.err])

    def steps_printed(self):
        return [int(m.group(1)) for line in self.out if (m := STEP_LINE.match(line))]


@pytest.fixture
def spawn():
    """Watch(argv) processes, killed at teardown if a test left one running."""
    started = []

    def start(argv):
        started.append(Watch(argv))
        return started[-1]
    yield start
    for w in started:
        w.stop()


# ---------------------------------------------------------------------------------------------------- live watch

def test_live_run_every_complete_step_once_as_its_single_checkpoint_run(saved, single, spawn, tmp_path):
    """Steps written while the watch runs (HF dir, SpecForge dir, a .pt written in two halves, a corrupt .pt, a later
    HF dir): each complete step is evaluated once with the single --ckpt run's numbers; the half-written step is
    retried ("does not load yet") and evaluated once whole; the corrupt one is named in one "stays unreadable" line,
    never evaluated, and the watch goes on to the last step."""
    run = new_run(tmp_path / "run")
    write_hf(run, 100)
    out = str(tmp_path / "series.jsonl")
    w = spawn(["--target", TARGET, "--load-hidden", saved["hidden"], "--watch", f"live={run}", "--output", out,
               "--watch-interval", "0.4", "--watch-until", "500", *DEPTHS])
    w.wait_for(w.out, r"^step\s+100\s")
    write_specforge(run, 200)
    whole = pt_bytes(300)
    half = write_pt(run, 300, whole[:len(whole) // 2])
    write_pt(run, 400, b"PK\x03\x04 not a checkpoint " * 200)
    w.wait_for(w.err, r"step 300 \(.*\) does not load yet")
    with open(half, "ab") as f:   # the writer finishes
        f.write(whole[len(whole) // 2:])
    w.wait_for(w.err, r"warning: step 400 \(.*\) stays unreadable")
    w.wait_for(w.out, r"^step\s+300\s")
    write_hf(run, 500)
    assert w.finish() == 0, w.text()

    header, lines = read_series(out)
    assert header["series"] == "live" and header["run"] == os.path.abspath(run)
    assert sorted(line["step"] for line in lines) == [100, 200, 300, 500]   # each once; 400 never
    assert sorted(w.steps_printed()) == [100, 200, 300, 500], w.text()
    for line in lines:
        assert "depths" in line
        assert_as_single(line, single, "live", *DEPTHS)
    taus = [line["tau"] for line in lines]
    assert len(set(taus)) == len(taus), taus   # the steps differ, so the equality above tells them apart
    unreadable = [line for line in w.err if "stays unreadable" in line]
    assert len(unreadable) == 1 and "step_400.pt" in unreadable[0], w.text()   # named once, then passed over
    assert not any("step 400" in line for line in w.out)
    best, marked = None, []
    for line in lines:   # in the order evaluated
        marked.append(best is None or line["tau"] > best)
        best = line["tau"] if best is None else max(best, line["tau"])
    assert [line.endswith("*best so far") for line in w.out if STEP_LINE.match(line)] == marked, w.text()


def test_ctrl_c_keeps_finished_steps_and_the_same_command_does_only_the_missing(saved, single, spawn, tmp_path):
    """SIGINT after the first step's line: exit 130, an "interrupted:" line and no traceback, the series holds the
    finished steps as whole JSON lines; the same command then evaluates exactly the steps not there (one of them
    written after the interrupt), and every step is in the file once."""
    run = new_run(tmp_path / "run")
    write_pt(run, 100)
    write_hf(run, 200)
    out = str(tmp_path / "series.jsonl")
    argv = ["--target", TARGET, "--load-hidden", saved["hidden"], "--watch", f"c={run}", "--output", out,
            "--watch-interval", "0.3", "--watch-until", "300"]
    w = spawn(argv)
    w.wait_for(w.out, r"^step\s+100\s")
    w.proc.send_signal(signal.SIGINT)   # step 300 is not written yet: the watch cannot have ended on its own
    assert w.finish() == 130, w.text()
    assert any(line.startswith("interrupted: ") for line in w.err) and "Traceback" not in w.text(), w.text()
    _, kept = read_series(out)
    kept_steps = [line["step"] for line in kept]
    assert 100 in kept_steps and len(set(kept_steps)) == len(kept_steps) and set(kept_steps) <= {100, 200}

    write_specforge(run, 300)
    again = spawn(argv)
    assert again.finish() == 0, again.text()
    missing = sorted({100, 200, 300} - set(kept_steps))
    assert sorted(again.steps_printed()) == missing, again.text()
    assert any(f"holds steps {', '.join(map(str, sorted(kept_steps)))}" in line for line in again.err), again.text()
    with open(out, encoding="utf-8") as f:
        assert sum("watch" in json.loads(line) for line in f) == 1   # one header
    _, lines = read_series(out)
    assert [line["step"] for line in lines] == kept_steps + missing
    assert same(lines[:len(kept)], kept)   # the kept lines untouched
    for line in lines:
        assert_as_single(line, single, "c")


# ---------------------------------------------------------------------------------------------------- target pass

def test_target_pass_form_gives_the_load_hidden_forms_numbers(series, tmp_path, capsys):
    """--prompts instead of --load-hidden (one target pass, kept in memory): the same steps with the same numbers as
    the --load-hidden watch of the same run directory."""
    out = str(tmp_path / "series.jsonl")
    assert ed.main(["--target", TARGET, "--prompts", PROMPTS, *SLICE, "--watch", f"w={series['run']}", "--output",
                    out, "--watch-interval", "0.05", "--watch-until", "200", "--quiet"]) == 0
    _, passed = read_series(out)
    _, loaded = read_series(series["out"])
    assert [line["step"] for line in passed] == [line["step"] for line in loaded] == [100, 200]
    assert passed[0]["tau"] != passed[1]["tau"]
    for a, b in zip(passed, loaded):
        for key in LINE_KEYS - {"seconds"}:
            assert same(a[key], b[key]), (a["step"], key, a[key], b[key])


def test_ctrl_c_in_the_target_pass_is_one_line(series, tmp_path, monkeypatch, capsys):
    """A Ctrl-C in the middle of the target pass (the second prompt's forward) ends the watch with exit 130 and one
    "interrupted:" line, no traceback; no step was finished, so the series holds none."""
    out = str(tmp_path / "series.jsonl")
    _, calls = interrupt_at(monkeypatch, "extract_hidden", 2)
    assert ed.main(["--target", TARGET, "--prompts", PROMPTS, *SLICE, "--watch", f"w={series['run']}", "--output",
                    out, "--watch-interval", "0.05", "--watch-until", "200", "--quiet"]) == 130
    assert len(calls) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted: "), err
    assert read_series(out)[1] == []


# ---------------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("extra, fragment", [
    (["--ckpt", f"demo={DRAFTER}"], "--ckpt"),
    (["--steps", "100"], "--steps"),
    (["--watch", DRAFTER], "one checkpoint"),
])
def test_watch_refusals_are_one_line(saved, series, tmp_path, capsys, extra, fragment):
    """--watch with --ckpt or --steps, and --watch of a single checkpoint directory: exit 2, one line naming why."""
    argv = ["--target", TARGET, "--load-hidden", saved["hidden"], "--watch", series["run"], "--output",
            str(tmp_path / "s.jsonl")]
    if extra[0] == "--watch":
        argv[argv.index("--watch") + 1] = extra[1]
    else:
        argv += extra
    refused_in_one_line(capsys, argv, fragment)
    assert not os.path.exists(tmp_path / "s.jsonl")


def test_watch_until_without_watch_is_refused(saved, tmp_path, capsys):
    """--watch-until sets up a watch: without --watch it is refused in one line, before anything runs."""
    refused_in_one_line(capsys, ["--target", TARGET, "--ckpt", f"demo={DRAFTER}", "--load-hidden", saved["hidden"],
                                 "--watch-until", "100", "--output", str(tmp_path / "x.json")], "--watch-until")
    assert not os.path.exists(tmp_path / "x.json")


def test_output_holding_an_ordinary_report_is_refused_and_kept(saved, series, tmp_path, capsys):
    """--output naming a normal run's JSON report (not a series): refused in one line, the report left as it was."""
    report = str(tmp_path / "X.json")
    shutil.copy(saved["report"], report)
    before = open(report, "rb").read()
    refused_in_one_line(capsys, ["--target", TARGET, "--load-hidden", saved["hidden"], "--watch", series["run"],
                                 "--output", report], "--watch series")
    assert open(report, "rb").read() == before


def test_rerun_with_other_settings_onto_a_series_is_refused(saved, series, tmp_path, capsys):
    """The same watch onto an existing series with another --ddtree-budgets: refused in one line naming what differs,
    the series untouched; the same settings are taken (the finished series is read, no step evaluated again)."""
    out = str(tmp_path / "series.jsonl")
    shutil.copy(series["out"], out)
    before = open(out, "rb").read()
    argv = [*series["argv"]]
    argv[argv.index("--output") + 1] = out
    refused_in_one_line(capsys, [*argv, "--ddtree-budgets", "8,16"], "--ddtree-budgets")
    assert open(out, "rb").read() == before
    assert ed.main(argv) == 0
    assert open(out, "rb").read() == before
    assert not [line for line in capsys.readouterr().out.splitlines() if STEP_LINE.match(line)]



def test_a_line_torn_by_a_kill_is_dropped_and_the_series_goes_on(series, tmp_path, capsys):
    """A kill in the middle of writing a step's line leaves half a line at the end of the series: the next start drops
    it with a note (never appends after it, which would garble the next line), keeps every whole line byte for byte,
    and evaluates that step again."""
    out = str(tmp_path / "series.jsonl")
    whole = open(series["out"], "rb").read().splitlines(keepends=True)
    with open(out, "wb") as f:
        f.write(b"".join(whole[:-1]) + whole[-1][:40])   # the last step's line cut short
    argv = [*series["argv"]]
    argv[argv.index("--output") + 1] = out
    assert ed.main([a for a in argv if a != "--quiet"]) == 0
    assert "torn line" in capsys.readouterr().err
    after = open(out, "rb").read().splitlines(keepends=True)
    assert after[:-1] == whole[:-1]
    timeless = [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in (after[-1], whole[-1])]
    assert same(*timeless)


def test_a_series_kept_inside_the_run_directory_is_no_input(saved, tmp_path, capsys):
    """--output inside the watched run directory (/ckpt/run5/tau.jsonl): the series is the watch's own output, not
    one of the run's checkpoint files, so the same command goes on from it instead of being refused."""
    run = new_run(tmp_path / "run")
    write_hf(run, 100)
    out = os.path.join(run, "tau.jsonl")
    argv = ["--target", TARGET, "--load-hidden", saved["hidden"], "--watch", f"w={run}", "--output", out,
            "--watch-interval", "0.05", "--watch-until", "200", "--quiet"]
    write_hf(run, 200)
    assert ed.main([*argv, "--watch-until", "100"]) == 0
    assert [line["step"] for line in read_series(out)[1]] == [100]
    assert ed.main(argv) == 0
    assert [line["step"] for line in read_series(out)[1]] == [100, 200]

# ---------------------------------------------------------------------------------------------------- TensorBoard

def test_tensorboard_holds_each_steps_tau_at_its_step(series):
    """--tensorboard: the events read back give "<series>/tau" = each step's tau (from the series) at its step, and
    the first position's acceptance beside it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, lines = read_series(series["out"])
    events = EventAccumulator(series["board"])
    events.Reload()
    assert "w/tau" in events.Tags()["scalars"], events.Tags()
    got = {e.step: e.value for e in events.Scalars("w/tau")}
    assert got == pytest.approx({line["step"]: line["tau"] for line in lines}, rel=1e-6)
    assert len(events.Scalars("w/tau")) == len(lines)   # one value a step, not repeated
    first = {e.step: e.value for e in events.Scalars("w/acceptance/pos1")}
    assert first == pytest.approx({line["step"]: line["first_position_acceptance"] for line in lines}, rel=1e-6)
    assert len(os.listdir(series["board"])) == 1   # one events file for the whole watch, not one a step
