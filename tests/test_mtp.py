"""The target's own MTP layer as a drafter (Qwen3.5/3.6, Qwen3-Next): its rounds equal an online greedy loop that
keeps the layer's KV cache as the engines do, round by round, and its drafts equal that loop's at every anchor.

The online loop (tests/drafters.py, `mtp_proposer`) is written from vLLM 0.33's target_dependent_ar speculator and
SGLang's NEXTN worker, and runs transformers' own modules of the target's kind (its decoder layer, its zero-centred
RMSNorm, its rotary embedding), the weights read from the checkpoint's mtp.* tensors: not the tool's functions.
The fixture is the hybrid demo target (tests/fixtures/demo_hybrid/target), into whose checkpoint
`python tests/make_demo.py --mtp` wrote a trained MTP layer, as Qwen3.5 checkpoints ship one. Qwen3.5 needs
transformers 5.x; the Qwen3-Next checks (a mixture-of-experts MTP layer) run under 4.x too.
"""
import io
import json
import os
import shutil

import pytest
import torch
import transformers

import eval_drafter as ed
from conftest import drafter_settings, interrupted_then_resumed, refused_in_one_line, scale_weights, write_jsonl
from drafters import mtp_proposer, online_rounds, run_tool, speculative_sampling_runs

HERE = os.path.dirname(os.path.abspath(__file__))
HYBRID = os.path.join(HERE, "fixtures", "demo_hybrid")
TARGET = os.path.join(HYBRID, "target")
PROMPTS = os.path.join(HYBRID, "prompts.jsonl")
needs_qwen35 = pytest.mark.skipif(not hasattr(transformers, "Qwen3_5ForCausalLM"),
                                  reason=f"transformers {transformers.__version__} has no Qwen3.5 model")
N_NEW = 48


