"""--verify standard,block: block verification (Sun et al. 2024, arXiv 2403.10444; vLLM 0.33's
rejection_sample_method "block", SGLang's --speculative-use-block-verification) beside the standard rule.

Given the text, the tool's expectation is a closed form in the proposal and target probabilities at the text's
tokens (README, Verification rules). Three independent checks:
- exact: on a tiny vocabulary, every draft sequence enumerated and the paper's rule (its h_i, its residual) applied
  to each, the posterior over round lengths given the text equals the closed form;
- online: a speculative loop running the rule as vLLM's kernel does (one uniform a slot, the largest i with
  u_i <= h_i, the residual max(r p - q, 0)), sampled EAGLE-3 drafts, 150 runs: the tool's expected rounds on each
  run's text are within 3 standard errors of the runs' own;
- greedy, and argmax drafts at any temperature: block verification is the standard rule, round by round.
"""
import dataclasses
import itertools
import json
import os

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, interrupted_then_resumed, refused_in_one_line, write_jsonl
from drafters import DEMO, demo_pair, dflash2_from_demo, public_module, run_refs, run_tool
from test_eagle3 import EAGLE, eagle_proposer
from test_sampled import mc_check, public_sampled_runs, sampling_argv

# two temperatures, the whole distribution kept (truncation by top-p / top-k leaves the rules all but equal here)
SETTINGS = {"low": (0.8, 1.0, 0), "high": (1.5, 1.0, 0)}


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


# ----------------------------------------------------------------------------------------------------
# Exact: the paper's rule on every draft sequence of a tiny vocabulary


def rows(seed, V):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(V, generator=g, dtype=torch.float64) ** 3 + 1e-3
    return x / x.sum()


def paper_posterior(p, q, text, N):
    """P(the round commits exactly a drafts and then text[a] | text), a = 0..N: every draft sequence d ~ q
    enumerated, the paper's block rule applied (rho_i = min(rho_{i-1} p/q, 1), h_i = Z / (Z + 1 - rho_i),
    h_N = rho_N, tau the largest i with u_i <= h_i, then the residual or the bonus), divided by the text's own
    probability. p(prefix), q(prefix): the next-token distributions after a prefix."""
    V = len(p(()))
    out = [0.0] * (N + 1)
    for d in itertools.product(range(V), repeat=N):
        weight, rho, h = 1.0, [1.0], [1.0]
        for i in range(N):
            weight *= float(q(d[:i])[d[i]])
            rho.append(min(rho[-1] * float(p(d[:i])[d[i]] / q(d[:i])[d[i]]), 1.0))
        for i in range(1, N + 1):
            if i == N:
                h.append(rho[N])
                continue
            Z = float((rho[i] * p(d[:i]) - q(d[:i])).clamp_min(0).sum())
            h.append(Z / (Z + 1 - rho[i]) if Z + 1 - rho[i] > 0 else 1.0)
        for a in range(N + 1):
            if tuple(d[:a]) != tuple(text[:a]):
                continue
            chance = h[a] if a else 1.0
            for i in range(a + 1, N + 1):
                chance *= 1 - h[i]
            if a == N:
                y = float(p(d)[text[N]])
            else:
                residual = (rho[a] * p(d[:a]) - q(d[:a])).clamp_min(0)
                y = float(residual[text[a]] / residual.sum()) if residual.sum() > 0 else 0.0
            out[a] += weight * chance * y
    own = 1.0
    for a in range(N + 1):   # divide by the text's probability up to the committed token
        own *= float(p(tuple(text[:a]))[text[a]])
        out[a] /= own
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_closed_form_is_the_papers_rule_marginalised(seed):
    V, N = 3, 3
    p = lambda prefix: rows(hash((seed, "p") + prefix) % 2**31, V)   # noqa: E731
    q = lambda prefix: rows(hash((seed, "q") + prefix) % 2**31, V)   # noqa: E731
    checked = 0
    for text in itertools.product(range(V), repeat=N + 1):
        want = paper_posterior(p, q, text, N)
        assert sum(want) == pytest.approx(1.0, abs=1e-9)   # the rule is lossless: a posterior
        p_at = torch.tensor([[float(p(text[:j])[text[j]]) for j in range(N)]], dtype=torch.float64)
        q_at = torch.tensor([[float(q(text[:j])[text[j]]) for j in range(N)]], dtype=torch.float64)
        reach = torch.cat([torch.ones(1), ed.block_accept(q_at, p_at)[0].cumprod(0)])
        assert reach.tolist() == pytest.approx([sum(want[j:]) for j in range(N + 1)], abs=1e-9)
        standard = torch.cat([torch.ones(1), (q_at / p_at).clamp(max=1)[0].cumprod(0)])
        checked += bool((reach > standard + 1e-9).any())
    assert checked > 0   # somewhere the block rule reaches further than the standard one: the check has teeth


