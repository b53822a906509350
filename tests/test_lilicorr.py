"""LiLiCorr drafters (a DFlash backbone and the lilicorr.* correlator over each slot's top-k candidates), exact like
the other families.

The reference here is written from the engines' source, not the tool's:
- the backbone is z-lab's public dflash package (dflash.model.DFlashDraftModel), the anchor row its fc and
  hidden_norm over the target features of the position before the anchor (vLLM's prepare_context_anchor, SGLang's
  project_target_hidden);
- the head (`LiLiCorrHead` below) mirrors vLLM 0.33's model_executor/models/lilicorr.py as torch nn.Modules (nn.RMSNorm,
  nn.LayerNorm(5), the non-gated MLPs, SDPA with the additive slot bias, the split factor_input_proj, F.normalize),
  loaded from the fixture's lilicorr.* tensors by name with load_state_dict(strict=True);
- candidates are the top-k of log_softmax(target lm_head(h_s)); the walk is v1/worker/gpu/spec_decode/dflash2's
  _selector_walk_kernel: i_0 = argmax start, i_s = argmax pairs[s-1][i_{s-1}] (greedy) or a draw from
  softmax(scores / T) at each step (draft_sample_method probabilistic: a Gumbel argmax of the scores at temperature T).

Tests: greedy rounds (trained depth and --depths 3) against an online loop round by round; drafts at every anchor;
sampled drafts' expected rounds against an online sampled loop; refusals in one line; saved features, shards and a
resume after an interruption give the plain run's numbers; --costs measure and the vLLM synthetic export; DFlash 2's
convolutions in the backbone, and their config keys.
"""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

import eval_drafter as ed
from conftest import drafter_settings, finished_prompts, refused_in_one_line, stop_in_prompt
from drafters import demo_pair, on_texts, online_rounds, run_tool, speculative_sampling_runs
from test_sampled import mc_check

HERE = os.path.dirname(os.path.abspath(__file__))
LILICORR = os.path.join(HERE, "fixtures", "families", "lilicorr")
N_NEW = 48
N_PROMPTS = 4
TOOL = ("--demo", "--ckpt", f"l={LILICORR}", "--max-new-tokens", str(N_NEW), "--ignore-eos", "--limit", str(N_PROMPTS))


# ----------------------------------------------------------------------------------------------------
# The engines' LiLiCorr head (vLLM 0.33 LiLiCorrHead; SGLang 0.5.23's is the same function)


