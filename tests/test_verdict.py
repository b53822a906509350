"""A verdict that never misleads (issue 59): a drafter slower than plain decoding is never called best, and no interval
leaves what its quantity can be (tau >= 1, a speedup > 0). Coverage is checked by simulation against the true tau of
a walk drawn from known acceptance probabilities, and the speedups recomputed from the report's own tau and costs."""
import json
import os
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
    row = ed.speedup(1.01, low, t, {"3": 0.05, "name": "x"}, "4", "3", None)
    assert 0 < row["speedup_ci95"][0] <= row["speedup"] <= row["speedup_ci95"][1]
    assert ed.ratio_ci95([0.0, 0.001, 0.0], [1.0, 1.0, 1.0], floor=0.0)[0] >= 0
    assert ed.bounded_ci95(1.5, 0.1, 1.0) == pytest.approx([1 + 0.5 / 1.2214027581601699, 1 + 0.5 * 1.2214027581601699])


def test_tau_by_reply_position_is_recomputed_from_the_rounds(tmp_path, capsys, monkeypatch):
    """Small reply buckets, so the demo's 64-token replies fill three; each bucket's tau and rounds recomputed from
    the per-prompt rounds, each round placed where it starts in the reply; two copies of one drafter never flip."""
    monkeypatch.setattr(ed, "REPLY_BUCKETS", ((16, "<16"), (40, "16-40"), (float("inf"), ">=40")))
    drafter = os.path.join(os.path.dirname(__file__), "fixtures", "demo", "drafter")
    out = tmp_path / "r.json"
    capsys.readouterr()
    assert ed.main([*DEMO[:-2], "--ckpt", "a=" + drafter, "--ckpt", "b=" + drafter, "--output", str(out)]) == 0
    report, text = json.loads(out.read_text()), capsys.readouterr().out
    d, want = report["drafters"][0], {}
    for p in d["prompts"]:
        at = 0
        for r in p["rounds"]:
            label = "<16" if at < 16 else "16-40" if at < 40 else ">=40"
            c, n = want.get(label, (0, 0))
            want[label] = (c + r, n + 1)
            at += r
    assert list(d["by_reply"]) == ["<16", "16-40", ">=40"]
    for label, (c, n) in want.items():
        assert d["by_reply"][label]["tau"] == pytest.approx(c / n) and d["by_reply"][label]["rounds"] == n
    c = report["comparison"]
    assert [row["tau"] for row in c["by_reply"]["<16"]] == [d["by_reply"]["<16"]["tau"]] * 2
    assert c["reply_flips"] is False and "tau by position in the reply" in text
    assert "changes with reply length" not in text


def test_a_leader_that_changes_with_reply_length_is_named():
    def drafter(name, taus):
        return {"name": name, "by_reply": {label: {"tau": t} for label, t in zip(("<64", "64-128", "128-256"), taus)}}
    short_strong, long_strong = drafter("early", [7.0, 6.5, 5.0]), drafter("late", [6.0, 6.4, 6.9])
    c = ed.reply_leaders([short_strong, long_strong])
    assert c["reply_leaders"] == {"<64": "early", "64-128": "early", "128-256": "late"} and c["reply_flips"]
    lines = list(ed.reply_lines(c, 7))
    assert "early leads at <64, 64-128; late leads at 128-256" in lines[-1]
    steady = ed.reply_leaders([short_strong, drafter("low", [5.0, 5.0, 4.0])])
    assert not steady["reply_flips"] and "changes" not in "".join(ed.reply_lines(steady, 7))


def test_each_tools_tau_equals_its_own_definition_recomputed_from_the_rounds(tmp_path, capsys):
    """Every convention recomputed here, by each tool's definition as its source reads, from the per-request rounds
    the JSON holds (two samples a prompt, sampled: each sample a request; greedy: each prompt)."""
    for extra in ([], ["--temperature", "0.6", "--samples-per-prompt", "2"]):
        out = tmp_path / "c.json"
        capsys.readouterr()
        assert ed.main([*DEMO, *extra, "--output", str(out)]) == 0
        report, text = json.loads(out.read_text()), capsys.readouterr().out
        d = report["drafters"][0]
        K = d["drafts_per_round"]
        if extra:   # sampled: each request's expected committed tokens and rounds
            requests = [(p["expected_committed"], p["expected_rounds"]) for p in d["prompts"]]
        else:
            requests = [(sum(p["rounds"]), len(p["rounds"])) for p in d["prompts"]]
        C, R = sum(c for c, _ in requests), sum(r for _, r in requests)
        acc = d["per_position"]["accuracy"]
        simulated, running = 0.0, 1.0
        for a in acc:   # SpecForge's _simulated_acc_len: the running product, summed, no +1
            running *= a
            simulated += running
        want = {"pooled": C / R,   # vLLM: 1 + accepted / drafts, accepted = committed - rounds
                "request_mean": sum(1 + (c - r) / r for c, r in requests) / len(requests),
                "sglang_request_mean": sum((1 + c) / r for c, r in requests) / len(requests),
                "trtllm_request_mean": sum((1 + c) / (r + 1) for c, r in requests) / len(requests),
                "draft_acceptance_rate": (C - R) / (R * K), "specforge_eagle3": simulated,
                "specforge_dflash": sum(acc) / len(acc), "speculators_eal": d["tau_all_anchors"]}
        assert d["conventions"] == pytest.approx(want, rel=1e-12)
        assert d["conventions"]["pooled"] == pytest.approx(d["tau"], rel=1e-12)
        assert d["conventions"]["sglang_request_mean"] > d["conventions"]["request_mean"]
        assert "== tau as each tool prints it" in text
        for _, tools, _, _ in ed.CONVENTIONS:
            assert tools in text


