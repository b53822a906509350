"""Drafters as teams save them: speculators (DFlash, DFlash 2, reduced draft vocabularies, sample_from_anchor),
SpecForge (training states, step directories, exports) and a training run evaluated step by step.

The speculators fixtures under tests/fixtures/speculators were written by speculators 0.9.0's own code
(tests/make_speculators_fixtures.py: its DFlashConverter, DFlash2DraftModel.save_pretrained, and its own forward
for the reference drafts in expected.json); the tests never need the package. The other layouts are built here.
"""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import eval_drafter as ed
from conftest import ROOT, drafter_settings, interrupt_at, md, online_draft_hidden, online_draft_logits
from drafters import demo_drafter_files, save, with_config

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
SPECULATORS = os.path.join(ROOT, "tests", "fixtures", "speculators")
FROM_ANCHOR = os.path.join(ROOT, "tests", "fixtures", "demo_from_anchor", "drafter")
N_NEW = 64


def run(tmp_path, name, *argv, code=0, quiet=True):
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, *(["--quiet"] if quiet else []), "--output", str(out)]) == code
    return json.loads(out.read_text()) if out.exists() else None


def rounds_of(report, j=0):
    return [(p["rounds"], p["ddtree_rounds"]) for p in report["drafters"][j]["prompts"]]


