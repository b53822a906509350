"""Sampled decoding: τ at the serving temperature, against the public loop run sampled.

- The processed distribution (temperature, top-k, top-p) read at single tokens equals the full one.
- Argmax proposals (vLLM, SGLang, TensorRT-LLM): on texts the public `dflash` 0.1.0 loop samples with argmax
  proposals, the tool's rounds equal the loop's, round by round.
- Sampled proposals (the public transformers loop), DFlash and DFlash 2, a low and a high temperature with top-p
  and top-k: over 150 runs of the public loop, the actual rounds minus the tool's E[rounds | that run's text]
  sum to 0 within 3 standard errors; the tool's τ from its own sampled references lies within 3 standard
  errors of the loop's Monte Carlo τ.
- DDTree at temperature T: the rounds equal an online tree loop's that samples the target at every node.
- Temperature 0 is today's greedy path; the reference check, the self-check, the cache and resume under sampling.
(The estimator itself is checked against brute-force enumeration in test_sampled_math.py.)
"""
import json
import math
import os

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, interrupt_at, online_draft_logits, write_jsonl
from drafters import DEMO, demo_pair, dflash2_from_demo, public_module

transformers = pytest.importorskip("transformers")
N_NEW = 32
RUNS = 150


@pytest.fixture(scope="module")
def demo():
    return demo_pair()


