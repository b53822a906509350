"""Every transformers version requirements.txt allows gives the same numbers (CI runs this suite under the
oldest and the newest), and the self-check names the culprit when the tool's own references disagree with
its own teacher-forced pass.

Here: the KV-cache rollback whose meaning changed between 4.x and 5.x, the floor the tool refuses below, a
target config saved in 5.x form read by 4.x, the self-check against a deliberately broken rollback, and the
small fixes from the same newcomer run (help, labels, float64 statistics, the DDTree note).
"""
import io
import json
import os
import shutil

import pytest
import torch

import eval_drafter as ed
from conftest import md, write_jsonl

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "demo")


# ----------------------------------------------------------------------------------------------------
# 1. The rollback: crop(0) empties a 4.x cache and is a no-op in 5.x; roll_back(cache, 0) keeps everything


@torch.inference_mode()
def test_roll_back_removes_exactly_n(tiny_target):
    from transformers import DynamicCache
    model = tiny_target["model"]
    ids = list(range(4, 16))
    for n in (0, 1, 5):
        cache = DynamicCache()
        _, _, cache = ed.target_pass(model, ids, [1], cache)
        assert cache.get_seq_length() == len(ids)
        ed.roll_back(cache, n)
        assert cache.get_seq_length() == len(ids) - n
        # What stays is the prefix's cache: continuing from it equals a fresh pass over the longer text.
        more = [20, 21, 22]
        _, last, _ = ed.target_pass(model, more, [1], cache)
        _, fresh, _ = ed.target_pass(model, ids[:len(ids) - n] + more, [1])
        torch.testing.assert_close(last, fresh[-len(more):], rtol=1e-5, atol=1e-5)


def broken_roll_back(cache, n):
    """transformers 4.x's reading of the old call cache.crop(-n): with n = 0, crop(0) keeps 0 positions."""
    if n > 0:
        cache.crop(-n)
    else:
        cache.crop(-cache.get_seq_length())


def demo_run(tmp_path, capsys, name, *extra):
    out = tmp_path / f"{name}.json"
    rc = ed.main(["--demo", "--limit", "3", "--max-new-tokens", "64", "--ignore-eos", "--ddtree-budgets", "none",
                  "--quiet", "--output", str(out), *extra])
    cap = capsys.readouterr()
    return rc, json.loads(out.read_text()), cap.out, cap.err


def test_self_check_passes_and_fires_on_a_broken_rollback(tmp_path, capsys, monkeypatch):
    rc, good, out, err = demo_run(tmp_path, capsys, "good")
    assert rc == 0 and "self-check" not in err + out
    check = good["target"]["self_check"]
    assert check == {"tokens": 3 * 64, "agreement": 1.0, "tolerance": 0.0, "passed": True, "first_divergence": None}

    monkeypatch.setattr(ed, "roll_back", broken_roll_back)
    rc, bad, out, err = demo_run(tmp_path, capsys, "bad")
    assert rc == 0   # the numbers are reported, with the warning
    check = bad["target"]["self_check"]
    assert not check["passed"] and check["agreement"] < 1.0
    first = next(p for p in bad["drafters"][0]["prompts"] if p["first_divergence"] is not None)
    where = check["first_divergence"]
    assert (where["prompt"], where["position"]) == (first["id"], first["first_divergence"])
    assert where["reference"] != where["argmax"] and where["logit_gap"] > 0
    for text in (err, out):
        assert "self-check failed: the tool's own generation and evaluation disagree" in text
        assert f"prompt {first['id']}, completion position {first['first_divergence']}" in text
        assert "tolerance: none on CPU in float32" in text
    assert "not the target's greedy output" not in err   # the references are not blamed


def item(source, hits, total, diverge=None, pid="p"):
    return ed.Prompt(id=pid, source=source, agree=(hits, total), first_divergence=diverge,
                     divergence=None if diverge is None else {"reference": 5, "argmax": 6, "logit_gap": 1e-3})


@pytest.mark.parametrize("device,dtype,hits,passed", [
    ("cpu", "float32", 1000, True), ("cpu", "float32", 999, False),
    ("cuda", "bfloat16", 995, True), ("cuda", "bfloat16", 989, False),
    ("cpu", "bfloat16", 995, True), ("cuda", "float32", 990, True)])
