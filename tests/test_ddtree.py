"""DDTree: the best-first tree against brute force, the offline tree walk by hand and against an online loop.

The online loop mirrors test_exactness.py: each round it runs the target over the committed tokens, drafts
ONE block, builds the tree from that block's top-k log-probs, and verifies every root-to-leaf path of the
tree with the target itself (no reference is used), committing the deepest accepted node plus the target's
bonus token.
"""
import contextlib
import io
import itertools
import json
import os

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, online_draft_logits, write_jsonl

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "demo")
N_NEW = 40
N_PROMPTS = 7   # 5 "train" prompts and 2 "fresh" ones: two splits
BUDGETS = (4, 8, 32)


# ----------------------------------------------------------------------------------------------------
# 1. build_tree against brute force


def path_score(logp, path):
    s = 0.0
    for d, r in enumerate(path):
        s += logp[d][r]
    return s


def brute_force_tree(logp, budget):
    """All rank paths, best (score, then lexicographically smaller path) first, kept if the parent is kept.

    With log-probs <= 0 sorted high to low, a node's parent and its previous sibling both score >= the node
    and are lexicographically smaller, so they come earlier in this order: the parent filter never drops a
    path, the order is a valid growth order, and best-first (which always pops the best candidate, and the
    next path of this order is always a candidate once all earlier ones joined) yields exactly this order.
    """
    depth, width = len(logp), len(logp[0])
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    taken, order = set(), []
    for p in sorted(paths, key=lambda p: (-path_score(logp, p), p)):
        if len(order) == budget:
            break
        if len(p) == 1 or p[:-1] in taken:
            taken.add(p)
            order.append(p)
    return order


def random_logp(seed, depth, width, vocab=11, ties=False):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct integer logits: many exactly equal log-probs and path scores
        logits = torch.randint(0, 3, (depth, vocab), generator=g).float()
    else:
        logits = torch.randn(depth, vocab, generator=g) * 2
    return logits.float().log_softmax(-1).topk(width, dim=-1).values.tolist()


def logp_cases():
    cases = []
    for seed in range(4):
        for depth, width in ((1, 5), (2, 4), (3, 3), (4, 2), (4, 3)):
            cases.append((f"rand{seed}-{depth}x{width}", random_logp(seed, depth, width)))
            cases.append((f"ties{seed}-{depth}x{width}", random_logp(seed, depth, width, ties=True)))
    cases.append(("uniform-3x4", [[-1.3862943611198906] * 4 for _ in range(3)]))
    cases.append(("ints-3x3", [[-1.0, -1.0, -2.0], [-1.0, -2.0, -2.0], [-0.0, -1.0, -1.0]]))
    return cases


@pytest.mark.parametrize("name,logp", logp_cases(), ids=[c[0] for c in logp_cases()])
def test_build_tree_equals_brute_force(name, logp):
    depth, width = len(logp), len(logp[0])
    n_nodes = sum(width ** d for d in range(1, depth + 1))
    for budget in sorted({1, 2, 3, 5, 8, n_nodes - 1, n_nodes, n_nodes + 7} - {0}):
        got = ed.build_tree(logp, budget)
        want = brute_force_tree(logp, budget)
        assert set(got) == set(want), f"budget {budget}"
        assert got == want, f"budget {budget}: joining order"
        assert len(got) == min(budget, n_nodes)


