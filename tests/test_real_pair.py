"""The real pair (issue 29, item 2): tests/make_demo.py --real trains a DFlash drafter (tests/fixtures/real_drafter)
for SmolLM2-135M-Instruct on the target's own greedy chat replies to templated instruction prompts."""
import importlib.util
import json
import os

import pytest

import eval_drafter as ed
import make_demo as md

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
HAVE_DRAFTER = os.path.isfile(os.path.join(md.REAL_DRAFTER, "model.safetensors"))


def test_training_prompts_are_deterministic_distinct_and_varied():
    a, b = md.real_prompts(384), md.real_prompts(384)
    assert a == b
    assert len({p["prompt"] for p in a}) == 384
    assert {p["category"] for p in a} == {"code", "math", "explain", "list", "rewrite"}
    assert len({t for _, t in md.REAL_TEMPLATES}) >= 20


def test_the_measured_prompts_are_not_training_text():
    trained = {p["prompt"] for p in md.real_prompts(384)}
    with open(os.path.join(ROOT, "prompts.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    texts = {r.get("prompt") or r["messages"][-1]["content"] for r in rows}
    assert not texts & trained


@pytest.mark.skipif(not HAVE_DRAFTER, reason="tests/fixtures/real_drafter (python tests/make_demo.py --real)")
def test_the_real_drafter_is_in_the_public_layout():
    from safetensors import safe_open
    with open(os.path.join(md.REAL_DRAFTER, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert 8 <= cfg["block_size"] <= 16 and cfg["num_hidden_layers"] in (1, 2) and cfg["hidden_size"] == 576
    assert cfg["num_target_layers"] == 30
    assert cfg["dflash_config"]["target_layer_ids"] == ed.default_layer_ids(30, 3)
    assert cfg["dflash_config"]["mask_token_id"] == md.REAL_MASK_ID
    path = os.path.join(md.REAL_DRAFTER, "model.safetensors")
    with safe_open(path, "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
        assert f.get_slice("fc.weight").get_shape() == [576, 3 * 576]
    assert os.path.getsize(path) <= 15 * 2 ** 20


HAVE_GGUF = os.path.isfile(md.REAL_GGUF) and importlib.util.find_spec("gguf") is not None


@pytest.mark.skipif(not HAVE_GGUF and not os.environ.get("EVAL_DRAFTER_REQUIRE_GGUF"),   # CI: fails, never skips
                    reason="the SmolLM2 GGUF (python tests/fetch_real.py) and the gguf package")
def test_the_mask_token_never_occurs_in_chat_text():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(ed.gguf_target(md.REAL_GGUF, True)[0])
    assert tok.convert_ids_to_tokens(md.REAL_MASK_ID) == "<empty_output>"
    for p in md.real_prompts(64):
        text = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        assert md.REAL_MASK_ID not in tok(text, add_special_tokens=False)["input_ids"]
