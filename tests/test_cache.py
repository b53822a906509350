"""The hidden-state cache (--save-hidden / --load-hidden), --compare-hidden and --check-mask.

Every run here is eval_drafter.main() in-process (no interpreter start-up per run). The demo pair gives
a trained drafter with meaningful tau; the tiny random target from conftest gives cheap targets and
drafters with any layer set.
"""
import contextlib
import hashlib
import io
import json
import os
import shutil

import pytest
import torch

import eval_drafter as ed
from conftest import interrupt_at, make_drafter, md, write_jsonl

DEMO_TARGET = os.path.join(ed.DEMO_DIR, "target")
DEMO_DRAFTER = os.path.join(ed.DEMO_DIR, "drafter")
DEMO_PROMPTS = os.path.join(ed.DEMO_DIR, "prompts.jsonl")
DEMO_ARGS = ["--demo", "--limit", "4", "--max-new-tokens", "40", "--quiet"]
META_KEY = "eval_drafter"


def cli(*argv):
    """ed.main in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = ed.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def ok(*argv):
    rc, out, err = cli(*argv)
    assert rc == 0, f"exit {rc}: {err}"
    return out, err


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def assert_one_error_line(rc, err, *fragments):
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, f"expected one stderr line, got: {err!r}"
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def read_cache(path):
    """(tensors, metadata dict) of a --save-hidden file."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()[META_KEY])
    return load_file(str(path)), meta


def write_cache(path, tensors, meta):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={META_KEY: json.dumps(meta)})
    return str(path)


# ----------------------------------------------------------------------------------------------------
# Fixtures: the demo pair (direct, saved, loaded; an fp32 and a bf16 cache) and the tiny target with two
# drafters whose layer sets differ


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo_cache")
    r = {"tmp": tmp, "fp32": str(tmp / "fp32.safetensors"), "bf16": str(tmp / "bf16.safetensors")}
    ok(*DEMO_ARGS, "--output", tmp / "direct.json")
    ok(*DEMO_ARGS, "--save-hidden", r["fp32"], "--output", tmp / "saved.json")
    ok("--target", DEMO_TARGET, "--ckpt", f"demo={DEMO_DRAFTER}", "--load-hidden", r["fp32"], "--quiet",
       "--output", tmp / "loaded.json")
    # The bf16 extraction teacher-forces the fp32 file's references, so both files hold the same tokens
    # whatever bf16 greedy decoding would have generated.
    tensors, meta = read_cache(r["fp32"])
    with open(DEMO_PROMPTS, encoding="utf-8") as f:
        texts = {row["id"]: row["prompt"] for row in map(json.loads, f)}
    rows = [{"id": p["id"], "split": p["split"], "prompt": texts[p["id"]],
             "completion_ids": tensors[f"{i}.ids"][p["prompt_tokens"]:].tolist()}
            for i, p in enumerate(meta["prompts"])]
    prompts = write_jsonl(tmp / "refs.jsonl", rows)
    ok("--target", DEMO_TARGET, "--ckpt", f"demo={DEMO_DRAFTER}", "--prompts", prompts, "--dtype", "bfloat16",
       "--save-hidden", r["bf16"], "--quiet")
    for name in ("direct", "saved", "loaded"):
        r[name] = read_json(tmp / f"{name}.json")
    return r


TINY_ROWS = [
    {"id": "g1", "split": "train", "prompt": "w1 w2 w3 w4"},
    {"id": "g2", "split": "fresh", "prompt": "w9 w8"},
    {"id": "given", "split": "fresh", "prompt": "w5 w6 w7", "completion_ids": [4 + (5 * i) % 60 for i in range(20)]},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_target):
    """Drafter p needs layers (1, 3, 4), q needs (0, 2); one cache holds the union, one only p's layers."""
    tmp = tmp_path_factory.mktemp("tiny_cache")
    r = {"tmp": tmp, "target": tiny_target["path"], "cfg": tiny_target["cfg"], "model": tiny_target["model"],
         "p": make_drafter(tmp / "p", tiny_target["cfg"], layer_ids=(1, 3, 4), seed=11),
         "q": make_drafter(tmp / "q", tiny_target["cfg"], layer_ids=(0, 2), block_size=6, seed=12),
         "prompts": write_jsonl(tmp / "prompts.jsonl", TINY_ROWS),
         "union": str(tmp / "union.safetensors"), "p_only": str(tmp / "p_only.safetensors")}
    common = ["--target", r["target"], "--prompts", r["prompts"], "--max-new-tokens", "24", "--ignore-eos", "--quiet"]
    r["common"] = common
    ok(*common, "--ckpt", f"p={r['p']}", "--ckpt", f"q={r['q']}", "--output", tmp / "both.json")
    ok(*common, "--ckpt", f"p={r['p']}", "--ckpt", f"q={r['q']}", "--save-hidden", r["union"],
       "--output", tmp / "both_saved.json")
    ok(*common, "--ckpt", f"p={r['p']}", "--save-hidden", r["p_only"], "--limit", "2")
    r["both"] = read_json(tmp / "both.json")
    r["both_saved"] = read_json(tmp / "both_saved.json")
    return r


def alone(drafter):
    """A drafter's entry of the p+q run as a run of it alone gives it: beside q (5 drafts a round) p (7) was walked
    at their common depth 5 too, a depth row and per-prompt rounds that a run of p alone has no reason to add."""
    common = {k: v for k, v in drafter.items() if k != "depths"}
    common["prompts"] = [{k: v for k, v in p.items() if k != "depth_rounds"} for p in drafter["prompts"]]
    return common


def load_argv(target, cache, *ckpts):
    return ["--target", target, *[x for c in ckpts for x in ("--ckpt", c)], "--load-hidden", cache, "--quiet"]


# ----------------------------------------------------------------------------------------------------
# 1. save -> load reproduces the direct run


