"""From tau to what to serve: tau at every served depth, the engines' own figures, the exported vLLM profile,
the predicted speedup, and tau by context length."""
import json
import math
import os
import shutil

import pytest
import torch

import eval_drafter as ed
from conftest import ROOT, drafter_settings, interrupt_at, online_rounds
from drafters import demo_pair, public_module, public_rounds

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
N_NEW = 64
BASE = ["--demo", "--max-new-tokens", str(N_NEW), "--ignore-eos", "--ddtree-budgets", "8"]


def run(tmp_path, name, *argv, code=0):
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, "--quiet", "--output", str(out)]) == code
    return json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="module")
def depths_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("depths")
    return run(tmp, "d", *BASE, "--limit", "5", "--depths", "3,5"), run(tmp, "plain", *BASE, "--limit", "5")


def test_depth_rounds_equal_the_public_loop_with_a_shorter_block(depths_run, tmp_path, monkeypatch):
    """--depths 3,5 on the block-8 demo drafter: each depth's rounds equal z-lab's dflash_generate run with the
    drafter's config saying block_size 4 and 6, and an online loop with a block of 1 + K; the trained depth's
    rounds are those of a run without --depths."""
    report, plain = depths_run
    d = report["drafters"][0]
    assert [p["rounds"] for p in d["prompts"]] == [p["rounds"] for p in plain["drafters"][0]["prompts"]]
    assert {k: v for k, v in d.items() if k not in ("depths", "prompts", "engine_metrics")} == \
        {k: v for k, v in plain["drafters"][0].items() if k not in ("prompts", "engine_metrics")}
    assert sorted(d["depths"]) == ["3", "5", "7"] and d["depths"]["7"]["tau"] == d["tau"]
    target, _, prompts = demo_pair()
    public = public_module(monkeypatch)
    drafter = ed.load_drafter(os.path.join(DEMO, "drafter"), target.config, drafter_settings())
    for depth in (3, 5):
        short = tmp_path / f"block{depth + 1}"
        shutil.copytree(os.path.join(DEMO, "drafter"), short)
        cfg = json.loads((short / "config.json").read_text())
        cfg["block_size"] = depth + 1
        (short / "config.json").write_text(json.dumps(cfg))
        for p, prompt_ids in zip(d["prompts"], prompts):
            tokens, lengths = public_rounds(public, str(short), target, prompt_ids, N_NEW + depth + 1)
            assert tokens[:N_NEW] == ed.plain_generate(target, prompt_ids, N_NEW, set())
            assert p["depth_rounds"][str(depth)] == lengths[:len(p["depth_rounds"][str(depth)])], (depth, p["id"])
            rounds, _ = online_rounds(target, ed.replace(drafter, block_size=depth + 1), prompt_ids, N_NEW)
            assert p["depth_rounds"][str(depth)] == rounds
    assert d["depths"]["3"]["tau"] < d["depths"]["5"]["tau"] < d["tau"]


def test_engine_metrics_follow_the_engines_definitions(depths_run):
    """Computed here from the per-prompt rounds, as vLLM's SpecDecodingLogging and SGLang's scheduler log
    define them: a draft is a round, accepted counts drafts (not the bonus), vLLM's per-position rate is
    accepted-at-position-i over drafts."""
    d = depths_run[0]["drafters"][0]
    for key, s in d["depths"].items():
        depth = int(key)
        rounds = [r for p in d["prompts"] for r in (p["rounds"] if depth == 7 else p["depth_rounds"][key])]
        drafts, accepted = len(rounds), sum(r - 1 for r in rounds)
        m = s["engine_metrics"]
        assert m["vllm"]["num_speculative_tokens"] == depth and m["sglang"]["speculative_num_draft_tokens"] == depth + 1
        assert m["vllm"]["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        assert m["vllm"]["per_position_acceptance_rate"] == pytest.approx(
            [sum(r - 1 >= i for r in rounds) / drafts for i in range(1, depth + 1)])
        assert m["vllm"]["avg_draft_acceptance_rate"] == pytest.approx(100 * accepted / (drafts * depth))
        assert m["sglang"]["accept_len"] == pytest.approx(1 + accepted / drafts)
        assert m["sglang"]["accept_rate"] == pytest.approx(accepted / (drafts * depth))
    assert d["engine_metrics"] == d["depths"]["7"]["engine_metrics"]


