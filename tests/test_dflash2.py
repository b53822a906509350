"""DFlash 2 pieces against naive references, the config knobs, checkpoint layouts and their refusals.

End to end, test_public_loop.py checks DFlash 2 rounds against the public loop; here each piece is checked
on its own: the grouped dynamic causal convolution, the candidate path selector, the logit transform, that
every knob changes the drafts (so the end-to-end equality exercises it), and what the loader recognizes or
refuses.
"""
import json
import math
import os
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

import eval_drafter as ed
from conftest import drafter_settings
from drafters import DEMO, dflash2_from_demo, native_from_demo, with_config


@pytest.fixture(scope="module")
def demo_target():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()


def naive_conv(x, taps, base, group):
    """out[t, c] = sum_o (base[o, c] + taps[t, o, c // group]) * x[t - o, c], x[< 0] = 0: float64 loops."""
    n, B, H = x.shape
    out = torch.zeros(n, B, H, dtype=torch.float64)
    for t in range(B):
        for o in range(base.shape[0]):
            if t - o < 0:
                continue
            for c in range(H):
                out[:, t, c] += (base[o, c].double() + taps[:, t, o, c // group].double()) * x[:, t - o, c].double()
    return out


@pytest.mark.parametrize("K,group,B", [(2, 4, 5), (3, 2, 4), (4, 8, 3)])
def test_block_conv_matches_naive(K, group, B):
    g = torch.Generator().manual_seed(K)
    n, H = 3, 16
    x, base = torch.randn(n, B, H, generator=g), torch.randn(K, H, generator=g)
    taps = torch.randn(n, B, K, H // group, generator=g)
    got = ed.block_conv(x.reshape(n * B, H), taps, base, group).view(n, B, H)
    torch.testing.assert_close(got.double(), naive_conv(x, taps, base, group), rtol=1e-5, atol=1e-5)
    # Causal within each block: the first slot sees only itself, whatever the later slots hold.
    y = x.clone()
    y[:, 1:] = torch.randn(n, B - 1, H, generator=g)
    first = ed.block_conv(y.reshape(n * B, H), taps, base, group).view(n, B, H)[:, 0]
    torch.testing.assert_close(first, got[:, 0])


def naive_path(unary, candidates, projected, before, after, anchor):
    """One anchor, slot by slot, every candidate scored in plain Python."""
    path, previous = [], anchor
    for j in range(len(unary)):
        scores = [float(unary[j][c]) + sum(float(before[previous][r] * projected[j][r] * after[candidates[j][c]][r])
                                           for r in range(len(projected[j]))) for c in range(len(candidates[j]))]
        previous = int(candidates[j][max(range(len(scores)), key=scores.__getitem__)])
        path.append(previous)
    return path


def test_selector_path_matches_naive(demo_target, tmp_path):
    drafter = ed.load_drafter(dflash2_from_demo(tmp_path / "d2"), demo_target.config, drafter_settings())
    g = torch.Generator().manual_seed(1)
    n, steps, k = 6, drafter.block_size - 1, drafter.selector_top_k
    rank, V = drafter.weights["candidate_selector.hidden_projection.weight"].shape[0], demo_target.config.vocab_size
    unary = torch.randn(n * steps, k, generator=g)
    candidates = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n * steps)])
    projected = torch.randn(n * steps, rank, generator=g)
    first = torch.randint(0, V, (n,), generator=g)
    got = ed.select_path(drafter, unary, candidates, projected, first).view(n, steps)
    before = drafter.weights["candidate_selector.predecessor_codebook"]
    after = drafter.weights["candidate_selector.successor_codebook"]
    for i in range(n):
        rows = slice(i * steps, (i + 1) * steps)
        want = naive_path(unary[rows], candidates[rows], projected[rows], before, after, int(first[i]))
        assert got[i].tolist() == want
    # The path is not the per-slot argmax: the pairwise term moves picks.
    assert (got != candidates.view(n, steps, k).gather(2, unary.view(n, steps, k).argmax(-1, keepdim=True))[..., 0]).any()


def test_logit_transform():
    drafter = ed.Drafter(name="x", checkpoint="", cfg={}, weights={}, layers=[], block_size=4, mask_token_id=0,
                         rules=[], rope=None, logit_rows=16, logit_multiplier=1.5, softcap=8.0)
    z = torch.linspace(-40, 40, 33)[None]
    logits, argmax = ed.drafter_logits(drafter, lambda rows: rows, z, "p")
    torch.testing.assert_close(logits, 8.0 * torch.tanh(1.5 * z / 8.0))
    assert int(argmax) == 32
    with pytest.raises(ed.UsageError, match="prompt p"):
        ed.drafter_logits(drafter, lambda rows: rows, torch.tensor([[0.0, math.nan]]), "p")


