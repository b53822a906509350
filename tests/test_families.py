"""DSpark and Domino drafters, exact like the others.

- Greedy: for DSpark (vanilla and rnn heads) and Domino (P = 1 and P = 0, shift_label off and on), trained on the
  demo target (tests/fixtures/families, made by tests/make_demo.py --families), the tool's rounds equal, round by
  round, those of an online greedy loop that drafts as the engines do: one block per round from the committed
  tokens alone, then the head slot by slot (DSpark's Markov bias given the token drafted before; Domino's GRU,
  torch.nn.GRU here, re-run over the drafted prefix). The same with the engines' narrowing (vLLM's
  dspark_draft_topk, SGLang's Domino candidate pool).
- The drafts equal SpecForge 0.2.0's own model classes' (DSparkDraftModel with its Markov head's
  sample_block_tokens, DominoDraftModel's _sample_draft_tokens), vanilla, gated and rnn heads, where SpecForge
  imports.
- Sampled DSpark: over 150 runs of an online sampled loop (drafts sampled from the drafter slot by slot,
  speculative sampling against the target), the actual rounds minus the tool's E[rounds | text] sum to 0 within 3
  standard errors. (The estimator for proposals chained through the drafts before them is checked against
  brute-force enumeration in test_sampled_math.py.)
- Loading: what is recognized and refused, in one line.
"""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import eval_drafter as ed
from conftest import drafter_settings, online_draft_hidden
from drafters import DEMO, demo_pair, on_texts, online_rounds, run_tool, speculative_sampling_runs
from test_sampled import mc_check

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = os.path.join(HERE, "fixtures", "families")
N_NEW = 48
N_PROMPTS = 5

# id: (fixture, dflash_config changes)
CASES = {
    "dspark_vanilla": ("dspark_vanilla", {}),
    "dspark_rnn": ("dspark_rnn", {}),
    "domino_p1": ("domino", {}),
    "domino_p0": ("domino", {"pure_draft_prefix_len": 0}),
    "domino_shift_p0": ("domino_shift", {}),
    "domino_shift_p1": ("domino_shift", {"pure_draft_prefix_len": 1}),
}


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