class MLP(nn.Module):
    """NemotronHMLP with bias, silu, not gated: down(silu(up(x)))."""

    def __init__(self, inp, hidden, out):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(inp, hidden), nn.Linear(hidden, out)

    def forward(self, x):
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """LiLiCorrLatticeAttention: packed in_proj (nn.MultiheadAttention's names), SDPA with an additive bias."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x, bias):
        n, L, W = x.shape
        q, k, v = (t.view(n, L, self.heads, W // self.heads).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(n, L, W))


class Layer(nn.Module):
    def __init__(self, width, heads, mlp_ratio, eps):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width, eps=eps), nn.RMSNorm(width, eps=eps)
        self.attn, self.mlp = LatticeAttention(width, heads), MLP(width, int(width * mlp_ratio), width)

    def forward(self, x, bias):
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, H = cfg["dflash_config"], cfg["hidden_size"]
        W, k, B, Fd, eps = c["lilicorr_hidden_size"] or H, c["lilicorr_candidate_topk"], cfg["block_size"], \
            c["lilicorr_factor_dim"], cfg["rms_norm_eps"]
        self.block, self.topk, self.heads = B, k, c["lilicorr_num_heads"]
        self.eps_vec, self.scale = c["lilicorr_vector_eps"], c["lilicorr_logit_scale"]
        self.token_proj = nn.Identity() if W == H else nn.Linear(H, W)
        self.pass_hidden_proj, self.context_proj = nn.Linear(H, W), nn.Linear(H, W)
        self.feature_norm = nn.LayerNorm(5)
        self.feature_mlp = MLP(5, W, W)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, B - 1, 1, W))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, k, W))
        self.relative_slot_bias = nn.Parameter(torch.zeros(self.heads, 2 * B - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(self.heads))
        self.layers = nn.ModuleList(Layer(W, self.heads, c["lilicorr_mlp_ratio"], eps)
                                    for _ in range(c["lilicorr_num_layers"]))
        self.output_norm, self.anchor_norm = nn.RMSNorm(W, eps=eps), nn.RMSNorm(W, eps=eps)
        self.factor_input_proj = nn.Linear(3 * W, W)
        self.out_head, self.in_head, self.anchor_out_head = nn.Linear(W, Fd), nn.Linear(W, Fd), nn.Linear(W, Fd)

    def attention_bias(self):
        """vLLM's _build_attention_bias over the trained B - 1 slots, offset B - 1 (a shorter draft takes the corner)."""
        slot = torch.arange(self.block - 1).repeat_interleave(self.topk)
        bias = self.relative_slot_bias[:, slot[:, None] - slot[None, :] + self.block - 1]
        return bias + (slot[:, None] == slot[None, :]).float()[None] * self.same_slot_bias[:, None, None]

    def forward(self, token_embeddings, log_probs, pass_hidden, anchor_hidden):
        """(start (n, k), pairs (n, S-1, k, k)) scaled by logit_scale; token_embeddings (n, S, k, H), log_probs
        (n, S, k), pass_hidden (n, S, H), anchor_hidden (n, H) (every anchor valid here: a row before it exists)."""
        n, S, k = log_probs.shape
        rank = torch.arange(k, dtype=torch.float32)
        features = torch.stack([log_probs, log_probs.exp(), log_probs - log_probs.max(-1, keepdim=True).values,
                                (rank / (k - 1) if k > 1 else rank * 0).expand_as(log_probs),
                                (rank == 0).float().expand_as(log_probs)], -1)
        x = self.token_proj(token_embeddings) + self.pass_hidden_proj(pass_hidden).unsqueeze(-2)
        x = x + self.feature_mlp(self.feature_norm(features))
        x = (x + self.slot_embedding[:, 0, :S] + self.rank_embedding[:, 0]).reshape(n, S * k, -1)
        bias = self.attention_bias()[None, :, :S * k, :S * k]
        for layer in self.layers:
            x = layer(x, bias)
        y = self.output_norm(x).reshape(n, S, k, -1)
        a = self.anchor_norm(self.context_proj(anchor_hidden))[:, None, None, :]
        W = y.shape[-1]
        w = self.factor_input_proj.weight
        pre = F.linear(y, w[:, :W], self.factor_input_proj.bias) + F.linear(a, w[:, W:2 * W]) \
            + F.linear(y * a, w[:, 2 * W:])
        f = F.silu(pre)
        out_vec = F.normalize(self.out_head(f), dim=-1, eps=self.eps_vec)
        in_vec = F.normalize(self.in_head(f), dim=-1, eps=self.eps_vec)
        anchor_out = F.normalize(self.anchor_out_head(a[:, 0, 0]), dim=-1, eps=self.eps_vec)
        start = (anchor_out[:, None, :] * in_vec[:, 0]).sum(-1)
        pairs = out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)
        return self.scale * start.float(), self.scale * pairs.float()


def walk(start, pairs, candidates, temperature=None, generator=None):
    """The engines' walk over one lattice (start (k,), pairs (S-1, k, k), candidates (S, k)): greedy, or each step
    drawn from softmax(scores / T) over the candidates; (drafts, each step's distribution over the candidates)."""
    drafts, dists, scores = [], [], start
    for s in range(candidates.shape[0]):
        if s:
            scores = pairs[s - 1, pick]
        if temperature is None:
            pick = int(scores.argmax())
        else:
            dists.append((scores.double() / temperature).softmax(-1))
            pick = int(torch.multinomial(dists[-1], 1, generator=generator))
        drafts.append(int(candidates[s, pick]))
    return drafts, dists


