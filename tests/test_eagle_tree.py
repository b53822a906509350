"""EAGLE-3 token trees as SGLang 0.5.23 builds and verifies them (--eagle-tree STEPS,TOPK,TOKENS): the tool's tree
rounds equal an online loop written from SGLang's EAGLE worker, round by round, greedy and sampled.

The online loop drafts one round at a time from the drafter's weights, naively (test_eagle3's OnlineEagle: one row at
a time, its own KV cache): the anchor row's top-k by softmax probability; then steps - 1 passes over k branches, each
branch j attending to the context and to the rows branch j held at the earlier steps (SGLang indexes its draft KV
slots by branch, not by parent); each branch's k children scored by the product of probabilities down the path, the
k best of the k * k kept as the next branches (their parent's hidden fed on); the tokens - 1 best-scored candidates
form the tree. Verification walks from the anchor to the child holding the target's token (greedy: its argmax;
sampled: a sample of the target's distribution, SGLang's target-only rule), with a fresh target pass per node.
"""
import json
import os

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, interrupted_then_resumed, refused_in_one_line, write_jsonl
from drafters import DEMO, demo_pair, run_refs, run_tool
from test_eagle3 import EAGLE, OnlineEagle, rms
from test_sampled import sampling_argv

N_NEW = 48
N_PROMPTS = 5


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


def tree_proposer(target, drafter, steps, topk, tokens, by_parent=False):
    """SGLang's tree round (module docstring): propose(seq) -> (node tokens, parents: -1 the anchor, else a node's
    place, -2 a node whose parent was not kept). by_parent: each branch attends to its own ancestors' rows instead
    (what SGLang does not do: the check that the difference shows)."""
    fc, e, done = drafter.weights["fc.weight"].float(), OnlineEagle(drafter, target), [0]

    def top(h):
        return e.logits(h).float().softmax(-1).topk(topk)

    def fed(h):
        return rms(h, e.w["norm.weight"]) if drafter.head["norm_output"] else h

    @torch.no_grad()
    def propose(seq):
        hs = target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[L + 1][0] for L in sorted(drafter.layers)], -1)
        for j in range(done[0], len(seq) - 1):
            h = e.layer(seq[j + 1], fc @ feats[j], j)
        done[0] = len(seq) - 1
        probs, ids = top(h)
        cands = [(probs[j], int(ids[j]), -1) for j in range(topk)]   # (score, token, parent candidate)
        frontier = [(j, fed(h)) for j in range(topk)]   # branch j: (its candidate, the hidden fed to it)
        slot_rows, path_rows = [[] for _ in range(topk)], {}
        for i in range(steps - 1):
            outs = []
            for j, (c, g) in enumerate(frontier):
                rows = list(path_rows.get(cands[c][2], [])) if by_parent else slot_rows[j]
                outs.append(e.layer(cands[c][1], g, len(seq) - 1 + i, rows))
                path_rows[c] = rows
            children = []
            for j, out in enumerate(outs):
                p, t = top(out)
                children += [(cands[frontier[j][0]][0] * p[r], int(t[r]), frontier[j][0], j) for r in range(topk)]
            base = len(cands)
            cands += [child[:3] for child in children]
            best = sorted(range(len(children)), key=lambda x: -float(children[x][0]))[:topk]
            frontier = [(base + x, fed(outs[children[x][3]])) for x in best]
        kept = sorted(sorted(range(len(cands)), key=lambda c: -float(cands[c][0]))[:tokens - 1])
        place = {c: j for j, c in enumerate(kept)}
        return [cands[c][1] for c in kept], [-1 if cands[c][2] == -1 else place.get(cands[c][2], -2) for c in kept]
    return propose


def child(tokens, parents, at, token):
    """The node under `at` (-1: the anchor) holding `token`, else None."""
    return next((j for j, (t, p) in enumerate(zip(tokens, parents)) if p == at and t == token), None)


@torch.no_grad()
def online_tree_rounds(target, propose, prompt_ids, n_new, steps):
    """Greedy: each round a tree, then from the anchor the child holding the target's argmax, one target pass per
    node, until none does; until the next round's deepest path would pass n_new tokens."""
    seq = list(prompt_ids)
    seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    rounds = []
    while len(seq) - len(prompt_ids) + steps <= n_new:
        tokens, parents = propose(seq)
        at, path = -1, []
        while True:
            token = int(target(torch.tensor([seq + path])).logits[0, -1].argmax())
            at = child(tokens, parents, at, token)
            if at is None:
                break
            path.append(token)
        seq += path + [token]
        rounds.append(len(path) + 1)
    return rounds