def test_build_tree_ties_by_hand():
    # every node at depth d scores -d: breadth first, lexicographic within a depth
    logp = [[-1.0, -1.0], [-1.0, -1.0]]
    assert ed.build_tree(logp, 10) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    # (0, 0) and (1,) both score -2, (0, 1) and (1, 0) both -3: the smaller path joins first
    logp = [[-1.0, -2.0], [-1.0, -2.0]]
    assert ed.build_tree(logp, 10) == [(0,), (0, 0), (1,), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("seed", range(3))
def test_build_tree_until_stops_early(seed):
    for ties in (False, True):
        logp = random_logp(seed, 4, 3, ties=ties)
        full = ed.build_tree(logp, 60)
        for i, node in enumerate(full):
            assert ed.build_tree(logp, 60, until=node) == full[:i + 1]
        # `until` not joining within the budget: the whole budget's tree
        assert ed.build_tree(logp, 10, until=full[30]) == full[:10]


# ----------------------------------------------------------------------------------------------------
# 2. ddtree_walks / score_prompt on hand-made top-k arrays


def hand_top(spec, reference):
    """spec[i][d] = (rank of the reference token or None, [log-probs by rank]) -> (top_logp, top_ids)."""
    n, depth, width = len(spec), len(spec[0]), len(spec[0][0][1])
    logp = torch.zeros(n, depth, width)
    ids = torch.zeros(n, depth, width, dtype=torch.long)
    filler = iter(range(1000, 10 ** 6))
    for i in range(n):
        for d in range(depth):
            rank, lp = spec[i][d]
            logp[i, d] = torch.tensor(lp)
            for r in range(width):
                ids[i, d, r] = int(reference[i][d]) if r == rank else next(filler)
    return logp, ids


def test_ddtree_walk_by_hand():
    B, n_prompt = 4, 2
    ids = [100, 101] + list(range(10, 18))         # 8 completion tokens: anchors 2..6 fit
    anchors = ed.fitting_anchors(n_prompt, len(ids), B)
    assert anchors.tolist() == [2, 3, 4, 5, 6]
    reference = torch.tensor(ids)[anchors[:, None] + torch.arange(1, B)]
    low = [-5.0, -6.0]
    spec = [
        # anchor 2: reference is rank 1 at depth 1, rank 0 at depth 2, absent at depth 3.
        # Joining order: (0,) (1,) (0,0) (0,0,0) (0,0,1) (1,0) ... -> acceptance 1 | 2 for budget 2..5 | 3 from 6
        [(1, [-0.5, -1.0]), (0, [-2.0, -3.0]), (None, [-0.1, -0.2])],
        # anchor 3: rank 0 at depth 1, absent at depth 2 -> acceptance 2 for any budget
        [(0, [-0.1, -4.0]), (None, low), (None, low)],
        # anchor 4: the greedy path (0,0,0) joins first -> acceptance 2, 3, then 4 from budget 3
        [(0, [-0.1, -5.0]), (0, [-0.1, -5.0]), (0, [-0.1, -5.0])],
        # anchor 5: reference absent at depth 1 -> acceptance 1
        [(None, [-0.1, -0.2]), (None, low), (None, low)],
        # anchor 6: reference path (0,1,0). (0,0) and (0,1) tie at -1.1; (0,0,0) and (0,1,0) tie at -1.6 and
        # the smaller path (0,0,0) joins first: order (0,) (0,0) (0,1) (0,0,0) (0,1,0) -> 2, 2, 3, 3, then 4
        [(0, [-0.1, -5.0]), (1, [-1.0, -1.0]), (0, [-0.5, -2.0])],
    ]
    top = hand_top(spec, reference)
    drafts = top[1][..., 0]                          # the chain's greedy drafts are the rank-0 tokens
    res = ed.score_prompt(drafts, ids, n_prompt, B, top, budgets=(1, 2, 3, 4, 5, 6))
    # chain: acceptance per anchor 1, 2, 4, 1, 2 -> anchors 2, 3, 5, 6
    assert res.rounds == [1, 2, 1, 2]
    assert res.ddtree_rounds == {
        1: [1, 2, 1, 2],   # acceptance 1,2,2,1,2: anchors 2, 3, 5, 6
        2: [2, 3],         # anchors 2 (acc 2), 4 (acc 3); next anchor 7 does not fit
        3: [2, 4],         # anchors 2, 4 (acc 4 from budget 3)
        4: [2, 4],
        5: [2, 4],
        6: [3, 1, 4],      # anchors 2 (acc 3), 5 (acc 1), 6 (acc 4 from budget 5)
    }
    # a subset of the budgets gives the same walks, and no budgets -> no DDTree
    assert ed.score_prompt(drafts, ids, n_prompt, B, top, [4, 6]).ddtree_rounds == {4: [2, 4], 6: [3, 1, 4]}
    assert ed.score_prompt(drafts, ids, n_prompt, B, None, []).ddtree_rounds == {}


def test_walk_rule():
    assert ed.walk(lambda a: 1, 0, 10, 4) == ([1] * 7, None)  # anchors 0..6: 6 + 3 <= 9
    assert ed.walk(lambda a: 3, 5, 12, 4) == ([3, 3], None)   # anchors 5, 8; 11 + 3 > 11
    assert ed.walk(lambda a: 2, 5, 8, 4) == ([], None)        # 5 + 3 > 7


def test_walk_pauses_at_an_undrafted_anchor_and_resumes():
    """--anchors walk advances each walk only as far as drafted blocks go; resuming gives the one-go rounds."""
    drafted = {0: 2, 2: 1, 3: 3}
    paused = ed.walk(lambda a: drafted.get(a), 0, 20, 4)
    assert paused == ([2, 1, 3], 6)
    drafted.update({6: 4, 10: 1, 11: 2, 13: 4})
    assert ed.walk(lambda a: drafted.get(a), 6, 20, 4, paused[0]) == ([2, 1, 3, 4, 1, 2, 4], None)
    assert ed.walk(lambda a: drafted.get(a), 0, 20, 4) == ([2, 1, 3, 4, 1, 2, 4], None)


def test_parse_budgets():
    assert ed.parse_budgets("32,8,8, 128") == [8, 32, 128]
    assert ed.parse_budgets(" None ") == []


# ----------------------------------------------------------------------------------------------------
# 3. Offline DDTree rounds equal an online tree-verification loop on the demo pair


@pytest.fixture(scope="module")
def demo_target():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def demo_prompts():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    rows = [json.loads(line) for line in open(os.path.join(DEMO, "prompts.jsonl"))][:N_PROMPTS]
    return [tok(row["prompt"])["input_ids"] for row in rows]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddtree") / "out.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = ed.main(["--demo", "--ddtree-budgets", ",".join(map(str, BUDGETS)), "--max-new-tokens",
                        str(N_NEW), "--ignore-eos", "--limit", str(N_PROMPTS), "--quiet", "--output", str(out)])
    assert code == 0
    return json.loads(out.read_text()), stdout.getvalue()


@torch.inference_mode()
def online_ddtree_rounds(target, drafter, prompt_ids, n_new, budget):
    B = drafter.block_size
    seq = list(prompt_ids)
    seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))  # first token: the target's prefill
    rounds = []
    while (len(seq) - len(prompt_ids)) + B - 1 <= n_new:
        anchor = len(seq) - 1
        top = online_draft_logits(target, drafter, seq).float().log_softmax(-1).topk(budget, dim=-1)
        tree = ed.build_tree(top.values.tolist(), budget)
        assert len(tree) == budget
        token = top.indices.tolist()
        parents = {p[:-1] for p in tree}
        best = None                                   # (depth, path tokens, bonus)
        for leaf in (p for p in tree if p not in parents):
            toks = [token[d][r] for d, r in enumerate(leaf)]
            greedy = target(torch.tensor([seq + toks])).logits[0, anchor:anchor + len(toks) + 1].argmax(-1).tolist()
            depth = 0
            while depth < len(toks) and toks[depth] == greedy[depth]:
                depth += 1
            if best is None or depth > best[0]:
                best = (depth, toks[:depth], greedy[depth])
        seq += best[1] + [best[2]]
        rounds.append(best[0] + 1)
    return rounds, seq


