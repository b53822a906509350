"""Never silently wrong, never silent (issue 41): every flag that replaces what a checkpoint states is named on the load
line and warned about, with a check against the checkpoint's own values; a run whose stderr is a log shows progress
lines; reference generation picks the faster method and says why; measure() keeps its pass off libgomp's spinning
threads; --server is checked before any model loads; and the smaller refusals and notes a new user met.

Every test drives eval_drafter.main (or the program, where the moment matters) on the bundled demo pair."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch

import eval_drafter as ed
from conftest import ROOT, interrupt_at, paused_at, pausing_program, refused_in_one_line, write_jsonl

DEMO = ["--demo", "--limit", "3", "--max-new-tokens", "48"]
DRAFTER = os.path.join(ed.DEMO_DIR, "drafter")
TARGET = os.path.join(ed.DEMO_DIR, "target")


def run(tmp_path, capsys, *argv, name="out"):
    """main(argv) with --output: (its report, the stderr lines)."""
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, "--output", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().err.splitlines()


def load_line(err, name="demo"):
    """The drafter's load summary line: 'drafter NAME: block ...' or '... steps a round ...'."""
    return next(line for line in err if line.startswith(f"drafter {name}: ") and ("block" in line or "steps" in line)
                and "layout" not in line)


# ----------------------------------------------------------------------------------------------------
# 1. Every override named


def test_mask_token_override_is_named_checked_and_warned(tmp_path, capsys):
    """--mask-token-id 7 on the demo drafter (trained with 2): the load line names it, the override check drafts the
    same anchors with the checkpoint's own mask token and finds it clearly better, one warning says so (stderr,
    the report's warnings, the JSON)."""
    report, err = run(tmp_path, capsys, *DEMO, "--mask-token-id", "7")
    assert load_line(err).endswith("; --mask-token-id 7 (overrides the checkpoint's 2)")
    d = report["drafters"][0]
    assert d["overrides"] == {"--mask-token-id": {"given": 7, "checkpoint": 2}}
    modes = d["override_check"]["modes"]
    assert modes["checkpoint's own values"]["accuracy"] > modes["as given"]["accuracy"] + 0.5
    assert modes["checkpoint's own values"]["z"] >= ed.CHECK_Z
    warnings = [w for w in d["warnings"] if "--mask-token-id" in w]
    assert len(warnings) == 1 and "drafts clearly worse than with the checkpoint's own values" in warnings[0]
    assert sum("warning: drafter demo: --mask-token-id 7 (overrides the checkpoint's 2): on" in line
               for line in err) == 1
    assert d["tau"] < 2   # the flag's numbers, as asked: the check names the problem, it does not undo the flag


def test_an_override_that_agrees_is_no_override(tmp_path, capsys):
    report, err = run(tmp_path, capsys, *DEMO, "--mask-token-id", "2", "--layers", "1,3,4", "--block-size", "8")
    assert "overrides" not in load_line(err)
    d = report["drafters"][0]
    assert "overrides" not in d and "override_check" not in d and d["warnings"] == []


@pytest.mark.parametrize("flags, key, shown", [
    (["--layers", "0,2,4"], "--layers", "--layers [0, 2, 4] (overrides the checkpoint's [1, 3, 4])"),
    (["--block-size", "4"], "--block-size", "--block-size 4 (overrides the checkpoint's 8)"),
    (["--block-mask", "bidirectional"], "--block-mask bidirectional",
     "--block-mask bidirectional: in-block mask bidirectional, window 32; bidirectional (overrides the checkpoint's "
     "causal, window 32; bidirectional)"),
    (["--sliding-window", "ignore"], "--sliding-window ignore",
     "--sliding-window ignore: in-block mask bidirectional; bidirectional (overrides the checkpoint's causal, window "
     "32; bidirectional)")])
def test_each_override_is_named_with_the_checkpoints_value(tmp_path, capsys, flags, key, shown):
    report, err = run(tmp_path, capsys, *DEMO, *flags)
    assert load_line(err).endswith("; " + shown)
    d = report["drafters"][0]
    assert list(d["overrides"]) == [key]
    assert [w for w in d["warnings"] if w.startswith(shown + ": ")], d["warnings"]
    assert d["override_check"]["modes"]["checkpoint's own values"]["anchors"] > 0


