"""EAGLE-3 drafters: the tool's rounds equal an online greedy loop that keeps the drafter's KV cache as the
engines do, round by round, in vLLM's and SGLang's layer-id conventions.

The online loop is written from vLLM 0.33's target_dependent_ar speculator and SGLang's EAGLE worker: after each
verify pass the drafter re-runs over the newly committed window (token j + 1 with the target's captured features
at j, at position j), writing its KV cache at those positions from the target's features; the first draft comes
from the window's last row; each further step feeds back the hidden before the final norm with the previous
draft's embedding, one position on, attending to the cache and its own chain; chain entries are dropped after the
round. The layer is written out naively here (one row at a time, its own KV cache), not with the tool's batched
functions.
"""
import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import eval_drafter as ed
from conftest import drafter_settings, interrupted_then_resumed, refused_in_one_line
from drafters import DEMO, demo_pair, online_rounds, run_tool, speculative_sampling_runs

HERE = os.path.dirname(os.path.abspath(__file__))
EAGLE = os.path.join(HERE, "fixtures", "families", "eagle3")
N_NEW = 48
N_PROMPTS = 5


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


def specforge_copy(tmp_path, nested_ids=None):
    """The fixture as SpecForge exports it: a Llama-style config, the layer as midlayer.*, the captured ids (if
    any) in eagle_config as layer outputs."""
    from safetensors.torch import load_file, save_file
    cfg = json.load(open(os.path.join(EAGLE, "config.json")))
    out = tmp_path / "specforge"
    out.mkdir(exist_ok=True)
    sf = {**cfg["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 64}
    if nested_ids is not None:
        sf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": nested_ids}
    (out / "config.json").write_text(json.dumps(sf))
    state = load_file(os.path.join(EAGLE, "model.safetensors"))
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in state.items()}, str(out / "model.safetensors"))
    return str(out)


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta=10000.0):
    """x (heads, head_dim) at position pos, Qwen3's rotate-half."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = pos * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
    half = hd // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class OnlineEagle:
    """One EAGLE-3 drafter with its own KV cache, one row at a time."""

    def __init__(self, drafter, target):
        self.w, self.d = {k: v.float() for k, v in drafter.weights.items()}, drafter
        self.embed, self.head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        self.cache = {}   # position -> (k (kv heads, hd), v)

    def layer(self, token, g, pos, extra=()):
        """The layer on one row; its k/v are stored at `pos` unless extra is a list (the chain's), where they go."""
        w, p = self.w, "layers.0."
        normed = rms(g, w[p + "hidden_norm.weight"])
        x = torch.cat([rms(self.embed[token], w[p + "input_layernorm.weight"]), normed])
        q = (w[p + "self_attn.q_proj.weight"] @ x).view(4, 16)
        k = (w[p + "self_attn.k_proj.weight"] @ x).view(2, 16)
        v = (w[p + "self_attn.v_proj.weight"] @ x).view(2, 16)
        q, k = rope(rms(q, w[p + "self_attn.q_norm.weight"]), pos), rope(rms(k, w[p + "self_attn.k_norm.weight"]), pos)
        if isinstance(extra, list):
            extra.append((k, v))
            keys = [self.cache[j] for j in sorted(self.cache) if j < pos - len(extra) + 1] + extra
        else:
            self.cache[pos] = (k, v)
            keys = [self.cache[j] for j in sorted(self.cache) if j <= pos]
        K, Vv = torch.stack([kv[0] for kv in keys], 1), torch.stack([kv[1] for kv in keys], 1)   # (2, n, 16)
        outs = []
        for hq in range(4):
            scores = (K[hq // 2] @ q[hq]) / math.sqrt(16)
            outs.append(scores.softmax(-1) @ Vv[hq // 2])
        residual = normed if self.d.head["norm_before_residual"] else g
        h = residual + w[p + "self_attn.o_proj.weight"] @ torch.cat(outs)
        y = rms(h, w[p + "post_attention_layernorm.weight"])
        return h + w[p + "mlp.down_proj.weight"] @ (F.silu(w[p + "mlp.gate_proj.weight"] @ y) * (w[p + "mlp.up_proj.weight"] @ y))

    def logits(self, h):
        return self.w["lm_head.weight"] @ rms(h, self.w["norm.weight"]) if "lm_head.weight" in self.w else \
            self.head @ rms(h, self.w["norm.weight"])


def eagle_proposer(target, drafter, sampling=None):
    """The engines' EAGLE-3 round: the drafter's cache re-prefilled over the newly committed window (token j + 1
    with the target's captured features at j, at position j); draft 1 from the window's last row; each further
    step feeds back the hidden with the previous draft, one position on, its chain entries dropped after the
    round. Greedy: argmax drafts; with `sampling`: each step drawn from softmax(logits / T). (drafts, q)."""
    K, fc, e, done = drafter.block_size - 1, drafter.weights["fc.weight"].float(), OnlineEagle(drafter, target), [0]

    def propose(seq, g=None):
        hs = target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[L + 1][0] for L in sorted(drafter.layers)], -1)
        for j in range(done[0], len(seq) - 1):
            h = e.layer(seq[j + 1], fc @ feats[j], j)
        done[0] = len(seq) - 1
        drafts, qs, chain, pos = [], [], [], len(seq) - 2
        for s in range(K):
            if s:
                pos += 1
                h = e.layer(drafts[-1], h, pos, chain)
            if sampling is None:
                drafts.append(int(e.logits(h).argmax()))
                continue
            qs.append((e.logits(h).double() / sampling[0]).softmax(-1))
            drafts.append(int(torch.multinomial(qs[-1], 1, generator=g)))
        return drafts, qs
    return propose


def online_eagle_rounds(target, drafter, prompt_ids, n_new):
    propose = eagle_proposer(target, drafter)
    return online_rounds(target, lambda seq: propose(seq)[0], prompt_ids, n_new, drafter.block_size - 1)


@pytest.mark.parametrize("layout,engine", [("speculators", "vllm"), ("specforge", "sglang"), ("specforge", "vllm")])
def test_rounds_equal_an_online_loop_with_the_engines_cache(tmp_path, demo, layout, engine):
    """speculators' layout (ids as hidden_states indices, vLLM); SpecForge's with eagle_config ids [1, 3, 4]: SGLang
    reads them as layer outputs (the layers trained with), vLLM's default runner ignores them for its default 2, L//2,
    L-3."""
    target, _, prompts = demo
    path = EAGLE if layout == "speculators" else specforge_copy(tmp_path, [1, 3, 4])
    report = run_tool(tmp_path, "e", "--demo", "--ckpt", f"e={path}", "--engine", engine, "--max-new-tokens",
                      str(N_NEW), "--ignore-eos", "--limit", str(N_PROMPTS), "--block-size", "8")   # 7 steps a round
    d = report["drafters"][0]
    assert d["generation"] == "EAGLE-3" and d["ddtree"] is None
    want = [1, 2, 2] if (layout, engine) == ("specforge", "vllm") else [1, 3, 4]
    assert d["layers"] == want
    drafter = ed.load_drafter(path, target.config, drafter_settings(engine=engine, block_size=8))
    online = [online_eagle_rounds(target, drafter, ids, N_NEW) for ids in prompts[:N_PROMPTS]]
    assert [p["rounds"] for p in d["prompts"]] == online
    flat = [r for rounds in online for r in rounds]
    assert len(set(flat)) >= 3   # rounds vary: the comparison has teeth
    if layout == "speculators":   # as trained: norm_before_residual (SGLang and SpecForge's layout have none)
        assert max(flat) == drafter.block_size


# ----------------------------------------------------------------------------------------------------
# Every promise: walk mode, depths, saved features, shards, an interruption inside the chain


ARGV = ("--demo", "--ckpt", f"e={EAGLE}", "--ckpt", f"d={os.path.join(DEMO, 'drafter')}", "--block-size", "8",
        "--max-new-tokens", "40", "--ignore-eos", "--limit", "4")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return run_tool(tmp_path_factory.mktemp("whole"), "whole", *ARGV, "--depths", "3,5")


def results(report):
    return [{k: v for k, v in d.items() if k != "checkpoint"} for d in report["drafters"]]


def test_walk_mode_gives_the_same_rounds(tmp_path, whole):
    walked = run_tool(tmp_path, "walk", *ARGV, "--anchors", "walk")
    for got, want in zip(walked["drafters"], whole["drafters"]):
        assert [p["rounds"] for p in got["prompts"]] == [p["rounds"] for p in want["prompts"]]


def test_depths_are_shorter_chains(tmp_path, demo, whole):
    target, _, prompts = demo
    e = whole["drafters"][0]
    drafter = ed.load_drafter(EAGLE, target.config, drafter_settings(block_size=8))
    for depth in (3, 5):
        short = ed.replace(drafter, block_size=depth + 1)
        assert [p["depth_rounds"][str(depth)] for p in e["prompts"]] == \
            [online_eagle_rounds(target, short, ids, 40) for ids in prompts[:4]]


def test_saved_features_and_shards_give_the_same_results(tmp_path, whole):
    saved = tmp_path / "h.safetensors"
    assert results(run_tool(tmp_path, "save", *ARGV, "--depths", "3,5", "--save-hidden", str(saved))) == results(whole)
    argv = [a for a in ARGV if a not in ("--max-new-tokens", "40", "--ignore-eos")]
    assert results(run_tool(tmp_path, "load", *argv, "--depths", "3,5", "--load-hidden", str(saved))) == results(whole)
    for k in (1, 2):
        run_tool(tmp_path, f"s{k}", *ARGV, "--depths", "3,5", "--shard", f"{k}/2")
    merged = run_tool(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert results(merged) == results(whole)


def test_an_interruption_inside_the_chain_loses_nothing(tmp_path, monkeypatch, whole):
    out = tmp_path / "cut.json"   # cut in the third prompt's trained depth (each prompt: trained depth, depths 3, 5,
    # the override check's two drafters (--block-size 8 overrides the checkpoint's steps), the feature check's
    argv = [*ARGV, "--depths", "3,5", "--quiet", "--output", str(out)]   # shuffled features)
    assert results(interrupted_then_resumed(monkeypatch, argv, out, "causal_chain", 13, 2)) == results(whole)


# ----------------------------------------------------------------------------------------------------
# Sampled proposals (vLLM's probabilistic drafts)


def test_sampled_expected_rounds_match_an_online_sampled_loop(tmp_path, demo):
    from conftest import write_jsonl
    from test_sampled import mc_check, sampling_argv
    target, rows, prompts = demo
    drafter = ed.load_drafter(EAGLE, target.config, drafter_settings(block_size=6))
    sampling = (0.9, 1.0, 0)
    runs = speculative_sampling_runs(target, prompts, sampling, 150, 32, drafter.block_size - 1,
                                     lambda: eagle_proposer(target, drafter, sampling), seed=3000)
    refs = [{"id": f"run{i}", "prompt": rows[p]["prompt"], "completion_ids": text} for i, (p, text, _) in enumerate(runs)]
    report = run_tool(tmp_path, "sampled", "--target", os.path.join(DEMO, "target"), "--ckpt", f"e={EAGLE}",
                      "--block-size", "6", "--prompts", write_jsonl(tmp_path / "refs.jsonl", refs), "--draft-policy",
                      "sample", *sampling_argv(sampling))
    _, _, sd = mc_check(runs, report)
    assert sd > 0.3   # the runs do vary: the check has power


# ----------------------------------------------------------------------------------------------------
# Loading


def test_load_line_and_json_say_the_conventions(tmp_path, capsys):
    sf = specforge_copy(tmp_path, [1, 3, 4])
    assert ed.main(["--demo", "--ckpt", f"s={EAGLE}", "--ckpt", f"f={sf}", "--limit", "1", "--max-new-tokens", "16",
                    "--output", str(tmp_path / "o.json")]) == 0
    err = capsys.readouterr().err
    assert "drafter s: EAGLE-3, speculators layout; captured layers [1, 3, 4] from eagle_aux_hidden_state_layer_ids " \
           "(hidden_states indices); 3 steps a round; norm_before_residual True" in err
    assert "drafter f: EAGLE-3, SpecForge layout; captured layers [1, 2, 2] from the engines' default (vLLM's default " \
           "runner ignores eagle_config's ids; --engine sglang reads them)" in err
    assert "references are generated by plain decoding" in err
    report = json.loads((tmp_path / "o.json").read_text())
    s, f = report["drafters"]
    assert s["head"] == {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
                         "engine": "vllm"}
    assert f["head"]["norm_before_residual"] is False and report["config"]["engine"] == "vllm"
    assert s["drafts_per_round"] == 3 and s["ddtree"] is None and "EAGLE-3 drafts a chain" in s["ddtree_note"]


@pytest.mark.parametrize("argv,fragment", [
    (["--layers", "1,3"], "fc expects 3 captured layers, --layers gives [1, 3]"),
    (["--layers", "1,3,5"], "captured layer ids [1, 3, 5] (--layers) must lie in 0..4"),
])
def test_refusals_are_one_line(capsys, argv, fragment):
    refused_in_one_line(capsys, ["--demo", "--ckpt", EAGLE, "--quiet", "--limit", "1", *argv], fragment)


def test_a_missing_layer_tensor_is_named(tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    out = tmp_path / "broken"
    shutil.copytree(EAGLE, out)
    state = load_file(str(out / "model.safetensors"))
    state.pop("layers.0.post_attention_layernorm.weight")
    save_file(state, str(out / "model.safetensors"))
    refused_in_one_line(capsys, ["--demo", "--ckpt", str(out), "--quiet", "--limit", "1"],
                        "1 missing (layers.0.post_attention_layernorm.weight)")


def test_a_specforge_training_state_equals_its_export(tmp_path):
    from safetensors.torch import load_file
    from test_layouts import training_state
    export = specforge_copy(tmp_path, [1, 3, 4])
    weights = load_file(os.path.join(export, "model.safetensors"))
    weights.pop("lm_head.weight")   # SpecForge's state keeps lm_head, d2t, t2d; here its head is the target's
    step = training_state(str(tmp_path / "run" / "specforge-run-step600" / "training_state.pt"),
                          {**weights, "lm_head.weight": load_file(os.path.join(EAGLE, "model.safetensors"))["lm_head.weight"]})
    bf16 = tmp_path / "bf16"
    shutil.copytree(export, bf16)
    from safetensors.torch import save_file
    save_file({k: v.to(torch.bfloat16).float().contiguous() for k, v in load_file(str(bf16 / "model.safetensors")).items()},
              str(bf16 / "model.safetensors"))
    report = run_tool(tmp_path, "sf", "--demo", "--limit", "3", "--max-new-tokens", "32", "--engine", "sglang",
                      "--ckpt", f"export={bf16}", "--ckpt", f"state={os.path.dirname(step)}", "--drafter-config",
                      os.path.join(export, "config.json"))
    a, b = report["drafters"]
    assert b["generation"] == "EAGLE-3" and b["layers"] == a["layers"] == [1, 3, 4]
    assert [p["rounds"] for p in b["prompts"]] == [p["rounds"] for p in a["prompts"]]


def test_costs_measured_for_the_eagle3_round(tmp_path):
    """--costs measure times EAGLE-3's round as the engines run it (the window's new rows, then K steps)."""
    report = run_tool(tmp_path, "c", "--demo", "--ckpt", f"e={EAGLE}", "--limit", "2", "--max-new-tokens", "24",
                      "--depths", "2", "--ddtree-budgets", "none", "--costs", "measure")
    assert set(report["config"]["costs_used"]["draft"]["e"]) == {"3", "2"}
    rows = report["drafters"][0]["predicted_speedup"]["1"]["rows"]
    assert set(rows) == {"K=3", "K=2"} and all(r["speedup"] > 0 for r in rows.values())