def vllm_accepts(config):
    """vLLM 0.33's rules for a synthetic profile (config/speculative.py): only its own keys, the method known,
    exactly one of the rates and the length, the rates K long, each in [0, 1], non-increasing."""
    known = {"method", "model", "num_speculative_tokens", "rejection_sample_method", "synthetic_acceptance_rates",
             "synthetic_acceptance_length", "draft_sample_method"}
    rates = config.get("synthetic_acceptance_rates")
    return (set(config) <= known and config["method"] == "dflash" and config["rejection_sample_method"] == "synthetic"
            and config["draft_sample_method"] in ("greedy", "probabilistic")
            and (rates is None) != (config.get("synthetic_acceptance_length") is None)
            and isinstance(config["num_speculative_tokens"], int) and config["num_speculative_tokens"] > 0
            and len(rates) == config["num_speculative_tokens"] and all(0 <= r <= 1 for r in rates)
            and all(a >= b for a, b in zip(rates, rates[1:])))


def test_exported_synthetic_profile(tmp_path):
    out = tmp_path / "vllm.json"
    report = run(tmp_path, "r", *BASE, "--limit", "5", "--depths", "3,5", "--export-vllm-synthetic", str(out),
                 "--export-depth", "5")
    config = json.loads(out.read_text())
    assert vllm_accepts(config) and config["num_speculative_tokens"] == 5
    want = report["drafters"][0]["depths"]["5"]["engine_metrics"]["vllm"]["per_position_acceptance_rate"]
    assert config["synthetic_acceptance_rates"] == pytest.approx(want, abs=1e-6)
    run(tmp_path, "t", *BASE, "--limit", "2", "--export-vllm-synthetic", str(out))
    assert json.loads(out.read_text())["num_speculative_tokens"] == 7   # the trained depth by default