def test_drafter_config_over_the_one_beside_is_an_override(tmp_path, capsys):
    """--drafter-config used to be ignored (with a note) when a config stood beside the weights; now the flag wins, as
    every explicit flag does, and is named with the keys the two configs give differently."""
    cfg = json.load(open(os.path.join(DRAFTER, "config.json")))
    cfg["dflash_config"]["mask_token_id"] = 5
    other = tmp_path / "other.json"
    other.write_text(json.dumps(cfg))
    report, err = run(tmp_path, capsys, *DEMO, "--drafter-config", str(other))
    d = report["drafters"][0]
    assert d["mask_token_id"] == 5
    assert d["overrides"]["--drafter-config"]["keys"] == ["dflash_config"]
    assert load_line(err).endswith(f"--drafter-config {other} (overrides config.json beside its weights: dflash_config "
                                   "differ)")
    assert any("drafts clearly worse" in w for w in d["warnings"])


def test_head_flags_over_a_config_are_applied_not_ignored(tmp_path, capsys):
    """--num-kv-heads used to be read only without a config (ignored in silence otherwise): over the demo's config
    (2 KV heads of 16) 4 KV heads do not fit its k_proj, and the run says so; agreeing values change nothing."""
    refused_in_one_line(capsys, [*DEMO, "--quiet", "--num-kv-heads", "4"], "tensor layers.0.self_attn.k_proj.weight has shape")
    report, err = run(tmp_path, capsys, *DEMO, "--num-kv-heads", "2", "--head-dim", "16")
    assert "overrides" not in report["drafters"][0]


def test_override_check_from_saved_features(tmp_path, capsys):
    """A run with an override saves the checkpoint's own layers too, so that a --load-hidden run can check it; from
    features that lack them (saved for another drafter), the override is still named and warned, and the warning says
    the check could not run."""
    saved = tmp_path / "h.safetensors"
    run(tmp_path, capsys, *DEMO, "--layers", "0,2,4", "--save-hidden", str(saved), name="save")
    argv = ["--target", TARGET, "--ckpt", f"demo={DRAFTER}", "--layers", "0,2,4", "--load-hidden"]
    report, _ = run(tmp_path, capsys, *argv, str(saved), name="loaded")
    assert report["drafters"][0]["override_check"]["modes"]["checkpoint's own values"]["anchors"] > 0
    other = tmp_path / "other"   # the demo drafter saying layers 0, 2, 4 itself: no override, its features alone
    shutil.copytree(DRAFTER, other)
    cfg = json.load(open(other / "config.json"))
    cfg["dflash_config"]["target_layer_ids"] = [0, 2, 4]
    (other / "config.json").write_text(json.dumps(cfg))
    narrow = tmp_path / "narrow.safetensors"
    run(tmp_path, capsys, *DEMO, "--ckpt", f"demo={other}", "--save-hidden", str(narrow), name="narrow")
    report, _ = run(tmp_path, capsys, *argv, str(narrow), name="narrow_loaded")
    d = report["drafters"][0]
    assert "override_check" not in d and d["overrides"]["--layers"]["checkpoint"] == [1, 3, 4]
    assert any("not checked against its own values: the saved features lack the layers" in w for w in d["warnings"])


# ----------------------------------------------------------------------------------------------------
# 2. Visible when stderr is not a terminal


def test_a_log_gets_progress_lines_before_the_run_ends(tmp_path):
    """The program with stderr to a file (as nohup or a job scheduler runs it), paused once its second prompt's record
    is on disk: the log already holds plain progress lines for both stages, and no carriage return."""
    log = tmp_path / "log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, pausing_program(tmp_path, "write_row",
                                                                 "sum('item' in a[1] for a in calls) == 2"),
                                 *DEMO, "--output", str(tmp_path / "o.json")], stdout=subprocess.DEVNULL, stderr=f,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        paused_at(tmp_path, proc)
        text = log.read_text()
    finally:
        proc.kill()
        proc.wait()
    assert "progress: target 0/3 prompts" in text and "progress: draft 0/3 prompts" in text, text
    assert "loading the target" in text and "\r" not in text


