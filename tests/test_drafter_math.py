"""The drafter math of eval_drafter.py against independent references written here.

The naive forward below drafts ONE block at a time with plain float64 matmuls, its own RMSNorm, its own
RoPE and a mask built by Python loops from the rule in DFLASH_NOTES.md; the tool drafts many blocks in one
SDPA call. Metrics are checked against values worked out by hand in the comments.
"""
import math

import pytest
import torch

import eval_drafter as ed
import make_demo as md
from conftest import drafter_settings, make_drafter

MASK = md.MASK_ID
T_FEATS = 34  # context length of the random features: longer than the windows tested


# ----------------------------------------------------------------------------------------------------
# Independent reference pieces


def ref_rms(x, weight, eps):
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_default_rope(positions, head_dim, theta):
    """cos/sin of the default RoPE for absolute `positions` (list of ints), float64."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def ref_hf_rope(rope_parameters, head_dim=16, max_pos=256):
    """transformers' own Qwen3 rotary embedding for a rope_parameters dict (used for YaRN only)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    scaling = dict(rope_parameters)
    theta = scaling.pop("rope_theta")  # the 4.x form (rope_scaling + rope_theta) is read by 4.x and 5.x alike
    emb = Qwen3RotaryEmbedding(Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=head_dim,
                                           max_position_embeddings=max_pos, rope_theta=theta, rope_scaling=scaling))

    def cos_sin(positions):
        pos = torch.tensor(positions)[None]
        cos, sin = emb(torch.empty(0, dtype=torch.float32), pos)
        return cos[0].double(), sin[0].double()
    return cos_sin


def ref_rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def visible(rule, anchor, slot, key_pos):
    """May the query at block slot `slot` of the block anchored at `anchor` see the key at absolute `key_pos`?

    Keys are [context positions 0..anchor-1 ; block slots at anchor..anchor+B-1], so a key's index in that
    concatenation is its absolute position.
    """
    mode, window = rule
    q_pos = anchor + slot
    if key_pos < anchor:
        ok = True                                   # context strictly before the anchor
    else:
        ok = mode == "bidirectional" or key_pos - anchor <= slot
    if window is not None and key_pos < q_pos - (window - 1):
        ok = False
    if window is not None and mode == "bidirectional" and key_pos > q_pos + (window - 1):
        ok = False                                  # a bidirectional window reaches both ways (public is_causal: false)
    return ok


