"""--bench NAME[,NAME...] (issue 44): the benchmarks as z-lab's dflash/benchmark.py runs them, from local copies.

- Every form of every dataset that tests/bench_data.py writes is found under --bench-dir, and the prompts built from
  it are dflash's own (its templates, by its own code), turn for turn, in its seed-42 order; --max-samples N keeps
  the first N of that order; each line's id names the row it came from, its split the benchmark.
- A bench prompt goes through the real Qwen3 chat template as dflash's apply_chat_template puts it (thinking off by
  default, on with --enable-thinking), tokenized without added special tokens.
- A run writes report["bench"]: a row per benchmark per drafter (tau pooled over verify rounds, the mean of the
  requests' taus, the paired delta from the first drafter) and their average, each figure the one the report's own
  per-prompt entries give; the printed table has them.
- MT-Bench's two turns are two scored requests, the second with the first's reply in its context.
- Ctrl-C in the middle of a benchmark then --resume gives the uninterrupted run's report.
- A missing copy, an unknown name, --bench with --prompts, --bench-dir or --max-samples without --bench: one line each.
"""
import json
import os

import pytest

import bench_data as bd
from bench_data import dflash_bench, needs_dflash
import eval_drafter as ed
from conftest import interrupted_then_resumed, refused_in_one_line


DEMO = os.path.join(ed.DEMO_DIR, "drafter")
FROM_ANCHOR = os.path.join(os.path.dirname(ed.DEMO_DIR), "demo_from_anchor", "drafter")
CASES = [(name, form) for name in bd.NAMES for form in bd.forms(name)]


def built(name, root, samples=None):
    """ed.bench_prompts([name], root, samples, notes): (its JSONL parsed, one dict a line; the files it read)."""
    data, read = ed.bench_prompts([name], str(root), samples, [])
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.decode("utf-8").splitlines()], read[name]


def turns_of(line):
    return line["turns"] if "turns" in line else [line["prompt"]]


@needs_dflash
@pytest.mark.parametrize("name, form", CASES)
def test_every_form_gives_dflash_prompts_in_its_order(tmp_path, name, form):
    """The prompts are dflash's, from any local copy: for each dataset and each form bench_data writes, the tool finds
    the copy (the files it read are the ones written), and its prompts equal those dflash's benchmark code builds
    from the same rows, turn for turn, in its seed-42 order; --max-samples 5 gives the first 5 of them. Each line's id
    is <name>-<i>, i the row's place in the split as stored (found here by content, not by redoing the shuffle), its
    split is the benchmark; MT-Bench lines keep both turns ("turns"), the others one "prompt"."""
    rows = bd.sample_rows(name)
    written = os.path.realpath(bd.write(name, form, tmp_path, rows))
    lines, read = built(name, tmp_path)
    assert read and all(os.path.realpath(p) == written or os.path.realpath(p).startswith(written + os.sep)
                        for p in read), (read, written)

    want = bd.dflash_prompts(name, rows)
    assert len(want) == len(rows) and [turns_of(x) for x in lines] == want
    first5, _ = built(name, tmp_path, 5)
    assert [turns_of(x) for x in first5] == bd.dflash_prompts(name, rows, 5) == want[:5]
    assert first5 == lines[:5]

    in_order = [s["turns"] for s in bd.dflash_samples(name, rows)]   # dflash's prompts in the split's own order
    assert len({json.dumps(t) for t in in_order}) == len(in_order), "rows must give distinct prompts"
    assert [x["id"] for x in lines] == [f"{name}-{in_order.index(t)}" for t in want]
    assert [x["id"] for x in lines] != [f"{name}-{i}" for i in range(len(rows))], "the order is not shuffled"
    key = "turns" if name == "mt-bench" else "prompt"
    assert all(set(x) == {"id", "split", key} and x["split"] == name for x in lines)
    assert [len(turns_of(x)) for x in lines] == [2 if name == "mt-bench" else 1] * len(rows)


