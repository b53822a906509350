"""Decisions that hold (issue 42): every predicted speedup carries a 95% interval, a best row is named only when its
interval clears the others', measured costs are paired round by round, and --costs gpu:NAME prices the rounds for an
accelerator from the models' shapes (a roofline), per batch size. The roofline's arithmetic is checked here against a
hand computation for one pass of a Qwen3-8B-shaped target, written out from its config."""
import json

import pytest

import eval_drafter as ed
from conftest import refused_in_one_line

DEMO = ["--demo", "--limit", "3", "--max-new-tokens", "64", "--quiet"]
QWEN3_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936}


def run(tmp_path, *argv, name="out"):
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, "--output", str(out)]) == 0
    return json.loads(out.read_text())


def test_roofline_of_one_pass_equals_the_hand_computation():
    """One plain decoding step of Qwen3-8B on an H100 at a context of 512, and a 16-token verify pass of 32 sequences:
    the bytes, the FLOPs and the fixed cost written out by hand."""
    gpu = ed.gpu_spec("gpu:H100")
    shape = ed.shape_of(QWEN3_8B)
    per_layer = 4096 * (32 + 8) * 128 * 2 + 3 * 4096 * 12288   # q, o and k, v projections; the SwiGLU MLP
    head = 151936 * 4096
    assert shape["dense"] == 36 * per_layer and shape["head"] == head
    kv_token = 36 * 2 * 8 * 128 * 2   # every layer's K and V, 8 KV heads of 128, 2 bytes each
    fixed = (40 + 4 * 36) * 1e-6

    def by_hand(batch, tokens, context):
        read = 2 * (36 * per_layer + head) + batch * context * kv_token
        flops = 2 * batch * tokens * (36 * per_layer + head) + 4 * batch * tokens * (context + tokens) * 32 * 128 * 36
        return max(read / (3.35e12 * 0.8), flops / (989e12 * 0.6)) + fixed

    one = ed.pass_seconds(gpu, shape, 1, 1, 512)
    assert one == pytest.approx(by_hand(1, 1, 512), rel=1e-12)
    assert 5.5e-3 < one < 6.2e-3   # memory-bound: 15.2 GB at 2.68 TB/s, and 0.18 ms of fixed cost
    wide = ed.pass_seconds(gpu, shape, 32, 16, 512)
    assert wide == pytest.approx(by_hand(32, 16, 512), rel=1e-12)
    assert wide > 2 * one   # 512 tokens a pass: compute-bound, where deep blocks stop paying