def test_self_check_tolerance(device, dtype, hits, passed, capsys):
    items = [item("target", hits, 1000, None if hits == 1000 else 17, "own"),
             item("file", 10, 100, 0, "given"), item("server", 50, 100, 3, "served")]
    check = ed.self_check(items, {"device": device, "dtype": dtype, "quiet": False})
    assert check["tokens"] == 1000 and check["agreement"] == hits / 1000   # file and server references left out
    assert check["passed"] is passed
    assert check["tolerance"] == (0.0 if (device, dtype) == ("cpu", "float32") else ed.SELF_CHECK_TOLERANCE)
    err = capsys.readouterr().err
    if hits < 1000:
        assert check["first_divergence"]["prompt"] == "own" and check["first_divergence"]["position"] == 17
        text = check.get("message") or err
        assert "prompt own, completion position 17: generated token 5, teacher-forced argmax 6, logit gap 0.001" in text
        if device != "cpu" or dtype != "float32":
            assert f"1% of tokens on {device} in {dtype}, where batch shapes can flip near-ties" in text
    assert ("message" in check) is (not passed)
    # Without references of its own, there is nothing to check.
    assert ed.self_check(items[1:], {"device": device, "dtype": dtype, "quiet": True}) is None


def test_extract_hidden_logit_gaps(tiny_target):
    model = tiny_target["model"]
    ids = list(range(4, 30))
    n_prompt = 6
    x = ed.extract_hidden(model, ids, [1], n_prompt)
    argmax, gaps = x.argmax, x.gaps
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, n_prompt - 1:len(ids) - 1]
    wrong = [k for k, t in enumerate(ids[n_prompt:]) if t != argmax[k]]
    assert sorted(gaps) == wrong and wrong
    for k in wrong:
        assert gaps[k] == pytest.approx(float(logits[k].max() - logits[k, ids[n_prompt + k]]), abs=1e-5)
        assert gaps[k] > 0
    greedy = ed.plain_generate(model, ids[:n_prompt], 20, set())
    x = ed.extract_hidden(model, ids[:n_prompt] + greedy, [1], n_prompt)
    argmax, none = x.argmax, x.gaps
    assert argmax == greedy and none == {}   # its own greedy text: no gap anywhere


# ----------------------------------------------------------------------------------------------------
# 2. The floor: refused below it, in one line


