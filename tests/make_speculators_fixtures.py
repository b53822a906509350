"""Build the committed speculators-layout drafter fixtures under tests/fixtures/speculators/ (and SpecForge's
P-EAGLE export under tests/fixtures/families/peagle_specforge/).

Its outputs are committed, so the tests never need speculators. Only rerun this script to rebuild them. It needs
speculators 0.9.0 and its light dependencies in a separate venv. On CPU:

    python -m venv /work/spec_venv && . /work/spec_venv/bin/activate
    pip install torch==2.13.0 "transformers>=5.0.0,<=5.19.0" safetensors pydantic loguru openai \
        "datasets>=4.0.0,<=5.1.0"
    pip install --no-deps hs-connectors==0.9.0 speculators==0.9.0 specforge==0.2.0
    python tests/make_speculators_fixtures.py [--only dflash,xpress,peagle,peagle_specforge]

(`import speculators` pulls in openai, datasets and hs_connectors. The other Requires-Dist entries, such as vllm
helpers, torchvision and triton, are not needed to convert, save or run a forward on CPU. specforge is only needed
for peagle_specforge; its P-EAGLE modules import with torch and transformers alone, except a Triton loss kernel,
see specforge_modules.) A full rebuild takes about 2-3 minutes on 2 idle cores; dflash rebuilds the four DFlash
fixtures together; peagle_specforge starts from the saved speculators peagle.

Fixtures (each has config.json + model.safetensors; speculators' save_pretrained also copies a config.py next to
config.json, and this script deletes it):

- dflash/             speculators' DFlashConverter run on the demo drafter with sliding_window 4096 (the window
                      never binds on the demo texts), base_model = tests/fixtures/demo/target (relative path).
- dflash_w32/         the converter run on the unmodified demo drafter (window 32, which binds), plus expected.json:
                      reference drafts from speculators' own DFlashDraftModel forward at every anchor of 4 sequences.
- dflash2/            a DFlash2DraftModel saved by speculators' save_pretrained. The weights are tests/drafters.py's
                      dflash2_from_demo without its logit/embedding knobs. sliding_window 4096, and
                      sliding_window_non_causal false, so sliding layers are causal in-block and full layers are
                      bidirectional, which is the z-lab rule. zlab_config.json is the knob-free z-lab twin config
                      (same weights file).
- dflash2_w32_bidi/   the same weights with sliding_window 32 and sliding_window_non_causal true (speculators'
                      DFlash 2 default), plus expected.json with speculators' own DFlash2 forward outputs.
- xpress/             speculators' XPressDraftModel (save_pretrained): the demo drafter's backbone (window 32,
                      frozen) and a refiner head (rank 16, MLP ratio 2) trained briefly by XPressDraftModel.forward
                      and its loss; full vocabulary, block 8, fill-in layout, num_jacobi_passes 3. expected.json: at
                      every anchor, vLLM 0.33's Jacobi drafts from speculators' backbone and refiner_head: topc0
                      (exact argmax), topc8 (among each slot's 8 best base logits), base (no pass), topc0_7passes.
- peagle/             speculators' PEagleDraftModel (save_pretrained): 1 Qwen3 layer initialised from
                      tests/fixtures/families/eagle3, trained briefly by PEagleDraftModel.forward (COD sampling, its
                      kl_div loss); 5 depths, mask token 2, norm_before_residual true. expected.json: at every
                      anchor, vLLM 0.33's 5 parallel drafts (bonus row + 4 mask slots) from speculators' modules.
- ../families/peagle_specforge/
                      SpecForge 0.2.0's PEagleDraftModel (Llama, 1 layer, norm_before_residual false) started from
                      peagle/ (all but q_norm/k_norm), trained briefly by SpecForge's OnlinePEagleModel.forward and
                      exported by SpecForge's export_to_hf: no mask_token_id in config.json (SpecForge keeps it in
                      its training state), capture layers as eagle_config ids [1, 3, 4] (layer outputs).
                      expected.json as for peagle/, from SpecForge's modules.

The sequences are the first 4 demo prompts, each followed by the demo target's float32 greedy continuation of 64
tokens (no EOS stop). The anchors are every a in [len(prompt), len(seq) - block_size] (P-EAGLE, K = 5 drafts:
[len(prompt), len(seq) - 1 - K]). The aux hidden states come from one teacher-forced float32 pass of the target
(transformers' `hidden_states`, indexed by aux_hidden_state_layer_ids as speculators indexes them). The XPress and
P-EAGLE training data: see the "Issue 31" section.
"""
import contextlib
import json
import os
import shutil
import sys
import tempfile
import types

import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(HERE, "fixtures", "speculators")
DEMO = os.path.join(HERE, "fixtures", "demo")
TARGET_REL = "tests/fixtures/demo/target"   # the verifier path written into the configs (relative to ROOT)
N_SEQ, N_NEW = 4, 64
DFLASH2_SELECTOR = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
ZLAB_KNOBS = ("output_multiplier", "final_logit_softcapping", "input_embedding_scale")
# config.json keys that the DFlashConverter leaves out of transformer_layer_config
NON_TRANSFORMER_KEYS = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"}


def log(*a):
    print(*a, flush=True)


def finish_dir(path):
    """Keep only config.json, model.safetensors (and expected.json / zlab_config.json written later)."""
    cfg_py = os.path.join(path, "config.py")
    if os.path.exists(cfg_py):
        os.remove(cfg_py)
    left = sorted(os.listdir(path))
    assert left == ["config.json", "model.safetensors"], left


# ----------------------------------------------------------------------------------------------------
# Target side: sequences and hidden states


