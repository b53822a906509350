"""The tool's rounds equal, round by round, those of an online greedy speculative decoding loop.

The loop below is the real thing, written without the tool's offline shortcuts: each round it runs the
target over the tokens committed so far (transformers' output_hidden_states, no hooks), drafts ONE block
from that prefix alone, verifies the block with a second target pass, commits the accepted drafts plus the
target's bonus token, and repeats. Only the drafter's layer math is shared with the tool; its batched form
is checked against a naive one separately (test_drafter_math.py).
"""
import json
import os

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, online_rounds

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "demo")
N_NEW = 48
N_PROMPTS = 6


@pytest.fixture(scope="module")
def demo_target():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()


def demo_drafter(target, block_mask):
    return ed.load_drafter(os.path.join(DEMO, "drafter"), target.config, drafter_settings(block_mask=block_mask))


@pytest.mark.parametrize("block_mask", ["bidirectional", "causal", "auto"])
def test_rounds_equal_online_loop(tmp_path, demo_target, block_mask):
    out = tmp_path / "out.json"
    code = ed.main(["--demo", "--block-mask", block_mask, "--max-new-tokens", str(N_NEW), "--ignore-eos",
                    "--limit", str(N_PROMPTS), "--quiet", "--output", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    tool = report["drafters"][0]["prompts"]
    assert len(tool) == N_PROMPTS
    drafter = demo_drafter(demo_target, block_mask)
    tokenizer_prompts = [json.loads(line) for line in open(os.path.join(DEMO, "prompts.jsonl"))][:N_PROMPTS]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    all_rounds = []
    for row, result in zip(tokenizer_prompts, tool):
        prompt_ids = tok(row["prompt"])["input_ids"]
        assert result["prompt_tokens"] == len(prompt_ids)
        rounds, seq = online_rounds(demo_target, drafter, prompt_ids, N_NEW)
        assert result["rounds"] == rounds, f"prompt {row['id']}"
        all_rounds += rounds
    # The comparison means something only if rounds vary: some rejections, some long accepts.
    assert min(all_rounds) == 1 and max(all_rounds) >= 4
    assert report["target"]["agreement"] == 1.0


def test_demo_tau_well_above_one(tmp_path):
    out = tmp_path / "demo.json"
    assert ed.main(["--demo", "--quiet", "--output", str(out)]) == 0
    d = json.loads(out.read_text())["drafters"][0]
    assert d["tau"] > 2.0
    assert d["per_position"]["acceptance"][0] > 0.5


@pytest.mark.parametrize("pair", ["demo", "random"])
def test_walk_anchors_give_the_same_rounds(tmp_path, pair, request):
    """--anchors walk drafts only the anchors the walks visit; its rounds (chain and every DDTree budget) must
    equal --anchors all, on a confident drafter (demo) and a weak one (random pair, short rounds)."""
    if pair == "demo":
        base = ["--demo", "--limit", "5", "--max-new-tokens", "64", "--ignore-eos"]
    else:
        tiny, drafter = request.getfixturevalue("tiny_target"), request.getfixturevalue("drafter_a")
        prompts = tmp_path / "p.jsonl"
        prompts.write_text("".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 7} w3"}) + "\n" for i in range(4)))
        base = ["--target", tiny["path"], "--ckpt", f"a={drafter}", "--prompts", str(prompts),
                "--max-new-tokens", "40", "--ignore-eos"]
    reports = {}
    for mode in ("all", "walk"):
        out = tmp_path / f"{mode}.json"
        assert ed.main(base + ["--ddtree-budgets", "2,8,32", "--anchors", mode, "--quiet", "--output", str(out)]) == 0
        reports[mode] = json.loads(out.read_text())["drafters"][0]
    every, walked = reports["all"], reports["walk"]
    for p_all, p_walk in zip(every["prompts"], walked["prompts"]):
        assert p_walk["rounds"] == p_all["rounds"]
        assert p_walk["ddtree_rounds"] == p_all["ddtree_rounds"]
    assert walked["tau"] == every["tau"] and walked["ddtree"] == every["ddtree"]
    assert walked["anchors"] < every["anchors"]          # it really drafted fewer anchors
