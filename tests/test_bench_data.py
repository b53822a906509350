"""The benchmark-copy builder of tests/bench_data.py: each dataset in each form, read back with pyarrow / json alone
(never with the builder's own code), gives the rows written, in their order, at the layout the real files have; and
dflash_prompts gives what dflash's benchmark itself builds from them, in its seed-42 order."""
import json
import os
import random
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import bench_data as bd
from bench_data import dflash_bench, needs_dflash


SHA = "[0-9a-f]{40}"
# Where each file lies under root, as the hub / `datasets` / FastChat lay it out (see bench_data's docstring).
LAYOUT = {
    ("gsm8k", "parquet"): "gsm8k/main/test-00000-of-00001.parquet",
    ("gsm8k", "parquet_convert"): "gsm8k/main/test/0000.parquet",
    ("gsm8k", "hub_cache"): f"datasets--openai--gsm8k/snapshots/{SHA}/main/test-00000-of-00001.parquet",
    ("gsm8k", "hf_cache"): f"openai___gsm8k/main/0.0.0/{SHA}/gsm8k-test.arrow",
    ("math500", "parquet"): "MATH-500/default/test/0000.parquet",
    ("math500", "parquet_convert"): "MATH-500/default/test/0000.parquet",
    ("math500", "hub_cache"): f"datasets--HuggingFaceH4--MATH-500/snapshots/{SHA}/test.jsonl",
    ("math500", "hf_cache"): f"HuggingFaceH4___math-500/default/0.0.0/{SHA}/math-500-test.arrow",
    ("math500", "repo_jsonl"): "MATH-500/test.jsonl",
    ("humaneval", "parquet"): "openai_humaneval/openai_humaneval/test-00000-of-00001.parquet",
    ("humaneval", "parquet_convert"): "openai_humaneval/openai_humaneval/test/0000.parquet",
    ("humaneval", "hub_cache"):
        f"datasets--openai--openai_humaneval/snapshots/{SHA}/openai_humaneval/test-00000-of-00001.parquet",
    ("humaneval", "hf_cache"):
        f"openai___openai_humaneval/openai_humaneval/0.0.0/{SHA}/openai_humaneval-test.arrow",
    ("mbpp", "parquet"): "mbpp/sanitized/test-00000-of-00001.parquet",
    ("mbpp", "parquet_convert"): "mbpp/sanitized/test/0000.parquet",
    ("mbpp", "hub_cache"):
        f"datasets--google-research-datasets--mbpp/snapshots/{SHA}/sanitized/test-00000-of-00001.parquet",
    ("mbpp", "hf_cache"): f"google-research-datasets___mbpp/sanitized/0.0.0/{SHA}/mbpp-test.arrow",
    ("mt-bench", "parquet"): "mt_bench_prompts/data/train-00000-of-00001-67c6c9fef07685a3.parquet",
    ("mt-bench", "parquet_convert"): "mt_bench_prompts/default/train/0000.parquet",
    ("mt-bench", "hub_cache"):
        f"datasets--HuggingFaceH4--mt_bench_prompts/snapshots/{SHA}/data/train-00000-of-00001-67c6c9fef07685a3.parquet",
    ("mt-bench", "hf_cache"): f"HuggingFaceH4___mt_bench_prompts/default/0.0.0/{SHA}/mt_bench_prompts-train.arrow",
    ("mt-bench", "repo_jsonl"): "FastChat/fastchat/llm_judge/data/mt_bench/question.jsonl",
}
STR, LIST = pa.string(), pa.list_(pa.string())
TYPES = {
    "gsm8k": {"question": STR, "answer": STR},
    "math500": {"problem": STR, "solution": STR, "answer": STR, "subject": STR, "level": pa.int64(), "unique_id": STR},
    "humaneval": {"task_id": STR, "prompt": STR, "canonical_solution": STR, "test": STR, "entry_point": STR},
    "mbpp": {"source_file": STR, "task_id": pa.int32(), "prompt": STR, "code": STR, "test_imports": LIST,
             "test_list": LIST},
    "mt-bench": {"prompt": LIST, "prompt_id": pa.int64(), "category": STR, "reference": LIST},
}
SPLIT = {"gsm8k": "test", "math500": "test", "humaneval": "test", "mbpp": "test", "mt-bench": "train"}
CASES = [(name, form) for name in bd.NAMES for form in bd.forms(name)]


