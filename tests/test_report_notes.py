"""The report says what it shows and the run says what it did with the flags: the side by side's predicted speedup,
the pooled engine lines labelled, notes kept out of the progress bars, and one note for each flag a run drops or
changes (a repeated budget, a repeated drafter name, --check-mask for a drafter without an in-block mask)."""
import contextlib
import io
import json
import os
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

import eval_drafter as ed
from conftest import ROOT

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
DRAFTER = os.path.join(DEMO, "drafter")
EAGLE = os.path.join(ROOT, "tests", "fixtures", "families", "eagle3")
SHORT = ("--demo", "--max-new-tokens", "16", "--ignore-eos")


def costs_file(path, batch_sizes=("1",)):
    """A --costs FILE for the demo drafter's depths 3 and 7 and a DDTree budget of 8."""
    table = {"target": {"1": 0.010, "4": 0.012, "8": 0.014, "9": 0.015}, "draft": {"3": 0.002, "7": 0.003}}
    path.write_text(json.dumps({"batch_sizes": {b: table for b in batch_sizes}}))
    return str(path)


def run_printed(tmp_path, *argv):
    """eval_drafter.main(argv) quietly into a JSON file: (the report, what it printed on stdout)."""
    out, printed = tmp_path / "r.json", io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert ed.main([*argv, "--quiet", "--output", str(out)]) == 0
    return json.loads(out.read_text()), printed.getvalue().splitlines()


@pytest.fixture(scope="module")
def two_splits(tmp_path_factory):
    """Two drafters over 6 demo prompts (5 of split train, 1 of split fresh), --depths 3, costs from a file."""
    tmp = tmp_path_factory.mktemp("two_splits")
    return run_printed(tmp, *SHORT, "--ckpt", f"mine={DRAFTER}", "--ckpt", f"ref={DRAFTER}", "--limit", "6",
                       "--depths", "3", "--ddtree-budgets", "8", "--costs", costs_file(tmp / "costs.json"))


def test_side_by_side_has_each_drafters_best_predicted_speedup(two_splits):
    report, lines = two_splits
    rows = report["comparison"]["drafters"]
    for row, d in zip(rows, report["drafters"]):
        p = d["predicted_speedup"]["1"]
        assert row["predicted_speedup"] == {"1": {"best": p["best"], "leaders": p["leaders"],
                                                  "speedup": p["rows"][p["leaders"][0]]["speedup"],
                                                  "plain_decoding_wins": False}}
        assert row["predicted_speedup"]["1"]["speedup"] > 1 and "delta_tau" in row   # added, nothing dropped
    start = lines.index(next(line for line in lines if line.startswith("== side by side")))
    header, table = lines[start + 1], lines[start + 2:start + 2 + len(rows)]
    assert header.rstrip().endswith("predicted speedup")
    for row, line in zip(rows, table):
        best = row["predicted_speedup"]["1"]
        assert line.split()[0] == row["name"] and \
            line.rstrip().endswith(f"{best['speedup']:.2f}x at {' ~ '.join(best['leaders'])}")   # a tie: all named


def test_side_by_side_names_the_batch_size_when_it_is_not_1():
    row = {"name": "a", "tau": 5.0, "tau_ci95": [4.0, 6.0], "first_position_acceptance": 0.9, "ddtree": {},
           "delta_tau": None, "delta_tau_ci95": None,
           "predicted_speedup": {"16": {"best": "K=3", "speedup": 1.5}, "4": {"best": "K=7", "speedup": 2.25}}}
    lines = list(ed.comparison_lines({"prompts": 2, "reference": "a", "best_steps": {}, "drafters": [row]}))
    assert lines[1].rstrip().endswith("predicted speedup (batch 4)") and lines[2].rstrip().endswith("2.25x at K=7")


def test_no_speedup_column_without_costs(tmp_path):
    report, lines = run_printed(tmp_path, *SHORT, "--ckpt", f"a={DRAFTER}", "--ckpt", f"b={DRAFTER}", "--limit", "1",
                                "--ddtree-budgets", "none")
    assert not any("predicted" in line for line in lines)
    assert all("predicted_speedup" not in row for row in report["comparison"]["drafters"])


def test_pooled_engine_lines_stand_after_the_splits_labelled(two_splits):
    _, lines = two_splits
    for name in ("mine", "ref"):
        start = lines.index(next(line for line in lines if line.startswith(f"== drafter {name}:")))
        block = lines[start:start + next(i for i, line in enumerate(lines[start + 1:] + ["=="], 1)
                                         if line.startswith("=="))]
        label = [i for i, line in enumerate(block) if line.startswith("-- all, pooled over every split")]
        last_split = max(i for i, line in enumerate(block) if line.startswith(("-- fresh:", "-- train:")))
        engines = [i for i, line in enumerate(block) if "vLLM (num_speculative_tokens" in line]
        speedups = [i for i, line in enumerate(block) if line.lstrip().startswith("predicted speedup")]
        assert len(label) == 1 and last_split < label[0] < min(engines) and label[0] < speedups[0], block
        assert "predicted speedup" in block[label[0]]