def family_dir(tmp_path, fixture, dflash=None, weights=None):
    """A copy of a family fixture with dflash_config keys changed, or some tensors changed by weights(state)."""
    src, out = os.path.join(FAMILIES, fixture), tmp_path / fixture
    if not dflash and not weights:
        return src
    shutil.copytree(src, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.get("dflash_config", cfg).update(dflash or {})   # speculators keeps DSpark's keys at the top level
    (out / "config.json").write_text(json.dumps(cfg))
    if weights:
        from safetensors.torch import load_file, save_file
        state = load_file(str(out / "model.safetensors"))
        save_file({k: v.contiguous() for k, v in weights(state).items()}, str(out / "model.safetensors"))
    return str(out)


# ----------------------------------------------------------------------------------------------------
# The engines' drafting, written from their source, one block at a time


def dspark_drafts(rows, anchor_token, lm_head, w, kind, topk=0, given=None, temperature=None, generator=None,
                  vocab=None):
    """vLLM's / SGLang's DSpark step over one block's slot rows (N, H): prev = the anchor's token, then each
    draft. Greedy: the argmax of base + bias (within the slot's top-k base tokens if topk; within the target ids
    `vocab` of a reduced draft vocabulary). With `temperature`, each draft is sampled from softmax(logits / T)
    (SGLang's default); returns (drafts, their distributions)."""
    W1, W2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    r = W1.shape[1]
    state, prev, drafts, dists = torch.zeros(r), anchor_token, [], []
    for k in range(rows.shape[0]):
        h, e = rows[k], W1[prev]
        if kind == "gated":
            e = torch.sigmoid(w["markov_head.gate_proj.weight"] @ torch.cat([h, e]) + w["markov_head.gate_proj.bias"]) * e
        elif kind == "rnn":
            a, c, o = (w["markov_head.joint_proj.weight"] @ torch.cat([state, e, h]) + w["markov_head.joint_proj.bias"]).split(r)
            state = torch.sigmoid(a) * state + (1 - torch.sigmoid(a)) * torch.tanh(c)
            e = torch.tanh(o)
        base = lm_head(h)
        logits = base + W2 @ e
        if topk or vocab is not None:
            outside = torch.ones_like(logits, dtype=torch.bool)
            outside[base.topk(topk).indices if topk else vocab] = False
            logits = logits.masked_fill(outside, float("-inf"))
        if temperature is None:
            token = int(logits.argmax())
        else:
            dist = (logits.double() / temperature).softmax(-1)
            dists.append(dist)
            token = int(torch.multinomial(dist, 1, generator=generator))
        drafts.append(token)
        prev = token
    return drafts, dists


def domino_drafts(rows, anchor_token, lm_head, embed_w, w, prefix, pool=0):
    """SGLang's Domino rollout over one block's proposal rows (B-1, H): proposal i reads row i - 1 here (the
    caller picks slots 1.. or, with shift_label, 0..), adds W_b SiLU(W_a [u; g]) past the pure-draft prefix,
    g = torch.nn.GRU (bias-free, zero state) run afresh over the embeddings of the anchor and the drafts so far;
    with a pool, proposals after the first choose among the pool tokens (best base logit over those rows)."""
    G, H = w["prefix_gru.weight_hh_l0"].shape[1], rows.shape[1]
    gru = torch.nn.GRU(H, G, bias=False, batch_first=True)
    gru.load_state_dict({"weight_ih_l0": w["prefix_gru.weight_ih_l0"], "weight_hh_l0": w["prefix_gru.weight_hh_l0"]})
    base = lm_head(rows)
    candidates = base[1:].amax(0).topk(pool).indices if pool and rows.shape[0] > 1 else None
    y = [anchor_token]
    for i in range(1, rows.shape[0] + 1):
        logits = base[i - 1]
        if i > prefix:
            g = gru(embed_w[torch.tensor([y])])[1][0, 0]
            logits = logits + w["embed_proj.2.weight"] @ F.silu(w["embed_proj.0.weight"] @ torch.cat([rows[i - 1], g]))
        y.append(int(candidates[logits[candidates].argmax()]) if candidates is not None and i > 1 else int(logits.argmax()))
    return y[1:]


@torch.no_grad()
def engine_propose(target, drafter, seq, topk=0, pool=0):
    """The drafts of one round anchored at seq's last token, from a fresh block over the committed tokens."""
    N, head = drafter.block_size - 1, drafter.head
    hidden = online_draft_hidden(target, drafter, seq, N if drafter.from_anchor else N + 1)
    lm_head, embed_w = target.get_output_embeddings(), target.get_input_embeddings().weight
    if drafter.generation == "DSpark":
        return dspark_drafts(hidden, seq[-1], lm_head, drafter.weights, head["kind"], topk)[0]
    rows = hidden[:-1] if head["shift"] else hidden[1:]
    return domino_drafts(rows, seq[-1], lm_head, embed_w, drafter.weights, head["prefix"], pool)


def tool_and_online(tmp_path, demo, path, *argv, topk=0, pool=0):
    target, rows, prompts = demo
    report = run_tool(tmp_path, "fam", "--demo", "--ckpt", f"fam={path}", "--max-new-tokens", str(N_NEW),
                      "--ignore-eos", "--limit", str(N_PROMPTS), *argv)
    drafter = ed.load_drafter(path, target.config, drafter_settings(dspark_draft_topk=topk, domino_candidate_pool=pool))
    online = [online_rounds(target, lambda seq: engine_propose(target, drafter, seq, topk, pool), ids, N_NEW,
                            drafter.block_size - 1) for ids in prompts[:N_PROMPTS]]
    return report, online


@pytest.mark.parametrize("case", list(CASES))
def test_rounds_equal_an_online_engine_loop(tmp_path, demo, case):
    fixture, dflash = CASES[case]
    path = family_dir(tmp_path, fixture, dflash)
    report, online = tool_and_online(tmp_path, demo, path)
    d = report["drafters"][0]
    assert d["generation"] == ("DSpark" if case.startswith("dspark") else "Domino")
    assert report["target"]["agreement"] == 1.0
    assert [p["rounds"] for p in d["prompts"]] == online
    flat = [r for rounds in online for r in rounds]
    assert len(set(flat)) >= 3 and max(flat) >= 4   # rounds vary: the comparison has teeth
    assert d["ddtree"] is None and "chain" in d["ddtree_note"]

    # The head changes drafts: without it (W2 or W_b zeroed) the rounds are others.
    zero = "markov_head.markov_w2.weight" if case.startswith("dspark") else "embed_proj.2.weight"
    plain = family_dir(tmp_path / "plain", fixture, dflash, lambda s: {**s, zero: torch.zeros_like(s[zero])})
    without = run_tool(tmp_path, "plain", "--demo", "--ckpt", f"fam={plain}", "--max-new-tokens", str(N_NEW),
                       "--ignore-eos", "--limit", str(N_PROMPTS))["drafters"][0]
    assert [p["rounds"] for p in without["prompts"]] != online


@pytest.mark.parametrize("case,flag,value", [("dspark_vanilla", "--dspark-draft-topk", 2),
                                             ("domino_p1", "--domino-candidate-pool", 3)])
def test_the_engines_narrowing_equals_an_online_loop(tmp_path, demo, case, flag, value):
    fixture, dflash = CASES[case]
    path = family_dir(tmp_path, fixture, dflash)
    topk, pool = (value, 0) if flag == "--dspark-draft-topk" else (0, value)
    report, online = tool_and_online(tmp_path, demo, path, flag, str(value), topk=topk, pool=pool)
    assert [p["rounds"] for p in report["drafters"][0]["prompts"]] == online
    assert report["config"][flag[2:].replace("-", "_")] == value
    exact = run_tool(tmp_path, "exact", "--demo", "--ckpt", f"fam={path}", "--max-new-tokens", str(N_NEW),
                     "--ignore-eos", "--limit", str(N_PROMPTS))["drafters"][0]
    assert [p["rounds"] for p in exact["prompts"]] != online   # the narrowing changes drafts here


# ----------------------------------------------------------------------------------------------------
# SpecForge's own classes


def specforge_model(path, cfg, tmp_path):
    """SpecForge's DSparkDraftModel / DominoDraftModel for a drafter's config (SpecForge's export form) with the
    fixture's tensors."""
    if os.environ.get("EVAL_DRAFTER_REQUIRE_SPECFORGE"):   # CI: the reference must be there, not skipped
        import specforge.modeling.auto as draft
    else:
        draft = pytest.importorskip("specforge.modeling.auto",
                                    reason="specforge 0.2.0 does not import here: pip install --no-deps specforge==0.2.0")
    from safetensors.torch import load_file
    config_path = str(tmp_path / "sf_config.json")   # beside the test's files, never in the committed fixture
    with open(config_path, "w") as f:
        json.dump(cfg, f)
    model = draft.AutoDraftModel.from_config(draft.AutoDraftModelConfig.from_file(config_path), torch_dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    missing, unexpected = model.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=False)
    assert not unexpected and all(k.startswith(("embed_tokens", "lm_head")) for k in missing), (missing, unexpected)
    return model.eval()


def specforge_config(path):
    """The drafter's config as SpecForge writes its export (speculators' DSpark config translated back)."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    if "speculators_model_type" not in cfg:
        return cfg
    return {**cfg["transformer_layer_config"], "architectures": ["DSparkDraftModel"], "block_size": cfg["block_size"],
            "num_target_layers": 6, "dflash_config": {
                "mask_token_id": cfg["mask_token_id"], "target_layer_ids": [i - 1 for i in cfg["aux_hidden_state_layer_ids"]],
                "markov_rank": cfg["markov_rank"], "markov_head_type": cfg["markov_head_type"]}}


def gated_from_rnn(tmp_path):
    """The rnn fixture's backbone with a random gated head (SpecForge's shapes), scaled to change drafts."""
    g = torch.Generator().manual_seed(5)

    def gated(state):
        out = {k: v for k, v in state.items() if "joint_proj" not in k}
        r, H = out["markov_head.markov_w1.weight"].shape[1], out["norm.weight"].shape[0]
        out["markov_head.gate_proj.weight"] = torch.randn(r, H + r, generator=g)
        out["markov_head.gate_proj.bias"] = torch.randn(r, generator=g)
        out["markov_head.markov_w2.weight"] = out["markov_head.markov_w2.weight"] * 4
        return out
    return family_dir(tmp_path, "dspark_rnn", {"markov_head_type": "gated"}, gated)


@pytest.mark.parametrize("case", ["dspark_vanilla", "dspark_rnn", "dspark_gated", "domino_p1", "domino_shift_p0"])
def test_drafts_equal_specforge_classes(tmp_path, demo, case):
    target, rows, prompts = demo
    path = gated_from_rnn(tmp_path) if case == "dspark_gated" else family_dir(tmp_path, *CASES[case])
    model = specforge_model(path, specforge_config(path), tmp_path)
    drafter = ed.load_drafter(path, target.config, drafter_settings())
    ids = prompts[0] + ed.plain_generate(target, prompts[0], 40, set())
    n_prompt, slots = len(prompts[0]), drafter.block_size - drafter.from_anchor
    features = ed.extract_hidden(target, ids, drafter.layers, n_prompt).features
    flat = torch.cat([features[L] for L in drafter.layers], -1)
    anchors = ed.fitting_anchors(n_prompt, len(ids), drafter.block_size)
    embed_w, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings()
    ids_t = torch.tensor(ids)
    tool, _ = ed.draft_all_anchors(drafter, ed.prompt_context(drafter, features), anchors, ids_t[anchors], embed_w,
                                   lm_head)
    theirs, bases = [], []
    with torch.no_grad():
        for a in anchors.tolist():
            block = torch.full((1, slots), drafter.mask_token_id)
            block[0, 0] = ids[a]
            h = model(position_ids=torch.arange(a + slots)[None], noise_embedding=target.get_input_embeddings()(block),
                      target_hidden=flat[None, :a], attention_mask=None, is_causal=False)
            if drafter.generation == "DSpark":   # the training-consistent step (spec_generate is off by one)
                drafts, _ = model.markov_head.sample_block_tokens(lm_head(h), first_prev_token_ids=block[:, 0],
                                                                  hidden_states=h)
                bases.append(lm_head(h)[0].argmax(-1).tolist())
            else:
                drafts = model._sample_draft_tokens(target, h, block)
                rows_ = h[0, :-1] if drafter.head["shift"] else h[0, 1:]
                bases.append(lm_head(rows_).argmax(-1).tolist())
            theirs.append(drafts[0].tolist())
    assert tool.tolist() == theirs
    assert tool.tolist() != bases   # the head changed some drafts: the comparison has teeth


# ----------------------------------------------------------------------------------------------------
# Sampled DSpark


def dspark_proposer(target, drafter, sampling):
    """Drafts sampled slot by slot from the DSpark drafter at the target's temperature."""
    def propose(seq, g):
        hidden = online_draft_hidden(target, drafter, seq, drafter.block_size - 1)
        return dspark_drafts(hidden, seq[-1], target.get_output_embeddings(), drafter.weights, drafter.head["kind"],
                             temperature=sampling[0], generator=g)
    return propose