CONFIG_KEYS_ALLOWED_TO_DIFFER = {"prompts", "load_hidden", "save_hidden", "output", "max_new_tokens", "limit",
                                 "demo", "chat_template", "prompts_hash", "hidden_cache", "hidden_hashes",
                                 "reference_generation_used", "reference_generation_choice"}


def test_demo_save_does_not_change_results(demo):
    assert demo["saved"]["drafters"] == demo["direct"]["drafters"]
    assert demo["saved"]["target"] == demo["direct"]["target"]


def test_demo_load_equals_direct_run(demo):
    direct, loaded = demo["direct"], demo["loaded"]
    assert loaded["drafters"] == direct["drafters"]
    assert loaded["target"] == direct["target"]
    assert loaded["drafters"][0]["tau"] > 3   # the trained demo drafter, not a degenerate run
    differ = {k for k in set(direct["config"]) | set(loaded["config"])
              if direct["config"].get(k) != loaded["config"].get(k)}
    assert differ <= CONFIG_KEYS_ALLOWED_TO_DIFFER, differ
    assert loaded["config"]["load_hidden"] == [demo["fp32"]]


def test_tiny_save_does_not_change_results(tiny):
    assert tiny["both_saved"]["drafters"] == tiny["both"]["drafters"]


@pytest.mark.parametrize("which", ["p", "q", "p+q", "q+p"])
def test_one_cache_serves_drafters_with_different_layers(tiny, which):
    names = which.split("+")
    out = tiny["tmp"] / f"load_{which}.json"
    ok(*load_argv(tiny["target"], tiny["union"], *[f"{n}={tiny[n]}" for n in names]), "--output", out)
    loaded = read_json(out)
    direct = {d["name"]: d for d in tiny["both"]["drafters"]}
    assert loaded["drafters"] == [direct[n] if len(names) > 1 else alone(direct[n]) for n in names]
    assert loaded["target"] == tiny["both"]["target"]
    assert [d["layers"] for d in loaded["drafters"]] == [{"p": [1, 3, 4], "q": [0, 2]}[n] for n in names]


def test_load_feeds_drafters_identical_tensors(tiny, monkeypatch):
    """Stronger than equal reports (drafts are argmaxes, small drifts would not show): every drafter call gets
    bit-identical features from the cache, and the embedding / head read by name give the model's own outputs."""
    real_context, real_draft, calls = ed.prompt_context, ed.draft_all_anchors, []

    def context_spy(drafter, features, *args):
        calls.append([drafter.name, {L: features[L].clone() for L in drafter.layers}])
        return real_context(drafter, features, *args)

    def spy(drafter, context_kv, anchors, first, embed, head, *args, **kwargs):
        calls[-1] += [anchors.tolist(), first.tolist(), embed, head]
        return real_draft(drafter, context_kv, anchors, first, embed, head, *args, **kwargs)

    monkeypatch.setattr(ed, "prompt_context", context_spy)
    monkeypatch.setattr(ed, "draft_all_anchors", spy)
    ok(*tiny["common"], "--ckpt", f"p={tiny['p']}", "--ckpt", f"q={tiny['q']}", "--reference-generation", "plain")
    direct, calls[:] = list(calls), []
    ok(*load_argv(tiny["target"], tiny["union"], f"p={tiny['p']}", f"q={tiny['q']}"))
    loaded = calls
    # per drafter and prompt, as extracted, shuffled, and p once more at q's depth (their common depth)
    assert len(direct) == len(loaded) == 5 * len(TINY_ROWS)
    probe_ids = torch.arange(tiny["cfg"].vocab_size)
    probe_x = torch.randn(5, tiny["cfg"].hidden_size, generator=torch.Generator().manual_seed(0))
    for d, l in zip(direct, loaded):
        assert d[0] == l[0] and d[2:4] == l[2:4]   # drafter, anchors, tokens at the anchors
        assert d[1].keys() == l[1].keys()
        for L in d[1]:
            assert torch.equal(d[1][L], l[1][L]), (d[0], L)
        with torch.no_grad():
            assert torch.equal(d[4][probe_ids], l[4][probe_ids])   # the embedding matrix
            assert torch.equal(d[5](probe_x), l[5](probe_x))


def test_load_with_limit_gives_the_first_prompts(tiny):
    out = tiny["tmp"] / "load_limit.json"
    ok(*load_argv(tiny["target"], tiny["union"], f"p={tiny['p']}"), "--limit", "2", "--output", out)
    (d,) = read_json(out)["drafters"]
    assert d["prompts"] == alone(tiny["both"]["drafters"][0])["prompts"][:2]


def test_cache_contents(tiny):
    """Tensors: ids, the target's argmax and hidden_states[L + 1] per layer; metadata as documented."""
    tensors, meta = read_cache(tiny["union"])
    report = tiny["both"]["drafters"][0]
    assert meta["format"] == "eval_drafter.hidden/3"
    assert meta["target_hash"] == ed.target_hash(tiny["target"])
    assert meta["layers"] == [0, 1, 2, 3, 4]
    assert (meta["dtype"], meta["device"]) == ("float32", "cpu")
    assert meta["torch_version"] == torch.__version__
    import transformers
    assert meta["transformers_version"] == transformers.__version__
    assert meta["prompts_file"] == os.path.abspath(tiny["prompts"])
    with open(tiny["prompts"], "rb") as f:
        assert meta["prompts_hash"] == hashlib.sha256(f.read()).hexdigest()
    assert meta["chat_template"] is False and meta["enable_thinking"] is False  # word tokenizer: no template
    fields = ("id", "split", "prompt_tokens", "completion_tokens")
    assert [{k: e[k] for k in fields} for e in meta["prompts"]] == [{k: p[k] for k in fields} for p in report["prompts"]]
    # Where each reference came from: "generated" (bool) in the first format, "source" since the server references.
    assert [origin(e) for e in meta["prompts"]] == ["target", "target", "file"]
    assert [origin(e) for e in meta["prompts"]] == [p.get("reference_source") or
                                                    ("target" if p["reference_generated"] else "file")
                                                    for p in report["prompts"]]
    expected_keys = {f"{i}.{k}" for i in range(3)
                     for k in ["ids", "argmax", "gaps", "ties"] + [f"layer{L}" for L in range(5)]}
    assert set(tensors) == expected_keys
    model = tiny["model"]
    for i, p in enumerate(meta["prompts"]):
        ids, n = tensors[f"{i}.ids"], p["prompt_tokens"]
        assert ids.shape == (n + p["completion_tokens"],)
        if p["id"] == "given":
            assert ids[n:].tolist() == TINY_ROWS[2]["completion_ids"]
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
        assert tensors[f"{i}.argmax"].tolist() == out.logits[0, n - 1:-1].argmax(-1).tolist()
        # the logit gap of each reference token below the top one: 0 where the argmax is the reference
        logits = out.logits[0, n - 1:-1]
        gap = logits.max(-1).values - logits.gather(1, ids[n:, None])[:, 0]
        torch.testing.assert_close(tensors[f"{i}.gaps"], gap, rtol=0, atol=1e-5)
        if p["id"] == "given":
            assert (gap > 0).any()   # a reference from the file: the target would say otherwise somewhere
        for L in range(5):
            assert tensors[f"{i}.layer{L}"].dtype == torch.float32
            torch.testing.assert_close(tensors[f"{i}.layer{L}"], out.hidden_states[L + 1][0], rtol=1e-5, atol=1e-5)