def test_progress_lines_carry_counts_rate_and_eta(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ed, "PROGRESS_EVERY", (0.0, 0.0))   # a line at every prompt
    _, err = run(tmp_path, capsys, *DEMO)
    lines = [line for line in err if line.startswith("progress: target")]
    assert lines[0] == "progress: target 0/3 prompts"
    assert [line.split()[2] for line in lines] == ["0/3", "1/3", "2/3", "3/3"]
    assert "a second, about" in lines[1] and " s to go" in lines[1] and lines[-1].endswith(", done")
    _, quiet = run(tmp_path, capsys, *DEMO, "--quiet", name="quiet")
    assert not any(line.startswith("progress:") for line in quiet)


# ----------------------------------------------------------------------------------------------------
# 3. Slow paths: references by the faster method, measure() off spinning threads, --server checked first


def references_by(monkeypatch, round_s, plain_s):
    """Pin the timings reference generation reads: each speculative round `round_s`, a plain step `plain_s`."""
    monkeypatch.setattr(ed, "seconds_since", lambda start: round_s)
    monkeypatch.setattr(ed, "timed_pass", lambda *args, **kwargs: plain_s)


@pytest.mark.parametrize("plain_s, method", [(0.5, "speculative"), (0.001, "plain")])
def test_auto_references_keep_the_faster_method_and_say_why(tmp_path, capsys, monkeypatch, plain_s, method):
    """auto: the first reference's rounds 2-8 against a plain step; the faster goes on, the choice said on stderr and
    in the JSON, and the references equal plain greedy decoding's, token for token, either way."""
    argv = ["--demo", "--limit", "2", "--max-new-tokens", "64"]   # 8 rounds a reference: the second decides
    want, _ = run(tmp_path, capsys, *argv, "--reference-generation", "plain", name="plain")
    references_by(monkeypatch, 0.01, plain_s)
    report, err = run(tmp_path, capsys, *argv)
    config = report["config"]
    assert config["reference_generation_used"] == method
    choice = config["reference_generation_choice"]
    assert choice.startswith("speculative decoding with drafter demo made ") and "a plain step takes" in choice
    assert ("the rest by plain decoding" in choice) == (method == "plain")
    assert sum(line == f"references: {choice}" for line in err) == 1
    assert report["drafters"] == want["drafters"]


def test_auto_goes_on_by_plain_decoding_inside_the_first_reference(monkeypatch):
    """The switch happens mid-reference, from speculative_generate's own cache: the tokens equal plain greedy's."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    target_cfg = ed.read_target_config(TARGET)
    drafter = ed.load_drafter(DRAFTER, target_cfg, ed.quietly(ed.Settings(dtype="float32", device="cpu")))
    asked, prompt = [], [5, 9, 13, 20, 21]

    def choose(timed, plain_step):   # plain after the third round
        asked.append(timed)
        return "plain" if len(asked) == 3 and plain_step() > 0 else None
    got = ed.speculative_generate(model, drafter, prompt, 120, set(), choose=choose)
    assert len(asked) == 3 and sum(tokens for _, tokens in asked) < 40
    assert got == ed.plain_generate(model, prompt, 120, set())


def test_sampled_auto_references_stay_speculative_and_say_why(tmp_path, capsys):
    report, err = run(tmp_path, capsys, *DEMO, "--temperature", "0.8", "--seed", "3")
    assert report["config"]["reference_generation_used"] == "speculative"
    assert "a seed's samples depend on the method" in report["config"]["reference_generation_choice"]


def test_measure_runs_its_pass_on_one_thread_and_gives_the_callers_back(tmp_path, capsys, monkeypatch):
    saved = tmp_path / "h.safetensors"
    run(tmp_path, capsys, *DEMO, "--save-hidden", str(saved))
    cfg = json.load(open(os.path.join(DRAFTER, "config.json")))
    from safetensors.torch import load_file
    weights = load_file(os.path.join(DRAFTER, "model.safetensors"))
    seen, real = [], ed.drafter_figures
    monkeypatch.setattr(ed, "drafter_figures", lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    held = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        features = ed.load_features(saved, TARGET)
        one = ed.measure(weights, features, config=cfg)
        two = ed.measure(weights, ed.load_features(saved, TARGET, threads=2), config=cfg)
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(held)
    assert one["tau"] == two["tau"] and one["per_position"] == two["per_position"]


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]   # closed when the socket goes: nothing listens there


def test_a_refused_server_is_found_before_anything_loads(tmp_path, capsys, monkeypatch):
    loaded = []
    for name in ("load_target", "load_drafter", "read_drafter"):
        real = getattr(ed, name)
        monkeypatch.setattr(ed, name, lambda *a, real=real, name=name, **k: loaded.append(name) or real(*a, **k))
    url = f"http://127.0.0.1:{closed_port()}"
    refused_in_one_line(capsys, [*DEMO, "--server", url, "--output", str(tmp_path / "o.json")],
                        f"cannot reach the server at {url}/generate: connection refused")
    assert loaded == [] and not os.listdir(tmp_path)


# ----------------------------------------------------------------------------------------------------
# 4. The smaller items


def test_ctrl_c_in_the_first_imports_is_one_line(tmp_path):
    """A stand-in for argparse (the script's first import after os, signal and sys) sends SIGINT from inside its own
    import: one line and exit 130. Before, the handler came after the standard library's imports: a traceback."""
    (tmp_path / "argparse.py").write_text("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\n"
                                          "time.sleep(5)\n")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "eval_drafter.py"), "--demo"], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines() == ["interrupted while starting: nothing was computed yet"]