def naive_block_forward(cfg, weights, rules, feats, anchor, block_tokens, embed_w, cos_sin):
    """One block, float64, loops over heads and over (query, key) for the mask."""
    w = {k: v.double() for k, v in weights.items()}
    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    B = len(block_tokens)

    def lin(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    ctx = ref_rms(feats[:anchor].double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed_w.double()[torch.tensor(block_tokens)]
    cos_c, sin_c = cos_sin(list(range(anchor)))
    cos_b, sin_b = cos_sin(list(range(anchor, anchor + B)))
    for i, rule in enumerate(rules):
        p = f"layers.{i}.self_attn."
        h = ref_rms(x, w[f"layers.{i}.input_layernorm.weight"], eps)
        q = lin(h, p + "q_proj").view(B, nh, hd)
        k_blk, v_blk = lin(h, p + "k_proj").view(B, nkv, hd), lin(h, p + "v_proj").view(B, nkv, hd)
        k_ctx, v_ctx = lin(ctx, p + "k_proj").view(anchor, nkv, hd), lin(ctx, p + "v_proj").view(anchor, nkv, hd)
        outs = []
        for hq in range(nh):
            g = hq // (nh // nkv)   # query heads 2g, 2g+1 share kv head g (heads 4, kv 2)
            qh = ref_rotate(ref_rms(q[:, hq], w[p + "q_norm.weight"], eps), cos_b, sin_b)
            keys = torch.cat([ref_rotate(ref_rms(k_ctx[:, g], w[p + "k_norm.weight"], eps), cos_c, sin_c),
                              ref_rotate(ref_rms(k_blk[:, g], w[p + "k_norm.weight"], eps), cos_b, sin_b)])
            values = torch.cat([v_ctx[:, g], v_blk[:, g]])
            scores = qh @ keys.T / math.sqrt(hd)
            for j in range(B):
                for t in range(anchor + B):
                    if not visible(rule, anchor, j, t):
                        scores[j, t] = float("-inf")
            e = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            outs.append((e / e.sum(dim=1, keepdim=True)) @ values)
        x = x + lin(torch.cat(outs, dim=-1), p + "o_proj")
        h = ref_rms(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps)
        gate = lin(h, f"layers.{i}.mlp.gate_proj")
        x = x + lin(gate / (1 + torch.exp(-gate)) * lin(h, f"layers.{i}.mlp.up_proj"), f"layers.{i}.mlp.down_proj")
    return ref_rms(x, w["norm.weight"], eps)


# ----------------------------------------------------------------------------------------------------
# 1. Batched drafter forward == one-block-at-a-time reference

FULL2 = ["full_attention", "full_attention"]
SLIDE = ["sliding_attention", "full_attention"]
BID, CAU = ("bidirectional", None), ("causal", None)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

FORWARD_CASES = [
    # id, drafter config overrides, settings overrides, rules the reference applies
    ("bidirectional", dict(layer_types=FULL2), {}, [BID, BID]),
    ("causal", dict(layer_types=FULL2, is_causal=True), {}, [CAU, CAU]),
    ("sliding_window_5", dict(layer_types=SLIDE, sliding_window=5), {}, [("causal", 5), BID]),
    ("sliding_ignored", dict(layer_types=SLIDE, sliding_window=5), {"sliding_window": "ignore"}, [BID, BID]),
    ("sliding_forced_bidirectional", dict(layer_types=SLIDE, sliding_window=5), {"block_mask": "bidirectional"},
     [("bidirectional", 5), BID]),
    ("gqa_4_to_1_bias", dict(layer_types=SLIDE, sliding_window=12, num_key_value_heads=1, attention_bias=True),
     {}, [("causal", 12), BID]),
    ("attention_bias", dict(layer_types=FULL2, attention_bias=True), {}, [BID, BID]),
    ("yarn", dict(layer_types=FULL2, rope_scaling=YARN, max_position_embeddings=256), {}, [BID, BID]),
]


@pytest.mark.parametrize("case_id,cfg_over,set_over,rules", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_batched_forward_matches_naive_per_block(tmp_path, tiny_target, case_id, cfg_over, set_over, rules):
    cfg_over = {"rope_theta": 50000.0, **cfg_over}   # not the 10000 default: a dropped theta would show
    path = make_drafter(tmp_path / "d", tiny_target["cfg"], seed=3, **cfg_over)
    drafter = ed.load_drafter(path, tiny_target["cfg"], drafter_settings(**set_over))
    cfg, B = drafter.cfg, drafter.block_size
    assert drafter.rules == rules

    g = torch.Generator().manual_seed(5)
    feats = torch.randn(T_FEATS, 3 * 64, generator=g)
    embed = torch.nn.Embedding(64, 64).weight.detach()
    torch.nn.init.normal_(embed, std=1.0, generator=g)
    ids = torch.randint(4, 64, (T_FEATS,), generator=g)
    anchors = torch.tensor([1, 2, 7, 12, 13, 20, 26])       # non-contiguous; last block ends at 33
    block = torch.full((len(anchors), B), MASK)
    block[:, 0] = ids[anchors]

    with torch.no_grad():
        got = ed.drafter_forward(drafter, ed.drafter_context(drafter, feats), anchors, block, embed)
    assert got.shape == (len(anchors), B, 64)

    if "rope_scaling" in cfg_over:
        cos_sin = ref_hf_rope({**YARN, "rope_theta": cfg_over["rope_theta"]})
    else:
        def cos_sin(pos):
            return ref_default_rope(pos, cfg["head_dim"], cfg_over["rope_theta"])
    for n, a in enumerate(anchors.tolist()):
        ref = naive_block_forward(cfg, drafter.weights, rules, feats, a, block[n].tolist(), embed,
                                  cos_sin)
        rel = ((got[n].double() - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-5, f"anchor {a}: relative error {rel:.2e}"


def test_mask_rules_change_the_output(tmp_path, tiny_target):
    """Guard for the test above: the cases must differ, or a wrong mask could pass unnoticed."""
    path = make_drafter(tmp_path / "d", tiny_target["cfg"], seed=3, layer_types=SLIDE, sliding_window=5)
    feats = torch.randn(T_FEATS, 3 * 64, generator=torch.Generator().manual_seed(5))
    embed = torch.nn.Embedding(64, 64).weight.detach()
    anchors = torch.tensor([12, 20, 26])
    block = torch.full((3, 8), MASK)
    outs = []
    for s in (drafter_settings(), drafter_settings(sliding_window="ignore"), drafter_settings(block_mask="causal")):
        d = ed.load_drafter(path, tiny_target["cfg"], s)
        with torch.no_grad():
            outs.append(ed.drafter_forward(d, ed.drafter_context(d, feats), anchors, block, embed))
    assert (outs[0] - outs[1]).abs().max() > 1e-3
    assert (outs[1] - outs[2]).abs().max() > 1e-3


def test_yarn_cos_sin_match_transformers(tmp_path, tiny_target):
    positions = torch.arange(0, 300)
    ref = ref_hf_rope({**YARN, "rope_theta": 50000.0})(positions.tolist())
    plain = ref_default_rope(positions.tolist(), 16, 50000.0)
    # Both config layouts: transformers 4.x (rope_scaling + rope_theta) and 5.x (rope_parameters).
    # A 5.x config carries the theta inside rope_parameters only, so drop the builder's top-level one.
    layouts = {"rope_scaling": (dict(rope_scaling=YARN, rope_theta=50000.0), None),
               "rope_parameters": (dict(rope_parameters={**YARN, "rope_theta": 50000.0}),
                                   lambda cfg, w: cfg.pop("rope_theta"))}
    for name, (over, mutate) in layouts.items():
        path = make_drafter(tmp_path / name, tiny_target["cfg"], max_position_embeddings=256, mutate=mutate, **over)
        drafter = ed.load_drafter(path, tiny_target["cfg"], drafter_settings())
        cos, sin = ed.rope_cos_sin(drafter, positions, torch.float32)
        assert cos.shape == (300, 16)
        torch.testing.assert_close(cos.double(), ref[0], rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(sin.double(), ref[1], rtol=0, atol=1e-6, msg=name)
        # YaRN really is in effect: attention scaling (cos at position 0 is the mscale) and other frequencies.
        assert cos[0, 0].item() == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-6)
        assert (cos.double() - plain[0]).abs().max() > 0.1


# ----------------------------------------------------------------------------------------------------
# 2. block_mask == dense mask from the rule


def dense_mask(anchors, n_ctx, B, rule):
    rows = []
    for a in anchors:
        for j in range(B):
            row = [p < a and visible(rule, a, j, p) for p in range(n_ctx)]
            for a2 in anchors:
                for s in range(B):
                    row.append(a2 == a and visible(rule, a, j, a + s))
            rows.append(row)
    return torch.tensor(rows)


@pytest.mark.parametrize("rule", [("bidirectional", None), ("causal", None), ("causal", 5), ("causal", 3),
                                  ("bidirectional", 5), ("bidirectional", 3)])
@pytest.mark.parametrize("anchors", [[4, 5, 6], [3, 9, 10, 17], [12], [2, 15, 8]])
def test_block_mask_matches_rule(rule, anchors):
    B = 4
    n_ctx = max(anchors)
    got = ed.block_mask(torch.tensor(anchors), n_ctx, B, rule)
    assert got.dtype == torch.bool
    assert torch.equal(got, dense_mask(anchors, n_ctx, B, rule))


@pytest.mark.parametrize("rule", [("bidirectional", None), ("causal", None), ("causal", 3), ("bidirectional", 5)])
def test_block_mask_with_prompt_starts(rule):
    """--anchors walk lays several prompts' contexts one after another (prompt lengths 10, 7, 12 here): a block
    sees only its own prompt's rows, at its own positions."""
    B, starts, anchors = 4, [0, 10, 17], [[4, 9], [3], [6, 11]]
    flat = [(a, st) for st, ans in zip(starts, anchors) for a in ans]
    n_ctx = max(a + st for a, st in flat)
    got = ed.block_mask(torch.tensor([a for a, _ in flat]), n_ctx, B, rule, torch.tensor([st for _, st in flat]))
    rows = []
    for i, (a, st) in enumerate(flat):
        for j in range(B):
            ctx = [st <= g < st + a and visible(rule, a, j, g - st) for g in range(n_ctx)]
            blk = [i2 == i and visible(rule, a, j, a + s) for i2 in range(len(flat)) for s in range(B)]
            rows.append(ctx + blk)
    assert torch.equal(got, torch.tensor(rows))


@pytest.mark.parametrize("layer_types, window", [(FULL2, None), (SLIDE, 5)])
def test_forward_over_several_prompts_equals_one_at_a_time(tmp_path, tiny_target, layer_types, window):
    """The batched --anchors walk call (contexts of three prompts concatenated) gives each block what a call
    on its own prompt gives."""
    over = {"layer_types": layer_types, **({"sliding_window": window} if window else {})}
    drafter = ed.load_drafter(make_drafter(tmp_path / "d", tiny_target["cfg"], seed=4, **over), tiny_target["cfg"],
                              drafter_settings())
    g = torch.Generator().manual_seed(6)
    embed = torch.nn.Embedding(64, 64).weight.detach()
    lengths, anchors = [20, 9, 34], [[3, 12, 13], [8], [1, 20, 33]]
    feats = [torch.randn(n, 3 * 64, generator=g) for n in lengths]
    ids = [torch.randint(4, 64, (n + 8,), generator=g) for n in lengths]
    contexts = [ed.drafter_context(drafter, f) for f in feats]
    joined = [tuple(torch.cat([c[i][j] for c in contexts], 1) for j in (0, 1)) for i in range(len(contexts[0]))]
    starts = [0, 20, 29]
    with torch.no_grad():
        flat_a = torch.tensor([a for ans in anchors for a in ans])
        block = torch.full((len(flat_a), 8), MASK)
        block[:, 0] = torch.cat([ids[p][torch.tensor(ans)] for p, ans in enumerate(anchors)])
        got = ed.drafter_forward(drafter, joined, flat_a, block, embed,
                                 torch.tensor([st for st, ans in zip(starts, anchors) for _ in ans]))
        i = 0
        for p, ans in enumerate(anchors):
            want = ed.drafter_forward(drafter, contexts[p], torch.tensor(ans), block[i:i + len(ans)], embed)
            torch.testing.assert_close(got[i:i + len(ans)], want, rtol=1e-5, atol=1e-5)
            i += len(ans)


def test_block_mask_causal_window_by_hand():
    # Anchor 6, B 3, window 3: slot 0 (pos 6) sees ctx 4,5 and itself; slot 2 (pos 8) sees slots 0..2 only.
    got = ed.block_mask(torch.tensor([6]), 6, 3, ("causal", 3)).int().tolist()
    assert got == [[0, 0, 0, 0, 1, 1, 1, 0, 0],
                   [0, 0, 0, 0, 0, 1, 1, 1, 0],
                   [0, 0, 0, 0, 0, 0, 1, 1, 1]]


# ----------------------------------------------------------------------------------------------------
# 3. layer_rules

BASE = {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 16}

RULE_CASES = [
    ("auto", {}, {}, [("causal", 16), BID, ("causal", 16)]),
    ("is_causal_true", {"is_causal": True}, {}, [("causal", 16), CAU, ("causal", 16)]),
    ("is_causal_false", {"is_causal": False}, {}, [("bidirectional", 16), BID, ("bidirectional", 16)]),
    ("dflash_causal_true", {"dflash_config": {"causal": True}}, {}, [("causal", 16), CAU, ("causal", 16)]),
    ("dflash_causal_false", {"dflash_config": {"causal": False}}, {},
     [("bidirectional", 16), BID, ("bidirectional", 16)]),
    ("swa_window_size", {"dflash_config": {"swa_window_size": 7}}, {}, [("causal", 7), BID, ("causal", 7)]),
    ("flag_causal", {}, {"block_mask": "causal"}, [("causal", 16), CAU, ("causal", 16)]),
    ("flag_bidirectional", {}, {"block_mask": "bidirectional"}, [("bidirectional", 16), BID, ("bidirectional", 16)]),
    ("flag_beats_config", {"is_causal": True}, {"block_mask": "bidirectional"},
     [("bidirectional", 16), BID, ("bidirectional", 16)]),
    ("ignore_window", {}, {"sliding_window": "ignore"}, [BID, BID, BID]),
    ("ignore_window_causal", {}, {"sliding_window": "ignore", "block_mask": "causal"}, [CAU, CAU, CAU]),
    ("all_full", {"layer_types": ["full_attention"] * 3}, {}, [BID, BID, BID]),
    ("sliding_without_window", {"sliding_window": None}, {}, [BID, BID, BID]),
]


@pytest.mark.parametrize("case_id,cfg_over,set_over,expected", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_layer_rules(case_id, cfg_over, set_over, expected):
    cfg = {**BASE, **cfg_over}
    assert ed.layer_rules(cfg, drafter_settings(**set_over)) == expected


# ----------------------------------------------------------------------------------------------------
# 4. Layer-index convention: id L == transformers' hidden_states[L + 1]


def test_extract_hidden_matches_hidden_states(tiny_target):
    model = tiny_target["model"]
    ids = torch.randint(4, 64, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    n_prompt = 7
    n_layers = model.config.num_hidden_layers
    x = ed.extract_hidden(model, ids, list(range(n_layers)), n_prompt)
    feats, argmax = x.features, x.argmax
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    assert len(out.hidden_states) == n_layers + 1
    for L in range(n_layers):          # includes the last layer, whose hidden_states entry is normed
        torch.testing.assert_close(feats[L], out.hidden_states[L + 1][0], rtol=0, atol=1e-6, msg=f"layer {L}")
    # The last layer's feature is the NORMED state, not the raw decoder output.
    assert (feats[n_layers - 1] - feats[n_layers - 2]).abs().max() > 1e-2
    assert argmax == out.logits[0, n_prompt - 1:len(ids) - 1].argmax(-1).tolist()
    assert len(argmax) == len(ids) - n_prompt


def test_extract_hidden_subset_keeps_order(tiny_target):
    model = tiny_target["model"]
    ids = list(range(4, 20))
    feats = ed.extract_hidden(model, ids, [4, 1], 5).features
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert list(feats) == [4, 1]
    torch.testing.assert_close(feats[4], hs[5][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(feats[1], hs[2][0], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# 5. score_prompt / walk / summarize on hand-made drafts

IDS = list(range(100, 112))   # 12 tokens: prompt 100..102 (n_prompt 3), completion 103..111
N_PROMPT, B = 3, 4            # anchors 3..8 (a + 3 <= 11)


def drafts_from(pattern):
    """pattern[n][k] True = draft k+1 of anchor 3+n equals the reference, False = a wrong token."""
    rows = []
    for n, row in enumerate(pattern):
        a = N_PROMPT + n
        rows.append([IDS[a + 1 + k] if ok else 7 for k, ok in enumerate(row)])
    return torch.tensor(rows)


T, F = True, False
PATTERN = [[T, T, F],   # anchor 3: matched 2
           [F, F, T],   # anchor 4: matched 0 (a later hit does not count for acceptance)
           [T, T, T],   # anchor 5: matched 3
           [T, F, T],   # anchor 6: matched 1
           [F, T, T],   # anchor 7: matched 0
           [T, T, T]]   # anchor 8: matched 3


def test_score_prompt_by_hand():
    res = ed.score_prompt(drafts_from(PATTERN), IDS, N_PROMPT, B)
    assert res.anchors.tolist() == [3, 4, 5, 6, 7, 8]
    assert res.matched.tolist() == [2, 0, 3, 1, 0, 3]
    assert res.equal.tolist() == PATTERN
    # Walk: anchor 3 accepts 3 -> anchor 6 accepts 2 -> anchor 8 accepts 4 (8 + 3 = 11 is the last
    # position) -> anchor 12 is past the end.
    assert res.rounds == [3, 2, 4]


def test_walk_stop_rule():
    def fixed(matched):  # acceptance(anchor) from a per-anchor list of matched drafts, first anchor 3
        return lambda a: 1 + matched[a - 3]
    # All drafts wrong: one round per anchor 3..8; anchor 9 would draft position 12, past the end (11).
    assert ed.walk(fixed([0] * 6), 3, 12, 4)[0] == [1, 1, 1, 1, 1, 1]
    # All right: 3 -> 7 -> 11; the block at 11 would draft 12..14, so it is not taken.
    assert ed.walk(fixed([3] * 6), 3, 12, 4)[0] == [4, 4]
    # A block exactly reaching the last token is taken: total 7, first anchor 3, B 4 -> 3 + 3 = 6.
    assert ed.walk(fixed([1]), 3, 7, 4)[0] == [2]
    # Too short for a single block: no rounds, and acceptance is never asked for.
    assert ed.walk(fixed([]), 3, 6, 4)[0] == []


@pytest.mark.parametrize("total_len", [6, 5, 4, 3])
def test_score_prompt_too_short(total_len):
    # Completion of 3, 2, 1, 0 tokens with B 4: no block fits (a block needs B - 1 = 3 drafted positions
    # after its anchor), so there are no anchors and no rounds. A reference that stops early on EOS, or a
    # small --max-new-tokens, produces exactly this.
    res = ed.score_prompt(torch.zeros(0, 3, dtype=torch.long), IDS[:total_len], 3, 4)
    assert res.rounds == [] and res.matched.numel() == 0 and res.anchors.numel() == 0


def test_summarize_by_hand():
    one = ed.score_prompt(drafts_from(PATTERN), IDS, N_PROMPT, B)
    s = ed.summarize([one], B)
    assert s["tau"] == pytest.approx(9 / 3)
    assert s["tau_prompt_mean"] == pytest.approx(3.0)
    assert s["tau_all_anchors"] == pytest.approx(1 + 9 / 6)          # matched [2,0,3,1,0,3]
    assert s["rounds"] == 3 and s["anchors"] == 6
    # Acceptance at k: P(matched >= k | matched >= k-1): 4/6, 3/4, 2/3.
    assert s["per_position"]["acceptance"] == pytest.approx([4 / 6, 3 / 4, 2 / 3])
    # Accuracy at k: column k of the equality table, whatever came before: 4/6, 4/6, 5/6.
    assert s["per_position"]["accuracy"] == pytest.approx([4 / 6, 4 / 6, 5 / 6])
    assert s["histogram"] == [0, 1, 1, 1]


def test_summarize_pooled_vs_prompt_mean():
    good = ed.score_prompt(drafts_from(PATTERN), IDS, N_PROMPT, B)              # rounds [3, 2, 4]
    bad = ed.score_prompt(drafts_from([[F, T, T]] * 6), IDS, N_PROMPT, B)       # rounds [1] * 6
    assert bad.rounds == [1] * 6
    s = ed.summarize([good, bad], B)
    assert s["tau"] == pytest.approx((9 + 6) / (3 + 6))       # pooled: all tokens / all rounds = 1.667
    assert s["tau_prompt_mean"] == pytest.approx((3 + 1) / 2)  # mean of per-prompt means = 2.0
    assert s["tau_all_anchors"] == pytest.approx(1 + 9 / 12)
    assert s["rounds"] == 9 and s["anchors"] == 12
    assert s["histogram"] == [6, 1, 1, 1]
    assert s["per_position"]["acceptance"] == pytest.approx([4 / 12, 3 / 4, 2 / 3])
    assert s["per_position"]["accuracy"] == pytest.approx([4 / 12, 10 / 12, 11 / 12])


def test_summarize_unreached_position_is_none():
    bad = ed.score_prompt(drafts_from([[F, T, T]] * 6), IDS, N_PROMPT, B)
    s = ed.summarize([bad], B)
    assert s["per_position"]["acceptance"] == [0.0, None, None]
    assert s["per_position"]["accuracy"] == pytest.approx([0.0, 1.0, 1.0])


# ----------------------------------------------------------------------------------------------------
# 6. default_layer_ids


def test_default_layer_ids():
    assert ed.default_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert ed.default_layer_ids(64, 1) == [32]
    assert ed.default_layer_ids(36, 1) == [18]
    assert ed.default_layer_ids(36, 4) == [1, 12, 22, 33]     # 1 + i*32/3 = 1, 11.67, 22.33, 33
    assert ed.default_layer_ids(7, 3) == [1, 2, 4]            # 1 + 1.5 = 2.5 rounds half to even -> 2
