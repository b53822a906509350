"""--adaptive-verification: vLLM 0.34's enable_adaptive_verification for DSpark drafters with a confidence head, at
batch size 1 and temperature 0, replayed over the exact rounds.

The online loop here is written from vLLM's source (v1/worker/gpu/spec_decode/adaptive_verification.py and
models/qwen3_dspark.py), not from the tool: each round the DSpark drafter drafts its block from a fresh target pass
(the engines' step, test_families.engine_propose); the confidence head gives sigmoid(W [row; markov_w1[prev]] + b) a
slot; before the verify, the budget is numpy's argmax over k of (1 + cumsum(cumprod(c))[k - 1]) / (draft + verify
cost of 1 + k tokens), c the previous block's confidences (all 1 for a request's first verify), the verify cost a step
function over the captured sizes (np.searchsorted on 1, 2, 4, 8 and 1 + K); the target verifies the first m drafts
only. The tool's rounds and budgets per prompt equal the loop's, with and without the Markov input; an interruption in
the middle then --resume, shards merged and saved features give the same row; the refusals are one line.
"""
import json
import os

import numpy as np
import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, interrupted_then_resumed, online_draft_hidden, refused_in_one_line
from drafters import DEMO, DEMO_DRAFTER, demo_pair, dspark_with_confidence, run_tool
from test_families import dspark_drafts

N_NEW, N_PROMPTS, K = 48, 5, 8
VERIFY = {1: 0.0010, 2: 0.0012, 4: 0.0016, 8: 0.0026, 9: 0.0027}   # seconds by tokens verified
DRAFT = 0.0005


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("confidence")
    costs = root / "costs.json"
    costs.write_text(json.dumps({"target": {str(n): s for n, s in VERIFY.items()},
                                 "draft": {name: {str(K): DRAFT} for name in ("c", "m")}}))
    return {"c": dspark_with_confidence(root / "c"), "m": dspark_with_confidence(root / "m", markov=True, seed=1),
            "costs": str(costs)}


def argv(paths, *extra):
    return ("--demo", "--ckpt", f"c={paths['c']}", "--ckpt", f"m={paths['m']}", "--max-new-tokens", str(N_NEW),
            "--ignore-eos", "--limit", str(N_PROMPTS), "--ddtree-budgets", "none", "--adaptive-verification",
            "--costs", paths["costs"], *extra)


@pytest.fixture(scope="module")
def whole(paths, tmp_path_factory):
    return run_tool(tmp_path_factory.mktemp("whole"), "whole", *argv(paths))


def budget(previous):
    """get_num_tokens at batch 1: survivals, expected tokens, the padded cost, np.argmax (the first maximum)."""
    survival = np.cumprod(np.asarray(previous, dtype=np.float64))
    expected = 1 + np.concatenate([[0.0], np.cumsum(survival)])
    sizes = np.asarray(sorted(VERIFY), dtype=np.int64)
    padded = np.maximum.accumulate(np.asarray([VERIFY[n] for n in sizes]))
    cost = DRAFT + padded[np.searchsorted(sizes, 1 + np.arange(len(previous) + 1), side="left")]
    return int(np.argmax(expected / cost))


@torch.no_grad()
def online_loop(target, drafter, prompt_ids, markov):
    w, seq = drafter.weights, list(prompt_ids)
    seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    previous, rounds, budgets = [1.0] * K, [], []
    while len(seq) - len(prompt_ids) + K <= N_NEW:
        rows = online_draft_hidden(target, drafter, seq, K)
        drafts = dspark_drafts(rows, seq[-1], target.get_output_embeddings(), w, drafter.head["kind"])[0]
        x = rows.float()
        if markov:
            x = torch.cat([x, w["markov_head.markov_w1.weight"][torch.tensor([seq[-1], *drafts[:-1]])].float()], -1)
        confidence = torch.sigmoid(x @ w["confidence_head.proj.weight"][0].float() + w["confidence_head.proj.bias"])
        m = budget(previous)
        verify = target(torch.tensor([seq + drafts[:m]])).logits[0, len(seq) - 1:].argmax(-1).tolist()
        accepted = next((j for j in range(m) if drafts[j] != verify[j]), m)
        seq += drafts[:accepted] + [verify[accepted]]
        rounds.append(accepted + 1)
        budgets.append(m)
        previous = confidence.tolist()
    return rounds, budgets