@pytest.fixture(scope="module")
def demo():
    """The demo target, its tokenizer's prompt ids and the target's greedy references (N_NEW tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    rows = [json.loads(line) for line in open(os.path.join(DEMO, "prompts.jsonl"))]
    prompts = [tok(row["prompt"])["input_ids"] for row in rows]
    return target, rows, prompts


BASE = ["--demo", "--max-new-tokens", str(N_NEW), "--ignore-eos", "--ddtree-budgets", "8,32"]


# ----------------------------------------------------------------------------------------------------
# speculators: the converter's output and DFlash 2 as speculators saves it, against the same drafter in z-lab's
# layout; the anchored sliding window against speculators' own forward


def test_converted_dflash_equals_the_zlab_drafter(tmp_path, capsys):
    """speculators' DFlashConverter on the demo drafter (window 4096, as in the z-lab twin: the window never
    binds on these texts, so both layouts' window rules agree): the same rounds, round by round, and the same
    layer ids in the report though the file says aux_hidden_state_layer_ids [2, 4, 5]."""
    zlab = with_config(tmp_path / "zlab", top={"sliding_window": 4096})
    report = run(tmp_path, "r", *BASE, "--ckpt", f"zlab={zlab}", "--ckpt", f"spec={SPECULATORS}/dflash", quiet=False)
    zl, spec = report["drafters"]
    assert json.load(open(f"{SPECULATORS}/dflash/config.json"))["aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert spec["layers"] == zl["layers"] == [1, 3, 4] and spec["layout"] == "speculators"
    assert rounds_of(report, 1) == rounds_of(report, 0)
    assert max(r for rounds, _ in rounds_of(report) for r in rounds) == 8 and zl["tau"] > 2
    assert "drafter spec: DFlash, speculators layout (aux_hidden_state_layer_ids [2, 4, 5] (hidden_states " \
           "indices) are layers [1, 3, 4]" in capsys.readouterr().err


def test_dflash2_saved_by_speculators_equals_the_zlab_drafter(tmp_path):
    zlab_cfg = json.load(open(f"{SPECULATORS}/dflash2/zlab_config.json"))
    zlab = save(tmp_path / "zlab", zlab_cfg, load_file(f"{SPECULATORS}/dflash2/model.safetensors"))
    report = run(tmp_path, "r", *BASE, "--ckpt", f"zlab={zlab}", "--ckpt", f"spec={SPECULATORS}/dflash2")
    zl, spec = report["drafters"]
    assert spec["generation"] == zl["generation"] == "DFlash 2" and spec["layout"] == "speculators"
    assert [r.split(",")[0] for r in spec["block_mask"]] == [r.split(",")[0] for r in zl["block_mask"]]
    assert rounds_of(report, 1) == rounds_of(report, 0)
    assert len({r for rounds, _ in rounds_of(report) for r in rounds}) >= 3


@pytest.mark.parametrize("fixture", ["dflash_w32", "dflash2_w32_bidi"])
def test_anchored_window_drafts_equal_speculators_forward(fixture, demo):
    """With a window that binds (32), speculators shows a sliding layer the 32 context positions before the
    anchor, the same for every slot, and nothing of a window inside the block (bidirectional there for the
    DFlash 2 fixture): the tool's drafts at every anchor equal those of speculators' own forward."""
    target = demo[0]
    path = f"{SPECULATORS}/{fixture}"
    expected = json.load(open(f"{path}/expected.json"))
    drafter = ed.load_drafter(path, target.config, drafter_settings())
    assert any(len(rule) == 3 for rule in drafter.rules)   # an anchored window
    query_relative = ed.replace(drafter, rules=[r[:2] for r in drafter.rules])   # z-lab's training rule
    compared = differ = 0
    for seq in expected["sequences"]:
        ids, n_prompt = seq["ids"], len(seq["prompt_ids"])
        x = ed.extract_hidden(target, ids, drafter.layers, n_prompt)
        anchors, ids_t = torch.tensor(seq["anchors"]), torch.tensor(ids)
        # speculators has no serving path for DFlash 2's greedy selector chain: its select(), slot by slot
        want = seq.get("drafts", seq.get("selector_greedy_drafts"))
        for d in (drafter, query_relative):
            drafts, _ = ed.draft_all_anchors(d, ed.prompt_context(d, x.features), anchors, ids_t[anchors],
                                             target.get_input_embeddings().weight, target.get_output_embeddings())
            if d is drafter:
                assert drafts.tolist() == want
            else:
                differ += sum(a != b for a, b in zip(drafts.tolist(), want))
        compared += len(seq["anchors"])
    assert compared == 228 and differ > 0   # the rule matters: the query-relative window drafts otherwise


# ----------------------------------------------------------------------------------------------------
# A reduced draft vocabulary


def reduced_drafter(out_dir, keep, **top):
    """The demo drafter in speculators' layout with a draft vocabulary of the target tokens `keep`: its own
    lm_head (the target head's rows), d2t offsets and the t2d mask."""
    cfg, weights = demo_drafter_files()
    head = load_file(os.path.join(DEMO, "target", "model.safetensors"))["lm_head.weight"]
    keep = sorted(keep)
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[keep] = True
    weights = {**weights, "lm_head.weight": head[keep].clone(), "t2d": t2d,
               "d2t": torch.tensor(keep) - torch.arange(len(keep))}
    return md.save_speculators(str(out_dir), cfg, weights, draft_vocab_size=len(keep), **top)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory, demo):
    """A draft vocabulary without a few tokens the demo references use often: rounds that would have accepted
    them end early."""
    target, rows, prompts = demo
    counts = torch.bincount(torch.tensor([t for p in prompts[:4] for t in ed.plain_generate(target, p, N_NEW, set())]),
                            minlength=64)
    dropped = counts.argsort(descending=True)[3:6].tolist()   # frequent, not the most frequent
    keep = [t for t in range(64) if t not in dropped]
    path = reduced_drafter(tmp_path_factory.mktemp("reduced") / "d", keep)
    return {"path": path, "keep": keep, "dropped": dropped}


