"""--adaptive-steps: SGLang 0.5.23's --speculative-adaptive (batch size 1) replayed over the exact rounds.

The online loop here serves the prompts one after another as one SGLang server does: an EAGLE-3 drafter with the
engines' KV cache (test_eagle3.eagle_proposer, its first `steps` drafts of a 7-step chain) verified greedily by the
demo target, the step count set before each verify by a controller written here from SGLang's source
(speculative/adaptive_spec_params.py, AdaptiveStepSlot: candidates 1, 3, 5, 7 from 3, an EMA of accepted drafts at
alpha 0.2 starting at steps - 1, 10 warm-up verifies, a recompute every 5th, down while the EMA <= the lower
candidate - 0.75, else up while it is > the current one - 0.5), its state never reset between requests. The tool's
rounds per prompt and its steps taken equal the loop's; a run interrupted in its middle and resumed, and shards
merged, give the same row; a run without an EAGLE-3 or MTP drafter refuses the flag in one line.
"""

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, interrupted_then_resumed, refused_in_one_line
from drafters import demo_pair, run_tool
from test_eagle3 import EAGLE, eagle_proposer

N_NEW, N_PROMPTS = 48, 6
ARGV = ("--demo", "--ckpt", f"e={EAGLE}", "--block-size", "8", "--max-new-tokens", str(N_NEW), "--ignore-eos",
        "--limit", str(N_PROMPTS), "--adaptive-steps")


class Slot:
    """SGLang's AdaptiveStepSlot at batch size 1, one verify at a time."""

    def __init__(self):
        self.ladder, self.steps = [1, 3, 5, 7], 3
        self.ema, self.count = float(self.steps - 1), 0

    def update(self, accepted):
        self.ema = 0.8 * self.ema + 0.2 * accepted
        self.count += 1
        if self.count <= 10 or (self.count - 10) % 5:
            return
        i = self.ladder.index(self.steps)
        moved = False
        while i > 0 and self.ema <= self.ladder[i - 1] - 0.5 - 0.25:
            i, moved = i - 1, True
        while not moved and i < len(self.ladder) - 1 and self.ema > self.ladder[i] - 0.5:
            i += 1
        self.steps = self.ladder[i]


@torch.no_grad()
def online_adaptive(target, drafter, prompts):
    slot, out, used = Slot(), [], []
    for ids in prompts:
        propose = eagle_proposer(target, drafter)   # 7 chained drafts; the first `steps` are the round's
        seq = list(ids) + [int(target(torch.tensor([ids])).logits[0, -1].argmax())]
        rounds = []
        while len(seq) - len(ids) + slot.steps <= N_NEW:
            k = slot.steps
            drafts = propose(seq)[0][:k]
            verify = target(torch.tensor([seq + drafts])).logits[0, len(seq) - 1:].argmax(-1).tolist()
            accepted = next((j for j in range(k) if drafts[j] != verify[j]), k)
            seq += drafts[:accepted] + [verify[accepted]]
            rounds.append(accepted + 1)
            used.append(k)
            slot.update(accepted)
        out.append(rounds)
    return out, used


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return run_tool(tmp_path_factory.mktemp("adaptive"), "whole", *ARGV)


def test_rounds_equal_an_online_sglang_server(whole):
    target, _, prompts = demo_pair()
    drafter = ed.load_drafter(EAGLE, target.config, drafter_settings(block_size=8))
    online, used = online_adaptive(target, drafter, prompts[:N_PROMPTS])
    a = whole["drafters"][0]["adaptive"]
    assert a["prompt_rounds"] == online
    assert a["steps"] == {str(k): used.count(k) for k in sorted(set(used))}
    assert len(set(used)) >= 2   # the controller moved: the replay has teeth
    flat = [r for rounds in online for r in rounds]
    assert a["rounds"] == len(flat) and a["tau"] == pytest.approx(sum(flat) / len(flat))
    assert set(whole["drafters"][0]["depths"]) == {"1", "3", "5", "7"}   # each step count walked as a depth


