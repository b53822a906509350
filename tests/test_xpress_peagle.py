"""XPress and P-EAGLE drafters, exact like the others.

- Greedy: the tool's rounds equal, round by round, those of an online greedy loop that drafts one round at a time
  from the committed tokens alone, the proposal step written here in plain torch from vLLM 0.33's source.
  XPress (jacobi_refine_greedy and its Triton latent pass): the base argmax, then P Jacobi passes of the refiner,
  slot 0 reading the anchor itself as the token before it, top-c candidates fixed from the base logits; with the
  checkpoint's passes, --xpress-topc 4 and --xpress-passes 1 (the backbone as the DFlash tests run it online).
  P-EAGLE (parallel drafting): one causal pass over the text rows (row j: token j + 1, fc(features at j), position j)
  and K - 1 mask slots after them; draft 1 from the bonus token's row, draft k + 1 from slot k; in speculators' and
  SpecForge's layouts. The fixtures are framework-made (tests/make_speculators_fixtures.py).
- The tool's drafts at every anchor equal those the frameworks' own modules give (expected.json): speculators'
  XPressDraftModel by vLLM's rule (3 passes, top-c 8, no pass), speculators' and SpecForge's PEagleDraftModel.
- vLLM's layout of the same XPress drafter (xpress_head.* names, xpress_* keys) gives the same results.
- Refusals, in one line.
P-EAGLE's rows read the drafter's own trained embed_tokens, as vLLM and both trainers do.
"""
import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import eval_drafter as ed
from conftest import drafter_settings, online_draft_hidden, refused_in_one_line
from drafters import demo_pair, online_rounds, run_tool

HERE = os.path.dirname(os.path.abspath(__file__))
XPRESS = os.path.join(HERE, "fixtures", "speculators", "xpress")
PEAGLE = os.path.join(HERE, "fixtures", "speculators", "peagle")
PEAGLE_SF = os.path.join(HERE, "fixtures", "families", "peagle_specforge")
N_NEW = 48
N_PROMPTS = 5


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


def read(path):
    return json.load(open(os.path.join(path, "config.json"))), load_file(os.path.join(path, "model.safetensors"))


def copy_with(tmp_path, src, name, config=None, weights=None):
    """A copy of a fixture with its config changed by config(cfg) and its tensors by weights(state)."""
    cfg, state = read(src)
    if config:
        config(cfg)
    if weights:
        state = weights(state)
    out = tmp_path / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return str(out)


def rounds(report, j=0):
    return [p["rounds"] for p in report["drafters"][j]["prompts"]]


# ----------------------------------------------------------------------------------------------------
# XPress, as vLLM 0.33 drafts it (qwen3_xpress.py jacobi_refine_greedy, xpress/kernels.py), one block at a time


