"""Runs the size of the public benchmark: --shard K/N and --merge, torchrun over ranks (gloo on CPU), caches of
shards and ranks read together.

A merged or torchrun report must equal the single-process report apart from timing and process facts
(output path, rank count, the merged files): the statistics are recomputed from every prompt's records,
never averaged over shards.
"""
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

import eval_drafter as ed
from conftest import ROOT, interrupt_at, paused_at, pausing_program

BASE = ["--demo", "--limit", "7", "--max-new-tokens", "48", "--ddtree-budgets", "8,32", "--quiet"]
PROCESS_FACTS = {"output", "merge", "ranks", "save_hidden", "load_hidden", "shard", "resume", "quiet",
                 "reference_generation_choice", "reference_generation_used"}   # said with the times auto measured


def run(tmp_path, name, *argv, code=0):
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, "--output", str(out)]) == code
    return json.loads(out.read_text()) if out.exists() else None


def assert_same_report(got, want):
    for key in ("drafters", "target", "skipped"):
        assert got[key] == want[key], key
    differ = {k for k in set(got["config"]) | set(want["config"]) if got["config"].get(k) != want["config"].get(k)}
    assert differ <= PROCESS_FACTS, differ


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    return run(tmp, "whole", *BASE, "--check-mask")


def test_three_shards_merged_equal_one_run(tmp_path, whole):
    shards = [run(tmp_path, f"s{k}", *BASE, "--check-mask", "--shard", f"{k}/3") for k in (1, 2, 3)]
    assert sorted(p["id"] for s in shards for p in s["drafters"][0]["prompts"]) == \
        sorted(p["id"] for p in whole["drafters"][0]["prompts"])
    assert all(0 < len(s["drafters"][0]["prompts"]) < 7 for s in shards)
    merged = run(tmp_path, "merged", "--merge", *[str(tmp_path / f"s{k}.json") for k in (1, 2, 3)])
    assert_same_report(merged, whole)
    # a pooled statistic is not an average of the shards' ones
    taus = [s["drafters"][0]["tau"] for s in shards]
    assert merged["drafters"][0]["tau"] == whole["drafters"][0]["tau"] != sum(taus) / 3


def one_error(capsys, fragment):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --merge") and fragment in err[0], err


def test_merge_refusals(tmp_path, capsys):
    shard = lambda name, k, *extra: run(tmp_path, name, *BASE, "--shard", f"{k}/2", *extra)   # noqa: E731
    shard("a", 1), shard("b", 2), shard("c", 2, "--ddtree-budgets", "8"), shard("d", 2, "--limit", "5")
    paths = {n: str(tmp_path / f"{n}.json") for n in "abcd"}
    capsys.readouterr()
    assert ed.main(["--merge", paths["a"], paths["c"]]) == 2
    one_error(capsys, "were run with other settings (--ddtree-budgets differ)")
    assert ed.main(["--merge", paths["a"], paths["d"]]) == 2
    one_error(capsys, "hold other prompt lists")
    assert ed.main(["--merge", paths["a"]]) == 2
    one_error(capsys, "no shard holds prompts train-1, train-3, fresh-0")
    assert ed.main(["--merge", paths["a"], paths["b"], paths["b"]]) == 2
    one_error(capsys, "is in both")
    single = run(tmp_path, "single", *BASE)
    capsys.readouterr()
    assert ed.main(["--merge", paths["a"], str(tmp_path / "single.json")]) == 2
    one_error(capsys, "holds no per-prompt records: only the outputs of --shard runs can be merged")
    assert single is not None


