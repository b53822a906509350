"""Prompt files as people have them: each behaviour runs the demo pair (tests/fixtures/demo) or reads a file.

- A line's id comes from id, task_id, question_id, idx or sample_id (the first present); GSM8K (question) and
  Alpaca (instruction + input) lines are prompts, their answer / output ignored (the target generates its own).
- OpenAI content parts: the text parts joined; an image or audio part refused by its type, naming the line.
- A UTF-8 BOM, one JSON array and --prompts - (stdin, resumable when the same content is piped again) give the
  plain JSONL file's numbers.
- A target without tokenizer files is refused before anything loads; an empty prompt is found before the models
  load and skipped (listed), a file of empty prompts refused; tau n/a always says why.
"""
import io
import json
import os
import shutil

import pytest

import eval_drafter as ed
from conftest import ROOT, interrupted_then_resumed, refused_in_one_line, write_jsonl

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
ROWS = [{"id": "a", "prompt": "w20 w9 w25 w52"}, {"id": "b", "prompt": "w3 w58 w28"},
        {"id": "c", "prompt": "w3 w52 w2 w48 w6"}]
FAST = ["--demo", "--max-new-tokens", "16", "--ddtree-budgets", "none"]


class Piped:
    """sys.stdin with `data` piped in: each run reads the same bytes again, as `cmd < file` twice would."""
    def __init__(self, data):
        self.data = data

    def isatty(self):
        return False

    @property
    def buffer(self):
        return io.BytesIO(self.data)


def run(tmp_path, name, *argv):
    out = tmp_path / f"{name}.json"
    assert ed.main([*FAST, *argv, "--quiet", "--output", str(out)]) == 0
    return json.loads(out.read_text())


