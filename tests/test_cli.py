"""eval_drafter.py as a command: bad inputs, the JSON report end to end, and the real Qwen3 chat template."""
import collections
import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

import eval_drafter as ed
from conftest import IM_START, ROOT, make_drafter, md, write_jsonl


def run_main(argv, capsys):
    rc = ed.main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_error_line(err, fragment):
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert len(lines) == 1, f"expected one stderr line, got: {err!r}"
    assert lines[0].startswith("error:")
    assert fragment in lines[0], lines[0]


# ----------------------------------------------------------------------------------------------------
# 1. Bad inputs: one "error:" line on stderr, exit code 2, no traceback


@pytest.fixture()
def env(tmp_path, tiny_target, drafter_a):
    prompts = write_jsonl(tmp_path / "ok.jsonl", [{"prompt": "w1 w2 w3"}])
    return {"tmp": tmp_path, "target": tiny_target["path"], "cfg": tiny_target["cfg"], "ckpt": drafter_a,
            "prompts": prompts}


def base_argv(e, **over):
    args = {"--target": e["target"], "--ckpt": e["ckpt"], "--prompts": e["prompts"]}
    args.update(over)
    argv = [x for k, v in args.items() for x in (k, v)]
    return argv + ["--quiet", "--max-new-tokens", "8"]


def broken_drafter(e, mutate, **over):
    return make_drafter(e["tmp"] / "broken", e["cfg"], mutate=mutate, **over)


def _drop_dflash_keys(cfg, w):
    del cfg["block_size"], cfg["dflash_config"]


def _set_mask(value):
    def mutate(cfg, w):
        cfg["dflash_config"]["mask_token_id"] = value
    return mutate


BAD_INPUTS = {
    "missing_target": (lambda e: base_argv(e, **{"--target": str(e["tmp"] / "nope")}),
                       "target directory not found"),
    "missing_ckpt": (lambda e: base_argv(e, **{"--ckpt": str(e["tmp"] / "nope")}),
                     "drafter checkpoint not found"),
    "missing_prompts": (lambda e: base_argv(e, **{"--prompts": str(e["tmp"] / "nope.jsonl")}),
                        "prompts file not found"),
    "bad_json_line": (lambda e: base_argv(e, **{"--prompts": write_jsonl(
        e["tmp"] / "p.jsonl", [{"prompt": "w1"}, "{not json", {"prompt": "w2"}])}), "line 2, column 2: not valid JSON"),
    "no_prompt_field": (lambda e: base_argv(e, **{"--prompts": write_jsonl(
        e["tmp"] / "p.jsonl", [{"prompt": "w1"}, {"query": "w2"}])}), "line 2: no prompt field"),
    "not_dflash_config": (lambda e: base_argv(e, **{"--ckpt": broken_drafter(e, _drop_dflash_keys)}),
                          "neither block_size nor dflash_config"),
    "target_as_ckpt": (lambda e: base_argv(e, **{"--ckpt": e["target"]}),
                       "is a qwen3 target model, not a drafter, and its checkpoint has no MTP layer"),
    "no_fc_weight": (lambda e: base_argv(e, **{"--ckpt": broken_drafter(e, lambda c, w: w.pop("fc.weight"))}),
                     "no fc.weight"),
    "layers_count": (lambda e: base_argv(e, **{"--layers": "1,3"}),
                     "fc expects 3 feature layers, --layers gives 2"),
    "hidden_mismatch": (lambda e: base_argv(e, **{"--ckpt": make_drafter(
        e["tmp"] / "h32", md.target_config(64, hidden_size=32))}), "hidden size 32 but the target has 64"),
    "layer_out_of_range": (lambda e: base_argv(e, **{"--layers": "1,3,6"}),
                           "layer id 6 is outside the target's 6 layers"),
    "mask_outside_vocab": (lambda e: base_argv(e, **{"--ckpt": broken_drafter(e, _set_mask(64))}),
                           "mask_token_id 64 is outside the target vocab (64)"),
    "block_size_1": (lambda e: base_argv(e, **{"--block-size": "1"}), "--block-size 1: must be at least 2 (a block needs the anchor"),
    "device_cuda": (lambda e: base_argv(e, **{"--device": "cuda"}), "--device cuda was asked for"),
    "device_map_on_cpu": (lambda e: base_argv(e, **{"--device-map": "auto"}),
                          "--device-map auto spreads the target over GPUs, but this run is on the CPU"),
    "max_memory_zero": (lambda e: base_argv(e, **{"--max-memory-gb": "0"}), "--max-memory-gb 0.0: must be a finite number above 0"),
    "layers_not_ints": (lambda e: base_argv(e, **{"--layers": "1,x,3"}), "--layers must be comma-separated"),
    # A malformed chat turn is bad input like any other: it must name the line, not raise a KeyError.
    "message_without_content": (lambda e: base_argv(e, **{"--prompts": write_jsonl(
        e["tmp"] / "p.jsonl", [{"prompt": "w1"}, {"messages": [{"role": "user"}]}])}), "line 2"),
}