def demo_sequences():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    with open(os.path.join(DEMO, "prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f][:N_SEQ]
    seqs = []
    with torch.no_grad():
        for text in prompts:
            prompt_ids = tok(text)["input_ids"]
            ids = list(prompt_ids)
            for _ in range(N_NEW):   # greedy, full passes, no EOS stop
                logits = target(torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
            seqs.append({"prompt_ids": prompt_ids, "ids": ids, "hidden_states": hs})
    return seqs


# ----------------------------------------------------------------------------------------------------
# Speculators side


@contextlib.contextmanager
def fixed_anchors(anchors):
    """speculators draws random anchors (select_anchors), and that function never takes the last valid position
    len - block_size. Swap in every anchor we want; the rest of _backbone_forward runs unchanged."""
    import speculators.models.dflash.core as core
    original = core.select_anchors

    def every_anchor(loss_mask, num_anchors, block_size):
        a = torch.tensor(anchors, dtype=torch.long)
        assert num_anchors == a.numel()
        return a, torch.ones(a.numel(), dtype=torch.bool)

    core.select_anchors = every_anchor
    try:
        yield
    finally:
        core.select_anchors = original


def load_spec(cls, path):
    """The model as speculators loads it (from_pretrained, which also loads the verifier's embed_tokens, lm_head and
    final norm from speculators_config.verifier.name_or_path), with eager attention (float masks from the same
    mask_mod). Checks that the embedding and head are the target's."""
    cfg = cls.config_class.from_pretrained(path)
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = cls.from_pretrained(path, config=cfg).eval()
    assert model._attn_impl == "eager"
    target = load_file(os.path.join(DEMO, "target", "model.safetensors"))
    assert torch.equal(model.embed_tokens.weight, target["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, target["lm_head.weight"])
    assert torch.equal(model.verifier_norm.weight, target["model.norm.weight"])
    saved = load_file(os.path.join(path, "model.safetensors"))
    state = model.state_dict()
    for k, v in saved.items():
        assert torch.equal(state[k], v), k
    return model


def backbone(model, seq):
    """speculators' DFlashDraftModel._backbone_forward (the training forward up to the draft logits), run at every
    anchor of one sequence. Returns (post-norm hidden, logits, block indices), blocks stacked per anchor."""
    ids = torch.tensor([seq["ids"]])
    T, B = ids.shape[1], model.block_size
    anchors = list(range(len(seq["prompt_ids"]), T - B + 1))
    hs = seq["hidden_states"]
    aux = torch.cat([hs[i] for i in model.target_layer_ids], dim=-1)
    loss_mask = torch.zeros(1, T)
    loss_mask[0, len(seq["prompt_ids"]):] = 1
    with torch.no_grad(), fixed_anchors(anchors):
        hidden, logits, _, _, block_indices = model._backbone_forward(
            hidden_states=aux, input_ids=ids, loss_mask=loss_mask, verifier_last_hidden_states=hs[-1],
            document_ids=torch.zeros(1, T, dtype=torch.long), max_anchors=len(anchors))
    n = len(anchors)
    assert torch.equal(block_indices.view(n, B)[:, 0], torch.tensor(anchors))
    return anchors, hidden.view(n, B, -1), logits.view(n, B, -1), block_indices


def dflash_drafts(model, seqs):
    out = []
    for seq in seqs:
        anchors, _, logits, _ = backbone(model, seq)
        out.append({"anchors": anchors, "drafts": logits[:, 1:].argmax(-1).tolist()})
    return out


def dflash2_drafts(model, seqs):
    """Unary argmax; the selector with speculators' teacher-forced predecessors (_predecessor_ids, as its training
    forward builds them); and the selector's greedy chain, where slot 1's predecessor is the anchor token and each
    later slot's is the previous slot's pick. speculators has no inference loop for that chain: the loop below is
    ours, and every score comes from CandidateSelector.select."""
    sel = model.candidate_selector
    out = []
    for seq in seqs:
        anchors, hidden, logits, block_indices = backbone(model, seq)
        n, B = hidden.shape[:2]
        unary = logits[:, 1:].argmax(-1)
        with torch.no_grad():
            pred = model._predecessor_ids(torch.tensor([seq["ids"]]), block_indices)   # [n, B]
            cand, scores = sel.select(logits, hidden, pred)
            teacher = cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0][:, 1:]
            prev, chain = torch.tensor(seq["ids"])[anchors], []
            for j in range(1, B):
                cand, scores = sel.select(logits[:, j], hidden[:, j], prev)
                prev = cand.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
                chain.append(prev)
            chain = torch.stack(chain, dim=1)
        out.append({"anchors": anchors, "unary_drafts": unary.tolist(),
                    "selector_teacher_forced_drafts": teacher.tolist(), "selector_greedy_drafts": chain.tolist()})
    return out


def count_diff(a, b, key):
    total = diff = 0
    for x, y in zip(a, b):
        assert x["anchors"] == y["anchors"]
        total += len(x["anchors"])
        diff += sum(p != q for p, q in zip(x[key], y[key]))
    return diff, total


def write_expected(path, seqs, results, how, keys):
    doc = {"how": how, "sequences": []}
    for seq, res in zip(seqs, results):
        doc["sequences"].append({"prompt_ids": seq["prompt_ids"], "ids": seq["ids"], "anchors": res["anchors"],
                                 **{k: res[k] for k in keys}})
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")


# ----------------------------------------------------------------------------------------------------
# Builders


def convert_demo(out_dir, sliding_window, tmp):
    from speculators.convert.dflash import DFlashConverter
    src = os.path.join(tmp, f"zlab_w{sliding_window}")
    shutil.copytree(os.path.join(DEMO, "drafter"), src)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["sliding_window"] = sliding_window
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    shutil.rmtree(out_dir, ignore_errors=True)
    DFlashConverter().convert(src, out_dir, base_model=TARGET_REL, validate=True)
    finish_dir(out_dir)


def import_drafters():
    """tests/drafters.py (dflash2_from_demo). It imports eval_drafter only for its public-loop helpers, which are
    not used here; a stub stands in if eval_drafter cannot be imported in this venv."""
    sys.path[:0] = [ROOT, HERE]
    try:
        import drafters
    except ImportError:
        sys.modules["eval_drafter"] = types.ModuleType("eval_drafter")
        import drafters
    return drafters


def zlab_dflash2(tmp, sliding_window):
    """The knob-free z-lab DFlash 2 twin: dflash2_from_demo's weights with no is_causal key (z-lab's per-layer
    rule: sliding layers causal, full layers bidirectional) and no multiplier/softcap/embedding scale."""
    drafters = import_drafters()
    path = drafters.dflash2_from_demo(os.path.join(tmp, "zlab_dflash2"), is_causal=None)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for k in ZLAB_KNOBS:
        cfg["dflash_config"].pop(k, None)
    assert {k: cfg["dflash_config"][k] for k in DFLASH2_SELECTOR} == DFLASH2_SELECTOR
    assert "is_causal" not in cfg
    cfg["sliding_window"] = sliding_window
    return cfg, load_file(os.path.join(path, "model.safetensors"))


def save_dflash2(out_dir, zcfg, weights, sliding_window, non_causal):
    from transformers import PretrainedConfig
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    tl = {k: v for k, v in zcfg.items() if k not in NON_TRANSFORMER_KEYS}   # as DFlashConverter builds it
    tl.update(sliding_window=sliding_window, use_sliding_window=True)
    dcfg = zcfg["dflash_config"]
    block_size = dcfg["block_size"]
    verifier = PretrainedConfig.get_config_dict(TARGET_REL)[0]
    n_layers = verifier["num_hidden_layers"]
    aux = [i + 1 for i in dcfg["target_layer_ids"] if i + 1 != n_layers]   # the converter's rule: [2, 4, 5]
    assert aux == [2, 4, 5]
    cfg = DFlash2SpeculatorConfig(
        transformer_layer_config=tl, draft_vocab_size=zcfg["vocab_size"], block_size=block_size,
        aux_hidden_state_layer_ids=aux, mask_token_id=dcfg["mask_token_id"], sliding_window_non_causal=non_causal,
        sample_from_anchor=False, **{k: dcfg[k] for k in DFLASH2_SELECTOR},
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block_size - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=TARGET_REL, architectures=verifier["architectures"])))
    model = DFlash2DraftModel(cfg)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                            "verifier_norm.weight"}, missing
    model.load_verifier_weights()
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir)
    finish_dir(out_dir)
    saved = load_file(os.path.join(out_dir, "model.safetensors"))
    assert set(saved) == set(weights), sorted(set(saved) ^ set(weights))
    reloaded = DFlash2DraftModel.from_pretrained(out_dir).state_dict()
    for k, v in weights.items():
        assert torch.equal(saved[k], v) and torch.equal(reloaded[k], v), k
    log(f"{out_dir}: {len(weights)} tensors equal after save_pretrained and from_pretrained")


