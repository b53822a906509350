"""The draft-model baseline: a small causal LM on the target's vocabulary drafting K tokens a round, as vLLM 0.34's
`draft_model` method (and SGLang's STANDALONE chain) runs it, named as drafters are (--ckpt NAME=draft_model:DIR:k=K).

The draft model here is the demo target with its weights disturbed, so it agrees with the target often but not always.
The online loops draft token by token with the draft model's own KV cache over the committed text (greedy: argmax;
probabilistic: a draw from softmax(logits / T)), verify with a fresh target pass, and count rounds. The tool reads
every round from one teacher-forced pass of the draft model; they must agree round by round (greedy, and argmax
drafts on sampled texts) and in expectation (sampled drafts). Then depths, costs, an interruption and the refusals.
"""
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import eval_drafter as ed
from conftest import drafter_settings, interrupted_then_resumed, refused_in_one_line
from drafters import DEMO, DEMO_DRAFTER, demo_pair, on_texts, online_rounds, run_tool, speculative_sampling_runs
from test_sampled import mc_check

TARGET, PROMPTS, N_NEW = os.path.join(DEMO, "target"), os.path.join(DEMO, "prompts.jsonl"), 40


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(directory, model): the demo target, every matrix disturbed by 70% of its own scale."""
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if w.dim() > 1:
                w.add_(0.7 * w.std() * torch.randn(w.shape, generator=g))
    where = str(tmp_path_factory.mktemp("draft_model"))
    model.save_pretrained(where)
    return where, model


@torch.no_grad()
def cached_proposer(model, K, temperature=None):
    """Drafts from the model with its own KV cache: the committed text's new rows in one pass, then K - 1 single
    steps; each draft its argmax, or a draw from softmax(logits / T) (the distribution returned beside it)."""
    def propose(seq, g=None):
        cache = DynamicCache()
        logits = model(torch.tensor([seq]), past_key_values=cache, use_cache=True).logits[0, -1]
        drafts, dists = [], []
        for i in range(K):
            if temperature:
                q = torch.softmax(logits.double() / temperature, -1)
                x = int(torch.multinomial(q, 1, generator=g))
                dists.append(q)
            else:
                x = int(logits.argmax())
            drafts.append(x)
            if i + 1 < K:
                logits = model(torch.tensor([[x]]), past_key_values=cache, use_cache=True).logits[0, -1]
        return (drafts, dists) if temperature else drafts
    return propose


def argv(*extra):
    return ("--target", TARGET, "--prompts", PROMPTS, "--max-new-tokens", str(N_NEW), "--ignore-eos", *extra)


@pytest.mark.parametrize("K", [3, 6])
def test_greedy_rounds_equal_an_online_draft_model_loop(tmp_path, demo, small, K):
    target, _, prompts = demo
    where, model = small
    d = run_tool(tmp_path, "g", *argv("--ckpt", f"small=draft_model:{where}:k={K}"))["drafters"][0]
    assert (d["generation"], d["drafts_per_round"], d["head"]["draft_sample_method"]) == ("draft_model", K, "greedy")
    online = [online_rounds(target, cached_proposer(model, K), ids, N_NEW, K) for ids in prompts]
    assert [p["rounds"] for p in d["prompts"]] == online
    flat = [r for rounds in online for r in rounds]
    assert min(flat) == 1 and max(flat) == K + 1 and len(set(flat)) >= 3   # misses, full blocks: teeth


def test_argmax_drafts_on_sampled_texts_equal_an_online_sampled_loop(tmp_path, demo, small):
    """vLLM's default greedy drafts at temperature 0.8: one-hot proposals, each round fixed by the sampled text."""
    target, rows, prompts = demo
    where, model = small
    greedy = cached_proposer(model, 3)

    def propose(seq, g):
        drafts = greedy(seq)
        return drafts, [torch.nn.functional.one_hot(torch.tensor(x), 64).double() for x in drafts]
    runs = speculative_sampling_runs(target, prompts, (0.8, 1.0, 0), 10, 32, 3, lambda: propose, seed=5400)
    report = on_texts(tmp_path, "argmax", f"draft_model:{where}:k=3", rows, runs, (0.8, 1.0, 0), "argmax")
    for (_, _, counted), p in zip(runs, report["drafters"][0]["prompts"]):
        assert p["rounds"] == counted and p["expected_rounds"] == len(counted), p["id"]