def test_device_map_without_accelerate(env, capsys, monkeypatch):
    """On a GPU box without accelerate, --device-map auto stops before loading, naming the package."""
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(ed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find_spec(name, *a))
    rc, out, err = run_main(base_argv(env, **{"--device-map": "auto"}), capsys)
    assert rc == 2
    assert_one_error_line(err, "--device-map auto needs the accelerate package")


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2(case, env, capsys):
    assert not ed.torch.cuda.is_available()  # the cuda case relies on this box having none
    make_argv, fragment = BAD_INPUTS[case]
    argv = make_argv(env)
    rc, out, err = run_main(argv, capsys)
    assert rc == 2
    assert_one_error_line(err, fragment)


def test_bad_input_real_process(env):
    bad = write_jsonl(env["tmp"] / "p.jsonl", [{"prompt": "w1"}, {"prompt": "w2"}, "[1, 2"])
    proc = subprocess.run([sys.executable, "eval_drafter.py"] + base_argv(env, **{"--prompts": bad}),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, "line 3, column 6: not valid JSON")


# ----------------------------------------------------------------------------------------------------
# 2. End to end on the tiny pair, two drafters, every prompt format

CONV_ANSWER = " ".join(f"w{i}" for i in (17, 30, 2, 41, 8, 8, 55, 23, 1, 9, 40, 12, 33, 5, 6, 7, 19, 28, 44, 50))
COMPLETION_IDS = [4 + (7 * i) % 60 for i in range(20)]
E2E_ROWS = [
    {"id": "p-prompt", "split": "train", "prompt": "w1 w2 w3 w4"},
    {"id": "p-messages", "split": "train",
     "messages": [{"role": "system", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9"}]},
    {"id": "p-turns", "split": "fresh", "turns": ["w10 w11 w12", "w13 w14"]},
    {"id": "p-conv", "split": "fresh", "conversations": [   # earlier turns are prompt, the LAST gpt turn is the reference
        {"from": "human", "value": "w14 w15 w16"}, {"from": "gpt", "value": "w3 w4"},
        {"from": "human", "value": "w18"}, {"from": "gpt", "value": CONV_ANSWER}]},
    {"id": "p-ids", "split": "fresh", "prompt": "w20 w21", "completion_ids": COMPLETION_IDS},
]
# The word tokenizer has no chat template, so prompts are the contents joined by newlines, one id per word.
PROMPT_TOKENS = {"p-prompt": 4, "p-messages": 5, "p-turns": 3, "p-conv": 6, "p-ids": 2}  # turns: the first turn
COMPLETION_TOKENS = {"p-prompt": 24, "p-messages": 24, "p-turns": 24, "p-conv": 20, "p-ids": 20}
MAX_NEW = 24


def e2e_argv(tmp, tiny_target, drafter_a, drafter_b, *extra):
    prompts = write_jsonl(tmp / "prompts.jsonl", E2E_ROWS)
    return ["--target", tiny_target["path"], "--ckpt", f"a={drafter_a}", "--ckpt", f"b={drafter_b}",
            "--prompts", prompts, "--max-new-tokens", str(MAX_NEW), "--ignore-eos", "--quiet",
            "--output", str(tmp / "out.json"), "--threads", "1", *extra]


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, tiny_target, drafter_a, drafter_b):
    """One real process run: exit code, stdout report and the JSON file."""
    tmp = tmp_path_factory.mktemp("e2e")
    proc = subprocess.run([sys.executable, "eval_drafter.py", *e2e_argv(tmp, tiny_target, drafter_a, drafter_b)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(tmp / "out.json", encoding="utf-8") as f:
        return {"proc": proc, "report": json.load(f)}


def test_e2e_config_echo(e2e, drafter_a, drafter_b):
    cfg = e2e["report"]["config"]
    assert cfg["device"] == "cpu" and cfg["dtype"] == "float32"
    assert cfg["block_mask"] == "auto" and cfg["sliding_window"] == "train"
    assert cfg["max_new_tokens"] == MAX_NEW and cfg["ignore_eos"] is True
    assert cfg["ckpt"] == [f"a={drafter_a}", f"b={drafter_b}"] and cfg["threads"] == 1
    assert cfg["layers"] is None and cfg["block_size"] is None
    assert e2e["report"]["target"]["device"] == "cpu" and e2e["report"]["target"]["dtype"] == "float32"


def test_e2e_drafter_identity(e2e):
    a, b = e2e["report"]["drafters"]
    assert (a["name"], a["block_size"], a["layers"], a["mask_token_id"]) == ("a", 8, [1, 3, 4], md.MASK_ID)
    assert (b["name"], b["block_size"], b["layers"]) == ("b", 6, [0, 5])
    # Demo layout: layer 0 sliding (window 32) -> causal with window; layer 1 full -> bidirectional.
    assert a["block_mask"] == ["causal, window 32", "bidirectional"]
    assert b["block_mask"] == ["causal, window 32", "bidirectional"]


def test_e2e_prompt_entries(e2e):
    for d in e2e["report"]["drafters"]:
        got = {(p["id"], p.get("turn", 1)): p for p in d["prompts"]}
        assert list(got) == [(r["id"], 1) for r in E2E_ROWS[:3]] + [("p-turns", 2)] + [(r["id"], 1) for r in E2E_ROWS[3:]]
        # The second turn's prompt: the first turn, the target's reply to it (special tokens dropped, so up to
        # its length), the second turn; test_large_runs checks it token for token.
        assert 3 + 2 < got["p-turns", 2]["prompt_tokens"] <= 3 + COMPLETION_TOKENS["p-turns"] + 2
        for (pid, turn), p in got.items():
            if turn == 1:
                assert p["prompt_tokens"] == PROMPT_TOKENS[pid], pid
            assert p["completion_tokens"] == COMPLETION_TOKENS[pid], pid
            assert p["reference_generated"] == (pid not in ("p-conv", "p-ids"))
            if p["reference_generated"]:
                assert p["target_agreement"] == 1.0, pid  # the target's own greedy output
            # The walk covers the completion up to the last full block: C - B + 1 <= sum <= C.
            assert COMPLETION_TOKENS[pid] - d["block_size"] + 1 <= sum(p["rounds"]) <= COMPLETION_TOKENS[pid]
            assert all(1 <= r <= d["block_size"] for r in p["rounds"])
            if p["rounds"]:
                assert p["tau"] == pytest.approx(sum(p["rounds"]) / len(p["rounds"]))
        assert {p["split"] for p in d["prompts"]} == {"train", "fresh"}


def test_e2e_target_agreement_is_token_weighted(e2e):
    p = e2e["report"]["drafters"][0]["prompts"]
    weighted = sum(x["target_agreement"] * x["completion_tokens"] for x in p) / sum(x["completion_tokens"] for x in p)
    assert e2e["report"]["target"]["agreement"] == pytest.approx(weighted)


def test_e2e_summaries_recomputed_from_prompts(e2e):
    for d in e2e["report"]["drafters"]:
        B = d["block_size"]
        rounds = [r for p in d["prompts"] for r in p["rounds"]]
        assert d["rounds"] == len(rounds)
        assert d["tau"] == pytest.approx(sum(rounds) / len(rounds))
        per_prompt = [sum(p["rounds"]) / len(p["rounds"]) for p in d["prompts"] if p["rounds"]]
        assert d["tau_prompt_mean"] == pytest.approx(sum(per_prompt) / len(per_prompt))
        assert d["tau_all_anchors"] is not None and 1.0 <= d["tau_all_anchors"] <= B
        assert d["anchors"] == sum(max(0, p["completion_tokens"] - B + 1) for p in d["prompts"])
        assert len(d["per_position"]["acceptance"]) == B - 1 and len(d["per_position"]["accuracy"]) == B - 1
        counts = collections.Counter(rounds)
        assert d["histogram"] == [counts.get(n, 0) for n in range(1, B + 1)]
        assert sum(d["histogram"]) == d["rounds"]
        assert set(d["splits"]) == {"train", "fresh"}
        for split, s in d["splits"].items():
            sr = [r for p in d["prompts"] if p["split"] == split for r in p["rounds"]]
            assert s["rounds"] == len(sr)
            assert s["tau"] == pytest.approx(sum(sr) / len(sr))
            assert sum(s["histogram"]) == len(sr)


def test_e2e_stdout_names_both_drafters(e2e):
    out = e2e["proc"].stdout
    assert "== drafter a:" in out and "== drafter b:" in out
    assert "target agreement" in out


@pytest.fixture(scope="module")
def limited_run(tmp_path_factory, tiny_target, drafter_a, drafter_b):
    """In-process run with --limit 2, stdout redirected the way a caller of main() would."""
    tmp = tmp_path_factory.mktemp("limit")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = ed.main(e2e_argv(tmp, tiny_target, drafter_a, drafter_b, "--limit", "2"))
    with open(tmp / "out.json", encoding="utf-8") as f:
        return {"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "report": json.load(f)}


def test_limit_evaluates_first_n(limited_run):
    assert limited_run["rc"] == 0
    assert limited_run["report"]["target"]["agreement"] == 1.0   # only generated references here
    for d in limited_run["report"]["drafters"]:
        assert [p["id"] for p in d["prompts"]] == ["p-prompt", "p-messages"]
        assert set(d["splits"]) == {"train"}


def test_limit_matches_full_run(limited_run, e2e):
    # Per-prompt results do not depend on which other prompts were evaluated.
    for d_lim, d_full in zip(limited_run["report"]["drafters"], e2e["report"]["drafters"]):
        assert [p["rounds"] for p in d_lim["prompts"]] == [p["rounds"] for p in d_full["prompts"][:2]]


def test_max_memory_gb_sets_chunks_not_results(tmp_path, tiny_target, drafter_a, drafter_b, limited_run, monkeypatch):
    """A tiny --max-memory-gb makes the lm_head run 16 rows at a time (the floor); every number stays the same."""
    loaded, load = [], ed.load_drafter
    monkeypatch.setattr(ed, "load_drafter", lambda *a: loaded.append(load(*a)) or loaded[-1])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = ed.main(e2e_argv(tmp_path, tiny_target, drafter_a, drafter_b, "--limit", "2", "--max-memory-gb", "1e-9"))
    assert rc == 0 and [d.logit_rows for d in loaded] == [16, 16]
    with open(tmp_path / "out.json", encoding="utf-8") as f:
        report = json.load(f)
    assert report["config"]["max_memory_gb"] == 1e-9
    assert limited_run["report"]["config"]["max_memory_gb"] == 0.5
    for small, default in zip(report["drafters"], limited_run["report"]["drafters"]):
        assert {k: v for k, v in small.items() if k != "checkpoint"} == \
            {k: v for k, v in default.items() if k != "checkpoint"}


def test_report_goes_to_current_stdout(limited_run):
    # main() called in-process with sys.stdout redirected must print its report there.
    assert "== drafter a:" in limited_run["out"], "report did not reach the redirected sys.stdout"


def test_reference_shorter_than_block_gives_no_rounds(tmp_path, tiny_target, drafter_a, capsys):
    """A completion with fewer than B - 1 tokens (early EOS, small --max-new-tokens) has no full block."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "gen", "prompt": "w1 w2 w3"},
                                                 {"id": "given", "prompt": "w4 w5", "completion_ids": [9, 10]},
                                                 {"id": "long", "prompt": "w6", "completion_ids": list(range(4, 24))}])
    rc, out, err = run_main(["--target", tiny_target["path"], "--ckpt", f"a={drafter_a}", "--prompts", prompts,
                             "--max-new-tokens", "3", "--ignore-eos", "--quiet",
                             "--output", str(tmp_path / "o.json")], capsys)
    assert rc == 0, err
    with open(tmp_path / "o.json", encoding="utf-8") as f:
        (d,) = json.load(f)["drafters"]
    short = {p["id"]: p for p in d["prompts"]}
    assert short["gen"]["completion_tokens"] == 3 and short["given"]["completion_tokens"] == 2
    for pid in ("gen", "given"):
        assert short[pid]["rounds"] == [] and short[pid]["tau"] is None
    assert d["rounds"] == len(short["long"]["rounds"]) > 0     # the long prompt alone sets tau


@pytest.mark.parametrize("second_block", [8, 6], ids=["same_block_size", "other_block_size"])
def test_same_basename_drafters_stay_apart(tmp_path, tiny_target, drafter_a, second_block, capsys):
    """Two checkpoints that share a directory name (run1/ckpt, run2/ckpt) must not pool their results.

    The second drafter differs from drafter_a in its weights, and in its block size when second_block is 6.
    """
    other = make_drafter(tmp_path / "run2" / "ckpt", tiny_target["cfg"], block_size=second_block, seed=7)
    assert os.path.basename(drafter_a) == os.path.basename(other)
    prompts = write_jsonl(tmp_path / "p.jsonl", E2E_ROWS[:2])
    rc, out, err = run_main(["--target", tiny_target["path"], "--ckpt", drafter_a, "--ckpt", other,
                             "--prompts", prompts, "--max-new-tokens", "16", "--ignore-eos", "--quiet",
                             "--output", str(tmp_path / "o.json")], capsys)
    if rc == 2:  # refusing the clash is fine, if it says so
        assert_one_error_line(err, "ckpt")
        return
    assert rc == 0, err
    with open(tmp_path / "o.json", encoding="utf-8") as f:
        drafters = json.load(f)["drafters"]
    for d in drafters:
        assert len(d["prompts"]) == 2
        assert d["rounds"] == sum(len(p["rounds"]) for p in d["prompts"]), "summary pools another drafter's rounds"
    assert drafters[0]["name"] != drafters[1]["name"]


# ----------------------------------------------------------------------------------------------------
# 3. The real Qwen3 tokenizer and chat template

QWEN_MESSAGES = [{"role": "user", "content": "Write a haiku about tests."}]
GEN_PROMPT = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"


def encode(qwen_target, messages, **settings):
    s = {"no_chat_template": False, "enable_thinking": False, "quiet": True, **settings}
    items = [ed.Prompt(id="x", messages=messages)]
    s["chat_template"] = ed.encode_prompts(qwen_target["tokenizer"], items, ed.Settings(**s))
    return items[0].prompt_ids, s


def test_qwen_template_without_thinking(qwen_target):
    ids, s = encode(qwen_target, QWEN_MESSAGES, enable_thinking=False)
    text = qwen_target["tokenizer"].decode(ids)
    assert text == "<|im_start|>user\nWrite a haiku about tests.<|im_end|>\n" + GEN_PROMPT + EMPTY_THINK
    assert s["chat_template"] == "applied"
    assert ids[0] == IM_START and ids.count(IM_START) == 2   # one special id per turn, never split into pieces
    assert qwen_target["tokenizer"].convert_ids_to_tokens(IM_START) == "<|im_start|>"


def test_qwen_template_with_thinking(qwen_target):
    ids, _ = encode(qwen_target, QWEN_MESSAGES, enable_thinking=True)
    text = qwen_target["tokenizer"].decode(ids)
    assert text.endswith("<|im_end|>\n" + GEN_PROMPT)
    assert "<think>" not in text


def test_qwen_no_chat_template(qwen_target):
    ids, s = encode(qwen_target, QWEN_MESSAGES, no_chat_template=True)
    tok = qwen_target["tokenizer"]
    assert s["chat_template"] == "off"
    assert IM_START not in ids
    assert tok.decode(ids) == "Write a haiku about tests."
    assert ids == tok.encode("Write a haiku about tests.", add_special_tokens=False)


def test_qwen_cli_end_to_end(tmp_path, qwen_target, capsys):
    def mutate(cfg, w):
        cfg["dflash_config"]["mask_token_id"] = 151669   # first id past the tokenizer, inside the model vocab

    ckpt = make_drafter(tmp_path / "qd", qwen_target["cfg"], layer_ids=(0,), block_size=4, intermediate_size=32,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, mutate=mutate)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "q", "messages": QWEN_MESSAGES}])
    rc, out, err = run_main(["--target", qwen_target["path"], "--ckpt", f"q={ckpt}", "--prompts", prompts,
                             "--max-new-tokens", "8", "--quiet", "--output", str(tmp_path / "o.json")], capsys)
    assert rc == 0, err
    with open(tmp_path / "o.json", encoding="utf-8") as f:
        report = json.load(f)
    tok = qwen_target["tokenizer"]
    # tokenize=True returns a list in transformers 4.x and a BatchEncoding in 5.x: tokenize the text instead.
    text = tok.apply_chat_template(QWEN_MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    expected = tok(text, add_special_tokens=False)["input_ids"]
    (d,) = report["drafters"]
    assert report["config"]["chat_template"] == "applied"
    assert d["prompts"][0]["prompt_tokens"] == len(expected)
    assert 1 <= d["prompts"][0]["completion_tokens"] <= 8
    assert d["layers"] == [0] and d["mask_token_id"] == 151669
