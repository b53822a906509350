"""Build the committed speculators-layout drafter fixtures under tests/fixtures/speculators/.

Its outputs are committed, so the tests never need speculators. Only rerun this script to rebuild them. It needs
speculators 0.9.0 and its light dependencies in a separate venv. On CPU:

    python -m venv /tmp/spec_venv && . /tmp/spec_venv/bin/activate
    pip install torch==2.13.0 "transformers>=5.0.0,<=5.19.0" safetensors pydantic loguru openai \
        "datasets>=4.0.0,<=5.1.0"
    pip install --no-deps hs-connectors==0.9.0 speculators==0.9.0
    python tests/make_speculators_fixtures.py

(`import speculators` pulls in openai, datasets and hs_connectors. The other Requires-Dist entries, such as vllm
helpers, torchvision and triton, are not needed to convert, save or run a forward on CPU.)

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

The sequences are the first 4 demo prompts, each followed by the demo target's float32 greedy continuation of 64
tokens (no EOS stop). The anchors are every a in [len(prompt), len(seq) - block_size]. The aux hidden states come
from one teacher-forced float32 pass of the target (transformers' `hidden_states`, indexed by
aux_hidden_state_layer_ids as speculators indexes them).
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


#@@NEW@@