class Engine:
    """One LiLiCorr round as the engines run it: the public DFlash backbone over [anchor, MASK x K] given the target
    features of the committed tokens before the anchor, then the correlator and the walk."""

    def __init__(self, target, path=LILICORR):
        from transformers import AutoConfig
        from dflash.model import DFlashDraftModel
        cfg = json.load(open(os.path.join(path, "config.json")))
        state = load_file(os.path.join(path, "model.safetensors"))
        self.head = LiLiCorrHead(cfg).eval()
        self.head.load_state_dict({k[len("lilicorr."):]: v for k, v in state.items() if k.startswith("lilicorr.")},
                                  strict=True)
        self.backbone = DFlashDraftModel(AutoConfig.from_pretrained(path)).eval()
        taps, group = cfg["dflash_config"].get("conv_kernel_size"), cfg["dflash_config"].get("conv_group_size")
        if taps:   # vLLM's DFlash2Qwen3DecoderLayer, SGLang's DFlashGroupedConv: the public DFlash 2 layer's convolutions
            from dflash.model import GroupedDynamicCausalConv
            for layer in self.backbone.layers:
                layer.attention_conv = GroupedDynamicCausalConv(cfg["hidden_size"], taps, group)
                layer.mlp_conv = GroupedDynamicCausalConv(cfg["hidden_size"], taps, group)
        missing, unexpected = self.backbone.load_state_dict(
            {k: v for k, v in state.items() if not k.startswith("lilicorr.")}, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        self.target, self.mask, self.B = target, cfg["dflash_config"]["mask_token_id"], cfg["block_size"]
        self.layer_ids, self.k = cfg["dflash_config"]["target_layer_ids"], cfg["dflash_config"]["lilicorr_candidate_topk"]

    @torch.no_grad()
    def lattice(self, ids, features, anchor, K=None):
        """(start, pairs, candidates (K, k), the backbone's argmax per slot) for the block at `anchor` over the
        target features (T, n*H) of positions < anchor."""
        K = K or self.B - 1
        embed, lm_head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
        block = torch.tensor([[ids[anchor]] + [self.mask] * K])
        h = self.backbone(position_ids=torch.arange(anchor + K + 1)[None], noise_embedding=embed(block),
                          target_hidden=features[None, :anchor])[0, 1:]
        logp, candidates = lm_head(h).float().log_softmax(-1).topk(self.k, dim=-1)
        anchor_row = self.backbone.hidden_norm(self.backbone.fc(features[anchor - 1]))
        start, pairs = self.head(embed(candidates)[None], logp[None], h[None], anchor_row[None])
        return start[0], pairs[0], candidates, lm_head(h).argmax(-1).tolist()

    @torch.no_grad()
    def features(self, seq):
        hs = self.target(torch.tensor([seq]), output_hidden_states=True).hidden_states
        return torch.cat([hs[L + 1][0] for L in self.layer_ids], -1)

    def propose(self, seq, K=None, temperature=None, generator=None):
        """(the drafts of the round anchored at seq's last token, from the committed tokens alone; each step's
        distribution over the vocabulary when sampled: softmax(scores / T) on the k candidates, 0 elsewhere)."""
        start, pairs, candidates, _ = self.lattice(seq, self.features(seq[:-1]), len(seq) - 1, K)
        drafts, dists = walk(start, pairs, candidates, temperature, generator)
        qs = []
        for s, q in enumerate(dists):
            qs.append(torch.zeros(self.target.config.vocab_size, dtype=torch.float64))
            qs[-1][candidates[s]] = q
        return drafts, qs


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


@pytest.fixture(scope="module")
def engine(demo):
    return Engine(demo[0])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The tool's greedy run at the trained depth and at depth 3."""
    return run_tool(tmp_path_factory.mktemp("plain"), "plain", *TOOL, "--depths", "3")


# ----------------------------------------------------------------------------------------------------
# 1. Greedy rounds, round by round


@pytest.mark.parametrize("K", [7, 3])
def test_greedy_rounds_equal_an_online_engine_loop(demo, engine, plain, K):
    """The tool's rounds (trained depth 7, and --depths 3: a block of 1 + 3 through the backbone, the head's first 3
    slot embeddings and the corner of its slot bias) equal, round by round, an online loop drafting each round from
    the committed tokens alone with the engines' backbone, correlator and walk."""
    target, _, prompts = demo
    d = plain["drafters"][0]
    assert d["generation"] == "LiLiCorr" and plain["target"]["agreement"] == 1.0
    online = [online_rounds(target, lambda seq: engine.propose(seq, K)[0], ids, N_NEW, K) for ids in prompts[:N_PROMPTS]]
    got = [p["rounds"] if K == 7 else p["depth_rounds"][str(K)] for p in d["prompts"]]
    assert got == online
    flat = [r for rounds in online for r in rounds]
    assert len(set(flat)) >= 3 and max(flat) == K + 1   # rounds vary: the comparison has teeth


def test_the_walk_is_not_the_backbones_argmax(tmp_path, demo, engine, plain):
    """The fixture's walk leaves the backbone's top-1 candidate often, and that pays: the same backbone drafting its
    argmax (a LiLiCorr drafter whose walk ignored the correlator) gets other, fewer accepted tokens."""
    target, _, prompts = demo
    seq, turned = prompts[0] + ed.plain_generate(target, prompts[0], 40, set()), 0
    features = engine.features(seq)
    for a in range(len(prompts[0]), len(seq) - 7, 3):
        start, pairs, candidates, argmax = engine.lattice(seq, features, a)
        turned += walk(start, pairs, candidates)[0] != argmax
    assert turned >= 3
    backbone = {k: v for k, v in load_file(os.path.join(LILICORR, "model.safetensors")).items()
                if not k.startswith("lilicorr.")}
    cfg = json.load(open(os.path.join(LILICORR, "config.json")))
    cfg["architectures"] = ["DFlashDraftModel"]
    cfg["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items() if not k.startswith("lilicorr_")}
    out = tmp_path / "backbone"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(backbone, str(out / "model.safetensors"))
    alone = run_tool(tmp_path, "alone", *[a if a != f"l={LILICORR}" else f"b={out}" for a in TOOL])["drafters"][0]
    assert alone["generation"] == "DFlash"
    assert alone["tau"] < plain["drafters"][0]["tau"]
    assert [p["rounds"] for p in alone["prompts"]] != [p["rounds"] for p in plain["drafters"][0]["prompts"]]


# ----------------------------------------------------------------------------------------------------
# 2. Drafts at every anchor


@pytest.mark.parametrize("K", [7, 3])
def test_drafts_equal_the_engines_at_every_anchor(demo, engine, K):
    """ed.draft_all_anchors on the loaded drafter (at depth K: a block of 1 + K, as --depths runs it) gives, at every
    anchor of a few texts (greedy continuations and a sampled one), the engines' drafts; at many anchors they are not
    the backbone's argmax."""
    target, _, prompts = demo
    drafter = ed.load_drafter(LILICORR, target.config, drafter_settings())
    drafter = ed.replace(drafter, block_size=K + 1)
    embed_w, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings()
    g = torch.Generator().manual_seed(3)
    texts = [(prompts[0], ed.plain_generate(target, prompts[0], 40, set())),
             (prompts[5], ed.plain_generate(target, prompts[5], 40, set())),
             (prompts[2], ed.plain_generate(target, prompts[2], 40, set(), (1.0, 1.0, 0), g))]
    differ = 0
    for prompt, completion in texts:
        ids, n_prompt = prompt + completion, len(prompt)
        features = ed.extract_hidden(target, ids, drafter.layers, n_prompt).features
        anchors = ed.fitting_anchors(n_prompt, len(ids), drafter.block_size)
        tool, _ = ed.draft_all_anchors(drafter, ed.prompt_context(drafter, features), anchors, torch.tensor(ids)[anchors],
                                       embed_w, lm_head)
        flat = engine.features(ids)
        theirs = []
        for a in anchors.tolist():
            start, pairs, candidates, argmax = engine.lattice(ids, flat, a, K)
            theirs.append(walk(start, pairs, candidates)[0])
            differ += theirs[-1] != argmax
        assert tool.tolist() == theirs
    assert differ >= 10


# ----------------------------------------------------------------------------------------------------
# 3. Sampled drafts


@pytest.mark.parametrize("T", [0.8, 0.4])
def test_proposal_probabilities_equal_the_engines_walk(demo, engine, T):
    """What the sampled estimate rests on: at every anchor of a sampled text, the tool's chance that a drafter sampling
    the walk proposes the text's next tokens (ed.draft_all_anchors with the reference) equals, prefix by prefix, the
    product of the engines' step distributions softmax(scores / T) along the text's candidates (0 once a token is
    not among its slot's candidates)."""
    target, _, prompts = demo
    drafter = ed.load_drafter(LILICORR, target.config, drafter_settings())
    B, g = drafter.block_size, torch.Generator().manual_seed(4)
    n_prompt = len(prompts[1])
    ids = prompts[1] + ed.plain_generate(target, prompts[1], 48, set(), (0.6, 1.0, 0), g)
    features = ed.extract_hidden(target, ids, drafter.layers, n_prompt).features
    anchors = ed.fitting_anchors(n_prompt, len(ids), B)
    ids_t = torch.tensor(ids)
    reference = ids_t[anchors[:, None] + torch.arange(1, B)]
    proposal = torch.zeros(len(anchors), B - 1, dtype=torch.float64)
    ed.draft_all_anchors(drafter, ed.prompt_context(drafter, features), anchors, ids_t[anchors],
                         target.get_input_embeddings().weight, target.get_output_embeddings(), reference=reference,
                         sampling=(T, 1.0, 0), proposal=proposal)
    flat, theirs = engine.features(ids), []
    for a, ref in zip(anchors.tolist(), reference.tolist()):
        start, pairs, candidates, _ = engine.lattice(ids, flat, a)
        chance, scores, row = 1.0, start, []
        for s, token in enumerate(ref):
            where = (candidates[s] == token).nonzero()
            chance *= float((scores.double() / T).softmax(-1)[where[0, 0]]) if len(where) else 0.0
            row.append(chance)
            if not len(where):
                row += [0.0] * (len(ref) - s - 1)
                break
            if s < len(ref) - 1:
                scores = pairs[s, where[0, 0]]
        theirs.append(row)
    theirs = torch.tensor(theirs, dtype=torch.float64)
    torch.testing.assert_close(proposal.cumprod(-1), theirs, rtol=1e-4, atol=1e-7)
    assert (theirs[:, 0] > 0).sum() >= 20 and (theirs[:, 2] > 0.05).sum() >= 5   # many paths stay on the lattice


def test_sampled_expected_rounds_match_an_online_sampled_loop(tmp_path, demo, engine):
    """--draft-policy sample at T = 0.8: over 150 runs of speculative sampling with drafts drawn along the walk
    (softmax(scores / T) over the k candidates at each step), the actual rounds minus the tool's E[rounds | text]
    sum to 0 within 3 standard errors."""
    target, rows, prompts = demo
    sampling = (0.8, 1.0, 0)

    runs = speculative_sampling_runs(target, prompts, sampling, 150, 32, engine.B - 1,
                                     lambda: lambda seq, g: engine.propose(seq, temperature=sampling[0], generator=g),
                                     seed=3100)
    report = on_texts(tmp_path, "sampled", LILICORR, rows, runs, sampling, "sample")
    _, _, sd = mc_check(runs, report)
    assert sd > 0.3   # the runs do vary: the check has power
    assert report["drafters"][0]["ddtree"] is None


# ----------------------------------------------------------------------------------------------------
# 4. Refusals


def variant(tmp_path, dflash=None, top=None, weights=None, drop=()):
    """A copy of the fixture with dflash_config keys set (None: removed), top-level keys set, tensors changed."""
    out = tmp_path / "variant"
    shutil.copytree(LILICORR, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in (dflash or {}).items():
        if value is None:
            cfg["dflash_config"].pop(key)
        else:
            cfg["dflash_config"][key] = value
    cfg.update(top or {})
    (out / "config.json").write_text(json.dumps(cfg))
    state = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if k not in drop}
    if weights:
        state = weights(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return str(out)


def shorter(name):
    return lambda s: {**s, name: s[name][..., :-1].contiguous()}


@pytest.mark.parametrize("change,fragment", [
    (dict(dflash={"lilicorr_factor_dim": None}), "needs lilicorr_factor_dim in its dflash_config"),
    (dict(dflash={"lilicorr_logit_scale": None}), "needs lilicorr_logit_scale in its dflash_config"),
    (dict(dflash={"lilicorr_candidate_topk": 3}), "lilicorr_candidate_topk 3 must be a power of two <= 16"),
    (dict(dflash={"lilicorr_candidate_topk": 32}), "lilicorr_candidate_topk 32 must be a power of two <= 16"),
    (dict(drop=("lilicorr.anchor_out_head.bias",)), "1 missing (lilicorr.anchor_out_head.bias)"),
    (dict(drop=("lilicorr.token_proj.weight",)), "1 missing (lilicorr.token_proj.weight)"),
    (dict(drop=("lilicorr.layers.1.attn.in_proj_bias",)), "1 missing (lilicorr.layers.1.attn.in_proj_bias)"),
    (dict(weights=shorter("lilicorr.relative_slot_bias")), "tensor lilicorr.relative_slot_bias has shape (4, 14)"),
    (dict(weights=shorter("lilicorr.rank_embedding")), "tensor lilicorr.rank_embedding has shape (1, 1, 1, 4, 31)"),
    (dict(dflash={"lilicorr_enabled": False}), "with lilicorr_enabled false"),
    (dict(top={"has_own_lm_head": True}), "with has_own_lm_head: vLLM takes its candidates"),
])
def test_refusals_are_one_line(tmp_path, capsys, change, fragment):
    """A missing lilicorr_* key, a top-k that is not a power of two <= 16, a missing or misshapen correlator tensor,
    lilicorr_enabled false, has_own_lm_head under vLLM: one line naming it, exit 2."""
    refused_in_one_line(capsys, ["--demo", "--ckpt", variant(tmp_path, **change), "--quiet", "--limit", "1",
                                 "--output", str(tmp_path / "o.json")], fragment)


def test_has_own_lm_head_under_sglang_uses_the_targets_head(tmp_path, plain):
    """SGLang takes the candidates from the target's head whatever has_own_lm_head says: under --engine sglang the
    drafter (with its own lm_head.weight, a different one) runs and drafts as the plain fixture does."""
    g = torch.Generator().manual_seed(0)
    path = variant(tmp_path, top={"has_own_lm_head": True},
                   weights=lambda s: {**s, "lm_head.weight": torch.randn(64, 64, generator=g)})
    report = run_tool(tmp_path, "sglang", *[a if a != f"l={LILICORR}" else f"l={path}" for a in TOOL], "--engine", "sglang")
    d = report["drafters"][0]
    assert d["generation"] == "LiLiCorr"
    assert [p["rounds"] for p in d["prompts"]] == [p["rounds"] for p in plain["drafters"][0]["prompts"]]


# ----------------------------------------------------------------------------------------------------
# 5. Saved features, shards, an interruption in the middle


def results(report):
    return [{k: v for k, v in d.items() if k != "checkpoint"} for d in report["drafters"]]


def test_saved_features_give_the_same_results(tmp_path, plain):
    saved = tmp_path / "h.safetensors"
    first = run_tool(tmp_path, "save", *TOOL, "--depths", "3", "--save-hidden", str(saved))
    assert results(first) == results(plain)
    argv = [a for a in TOOL if a not in ("--max-new-tokens", str(N_NEW), "--ignore-eos")]
    again = run_tool(tmp_path, "load", *argv, "--depths", "3", "--load-hidden", str(saved))
    assert results(again) == results(plain)


def test_shards_merged_equal_one_run(tmp_path, plain):
    for k in (1, 2):
        run_tool(tmp_path, f"s{k}", *TOOL, "--depths", "3", "--shard", f"{k}/2")
    merged = run_tool(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert results(merged) == results(plain)


def test_an_interruption_in_the_correlator_loses_nothing(tmp_path, monkeypatch, plain):
    """Ctrl-C inside the correlator's scoring during the third prompt: the two finished prompts stay, --resume ends
    with the uninterrupted run's numbers."""
    out, real = tmp_path / "cut.json", ed.lilicorr_scores
    stopping, calls = stop_in_prompt(out, real)
    monkeypatch.setattr(ed, "lilicorr_scores", stopping)
    argv = [*TOOL, "--depths", "3", "--quiet", "--output", str(out)]
    assert ed.main(argv) == 130
    assert finished_prompts(out) == 2 and len(calls) == 2
    monkeypatch.setattr(ed, "lilicorr_scores", real)
    assert ed.main([*argv, "--resume"]) == 0
    assert results(json.loads(out.read_text())) == results(plain)


# ----------------------------------------------------------------------------------------------------
# 6. Serving: costs, vLLM's synthetic export


def test_costs_measure_times_the_correlator(tmp_path, monkeypatch):
    """--costs measure gives LiLiCorr a draft cost per depth, and the timed round runs the correlator over a lattice
    of K slots (K = 7 and 3)."""
    real, during, measuring = ed.lilicorr_scores, [], [False]
    real_measure = ed.measure_costs

    def scores(d, rows, candidates, *args):
        if measuring[0]:
            during.append(candidates.shape[1])
        return real(d, rows, candidates, *args)

    def measure(*args, **kwargs):
        measuring[0] = True
        try:
            return real_measure(*args, **kwargs)
        finally:
            measuring[0] = False
    monkeypatch.setattr(ed, "lilicorr_scores", scores)
    monkeypatch.setattr(ed, "measure_costs", measure)
    report = run_tool(tmp_path, "c", "--demo", "--ckpt", f"l={LILICORR}", "--limit", "2", "--max-new-tokens", "24",
                      "--depths", "3", "--costs", "measure")
    draft = report["config"]["costs_used"]["draft"]["l"]
    assert set(draft) == {"7", "3"} and all(v > 0 for v in draft.values())
    assert set(during) == {7, 3}
    rows = report["drafters"][0]["predicted_speedup"]["1"]["rows"]
    assert set(rows) == {"K=7", "K=3"} and all(r["speedup"] > 0 for r in rows.values())


def test_vllm_synthetic_export_says_method_dflash(tmp_path, plain):
    out = tmp_path / "vllm.json"
    report = run_tool(tmp_path, "x", *TOOL, "--depths", "3", "--export-vllm-synthetic", str(out), "--export-depth", "3")
    config = json.loads(out.read_text())
    assert config["method"] == "dflash" and config["model"] == report["drafters"][0]["checkpoint"]
    assert config["num_speculative_tokens"] == 3 and "parallel_drafting" not in config
    want = plain["drafters"][0]["depths"]["3"]["engine_metrics"]["vllm"]["per_position_acceptance_rate"]
    assert config["synthetic_acceptance_rates"] == pytest.approx(want, abs=1e-6)


# ----------------------------------------------------------------------------------------------------
# 7. DFlash 2's convolutions in the backbone


def conv_tensors(state, taps=2, group=16, scale=0.05, seed=0):
    """The fixture's tensors with DFlash 2's grouped convolutions around each backbone sublayer (base kernel near the
    identity, random taps large enough to change drafts)."""
    g, H = torch.Generator().manual_seed(seed), state["norm.weight"].shape[0]
    out = dict(state)
    for sub in ("attention_conv", "mlp_conv"):
        base = scale * torch.randn(2, taps, H, generator=g)
        base[:, 0] += 1.0
        out[f"layers.0.{sub}.base_kernel"] = base
        out[f"layers.0.{sub}.kernel_projection.weight"] = scale * torch.randn(2 * taps * (H // group), H, generator=g)
    return out


def test_dflash2_convolutions_equal_the_engines(tmp_path, demo):
    """With conv_kernel_size and conv_group_size in its dflash_config (and the tensors), the backbone runs DFlash 2's
    grouped convolutions, as both engines build them: drafts at every anchor equal the engines' with the public
    DFlash 2 convolution module, and differ from the same drafter's without them."""
    target, _, prompts = demo
    path = variant(tmp_path, dflash={"conv_kernel_size": 2, "conv_group_size": 16}, weights=conv_tensors)
    drafter = ed.load_drafter(path, target.config, drafter_settings())
    plain_drafter = ed.load_drafter(LILICORR, target.config, drafter_settings())
    engine = Engine(target, path)
    ids = prompts[3] + ed.plain_generate(target, prompts[3], 40, set())
    n_prompt = len(prompts[3])
    features = ed.extract_hidden(target, ids, drafter.layers, n_prompt).features
    anchors = ed.fitting_anchors(n_prompt, len(ids), drafter.block_size)
    embed_w, lm_head, ids_t = target.get_input_embeddings().weight, target.get_output_embeddings(), torch.tensor(ids)
    tool, _ = ed.draft_all_anchors(drafter, ed.prompt_context(drafter, features), anchors, ids_t[anchors], embed_w,
                                   lm_head)
    without, _ = ed.draft_all_anchors(plain_drafter, ed.prompt_context(plain_drafter, features), anchors,
                                      ids_t[anchors], embed_w, lm_head)
    flat = engine.features(ids)
    theirs = [walk(*engine.lattice(ids, flat, a)[:3])[0] for a in anchors.tolist()]
    assert tool.tolist() == theirs
    assert tool.tolist() != without.tolist()


@pytest.mark.parametrize("dflash,fragment", [({}, "conv_kernel_size"), ({"conv_kernel_size": 2}, "conv_group_size")])
def test_convolutions_need_both_config_keys(tmp_path, capsys, dflash, fragment):
    """Both engines build the convolutions from conv_kernel_size and conv_group_size (each defaults to 0: none) and
    require both or neither; a LiLiCorr checkpoint with conv tensors and a config lacking them loads in neither (vLLM:
    the tensors have no parameter; SGLang: "cannot be inferred from the tensors"), so it is refused in one line."""
    path = variant(tmp_path, dflash=dflash, weights=conv_tensors)
    refused_in_one_line(capsys, ["--demo", "--ckpt", path, "--quiet", "--limit", "1", "--output",
                                 str(tmp_path / "o.json")], fragment)