def test_the_conventions_page_names_every_figure():
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "conventions.md")).read()
    for key, *_ in ed.CONVENTIONS:
        assert f"| `{key}` |" in page


def test_measured_speedups_widen_by_the_drift_of_their_cost_ratio_over_the_run():
    """A busy box's contention that moves during the measurement (here the drafter's round growing slower, round by
    round) moves the cost ratio; the interval holds every quarter's median ratio (recomputed here), which the
    median's own interval alone does not. The same rounds in shuffled order (no drift) keep the median's interval."""
    import statistics
    rounds = 48
    plain = [0.010] * rounds
    verify = [0.012] * rounds
    drift = [0.002 + 0.004 * i / rounds for i in range(rounds)]   # 2 ms growing to 6 ms
    t = {"target": {"1": 0.010, "4": 0.012}, "runs": {"target": {"1": plain, "4": verify}, "draft": {"x": {"3": drift}}}}
    draft = {"3": statistics.median(drift), "name": "x"}
    row = ed.speedup(3.0, [2.9, 3.1], t, draft, "4", "3", ed.round_ratios(t, draft, "4", "3"))
    ratios = [a / (b + c) for a, b, c in zip(plain, verify, drift)]
    quarters = [statistics.median(ratios[i * 12:(i + 1) * 12]) for i in range(4)]
    lo, hi = row["ratio_ci95"]
    assert lo <= min(quarters) and max(quarters) <= hi
    _, (mlo, mhi) = ed.median_ci95(ratios)
    assert lo < mlo and hi > mhi   # wider than the median's own interval: the drift is in it
    shuffled = drift[:]
    random.Random(0).shuffle(shuffled)
    t["runs"]["draft"]["x"]["3"] = shuffled
    calm = ed.speedup(3.0, [2.9, 3.1], t, draft, "4", "3", ed.round_ratios(t, draft, "4", "3"))
    quarters = [statistics.median(ratios_q) for ratios_q in (
        [a / (b + c) for a, b, c in zip(plain, verify, shuffled)][i * 12:(i + 1) * 12] for i in range(4))]
    assert calm["ratio_ci95"][1] - calm["ratio_ci95"][0] < hi - lo
    assert calm["ratio_ci95"][0] <= min(quarters) and max(quarters) <= calm["ratio_ci95"][1]


def test_a_conversion_beside_its_source_says_what_the_layouts_reading_costs(tmp_path, capsys):
    """The demo drafter and speculators' own conversion of it (window 32: DFlashConverter, tests/fixtures/speculators):
    the same weights, read otherwise. The load lines say each reading; the pair's paired delta tau is recomputed here
    from the per-prompt rounds."""
    conv = os.path.join(os.path.dirname(__file__), "fixtures", "speculators", "dflash_w32")
    dspark = os.path.join(os.path.dirname(__file__), "fixtures", "families", "dspark_vanilla")
    out = tmp_path / "r.json"
    capsys.readouterr()
    assert ed.main(["--demo", "--ddtree-budgets", "none", "--ckpt", "src=" + os.path.join(os.path.dirname(__file__), "fixtures", "demo", "drafter"), "--ckpt",
                    f"conv={conv}", "--ckpt", f"other={dspark}", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    report = json.loads(out.read_text())
    src, converted, other = report["drafters"]
    assert src["weights_hash"] == converted["weights_hash"] != other["weights_hash"]
    assert "drafter src: DFlash, public layout; sliding window 32 read as z-lab's layout does" in captured.err
    assert "sliding window 32 read as speculators' layout does" in captured.err
    [pair] = report["comparison"]["same_weights"]
    assert pair["drafters"] == ["src", "conv"] and pair["layouts"] == ["public", "speculators"]
    rounds = [[(sum(p["rounds"]), len(p["rounds"])) for p in d["prompts"]] for d in (src, converted)]
    taus = [sum(c for c, _ in r) / sum(n for _, n in r) for r in rounds]
    assert pair["delta_tau"] == pytest.approx(taus[1] - taus[0], rel=1e-12) and pair["delta_tau"] < 0
    assert "conv holds src's weights, read as the speculators layout reads them" in captured.out