def origin(entry):
    return entry["source"] if "source" in entry else ("target" if entry["generated"] else "file")


def test_cache_of_the_first_format_still_loads(tiny, tmp_path):
    """Regression test; the bug was: caches written by the first versions of --save-hidden (commits f948551..221a0a2) store
    prompts[i].generated; the current open_hidden reads prompts[i]["source"] and dies with KeyError: 'source'
    (a traceback), although the file still says format "eval_drafter.hidden/1". Either read the old field
    (generated true -> "target", false -> "file") or bump the format and refuse old files with one clear line."""
    tensors, meta = read_cache(tiny["union"])
    meta.pop("shards", None)
    for e in meta["prompts"]:
        e["generated"] = e.pop("source", "file") != "file"
    old = write_cache(tmp_path / "first_format.safetensors", tensors, meta)
    out = tmp_path / "o.json"
    try:
        rc, _, err = cli(*load_argv(tiny["target"], old, f"p={tiny['p']}", f"q={tiny['q']}"), "--output", out)
    except Exception as e:  # noqa: BLE001 - the bug
        pytest.fail(f"loading a first-format cache raised {type(e).__name__}: {e}")
    if rc == 2:
        assert_one_error_line(rc, err, old)
        return
    assert rc == 0, err
    got = read_json(out)["drafters"]
    assert [(d["tau"], [p["rounds"] for p in d["prompts"]]) for d in got] == \
        [(d["tau"], [p["rounds"] for p in d["prompts"]]) for d in tiny["both"]["drafters"]]
    assert [p["reference_generated"] for p in got[0]["prompts"]] == [True, True, False]


def test_save_is_atomic(tiny, tmp_path, monkeypatch):
    """The file is written under another name and renamed: an old cache stays whole until the new one is done."""
    import safetensors.torch
    dest = tmp_path / "c.safetensors"
    dest.write_bytes(b"old cache")
    real, calls = safetensors.torch.save_file, []

    def spy(tensors, filename, metadata=None):
        calls.append(filename)
        assert dest.read_bytes() == b"old cache"
        real(tensors, filename, metadata=metadata)
        assert dest.read_bytes() == b"old cache"

    monkeypatch.setattr(safetensors.torch, "save_file", spy)
    ok(*tiny["common"], "--ckpt", f"p={tiny['p']}", "--limit", "1", "--save-hidden", dest)
    assert calls and all(os.path.abspath(c) != os.path.abspath(dest) for c in calls)   # a prompt's part, the cache
    assert all(os.path.dirname(os.path.abspath(c)) == str(tmp_path) for c in calls)   # same filesystem: rename is atomic
    assert read_cache(dest)[1]["layers"] == [1, 3, 4]
    assert sorted(os.listdir(tmp_path)) == ["c.safetensors"]


def test_save_hidden_into_missing_directory_fails_before_the_run(tiny, tmp_path):
    """Regression test; the bug was: --save-hidden into a directory that does not exist is only noticed by safetensors at the very end:
    a SafetensorError traceback, and the whole run (generation, extraction, drafting) is lost with no report.
    Expected: refused up front like any bad path (exit 2, one 'error:' line)."""
    try:
        rc, out, err = cli(*tiny["common"], "--ckpt", f"p={tiny['p']}", "--limit", "1",
                           "--save-hidden", tmp_path / "no" / "such" / "dir" / "c.safetensors")
    except Exception as e:  # noqa: BLE001 - the bug: main() lets the safetensors error out
        pytest.fail(f"--save-hidden into a missing directory raised {type(e).__name__}: {e}")
    assert_one_error_line(rc, err, "no/such/dir")


def test_load_report_says_how_the_cache_was_extracted(demo, tmp_path):
    """Regression test; the bug was (minor, reporting): a run from a bf16 cache reports "target: ... (cpu, float32)" and its JSON holds
    no trace of the extraction's dtype/device/versions, which the cache's metadata carries. The point of the
    cache is to extract on one box (GPU, bf16) and evaluate on another, so the report should say how the
    features were made (e.g. echo the cache metadata's dtype, device and versions)."""
    out = tmp_path / "load_bf16.json"
    stdout, _ = ok("--target", DEMO_TARGET, "--ckpt", f"demo={DEMO_DRAFTER}", "--load-hidden", demo["bf16"],
                   "--quiet", "--output", out)
    rep = read_json(out)
    assert "bfloat16" in json.dumps({k: rep[k] for k in ("target", "config")}), rep["target"]
    assert "bfloat16" in stdout.splitlines()[0], stdout.splitlines()[0]