@needs_dflash
@pytest.mark.parametrize("thinking", [False, True])
def test_the_chat_template_is_dflash(tmp_path, qwen_target, thinking):
    """A bench prompt is tokenized as dflash's benchmark does it: on the real Qwen3 tokenizer, the tool's prompt ids of
    a one-turn item (gsm8k) and of both MT-Bench turns (the second with the first turn and its reply before it) equal
    dflash.benchmark.apply_chat_template(tokenizer, messages, reasoning) encoded with add_special_tokens=False,
    reasoning "off" when the tool runs with thinking off (its default) and "on" with --enable-thinking."""
    for name in ("gsm8k", "mt-bench"):
        bd.write(name, "jsonl", tmp_path)
    argv = ["--target", qwen_target["path"], "--ckpt", DEMO, "--bench", "gsm8k,mt-bench", "--bench-dir",
            str(tmp_path), "--max-samples", "2", "--quiet", *(["--enable-thinking"] if thinking else [])]
    settings = ed.prepare(ed.resolve_settings(ed.parse_args(argv)), ranks=False)
    assert settings.enable_thinking is thinking and settings.no_chat_template is False
    items = ed.expand(ed.read_prompts(settings.prompts), settings)
    turns = [("gsm8k", None)] * 2 + [("mt-bench", 1), ("mt-bench", 2)] * 2
    assert [(it.split, it.turn) for it in items] == turns
    tok, reasoning = qwen_target["tokenizer"], "on" if thinking else "off"

    def dflash_ids(messages):
        return tok.encode(dflash_bench.apply_chat_template(tok, messages, reasoning), add_special_tokens=False)

    by_index, reply = {it.index: it for it in items}, "Sure: a short note, then {braces} and a \\ backslash."
    for it in items:
        if it.turn == 2:
            it.messages = ed.conversation(it, by_index, tok)
        assert ed.encode_prompts(tok, [it], settings) == "applied"
        user = [{"role": "user", "content": t} for t in (it.turns or [it.row["prompt"]])]
        messages = user[:1] if it.turn != 2 else [user[0], {"role": "assistant", "content": reply}, user[1]]
        assert it.prompt_ids == dflash_ids(messages), (it.id, it.turn)
        it.completion = reply   # turn 2's context: this reply
    think = tok.convert_tokens_to_ids("<think>")
    assert (think in items[0].prompt_ids) is not thinking, "thinking off closes an empty <think> block"


def demo_rows(texts):
    """Rows of gsm8k, humaneval and mt-bench whose text is the demo pair's own words, so the demo target's replies
    and the drafters' rounds differ from prompt to prompt."""
    return {"gsm8k": [{"question": t, "answer": "#### 0"} for t in texts],
            "humaneval": [{"task_id": f"HumanEval/{i}", "prompt": t, "canonical_solution": "", "test": "",
                           "entry_point": "f"} for i, t in enumerate(texts)],
            "mt-bench": [{"prompt": [t, " ".join(reversed(t.split()))], "prompt_id": i, "category": "writing",
                          "reference": []} for i, t in enumerate(texts)]}


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    """gsm8k (a to_json export), humaneval (the hub's parquet) and mt-bench (its parquet) in the demo's words."""
    with open(os.path.join(ed.DEMO_DIR, "prompts.jsonl"), encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f if line.strip()]
    root = tmp_path_factory.mktemp("bench")
    for (name, rows), form in zip(demo_rows(texts).items(), ("jsonl", "parquet", "parquet")):
        bd.write(name, form, root, rows)
    return str(root)


BASE = ["--demo", "--max-new-tokens", "32", "--ddtree-budgets", "none"]
TWO = ["--ckpt", f"a={DEMO}", "--ckpt", f"b={FROM_ANCHOR}"]


def pooled(entries):
    rounds = [r for p in entries for r in p["rounds"]]
    return sum(rounds) / len(rounds)