def test_one_split_needs_no_label(tmp_path):
    _, lines = run_printed(tmp_path, *SHORT, "--limit", "2", "--ddtree-budgets", "none")
    assert any("vLLM (num_speculative_tokens" in line for line in lines)
    assert not any("pooled over every" in line for line in lines)


class FakeTerminal(io.StringIO):
    """stderr as a terminal: tqdm draws its bars here."""
    def isatty(self):
        return True


def screen_rows(text):
    """Every row a terminal shows of `text`, as drawn at the end (\\r back to column 0, ESC[A a row up)."""
    rows, row, col = [[]], 0, 0
    for token in re.findall(r"\x1b\[[0-9;]*[A-Za-z]|[\s\S]", text):
        if token == "\x1b[A":
            row = max(row - 1, 0)
        elif token.startswith("\x1b"):
            continue
        elif token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            rows += [[] for _ in range(row + 1 - len(rows))]
        else:
            line = rows[row]
            line += [" "] * (col + 1 - len(line))
            line[col], col = token, col + 1
    return ["".join(r).rstrip() for r in rows]


def test_a_note_is_not_spliced_into_a_progress_bar(monkeypatch):
    """The demo's tokenizer has no chat template: its note comes while the target's bar is drawn."""
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert ed.main([*SHORT, "--limit", "2", "--ddtree-budgets", "none"]) == 0
    drawn = terminal.getvalue()
    assert "target:" in drawn and "draft:" in drawn   # the bars were drawn
    rows = screen_rows(drawn)
    notes = [r for r in rows if "note: the target's tokenizer has no chat template" in r]
    assert len(notes) == 1 and notes[0].startswith("note:"), rows
    assert not any("note:" in r and ("target:" in r or "draft:" in r or "it/s" in r) for r in rows), rows


def test_one_note_for_a_repeated_budget_and_a_repeated_name(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert ed.main([*SHORT, "--limit", "1", "--ckpt", f"a={DRAFTER}", "--ckpt", f"a={DRAFTER}",
                    "--ddtree-budgets", "8,32,8", "--output", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    report = json.loads(out.read_text())
    assert report["config"]["ddtree_budgets"] == [8, 32] and [d["name"] for d in report["drafters"]] == ["a", "a#2"]
    budgets = [line for line in err if "--ddtree-budgets" in line]
    assert budgets == ["note: --ddtree-budgets 8,32,8: 8 given more than once, counted once"]
    renamed = [line for line in err if "a#2 in the report" in line]
    assert len(renamed) == 1 and renamed[0].startswith("note: a drafter named a came before")


def test_notes_are_quiet_under_quiet(tmp_path, capsys):
    assert ed.main([*SHORT, "--limit", "1", "--ckpt", f"a={DRAFTER}", "--ckpt", f"a={DRAFTER}", "--ddtree-budgets",
                    "8,8", "--quiet", "--output", str(tmp_path / "r.json")]) == 0
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, note", [
    (["--depths", "3,5,3"], "--depths 3,5,3: 3 given more than once, counted once"),
    (["--steps", "400,800,400,800"], "--steps 400,800,400,800: 400, 800 given more than once, counted once"),
    (["--enable-thinking", "--no-chat-template"], "--enable-thinking does nothing with --no-chat-template"),
])
def test_a_flag_the_run_changes_or_drops_gets_a_note(argv, note):
    notes = ed.check_flags(ed.parse_args(["--demo", *argv]))
    assert sum(n.startswith(note) for n in notes) == 1, notes
    assert not ed.check_flags(ed.parse_args(["--demo", "--depths", "3,5", "--steps", "400,800"]))


def test_check_mask_is_noted_as_ignored_for_a_drafter_without_an_in_block_mask(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert ed.main([*SHORT, "--limit", "1", "--ckpt", f"e={EAGLE}", "--ckpt", f"d={DRAFTER}", "--block-size", "8",
                    "--ddtree-budgets", "none", "--check-mask", "--output", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    notes = [line for line in err if "--check-mask" in line]
    assert notes == ["note: --check-mask ignored for drafter e (EAGLE-3): a causal chain has no in-block mask"]
    e, d = json.loads(out.read_text())["drafters"]
    assert "mask_check" not in e and "mask_check" in d   # the DFlash drafter is still checked


def test_block_mask_flags_are_noted_as_ignored_for_an_mtp_layer_too(capsys):
    mtp, dflash = (SimpleNamespace(name=n, generation=g, rules=r) for n, g, r in (("mtp", "MTP", []),
                                                                                  ("d", "DFlash", ["causal"])))
    settings = ed.Settings(check_mask=False, block_mask="causal", sliding_window="ignore", quiet=False)
    ed.note_maskless([dflash, mtp], settings)
    assert capsys.readouterr().err.splitlines() == [
        "note: --block-mask, --sliding-window ignored for drafter mtp (MTP): a causal chain has no in-block mask"]
    ed.note_maskless([dflash, mtp], replace(settings, block_mask="auto", sliding_window="train"))
    ed.note_maskless([dflash], replace(settings, check_mask=True))
    assert capsys.readouterr().err == ""