def round_anchors(rounds):
    """{anchor offset from the first completion token: acceptance} of a walk's rounds."""
    return dict(zip(itertools.accumulate([0] + rounds[:-1]), rounds))


def compare_online(target, drafter, prompts, tool_prompts, n_new):
    """Assert the tool's DDTree rounds equal the online loop's; return how many tree rounds beat the chain."""
    assert len(tool_prompts) == len(prompts)
    longer_than_chain = 0
    for prompt_ids, result in zip(prompts, tool_prompts):
        assert result["prompt_tokens"] == len(prompt_ids)
        # the last round's bonus token may be one past the tool's n_new-token reference
        reference = ed.plain_generate(target, prompt_ids, n_new + 1, set())
        chain = round_anchors(result["rounds"])
        for budget in BUDGETS:
            rounds, seq = online_ddtree_rounds(target, drafter, prompt_ids, n_new, budget)
            assert result["ddtree_rounds"][str(budget)] == rounds, f"prompt {prompt_ids}, budget {budget}"
            assert seq == prompt_ids + reference[:len(seq) - len(prompt_ids)]
            longer_than_chain += sum(a in chain and r > chain[a] for a, r in round_anchors(rounds).items())
    return longer_than_chain


def test_ddtree_rounds_equal_online_loop(demo_run, demo_target, demo_prompts):
    report, _ = demo_run
    d = report["drafters"][0]
    drafter = ed.load_drafter(os.path.join(DEMO, "drafter"), demo_target.config, drafter_settings())
    assert compare_online(demo_target, drafter, demo_prompts, d["prompts"], N_NEW) > 0
    # The comparison means something: trees beat the chain somewhere (above), and tau grows with the budget.
    taus = [d["ddtree"][str(b)]["tau"] for b in BUDGETS]
    assert taus == sorted(taus) and taus[-1] > d["tau"], (taus, d["tau"])
    assert report["target"]["agreement"] == 1.0


