"""Which target a drafter belongs to (issue 52): what a checkpoint records of its target (speculators' verifier
architectures and name, a model card's base_model, SpecForge's model provenance) is held against the target in the
run, and a mismatch is a warning on the drafter's line and in the JSON. Where the record agrees, or says nothing,
no warning is added (the wrong-drafter check stays the guard)."""
import hashlib
import json
import os
import shutil

import torch
from safetensors.torch import load_file

import eval_drafter as ed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures")
DEMO_TARGET, LLAMA_TARGET = os.path.join(FIX, "demo", "target"), os.path.join(FIX, "llama", "target")


def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(open(os.path.join(FIX, "demo", "prompts.jsonl")).readlines()[:2]))
    return str(path)


def warnings_of(tmp_path, ckpt, target=DEMO_TARGET, name="out"):
    out = tmp_path / f"{name}.json"
    assert ed.main(["--target", target, "--ckpt", f"d={ckpt}", "--prompts", prompts(tmp_path), "--quiet",
                    "--ddtree-budgets", "none", "--max-new-tokens", "32", "--output", str(out)]) == 0
    return json.loads(out.read_text())["drafters"][0]["warnings"]


def about_target(warnings):
    return [w for w in warnings if "names its target" in w or "trained for a" in w]


def with_verifier(tmp_path, name_or_path, archs=("Qwen3ForCausalLM",)):
    """The speculators DFlash fixture (trained on the demo target) with its verifier record replaced."""
    ckpt = tmp_path / "spec"
    shutil.copytree(os.path.join(FIX, "speculators", "dflash"), ckpt, dirs_exist_ok=True)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["speculators_config"]["verifier"] = {"name_or_path": name_or_path, "architectures": list(archs)}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return str(ckpt)


def test_a_llama_drafter_on_a_qwen_target_is_named(tmp_path, capsys):
    eagle = os.path.join(FIX, "llama", "eagle3")
    said = about_target(warnings_of(tmp_path, eagle))
    assert len(said) == 1 and "LlamaForCausalLM" in said[0] and "Qwen3ForCausalLM" in said[0]
    assert "speculators_config.verifier.architectures" in said[0]
    assert "trained for a LlamaForCausalLM" in capsys.readouterr().out   # on the drafter's line in the report
    assert about_target(warnings_of(tmp_path, eagle, LLAMA_TARGET, "own")) == []   # on its own target: nothing


def test_the_verifier_name_is_held_to_the_target(tmp_path):
    assert about_target(warnings_of(tmp_path, with_verifier(tmp_path, DEMO_TARGET))) == []
    other = about_target(warnings_of(tmp_path, with_verifier(tmp_path, LLAMA_TARGET), name="local"))
    assert len(other) == 1 and "whose config.json is not this target's" in other[0] and LLAMA_TARGET in other[0]
    hub = about_target(warnings_of(tmp_path, with_verifier(tmp_path, "Qwen/Qwen3-8B"), name="hub"))
    assert len(hub) == 1 and "Qwen/Qwen3-8B" in hub[0] and "if they are the same model, ignore this" in hub[0]
    # a hub name whose last part is the target directory's own name is taken as the same model
    assert about_target(warnings_of(tmp_path, with_verifier(tmp_path, "someone/target"), name="same")) == []


def test_a_model_card_base_model_is_read(tmp_path):
    ckpt = tmp_path / "card"
    shutil.copytree(os.path.join(FIX, "demo", "drafter"), ckpt)
    (ckpt / "README.md").write_text("---\nlicense: mit\nbase_model:\n- Qwen/Qwen3-4B\ntags:\n- dflash\n---\n# card\n")
    said = about_target(warnings_of(tmp_path, str(ckpt)))
    assert len(said) == 1 and "README.md base_model" in said[0] and "Qwen/Qwen3-4B" in said[0]
    (ckpt / "README.md").write_text("---\nbase_model: org/target\n---\n")
    assert about_target(warnings_of(tmp_path, str(ckpt), name="same")) == []


def test_specforge_provenance_is_held_to_the_target_config(tmp_path):
    """SpecForge's training_state.pt records its target as a directory with its config.json's sha256."""
    def step(target, name, recorded=None):   # recorded: the path it names (moved since, on another box)
        config = os.path.join(target, "config.json")
        digest = hashlib.sha256(open(config, "rb").read()).hexdigest()
        provenance = (("target_model", ("directory-stat-v2", recorded or target,
                                        (("sha256", "config.json", os.path.getsize(config), digest),))),
                      ("torch_dtype", "bfloat16"))
        where = tmp_path / name
        where.mkdir()
        shutil.copy(os.path.join(FIX, "demo", "drafter", "config.json"), where / "config.json")
        torch.save({"draft_state_dict": load_file(os.path.join(FIX, "demo", "drafter", "model.safetensors")),
                    "global_step": 10, "specforge_model_provenance": provenance}, where / "training_state.pt")
        return str(where)
    assert about_target(warnings_of(tmp_path, step(DEMO_TARGET, "own-step10"), name="own")) == []
    said = about_target(warnings_of(tmp_path, step(LLAMA_TARGET, "other-step10"), name="other"))
    assert len(said) == 1 and "SpecForge training state" in said[0] and "config.json is not this target's" in said[0]
    gone = "/gone/elsewhere/target"   # the directory is not here: its config.json's sha256 decides
    assert about_target(warnings_of(tmp_path, step(DEMO_TARGET, "moved-step10", gone), name="moved")) == []
    said = about_target(warnings_of(tmp_path, step(LLAMA_TARGET, "moved-other-step10", gone), name="moved-other"))
    assert len(said) == 1 and "sha256" in said[0] and gone in said[0]


def test_demo_with_another_target_names_the_replacement(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert ed.main(["--demo", "--target", LLAMA_TARGET, "--prompts", prompts(tmp_path), "--ddtree-budgets", "none",
                    "--max-new-tokens", "32", "--output", str(out)]) == 0
    err = capsys.readouterr().err + capsys.readouterr().out
    assert f"--demo with --target {LLAMA_TARGET}: the demo's drafter runs on that target" in err
