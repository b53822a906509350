"""The manual cannot drift from the code (issue 45).

- docs/options.md is what `eval_drafter.py --help-markdown` writes from the flag table, byte for byte; every flag is
  on it, with its number rule.
- docs/code.md is written from the script (tests/code_page.py): a row for every section banner (which its docstring
  lists), the declared records, every family class and every verification rule.
- The README's support table is what support_markdown() writes from the family table; --help lists every family,
  where its checkpoints come from and who serves it, and the target kinds.
- Every heading of the README as it stood before the manual (1,496 lines) has a home in docs/, and every link and
  picture in the README and docs/ leads somewhere: a page, a heading on it, a file.
- docs/json.md describes the report: the demo run in several modes (two drafters with depths, costs and the mask
  check; sampled with both verification rules; a benchmark; a shard; EAGLE-3 with SGLang's tree; the other drafter
  families; a training run's steps; an override; a skipped prompt; an engine's served figures, greedy and sampled)
  writes no key the page does not describe, and every key the page describes is written by one of them (RARE lists
  the few written on paths other tests reach).
"""
import json
import os
import re
import shutil

import pytest
import transformers

import bench_data as bd
import eval_drafter as ed
from spec_engine import load_demo, start_engine
from drafters import dspark_with_confidence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
FIX = os.path.join(ROOT, "tests", "fixtures")
HYBRID = hasattr(transformers, "Qwen3_5ForCausalLM")   # the hybrid demo target needs transformers 5


def page(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def test_the_options_page_is_the_flag_table(capsys):
    assert ed.main(["--help-markdown"]) == 0
    written = capsys.readouterr().out
    assert written == page("docs/options.md"), "run: python eval_drafter.py --help-markdown > docs/options.md"
    for _, flag, modes, rule, _ in ed.FLAGS:
        row = [line for line in written.splitlines() if re.match(rf"\| `{flag}[ `]", line)]
        assert len(row) == 1, flag
        assert (rule is None or f"| {rule[0]} |" in row[0]) and row[0].endswith(f"| {modes} |"), row[0]


def test_the_support_table_and_help_are_the_family_table(capsys):
    readme = page("README.md")
    start = readme.index("<!-- support:")
    block = readme[readme.index("\n", start) + 1:readme.index("<!-- /support -->")]
    assert block == ed.support_markdown()
    with pytest.raises(SystemExit):
        ed.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for name, fam in ed.FAMILIES.items():
        assert f"{name} {fam.sources}; served by {fam.engines}" in shown, name
        assert f"| {name} | {fam.sources} | {fam.engines} |" in block
    assert " ".join(ed.TARGET_KINDS.split()) in shown


def test_the_code_page_is_written_from_the_code():
    """docs/code.md is tests/code_page.py's page: the banners, the records, the family classes and the rules."""
    import code_page
    assert page("docs/code.md") == code_page.page(), "run: python tests/code_page.py > docs/code.md"
    source = page("eval_drafter.py")
    banners = re.findall(r"^# -{20,}\n# ([^:\n]+)", source, re.M)
    assert len(banners) >= 16 and all(f"| **{b.split(': ')[0]}**" in page("docs/code.md") for b in banners)
    start = source.index('"""') + 3
    listed = source[start:source.index('"""', start)]
    for title in banners:   # and the top docstring lists them
        assert f"\n    {title}" in listed, title
    for name, fam in ed.FAMILIES.items():   # every family, with its class and its parent
        assert f"| {name} | `{type(fam).__name__}` | `{type(fam).__bases__[0].__name__}` |" in page("docs/code.md")


# The README's headings before the manual took its body (git show a5179fa:README.md).
OLD_HEADINGS = [
    "Why offline is exact", "Fresh machine: the demo, a real model, the tests", "transformers versions",
    "A real target: Qwen3.6-27B and its drafter, on CPU",
    "A real pair: SmolLM2-135M-Instruct and a drafter trained for it", "Options",
    "Hybrid targets (Qwen3.5 / Qwen3.6) and the two-box workflow", "Is my extraction right? `--compare-hidden`",
    "Was the drafter evaluated with the right mask? `--check-mask`", "Checkpoints from training",
    "A training run, step by step", "While a drafter trains: `--watch`, `measure()`, pictures",
    "Drafter generations, checkpoint layouts, targets", "References from a serving engine (SGLang, vLLM)",
    "Served against offline", "Benchmarks as the papers run them: `--bench`",
    "Large runs: torchrun, shards, merge, multi-turn", "Long runs: nothing lost",
    "Prompt formats (JSONL, one object a line)", "Sampled decoding: τ at the serving temperature",
    "Choosing what to serve", "My DFlash drafter against the target's MTP head", "Reading the report",
    "Several drafters: side by side", "Warnings: a drafter trained for something else",
    "Overrides: a flag over what the checkpoint says", "DDTree rows", "JSON output (`--output`)", "Reading the code",
    "Benchmark", "Errors"]


def headings(text):
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,4} ", line)]


