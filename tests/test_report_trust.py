"""Nothing misleading: a drafter trained for another target is named, intervals mean what they say, bad flags and
flags a mode ignores are refused in one line, and the report says what its rows cover.
"""
import json
import math
import os
import shutil

import pytest

import eval_drafter as ed
from conftest import ROOT, interrupt_at, write_jsonl

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
HYBRID_DRAFTER = os.path.join(ROOT, "tests", "fixtures", "demo_hybrid", "drafter")   # trained for the hybrid target


def run(tmp_path, name, *argv, code=0, capsys=None):
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, "--quiet", "--output", str(out)]) == code
    return json.loads(out.read_text()) if out.exists() else None


def drafter_copy(tmp_path, source, name, **config):
    """A copy of a drafter directory with config keys changed."""
    path = tmp_path / name
    shutil.copytree(source, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(config)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


# ----------------------------------------------------------------------------------------------------
# A wrong drafter is named


def test_a_drafter_trained_for_another_target_is_named(tmp_path, capsys):
    """The hybrid demo's drafter has the demo target's shapes (hidden 64, 3 feature layers that exist): it runs,
    and accepts almost nothing. Its config says 4 target layers; a copy that claims 6 is caught by its acceptance
    alone. The demo drafter on its own target gets no warning."""
    consistent = drafter_copy(tmp_path, HYBRID_DRAFTER, "claims6", num_target_layers=6)
    vocab = drafter_copy(tmp_path, os.path.join(DEMO, "drafter"), "vocab", vocab_size=151936)
    report = run(tmp_path, "r", "--demo", "--ckpt", "demo=" + os.path.join(DEMO, "drafter"), "--ckpt",
                 "hybrid=" + HYBRID_DRAFTER, "--ckpt", f"claims6={consistent}", "--ckpt", f"vocab={vocab}",
                 "--max-new-tokens", "64", "--ddtree-budgets", "none")
    demo, hybrid, claims6, wrong_vocab = report["drafters"]
    assert demo["warnings"] == [] and demo["per_position"]["acceptance"][0] > 0.9
    assert len(hybrid["warnings"]) == 2
    assert hybrid["warnings"][0].startswith("its config says num_target_layers 4 where the target has 6")
    assert len(claims6["warnings"]) == 1 and claims6["warnings"][0].startswith("first-position acceptance 0.0")
    for warning in hybrid["warnings"] + claims6["warnings"]:
        assert all(what in warning for what in ("--target", "target_layer_ids", "mask token", "chat template"))
    assert wrong_vocab["warnings"] == ["its config says vocab_size 151936 where the target has 64: it was trained "
                                       "for another target; " + ed.WRONG_DRAFTER_CHECK]
    out, err = capsys.readouterr()
    assert "warning: drafter claims6: first-position acceptance" in err
    assert "   WARNING: first-position acceptance" in out


def test_low_acceptance_on_foreign_references_is_no_verdict(tmp_path):
    """Against references that are not the target's text, low acceptance says nothing of the drafter."""
    rows = [{"id": f"r{i}", "prompt": "w1 w2", "completion_ids": [4 + (7 * i + 11 * k) % 60 for k in range(80)]}
            for i in range(6)]
    report = run(tmp_path, "r", "--demo", "--prompts", write_jsonl(tmp_path / "p.jsonl", rows), "--ddtree-budgets",
                 "none")
    d = report["drafters"][0]
    assert d["target_agreement"] < 0.5 and d["per_position"]["acceptance"][0] < 0.2 and d["warnings"] == []


# ----------------------------------------------------------------------------------------------------
# Intervals


def test_identical_samples_give_the_interval_of_one(tmp_path, monkeypatch):
    """Two samples per prompt that are the same text (every sample seeded as sample 0) carry no more information
    than one, and give the same interval: a prompt's samples are one unit. Counted as independent references,
    they would have narrowed it by about sqrt(2)."""
    seed = ed.sample_seed
    monkeypatch.setattr(ed, "sample_seed", lambda settings, prompt_id, sample: seed(settings, prompt_id, 0))
    base = ["--demo", "--max-new-tokens", "64", "--temperature", "0.6", "--ddtree-budgets", "none"]
    one = run(tmp_path, "one", *base)
    two = run(tmp_path, "two", *base, "--samples-per-prompt", "2")
    by_sample = {}
    for p in two["drafters"][0]["prompts"]:
        by_sample.setdefault(p["id"], []).append(p["rounds"])
    assert len(by_sample) == 10 and all(a == b for a, b in by_sample.values())   # the samples are identical
    assert one["drafters"][0]["tau"] == two["drafters"][0]["tau"]
    assert one["drafters"][0]["tau_ci95"] == two["drafters"][0]["tau_ci95"] is not None
    refs = two["drafters"][0]["prompts"]
    lo, hi = ed.ratio_ci95([p["expected_committed"] for p in refs], [p["expected_rounds"] for p in refs])
    tau = two["drafters"][0]["tau"]

    def half(ci):   # the half-width on the log of tau - 1, where the interval is taken (it never reaches below 1)
        return math.log((ci[1] - 1) / (tau - 1))
    assert half([lo, hi]) == pytest.approx(half(two["drafters"][0]["tau_ci95"]) * math.sqrt(9 / 19), rel=1e-9)


def jackknife_se(pairs):
    """Leave-one-prompt-out standard error of f over prompts (an independent way to the same uncertainty)."""
    def tau(ps):
        return sum(c for c, _ in ps) / sum(r for _, r in ps)
    n = len(pairs)
    values = [tau(pairs[:i] + pairs[i + 1:]) for i in range(n)]
    mean = sum(values) / n
    return math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in values))