def test_sampled_drafts_expected_rounds_match_an_online_sampled_loop(tmp_path, demo, small):
    """draft_sample_method probabilistic (--draft-policy sample): drafts drawn at the temperature alone; the tool's
    E[rounds | text] against 120 runs of the online loop."""
    target, rows, prompts = demo
    where, model = small
    sampling = (0.8, 1.0, 0)
    runs = speculative_sampling_runs(target, prompts, sampling, 120, 32, 3,
                                     lambda: cached_proposer(model, 3, sampling[0]), seed=5500)
    report = on_texts(tmp_path, "sampled", f"draft_model:{where}:k=3", rows, runs, sampling, "sample")
    assert report["drafters"][0]["head"]["draft_sample_method"] == "probabilistic"
    _, _, sd = mc_check(runs, report)
    assert sd > 0.3


def test_beside_a_drafter_with_depths_and_costs(tmp_path, small):
    """No k=: as many drafts as the model drafter; paired Δτ in the comparison; --depths 3 equals a k=3 run; its
    costs are its own passes (a roofline of its shape; timed passes under --costs measure)."""
    where, _ = small
    one = run_tool(tmp_path, "side", *argv("--ckpt", f"demo={DEMO_DRAFTER}", "--ckpt", f"dm=draft_model:{where}",
                                           "--depths", "3", "--costs", "gpu:H100"))
    demo, dm = one["drafters"]
    assert dm["drafts_per_round"] == demo["drafts_per_round"] == 7
    assert {r["name"] for r in one["comparison"]["drafters"]} == {"demo", "dm"}
    alone = run_tool(tmp_path, "k3", *argv("--ckpt", f"draft_model:{where}:k=3"))["drafters"][0]
    assert [p["depth_rounds"]["3"] for p in dm["prompts"]] == [p["rounds"] for p in alone["prompts"]]
    costs = one["config"]["costs_used"]["batch_sizes"]["1"]["draft"]["dm"]
    assert 0 < costs["3"] < costs["7"]
    measured = run_tool(tmp_path, "m", *argv("--ckpt", f"dm=draft_model:{where}:k=3", "--limit", "1",
                                             "--costs", "measure"))
    assert measured["config"]["costs_used"]["draft"]["dm"]["3"] > 0


def test_interrupted_in_the_middle_then_resumed(tmp_path, small, monkeypatch):
    """Ctrl-C in the third prompt's teacher-forced pass: two prompts kept; --resume gives the whole run's numbers."""
    where, _ = small
    base = argv("--ckpt", f"dm=draft_model:{where}:k=4", "--quiet")
    whole = run_tool(tmp_path, "whole", *base)
    out = tmp_path / "cut.json"
    resumed = interrupted_then_resumed(monkeypatch, [*base, "--output", str(out)], out, "model_drafts", 3, 2)
    assert resumed["drafters"] == whole["drafters"]


def test_refusals_are_one_line(tmp_path, small, capsys):
    from transformers import AutoConfig
    refused_in_one_line(capsys, [*argv("--ckpt", f"draft_model:{tmp_path}/none:k=3")],
                        "draft_model takes a causal LM's")
    cfg = AutoConfig.from_pretrained(TARGET)
    cfg.vocab_size = 80
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "wide")
    refused_in_one_line(capsys, [*argv("--ckpt", f"draft_model:{tmp_path}/wide:k=3")],
                        "has a vocabulary of 80 tokens, the target 64")
    refused_in_one_line(capsys, [*argv("--ckpt", f"draft_model:{small[0]}")], "give its drafts a round as k=")


def test_chunked_logits_give_the_same_drafts_and_chances(small, demo, monkeypatch):
    """model_drafts reads the draft model's logits a chunk of rows at a time: 7 rows a chunk, the same as 256."""
    target, _, prompts = demo
    settings = drafter_settings(temperature=0.8, draft_policy="sample")
    d = ed.load_drafter(f"dm=draft_model:{small[0]}:k=4", target.config, settings)
    ids = prompts[0] + prompts[1] + prompts[2]
    whole = ed.model_drafts(d, ids)
    monkeypatch.setattr(ed, "LOGIT_ROWS_PER_CHUNK", 7)
    chunked = ed.model_drafts(d, ids)
    assert torch.equal(whole[0], chunked[0]) and torch.allclose(whole[1], chunked[1], rtol=1e-6, atol=0)
    assert (whole[0][:-4] >= 0).all() and (whole[1] > 0).any()
