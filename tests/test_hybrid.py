"""Hybrid targets (Qwen3.5 / Qwen3.6: Gated DeltaNet linear-attention layers plus full attention).

Two checkpoint layouts are covered: the text-only one (model_type qwen3_5_text, keys `model.*`) and the
multimodal one real Qwen3.5 / 3.6 checkpoints ship (model_type qwen3_5, keys `model.language_model.*`,
`model.visual.*`, `lm_head.weight`), which AutoModelForCausalLM loads as its text model.

A hybrid target cannot roll a linear-attention state back, so the online reference loop below recomputes
the target from scratch every round (no cache at all), and the tool's one teacher-forced pass must give the
same rounds.

transformers 4.x has no Qwen3.5 model: the whole module is skipped there.
"""
import json
import os
import shutil

import pytest
import torch

import eval_drafter as ed
from conftest import (IM_END, QWEN_VOCAB, drafter_settings, make_drafter, md, online_rounds,
                      qwen_tokenizer_dir, scale_weights, write_jsonl)

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5 (hybrid) model", allow_module_level=True)

N_WORDS = 6          # a 10-token word vocab: random drafts are sometimes right, so rounds vary
N_NEW = 40
LIVE_TOKENS = [220, 271, 279, 311, 323, 374]  # lm_head rows left non-zero in the Qwen-vocab targets
QWEN_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=1, spatial_merge_size=1)
WORD_PROMPTS = [{"id": f"p{i}", "prompt": " ".join(f"w{(3 * i + j) % N_WORDS}" for j in range(3 + i))}
                for i in range(4)]