def drafts_of(drafter, target, ids, anchors):
    features = ed.extract_hidden(target, ids, drafter.layers, 4).features
    ids_t = torch.tensor(ids)
    drafts, _ = ed.draft_all_anchors(drafter, ed.prompt_context(drafter, features), anchors, ids_t[anchors],
                                     target.get_input_embeddings().weight, target.get_output_embeddings())
    return drafts


def test_every_dflash2_knob_changes_the_drafts(demo_target, tmp_path):
    """Neutralize one knob at a time: the drafts change, so rounds equal to the public loop's mean each knob is
    applied as the public code applies it."""
    drafter = ed.load_drafter(dflash2_from_demo(tmp_path / "d2"), demo_target.config, drafter_settings())
    assert drafter.conv == (2, 16) and drafter.selector_top_k == 4
    assert (drafter.logit_multiplier, drafter.softcap, drafter.embed_scale) == (1.25, 12.0, 4.0)
    ids = [4 + (7 * k) % 60 for k in range(90)]
    anchors = torch.arange(4, 80)
    base = drafts_of(drafter, demo_target, ids, anchors)
    variants = {"no selector": replace(drafter, selector_top_k=0), "no multiplier": replace(drafter, logit_multiplier=1.0),
                "no softcap": replace(drafter, softcap=0.0), "no embedding scale": replace(drafter, embed_scale=1.0),
                "no conv taps": replace(drafter, conv=())}
    for name, variant in variants.items():
        weights = variant.weights
        if name == "no conv taps":   # drop the conv tensors with the taps
            weights = {k: v for k, v in weights.items() if "_conv." not in k}
        assert (drafts_of(replace(variant, weights=weights), demo_target, ids, anchors) != base).any(), name


# ----------------------------------------------------------------------------------------------------
# Loading: what is recognized, said in a line, or refused in one


def load_line(path, capsys, target_cfg):
    ed.load_drafter(str(path), target_cfg, drafter_settings(quiet=False))
    return capsys.readouterr().err


def test_recognized_generation_and_layout_in_one_line(tmp_path, demo_target, capsys):
    cfg = demo_target.config
    assert "drafter d1: DFlash, public layout" in load_line(with_config(tmp_path / "d1"), capsys, cfg)
    assert "drafter d2: DFlash 2, public layout" in load_line(dflash2_from_demo(tmp_path / "d2"), capsys, cfg)
    assert "drafter n: DFlash, transformers-native assistant layout" in \
        load_line(native_from_demo(tmp_path / "n"), capsys, cfg)