@pytest.mark.parametrize("version", ["4.56.2", "4.57.0", "4.46.0.dev0", "3.5.1"])
def test_refuses_transformers_below_the_floor(version, monkeypatch, capsys):
    import transformers
    monkeypatch.setattr(transformers, "__version__", version)
    assert ed.main(["--demo", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: transformers ")
    assert f"transformers {version} is installed" in err[0] and f">= {ed.MIN_TRANSFORMERS}" in err[0]


def test_floor_matches_requirements_and_ci():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    requirements = open(os.path.join(root, "requirements.txt")).read()
    assert f"transformers>={ed.MIN_TRANSFORMERS}" in requirements.split()
    ci = open(os.path.join(root, ".ci", "run")).read()
    assert f'setup "$WORK/floor" "transformers=={ed.MIN_TRANSFORMERS}"' in ci   # CI installs the floor itself
    assert f'grep -qx "transformers>={ed.MIN_TRANSFORMERS}" requirements.txt' in ci


def test_version_tuple():
    assert ed.version_tuple("4.57.1") == (4, 57, 1)
    assert ed.version_tuple("5.0.0rc1") == (5, 0, 0)
    assert ed.version_tuple("4.58.0.dev0") == (4, 58, 0)
    assert ed.version_tuple("5.3") == (5, 3, 0)
    assert ed.version_tuple("4.57.1") >= ed.version_tuple(ed.MIN_TRANSFORMERS) > ed.version_tuple("4.57.0")


# ----------------------------------------------------------------------------------------------------
# 3. A target config in either RoPE form loads with its own RoPE under every version


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("form", ["rope_parameters", "rope_theta"])
def test_target_rope_forms(tmp_path, form):
    """transformers 5.x saves `rope_parameters` (theta inside), 4.x `rope_theta` + `rope_scaling`. 4.x alone
    ignores the 5.x form and would run the default RoPE (theta 10000, no YaRN): the tool must not."""
    from transformers import Qwen3ForCausalLM
    vocab = md.save_tokenizer(str(tmp_path))
    cfg = md.target_config(vocab, num_hidden_layers=2, rope_theta=500000.0, rope_scaling=dict(YARN),
                           max_position_embeddings=256)
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(str(tmp_path))
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    for key in ("rope_parameters", "rope_theta", "rope_scaling"):
        raw.pop(key, None)
    if form == "rope_parameters":
        raw["rope_parameters"] = {**YARN, "rope_theta": 500000.0}
    else:
        raw.update(rope_theta=500000.0, rope_scaling=dict(YARN))
    path.write_text(json.dumps(raw))
    ids = torch.tensor([list(range(4, 60)) * 3])   # past the original 64 positions: YaRN matters
    with torch.no_grad():
        want = model(ids).logits
        loaded, _ = ed.load_target(ed.Settings(target=str(tmp_path), dtype="float32", device="cpu", quiet=True))
        got = loaded(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    text = ed.read_target_config(str(tmp_path))   # what an inferred drafter config takes its theta from
    theta = getattr(text, "rope_theta", None) or text.rope_parameters["rope_theta"]
    assert theta == 500000.0


# ----------------------------------------------------------------------------------------------------
# 4. From the same newcomer run: help, JSON errors, labels, float64 statistics, the DDTree note


def test_help_is_grouped_with_the_demo_on_top(capsys):
    with pytest.raises(SystemExit) as stop:
        ed.parse_args(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    head = text.split("options:")[0]
    assert "--demo" in head.splitlines()[0] and "python eval_drafter.py --demo" in head
    assert "python eval_drafter.py --target" in head
    titles = ["inputs:", "drafter config", "evaluation:", "references", "hidden-state cache", "long runs", "output:"]
    where = [text.index("\n" + t) for t in titles]
    assert where == sorted(where)
    flat = " ".join(text.split())   # argparse wraps lines
    ckpt = flat[flat.index("--ckpt [NAME=]PATH"):flat.index("--prompts PROMPTS")]
    for form in ("config.json + model.safetensors", "model.safetensors.index.json", "a .safetensors file",
                 ".pt/.pth/.bin state dict", "torch.load(weights_only=True)"):
        assert form in ckpt, form
    assert "CUDA_VISIBLE_DEVICES" in flat[flat.index("--device {"):flat.index("--dtype {")]


@pytest.mark.parametrize("spec,name", [
    ("/runs/v5/drafter", "v5/drafter"), ("/runs/v5/drafter/", "v5/drafter"), ("/runs/my-drafter-v5", "my-drafter-v5"),
    ("/runs/step4000/model.safetensors", "step4000/model.safetensors"), ("/runs/v2/ckpt.pt", "v2/ckpt.pt"),
    ("/runs/v2/step_900.pt", "step_900.pt"), ("mine=/runs/v5/drafter", "mine")])
def test_default_drafter_labels(spec, name):
    assert ed.split_ckpt_spec(spec)[0] == name


def test_demo_label_and_chat_template_field(tmp_path, capsys):
    drafter = tmp_path / "run7" / "drafter"
    shutil.copytree(os.path.join(DEMO, "drafter"), drafter)
    rc, report, out, _ = demo_run(tmp_path, capsys, "label", "--ckpt", str(drafter))
    assert rc == 0 and report["drafters"][0]["name"] == "run7/drafter"
    assert "== drafter run7/drafter:" in out and "drafter drafter" not in out
    config = report["config"]
    assert config["chat_template"] == "none in the tokenizer: plain text" and config["no_chat_template"] is False
    assert "chat_template_applied" not in config


def test_statistics_are_exact_fractions():
    """Accuracy and tau_all_anchors are counts divided in float64: 119/121, not float32's 0.98429751396..."""
    equal = torch.ones(121, 3, dtype=torch.bool)
    equal[:2, 0] = False
    equal[5:9, 2] = False
    matched = equal.long().cumprod(1).sum(1)
    res = ed.Result(rounds=[4, 1], ddtree_rounds={}, anchors=torch.arange(121), matched=matched, equal=equal)
    s = ed.summarize([res], 4)
    assert s["per_position"]["accuracy"] == [119 / 121, 1.0, 117 / 121]
    assert s["tau_all_anchors"] == 1 + int(matched.sum()) / 121
    assert s["per_position"]["acceptance"] == [119 / 121, 1.0, 115 / 119]


def test_ddtree_note_when_a_budget_is_below_the_chain(tmp_path, capsys):
    rc, report, out, _ = demo_run(tmp_path, capsys, "trees", "--ddtree-budgets", "2,32")
    assert rc == 0
    d = report["drafters"][0]
    below = [b for b, t in d["ddtree"].items() if t["tau"] < d["tau"]]
    assert ("below the chain" in out) is bool(below)
    d["ddtree"]["32"]["tau"] = d["tau"] - 0.01
    d["ddtree"]["2"]["tau"] = d["tau"] - 0.5
    text = io.StringIO()
    ed.print_report(report, text)
    note = [line for line in text.getvalue().splitlines() if "below the chain" in line]
    assert len(note) == 1 and "budget 2, 32 below the chain" in note[0] and "depth-7 path" in note[0]