def test_sampled_dspark_expected_rounds_match_an_online_sampled_loop(tmp_path, demo):
    target, rows, prompts = demo
    path = family_dir(tmp_path, "dspark_rnn")
    drafter = ed.load_drafter(path, target.config, drafter_settings())
    sampling = (0.8, 1.0, 0)
    runs = speculative_sampling_runs(target, prompts, sampling, 150, 32, drafter.block_size - 1,
                                     lambda: dspark_proposer(target, drafter, sampling), seed=2000)
    report = on_texts(tmp_path, "sampled", path, rows, runs, sampling, "sample")
    _, _, sd = mc_check(runs, report)
    assert sd > 0.3   # the runs do vary: the check has power
    assert report["drafters"][0]["ddtree"] is None


# ----------------------------------------------------------------------------------------------------
# Loading


def test_load_line_names_the_family_and_its_engines(tmp_path, capsys):
    assert ed.main(["--demo", "--ckpt", f"v={FAMILIES}/dspark_vanilla", "--ckpt", f"r={FAMILIES}/dspark_rnn",
                    "--ckpt", f"d={FAMILIES}/domino", "--limit", "1", "--max-new-tokens", "16",
                    "--output", str(tmp_path / "o.json")]) == 0
    err = capsys.readouterr().err
    assert "drafter v: DSpark, speculators layout" in err and "vanilla Markov head of rank 16" in err
    assert "served by SGLang 0.5.23" in err and "and vLLM 0.33 and 0.34" in err
    assert "drafter r: DSpark" in err and "not vLLM 0.33 or 0.34 (their Qwen3 DSpark has the vanilla head only)" in err
    assert "drafter d: Domino" in err and "pure-draft prefix P = 1" in err and "served by SGLang 0.5.23 only" in err
    report = json.loads((tmp_path / "o.json").read_text())
    heads = {d["name"]: d.get("head") for d in report["drafters"]}
    assert heads == {"v": {"kind": "vanilla", "rank": 16, "topk": 0}, "r": {"kind": "rnn", "rank": 16, "topk": 0},
                     "d": {"prefix": 1, "shift": False, "pool": 0}}
    assert [d["drafts_per_round"] for d in report["drafters"]] == [8, 8, 7]


