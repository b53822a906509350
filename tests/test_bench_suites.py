"""--bench specbench, --bench speed-bench and --bench-recipe (issue 44): the wider suites and the other protocols.

- Spec-Bench's question.jsonl, wherever its users keep it (a clone of the repo, AIPerf's cached copy, an export), gives
  its questions turn for turn in the file's order; a row's split is its subtask (Spec-Bench's speed.py: MT-Bench's 8
  categories are "mt_bench"). --max-samples N keeps the file's first N.
- SPEED-Bench's qualitative split, from the hub's parquet or specdec_bench's prepared one, splits by category; the
  hub's placeholder prompts are refused in one line that says how to fetch the real ones.
- --bench-recipe dflash on Spec-Bench orders its rows as dflash's own _select_dataset does (seed 42); --bench-recipe
  specbench on GSM8K gives the raw question, in the file's order; a dflash {"turns"} export is refused under another
  recipe (its prompts carry dflash's template).
- A run's table holds a row per subtask and the suite's overall row, each pooled over the verify rounds of its own
  requests (as speed.py's np.mean of every step's accepted length), and the average is the suite's overall.
- The recipe sets the references' length when --max-new-tokens is not given; a run that departs from it says so.
- Ctrl-C in the middle of a suite, then --resume, gives the uninterrupted run's report.
"""
import json
import os

import pytest

import bench_data as bd
from bench_data import dflash_bench, needs_dflash
import eval_drafter as ed
from conftest import interrupted_then_resumed, refused_in_one_line


def built(name, root, samples=None, recipe=None):
    data, read = ed.bench_prompts([name], str(root), samples, [], recipe)
    return [json.loads(line) for line in data.decode("utf-8").splitlines()], read[name]


def turns_of(line):
    return line["turns"] if "turns" in line else [line["prompt"]]


@pytest.mark.parametrize("form", list(bd.SUITE_FORMS["specbench"]))
def test_spec_bench_is_its_questions_in_file_order(tmp_path, form):
    """Spec-Bench from a clone, AIPerf's cached copy or an export: its turns as they are, in the file's order, ids by
    row, a split per speed.py subtask (MT-Bench's 8 categories as mt_bench); --max-samples 5 is the first 5."""
    rows = bd.spec_bench_rows()
    written = bd.write_suite("specbench", form, tmp_path, rows)
    lines, read = built("specbench", tmp_path)
    assert read == [written]
    assert [turns_of(x) for x in lines] == [r["turns"] for r in rows]
    assert [x["id"] for x in lines] == [f"specbench-{i}" for i in range(len(rows))]
    mt = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert [x["split"] for x in lines] == \
        [f"specbench/{'mt_bench' if r['category'] in mt else r['category']}" for r in rows]
    assert len({x["split"] for x in lines}) == 6   # speed.py's subtasks
    assert built("specbench", tmp_path, 5)[0] == lines[:5]


@needs_dflash
def test_spec_bench_under_dflash_recipe_is_in_dflash_order(tmp_path):
    """--bench-recipe dflash on Spec-Bench: the order dflash's own _select_dataset gives the same rows (seed 42), and
    --max-samples 7 its first 7; not the file's order."""
    rows = bd.spec_bench_rows()
    bd.write_suite("specbench", "export", tmp_path, rows)
    lines, _ = built("specbench", tmp_path, recipe="dflash")
    want = dflash_bench._select_dataset([{"turns": r["turns"]} for r in rows], None)
    assert [turns_of(x) for x in lines] == [w["turns"] for w in want]
    assert [turns_of(x) for x in built("specbench", tmp_path, 7, "dflash")[0]] == [w["turns"] for w in want[:7]]
    assert lines != built("specbench", tmp_path)[0]


@pytest.mark.parametrize("form", ["parquet", "prepared", "export"])
def test_speed_bench_splits_by_category(tmp_path, form):
    """SPEED-Bench from the hub's parquet, specdec_bench's prepared parquet or an export: every turn of each row, a
    split per category, two-turn rows as two turns."""
    rows = bd.speed_bench_rows()
    written = bd.write_suite("speed-bench", form, tmp_path, rows)
    lines, read = built("speed-bench", tmp_path)
    assert read == [written]
    assert [turns_of(x) for x in lines] == [r["turns"] for r in rows]
    assert [x["split"] for x in lines] == [f"speed-bench/{r['category']}" for r in rows]
    assert [len(turns_of(x)) for x in lines] == [2 if r["multiturn"] else 1 for r in rows]