def test_resume_with_other_settings_names_what_would_work(tmp_path, capsys, monkeypatch):
    """--resume with an added --depths is refused (it changes the numbers), naming the flag and what works instead;
    --overwrite then reuses the earlier run's references (none generated again) and gives a fresh run's numbers."""
    out = tmp_path / "o.json"
    argv = [*DEMO, "--limit", "4", "--output", str(out), "--quiet"]
    real, _ = interrupt_at(monkeypatch, "extract_hidden", 3)
    assert ed.main(argv) == 130
    monkeypatch.setattr(ed, "extract_hidden", real)
    capsys.readouterr()
    refused_in_one_line(capsys, [*argv, "--depths", "3", "--resume"], "(--depths differ): a resume may change only")
    _, calls = interrupt_at(monkeypatch, "generate_reference", 10 ** 9)   # counting only
    assert ed.main([*argv, "--depths", "3", "--overwrite"]) == 0
    assert len(calls) == 1   # three references reused, the fourth generated
    got = json.loads(out.read_text())
    fresh = tmp_path / "fresh.json"
    assert ed.main([*DEMO, "--limit", "4", "--quiet", "--depths", "3", "--output", str(fresh)]) == 0
    assert got["drafters"] == json.loads(fresh.read_text())["drafters"]


def test_overwrite_does_not_reuse_references_of_other_origin(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o.json"
    argv = [*DEMO, "--output", str(out)]
    real, _ = interrupt_at(monkeypatch, "extract_hidden", 3)
    assert ed.main(argv) == 130
    monkeypatch.setattr(ed, "extract_hidden", real)
    capsys.readouterr()
    assert ed.main([*argv, "--max-new-tokens", "32", "--overwrite"]) == 0
    assert "references of the earlier run not reused (--max-new-tokens differ" in capsys.readouterr().err


@pytest.mark.parametrize("row, said", [
    ({"prompt": 5}, "line 1: prompt is 5 (an integer); expected a string"),
    ({"messages": "hi"}, "line 1: messages is \"hi\" (a string); expected a non-empty list of chat turns"),
    ({"turns": []}, "line 1: turns is [] (a list); expected a non-empty list of strings"),
    ({"instruction": "w1", "input": 3}, "line 1: input is 3 (an integer); expected a string (Alpaca)"),
    ({"query": "w1"}, "line 1: no prompt field; give one of \"prompt\", \"messages\"")])
def test_a_prompt_field_of_the_wrong_kind_is_named(tmp_path, capsys, row, said):
    refused_in_one_line(capsys, ["--demo", "--prompts", write_jsonl(tmp_path / "p.jsonl", [row])], said)


def test_a_truncated_saved_features_file_says_cut_short(tmp_path, capsys):
    saved = tmp_path / "h.safetensors"
    run(tmp_path, capsys, *DEMO, "--save-hidden", str(saved))
    data = saved.read_bytes()
    for keep in (len(data) - 1000, 40):
        cut = tmp_path / f"cut{keep}.safetensors"
        cut.write_bytes(data[:keep])
        refused_in_one_line(capsys, ["--target", TARGET, "--ckpt", DRAFTER, "--load-hidden", str(cut)],
                            f"{cut} is a --save-hidden file cut short ({keep} ")
    other = tmp_path / "other.safetensors"
    shutil.copy(os.path.join(DRAFTER, "model.safetensors"), other)
    refused_in_one_line(capsys, ["--target", TARGET, "--ckpt", DRAFTER, "--load-hidden", str(other)],
                        "is not a hidden-state file written by --save-hidden")


def test_a_one_turn_line_counts_in_turn_1(tmp_path, capsys):
    rows = [{"id": "a", "turns": ["w5 w9 w13", "w20 w21"]}, {"id": "b", "turns": ["w7 w3 w1 w8"]}]
    report, _ = run(tmp_path, capsys, "--demo", "--max-new-tokens", "32", "--prompts",
                    write_jsonl(tmp_path / "p.jsonl", rows))
    d = report["drafters"][0]
    by_turn = {p["id"] + str(p.get("turn")): p for p in d["prompts"]}
    assert set(by_turn) == {"a1", "a2", "b1"}
    first = [p for p in d["prompts"] if p.get("turn") == 1]
    assert d["turns"]["1"]["rounds"] == sum(len(p["rounds"]) for p in first)
    assert d["turns"]["1"]["rounds"] + d["turns"]["2"]["rounds"] == d["rounds"]


def test_dataset_answers_left_out_are_named(tmp_path, capsys):
    rows = [{"question_id": 81, "turns": ["w3 w4 w5"], "reference": ["w9"]},
            {"task_id": "HumanEval/0", "prompt": "w1 w2", "canonical_solution": "w8", "test": "w9"}]
    _, err = run(tmp_path, capsys, "--demo", "--max-new-tokens", "24", "--prompts",
                 write_jsonl(tmp_path / "p.jsonl", rows))
    note = next(line for line in err if line.startswith("note: MT-Bench's"))
    assert note.startswith("note: MT-Bench's \"reference\" is GPT-4's answer; HumanEval's \"canonical_solution\" is a "
                           "person's code: not the target's own")


def test_sampling_that_changes_nothing_is_said(tmp_path, capsys):
    """At temperature 0.1 the demo target's samples are its greedy text: the report says so (and tau is greedy's);
    at 1.5 they are not, and it says nothing."""
    greedy, _ = run(tmp_path, capsys, *DEMO, name="greedy")
    cold, _ = run(tmp_path, capsys, *DEMO, "--temperature", "0.1", name="cold")
    note = cold["target"]["sampling_note"]
    assert note.startswith("every token of the 3 sampled references is the target's argmax")
    assert cold["drafters"][0]["tau"] == pytest.approx(greedy["drafters"][0]["tau"])
    hot, _ = run(tmp_path, capsys, *DEMO, "--temperature", "1.5", name="hot")
    assert "sampling_note" not in hot["target"]


def test_help_lists_every_family_and_gguf_targets(capsys):
    with pytest.raises(SystemExit):
        ed.main(["--help"])
    text = capsys.readouterr().out
    for name in ed.FAMILIES:
        assert f"\n  {name} " in text, name
    assert "GGUF file" in text


def test_plot_names_identical_series_together_and_joins_only_neighbouring_depths(tmp_path, capsys):
    """Two drafters with the same figures are drawn once, the legend naming both (one line used to hide the other);
    on the depth panel, depths 2 and 5 are joined by a dotted line (nothing was measured between them), 1 and 2 by a
    solid one."""
    report, _ = run(tmp_path, capsys, *DEMO, "--ckpt", f"a={DRAFTER}", "--ckpt", f"b={DRAFTER}", "--depths", "1,2,5")
    fig = ed.draw_plot(report, str(tmp_path / "p.png"))
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    for ax in panels.values():
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["a = b"], (ax.get_title(), labels)
    depth = panels["tau by served depth"]
    joins = [(list(line.get_xdata()), line.get_linestyle()) for line in depth.get_lines()
             if line.get_label().startswith("_") and len(line.get_xdata()) == 2]
    assert joins == [([1, 2], "-"), ([2, 5], ":"), ([5, 7], ":")]
