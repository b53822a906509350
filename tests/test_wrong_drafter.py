"""The wrong-drafter warning compares each drafter with itself: the same sampled anchors drafted again with the
target's features shuffled across positions. A drafter fed another target's features does no better with them
than shuffled and is named; a right drafter that is weak, or sampled at a high temperature, accepts little but
far more with its features than without, and is not.
"""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

import eval_drafter as ed
import make_demo as md
from conftest import ROOT, interrupted_then_resumed

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
FAST = ["--max-new-tokens", "64", "--ddtree-budgets", "none", "--quiet"]


def run(tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, *FAST, "--output", str(out)]) == 0
    return json.loads(out.read_text())


def permuted_target(path, seed=0):
    """The demo target with its hidden dimensions permuted: the same model in another basis, so it writes the same
    text while its features are another target's (what a drafter trained for some other target of these shapes
    reads). Every tensor that reads the hidden state has its columns permuted, every one that writes it its rows."""
    shutil.copytree(os.path.join(DEMO, "target"), path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    order = torch.randperm(64, generator=torch.Generator().manual_seed(seed))
    for name, w in weights.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                          "gate_proj.weight", "up_proj.weight")):
            weights[name] = w[:, order]
        elif name.endswith(("o_proj.weight", "down_proj.weight", "layernorm.weight", "model.norm.weight")):
            weights[name] = w[order]
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return str(path)


def weak_drafter(path, share=0.1):
    """The demo drafter moved back toward its initial weights (make_demo's, same seed) to `share` of its training:
    a right drafter, for this target, that has barely learned."""
    source = os.path.join(DEMO, "drafter")
    cfg = json.load(open(os.path.join(source, "config.json")))
    trained, start = load_file(os.path.join(source, "model.safetensors")), md.random_drafter_weights(cfg, 3)
    md.save_drafter(str(path), cfg, {k: start[k] + share * (w - start[k]) for k, w in trained.items()})
    return str(path)


def test_a_drafter_reading_another_targets_features_is_named(tmp_path, capsys):
    """On a target that writes the demo's text with its features in another basis, the demo drafter does no better
    than with the features shuffled: warned, with both figures; on its own target it reads them and is not."""
    other = permuted_target(tmp_path / "other")
    report = run(tmp_path, "other", "--demo", "--target", other)
    d = report["drafters"][0]
    assert d["target_agreement"] == 1.0
    check = d["feature_check"]
    assert check["anchors"] == 320 and check["z"] < ed.FEATURE_CHECK_Z
    assert check["gain_upper95"] < ed.FEATURE_CHECK_MARGIN
    assert len(d["warnings"]) == 1
    warning = d["warnings"][0]
    assert warning.startswith(f"first-position acceptance {check['first_acceptance']:.3f} with the target's features "
                              f"and {check['first_acceptance_shuffled']:.3f} with them shuffled across positions")
    assert "it does not read this target's features" in warning and warning.endswith(ed.WRONG_DRAFTER_CHECK)
    assert "warning: drafter demo: first-position acceptance" in capsys.readouterr().err
    right = run(tmp_path, "right", "--demo")["drafters"][0]
    assert right["warnings"] == [] and right["feature_check"]["z"] > 10
    assert right["feature_check"]["first_acceptance"] > 0.9 > 0.2 > right["feature_check"]["first_acceptance_shuffled"]


