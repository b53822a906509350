"""Small local copies of the five speculative-decoding benchmarks of z-lab's `dflash/benchmark.py` (gsm8k, math500,
humaneval, mbpp, mt-bench), in every form their users already have on disk, with the real field names, types and
file layouts, but with our own short synthetic rows (no dataset text is copied). Groundwork for `--bench NAME`.

    write(name, form, root, rows=None) -> path     one form of one dataset under root (rows: default sample_rows)
    write_all(name, root, rows=None) -> {form: path}
    sample_rows(name)                              12-20 synthetic rows, varied lengths, some with quotes,
                                                   newlines, backslashes, slashes, braces {} and non-ASCII text
    dflash_prompts(name, rows, max_samples=None)   the turns lists dflash's benchmark builds from these rows, by its
                                                   own code, in its seed-42 order (dflash_samples: in row order)

Forms (FORMS; `forms(name)` lists those a dataset has):
  jsonl              `Dataset.to_json(path)`: JSON Lines in pandas' style (compact, ASCII-escaped, "/" as "\\/")
  json               a JSON array of the rows (`json.dump(list(ds), f)`)
  parquet            the repo's own parquet at its hub path inside a folder named as the repo
                     (<root>/gsm8k/main/test-00000-of-00001.parquet); MATH-500 has none: its refs/convert/parquet file
  parquet_convert    the hub's refs/convert/parquet branch: <root>/<repo>/<config>/<split>/0000.parquet
  hub_cache          huggingface_hub's cache of the repo's own data file: <root>/datasets--<org>--<name>/refs/main,
                     blobs/<sha256>, snapshots/<commit>/<path> (a relative symlink to the blob, as the hub client makes)
  save_to_disk       `Dataset.save_to_disk`: data-00000-of-00001.arrow (Arrow IPC stream), dataset_info.json, state.json
  save_to_disk_dict  `DatasetDict.save_to_disk`: dataset_dict.json + one such folder per split
  hf_cache           `datasets`' own cache: <root>/<org>___<name>/<config>/0.0.0/<commit>/<name>-<split>.arrow
                     (Arrow IPC stream) beside dataset_info.json; <root> plays HF_DATASETS_CACHE
  turns              dflash-style prompts already formatted: one {"turns": [...]} line per row, in dataset order
                     (made by dflash's own code: needs dflash installed)
  repo_jsonl         the JSONL the dataset's own repo ships: MATH-500's test.jsonl; FastChat's MT-Bench question.jsonl

Where the facts come from (public sources, looked up for this file):
- Repo ids, configs, splits, and the prompt templates: dflash 0.1.0's `benchmark.py` (DATASETS, installed here).
- gsm8k: the hub README (`configs: main -> main/test-*`, commit 2c868b8 "Convert dataset to Parquet", 60b4b82 adding
  socratic/test-00000-of-00001.parquet alongside main/); fields question, answer (string); refs/convert/parquet holds
  main/test/0000.parquet (its .gitattributes).
- MATH-500: the repo holds only test.jsonl (hub tree at ff5b202); fields problem, solution, answer, subject (string),
  level (int64), unique_id (string, "test/<subject>/<n>.json") per the dataset viewer; the parquet converter's layout
  default/<split>/0000.parquet as on other repos' refs/convert/parquet branches.
- humaneval: PR #5 "Convert dataset to Parquet" adds openai_humaneval/test-00000-of-00001.parquet with config
  openai_humaneval; fields task_id, prompt, canonical_solution, test, entry_point (all string).
- mbpp: hub tree sanitized/{prompt,test,train,validation}-00000-of-00001.parquet (commits 4bb6404, 7bc94ee); fields
  source_file, task_id, prompt, code, test_imports, test_list; task_id int32 and the lists as sequences of string from
  the loading script's features (TFDS community catalog copy of them).
- mt-bench (HuggingFaceH4/mt_bench_prompts): README's creation code (prompt, prompt_id = sha256 of the joined turns
  mod 1e8, category, reference; "add empty reference to remaining prompts"); data/train-00000-of-00001-67c6c9fef07685a3
  .parquet in its hub tree (push_to_hub of 2023, a hash in the name); refs/convert/parquet default/train/0000.parquet
  (commit 1c8e96c). FastChat's fastchat/llm_judge/data/mt_bench/question.jsonl (lm-sys/FastChat): {"question_id",
  "category", "turns"} and "reference" on some rows, json.dumps' default separators, question ids from 81.
- `datasets` (huggingface/datasets at b7cb10b): builder.py `_relative_data_dir` ("namespace___dataset_name" /
  config_id / version / hash) and the shard name "{dataset_name}-{split}.arrow" when one shard; load.py sets
  dataset_name = camelcase_to_snakecase(repo name) (so "math-500") and hash = the repo's commit; packaged_modules/
  cache/cache.py reads a cache back only where dataset_info.json's config_name equals the config folder;
  arrow_writer.py writes pa.RecordBatchStreamWriter with schema metadata {"huggingface": {"info": {"features"}}};
  arrow_dataset.py `save_to_disk` (data-{i:05d}-of-{n:05d}.arrow, state.json keys, json indent 2, sorted);
  dataset_dict.py writes {"splits": [...]}; io/json.py's writer is pandas' to_json(orient="records", lines=True);
  features are dumped as {"dtype", "_type": "Value"} and {"feature", "_type": "List"} (datasets 4; older versions
  wrote "Sequence").
The commit hashes in hub_cache/hf_cache are stand-ins (sha1 of the repo id), not the repos' real commits.
Checked once by hand, in a separate venv with datasets 5.2.0 / huggingface_hub 2.4.0 (neither is a test dependency):
load_from_disk reads both save_to_disk forms; load_dataset(repo, config, split, cache_dir=root) offline reads
hf_cache; the parquet and json builders, and load_dataset(<repo folder>, config) through its README, read the files;
our jsonl is byte-identical to Dataset.to_json of the same rows; features, schema and state.json keys equal those
save_to_disk writes; hf_hub_download(local_files_only=True) and scan_cache_dir accept hub_cache.
"""
import contextlib
import hashlib
import json
import os
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