def test_resume_across_a_merge(tmp_path, monkeypatch, capsys, whole):
    """Shard 2 of 2 interrupted after its first prompt: the merge refuses it; resumed, the merge equals the
    single run."""
    run(tmp_path, "s1", *BASE, "--check-mask", "--shard", "1/2")
    real, calls = interrupt_at(monkeypatch, "evaluate_prompts", 2)
    cut = run(tmp_path, "s2", *BASE, "--check-mask", "--shard", "2/2", code=130)
    assert cut["interrupted"] and len(cut["drafters"][0]["prompts"]) == 1
    monkeypatch.setattr(ed, "evaluate_prompts", real)
    capsys.readouterr()
    assert ed.main(["--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json")]) == 2
    one_error(capsys, "is an interrupted shard: finish it with --resume")
    run(tmp_path, "s2", *BASE, "--check-mask", "--shard", "2/2", "--resume")
    merged = run(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert_same_report(merged, whole)


# ----------------------------------------------------------------------------------------------------
# torchrun


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(tmp_path, name, *argv, ranks=2, wait=True, script=os.path.join(ROOT, "eval_drafter.py")):
    """`torchrun --nproc_per_node=ranks eval_drafter.py argv --output <name>.json` on this machine (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={ranks}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", script,
           *argv, "--output", str(tmp_path / f"{name}.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if not wait:
        return proc
    out, err = proc.communicate(timeout=600)
    return proc.returncode, err


def test_torchrun_two_ranks_equal_one_process(tmp_path, whole):
    code, err = torchrun(tmp_path, "ranks", *BASE, "--check-mask", "--save-hidden", str(tmp_path / "h.safetensors"))
    assert code == 0, err
    report = json.loads((tmp_path / "ranks.json").read_text())
    assert report["config"]["ranks"] == 2
    assert_same_report(report, whole)
    assert "error" not in err and "Traceback" not in err
    # each rank wrote its own cache; read together they give the same numbers without the target model
    caches = [str(tmp_path / f"h.rank{r}-of-2.safetensors") for r in (0, 1)]
    assert all(os.path.isfile(c) for c in caches) and not (tmp_path / "h.safetensors").exists()
    loaded = run(tmp_path, "loaded", "--target", whole["config"]["target"], "--ckpt", whole["config"]["ckpt"][0],
                 "--load-hidden", *caches, "--ddtree-budgets", "8,32", "--check-mask", "--quiet")
    assert loaded["drafters"] == whole["drafters"]
    assert not [n for n in os.listdir(tmp_path) if ".partial." in n]


def test_torchrun_interrupted_then_resumed(tmp_path):
    """Ctrl-C under torchrun: every rank stops, rank 0 reports what all finished (interrupted), each rank's
    partial file stays; --resume under torchrun completes it to the uninterrupted numbers."""
    many = [*BASE[:1], "--limit", "10", "--max-new-tokens", "128", "--ddtree-budgets", "8", "--quiet"]
    want = run(tmp_path, "want", *many)
    # each rank pauses once a prompt's record is on disk in its partial file
    proc = torchrun(tmp_path, "cut", *many, wait=False,
                    script=pausing_program(tmp_path, "write_row", "'item' in args[1]"))
    partials = [tmp_path / f"cut.json.partial.rank{r}.jsonl" for r in (0, 1)]
    paused_at(tmp_path, proc, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    report = json.loads((tmp_path / "cut.json").read_text())
    assert report.get("interrupted") is True, err
    finished = [p["id"] for p in report["drafters"][0]["prompts"]]
    assert 2 <= len(finished) < 10 and all(p.exists() for p in partials)
    code, err = torchrun(tmp_path, "cut", *many, "--resume")
    assert code == 0, err
    final = json.loads((tmp_path / "cut.json").read_text())
    assert "interrupted" not in final
    assert final["drafters"] == want["drafters"]
    assert not any(p.exists() for p in partials)


# ----------------------------------------------------------------------------------------------------
# Multi-turn prompts

TWO_TURNS = [{"id": "a", "turns": ["w5 w9 w13", "w20 w21"]}, {"id": "b", "turns": ["w7 w3 w1 w8", "w40 w2 w9"]},
             {"id": "c", "prompt": "w30 w31 w32"}]


def test_two_turns_equal_an_online_loop_turn_by_turn(tmp_path):
    """Turn 2's context is turn 1 and the target's own decoded reply (the demo tokenizer has no chat template:
    the messages are joined by newlines, as the tool joins them); each turn's rounds equal an online loop's."""
    from conftest import drafter_settings, online_rounds, write_jsonl
    from drafters import DEMO, demo_pair
    import torch
    target, _, _ = demo_pair()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    drafter = ed.load_drafter(os.path.join(DEMO, "drafter"), target.config, drafter_settings())
    n_new = 40
    report = run(tmp_path, "turns", "--demo", "--prompts", write_jsonl(tmp_path / "t.jsonl", TWO_TURNS),
                 "--max-new-tokens", str(n_new), "--ignore-eos", "--quiet")
    got = {(p["id"], p.get("turn")): p for p in report["drafters"][0]["prompts"]}
    assert sorted(got) == [("a", 1), ("a", 2), ("b", 1), ("b", 2), ("c", None)]

    def reply(ids):   # the target's greedy continuation, full passes without a cache
        seq = list(ids)
        with torch.no_grad():
            while len(seq) < len(ids) + n_new:
                seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(ids):]

    for row in TWO_TURNS[:2]:
        first = tok(row["turns"][0])["input_ids"]
        rounds, _ = online_rounds(target, drafter, first, n_new)
        assert got[(row["id"], 1)]["rounds"] == rounds
        text = "\n".join([row["turns"][0], tok.decode(reply(first), skip_special_tokens=True), row["turns"][1]])
        second = tok(text)["input_ids"]
        assert got[(row["id"], 2)]["prompt_tokens"] == len(second)
        rounds, _ = online_rounds(target, drafter, second, n_new)
        assert got[(row["id"], 2)]["rounds"] == rounds
    turns = report["drafters"][0]["turns"]
    assert set(turns) == {"1", "2"} and turns["2"]["rounds"] == sum(len(got[(r, 2)]["rounds"]) for r in "ab")
    # --turns first: today's report, the first turn of each line only
    first_only = run(tmp_path, "first", "--demo", "--prompts", str(tmp_path / "t.jsonl"), "--max-new-tokens",
                     str(n_new), "--ignore-eos", "--quiet", "--turns", "first")
    assert [p["id"] for p in first_only["drafters"][0]["prompts"]] == ["a", "b", "c"]
    assert "turns" not in first_only["drafters"][0] and "turn" not in first_only["drafters"][0]["prompts"][0]
    assert first_only["drafters"][0]["prompts"][0]["rounds"] == got[("a", 1)]["rounds"]
    # references given for every turn are used as given, turn 2's context holding the given first reply
    given = [{**TWO_TURNS[0], "completions": ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10", "w11 w12 w13 w14 w15 w16 w17 w18"]}]
    fixed = run(tmp_path, "given", "--demo", "--prompts", write_jsonl(tmp_path / "g.jsonl", given), "--quiet")
    one, two = fixed["drafters"][0]["prompts"]
    assert (one["completion_tokens"], two["completion_tokens"]) == (10, 8)
    assert two["prompt_tokens"] == len(tok("w5 w9 w13\nw1 w2 w3 w4 w5 w6 w7 w8 w9 w10\nw20 w21")["input_ids"])
    assert one["reference_source"] == two["reference_source"] == "file"


def test_turns_under_shards_and_resume(tmp_path, monkeypatch):
    """A line's turns stay in one slice; a resumed run takes turn 1's reply from the partial file."""
    from conftest import write_jsonl
    prompts = write_jsonl(tmp_path / "t.jsonl", TWO_TURNS * 1)
    argv = ["--demo", "--prompts", prompts, "--max-new-tokens", "40", "--ignore-eos", "--quiet"]
    whole = run(tmp_path, "whole", *argv)
    for k in (1, 2):
        run(tmp_path, f"s{k}", *argv, "--shard", f"{k}/2")
    merged = run(tmp_path, "merged", "--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"))
    assert_same_report(merged, whole)
    real, calls = interrupt_at(monkeypatch, "evaluate_prompts", 2)   # after turn 1 of line a
    run(tmp_path, "cut", *argv, code=130)
    monkeypatch.setattr(ed, "evaluate_prompts", real)
    resumed = run(tmp_path, "cut", *argv, "--resume")
    assert resumed["drafters"] == whole["drafters"]