def test_speed_bench_as_aiperf_lines(tmp_path):
    """AIPerf's SPEED-Bench lines hold OpenAI-style "messages" in place of "turns": the user turns are the prompt."""
    rows = bd.speed_bench_rows()
    lines = [{"question_id": r["question_id"], "category": r["category"],
              "messages": [{"role": "user", "content": t} for t in r["turns"]]} for r in rows]
    bd.write_suite("speed-bench", "export", tmp_path, lines)
    assert [turns_of(x) for x in built("speed-bench", tmp_path)[0]] == [r["turns"] for r in rows]


def test_speed_bench_placeholders_are_refused(tmp_path, capsys):
    """The hub copy's placeholder prompts are refused in one line that names the file and how to fetch the real ones."""
    bd.write_suite("speed-bench", "parquet", tmp_path, bd.speed_bench_rows(placeholder=True))
    refused_in_one_line(capsys, ["--demo", "--bench", "speed-bench", "--bench-dir", str(tmp_path)],
                        "--bench speed-bench: " + os.path.join(str(tmp_path), bd.SUITE_FORMS["speed-bench"]["parquet"])
                        + " holds the hub's placeholder prompts; the hub copy's prompts are placeholders: fetch them "
                        "with NVIDIA Model-Optimizer's examples/specdec_bench/prepare_data.py --config qualitative "
                        f"--output_dir {tmp_path}")


@needs_dflash
def test_a_recipe_builds_its_own_prompts_from_the_same_rows(tmp_path, capsys):
    """The same GSM8K rows: dflash's recipe gives dflash's prompts (its template, its order), Spec-Bench's and
    SPEED-Bench's the raw question in the file's order; dflash's formatted {"turns"} export reads under dflash's
    recipe and is refused under another."""
    rows = bd.sample_rows("gsm8k")
    bd.write("gsm8k", "jsonl", tmp_path, rows)
    raw, _ = built("gsm8k", tmp_path, recipe="specbench")
    assert [x["prompt"] for x in raw] == [r["question"] for r in rows]   # as Spec-Bench's math_reasoning: the question
    own, _ = built("gsm8k", tmp_path)
    assert [[x["prompt"]] for x in own] == bd.dflash_prompts("gsm8k", rows)
    for recipe in ("specbench", "speedbench"):   # no template: the same prompts in the same order
        assert built("gsm8k", tmp_path, recipe=recipe)[0] == raw
    turns = tmp_path / "turns"
    bd.write("gsm8k", "turns", turns, rows)   # dflash's formatted export
    assert [[x["prompt"]] for x in built("gsm8k", turns, recipe="dflash")[0]] == bd.dflash_prompts("gsm8k", rows)
    refused_in_one_line(capsys, ["--demo", "--bench", "gsm8k", "--bench-recipe", "specbench", "--bench-dir",
                                 str(turns)], "holds dflash's formatted {\"turns\"}, not the rows: save the dataset "
                        "itself for --bench-recipe specbench")


def test_the_recipe_sets_the_length_unless_given(tmp_path):
    """Without --max-new-tokens the references are as long as the recipe's (Spec-Bench 1024, dflash 2048, a named
    --bench-recipe speedbench over two suites 4096); a given length wins."""
    bd.write_suite("specbench", "export", tmp_path, bd.spec_bench_rows())
    bd.write("gsm8k", "jsonl", tmp_path)
    target = os.path.join(ed.DEMO_DIR, "target")
    for bench, recipe, tokens in (("specbench", [], 1024), ("gsm8k", [], 2048),
                                  ("gsm8k,specbench", ["--bench-recipe", "speedbench"], 4096)):
        argv = ["--target", target, "--ckpt", os.path.join(ed.DEMO_DIR, "drafter"), "--bench", bench, "--bench-dir",
                str(tmp_path), *recipe]
        settings = ed.resolve_settings(ed.parse_args(argv))
        own = recipe[1] if recipe else "specbench" if bench == "specbench" else "dflash"
        assert (settings.max_new_tokens, settings.bench_recipe) == (tokens, own)
        assert ed.resolve_settings(ed.parse_args([*argv, "--max-new-tokens", "7"])).max_new_tokens == 7