def xpress_config(path):
    """(passes, top-c) the way vLLM's XPressSpeculator reads them: xpress_num_passes (speculators' name:
    num_jacobi_passes), default 6; xpress_topc, default 512."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    passes = cfg.get("xpress_num_passes", cfg.get("num_jacobi_passes", 6))
    return passes, cfg.get("xpress_topc", 512)


def refiner_weights(path):
    """The refiner's tensors by speculators' names (vLLM's xpress_head.* renamed), float32."""
    vllm_names = {"w1.weight": "token_embed.weight", "w2.weight": "readout.weight", "mix.L": "mix_l",
                  "mlp.gate_proj.weight": "mlp_gate.weight", "mlp.up_proj.weight": "mlp_up.weight",
                  "mlp.down_proj.weight": "mlp_down.weight"}
    out = {}
    for k, v in load_file(os.path.join(path, "model.safetensors")).items():
        if k.startswith("refiner_head."):
            out[k[len("refiner_head."):]] = v.float()
        elif k.startswith("xpress_head."):
            k = k[len("xpress_head."):]
            out[vllm_names.get(k, k)] = v.float()
    return out


@torch.no_grad()
def xpress_refine(w, hidden, base, anchor, passes, topc):
    """One block's K drafts: hidden (B, H) the backbone's post-norm rows (slot 0 the anchor's), base (B - 1, V) the
    mask slots' base logits. Slot by slot and channel by channel, as the Triton kernel walks it: x[b] = in_proj
    [down_h h_b; down_g mean(h); w1[prev_b]], prev_0 = the anchor itself, prev_b = the current draft b - 1; u[b] = x[b]
    + sum_{j <= b} L[:, b, j] x[j]; lat = u + SwiGLU(u); each draft = the argmax of base + w2 lat (over the slot's
    top-c base tokens when 0 < c < V). Every pass reads the previous pass's block (Jacobi)."""
    B, V = hidden.shape[0], base.shape[1]
    g = hidden.mean(0)
    hc = [torch.cat([w["down_h.weight"] @ hidden[b], w["down_g.weight"] @ g]) for b in range(B)]
    cands = [base[k].topk(topc).indices.tolist() if 0 < topc < V else list(range(V)) for k in range(B - 1)]
    block = [anchor] + [int(base[k].argmax()) for k in range(B - 1)]
    for _ in range(passes):
        prev = [anchor] + block[:-1]
        x = [w["in_proj.weight"] @ torch.cat([hc[b], w["token_embed.weight"][prev[b]]]) for b in range(B)]
        new = [anchor]
        for b in range(1, B):
            u = x[b] + sum(w["mix_l"][:, b, j] * x[j] for j in range(b + 1))
            lat = u + w["mlp_down.weight"] @ (F.silu(w["mlp_gate.weight"] @ u) * (w["mlp_up.weight"] @ u))
            scores = {c: float(base[b - 1, c] + w["readout.weight"][c] @ lat) for c in cands[b - 1]}
            new.append(max(cands[b - 1], key=lambda c: scores[c]))   # the first of equal maxima, in candidate order
        block = new
    return block[1:]


def xpress_proposer(target, path, passes, topc):
    """propose(seq): the round's drafts anchored at seq's last token, from a fresh block over the committed tokens
    (the backbone as the DFlash tests run it online, conftest.online_draft_hidden), then the refiner."""
    drafter = ed.load_drafter(path, target.config, drafter_settings())
    w, B = refiner_weights(path), drafter.block_size
    lm_head = target.get_output_embeddings()

    def propose(seq):
        hidden = online_draft_hidden(target, drafter, seq, B)
        return xpress_refine(w, hidden, lm_head(hidden[1:]), seq[-1], passes, topc)
    return propose


# ----------------------------------------------------------------------------------------------------
# P-EAGLE, as vLLM 0.33 drafts it (llm_base_proposer.py parallel drafting, llama_eagle3.py / qwen3_eagle3.py)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, theta):
    """x (n, heads, head_dim) at positions pos (n,): rotate-half RoPE."""
    hd = x.shape[-1]
    ang = pos[:, None].float() * (1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


class NaivePEagle:
    """A P-EAGLE checkpoint read here from its files: the layer config (speculators' transformer_layer_config or
    SpecForge's flat Llama config), the captured ids vLLM reads (top-level eagle_aux_hidden_state_layer_ids as
    hidden_states indices, else its default 2, L // 2, L - 3), vLLM's mask id lookup, its norm_before_residual
    (false unless said), and the one decoder layer over [norm(embedding); norm(fc(features))], written out."""

    def __init__(self, path, target, hs_ids=None, mask_id=None):
        cfg, w = read(path)
        self.layer_cfg = cfg.get("transformer_layer_config", cfg)
        self.w = {k.replace("midlayer.", "layers.0."): v.float() for k, v in w.items()}
        L = target.config.num_hidden_layers
        self.hs_ids = sorted(hs_ids or cfg.get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3])
        self.mask_id = next(v for v in [mask_id, (cfg.get("dflash_config") or {}).get("mask_token_id"),
                                        cfg.get("mask_token_id"), cfg.get("dspark_noise_token_id"), cfg.get("pard_token"),
                                        cfg.get("ptd_token_id")] if v is not None)
        self.nbr = bool(cfg.get("norm_before_residual", False))
        assert not cfg.get("norm_before_fc") and not cfg.get("fc_norm")   # the fixtures have neither
        self.embed = self.w.get("embed_tokens.weight", target.get_input_embeddings().weight.float())   # vLLM: its own
        self.head = self.w.get("lm_head.weight", target.get_output_embeddings().weight.float())
        self.d2t = self.w.get("d2t")
        c = self.layer_cfg
        rope = c.get("rope_parameters") or {}
        assert rope.get("rope_type", "default") == "default" and not c.get("rope_scaling")
        self.theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or c["hidden_size"] // self.nh

    def fc(self, feats):
        return feats @ self.w["fc.weight"].T

    def layer(self, tokens, g, positions):
        """The layer over rows (token, hidden g, position), each attending causally to the rows before it."""
        w, p, n, eps = self.w, "layers.0.", len(tokens), self.eps
        normed = rms(g, w[p + "hidden_norm.weight"], eps)
        x = torch.cat([rms(self.embed[tokens], w[p + "input_layernorm.weight"], eps), normed], -1)

        def proj(name, heads):
            y = x @ w[p + f"self_attn.{name}.weight"].T
            if p + f"self_attn.{name}.bias" in w:
                y = y + w[p + f"self_attn.{name}.bias"]
            return y.view(n, heads, self.hd)
        q, k, v = proj("q_proj", self.nh), proj("k_proj", self.nkv), proj("v_proj", self.nkv)
        if p + "self_attn.q_norm.weight" in w:
            q, k = rms(q, w[p + "self_attn.q_norm.weight"], eps), rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
        rep = self.nh // self.nkv
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out = torch.empty(n, self.nh, self.hd)
        for hq in range(self.nh):
            scores = (q[:, hq] @ k[:, hq // rep].T) / math.sqrt(self.hd)
            out[:, hq] = scores.masked_fill(~causal, -math.inf).softmax(-1) @ v[:, hq // rep]
        o = out.reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        if p + "self_attn.o_proj.bias" in w:
            o = o + w[p + "self_attn.o_proj.bias"]
        h = (normed if self.nbr else g) + o
        y = rms(h, w[p + "post_attention_layernorm.weight"], eps)
        return h + (F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)) @ \
            w[p + "mlp.down_proj.weight"].T

    def logits(self, h):
        return rms(h, self.w["norm.weight"], self.eps) @ self.head.T

    def to_target(self, i):
        return int(i + self.d2t[i]) if self.d2t is not None else int(i)


def peagle_depth(path):
    """K, the drafts a round: speculators' proposal_methods[0].speculative_tokens (vLLM's converter reads it)."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    return cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]


def peagle_proposer(target, path, K, sampling=None, **given):
    """vLLM's parallel drafting round for the committed tokens seq (anchor a = the last one): the text rows j < a
    (token j + 1, fc(features at j), position j), then K - 1 mask slots (the mask token, fc(mask_hidden), positions a,
    a + 1, ...), one causal pass; draft 1 from row a - 1 (the bonus token's), draft k + 1 from slot k. Greedy: the
    argmax; with `sampling`, each draft drawn from its row's softmax(logits / T). propose(seq[, g]) -> (drafts, q)."""
    m = NaivePEagle(path, target, **given)

    @torch.no_grad()
    def propose(seq, g=None):
        a = len(seq) - 1
        hs = target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i][0] for i in m.hs_ids], -1)
        tokens = seq[1:] + [m.mask_id] * (K - 1)
        rows = torch.cat([m.fc(feats), m.fc(m.w["mask_hidden"].reshape(1, -1)).expand(K - 1, -1)])
        h = m.layer(torch.tensor(tokens), rows, torch.arange(a + K - 1))
        logits = m.logits(h[a - 1:])
        if sampling is None:
            return [m.to_target(int(i)) for i in logits.argmax(-1)], []
        qs = [(row.double() / sampling[0]).softmax(-1) for row in logits]
        return [m.to_target(int(torch.multinomial(q, 1, generator=g))) for q in qs], qs
    return propose


# ----------------------------------------------------------------------------------------------------
# Greedy rounds equal the online loop's


def tool_rounds(tmp_path, path, *argv, name="t"):
    return run_tool(tmp_path, name, "--demo", "--ckpt", f"x={path}", "--max-new-tokens", str(N_NEW), "--ignore-eos",
                    "--limit", str(N_PROMPTS), *argv)


@pytest.fixture(scope="module")
def sensitive(tmp_path_factory):
    return sensitized_xpress(tmp_path_factory.mktemp("sensitive"))


def sensitized_xpress(out_dir):
    """The XPress fixture with its refiner's say doubled (readout x 2) and random entries above the mixer's diagonal:
    trained briefly, its refiner changes few drafts on these texts, and training leaves that triangle at its initial
    zeros, though vLLM discards it (it folds raw L * tril + I). Rounds then tell the rule's details apart."""
    g = torch.Generator().manual_seed(31)

    def change(state):
        mix = state["refiner_head.mix_l"]
        above = 1 - torch.ones(mix.shape[1:]).tril()
        return {**state, "refiner_head.readout.weight": 2 * state["refiner_head.readout.weight"],
                "refiner_head.mix_l": mix + torch.randn(mix.shape, generator=g) * above}
    return copy_with(out_dir, XPRESS, "xpress", weights=change)


XPRESS_CASES = {"as_trained": ((), {}), "config": ((), {}), "topc4": (("--xpress-topc", "4"), {"topc": 4}),
                "one_pass": (("--xpress-passes", "1"), {"passes": 1})}


@pytest.mark.parametrize("case", list(XPRESS_CASES))
def test_xpress_rounds_equal_an_online_jacobi_loop(tmp_path, demo, sensitive, case):
    """The checkpoint's passes (3; its top-c 512 covers the 64 tokens: the exact argmax), --xpress-topc 4,
    --xpress-passes 1: on the sensitized copy, each changes the rounds; as trained, the checkpoint's own settings."""
    target, _, prompts = demo
    path = XPRESS if case == "as_trained" else sensitive
    argv, given = XPRESS_CASES[case]
    passes, topc = xpress_config(path)
    passes, topc = given.get("passes", passes), given.get("topc", topc)
    report = tool_rounds(tmp_path, path, *argv)
    d = report["drafters"][0]
    assert d["generation"] == "XPress" and d["ddtree"] is None and "chain" in d["ddtree_note"]
    assert d["head"]["passes"] == passes and d["head"]["topc"] == (topc if topc < 64 else 0)
    propose = xpress_proposer(target, path, passes, topc)
    online = [online_rounds(target, propose, ids, N_NEW, d["drafts_per_round"]) for ids in prompts[:N_PROMPTS]]
    assert rounds(report) == online
    flat = [r for rr in online for r in rr]
    assert len(set(flat)) >= 2 and min(flat) == 1 and max(flat) == 8
    if case != "as_trained":   # the setting changes the rounds: the comparison has teeth
        others = ["--xpress-passes", "0"] if case == "config" else []   # the backbone's argmax alone; the checkpoint's
        assert rounds(tool_rounds(tmp_path, path, *others, name="other")) != online


# SpecForge's export: the mask token stays in its training state, its captured layers (eagle_config ids [1, 3, 4]) are
# layer outputs as trained, which vLLM's V1 runner reads as hidden_states indices; a user serving it passes both (K: 5)
SPECFORGE_ARGV = ("--mask-token-id", "2", "--layers", "1,3,4", "--block-size", "6")
SPECFORGE_GIVEN = {"mask_id": 2, "hs_ids": [2, 4, 5]}


@pytest.mark.parametrize("layout", ["speculators", "SpecForge"])
def test_peagle_rounds_equal_an_online_parallel_loop(tmp_path, demo, layout):
    """speculators' P-EAGLE (K 5 from its proposal method, norm_before_residual true as saved) and SpecForge's export
    (a Llama layer without q/k norms, norm_before_residual false, K 5 given as a user gives vLLM)."""
    target, _, prompts = demo
    path, argv, given = (PEAGLE, (), {}) if layout == "speculators" else (PEAGLE_SF, SPECFORGE_ARGV, SPECFORGE_GIVEN)
    report = tool_rounds(tmp_path, path, *argv)
    d = report["drafters"][0]
    assert d["generation"] == "P-EAGLE" and d["layout"] == layout and d["ddtree"] is None
    K = d["drafts_per_round"]
    assert K == 5 and d["layers"] == [1, 3, 4]
    propose = peagle_proposer(target, path, K, **given)
    online = [online_rounds(target, lambda seq: propose(seq)[0], ids, N_NEW, K) for ids in prompts[:N_PROMPTS]]
    assert rounds(report) == online
    flat = [r for rr in online for r in rr]
    assert len(set(flat)) >= 3 and max(flat) == K + 1   # rounds vary, every mask slot's draft accepted: it has teeth


@pytest.mark.parametrize("engine,given,want", [("vllm", None, [0, 2, 3]), ("sglang", None, [1, 3, 4]),
                                               ("vllm", [1, 3, 4], [1, 3, 4])])
def test_peagle_nested_ids_read_as_each_engine_reads_them(demo, capsys, engine, given, want):
    """SpecForge writes eagle_config's ids (layer outputs, as trained). vLLM serves P-EAGLE on its V1 runner, which reads
    them as hidden_states indices, one layer early: the load line says so and how to read them as trained."""
    target = demo[0]
    settings = drafter_settings(engine=engine, mask_token_id=2, layers=given, quiet=False)
    assert ed.load_drafter(PEAGLE_SF, target.config, settings).layers == want
    err = capsys.readouterr().err
    if (engine, given) == ("vllm", None):
        assert "eagle_config's ids as hidden_states indices (vLLM's V1 runner, which serves P-EAGLE); SpecForge " \
               "trained them as layer outputs: --layers 1,3,4 reads them so" in err


# ----------------------------------------------------------------------------------------------------
# Drafts at every anchor equal the frameworks' own modules' (expected.json)


def tool_drafts(drafter, target, seq):
    """The tool's drafts at each of seq's anchors, from one target pass over seq (as the tool scores a prompt)."""
    ids = seq["ids"]
    x = ed.extract_hidden(target, ids, drafter.layers, seq["n_prompt"])
    embed_w, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings()
    anchors = torch.tensor(seq["anchors"])
    drafts, _ = ed.draft_all_anchors(drafter, ed.prompt_context(drafter, x.features, ids, embed_w), anchors,
                                     torch.tensor(ids)[anchors], embed_w, lm_head)
    return drafts.tolist()


@pytest.mark.parametrize("variant", ["topc0", "topc8", "base"])
def test_xpress_drafts_equal_speculators_refiner(demo, variant):
    """speculators' XPressDraftModel (its backbone, hidden_cache and block_bias) by vLLM's Jacobi rule: the checkpoint's
    3 passes over the whole vocabulary (topc0) and among each slot's 8 best base logits (topc8); no pass (base)."""
    target = demo[0]
    expected = json.load(open(os.path.join(XPRESS, "expected.json")))
    passes = 0 if variant == "base" else expected["num_jacobi_passes"]
    topc = expected["topc"] if variant == "topc8" else 0
    drafter = ed.load_drafter(XPRESS, target.config, drafter_settings(xpress_passes=passes, xpress_topc=topc))
    compared = 0
    for seq in expected["sequences"]:
        assert tool_drafts(drafter, target, seq) == seq[variant]
        compared += len(seq["anchors"])
    assert compared > 200
    other = "topc0" if variant == "base" else "base"
    changed = sum(a != b for seq in expected["sequences"] for a, b in zip(seq[variant], seq[other]))
    assert changed > 0   # the refiner changed some anchors' drafts: the comparison has teeth


@pytest.mark.parametrize("layout", ["speculators", "SpecForge"])
def test_peagle_drafts_equal_the_trainers_modules(demo, layout):
    """speculators' PEagleDraftModel and SpecForge's, each checked equal to its own training forward with every chain:
    vLLM's rows at every anchor (the bonus row, then 4 mask slots), their argmax drafts."""
    target = demo[0]
    path = PEAGLE if layout == "speculators" else PEAGLE_SF
    expected = json.load(open(os.path.join(path, "expected.json")))
    settings = drafter_settings() if layout == "speculators" else drafter_settings(mask_token_id=2, layers=[1, 3, 4])
    drafter = ed.load_drafter(path, target.config, dataclasses.replace(settings, block_size=expected["num_depths"] + 1))
    compared = 0
    for seq in expected["sequences"]:
        assert tool_drafts(drafter, target, seq) == seq["drafts"]
        compared += len(seq["anchors"])
    assert compared > 200


# ----------------------------------------------------------------------------------------------------
# vLLM's layout of XPress


VLLM_NAMES = {"token_embed.weight": "w1.weight", "readout.weight": "w2.weight", "mix_l": "mix.L",
              "mlp_gate.weight": "mlp.gate_proj.weight", "mlp_up.weight": "mlp.up_proj.weight",
              "mlp_down.weight": "mlp.down_proj.weight"}


def vllm_layout(tmp_path, name="vllm", src=XPRESS, **keys):
    """The speculators XPress fixture as vLLM 0.33 loads one (its tests' config): the layer config at the top level,
    architectures DFlashQwen3XPressModel, xpress_num_passes / xpress_topc / xpress_rank / xpress_mlp_hidden /
    xpress_block_size, dflash_config {mask_token_id, target_layer_ids}; the head under xpress_head.* (w1, w2, mix.L,
    mlp.*_proj). `keys` overrides top-level keys."""
    cfg, state = read(src)
    rank = cfg["xpress_rank"]
    out = {**cfg["transformer_layer_config"], "architectures": ["DFlashQwen3XPressModel"],
           "block_size": cfg["block_size"], "xpress_block_size": cfg["block_size"],
           "xpress_num_passes": cfg["num_jacobi_passes"], "xpress_topc": 512, "xpress_rank": rank,
           "xpress_mlp_hidden": round(rank * cfg["xpress_mlp_ratio"]), "sample_from_anchor": False,
           "dflash_config": {"mask_token_id": cfg["mask_token_id"],
                             "target_layer_ids": [i - 1 for i in cfg["aux_hidden_state_layer_ids"]]}, **keys}
    renamed = {}
    for k, v in state.items():
        if k.startswith("refiner_head."):
            k = k[len("refiner_head."):]
            k = "xpress_head." + VLLM_NAMES.get(k, k)
        renamed[k] = v
    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(out))
    save_file(renamed, str(path / "model.safetensors"))
    return str(path)