def json_lines(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def read_stream(path):
    """An Arrow IPC *stream* (what `datasets` writes); the random-access file format would start with ARROW1."""
    with open(path, "rb") as f:
        assert not f.read(6) == b"ARROW1"
    with pa.OSFile(path, "rb") as f:
        return pa.ipc.open_stream(f).read_all()


def check_schema(name, tbl):
    assert {f.name: f.type for f in tbl.schema} == TYPES[name]
    assert list(tbl.column_names) == list(TYPES[name])
    hf = json.loads(tbl.schema.metadata[b"huggingface"])["info"]["features"]
    assert list(hf) == list(TYPES[name])
    for col, t in TYPES[name].items():
        if t == LIST:
            assert hf[col] == {"feature": {"dtype": "string", "_type": "Value"}, "_type": "List"}
        else:
            assert hf[col] == {"dtype": str(t), "_type": "Value"}


def check_saved(name, folder, rows):
    with open(os.path.join(folder, "state.json")) as f:
        state = json.load(f)
    assert state["_data_files"] == [{"filename": "data-00000-of-00001.arrow"}]
    assert state["_split"] == SPLIT[name] and state["_format_type"] is None
    with open(os.path.join(folder, "dataset_info.json")) as f:
        info = json.load(f)
    assert list(info["features"]) == list(TYPES[name]) and list(info) == sorted(info)
    assert info["splits"][SPLIT[name]]["num_examples"] == len(rows)
    tbl = read_stream(os.path.join(folder, "data-00000-of-00001.arrow"))
    check_schema(name, tbl)
    return tbl.to_pylist()


def read_back(name, form, path, rows):
    """The rows a form holds, read with json / pyarrow; also checks what is particular to that form."""
    if form == "jsonl":  # pandas' to_json: ASCII only, every "/" escaped
        with open(path, "rb") as f:
            raw = f.read()
        assert raw.isascii() and b"/" not in raw.replace(b"\\/", b"")
        return json_lines(path)
    if form == "json":
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if form in ("parquet", "parquet_convert") or (form == "hub_cache" and path.endswith(".parquet")):
        tbl = pq.read_table(path)
        check_schema(name, tbl)
        return tbl.to_pylist()
    if form == "hub_cache":  # MATH-500's own test.jsonl
        return json_lines(path)
    if form == "save_to_disk":
        return check_saved(name, path, rows)
    if form == "save_to_disk_dict":
        with open(os.path.join(path, "dataset_dict.json")) as f:
            assert json.load(f) == {"splits": [SPLIT[name]]}
        return check_saved(name, os.path.join(path, SPLIT[name]), rows)
    if form == "hf_cache":
        folder = os.path.dirname(path)
        with open(os.path.join(folder, "dataset_info.json")) as f:
            info = json.load(f)
        # datasets' cache builder takes a folder only where its dataset_info.json names that config
        assert info["config_name"] == folder.split(os.sep)[-3]
        assert info["splits"][SPLIT[name]]["num_examples"] == len(rows)
        assert list(info["features"]) == list(TYPES[name])
        tbl = read_stream(path)
        check_schema(name, tbl)
        return tbl.to_pylist()
    return json_lines(path)  # turns, repo_jsonl


@pytest.mark.parametrize("name", bd.NAMES)
def test_sample_rows_have_the_real_fields_and_types(name):
    rows = bd.sample_rows(name)
    assert 12 <= len(rows) <= 20
    for row in rows:
        assert list(row) == list(TYPES[name])
        for col, t in TYPES[name].items():
            if t == LIST:
                assert isinstance(row[col], list) and all(isinstance(s, str) for s in row[col])
            elif t == STR:
                assert isinstance(row[col], str) and row[col]
            else:
                assert isinstance(row[col], int)
    text = json.dumps(rows, ensure_ascii=False)
    for needed in ('\\"', "\\n", "{", "}", "\\\\", "/"):  # quotes, newlines, braces, backslashes, slashes
        assert needed in text, (name, needed)
    main = {"gsm8k": "question", "math500": "problem", "humaneval": "prompt", "mbpp": "prompt", "mt-bench": "prompt"}
    lengths = [len(json.dumps(r[main[name]])) for r in rows]
    assert max(lengths) > 1.5 * min(lengths)
    assert bd.sample_rows(name) == rows  # the same rows on every call


def test_sample_rows_particulars():
    mt = bd.sample_rows("mt-bench")
    import hashlib
    for row in mt:
        assert len(row["prompt"]) == 2
        assert row["prompt_id"] == int(hashlib.sha256("".join(row["prompt"]).encode()).hexdigest(), 16) % 10 ** 8
    assert any(r["reference"] for r in mt) and any(not r["reference"] for r in mt)
    assert any(not r.isascii() for r in json.dumps(mt, ensure_ascii=False))
    for row in bd.sample_rows("math500"):
        assert 1 <= row["level"] <= 5 and re.fullmatch(r"test/[a-z_]+/\d+\.json", row["unique_id"])
    mbpp = bd.sample_rows("mbpp")
    assert any(r["test_imports"] for r in mbpp) and any(not r["test_imports"] for r in mbpp)
    assert all(len(r["test_list"]) >= 2 for r in mbpp)
    assert [r["task_id"] for r in bd.sample_rows("humaneval")] == [f"HumanEval/{i}" for i in range(13)]


@pytest.mark.parametrize("name,form", CASES)
def test_each_form_reads_back_as_written(tmp_path, name, form):
    if form == "turns" and dflash_bench is None:
        pytest.skip("the turns form is dflash's own formatting")
    rows = bd.sample_rows(name)
    path = bd.write(name, form, tmp_path)
    assert os.path.exists(path) and str(path).startswith(str(tmp_path))
    rel = os.path.relpath(path, tmp_path).replace(os.sep, "/")
    if (name, form) in LAYOUT:
        assert re.fullmatch(LAYOUT[name, form], rel), rel
    got = read_back(name, form, path, rows)
    if form == "turns":
        expected = bd.dflash_samples(name, rows)
        assert got == expected and all(list(s) == ["turns"] for s in got)
    elif form == "repo_jsonl" and name == "mt-bench":
        expected = [{"question_id": 81 + i, "category": r["category"], "turns": r["prompt"],
                     **({"reference": r["reference"]} if r["reference"] else {})} for i, r in enumerate(rows)]
        assert [list(q) for q in got] == [list(q) for q in expected]  # FastChat's field order
    else:
        expected = rows
        assert [list(r) for r in got] == [list(TYPES[name])] * len(rows)
    assert got == expected
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path) for f in fs)
    assert size < 64 * 1024