def test_dflash2_codebooks_with_weight_suffix_and_config_inferred(tmp_path, demo_target, capsys):
    """Codebooks saved as nn.Embedding weights (".weight") load like bare ones; conv sizes and the selector's
    candidates missing from the config come from the shapes and the public default, said in a line."""
    path = dflash2_from_demo(tmp_path / "d2")
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name in ("predecessor_codebook", "successor_codebook"):
        weights[f"candidate_selector.{name}.weight"] = weights.pop(f"candidate_selector.{name}")
    save_file(weights, os.path.join(path, "model.safetensors"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    for key in ("conv_kernel_size", "conv_group_size", "selector_top_k"):
        del cfg["dflash_config"][key]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    err = load_line(path, capsys, demo_target.config)
    assert "inferred conv_kernel_size 2, conv_group_size 16, selector_top_k 16" in err
    drafter = ed.load_drafter(path, demo_target.config, drafter_settings())
    assert drafter.conv == (2, 16) and drafter.selector_top_k == 16


BROKEN = {
    "missing_conv": (lambda w: w.pop("layers.1.mlp_conv.base_kernel"),
                     "does not match a DFlash 2 drafter of its config: 1 missing (layers.1.mlp_conv.base_kernel)"),
    "missing_codebook": (lambda w: w.pop("candidate_selector.successor_codebook"),
                         "1 missing (candidate_selector.successor_codebook)"),
    "misshapen_codebook": (lambda w: w.update({"candidate_selector.successor_codebook": torch.zeros(63, 8)}),
                           "tensor candidate_selector.successor_codebook has shape (63, 8), its config implies (64, 8)"),
    "misshapen_taps": (lambda w: w.update({"layers.0.attention_conv.kernel_projection.weight": torch.zeros(15, 64)}),
                       "tensor layers.0.attention_conv.kernel_projection.weight has shape (15, 64), its config implies "
                       "(16, 64)"),
    "nan_base_kernel": (lambda w: w["layers.0.attention_conv.base_kernel"].__setitem__((0, 0, 0), math.nan),
                        "tensor layers.0.attention_conv.base_kernel holds NaN or Inf"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_dflash2_checkpoint_is_one_line(tmp_path, capsys, case):
    path = dflash2_from_demo(tmp_path / "d2")
    weights = load_file(os.path.join(path, "model.safetensors"))
    BROKEN[case][0](weights)
    save_file(weights, os.path.join(path, "model.safetensors"))
    assert ed.main(["--demo", "--ckpt", path, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: drafter ") and BROKEN[case][1] in err[0], err


def test_bad_conv_group_is_one_line(tmp_path, capsys):
    path = dflash2_from_demo(tmp_path / "d2", conv_group_size=24)   # 64 channels: 24 does not divide them
    assert ed.main(["--demo", "--ckpt", path, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "conv_group_size 24 does not divide the hidden size 64" in err[0]


NOPE = {"dflash": (lambda d: with_config(d, top={"no_rope_layers": [1]}),
                   "its config lists no_rope_layers, which vLLM 0.34 reads for DFlash 2 drafters only"),
        "past_the_layers": (lambda d: dflash2_from_demo(d, no_rope_layers=[0, 2]),
                            "its no_rope_layers [0, 2] name a layer past its 2"),
        "not_a_list": (lambda d: dflash2_from_demo(d, no_rope_layers=1), "no_rope_layers")}


def test_no_rope_layers_said_on_the_load_line(tmp_path, demo_target, capsys):
    err = load_line(dflash2_from_demo(tmp_path / "d2", no_rope_layers=[1]), capsys, demo_target.config)
    assert "DFlash 2, public layout" in err and "no RoPE in layers [1] (vLLM 0.34 serves it as " \
        "DFlash2RicursiveDraftModel" in err


@pytest.mark.parametrize("case", sorted(NOPE))
def test_misplaced_no_rope_layers_are_one_line(tmp_path, capsys, case):
    path = NOPE[case][0](tmp_path / "d")
    assert ed.main(["--demo", "--ckpt", path, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and NOPE[case][1] in err[0], err


# ----------------------------------------------------------------------------------------------------
# The rest of the tool with a DFlash 2 drafter


def run(tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    assert ed.main(["--demo", "--limit", "4", "--max-new-tokens", "64", "--ignore-eos", "--quiet", "--output", str(out),
                    *argv]) == 0
    return json.loads(out.read_text())


def test_dflash2_walk_cache_and_mask_check(tmp_path):
    """--anchors walk gives --anchors all's rounds; a hidden-state cache gives the direct run's numbers; the mask
    check runs; DDTree is null with its note, next to a DFlash drafter that keeps its trees."""
    d2 = dflash2_from_demo(tmp_path / "d2")
    both = ["--ckpt", f"d2={d2}", "--ckpt", f"d1={os.path.join(DEMO, 'drafter')}"]
    every = run(tmp_path, "all", *both, "--save-hidden", str(tmp_path / "h.safetensors"))
    walked = run(tmp_path, "walk", *both, "--anchors", "walk")
    for a, w in zip(every["drafters"], walked["drafters"]):
        assert [p["rounds"] for p in a["prompts"]] == [p["rounds"] for p in w["prompts"]]
    two, one = every["drafters"]
    assert two["ddtree"] is None and all(s["ddtree"] is None for s in two["splits"].values())
    assert "DFlash 2" in two["ddtree_note"]
    assert set(one["ddtree"]) == {"8", "32", "128"} and "ddtree_note" not in one
    assert all(p["ddtree_rounds"] == {} for p in two["prompts"])
    loaded = tmp_path / "loaded.json"
    assert ed.main(["--target", os.path.join(DEMO, "target"), *both, "--load-hidden", str(tmp_path / "h.safetensors"),
                    "--quiet", "--output", str(loaded)]) == 0
    assert json.loads(loaded.read_text())["drafters"] == every["drafters"]
    checked = run(tmp_path, "mask", "--ckpt", f"d2={d2}", "--check-mask")["drafters"][0]["mask_check"]
    assert checked["modes"]["configured"]["block_mask"] == ["bidirectional, window 32", "bidirectional"]
    assert checked["modes"]["causal"]["accuracy"] != checked["modes"]["configured"]["accuracy"]