@pytest.mark.parametrize("shard_bytes", [1, 30000], ids=["shard_per_prompt", "some_shards"])
def test_sharded_cache(tiny, tmp_path, monkeypatch, shard_bytes):
    """Past SAVE_SHARD_BYTES the features go to shard files beside the cache; loading and comparing see one cache."""
    monkeypatch.setattr(ed, "SAVE_SHARD_BYTES", shard_bytes)
    cache = tmp_path / "sharded.safetensors"
    ok(*tiny["common"], "--ckpt", f"p={tiny['p']}", "--ckpt", f"q={tiny['q']}", "--save-hidden", cache)
    _, meta = read_cache(cache)
    assert meta["shards"], "nothing was sharded"
    assert sorted(os.listdir(tmp_path)) == sorted(["sharded.safetensors"] + meta["shards"])
    out = tmp_path / "o.json"
    ok(*load_argv(tiny["target"], cache, f"p={tiny['p']}", f"q={tiny['q']}"), "--output", out)
    assert read_json(out)["drafters"] == tiny["both"]["drafters"]
    rep, _ = compare(tiny["union"], cache, tmp_path / "cmp.json")
    assert all(st["relative_error"] == 0.0 for st in rep["layers"].values()) and rep["argmax_agreement"] == 1.0
    os.remove(tmp_path / meta["shards"][-1])
    rc, _, err = cli(*load_argv(tiny["target"], cache, f"p={tiny['p']}"))
    assert_one_error_line(rc, err, meta["shards"][-1], "missing")


def test_interrupted_resave_keeps_the_old_sharded_cache(tiny, tmp_path, monkeypatch):
    """Regression test; the bug was: shards are written under fixed names (<file>.shard1, ...) as the run goes, so re-extracting to the path
    of an existing sharded cache overwrites its shards long before the new main file replaces the old one. Stop
    that run (Ctrl-C / SIGTERM, a crash, an OOM) after its first shard and the OLD cache silently mixes two
    extractions: its metadata, the new run's tensors in shard1. The main file's tmp + rename is atomic, the cache
    as a whole is not. Shards need names of their own run (or tmp names renamed at the end)."""
    monkeypatch.setattr(ed, "SAVE_SHARD_BYTES", 1)
    cache = tmp_path / "c.safetensors"
    first = tmp_path / "first.json"
    ok(*tiny["common"], "--ckpt", f"p={tiny['p']}", "--save-hidden", cache, "--output", first)
    other_prompts = write_jsonl(tmp_path / "other.jsonl", [{"id": f"o{i}", "prompt": f"w{10 + i} w{30 + i} w7"}
                                                           for i in range(3)])
    real, calls = interrupt_at(monkeypatch, "extract_hidden", 2)
    argv = ["--target", tiny["target"], "--prompts", other_prompts, "--max-new-tokens", "24", "--ignore-eos",
            "--quiet", "--ckpt", f"p={tiny['p']}", "--save-hidden", cache]
    rc, _, _ = cli(*argv)
    assert rc == 130 and len(calls) == 2              # interrupted after the first prompt was kept
    monkeypatch.setattr(ed, "extract_hidden", real)
    out = tmp_path / "again.json"
    rc, _, err = cli(*load_argv(tiny["target"], cache, f"p={tiny['p']}"), "--output", out)
    assert rc == 0, err
    assert read_json(out)["drafters"] == read_json(first)["drafters"], \
        "the old cache now holds another run's tensors"


# ----------------------------------------------------------------------------------------------------
# 2. --load-hidden never builds the target: only its embedding and lm_head are read


