"""--plot, --plot --from and --tensorboard draw and log the numbers of the run's JSON, nothing else.

The figure's data is read back from matplotlib (each panel by its title: its lines' labels, x and y; its bars'
labels and heights) and compared to the JSON report the same run wrote; the TensorBoard events are read back with
tensorboard's own reader. The drafters are the demo's and perturbed copies of it, evaluated from saved features.
"""
import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import eval_drafter as ed
from conftest import ROOT, refused_in_one_line, write_jsonl

TARGET = os.path.join(ed.DEMO_DIR, "target")
DRAFTER = os.path.join(ed.DEMO_DIR, "drafter")
CONDITIONAL = "acceptance by position (conditional)"
VLLM = "acceptance by position (vLLM's, unconditional)"
LENGTHS = "acceptance lengths"
DEPTHS = "tau by served depth"
STEPS = "tau by training step"
CONTEXT = "tau by context length"


def numbers(values):
    """Plotted values as floats, a gap (NaN) as None, so that lists compare with =="""
    return [None if v is None or math.isnan(float(v)) else float(v) for v in values]


def figure_data(fig):
    """{panel title: {"lines": [(label, xs, ys)], "bars": [(label, heights)], "ticks": [tick labels]}}."""
    panels = {}
    for ax in fig.axes:
        if not ax.get_title():
            continue
        panels[ax.get_title()] = {
            "lines": [(line.get_label(), numbers(line.get_xdata()), numbers(line.get_ydata()))
                      for line in ax.get_lines() if not line.get_label().startswith("_")],   # not the joins
            "bars": [(c.get_label(), numbers(p.get_height() for p in c.patches)) for c in ax.containers if hasattr(c, "patches")],
            "ticks": [t.get_text() for t in ax.get_xticklabels()]}
    return panels


@pytest.fixture
def drawn(monkeypatch):
    """Every figure the CLI draws (eval_drafter.draw_plot wrapped), as figure_data, in order."""
    real, seen = ed.draw_plot, []

    def recording(source, path):
        fig = real(source, path)
        seen.append(figure_data(fig))
        return fig

    monkeypatch.setattr(ed, "draw_plot", recording)
    return seen


def own_figure(source, path):
    """draw_plot called directly: its figure's data."""
    return figure_data(ed.draw_plot(source, str(path)))