def test_an_interruption_in_the_middle_and_shards_give_the_same_row(tmp_path, monkeypatch, whole):
    out = tmp_path / "cut.json"
    argv = [*ARGV, "--quiet", "--output", str(out)]
    resumed = interrupted_then_resumed(monkeypatch, argv, out, "causal_chain", 20, 2)
    assert resumed["drafters"][0]["adaptive"] == whole["drafters"][0]["adaptive"]
    for k in (1, 2):
        run_tool(tmp_path, f"s{k}", *ARGV, "--shard", f"{k}/2")
    merged = run_tool(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert merged["drafters"][0]["adaptive"] == whole["drafters"][0]["adaptive"]


def test_without_an_adaptive_drafter_it_is_one_line(capsys):
    refused_in_one_line(capsys, ["--demo", "--quiet", "--adaptive-steps"], "EAGLE, EAGLE-3 and MTP")
    refused_in_one_line(capsys, [*ARGV, "--quiet", "--temperature", "0.8", "--draft-policy", "sample"],
                        "argmax drafts")


# ----------------------------------------------------------------------------------------------------
# vLLM's K by batch size (num_speculative_tokens_per_batch_size) in the cost rows


def vllm_dense_lookup(table, static_k, max_seqs):
    """vLLM's dense table (v1/spec_decode/dynamic/utils.py), written from its description: entry b for 1..max_seqs is
    min(static K, the K of the range holding b); a gap and sizes past the last range keep the K last set."""
    dense, k = [None], None
    ranges = sorted(table)
    for b in range(1, max_seqs + 1):
        k = next((K for start, end, K in ranges if start <= b <= end), k)
        dense.append(min(static_k, k))
    return dense


def test_k_by_batch_size_names_the_row_vllm_serves(tmp_path):
    table, sizes = [(1, 4, 7), (5, 16, 3), (20, 40, 5), (48, 100, 0)], [1, 4, 5, 17, 20, 33, 47, 48, 64, 200]
    spec = ",".join(f"{a}-{b}:{k}" for a, b, k in [table[2], table[0], table[3], table[1]])   # any order
    report = run_tool(tmp_path, "k", "--demo", "--limit", "3", "--max-new-tokens", "32", "--ddtree-budgets", "none",
                      "--block-size", "6", "--costs", "gpu:H100", "--batch-sizes", ",".join(map(str, sizes)),
                      "--k-by-batch-size", spec)
    d = report["drafters"][0]
    dense = vllm_dense_lookup(table, d["drafts_per_round"], max(sizes))
    assert set(d["depths"]) == {"3", "5"}   # the depths vLLM serves below the drafter's 5 were walked
    for b in sizes:
        p, k = d["predicted_speedup"][str(b)], dense[b]
        assert p["vllm_k"]["k"] == k, b
        assert p["vllm_k"]["speedup"] == (p["rows"][f"K={k}"]["speedup"] if k else 1.0), b
    assert {dense[b] for b in sizes} == {0, 3, 5}   # capped at 5, carried through gaps, plain decoding at 0


@pytest.mark.parametrize("spec, fragment", [
    ("2-4:7", "its first range must start at batch size 1"),
    ("1-8:7,4-16:3", "ranges 1-8 and 4-16 overlap"),
    ("1-8", "takes START-END:K ranges"),
    ("1-0:3", "takes START-END:K ranges"),
])
def test_bad_k_by_batch_size_is_one_line(spec, fragment, capsys):
    refused_in_one_line(capsys, ["--demo", "--costs", "gpu:H100", "--k-by-batch-size", spec], fragment)


def test_k_by_batch_size_goes_with_costs(capsys):
    refused_in_one_line(capsys, ["--demo", "--k-by-batch-size", "1-8:3"], "--k-by-batch-size and --save-costs go with")