class SafeOpenSpy:
    """Wraps safetensors.safe_open and records (file, tensor name) of every get_tensor."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __call__(self, filename, framework, device="cpu"):
        spy, inner = self, self.real(filename, framework, device=device)

        class Handle:
            def __enter__(self):
                inner.__enter__()
                return self

            def __exit__(self, *exc):
                return inner.__exit__(*exc)

            def get_tensor(self, name):
                spy.log.append((os.path.abspath(str(filename)), name))
                return inner.get_tensor(name)

            def __getattr__(self, name):
                return getattr(inner, name)

        return Handle()


@pytest.fixture()
def no_target_model(monkeypatch):
    """Building the target model or its tokenizer raises; tensors read from safetensors are recorded."""
    import safetensors
    import transformers
    from transformers.modeling_utils import PreTrainedModel

    def refuse(*a, **k):
        raise AssertionError("the target must not be built with --load-hidden")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda cls, *a, **k: refuse()))
    monkeypatch.setattr(PreTrainedModel, "__init__", refuse)
    log = []
    monkeypatch.setattr(safetensors, "safe_open", SafeOpenSpy(safetensors.safe_open, log))
    return log


def tensors_read_under(log, directory):
    directory = os.path.abspath(directory)
    return sorted(name for path, name in log if os.path.dirname(path) == directory)


def test_patches_catch_a_normal_run(tiny, no_target_model):
    """Sanity check of the fixture: a run that builds the target fails under it (the tokenizer error is reported
    as a usage error), and so does building any model directly."""
    from transformers import Qwen3ForCausalLM
    try:
        rc, _, err = cli(*tiny["common"], "--ckpt", f"p={tiny['p']}", "--limit", "1")
    except AssertionError as e:
        rc, err = 2, str(e)
    assert rc == 2 and "must not be built" in err
    with pytest.raises(AssertionError, match="must not be built"):
        Qwen3ForCausalLM(tiny["cfg"])


def test_demo_load_reads_only_embedding_and_head(demo, no_target_model):
    out = demo["tmp"] / "load_spied.json"
    ok("--target", DEMO_TARGET, "--ckpt", f"demo={DEMO_DRAFTER}", "--load-hidden", demo["fp32"], "--quiet",
       "--output", out)
    assert read_json(out)["drafters"] == demo["direct"]["drafters"]
    assert tensors_read_under(no_target_model, DEMO_TARGET) == ["lm_head.weight", "model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny target with tied embeddings (its safetensors hold no lm_head.weight), a drafter and a cache."""
    from safetensors import safe_open
    from transformers import Qwen3ForCausalLM
    tmp = tmp_path_factory.mktemp("tied")
    target = str(tmp / "target")
    vocab = md.save_tokenizer(target)
    cfg = md.target_config(vocab, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = 1
    model.save_pretrained(target)
    with safe_open(os.path.join(target, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    ckpt = make_drafter(tmp / "d", cfg, layer_ids=(1, 3, 4), seed=5)
    prompts = write_jsonl(tmp / "p.jsonl", TINY_ROWS[:2])
    cache = str(tmp / "c.safetensors")
    ok("--target", target, "--ckpt", f"d={ckpt}", "--prompts", prompts, "--max-new-tokens", "16", "--ignore-eos",
       "--quiet", "--save-hidden", cache, "--output", tmp / "direct.json")
    return {"tmp": tmp, "target": target, "ckpt": ckpt, "cache": cache, "direct": read_json(tmp / "direct.json")}


def test_tied_load_reads_only_embedding(tied, no_target_model):
    out = tied["tmp"] / "loaded.json"
    ok(*load_argv(tied["target"], tied["cache"], f"d={tied['ckpt']}"), "--output", out)
    assert read_json(out)["drafters"] == tied["direct"]["drafters"]
    assert tensors_read_under(no_target_model, tied["target"]) == ["model.embed_tokens.weight"]


def copy_target_with_tensors(src, dst, shards):
    """Copy a target directory, re-writing its weights as `shards`: [{new name: old name}, ...]; more than one
    shard gets a model.safetensors.index.json like a real large checkpoint."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    weights = load_file(os.path.join(dst, "model.safetensors"))
    os.remove(os.path.join(dst, "model.safetensors"))
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
             for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file({new: weights[old].contiguous() for new, old in shard.items()}, os.path.join(dst, name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(dst)


def test_sharded_multimodal_names_read_by_name(tiny, tmp_path, no_target_model):
    """Embedding under the multimodal name in one shard, lm_head in another, behind an index file."""
    from safetensors import safe_open
    with safe_open(os.path.join(tiny["target"], "model.safetensors"), "pt") as f:
        names = list(f.keys())
    rename = {n: n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n for n in names}
    first = {new: old for old, new in rename.items() if "embed_tokens" in new or "layers.0." in new}
    second = {new: old for old, new in rename.items() if new not in first}
    assert "lm_head.weight" in second and "model.language_model.embed_tokens.weight" in first
    target = copy_target_with_tensors(tiny["target"], tmp_path / "sharded", [first, second])
    assert ed.target_hash(target) == ed.target_hash(tiny["target"])
    out = tmp_path / "o.json"
    ok(*load_argv(target, tiny["union"], f"p={tiny['p']}", f"q={tiny['q']}"), "--output", out)
    assert read_json(out)["drafters"] == tiny["both"]["drafters"]
    read = sorted(no_target_model, key=lambda x: x[1])
    read = [(os.path.basename(p), n) for p, n in read if os.path.dirname(p) == os.path.abspath(target)]
    assert read == [("model-00002-of-00002.safetensors", "lm_head.weight"),
                    ("model-00001-of-00002.safetensors", "model.language_model.embed_tokens.weight")]


# ----------------------------------------------------------------------------------------------------
# 3. Caches that do not fit the run are refused: exit 2, one "error:" line


def test_cache_missing_layers(tiny):
    rc, out, err = cli(*load_argv(tiny["target"], tiny["p_only"], f"p={tiny['p']}", f"q={tiny['q']}"))
    assert_one_error_line(rc, err, "missing [0, 2]")


def test_cache_missing_all_layers(tiny):
    rc, out, err = cli(*load_argv(tiny["target"], tiny["p_only"], f"q={tiny['q']}"))
    assert_one_error_line(rc, err, "missing [0, 2]")


def test_cache_from_target_with_other_config(tiny, tmp_path):
    other = str(tmp_path / "other")
    shutil.copytree(tiny["target"], other)
    cfg = read_json(os.path.join(other, "config.json"))
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 2
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert ed.target_hash(other) != ed.target_hash(tiny["target"])
    rc, out, err = cli(*load_argv(other, tiny["union"], f"p={tiny['p']}"))
    assert_one_error_line(rc, err, "another target")


def test_cache_from_target_with_same_config_other_weights(tiny, tmp_path):
    """Regression test; the bug was: target_hash hashes config.json only, so a cache made with one target is accepted for any other target
    of the same architecture (a fine-tune, another seed). Here the tiny target's cache is evaluated against a copy
    of the tiny target whose weights are re-drawn (config.json byte-identical): the run exits 0 and reports a tau
    and "target agreement" (taken from the cache's argmax) that belong to neither target, instead of refusing.
    The hash should cover the weights too (at least the embedding / lm_head the loading run reads anyway, or the
    safetensors headers plus a sample of tensor bytes)."""
    from safetensors.torch import load_file, save_file
    other = str(tmp_path / "other_weights")
    shutil.copytree(tiny["target"], other)
    weights_path = os.path.join(other, "model.safetensors")
    g = torch.Generator().manual_seed(99)
    weights = {k: torch.randn(v.shape, generator=g) * 0.2 if v.dim() > 1 else v
               for k, v in load_file(weights_path).items()}
    save_file(weights, weights_path, metadata={"format": "pt"})
    assert ed.target_hash(other, version=1) == ed.target_hash(tiny["target"], version=1)  # same config
    rc, out, err = cli(*load_argv(other, tiny["union"], f"p={tiny['p']}"))
    assert_one_error_line(rc, err, "another target")


def not_caches(tmp):
    from safetensors.torch import save_file
    plain = str(tmp / "plain.safetensors")
    save_file({"x": torch.randn(3, 4)}, plain)
    other_meta = str(tmp / "other_meta.safetensors")
    save_file({"x": torch.randn(3, 4)}, other_meta, metadata={"format": "pt"})
    bad_json = str(tmp / "bad_json.safetensors")
    save_file({"x": torch.randn(3, 4)}, bad_json, metadata={META_KEY: "{not json"})
    text = tmp / "notes.txt"
    text.write_text("these are not hidden states\n")
    return {"plain": plain, "other_meta": other_meta, "bad_json": bad_json, "text": str(text)}


@pytest.mark.parametrize("kind", ["plain", "other_meta", "bad_json", "text"])
def test_not_a_cache(tiny, tmp_path, kind):
    path = not_caches(tmp_path)[kind]
    rc, out, err = cli(*load_argv(tiny["target"], path, f"p={tiny['p']}"))
    assert_one_error_line(rc, err, "not a hidden-state file written by --save-hidden")


def test_cache_metadata_without_fields(tiny, tmp_path):
    """Regression test; the bug was (minor): metadata under the right key but without the cache's fields (a hand-made or future-format
    file) passes read_hidden_meta, then open_hidden raises KeyError('target_hash'): a traceback, not exit 2.
    The "format" field is never checked either."""
    from safetensors.torch import save_file
    path = str(tmp_path / "empty_meta.safetensors")
    save_file({"x": torch.randn(3, 4)}, path, metadata={META_KEY: json.dumps({"format": "something/else"})})
    try:
        rc, out, err = cli(*load_argv(tiny["target"], path, f"p={tiny['p']}"))
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"a file with foreign eval_drafter metadata raised {type(e).__name__}: {e}")
    assert_one_error_line(rc, err, path)


def test_cache_not_found(tiny, tmp_path):
    rc, out, err = cli(*load_argv(tiny["target"], tmp_path / "nope.safetensors", f"p={tiny['p']}"))
    assert_one_error_line(rc, err, "hidden-state file not found")


@pytest.mark.parametrize("other", ["--save-hidden", "--compare-hidden"])
def test_load_hidden_with_save_or_compare(tiny, tmp_path, other):
    extra = [other, tmp_path / "x.safetensors"] + ([tiny["union"]] if other == "--compare-hidden" else [])
    rc, out, err = cli(*load_argv(tiny["target"], tiny["union"], f"p={tiny['p']}"), *extra)
    assert_one_error_line(rc, err, "separate runs")
    assert not os.path.exists(tmp_path / "x.safetensors")


# ----------------------------------------------------------------------------------------------------
# 4. --compare-hidden


def compare(a, b, out, *extra):
    stdout, _ = ok("--compare-hidden", a, b, "--quiet", "--output", out, *extra)
    return read_json(out), stdout


def test_compare_identical_files(demo, tmp_path):
    copy = str(tmp_path / "copy.safetensors")
    shutil.copy(demo["fp32"], copy)
    rep, stdout = compare(demo["fp32"], copy, tmp_path / "cmp.json")
    assert [f["path"] for f in rep["files"]] == [demo["fp32"], copy]
    assert list(rep["layers"]) == ["1", "3", "4"]
    for L, st in rep["layers"].items():
        assert st["relative_error"] == 0.0, L
        assert st["max_abs_diff"] == 0.0, L
        assert st["cosine_mean"] == pytest.approx(1.0, abs=1e-12)
        assert st["cosine_min"] == pytest.approx(1.0, abs=1e-12)
    assert rep["argmax_agreement"] == 1.0
    assert "drafters" not in rep
    assert "target argmax agreement A vs B: 1.0000" in stdout


def test_compare_perturbed_copy(tiny, tmp_path):
    tensors, meta = read_cache(tiny["union"])
    prompt, layer = 1, 3
    position = meta["prompts"][prompt]["prompt_tokens"] + 5
    g = torch.Generator().manual_seed(0)
    noise = 0.5 * torch.randn(tensors[f"{prompt}.layer{layer}"].shape[-1], generator=g)
    tensors[f"{prompt}.layer{layer}"][position] += noise
    b = write_cache(tmp_path / "perturbed.safetensors", tensors, meta)
    rep, stdout = compare(tiny["union"], b, tmp_path / "cmp.json")
    assert list(rep["layers"]) == ["0", "1", "2", "3", "4"]
    for L, st in rep["layers"].items():
        if L != str(layer):
            assert (st["relative_error"], st["max_abs_diff"]) == (0.0, 0.0), L
            assert st["cosine_min"] == pytest.approx(1.0, abs=1e-12)
    st = rep["layers"][str(layer)]
    whole_b = torch.cat([tensors[f"{i}.layer{layer}"] for i in range(len(meta["prompts"]))]).double()
    assert st["relative_error"] == pytest.approx(float(noise.double().norm() / whole_b.norm()), rel=1e-4)
    assert st["max_abs_diff"] == pytest.approx(float(noise.abs().max()), rel=1e-5)
    assert st["cosine_min"] < 1 - 1e-4 and st["cosine_mean"] < 1
    assert st["worst"] == {"prompt": meta["prompts"][prompt]["id"], "position": position}
    assert rep["argmax_agreement"] == 1.0


def test_compare_different_prompts(tiny, tmp_path):
    """Another prompt list (here: the first two prompts only) is refused."""
    rc, out, err = cli("--compare-hidden", tiny["union"], tiny["p_only"], "--quiet")
    assert_one_error_line(rc, err, "different prompts")


def test_compare_different_token_ids(tiny, tmp_path):
    """Same prompt list and lengths, other tokens: refused too."""
    tensors, meta = read_cache(tiny["union"])
    ids = tensors["2.ids"]
    ids[-1] = 4 if int(ids[-1]) != 4 else 5
    b = write_cache(tmp_path / "other_ids.safetensors", tensors, meta)
    rc, out, err = cli("--compare-hidden", tiny["union"], b, "--quiet")
    assert_one_error_line(rc, err, "different token ids")


def test_compare_not_a_cache(tiny, tmp_path):
    rc, out, err = cli("--compare-hidden", tiny["union"], not_caches(tmp_path)["plain"], "--quiet")
    assert_one_error_line(rc, err, "not a hidden-state file")


@pytest.fixture(scope="module")
def fp32_vs_bf16(demo):
    out = demo["tmp"] / "cmp_bf16.json"
    stdout, _ = ok("--compare-hidden", demo["fp32"], demo["bf16"], "--target", DEMO_TARGET,
                   "--ckpt", f"demo={DEMO_DRAFTER}", "--quiet", "--output", out)
    return read_json(out), stdout


def test_compare_drafter_tau_matches_load_hidden(demo, fp32_vs_bf16, tmp_path):
    rep, stdout = fp32_vs_bf16
    assert len(rep["drafters"]) == 2
    from_a, from_b = rep["drafters"]
    assert from_a == demo["loaded"]["drafters"]           # A's side = a plain --load-hidden A run
    out = tmp_path / "load_bf16.json"
    ok("--target", DEMO_TARGET, "--ckpt", f"demo={DEMO_DRAFTER}", "--load-hidden", demo["bf16"], "--quiet",
       "--output", out)
    assert from_b == read_json(out)["drafters"]
    assert f"tau A {from_a[0]['tau']:.3f}  B {from_b[0]['tau']:.3f}" in stdout


def test_compare_fp32_vs_bf16_demo(fp32_vs_bf16):
    """bf16 extraction drifts a little from fp32: small, nonzero. The figures are printed for the report."""
    rep, stdout = fp32_vs_bf16
    print("\n" + stdout)
    assert [f["dtype"] for f in rep["files"]] == ["float32", "bfloat16"]
    assert list(rep["layers"]) == ["1", "3", "4"]
    for L, st in rep["layers"].items():
        assert 0 < st["relative_error"] < 0.05, (L, st)
        assert 0.99 < st["cosine_mean"] < 1 and st["cosine_min"] <= st["cosine_mean"]
        assert st["max_abs_diff"] > 0
    assert rep["argmax_agreement"] > 0.95


# ----------------------------------------------------------------------------------------------------
# 5. --check-mask

MODES = ["configured", "bidirectional", "causal", "no sliding window"]


def mask_check_run(tmp, name, *argv):
    out = tmp / f"{name}.json"
    stdout, stderr = ok(*argv, "--check-mask", "--ddtree-budgets", "none", "--output", out)
    (d,) = read_json(out)["drafters"]
    return d, stdout, stderr


def assert_no_warning(d, stdout, stderr):
    assert d["mask_check"]["warning"] is None, d["mask_check"]
    assert "WARNING" not in stdout and "warning: drafter" not in stderr


def assert_warns(d, stdout, stderr, better):
    warning = d["mask_check"]["warning"]
    assert warning is not None, d["mask_check"]["modes"]
    assert f"'{better}'" in warning
    assert f"WARNING: {warning}" in stdout
    assert [ln for ln in stderr.splitlines() if ln.startswith("warning:") and warning in ln]


def test_check_mask_on_demo(demo, tmp_path):
    """Modes, sizes and labels; the demo drafter under its training rule is not flagged; the main results are
    the same as without --check-mask."""
    d, stdout, stderr = mask_check_run(tmp_path, "demo", *DEMO_ARGS)
    direct = demo["direct"]["drafters"][0]
    assert {k: v for k, v in d.items() if k not in ("mask_check", "ddtree", "splits", "prompts")} == \
        {k: v for k, v in direct.items() if k not in ("ddtree", "splits", "prompts")}
    modes = d["mask_check"]["modes"]
    assert list(modes) == MODES
    assert modes["configured"]["block_mask"] == ["causal, window 32", "bidirectional"]
    assert modes["bidirectional"]["block_mask"] == ["bidirectional, window 32", "bidirectional"]
    assert modes["causal"]["block_mask"] == ["causal, window 32", "causal"]
    assert modes["no sliding window"]["block_mask"] == ["bidirectional", "bidirectional"]
    for t in modes.values():
        assert t["anchors"] == 4 * ed.CHECK_ANCHORS          # 33 fitting anchors per prompt, 32 sampled
        assert 0 <= t["accuracy"] <= 1 and 1 <= t["tau_all_anchors"] <= d["block_size"]
    assert modes["configured"]["accuracy"] > 0.9
    assert modes["no sliding window"]["accuracy"] < modes["configured"]["accuracy"]
    assert_no_warning(d, stdout, stderr)
    assert "mask check on sampled anchors" in stdout


def test_check_mask_from_cache_equals_direct(demo, tmp_path):
    d_direct, _, _ = mask_check_run(tmp_path, "direct", *DEMO_ARGS)
    d_load, _, _ = mask_check_run(tmp_path, "load", "--target", DEMO_TARGET, "--ckpt", f"demo={DEMO_DRAFTER}",
                                  "--load-hidden", demo["fp32"], "--quiet")
    assert d_load["mask_check"] == d_direct["mask_check"]


def test_check_mask_flags_wrong_window(tmp_path):
    """A config whose window is far too small (swa_window_size 2, trained with 32): 'no sliding window' wins."""
    ckpt = str(tmp_path / "drafter")
    shutil.copytree(DEMO_DRAFTER, ckpt)
    cfg = read_json(os.path.join(ckpt, "config.json"))
    cfg["dflash_config"]["swa_window_size"] = 2
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(cfg, f)
    d, stdout, stderr = mask_check_run(tmp_path, "w2", *DEMO_ARGS, "--ckpt", f"w2={ckpt}")
    modes = d["mask_check"]["modes"]
    assert modes["configured"]["block_mask"] == ["causal, window 2", "bidirectional"]
    assert modes["no sliding window"]["accuracy"] >= modes["configured"]["accuracy"] + ed.CHECK_MIN_GAIN
    assert modes["no sliding window"]["z"] >= ed.CHECK_Z
    assert_warns(d, stdout, stderr, "no sliding window")


def test_check_mask_flags_demo_with_sliding_window_ignored(tmp_path):
    """Regression test; the bug was: run with --sliding-window ignore, the demo drafter (trained with a window of 32 on its sliding layer)
    drafts far worse (accuracy ~0.67 vs ~0.97 at 64 new tokens), but --check-mask cannot see it: mask_variants
    builds every variant with the run's own sliding_window setting, so with 'ignore' no variant ever applies the
    window ('no sliding window' is then just the configured rule again) and no warning is given. The check must
    also try the windowed (training) rule."""
    d, stdout, stderr = mask_check_run(tmp_path, "ignore", "--demo", "--limit", "4", "--max-new-tokens", "64",
                                       "--quiet", "--sliding-window", "ignore")
    assert d["mask_check"]["modes"]["configured"]["block_mask"] == ["bidirectional", "bidirectional"]
    windowed = [t for t in d["mask_check"]["modes"].values() if any("window" in r for r in t["block_mask"])]
    assert windowed, "no mode with the sliding window was tried: " + json.dumps(d["mask_check"]["modes"])
    assert d["mask_check"]["warning"] is not None


@pytest.fixture(scope="module")
def causal_drafter(tmp_path_factory):
    """A drafter trained with causal in-block attention on every layer (is_causal, no sliding layers), block 16:
    the longer block gives the bidirectional mask more unseen keys to disturb it with."""
    from transformers import AutoModelForCausalLM
    out = str(tmp_path_factory.mktemp("causal") / "drafter")
    target = AutoModelForCausalLM.from_pretrained(DEMO_TARGET, dtype=torch.float32).eval()
    with contextlib.redirect_stdout(io.StringIO()):
        md.train_drafter(out, target, md.language(), steps=200, anchors_per_step=48, n_sequences=12, completion=64,
                         is_causal=True, layer_types=["full_attention", "full_attention"], block_size=16)
    return out


PAIRED = ("wins", "losses", "z")   # counted against the configured mode, so they change with it


def unpaired(t):
    return {k: v for k, v in t.items() if k not in PAIRED}


def test_check_mask_causal_drafter(causal_drafter, tmp_path):
    """Auto honours is_causal and gives no warning. Run bidirectional (the wrong mask), the check flags it and
    names 'causal'; its causal mode reproduces the auto run's numbers, and the paired counts mirror each other."""
    common = ["--target", DEMO_TARGET, "--ckpt", f"c={causal_drafter}", "--prompts", DEMO_PROMPTS, "--limit", "4",
              "--max-new-tokens", "64", "--quiet"]
    auto, stdout, stderr = mask_check_run(tmp_path, "auto", *common)
    modes = auto["mask_check"]["modes"]
    assert auto["block_mask"] == modes["configured"]["block_mask"] == ["causal", "causal"]
    assert modes["configured"] == modes["causal"] == modes["no sliding window"]
    assert modes["configured"]["wins"] == modes["configured"]["losses"] == 0
    assert modes["bidirectional"]["block_mask"] == ["bidirectional", "bidirectional"]
    assert modes["configured"]["accuracy"] > 0.5    # it did learn
    assert_no_warning(auto, stdout, stderr)

    bidi, stdout, stderr = mask_check_run(tmp_path, "bidi", *common, "--block-mask", "bidirectional")
    bmodes = bidi["mask_check"]["modes"]
    assert bidi["block_mask"] == ["bidirectional", "bidirectional"]
    assert bmodes["configured"] == bmodes["bidirectional"]
    assert unpaired(bmodes["bidirectional"]) == unpaired(modes["bidirectional"])
    assert unpaired(bmodes["causal"]) == unpaired(modes["causal"])
    assert (bmodes["causal"]["wins"], bmodes["causal"]["losses"]) == \
        (modes["bidirectional"]["losses"], modes["bidirectional"]["wins"])
    drafts = bmodes["causal"]["anchors"] * 15
    assert bmodes["causal"]["accuracy"] - bmodes["configured"]["accuracy"] == \
        pytest.approx((bmodes["causal"]["wins"] - bmodes["causal"]["losses"]) / drafts)
    print(f"\ncausal-trained drafter: accuracy causal {bmodes['causal']['accuracy']:.3f} "
          f"bidirectional {bmodes['bidirectional']['accuracy']:.3f}; wins/losses {bmodes['causal']['wins']}/"
          f"{bmodes['causal']['losses']} z {bmodes['causal']['z']}")
    assert_warns(bidi, stdout, stderr, "causal")


def fake_summary(wins, losses, drafts):
    """mask_check_summary over made-up counts: one prompt; 'causal' wins `wins` drafts from the configured mode
    and loses `losses`."""
    variants = {name: ["bidirectional"] for name in ("configured", "causal")}
    hits = drafts // 2
    counts = {"configured": [hits, drafts, 0, 10, 0, 0],
              "causal": [hits + wins - losses, drafts, 0, 10, wins, losses]}
    return ed.mask_check_summary(variants, [counts])


@pytest.mark.parametrize("wins, losses, drafts, warns", [
    (0, 0, 1000, False),
    (30, 0, 1000, True),        # gain 0.03, z 5.3
    (30, 10, 1000, True),       # gain 0.02, z 3.0: just significant
    (30, 12, 1000, False),      # gain 0.018 but z 2.6: could be noise
    (5, 0, 100, False),         # gain 0.05 but z 1.8: five drafts prove nothing
    (200, 190, 1000, False),    # z 0.46: many flips both ways, no clear winner
    (60, 10, 10000, False),     # z 5.9 but gain 0.005: real, too small to matter
])
def test_mask_check_summary_rule(wins, losses, drafts, warns):
    z = (wins - losses - 1) / (wins + losses) ** 0.5 if wins + losses else 0
    summary = fake_summary(wins, losses, drafts)
    causal = summary["modes"]["causal"]
    assert causal["accuracy"] == pytest.approx(0.5 + (wins - losses) / drafts)
    assert (causal["wins"], causal["losses"]) == (wins, losses) and causal["z"] == pytest.approx(z, abs=0.01)
    if warns:
        assert "'causal'" in summary["warning"] and f"{wins} times" in summary["warning"]
    else:
        assert summary["warning"] is None