def test_greedy_interval_and_the_paired_difference(tmp_path, capsys):
    """Greedy tau has a 95% interval over prompts; a second drafter (the demo drafter at block 4) gets a paired
    difference against the first. Checked against leave-one-out jackknife standard errors computed from the
    per-prompt rounds; pairing removes the spread both drafters share, so the paired interval is narrower than
    the two intervals combined."""
    short = drafter_copy(tmp_path, os.path.join(DEMO, "drafter"), "short", block_size=4)
    report = run(tmp_path, "r", "--demo", "--ckpt", "ref=" + os.path.join(DEMO, "drafter"), "--ckpt",
                 f"mine={short}", "--max-new-tokens", "96", "--ddtree-budgets", "8")
    ref, mine = report["drafters"]
    totals = [[(sum(p["rounds"]), len(p["rounds"])) for p in d["prompts"]] for d in (ref, mine)]
    for d, pairs in zip((ref, mine), totals):
        lo, hi = d["tau_ci95"]
        assert lo < d["tau"] < hi
        assert (hi - lo) / (2 * 1.96) == pytest.approx(jackknife_se(pairs), rel=0.25)
    c = report["comparison"]
    assert c["reference"] == "ref" and c["prompts"] == 10
    row = c["drafters"][1]
    assert row["delta_tau"] == pytest.approx(mine["tau"] - ref["tau"])
    lo, hi = row["delta_tau_ci95"]
    diffs = [[(cm, rm), (cr, rr)] for (cr, rr), (cm, rm) in zip(*totals)]
    n = len(diffs)

    def delta(ps):
        return sum(m[0] for m, _ in ps) / sum(m[1] for m, _ in ps) - sum(r[0] for _, r in ps) / sum(r[1] for _, r in ps)
    values = [delta(diffs[:i] + diffs[i + 1:]) for i in range(n)]
    jack = math.sqrt((n - 1) / n * sum((v - sum(values) / n) ** 2 for v in values))
    assert (hi - lo) / (2 * 1.96) == pytest.approx(jack, rel=0.25)
    unpaired = math.hypot(*[(d["tau_ci95"][1] - d["tau_ci95"][0]) / (2 * 1.96) for d in (ref, mine)])
    assert (hi - lo) / (2 * 1.96) < unpaired
    assert row["first_position_acceptance"] == mine["per_position"]["acceptance"][0]
    assert c["drafters"][0]["ddtree"] == {"8": ref["ddtree"]["8"]["tau"]}
    out = capsys.readouterr().out
    assert "== side by side over 10 prompts" in out
    assert f"mine − ref: Δτ {row['delta_tau']:+.2f} [{lo:+.2f}, {hi:+.2f}]" in out