def test_depths_under_sampling_cache_shards_and_resume(tmp_path, monkeypatch):
    """Depths under sampled decoding (expectations), from saved features, through shards, and after an
    interruption in the middle of a run."""
    argv = [*BASE, "--limit", "6", "--depths", "2,4", "--temperature", "1.2", "--draft-policy", "sample"]
    whole = run(tmp_path, "whole", *argv, "--save-hidden", str(tmp_path / "h.safetensors"))
    d = whole["drafters"][0]
    assert sorted(d["depths"]) == ["2", "4", "7"] and d["depths"]["2"]["tau"] < d["depths"]["4"]["tau"] < d["tau"]
    assert "tau_ci95" in d["depths"]["2"] and d["depths"]["2"]["engine_metrics"]["vllm"]["num_speculative_tokens"] == 2
    loaded = run(tmp_path, "loaded", "--target", os.path.join(DEMO, "target"), "--ckpt",
                 f"demo={os.path.join(DEMO, 'drafter')}", "--load-hidden", str(tmp_path / "h.safetensors"),
                 "--ddtree-budgets", "8", "--depths", "2,4", "--temperature", "1.2", "--draft-policy", "sample")
    assert loaded["drafters"] == whole["drafters"]
    for k in (1, 2):
        run(tmp_path, f"s{k}", *argv, "--shard", f"{k}/2")
    merged = run(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert merged["drafters"] == whole["drafters"]
    real, _ = interrupt_at(monkeypatch, "score_drafter", 5)   # the 2nd prompt, at one of its depths
    run(tmp_path, "cut", *argv, code=130)
    monkeypatch.setattr(ed, "score_drafter", real)
    assert run(tmp_path, "cut", *argv, "--resume")["drafters"] == whole["drafters"]


def test_tau_by_context_length(tmp_path, monkeypatch):
    """Buckets of the anchor's position (small ones here, so that the demo's short texts fill three): each
    bucket's tau and first-position acceptance, recomputed from the per-prompt rounds."""
    monkeypatch.setattr(ed, "CONTEXT_BUCKETS", ((24, "<24"), (48, "24-48"), (math.inf, ">=48")))
    report = run(tmp_path, "r", *BASE, "--limit", "6", "--ddtree-budgets", "none")
    d = report["drafters"][0]
    assert list(d["by_context"]) == ["<24", "24-48", ">=48"]
    want = {}
    for p in d["prompts"]:
        a = p["prompt_tokens"]
        for r in p["rounds"]:
            label = "<24" if a < 24 else "24-48" if a < 48 else ">=48"
            c, n = want.get(label, (0, 0))
            want[label] = (c + r, n + 1)
            a += r
    for label, (c, n) in want.items():
        assert d["by_context"][label]["tau"] == pytest.approx(c / n) and d["by_context"][label]["rounds"] == n
    assert sum(b["anchors"] for b in d["by_context"].values()) == d["anchors"]


def test_predicted_speedup_from_a_costs_file(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"batch_sizes": {
        "1": {"target": {"1": 0.010, "4": 0.012, "8": 0.014, "9": 0.015}, "draft": {"3": 0.002, "7": 0.003}},
        "16": {"target": {"1": 0.012, "4": 0.020, "8": 0.030}, "draft": {"demo": {"3": 0.004, "7": 0.006}}}}}))
    report = run(tmp_path, "r", *BASE, "--limit", "4", "--depths", "3", "--costs", str(costs))
    d = report["drafters"][0]
    one, many = d["predicted_speedup"]["1"], d["predicted_speedup"]["16"]
    tau3, tau7, tree = d["depths"]["3"]["tau"], d["tau"], d["ddtree"]["8"]["tau"]
    assert one["rows"]["K=3"]["speedup"] == pytest.approx(tau3 * 0.010 / (0.012 + 0.002))
    assert one["rows"]["K=7"]["speedup"] == pytest.approx(tau7 * 0.010 / (0.014 + 0.003))
    assert one["rows"]["DDTree 8"]["speedup"] == pytest.approx(tree * 0.010 / (0.015 + 0.003))
    assert many["rows"]["K=7"]["speedup"] == pytest.approx(tau7 * 0.012 / (0.030 + 0.006))
    assert many["rows"]["DDTree 8"]["speedup"] is None   # no cost for verifying 9 tokens at this batch size
    top = max(one["rows"], key=lambda k: one["rows"][k]["speedup"])
    assert one["leaders"][0] == top and one["best"] == (top if one["leaders"] == [top] else None)
    assert report["config"]["costs_used"]["batch_sizes"]["16"]["target"]["8"] == 0.030
    out = capsys.readouterr().out
    assert "predicted speedup at batch size 16" in out and "<- best" in out


def test_costs_measured_here(tmp_path):
    report = run(tmp_path, "r", *BASE, "--limit", "3", "--depths", "3", "--costs", "measure")
    costs = report["config"]["costs_used"]
    assert set(costs["target"]) == {"1", "4", "8", "9"} and all(v > 0 for v in costs["target"].values())
    assert set(costs["draft"]["demo"]) == {"7", "3"} and costs["context"] > 0
    rows = report["drafters"][0]["predicted_speedup"]["1"]["rows"]
    assert all(r["speedup"] > 1 for r in rows.values())   # a tau-7 drafter on a target that costs more than it


@pytest.mark.parametrize("argv,fragment", [
    (["--depths", "9"], "--depths 9: drafter demo drafts 7 tokens a round"),
    (["--depths", "0,3"], "--depths takes all or depths >= 1"),
    (["--depths", "3", "--export-vllm-synthetic", "x.json", "--export-depth", "5"],
     "--export-depth 5: drafter demo is not evaluated at depth 5"),
    (["--export-depth", "3"], "--export-depth sets the depth of --export-vllm-synthetic, which is not given"),
    (["--costs", "nope.json"], "--costs takes measure, gpu:NAME or a JSON file"),
    (["--load-hidden", "h.safetensors", "--costs", "measure"], "--costs measure times the target model"),
])
def test_serving_flag_refusals(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ed.main(["--demo", "--quiet", "--limit", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_a_costs_file_without_what_it_needs_is_one_line(tmp_path, capsys):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"target": {"4": 0.1}, "draft": {"3": 0.01}}))
    assert ed.main(["--demo", "--quiet", "--limit", "1", "--costs", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'needs "target" (seconds per n new tokens, "1" among them)' in err[0], err
