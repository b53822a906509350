"""The tool's rounds against an engine that serves the drafter: the groundwork of holding served acceptance against the
exact figures.

tests/spec_engine.py decodes the demo pair by real online speculative decoding, one request at a time, and keeps the
drafts each verify step accepted, as vLLM 0.33 and SGLang 0.5.23 report them per request. Served by a correctly
configured engine, greedy, the tool's rounds for the engine's own text (fetched by --server) are the engine's verify
steps, one for one, up to the last steps the tool leaves unscored (a block that would pass the reply's end), at the
trained depth and at a served depth K (--depths K against an engine verifying K drafts). An engine that feeds the
drafter another mask token or other layers draws other rounds from the same text: the comparison sees it.
"""
import json
import re

import pytest
from transformers import AutoTokenizer

import eval_drafter as ed
from spec_engine import TARGET, load_demo, start_engine

N_NEW, LIMIT = 40, 6
BASE = ["--demo", "--limit", str(LIMIT), "--max-new-tokens", str(N_NEW), "--ignore-eos", "--ddtree-budgets", "none",
        "--quiet"]


@pytest.fixture(scope="module")
def engine():
    model, drafter, _ = load_demo()
    srv = start_engine(model, drafter)
    decode, srv.steps = srv.decode, {}

    def keeping(prompt, *args):   # each request's verify steps, by its prompt (two demo prompts share a reply)
        out, finish, steps = decode(prompt, *args)
        srv.steps[tuple(prompt)] = steps
        return out, finish, steps
    srv.decode = keeping
    tok = AutoTokenizer.from_pretrained(TARGET)
    srv.tokenize = lambda text: tok(text)["input_ids"]
    yield srv
    srv.shutdown()


