"""The baselines a team compares a drafter with first: vLLM 0.34's n-gram prompt lookup (`ngram`) and suffix decoding
(`suffix`, its own-history match), named as drafters are (--ckpt NAME=ngram:k=K,min=N,max=M, NAME=suffix:depth=D).

Their proposals depend on the text alone, so every round is exact from the reference. Each is held against an online
greedy loop on the demo target whose proposer is written here from vLLM 0.34's source (ngram/speculator.py: every n
in [min, max] scored n * (L + 1) + position, the best taken; suffix/speculator.py: every end scored by its common
suffix with the text, capped at the depth, then by the end), by brute force, not by the tool's index; and against an
online sampled loop, where a deterministic proposal's round is fixed by the text. Then the rest of the tool: depths,
a run interrupted in its middle and resumed, saved features, the refusals in one line.
"""
import json
import os

import pytest
import torch

import eval_drafter as ed
from conftest import finished_prompts, refused_in_one_line
from drafters import DEMO, DEMO_DRAFTER, demo_pair, on_texts, online_rounds, run_tool, speculative_sampling_runs

TARGET, PROMPTS, N_NEW = os.path.join(DEMO, "target"), os.path.join(DEMO, "prompts.jsonl"), 40


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


def vllm_ngram(tokens, k, low, high):
    """The kernel's scan: every (n, start) with the n tokens at start equal to the text's last n and a token after
    them, scored n * (L + 1) + start + 1; the best one's following tokens, padded with the last token to k."""
    L, best = len(tokens), None
    for n in range(low, high + 1):
        for start in range(0, L - n):
            if tokens[start:start + n] == tokens[L - n:]:
                score = n * (L + 1) + start + 1
                best = max(best or (0, 0), (score, start + n))
    after = tokens[best[1]:best[1] + k] if best else []
    return after + [tokens[-1]] * (k - len(after))


def vllm_suffix(tokens, k, depth):
    """The own-history scan: for every end in [1, L - 1], m = the common suffix of tokens[:end] and the text (at most
    depth); the longest m >= 1, then the latest end; the tokens from end on, padded with the last token to k."""
    L, best = len(tokens), (0, 0)
    for end in range(1, L):
        m = 0
        while m < depth and m < end and tokens[end - 1 - m] == tokens[L - 1 - m]:
            m += 1
        best = max(best, (m, end)) if m else best
    after = tokens[best[1]:best[1] + k] if best[0] else []
    return after + [tokens[-1]] * (k - len(after))


SPECS = {"ngram:k=3,min=1,max=3": lambda seq: vllm_ngram(seq, 3, 1, 3),
         "ngram:k=7": lambda seq: vllm_ngram(seq, 7, 5, 5),
         "suffix:k=5": lambda seq: vllm_suffix(seq, 5, 24),
         "suffix:k=4,depth=2": lambda seq: vllm_suffix(seq, 4, 2)}


def argv(*extra):
    return ("--target", TARGET, "--prompts", PROMPTS, "--max-new-tokens", str(N_NEW), "--ignore-eos", *extra)


def test_greedy_rounds_equal_online_loops_of_vllms_rules(tmp_path, demo):
    """Each spelling, round by round, against an online loop proposing by the engine's rule; all four in one run,
    each at its own K."""
    target, _, prompts = demo
    report = run_tool(tmp_path, "all", *argv(*[x for i, spec in enumerate(SPECS) for x in ("--ckpt", f"b{i}={spec}")]))
    flat = []
    for d, (spec, propose) in zip(report["drafters"], SPECS.items()):
        K = int(spec.split("k=")[1].split(",")[0])
        assert (d["generation"], d["drafts_per_round"], d["layers"]) == (spec.split(":")[0], K, [])
        online = [online_rounds(target, propose, ids, N_NEW, K) for ids in prompts]
        assert [p["rounds"] for p in d["prompts"]] == online, spec
        flat += [r for rounds in online for r in rounds]
    assert len(set(flat)) >= 4 and max(flat) == 8   # rounds vary, full blocks included: the comparison has teeth


def test_argmax_rounds_on_sampled_texts_equal_an_online_sampled_loop(tmp_path, demo):
    """At temperature 0.8: the proposal carries no probabilities (vLLM verifies it as one-hot), so a draft is
    accepted exactly when the sampled text holds it; the tool's rounds and E[rounds] equal the loop's."""
    target, rows, prompts = demo
    sampling, K = (0.8, 1.0, 0), 3

    def propose(seq, g):
        drafts = vllm_ngram(seq, K, 1, 3)
        return drafts, [torch.nn.functional.one_hot(torch.tensor(x), 64).double() for x in drafts]
    runs = speculative_sampling_runs(target, prompts, sampling, 12, 32, K, lambda: propose, seed=5300)
    report = on_texts(tmp_path, "sampled", "ngram:k=3,min=1,max=3", rows, runs, sampling, "argmax")
    flat = []
    for (_, _, counted), p in zip(runs, report["drafters"][0]["prompts"]):
        assert p["rounds"] == counted and p["expected_rounds"] == len(counted), p["id"]
        flat += counted
    assert len(set(flat)) >= 3


