"""References are results, and runs are identified by content.

- A reference the target generated (greedy, sampled, speculative or plain, turn by turn) goes to the partial file
  the moment it exists: Ctrl-C in the middle of generation keeps every finished one, and --resume generates none
  of them again and ends with the uninterrupted run's JSON.
- --save-references works for local generation as for --server: a line per reference as it is made, lines that
  read back as --prompts with no target generation (a conversation's turns joined again).
- --resume and --merge compare the target, the drafters and the prompts by content: the same drafter at another
  path (relative, absolute, a copy elsewhere) is the same run; other weights are refused, naming the drafter.
"""
import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import eval_drafter as ed
from conftest import ROOT, drafter_settings, interrupt_at, write_jsonl

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
# Facts of the process, not of the results: which flags were given, where the files were.
PROCESS = {"resume", "output", "merge", "shard", "ranks", "ckpt", "target", "prompts", "save_references", "quiet",
           "reference_generation_choice", "reference_generation_used",   # auto decides by the times it measures
           "demo"}

TURNS = [{"id": "a", "turns": ["w5 w9 w13", "w20 w21"]}, {"id": "b", "prompt": "w30 w31 w32"},
         {"id": "c", "turns": ["w7 w3 w1 w8", "w40 w2 w9"]}, {"id": "d", "prompt": "w3 w4 w5"}]
# Under the default --reference-generation auto the method is chosen by timing, so these interrupt
# generate_reference, which every reference passes through whichever method makes it.
MODES = {   # name: (extra flags, the generation function to interrupt, a prompts file or None for the demo's)
    "greedy": ([], "generate_reference", None),
    "plain": (["--reference-generation", "plain"], "plain_generate", None),
    "sampled": (["--temperature", "1.5", "--top-k", "30", "--samples-per-prompt", "2"], "speculative_generate", None),
    "walk": (["--anchors", "walk"], "generate_reference", None),   # 16 prompts drafted together: none scored yet
    "turns": ([], "generate_reference", TURNS),
}


def run(tmp_path, name, *argv, code=0):
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, "--quiet", "--output", str(out)]) == code
    return json.loads(out.read_text()) if out.exists() else None


def same_results(got, want, paths=True):
    """Equal JSON apart from timing and process facts (and, paths=False, the drafters' checkpoint paths)."""
    def drafters(report):
        return [{k: v for k, v in d.items() if paths or k != "checkpoint"} for d in report["drafters"]]

    assert drafters(got) == drafters(want)
    assert {k: v for k, v in got["target"].items() if paths or k != "path"} == \
        {k: v for k, v in want["target"].items() if paths or k != "path"}
    for key in ("skipped", "comparison"):
        assert got.get(key) == want.get(key), key
    differ = {k for k in set(got["config"]) | set(want["config"]) if got["config"].get(k) != want["config"].get(k)}
    assert differ <= PROCESS, differ