def served(engine, tmp_path, api, *extra, **serving):
    """The tool's report on the engine's own text, and the engine's (completion, accepted drafts per verify step) for
    each of the report's prompts (the references --save-references kept say which prompt is whose: the demo's are
    plain text, no chat template)."""
    engine.reset(**serving)
    engine.steps.clear()
    here = tmp_path / f"run{len(list(tmp_path.iterdir()))}"   # a fresh folder: nothing saved is reused
    here.mkdir()
    out, refs = here / "out.json", here / "refs.jsonl"
    server = ["--server", engine.url] + (["--server-api", "openai", "--server-model", "demo"] if api == "openai" else [])
    assert ed.main(BASE + server + list(extra) + ["--save-references", str(refs), "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    kept = {r["id"]: r for r in map(json.loads, refs.read_text().splitlines())}
    return report, [(kept[p["id"]]["completion_ids"], engine.steps[tuple(engine.tokenize(kept[p["id"]]["prompt"]))])
                    for p in report["drafters"][0]["prompts"]]


def held(rounds, completion, steps, block):
    """The tool's rounds equal the engine's first verify steps (accepted drafts + 1), and the steps after them commit
    only the tokens the tool leaves unscored: a round is scored while its drafts lie inside the reply (its bonus token
    may fall past the end: -1 left), so fewer than a block's drafts are left to the engine's last steps."""
    assert [j + 1 for j in steps[:len(rounds)]] == rounds
    left = len(completion) - 1 - sum(rounds)   # the prefill's token, then the scored rounds
    assert -1 <= left < block - 1 and (left <= 0) == (len(steps) == len(rounds))


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_the_tools_rounds_are_the_engines_verify_steps(engine, tmp_path, api):
    report, by_request = served(engine, tmp_path, api)
    d = report["drafters"][0]
    assert len(d["prompts"]) == LIMIT == len(by_request)
    for p, (completion, steps) in zip(d["prompts"], by_request):
        assert p["completion_tokens"] == len(completion)
        held(p["rounds"], completion, steps, d["block_size"])
    assert any(r < d["block_size"] for p in d["prompts"] for r in p["rounds"]), "every draft accepted: a weak test"


def test_at_a_served_depth(engine, tmp_path):
    """An engine verifying K = 3 drafts a round (a block of 1 + 3, as vLLM runs DFlash at num_speculative_tokens 3):
    the tool's --depths 3 rounds are its steps."""
    report, by_request = served(engine, tmp_path, "sglang", "--depths", "3", k=3)
    for p, (completion, steps) in zip(report["drafters"][0]["prompts"], by_request):
        assert max(steps) <= 3
        held(p["depth_rounds"]["3"], completion, steps, 4)


@pytest.mark.parametrize("serving", [{"mask_token_id": 7}, {"layers": [4, 3, 1]}], ids=["mask_token", "layers"])
def test_a_misconfigured_engine_draws_other_rounds(engine, tmp_path, serving):
    """Another mask token or other feature layers in the engine: the same greedy text (references equal), other verify
    steps, fewer drafts accepted than the tool's exact rounds say the drafter earns."""
    report, by_request = served(engine, tmp_path, "sglang", **serving)
    prompts = report["drafters"][0]["prompts"]
    differ = [p["id"] for p, (_, steps) in zip(prompts, by_request)
              if [j + 1 for j in steps[:len(p["rounds"])]] != p["rounds"]]
    assert len(differ) >= LIMIT // 2, differ
    exact = sum(sum(p["rounds"]) for p in prompts) / sum(len(p["rounds"]) for p in prompts)
    engine_tau = 1 + sum(sum(s) for _, s in by_request) / sum(len(s) for _, s in by_request)
    assert engine_tau < exact - 0.5


# ----------------------------------------------------------------------------------------------------
# Issue 43 (work in progress): the tool reads the engine's own figures and holds them against the exact rounds


def served_summary(engine, tmp_path, api, *extra, **serving):
    report, _ = served(engine, tmp_path, api, *extra, **serving)
    d = report["drafters"][0]
    return d["served"], d["prompts"]


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_a_correct_engine_is_held_equal(engine, tmp_path, api):
    s, prompts = served_summary(engine, tmp_path, api)
    assert s["engine"] == ("sglang" if api == "sglang" else "vllm") and s["k"] == [7]
    assert s["requests"] == s["compared"] == s["equal"] == LIMIT
    assert s["causes"] == ["none: every served verify step is the exact round on the same text"]
    assert all(p["served"]["equal"] for p in prompts)
    if api == "openai":   # vLLM gives its figures for one-prompt requests only: one prompt a request after the probe
        assert all(len(r["body"]["prompt"]) == 1 for r in engine.requests)


def test_another_depth_is_named_then_held(engine, tmp_path):
    s, _ = served_summary(engine, tmp_path, "sglang", k=3)
    assert s["compared"] == 0 and "add --depths 3" in s["causes"][0]
    s, _ = served_summary(engine, tmp_path, "sglang", "--depths", "3", k=3)
    assert s["equal"] == LIMIT and s["causes"][0].startswith("none")


@pytest.mark.parametrize("serving, named", [
    ({"layers": [0, 2, 3]}, "layers [0, 2, 3]"), ({"layers": [4, 3, 1]}, "layers [4, 3, 1]"),
    ({"mask_token_id": 0}, "mask token 0 (the target's pad_token_id)")], ids=["layers_one_lower", "reversed", "pad"])
def test_the_engines_other_inputs_are_named(engine, tmp_path, serving, named):
    """An engine reading the layer ids one lower (hidden_states indices as layer outputs), in reverse order, or the pad
    token as its mask: the run redrafts the requests that differ with each suspect and names the one whose rounds are
    the engine's steps, in every such request."""
    s, prompts = served_summary(engine, tmp_path, "openai", **serving)
    differ = [p for p in prompts if p["served"]["equal"] is False]
    assert differ and s["equal"] == LIMIT - len(differ)
    assert all(named in p["served"]["suspects"] for p in differ), [p["served"].get("suspects") for p in differ]
    assert f"the engine's drafter gets {named}: with it this run's rounds are the served steps but where its own " \
           f"near-ties decide, in {len(differ)} of {len(differ)} requests that differ so" in s["causes"], s["causes"]
    assert s["gap"] < 0 and s["gap_ci95"][0] < s["gap"] < s["gap_ci95"][1]


def test_an_input_no_suspect_explains_is_said_plainly(engine, tmp_path):
    s, prompts = served_summary(engine, tmp_path, "openai", mask_token_id=7)
    assert s["equal"] < LIMIT // 2 and s["gap"] < -0.5
    assert all(p["served"]["suspects"] == [] for p in prompts if p["served"]["equal"] is False)
    assert "none of the neighbouring layer ids, their reverse order or the configs' and tokenizer's other token ids " \
           "reproduce them" in s["causes"][-1]


def test_saved_served_lines_give_the_same_report_without_the_server(engine, tmp_path):
    report, _ = served(engine, tmp_path, "openai", mask_token_id=7)
    refs = tmp_path / "run0" / "refs.jsonl"
    assert all("served" in json.loads(line) for line in refs.read_text().splitlines())
    out = tmp_path / "again.json"
    assert ed.main(["--demo", "--prompts", str(refs), "--max-new-tokens", str(N_NEW), "--ignore-eos",
                    "--ddtree-budgets", "none", "--quiet", "--output", str(out)]) == 0
    again = json.loads(out.read_text())["drafters"][0]
    assert again["served"] == report["drafters"][0]["served"]


def test_a_served_file_gives_the_report_of_the_server(engine, tmp_path):
    """--served FILE: the engine's own replies saved a line each (vLLM's, with return_token_ids) give the report
    --server gives on the same requests, with no server."""
    import urllib.request
    report, _ = served(engine, tmp_path, "openai", mask_token_id=7)
    rows = [json.loads(line) for line in open(f"{ed.DEMO_DIR}/prompts.jsonl", encoding="utf-8")][:LIMIT]
    lines = []
    for r in reversed(rows):   # any order: a line is its prompt's by the prompt ids it carries
        body = {"model": "demo", "prompt": [engine.tokenize(r["prompt"])], "max_tokens": N_NEW, "ignore_eos": True,
                "temperature": 0, "return_token_ids": True}
        request = urllib.request.Request(engine.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        lines.append(urllib.request.urlopen(request).read().decode())
    (tmp_path / "served.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "file.json"
    assert ed.main(BASE + ["--served", str(tmp_path / "served.jsonl"), "--output", str(out)]) == 0
    got, want = json.loads(out.read_text())["drafters"][0], report["drafters"][0]
    assert got["served"] == want["served"] and got["served"]["equal"] == 0
    assert [p["rounds"] for p in got["prompts"]] == [p["rounds"] for p in want["prompts"]]


@pytest.mark.parametrize("serving", [{}, {"mask_token_id": 7}], ids=["correct", "mask_token"])
def test_sampled_requests_are_held_to_the_exact_expectation(engine, tmp_path, serving):
    """Sampled drafts (the public loop's policy), 150 requests: a correct engine's accepted drafts lie within 3 standard
    errors of the exact expectation on the texts it served, pooled (a z-score summed step by step: each step's count
    depends on its anchor alone), and per request at the rate chance gives; an engine with another mask token does
    not."""
    report, _ = served(engine, tmp_path, "openai", "--temperature", "0.8", "--draft-policy", "sample",
                       "--samples-per-prompt", "15", "--limit", "10", "--max-new-tokens", "24", **serving)
    s = report["drafters"][0]["served"]
    assert s["requests"] == s["compared"] == 150
    if not serving:
        assert abs(s["z"]) <= 3 and s["beyond_3se"] <= 3 and s["causes"][-1].startswith("none: ")
        assert s["gap_ci95"][0] <= 0 <= s["gap_ci95"][1]
    else:
        assert s["z"] < -3 and "below the exact expectation" in s["causes"][-1]


def test_thinking_on_against_off_is_named(engine, tmp_path):
    """The engine's prompts rendered by the real Qwen3 chat template with thinking on, this run's with it off (the
    default): the --served lines, matched by id, carry other prompt ids; the run names the flag that gives the engine's
    prompts, and with it every request is held equal."""
    import shutil
    import urllib.request
    from conftest import qwen_tokenizer_dir
    target = tmp_path / "target"
    shutil.copytree(TARGET, target)
    template = json.load(open(f"{qwen_tokenizer_dir()}/tokenizer_config.json"))["chat_template"]
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    tok = AutoTokenizer.from_pretrained(str(target))
    engine.reset()
    lines = []
    for r in [json.loads(line) for line in open(f"{ed.DEMO_DIR}/prompts.jsonl", encoding="utf-8")][:LIMIT]:
        prompt = tok(tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=True))["input_ids"]
        body = {"model": "demo", "prompt": [prompt], "max_tokens": N_NEW, "ignore_eos": True, "temperature": 0,
                "return_token_ids": True}
        request = urllib.request.Request(engine.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        lines.append(json.dumps({**json.loads(urllib.request.urlopen(request).read()), "prompt_id": r["id"]}))
    (tmp_path / "served.jsonl").write_text("\n".join(lines) + "\n")
    reports = []
    for extra in ([], ["--enable-thinking"]):
        out = tmp_path / f"out{len(reports)}.json"
        assert ed.main(BASE + ["--target", str(target), "--served", str(tmp_path / "served.jsonl"), "--output",
                               str(out)] + extra) == 0
        reports.append(json.loads(out.read_text())["drafters"][0]["served"])
    off, on = reports
    assert f"{LIMIT} of {LIMIT} requests were served another prompt than this run's" in off["causes"][0]
    assert "this run with --enable-thinking gives the engine's prompt ids" in off["causes"][0]
    assert on["equal"] == on["compared"] == LIMIT and on["causes"] == [
        "none: every served verify step is the exact round on the same text"]


def test_a_gap_that_grows_with_the_context_is_named(engine, tmp_path):
    """An engine that feeds the drafter past 24 tokens the features of the last 3 only: the early rounds of each reply are the exact
    ones, the later ones fall short; the run names a gap that grows along the replies, with both halves' figures."""
    s, prompts = served_summary(engine, tmp_path, "openai", context=24)
    grows = [c for c in s["causes"] if c.startswith("the gap grows along the replies")]
    assert grows, s["causes"]
    early, late = (float(x) for x in re.findall(r"([+-]\d\.\d\d) in their", grows[0]))
    assert late < early - 0.5
    s, _ = served_summary(engine, tmp_path, "openai")
    assert not any("grows" in c for c in s["causes"])


def test_sampled_counts_alone_are_said_to_hold_nothing(engine, tmp_path):
    """SGLang's figures are counts: with sampled drafts they cannot place the engine's steps on the text, and the run
    says so instead of holding them."""
    report, _ = served(engine, tmp_path, "sglang", "--temperature", "0.8", "--draft-policy", "sample", "--limit", "2")
    s = report["drafters"][0]["served"]
    assert s["requests"] == 2 and s["compared"] == 0 and s["gap"] is None
    assert s["causes"] == ["no request is held: sampled drafts need the engine's steps one by one, which vLLM gives "
                           "with --per-request-spec-decode-metrics detailed (SGLang's figures are counts)"]


@pytest.mark.parametrize("matched_by", ["prompt ids", "request id"])
def test_sglang_replies_as_sglang_returns_them(engine, tmp_path, matched_by):
    """SGLang 0.5.23's /generate reply: the prompt ids only at the top level as `prompt_token_ids` (with
    return_prompt_token_ids), the request's id as `meta_info.id` (the `rid` a client sets). Saved a line each, either
    way they give the report --server gives on the same requests."""
    import urllib.request
    report, _ = served(engine, tmp_path, "sglang", mask_token_id=7)
    lines = []
    for r in [json.loads(line) for line in open(f"{ed.DEMO_DIR}/prompts.jsonl", encoding="utf-8")][:LIMIT]:
        prompt = engine.tokenize(r["prompt"])
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": N_NEW, "ignore_eos": True, "temperature": 0}}
        request = urllib.request.Request(engine.url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request).read())
        assert "input_ids" not in reply and "prompt_ids" not in reply
        if matched_by == "prompt ids":
            reply["prompt_token_ids"] = prompt
        else:
            reply["meta_info"]["id"] = r["id"]
        lines.append(json.dumps(reply))
    (tmp_path / "sglang.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "file.json"
    assert ed.main(BASE + ["--served", str(tmp_path / "sglang.jsonl"), "--output", str(out)]) == 0
    got, want = json.loads(out.read_text())["drafters"][0], report["drafters"][0]
    assert got["served"] == want["served"] and got["served"]["compared"] == LIMIT
    assert all(p["reference_source"] == "server" for p in got["prompts"])


def test_a_served_file_for_no_prompt_of_the_run_is_refused(tmp_path, capsys):
    from conftest import refused_in_one_line
    line = {"choices": [{"index": 0, "token_ids": [5, 6, 7], "prompt_token_ids": [9, 9, 9], "finish_reason": "length"}],
            "prompt_id": "another-prompt"}
    (tmp_path / "served.jsonl").write_text(json.dumps(line) + "\n")
    refused_in_one_line(capsys, BASE + ["--served", str(tmp_path / "served.jsonl")],
                        "none of its 1 replies is for a prompt of this run")


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_counts_alone_give_the_gap_steps_give(engine, tmp_path, api):
    """An engine whose figures are counts alone (SGLang's meta_info, vLLM's `summary`) against one giving its steps
    (vLLM's `detailed`), on the same requests to an engine feeding the layers one lower: over whole replies, the tail
    past the last full block scored too, both give the same served and exact tau and the same gap."""
    steps, _ = served_summary(engine, tmp_path, "openai", layers=[0, 2, 3])
    counts, _ = served_summary(engine, tmp_path, api, layers=[0, 2, 3], detailed=False)
    for key in ("tau_exact", "tau_served_scored", "gap", "gap_ci95", "steps"):
        assert counts[key] == steps[key], key
    assert steps["gap"] < -0.1 and "near_tie_steps" in steps and "near_tie_steps" not in counts
