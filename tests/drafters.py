"""Builders for the drafter generations and checkpoint layouts the public code runs, and the public loop.

A random drafter on a random target accepts almost nothing, so comparisons of rounds would have no teeth.
These builders start from the trained demo drafter and change what is being tested:
- `dflash2_from_demo`: DFlash 2. Conv taps close to the identity (base kernel 1 at offset 0, small random
  taps) and a small random selector keep most of the demo's skill, so rounds vary between 1 and B.
- `with_config`: the demo drafter with some config keys changed, e.g. input_embedding_scale.
- `native_from_demo`: the same weights in the transformers-native assistant layout (muse_glimmer_assistant).

`public_rounds` runs z-lab's dflash 0.1.0 `dflash_generate` and returns its tokens and acceptance lengths.
"""
import json
import math
import os
import time

import torch
from safetensors.torch import load_file, save_file

import eval_drafter as ed

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "fixtures", "demo")
DEMO_DRAFTER = os.path.join(DEMO, "drafter")


def demo_pair():
    """The demo target (float32), its prompt lines and their token ids (plain text, as the tool encodes them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    with open(os.path.join(DEMO, "prompts.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return target, rows, [tok(row["prompt"])["input_ids"] for row in rows]


def demo_drafter_files():
    with open(os.path.join(DEMO_DRAFTER, "config.json")) as f:
        return json.load(f), load_file(os.path.join(DEMO_DRAFTER, "model.safetensors"))


def save(out_dir, cfg, weights):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"))
    return str(out_dir)


def with_config(out_dir, top=None, dflash=None, drop=()):
    """The demo drafter with top-level keys `top` and dflash_config keys `dflash` set, keys `drop` removed."""
    cfg, weights = demo_drafter_files()
    cfg.update(top or {})
    cfg["dflash_config"].update(dflash or {})
    for key in drop:
        cfg.pop(key, None)
    return save(out_dir, cfg, weights)


DFLASH2_KNOBS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
                 "output_multiplier": 1.25, "final_logit_softcapping": 12.0, "input_embedding_scale": 4.0}


def dflash2_weights(cfg, weights, knobs, seed=0, tap_scale=0.05, code_scale=0.6):
    """Conv and selector tensors in the public DFlash 2 layout (codebooks as bare tensors)."""
    g = torch.Generator().manual_seed(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    K, groups, rank = knobs["conv_kernel_size"], H // knobs["conv_group_size"], knobs["selector_rank"]
    out = dict(weights)
    for i in range(cfg["num_hidden_layers"]):
        for sub in ("attention_conv", "mlp_conv"):
            base = tap_scale * torch.randn(2, K, H, generator=g)
            base[:, 0] += 1.0   # close to the identity: the demo drafter's skill survives
            out[f"layers.{i}.{sub}.base_kernel"] = base
            out[f"layers.{i}.{sub}.kernel_projection.weight"] = tap_scale * torch.randn(2 * K * groups, H, generator=g)
    out["candidate_selector.hidden_projection.weight"] = torch.randn(rank, H, generator=g) / math.sqrt(H)
    out["candidate_selector.predecessor_codebook"] = code_scale * torch.randn(V, rank, generator=g)
    out["candidate_selector.successor_codebook"] = code_scale * torch.randn(V, rank, generator=g)
    return out


def dflash2_from_demo(out_dir, seed=0, is_causal=False, block_size_in_dflash_config=True, **knobs):
    """A DFlash 2 drafter grown from the demo drafter: one sliding and one full layer, conv taps, selector,
    multiplier, softcap and embedding scale (DFLASH2_KNOBS, overridden by `knobs`)."""
    cfg, weights = demo_drafter_files()
    knobs = {**DFLASH2_KNOBS, **knobs}
    weights = dflash2_weights(cfg, weights, knobs, seed)
    cfg.update(architectures=["DFlash2DraftModel"])
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    cfg["dflash_config"].update(knobs)
    if block_size_in_dflash_config:
        cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    return save(out_dir, cfg, weights)


def native_from_demo(out_dir, sliding_window=32):
    """The demo drafter's weights in the transformers-native assistant layout: context projection under
    encoder.*, block_size / mask_token_id / target_layer_ids at the top level, model_type
    muse_glimmer_assistant (bidirectional in every layer, sliding layers windowed)."""
    cfg, weights = demo_drafter_files()
    names = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    weights = {names.get(k, k): v for k, v in weights.items()}
    native = {"architectures": ["MuseGlimmerAssistantModel"], "model_type": "muse_glimmer_assistant",
              **{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                                     "layer_types", "block_size")},
              "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"]},
              "sliding_window": sliding_window, "mask_token_id": cfg["dflash_config"]["mask_token_id"],
              "target_layer_ids": cfg["dflash_config"]["target_layer_ids"],
              "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0}
    return save(out_dir, native, weights)


# ----------------------------------------------------------------------------------------------------
# The public loop


def _crop_to_4x(cache, length):
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def public_module(monkeypatch):
    """dflash.model, made to run on CPU under the installed transformers. Its stats time with
    torch.cuda.synchronize: on CPU the clock alone does. It is written for transformers 5.x: under 4.x two
    cache helpers get 4.x semantics (a plain DynamicCache, since 4.x has no past recording; a rollback that
    never calls crop(0), which empties a 4.x cache). Its loop and its models are used as they are."""
    import transformers
    from transformers import DynamicCache
    import dflash.model as public
    monkeypatch.setattr(public, "_cuda_time", time.perf_counter)
    if ed.version_tuple(transformers.__version__) < (5, 0, 0):
        monkeypatch.setattr(public, "_make_cache", lambda config: DynamicCache())
        monkeypatch.setattr(public, "_crop_to", _crop_to_4x)
    return public


def public_rounds(public, drafter_dir, target, prompt_ids, n_new):
    """dflash_generate's output tokens and acceptance lengths (greedy, float32)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(drafter_dir)
    cls = public.DFlash2DraftModel if "DFlash2DraftModel" in (config.architectures or []) else public.DFlashDraftModel
    model = cls.from_pretrained(drafter_dir, config=config, dtype=torch.float32).eval()
    out = public.dflash_generate(model, target, torch.tensor([prompt_ids]), n_new, None, return_stats=True)
    return out.output_ids[0, len(prompt_ids):].tolist(), out.acceptance_lengths