def test_ddtree_rounds_equal_online_loop_random_pair(tmp_path, tiny_target, drafter_a):
    """The demo drafter is so sure that its trees are nearly chains; a random drafter's trees branch."""
    rows = [{"id": f"r{i}", "prompt": " ".join(f"w{(7 * i + 3 * k) % 50}" for k in range(3 + i))} for i in range(4)]
    out = tmp_path / "out.json"
    code = ed.main(["--target", tiny_target["path"], "--ckpt", drafter_a, "--prompts",
                    write_jsonl(tmp_path / "p.jsonl", rows), "--ddtree-budgets", ",".join(map(str, BUDGETS)),
                    "--max-new-tokens", "24", "--ignore-eos", "--quiet", "--output", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["target"]["agreement"] == 1.0
    target = tiny_target["model"]
    drafter = ed.load_drafter(drafter_a, target.config, drafter_settings())
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_target["path"])
    prompts = [tok(row["prompt"])["input_ids"] for row in rows]
    prompts_report = report["drafters"][0]["prompts"]
    assert compare_online(target, drafter, prompts, prompts_report, 24) > 0
    # a poor drafter: the trees accept tokens that are not its top-1 (rank > 0) where the chain cannot
    d = report["drafters"][0]
    taus = [d["ddtree"][str(b)]["tau"] for b in BUDGETS]
    assert d["tau"] < taus[0] <= taus[1] < taus[2], (d["tau"], taus)


# ----------------------------------------------------------------------------------------------------
# 4. JSON and stdout shape


def test_ddtree_json_shape(demo_run):
    report, stdout = demo_run
    keys = [str(b) for b in BUDGETS]
    for d in report["drafters"]:
        B = d["block_size"]
        for s in [d] + list(d["splits"].values()):
            assert list(s["ddtree"]) == keys
            for t in s["ddtree"].values():
                assert {"tau", "tau_prompt_mean", "histogram"} <= set(t)
                assert len(t["histogram"]) == B
        for p in d["prompts"]:
            assert list(p["ddtree_rounds"]) == keys
        for b in keys:
            rounds = [r for p in d["prompts"] for r in p["ddtree_rounds"][b]]
            t = d["ddtree"][b]
            assert sum(t["histogram"]) == len(rounds) > 0
            assert t["histogram"] == [rounds.count(n) for n in range(1, B + 1)]
            assert t["tau"] == pytest.approx(sum(rounds) / len(rounds))
            per_prompt = [sum(p["ddtree_rounds"][b]) / len(p["ddtree_rounds"][b]) for p in d["prompts"]]
            assert t["tau_prompt_mean"] == pytest.approx(sum(per_prompt) / len(per_prompt))
            split_hist = [sum(s["ddtree"][b]["histogram"][n] for s in d["splits"].values()) for n in range(B)]
            assert split_hist == t["histogram"]
    rows = [line for line in stdout.splitlines() if "DDTree budget" in line]
    assert len(report["drafters"][0]["splits"]) == 2
    assert len(rows) == len(BUDGETS) * 3          # all, then each split
    for b in BUDGETS:
        assert any(f"DDTree budget {b:>4}:" in line for line in rows)


def test_ddtree_budgets_none(tmp_path, capsys):
    out = tmp_path / "none.json"
    assert ed.main(["--demo", "--ddtree-budgets", "none", "--max-new-tokens", "12", "--ignore-eos", "--limit", "2",
                    "--quiet", "--output", str(out)]) == 0
    assert "DDTree" not in capsys.readouterr().out
    d = json.loads(out.read_text())["drafters"][0]
    assert d["ddtree"] == {} and d["rounds"] > 0
    assert all(s["ddtree"] == {} for s in d["splits"].values())
    assert all(p["ddtree_rounds"] == {} for p in d["prompts"])


# ----------------------------------------------------------------------------------------------------
# 5. Bad budgets: one clear error line


@pytest.mark.parametrize("text", ["0", "-3", "abc", "8,x", "", "8,0", " , "])
def test_bad_budgets_are_one_error_line(text, capsys):
    assert ed.main(["--demo", "--quiet", "--limit", "1", "--ddtree-budgets", text]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "--ddtree-budgets" in lines[0]


def test_top_k_skipped_only_where_no_tree_can_hold_the_reference(tiny_target, drafter_a):
    """Given the reference's next token, draft_all_anchors leaves out the top-k (ids -1) of anchors whose first
    slot ranks top_k tokens or more above it, and only those; the drafts, the other anchors' top-k and the
    DDTree rounds stay as without the shortcut."""
    target = tiny_target["model"]
    drafter = ed.load_drafter(drafter_a, target.config, drafter_settings())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 64, (60,), generator=g).tolist()
    n_prompt, k, B = 8, 4, drafter.block_size
    features = ed.extract_hidden(target, ids, drafter.layers, n_prompt).features
    anchors = ed.fitting_anchors(n_prompt, len(ids), B)
    ids_t = torch.tensor(ids)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings()
    context = ed.prompt_context(drafter, features)
    full = ed.draft_all_anchors(drafter, context, anchors, ids_t[anchors], embed, head, k)
    short = ed.draft_all_anchors(drafter, context, anchors, ids_t[anchors], embed, head, k, after=ids_t[anchors + 1])
    assert torch.equal(full[0], short[0])
    in_top = (full[1][1][:, 0] == ids_t[anchors + 1][:, None]).any(-1)      # reference in slot 1's top-k
    skipped = (short[1][1] == -1).all(-1).all(-1)
    assert 0 < int(skipped.sum()) < len(anchors)                           # both kinds occur here
    assert not (skipped & in_top).any()                                    # never where a tree could hold it
    kept = ~skipped
    assert torch.equal(short[1][1][kept], full[1][1][kept]) and torch.equal(short[1][0][kept], full[1][0][kept])
    assert (short[1][0][skipped] == -float("inf")).all()
    budgets = [1, 2, k]
    one = ed.score_prompt(full[0], ids, n_prompt, B, full[1], budgets)
    two = ed.score_prompt(short[0], ids, n_prompt, B, short[1], budgets)
    assert one.ddtree_rounds == two.ddtree_rounds and one.rounds == two.rounds