def partial_lines(out):
    with open(f"{out}.partial.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def argv_of(tmp_path, mode):
    extra, _, rows = MODES[mode]
    prompts = ["--prompts", write_jsonl(tmp_path / "p.jsonl", rows)] if rows else ["--limit", "6"]
    return ["--demo", *prompts, "--max-new-tokens", "40", "--ignore-eos", "--ddtree-budgets", "8", *extra]


@pytest.mark.parametrize("mode", list(MODES))
def test_ctrl_c_during_generation_keeps_every_reference(tmp_path, monkeypatch, mode):
    """Ctrl-C as the 4th reference is being generated: the three before it are in the partial file (as finished
    records, or as references not yet scored); --resume generates only the others and gives the uninterrupted
    run's JSON."""
    argv, generating = argv_of(tmp_path, mode), MODES[mode][1]
    real, calls = interrupt_at(monkeypatch, generating, 10 ** 9)   # counting only
    whole = run(tmp_path, "whole", *argv)
    total = len(calls)
    assert total >= 6 and whole["target"]["self_check"]["passed"]
    monkeypatch.setattr(ed, generating, real)

    real, calls = interrupt_at(monkeypatch, generating, 4)
    cut = run(tmp_path, "cut", *argv, code=130)
    assert cut["interrupted"] is True
    lines = partial_lines(tmp_path / "cut.json")
    kept = {row["item"]["index"]: row["item"]["completion_ids"] for row in lines if "item" in row}
    kept.update({row["reference"]["index"]: row["reference"]["completion_ids"] for row in lines if "reference" in row})
    assert len(kept) == 3
    want = {(p["id"], p.get("sample"), p.get("turn")): p for p in whole["drafters"][0]["prompts"]}
    if mode == "walk":   # nothing scored yet: the references alone were kept
        assert not [row for row in lines if "item" in row] and cut["drafters"][0]["prompts"] == []
    monkeypatch.setattr(ed, generating, real)

    real, calls = interrupt_at(monkeypatch, generating, 10 ** 9)
    resumed = run(tmp_path, "cut", *argv, "--resume")
    assert len(calls) == total - 3, "a kept reference was generated again"
    same_results(resumed, whole)
    assert not os.path.exists(tmp_path / "cut.json.partial.jsonl")
    got = {(p["id"], p.get("sample"), p.get("turn")): p for p in resumed["drafters"][0]["prompts"]}
    assert got == want


def test_interrupted_twice_keeps_what_the_first_run_kept(tmp_path, monkeypatch):
    """A resumed run that is interrupted again still holds the references of the first run."""
    argv = argv_of(tmp_path, "walk")
    whole = run(tmp_path, "whole", *argv)
    real, _ = interrupt_at(monkeypatch, "generate_reference", 3)
    run(tmp_path, "cut", *argv, code=130)
    monkeypatch.setattr(ed, "generate_reference", real)
    real, calls = interrupt_at(monkeypatch, "generate_reference", 3)
    run(tmp_path, "cut", *argv, "--resume", code=130)
    refs = [row for row in partial_lines(tmp_path / "cut.json") if "reference" in row]
    assert len(refs) == 4   # 2 from the first run, 2 more
    monkeypatch.setattr(ed, "generate_reference", real)
    same_results(run(tmp_path, "cut", *argv, "--resume"), whole)


def test_save_references_locally_as_generated_and_read_back(tmp_path, monkeypatch):
    """One line per reference the moment it is generated (the lines are there after an interruption); the lines
    are --prompts input: no target generation, the same rounds. A conversation's turn lines join again."""
    saved = tmp_path / "refs.jsonl"
    argv = argv_of(tmp_path, "turns") + ["--save-references", str(saved)]
    real, calls = interrupt_at(monkeypatch, "generate_reference", 4)
    run(tmp_path, "cut", *argv, code=130)
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [(r["id"], r.get("turn")) for r in rows] == [("a", 1), ("a", 2), ("b", None)]
    assert all(r["reference_source"] == "target" and r["reference_generation"] in ("speculative", "plain") and
               r["max_new_tokens"] == 40 and r["ignore_eos"] is True for r in rows)
    monkeypatch.setattr(ed, "generate_reference", real)
    whole = run(tmp_path, "whole", *argv_of(tmp_path, "turns"))

    # a rerun with the same file takes those three from it, generates the others, and appends them
    real, calls = interrupt_at(monkeypatch, "generate_reference", 10 ** 9)
    again = run(tmp_path, "again", *argv)
    assert len(calls) == 3   # c's two turns and d
    same_results(again, whole)
    monkeypatch.setattr(ed, "generate_reference", real)
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    assert sorted((r["id"], r.get("turn")) for r in rows) == [("a", 1), ("a", 2), ("b", None), ("c", 1), ("c", 2),
                                                             ("d", None)]

    def no_generation(*args, **kwargs):
        raise AssertionError("the target generated a reference that the file holds")

    monkeypatch.setattr(ed, "generate_reference", no_generation)
    monkeypatch.setattr(ed, "plain_generate", no_generation)
    back = run(tmp_path, "back", "--demo", "--prompts", str(saved), "--ddtree-budgets", "8")
    got = {(p["id"], p.get("turn")): p for p in back["drafters"][0]["prompts"]}
    for p in whole["drafters"][0]["prompts"]:
        q = got[(p["id"], p.get("turn"))]
        assert (q["rounds"], q["ddtree_rounds"], q["prompt_tokens"]) == (p["rounds"], p["ddtree_rounds"], p["prompt_tokens"])
        assert q["reference_source"] == "file"
    assert back["drafters"][0]["tau"] == whole["drafters"][0]["tau"]
    assert back["target"]["agreement"] == 1.0 and back["target"]["self_check"] is None


def test_saved_sampled_references_read_back(tmp_path):
    saved = tmp_path / "refs.jsonl"
    sampled = ["--temperature", "1.5", "--top-k", "30"]
    whole = run(tmp_path, "whole", "--demo", "--limit", "3", "--max-new-tokens", "40", *sampled,
                "--samples-per-prompt", "2", "--save-references", str(saved))
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    assert sorted((r["id"], r["sample"]) for r in rows) == sorted((p["id"], p["sample"])
                                                                  for p in whole["drafters"][0]["prompts"])
    assert all(r["sampling"] == {"temperature": 1.5, "top_p": 1.0, "top_k": 30, "seed": 0} for r in rows)
    back = run(tmp_path, "back", "--demo", "--prompts", str(saved), *sampled)
    assert back["drafters"][0]["tau"] == whole["drafters"][0]["tau"]
    assert back["drafters"][0]["tau_ci95"] == whole["drafters"][0]["tau_ci95"]   # a prompt's samples: one unit


# ----------------------------------------------------------------------------------------------------
# Identity by content


@pytest.fixture()
def copies(tmp_path):
    """The demo target, drafter and prompts copied elsewhere (another directory name for the drafter too)."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(DEMO, "target"), elsewhere / "model")
    shutil.copytree(os.path.join(DEMO, "drafter"), elsewhere / "run7-drafter")
    shutil.copy(os.path.join(DEMO, "prompts.jsonl"), elsewhere / "mine.jsonl")
    return elsewhere


SHARD = ["--max-new-tokens", "40", "--ddtree-budgets", "8,32", "--check-mask"]


def test_shards_with_the_drafter_at_other_paths_merge(tmp_path, copies, monkeypatch):
    monkeypatch.chdir(ROOT)
    relative = os.path.relpath(os.path.join(DEMO, "drafter"))
    whole = run(tmp_path, "whole", "--demo", "--ckpt", relative, *SHARD)
    run(tmp_path, "s1", "--demo", "--ckpt", relative, "--shard", "1/3", *SHARD)
    run(tmp_path, "s2", "--demo", "--ckpt", os.path.join(DEMO, "drafter"), "--shard", "2/3", *SHARD)
    run(tmp_path, "s3", "--target", str(copies / "model"), "--ckpt", str(copies / "run7-drafter"), "--prompts",
        str(copies / "mine.jsonl"), "--shard", "3/3", *SHARD)
    merged = run(tmp_path, "merged", "--merge", *[str(tmp_path / f"s{k}.json") for k in (1, 2, 3)])
    same_results(merged, whole)
    assert merged["drafters"][0]["hash"] == whole["drafters"][0]["hash"]

    # other weights (one value changed) are refused, naming the drafter
    other = tmp_path / "other" / "drafter"
    shutil.copytree(os.path.join(DEMO, "drafter"), other)
    w = load_file(str(other / "model.safetensors"))
    w["norm.weight"] = w["norm.weight"].clone()
    w["norm.weight"][0] += 1e-3
    save_file(w, str(other / "model.safetensors"))
    run(tmp_path, "bad", "--demo", "--ckpt", f"{os.path.basename(relative)}={other}", "--shard", "3/3", *SHARD)
    assert ed.main(["--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"), str(tmp_path / "bad.json"),
                    "--output", str(tmp_path / "m.json")]) == 2


def test_merge_refusal_names_the_drafter_and_the_target(tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(os.path.join(DEMO, "drafter"), other)
    w = load_file(str(other / "model.safetensors"))
    w["fc.weight"] = w["fc.weight"] * 1.001
    save_file(w, str(other / "model.safetensors"))
    run(tmp_path, "s1", "--demo", "--ckpt", f"demo={os.path.join(DEMO, 'drafter')}", "--shard", "1/2", *SHARD)
    run(tmp_path, "s2", "--demo", "--ckpt", f"demo={other}", "--shard", "2/2", *SHARD)
    capsys.readouterr()
    assert ed.main(["--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drafter demo (its weights or resolved config) differ" in err[0], err
    # another target with the same config and shapes: its weights differ
    target = tmp_path / "target"
    shutil.copytree(os.path.join(DEMO, "target"), target)
    w = load_file(str(target / "model.safetensors"))
    name = "model.layers.2.mlp.up_proj.weight"
    w[name] = w[name] + 0.01
    save_file(w, str(target / "model.safetensors"), metadata={"format": "pt"})
    run(tmp_path, "s2", "--demo", "--target", str(target), "--shard", "2/2", *SHARD)
    capsys.readouterr()
    assert ed.main(["--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the target (its config or weights) differ" in err[0], err


def test_resume_with_the_drafter_copied_elsewhere(tmp_path, copies, monkeypatch):
    argv = ["--max-new-tokens", "40", "--limit", "5", "--ddtree-budgets", "8"]
    whole = run(tmp_path, "whole", "--demo", *argv)
    real, _ = interrupt_at(monkeypatch, "evaluate_prompts", 3)
    run(tmp_path, "cut", "--demo", *argv, code=130)
    monkeypatch.setattr(ed, "evaluate_prompts", real)
    resumed = run(tmp_path, "cut", "--target", str(copies / "model"), "--ckpt", f"demo={copies / 'run7-drafter'}",
                  "--prompts", str(copies / "mine.jsonl"), *argv, "--resume")
    same_results(resumed, whole, paths=False)
    assert resumed["drafters"][0]["checkpoint"] == str(copies / "run7-drafter")


def test_content_hashes(tmp_path, copies):
    assert ed.target_hash(str(copies / "model")) == ed.target_hash(os.path.join(DEMO, "target"))
    settings = drafter_settings()
    cfg = ed.read_target_config(os.path.join(DEMO, "target"))
    here, there = (ed.load_drafter(p, cfg, settings) for p in (os.path.join(DEMO, "drafter"), str(copies / "run7-drafter")))
    assert here.hash == there.hash and len(here.hash) == 64
    # a resolved setting is part of the identity: the same weights at another block size are another drafter
    assert ed.load_drafter(os.path.join(DEMO, "drafter"), cfg, dataclasses.replace(settings, block_size=4)).hash != here.hash
    # a tensor stored in another dtype is another file
    w = load_file(str(copies / "run7-drafter" / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, str(copies / "run7-drafter" / "model.safetensors"))
    assert ed.load_drafter(str(copies / "run7-drafter"), cfg, settings).hash != here.hash


def test_a_turn_given_twice_is_one_line(tmp_path, capsys):
    line = {"id": "a", "turns": ["w5 w9", "w20 w21"], "turn": 2, "completion_ids": [4, 5, 6]}
    prompts = write_jsonl(tmp_path / "p.jsonl", [line, {**line, "completion_ids": [7, 8]}])
    assert ed.main(["--demo", "--prompts", prompts, "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {prompts} line 2: turn 2 of id 'a' is given twice, or with another conversation"]
