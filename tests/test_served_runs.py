"""Served against offline (issue 43) under the promises every mode keeps.

With --server (an engine's HTTP endpoint) or --served FILE (its replies saved a line each), every reference carries
the engine's own per-request speculative figures, and the report holds them against the exact rounds: per prompt
(`served`: the engine's steps, equal or not, the suspects that reproduce them) and per drafter (the `served` summary:
requests, steps, tau_served, tau_exact, gap and its interval, the causes named). Those figures are results like the
rounds, so the run's promises hold for them too:

- Ctrl-C in the middle (while references arrive, or after the first prompts are scored) loses none of them, and
  --resume ends with the uninterrupted run's served figures without asking the engine again for a kept reference;
- --shard K/N then --merge gives the single run's served summary;
- --save-hidden then --load-hidden gives the same served summary, suspects included (their layers are in the cache);
- a --served flag the run cannot use is refused in one line, exit 2.

The engine (tests/spec_engine.py) is misconfigured on purpose (it feeds the drafter the layer ids one lower), so the
summary is not the trivial "every step equal" and its causes name a suspect.
"""
import json
import os
import urllib.request
from collections import Counter

import pytest
from transformers import AutoTokenizer

import eval_drafter as ed
from conftest import interrupt_at, refused_in_one_line
from spec_engine import TARGET, load_demo, start_engine

N_NEW, LIMIT = 40, 6
BASE = ["--demo", "--limit", str(LIMIT), "--max-new-tokens", str(N_NEW), "--ignore-eos", "--ddtree-budgets", "none",
        "--quiet"]
LOADED = ["--demo", "--limit", str(LIMIT), "--ddtree-budgets", "none", "--quiet"]   # the references: the cache's
MISCONFIGURED, NAMED = {"layers": [0, 2, 3]}, "layers [0, 2, 3]"   # hidden_states indices read as layer outputs


@pytest.fixture(scope="module")
def engine():
    model, drafter, _ = load_demo()
    srv = start_engine(model, drafter)
    tok = AutoTokenizer.from_pretrained(TARGET)
    srv.tokenize = lambda text: tok(text)["input_ids"]
    yield srv
    srv.shutdown()


def server(engine):
    return ["--server", engine.url, "--server-api", "openai", "--server-model", "demo"]


def run(folder, name, *argv, code=0, base=BASE):
    """eval_drafter.main(base + argv) writing <folder>/<name>.json: its report (None when none was written)."""
    out = folder / f"{name}.json"
    assert ed.main([*base, *argv, "--output", str(out)]) == code
    return json.loads(out.read_text()) if out.exists() else None


def demo_prompt_ids(engine):
    """{prompt id: its token ids} of the run's prompts (the demo's are plain text: no chat template)."""
    rows = [json.loads(line) for line in open(os.path.join(ed.DEMO_DIR, "prompts.jsonl"), encoding="utf-8")][:LIMIT]
    return {r["id"]: tuple(engine.tokenize(r["prompt"])) for r in rows}


def asked(engine):
    """The prompts (token ids) the engine was asked to complete since its last reset, the one-token probe left out."""
    return Counter(tuple(p) for r in engine.requests if r["body"].get("max_tokens", 0) > 1
                   for p in r["body"]["prompt"])


def served_of(report):
    """(the first drafter's served summary, [(prompt id, its held served figures)] in the report's order)."""
    d = report["drafters"][0]
    return d.get("served"), [((p["id"], p.get("sample"), p.get("turn")), p.get("served")) for p in d["prompts"]]


def assert_same_served(got, want):
    summary, prompts = served_of(got)
    want_summary, want_prompts = served_of(want)
    assert summary == want_summary
    assert len(prompts) == LIMIT and prompts == want_prompts


def assert_misconfiguration_seen(report):
    """The summary is not the trivial one: some requests differ, and the suspect that reproduces them is named."""
    s, prompts = served_of(report)
    assert s is not None, "the report holds no served summary"
    assert s["requests"] == s["compared"] == LIMIT and 0 < s["equal"] < LIMIT, s
    assert any(NAMED in cause for cause in s["causes"]), s["causes"]
    differ = [p for _, p in prompts if p["equal"] is False]
    assert differ and all(NAMED in p["suspects"] for p in differ)


@pytest.fixture(scope="module")
def whole(engine, tmp_path_factory):
    """The uninterrupted --server run against the misconfigured engine."""
    engine.reset(**MISCONFIGURED)
    report = run(tmp_path_factory.mktemp("whole"), "whole", *server(engine))
    assert_misconfiguration_seen(report)
    assert asked(engine) == Counter(demo_prompt_ids(engine).values())   # each prompt asked once
    return report