def test_beside_a_drafter_at_its_depth_with_paired_differences(tmp_path):
    """With no k= a baseline drafts as many a round as the first model drafter; the comparison gives its paired
    Δτ; --depths 3 of it equals a k=3 run; its costs are the target's alone."""
    one = run_tool(tmp_path, "side", *argv("--ckpt", f"demo={DEMO_DRAFTER}", "--ckpt", "ngram", "--ckpt", "s=suffix",
                                           "--depths", "3", "--costs", "gpu:H100"))
    demo, ngram, suffix = one["drafters"]
    assert ngram["drafts_per_round"] == suffix["drafts_per_round"] == demo["drafts_per_round"] == 7
    rows = {r["name"]: r for r in one["comparison"]["drafters"]}
    assert set(rows) == {"demo", "ngram", "s"} and rows["ngram"]["delta_tau"] < 0
    alone = run_tool(tmp_path, "k3", *argv("--ckpt", "ngram:k=3"))["drafters"][0]
    assert [p["depth_rounds"]["3"] for p in ngram["prompts"]] == [p["rounds"] for p in alone["prompts"]]
    costs = one["config"]["costs_used"]["batch_sizes"]["1"]["draft"]
    assert set(costs["ngram"].values()) == {0.0} and min(costs["demo"].values()) > 0


def test_interrupted_in_the_middle_then_resumed_and_saved_features(tmp_path, monkeypatch):
    """Ctrl-C inside the third prompt's baseline proposals: the finished prompts kept; --resume gives the whole
    run's numbers; a --save-hidden run read back by --load-hidden too."""
    base = argv("--ckpt", f"demo={DEMO_DRAFTER}", "--ckpt", "n=ngram:min=2,max=3", "--quiet")
    whole = run_tool(tmp_path, "whole", *base)
    out = tmp_path / "cut.json"
    real, calls = ed.lookup_drafts, []

    def stopping(*args):   # one lookup a prompt: the third prompt's, after the demo drafter scored it
        if finished_prompts(out) == 2:
            calls.append(1)
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(ed, "lookup_drafts", stopping)
    assert ed.main([*base, "--output", str(out)]) == 130
    assert calls == [1] and finished_prompts(out) == 2
    monkeypatch.undo()
    assert ed.main([*base, "--output", str(out), "--resume"]) == 0
    resumed = json.loads(out.read_text())
    assert resumed["drafters"] == whole["drafters"]
    hidden = str(tmp_path / "h.safetensors")
    run_tool(tmp_path, "saved", *base, "--save-hidden", hidden)
    loaded = run_tool(tmp_path, "loaded", "--target", TARGET, "--load-hidden", hidden, "--ckpt", f"demo={DEMO_DRAFTER}",
                      "--ckpt", "n=ngram:min=2,max=3")
    assert loaded["drafters"] == whole["drafters"]


@pytest.mark.parametrize("spec, fragment", [
    ("ngram:k=3,size=2", "ngram takes k=, min=, max="),
    ("ngram:k=0", "whole numbers of 1 or more"),
    ("suffix:k=x", "suffix takes k=, depth="),
    ("ngram:min=4,max=2", "min 4 is above max 2"),
    ("ngram:min=3", "give its drafts a round as k="),
])
def test_bad_baseline_spellings_are_one_line(spec, fragment, capsys):
    refused_in_one_line(capsys, [*argv("--ckpt", spec)], fragment)


def test_costs_measured_beside_a_drafter(tmp_path):
    """--costs measure times the target and the model drafter; a baseline's round is the target's alone (its lookup
    is not a pass), and its predicted speedup is tau x a plain step over a verify pass."""
    report = run_tool(tmp_path, "m", *argv("--ckpt", f"demo={DEMO_DRAFTER}", "--ckpt", "ngram", "--limit", "2",
                                           "--ddtree-budgets", "none", "--costs", "measure"))
    costs = report["config"]["costs_used"]
    assert costs["draft"]["ngram"] == {"7": 0.0} and costs["draft"]["demo"]["7"] > 0
    row = report["drafters"][1]["predicted_speedup"]["1"]["rows"]["K=7"]
    assert row["draft_s"] == 0.0 and row["speedup"] > 0