def test_vllm_layout_equals_speculators_layout(tmp_path, sensitive):
    """The same XPress drafter in vLLM's layout: the same rounds and head; its config's xpress_topc is read (4 there
    equals --xpress-topc 4 on speculators' layout, and differs from the exact argmax). Both with a window that never
    binds on these texts (4096), so the layouts' window rules (speculators': the W context positions before the
    anchor) agree."""
    wide = copy_with(tmp_path, sensitive, "wide", lambda c: c["transformer_layer_config"].update(sliding_window=4096))
    vllm, vllm4 = vllm_layout(tmp_path, src=wide), vllm_layout(tmp_path, "vllm4", src=wide, xpress_topc=4)
    report = tool_rounds(tmp_path, wide, "--ckpt", f"v={vllm}", "--ckpt", f"v4={vllm4}")
    spec, v, v4 = report["drafters"]
    assert v["generation"] == "XPress" and v["layout"] == "public" and spec["layout"] == "speculators"
    assert v["head"] == spec["head"] and v4["head"] == {**spec["head"], "topc": 4}
    assert rounds(report, 1) == rounds(report, 0)
    top4 = tool_rounds(tmp_path, wide, "--xpress-topc", "4", name="top4")
    assert rounds(report, 2) == rounds(top4) != rounds(report, 0)