def main():
    os.chdir(ROOT)   # configs name the verifier by its repo-relative path
    torch.manual_seed(0)
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash2 import DFlash2DraftModel
    os.makedirs(OUT, exist_ok=True)
    seqs = demo_sequences()
    log("sequences:", [(len(s["prompt_ids"]), len(s["ids"])) for s in seqs])
    with tempfile.TemporaryDirectory() as tmp:
        # 1, 2: the converter
        d4096, d32 = os.path.join(OUT, "dflash"), os.path.join(OUT, "dflash_w32")
        convert_demo(d4096, 4096, tmp)
        convert_demo(d32, 32, tmp)
        ref32 = dflash_drafts(load_spec(DFlashDraftModel, d32), seqs)
        ref4096 = dflash_drafts(load_spec(DFlashDraftModel, d4096), seqs)
        how = ("speculators 0.9.0 DFlashDraftModel.from_pretrained(dflash_w32) with "
               "transformer_layer_config._attn_implementation='eager' (verifier embed_tokens/lm_head/norm loaded by "
               "load_verifier_weights from tests/fixtures/demo/target), then DFlashDraftModel._backbone_forward "
               "(the training forward up to the logits: anchored blocks [anchor token, mask x7], fc+hidden_norm "
               "context, masks from models/dflash/attention.create_anchor_block_mask_mod via create_float_mask, "
               "logits = lm_head(norm(hidden))) over each whole sequence with every anchor at once "
               "(core.select_anchors replaced by a function returning all anchors, since it samples at random and "
               "never takes len - block_size). hidden_states = cat(hs[i] for i in aux_hidden_state_layer_ids) from "
               "one float32 pass of the target with output_hidden_states, verifier_last_hidden_states = hs[-1], "
               "document_ids 0. drafts[k] = argmax over the full vocab of block slots 1..7 (sample_from_anchor false).")
        write_expected(d32, seqs, ref32, how, ["drafts"])
        diff, total = count_diff(ref32, ref4096, "drafts")
        log(f"SANITY dflash: window 32 vs 4096 drafts differ at {diff} of {total} anchors")

        # 3, 4: DFlash 2
        zcfg, weights = zlab_dflash2(tmp, 4096)
        d2, d2b = os.path.join(OUT, "dflash2"), os.path.join(OUT, "dflash2_w32_bidi")
        save_dflash2(d2, zcfg, weights, 4096, False)
        with open(os.path.join(d2, "zlab_config.json"), "w") as f:
            json.dump(zcfg, f, indent=1)
            f.write("\n")
        save_dflash2(d2b, zcfg, weights, 32, True)
        ref_b = dflash2_drafts(load_spec(DFlash2DraftModel, d2b), seqs)
        ref_c = dflash2_drafts(load_spec(DFlash2DraftModel, d2), seqs)
        how2 = ("speculators 0.9.0 DFlash2DraftModel.from_pretrained(dflash2_w32_bidi) with eager attention and the "
                "target's embed_tokens/lm_head/norm, then DFlashDraftModel._backbone_forward exactly as for "
                "dflash_w32 (DFlash2 layers: grouped dynamic conv around attention and MLP, positions in block = "
                "flat index % block_size; sliding layer window 32 anchored at the anchor, in-block bidirectional "
                "because sliding_window_non_causal is true). unary_drafts = argmax of lm_head(norm(hidden)) at slots "
                "1..7. speculators has NO inference path for the selector's greedy chain (its forward scores the "
                "selector only teacher-forced, for the loss). selector_teacher_forced_drafts = candidate_selector."
                "select(unary_logits, hidden, DFlash2DraftModel._predecessor_ids(...)) argmax, i.e. speculators' own "
                "teacher-forced selector (predecessor of slot k = true token at a+k-1; unary top-4 candidates, no "
                "target injection). selector_greedy_drafts = a loop of ours over candidate_selector.select slot by "
                "slot: slot 1's predecessor is the anchor token, each later slot's is the previous slot's pick (the "
                "z-lab serving rule); all scores from speculators' code. Hidden is post-norm in both.")
        keys = ["unary_drafts", "selector_teacher_forced_drafts", "selector_greedy_drafts"]
        write_expected(d2b, seqs, ref_b, how2, keys)
        for k in keys:
            diff, total = count_diff(ref_b, ref_c, k)
            log(f"SANITY dflash2 {k}: w32 bidirectional vs 4096 causal-sliding differ at {diff} of {total} anchors")
        for ref, name in ((ref_b, "w32_bidi"), (ref_c, "4096 causal")):
            for a in ("unary_drafts", "selector_teacher_forced_drafts"):
                diff = sum(sum(p != q for p, q in zip(r[a], r["selector_greedy_drafts"])) for r in ref)
                log(f"SANITY dflash2 {name}: {a} vs selector_greedy_drafts differ at {diff} of "
                    f"{sum(len(r['anchors']) for r in ref)} anchors")
    for name in sorted(os.listdir(OUT)):
        log(name, sorted(os.listdir(os.path.join(OUT, name))))


# ----------------------------------------------------------------------------------------------------
# Issue 31: XPress and P-EAGLE drafters built, briefly trained and saved by the frameworks' own classes
#
# Training data (all three): the demo target's own SAMPLED continuations (temperature 1, seeded; N_TRAIN_NEW tokens,
# no EOS stop, KV cache) of N_TRAIN random word prompts (never one of the demo prompts), as a regeneration pipeline
# makes them, with the target's float32 logits, the aux hidden states hs[i] for AUX_IDS and the last decoder
# layer's PRE-norm output (transformers' last `hidden_states` entry is already normed, and speculators applies
# verifier_norm itself). Sampled rather than greedy text: on greedy text the demo drafter's backbone is right at
# ~97% of slots, and a refiner trained there has even fewer errors to fix. Everything is float32 on CPU with fixed
# seeds and a fixed number of steps, so a rerun rebuilds the same files up to CPU float nondeterminism.

import random  # noqa: E402
import time  # noqa: E402

FAMILIES_DIR = os.path.join(HERE, "fixtures", "families")
AUX_IDS = [2, 4, 5]          # the demo drafter's target_layer_ids [1, 3, 4] as speculators' hidden_states indices
MASK_ID = 2                  # the demo drafter's mask_token_id (the tokenizer's <mask>)
N_TRAIN, N_TRAIN_NEW = 48, 96
XPRESS = {"xpress_rank": 16, "xpress_mlp_ratio": 2, "num_jacobi_passes": 3}
XPRESS_TOPC, XPRESS_STEPS, XPRESS_ANCHORS, XPRESS_LR = 8, 600, 64, 3e-3
PEAGLE_DEPTHS, PEAGLE_STEPS, PEAGLE_LR = 5, 1500, 1e-3
SPECFORGE_STEPS, SPECFORGE_LR = 500, 1e-3
SPECFORGE_AUX_LAYERS = [1, 3, 4]   # SpecForge's eagle_config ids: SGLang capture ids = layer OUTPUTS (hs[i + 1])


