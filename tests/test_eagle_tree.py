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
from drafters import DEMO, demo_pair, run_tool
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