def tree_run(tmp_path, name, *argv):
    return run_tool(tmp_path, name, "--demo", "--ckpt", f"e={EAGLE}", "--max-new-tokens", str(N_NEW), "--ignore-eos",
                    "--limit", str(N_PROMPTS), *argv)


@pytest.mark.parametrize("shape", [(5, 4, 8), (4, 3, 10)])
def test_tree_rounds_equal_an_online_sglang_loop(tmp_path, demo, shape):
    target, _, prompts = demo
    steps, topk, tokens = shape
    report = tree_run(tmp_path, "t", "--eagle-tree", ",".join(map(str, shape)))
    d = report["drafters"][0]
    assert {k: d["eagle_tree"][k] for k in ("steps", "topk", "tokens", "source")} == \
        {"steps": steps, "topk": topk, "tokens": tokens, "source": "--eagle-tree"}
    drafter = ed.load_drafter(EAGLE, target.config, drafter_settings())
    online = [online_tree_rounds(target, tree_proposer(target, drafter, *shape), ids, N_NEW, steps)
              for ids in prompts[:N_PROMPTS]]
    assert [p["eagle_tree_rounds"] for p in d["prompts"]] == online
    flat = [r for rr in online for r in rr]
    assert len(set(flat)) >= 3 and max(flat) == steps + 1   # rounds vary, some reach the whole depth: it has teeth
    chain = [p["rounds"] for p in d["prompts"]]
    assert sum(map(sum, online)) / sum(map(len, online)) > sum(map(sum, chain)) / sum(map(len, chain))
    s = d["eagle_tree"]
    assert s["tau"] == pytest.approx(sum(map(sum, online)) / sum(map(len, online)))
    assert s["histogram"] == [flat.count(k) for k in range(1, steps + 2)]
    assert s["engine_metrics"]["sglang"]["accept_rate"] == \
        pytest.approx(sum(r - 1 for r in flat) / (len(flat) * (tokens - 1)))
    assert "vllm" not in s["engine_metrics"]


def test_trees_equal_sglangs_at_every_anchor_and_the_branch_slots_matter(demo):
    """The tool's trees at every anchor equal the online proposer's; with each branch attending to its real
    ancestors instead (not what SGLang does) some trees differ: the slot rule is checked, not assumed."""
    target, _, prompts = demo
    shape = (5, 4, 12)
    drafter = ed.load_drafter(EAGLE, target.config, drafter_settings(eagle_tree=shape))
    embed_w, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    compared, differ = 0, 0
    with torch.inference_mode():
        for ids in prompts[:3]:
            seq = greedy_text(target, ids, 24)
            hs = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
            context = ed.prompt_context(drafter, {L: hs[L + 1][0] for L in drafter.layers}, seq, embed_w)
            anchors = torch.arange(len(ids), len(seq))
            tokens, parents = ed.eagle_trees(drafter, context, anchors, None, embed_w, head, "p")
            for a, t, p in zip(anchors.tolist(), tokens.tolist(), parents.tolist()):
                want = tree_proposer(target, drafter, *shape)(seq[:a + 1])
                assert (t, p) == want
                differ += want != tree_proposer(target, drafter, *shape, by_parent=True)(seq[:a + 1])
                compared += 1
    assert compared >= 60 and differ > 0