def broken(tmp_path, fixture, drop=(), dflash=None, reshape=None):
    def change(state):
        state = {k: v for k, v in state.items() if k not in drop}
        if reshape:
            state[reshape] = state[reshape][:, :-1].contiguous()
        return state
    return family_dir(tmp_path, fixture, dflash or {"unused": 0}, change)


@pytest.mark.parametrize("make,fragment", [
    (lambda t: broken(t, "dspark_rnn", drop=("markov_head.joint_proj.weight",)),
     "does not match a DSpark drafter of its config: 1 missing (markov_head.joint_proj.weight)"),
    (lambda t: broken(t, "dspark_rnn", reshape="markov_head.markov_w2.weight"),
     "tensor markov_head.markov_w2.weight has shape (64, 15)"),
    (lambda t: broken(t, "domino", drop=("prefix_gru.weight_hh_l0",)),
     "does not match a Domino drafter of its config: 1 missing (prefix_gru.weight_hh_l0)"),
    (lambda t: broken(t, "dspark_rnn", dflash={"markov_head_type": "lstm"}), "markov_head_type 'lstm'"),
    (lambda t: broken(t, "domino", dflash={"emb_dim": None}), "needs emb_dim in its dflash_config"),
])
def test_a_missing_or_misshapen_head_is_one_line(tmp_path, capsys, make, fragment):
    path = make(tmp_path)
    assert ed.main(["--demo", "--ckpt", path, "--quiet", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_domino_refuses_sampled_proposals(tmp_path, capsys):
    assert ed.main(["--demo", "--ckpt", f"{FAMILIES}/domino", "--quiet", "--limit", "1", "--temperature", "0.7",
                    "--draft-policy", "sample"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drafts greedily at every temperature" in err[0]


# ----------------------------------------------------------------------------------------------------
# Every promise, for both families: walk mode, depths, saved features, shards, resume after an interruption
# in the middle, the mask check


PROMISE_ARGV = ("--demo", "--ckpt", f"s={FAMILIES}/dspark_rnn", "--ckpt", f"d={FAMILIES}/domino_shift",
                "--max-new-tokens", "40", "--ignore-eos", "--limit", "4")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return run_tool(tmp_path_factory.mktemp("whole"), "whole", *PROMISE_ARGV, "--depths", "3,5", "--check-mask")


def results(report):
    return [{k: v for k, v in d.items() if k not in ("checkpoint",)} for d in report["drafters"]]


def test_walk_mode_gives_the_same_rounds(tmp_path, whole):
    walked = run_tool(tmp_path, "walk", *PROMISE_ARGV, "--anchors", "walk")
    for got, want in zip(walked["drafters"], whole["drafters"]):
        assert [p["rounds"] for p in got["prompts"]] == [p["rounds"] for p in want["prompts"]]
        assert got["tau"] == want["tau"]


def test_depths_equal_an_online_loop_with_the_shorter_block(tmp_path, demo, whole):
    """DSpark at depth K runs K slots (K drafts), Domino a block of 1 + K; the trained depth is unchanged."""
    target, _, prompts = demo
    plain = run_tool(tmp_path, "plain", *PROMISE_ARGV)
    for d, name, path in zip(whole["drafters"], ("s", "d"), (f"{FAMILIES}/dspark_rnn", f"{FAMILIES}/domino_shift")):
        assert [p["rounds"] for p in d["prompts"]] == [p["rounds"] for p in plain["drafters"][("s", "d").index(name)]["prompts"]]
        drafter = ed.load_drafter(path, target.config, drafter_settings())
        for depth in (3, 5):
            short = ed.replace(drafter, block_size=depth + 1)
            online = [online_rounds(target, lambda seq: engine_propose(target, short, seq), ids, 40, depth)
                      for ids in prompts[:4]]
            assert [p["depth_rounds"][str(depth)] for p in d["prompts"]] == online, (name, depth)


def test_saved_features_give_the_same_results(tmp_path, whole):
    saved = tmp_path / "h.safetensors"
    first = run_tool(tmp_path, "save", *PROMISE_ARGV, "--depths", "3,5", "--check-mask", "--save-hidden", str(saved))
    assert results(first) == results(whole)
    argv = [a for a in PROMISE_ARGV if a not in ("--max-new-tokens", "40", "--ignore-eos")]
    again = run_tool(tmp_path, "load", *argv, "--depths", "3,5", "--check-mask", "--load-hidden", str(saved))
    assert results(again) == results(whole)


def test_shards_merged_equal_one_run(tmp_path, whole):
    for k in (1, 2):
        run_tool(tmp_path, f"s{k}", *PROMISE_ARGV, "--depths", "3,5", "--check-mask", "--shard", f"{k}/2")
    merged = run_tool(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert results(merged) == results(whole)


def test_an_interruption_in_the_chained_proposals_loses_nothing(tmp_path, monkeypatch, whole):
    """Ctrl-C inside the slot-by-slot proposal step of the third prompt: the finished prompts stay, --resume
    ends with the uninterrupted run's numbers."""
    out = tmp_path / "cut.json"
    real, scoring = ed.chain_drafts, []

    def finished():
        with open(str(out) + ".partial.jsonl") as f:
            return sum("results" in json.loads(line) for line in f)

    def stopping(drafter, *args, **kwargs):   # in the second drafter's proposals, once two prompts are done
        if drafter.name == "d" and finished() == 2 and kwargs.get("given") is None and args[-1] is not None:
            scoring.append(1)
            if len(scoring) == 2:
                raise KeyboardInterrupt
        return real(drafter, *args, **kwargs)

    monkeypatch.setattr(ed, "chain_drafts", stopping)
    argv = [*PROMISE_ARGV, "--depths", "3,5", "--check-mask", "--quiet", "--output", str(out)]
    assert ed.main(argv) == 130
    assert finished() == 2
    monkeypatch.setattr(ed, "chain_drafts", real)
    assert ed.main([*argv, "--resume"]) == 0
    assert results(json.loads(out.read_text())) == results(whole)


def test_the_mask_check_runs_the_chained_proposals(whole):
    for d in whole["drafters"]:
        modes = d["mask_check"]["modes"]
        # trained bidirectional (full attention): a causal block drafts worse, and no warning fires
        assert modes["configured"]["accuracy"] > modes["causal"]["accuracy"]
        assert d["mask_check"]["warning"] is None


@pytest.mark.parametrize("fixture", ["dspark_rnn", "domino_shift"])
def test_a_specforge_training_state_equals_its_export(tmp_path, fixture):
    from safetensors.torch import load_file
    from test_layouts import training_state
    weights = load_file(os.path.join(FAMILIES, fixture, "model.safetensors"))
    step = training_state(str(tmp_path / "run" / "specforge-run-step600" / "training_state.pt"),
                          {k: v.float() for k, v in weights.items()}, step=600)
    # SpecForge saves bf16 weights; the export holds the same weights rounded alike
    export = family_dir(tmp_path, fixture, weights=lambda s: {k: v.to(torch.bfloat16).float() for k, v in s.items()})
    report = run_tool(tmp_path, "sf", "--demo", "--limit", "3", "--max-new-tokens", "32", "--ckpt", f"export={export}",
                      "--ckpt", f"state={os.path.dirname(step)}", "--drafter-config",
                      os.path.join(FAMILIES, fixture, "config.json"))
    export_d, state_d = report["drafters"]
    assert state_d["generation"] == export_d["generation"] and state_d["head"] == export_d["head"]
    assert [p["rounds"] for p in state_d["prompts"]] == [p["rounds"] for p in export_d["prompts"]]


def test_a_reduced_draft_vocabulary_equals_the_full_drafter_masked(tmp_path, demo):
    """speculators' DSpark with a draft vocabulary of 56 of the 64 tokens (its own lm_head and W2 rows, d2t, t2d;
    W1 still reads target ids) against the online loop with the full drafter's logits outside it masked."""
    from safetensors.torch import load_file
    target, _, prompts = demo
    keep = [t for t in range(64) if t not in (17, 23, 31, 40, 45, 52, 58, 61)]
    head = load_file(os.path.join(DEMO, "target", "model.safetensors"))["lm_head.weight"]

    def reduce(state):
        t2d = torch.zeros(64, dtype=torch.bool)
        t2d[keep] = True
        return {**state, "lm_head.weight": head[keep].clone(), "t2d": t2d, "d2t": torch.tensor(keep) - torch.arange(56),
                "markov_head.markov_w2.weight": state["markov_head.markov_w2.weight"][keep].clone()}
    path = family_dir(tmp_path, "dspark_vanilla", {"draft_vocab_size": 56}, reduce)
    report = run_tool(tmp_path, "reduced", "--demo", "--ckpt", f"r={path}", "--max-new-tokens", str(N_NEW),
                      "--ignore-eos", "--limit", str(N_PROMPTS))
    full = ed.load_drafter(os.path.join(FAMILIES, "dspark_vanilla"), target.config, drafter_settings())
    lm_head = target.get_output_embeddings()

    def propose(seq):
        rows = online_draft_hidden(target, full, seq, full.block_size - 1)
        return dspark_drafts(rows, seq[-1], lm_head, full.weights, "vanilla", vocab=keep)[0]
    online = [online_rounds(target, propose, ids, N_NEW, full.block_size - 1) for ids in prompts[:N_PROMPTS]]
    assert [p["rounds"] for p in report["drafters"][0]["prompts"]] == online
    whole = run_tool(tmp_path, "whole", "--demo", "--ckpt", f"w={FAMILIES}/dspark_vanilla", "--max-new-tokens",
                     str(N_NEW), "--ignore-eos", "--limit", str(N_PROMPTS))
    assert [p["rounds"] for p in whole["drafters"][0]["prompts"]] != online   # the missing tokens cost rounds


def test_a_confidence_head_and_older_names_change_no_draft(tmp_path):
    """SpecForge's confidence head (read past: it never changes a draft) and its older logit_head.* names."""
    def older(state):
        out = {("logit_head." + k if k.startswith("markov_head.") else k): v for k, v in state.items()}
        out.update({"logit_head.confidence_head.proj.weight": torch.ones(1, 80), "logit_head.confidence_head.proj.bias":
                    torch.zeros(1)})
        return out
    path = family_dir(tmp_path, "dspark_rnn", {"enable_confidence_head": True}, older)
    argv = ("--demo", "--limit", "3", "--max-new-tokens", "32")
    report = run_tool(tmp_path, "older", *argv, "--ckpt", f"a={FAMILIES}/dspark_rnn", "--ckpt", f"b={path}")
    a, b = report["drafters"]
    assert b["generation"] == "DSpark" and b["head"] == a["head"]
    assert [p["rounds"] for p in b["prompts"]] == [p["rounds"] for p in a["prompts"]]


def test_a_speculators_dspark_config_without_sample_from_anchor_reads_as_vllm_does(tmp_path, capsys):
    """vLLM 0.34's speculators reader takes a missing sample_from_anchor as false (speculators' own default is true):
    block 8 then drafts 7 a round, not 8, and the load line says the default and whose it is."""
    out = tmp_path / "d"
    shutil.copytree(os.path.join(FAMILIES, "dspark_vanilla"), out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.pop("sample_from_anchor") is True
    (out / "config.json").write_text(json.dumps(cfg))
    assert ed.main(["--demo", "--ckpt", f"a={FAMILIES}/dspark_vanilla", "--ckpt", f"b={out}", "--limit", "1",
                    "--max-new-tokens", "16", "--output", str(tmp_path / "o.json")]) == 0
    assert "sample_from_anchor False (vLLM 0.34's reading of a speculators DSpark config without the key" in \
        capsys.readouterr().err
    a, b = json.loads((tmp_path / "o.json").read_text())["drafters"]
    assert (a["drafts_per_round"], b["drafts_per_round"]) == (8, 7)