# ----------------------------------------------------------------------------------------------------
# Online: sampled EAGLE-3 drafts verified as vLLM's kernel does


@torch.no_grad()
def block_sampling_runs(target, prompts, sampling, runs, n_new, drafter, seed):
    """vLLM's block rule, round by round: drafts from softmax(logits / T), a verify pass, rho and h per slot (the
    residual mass one slot ahead), one uniform a slot, tau the largest i with u_i <= h_i, then a token of the
    residual max(rho_tau p - q, 0) or the bonus. [(prompt index, first n_new tokens, the rounds inside them)]."""
    K = drafter.block_size - 1

    def p_of(logits):
        return ed.sampling_probs(logits, sampling).double()

    out = []
    for i in range(runs):
        g, ids = torch.Generator().manual_seed(seed + i), prompts[i % len(prompts)]
        propose, seq, rounds = eagle_proposer(target, drafter, sampling), list(ids), []
        seq.append(int(torch.multinomial(p_of(target(torch.tensor([seq])).logits[0, -1:])[0], 1, generator=g)))
        while len(seq) - len(ids) < n_new + K:
            anchor = len(seq) - 1
            drafts, qs = propose(seq, g)
            ps = p_of(target(torch.tensor([seq + drafts])).logits[0, anchor:])
            rho = [1.0]
            for j, x in enumerate(drafts):
                rho.append(min(rho[-1] * float(ps[j, x] / qs[j][x]), 1.0))
            tau = 0
            for j in range(1, K + 1):
                if j < K:
                    Z = float((rho[j] * ps[j] - qs[j]).clamp_min(0).sum())
                    h = Z / (Z + 1 - rho[j]) if Z + 1 - rho[j] > 0 else 1.0
                else:
                    h = rho[K]
                if torch.rand(1, generator=g).item() <= h:
                    tau = j
            if tau == K:
                token = int(torch.multinomial(ps[K], 1, generator=g))
            else:
                residual = (rho[tau] * ps[tau] - qs[tau]).clamp_min(0)
                token = int(torch.multinomial(residual / residual.sum(), 1, generator=g))
            seq += drafts[:tau] + [token]
            rounds.append(tau + 1)
        counted, at = [], 0
        for length in rounds:
            if at + K > n_new - 1:
                break
            counted.append(length)
            at += length
        out.append((i % len(prompts), seq[len(ids):len(ids) + n_new], counted))
    return out


def test_block_expected_rounds_match_an_online_block_loop(tmp_path, demo):
    target, rows_, prompts = demo
    sampling = (0.9, 1.0, 0)
    drafter = ed.load_drafter(EAGLE, target.config, drafter_settings(block_size=6))
    runs = block_sampling_runs(target, prompts, sampling, 150, 32, drafter, seed=7000)
    refs = run_refs(rows_, runs)
    report = run_tool(tmp_path, "block", "--target", os.path.join(DEMO, "target"), "--ckpt", f"e={EAGLE}",
                      "--block-size", "6", "--prompts", write_jsonl(tmp_path / "refs.jsonl", refs), "--draft-policy",
                      "sample", "--verify", "block,standard", *sampling_argv(sampling))
    _, _, sd = mc_check(runs, report)   # the main row is block's
    assert sd > 0.3
    d = report["drafters"][0]
    standard = d["verify"]["standard"]
    assert d["tau"] > standard["tau"] and d["rounds"] < standard["rounds"]   # block reaches further: it has teeth
    assert report["config"]["verify"] == ["block", "standard"]
    assert [p["verify_tau"]["standard"] for p in d["prompts"]] != [p["tau"] for p in d["prompts"]]