def test_the_bench_table_is_the_reports_own_figures(tmp_path, bench_dir, capsys):
    """report["bench"] holds, per benchmark and drafter, the figures the report's own per-prompt entries give: tau
    pooled over the benchmark's verify rounds (committed tokens over rounds), the mean of its requests' taus, the
    prompt and request counts, the second drafter's paired delta (the pooled difference, every prompt being both
    drafters'), and the average row is the mean over the benchmarks; the printed table has the header, a row per
    benchmark per drafter and the average, with these numbers. b drafts 8 a round and a 7: every row is at depth 7,
    b's from its depth-7 rounds."""
    out = tmp_path / "r.json"
    assert ed.main([*BASE, *TWO, "--bench", "gsm8k,humaneval", "--bench-dir", bench_dir, "--max-samples", "4",
                    "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    bench, names = report["bench"], ["gsm8k", "humaneval"]
    assert bench["recipe"] == {"name": "dflash", "source": "z-lab's dflash/benchmark.py", "seed": 42,
                               "max_new_tokens": 2048, "reported": "tau_request_mean"}
    assert bench["departures"] == ["references of up to 32 new tokens (the recipe's: 2048)"]
    assert bench["depth"] == 7   # b drafts 8 a round, a 7: the table is at the common depth (issue 52)
    assert list(bench["benchmarks"]) == names
    assert [r["drafter"] for r in bench["average"]] == ["a", "b"]
    taus = set()
    for name in names:
        rows = bench["benchmarks"][name]
        assert [r["drafter"] for r in rows] == ["a", "b"]
        for d, row in zip(report["drafters"], rows):
            entries = [{**p, "rounds": r, "tau": sum(r) / len(r)} for p in d["prompts"] if p["split"] == name
                       for r in [p["rounds"] if d["drafts_per_round"] == 7 else p["depth_rounds"]["7"]]]
            assert len(entries) == 4 and all(p["id"].startswith(name + "-") for p in entries)
            assert row["prompts"] == row["requests"] == 4
            assert row["tau"] == pytest.approx(pooled(entries), abs=1e-12)
            assert row["tau_request_mean"] == pytest.approx(sum(p["tau"] for p in entries) / 4, abs=1e-12)
            assert row["accepted_per_step"] == pytest.approx(row["tau"] - 1, abs=1e-12)
            ranked = sorted(p["tau"] for p in entries)   # 4 requests: linear interpolation between the ranks
            assert row["tau_request_p10_p50_p90"] == pytest.approx(
                [ranked[0] + 0.3 * (ranked[1] - ranked[0]), (ranked[1] + ranked[2]) / 2,
                 ranked[2] + 0.7 * (ranked[3] - ranked[2])], abs=1e-12)
            assert row["tau_ci95"][0] <= row["tau"] <= row["tau_ci95"][1]
            assert row["tau_request_mean_ci95"][0] <= row["tau_request_mean"] <= row["tau_request_mean_ci95"][1]
            taus |= {p["tau"] for p in entries}
        assert rows[0]["delta_tau"] is None and rows[0]["delta_tau_ci95"] is None
        assert rows[1]["delta_tau"] == pytest.approx(rows[1]["tau"] - rows[0]["tau"], abs=1e-12)
        assert rows[1]["delta_tau_ci95"][0] <= rows[1]["delta_tau"] <= rows[1]["delta_tau_ci95"][1]
    assert len(taus) > 2, "the prompts' taus should differ, or a mean could not tell them apart"
    assert any(bench["benchmarks"][n][1]["delta_tau"] for n in names), "the drafters should differ somewhere"
    for j, avg in enumerate(bench["average"]):
        for key in ("tau", "tau_request_mean"):
            assert avg[key] == pytest.approx(sum(bench["benchmarks"][n][j][key] for n in names) / 2, abs=1e-12)
            assert avg[key + "_ci95"][0] <= avg[key] <= avg[key + "_ci95"][1]
    a, b = bench["average"]
    assert a.get("delta_tau") is None and a.get("delta_tau_ci95") is None
    assert b["delta_tau"] == pytest.approx(sum(bench["benchmarks"][n][1]["delta_tau"] for n in names) / 2, abs=1e-12)
    assert b["delta_tau"] == pytest.approx(b["tau"] - a["tau"], abs=1e-12)
    assert b["delta_tau_ci95"][0] <= b["delta_tau"] <= b["delta_tau_ci95"][1]

    lines = printed.splitlines()
    header = [i for i, line in enumerate(lines) if line.split()[:3] == ["benchmark", "drafter", "prompts"]]
    assert len(header) == 1, printed
    table = [line.split() for line in lines[header[0] + 1:header[0] + 7]]
    want = [(n, r) for n in names for r in bench["benchmarks"][n]] + [("average", r) for r in bench["average"]]
    assert [t[:2] for t in table] == [[n, r["drafter"]] for n, r in want]
    for t, (n, r) in zip(table, want):
        assert f"{r['tau']:.3f}" in t and f"{r['tau_request_mean']:.3f}" in t, (t, r)
        assert (t[2] == "4") is (n != "average")
        assert (f"{r['delta_tau']:+.3f}" in t) if r.get("delta_tau") is not None else \
            len(t) == 10 - 2 * (n == "average")
    title, departs, depth = lines[header[0] - 5:header[0] - 2]   # above the two files read
    assert depth.startswith("   every row at depth 7, the fewest drafts a round")
    assert "--bench-recipe dflash" in title and "thinking off" in title and "mean of per-request means" in title
    assert departs.split(": ", 1)[1] == bench["departures"][0]
    assert "mean of requests* [95%]" in lines[header[0]] and "tau pooled [95%]" in lines[header[0]]


def test_published_figures_print_beside_the_run_with_the_recipe_differences(tmp_path, bench_dir, capsys):
    """--published NAME (issue 52): the table's published row for each benchmark it has figures for, its source,
    and each way its recipe differs from this run's; where they agree nothing is named."""
    out = tmp_path / "r.json"
    assert ed.main([*BASE, "--bench", "gsm8k,humaneval", "--bench-dir", bench_dir, "--max-samples", "4",
                    "--published", "z-lab/Qwen3-8B-DFlash-b16", "--output", str(out)]) == 0
    pub, table = json.loads(out.read_text())["bench"]["published"], ed.PUBLISHED["z-lab/Qwen3-8B-DFlash-b16"]
    assert pub["figures"] == {"gsm8k": table.figures["gsm8k"]} and pub["source"] == table.source
    assert pub["differences"] == ["sampling: not stated there, greedy decoding here", "block: 16 there, 8 here",
                                  "thinking: not stated there, off here", "gsm8k prompts: not stated there, 4 here"]
    lines = capsys.readouterr().out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.split()[:2] == ["gsm8k", "published"])
    assert lines[row - 1].split()[:2] == ["gsm8k", "demo"] and f"{table.figures['gsm8k']:.3f}" in lines[row]
    assert not any(line.split()[:2] == ["humaneval", "published"] for line in lines)
    assert any(line.startswith("   published: z-lab/Qwen3-8B-DFlash-b16") and "block: 16 there, 8 here" in line
               for line in lines)
    # the DFlash 2 row was measured at block 8 with thinking on, T 1, top-p 0.95, top-k 20 over 128 prompts: only
    # the prompts differ when this run samples the same way with thinking on
    assert ed.main([*BASE, "--bench", "gsm8k", "--bench-dir", bench_dir, "--max-samples", "4", "--enable-thinking",
                    "--temperature", "1", "--top-p", "0.95", "--top-k", "20", "--published",
                    "z-lab/Qwen3.8-27B-DFlash2", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["bench"]["published"]["differences"] == ["gsm8k prompts: 128 there, 4 here"]


def test_mt_bench_runs_both_turns_the_second_after_the_first_reply(tmp_path, bench_dir):
    """MT-Bench as dflash runs it: each conversation gives two scored requests, turn 1 and turn 2, in that order;
    turn 2's context holds turn 1's prompt and the target's reply to it, so it is longer than both together; the bench
    row counts 3 prompts and 6 requests, its request mean over all 6 turns."""
    out = tmp_path / "mt.json"
    assert ed.main([*BASE, "--bench", "mt-bench", "--bench-dir", bench_dir, "--max-samples", "3", "--quiet",
                    "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    entries = report["drafters"][0]["prompts"]
    assert [p["turn"] for p in entries] == [1, 2] * 3 and all(p["split"] == "mt-bench" for p in entries)
    assert [p["id"] for p in entries[::2]] == [p["id"] for p in entries[1::2]]
    for first, second in zip(entries[::2], entries[1::2]):
        assert first["completion_tokens"] > 0
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"], (first, second)
    row = report["bench"]["benchmarks"]["mt-bench"][0]
    assert (row["prompts"], row["requests"]) == (3, 6)
    assert row["tau_request_mean"] == pytest.approx(sum(p["tau"] for p in entries) / 6, abs=1e-12)
    assert row["tau"] == pytest.approx(pooled(entries), abs=1e-12)


def figures(report):
    return [{k: v for k, v in d.items() if k != "checkpoint"} for d in report["drafters"]], report["bench"]


@pytest.mark.parametrize("cut, kept", [(2, 1), (5, 4)])
def test_resumed_mid_benchmark_equals_the_whole_run(tmp_path, bench_dir, monkeypatch, cut, kept):
    """Nothing is lost or counted twice when a --bench run is interrupted: Ctrl-C at the cut-th prompt's scoring
    (inside gsm8k, or inside mt-bench between turns) exits 130 keeping the prompts scored, and --resume ends with the
    uninterrupted run's drafter figures and bench table."""
    argv = [*BASE, *TWO, "--bench", "gsm8k,mt-bench", "--bench-dir", bench_dir, "--max-samples", "3", "--quiet"]
    whole = tmp_path / "whole.json"
    assert ed.main([*argv, "--output", str(whole)]) == 0
    out = tmp_path / "out.json"
    resumed = interrupted_then_resumed(monkeypatch, [*argv, "--output", str(out)], out, "evaluate_prompts", cut, kept)
    want = json.loads(whole.read_text())
    assert list(want["bench"]["benchmarks"]) == ["gsm8k", "mt-bench"]
    assert not resumed.get("interrupted")
    assert figures(resumed) == figures(want)


def test_bench_refusals_are_one_line(tmp_path, capsys):
    """A --bench the run cannot use is refused before anything loads, in one line on stderr (exit 2, no traceback):
    a benchmark with no local copy (the line names the folder looked in, the file names looked for and the
    datasets command that saves one there, or for Spec-Bench and SPEED-Bench their own way to one), an unknown or
    empty name, two suites' benchmarks without --bench-recipe to run them by, --bench beside --prompts, --bench-dir,
    --bench-recipe or --max-samples without --bench, and --limit (which would drop the later benchmarks whole)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    refused_in_one_line(capsys, ["--demo", "--bench", "humaneval,gsm8k", "--bench-dir", str(empty)],
                        f"--bench humaneval: no local copy in {empty} (looked for humaneval.jsonl")
    refused_in_one_line(capsys, ["--demo", "--bench", "gsm8k", "--bench-dir", str(empty)],
                        "datasets.load_dataset('openai/gsm8k', 'main', split='test').to_json("
                        f"'{os.path.join(str(empty), 'gsm8k.jsonl')}')")
    for value in ("gsm9k", "gsm8k,,nope", ",", "All"):
        refused_in_one_line(capsys, ["--demo", "--bench", value, "--bench-dir", str(empty)],
                            "--bench takes gsm8k, math500, humaneval, mbpp, mt-bench, specbench, speed-bench or all, "
                            f"comma-separated; got {value!r}")
    refused_in_one_line(capsys, ["--demo", "--bench", "gsm8k,specbench", "--bench-dir", str(empty)],
                        "--bench gsm8k,specbench joins suites run by different recipes (dflash, specbench): name the "
                        "one to run them all by with --bench-recipe")
    refused_in_one_line(capsys, ["--demo", "--bench", "specbench", "--bench-dir", str(empty)],
                        f"save one there, e.g. curl -o {empty}/specbench.jsonl https://raw.githubusercontent.com/"
                        "hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl")
    refused_in_one_line(capsys, ["--demo", "--bench", "speed-bench", "--bench-dir", str(empty)],
                        "Model-Optimizer's examples/specdec_bench/prepare_data.py --config qualitative --output_dir "
                        f"{empty}")
    prompts = os.path.join(ed.DEMO_DIR, "prompts.jsonl")
    refused_in_one_line(capsys, ["--demo", "--bench", "gsm8k", "--prompts", prompts, "--bench-dir", str(empty)],
                        "--bench builds the prompts from the benchmarks: drop --prompts")
    for flag, value in (("--bench-dir", str(empty)), ("--max-samples", "3"), ("--bench-recipe", "specbench")):
        refused_in_one_line(capsys, ["--demo", flag, value],
                            "--bench-dir, --bench-recipe, --max-samples and --published go with --bench")
    refused_in_one_line(capsys, ["--demo", "--bench", "gsm8k", "--limit", "3", "--bench-dir", str(empty)],
                        "--limit cuts the benchmarks joined, the later ones first: use --max-samples N")
    assert os.listdir(empty) == []


def test_a_cache_of_two_versions_reads_the_newest_once(tmp_path):
    """The hub cache and the datasets cache keep every version they fetched: the newest is read, once, and a note
    says so (read both, each prompt would run twice, in an order that is not dflash's)."""
    import shutil
    for form in ("hub_cache", "hf_cache"):
        root = tmp_path / form
        path = bd.write("gsm8k", form, root)
        old = str(path).replace(bd.commit("gsm8k"), "0" * 40)
        shutil.copytree(os.path.dirname(path) if form == "hf_cache" else str(path).split(bd.commit("gsm8k"))[0] +
                        bd.commit("gsm8k"), os.path.dirname(old) if form == "hf_cache" else
                        str(path).split(bd.commit("gsm8k"))[0] + "0" * 40, symlinks=True)
        os.utime(os.path.dirname(old) if form == "hf_cache" else str(path).split(bd.commit("gsm8k"))[0] + "0" * 40,
                 (1, 1))
        notes = []
        data, read = ed.bench_prompts(["gsm8k"], str(root), None, notes)
        prompts = [json.loads(line)["prompt"] for line in data.decode().splitlines()]
        assert [[p] for p in prompts] == bd.dflash_prompts("gsm8k")
        assert read["gsm8k"] == [str(path)] and "2 cached versions; the newest is read" in notes[0]


def test_a_json_export_of_lines_is_read_and_a_broken_one_refused(tmp_path, capsys):
    """Dataset.to_json("x.json") writes one object a line: read as lines; a cut-off line is one clear refusal."""
    rows = bd.sample_rows("gsm8k")
    (tmp_path / "gsm8k.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data, _ = ed.bench_prompts(["gsm8k"], str(tmp_path), None, [])
    assert len(data.decode().splitlines()) == len(rows)
    (tmp_path / "gsm8k.json").write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1])[:20] + "\n")
    with pytest.raises(ed.UsageError, match=r"--bench gsm8k: .*gsm8k.json is not valid JSON"):
        ed.bench_prompts(["gsm8k"], str(tmp_path), None, [])


def test_the_picture_and_the_board_have_tau_by_benchmark(tmp_path, bench_dir):
    """--plot draws tau per benchmark per drafter (one bars panel, a bar per benchmark), and --tensorboard logs each
    benchmark's tau: the report's own split figures. The two draft 7 and 8 a round, so the bars are at depth 7, the
    common one (issue 52): b's are its depth-7 rounds' pooled tau, from the report's per-prompt entries."""
    out = tmp_path / "r.json"
    assert ed.main([*BASE, *TWO, "--bench", "gsm8k,humaneval", "--bench-dir", bench_dir, "--max-samples", "3",
                    "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    panel = next(p for p in ed.plot_panels(report) if p[0].startswith("tau by split"))
    assert panel[3] == "bars" and [label for label, *_ in panel[4]] == ["a", "b"] and "at depth 7" in panel[0]
    (_, xs, ys, _), (_, _, ys_b, _) = panel[4]
    a, b = report["drafters"]
    assert xs == ["gsm8k", "humaneval"] and ys == [a["splits"][n]["tau"] for n in xs]
    assert b["drafts_per_round"] == 8 and ys_b == [pytest.approx(pooled(
        [{"rounds": p["depth_rounds"]["7"]} for p in b["prompts"] if p["split"] == n]), abs=1e-12) for n in xs]
    assert ys_b != [b["splits"][n]["tau"] for n in xs]
    scalars = ed.board_scalars(report["drafters"][1])
    assert {k: v for k, v in scalars.items() if k.startswith("split_tau/")} == {
        f"split_tau/{n}": report["drafters"][1]["splits"][n]["tau"] for n in ("gsm8k", "humaneval")}
