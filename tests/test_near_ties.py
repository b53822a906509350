"""Near-ties (issue 51): a round whose length a near-tie decided, counted per drafter, held to the online way.

Two implementations of one model differ in the last bits; where the drafter's top-2 logits (or its draft and the
text's token) lie within eval_drafter.NEAR_TIE's share of the top logit, or the target's do, that is enough to flip a
decision. Here the marks are recomputed without the tool's batching: the drafter's logits block by block from a fresh
target pass over the committed tokens (conftest.online_draft_logits), the target's from one plain forward, and the
rounds the report gives are walked with them. A random pair has close logits often, so the counts are not zero.
"""
import json

import torch
from safetensors import safe_open

import eval_drafter as ed
from conftest import drafter_settings, online_draft_logits, write_jsonl


def tied(logits, chosen):
    """Is the choice between the row's argmax and `chosen` (the runner-up where they are one) a near-tie?"""
    top = logits.topk(2).values.double()
    other = top[1] if int(logits.argmax()) == chosen else float(logits[chosen])
    return float(top[0] - other) < ed.NEAR_TIE["float32"] * max(abs(float(top[0])), 10.0)


def test_each_round_a_near_tie_decides_is_counted(tiny_target, drafter_a, tmp_path):
    prompts = tmp_path / "p.jsonl"
    write_jsonl(prompts, [{"id": f"p{i}", "prompt": " ".join(f"w{(7 * i + 3 * k) % 60}" for k in range(5 + i))}
                          for i in range(4)])
    out, saved = tmp_path / "out.json", tmp_path / "h.safetensors"
    assert ed.main(["--target", tiny_target["path"], "--ckpt", f"a={drafter_a}", "--prompts", str(prompts),
                    "--max-new-tokens", "40", "--ignore-eos", "--ddtree-budgets", "none", "--quiet",
                    "--save-hidden", str(saved), "--output", str(out)]) == 0
    d = json.loads(out.read_text())["drafters"][0]
    target = tiny_target["model"]
    drafter = ed.load_drafter(str(drafter_a), target.config, drafter_settings())
    expected = 0
    with safe_open(str(saved), "pt") as f, torch.inference_mode():
        for i, p in enumerate(d["prompts"]):
            ids = f.get_tensor(f"{i}.ids").tolist()
            n = p["prompt_tokens"]
            logits = target(torch.tensor([ids])).logits[0]
            target_ties = [tied(logits[t - 1], ids[t]) for t in range(n, len(ids))]
            assert f.get_tensor(f"{i}.ties").tolist() == target_ties   # the saved marks: the target's own
            anchor = n
            for length in p["rounds"]:
                drafts = online_draft_logits(target, drafter, ids[:anchor + 1])
                slots = range(min(length, drafter.block_size - 1))
                expected += any(tied(drafts[j], ids[anchor + 1 + j]) or target_ties[anchor + j + 1 - n]
                                for j in slots)
                anchor += length
    assert d["near_ties"] == expected and expected > 0