def test_hub_layouts(tmp_path):
    """The hub cache: refs/main names the snapshot; the snapshot file links to its blob. The parquet repos ship a
    README whose configs map the split to its files, as on the hub."""
    path = bd.write("gsm8k", "hub_cache", tmp_path)
    base = tmp_path / "datasets--openai--gsm8k"
    sha = (base / "refs" / "main").read_text()
    assert f"/snapshots/{sha}/" in path
    blob = os.path.realpath(path)
    assert os.path.dirname(blob) == os.path.realpath(base / "blobs")
    assert pq.read_table(blob).num_rows == 16
    bd.write("gsm8k", "parquet", tmp_path)
    readme = (tmp_path / "gsm8k" / "README.md").read_text()
    assert "- config_name: main" in readme and "path: main/test-*" in readme
    bd.write("mt-bench", "parquet", tmp_path)
    assert not (tmp_path / "mt_bench_prompts" / "README.md").exists()


def test_custom_rows_and_refusals(tmp_path):
    rows = bd.sample_rows("mbpp")[:3]
    rows[0]["prompt"] = "Only {this} one."
    path = bd.write("mbpp", "hf_cache", tmp_path, rows=rows)
    assert read_stream(path).to_pylist() == rows
    bad = [dict(r) for r in rows]
    del bad[1]["code"]
    with pytest.raises(ValueError, match="row 1"):
        bd.write("mbpp", "parquet", tmp_path, rows=bad)
    with pytest.raises(ValueError, match="no 'repo_jsonl' form"):
        bd.write("gsm8k", "repo_jsonl", tmp_path)
    with pytest.raises(ValueError, match="unknown benchmark"):
        bd.write("gsm9k", "jsonl", tmp_path)
    assert set(bd.forms("math500")) == set(bd.FORMS) and "repo_jsonl" not in bd.forms("humaneval")


