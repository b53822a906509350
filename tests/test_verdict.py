"""A verdict that never misleads (issue 59): a drafter slower than plain decoding is never called best, and no interval
leaves what its quantity can be (tau >= 1, a speedup > 0). Coverage is checked by simulation against the true tau of
a walk drawn from known acceptance probabilities, and the speedups recomputed from the report's own tau and costs."""
import json
import random

import pytest

import eval_drafter as ed

DEMO = ["--demo", "--limit", "3", "--max-new-tokens", "64", "--ddtree-budgets", "none", "--depths", "3"]


def run_with_costs(tmp_path, capsys, draft_s):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"target": {"1": 0.010, "4": 0.011, "8": 0.012},
                                 "draft": {"3": draft_s, "7": draft_s}}))
    out = tmp_path / "out.json"
    capsys.readouterr()
    assert ed.main([*DEMO, "--costs", str(costs), "--output", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_a_drafter_slower_than_plain_decoding_is_never_best(tmp_path, capsys):
    report, text = run_with_costs(tmp_path, capsys, draft_s=0.5)   # a round costs 50 plain steps
    d = report["drafters"][0]
    p = d["predicted_speedup"]["1"]
    for name, row in p["rows"].items():   # the speedup recomputed from the report's tau and the costs given
        K = 7 if name == "K=7" else 3
        assert row["speedup"] == pytest.approx(row["tau"] * 0.010 / ({3: 0.011, 7: 0.012}[K] + 0.5))
        assert row["speedup"] < 1
    assert p["plain_decoding_wins"] is True and p["best"] is None
    assert "plain decoding wins: every row predicts a slowdown" in text
    assert "<- best" not in text and "<- a leader" not in text


def test_a_drafter_faster_than_plain_decoding_keeps_its_best_row(tmp_path, capsys):
    report, text = run_with_costs(tmp_path, capsys, draft_s=0.001)
    p = report["drafters"][0]["predicted_speedup"]["1"]
    top = max(p["rows"].values(), key=lambda r: r["speedup"])
    assert top["speedup"] > 1 and p["plain_decoding_wins"] is False
    assert "plain decoding wins" not in text
    assert "<- best" in text or "<- a leader" in text


def walk_units(rng, p, prompts, rounds, K):
    """Per prompt (committed, rounds) of a walk whose position k is accepted with probability p given the earlier
    ones: tau = 1 + sum_k p^k exactly."""
    units = []
    for _ in range(prompts):
        committed = 0
        for _ in range(rounds):
            a = 0
            while a < K and rng.random() < p:
                a += 1
            committed += a + 1
        units.append((committed, rounds))
    return units


@pytest.mark.parametrize("p,prompts,rounds,K", [(0.02, 12, 30, 7), (0.1, 16, 40, 7), (0.6, 12, 30, 7)])
def test_tau_intervals_stay_above_1_and_cover_the_true_tau(p, prompts, rounds, K):
    rng, true = random.Random(59), 1 + sum(p ** k for k in range(1, K + 1))
    covered, symmetric_below = 0, 0
    for _ in range(600):
        units = walk_units(rng, p, prompts, rounds, K)
        lo, hi = ed.ratio_ci95([c for c, _ in units], [r for _, r in units])
        tau = sum(c for c, _ in units) / sum(r for _, r in units)
        assert 1 <= lo <= tau <= hi
        covered += lo <= true <= hi
        # tau +- 1.96 standard errors over prompts, written here: what the bounded interval replaces
        n = len(units)
        se = (sum((c - tau * r) ** 2 for c, r in units) / (n * (n - 1))) ** 0.5 / rounds
        symmetric_below += tau - 1.96 * se < 1
        if p > 0.05:   # away from 1, the same spread as the symmetric interval
            assert (hi - lo) / 2 == pytest.approx(1.96 * se, rel=0.1)
    assert 0.88 <= covered / 600 <= 0.99
    if p == 0.02:   # near 1 the symmetric interval leaves the range often; the bounded one never does
        assert symmetric_below > 60


def test_a_tau_at_its_floor_has_a_point_interval_and_a_speedup_interval_stays_positive():
    assert ed.ratio_ci95([30, 30, 30], [30, 30, 30]) == [1.0, 1.0]
    low = ed.ratio_ci95([31, 30, 30, 30], [30, 30, 30, 30])
    assert low[0] >= 1 and low[1] > 1
    t = {"target": {"1": 0.01, "4": 0.04}}
    row = ed.speedup(1.01, low, t, {"3": 0.05, "name": "x"}, "4", "3")
    assert 0 < row["speedup_ci95"][0] <= row["speedup"] <= row["speedup_ci95"][1]
    assert ed.ratio_ci95([0.0, 0.001, 0.0], [1.0, 1.0, 1.0], floor=0.0)[0] >= 0
    assert ed.bounded_ci95(1.5, 0.1, 1.0) == pytest.approx([1 + 0.5 / 1.2214027581601699, 1 + 0.5 * 1.2214027581601699])