def perturbed(folder, std, seed=1):
    """The demo drafter with noise of `std` on its second layer's MLP, saved as a checkpoint directory."""
    g = torch.Generator().manual_seed(seed)
    weights = {k: (v + std * torch.randn(v.shape, generator=g) if k.startswith("layers.1.mlp") else v).contiguous()
               for k, v in load_file(os.path.join(DRAFTER, "model.safetensors")).items()}
    os.makedirs(folder)
    shutil.copy(os.path.join(DRAFTER, "config.json"), folder)
    save_file(weights, os.path.join(folder, "model.safetensors"))
    return str(folder)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def load_hidden(saved, *flags):
    return ["--target", TARGET, "--load-hidden", saved["hidden"], "--quiet", *flags]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Features of 4 demo prompts (--save-hidden), a perturbed copy of the demo drafter, and a training run's
    directory of 3 step checkpoints whose best (the demo's weights) is the middle one."""
    folder = tmp_path_factory.mktemp("plot")
    hidden = folder / "h.safetensors"
    assert ed.main(["--demo", "--limit", "4", "--max-new-tokens", "64", "--quiet", "--save-hidden", str(hidden),
                    "--output", str(folder / "x.json")]) == 0
    run = folder / "run"
    for step, std in ((100, 0.2), (200, 0.0), (300, 0.1)):
        perturbed(run / f"checkpoint-{step}", std)
    return {"hidden": str(hidden), "folder": folder, "perturbed": perturbed(folder / "perturbed", 0.1), "run": str(run)}


@pytest.fixture(scope="module")
def two(saved):
    """A two-drafter run with --depths 3,5, --plot, --tensorboard and --output; the figure data the run drew."""
    folder, seen = saved["folder"] / "two", []
    os.makedirs(folder)
    real = ed.draw_plot

    def recording(source, path):
        fig = real(source, path)
        seen.append(figure_data(fig))
        return fig

    ed.draw_plot = recording   # module scope: no monkeypatch fixture here
    try:
        assert ed.main(load_hidden(saved, "--ckpt", f"demo={DRAFTER}", "--ckpt", f"pert={saved['perturbed']}",
                                   "--depths", "3,5", "--plot", str(folder / "out.png"), "--output",
                                   str(folder / "r.json"), "--tensorboard", str(folder / "tb"))) == 0
    finally:
        ed.draw_plot = real
    assert len(seen) == 1
    return {"folder": folder, "report": read_json(folder / "r.json"), "drawn": seen[0]}


@pytest.fixture(scope="module")
def series(saved):
    """--ckpt run=RUN_DIR over the 3 steps, with --plot and --tensorboard."""
    folder = saved["folder"] / "series"
    os.makedirs(folder)
    assert ed.main(load_hidden(saved, "--ckpt", f"run={saved['run']}", "--plot", str(folder / "s.png"),
                               "--output", str(folder / "s.json"), "--tensorboard", str(folder / "tb"))) == 0
    return {"folder": folder, "report": read_json(folder / "s.json")}


def assert_valid_png(path):
    from PIL import Image
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 0 and im.size[1] > 0
        im.verify()


def test_two_drafters_panels_hold_the_json(two, tmp_path):
    """The PNG is a valid image, and its figure (drawn again from the JSON, and as the run drew it) holds, per
    panel, one series per drafter under its name: the conditional per-position acceptance, vLLM's per-position
    rates and the depth taus at x = positions / depths, the acceptance-length shares and context taus as bars."""
    assert_valid_png(two["folder"] / "out.png")
    report = two["report"]
    data = own_figure(report, tmp_path / "again.png")
    assert data == two["drawn"]
    names = [d["name"] for d in report["drafters"]]
    assert names == ["demo", "pert"] and report["drafters"][0]["tau"] != report["drafters"][1]["tau"]
    want = {
        CONDITIONAL: [(d["name"], d["per_position"]["acceptance"]) for d in report["drafters"]],
        VLLM: [(d["name"], d["engine_metrics"]["vllm"]["per_position_acceptance_rate"]) for d in report["drafters"]]}
    for title, rows in want.items():
        assert [(label, xs, ys) for label, xs, ys in data[title]["lines"]] == \
            [(name, numbers(range(1, len(ys) + 1)), numbers(ys)) for name, ys in rows], title
    assert data[DEPTHS]["lines"] == [(d["name"], numbers(int(k) for k in d["depths"]),
                                      numbers(s["tau"] for s in d["depths"].values())) for d in report["drafters"]]
    assert {3, 5} <= {int(k) for k in report["drafters"][0]["depths"]}
    assert data[LENGTHS]["bars"] == [(d["name"], numbers(c / sum(d["histogram"]) for c in d["histogram"]))
                                     for d in report["drafters"]]
    assert all(len(d["by_context"]) == 1 for d in report["drafters"])   # the demo's contexts are all short:
    assert CONTEXT not in data and STEPS not in data   # one bucket compares nothing; no series: no such panels
    spread = copy.deepcopy(report)   # anchors in two length buckets, as a long-context run has them
    for k, d in enumerate(spread["drafters"]):
        d["by_context"]["512-2k"] = {**d["by_context"]["<512"], "tau": 2.5 + k}
    data = own_figure(spread, tmp_path / "spread.png")
    assert data[CONTEXT]["bars"] == [(d["name"], numbers(s["tau"] for s in d["by_context"].values()))
                                     for d in spread["drafters"]]
    assert data[CONTEXT]["ticks"] == ["<512", "512-2k"]


def test_plot_from_draws_the_same(two, drawn, tmp_path):
    """--plot --from the run's JSON draws, without running anything, the figure the run drew."""
    assert ed.main(["--plot", str(tmp_path / "from.png"), "--from", str(two["folder"] / "r.json"), "--quiet"]) == 0
    assert drawn == [two["drawn"]]
    assert_valid_png(tmp_path / "from.png")
    assert os.listdir(tmp_path) == ["from.png"]


def best_marker(panel):
    """(step, tau) of the training-step panel's best marker, read from its label and its point."""
    marks = [line for line in panel["lines"] if line[0].startswith("best")]
    assert len(marks) == 1, panel["lines"]
    label, xs, ys = marks[0]
    m = re.fullmatch(r"best: step (\d+), tau ([0-9.]+)", label)
    assert m and xs == [float(m.group(1))] and ys[0] == pytest.approx(float(m.group(2)), abs=5e-4), marks
    return int(m.group(1)), ys[0]


def test_training_series_panel(series, tmp_path):
    """A run directory's 3 steps: the "tau by training step" panel's line is the series with x = steps, y = the
    JSON's taus, and the best marker sits at the step of the highest tau (the middle step here, neither the first
    nor the last); the per-position panels show the first, the best and the last step."""
    assert_valid_png(series["folder"] / "s.png")
    drafters = series["report"]["drafters"]
    steps = sorted(drafters, key=lambda d: d["step"])
    assert [d["step"] for d in steps] == [100, 200, 300] and {d["series"] for d in steps} == {"run"}
    data = own_figure(series["report"], tmp_path / "s.png")
    line = [row for row in data[STEPS]["lines"] if row[0] == "run"]
    assert line == [("run", numbers(d["step"] for d in steps), numbers(d["tau"] for d in steps))]
    best = max(steps, key=lambda d: d["tau"])
    assert best["step"] == 200   # the fixture's design: the equality below tells the max from an end point
    assert best_marker(data[STEPS]) == (best["step"], best["tau"])
    assert [row[0] for row in data[CONDITIONAL]["lines"]] == ["run@100", "run@200", "run@300"]


def test_watch_series_plot_from(saved, series, drawn, tmp_path):
    """A --watch of the same run directory (its JSONL series) given to --plot --from draws the training-step panel
    of the series run's JSON: the same steps and taus, the best marker at the same step; and the watch's own
    --plot drew that figure after its last step."""
    watched = tmp_path / "w.jsonl"
    assert ed.main(["--watch", f"run={saved['run']}", *load_hidden(saved), "--output", str(watched),
                    "--watch-interval", "0.05", "--watch-until", "300", "--plot", str(tmp_path / "w.png")]) == 0
    assert_valid_png(tmp_path / "w.png")
    watch_drew = drawn[-1]
    assert ed.main(["--plot", str(tmp_path / "from.png"), "--from", str(watched), "--quiet"]) == 0
    assert drawn[-1] == watch_drew
    from_series = own_figure(series["report"], tmp_path / "s.png")
    assert watch_drew[STEPS] == from_series[STEPS]
    assert best_marker(watch_drew[STEPS])[0] == 200


def test_watch_lines_written_by_hand(series, drawn, tmp_path):
    """A series file in the watch's line format ({"watch": header}, then a line a step) written from the series
    run's JSON: --plot --from reads it as a series and marks its best step."""
    steps = sorted(series["report"]["drafters"], key=lambda d: d["step"])
    keys = ("series", "step", "tau", "tau_ci95", "per_position", "engine_metrics", "histogram", "by_context")
    path = write_jsonl(tmp_path / "series.jsonl", [{"watch": {"series": "run"}},
                                                   *({k: d[k] for k in keys} for d in steps)])
    assert ed.main(["--plot", str(tmp_path / "hand.png"), "--from", path, "--quiet"]) == 0
    panel = drawn[-1][STEPS]
    assert [row for row in panel["lines"] if row[0] == "run"] == \
        [("run", numbers(d["step"] for d in steps), numbers(d["tau"] for d in steps))]
    assert best_marker(panel)[0] == max(steps, key=lambda d: d["tau"])["step"]


@pytest.mark.parametrize("ext, magic", [("svg", (b"<?xml", b"<svg")), ("pdf", (b"%PDF",))])
def test_svg_and_pdf(two, drawn, tmp_path, ext, magic):
    """.svg and .pdf are written in their formats (the name's ending picks it), with the run's figure."""
    out = tmp_path / f"out.{ext}"
    assert ed.main(["--plot", str(out), "--from", str(two["folder"] / "r.json"), "--quiet"]) == 0
    assert out.read_bytes().lstrip().startswith(magic)
    assert drawn == [two["drawn"]]


BLOCKED = ("import sys; sys.modules['matplotlib'] = None; sys.path.insert(0, {root!r}); import eval_drafter as ed; "
           "sys.exit(ed.main(sys.argv[1:]))")


def without_matplotlib(argv, cwd):
    return subprocess.run([sys.executable, "-c", BLOCKED.format(root=ROOT), *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_plot_without_matplotlib(saved, tmp_path):
    """Where matplotlib cannot be imported, --plot is refused in one line naming pip install matplotlib (exit 2, no
    traceback, nothing written); the same run without --plot needs no matplotlib and succeeds."""
    argv = load_hidden(saved, "--ckpt", f"demo={DRAFTER}", "--output", str(tmp_path / "r.json"))
    refused = without_matplotlib([*argv, "--plot", str(tmp_path / "out.png")], tmp_path)
    assert refused.returncode == 2, refused.stderr
    err = refused.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "pip install matplotlib" in err[0], err
    assert os.listdir(tmp_path) == []
    ran = without_matplotlib(argv, tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert read_json(tmp_path / "r.json")["drafters"][0]["tau"] is not None


def test_plot_refusals(saved, two, tmp_path, capsys):
    """Exit 2 with one line, nothing drawn: --from a file that is not a run's JSON (text; JSON without drafters),
    --from without --plot, --plot to a name that is not .png/.svg/.pdf on a run."""
    report = str(two["folder"] / "r.json")
    text = tmp_path / "notes.txt"
    text.write_text("not a run's output\n")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"config": {}}))
    png = tmp_path / "out.png"
    refused_in_one_line(capsys, ["--plot", str(png), "--from", str(text)], "--from")
    refused_in_one_line(capsys, ["--plot", str(png), "--from", str(other)], "--from")
    refused_in_one_line(capsys, ["--from", report], "--plot")
    refused_in_one_line(capsys, load_hidden(saved, "--ckpt", f"demo={DRAFTER}", "--plot", str(tmp_path / "x.txt"),
                                            "--output", str(tmp_path / "r.json")), ".png")
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "other.json"]