def target_features(target, ids):
    """One teacher-forced float32 pass: (cat(hs[i] for AUX_IDS) [1, T, 3H], last layer's pre-norm output [1, T, H],
    logits [1, T, V])."""
    captured = {}

    def keep(_module, _inputs, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = target.model.layers[-1].register_forward_hook(keep)
    try:
        out = target(torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    last = captured["last"]
    assert torch.allclose(target.lm_head(target.model.norm(last)), out.logits, atol=1e-4)
    return torch.cat([out.hidden_states[i] for i in AUX_IDS], dim=-1), last, out.logits


def training_data():
    """N_TRAIN sequences {prompt_ids, ids, aux, last, logits}: sampled continuations (see the section's comment)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    with open(os.path.join(DEMO, "prompts.jsonl")) as f:
        held_out = {json.loads(line)["prompt"] for line in f}
    words = sorted((w for w in tok.get_vocab() if w.startswith("w")), key=lambda w: int(w[1:]))
    rng, g, data = random.Random(31), torch.Generator().manual_seed(31), []
    with torch.no_grad():
        while len(data) < N_TRAIN:
            text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
            if text in held_out:
                continue
            prompt = tok(text)["input_ids"]
            ids, cache, step = list(prompt), None, torch.tensor([prompt])
            for _ in range(N_TRAIN_NEW):
                out = target(step, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                ids.append(int(torch.multinomial(torch.softmax(out.logits[0, -1], -1), 1, generator=g)))
                step = torch.tensor([[ids[-1]]])
            aux, last, logits = target_features(target, ids)
            data.append({"prompt_ids": prompt, "ids": ids, "aux": aux, "last": last, "logits": logits})
    log(f"training data: {len(data)} sequences of {sum(len(d['ids']) for d in data) // len(data)} tokens on average")
    return data


def reference_sequences():
    """demo_sequences() plus the pre-norm last hidden state (the P-EAGLE forwards need verifier targets)."""
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()
    seqs = demo_sequences()
    with torch.no_grad():
        for seq in seqs:
            seq["aux"], seq["last"], seq["logits"] = target_features(target, seq["ids"])
            assert torch.equal(seq["aux"], torch.cat([seq["hidden_states"][i] for i in AUX_IDS], dim=-1))
    return seqs


def verifier(**kw):
    from speculators import VerifierConfig
    return VerifierConfig(name_or_path=TARGET_REL, architectures=["Qwen3ForCausalLM"], **kw)


def write_doc(path, doc):
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")


def differ(a, b):
    """How many anchors' drafts (rows of two [n, K] lists) differ."""
    return sum(x != y for x, y in zip(a, b))


# -- XPress (speculators 0.9.0 models/xpress) ---------------------------------------------------------


def xpress_config():
    """XPressSpeculatorConfig: the demo drafter's layer config as DFlashConverter writes it (window 32, the layer
    types), full vocabulary, block 8, fill-in layout, rank 16, MLP ratio 2, 3 Jacobi passes."""
    from speculators import SpeculatorsConfig
    from speculators.models.xpress import XPressSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    with open(os.path.join(DEMO, "drafter", "config.json")) as f:
        zcfg = json.load(f)
    dcfg = zcfg["dflash_config"]
    assert [i + 1 for i in dcfg["target_layer_ids"]] == AUX_IDS and dcfg["mask_token_id"] == MASK_ID
    block_size = zcfg["block_size"]
    return XPressSpeculatorConfig(
        transformer_layer_config={k: v for k, v in zcfg.items() if k not in NON_TRANSFORMER_KEYS},
        draft_vocab_size=zcfg["vocab_size"], block_size=block_size, aux_hidden_state_layer_ids=AUX_IDS,
        mask_token_id=MASK_ID, sliding_window_non_causal=False, sample_from_anchor=False, **XPRESS,
        speculators_config=SpeculatorsConfig(
            algorithm="xpress", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block_size - 1)],
            default_proposal_method="greedy", verifier=verifier()))


def train_xpress(model, data):
    """XPressDraftModel.forward (speculators' training forward: random anchors, teacher-forced refine pass,
    consistency_passes=3 free-running Jacobi rounds with slot 0's predecessor = the token before the anchor, base
    anchor term) and its loss, XPressArgs' default {"ce": 0.1, "tv": 0.9} with the eager loss implementation and
    ce_from_data (XPressArgs' option for regenerated data: the CE term's labels are the sampled tokens, the TV term
    still matches the verifier's distribution). Only refiner_head trains: the backbone stays the demo drafter's,
    so "base" drafts are dflash_w32's drafts."""
    from speculators.losses import resolve_loss_config
    loss_config = resolve_loss_config('{"ce": 0.1, "tv": 0.9}', "eager")
    model.requires_grad_(False)
    model.refiner_head.requires_grad_(True)
    opt = torch.optim.AdamW(model.refiner_head.parameters(), lr=XPRESS_LR, weight_decay=0.0)
    model.train()
    keys = ("loss", "tf_loss", "consistency_loss", "accuracy", "accept_rate", "base_accept_rate")
    sums = dict.fromkeys(keys, 0.0)
    for step in range(XPRESS_STEPS):
        d = data[step % len(data)]
        T = len(d["ids"])
        loss_mask = torch.zeros(1, T)
        loss_mask[0, len(d["prompt_ids"]):] = 1
        _, loss, metrics = model(
            hidden_states=d["aux"], input_ids=torch.tensor([d["ids"]]), loss_mask=loss_mask,
            verifier_last_hidden_states=d["last"], document_ids=torch.zeros(1, T, dtype=torch.long),
            loss_config=loss_config, max_anchors=XPRESS_ANCHORS, ce_from_data=True)
        opt.zero_grad()
        loss.backward()
        opt.step()
        for k in keys:
            sums[k] += float(metrics[k + "_sum"]) / float(metrics[k + "_total"])
        if (step + 1) % 100 == 0:
            log(f"xpress step {step + 1}: " + " ".join(f"{k} {v / 100:.4f}" for k, v in sums.items()))
            sums = dict.fromkeys(keys, 0.0)
    model.eval()


def xpress_jacobi(head, hcache, base, anchor_ids, passes, topc=0, prev0=None):
    """vLLM 0.33's XPress proposal (qwen3_xpress.XPressRefinerHead.jacobi_refine_greedy, called by
    spec_decode/xpress/speculator.XPressSpeculator._jacobi_refine), every score from speculators' refiner head:
    blk[0] = anchor id, blk[1:] = argmax of the base logits of slots 1..B-1; then `passes` Jacobi passes, all
    slots at once: prev = [prev0, blk[0], ..., blk[B-2]] with prev0 = the ANCHOR id (vLLM: tok_am1 = anchor_ids)
    unless given, bias = refiner_head.block_bias(prev, hcache), blk[1:] = argmax(base + bias) over the full
    vocabulary (topc=0), or with topc=C over the C largest BASE logits of each slot (torch.topk, sorted), fixed for
    every pass: blk = cand[argmax_c(base_c + bias_c)]. float32 (vLLM rounds base + bias to the model dtype).
    Returns the drafts blk[1:] after pass 0 (the base argmax), 1, ..., passes."""
    n, B, _ = base.shape
    slots = base[:, 1:]
    blk = torch.empty(n, B, dtype=torch.long)
    blk[:, 0] = anchor_ids
    blk[:, 1:] = slots.argmax(-1)
    if topc:
        base_c, cand = torch.topk(slots, topc, dim=-1, sorted=True)
        assert torch.equal(cand[..., 0], blk[:, 1:])
    prev0 = anchor_ids if prev0 is None else prev0
    history = [blk[:, 1:].clone()]
    for _ in range(passes):
        prev = torch.cat([prev0[:, None], blk[:, :-1]], dim=1)
        bias = head.block_bias(prev, hcache=hcache)[:, 1:]
        if topc:
            pick = (base_c + bias.gather(-1, cand)).argmax(-1, keepdim=True)
            blk[:, 1:] = cand.gather(-1, pick)[..., 0]
        else:
            blk[:, 1:] = (slots + bias).argmax(-1)
        history.append(blk[:, 1:].clone())
    return history


def xpress_drafts(model, seqs):
    """Per sequence: the backbone at every anchor (backbone(): speculators' _backbone_forward, post-norm hidden and
    lm_head logits), refiner_head.hidden_cache once per block, then xpress_jacobi. Also the drafts after all 7
    passes (the sequential greedy decode) and with speculators' training predecessor for slot 0 (report only)."""
    head, P = model.refiner_head, model.config.num_jacobi_passes
    out = []
    for seq in seqs:
        anchors, hidden, logits, _ = backbone(model, seq)
        ids = torch.tensor(seq["ids"])
        a = torch.tensor(anchors)
        B = hidden.shape[1]
        with torch.no_grad():
            hcache = head.hidden_cache(hidden)
            full = xpress_jacobi(head, hcache, logits, ids[a], B - 1)
            topc = xpress_jacobi(head, hcache, logits, ids[a], P, topc=XPRESS_TOPC)
            am1 = xpress_jacobi(head, hcache, logits, ids[a], P, prev0=ids[a - 1])
        out.append({"anchors": anchors, "n_prompt": len(seq["prompt_ids"]), "topc0": full[P].tolist(),
                    "topc8": topc[P].tolist(), "base": full[0].tolist(), "converged": full[B - 1].tolist(),
                    "trained_prev0": am1[P].tolist(), "truth": [seq["ids"][i + 1:i + B] for i in anchors]})
    return out