def demo_suite(texts):
    """Spec-Bench rows in the demo pair's words: two MT-Bench categories (two turns) and two subtasks."""
    cats = ["writing", "coding", "translation", "qa"]
    return [{"question_id": i, "category": cats[i % 4],
             "turns": [t, " ".join(reversed(t.split()))] if i % 4 < 2 else [t]} for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory):
    with open(os.path.join(ed.DEMO_DIR, "prompts.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    root = tmp_path_factory.mktemp("suite")
    bd.write_suite("specbench", "clone", root, demo_suite(texts[:8]))
    return str(root)


BASE = ["--demo", "--max-new-tokens", "24", "--ddtree-budgets", "none", "--ckpt",
        f"a={os.path.join(ed.DEMO_DIR, 'drafter')}", "--ckpt",
        f"b={os.path.join(os.path.dirname(ed.DEMO_DIR), 'demo_from_anchor', 'drafter')}"]


def pooled(entries):
    rounds = [r for p in entries for r in p["rounds"]]
    return sum(rounds) / len(rounds)


def test_the_table_has_each_subtask_and_the_overall(tmp_path, suite_dir, capsys):
    """--bench specbench: a row per subtask and the suite overall, each pooled over its own requests' rounds (speed.py's
    mean over every step), the average the suite's; the recipe, its reported averaging and the shorter length named."""
    out = tmp_path / "r.json"
    assert ed.main([*BASE, "--bench", "specbench", "--bench-dir", suite_dir, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    bench = report["bench"]
    subtasks = ["specbench/mt_bench", "specbench/translation", "specbench/qa"]
    assert list(bench["benchmarks"]) == [*subtasks, "specbench"]
    assert bench["recipe"]["name"] == "specbench" and bench["recipe"]["reported"] == "tau"
    assert bench["departures"] == ["references of up to 24 new tokens (the recipe's: 1024)"]
    for j, d in enumerate(report["drafters"]):
        for name, row in bench["benchmarks"].items():   # b drafts 8 a round, a 7: the table is at depth 7
            entries = [{**p, "rounds": r, "tau": sum(r) / len(r)} for p in d["prompts"]
                       if p["split"] == name or p["split"].startswith(name + "/")
                       for r in [p["rounds"] if d["drafts_per_round"] == 7 else p["depth_rounds"]["7"]]]
            assert row[j]["tau"] == pytest.approx(pooled(entries), abs=1e-12)
            assert row[j]["requests"] == len(entries)
            assert row[j]["tau_request_mean"] == pytest.approx(sum(p["tau"] for p in entries) / len(entries))
        assert bench["benchmarks"]["specbench"][j]["prompts"] == 8
        assert bench["benchmarks"]["specbench/mt_bench"][j]["requests"] == 8   # 4 rows, 2 turns each
        assert bench["average"][j]["tau"] == pytest.approx(bench["benchmarks"]["specbench"][j]["tau"], abs=1e-12)
    assert len({row[0]["tau"] for row in bench["benchmarks"].values()}) > 1
    for name in bench["benchmarks"]:
        assert any(line.split()[:2] == [name, "a"] for line in printed.splitlines()), name
    assert "Spec-Bench's evaluation (speed.py)" in printed and "tau pooled* [95%]" in printed


@pytest.mark.parametrize("cut, kept", [(3, 2), (9, 8)])
def test_resumed_mid_suite_equals_the_whole_run(tmp_path, suite_dir, monkeypatch, cut, kept):
    """Ctrl-C at the cut-th scoring (inside mt_bench, or between subtasks), then --resume: the whole run's table and
    drafters."""
    argv = [*BASE, "--bench", "specbench", "--bench-dir", suite_dir, "--quiet"]
    whole = tmp_path / "whole.json"
    assert ed.main([*argv, "--output", str(whole)]) == 0
    out = tmp_path / "out.json"
    resumed = interrupted_then_resumed(monkeypatch, [*argv, "--output", str(out)], out, "evaluate_prompts", cut, kept)
    want = json.loads(whole.read_text())
    assert not resumed.get("interrupted")
    assert resumed["bench"] == want["bench"]
    assert [{k: v for k, v in d.items() if k != "checkpoint"} for d in resumed["drafters"]] == \
        [{k: v for k, v in d.items() if k != "checkpoint"} for d in want["drafters"]]