@pytest.fixture(scope="module")
def demo():
    """The hybrid demo target (float32, its mtp.* tensors left unloaded by transformers), prompt lines and ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(TARGET)
    with open(PROMPTS) as f:
        rows = [json.loads(line) for line in f]
    return target, rows, [tok(row["prompt"])["input_ids"] for row in rows]


def argv(*extra):
    return ("--target", TARGET, "--prompts", PROMPTS, "--max-new-tokens", str(N_NEW), "--ignore-eos", *extra)


def online_mtp_rounds(target, prompt_ids, n_new, K, path=TARGET):
    propose = mtp_proposer(target, path, K)
    return online_rounds(target, lambda seq: propose(seq)[0], prompt_ids, n_new, K)


@needs_qwen35
@pytest.mark.parametrize("K", [3, 5])
def test_rounds_equal_an_online_mtp_loop(tmp_path, demo, K):
    """--mtp (3 steps by default, SGLang's for Qwen) and --block-size K + 1."""
    target, _, prompts = demo
    report = run_tool(tmp_path, "m", *argv("--mtp", *(["--block-size", str(K + 1)] if K != 3 else [])))
    (d,) = report["drafters"]
    assert (d["name"], d["generation"], d["layout"], d["layers"], d["drafts_per_round"]) == ("mtp", "MTP", "target", [3], K)
    online = [online_mtp_rounds(target, ids, N_NEW, K) for ids in prompts]
    assert [p["rounds"] for p in d["prompts"]] == online
    flat = [r for rounds in online for r in rounds]
    assert len(set(flat)) >= 3 and max(flat) == K + 1   # rounds vary: the comparison has teeth


def random_mtp_target(path, kind):
    """A random tiny target of `kind` (Qwen3.5, or Qwen3-Next with a mixture of experts) with a random MTP layer
    written into its checkpoint, taken from transformers' own modules (their parameter names, fused experts or
    not, are the checkpoint's). Weights are scaled up so that drafts differ from anchor to anchor."""
    import copy
    import importlib
    from safetensors.torch import load_file, save_file
    if kind == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM as cls, Qwen3_5TextConfig as config_cls
        extra = dict(intermediate_size=64, layer_types=["linear_attention", "full_attention"])
    else:
        from transformers import Qwen3NextForCausalLM as cls, Qwen3NextConfig as config_cls
        extra = dict(intermediate_size=64, layer_types=["linear_attention", "full_attention"], num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                     decoder_sparse_step=1, norm_topk_prob=True)
    cfg = config_cls(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                     linear_num_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                     mtp_num_hidden_layers=1, **extra)
    torch.manual_seed(0)
    target = cls(cfg).eval()
    scale_weights(target, 0.3)
    target.save_pretrained(path)
    module, name = importlib.import_module(type(target).__module__), type(target).__name__[:-len("ForCausalLM")]
    layer_cfg = copy.deepcopy(cfg)
    layer_cfg.layer_types = ["full_attention"]
    layer = getattr(module, name + "DecoderLayer")(layer_cfg, 0)
    g = torch.Generator().manual_seed(1)
    mtp = {"layers.0." + k: torch.randn(v.shape, generator=g) * (0.3 if v.dim() > 1 else 0.2)
           for k, v in layer.state_dict().items()}
    H = cfg.hidden_size
    mtp.update({"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.3, "norm.weight": torch.randn(H, generator=g) * 0.2,
                "pre_fc_norm_embedding.weight": torch.randn(H, generator=g) * 0.2,
                "pre_fc_norm_hidden.weight": torch.randn(H, generator=g) * 0.2})
    file = os.path.join(path, "model.safetensors")
    save_file({**load_file(file), **{"mtp." + k: v.contiguous() for k, v in mtp.items()}}, file, metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("kind", [pytest.param("qwen3_5", marks=needs_qwen35), "qwen3_next"])
def test_drafts_equal_the_online_layer_at_every_anchor(tmp_path, kind):
    """At every anchor of a text the tool's K drafts equal those of a fresh online proposer given the text up to
    the anchor: the layer (gated attention, partial rotary, zero-centred norms, Qwen3-Next's experts), the
    post-norm feedback and the chain's attention, on random weights where every draft is a different token."""
    target = random_mtp_target(str(tmp_path / kind), kind)
    K, settings = 4, drafter_settings(block_size=5)
    d = ed.load_drafter(str(tmp_path / kind), target.config, settings)
    assert d.generation == "MTP" and ("layers.0.mlp.gate.weight" in d.weights) == (kind == "qwen3_next")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 48, (40,), generator=g).tolist()
    features = ed.extract_hidden(target, ids, d.layers, 8).features
    anchors = ed.fitting_anchors(8, len(ids), d.block_size)
    embed_w, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    drafts, _ = ed.draft_all_anchors(d, ed.prompt_context(d, features, ids, embed_w), anchors,
                                     torch.tensor(ids)[anchors], embed_w, head)
    online = torch.tensor([mtp_proposer(target, str(tmp_path / kind), K)(ids[:a + 1])[0] for a in anchors.tolist()])
    assert torch.equal(drafts, online)
    assert len(set(online.flatten().tolist())) > 10


def test_a_round_prefill_over_the_cache_equals_the_whole_pass(tmp_path):
    """causal_pass over the rows after a cached pass (one round's window, as --costs measure times it) gives the
    keys, values and outputs of one pass over the whole text."""
    target = random_mtp_target(str(tmp_path / "t"), "qwen3_next")
    d = ed.load_drafter(str(tmp_path / "t"), target.config, drafter_settings())
    ids = torch.randint(0, 48, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    features = torch.cat([ed.extract_hidden(target, ids, d.layers, 4).features[L] for L in d.layers], -1)
    embed_w = target.get_input_embeddings().weight
    whole = ed.causal_pass(d, features, ids, embed_w)[0]
    parts = ed.causal_pass(d, features, ids, embed_w, ed.causal_pass(d, features, ids[:21], embed_w))[0]
    for a, b in zip(whole, parts):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


@needs_qwen35
def test_costs_measured_for_the_mtp_round(tmp_path):
    report = run_tool(tmp_path, "c", *argv("--ckpt", f"mine={os.path.join(HYBRID, 'drafter')}", "--mtp", "--limit", "2",
                                           "--depths", "3", "--ddtree-budgets", "none", "--costs", "measure"))
    draft = report["config"]["costs_used"]["draft"]
    assert set(draft["mtp"]) == {"3"} and set(draft["mine"]) == {"7", "3"} and all(v > 0 for v in draft["mtp"].values())
    rows = report["drafters"][1]["predicted_speedup"]["1"]["rows"]
    assert set(rows) == {"K=3"} and rows["K=3"]["speedup"] > 0


@needs_qwen35
def test_transformers_does_not_load_the_mtp_layer_and_the_tool_reads_it(demo):
    from safetensors import safe_open
    target = demo[0]
    assert not any("mtp" in k for k in target.state_dict())   # dropped at load (_keys_to_ignore_on_load_unexpected)
    d = ed.load_drafter("mtp=" + TARGET, target.config, drafter_settings())
    with safe_open(os.path.join(TARGET, "model.safetensors"), "pt") as f:
        stored = {k[len("mtp."):]: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")}
    assert set(stored) == set(d.weights) and len(stored) == 15
    for k, v in stored.items():   # zero-centred norms: the stored w scales by 1 + w
        assert torch.equal(d.weights[k], 1 + v if "norm" in k.split(".")[-2] else v), k
    assert all(v.abs().max() > 0.01 for k, v in stored.items() if "norm" in k)   # trained: none left at 0


@needs_qwen35
def test_the_mtp_layer_is_identified_by_content(tmp_path):
    """A copy of the target elsewhere, sharded in three files with the mtp.* tensors spread over them, is the same
    drafter (its hash: --resume and --merge compare it); another MTP layer is not."""
    from test_hybrid import clone_checkpoint
    config = ed.read_target_config(TARGET)
    same = ed.load_drafter(f"m={clone_checkpoint(TARGET, str(tmp_path / 'sharded'), shards=3)}", config,
                           drafter_settings())
    assert same.hash == ed.load_drafter(f"m={TARGET}", config, drafter_settings()).hash
    other = edited_target(tmp_path, lambda s: s["mtp.fc.weight"].mul_(1.01))
    assert ed.load_drafter(f"m={other}", config, drafter_settings()).hash != same.hash


# ----------------------------------------------------------------------------------------------------
# Every promise, beside a DFlash drafter: walk mode, depths, saved features, shards, an interruption in the chain


ARGV = ("--target", TARGET, "--ckpt", f"mine={os.path.join(HYBRID, 'drafter')}", "--mtp", "--prompts", PROMPTS,
        "--max-new-tokens", "32", "--ignore-eos", "--limit", "3", "--depths", "2,5")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("no Qwen3.5 model in this transformers")
    return run_tool(tmp_path_factory.mktemp("whole"), "whole", *ARGV)


def results(report):
    return [{k: v for k, v in d.items() if k != "checkpoint"} for d in report["drafters"]]


@needs_qwen35
def test_walk_mode_and_depths(tmp_path, demo, whole):
    """Walk mode gives the same rounds; depths 2 and 5 (past the default 3: a chain runs any number of steps)
    equal the online loop with that many steps."""
    target, _, prompts = demo
    walked = run_tool(tmp_path, "walk", *ARGV, "--anchors", "walk")
    for got, want in zip(walked["drafters"], whole["drafters"]):
        assert [p["rounds"] for p in got["prompts"]] == [p["rounds"] for p in want["prompts"]]
    mtp = whole["drafters"][1]
    assert sorted(mtp["depths"]) == ["2", "3", "5"]
    for depth in (2, 5):
        assert [p["depth_rounds"][str(depth)] for p in mtp["prompts"]] == \
            [online_mtp_rounds(target, ids, 32, depth) for ids in prompts[:3]]


@needs_qwen35
def test_side_by_side_pairs_the_drafters_at_the_same_depth(whole):
    """7 drafts a round against 3 is no comparison: the drafters are also paired at the depths both were
    evaluated at (--depths 2,5, and 3: the fewest, where both draft), each tau the drafter's own at that depth."""
    c = whole["comparison"]
    assert c["drafts_per_round"] == {"mine": 7, "mtp": 3} and sorted(c["at_depth"]) == ["2", "3", "5"]
    for K, (mine, mtp) in c["at_depth"].items():
        assert [mine["name"], mtp["name"]] == ["mine", "mtp"] and mine["delta_tau"] is None
        assert mine["tau"] == pytest.approx(whole["drafters"][0]["depths"][K]["tau"])
        assert mtp["tau"] == pytest.approx(whole["drafters"][1]["depths"][K]["tau"])
        assert mtp["delta_tau"] == pytest.approx(mtp["tau"] - mine["tau"])
        assert mtp["delta_tau_ci95"][0] <= mtp["delta_tau"] <= mtp["delta_tau_ci95"][1]
    out = io.StringIO()
    ed.print_report(whole, out)
    assert "the drafters draft different numbers of tokens a round (mine 7, mtp 3)" in out.getvalue()
    assert "mtp − mine at depth 5: Δτ" in out.getvalue()


@needs_qwen35
def test_saved_features_and_shards_give_the_same_results(tmp_path, whole):
    saved = tmp_path / "h.safetensors"
    assert results(run_tool(tmp_path, "save", *ARGV, "--save-hidden", str(saved))) == results(whole)
    loaded = [a for a in ARGV if a not in ("--prompts", PROMPTS, "--max-new-tokens", "32", "--ignore-eos")]
    assert results(run_tool(tmp_path, "load", *loaded, "--load-hidden", str(saved))) == results(whole)
    for k in (1, 2):
        run_tool(tmp_path, f"s{k}", *ARGV, "--shard", f"{k}/2")
    merged = run_tool(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert results(merged) == results(whole)


@needs_qwen35
def test_an_interruption_inside_the_chain_loses_nothing(tmp_path, monkeypatch, whole):
    out = tmp_path / "cut.json"   # cut in the third prompt's MTP chain (per prompt: depths 3, 2, 5, feature check)
    resumed = interrupted_then_resumed(monkeypatch, [*ARGV, "--quiet", "--output", str(out)], out, "causal_chain", 9, 2)
    assert results(resumed) == results(whole)


# ----------------------------------------------------------------------------------------------------
# Sampled proposals, the multimodal layout, the load line, refusals


@needs_qwen35
def test_sampled_expected_rounds_match_an_online_sampled_loop(tmp_path, demo):
    from test_sampled import mc_check, sampling_argv
    target, rows, prompts = demo
    sampling = (1.0, 1.0, 0)
    runs = speculative_sampling_runs(target, prompts, sampling, 150, 24, 3,
                                     lambda: mtp_proposer(target, TARGET, 3, sampling), seed=4000)
    refs = [{"id": f"run{i}", "prompt": rows[p]["prompt"], "completion_ids": text} for i, (p, text, _) in enumerate(runs)]
    report = run_tool(tmp_path, "sampled", "--target", TARGET, "--mtp", "--prompts",
                      write_jsonl(tmp_path / "refs.jsonl", refs), "--draft-policy", "sample", *sampling_argv(sampling))
    _, _, sd = mc_check(runs, report)
    assert sd > 0.3   # the runs do vary: the check has power


@needs_qwen35
def test_the_multimodal_layout_gives_the_text_only_drafts(tmp_path, demo):
    """Qwen3.6-27B's layout: Qwen3_5ForConditionalGeneration, the text weights under model.language_model, mtp.*
    at the top level beside model.visual.*: the same drafts at every anchor as the text-only checkpoint. (Through
    the tool's own functions: transformers 5.x gives a multimodal Qwen3.5 directory its Qwen tokenizer class,
    which the word-level demo vocabulary is not.)"""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from test_hybrid import VISION
    target, _, prompts = demo
    text = json.load(open(os.path.join(TARGET, "config.json")))
    text = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "transformers_version", "dtype")}
    mm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=VISION,
                                                       tie_word_embeddings=False)).eval()
    state = load_file(os.path.join(TARGET, "model.safetensors"))
    missing, unexpected = mm.load_state_dict({(k if k == "lm_head.weight" else "model.language_model." + k[len("model."):]):
                                              v for k, v in state.items() if not k.startswith("mtp.")}, strict=False)
    assert not unexpected and all(k.startswith("model.visual.") for k in missing)
    out = str(tmp_path / "mm")
    mm.save_pretrained(out)
    file = os.path.join(out, "model.safetensors")
    save_file({**load_file(file), **{k: v for k, v in state.items() if k.startswith("mtp.")}}, file,
              metadata={"format": "pt"})
    ids = prompts[0] + ed.plain_generate(target, prompts[0], 40, set())
    drafts = []
    for path in (TARGET, out):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        d = ed.load_drafter("mtp=" + path, ed.read_target_config(path), drafter_settings())
        embed_w, head = model.get_input_embeddings().weight, model.get_output_embeddings()
        features = ed.extract_hidden(model, ids, d.layers, len(prompts[0])).features
        anchors = ed.fitting_anchors(len(prompts[0]), len(ids), d.block_size)
        drafts.append(ed.draft_all_anchors(d, ed.prompt_context(d, features, ids, embed_w), anchors,
                                           torch.tensor(ids)[anchors], embed_w, head)[0])
    assert "text_config" in json.load(open(os.path.join(out, "config.json"))) and torch.equal(*drafts)


