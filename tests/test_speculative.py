"""Local references by speculative decoding are lossless: token for token what plain greedy decoding gives."""
import json
import os

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "demo")


@pytest.fixture(scope="module")
def demo_pair():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()
    drafter = ed.load_drafter(os.path.join(DEMO, "drafter"), target.config, drafter_settings())
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in open(os.path.join(DEMO, "prompts.jsonl"))]
    return target, drafter, prompts


def test_speculative_equals_plain_greedy_on_the_demo(demo_pair):
    target, drafter, prompts = demo_pair
    for ids in prompts:
        plain = ed.plain_generate(target, ids, 128, set())
        assert ed.speculative_generate(target, drafter, ids, 128, set()) == plain


def test_speculative_equals_plain_with_rejections_and_stops(tiny_target, drafter_a):
    """A random drafter is mostly wrong: nearly every round rolls the cache back. Stop tokens taken from the
    plain output must end both at the same place, also when the stop falls inside an accepted block."""
    model = tiny_target["model"].eval()
    drafter = ed.load_drafter(drafter_a, tiny_target["cfg"], drafter_settings())
    for seed in range(4):
        ids = [4 + (seed * 7 + k * 3) % 50 for k in range(5 + seed)]
        plain = ed.plain_generate(model, ids, 40, set())
        assert ed.speculative_generate(model, drafter, ids, 40, set()) == plain
        for stop_at in (0, 5, 17):
            stop = {plain[stop_at]}
            expected = ed.plain_generate(model, ids, 40, stop)
            assert expected[-1] == plain[stop_at] and len(expected) <= stop_at + 1
            assert ed.speculative_generate(model, drafter, ids, 40, stop) == expected
        for limit in (1, 2, 9):
            assert ed.speculative_generate(model, drafter, ids, limit, set()) == plain[:limit]


def test_cli_reference_generation_modes_agree(tmp_path):
    outs = {}
    for mode in ("speculative", "plain"):
        out = tmp_path / f"{mode}.json"
        assert ed.main(["--demo", "--limit", "4", "--reference-generation", mode, "--quiet", "--output", str(out)]) == 0
        outs[mode] = json.loads(out.read_text())
    assert outs["speculative"]["config"]["reference_generation_used"] == "speculative"
    assert outs["plain"]["config"]["reference_generation_used"] == "plain"
    assert outs["speculative"]["drafters"] == outs["plain"]["drafters"]
