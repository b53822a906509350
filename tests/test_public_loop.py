"""The tool's rounds equal the public reference loops', round by round (greedy, CPU, float32):
- z-lab's `dflash` 0.1.0 `dflash_generate`, an implementation written independently of this tool, for the
  demo drafter under each in-block mask rule, for a DFlash 2 drafter (conv taps, selector, multiplier,
  softcap, embedding scale), for a DFlash drafter with an input_embedding_scale, and on a Llama target;
- transformers' own assisted decoding (`speculation_type="dflash"`) for a drafter in the transformers-native
  assistant layout.

Install the first with `pip install --no-deps dflash==0.1.0`. CI sets EVAL_DRAFTER_REQUIRE_DFLASH=1 so that a
missing package fails there instead of skipping. It is written for transformers 5.x; under 4.x two of its
cache helpers get 4.x semantics (tests/drafters.py), its loop and models run as they are.
"""
import json
import os

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, write_jsonl
from drafters import DEMO, demo_pair, dflash2_from_demo, native_from_demo, public_module, public_rounds, with_config

transformers = pytest.importorskip("transformers")
try:
    import dflash.model  # noqa: F401
except ImportError:
    if os.environ.get("EVAL_DRAFTER_REQUIRE_DFLASH"):
        raise
    pytest.skip("the public reference is not installed: pip install --no-deps dflash==0.1.0", allow_module_level=True)

N_NEW = 64
N_PROMPTS = 4


@pytest.fixture(scope="module")
def demo():
    target, rows, prompts = demo_pair()
    return target, rows[:N_PROMPTS], prompts[:N_PROMPTS]