def test_a_weak_right_drafter_is_not_named(tmp_path):
    """The demo drafter a tenth of the way from its initial weights accepts under 0.2 of its first drafts, which the
    old fixed floor (a Wilson bound under 0.2) called a drafter for another target; with its features it still
    accepts several times what it does with them shuffled, so no warning."""
    weak = run(tmp_path, "weak", "--demo", "--ckpt", "weak=" + weak_drafter(tmp_path / "weak"))["drafters"][0]
    first, n = weak["per_position"]["acceptance"][0], weak["anchors"]
    assert first < 0.2 and n > 500
    z = 1.96   # the old rule, a Wilson upper bound under 0.2: fired here
    upper = (first + z * z / (2 * n) + z * (first * (1 - first) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    assert upper < 0.2
    assert weak["warnings"] == []
    check = weak["feature_check"]
    assert check["first_acceptance"] > 2 * check["first_acceptance_shuffled"] and check["z"] > ed.FEATURE_CHECK_Z


def test_the_right_drafter_at_temperature_1_5_is_not_named(tmp_path):
    """Sampled at T 1.5 the demo target's text is nearly noise and the right drafter accepts under 0.1 of its first
    drafts; it still does clearly better with its features than shuffled, so no warning."""
    d = run(tmp_path, "hot", "--demo", "--temperature", "1.5")["drafters"][0]
    assert d["reference_support"] == 1.0 and d["per_position"]["acceptance"][0] < 0.1
    assert d["warnings"] == [] and d["feature_check"]["z"] > ed.FEATURE_CHECK_Z


def test_a_resumed_run_gives_the_same_warning(tmp_path, monkeypatch):
    """The per-prompt counts travel in the partial file: a run stopped after three prompts and resumed gives the
    figures and the warning of the run that was never stopped."""
    other = permuted_target(tmp_path / "other")
    whole = run(tmp_path, "whole", "--demo", "--target", other)["drafters"][0]
    out = tmp_path / "resumed.json"
    resumed = interrupted_then_resumed(monkeypatch, ["--demo", "--target", other, *FAST, "--output", str(out)], out,
                                       "shuffled_features", 4, 3)["drafters"][0]
    assert resumed["feature_check"] == whole["feature_check"] and resumed["warnings"] == whole["warnings"]
    assert len(whole["warnings"]) == 1


def test_the_rule_needs_evidence():
    """No verdict from a handful of anchors, even identical drafts; none when the features clearly help, however
    little is accepted; a verdict when many anchors show they add nothing."""
    trusted = {"target_agreement": 1.0}

    def warns(*per_prompt):
        return bool(ed.acceptance_warning(trusted, ed.feature_check_summary(per_prompt)))
    assert not warns([5, 0, 0, 0, 0, 0])                 # 5 anchors, nothing either way
    assert warns(*[[32, 1, 1, 1, 1, 0]] * 10)            # 320 anchors, the same drafts
    assert warns(*[[32, 2, 2, 2, 2, 4]] * 10)            # right at different anchors, no gain
    assert not warns(*[[32, 3, 1, 3, 1, 2]] * 10)        # 0.09 against 0.03 at the first position: reads them
    assert not ed.acceptance_warning({"target_agreement": 0.5}, ed.feature_check_summary([[32, 1, 1, 1, 1, 0]] * 10))


def test_merged_shards_give_the_same_warning(tmp_path):
    """Shards carry the per-prompt counts to --merge: the merged report has the unsharded run's figures and warning."""
    other = permuted_target(tmp_path / "other")
    base = ["--demo", "--target", other, "--limit", "6"]
    whole = run(tmp_path, "whole", *base)["drafters"][0]
    for k in (1, 2):
        run(tmp_path, f"s{k}", *base, "--shard", f"{k}/2")
    out = tmp_path / "merged.json"
    shards = [str(tmp_path / f"s{k}.json") for k in (1, 2)]
    assert ed.main(["--merge", *shards, "--quiet", "--output", str(out)]) == 0
    merged = json.loads(out.read_text())["drafters"][0]
    assert merged["feature_check"] == whole["feature_check"] and merged["warnings"] == whole["warnings"]
    assert len(whole["warnings"]) == 1


def test_saved_features_give_the_same_warning(tmp_path):
    """--load-hidden: the check shuffles the loaded features as it does the extracted ones."""
    other = permuted_target(tmp_path / "other")
    saved = str(tmp_path / "h.safetensors")
    direct = run(tmp_path, "direct", "--demo", "--target", other, "--limit", "4", "--save-hidden", saved)
    out = tmp_path / "loaded.json"
    assert ed.main(["--target", other, "--ckpt", "demo=" + os.path.join(DEMO, "drafter"), "--load-hidden", saved,
                    "--quiet", "--output", str(out)]) == 0
    loaded = json.loads(out.read_text())["drafters"][0]
    assert loaded["feature_check"] == direct["drafters"][0]["feature_check"]
    assert loaded["warnings"] == direct["drafters"][0]["warnings"] and len(loaded["warnings"]) == 1