def slot_accuracy(results, key):
    """Per slot, how often the draft equals the sequence's own next token (the target's greedy choice)."""
    hits, n = None, 0
    for r in results:
        for d, t in zip(r[key], r["truth"]):
            row = [int(x == y) for x, y in zip(d, t)]
            hits = row if hits is None else [h + x for h, x in zip(hits, row)]
            n += 1
    return [round(h / n, 3) for h in hits]


def load_xpress(path):
    """load_spec(XPressDraftModel), then the refiner's causal mask restored: XPressRefinerHead registers
    causal_tril (tril of ones, [B, B]) as a NON-persistent buffer in __init__, and from_pretrained (transformers
    5.19, meta-device init) leaves it uninitialised memory, so a reloaded model mixes the block with garbage."""
    from speculators.models.xpress import XPressDraftModel
    model = load_spec(XPressDraftModel, path)
    head = model.refiner_head
    tril = torch.tril(torch.ones(head.block_size, head.block_size))
    if not torch.equal(head.causal_tril, tril):
        log("NOTE speculators: XPressDraftModel.from_pretrained left refiner_head.causal_tril uninitialised; "
            "restored to tril(ones)")
        head.causal_tril = tril
    return model


def build_xpress(data, seqs):
    """tests/fixtures/speculators/xpress: XPressDraftModel with the demo drafter's backbone (the same tensors
    DFlashConverter keeps for dflash_w32), refiner trained by train_xpress, saved by save_pretrained."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.xpress import XPressDraftModel
    out_dir = os.path.join(OUT, "xpress")
    torch.manual_seed(31)
    cfg = xpress_config()
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = XPressDraftModel(cfg)
    demo = load_file(os.path.join(DEMO, "drafter", "model.safetensors"))
    missing, unexpected = model.load_state_dict(demo, strict=False)
    assert not unexpected, unexpected
    assert {k for k in missing if not k.startswith("refiner_head.")} == {
        "embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}, missing
    model.load_verifier_weights()
    assert torch.equal(model.refiner_head.causal_tril, torch.tril(torch.ones(8, 8)))
    started = time.time()
    train_xpress(model, data)
    log(f"xpress: {XPRESS_STEPS} training steps in {time.time() - started:.0f} s")
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir)
    finish_dir(out_dir)
    saved = load_file(os.path.join(out_dir, "model.safetensors"))
    head = {k for k in saved if k.startswith("refiner_head.")}
    assert set(saved) - head == set(demo), sorted(set(saved) ^ set(demo))
    assert all(torch.equal(saved[k], v) for k, v in demo.items())
    log(f"{out_dir}: backbone = the demo drafter's {len(demo)} tensors, plus {sorted(head)}")

    res = xpress_drafts(load_xpress(out_dir), seqs)
    ref = dflash_drafts(load_spec(DFlashDraftModel, os.path.join(OUT, "dflash_w32")), seqs)
    assert all(r["base"] == d["drafts"] for r, d in zip(res, ref)), "XPress base drafts != dflash_w32's drafts"
    total = sum(len(r["anchors"]) for r in res)
    for a, b, what in (("topc0", "base", "the refiner changes the base drafts"),
                       ("topc8", "base", "top-8 refined vs base"), ("topc0", "topc8", "top-0 vs top-8"),
                       ("topc0", "converged", "3 passes vs 7 (the sequential decode)"),
                       ("topc0", "trained_prev0", "slot-0 predecessor: anchor (vLLM) vs true token (training)")):
        log(f"SANITY xpress {what}: {sum(differ(r[a], r[b]) for r in res)} of {total} anchors differ")
    for key in ("base", "topc0", "topc8", "converged", "trained_prev0"):
        log(f"SANITY xpress per-slot accuracy vs the target's greedy text, {key}: {slot_accuracy(res, key)}")
    how = ("speculators 0.9.0 XPressDraftModel.from_pretrained(xpress) with eager attention and the target's "
           "embed_tokens/lm_head/norm; the backbone as for dflash_w32 (DFlashDraftModel._backbone_forward at every "
           "anchor: block [anchor token, mask x7], context = the target's aux features of positions < anchor; "
           "post-norm hidden h and base logits = lm_head(h)). Then vLLM 0.33's Jacobi rule (qwen3_xpress "
           "jacobi_refine_greedy + XPressSpeculator._jacobi_refine) with speculators' refiner_head.hidden_cache / "
           "block_bias: blk[0] = anchor id, blk[1:] = argmax base of slots 1..7; num_jacobi_passes = 3 passes, "
           "each prev = [ANCHOR id (vLLM's tok_am1; speculators trains slot 0 with the token before the anchor), "
           "blk[0..6]], refined = base + block_bias(prev), blk[1:] updated all at once. topc0 = argmax over the "
           "full vocabulary; topc8 = among each slot's 8 largest BASE logits (torch.topk sorted, fixed for all "
           "passes): blk = cand[argmax_c(base_c + bias_c)] (first maximum in candidate order); base = the pass-0 "
           "argmax (equal to dflash_w32's drafts: the backbone is the demo drafter's, frozen in training); "
           "topc0_7passes = topc0 with 7 passes (= block_size - 1: every slot settled, the sequential greedy "
           "decode). float32 throughout (vLLM rounds base + bias to bf16 before its argmax).")
    doc = {"how": how, "num_jacobi_passes": XPRESS["num_jacobi_passes"], "topc": XPRESS_TOPC,
           "slot0_prev": "anchor", "sequences": []}
    for seq, r in zip(seqs, res):
        doc["sequences"].append({"prompt_ids": seq["prompt_ids"], "ids": seq["ids"], "n_prompt": r["n_prompt"],
                                 "anchors": r["anchors"], **{k: r[k] for k in ("topc0", "topc8", "base")},
                                 "topc0_7passes": r["converged"]})
    write_doc(out_dir, doc)


# -- P-EAGLE (speculators 0.9.0 models/peagle) --------------------------------------------------------


def peagle_config():
    """PEagleSpeculatorConfig: tests/fixtures/families/eagle3's 1-layer Qwen3 layer config and norm flags
    (norm_before_residual true, as that EAGLE-3 drafter was trained), full vocabulary, aux [2, 4, 5], mask token 2,
    speculative_tokens (num_depths) 5."""
    from speculators import SpeculatorsConfig
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    with open(os.path.join(FAMILIES_DIR, "eagle3", "config.json")) as f:
        ecfg = json.load(f)
    assert ecfg["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    return PEagleSpeculatorConfig(
        transformer_layer_config=ecfg["transformer_layer_config"], draft_vocab_size=ecfg["draft_vocab_size"],
        **{k: ecfg[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")},
        target_hidden_size=None, eagle_aux_hidden_state_layer_ids=AUX_IDS, mask_token_id=MASK_ID,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=PEAGLE_DEPTHS)],
            default_proposal_method="greedy", verifier=verifier()))


def shifted(d):
    """speculators' eagle3 shift_batch (row i = token x_{i+1}, aux g_i, verifier hidden y_{i+1}, loss l_{i+1}); the
    loss mask marks the completion."""
    from speculators.models.eagle3.data import shift_batch
    T = len(d["ids"])
    loss_mask = torch.zeros(T)
    loss_mask[len(d["prompt_ids"]):] = 1
    b = shift_batch({"input_ids": torch.tensor(d["ids"]), "hidden_states": d["aux"][0],
                     "verifier_last_hidden_states": d["last"][0], "loss_mask": loss_mask,
                     "lengths": torch.tensor([T]), "position_ids": torch.arange(T)})
    return {k: v[None] for k, v in b.items() if k != "lengths"}


def per_depth(sums):
    return [round(sums[d][0] / max(sums[d][1], 1), 3) for d in range(PEAGLE_DEPTHS)]


def optimize(model, steps, lr, step_loss, what):
    """AdamW over the model's trainable parameters; step_loss(step) gives (loss, metrics with P-EAGLE's per-depth
    accuracy sums), logged every 100 steps."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    sums, loss_sum = [[0.0, 0.0] for _ in range(PEAGLE_DEPTHS)], 0.0
    for step in range(steps):
        loss, metrics = step_loss(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_sum += float(loss)
        for d in range(PEAGLE_DEPTHS):
            sums[d][0] += float(metrics[f"position_{d}_acc_sum"])
            sums[d][1] += float(metrics[f"position_{d}_acc_total"])
        if (step + 1) % 100 == 0:
            log(f"{what} step {step + 1}: loss {loss_sum / 100:.4f}, per-depth accuracy {per_depth(sums)}")
            sums, loss_sum = [[0.0, 0.0] for _ in range(PEAGLE_DEPTHS)], 0.0
    model.eval()


def train_peagle(model, data):
    """PEagleDraftModel.forward (speculators' P-EAGLE training forward: COD sampling with num_depths 5,
    down_sample_ratio 0.7, min 0.2 (PEagleArgs' defaults), mask rows = mask token + mask_hidden, the P-EAGLE
    attention mask) and its default loss (kl_div, eager implementation). Trainable as in speculators: everything
    but lm_head (frozen by load_verifier_weights) and the verifier copies; embed_tokens trains
    (embed_requires_grad true)."""
    from speculators.losses import resolve_loss_config
    loss_config = resolve_loss_config("kl_div", "eager")

    def step_loss(step):
        b = shifted(data[step % len(data)])
        _, loss, metrics = model(
            hidden_states=b["hidden_states"], input_ids=b["input_ids"],
            document_ids=torch.zeros_like(b["input_ids"]), loss_mask=b["loss_mask"],
            verifier_last_hidden_states=b["verifier_last_hidden_states"], loss_config=loss_config,
            num_depths=PEAGLE_DEPTHS, down_sample_ratio=0.7, down_sample_ratio_min=0.2)
        return loss, metrics
    optimize(model, PEAGLE_STEPS, PEAGLE_LR, step_loss, "peagle")


def all_chains(T1, anchors, K):
    """COD indices with every chain: depth 0 = every shifted row (as generate_cod_sample_indices does), depth d
    (1..K-1) = one row per anchor a, chain anchor a - 1 (the shifted row holding token a and feature a - 1)."""
    chain = torch.tensor(anchors) - 1
    anchor_pos = torch.cat([torch.arange(T1)] + [chain] * (K - 1))
    depth = torch.cat([torch.zeros(T1, dtype=torch.long)]
                      + [torch.full((len(anchors),), d, dtype=torch.long) for d in range(1, K)])
    return anchor_pos, depth


def chain_drafts(logits, T1, anchors, K):
    """Drafts from the rows all_chains laid out: draft 1 from depth-0 row a - 1, draft k + 1 from depth k."""
    n = len(anchors)
    first = logits[torch.tensor(anchors) - 1].argmax(-1)[:, None]
    rest = [logits[T1 + (d - 1) * n:T1 + d * n].argmax(-1)[:, None] for d in range(1, K)]
    return torch.cat([first] + rest, dim=1)


@contextlib.contextmanager
def capture_logits(module, into):
    handle = module.register_forward_hook(lambda _m, _i, out: into.append(out.detach()))
    try:
        yield
    finally:
        handle.remove()


def peagle_rows(anchors, ids, K):
    """vLLM's parallel-drafting rows at anchor a (llm_base_proposer propose / set_inputs_first_pass,
    copy_and_expand_eagle_inputs_kernel): context rows j = 0..a-2 (token j + 1, feature j, position j), the bonus
    row (token a, feature a - 1, position a - 1), K - 1 mask slots (mask token, mask_hidden, positions
    a..a+K-2); causal attention over all of them. Returns (tokens, number of real feature rows, positions)."""
    for a in anchors:
        yield a, torch.tensor(ids[1:a + 1] + [MASK_ID] * (K - 1)), a, torch.arange(a + K - 1)


def causal_float_mask(L):
    m = torch.full((L, L), float("-inf")).triu(1)
    return m[None, None]


def speculators_peagle_drafts(model, seqs):
    """(1) speculators' own PEagleDraftModel.forward, generate_cod_sample_indices replaced by all_chains, logits
    caught at lm_head: the training forward's rows and mask (create_peagle_mask_mod via create_float_mask) ARE
    vLLM's rule. (2) vLLM's rows built explicitly (peagle_rows) through the model's embed_tokens, fc, layers (eager
    attention, explicit causal float mask), norm and lm_head. Both must give the same drafts."""
    import speculators.models.peagle.core as core
    from speculators.losses import resolve_loss_config
    K, out = PEAGLE_DEPTHS, []
    assert model.input_norm is None and model.fc_norm is None and not model.config.norm_output
    for seq in seqs:
        b = shifted(seq)
        T1 = b["input_ids"].shape[1]
        anchors = list(range(len(seq["prompt_ids"]), len(seq["ids"]) - K))
        chains = all_chains(T1, anchors, K)
        original, caught = core.generate_cod_sample_indices, []
        core.generate_cod_sample_indices = lambda **_kw: chains
        try:
            with torch.no_grad(), capture_logits(model.lm_head, caught):
                model(hidden_states=b["hidden_states"], input_ids=b["input_ids"],
                      document_ids=torch.zeros_like(b["input_ids"]), loss_mask=b["loss_mask"],
                      verifier_last_hidden_states=b["verifier_last_hidden_states"], num_depths=K,
                      loss_config=resolve_loss_config("kl_div", "eager"))
        finally:
            core.generate_cod_sample_indices = original
        forward = chain_drafts(caught[0][0], T1, anchors, K)
        explicit = []
        with torch.no_grad():
            for a, tokens, n_real, pos in peagle_rows(anchors, seq["ids"], K):
                feats = torch.cat([seq["aux"][0, :n_real], model.mask_hidden[0].expand(K - 1, -1)], dim=0)
                x = torch.cat([model.embed_tokens(tokens), model.fc(feats)], dim=-1)[None]
                pe = model.rotary_emb(x, pos[None])
                mask = causal_float_mask(len(tokens))
                for layer in model.layers:
                    x = layer(x, attention_mask=mask, position_ids=pos[None], position_embeddings=pe)
                logits = model.lm_head(model.norm(x))[0]
                explicit.append(logits[a - 1:a + K - 1].argmax(-1))
        explicit = torch.stack(explicit)
        assert torch.equal(forward, explicit), "speculators' training forward and vLLM's rows disagree"
        out.append({"anchors": anchors, "n_prompt": len(seq["prompt_ids"]), "drafts": explicit.tolist(),
                    "truth": [seq["ids"][a + 1:a + 1 + K] for a in anchors]})
    return out


def load_peagle(path):
    """PEagleDraftModel.from_pretrained with eager attention; the saved tensors must be the model's."""
    from speculators.models.peagle import PEagleDraftModel
    cfg = PEagleDraftModel.config_class.from_pretrained(path)
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = PEagleDraftModel.from_pretrained(path, config=cfg).eval()
    state = model.state_dict()
    for k, v in load_file(os.path.join(path, "model.safetensors")).items():
        assert torch.equal(state[k], v), k
    return model


def build_peagle(data, seqs):
    """tests/fixtures/speculators/peagle: PEagleDraftModel initialised from tests/fixtures/families/eagle3 (fc,
    layers.0.*, norm, lm_head: the same names and shapes), embed_tokens from the target (load_verifier_weights),
    mask_hidden randn (its constructor); trained by train_peagle; saved by save_pretrained."""
    out_dir = os.path.join(OUT, "peagle")
    from speculators.models.peagle import PEagleDraftModel
    torch.manual_seed(31)
    cfg = peagle_config()
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = PEagleDraftModel(cfg)
    eagle = load_file(os.path.join(FAMILIES_DIR, "eagle3", "model.safetensors"))
    missing, unexpected = model.load_state_dict(eagle, strict=False)
    assert not unexpected, unexpected
    assert set(missing) == {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                            "mask_hidden"}, missing
    model.load_verifier_weights()
    before = speculators_peagle_drafts(model, seqs)
    started = time.time()
    train_peagle(model, data)
    log(f"peagle: {PEAGLE_STEPS} training steps in {time.time() - started:.0f} s")
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir)
    finish_dir(out_dir)
    res = speculators_peagle_drafts(load_peagle(out_dir), seqs)
    log(f"SANITY peagle per-depth accuracy on the reference anchors vs the target's greedy text, eagle3 init: "
        f"{slot_accuracy(before, 'drafts')}, trained: {slot_accuracy(res, 'drafts')}")
    how = ("speculators 0.9.0 PEagleDraftModel.from_pretrained(peagle), eager attention. At every anchor a in "
           "[n_prompt, len(ids) - 1 - 5], vLLM 0.33's parallel drafting (llm_base_proposer propose / "
           "set_inputs_first_pass, copy_and_expand_eagle_inputs_kernel): rows j = 0..a-2 = (token ids[j+1], aux "
           "feature j, position j), the bonus row (token ids[a], feature a-1, position a-1), 4 mask slots (token "
           "mask_token_id 2, hidden fc(mask_hidden), positions a..a+3), causal attention over all rows; drafts[0] = "
           "argmax of the bonus row, drafts[k] = argmax of mask slot k. Computed twice and checked equal: "
           "(1) speculators' own training forward with every chain (generate_cod_sample_indices replaced; shifted "
           "row s = a-1 at depths 1..4 under create_peagle_mask_mod), (2) the rows above through the model's "
           "embed_tokens, fc, layers (explicit causal float mask), norm, lm_head. Aux features = cat(hidden_states"
           "[2], [4], [5]) of one float32 target pass; norm_before_residual true (as saved).")
    doc = {"how": how, "num_depths": PEAGLE_DEPTHS, "mask_token_id": MASK_ID, "sequences": []}
    for seq, r in zip(seqs, res):
        doc["sequences"].append({"prompt_ids": seq["prompt_ids"], "ids": seq["ids"], "n_prompt": r["n_prompt"],
                                 "anchors": r["anchors"], "drafts": r["drafts"]})
    write_doc(out_dir, doc)
    return res