def online_loop(target, draft_logits, prompt_ids, n_new, n_drafts, budget=None):
    """Greedy speculative decoding, every pass from scratch: draft_logits(seq) gives the (n_drafts, V) logits
    over the target's tokens for the block anchored at seq's last token; the chain drafts their argmax, a
    DDTree of `budget` nodes is built from their log-probs. Rounds until a block would pass n_new tokens."""
    seq = list(prompt_ids)
    seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    rounds = []
    while len(seq) - len(prompt_ids) + n_drafts <= n_new:
        logits = draft_logits(seq).float()
        if budget is None:
            candidates = [logits.argmax(-1).tolist()]
        else:
            top = logits.log_softmax(-1).topk(budget, dim=-1)
            tree = ed.build_tree(top.values.tolist(), budget)
            parents = {p[:-1] for p in tree}
            candidates = [[int(top.indices[d, r]) for d, r in enumerate(leaf)] for leaf in tree if leaf not in parents]
        best = None
        for toks in candidates:
            greedy = target(torch.tensor([seq + toks])).logits[0, len(seq) - 1:].argmax(-1).tolist()
            depth = 0
            while depth < len(toks) and toks[depth] == greedy[depth]:
                depth += 1
            if best is None or depth > best[0]:
                best = (depth, toks[:depth] + [greedy[depth]])
        seq += best[1]
        rounds.append(best[0] + 1)
    return rounds


@torch.inference_mode()
def test_reduced_vocabulary_equals_online_loops(tmp_path, demo, reduced):
    """The chain and DDTree rounds of a drafter with a reduced draft vocabulary equal (a) an online loop whose
    drafts are the argmax over the draft vocabulary mapped by d2t, and (b) one with the full-vocabulary drafter
    whose logits outside t2d are masked; and they differ from the full drafter's."""
    target, rows, prompts = demo
    drafter = ed.load_drafter(reduced["path"], target.config, drafter_settings())
    full = ed.load_drafter(os.path.join(DEMO, "drafter"), target.config, drafter_settings())
    full = ed.replace(full, rules=drafter.rules)   # speculators' window rule: only the vocabulary differs
    assert len(drafter.vocab[0]) == 61 and drafter.vocab[1][reduced["dropped"]].tolist() == [-1, -1, -1]
    report = run(tmp_path, "r", *BASE, "--limit", "4", "--ckpt", f"reduced={reduced['path']}", "--ckpt",
                 f"full={DEMO}/drafter")
    outside = torch.ones(64, dtype=torch.bool)
    outside[reduced["keep"]] = False

    def masked(seq):
        return online_draft_logits(target, full, seq).masked_fill(outside, -torch.inf)

    def draft_vocab(seq):   # the reduced drafter's own head; its argmax d is target token d + d2t[d]
        ids = F.linear(online_draft_hidden(target, drafter, seq)[1:], drafter.weights["lm_head.weight"]).argmax(-1)
        logits = torch.full((len(ids), 64), -torch.inf)
        logits[torch.arange(len(ids)), drafter.vocab[0][ids]] = 0.0
        return logits

    for p, prompt_ids in zip(report["drafters"][0]["prompts"], prompts):
        assert p["rounds"] == online_loop(target, draft_vocab, prompt_ids, N_NEW, 7)
        assert p["rounds"] == online_loop(target, masked, prompt_ids, N_NEW, 7)
        for budget in (8, 32):
            assert p["ddtree_rounds"][str(budget)] == online_loop(target, masked, prompt_ids, N_NEW, 7, budget)
    assert rounds_of(report, 0) != rounds_of(report, 1)


@torch.inference_mode()
def test_reduced_vocabulary_under_sampling(demo, reduced):
    """Sampled proposals: q of a reference token outside the draft vocabulary is 0; inside it is the drafter's
    sampling probability over the draft vocabulary (= the full logits with the rest masked)."""
    target, rows, prompts = demo
    drafter = ed.load_drafter(reduced["path"], target.config, drafter_settings())
    full = ed.load_drafter(os.path.join(DEMO, "drafter"), target.config, drafter_settings())
    full = ed.replace(full, rules=drafter.rules)   # speculators' window rule: only the vocabulary differs
    ids = prompts[0] + ed.plain_generate(target, prompts[0], N_NEW, set())
    x = ed.extract_hidden(target, ids, drafter.layers, len(prompts[0]))
    anchors = ed.fitting_anchors(len(prompts[0]), len(ids), drafter.block_size)
    ids_t = torch.tensor(ids)
    reference = ids_t[anchors[:, None] + torch.arange(1, drafter.block_size)]
    reference[::5, 0] = reduced["dropped"][0]   # some slots' token is outside the draft vocabulary
    sampling = (1.3, 0.95, 0)
    q = torch.zeros(reference.shape, dtype=torch.float64)
    ed.draft_all_anchors(drafter, ed.prompt_context(drafter, x.features), anchors, ids_t[anchors],
                         target.get_input_embeddings().weight, target.get_output_embeddings(), reference=reference,
                         sampling=sampling, proposal=q)
    block = torch.full((len(anchors), drafter.block_size), drafter.mask_token_id)
    block[:, 0] = ids_t[anchors]
    hidden = ed.drafter_forward(full, ed.prompt_context(full, x.features), anchors, block,
                                target.get_input_embeddings().weight)[:, 1:]
    logits = target.get_output_embeddings()(hidden).reshape(-1, 64)
    outside = torch.ones(64, dtype=torch.bool)
    outside[reduced["keep"]] = False
    want = ed.sampling_probs(logits.masked_fill(outside, -torch.inf), sampling)
    want = want.gather(1, reference.reshape(-1, 1))[:, 0].double().view(q.shape)
    assert (q[::5, 0] == 0).all() and q.sum() > 0
    assert torch.allclose(q, want, atol=1e-6)