def test_plot_from_refuses_like_plot(two, tmp_path, capsys):
    """--plot --from refuses what --plot refuses on a run, in one line with exit 2 and nothing written: a name
    that is not .png/.svg/.pdf, and a process where matplotlib cannot be imported."""
    report = str(two["folder"] / "r.json")
    blocked = without_matplotlib(["--plot", str(tmp_path / "out.png"), "--from", report], tmp_path)
    assert (blocked.returncode, blocked.stderr.count("\n")) == (2, 1), blocked.stderr
    assert blocked.stderr.startswith("error: ") and "pip install matplotlib" in blocked.stderr
    refused_in_one_line(capsys, ["--plot", str(tmp_path / "x.txt"), "--from", report], ".png")
    assert os.listdir(tmp_path) == []


def scalars(folder):
    """{tag: [(step, value)]} of a --tensorboard directory, read with tensorboard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars(two, series):
    """--tensorboard: each drafter's tau and per-position acceptance under its name at step 0, and a training
    series' taus under the series' name at each step, equal the JSON's (to float32, TensorBoard's precision)."""
    got = scalars(two["folder"] / "tb")
    for d in two["report"]["drafters"]:
        assert got[f"{d['name']}/tau"] == [(0, pytest.approx(d["tau"], rel=1e-6))]
        for k, a in enumerate(d["per_position"]["acceptance"], 1):
            assert got[f"{d['name']}/acceptance/pos{k}"] == [(0, pytest.approx(a, rel=1e-6))]
    steps = sorted(series["report"]["drafters"], key=lambda d: d["step"])
    assert scalars(series["folder"] / "tb")["run/tau"] == \
        [(d["step"], pytest.approx(d["tau"], rel=1e-6)) for d in steps]


def wandb_rows(path):
    """The history rows of an offline W&B run, read from its .wandb file: wandb writes LevelDB's log format (a
    7-byte file header, 32 KiB blocks of records each with a crc, length and kind) of protobuf Records; there is no
    offline reader in the package, so this is one."""
    import struct
    from wandb.proto import wandb_internal_pb2
    data, pos, part, rows = open(path, "rb").read(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or length == kind == 0:   # a block's zero padding
            pos += left
            continue
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):   # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_logs_the_tensorboard_series(saved, tmp_path, monkeypatch):
    """--wandb PROJECT (offline, no network): a row per training step in step order, each holding every scalar
    --tensorboard logs, equal to the JSON's figures; two drafters at step 0 share one row."""
    pytest.importorskip("wandb")
    import glob
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))   # wandb reads it once a process: both runs land here
    runs = {"run": ["--ckpt", f"run={saved['run']}"],
            "demo": ["--ckpt", f"demo={DRAFTER}", "--ckpt", f"pert={saved['perturbed']}", "--depths", "3"]}
    for name, flags in runs.items():
        assert ed.main(load_hidden(saved, *flags, "--wandb", "evals", "--output", str(tmp_path / f"{name}.json"))) == 0
    logged = [wandb_rows(path) for path in glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))]
    assert len(logged) == 2
    for name in runs:
        drafters = read_json(tmp_path / f"{name}.json")["drafters"]
        (rows,) = [rows for rows in logged if any(k.startswith(name + "/") for k in rows[0])]
        steps = sorted({d.get("step") or 0 for d in drafters})
        assert [row["_step"] for row in rows] == steps
        for d in drafters:
            (row,) = [r for r in rows if r["_step"] == (d.get("step") or 0)]
            prefix = d.get("series") or d["name"]
            assert {k: v for k, v in row.items() if k.startswith(prefix + "/")} == \
                {f"{prefix}/{tag}": v for tag, v in ed.board_scalars(d).items()}
            assert row[f"{prefix}/tau"] == d["tau"]
    assert len(steps) == 1 and len(drafters) == 2 and "demo/depth_tau/K3" in rows[0] and "pert/tau" in rows[0]


def test_wandb_without_the_package_is_one_line(saved, tmp_path):
    blocked = subprocess.run([sys.executable, "-c", BLOCKED.replace("matplotlib", "wandb").format(root=ROOT),
                              *load_hidden(saved, "--ckpt", f"demo={DRAFTER}", "--wandb", "p")],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert (blocked.returncode, blocked.stderr.count("\n")) == (2, 1), blocked.stderr
    assert blocked.stderr.startswith("error: ") and "pip install wandb" in blocked.stderr