def numbers(report):
    d = report["drafters"][0]
    return d["tau"], d["rounds"], [(p["id"], p["prompt_tokens"], p["completion_tokens"], p["rounds"])
                                   for p in d["prompts"]]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain JSONL run that the other spellings of the same prompts must equal."""
    tmp = tmp_path_factory.mktemp("plain")
    report = run(tmp, "plain", "--prompts", write_jsonl(tmp / "p.jsonl", ROWS))
    assert [p["id"] for p in report["drafters"][0]["prompts"]] == ["a", "b", "c"] and report["drafters"][0]["rounds"]
    return report


def seen_prompts(monkeypatch):
    """The user texts of every prompt the target tokenizes, as encode_prompts gets them."""
    real, seen = ed.encode_prompts, []

    def spy(tokenizer, items, *args, **kwargs):
        seen.extend(m["content"] for it in items for m in it.messages)
        return real(tokenizer, items, *args, **kwargs)

    monkeypatch.setattr(ed, "encode_prompts", spy)
    return seen


# ----------------------------------------------------------------------------------------------------
# Ids and dataset formats


@pytest.mark.parametrize("key", ["id", "task_id", "question_id", "idx", "sample_id"])
def test_each_id_key_names_the_prompt(tmp_path, key):
    items = ed.read_prompts(write_jsonl(tmp_path / "p.jsonl", [{key: 81, "prompt": "w1"}, {key: "x/2", "prompt": "w2"},
                                                               {"prompt": "w3"}]))
    assert [it.id for it in items] == ["81", "x/2", "3"]   # numbers made strings; none: the line number


def test_the_first_id_key_present_wins(tmp_path):
    rows = [{"sample_id": "s", "idx": 4, "question_id": "q", "task_id": "t", "prompt": "w1"},
            {"sample_id": "s", "idx": 4, "question_id": "q", "prompt": "w1"},
            {"sample_id": "s", "idx": 4, "prompt": "w1"}, {"sample_id": "s", "task_id": None, "prompt": "w1"}]
    assert [it.id for it in ed.read_prompts(write_jsonl(tmp_path / "p.jsonl", rows))] == ["t", "q", "4", "s"]


def test_gsm8k_and_alpaca_lines_run_as_their_questions(tmp_path, monkeypatch, capsys):
    """The target sees GSM8K's question and Alpaca's instruction with its input below it; GSM8K's answer and
    Alpaca's output are not the target's replies, so its own greedy references are scored (and a note says so)."""
    rows = [{"question_id": 81, "question": "w3 w4 w5", "answer": "w9 w9 #### 42"},
            {"task_id": "alpaca/2", "instruction": "w1 w2", "input": "w7 w8", "output": "w9 w10"},
            {"idx": 3, "instruction": "w5 w6", "input": ""}]
    seen = seen_prompts(monkeypatch)
    out = tmp_path / "o.json"
    assert ed.main([*FAST, "--prompts", write_jsonl(tmp_path / "p.jsonl", rows), "--output", str(out)]) == 0
    assert seen == ["w3 w4 w5", "w1 w2\n\nw7 w8", "w5 w6"]
    prompts = json.loads(out.read_text())["drafters"][0]["prompts"]
    assert [(p["id"], p["prompt_tokens"], p["reference_generated"]) for p in prompts] == \
        [("81", 3, True), ("alpaca/2", 4, True), ("3", 2, True)]
    assert "note: GSM8K's \"answer\" is a person's solution; Alpaca's \"output\" is text-davinci-003's reply: not " \
           "the target's own, so not used as the reference; the target generates its own" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# OpenAI content parts


def test_content_parts_are_joined(tmp_path):
    def text(*parts):
        return [{"type": "text", "text": t} for t in parts]
    rows = [{"messages": [{"role": "system", "content": text("w1")}, {"role": "user", "content": text("w2 w3", "w4")}]},
            {"conversations": [{"from": "human", "value": text("w5")}, {"from": "gpt", "value": text("w6", "w7")}]}]
    first, second = ed.read_prompts(write_jsonl(tmp_path / "p.jsonl", rows))
    assert first.messages == [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3\nw4"}]
    assert second.messages == [{"role": "user", "content": "w5"}] and second.completion == "w6\nw7"


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_a_part_that_is_not_text_is_refused_by_name(tmp_path, capsys, part):
    rows = [{"prompt": "w1"}, {"messages": [{"role": "user", "content": [{"type": "text", "text": "w2"}, part]}]}]
    refused_in_one_line(capsys, ["--demo", "--prompts", write_jsonl(tmp_path / "p.jsonl", rows), "--quiet"],
                        f"line 2: a chat turn holds a part of type '{part['type']}'; only text parts can be evaluated")


# ----------------------------------------------------------------------------------------------------
# BOM, JSON array, stdin: the plain file's numbers


def test_a_bom_file_gives_the_plain_numbers(tmp_path, plain):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in ROWS).encode())
    assert numbers(run(tmp_path, "bom", "--prompts", str(path))) == numbers(plain)


def test_a_json_array_file_gives_the_plain_numbers(tmp_path, plain):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(ROWS, indent=2))
    assert numbers(run(tmp_path, "array", "--prompts", str(path))) == numbers(plain)


def test_a_json_array_names_its_bad_element(tmp_path, capsys):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([ROWS[0], {"text": "w1"}]))
    refused_in_one_line(capsys, ["--demo", "--prompts", str(path), "--quiet"], f"{path} item 2: no prompt field")


def test_stdin_gives_the_plain_numbers_and_hashes_what_it_read(tmp_path, monkeypatch, plain):
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    monkeypatch.setattr("sys.stdin", Piped(data))
    report = run(tmp_path, "stdin", "--prompts", "-")
    assert numbers(report) == numbers(plain)
    assert report["config"]["prompts"] == "-" and report["config"]["prompts_hash"] == plain["config"]["prompts_hash"]


def test_stdin_resumes_when_the_same_content_is_piped_again(tmp_path, monkeypatch, plain):
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    monkeypatch.setattr("sys.stdin", Piped(data))
    out = tmp_path / "o.json"
    argv = [*FAST, "--prompts", "-", "--quiet", "--output", str(out)]
    assert numbers(interrupted_then_resumed(monkeypatch, argv, out, "evaluate_prompts", 2, 1)) == numbers(plain)


def test_stdin_with_other_content_does_not_resume(tmp_path, monkeypatch, capsys):
    out = tmp_path / "o.json"
    argv = [*FAST, "--prompts", "-", "--quiet", "--output", str(out)]
    monkeypatch.setattr("sys.stdin", Piped("".join(json.dumps(r) + "\n" for r in ROWS).encode()))
    real = ed.evaluate_prompts
    monkeypatch.setattr(ed, "evaluate_prompts", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert ed.main(argv) == 130
    monkeypatch.setattr(ed, "evaluate_prompts", real)
    monkeypatch.setattr("sys.stdin", Piped(json.dumps(ROWS[0]).encode()))
    capsys.readouterr()
    refused_in_one_line(capsys, [*argv, "--resume"], "other settings (the prompts (file content) differ)")


# ----------------------------------------------------------------------------------------------------
# Found before the models load


def forbid(monkeypatch, *names):
    for name in names:
        monkeypatch.setattr(ed, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} was called"))


def test_a_target_without_a_tokenizer_is_named_before_anything_loads(tmp_path, monkeypatch, capsys):
    target = tmp_path / "target"
    shutil.copytree(os.path.join(DEMO, "target"), target, ignore=shutil.ignore_patterns("tokenizer*"))
    forbid(monkeypatch, "load_run", "load_target", "load_drafter")
    refused_in_one_line(capsys, ["--demo", "--target", str(target), "--quiet"],
                        f"the target {target} has no tokenizer (none of tokenizer.json, vocab.json")


def test_an_empty_prompt_is_skipped_named_before_the_models_load(tmp_path, monkeypatch, capsys, plain):
    """The empty line is named (a note, before any model loads) and listed under skipped; the others run."""
    rows = [ROWS[0], {"id": "e", "prompt": "  "}, ROWS[1], {"id": "m", "messages": [{"role": "user", "content": ""}]},
            ROWS[2]]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    real, before_load = ed.load_run, []
    monkeypatch.setattr(ed, "load_run", lambda *a: before_load.append(capsys.readouterr().err) or real(*a))
    out = tmp_path / "o.json"
    assert ed.main([*FAST, "--prompts", path, "--output", str(out)]) == 0
    assert f'note: skipping prompt e: the prompt is empty ({path} line 2); the report lists it under "skipped"' \
        in before_load[0]
    assert f"note: skipping prompt m: the prompt is empty ({path} line 4)" in before_load[0]
    report = json.loads(out.read_text())
    assert report["skipped"] == [{"id": "e", "reason": f"the prompt is empty ({path} line 2)"},
                                 {"id": "m", "reason": f"the prompt is empty ({path} line 4)"}]
    assert numbers(report) == numbers(plain)


def test_each_empty_prompt_is_named(tmp_path):
    rows = [{"prompt": "w1"}, {"turns": ["w1", " "]}, {"instruction": " ", "input": ""}, {"question": "\n"},
            {"messages": [{"role": "system", "content": "w1"}, {"role": "user", "content": ""}]}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    assert [it.skip for it in ed.read_prompts(path)] == [
        None, f"the prompt (turn 2) is empty ({path} line 2)", f"the prompt is empty ({path} line 3)",
        f"the prompt is empty ({path} line 4)", None]   # a system message is text the target reads


def test_a_file_of_empty_prompts_is_refused_before_the_models_load(tmp_path, monkeypatch, capsys):
    rows = [{"prompt": ""}, {"turns": ["w1", " "]}, {"instruction": "", "input": "\n"}]
    forbid(monkeypatch, "load_run", "load_target")
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    refused_in_one_line(capsys, ["--demo", "--prompts", path, "--quiet"],
                        f"every prompt of {path} is empty (line 1, line 2, line 3): nothing to evaluate")


# ----------------------------------------------------------------------------------------------------
# tau n/a says why


@pytest.mark.parametrize("completions, reason", [
    (["", ""], "tau n/a (no anchors: every completion is empty)"),
    (["", "w1 w2"], "tau n/a (no rounds: every completion is shorter than one block of 8 tokens)")])
def test_tau_na_prints_its_reason(tmp_path, capsys, completions, reason):
    rows = [{**row, "completion": c} for row, c in zip(ROWS, completions)]
    assert ed.main([*FAST, "--prompts", write_jsonl(tmp_path / "p.jsonl", rows), "--quiet"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("-- all:"))
    assert line.startswith(f"-- all: {reason} (pooled, 0 rounds)"), line


def test_every_prompt_skipped_says_so(tmp_path, capsys):
    rows = [{**row, "completion_ids": [5] * 600} for row in ROWS[:2]]   # past the demo target's 512 positions
    assert ed.main([*FAST, "--prompts", write_jsonl(tmp_path / "p.jsonl", rows), "--quiet"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        'tau n/a: every prompt was skipped (2, listed under "skipped"; the first: prompt + completion (604 tokens) '
        "exceed the target's 512 positions): nothing to report"]