def tool_rounds(tmp_path, target_dir, drafter_dir, rows, references, name="run"):
    """The tool's report on `rows` with the given references (token ids)."""
    prompts = write_jsonl(tmp_path / f"{name}.jsonl", [{**row, "completion_ids": ref} for row, ref in zip(rows, references)])
    out = tmp_path / f"{name}.json"
    assert ed.main(["--target", target_dir, "--ckpt", f"d={drafter_dir}", "--prompts", prompts,
                    "--ddtree-budgets", "none", "--quiet", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["target"]["agreement"] == 1.0   # the loop's text is the target's greedy text
    return report


def check_against(report, expected, block_size, n_new=N_NEW):
    """Every round whose block lies inside the reference equals the loop's; returns all those rounds."""
    all_rounds = []
    for p, lengths in zip(report["drafters"][0]["prompts"], expected):
        rounds = p["rounds"]
        assert rounds == lengths[:len(rounds)], p["id"]
        assert sum(rounds) + block_size > n_new   # the walk went on as long as a block fits
        all_rounds += rounds
    return all_rounds


def run_public(public, drafter_dir, target, prompts, block_size):
    """References (N_NEW tokens) and acceptance lengths from the public loop. It runs a block past N_NEW,
    so that the rounds whose block lies inside N_NEW tokens are not cut by its end."""
    references, expected = [], []
    for prompt_ids in prompts:
        tokens, lengths = public_rounds(public, drafter_dir, target, prompt_ids, N_NEW + block_size)
        references.append(tokens[:N_NEW])
        expected.append(lengths)
    return references, expected


@pytest.mark.parametrize("is_causal", [None, False, True])
def test_rounds_equal_the_public_loop(tmp_path, demo, monkeypatch, is_causal):
    """is_causal unset: sliding layers causal with their window (the training rule), full layers
    bidirectional; False: bidirectional everywhere, windows on both sides; True: causal everywhere. The tool
    reads the same config key under --block-mask auto."""
    target, rows, prompts = demo
    drafter_dir = with_config(tmp_path / "drafter", top={} if is_causal is None else {"is_causal": is_causal})
    references, expected = run_public(public_module(monkeypatch), drafter_dir, target, prompts, 8)
    all_rounds = check_against(tool_rounds(tmp_path, os.path.join(DEMO, "target"), drafter_dir, rows, references),
                               expected, 8)
    assert min(all_rounds) == 1 and max(all_rounds) == 8   # rejections and full blocks: the check has teeth


def test_dflash2_rounds_equal_the_public_loop(tmp_path, demo, monkeypatch):
    """A DFlash 2 drafter with a sliding and a full layer, is_causal false, conv taps, the selector, an output
    multiplier, a softcap, an embedding scale, and block_size under dflash_config."""
    target, rows, prompts = demo
    drafter_dir = dflash2_from_demo(tmp_path / "dflash2")
    references, expected = run_public(public_module(monkeypatch), drafter_dir, target, prompts, 8)
    report = tool_rounds(tmp_path, os.path.join(DEMO, "target"), drafter_dir, rows, references)
    d = report["drafters"][0]
    assert (d["generation"], d["layout"], d["block_size"]) == ("DFlash 2", "public", 8)
    assert d["ddtree"] is None and "DFlash 2" in d["ddtree_note"]
    all_rounds = check_against(report, expected, 8)
    assert len(set(all_rounds)) >= 5   # rounds of many lengths


def test_dflash2_no_rope_layers_equal_the_public_loop_without_their_rotation(tmp_path, demo, monkeypatch):
    """no_rope_layers (vLLM 0.34's DFlash2RicursiveDraftModel): the listed layers rotate neither queries, keys nor
    context keys. The public model, its attention given an identity rotation (cos 1, sin 0) in those layers, is the
    online loop; the tool's rounds equal it and differ from the same drafter with every layer rotated."""
    target, rows, prompts = demo
    public = public_module(monkeypatch)
    rotate = public.Qwen3DFlashAttention.forward

    def forward(self, *args, position_embeddings=None, **kwargs):
        if self.layer_idx in (getattr(self.config, "no_rope_layers", None) or ()):
            position_embeddings = tuple(f(t) for f, t in zip((torch.ones_like, torch.zeros_like), position_embeddings))
        return rotate(self, *args, position_embeddings=position_embeddings, **kwargs)

    monkeypatch.setattr(public.Qwen3DFlashAttention, "forward", forward)
    plain_dir = dflash2_from_demo(tmp_path / "plain")
    nope_dir = dflash2_from_demo(tmp_path / "nope")
    cfg = json.loads((tmp_path / "nope" / "config.json").read_text())
    (tmp_path / "nope" / "config.json").write_text(json.dumps({**cfg, "no_rope_layers": [1]}))
    references, expected = run_public(public, nope_dir, target, prompts, 8)
    report = tool_rounds(tmp_path, os.path.join(DEMO, "target"), nope_dir, rows, references)
    all_rounds = check_against(report, expected, 8)
    assert len(set(all_rounds)) >= 4
    plain = tool_rounds(tmp_path, os.path.join(DEMO, "target"), plain_dir, rows, references, name="plain")
    rounds = [[p["rounds"] for p in r["drafters"][0]["prompts"]] for r in (plain, report)]
    assert rounds[0] != rounds[1]
    assert report["drafters"][0]["hash"] != plain["drafters"][0]["hash"]


def test_dflash_embedding_scale_rounds_equal_the_public_loop(tmp_path, demo, monkeypatch):
    """input_embedding_scale 10: the block's embeddings are raw embedding rows x 10. Ignoring it changes the
    rounds (checked below), so the equality says the scale is applied as the public loop applies it."""
    target, rows, prompts = demo
    scaled = with_config(tmp_path / "scaled", dflash={"input_embedding_scale": 10.0})
    references, expected = run_public(public_module(monkeypatch), scaled, target, prompts, 8)
    report = tool_rounds(tmp_path, os.path.join(DEMO, "target"), scaled, rows, references)
    all_rounds = check_against(report, expected, 8)
    assert min(all_rounds) == 1 and max(all_rounds) == 8
    unscaled = tool_rounds(tmp_path, os.path.join(DEMO, "target"), os.path.join(DEMO, "drafter"), rows, references,
                           "unscaled")
    assert [p["rounds"] for p in unscaled["drafters"][0]["prompts"]] != \
        [p["rounds"] for p in report["drafters"][0]["prompts"]]


def test_llama_target_rounds_and_drafts_equal_the_public_loop(tmp_path, monkeypatch):
    """A tiny random Llama target (the public transformers loop supports Qwen3 and Llama targets). A random
    drafter rarely gets a draft accepted, so the drafts of every round are compared too."""
    from conftest import make_drafter, save_other_target
    target = save_other_target(str(tmp_path / "llama"), "llama")
    drafter_dir = make_drafter(tmp_path / "drafter", target["cfg"], layer_ids=(0, 2, 3), block_size=4, seed=1)
    public = public_module(monkeypatch)
    drafts_seen = []
    compute_logits = public.DFlashDraftModel.compute_logits

    def spy(self, hidden, head):
        logits = compute_logits(self, hidden, head)
        drafts_seen.append(logits.argmax(-1)[0].tolist())
        return logits

    monkeypatch.setattr(public.DFlashDraftModel, "compute_logits", spy)
    rows = [{"id": f"l{i}", "prompt": " ".join(f"w{(7 * i + 3 * k) % 50}" for k in range(3 + i))} for i in range(5)]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target["path"])
    prompts = [tok(row["prompt"])["input_ids"] for row in rows]
    references, expected, public_drafts = [], [], []
    for prompt_ids in prompts:
        drafts_seen.clear()
        tokens, lengths = public_rounds(public, drafter_dir, target["model"], prompt_ids, N_NEW + 4)
        references.append(tokens[:N_NEW])
        expected.append(lengths)
        public_drafts.append(list(drafts_seen))
    report = tool_rounds(tmp_path, target["path"], drafter_dir, rows, references)
    check_against(report, expected, 4)
    drafter = ed.load_drafter(drafter_dir, target["cfg"], drafter_settings())
    model, compared = target["model"], 0
    for prompt_ids, ref, p, seen in zip(prompts, references, report["drafters"][0]["prompts"], public_drafts):
        ids = prompt_ids + ref
        anchors = [len(prompt_ids) + sum(p["rounds"][:r]) for r in range(len(p["rounds"]))]
        features = ed.extract_hidden(model, ids, drafter.layers, len(prompt_ids)).features
        ids_t = torch.tensor(ids)
        drafts, _ = ed.draft_all_anchors(drafter, ed.prompt_context(drafter, features), torch.tensor(anchors),
                                         ids_t[anchors], model.get_input_embeddings().weight,
                                         model.get_output_embeddings())
        assert drafts.tolist() == seen[:len(anchors)], p["id"]
        compared += len(anchors)
    assert compared >= 100


def native_rounds(target, assistant, prompt_ids, n_new, block_size, monkeypatch):
    """transformers' own DFlash assisted decoding: its tokens and round lengths (the growth of the text
    between two calls for candidates, and the last round from the final length)."""
    from transformers.generation import candidate_generator
    lengths, get_candidates = [], candidate_generator.DFlashTokenCandidateGenerator.get_candidates

    def spy(self, input_ids, *args, **kwargs):
        lengths.append(input_ids.shape[1])
        return get_candidates(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(candidate_generator.DFlashTokenCandidateGenerator, "get_candidates", spy)
    out = target.generate(torch.tensor([prompt_ids]), assistant_model=assistant, speculation_type="dflash",
                          do_sample=False, max_new_tokens=n_new + 2 * block_size, eos_token_id=None)
    marks = lengths[1:] + [out.shape[1]]   # the first call only lets the target prefill
    return out[0, len(prompt_ids):].tolist(), [b - a for a, b in zip(marks, marks[1:])]


def test_native_assistant_layout_equals_transformers_assisted_decoding(tmp_path, demo, monkeypatch):
    """The demo drafter's weights in the transformers-native layout (muse_glimmer_assistant): bidirectional
    in every layer, sliding layers windowed. A window of 5 makes the window's edge matter: transformers'
    bidirectional sliding mask keeps |q - p| <= W; with the window one position shorter the rounds differ."""
    try:
        from transformers import MuseGlimmerAssistantModel
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no muse_glimmer_assistant model")
    target, rows, prompts = demo
    drafter_dir = native_from_demo(tmp_path / "native", sliding_window=5)
    assistant = MuseGlimmerAssistantModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    references, expected = [], []
    for prompt_ids in prompts:
        tokens, lengths = native_rounds(target, assistant, prompt_ids, N_NEW, 8, monkeypatch)
        references.append(tokens[:N_NEW])
        expected.append(lengths)
    report = tool_rounds(tmp_path, os.path.join(DEMO, "target"), drafter_dir, rows, references)
    d = report["drafters"][0]
    assert (d["generation"], d["layout"]) == ("DFlash", "transformers-native assistant")
    assert d["block_mask"] == ["bidirectional, window 6", "bidirectional"]
    all_rounds = check_against(report, expected, 8)
    assert min(all_rounds) == 1 and len(set(all_rounds)) >= 4
    real_rules = ed.layer_rules   # teeth: the window one shorter gives other rounds
    monkeypatch.setattr(ed, "layer_rules", lambda cfg, settings, layout="public": [
        (mode, window and window - 1) for mode, window in real_rules(cfg, settings, layout)])
    shorter = tool_rounds(tmp_path, os.path.join(DEMO, "target"), drafter_dir, rows, references, "shorter")
    assert [p["rounds"] for p in shorter["drafters"][0]["prompts"]] != [p["rounds"] for p in d["prompts"]]


def test_speculative_references_equal_the_public_loop(demo, monkeypatch, tmp_path):
    """The tool's own speculative generation and the public loop commit the same tokens (both lossless), for
    DFlash and DFlash 2."""
    target, _, prompts = demo
    public = public_module(monkeypatch)
    for drafter_dir in (os.path.join(DEMO, "drafter"), dflash2_from_demo(tmp_path / "dflash2")):
        drafter = ed.load_drafter(drafter_dir, target.config, drafter_settings())
        for prompt_ids in prompts:
            tokens, _ = public_rounds(public, drafter_dir, target, prompt_ids, N_NEW)
            assert ed.speculative_generate(target, drafter, prompt_ids, N_NEW, set()) == tokens