# -- P-EAGLE (SpecForge 0.2.0 modeling/draft/peagle.py) -----------------------------------------------


def specforge_modules():
    """SpecForge's P-EAGLE modules, made importable on CPU: specforge.core.loss (imported by
    algorithms/peagle/model.py) is a Triton kernel, so without triton a stand-in module gives LogSoftmaxLoss that
    file's own reference formula (_compute_loss: -sum(mask * p * log_softmax(logits), -1).mean()). Returns
    (modeling.draft.peagle, algorithms.peagle.model)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        stub = types.ModuleType("specforge.core.loss")

        class LogSoftmaxLoss:
            @staticmethod
            def apply(logits, target_p, position_mask):
                logp = torch.log_softmax(logits.float(), dim=2)
                return -torch.sum(position_mask * target_p * logp, 2).mean()

        stub.LogSoftmaxLoss = LogSoftmaxLoss
        sys.modules["specforge.core.loss"] = stub
    import specforge.modeling.draft.peagle as draft
    import specforge.algorithms.peagle.model as algo
    return draft, algo


@contextlib.contextmanager
def specforge_attention(draft, kind):
    """SpecForge's attention op, compile_friendly_flex_attention (torch.compile of flex_attention), swapped for
    kind="flex": eager flex_attention, the same op uncompiled (CPU, no backward), for the reference drafts; or
    kind="dense": the BlockMask's mask_mod expanded by create_mask, then scaled_dot_product_attention (the same
    math: scale 1/sqrt(head_dim), GQA), for training, since flex_attention has no backward on CPU."""
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    def eager_flex(query, key, value, block_mask=None, enable_gqa=False, **_kernel_options):
        return flex_attention(query, key, value, block_mask=block_mask, enable_gqa=enable_gqa)

    def dense(query, key, value, block_mask=None, enable_gqa=False, **_kernel_options):
        allowed = create_mask(block_mask.mask_mod, None, None, query.shape[-2], key.shape[-2], device=query.device)
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                                                enable_gqa=enable_gqa)

    original = draft.compile_friendly_flex_attention
    draft.compile_friendly_flex_attention = eager_flex if kind == "flex" else dense
    try:
        yield
    finally:
        draft.compile_friendly_flex_attention = original


def specforge_draft_config():
    """The draft config a SpecForge user passes (model.draft_model_config): a flat 1-layer Llama config like
    SpecForge's own P-EAGLE tests, vocab 64 (full), the capture layers in eagle_config (read by
    resolve_eagle_capture_layers; SGLang ids = layer outputs). No norm_before_residual (SpecForge's default:
    False) and no mask_token_id (SpecForge keeps it in its training state only)."""
    return {"architectures": ["PEagleDraftModel"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 64,
            "intermediate_size": 192, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_hidden_layers": 1, "max_position_embeddings": 512, "rope_theta": 10000.0, "vocab_size": 64,
            "draft_vocab_size": 64, "pad_token_id": 0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "attention_bias": False, "eagle_config": {"eagle_aux_hidden_state_layer_ids": SPECFORGE_AUX_LAYERS}}


def specforge_batch(d):
    """SpecForge's P-EAGLE batch, aligned as TargetHead.preprocess does (input_ids and target shifted left by one;
    the same rows as speculators' shift_batch): row i = (x_{i+1}, aux g_i, target logits of position i + 1)."""
    b = shifted(d)
    T1 = b["input_ids"].shape[1]
    return {"input_ids": b["input_ids"], "attention_mask": torch.ones(1, T1, dtype=torch.long),
            "target": d["logits"][:, 1:], "loss_mask": b["loss_mask"], "hidden_states": b["hidden_states"],
            "lengths": torch.tensor([T1])}


