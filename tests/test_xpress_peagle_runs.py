"""XPress and P-EAGLE drafters through the rest of the tool (the drafting itself: test_xpress_peagle.py).

- Sampled: P-EAGLE drafting sampled at the target's temperature, over 150 runs of an online sampled loop (each
  round's K drafts drawn from their rows of vLLM's parallel pass, speculative sampling against the target), the
  actual rounds minus the tool's E[rounds | text] sum to 0 within 3 standard errors. XPress drafts greedily at every
  temperature (vLLM does): with --draft-policy argmax on texts an online loop samples, a round's length is fixed by
  the text, and the tool's rounds equal the loop's, round by round.
- Saved features, shards merged and a run interrupted inside the third prompt's proposals then resumed give the
  numbers of one plain run.
- --depths K equals a run with --block-size K + 1; --export-vllm-synthetic says vLLM's method (P-EAGLE: eagle3 with
  parallel_drafting); --costs measure times both.
- The wrong-drafter check: fed another target's features, neither drafts better with them than with them shuffled.
"""
import json
import os

import pytest
import torch

import eval_drafter as ed
from conftest import finished_prompts, stop_in_prompt
from drafters import DEMO, demo_pair, on_texts, run_tool, speculative_sampling_runs
from test_sampled import mc_check
from test_wrong_drafter import permuted_target
from test_xpress_peagle import (PEAGLE, XPRESS, peagle_depth, peagle_proposer, sensitized_xpress,
                                xpress_config, xpress_proposer)

TARGET = os.path.join(DEMO, "target")


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


# ----------------------------------------------------------------------------------------------------
# Sampled


def test_sampled_peagle_expected_rounds_match_an_online_sampled_loop(tmp_path, demo):
    """--temperature 0.8 --draft-policy sample: each of the K drafts drawn from its own row of the one parallel pass
    (vLLM's probabilistic drafts); 150 runs, the tool's E[rounds] of each run's text against its actual rounds."""
    target, rows, prompts = demo
    K, sampling = peagle_depth(PEAGLE), (0.8, 1.0, 0)
    runs = speculative_sampling_runs(target, prompts, sampling, 150, 32, K,
                                     lambda: peagle_proposer(target, PEAGLE, K, sampling), seed=3100)
    report = on_texts(tmp_path, "sampled", PEAGLE, rows, runs, sampling, "sample")
    assert report["drafters"][0]["generation"] == "P-EAGLE" and report["drafters"][0]["drafts_per_round"] == K
    _, _, sd = mc_check(runs, report)
    assert sd > 0.3   # the runs do vary: the check has power


def test_xpress_argmax_drafts_on_sampled_texts_equal_an_online_loop(tmp_path, demo):
    """Argmax drafts against a sampled target: a draft is accepted exactly when the text holds it, so the text fixes
    every round; the tool's rounds, counted rounds and E[rounds] equal the loop's. The XPress fixture with its
    refiner's say doubled (test_xpress_peagle.sensitized_xpress), so the refiner's details show in the rounds."""
    target, rows, prompts = demo
    path = sensitized_xpress(tmp_path)
    passes, topc = xpress_config(path)
    greedy, sampling = xpress_proposer(target, path, passes, topc), (0.8, 1.0, 0)
    K = json.load(open(os.path.join(path, "config.json")))["block_size"] - 1

    def propose(seq, g):
        drafts = greedy(seq)
        return drafts, [torch.nn.functional.one_hot(torch.tensor(x), 64).double() for x in drafts]
    runs = speculative_sampling_runs(target, prompts, sampling, 20, 32, K, lambda: propose, seed=3200)
    report = on_texts(tmp_path, "argmax", path, rows, runs, sampling, "argmax")
    flat = []
    for (_, _, counted), p in zip(runs, report["drafters"][0]["prompts"]):
        assert p["rounds"] == counted, p["id"]
        assert p["expected_rounds"] == len(counted) and p["expected_committed"] == sum(counted)
        flat += counted
    assert len(set(flat)) >= 3 and max(flat) > 2
    assert report["target"]["reference_support"] == 1.0


# ----------------------------------------------------------------------------------------------------
# Saved features, shards, an interruption in the middle


ARGV = ("--demo", "--ckpt", f"x={XPRESS}", "--ckpt", f"p={PEAGLE}", "--max-new-tokens", "40", "--ignore-eos",
        "--limit", "4", "--depths", "3")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return run_tool(tmp_path_factory.mktemp("whole"), "whole", *ARGV)


def results(report):
    return [{k: v for k, v in d.items() if k != "checkpoint"} for d in report["drafters"]]