def slug(heading):   # GitHub's anchor for a heading
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_every_old_heading_has_a_home_and_every_link_leads_somewhere():
    pages = {name: page(os.path.join("docs", name)) for name in os.listdir(DOCS) if name.endswith(".md")}
    homes = {h: name for name, text in pages.items() for h in headings(text)}
    assert [h for h in OLD_HEADINGS if h not in homes] == []
    assert len(page("README.md").splitlines()) <= 250
    for name, text in [("README.md", page("README.md")), *((f"docs/{n}", t) for n, t in pages.items())]:
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("http"):
                continue
            path, _, anchor = target.partition("#")
            where = os.path.normpath(os.path.join(ROOT, os.path.dirname(name), path or os.path.basename(name)))
            assert os.path.exists(where), (name, target)
            if anchor:
                assert anchor in {slug(h) for h in headings(page(os.path.relpath(where, ROOT)))}, (name, target)


# Keys whose children are named by the data (depths, budgets, splits, drafters, batch sizes, ...): their values are
# described once under a placeholder.
MAPS = {"depths", "verify", "ddtree", "splits", "turns", "predicted_speedup", "rows", "by_context", "by_reply",
        "reply_leaders", "best_steps",
        "drafts_per_round", "at_depth", "benchmarks", "overrides", "modes", "ddtree_rounds", "depth_rounds",
        "verify_tau", "bench_files", "batch_sizes", "figures", "steps"}
# Described, and written only where other tests go: a run cut short (test_long_runs), a failed self-check
# (test_selfcheck), --costs measure's timing runs (test_costs), an engine's counts alone (test_served), llama-server's
# figures (test_llamacpp) and a conversion run beside its source (test_verdict).
RARE = {"interrupted", "message", "runs", "within_ties", "drafted_exact", "same_weights", "layouts"}