def train_specforge(online, data):
    """OnlinePEagleModel.forward (SpecForge's training forward: its COD sampling with num_depths 5 and
    down_sample_ratio 0.8 / min 0.2 (training config defaults), flex block mask, soft cross-entropy against
    softmax(target)). Everything trains (build_peagle_draft does not freeze the embedding)."""
    optimize(online, SPECFORGE_STEPS, SPECFORGE_LR, lambda step: online(**specforge_batch(data[step % len(data)])),
             "specforge peagle")


def specforge_drafts(draft_model, algo, seqs):
    """(1) SpecForge's OnlinePEagleModel.forward with every chain (its generate_cod_sample_indices replaced by
    all_chains; its create_peagle_mask_mod + create_block_mask; logits caught at lm_head); (2) vLLM's rows
    (peagle_rows) through PEagleDraftModel.embed_input_ids, project_hidden_states, backbone (a causal BlockMask)
    and compute_logits. Both must give the same drafts."""
    from torch.nn.attention.flex_attention import create_block_mask
    K, out = PEAGLE_DEPTHS, []
    online = algo.OnlinePEagleModel(draft_model, mask_token_id=MASK_ID, num_depths=K).eval()
    for seq in seqs:
        batch = specforge_batch(seq)
        T1 = batch["input_ids"].shape[1]
        anchors = list(range(len(seq["prompt_ids"]), len(seq["ids"]) - K))
        chains = all_chains(T1, anchors, K)
        original, caught = algo.generate_cod_sample_indices, []
        algo.generate_cod_sample_indices = lambda **_kw: chains
        try:
            with torch.no_grad(), capture_logits(draft_model.lm_head, caught):
                online(**batch)
        finally:
            algo.generate_cod_sample_indices = original
        forward = chain_drafts(caught[0][0], T1, anchors, K)
        explicit = []
        with torch.no_grad():
            for a, tokens, n_real, pos in peagle_rows(anchors, seq["ids"], K):
                L = len(tokens)
                feats = torch.cat([seq["aux"][0, :n_real], draft_model.mask_hidden[0].expand(K - 1, -1)], dim=0)
                mask = create_block_mask(lambda _b, _h, q, kv: q >= kv, B=None, H=None, Q_LEN=L, KV_LEN=L,
                                         device="cpu")
                h = draft_model.backbone(input_embeds=draft_model.embed_input_ids(tokens[None]),
                                         hidden_states=draft_model.project_hidden_states(feats[None]),
                                         attention_mask=mask, position_ids=pos[None])
                logits = draft_model.compute_logits(h)[0]
                explicit.append(logits[a - 1:a + K - 1].argmax(-1))
        explicit = torch.stack(explicit)
        assert torch.equal(forward, explicit), "SpecForge's training forward and vLLM's rows disagree"
        out.append({"anchors": anchors, "n_prompt": len(seq["prompt_ids"]), "drafts": explicit.tolist(),
                    "truth": [seq["ids"][a + 1:a + 1 + K] for a in anchors]})
    return out