def test_roofline_reads_moe_and_hybrid_shapes():
    """A mixture of experts reads only the experts its tokens pick (all of them once enough tokens pass); a hybrid's
    linear-attention layers keep a state, not a KV cache that grows with the context."""
    gpu = ed.gpu_spec("gpu:H200")
    moe = ed.shape_of({**QWEN3_8B, "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 1024})
    assert moe["expert"] == 36 * 3 * 4096 * 1024 and moe["picks"] == 4
    assert ed.pass_seconds(gpu, moe, 1, 1, 512) < ed.pass_seconds(gpu, moe, 64, 16, 512)
    hybrid = ed.shape_of({**QWEN3_8B, "layer_types": ["linear_attention"] * 27 + ["full_attention"] * 9,
                          "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
                          "linear_value_head_dim": 128})
    assert hybrid["kv_token"] == 9 * 2 * 8 * 128 * 2 and hybrid["state"] == 27 * 32 * 128 * 128 * 4
    grows = [ed.pass_seconds(gpu, s, 8, 1, 32768) - ed.pass_seconds(gpu, s, 8, 1, 512)
             for s in (ed.shape_of(QWEN3_8B), hybrid)]
    assert grows[1] < grows[0] / 3


def test_every_speedup_has_an_interval_and_a_ranking_per_batch_size(tmp_path, capsys):
    report = run(tmp_path, *DEMO, "--depths", "3", "--costs", "gpu:H100", "--batch-sizes", "1,32")
    d = report["drafters"][0]
    assert set(d["predicted_speedup"]) == {"1", "32"}
    assert report["config"]["costs_used"]["source"].startswith("a roofline for H100 (3.35 TB/s x 0.8")
    for batch in d["predicted_speedup"].values():
        for r in batch["rows"].values():
            lo, hi = r["speedup_ci95"]
            assert lo <= r["speedup"] <= hi
        assert batch["leaders"] and (batch["best"] is None) == (len(batch["leaders"]) > 1)
    printed = capsys.readouterr().out
    assert "predicted speedup at batch size 32" in printed and "costs: a roofline for H100" in printed


def test_a_best_is_named_only_when_its_interval_clears_the_rest(tmp_path):
    """A costs table where depth 7's round costs 1.1 plain steps and depth 3's 2: K=7's interval clears K=3's, so it
    is named; beside it DDTree 8 has the same tau and cost, their intervals overlap, and both are listed as leaders."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"target": {"1": 1.0, "4": 1.0, "8": 1.0, "9": 1.0},
                                 "draft": {"3": 1.0, "7": 0.1}}))
    report = run(tmp_path, *DEMO, "--depths", "3", "--ddtree-budgets", "none", "--costs", str(costs))
    p = report["drafters"][0]["predicted_speedup"]["1"]
    assert p["best"] == "K=7" and p["leaders"] == ["K=7"]
    report = run(tmp_path, *DEMO, "--depths", "3", "--ddtree-budgets", "8", "--costs", str(costs), name="tree")
    p = report["drafters"][0]["predicted_speedup"]["1"]
    assert p["best"] is None and sorted(p["leaders"]) == ["DDTree 8", "K=7"]


def test_rows_of_one_drafter_are_compared_paired_over_the_same_prompts(tmp_path, capsys):
    """Issue 52: on the demo at batch 1 the top row's marginal interval overlaps the next row's, yet both are measured
    on the same prompts, so their difference is paired: the best is named when the paired interval against every
    other row lies above 0. The paired interval is recomputed here from the report's per-prompt rounds (the
    delta-method over prompts for a difference of ratio estimators); a roofline's costs carry no timing spread."""
    report = run(tmp_path, "--demo", "--quiet", "--costs", "gpu:H100", "--batch-sizes", "1,32")
    d = report["drafters"][0]
    one = d["predicted_speedup"]["1"]
    rows = one["rows"]
    ranked = sorted(rows, key=lambda n: -rows[n]["speedup"])
    top, second = ranked[:2]
    assert rows[second]["speedup_ci95"][1] >= rows[top]["speedup_ci95"][0]   # marginally they overlap

    def units(name):   # (committed, rounds) per prompt of one row, from the report's own rounds
        kind, _, size = name.partition(" ")
        per = [p["ddtree_rounds"][size] if kind == "DDTree" else
               p["rounds"] if name == f"K={d['drafts_per_round']}" else p["depth_rounds"][name[2:]]
               for p in d["prompts"]]
        return [(sum(r), len(r)) for r in per]

    def paired(a, b):
        (ua, ub), (ra, rb) = (units(a), units(b)), (rows[a]["ratio"], rows[b]["ratio"])
        n = len(ua)
        ta, tb = (sum(c for c, _ in u) / sum(r for _, r in u) for u in (ua, ub))
        mean_a, mean_b = (sum(r for _, r in u) / n for u in (ua, ub))
        terms = [ra * (ca - ta * xa) / mean_a - rb * (cb - tb * xb) / mean_b for (ca, xa), (cb, xb) in zip(ua, ub)]
        se = (sum(t * t for t in terms) / (n * (n - 1))) ** 0.5
        delta = ta * ra - tb * rb
        return delta, delta - 1.96 * se, delta + 1.96 * se

    for name in ranked[1:]:
        assert rows[name]["below_top"] == pytest.approx(list(paired(top, name)), rel=1e-9, abs=1e-12)
    assert one["best"] == top and one["leaders"] == [top]
    assert all(paired(top, n)[1] > 0 for n in ranked[1:])
    many = d["predicted_speedup"]["32"]   # a leader is a row the paired test cannot tell from the top one
    assert many["leaders"][1:] == [n for n, r in many["rows"].items() if r.get("below_top") and r["below_top"][1] <= 0]
    assert "below_top" not in rows[top]
    printed = capsys.readouterr().out
    assert f"paired speedup differences over the same prompts, {top} minus:" in printed and "<- best" in printed


def test_measured_costs_are_paired_by_round_and_saved_for_another_box(tmp_path):
    """--costs measure keeps each pass's rounds (interleaved: a slow moment falls on a whole round), each row's
    interval comes from the per-round ratios, and --save-costs writes a table that --costs FILE prices the same."""
    saved = tmp_path / "costs.json"
    report = run(tmp_path, *DEMO, "--depths", "3", "--costs", "measure", "--save-costs", str(saved))
    costs = report["config"]["costs_used"]
    runs = costs["runs"]
    assert costs["rounds"] >= ed.COST_ROUNDS[0] and len(runs["target"]["1"]) == costs["rounds"]
    assert all(len(v) == costs["rounds"] for v in runs["draft"]["demo"].values())
    assert costs["target"]["1"] == ed.median_ci95(runs["target"]["1"])[0]
    p = report["drafters"][0]["predicted_speedup"]["1"]
    r = p["rows"]["K=3"]
    ratios = [a / (b + c) for a, b, c in zip(runs["target"]["1"], runs["target"]["4"], runs["draft"]["demo"]["3"])]
    _, (lo, hi) = ed.median_ci95(ratios)
    n = len(ratios)   # widened to hold each quarter's median: the ratio's drift over the run
    quarters = [ed.median_ci95(ratios[i * n // 4:(i + 1) * n // 4])[0] for i in range(4)]
    lo, hi = min(lo, *quarters), max(hi, *quarters)
    tau_lo, tau_hi = report["drafters"][0]["depths"]["3"]["tau_ci95"]
    printed = costs["target"]["1"] / (costs["target"]["4"] + costs["draft"]["demo"]["3"])   # the medians shown
    assert r["target_s"] == costs["target"]["4"] and r["speedup"] == pytest.approx(r["tau"] * printed)
    assert r["speedup_ci95"] == pytest.approx([tau_lo * min(lo, printed), tau_hi * max(hi, printed)])
    again = run(tmp_path, *DEMO, "--depths", "3", "--costs", str(saved), name="again")
    assert again["drafters"][0]["predicted_speedup"] == report["drafters"][0]["predicted_speedup"]


def test_a_spec_file_prices_an_accelerator_of_ones_own(tmp_path, capsys):
    spec = tmp_path / "mine.json"
    spec.write_text(json.dumps({"peak_tflops": 100, "bandwidth_tbs": 1.0, "pass_us": 0, "layer_us": 0}))
    report = run(tmp_path, *DEMO, "--costs", f"gpu:{spec}")
    gpu = report["config"]["costs_used"]["gpu"]
    assert gpu["name"] == "mine.json" and gpu["peak_tflops"] == 100 and gpu["compute_share"] == 0.6
    refused_in_one_line(capsys, [*DEMO, "--costs", "gpu:H900"], "no accelerator named 'H900'; give one of H100")
    spec.write_text(json.dumps({"peak_tflops": 100}))
    refused_in_one_line(capsys, [*DEMO, "--costs", f"gpu:{spec}"], "peak_tflops must be a number above 0")
    refused_in_one_line(capsys, [*DEMO, "--batch-sizes", "8"],
                        "--batch-sizes, --k-by-batch-size and --save-costs go with --costs")