def test_saved_features_and_shards_give_the_same_results(tmp_path, whole):
    """--save-hidden then --load-hidden, and --shard 1/2, 2/2 merged: the plain run's results, depths included."""
    saved = tmp_path / "h.safetensors"
    assert results(run_tool(tmp_path, "save", *ARGV, "--save-hidden", str(saved))) == results(whole)
    argv = [a for a in ARGV if a not in ("--max-new-tokens", "40", "--ignore-eos")]
    assert results(run_tool(tmp_path, "load", *argv, "--load-hidden", str(saved))) == results(whole)
    for k in (1, 2):
        run_tool(tmp_path, f"s{k}", *ARGV, "--shard", f"{k}/2")
    merged = run_tool(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert results(merged) == results(whole)


@pytest.mark.parametrize("generation", ["XPress", "P-EAGLE"])
def test_an_interruption_in_the_proposals_loses_nothing(tmp_path, monkeypatch, whole, generation):
    """Ctrl-C inside the family's proposal step in the third prompt: the two finished prompts stay in the partial
    file, --resume ends with the uninterrupted run's numbers."""
    out, family = tmp_path / "cut.json", ed.FAMILIES[generation]
    real = family.propose
    stopping, calls = stop_in_prompt(out, real)
    monkeypatch.setattr(family, "propose", stopping)
    argv = [*ARGV, "--quiet", "--output", str(out)]
    assert ed.main(argv) == 130
    assert finished_prompts(out) == 2 and len(calls) == 2
    monkeypatch.setattr(family, "propose", real)
    assert ed.main([*argv, "--resume"]) == 0
    assert results(json.loads(out.read_text())) == results(whole)


# ----------------------------------------------------------------------------------------------------
# Depths, the vLLM export, measured costs


def test_a_depth_equals_the_shorter_block(tmp_path, whole):
    """--depths 3 gives each drafter the rounds of a run with --block-size 4 (XPress: a block of 4, its refiner's
    mixer read at that block; P-EAGLE: the bonus row and 2 mask slots)."""
    short = run_tool(tmp_path, "short", *ARGV[:-2], "--block-size", "4")
    for d, s in zip(whole["drafters"], short["drafters"]):
        assert s["drafts_per_round"] == 3 and d["drafts_per_round"] > 3
        assert [p["depth_rounds"]["3"] for p in d["prompts"]] == [p["rounds"] for p in s["prompts"]]
        assert [p["depth_rounds"]["3"] for p in d["prompts"]] != [p["rounds"] for p in d["prompts"]]


@pytest.mark.parametrize("path,method", [(XPRESS, {"method": "dflash"}),
                                         (PEAGLE, {"method": "eagle3", "parallel_drafting": True})],
                         ids=["XPress", "P-EAGLE"])
def test_vllm_export_and_measured_costs(tmp_path, path, method):
    """--export-vllm-synthetic: vLLM's method for the family (P-EAGLE: eagle3 with parallel_drafting), its K, the
    measured per-position rates; --costs measure: a draft cost at each depth, so a predicted speedup for each."""
    export = tmp_path / "vllm.json"
    report = run_tool(tmp_path, "c", "--demo", "--ckpt", f"x={path}", "--limit", "2", "--max-new-tokens", "24",
                      "--depths", "2", "--costs", "measure", "--export-vllm-synthetic", str(export))
    d = report["drafters"][0]
    config = json.loads(export.read_text())
    K = d["drafts_per_round"]
    assert config["method"] == method["method"] and config.get("parallel_drafting") == method.get("parallel_drafting")
    assert config["num_speculative_tokens"] == K and config["model"] == os.path.abspath(path)
    assert config["synthetic_acceptance_rates"] == [round(r, 6) for r in
                                                    d["engine_metrics"]["vllm"]["per_position_acceptance_rate"]]
    assert set(report["config"]["costs_used"]["draft"]["x"]) == {str(K), "2"}
    rows = d["predicted_speedup"]["1"]["rows"]
    assert set(rows) == {f"K={K}", "K=2"} and all(r["speedup"] > 0 for r in rows.values())


# ----------------------------------------------------------------------------------------------------
# The wrong-drafter warning


def test_the_feature_check_sees_another_targets_features(tmp_path, whole):
    """On the demo target with its hidden dimensions permuted (the same text, another target's features) neither
    drafter drafts better with the features than with them shuffled across positions; on their own target both do,
    clearly, and neither is named. (The warning on the permuted target is not asserted: it also needs the features'
    gain bounded under its margin, which XPress's refiner keeps too wide at 320 anchors, reading the anchor and the
    drafts before each slot it accepts about 0.7 of its first drafts there without the features; so would P-EAGLE,
    about 0.55 with its own trained embedding, once the tool reads that embedding.)"""
    other = permuted_target(tmp_path / "other")
    report = run_tool(tmp_path, "other", "--demo", "--target", other, "--ckpt", f"x={XPRESS}", "--ckpt", f"p={PEAGLE}",
                      "--max-new-tokens", "64", "--ddtree-budgets", "none")
    for wrong, right in zip(report["drafters"], whole["drafters"]):
        assert wrong["target_agreement"] == 1.0 and wrong["feature_check"]["anchors"] == 320
        assert wrong["feature_check"]["z"] < ed.FEATURE_CHECK_Z < right["feature_check"]["z"]
        assert not [w for w in right["warnings"] if w.startswith("first-position acceptance")]