def build_peagle_specforge(data, seqs):
    """tests/fixtures/families/peagle_specforge: SpecForge's PEagleDraftModel (Llama, 1 layer, norm_before_residual
    False), initialised from tests/fixtures/speculators/peagle where the tensors map (every name but the Qwen3
    layer's self_attn.q_norm / k_norm, which SpecForge's Llama attention lacks), trained by train_specforge, then
    exported by SpecForge's own export_to_hf (a training_state.pt with draft_state_dict + the draft config file):
    AutoDraftModel.from_config in bf16, the state loaded (trained keys win, so float32 tensors),
    save_pretrained, apply_legacy_rope_scaling."""
    from transformers import LlamaConfig
    from specforge.export.to_hf import export_to_hf
    from specforge.modeling.auto import AutoDraftModel
    draft, algo = specforge_modules()
    out_dir = os.path.join(FAMILIES_DIR, "peagle_specforge")
    torch.manual_seed(31)
    model = draft.PEagleDraftModel(LlamaConfig(**specforge_draft_config()))
    spec = load_file(os.path.join(OUT, "peagle", "model.safetensors"))
    dropped = {k for k in spec if k.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight"))}
    missing, unexpected = model.load_state_dict({k: v for k, v in spec.items() if k not in dropped}, strict=False)
    assert not unexpected and set(missing) == {"t2d", "d2t"}, (missing, unexpected)
    log(f"specforge peagle: {len(spec) - len(dropped)} tensors from speculators' peagle, dropped {sorted(dropped)}")
    with specforge_attention(draft, "flex"):
        before = specforge_drafts(model, algo, seqs)
    with specforge_attention(draft, "dense"):
        assert specforge_drafts(model, algo, seqs[:1]) == before[:1]
        started = time.time()
        train_specforge(algo.OnlinePEagleModel(model, mask_token_id=MASK_ID, num_depths=PEAGLE_DEPTHS,
                                               down_sample_ratio=0.8, down_sample_ratio_min=0.2), data)
        log(f"specforge peagle: {SPECFORGE_STEPS} training steps in {time.time() - started:.0f} s")
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, state_path = os.path.join(tmp, "draft_config.json"), os.path.join(tmp, "training_state.pt")
        with open(cfg_path, "w") as f:
            json.dump(specforge_draft_config(), f, indent=1)
        torch.save({"draft_state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   state_path)
        shutil.rmtree(out_dir, ignore_errors=True)
        export_to_hf(state_path, cfg_path, out_dir)
    assert sorted(os.listdir(out_dir)) == ["config.json", "model.safetensors"], os.listdir(out_dir)
    saved = load_file(os.path.join(out_dir, "model.safetensors"))
    reloaded = AutoDraftModel.from_pretrained(out_dir, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "PEagleDraftModel"
    state = reloaded.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(saved[k].float(), v.float()) and torch.equal(state[k].float(), v.float()), k
    with specforge_attention(draft, "flex"):
        res = specforge_drafts(reloaded, algo, seqs)
    log(f"SANITY specforge peagle per-depth accuracy on the reference anchors, speculators init (no q/k norm): "
        f"{slot_accuracy(before, 'drafts')}, trained: {slot_accuracy(res, 'drafts')}")
    how = ("SpecForge 0.2.0 PEagleDraftModel loaded back by AutoDraftModel.from_pretrained(peagle_specforge, "
           "float32). Rows and drafts exactly as in tests/fixtures/speculators/peagle/expected.json (vLLM 0.33's "
           "parallel drafting at every anchor a in [n_prompt, len(ids) - 1 - 5], mask token 2 (NOT in config.json: "
           "SpecForge keeps it in its training state), 4 mask slots), computed twice and checked equal: (1) "
           "SpecForge's OnlinePEagleModel.forward with every chain (generate_cod_sample_indices replaced; its "
           "create_peagle_mask_mod BlockMask; logits caught at lm_head), (2) the rows through embed_input_ids, "
           "project_hidden_states, backbone (causal BlockMask, SpecForge's RoPE) and compute_logits. flex_attention "
           "run eagerly (SpecForge compiles it; training used the same math densely: no flex backward on CPU). "
           "Aux features = hidden_states[2], [4], [5] = the outputs of layers 1, 3, 4 (eagle_config ids [1, 3, 4], "
           "SGLang's capture convention); norm_before_residual false.")
    doc = {"how": how, "num_depths": PEAGLE_DEPTHS, "mask_token_id": MASK_ID, "aux_hidden_state_indices": AUX_IDS,
           "sequences": []}
    for seq, r in zip(seqs, res):
        doc["sequences"].append({"prompt_ids": seq["prompt_ids"], "ids": seq["ids"], "n_prompt": r["n_prompt"],
                                 "anchors": r["anchors"], "drafts": r["drafts"]})
    write_doc(out_dir, doc)


FIXTURE_GROUPS = ("dflash", "xpress", "peagle", "peagle_specforge")


def run(argv):
    """`--only GROUP[,GROUP]`: dflash (main(): dflash, dflash_w32, dflash2, dflash2_w32_bidi), xpress, peagle,
    peagle_specforge (reads the saved speculators peagle). Default: all, in that order."""
    only = list(FIXTURE_GROUPS)
    if argv:
        if len(argv) != 2 or argv[0] != "--only" or not set(argv[1].split(",")) <= set(FIXTURE_GROUPS):
            sys.exit(f"usage: make_speculators_fixtures.py [--only {{{','.join(FIXTURE_GROUPS)}}}[,...]]")
        only = [g for g in FIXTURE_GROUPS if g in argv[1].split(",")]
    os.chdir(ROOT)
    if "dflash" in only:
        main()
    new = [g for g in only if g != "dflash"]
    if not new:
        return
    seqs = reference_sequences()
    data = training_data() if {"xpress", "peagle", "peagle_specforge"} & set(new) else None
    if "xpress" in new:
        build_xpress(data, seqs)
    if "peagle" in new:
        build_peagle(data, seqs)
    if "peagle_specforge" in new:
        build_peagle_specforge(data, seqs)


if __name__ == "__main__":
    run(sys.argv[1:])