def test_the_comparison_survives_a_merge(tmp_path):
    short = drafter_copy(tmp_path, os.path.join(DEMO, "drafter"), "short", block_size=4)
    argv = ["--demo", "--ckpt", "ref=" + os.path.join(DEMO, "drafter"), "--ckpt", f"mine={short}", "--max-new-tokens",
            "48", "--ddtree-budgets", "8"]
    whole = run(tmp_path, "whole", *argv)
    for k in (1, 2):
        run(tmp_path, f"s{k}", *argv, "--shard", f"{k}/2")
    merged = run(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert merged["comparison"] == whole["comparison"] and merged["drafters"] == whole["drafters"]


# ----------------------------------------------------------------------------------------------------
# Flags


@pytest.mark.parametrize("argv,line", [
    (["--threads", "-1"], "--threads -1: must be at least 1"),
    (["--threads", "0"], "--threads 0: must be at least 1"),
    (["--temperature", "nan"], "--temperature nan: must be a finite number >= 0"),
    (["--temperature", "-0.5"], "--temperature -0.5: must be a finite number >= 0"),
    (["--temperature", "inf"], "--temperature inf: must be a finite number >= 0"),
    (["--temperature", "0.7", "--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--temperature", "0.7", "--top-p", "nan"], "--top-p nan: must be in (0, 1]"),
    (["--temperature", "0.7", "--top-k", "-1"], "--top-k -1: must be at least 0"),
    (["--temperature", "0.7", "--samples-per-prompt", "0"], "--samples-per-prompt 0: must be at least 1"),
    (["--max-memory-gb", "nan"], "--max-memory-gb nan: must be a finite number above 0"),
    (["--limit", "0"], "--limit 0: must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
    (["--server", "http://x", "--server-timeout", "inf"], "--server-timeout inf: must be a finite number"),
    (["--mask-token-id", "-3"], "--mask-token-id -3: must be at least 0"),
    # flags the mode would ignore
    (["--load-hidden", "h.safetensors", "--prompts", "p.jsonl"], "--load-hidden takes the prompts and references "
                                                                  "from the saved file (they were fixed at extraction); "
                                                                  "drop --prompts"),
    (["--load-hidden", "h.safetensors", "--max-new-tokens", "64"], "; drop --max-new-tokens"),
    (["--load-hidden", "h.safetensors", "--save-references", "r.jsonl", "--seed", "3"],
     "drop --save-references, --seed"),
    (["--server-model", "q"], "these flags set up --server, not given; drop --server-model"),
    (["--compare-hidden", "a.safetensors", "b.safetensors", "--resume"], "; drop --resume"),
])
def test_bad_flags_are_one_line(argv, line, capsys):
    assert ed.main(["--demo", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and line in err[0], err


def test_merge_refuses_every_other_flag(capsys):
    assert ed.main(["--merge", "a.json", "--limit", "3", "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --merge rebuilds a report from shard outputs alone; drop --limit, --temperature"]


def test_harmless_ignored_flags_are_named_in_a_note(tmp_path, capsys):
    assert ed.main(["--demo", "--limit", "2", "--max-new-tokens", "24", "--seed", "7"]) == 0
    assert "note: --seed 7 does nothing at --temperature 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# What the report says


def test_walk_mode_says_what_its_rows_cover(capsys):
    assert ed.main(["--demo", "--limit", "2", "--max-new-tokens", "40", "--anchors", "walk", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "per-position rows and tau_all_anchors cover the anchors the walks visited (--anchors walk)" in out
    assert ed.main(["--demo", "--limit", "2", "--max-new-tokens", "40", "--quiet"]) == 0
    assert "walks visited" not in capsys.readouterr().out


def test_interrupt_says_how_to_go_on_and_nothing_finished_is_one_line(tmp_path, monkeypatch, capsys):
    real, _ = interrupt_at(monkeypatch, "evaluate_prompts", 1)
    out = tmp_path / "o.json"
    assert ed.main(["--demo", "--limit", "3", "--max-new-tokens", "24", "--quiet", "--output", str(out)]) == 130
    cap = capsys.readouterr()
    assert cap.out.strip().splitlines() == ["no prompt finished before the interruption: nothing to report"]
    assert "interrupted: reporting the 0 prompts finished so far and 1 references not yet scored; to finish, run the " \
           "same command with --resume" in cap.err
    report = json.loads(out.read_text())
    assert report["interrupted"] and report["drafters"][0]["prompts"] == []
    monkeypatch.setattr(ed, "evaluate_prompts", real)
    interrupt_at(monkeypatch, "evaluate_prompts", 2)
    assert ed.main(["--demo", "--limit", "3", "--max-new-tokens", "24", "--quiet"]) == 130
    assert "interrupted: reporting the 1 prompts finished so far; without --output nothing is kept for later" in \
        capsys.readouterr().err