try:   # z-lab's dflash.benchmark, the reference the prompts are held to (pip install --no-deps dflash==0.1.0)
    import dflash.benchmark as dflash_bench
except ImportError:
    if os.environ.get("EVAL_DRAFTER_REQUIRE_DFLASH"):
        raise
    dflash_bench = None
needs_dflash = pytest.mark.skipif(dflash_bench is None,
                                  reason="dflash is not installed: pip install --no-deps dflash==0.1.0")

NAMES = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
FORMS = ("jsonl", "json", "parquet", "parquet_convert", "hub_cache", "save_to_disk", "save_to_disk_dict", "hf_cache",
         "turns", "repo_jsonl")

S, I64, I32, LS = "string", "int64", "int32", "list<string>"

SPECS = {
    "gsm8k": {
        "repo": "openai/gsm8k", "config": "main", "split": "test", "builder": "parquet",
        "columns": [("question", S), ("answer", S)],
        "repo_files": ["main/test-00000-of-00001.parquet"],
        "convert": "main/test/0000.parquet",
        "readme_configs": {"main": "main/test-*"},
    },
    "math500": {
        "repo": "HuggingFaceH4/MATH-500", "config": None, "split": "test", "builder": "json",
        "columns": [("problem", S), ("solution", S), ("answer", S), ("subject", S), ("level", I64),
                    ("unique_id", S)],
        "repo_files": ["test.jsonl"],
        "convert": "default/test/0000.parquet",
        "repo_jsonl": "MATH-500/test.jsonl",
    },
    "humaneval": {
        "repo": "openai/openai_humaneval", "config": None, "hub_config": "openai_humaneval", "split": "test",
        "builder": "parquet",
        "columns": [("task_id", S), ("prompt", S), ("canonical_solution", S), ("test", S), ("entry_point", S)],
        "repo_files": ["openai_humaneval/test-00000-of-00001.parquet"],
        "convert": "openai_humaneval/test/0000.parquet",
        "readme_configs": {"openai_humaneval": "openai_humaneval/test-*"},
    },
    "mbpp": {
        "repo": "google-research-datasets/mbpp", "config": "sanitized", "split": "test", "builder": "parquet",
        "columns": [("source_file", S), ("task_id", I32), ("prompt", S), ("code", S), ("test_imports", LS),
                    ("test_list", LS)],
        "repo_files": ["sanitized/test-00000-of-00001.parquet"],
        "convert": "sanitized/test/0000.parquet",
        "readme_configs": {"sanitized": "sanitized/test-*"},
    },
    "mt-bench": {
        "repo": "HuggingFaceH4/mt_bench_prompts", "config": None, "split": "train", "builder": "parquet",
        "columns": [("prompt", LS), ("prompt_id", I64), ("category", S), ("reference", LS)],
        "repo_files": ["data/train-00000-of-00001-67c6c9fef07685a3.parquet"],
        "convert": "default/train/0000.parquet",
        "repo_jsonl": "FastChat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    },
}


def spec(name):
    if name not in SPECS:
        raise ValueError(f"unknown benchmark {name!r}: one of {', '.join(NAMES)}")
    return SPECS[name]


def config_name(name):
    """The config `datasets` names the cache folder after: the one given, the repo's single config, or "default"."""
    sp = spec(name)
    return sp["config"] or sp.get("hub_config") or "default"


def repo_folder(name):
    return spec(name)["repo"].split("/")[1]


def cache_dataset_name(name):
    """`datasets`' dataset_name: camelcase_to_snakecase of the repo's name (naming.py), "MATH-500" -> "math-500"."""
    import re
    n = repo_folder(name)
    n = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", n)
    n = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", n)
    return n.lower()


def commit(name):
    """A stand-in for the repo's commit hash (40 hex digits), the same on every call."""
    return hashlib.sha1(spec(name)["repo"].encode()).hexdigest()


def forms(name):
    sp = spec(name)
    return tuple(f for f in FORMS if f != "repo_jsonl" or "repo_jsonl" in sp)


# ---- types -------------------------------------------------------------------------------------------------------

def _arrow_type(t):
    return {S: pa.string(), I64: pa.int64(), I32: pa.int32(), LS: pa.list_(pa.string())}[t]


def features(name):
    """The features as `datasets` dumps them into dataset_info.json and the schema's "huggingface" metadata."""
    def value(dtype):
        return {"dtype": dtype, "_type": "Value"}
    return {col: ({"feature": value("string"), "_type": "List"} if t == LS else value(t))
            for col, t in spec(name)["columns"]}


def schema(name):
    meta = {"huggingface": json.dumps({"info": {"features": features(name)}})}
    return pa.schema([pa.field(col, _arrow_type(t)) for col, t in spec(name)["columns"]], metadata=meta)


def table(name, rows):
    cols = [c for c, _ in spec(name)["columns"]]
    for i, row in enumerate(rows):
        if list(row) != cols:
            raise ValueError(f"{name} row {i}: fields {list(row)}, expected {cols} in that order")
    return pa.Table.from_pylist(list(rows), schema=schema(name))


# ---- synthetic rows ----------------------------------------------------------------------------------------------

def _gsm8k():
    people = ["Mara", "Tobias", "Ines", "Kofi", "Lena", "Ravi", "Sofía", "Jonas", "Aiko", "Pedro", "Nadia", "Oskar",
              "Yusuf", "Greta", "Tomás", "Hana"]
    things = ["pencils", "apples", "stamps", "marbles", "cookies", "shells", "buttons", "cards"]
    extra = ["", " Each one costs $2.", " The shop closes at 5 pm, and the bus ride home takes 20 minutes.",
             " Half of them are red, a third are blue, and the rest are green; none of that matters here."]
    rows = []
    for i, who in enumerate(people):
        a, b, thing = 3 + 2 * i, 5 + i % 7, things[i % len(things)]
        q = f"{who} buys {a} {thing} on Monday and {b} more on Tuesday.{extra[i % 4]} How many {thing} does {who} have?"
        if i == 3:
            q = f'A sign says "2 for 1" and {who}\'s note says \'half off\'. ' + q
        if i == 5:
            q += " (The box is labelled {x} and the receipt says \\boxed{} - ignore both.)"
        if i == 7:
            q = "Read both lines.\nLine two: " + q
        if i == 10:
            q += " One ratio is 1/2, the path is C:\\temp\\bag."
        ans = f"{who} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n#### {a + b}"
        if i % 5 == 2:
            ans = f"On Monday: {a}.\nOn Tuesday: {b}.\nTogether {a} + {b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b}"
        rows.append({"question": q, "answer": ans})
    return rows


def _math500():
    subjects = ["Algebra", "Prealgebra", "Number Theory", "Geometry", "Precalculus", "Counting & Probability",
                "Intermediate Algebra"]
    rows = []
    for i in range(14):
        a, b = 2 + i, 7 + 3 * i
        subject = subjects[i % len(subjects)]
        problem, answer = f"What is ${a} + {b}$?", str(a + b)
        solution = f"We add: ${a} + {b} = \\boxed{{{a + b}}}$."
        if i % 4 == 1:
            problem = f"Simplify $\\frac{{{a * 2}}}{{{b * 2}}}$."
            answer = f"\\frac{{{a}}}{{{b}}}"
            solution = f"Divide top and bottom by 2:\n\\[\\frac{{{a * 2}}}{{{b * 2}}} = \\boxed{{{answer}}}.\\]"
        if i == 6:
            problem = 'Let $f(x) = x^2$. A student writes "f(3) = 6". What is $f(3)$ really?'
            answer, solution = "9", "We have\n\\begin{align*}\nf(3) &= 3^2 \\\\\n&= \\boxed{9}.\n\\end{align*}"
        if i == 9:
            problem = "Find the set $\\{x : x^2 = 4\\}$ and give its largest element.\nAnswer with a number."
            answer, solution = "2", "The set is $\\{-2, 2\\}$, so the largest element is $\\boxed{2}$."
        if i % 3 == 0:
            solution += " This is a quick check; " * (i // 3) + "Done."
        slug = subject.lower().replace(" & ", "_and_").replace(" ", "_")
        rows.append({"problem": problem, "solution": solution, "answer": answer, "subject": subject,
                     "level": 1 + i % 5, "unique_id": f"test/{slug}/{100 + 7 * i}.json"})
    return rows


def _humaneval():
    funcs = [
        ("add_pair", "a: int, b: int", "int", "Return the sum of a and b.", "2, 3", "5", "return a + b"),
        ("longest", "words: List[str]", "str", "Return the longest word, the first one on a tie.",
         "['ab', 'abc']", "'abc'", "return max(words, key=len) if words else ''"),
        ("count_vowels", "s: str", "int", 'Count the vowels in s; "y" is not a vowel.', "'hey'", "1",
         "return sum(c in 'aeiou' for c in s.lower())"),
        ("empty_map", "", "dict", "Return an empty dict, that is {}.", "", "{}", "return {}"),
        ("is_even", "n: int", "bool", "Return True if n is even.\n    Negative numbers count too.", "-4", "True",
         "return n % 2 == 0"),
        ("join_path", "parts: List[str]", "str", "Join the parts with '/'; a backslash \\ stays as it is.",
         "['a', 'b']", "'a/b'", "return '/'.join(parts)"),
        ("clamp", "x: float, lo: float, hi: float", "float", "Clamp x into [lo, hi].", "5.0, 0.0, 1.0", "1.0",
         "return min(max(x, lo), hi)"),
    ]
    rows = []
    for i in range(13):
        fn, args, ret, doc, ex_in, ex_out, body = funcs[i % len(funcs)]
        entry = fn if i < len(funcs) else f"{fn}_{i}"
        header = "from typing import List\n\n\n" if "List" in args else ""
        prompt = (f'{header}def {entry}({args}) -> {ret}:\n    """ {doc}\n'
                  f'    >>> {entry}({ex_in})\n    {ex_out}\n    """\n')
        test = (f"\n\nMETADATA = {{\n    'author': 'synthetic',\n    'dataset': 'test'\n}}\n\n\ndef check(candidate):\n"
                f"    assert candidate({ex_in}) == {ex_out}\n" + "    assert True\n" * (i % 3))
        rows.append({"task_id": f"HumanEval/{i}", "prompt": prompt, "canonical_solution": f"    {body}\n",
                     "test": test, "entry_point": entry})
    return rows


def _mbpp():
    tasks = [
        ("Write a function to find the larger of two numbers.", "bigger",
         "def bigger(a, b):\n    return a if a > b else b",
         ["assert bigger(1, 2) == 2", "assert bigger(5, 3) == 5", "assert bigger(-1, -1) == -1"], []),
        ("Write a python function to count the words in a string.", "count_words",
         "def count_words(s):\n    return len(s.split())",
         ['assert count_words("a b c") == 3', 'assert count_words("") == 0', "assert count_words('one') == 1"], []),
        ("Write a function to compute the distance between two points.", "distance",
         "import math\ndef distance(p, q):\n    return math.hypot(p[0] - q[0], p[1] - q[1])",
         ["assert math.isclose(distance((0, 0), (3, 4)), 5.0)", "assert distance((1, 1), (1, 1)) == 0"],
         ["import math"]),
        ("Write a function to turn a list of pairs into a dict like {key: value}.", "to_dict",
         "def to_dict(pairs):\n    return {k: v for k, v in pairs}",
         ["assert to_dict([('a', 1)]) == {'a': 1}", "assert to_dict([]) == {}", "assert to_dict([(1, 2)]) == {1: 2}"],
         []),
        ("Write a function to reverse a string.\nKeep the case of each letter.", "rev",
         "def rev(s):\n    return s[::-1]",
         ["assert rev('abc') == 'cba'", "assert rev('A/b') == 'b/A'", "assert rev('a\\\\b') == 'b\\\\a'"], []),
    ]
    rows = []
    for i in range(15):
        text, fn, code, tests, imports = tasks[i % len(tasks)]
        source = "Synthetic Questions V1.ipynb" if i % 3 else "Someone's Copy of Synthetic Questions V1.ipynb"
        rows.append({"source_file": source, "task_id": 11 + 7 * i, "prompt": text + " Return early." * (i // 5),
                     "code": code, "test_imports": list(imports), "test_list": list(tests)})
    return rows


def mt_bench_prompt_id(turns):
    """mt_bench_prompts' prompt_id, by its README's creation code: sha256 of the joined turns, mod 10**8."""
    return int(hashlib.sha256("".join(turns).encode("utf-8")).hexdigest(), 16) % (10 ** 8)


def _mt_bench():
    cats = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    with_reference = {"reasoning", "math", "coding"}
    rows = []
    for i in range(12):
        cat = cats[i % len(cats)]
        first = f"Task {i} ({cat}): write a short note about topic number {i}." + " Keep it vivid." * (i % 3 * 4)
        second = "Now rewrite your previous answer in exactly three sentences, or 3/4 of its length."
        if i == 2:
            first = 'Someone says "all cats are grey at night". Is that a valid argument? Explain.'
        if i == 4:
            first = "Write a Python function that returns a dict like {'a': 1}.\nUse no imports."
            second = "Now make it return {} when the input is empty, and show a test with braces {x}."
        if i == 6:
            first, second = "Name a colour.", "Another?"
        if i == 9:
            first = "Résumé the café menu in two lines: crème brûlée 4 €, tea 2 €."
        turns = [first, second]
        reference = [f"Reference one for {i}.", "Reference two, with a \\ backslash."] if cat in with_reference else []
        rows.append({"prompt": turns, "prompt_id": mt_bench_prompt_id(turns), "category": cat, "reference": reference})
    return rows


_BUILDERS = {"gsm8k": _gsm8k, "math500": _math500, "humaneval": _humaneval, "mbpp": _mbpp, "mt-bench": _mt_bench}


def sample_rows(name):
    """Fresh synthetic rows for a benchmark, with its real columns in their real order and types."""
    spec(name)
    return _BUILDERS[name]()


def fastchat_rows(rows):
    """mt_bench_prompts rows as FastChat's question.jsonl has them: {"question_id", "category", "turns"}, with
    "reference" only where there is one."""
    out = []
    for i, row in enumerate(rows):
        q = {"question_id": 81 + i, "category": row["category"], "turns": list(row["prompt"])}
        if row["reference"]:
            q["reference"] = list(row["reference"])
        out.append(q)
    return out


# ---- writers -----------------------------------------------------------------------------------------------------

def _mkdir_for(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def _write_stream(path, tbl):
    with pa.OSFile(_mkdir_for(path), "wb") as sink, pa.ipc.new_stream(sink, tbl.schema) as writer:
        writer.write_table(tbl)
    return path


def _dataset_info(name, tbl):
    """A minimal dataset_info.json as `datasets` dumps a DatasetInfo (fields at their default left out)."""
    split, dname = spec(name)["split"], cache_dataset_name(name)
    return {"description": "", "citation": "", "homepage": "", "license": "", "features": features(name),
            "builder_name": spec(name)["builder"], "dataset_name": dname, "config_name": config_name(name),
            "version": {"version_str": "0.0.0", "major": 0, "minor": 0, "patch": 0},
            "splits": {split: {"name": split, "num_bytes": tbl.nbytes, "num_examples": tbl.num_rows,
                               "dataset_name": dname}},
            "dataset_size": tbl.nbytes, "size_in_bytes": tbl.nbytes}


def _pandas_json(obj):
    """One record as pandas' to_json writes it (what Dataset.to_json calls): compact, ASCII, "/" escaped."""
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).replace("/", "\\/")


def _save_to_disk(name, tbl, folder):
    _write_stream(os.path.join(folder, "data-00000-of-00001.arrow"), tbl)
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
             "_fingerprint": hashlib.sha1(f"{name}:{tbl.num_rows}".encode()).hexdigest()[:16],
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": spec(name)["split"]}
    with open(os.path.join(folder, "state.json"), "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2, sort_keys=True)
    info = _dataset_info(name, tbl)
    with open(os.path.join(folder, "dataset_info.json"), "w", encoding="utf-8") as f:
        json.dump({k: info[k] for k in sorted(info)}, f, indent=2)
    return folder


def _readme(name):
    configs = spec(name).get("readme_configs")
    if not configs:
        return None
    split = spec(name)["split"]
    lines = ["---", "configs:"]
    for cfg, pattern in configs.items():
        lines += [f"- config_name: {cfg}", "  data_files:", f"  - split: {split}", f"    path: {pattern}"]
    return "\n".join(lines + ["---", ""])


def _write_repo_file(name, rel, path, rows, tbl):
    """One of the repo's own data files (rel: its path in the repo) at path."""
    _mkdir_for(path)
    if rel.endswith(".parquet"):
        pq.write_table(tbl, path)
    else:  # MATH-500's test.jsonl
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return path


def write(name, form, root, rows=None):
    """Write one form of benchmark `name` under folder `root`; returns the path a user would hand over: the data file
    (jsonl, json, parquet, parquet_convert, hub_cache, hf_cache, turns, repo_jsonl) or the folder (save_to_disk,
    save_to_disk_dict)."""
    sp = spec(name)
    if form not in forms(name):
        raise ValueError(f"{name} has no {form!r} form: one of {', '.join(forms(name))}")
    rows = sample_rows(name) if rows is None else [dict(r) for r in rows]
    tbl = table(name, rows)
    root, split = str(root), sp["split"]
    if form == "jsonl":
        path = _mkdir_for(os.path.join(root, f"{cache_dataset_name(name)}-{split}.jsonl"))
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(_pandas_json(row) + "\n")
        return path
    if form == "json":
        path = _mkdir_for(os.path.join(root, f"{cache_dataset_name(name)}-{split}.json"))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rows, f, ensure_ascii=False, indent=2)
            f.write("\n")
        return path
    if form == "parquet":
        rel = next((p for p in sp["repo_files"] if p.endswith(".parquet")), sp["convert"])
        path = os.path.join(root, repo_folder(name), rel)
        pq.write_table(tbl, _mkdir_for(path))
        readme = _readme(name) if rel != sp["convert"] else None
        if readme:
            with open(os.path.join(root, repo_folder(name), "README.md"), "w", encoding="utf-8") as f:
                f.write(readme)
        return path
    if form == "parquet_convert":
        path = os.path.join(root, repo_folder(name), sp["convert"])
        pq.write_table(tbl, _mkdir_for(path))
        return path
    if form == "hub_cache":
        org, repo_name = sp["repo"].split("/")
        base = os.path.join(root, f"datasets--{org}--{repo_name}")
        rel = sp["repo_files"][0]
        tmp = _write_repo_file(name, rel, os.path.join(base, "blobs", "incoming"), rows, tbl)
        with open(tmp, "rb") as f:
            blob = os.path.join(base, "blobs", hashlib.sha256(f.read()).hexdigest())
        os.replace(tmp, blob)
        path = _mkdir_for(os.path.join(base, "snapshots", commit(name), rel))
        try:
            os.symlink(os.path.relpath(blob, os.path.dirname(path)), path)
        except OSError:  # no symlinks here: the hub client then copies
            with open(blob, "rb") as src, open(path, "wb") as dst:
                dst.write(src.read())
        with open(_mkdir_for(os.path.join(base, "refs", "main")), "w") as f:
            f.write(commit(name))
        return path
    if form == "save_to_disk":
        return _save_to_disk(name, tbl, os.path.join(root, name))   # a folder named as the benchmark: --bench finds it
    if form == "save_to_disk_dict":
        folder = os.path.join(root, name)
        _save_to_disk(name, tbl, os.path.join(folder, split))
        with open(os.path.join(folder, "dataset_dict.json"), "w", encoding="utf-8") as f:
            json.dump({"splits": [split]}, f)
        return folder
    if form == "hf_cache":
        org = sp["repo"].split("/")[0]
        dname = cache_dataset_name(name)
        folder = os.path.join(root, f"{org}___{dname}", config_name(name), "0.0.0", commit(name))
        path = _write_stream(os.path.join(folder, f"{dname}-{split}.arrow"), tbl)
        with open(os.path.join(folder, "dataset_info.json"), "w", encoding="utf-8") as f:
            json.dump(_dataset_info(name, tbl), f)
        return path
    if form == "turns":
        path = _mkdir_for(os.path.join(root, f"{name}.jsonl"))   # named as the benchmark: --bench finds it
        with open(path, "w", encoding="utf-8") as f:
            for sample in dflash_samples(name, rows):
                f.write(json.dumps(sample, ensure_ascii=False) + "\n")
        return path
    # repo_jsonl
    path = _mkdir_for(os.path.join(root, sp["repo_jsonl"]))
    out = fastchat_rows(rows) if name == "mt-bench" else rows
    with open(path, "w", encoding="utf-8") as f:
        for row in out:
            f.write(json.dumps(row) + "\n")
    return path


def write_all(name, root, rows=None):
    return {form: write(name, form, root, rows) for form in forms(name)}


# ---- the wider suites: Spec-Bench and SPEED-Bench ------------------------------------------------------------------
# Spec-Bench (hemingkx/Spec-Bench, data/spec_bench/question.jsonl): {"question_id", "category", "turns"} a line, as
# FastChat writes its questions; 480 rows, the first 80 MT-Bench's under its 8 categories (two turns), then 80 each of
# translation, summarization, qa, math_reasoning and rag (one turn). AIPerf caches the same file as spec_bench.jsonl.
# SPEED-Bench (nvidia/SPEED-Bench, config qualitative, split test, 880 rows): question_id (32 hex), category (11),
# sub_category, turns (list of string), source, src_id, difficulty, multiturn (bool), per its README's dataset_info;
# the hub's parquet holds the placeholder below in place of prompts whose sources' licences keep them off the hub, and
# NVIDIA Model-Optimizer's examples/specdec_bench/prepare_data.py writes the resolved rows as parquet under
# <output_dir>/speed/qualitative/ (the file name here is ours).
SPEC_BENCH_TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
SPEED_BENCH_CATEGORIES = ("coding", "humanities", "math", "multilingual", "qa", "rag", "reasoning", "roleplay", "stem",
                          "summarization", "writing")
SPEED_BENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
SUITE_FORMS = {"specbench": {"clone": "Spec-Bench/data/spec_bench/question.jsonl", "aiperf": "spec_bench.jsonl",
                             "export": "specbench.jsonl"},
               "speed-bench": {"parquet": "SPEED-Bench/qualitative/test-00000-of-00001.parquet",
                               "prepared": "data/speed/qualitative/qualitative_prepared.parquet",
                               "export": "speed-bench.jsonl"}}
SPEED_BENCH_COLUMNS = [("question_id", S), ("category", S), ("sub_category", S), ("turns", LS), ("source", S),
                       ("src_id", S), ("difficulty", S), ("multiturn", "bool")]


def spec_bench_rows():
    """Spec-Bench's layout in 31 rows: two per MT-Bench category (two turns each), then three per subtask."""
    mt = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    rows = [{"question_id": 81 + i, "category": cat, "turns": [f"About {cat}, part {i}: say something {{new}}.",
                                                                "Now say it again, shorter."]}
            for i, cat in enumerate(mt * 2)]
    for task in SPEC_BENCH_TASKS:
        rows += [{"question_id": 81 + len(rows), "category": task,
                  "turns": [f"{task} item {k}: " + "the words go on " * (k * 3) + "\u00e9 \\ end."]} for k in range(3)]
    return rows


def speed_bench_rows(placeholder=False):
    """SPEED-Bench's layout in 22 rows, two per category; the second of each has two turns."""
    return [{"question_id": hashlib.md5(f"{cat}{k}".encode()).hexdigest(), "category": cat, "sub_category": f"{cat}-x",
             "turns": [SPEED_BENCH_PLACEHOLDER if placeholder and k == 0 else f"A {cat} question, number {k}."]
             + (["And a follow-up?"] if k else []), "source": "synthetic", "src_id": str(k), "difficulty": "easy",
             "multiturn": bool(k)} for cat in SPEED_BENCH_CATEGORIES for k in range(2)]


def write_suite(name, form, root, rows):
    """One form of a wider suite's copy under root (SUITE_FORMS): JSON lines, or parquet with SPEED-Bench's types."""
    path = os.path.join(root, SUITE_FORMS[name][form])
    _mkdir_for(path)
    if path.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema(
            [pa.field(c, {S: pa.string(), LS: pa.list_(pa.string()), "bool": pa.bool_()}[t])
             for c, t in SPEED_BENCH_COLUMNS])), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


# ---- dflash's own prompts ----------------------------------------------------------------------------------------

def dflash_benchmark():
    """z-lab's dflash.benchmark (pip install --no-deps dflash==0.1.0; it imports requests and tqdm)."""
    import dflash.benchmark
    return dflash.benchmark


def load_args(name):
    """What dflash's table passes to datasets.load_dataset for this benchmark, by our SPECS."""
    sp = spec(name)
    return (sp["repo"],) + ((sp["config"],) if sp["config"] else ()), {"split": sp["split"]}


_MISSING = object()


@contextlib.contextmanager
def _datasets_serving(rows, calls):
    """sys.modules["datasets"] replaced, for the block, by one whose load_dataset records its call and returns rows."""
    fake = types.ModuleType("datasets")

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return [dict(r) for r in rows]

    fake.load_dataset = load_dataset
    saved = sys.modules.get("datasets", _MISSING)
    sys.modules["datasets"] = fake
    try:
        yield
    finally:
        if saved is _MISSING:
            del sys.modules["datasets"]
        else:
            sys.modules["datasets"] = saved


def dflash_samples(name, rows=None):
    """dflash's load_and_process_dataset(name) run on these rows (its own code: DATASETS[name]["format"] and the
    multi-turn wrapping), in dataset order: [{"turns": [...]}, ...]. Raises if dflash would ask for another repo,
    config or split than SPECS says."""
    bench = dflash_benchmark()
    rows = sample_rows(name) if rows is None else rows
    calls = []
    with _datasets_serving(rows, calls):
        samples = bench.load_and_process_dataset(name)
    if calls != [load_args(name)]:
        raise AssertionError(f"dflash loads {name} with {calls}, SPECS says {load_args(name)}")
    return samples


def dflash_prompts(name, rows=None, max_samples=None, repeat=False):
    """The prompts dflash's benchmark would run on these rows: its load_and_process_dataset, then its own
    _select_dataset(samples, max_samples) (seed-42 shuffle; repeat=True as its OpenAI-server backend does).
    A list of turns lists, one per sample."""
    samples = dflash_samples(name, rows)
    return [s["turns"] for s in dflash_benchmark()._select_dataset(samples, max_samples, repeat=repeat)]


def demo_copies(root):
    """Copies of gsm8k (a to_json export) and humaneval (the hub's parquet) whose text is the demo pair's own words
    (its prompts, then their replies' words shifted), so the demo target reads them: the README's --bench example."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "fixtures", "demo", "prompts.jsonl"), encoding="utf-8") as f:
        words = [json.loads(line)["prompt"] for line in f if line.strip()]
    texts = words + [" ".join(reversed(w.split())) for w in words]
    gsm8k = [{"question": t, "answer": "#### 0"} for t in texts]
    humaneval = [{"task_id": f"HumanEval/{i}", "prompt": t, "canonical_solution": "", "test": "", "entry_point": "f"}
                 for i, t in enumerate(texts)]
    return write("gsm8k", "jsonl", root, gsm8k), write("humaneval", "parquet", root, humaneval)


if __name__ == "__main__":   # python tests/bench_data.py DIR: the README's demo copies
    print("\n".join(demo_copies(sys.argv[1])))