@needs_dflash
@pytest.mark.parametrize("name", bd.NAMES)
def test_dflash_table_asks_for_these_repos(name):
    cfg = dflash_bench.DATASETS[name]
    assert (tuple(cfg["load_args"]), cfg["load_kwargs"]) == bd.load_args(name)


@needs_dflash
def test_dflash_prompts_apply_dflash_formats():
    boxed = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    fence = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    expected = {
        "gsm8k": lambda r: [r["question"] + boxed],
        "math500": lambda r: [r["problem"] + boxed],
        "humaneval": lambda r: [fence + r["prompt"] + "\n```"],
        "mbpp": lambda r: [r["prompt"]],
        "mt-bench": lambda r: r["prompt"],
    }
    for name in bd.NAMES:
        rows = bd.sample_rows(name)
        samples = bd.dflash_samples(name, rows)
        assert [s["turns"] for s in samples] == [expected[name](r) for r in rows], name
    gsm8k = [s["turns"][0] for s in bd.dflash_samples("gsm8k")]
    assert any("labelled {x} and the receipt says \\boxed{}" in p for p in gsm8k)  # data braces left as they are
    assert all(len(s["turns"]) == 2 for s in bd.dflash_samples("mt-bench"))


@needs_dflash
@pytest.mark.parametrize("name", bd.NAMES)
def test_dflash_prompts_in_the_seed_42_order(name):
    rows = bd.sample_rows(name)
    turns = [s["turns"] for s in bd.dflash_samples(name, rows)]
    order = list(range(len(rows)))
    random.Random(42).shuffle(order)
    assert order != sorted(order)
    assert bd.dflash_prompts(name, rows) == [turns[i] for i in order]
    assert bd.dflash_prompts(name, rows, max_samples=5) == [turns[i] for i in order[:5]]
    assert bd.dflash_prompts(name, rows, max_samples=len(rows) + 4) == [turns[i] for i in order]
    assert bd.dflash_prompts(name, rows, max_samples=len(rows) + 4, repeat=True) == \
        [turns[order[i % len(rows)]] for i in range(len(rows) + 4)]
    few = rows[:7]
    order7 = list(range(7))
    random.Random(42).shuffle(order7)
    assert bd.dflash_prompts(name, few) == [turns[i] for i in order7]


@needs_dflash
def test_dflash_prompts_leave_datasets_module_alone(monkeypatch):
    before = sys.modules.get("datasets", "absent")
    bd.dflash_prompts("gsm8k", max_samples=2)
    assert sys.modules.get("datasets", "absent") is before
    monkeypatch.setitem(bd.SPECS["gsm8k"], "split", "train")  # a table that disagrees with dflash's is refused
    with pytest.raises(AssertionError, match="dflash loads gsm8k"):
        bd.dflash_prompts("gsm8k")
    assert sys.modules.get("datasets", "absent") is before