QWEN_PROMPTS = [{"id": "q0", "prompt": "Write a haiku about the sea."},
                {"id": "q1", "prompt": "What is 12 times 7?"},
                {"id": "q2", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Name three colours."}]}]


def hybrid_text_kwargs(vocab, hidden=64, **overrides):
    """Layer types come out as 3 x linear_attention + 1 x full_attention (full_attention_interval 4)."""
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              max_position_embeddings=512, eos_token_id=1, tie_word_embeddings=False)
    kw.update(overrides)
    return kw


def copy_qwen_tokenizer(path):
    src = qwen_tokenizer_dir()
    for name in QWEN_FILES:
        shutil.copy(os.path.join(src, name), path)


def run_main(argv, capsys):
    rc = ed.main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def hybrid_warnings(err):
    return [line for line in err.splitlines() if "linear-attention" in line]


def clone_checkpoint(src, dst, drop=(), shards=1, edit_config=None):
    """Copy a target directory, dropping tensors, optionally splitting the weights into `shards` files with
    a model.safetensors.index.json, and optionally editing config.json in place."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, name), dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    weights = {k: v for k, v in weights.items() if k not in drop}
    if shards == 1:
        save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    else:
        names, weight_map = sorted(weights), {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: weights[k] for k in names[i::shards]}
            save_file(part, os.path.join(dst, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if edit_config is not None:
        cfg = read_json(os.path.join(dst, "config.json"))
        edit_config(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return dst


# ----------------------------------------------------------------------------------------------------
# Fixtures: a word-vocab text-only hybrid, and a Qwen-vocab pair (text-only + multimodal, same weights)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """Text-only hybrid over a 10-token word vocab, its drafter (block 4, feature layers 0, 2 and the last
    layer 3) and four plain-text prompts."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    tmp = tmp_path_factory.mktemp("hybrid")
    path = str(tmp / "target")
    vocab = md.save_tokenizer(path, n_words=N_WORDS)
    cfg = Qwen3_5TextConfig(**hybrid_text_kwargs(vocab))
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).eval()
    scale_weights(model, 0.3)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)
    drafter = make_drafter(tmp / "drafter", cfg, layer_ids=(0, 2, 3), block_size=4, seed=1, scale=0.5)
    prompts = write_jsonl(tmp / "prompts.jsonl", WORD_PROMPTS)
    return {"path": path, "cfg": cfg, "drafter": drafter, "prompts": prompts, "tmp": tmp}


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory):
    """The same random hybrid text weights (Qwen vocab, hidden 32) saved twice: text-only and in the
    multimodal Qwen3.5 layout, both with the real Qwen3 tokenizer files; plus a drafter and prompts."""
    from transformers import (Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration,
                              Qwen3_5TextConfig)
    tmp = tmp_path_factory.mktemp("qwen_pair")
    text_kw = hybrid_text_kwargs(QWEN_VOCAB, hidden=32, eos_token_id=IM_END, pad_token_id=151643)
    torch.manual_seed(0)
    text_model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_kw)).eval()
    scale_weights(text_model, 0.3, seed=3)
    with torch.no_grad():  # only a few tokens can win the argmax: drafts (same head) are sometimes right
        keep = text_model.lm_head.weight[LIVE_TOKENS].clone()
        text_model.lm_head.weight.zero_()
        text_model.lm_head.weight[LIVE_TOKENS] = keep
    text_model.generation_config.eos_token_id = IM_END
    text_dir = str(tmp / "text")
    text_model.save_pretrained(text_dir)
    copy_qwen_tokenizer(text_dir)

    mm = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text_kw, vision_config=VISION,
                                                       tie_word_embeddings=False)).eval()
    state = {(k if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
             for k, v in text_model.state_dict().items()}
    missing, unexpected = mm.load_state_dict(state, strict=False)
    assert not unexpected and missing and all(k.startswith("model.visual.") for k in missing)
    mm.generation_config.eos_token_id = IM_END
    mm_dir = str(tmp / "multimodal")
    mm.save_pretrained(mm_dir)
    copy_qwen_tokenizer(mm_dir)

    drafter = make_drafter(tmp / "drafter", text_model.config, layer_ids=(1, 3), block_size=4, seed=5, scale=0.5)
    prompts = write_jsonl(tmp / "prompts.jsonl", QWEN_PROMPTS)
    return {"text": text_dir, "mm": mm_dir, "cfg": text_model.config, "drafter": drafter, "prompts": prompts,
            "tmp": tmp}


def word_argv(h, out, *extra):
    return ["--target", h["path"], "--ckpt", h["drafter"], "--prompts", h["prompts"], "--no-chat-template",
            "--max-new-tokens", str(N_NEW), "--ignore-eos", "--device", "cpu", "--quiet",
            "--output", str(out), *extra]


def qwen_argv(q, target, out, *extra):
    return ["--target", target, "--ckpt", q["drafter"], "--prompts", q["prompts"], "--max-new-tokens", "16",
            "--ignore-eos", "--device", "cpu", "--ddtree-budgets", "4,16", "--quiet", "--output", str(out), *extra]


@pytest.fixture(scope="module")
def word_run(hybrid):
    out = hybrid["tmp"] / "word_run.json"   # speculative references forced: auto would pick plain decoding over this
    assert ed.main(word_argv(hybrid, out, "--reference-generation", "speculative")) == 0   # random drafter
    return read_json(out)


@pytest.fixture(scope="module")
def qwen_runs(qwen_pair):
    reports = {}
    for layout in ("text", "mm"):
        out = qwen_pair["tmp"] / f"{layout}.json"
        assert ed.main(qwen_argv(qwen_pair, qwen_pair[layout], out)) == 0, layout
        reports[layout] = read_json(out)
    return reports


# ----------------------------------------------------------------------------------------------------
# 1. End to end, both layouts; the multimodal layout gives the text-only layout's numbers


def test_text_only_hybrid_end_to_end(word_run):
    assert word_run["target"]["agreement"] == 1.0
    assert word_run["target"]["dtype"] == "float32" and word_run["target"]["device"] == "cpu"
    (d,) = word_run["drafters"]
    assert d["layers"] == [0, 2, 3] and d["block_size"] == 4
    assert [p["id"] for p in d["prompts"]] == [r["id"] for r in WORD_PROMPTS]
    for p in d["prompts"]:
        assert p["reference_generated"] and p["completion_tokens"] == N_NEW
        assert p["target_agreement"] == 1.0
        assert N_NEW - d["block_size"] + 1 <= sum(p["rounds"]) <= N_NEW


def test_multimodal_layout_is_the_real_one(qwen_pair):
    from safetensors import safe_open
    cfg = read_json(os.path.join(qwen_pair["mm"], "config.json"))
    assert cfg["model_type"] == "qwen3_5" and "text_config" in cfg and "vision_config" in cfg
    with safe_open(os.path.join(qwen_pair["mm"], "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" in keys and "model.language_model.embed_tokens.weight" in keys
    assert any(k.startswith("model.visual.") for k in keys)
    assert not any(k.startswith("model.layers.") for k in keys)


def test_both_layouts_end_to_end(qwen_runs):
    for layout, report in qwen_runs.items():
        assert report["target"]["agreement"] == 1.0, layout
        (d,) = report["drafters"]
        assert report["config"]["chat_template"] == "applied", layout
        for p in d["prompts"]:
            assert p["reference_generated"] and p["completion_tokens"] == 16, (layout, p["id"])
            assert p["rounds"], (layout, p["id"])


def test_multimodal_layout_gives_text_only_rounds(qwen_runs):
    text, mm = (qwen_runs[k]["drafters"][0] for k in ("text", "mm"))
    keys = ("id", "prompt_tokens", "completion_tokens", "rounds", "ddtree_rounds", "target_agreement")
    for a, b in zip(text["prompts"], mm["prompts"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["id"]
    for k in ("tau", "tau_all_anchors", "anchors", "histogram", "per_position", "ddtree"):
        assert text[k] == mm[k], k
    # Non-trivial: some drafts are right, so a different model would be unlikely to give the same numbers.
    assert max(r for p in text["prompts"] for r in p["rounds"]) >= 2
    assert max(text["per_position"]["accuracy"]) > 0


# ----------------------------------------------------------------------------------------------------
# 2. Rounds equal an online loop that recomputes the hybrid target from scratch every round


def test_hybrid_rounds_equal_online_loop(hybrid, word_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(hybrid["path"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hybrid["path"])
    drafter = ed.load_drafter(hybrid["drafter"], target.config, drafter_settings())
    tool = word_run["drafters"][0]["prompts"]
    all_rounds = []
    for row, result in zip(WORD_PROMPTS, tool, strict=True):
        prompt_ids = tok(row["prompt"])["input_ids"]
        assert result["prompt_tokens"] == len(prompt_ids)
        rounds, seq = online_rounds(target, drafter, prompt_ids, N_NEW)
        assert len(rounds) >= 3, row["id"]
        assert result["rounds"] == rounds, row["id"]
        all_rounds += rounds
    # Non-trivial: some rejections, and some rounds that accept two or more drafts.
    assert min(all_rounds) == 1 and max(all_rounds) >= 3, all_rounds


# ----------------------------------------------------------------------------------------------------
# 2b. Local references by speculative decoding on a hybrid: token for token plain greedy


def load_word_pair(hybrid):
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(hybrid["path"], dtype=torch.float32).eval()
    return target, ed.load_drafter(hybrid["drafter"], target.config, drafter_settings())


def word_prompt_ids(i):
    return [len(md.SPECIALS) + (3 * i + j) % N_WORDS for j in range(3 + i)]


HYBRID_DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "demo_hybrid")


def counting_verdicts(monkeypatch):
    """Every verify verdict's acceptance, in order, while the test runs."""
    accepted, verify = [], ed.verify

    def counted(*args):
        verdict = verify(*args)
        accepted.append(verdict[0])
        return verdict

    monkeypatch.setattr(ed, "verify", counted)
    return accepted


def test_hybrid_speculative_equals_plain_greedy(hybrid, monkeypatch):
    """Rejected rounds (the recurrent state put back, the kept tokens run again), fully accepted rounds (the
    convolution window trimmed) and a stop inside a block all give plain greedy's tokens."""
    target, drafter = load_word_pair(hybrid)
    accepted = counting_verdicts(monkeypatch)
    for i in range(6):
        ids = word_prompt_ids(i)
        plain = ed.plain_generate(target, ids, 60, set())
        assert ed.speculative_generate(target, drafter, ids, 60, set()) == plain, i
        assert ed.speculative_generate(target, drafter, ids, 60, {plain[30]}) == plain[:plain.index(plain[30]) + 1]
    B = drafter.block_size
    assert min(accepted) < B - 1 and max(accepted) == B - 1, accepted
    assert sum(a < B - 1 for a in accepted) >= 20, accepted


def test_hybrid_demo_speculative_equals_plain_greedy(monkeypatch):
    """The bundled hybrid demo pair (a trained Qwen3.5 target and its drafter, tests/make_demo.py --hybrid):
    128 tokens of every demo prompt, speculative == plain greedy, at the long acceptances a trained drafter
    gets (the bench times the same against plain decoding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(os.path.join(HYBRID_DEMO, "target"), dtype=torch.float32).eval()
    assert ed.is_hybrid(target.config)
    tok = AutoTokenizer.from_pretrained(os.path.join(HYBRID_DEMO, "target"))
    drafter = ed.load_drafter(os.path.join(HYBRID_DEMO, "drafter"), target.config, drafter_settings())
    with open(os.path.join(HYBRID_DEMO, "prompts.jsonl")) as f:
        prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in f]
    accepted = counting_verdicts(monkeypatch)
    for ids in prompts:
        assert ed.speculative_generate(target, drafter, ids, 128, set()) == ed.plain_generate(target, ids, 128, set())
    B = drafter.block_size
    tau = (127 * len(prompts)) / len(accepted)   # the first token of each comes from the prompt pass
    assert tau >= 4, tau
    assert sum(a < B - 1 for a in accepted) >= 10 and B - 1 in accepted, accepted


def test_hybrid_speculative_needs_the_state_put_back(hybrid, monkeypatch):
    """The control: without the snapshot (attention and convolution crop only) the tokens drift."""
    target, drafter = load_word_pair(hybrid)
    rewind = ed.rewind

    def without_the_snapshot(cache, saved, n):   # each recurrent state left as the whole block made it
        rewind(cache, [(layer, i, layer.recurrent_states[i].clone()) for layer, i, _ in saved], n)
    monkeypatch.setattr(ed, "rewind", without_the_snapshot)
    differ = [i for i in range(6) if ed.speculative_generate(target, drafter, word_prompt_ids(i), 60, set())
              != ed.plain_generate(target, word_prompt_ids(i), 60, set())]
    assert differ, "dropping the recurrent snapshot changed nothing: the test would not see a broken rollback"


def test_hybrid_cli_reference_modes_agree(hybrid, word_run):
    assert word_run["config"]["reference_generation_used"] == "speculative"
    out = hybrid["tmp"] / "word_plain.json"
    assert ed.main(word_argv(hybrid, out, "--reference-generation", "plain")) == 0
    plain = read_json(out)
    assert plain["config"]["reference_generation_used"] == "plain"
    assert plain["drafters"] == word_run["drafters"]


# ----------------------------------------------------------------------------------------------------
# 3. Layer id L = output of decoder layer L = hidden_states[L + 1], the last one included (normed)


def check_layer_convention(model, ids, n_prompt):
    n_layers = model.config.num_hidden_layers
    x = ed.extract_hidden(model, ids, list(range(n_layers)), n_prompt)
    features, argmax = x.features, x.argmax
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == n_layers + 1
    for L in range(n_layers):
        assert features[L].shape == (len(ids), model.config.hidden_size)
        assert torch.allclose(features[L], out.hidden_states[L + 1][0], atol=1e-5, rtol=0), f"layer {L}"
    assert argmax == out.logits[0, n_prompt - 1:len(ids) - 1].argmax(-1).tolist()
    return features


def test_layer_convention_text_only_hybrid(hybrid):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hybrid["path"], dtype=torch.float32).eval()
    assert "linear_attention" in model.config.layer_types
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 4 + N_WORDS, (30,), generator=g).tolist()
    check_layer_convention(model, ids, 7)


def test_layer_convention_both_layouts(qwen_pair):
    from transformers import AutoModelForCausalLM
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 150000, (24,), generator=g).tolist()
    feats = {}
    for layout in ("text", "mm"):
        model = AutoModelForCausalLM.from_pretrained(qwen_pair[layout], dtype=torch.float32).eval()
        assert "linear_attention" in model.config.layer_types, layout
        feats[layout] = check_layer_convention(model, ids, 5)
    for L in feats["text"]:
        assert torch.equal(feats["text"][L], feats["mm"][L]), f"layer {L}: layouts differ"


# ----------------------------------------------------------------------------------------------------
# 4. bf16 on CPU with a hybrid target warns; float32, or a dense target, does not


def test_bf16_hybrid_on_cpu_warns(hybrid, capsys):
    out = hybrid["tmp"] / "bf16.json"
    rc, _, err = run_main(word_argv(hybrid, out, "--dtype", "bfloat16", "--limit", "1"), capsys)
    assert rc == 0, err
    warned = hybrid_warnings(err)
    assert len(warned) == 1, err
    assert warned[0].startswith("warning:") and "float32" in warned[0]
    assert read_json(out)["target"]["dtype"] == "bfloat16"


def test_bf16_multimodal_hybrid_on_cpu_warns(qwen_pair, capsys):
    rc, _, err = run_main(qwen_argv(qwen_pair, qwen_pair["mm"], qwen_pair["tmp"] / "mm_bf16.json",
                                    "--dtype", "bfloat16", "--limit", "1"), capsys)
    assert rc == 0, err
    warned = hybrid_warnings(err)
    assert len(warned) == 1 and warned[0].startswith("warning:") and "float32" in warned[0], err


def test_float32_hybrid_does_not_warn(hybrid, capsys):
    rc, _, err = run_main(word_argv(hybrid, hybrid["tmp"] / "f32.json", "--dtype", "float32", "--limit", "1"),
                          capsys)
    assert rc == 0, err
    assert hybrid_warnings(err) == []
    assert not any(line.startswith("warning:") for line in err.splitlines()), err


def test_bf16_dense_target_does_not_warn(tmp_path, tiny_target, drafter_a, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "w1 w2 w3"}])
    rc, _, err = run_main(["--target", tiny_target["path"], "--ckpt", drafter_a, "--prompts", prompts,
                           "--device", "cpu", "--dtype", "bfloat16", "--max-new-tokens", "12", "--quiet",
                           "--output", str(tmp_path / "o.json")], capsys)
    assert rc == 0, err
    assert hybrid_warnings(err) == [], err


# ----------------------------------------------------------------------------------------------------
# 5. An untied config without lm_head.weight is refused (it would load a random head); tied runs


def assert_lm_head_error(rc, err):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got: {err!r}"
    assert lines[0].startswith("error:") and "lm_head" in lines[0], lines[0]


@pytest.mark.parametrize("shards", [1, 2], ids=["single-file", "sharded"])
def test_missing_untied_lm_head_is_an_error(hybrid, tmp_path, capsys, shards):
    assert read_json(os.path.join(hybrid["path"], "config.json"))["tie_word_embeddings"] is False
    broken = clone_checkpoint(hybrid["path"], str(tmp_path / "no_head"), drop={"lm_head.weight"}, shards=shards)
    if shards > 1:
        weight_map = read_json(os.path.join(broken, "model.safetensors.index.json"))["weight_map"]
        assert "lm_head.weight" not in weight_map and "model.embed_tokens.weight" in weight_map
        assert len(set(weight_map.values())) == shards
    argv = word_argv(hybrid, tmp_path / "o.json", "--limit", "1")
    argv[argv.index("--target") + 1] = broken
    assert_lm_head_error(*run_main(argv, capsys)[::2])
    assert not (tmp_path / "o.json").exists()


def test_sharded_checkpoint_with_lm_head_runs(hybrid, word_run, tmp_path, capsys):
    sharded = clone_checkpoint(hybrid["path"], str(tmp_path / "sharded"), shards=2)
    argv = word_argv(hybrid, tmp_path / "o.json")
    argv[argv.index("--target") + 1] = sharded
    rc, _, err = run_main(argv, capsys)
    assert rc == 0, err
    got = read_json(tmp_path / "o.json")["drafters"][0]["prompts"]
    assert [p["rounds"] for p in got] == [p["rounds"] for p in word_run["drafters"][0]["prompts"]]


def test_tied_config_without_lm_head_runs(hybrid, tmp_path, capsys):
    def tie(cfg):
        cfg["tie_word_embeddings"] = True
    tied = clone_checkpoint(hybrid["path"], str(tmp_path / "tied"), drop={"lm_head.weight"}, edit_config=tie)
    argv = word_argv(hybrid, tmp_path / "o.json", "--limit", "2")
    argv[argv.index("--target") + 1] = tied
    rc, _, err = run_main(argv, capsys)
    assert rc == 0, err
    assert read_json(tmp_path / "o.json")["target"]["agreement"] == 1.0


@pytest.mark.parametrize("top,text", [(False, False), (True, True), (True, False), (False, True)],
                         ids=["untied", "tied", "top-tied-text-untied", "top-untied-text-tied"])
def test_multimodal_head_check_follows_the_loaded_model(qwen_pair, tmp_path, capsys, top, text):
    """Multimodal configs carry tie_word_embeddings twice (top level and text_config). AutoModelForCausalLM,
    which the tool loads the target with, builds the text model, so the text_config's flag decides whether
    the head is tied. The tool must refuse exactly when the loaded model would get a random lm_head: e.g. a
    user who follows the error's advice ("set tie_word_embeddings") at the top level only still gets a
    random head."""
    from transformers import AutoModelForCausalLM

    def edit(cfg):
        cfg["tie_word_embeddings"] = top
        cfg["text_config"]["tie_word_embeddings"] = text
    path = clone_checkpoint(qwen_pair["mm"], str(tmp_path / "mm"), drop={"lm_head.weight"}, edit_config=edit)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    head_is_tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    del model
    capsys.readouterr()
    rc, _, err = run_main(qwen_argv(qwen_pair, path, tmp_path / "o.json", "--limit", "1",
                                    "--ddtree-budgets", "none"), capsys)
    if head_is_tied:
        assert rc == 0, f"the loaded model ties its head, yet the tool refused: {err}"
    else:
        assert_lm_head_error(rc, err)


# ----------------------------------------------------------------------------------------------------
# The hidden-state cache on a hybrid target: --load-hidden (target never built, embedding and head read by
# name, `model.language_model.*` in the multimodal layout) gives the numbers of the direct run


@pytest.mark.parametrize("layout", ["text", "mm"])
def test_hidden_cache_round_trip(qwen_pair, qwen_runs, tmp_path, capsys, layout):
    cache = str(tmp_path / "hidden.safetensors")
    rc, _, err = run_main(qwen_argv(qwen_pair, qwen_pair[layout], tmp_path / "save.json", "--save-hidden", cache),
                          capsys)
    assert rc == 0, err
    rc, _, err = run_main(["--target", qwen_pair[layout], "--ckpt", qwen_pair["drafter"], "--load-hidden", cache,
                           "--device", "cpu", "--ddtree-budgets", "4,16", "--quiet",
                           "--output", str(tmp_path / "load.json")], capsys)
    assert rc == 0, err
    direct, loaded = qwen_runs[layout]["drafters"][0], read_json(tmp_path / "load.json")["drafters"][0]
    keys = ("id", "prompt_tokens", "completion_tokens", "rounds", "ddtree_rounds", "target_agreement")
    for a, b in zip(direct["prompts"], loaded["prompts"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["id"]
    for k in ("tau_all_anchors", "per_position", "ddtree"):
        assert direct[k] == loaded[k], k