@needs_qwen35
def test_load_line_and_json(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert ed.main(["--target", TARGET, "--ckpt", "head=" + TARGET, "--prompts", PROMPTS, "--limit", "1",
                    "--max-new-tokens", "16", "--output", str(out), "--export-vllm-synthetic",
                    str(tmp_path / "vllm.json")]) == 0
    err = capsys.readouterr().err
    assert "drafter head: MTP, the target's own layer (mtp.* in its safetensors; transformers does not load it); 3 " \
           "steps a round, the one layer reused; reads the last hidden state after the final norm and feeds its own " \
           "post-norm output back, as vLLM and SGLang draft it; a dense MLP" in err
    assert "references are generated by plain decoding (the speculative loop drafts with DFlash-family drafters; " \
           "head is MTP)" in err
    (d,) = json.loads(out.read_text())["drafters"]
    assert d["head"] == {"norm_output": True, "gate": True} and d["layout"] == "target"
    assert d["ddtree"] is None and "the MTP layer drafts a chain here" in d["ddtree_note"]
    exported = json.loads((tmp_path / "vllm.json").read_text())   # vLLM's MTP reads the target's own checkpoint
    assert exported["method"] == "mtp" and "model" not in exported and exported["num_speculative_tokens"] == 3


def one_line_refusal(capsys, argv, fragment):
    refused_in_one_line(capsys, [*argv, "--quiet", "--limit", "1", "--max-new-tokens", "8"], fragment)


def edited_target(tmp_path, edit):
    """A copy of the hybrid demo target whose tensors edit(state) changes."""
    from safetensors.torch import load_file, save_file
    out = tmp_path / "edited"
    shutil.copytree(TARGET, out)
    state = load_file(str(out / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def test_a_target_without_an_mtp_layer_is_refused(capsys):
    one_line_refusal(capsys, ["--demo", "--mtp"], "is a qwen3 target model, not a drafter, and its checkpoint has no "
                                                  "MTP layer (no mtp.* tensors) to evaluate; give --ckpt a drafter")


def test_deepseek_style_mtp_is_named(tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    out = tmp_path / "ds"
    shutil.copytree(os.path.join(HERE, "fixtures", "demo", "target"), out)
    state = load_file(str(out / "model.safetensors"))
    state["model.layers.6.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    one_line_refusal(capsys, ["--demo", "--ckpt", f"m={out}"], "a DeepSeek-style MTP layer (eh_proj, enorm, hnorm, "
                                                                "shared_head), which this tool does not run yet")


@needs_qwen35
@pytest.mark.parametrize("edit,fragment", [
    (lambda s: s.pop("mtp.layers.0.post_attention_layernorm.weight"),
     "1 missing (layers.0.post_attention_layernorm.weight)"),
    (lambda s: s.update({"mtp.layers.1.input_layernorm.weight": torch.zeros(64)}),
     "whose MTP has several layers (mtp.layers.1.*)"),
    (lambda s: s.update({"mtp.fc.weight": torch.zeros(64, 64)}),
     "tensor fc.weight has shape (64, 64), its config implies (64, 128)"),
])
def test_a_broken_mtp_layer_is_named(tmp_path, capsys, edit, fragment):
    target = edited_target(tmp_path, edit)
    one_line_refusal(capsys, ["--target", target, "--mtp", "--prompts", PROMPTS], fragment)
