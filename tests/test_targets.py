"""Targets beyond Qwen: any decoder-only transformers model whose layers and final norm the tool can find.

Tiny random Llama and gpt-oss targets built from configs (conftest.other_target). A random drafter on a
random target rarely gets a draft accepted, so rounds alone would say little: the drafts themselves are
compared at every anchor a round visits. The public transformers loop supports Llama targets
(test_public_loop.py checks that one against it too); both are checked here against the online loop in
conftest, which recomputes every target pass from scratch with transformers' own output_hidden_states.
"""
import json

import torch

import eval_drafter as ed
from conftest import drafter_settings, online_rounds, write_jsonl

N_NEW = 40
ROWS = [{"id": f"t{i}", "prompt": " ".join(f"w{(7 * i + 3 * k) % 50}" for k in range(3 + i))} for i in range(5)]


def tool_drafts(model, drafter, ids, n_prompt, anchors):
    """The tool's drafts at `anchors`, from its own teacher-forced extraction."""
    features = ed.extract_hidden(model, ids, drafter.layers, n_prompt).features
    ids_t = torch.tensor(ids)
    drafts, _ = ed.draft_all_anchors(drafter, ed.prompt_context(drafter, features), torch.tensor(anchors),
                                     ids_t[anchors], model.get_input_embeddings().weight, model.get_output_embeddings())
    return drafts.tolist()


def test_rounds_and_drafts_equal_the_online_loop(tmp_path, other_target):
    model = other_target["model"]
    out = tmp_path / "out.json"
    assert ed.main(["--target", other_target["path"], "--ckpt", f"d={other_target['drafter']}", "--prompts",
                    write_jsonl(tmp_path / "p.jsonl", ROWS), "--max-new-tokens", str(N_NEW), "--ignore-eos",
                    "--ddtree-budgets", "none", "--quiet", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["target"]["self_check"]["passed"] and report["target"]["agreement"] == 1.0
    drafter = ed.load_drafter(other_target["drafter"], other_target["cfg"], drafter_settings())
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(other_target["path"])
    visited = 0
    for row, p in zip(ROWS, report["drafters"][0]["prompts"]):
        prompt_ids = tok(row["prompt"])["input_ids"]
        seen = {}
        rounds, seq = online_rounds(model, drafter, prompt_ids, N_NEW, seen)
        assert p["rounds"] == rounds, row["id"]
        anchors = sorted(seen)
        assert tool_drafts(model, drafter, seq, len(prompt_ids), anchors) == [seen[a] for a in anchors], row["id"]
        visited += len(anchors)
    assert visited >= 100


def test_speculative_references_equal_plain_greedy(other_target):
    """The target's KV cache rolls back after rejected drafts (gpt-oss: sliding-window layers too)."""
    model = other_target["model"]
    drafter = ed.load_drafter(other_target["drafter"], other_target["cfg"], drafter_settings())
    for i in range(3):
        ids = [4 + (i * 7 + k * 3) % 50 for k in range(5 + i)]
        plain = ed.plain_generate(model, ids, 30, set())
        assert ed.speculative_generate(model, drafter, ids, 30, set()) == plain
        stop = {plain[11]}
        assert ed.speculative_generate(model, drafter, ids, 30, stop) == ed.plain_generate(model, ids, 30, stop)


def test_features_are_the_layer_outputs(other_target):
    """Layer id L is transformers' hidden_states[L + 1]; the last layer's entry is the normed state."""
    model = other_target["model"]
    ids = list(range(4, 30))
    n_layers = model.config.num_hidden_layers
    x = ed.extract_hidden(model, ids, list(range(n_layers)), 6)
    feats, argmax = x.features, x.argmax
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    for L in range(n_layers):
        torch.testing.assert_close(feats[L], out.hidden_states[L + 1][0], rtol=1e-5, atol=1e-5)
    assert argmax == out.logits[0, 5:-1].argmax(-1).tolist()