# ----------------------------------------------------------------------------------------------------
# Refusals


def drop(*names):
    return lambda state: {k: v for k, v in state.items() if k not in names}


REFUSALS = {
    "peagle_no_mask_hidden": (PEAGLE, None, drop("mask_hidden"), (), "1 missing (mask_hidden)"),
    "peagle_no_mask_id": (PEAGLE, lambda c: c.pop("mask_token_id"), None, (), "pass --mask-token-id"),
    "peagle_two_layers": (PEAGLE, None, lambda s: {**s, **{k.replace("layers.0.", "layers.1."): v.clone()
                                                           for k, v in s.items() if k.startswith("layers.0.")}},
                          (), "layers.1.*"),
    "xpress_mix_shape": (XPRESS, None, lambda s: {**s, "refiner_head.mix_l": s["refiner_head.mix_l"][:, :-1, :-1]},
                         (), "refiner_head.mix_l has shape"),
    "xpress_missing_tensor": (XPRESS, None, drop("refiner_head.mlp_up.weight"), (),
                              "1 missing (refiner_head.mlp_up.weight)"),
    "xpress_from_anchor": (XPRESS, lambda c: c.update(sample_from_anchor=True), None, (), "sample_from_anchor true"),
    "xpress_sampled": (XPRESS, None, None, ("--temperature", "0.7", "--draft-policy", "sample"),
                       "drafts greedily at every temperature"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals_are_one_line(tmp_path, capsys, case):
    """P-EAGLE without mask_hidden, without any mask token id (--mask-token-id named), with a second layer; XPress with
    a mixer of another block, a refiner tensor missing, sample_from_anchor true, sampled drafting asked for."""
    src, config, weights, argv, fragment = REFUSALS[case]
    path = copy_with(tmp_path, src, case, config, weights) if config or weights else src
    refused_in_one_line(capsys, ["--demo", "--ckpt", path, "--quiet", "--limit", "1", *argv], fragment)


def test_a_negative_topc_in_vllm_config_is_refused(tmp_path, capsys):
    """xpress_topc -1 in vLLM's layout (where the key lives): named with its value."""
    refused_in_one_line(capsys, ["--demo", "--ckpt", vllm_layout(tmp_path, xpress_topc=-1), "--quiet", "--limit", "1"],
                        "xpress_topc is -1; expected an integer >= 0")