def bad_vocab(tmp_path, name, change):
    cfg, weights = demo_drafter_files()
    head = load_file(os.path.join(DEMO, "target", "model.safetensors"))["lm_head.weight"]
    keep = list(range(4, 64))
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[keep] = True
    w = {**weights, "lm_head.weight": head[keep].clone(), "t2d": t2d, "d2t": torch.tensor(keep) - torch.arange(60)}
    top = {"draft_vocab_size": 60}
    change(w, top)
    return md.save_speculators(str(tmp_path / name), cfg, w, **top)


@pytest.mark.parametrize("name,change,fragment", [
    ("no_t2d", lambda w, t: w.pop("t2d"), "needs d2t, t2d and its own lm_head.weight; it has only d2t, lm_head.weight"),
    ("not_increasing", lambda w, t: w["d2t"].__setitem__(slice(0, 2), torch.tensor([5, 3])),
     "d + d2t[d] must be increasing target ids"),
    ("t2d_disagrees", lambda w, t: w["t2d"].__setitem__(0, True), "t2d marks 61 target tokens, not the 60"),
    ("size_disagrees", lambda w, t: t.update(draft_vocab_size=50), "draft_vocab_size is 50; all three must agree"),
    ("no_mapping", lambda w, t: [w.pop(k) for k in ("t2d", "d2t", "lm_head.weight")],
     "says draft_vocab_size 60 (the target has 64 tokens) but it carries no d2t / t2d"),
])
def test_inconsistent_vocabularies_are_one_line(tmp_path, capsys, name, change, fragment):
    path = bad_vocab(tmp_path, name, change)
    assert ed.main(["--demo", "--ckpt", path, "--quiet", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_carried_target_tensors_are_compared(tmp_path, capsys):
    """speculators may keep the verifier's embedding and head in the file: the target's own copies pass
    silently; another embedding is named in a warning, and the run goes on with the target's."""
    cfg, weights = demo_drafter_files()
    target = load_file(os.path.join(DEMO, "target", "model.safetensors"))
    same = md.save_speculators(str(tmp_path / "same"), cfg, {**weights, "embed_tokens.weight": target["model.embed_tokens.weight"],
                                                             "verifier_lm_head.weight": target["lm_head.weight"]})
    other = md.save_speculators(str(tmp_path / "other"), cfg, {**weights, "embed_tokens.weight":
                                                               target["model.embed_tokens.weight"] * 1.5})
    report = run(tmp_path, "r", "--demo", "--limit", "2", "--max-new-tokens", "24", "--ckpt", f"same={same}",
                 "--ckpt", f"other={other}", "--ddtree-budgets", "none")
    s, o = report["drafters"]
    assert s["warnings"] == [] and rounds_of(report, 0) == rounds_of(report, 1)
    assert len(o["warnings"]) == 1 and o["warnings"][0].startswith(
        "it carries embed_tokens.weight (64, 64), which is not the target's model.embed_tokens.weight")


@pytest.mark.parametrize("top,fragment", [
    ({"speculators_model_type": "mlp"}, "says speculators_model_type 'mlp'; this tool evaluates dflash, dflash2, dspark, xpress, eagle3 and peagle"),
    ({"speculators_model_type": "mtp"}, "'mtp': speculators 0.9.0 saves it, but neither vLLM 0.33 nor 0.34 reads"),
    ({"transformer_layer_config": None}, "has no transformer_layer_config"),
    ({"aux_hidden_state_layer_ids": [0, 2, 3]}, "aux_hidden_state_layer_ids [0, 2, 3]: they must be indices >= 1"),
    ({"mask_token_id": None}, "has no mask_token_id"),
    ({"confidence_head_alpha": 0.5}, "has the key 'confidence_head_alpha', which this tool cannot map"),
])
def test_speculators_configs_it_cannot_map_are_one_line(tmp_path, capsys, top, fragment):
    cfg, weights = demo_drafter_files()
    path = md.save_speculators(str(tmp_path / "d"), cfg, weights, **top)
    assert ed.main(["--demo", "--ckpt", path, "--quiet", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_a_nested_config_without_hidden_size_names_the_key(tmp_path, capsys):
    """Once refused as "hidden size None ... trained for another target"."""
    cfg, weights = demo_drafter_files()
    path = md.save_speculators(str(tmp_path / "d"), cfg, weights)
    spec = json.load(open(f"{path}/config.json"))
    del spec["transformer_layer_config"]["hidden_size"]
    json.dump(spec, open(f"{path}/config.json", "w"))
    assert ed.main(["--demo", "--ckpt", path, "--quiet", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(": its config has no hidden_size in transformer_layer_config"), err


# ----------------------------------------------------------------------------------------------------
# sample_from_anchor


@torch.inference_mode()
def test_sample_from_anchor_equals_an_online_loop(tmp_path, demo):
    """A drafter trained with sample_from_anchor (make_demo.py --from-anchor): block [anchor, mask x 7] of 8
    slots, slot k drafting the token after position a + k, 8 drafts a round (rounds up to 9)."""
    target, rows, prompts = demo
    drafter = ed.load_drafter(FROM_ANCHOR, target.config, drafter_settings())
    assert drafter.from_anchor and drafter.block_size == 9
    report = run(tmp_path, "r", *BASE, "--limit", "4", "--ckpt", f"anchor={FROM_ANCHOR}")
    d = report["drafters"][0]
    assert d["block_size"] == 8 and d["drafts_per_round"] == 8 and len(d["per_position"]["acceptance"]) == 8
    assert len(d["histogram"]) == 9 and d["histogram"][8] > 0   # full rounds: 8 drafts and the bonus

    def all_slots(seq):   # the block's 8 slots, the anchor's too
        return target.get_output_embeddings()(online_draft_hidden(target, drafter, seq, slots=8))

    for p, prompt_ids in zip(d["prompts"], prompts):
        assert p["rounds"] == online_loop(target, all_slots, prompt_ids, N_NEW, 8)
        assert p["ddtree_rounds"]["8"] == online_loop(target, all_slots, prompt_ids, N_NEW, 8, 8)
    assert d["tau"] > 4


# ----------------------------------------------------------------------------------------------------
# SpecForge


def training_state(path, weights, step=400, **resolved):
    """A rank-0 SpecForge training_state.pt as its CheckpointManager writes it (weights under draft_state_dict,
    counters, the resolved DFlash values, provenance tuples, an optimizer moment)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"draft_state_dict": {k: v.to(torch.bfloat16) for k, v in weights.items()}, "global_step": step,
                "epoch": 0, "epoch_batch": step, "strategy": "dflash", "run_id": "specforge-run", "world_size": 1,
                **{f"dflash_{k}": v for k, v in resolved.items()},
                "specforge_model_provenance": (("target", "demo"), ("draft", "dflash")),
                "replicated_optimizer_state": {"state": {0: {"exp_avg": torch.zeros(3)}}}}, path)
    return path


def bf16_public(out_dir):
    """The demo drafter with its weights rounded to bf16, as SpecForge saves them, in the public layout."""
    cfg, weights = demo_drafter_files()
    return save(out_dir, cfg, {k: v.to(torch.bfloat16) for k, v in weights.items()})


def test_training_state_with_drafter_config_equals_the_public_layout(tmp_path, capsys):
    cfg, weights = demo_drafter_files()
    public = bf16_public(tmp_path / "public")
    step = training_state(str(tmp_path / "run" / "specforge-run-step400" / "training_state.pt"), weights)
    report = run(tmp_path, "r", *BASE, "--limit", "5", "--ckpt", f"public={public}", "--ckpt", f"sf={os.path.dirname(step)}",
                 "--drafter-config", os.path.join(DEMO, "drafter", "config.json"))
    assert rounds_of(report, 1) == rounds_of(report, 0)
    # without a config the training state's own values fill in what the shapes cannot say
    report = run(tmp_path, "i", *BASE, "--limit", "2", "--ckpt", f"sf={step}", code=2)
    training_state(step, weights, target_layer_ids=(1, 3, 4), block_size=8, mask_token_id=2)
    capsys.readouterr()
    assert ed.main([*BASE, "--limit", "2", "--ckpt", f"sf={step}", "--output", str(tmp_path / "j.json")]) == 0
    err = capsys.readouterr().err
    assert "block size 8 (the training state), mask token id 2 (the training state), target layer ids [1, 3, 4] " \
           "(the training state)" in err
    assert json.load(open(tmp_path / "j.json"))["drafters"][0]["layers"] == [1, 3, 4]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A SpecForge run directory of two steps (the demo drafter, and at step 800 a copy with changed weights),
    its -latest and -best links, best_meta.json and a rank file."""
    root = tmp_path_factory.mktemp("run")
    cfg, weights = demo_drafter_files()
    g = torch.Generator().manual_seed(8)
    later = {k: (v + 0.1 * torch.randn(v.shape, generator=g) if k.startswith("layers.1.mlp") else v)
             for k, v in weights.items()}
    for step, w in ((400, weights), (800, later)):
        training_state(str(root / "run" / f"specforge-run-step{step}" / "training_state.pt"), w)
        torch.save({"rng": {"torch": torch.zeros(2)}}, root / "run" / f"specforge-run-step{step}" / "training_state_rank0.pt")
    os.symlink("specforge-run-step800", root / "run" / "specforge-run-latest")
    os.symlink("specforge-run-step400", root / "run" / "specforge-run-best")
    (root / "run" / "specforge-run.best_meta.json").write_text('{"step": 400}')
    shutil.copy(os.path.join(DEMO, "drafter", "config.json"), root / "run" / "config.json")
    return str(root / "run")


def test_a_training_run_is_a_series_of_drafters(tmp_path, run_dir, monkeypatch):
    """Every step from one target pass, each equal to its own single-checkpoint run; the steps wait on disk
    and are loaded for their turn."""
    calls = []
    extract = ed.extract_hidden
    monkeypatch.setattr(ed, "extract_hidden", lambda *a, **k: calls.append(1) or extract(*a, **k))
    series = run(tmp_path, "series", *BASE, "--limit", "4", "--ckpt", f"sf={run_dir}")
    assert len(calls) == 4   # one target pass per prompt for both steps
    one, two = series["drafters"]
    assert (one["name"], one["step"], one["series"]) == ("sf@400", 400, "sf") and two["step"] == 800
    assert one["checkpoint"].endswith("specforge-run-step400") and two["checkpoint"].endswith("specforge-run-step800")
    for d in (one, two):
        alone = run(tmp_path, f"s{d['step']}", *BASE, "--limit", "4", "--ckpt", d["checkpoint"])
        assert rounds_of(alone) == [(p["rounds"], p["ddtree_rounds"]) for p in d["prompts"]]
        assert alone["drafters"][0]["tau"] == d["tau"]
    assert rounds_of(series, 0) != rounds_of(series, 1)
    best = max((one, two), key=lambda d: d["tau"])["step"]
    assert series["comparison"]["best_steps"] == {"sf": best}
    picked = run(tmp_path, "last", *BASE, "--limit", "4", "--ckpt", f"sf={run_dir}", "--steps", "last:1")
    assert [d["step"] for d in picked["drafters"]] == [800] and picked["drafters"][0]["tau"] == two["tau"]
    picked = run(tmp_path, "some", *BASE, "--limit", "4", "--ckpt", f"sf={run_dir}", "--steps", "400")
    assert [d["step"] for d in picked["drafters"]] == [400]


def test_series_steps_wait_on_disk(tmp_path, run_dir, monkeypatch):
    """Only the first step stays loaded; the others are read for each group of prompts and let go."""
    loads = []
    real = ed.load_drafter
    monkeypatch.setattr(ed, "load_drafter", lambda spec, *a, **k: loads.append((spec, k.get("identify", True)))
                        or real(spec, *a, **k))
    run(tmp_path, "series", *BASE, "--limit", "3", "--ckpt", f"sf={run_dir}")
    assert [identify for _, identify in loads] == [True, True, False]   # step 800 again, for the one group
    monkeypatch.setattr(ed, "FEATURES_PER_GROUP", 1)   # a group per prompt: step 800 read for each
    loads.clear()
    run(tmp_path, "small", *BASE, "--limit", "3", "--ckpt", f"sf={run_dir}")
    assert [identify for _, identify in loads] == [True, True, False, False, False]


def test_series_from_saved_features_shards_and_resume(tmp_path, run_dir, monkeypatch):
    """--load-hidden serves a run's steps; shards of a series merge into the single run; a series interrupted
    in its middle resumes to the same report."""
    argv = [*BASE, "--limit", "5", "--ckpt", f"sf={run_dir}"]
    whole = run(tmp_path, "whole", *argv, "--save-hidden", str(tmp_path / "h.safetensors"))
    loaded = run(tmp_path, "loaded", "--target", os.path.join(DEMO, "target"), "--ckpt", f"sf={run_dir}",
                 "--ddtree-budgets", "8,32", "--load-hidden", str(tmp_path / "h.safetensors"))
    assert loaded["drafters"] == whole["drafters"]
    for k in (1, 2):
        run(tmp_path, f"s{k}", *argv, "--shard", f"{k}/2")
    merged = run(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert merged["drafters"] == whole["drafters"] and merged["comparison"] == whole["comparison"]
    monkeypatch.setattr(ed, "FEATURES_PER_GROUP", 1)
    real, _ = interrupt_at(monkeypatch, "evaluate_prompts", 3)
    cut = run(tmp_path, "cut", *argv, code=130)
    assert len(cut["drafters"][0]["prompts"]) == 2
    monkeypatch.setattr(ed, "evaluate_prompts", real)
    assert run(tmp_path, "cut", *argv, "--resume")["drafters"] == whole["drafters"]


def test_steps_flag_refusals(tmp_path, run_dir, capsys):
    for argv, fragment in (
            (["--steps", "1200", "--ckpt", f"sf={run_dir}"], "--steps 1200: "),
            (["--steps", "last:0", "--ckpt", f"sf={run_dir}"], "--steps takes all, last:N"),
            (["--steps", "400"], "--steps picks steps of a training run's directory, and no --ckpt is one")):
        assert ed.main(["--demo", "--quiet", "--limit", "1", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err


def test_specforge_export_of_another_family_is_named(tmp_path, capsys):
    """A DSpark export whose config asks for a Markov head its weights lack: recognized as DSpark, and the missing
    head tensor named in one line."""
    cfg, weights = demo_drafter_files()
    cfg["architectures"] = ["DSparkDraftModel"]
    cfg["dflash_config"].update(projector_type="dspark", markov_rank=8)
    path = save(tmp_path / "dspark", cfg, weights)
    assert ed.main(["--demo", "--ckpt", path, "--quiet", "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not match a DSpark drafter of its config: 2 missing (markov_head.markov_w1.weight" \
        in err[0], err