@torch.no_grad()
def greedy_text(target, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq


@torch.no_grad()
def sampled_tree_runs(target, prompts, sampling, runs, n_new, shape, drafter, seed):
    """SGLang's sampled verify of a tree (target-only): at each node a token drawn from the target's distribution
    at `sampling`; the child holding it is accepted, else that token ends the round. [(prompt index, the first n_new
    completion tokens, the rounds whose deepest path lies inside them, as the tool counts rounds)]."""
    out = []
    for i in range(runs):
        g, ids = torch.Generator().manual_seed(seed + i), prompts[i % len(prompts)]
        propose, seq, rounds = tree_proposer(target, drafter, *shape), list(ids), []

        def draw(tokens):
            p = ed.sampling_probs(target(torch.tensor([tokens])).logits[0, -1:], sampling).double()[0]
            return int(torch.multinomial(p, 1, generator=g))
        seq.append(draw(seq))
        while len(seq) - len(ids) < n_new + shape[0]:
            tokens, parents = propose(seq)
            at, path = -1, []
            while True:
                token = draw(seq + path)
                at = child(tokens, parents, at, token)
                if at is None:
                    break
                path.append(token)
            seq += path + [token]
            rounds.append(len(path) + 1)
        counted, at = [], 0
        for length in rounds:
            if at + shape[0] > n_new - 1:
                break
            counted.append(length)
            at += length
        out.append((i % len(prompts), seq[len(ids):len(ids) + n_new], counted))
    return out


def test_sampled_tree_rounds_equal_sglangs_target_only_verify(tmp_path, demo):
    """Under sampling SGLang verifies a tree against the target's own samples, so given the text the walk is fixed:
    the tool's tree rounds on each sampled run's text equal that run's, round by round."""
    target, rows, prompts = demo
    shape, sampling = (4, 3, 8), (0.9, 1.0, 0)
    drafter = ed.load_drafter(EAGLE, target.config, drafter_settings())
    runs = sampled_tree_runs(target, prompts, sampling, 40, 32, shape, drafter, seed=500)
    refs = run_refs(rows, runs)
    report = run_tool(tmp_path, "sampled", "--target", os.path.join(DEMO, "target"), "--ckpt", f"e={EAGLE}",
                      "--eagle-tree", "4,3,8", "--prompts", write_jsonl(tmp_path / "refs.jsonl", refs),
                      *sampling_argv(sampling))
    got = [p["eagle_tree_rounds"] for p in report["drafters"][0]["prompts"]]
    assert got == [rounds for _, _, rounds in runs]
    flat = [r for rr in got for r in rr]
    assert len(set(flat)) >= 3 and report["drafters"][0]["eagle_tree"]["rounds"] == len(flat)


# ----------------------------------------------------------------------------------------------------
# Its shapes: SGLang's default by the target's architecture, a chain as a tree, the refusals


def test_the_default_is_what_sglang_picks_for_the_target(demo, capsys):
    target = demo[0]
    llama = type(target.config)(**{**target.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    d = ed.load_drafter(EAGLE, llama, drafter_settings(eagle_tree="auto"))
    assert d.tree == {"steps": 5, "topk": 4, "tokens": 8, "source": "SGLang's default for LlamaForCausalLM targets"}
    d = ed.load_drafter(EAGLE, target.config, drafter_settings(eagle_tree="auto", quiet=False))
    assert d.tree is None and target.config.architectures[0] not in ed.SGLANG_TREE_TARGETS
    assert f"SGLang serves it as a chain of 3 drafts (SGLang's default for {target.config.architectures[0]} " \
           "targets; --eagle-tree for a tree)" in capsys.readouterr().err
    assert ed.load_drafter(EAGLE, llama, drafter_settings(eagle_tree=None)).tree is None


def test_a_top_1_tree_is_the_chain(tmp_path):
    """SGLang's chain (top-k 1, its draft tokens set to steps + 1) walks as the tool's chain of that depth."""
    report = tree_run(tmp_path, "c", "--eagle-tree", "3,1,9", "--block-size", "4")
    d = report["drafters"][0]
    assert d["eagle_tree"]["tokens"] == 4
    assert [p["eagle_tree_rounds"] for p in d["prompts"]] == [p["rounds"] for p in d["prompts"]]
    assert d["eagle_tree"]["tau"] == d["tau"] and len({r for p in d["prompts"] for r in p["rounds"]}) >= 2


@pytest.mark.parametrize("value,fragment", [
    ("5,4", "--eagle-tree takes STEPS,TOPK,TOKENS"), ("5,0,8", "--eagle-tree takes STEPS,TOPK,TOKENS"),
    ("5,4,1", "TOKENS at least 2"), ("tree", "--eagle-tree takes STEPS,TOPK,TOKENS"),
    ("2,2,8", "2 steps of top-2 give 6 candidate nodes, fewer than the 7 draft nodes asked")])
def test_a_bad_shape_is_refused_in_one_line(capsys, value, fragment):
    refused_in_one_line(capsys, ["--demo", "--ckpt", f"e={EAGLE}", "--eagle-tree", value, "--limit", "1"], fragment)


# ----------------------------------------------------------------------------------------------------
# Every promise: walk mode, saved features, shards, an interruption inside the tree


ARGV = ("--demo", "--ckpt", f"e={EAGLE}", "--eagle-tree", "4,3,8", "--max-new-tokens", "40", "--ignore-eos",
        "--limit", "4")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return run_tool(tmp_path_factory.mktemp("whole"), "whole", *ARGV)


def results(report):
    return [{k: v for k, v in d.items() if k != "checkpoint"} for d in report["drafters"]]


def test_walk_mode_saved_features_and_shards_give_the_same_trees(tmp_path, whole):
    assert {len(p["eagle_tree_rounds"]) for p in whole["drafters"][0]["prompts"]} != {0}
    walked = run_tool(tmp_path, "walk", *ARGV, "--anchors", "walk")["drafters"][0]
    assert walked["eagle_tree"] == whole["drafters"][0]["eagle_tree"]
    assert [p["eagle_tree_rounds"] for p in walked["prompts"]] == \
        [p["eagle_tree_rounds"] for p in whole["drafters"][0]["prompts"]]
    saved = tmp_path / "h.safetensors"
    assert results(run_tool(tmp_path, "save", *ARGV, "--save-hidden", str(saved))) == results(whole)
    argv = [a for a in ARGV if a not in ("--max-new-tokens", "40", "--ignore-eos")]
    assert results(run_tool(tmp_path, "load", *argv, "--load-hidden", str(saved))) == results(whole)
    for k in (1, 2):
        run_tool(tmp_path, f"s{k}", *ARGV, "--shard", f"{k}/2")
    merged = run_tool(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert results(merged) == results(whole)


def test_an_interruption_inside_the_tree_loses_nothing(tmp_path, monkeypatch, whole):
    out = tmp_path / "cut.json"   # the third prompt's trees (one eagle_trees call a prompt at these lengths)
    argv = [*ARGV, "--quiet", "--output", str(out)]
    assert results(interrupted_then_resumed(monkeypatch, argv, out, "eagle_trees", 3, 2)) == results(whole)


def test_the_predicted_speedup_prices_the_trees_draft_tokens(tmp_path, whole, capsys):
    """--costs measure times a verify pass over the tree's draft tokens and the drafter's tree; its row uses both."""
    report = run_tool(tmp_path, "costs", *ARGV, "--costs", "measure")
    costs, d = report["config"]["costs_used"], report["drafters"][0]
    row = d["predicted_speedup"]["1"]["rows"]["SGLang tree 4,3,8"]
    assert row["tau"] == d["eagle_tree"]["tau"] == whole["drafters"][0]["eagle_tree"]["tau"]
    assert row["target_s"] == costs["target"]["8"] and row["draft_s"] == costs["draft"]["e"]["tree"] > 0
    assert row["speedup"] == pytest.approx(row["tau"] * costs["target"]["1"] / (row["target_s"] + row["draft_s"]))
    assert "SGLang (--speculative-num-steps 4 --speculative-eagle-topk 3 --speculative-num-draft-tokens 8): accept " \
           "len" in capsys.readouterr().out


def test_a_watched_run_has_the_tree_in_each_steps_line(tmp_path, whole):
    """--watch over EAGLE-3 steps from saved features: each step's line holds the tree's figures, as the single
    checkpoint's report does."""
    import shutil
    from safetensors.torch import load_file, save_file
    hidden = str(tmp_path / "h.safetensors")
    run_tool(tmp_path, "save", *ARGV, "--save-hidden", hidden)
    run = tmp_path / "run"
    for step, scale in ((100, 0.3), (200, 1.0)):   # two steps that draft differently
        path = run / f"checkpoint-{step}"
        path.mkdir(parents=True)
        shutil.copy(os.path.join(EAGLE, "config.json"), path)
        state = load_file(os.path.join(EAGLE, "model.safetensors"))
        save_file({k: v * scale if k == "layers.0.mlp.down_proj.weight" else v for k, v in state.items()},
                  str(path / "model.safetensors"))
    out = str(tmp_path / "series.jsonl")
    flags = ["--eagle-tree", "4,3,8", "--quiet"]
    target = os.path.join(DEMO, "target")
    assert ed.main(["--target", target, "--load-hidden", hidden, "--watch", f"w={run}", "--output", out,
                    "--watch-interval", "0.05", "--watch-until", "200", *flags]) == 0
    with open(out) as f:
        lines = [json.loads(line) for line in f][1:]
    assert [line["step"] for line in lines] == [100, 200]
    for line in lines:
        single = run_tool(tmp_path, f"single{line['step']}", "--target", target, "--ckpt",
                          f"w={run / ('checkpoint-%d' % line['step'])}", "--load-hidden", hidden, *flags)
        assert line["eagle_tree"] == single["drafters"][0]["eagle_tree"]
    assert lines[1]["eagle_tree"] == whole["drafters"][0]["eagle_tree"]
    assert lines[0]["eagle_tree"]["histogram"] != lines[1]["eagle_tree"]["histogram"]


def test_side_by_side_and_tensorboard_carry_the_tree(tmp_path, whole):
    report = run_tool(tmp_path, "two", *ARGV, "--ckpt", f"d={os.path.join(DEMO, 'drafter')}")
    e, d = report["comparison"]["drafters"]
    assert e["eagle_tree"] == report["drafters"][0]["eagle_tree"]["tau"] == whole["drafters"][0]["eagle_tree"]["tau"]
    assert "eagle_tree" not in d and "eagle_tree" not in report["drafters"][1]
    assert ed.board_scalars(report["drafters"][0])["eagle_tree_tau"] == e["eagle_tree"]


# ----------------------------------------------------------------------------------------------------
# A Llama target, where SGLang's default is the tree (tests/fixtures/llama: make_demo.py --llama)


LLAMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "llama")


@pytest.fixture(scope="module")
def llama():
    return demo_pair(os.path.join(LLAMA, "target"))


def llama_run(tmp_path, name, *argv):
    return run_tool(tmp_path, name, "--target", os.path.join(LLAMA, "target"), "--ckpt",
                    f"e={os.path.join(LLAMA, 'eagle3')}", "--prompts", os.path.join(DEMO, "prompts.jsonl"), *argv)


def test_on_a_llama_target_the_default_tree_equals_an_online_sglang_loop(tmp_path, llama):
    target, _, prompts = llama
    assert target.config.architectures == ["LlamaForCausalLM"]
    report = llama_run(tmp_path, "llama", "--max-new-tokens", str(N_NEW), "--ignore-eos", "--limit", str(N_PROMPTS))
    d = report["drafters"][0]
    assert {k: d["eagle_tree"][k] for k in ("steps", "topk", "tokens", "source")} == \
        {"steps": 5, "topk": 4, "tokens": 8, "source": "SGLang's default for LlamaForCausalLM targets"}
    drafter = ed.load_drafter(os.path.join(LLAMA, "eagle3"), target.config, drafter_settings())
    online = [online_tree_rounds(target, tree_proposer(target, drafter, 5, 4, 8), ids, N_NEW, 5)
              for ids in prompts[:N_PROMPTS]]
    assert [p["eagle_tree_rounds"] for p in d["prompts"]] == online
    flat = [r for rr in online for r in rr]
    assert len(set(flat)) >= 3 and max(flat) == 6
    assert d["eagle_tree"]["tau"] > d["tau"]   # the tree accepts more than the chain of 3 it is served beside


def test_on_a_llama_target_sampled_trees_match_sglangs_loop_over_150_runs(tmp_path, llama):
    """150 runs of SGLang's sampled tree verify: the tool's tree rounds on each run's text equal that run's (given
    the text the walk is fixed), so the expectation is within 3 standard errors, with none to spare."""
    target, rows_, prompts = llama
    shape, sampling = (5, 4, 8), (1.0, 1.0, 0)
    drafter = ed.load_drafter(os.path.join(LLAMA, "eagle3"), target.config, drafter_settings())
    runs = sampled_tree_runs(target, prompts, sampling, 150, 24, shape, drafter, seed=800)
    refs = run_refs(rows_, runs)
    report = run_tool(tmp_path, "sampled", "--target", os.path.join(LLAMA, "target"), "--ckpt",
                      f"e={os.path.join(LLAMA, 'eagle3')}", "--prompts", write_jsonl(tmp_path / "refs.jsonl", refs),
                      *sampling_argv(sampling))
    got = [p["eagle_tree_rounds"] for p in report["drafters"][0]["prompts"]]
    assert got == [rounds for _, _, rounds in runs]
    taus = [sum(r) / len(r) for r in got if r]
    assert len(taus) == 150 and len(set(taus)) > 10   # the runs vary