def block_rejection_sample(draft_tokens, target_probs, draft_probs, draft_indices=None):
    """The block rule in the public loop's verify step (dflash.model._rejection_sample's signature and random
    source): rho and h per slot, one uniform a slot, tau the largest i with u_i <= h_i, then a token of the residual
    max(rho_tau p - q, 0) or the bonus. DFlash 2's proposals are over its candidates (draft_indices)."""
    K, p = draft_tokens.shape[1], target_probs[0].double()
    q = draft_probs[0].double() if draft_indices is None else \
        torch.zeros(K, p.shape[-1], dtype=torch.float64).scatter_add_(1, draft_indices[0], draft_probs[0].double())
    d = draft_tokens[0].tolist()
    rho = [1.0]
    for j, x in enumerate(d):
        rho.append(min(rho[-1] * float(p[j, x] / q[j, x]), 1.0))
    tau = 0
    for j in range(1, K + 1):
        if j < K:
            Z = float((rho[j] * p[j] - q[j]).clamp_min(0).sum())
            h = Z / (Z + 1 - rho[j]) if Z + 1 - rho[j] > 0 else 1.0
        else:
            h = rho[K]
        if torch.rand(()).item() <= h:
            tau = j
    row = p[K] if tau == K else (rho[tau] * p[tau] - q[tau]).clamp_min(0)
    return tau, torch.multinomial(row / row.sum(), 1)[0]


def tool_expectations(tmp_path, name, drafter_dir, rows_, runs, sampling, rule):
    refs = run_refs(rows_, runs)
    return run_tool(tmp_path, name, "--target", os.path.join(DEMO, "target"), "--ckpt", f"d={drafter_dir}",
                    "--prompts", write_jsonl(tmp_path / f"{name}.jsonl", refs), "--ddtree-budgets", "none",
                    "--draft-policy", "sample", "--verify", rule, *sampling_argv(sampling))


@pytest.mark.parametrize("level", ["low", "high"])
@pytest.mark.parametrize("generation", ["DFlash", "DFlash 2"])
def test_block_expectation_matches_the_public_loop_under_the_block_rule(tmp_path, demo, monkeypatch, generation,
                                                                        level):
    """The public dflash loop with its verify step replaced by the block rule, 150 runs: the tool's block
    expectation on each run's text is within 3 standard errors of the runs' rounds. The control: for DFlash at the
    high temperature, where the rules differ most (the standard rule expects about 120 rounds more than block over
    the 150 texts, 3 standard errors being about 50), the standard rule's expectation lies outside."""
    target, rows_, prompts = demo
    drafter_dir = os.path.join(DEMO, "drafter") if generation == "DFlash" else dflash2_from_demo(tmp_path / "d2")
    public = public_module(monkeypatch)
    monkeypatch.setattr(public, "_rejection_sample", block_rejection_sample)
    runs = public_sampled_runs(public, drafter_dir, target, prompts, SETTINGS[level], 150, seed=9000)
    block = tool_expectations(tmp_path, "block", drafter_dir, rows_, runs, SETTINGS[level], "block")
    _, _, sd = mc_check(runs, block)
    assert sd > 0.2   # the runs do vary: the check has power
    standard = tool_expectations(tmp_path, "standard", drafter_dir, rows_, runs, SETTINGS[level], "standard")
    gap = sum(p["expected_rounds"] for p in standard["drafters"][0]["prompts"]) - \
        sum(p["expected_rounds"] for p in block["drafters"][0]["prompts"])
    assert gap >= 0   # the standard rule never expects fewer rounds: block reaches at least as far
    if (generation, level) == ("DFlash", "high"):
        with pytest.raises(AssertionError):
            mc_check(runs, standard)


# ----------------------------------------------------------------------------------------------------
# Greedy decoding and argmax drafts: the standard rule


ARGV = ("--demo", "--ckpt", f"d={os.path.join(DEMO, 'drafter')}", "--limit", "4", "--max-new-tokens", "40",
        "--verify", "standard,block")


@pytest.mark.parametrize("sampled", [False, True])
def test_with_argmax_drafts_block_is_the_standard_rule(tmp_path, sampled):
    argv = [*ARGV, *(sampling_argv((1.0, 1.0, 0)) if sampled else [])]
    d = run_tool(tmp_path, "a", *argv)["drafters"][0]
    b = d["verify"]["block"]
    assert b["tau"] == d["tau"] and b["histogram"] == d["histogram"] and b["per_position"] == d["per_position"]
    assert [p["verify_tau"]["block"] for p in d["prompts"]] == [p["tau"] for p in d["prompts"]]
    assert len(set(d["histogram"])) > 2   # rounds of several lengths