def test_rounds_and_budgets_equal_an_online_vllm_loop(paths, whole):
    target, _, prompts = demo_pair()
    settings = drafter_settings(adaptive_verification=True)
    for d, markov in zip(whole["drafters"], (False, True)):
        drafter = ed.load_drafter(paths[d["name"]], target.config, settings)
        assert drafter.head["confidence"] == ("markov" if markov else "plain")
        online = [online_loop(target, drafter, ids, markov) for ids in prompts[:N_PROMPTS]]
        v = d["adaptive_verification"]
        assert v["prompt_rounds"] == [r for r, _ in online] and v["prompt_budgets"] == [b for _, b in online], d["name"]
        budgets = [m for _, b in online for m in b]
        assert len(set(budgets)) >= 3 and min(budgets) < K   # the budget moves: the replay has teeth
        assert v["verified_per_round"] == pytest.approx(sum(budgets) / len(budgets))
        assert v["capture_sizes"] == [1, 2, 4, 8, 9]
        rounds = [n for r, _ in online for n in r]
        spent = sum(DRAFT + VERIFY[next(g for g in sorted(VERIFY) if g >= 1 + m)] for m in budgets)
        assert v["speedup"] == pytest.approx(sum(rounds) * VERIFY[1] / spent)
        assert v["tau"] < d["tau"]   # fewer drafts verified, fewer accepted


def test_an_interruption_shards_and_saved_features_give_the_same_row(tmp_path, monkeypatch, paths, whole):
    out = tmp_path / "cut.json"
    args = [*argv(paths), "--quiet", "--output", str(out)]
    resumed = interrupted_then_resumed(monkeypatch, args, out, "dspark_confidence", 5, 2)
    rows = [d["adaptive_verification"] for d in whole["drafters"]]
    assert [d["adaptive_verification"] for d in resumed["drafters"]] == rows
    for k in (1, 2):
        run_tool(tmp_path, f"s{k}", *argv(paths), "--shard", f"{k}/2")
    merged = run_tool(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert [d["adaptive_verification"] for d in merged["drafters"]] == rows
    hidden = str(tmp_path / "h.safetensors")
    run_tool(tmp_path, "saved", *argv(paths), "--save-hidden", hidden)
    loaded = run_tool(tmp_path, "loaded", "--target", os.path.join(DEMO, "target"), "--load-hidden", hidden,
                      "--ckpt", f"c={paths['c']}", "--ckpt", f"m={paths['m']}", "--ddtree-budgets", "none",
                      "--adaptive-verification", "--costs", paths["costs"])
    assert [d["adaptive_verification"] for d in loaded["drafters"]] == rows


def test_refusals_and_notes(paths, capsys, tmp_path):
    refused_in_one_line(capsys, ["--demo", "--adaptive-verification"], "--adaptive-verification weighs each")
    refused_in_one_line(capsys, ["--demo", "--adaptive-verification", "--costs", "gpu:H100", "--temperature", "0.7"],
                        "temperature 0, without --anchors walk")
    refused_in_one_line(capsys, ["--demo", "--adaptive-verification", "--costs", "gpu:H100", "--quiet"],
                        "no drafter here is a DSpark drafter whose config enables its confidence head")
    report = run_tool(tmp_path, "gpu", "--demo", "--ckpt", f"c={paths['c']}", "--ckpt", f"demo={DEMO_DRAFTER}",
                      "--limit", "2", "--max-new-tokens", "32", "--adaptive-verification", "--costs", "gpu:H100")
    c, demo = report["drafters"]
    assert c["adaptive_verification"]["capture_sizes"] == [1, 2, 4, 8, 9] and "adaptive_verification" not in demo
    assert c["head"]["confidence"] == "plain"
    plain = run_tool(tmp_path, "plain", "--demo", "--ckpt", f"c={paths['c']}", "--limit", "1", "--max-new-tokens", "16")
    assert "confidence" not in plain["drafters"][0]["head"] and "adaptive_verification" not in plain["drafters"][0]