def run_tool(tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, "--quiet", "--output", str(out)]) == 0
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------------------------------
# 1. The processed distribution


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 0), (1.0, 7), (0.8, 12), (0.999, 0)])
def test_sampled_prob_equals_the_full_distribution(top_p, top_k):
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(40, 300, generator=g) * torch.linspace(0.1, 4, 40)[:, None]   # flat rows to peaked ones
    tokens = torch.randint(0, 300, (40,), generator=g)
    tokens[::3] = logits[::3].argmax(-1)
    sampling = (0.8, top_p, top_k)
    full = ed.sampling_probs(logits, sampling)
    got = ed.sampled_prob(logits, tokens, sampling)
    torch.testing.assert_close(got, full[torch.arange(40), tokens].double(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(full.sum(-1), torch.ones(40))
    if top_p < 1 or top_k:
        assert (got == 0).any() and (got > 0).any()   # some tokens are cut: the support matters
    if top_p == 0.999:   # flat rows: the top-64 prefix falls short, the full sort is taken
        assert (torch.softmax(logits / 0.8, -1).topk(64).values.sum(-1) < 0.999).any()


def test_sampling_probs_match_the_public_code():
    public = pytest.importorskip("dflash.model")
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    for sampling in [(0.7, 0.95, 20), (1.5, 0.9, 0), (1.0, 1.0, 5)]:
        torch.testing.assert_close(ed.sampling_probs(logits, sampling),
                                   public._sampling_probs(logits, sampling[0], sampling[1], sampling[2]))


# ----------------------------------------------------------------------------------------------------
# 2. Against the public loop run sampled

SETTINGS = {"low": (0.7, 0.95, 20), "high": (1.5, 0.9, 30)}


def sampling_argv(sampling):
    return ["--temperature", str(sampling[0]), "--top-p", str(sampling[1]), "--top-k", str(sampling[2])]


def counted_rounds(lengths, n_new, block_size):
    """The loop's rounds whose block lies inside the first n_new completion tokens (the tool's rule)."""
    out, anchor = [], 0
    for length in lengths:
        if anchor + block_size - 1 > n_new - 1:
            break
        out.append(length)
        anchor += length
    return out


def public_sampled_runs(public, drafter_dir, target, prompts, sampling, runs, seed=1000, n_new=N_NEW):
    """`runs` runs of dflash_generate at `sampling`, prompts in turn: [(prompt index, text, counted rounds)]."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(drafter_dir)
    cls = public.DFlash2DraftModel if "DFlash2DraftModel" in config.architectures else public.DFlashDraftModel
    model = cls.from_pretrained(drafter_dir, config=config, dtype=torch.float32).eval()
    B = model.block_size
    out = []
    for i in range(runs):
        torch.manual_seed(seed + i)
        ids = prompts[i % len(prompts)]
        res = public.dflash_generate(model, target, torch.tensor([ids]), n_new + B, None, temperature=sampling[0],
                                     top_p=sampling[1], top_k=sampling[2], return_stats=True)
        out.append((i % len(prompts), res.output_ids[0, len(ids):len(ids) + n_new].tolist(),
                    counted_rounds(res.acceptance_lengths, n_new, B)))
    return out


def tool_on_texts(tmp_path, name, drafter_dir, rows, runs, sampling, policy):
    refs = [{"id": f"run{i}", "prompt": rows[p]["prompt"], "completion_ids": text} for i, (p, text, _) in enumerate(runs)]
    return run_tool(tmp_path, name, "--target", os.path.join(DEMO, "target"), "--ckpt", f"d={drafter_dir}",
                    "--prompts", write_jsonl(tmp_path / f"{name}.jsonl", refs), "--ddtree-budgets", "none",
                    "--draft-policy", policy, *sampling_argv(sampling))


def argmax_proposals(public, monkeypatch):
    """The public loop with argmax proposals (vLLM / SGLang / TensorRT-LLM): DFlash logits scaled so far that
    its processed distribution is one-hot at the argmax; DFlash 2's selector at a vanishing temperature."""
    compute_logits, select = public.DFlashDraftModel.compute_logits, public.CandidateSelector.select
    monkeypatch.setattr(public.DFlashDraftModel, "compute_logits",
                        lambda self, hidden, head: compute_logits(self, hidden, head) * 1e5)
    monkeypatch.setattr(public.CandidateSelector, "select",
                        lambda self, hidden, logits, anchor_ids, temperature: select(self, hidden, logits / 1e5,
                                                                                     anchor_ids, 1e-6))


@pytest.mark.parametrize("generation", ["DFlash", "DFlash 2"])
def test_argmax_rounds_equal_the_public_loop(tmp_path, demo, monkeypatch, generation):
    target, rows, prompts = demo
    drafter_dir = os.path.join(DEMO, "drafter") if generation == "DFlash" else dflash2_from_demo(tmp_path / "d2")
    public = public_module(monkeypatch)
    argmax_proposals(public, monkeypatch)
    sampling = SETTINGS["low"]
    runs = public_sampled_runs(public, drafter_dir, target, prompts, sampling, 20)
    report = tool_on_texts(tmp_path, "argmax", drafter_dir, rows, runs, sampling, "argmax")
    all_rounds = []
    for (_, _, rounds), p in zip(runs, report["drafters"][0]["prompts"]):
        assert p["rounds"] == rounds, p["id"]
        assert p["expected_rounds"] == len(rounds) and p["expected_committed"] == sum(rounds)
        all_rounds += rounds
    assert len(set(all_rounds)) >= 3 and max(all_rounds) > 1
    assert report["target"]["reference_support"] == 1.0


def mc_check(runs, report):
    """Sum over runs of (actual rounds - the tool's E[rounds | text]) within 3 standard errors of 0; and the
    loop's Monte Carlo tau with its standard error."""
    diffs = [len(rounds) - p["expected_rounds"] for (_, _, rounds), p in zip(runs, report["drafters"][0]["prompts"])]
    n = len(diffs)
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    assert abs(sum(diffs)) <= 3 * sd * math.sqrt(n), (sum(diffs), sd)
    committed, rounds = [sum(r) for _, _, r in runs], [len(r) for _, _, r in runs]
    lo, hi = ed.ratio_ci95(committed, rounds)
    return sum(committed) / sum(rounds), (hi - lo) / (2 * 1.96), sd


@pytest.mark.parametrize("level", ["low", "high"])
@pytest.mark.parametrize("generation", ["DFlash", "DFlash 2"])
def test_sampled_proposals_expected_rounds_match_the_public_loop(tmp_path, demo, monkeypatch, generation, level):
    target, rows, prompts = demo
    drafter_dir = os.path.join(DEMO, "drafter") if generation == "DFlash" else dflash2_from_demo(tmp_path / "d2")
    sampling = SETTINGS[level]
    runs = public_sampled_runs(public_module(monkeypatch), drafter_dir, target, prompts, sampling, RUNS)
    report = tool_on_texts(tmp_path, "sampled", drafter_dir, rows, runs, sampling, "sample")
    mc_tau, mc_se, sd = mc_check(runs, report)
    assert sd > 0.3   # the runs do vary: the check has power
    if level == "high" and generation == "DFlash":
        # The tool's tau from its own sampled references (speculative sampling with the drafter) against the
        # loop's Monte Carlo tau.
        own = run_tool(tmp_path, "own", "--demo", "--max-new-tokens", str(N_NEW), "--ignore-eos", "--ddtree-budgets",
                       "none", "--draft-policy", "sample", "--samples-per-prompt", str(RUNS // 10),
                       *sampling_argv(sampling))
        d = own["drafters"][0]
        assert len(d["prompts"]) == RUNS and {p["sample"] for p in d["prompts"]} == set(range(RUNS // 10))
        assert own["config"]["reference_generation_used"] == "speculative"
        lo, hi = d["tau_ci95"]
        tool_se = (hi - lo) / (2 * 1.96)
        assert abs(d["tau"] - mc_tau) <= 3 * math.sqrt(tool_se ** 2 + mc_se ** 2), (d["tau"], mc_tau)


# ----------------------------------------------------------------------------------------------------
# 3. DDTree at temperature T


def online_tree_rounds(target, drafter, prompt_ids, n_new, budget, sampling, generator):
    """The DDTree loop at temperature T: the tree from the drafter's raw log-probs; the target samples a token
    at every node it reaches (processed distribution) and the walk follows the child holding it; that token
    ends the round when no child holds it. Returns (rounds, committed text)."""
    B = drafter.block_size
    seq = list(prompt_ids)
    with torch.no_grad():
        def sample(s):
            logits = target(torch.tensor([s])).logits[0, -1:]
            return int(torch.multinomial(ed.sampling_probs(logits, sampling), 1, generator=generator))
        seq.append(sample(seq))
        rounds = []
        while (len(seq) - len(prompt_ids)) + B - 1 <= n_new:
            top = online_draft_logits(target, drafter, seq).float().log_softmax(-1).topk(budget, dim=-1)
            tree = ed.build_tree(top.values.tolist(), budget)
            node, depth = (), 0
            while True:
                token = sample(seq)
                children = [path for path in tree if len(path) == depth + 1 and path[:-1] == node
                            and int(top.indices[depth, path[-1]]) == token]
                seq.append(token)
                if not children or depth + 1 == B - 1:
                    if children:   # the deepest slot matched: one more token, the bonus
                        seq.append(sample(seq))
                        depth += 1
                    break
                node, depth = children[0], depth + 1
            rounds.append(depth + 1)
        while len(seq) < len(prompt_ids) + n_new:   # the rest of the text, sampled plainly: no round counts there
            seq.append(sample(seq))
    return rounds, seq


def test_ddtree_rounds_at_temperature_equal_an_online_tree_loop(tmp_path, demo):
    target, rows, prompts = demo
    drafter = ed.load_drafter(os.path.join(DEMO, "drafter"), target.config, drafter_settings())
    sampling = (1.5, 0.9, 30)
    refs, expected = [], {8: [], 32: []}
    for i, prompt_ids in enumerate(prompts[:4]):
        for budget in expected:
            g = torch.Generator().manual_seed(i * 100 + budget)
            rounds, seq = online_tree_rounds(target, drafter, prompt_ids, N_NEW, budget, sampling, g)
            refs.append({"id": f"p{i}b{budget}", "prompt": rows[i]["prompt"],
                         "completion_ids": seq[len(prompt_ids):len(prompt_ids) + N_NEW]})
            expected[budget].append(rounds)
    report = run_tool(tmp_path, "trees", "--target", os.path.join(DEMO, "target"), "--ckpt",
                      f"d={os.path.join(DEMO, 'drafter')}", "--prompts", write_jsonl(tmp_path / "t.jsonl", refs),
                      "--ddtree-budgets", "8,32", *sampling_argv(sampling))
    got = {p["id"]: p["ddtree_rounds"] for p in report["drafters"][0]["prompts"]}
    all_rounds = []
    for i in range(4):
        for budget in expected:
            assert got[f"p{i}b{budget}"][str(budget)] == expected[budget][i], (i, budget)
            all_rounds += expected[budget][i]
    assert max(all_rounds) > 2 and min(all_rounds) == 1


# ----------------------------------------------------------------------------------------------------
# 4. Temperature 0, the reference check, the self-check, cache, resume, flags


def test_temperature_zero_is_the_greedy_json(tmp_path):
    base = ["--demo", "--limit", "3", "--max-new-tokens", "48"]
    default = run_tool(tmp_path, "default", *base)
    explicit = run_tool(tmp_path, "explicit", *base, "--temperature", "0", "--seed", "7")
    for key in ("drafters", "target", "skipped"):
        assert default[key] == explicit[key], key
    d = default["drafters"][0]
    assert "expected_rounds" not in d["prompts"][0] and "sample" not in d["prompts"][0]
    assert default["target"]["agreement"] == 1.0 and "reference_support" not in default["target"]


def test_references_from_other_settings_are_named(tmp_path, capsys):
    """References sampled without top-k, evaluated at top-k 2: tokens outside the support get acceptance 0
    (never a division by zero) and a warning names the prompt."""
    loose = run_tool(tmp_path, "loose", "--demo", "--limit", "3", "--max-new-tokens", "40", "--temperature", "2",
                     "--save-hidden", str(tmp_path / "h.safetensors"))
    capsys.readouterr()
    rows = [json.loads(line) for line in open(os.path.join(DEMO, "prompts.jsonl"))][:3]
    ids = ed.read_hidden_meta(str(tmp_path / "h.safetensors"))["prompts"]
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / "h.safetensors"))
    refs = [{**row, "completion_ids": tensors[f"{i}.ids"][m["prompt_tokens"]:].tolist()}
            for i, (row, m) in enumerate(zip(rows, ids))]
    out = tmp_path / "tight.json"
    assert ed.main(["--demo", "--prompts", write_jsonl(tmp_path / "r.jsonl", refs), "--temperature", "2", "--top-k",
                    "2", "--draft-policy", "sample", "--quiet", "--output", str(out)]) == 0
    err = capsys.readouterr().err
    tight = json.loads(out.read_text())
    first = next(p for p in tight["drafters"][0]["prompts"] if p["first_outside_support"] is not None)
    assert f"outside the target's sampling support at temperature 2.0, top-p 1.0, top-k 2 (first: prompt {first['id']}" \
        in err
    assert 0 < tight["target"]["reference_support"] < 1 and loose["target"]["reference_support"] == 1.0
    d = tight["drafters"][0]
    assert math.isfinite(d["tau"]) and all(math.isfinite(p["expected_rounds"]) for p in d["prompts"])
    assert tight["target"]["self_check"] is None   # references from a file: nothing generated here


def test_self_check_fires_when_own_samples_leave_the_support(tmp_path, capsys, monkeypatch):
    """A broken sampler (top-k ignored) generates tokens its own evaluation says it could not produce."""
    real = ed.sampling_probs
    monkeypatch.setattr(ed, "sampling_probs", lambda logits, sampling: real(logits, (sampling[0], sampling[1], 0)))
    out = tmp_path / "broken.json"
    assert ed.main(["--demo", "--limit", "3", "--max-new-tokens", "40", "--temperature", "2", "--top-k", "3",
                    "--quiet", "--output", str(out)]) == 0
    err = capsys.readouterr().err
    check = json.loads(out.read_text())["target"]["self_check"]
    assert not check["passed"] and check["agreement"] < 1
    assert "self-check failed: the tool's own generation and evaluation disagree" in err
    assert f"prompt {check['first_divergence']['prompt']}, completion position {check['first_divergence']['position']}: " \
           "generated token" in err and "has probability 0 under its own teacher-forced sampling distribution" in err


def test_cache_and_resume_under_sampling(tmp_path, monkeypatch, capsys):
    argv = ["--demo", "--limit", "4", "--max-new-tokens", "40", "--temperature", "1.5", "--top-p", "0.9",
            "--draft-policy", "sample", "--samples-per-prompt", "2", "--ddtree-budgets", "8"]
    whole = run_tool(tmp_path, "whole", *argv, "--save-hidden", str(tmp_path / "h.safetensors"))
    assert len(whole["drafters"][0]["prompts"]) == 8 and whole["target"]["self_check"]["passed"]
    loaded = run_tool(tmp_path, "loaded", "--target", os.path.join(DEMO, "target"), "--ckpt",
                      f"demo={os.path.join(DEMO, 'drafter')}", "--load-hidden", str(tmp_path / "h.safetensors"),
                      "--temperature", "1.5", "--top-p", "0.9", "--draft-policy", "sample", "--ddtree-budgets", "8")
    assert loaded["drafters"] == whole["drafters"]
    capsys.readouterr()
    assert ed.main(["--target", os.path.join(DEMO, "target"), "--ckpt", f"demo={os.path.join(DEMO, 'drafter')}",
                    "--load-hidden", str(tmp_path / "h.safetensors"), "--temperature", "1.0", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was extracted at temperature 1.5, top-p 0.9, top-k 0, this run asks for temperature 1.0" \
        in err[0]
    # Interrupted after the first group of prompts, then resumed: the same report.
    out = tmp_path / "resumed.json"
    real, calls = interrupt_at(monkeypatch, "evaluate_prompts", 4)
    assert ed.main([*argv, "--quiet", "--output", str(out)]) == 130
    monkeypatch.setattr(ed, "evaluate_prompts", real)
    assert ed.main([*argv, "--quiet", "--output", str(out), "--resume"]) == 0
    assert json.loads(out.read_text())["drafters"] == whole["drafters"]


@pytest.mark.parametrize("argv,fragment", [
    (["--samples-per-prompt", "3"], "need --temperature > 0"),
    (["--draft-policy", "sample"], "need --temperature > 0"),
    (["--top-k", "20"], "at --temperature 0 (greedy) they do nothing"),
    (["--temperature", "0.5", "--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--temperature", "0.5", "--draft-policy", "sample", "--anchors", "walk"], "use --anchors all"),
])
def test_bad_sampling_flags_are_one_line(argv, fragment, capsys):
    assert ed.main(["--demo", "--quiet", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_target_distribution_is_its_forwards(tmp_path):
    """p is the model's own sampling distribution: a target whose config softcaps its logits (Gemma 2) is
    read through the softcap; a forward that changes its logits in another way is refused."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from conftest import md, save_random_target
    vocab = md.save_tokenizer(str(tmp_path))
    cfg = Gemma2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       final_logit_softcapping=3.0, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = save_random_target(str(tmp_path), Gemma2ForCausalLM, cfg, 0.5)
    ids = list(range(4, 40))
    sampling = (1.3, 0.9, 0)
    p = ed.extract_hidden(model, ids, [0], 8, sampling).p
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, 7:-1]
    want = ed.sampling_probs(logits, sampling)[torch.arange(len(ids) - 8), torch.tensor(ids[8:])].double()
    torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-6)
    raw = ed.sampled_prob(model.get_output_embeddings()(model.get_decoder()(torch.tensor([ids])).last_hidden_state[0, 7:-1]),
                          torch.tensor(ids[8:]), sampling)
    assert (raw - want).abs().max() > 1e-3   # without the softcap the numbers would be wrong

    class Scaled(torch.nn.Module):   # a forward that doubles its logits: not the head, nor a known config knob
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.config = inner.config

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            out.logits = out.logits * 2
            return out

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def get_decoder(self):
            return self.inner.get_decoder()

        @property
        def device(self):
            return self.inner.device

    with pytest.raises(ed.UsageError, match="transforms its logits in a way this tool does not reproduce"):
        ed.model_logits(Scaled(model))