@pytest.fixture(scope="module")
def served_file(engine, tmp_path_factory):
    """The misconfigured engine's own replies to the run's requests, one a line (vLLM's, with return_token_ids and
    its per-request metrics), in reverse order: a line is its prompt's by the prompt ids it carries."""
    engine.reset(**MISCONFIGURED)
    lines = []
    for ids in reversed(list(demo_prompt_ids(engine).values())):
        body = {"model": "demo", "prompt": [list(ids)], "max_tokens": N_NEW, "ignore_eos": True, "temperature": 0,
                "return_token_ids": True}
        request = urllib.request.Request(engine.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        lines.append(urllib.request.urlopen(request).read().decode())
    path = tmp_path_factory.mktemp("served") / "served.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def whole_file(served_file, tmp_path_factory):
    """The uninterrupted --served FILE run: the --server run's figures, with no server."""
    return run(tmp_path_factory.mktemp("whole_file"), "whole", "--served", str(served_file))


def test_a_served_file_is_the_server_run(whole, whole_file):
    """The ground the other tests stand on: --served FILE and --server give the same served figures."""
    assert_misconfiguration_seen(whole_file)
    assert_same_served(whole_file, whole)


def partial_rows(out):
    with open(f"{out}.partial.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def stop_at_reference(monkeypatch, n):
    """Ctrl-C as the n-th reference arrives from the server, before it is written (eval_drafter.write_row, in the main
    thread, as fetch_references hands each reply to keep): the real write_row, to put back before a resume."""
    real, seen = ed.write_row, []

    def stopping(f, row):
        if "reference" in row:
            seen.append(row)
            if len(seen) == n:
                raise KeyboardInterrupt
        return real(f, row)

    monkeypatch.setattr(ed, "write_row", stopping)
    return real


@pytest.mark.parametrize("source, cut", [("server", "fetching"), ("server", "scoring"), ("file", "scoring")])
def test_interrupted_then_resumed_keeps_the_served_figures(engine, whole, whole_file, served_file, tmp_path,
                                                           monkeypatch, source, cut):
    """Nothing served is lost on Ctrl-C: interrupted while the engine's replies arrive (3 of 6 kept) or after the first
    two prompts are scored, the run exits 130 with what it had in its partial file; --resume sends the engine no
    request for a prompt whose reference was kept, and ends with the uninterrupted run's served summary and every
    prompt's served figures (its requests, steps, equality and suspects)."""
    flags = server(engine) if source == "server" else ["--served", str(served_file)]
    want = whole if source == "server" else whole_file
    engine.reset(**MISCONFIGURED)
    if cut == "fetching":
        real, name = stop_at_reference(monkeypatch, 4), "write_row"
    else:
        (real, _), name = interrupt_at(monkeypatch, "evaluate_prompts", 3), "evaluate_prompts"
    cut_report = run(tmp_path, "cut", *flags, code=130)
    assert cut_report["interrupted"] is True
    rows = partial_rows(tmp_path / "cut.json")
    scored = {row["item"]["id"] for row in rows if "item" in row}
    kept = scored | {row["reference"]["id"] for row in rows if "reference" in row}
    assert len(scored) == (0 if cut == "fetching" else 2)
    if source == "server":
        assert len(kept) == (3 if cut == "fetching" else LIMIT)
        assert all(row["reference"].get("served") for row in rows if "reference" in row), \
            "a reference was kept without the engine's figures"
    monkeypatch.setattr(ed, name, real)

    engine.reset(**MISCONFIGURED)   # forgets the requests of the interrupted run
    resumed = run(tmp_path, "cut", *flags, "--resume")
    ids = demo_prompt_ids(engine)
    if source == "server":
        assert asked(engine) == Counter(ids[i] for i in ids if i not in kept), "a kept reference was asked for again"
    else:
        assert not engine.requests
    assert not resumed.get("interrupted")
    assert_same_served(resumed, want)


def test_shards_merge_to_the_served_summary_of_one_run(engine, whole, tmp_path):
    """Equal numbers through shards: --shard 1/2 and 2/2 against the engine, each asking it for its own prompts only,
    then --merge of the two gives the single run's served summary (pooled from every request, not averaged) and every
    prompt's served figures."""
    engine.reset(**MISCONFIGURED)
    shards = [run(tmp_path, f"s{k}", *server(engine), "--shard", f"{k}/2") for k in (1, 2)]
    assert asked(engine) == Counter(demo_prompt_ids(engine).values())   # each prompt asked once, by one shard
    sizes = [len(s["drafters"][0]["prompts"]) for s in shards]
    assert sum(sizes) == LIMIT and all(sizes)
    assert [s["drafters"][0]["served"]["requests"] for s in shards] == sizes
    assert ed.main(["--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"), "--quiet", "--output",
                    str(tmp_path / "merged.json")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert_same_served(merged, whole)


def test_saved_features_keep_the_served_figures_and_suspects(served_file, whole_file, tmp_path):
    """Saved features: a --served FILE run with --save-hidden, then a --load-hidden run (no target pass; the references
    and what the engine said of them were fixed at extraction, so --served, like --max-new-tokens, is the saved
    file's and refused beside --load-hidden) gives the same served summary and per-prompt figures, the suspects named
    included: the suspect layers the redrafting needs were saved in the features."""
    cache = tmp_path / "h.safetensors"
    saved = run(tmp_path, "saved", "--served", str(served_file), "--save-hidden", str(cache))
    assert_same_served(saved, whole_file)
    assert set(MISCONFIGURED["layers"]) <= set(ed.read_hidden_meta(str(cache))["layers"])
    loaded = run(tmp_path, "loaded", "--load-hidden", str(cache), base=LOADED)
    assert_misconfiguration_seen(loaded)
    assert_same_served(loaded, saved)


def test_served_refusals_are_one_line(engine, served_file, tmp_path, capsys):
    """A --served the run cannot use is refused before anything loads: a missing file, or --served with --server (two
    sources of the same references), each exits 2 with one line on stderr (no traceback) and writes no output."""
    out = tmp_path / "o.json"
    refused_in_one_line(capsys, [*BASE, "--served", str(tmp_path / "missing.jsonl"), "--output", str(out)],
                        "--served file not found")
    refused_in_one_line(capsys, [*BASE, "--served", str(served_file), *server(engine), "--output", str(out)],
                        "--served and --server both give the references")
    assert not os.listdir(tmp_path)
