"""--verify fly: vLLM 0.34's FLy (rejection_sample_method "fly") at temperature 0, each drafter's own text.

FLy is lossy: a mismatch the target is unsure of (its entropy over its top-k probabilities at least the threshold) is
deferred and committed, the draft kept, when the next W drafts match. The committed text is then the drafter's own,
not the target's greedy one, so its rounds come from a loop, not from the greedy reference. Held here against an
online FLy loop written from vLLM 0.34's source (fly.py's entropy: the top-k log-probabilities of the full softmax,
natural log, not renormalized; the rejection kernel's rule: a deferral only while i + W < K, a window of native
matches, a failed window committing what the standard rule does, a later deferral in the same round), every target
pass over the whole committed text from scratch: round by round, the deferred mismatches and where the text departs
from the greedy reference. Then an interruption in the middle and --resume, and the refusals.
"""
import json
import math

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, interrupted_then_resumed, online_draft_logits, refused_in_one_line
from drafters import DEMO_DRAFTER, demo_pair, run_tool

N_NEW = 64


@pytest.fixture(scope="module")
def demo():
    target, rows, prompts = demo_pair()
    return target, prompts, ed.load_drafter(DEMO_DRAFTER, target.config, drafter_settings())


def entropy(logits, k):
    """Over the k largest probabilities of the full softmax, natural log, no renormalization."""
    probs = torch.softmax(logits.double(), -1)
    return -sum(float(p) * math.log(float(p)) for p in probs.topk(k).values if p > 0)


@torch.no_grad()
def online_fly(target, drafter, prompt_ids, window, threshold, top_k):
    """Greedy FLy decoding until the next block would pass N_NEW tokens: (rounds, deferred, completion)."""
    K = drafter.block_size - 1
    W = window or min(6, K - 1)
    seq = list(prompt_ids) + [int(target(torch.tensor([prompt_ids])).logits[0, -1].argmax())]
    rounds, deferred = [], 0
    while len(seq) - len(prompt_ids) + K <= N_NEW:
        anchor, drafts = len(seq) - 1, online_draft_logits(target, drafter, seq).argmax(-1).tolist()
        rows = target(torch.tensor([seq + drafts])).logits[0, anchor:]
        best = rows.argmax(-1).tolist()
        kept, open_at, i = 0, None, 0
        while i < K:
            ok = drafts[i] == best[i]
            if open_at is None and not ok:
                if i + W >= K or entropy(rows[i], top_k) < threshold:
                    break
                open_at = i
            elif open_at is not None and not ok:
                break   # the window failed: back to the deferred slot
            elif open_at is not None and i - open_at == W:
                kept, open_at, deferred = i + 1, None, deferred + 1
            elif open_at is None:
                kept = i + 1
            i += 1
        seq += drafts[:kept] + [best[kept]]
        rounds.append(kept + 1)
    return rounds, deferred, seq[len(prompt_ids):]


def first_departure(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("knobs", [(), ("--fly-window", "2", "--fly-threshold", "0"),
                                   ("--fly-window", "1", "--fly-threshold", "0.05", "--fly-top-k", "5")])
def test_rounds_equal_an_online_fly_loop(tmp_path, demo, knobs):
    target, prompts, drafter = demo
    report = run_tool(tmp_path, "f", "--demo", "--verify", "fly", *knobs, "--max-new-tokens", str(N_NEW),
                      "--ignore-eos", "--limit", "6")
    d = report["drafters"][0]
    fly = d["fly"]
    given = dict(zip(knobs[::2], knobs[1::2]))
    window, threshold = int(given.get("--fly-window", 0)) or None, float(given.get("--fly-threshold", 0.3))
    deferred_all = 0
    for p, ids in zip(fly["prompts"], prompts):
        rounds, deferred, text = online_fly(target, drafter, ids, window, threshold, int(given.get("--fly-top-k", 3)))
        assert (p["rounds"], p["deferred"], p["tokens"]) == (rounds, deferred, min(len(text), N_NEW)), p["id"]
        assert deferred or p["first_departure"] is None   # no deferral: the greedy text itself
        deferred_all += deferred
    assert fly["deferred"] == deferred_all and fly["rounds"] == sum(len(p["rounds"]) for p in fly["prompts"])
    if knobs:   # the gate open: deferrals happen, the text departs from the target's
        assert deferred_all > 0 and any(p["first_departure"] is not None for p in fly["prompts"])
        assert fly["tau"] >= d["tau"] - 0.5


def test_departure_is_where_the_fly_text_leaves_the_greedy_text(tmp_path, demo):
    target, prompts, drafter = demo
    report = run_tool(tmp_path, "g", "--demo", "--verify", "standard,fly", "--fly-window", "2", "--fly-threshold", "0",
                      "--max-new-tokens", str(N_NEW), "--ignore-eos", "--limit", "3")
    for p, ids in zip(report["drafters"][0]["fly"]["prompts"], prompts):
        _, _, text = online_fly(target, drafter, ids, 2, 0.0, 3)
        greedy = ed.plain_generate(target, ids, N_NEW, set())
        assert p["first_departure"] == first_departure(text, greedy)


def test_fly_has_its_own_predicted_speedup_row(tmp_path):
    """Its own texts' tau over the K row's cost (the same passes verify them); the loss is beside it, not in it."""
    d = run_tool(tmp_path, "c", "--demo", "--verify", "standard,fly", "--fly-window", "2", "--fly-threshold", "0",
                 "--max-new-tokens", str(N_NEW), "--ignore-eos", "--limit", "3", "--ddtree-budgets", "none",
                 "--costs", "gpu:H100")["drafters"][0]
    K = d["drafts_per_round"]
    rows = d["predicted_speedup"]["1"]["rows"]
    fly, plain = rows[f"K={K} fly"], rows[f"K={K}"]
    assert fly["tau"] == d["fly"]["tau"] != plain["tau"]
    assert fly["speedup"] == pytest.approx(d["fly"]["tau"] * plain["ratio"])
    assert fly["speedup_ci95"] == pytest.approx([x * plain["ratio"] for x in d["fly"]["tau_ci95"]])


def test_an_interruption_in_the_middle_then_resume(tmp_path, monkeypatch):
    out = tmp_path / "cut.json"
    argv = ["--demo", "--verify", "fly", "--fly-window", "2", "--fly-threshold", "0", "--max-new-tokens", "48",
            "--ignore-eos", "--limit", "4", "--quiet", "--output", str(out)]
    whole = run_tool(tmp_path, "whole", *argv[:-2])
    resumed = interrupted_then_resumed(monkeypatch, argv, out, "fly_run", 3, 2)
    assert resumed["drafters"][0]["fly"] == whole["drafters"][0]["fly"]


@pytest.mark.parametrize("argv, fragment", [
    (["--verify", "fly", "--temperature", "0.7"], "runs at temperature 0"),
    (["--fly-window", "2"], "add fly to --verify"),
    (["--verify", "fly", "--fly-window", "7"], "a window below that (7 given)"),
])
def test_refusals_are_one_line(argv, fragment, capsys):
    refused_in_one_line(capsys, ["--demo", "--quiet", "--limit", "1", *argv], fragment)