def keys(x, parent, got, mapped=False):
    """The key names of a report, below maps (MAPS) their values' keys only; not into what --merge reads back (a
    shard's records) nor into a cost table's seconds (by tokens, by drafter and depth)."""
    if isinstance(x, dict):
        for k, v in x.items():
            if mapped:
                keys(v, "*", got)
            else:
                got.add(k)
                if k == "shard":
                    got.update(v)
                elif not (parent == "*" and k in ("target", "draft")):
                    keys(v, k, got, k in MAPS)
    elif isinstance(x, list):
        for v in x:
            keys(v, parent, got)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("json")
    bd.write("gsm8k", "jsonl", root / "bench")
    bd.write("mt-bench", "jsonl", root / "bench")
    run = root / "run"
    for step in (100, 200):
        shutil.copytree(os.path.join(FIX, "demo", "drafter"), run / f"step_{step}")
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"id": "empty", "prompt": ""}\n{"id": "one", "prompt": "w20 w9 w25 w52"}\n'
                       '{"id": "given", "prompt": "w3 w58 w28", "completion": "w1 w1 w2 w2 w3 w4 w5 w6 w7 w8 w9"}\n'
                       '{"id": "short", "prompt": "w3 w58", "completion": "w1 w2"}\n')
    demo, short = os.path.join(FIX, "demo", "drafter"), ["--max-new-tokens", "24", "--quiet"]
    modes = {
        "two": ["--demo", "--ckpt", f"a={demo}", "--ckpt", f"b={FIX}/families/dspark_vanilla", "--depths", "3",
                "--costs", "gpu:H100", "--check-mask", "--limit", "3", "--batch-sizes", "1,64",
                "--k-by-batch-size", "1-8:3,9-64:0"],
        "sampled": ["--demo", "--temperature", "0.01", "--verify", "standard,block", "--samples-per-prompt", "2",
                    "--limit", "2"],
        "bench": ["--demo", "--bench", "gsm8k,mt-bench", "--bench-dir", str(root / "bench"), "--max-samples", "2",
                  "--published", "z-lab/Qwen3-4B-DFlash-b16"],
        "shard": ["--demo", "--shard", "1/2", "--limit", "2", "--verify", "standard,fly"],
        "eagle": ["--target", f"{FIX}/llama/target", "--ckpt", f"{FIX}/llama/eagle3", "--prompts",
                  f"{FIX}/demo/prompts.jsonl", "--limit", "2", "--adaptive-steps"],
        "families": ["--demo", "--ckpt", f"{FIX}/families/domino", "--ckpt", f"{FIX}/speculators/xpress", "--ckpt",
                     f"{FIX}/families/lilicorr", "--ckpt", "n=ngram:min=2,max=3", "--ckpt", "s=suffix", "--ckpt",
                     f"m=draft_model:{FIX}/demo/target", "--limit", "2"],
        "steps": ["--demo", "--ckpt", f"run={run}", "--mask-token-id", "1", "--prompts", str(prompts)],
        "verification": ["--demo", "--ckpt", f"c={dspark_with_confidence(root / 'c')}", "--adaptive-verification",
                         "--costs", "gpu:H100", "--limit", "2"],
    }
    if HYBRID:   # the hybrid target's MTP layer
        modes["mtp"] = ["--target", f"{FIX}/demo_hybrid/target", "--mtp", "--prompts",
                        f"{FIX}/demo_hybrid/prompts.jsonl", "--limit", "1"]
    flags = set(ed.flag_names(""))
    got = set()
    engine = start_engine(*load_demo()[:2])   # served figures: greedy with the layers one lower, sampled
    serve = ["--demo", "--limit", "3", "--ignore-eos", "--ddtree-budgets", "none", "--server", engine.url,
             "--server-api", "openai", "--server-model", "demo"]
    modes.update(served=serve, served_sampled=[*serve, "--temperature", "0.8", "--draft-policy", "sample"])
    try:
        for name, argv in modes.items():
            if name.startswith("served"):
                engine.reset(**({"layers": [0, 2, 3]} if name == "served" else {}), detailed=True)
            out = root / f"{name}.json"
            assert ed.main([*argv, *short, "--output", str(out)]) == 0, name
            report = json.loads(out.read_text())
            keys({k: v for k, v in report.pop("config").items() if k not in flags}, "config", got)
            keys(report, None, got)
    finally:
        engine.shutdown()
    return got | {"config"}


def test_the_json_page_describes_what_runs_write(written):
    text = page("docs/json.md")
    described = set(re.findall(r'"([a-z_][a-z0-9_]*)"', text[text.index("```"):]))
    unknown = sorted(written - described)
    assert unknown == [], f"written by a run, not described in docs/json.md: {unknown}"
    missing = described - written - RARE
    if not HYBRID:
        missing -= {"gate"}   # the MTP head's gate: the hybrid target needs transformers 5
    assert sorted(missing) == [], f"described in docs/json.md, written by no run: {sorted(missing)}"