def test_sampled_block_rows_survive_saved_features_shards_and_resume(tmp_path, monkeypatch):
    argv = [*ARGV, "--draft-policy", "sample", *sampling_argv((1.0, 1.0, 0))]
    whole = run_tool(tmp_path, "whole", *argv)
    d = whole["drafters"][0]
    assert d["verify"]["block"]["tau"] > d["tau"]
    saved = tmp_path / "h.safetensors"
    same = lambda r: [{k: v for k, v in x.items() if k != "checkpoint"} for x in r["drafters"]]   # noqa: E731
    assert same(run_tool(tmp_path, "save", *argv, "--save-hidden", str(saved))) == same(whole)
    for k in (1, 2):
        run_tool(tmp_path, f"s{k}", *argv, "--shard", f"{k}/2")
    assert same(run_tool(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))) == \
        same(whole)
    out = tmp_path / "cut.json"
    resumed = interrupted_then_resumed(monkeypatch, [*argv, "--quiet", "--output", str(out)], out,
                                       "block_accept", 3, 2)
    assert same(resumed) == same(whole)


@pytest.mark.parametrize("value", ["synthetic", "standard,,x", ""])
def test_an_unknown_rule_is_refused_in_one_line(capsys, value):
    refused_in_one_line(capsys, ["--demo", "--verify", value, "--limit", "1"], "--verify takes standard, block, fly")


def test_costs_and_the_vllm_export_under_block(tmp_path, capsys):
    """The speedup row prices block at its depth's verify pass; the vLLM export stays synthetic (vLLM refuses block
    with synthetic rates), replays the main rule's rates, and says so in one line."""
    export = tmp_path / "vllm.json"
    argv = [*ARGV, "--draft-policy", "sample", *sampling_argv((1.0, 1.0, 0)), "--verify", "block,standard"]
    out = tmp_path / "c.json"
    assert ed.main([*argv, "--costs", "measure", "--export-vllm-synthetic", str(export), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    d, costs = report["drafters"][0], report["config"]["costs_used"]
    rows = d["predicted_speedup"]["1"]["rows"]
    K = str(d["drafts_per_round"])
    assert rows[f"K={K}"]["tau"] == d["tau"] and rows[f"K={K} standard"]["tau"] == d["verify"]["standard"]["tau"]
    assert rows[f"K={K} standard"]["target_s"] == rows[f"K={K}"]["target_s"] == costs["target"][str(int(K) + 1)]
    config = json.loads(export.read_text())
    assert config["rejection_sample_method"] == "synthetic"
    assert config["synthetic_acceptance_rates"] == [round(r, 6) for r in
                                                    d["engine_metrics"]["vllm"]["per_position_acceptance_rate"]]
    err = capsys.readouterr().err
    assert "vLLM refuses block verification together with synthetic acceptance, so the export replays the block " \
           "rule's measured rates" in err


def test_side_by_side_has_each_rules_tau(tmp_path, capsys):
    argv = ["--demo", "--ckpt", f"d={os.path.join(DEMO, 'drafter')}", "--ckpt", f"e={EAGLE}", "--limit", "3",
            "--max-new-tokens", "32", "--draft-policy", "sample", *sampling_argv((1.0, 1.0, 0)), "--verify",
            "standard,block", "--ddtree-budgets", "none"]
    out = tmp_path / "two.json"
    assert ed.main([*argv, "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    for row, d in zip(report["comparison"]["drafters"], report["drafters"]):
        assert row["verify"] == {"block": d["verify"]["block"]["tau"]} and row["tau"] == d["tau"]
    header = next(line for line in capsys.readouterr().out.splitlines() if "accept@1" in line)
    assert header.split()[-1] == "block"


def test_a_p_eagle_block_row_is_named_as_no_vllms(demo, capsys):
    """vLLM serves P-EAGLE on its V1 runner, which has no block verification: the load line says so."""
    from test_xpress_peagle import PEAGLE
    settings = drafter_settings(verify=["standard", "block"], quiet=False)
    ed.load_drafter(PEAGLE, demo[0].config, settings)
    assert "vLLM serves it on its V1 runner, which has no block verification: its --verify block row is what no " \
           "vLLM serves yet" in capsys.readouterr().err
    ed.load_drafter(PEAGLE, demo[0].config, dataclasses.replace(settings, verify=["standard"]))
    assert "block" not in capsys.readouterr().err
