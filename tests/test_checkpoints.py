"""Checkpoint forms, bad inputs, prompt robustness, layer-set notes and "nothing lost" (interrupt, resume).

Everything runs on the bundled demo pair (`--demo`, overridden with `--ckpt` / `--target` / `--prompts`), mostly
in-process through eval_drafter.main; one test starts a real process to send it a real SIGINT. The builders
below are local to this file (conftest.py belongs to another suite).
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import eval_drafter as ed  # noqa: E402

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
DEMO_DRAFTER = os.path.join(DEMO, "drafter")
DEMO_TARGET = os.path.join(DEMO, "target")
DEMO_CONFIG = os.path.join(DEMO_DRAFTER, "config.json")
FAST = ["--demo", "--limit", "2", "--max-new-tokens", "24", "--quiet"]


# ----------------------------------------------------------------------------------------------------
# Local builders


def demo_weights():
    return load_file(os.path.join(DEMO_DRAFTER, "model.safetensors"))


def demo_config():
    with open(DEMO_CONFIG, encoding="utf-8") as f:
        return json.load(f)


def write_config(folder, cfg=None):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(demo_config() if cfg is None else cfg, f, indent=1)


def save_public(folder, weights=None, cfg=None):
    """config.json + model.safetensors, as the public DFlash checkpoints are laid out."""
    folder = str(folder)
    write_config(folder, cfg)
    save_file({k: v.contiguous() for k, v in (demo_weights() if weights is None else weights).items()},
              os.path.join(folder, "model.safetensors"))
    return folder


def save_single(folder, name="drafter.safetensors", with_config=True):
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    if with_config:
        write_config(folder)
    path = os.path.join(folder, name)
    save_file(demo_weights(), path)
    return path


def save_sharded(folder, weights=None, shards=2, drop_shard=None):
    """The tensors split over `shards` files named by model.safetensors.index.json, config.json beside."""
    folder = str(folder)
    write_config(folder)
    weights = demo_weights() if weights is None else weights
    keys = sorted(weights)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in keys[s::shards]}
        weight_map.update(dict.fromkeys(part, name))
        if s != drop_shard:
            save_file(part, os.path.join(folder, name))
    total = sum(v.numel() * v.element_size() for v in weights.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return folder


def save_pt(path, obj, with_config=True):
    """torch.save(obj) to `path`, with the demo config.json beside it when asked."""
    path = str(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if with_config:
        write_config(os.path.dirname(path))
    torch.save(obj, path)
    return path


def write_lines(path, lines):
    """Lines as given: dicts are JSON-encoded, str are written as text, bytes as raw bytes."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            f.write((line.encode("utf-8") if isinstance(line, str) else line) + b"\n")
    return str(path)


def demo_prompt_rows():
    with open(os.path.join(DEMO, "prompts.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class MakesMarker:
    """Unpickling this runs open(marker, "w"): the file appears only if the checkpoint was unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def run_main(argv, capsys):
    try:
        rc = ed.main([str(a) for a in argv])
    except Exception as e:  # noqa: BLE001 - in a real process this is a traceback and exit code 1
        err = capsys.readouterr().err
        pytest.fail(f"main raised {type(e).__name__}: {str(e)[:300]} (a traceback for the user, not an error: "
                    f"line); stderr so far: {err[-500:]!r}")
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_error_line(err, fragment):
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got: {err!r}"
    assert lines[0].startswith("error:"), lines[0]
    assert fragment in lines[0], lines[0]


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def same_results(a, b, also=()):
    """A drafter's report entries without its name, checkpoint path and hash (of weights and config: a config
    inferred from the shapes is not the file's, though it describes the same drafter), and `also`."""
    strip = ("name", "checkpoint", "hash", *also)
    a, b = ({k: v for k, v in d.items() if k not in strip} for d in (a, b))
    assert a == b, {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
    return True


def partial_of(out):
    return str(out) + ".partial.jsonl"


# ----------------------------------------------------------------------------------------------------
# a. Bad inputs: exit 2, one "error:" line, no traceback, an earlier good JSON at --output untouched


@pytest.fixture(scope="module")
def good_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("good") / "out.json"
    assert ed.main(FAST + ["--output", str(out)]) == 0
    assert not os.path.exists(partial_of(out))
    return out.read_bytes()


def _pt_that_runs_code(t):
    marker = t.tmp / "MARKER_unpickled"
    path = save_pt(t.tmp / "evil" / "ckpt.pt", {"model": demo_weights(), "payload": MakesMarker(marker)})

    def post():
        assert not marker.exists(), "the .pt was unpickled: its payload ran"
        torch.load(path, weights_only=False)      # the payload is real: a plain unpickle does run it
        assert marker.exists()

    return {"argv": ["--ckpt", path], "post": post,
            "fragment": "is not a tensors-only torch checkpoint"}


def _resume_with_other_settings(t):
    argv = FAST + ["--output", str(t.out), "--resume"]
    other = [x if x != "24" else "16" for x in argv]  # --max-new-tokens 24 -> 16
    settings = ed.prepare(ed.resolve_settings(ed.parse_args(other)), ranks=False)
    cfg = ed.read_target_config(settings.target)
    facts = [ed.drafter_facts(ed.load_drafter(spec, cfg, settings)) for spec in settings.ckpt]
    header = {"fingerprint": ed.fingerprint({**settings.json(), "target_hash": ed.target_hash(settings.target)}, facts)}
    write_lines(partial_of(t.out), [header])
    return {"argv": argv, "own_argv": True, "fragment": "was written with other settings (--max-new-tokens differ)"}


def _resume_foreign_partial(first_line):
    def build(t):
        write_lines(partial_of(t.out), [first_line, {"item": {}}])
        return {"argv": ["--resume"], "fragment": "is not a partial-results file of this tool"}
    return build


def _prefix_mixture(t):
    # Only layer 1's keys carry the DDP prefix: nothing may be stripped, and the keys then do not match.
    w = {("module." + k if k.startswith("layers.1.") else k): v for k, v in demo_weights().items()}
    return {"argv": ["--ckpt", save_pt(t.tmp / "mixed" / "ckpt.pt", {"model": w})],
            "fragment": "11 missing (layers.1.input_layernorm.weight, layers.1.post_attention_layernorm.weight, "
                        "layers.1.mlp.gate_proj.weight, ...), 11 unexpected (module.layers.1."}


def _nan_target_layer(t):
    target = t.tmp / "nan_target"
    shutil.copytree(DEMO_TARGET, target)
    path = str(target / "model.safetensors")
    w = load_file(path)
    w["model.layers.3.mlp.down_proj.weight"] = torch.full_like(w["model.layers.3.mlp.down_proj.weight"], float("nan"))
    save_file(w, path, metadata={"format": "pt"})
    return {"argv": ["--target", target], "fragment": "prompt train-0: the target's layer 3 output holds NaN or Inf"}


def _weights_with(**changes):
    w = demo_weights()
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            del w[k]
        elif callable(v):
            w[k] = v(w[k])
        else:
            w[k] = v
    return w


def _poison(value, index=(0, 0)):
    def f(t):
        t = t.clone()
        t[index] = value
        return t
    return f


def _case(argv_fn, fragment):
    return lambda t: {"argv": argv_fn(t), "fragment": fragment}


BAD_INPUTS = {
    # -- checkpoint forms
    "pt_that_runs_code": _pt_that_runs_code,
    "pt_not_a_torch_file": _case(lambda t: ["--ckpt", write_lines(t.tmp / "junk.pt", ["not a zip"])],
                                 "is not a tensors-only torch checkpoint"),
    "pt_nested_without_state_dict": _case(
        lambda t: ["--ckpt", save_pt(t.tmp / "opt" / "ckpt.pt", {"step": 3, "optimizer": {"lr": 0.1}})],
        "holds no state dict of tensors (top-level keys: step, optimizer)"),
    "pt_empty_dict": _case(lambda t: ["--ckpt", save_pt(t.tmp / "empty" / "ckpt.pt", {"model": {}})],
                           "the checkpoint holds no tensors"),
    "unknown_extension": _case(lambda t: ["--ckpt", write_lines(t.tmp / "ckpt.npz", ["x"])],
                               "unknown checkpoint form"),
    "dir_without_weights": _case(lambda t: (write_config(t.tmp / "cfg_only"), ["--ckpt", t.tmp / "cfg_only"])[1],
                                 "the directory has no model.safetensors"),
    "unexpected_extra_key": _case(
        lambda t: ["--ckpt", save_public(t.tmp / "extra", _weights_with(extra__bias=torch.zeros(3)))],
        "0 missing (none), 1 unexpected (extra.bias)"),
    "missing_key": _case(
        lambda t: ["--ckpt", save_public(t.tmp / "missing", _weights_with(layers__1__mlp__up_proj__weight=None))],
        "1 missing (layers.1.mlp.up_proj.weight), 0 unexpected (none)"),
    "prefix_mixture": _prefix_mixture,
    "nan_tensor": _case(
        lambda t: ["--ckpt", save_sharded(t.tmp / "nan", _weights_with(
            layers__0__self_attn__k_proj__weight=_poison(float("nan"))))],
        "tensor layers.0.self_attn.k_proj.weight holds NaN or Inf"),
    "inf_tensor": _case(
        lambda t: ["--ckpt", save_public(t.tmp / "inf", _weights_with(hidden_norm__weight=_poison(float("inf"), 5)))],
        "tensor hidden_norm.weight holds NaN or Inf"),
    # finite weights, but norm.weight near float32's max: the logits overflow on the first prompt
    "nan_logits": _case(
        lambda t: ["--ckpt", save_public(t.tmp / "huge", _weights_with(
            norm__weight=lambda v: torch.full_like(v, 3e38)))],
        "its logits on prompt train-0 hold NaN or Inf"),
    "nan_target_layer": _nan_target_layer,
    # -- config for a file checkpoint
    "no_config_no_mask_token_id": _case(
        lambda t: ["--ckpt", save_pt(t.tmp / "bare" / "ckpt.pt", demo_weights(), with_config=False)],
        "no config.json, so the mask token id is unknown; pass --mask-token-id"),
    "heads_do_not_fit": _case(
        lambda t: ["--ckpt", save_pt(t.tmp / "bare" / "ckpt.pt", demo_weights(), with_config=False),
                   "--mask-token-id", "2", "--num-heads", "8"],
        "q/k widths 64/32 do not fit 8/2 heads of 16"),
    "drafter_config_missing_file": _case(
        lambda t: ["--ckpt", save_pt(t.tmp / "bare" / "ckpt.pt", demo_weights(), with_config=False),
                   "--drafter-config", t.tmp / "nope.json"], "--drafter-config file not found"),
    "drafter_config_invalid_json": _case(
        lambda t: ["--ckpt", save_pt(t.tmp / "bare" / "ckpt.pt", demo_weights(), with_config=False),
                   "--drafter-config", write_lines(t.tmp / "bad.json", ['{"hidden_size": 64,'])],
        "bad.json as JSON"),
    # -- layer sets
    "layers_count_differs_from_fc": _case(lambda t: ["--layers", "1,3"],
                                          "fc expects 3 feature layers, --layers gives 2"),
    # -- prompts
    "invalid_utf8_line": _case(
        lambda t: ["--prompts", write_lines(t.tmp / "p.jsonl", [{"prompt": "w1"}, b'{"prompt": "w2 \xff\xfe"}'])],
        "line 2: not valid UTF-8"),
    "invalid_json_line_after_blanks": _case(   # blank lines are skipped but still counted
        lambda t: ["--prompts", write_lines(t.tmp / "p.jsonl", [{"prompt": "w1"}, "", "   ", '{"prompt": "w2"'])],
        "line 4, column 16: not valid JSON (Expecting ',' delimiter)"),
    "control_character_in_json_line": _case(   # json's own message ends in a dangling "at"
        lambda t: ["--prompts", write_lines(t.tmp / "p.jsonl", [{"prompt": "w1"}, '{"prompt": "w1\tw2"}'])],
        "line 2, column 15: not valid JSON (Invalid control character); each line"),
    "json_line_not_an_object": _case(
        lambda t: ["--prompts", write_lines(t.tmp / "p.jsonl", [{"prompt": "w1"}, "[1, 2]"])],
        "line 2: expected a JSON object, got list"),
    "duplicate_ids": _case(
        lambda t: ["--prompts", write_lines(t.tmp / "p.jsonl", [{"id": "a", "prompt": "w1"}, "",
                                                                 {"id": "a", "prompt": "w2"}])],
        "line 3: id 'a' was already used on line 1"),
    # -- resume
    "resume_without_output": lambda t: {"argv": FAST + ["--resume"], "own_argv": True,
                                        "fragment": "--resume needs --output"},
    "resume_with_other_settings": _resume_with_other_settings,
    "resume_foreign_partial": _resume_foreign_partial({"hello": 1}),
    # -- bugs found while writing these tests: each is bad input that ends in a traceback today
    "corrupt_safetensors_file": _case(
        lambda t: ["--ckpt", write_lines(t.tmp / "corrupt.safetensors", ["garbage" * 10])], "corrupt.safetensors"),
    "sharded_index_names_missing_shard": _case(
        lambda t: ["--ckpt", save_sharded(t.tmp / "sharded", drop_shard=1)], "model-00002-of-00002.safetensors"),
    "sharded_index_invalid_json": _case(
        lambda t: ["--ckpt", (save_sharded(t.tmp / "sharded"),
                              write_lines(t.tmp / "sharded" / "model.safetensors.index.json", ["{oops"]))[0]],
        "model.safetensors.index.json"),
    "tensor_shape_differs_from_config": _case(
        lambda t: ["--ckpt", save_public(t.tmp / "shape", _weights_with(
            layers__0__self_attn__q_proj__weight=torch.zeros(32, 64)))],
        "layers.0.self_attn.q_proj.weight"),
    "no_config_and_a_layer0_tensor_missing": _case(
        lambda t: ["--ckpt", save_pt(t.tmp / "bare" / "ckpt.pt",
                                     _weights_with(layers__0__self_attn__k_proj__weight=None), with_config=False),
                   "--mask-token-id", "2"],
        "layers.0.self_attn.k_proj.weight"),
    "drafter_config_not_an_object": _case(
        lambda t: ["--ckpt", save_pt(t.tmp / "bare" / "ckpt.pt", demo_weights(), with_config=False),
                   "--drafter-config", write_lines(t.tmp / "list.json", ["[1, 2]"])],
        "list.json"),
    "resume_partial_first_line_not_json": _resume_foreign_partial("not json"),
}


class _Ctx:
    def __init__(self, tmp, out):
        self.tmp, self.out = tmp, out


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(case, tmp_path, good_json, capsys):
    out = tmp_path / "out.json"
    out.write_bytes(good_json)
    spec = BAD_INPUTS[case](_Ctx(tmp_path, out))
    argv = spec["argv"] if spec.get("own_argv") else FAST + ["--output", out] + spec["argv"]
    partial = partial_of(out)
    partial_before = open(partial, "rb").read() if os.path.exists(partial) else None

    rc, _, err = run_main(argv, capsys)

    assert rc == 2, err
    assert_one_error_line(err, spec["fragment"])
    assert out.read_bytes() == good_json, "the earlier good JSON at --output was changed"
    assert not [n for n in os.listdir(tmp_path) if ".tmp" in n], os.listdir(tmp_path)
    if partial_before is not None:
        assert open(partial, "rb").read() == partial_before, "the partial file was changed by a refused run"
    elif os.path.exists(partial):  # the run failed after it began: what it wrote is whole JSON lines
        with open(partial, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        assert "fingerprint" in rows[0]
    if spec.get("post"):
        spec["post"]()


# ----------------------------------------------------------------------------------------------------
# b. Round trip: the demo weights in every checkpoint form give identical rounds


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forms")
    w = demo_weights()
    return {
        "public": save_public(tmp / "public"),
        "single": save_single(tmp / "single"),
        "sharded": save_sharded(tmp / "sharded"),
        "nested": save_pt(tmp / "nested" / "ckpt.pt", {"step": 3, "model": {"module._orig_mod." + k: v
                                                                           for k, v in w.items()}}),
        "lightning": save_pt(tmp / "lightning" / "last.pth", {"epoch": 1, "optimizer_states": [{"lr": 0.1}],
                                                               "state_dict": {"draft_model." + k: v
                                                                              for k, v in w.items()}}),
        "ddp": save_pt(tmp / "ddp" / "pytorch_model.bin", {"draft_model": {"module": {"module." + k: v
                                                                                     for k, v in w.items()}}}),
        "bare": save_pt(tmp / "bare" / "drafter.pt", w, with_config=False),
    }


ROUND_TRIP_ARGS = ["--demo", "--max-new-tokens", "48", "--threads", "1"]  # all ten prompts, past the window of 32


@pytest.fixture(scope="module")
def round_trip(forms, tmp_path_factory):
    """(report, stderr) of one run over the forms that carry a config (or a nesting) of their own."""
    import contextlib
    import io
    out = tmp_path_factory.mktemp("rt") / "out.json"
    names = ["public", "single", "sharded", "nested", "lightning", "ddp"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        ckpts = [x for n in names for x in ("--ckpt", f"{n}={forms[n]}")]
        rc = ed.main(ROUND_TRIP_ARGS + ["--output", str(out)] + ckpts)
    assert rc == 0, err.getvalue()
    return read_json(out), err.getvalue()


@pytest.mark.parametrize("name", ["single", "sharded", "nested", "lightning", "ddp"])
def test_round_trip_identical(round_trip, name):
    report, _ = round_trip
    by_name = {d["name"]: d for d in report["drafters"]}
    public, other = by_name["public"], by_name[name]
    assert other["hash"] == public["hash"]   # identity by content, whatever the layout
    assert [p["rounds"] for p in other["prompts"]] == [p["rounds"] for p in public["prompts"]]
    assert [p["ddtree_rounds"] for p in other["prompts"]] == [p["ddtree_rounds"] for p in public["prompts"]]
    assert same_results(other, public)


def test_round_trip_is_a_sensitive_comparison(round_trip):
    """The comparison would see a wrong weight: the demo drafter misses somewhere, and the window matters."""
    report, _ = round_trip
    public = next(d for d in report["drafters"] if d["name"] == "public")
    assert public["block_mask"] == ["causal, window 32", "bidirectional"]
    rounds = [r for p in public["prompts"] for r in p["rounds"]]
    assert len(public["prompts"]) == 10 and min(rounds) < 8 and max(rounds) == 8
    assert max(p["prompt_tokens"] + p["completion_tokens"] for p in public["prompts"]) > 32


def test_round_trip_says_which_rules_applied(round_trip):
    _, err = round_trip
    rules = [line for line in err.splitlines() if "to reach the public key layout" in line]
    assert sorted(rules) == sorted([
        "drafter nested: took ['model'], stripped 'module.', stripped '_orig_mod.' to reach the public key layout",
        "drafter lightning: took ['state_dict'], stripped 'draft_model.' to reach the public key layout",
        "drafter ddp: took ['draft_model'], took ['module'], stripped 'module.' to reach the public key layout",
    ])
    assert "inferred" not in err


def test_pt_without_config_with_drafter_config_is_identical(forms, round_trip, tmp_path, capsys):
    out = tmp_path / "out.json"
    rc, _, err = run_main(ROUND_TRIP_ARGS + ["--quiet", "--output", out, "--ckpt", f"bare={forms['bare']}",
                                             "--mask-token-id", "2", "--block-size", "8", "--layers", "1,3,4",
                                             "--drafter-config", DEMO_CONFIG], capsys)
    assert rc == 0, err
    bare = read_json(out)["drafters"][0]
    public = next(d for d in round_trip[0]["drafters"] if d["name"] == "public")
    assert bare["block_mask"] == ["causal, window 32", "bidirectional"]  # the window came back from the file
    assert [p["rounds"] for p in bare["prompts"]] == [p["rounds"] for p in public["prompts"]]
    assert [p["ddtree_rounds"] for p in bare["prompts"]] == [p["ddtree_rounds"] for p in public["prompts"]]
    assert same_results(bare, public)


def test_pt_without_config_inferred_from_shapes(forms, tmp_path, capsys):
    """No config anywhere: shapes + flags + the target's config. Every layer is full attention then, which is
    exactly the demo drafter with its sliding window ignored: both in one run must agree."""
    out = tmp_path / "out.json"
    rc, _, err = run_main(ROUND_TRIP_ARGS + ["--output", out, "--sliding-window", "ignore",
                                             "--ckpt", f"public={forms['public']}", "--ckpt", f"bare={forms['bare']}",
                                             "--mask-token-id", "2", "--block-size", "8", "--layers", "1,3,4"], capsys)
    assert rc == 0, err
    assert "Traceback" not in err
    inferred = [line for line in err.splitlines() if line.startswith("drafter bare: inferred ")]
    assert len(inferred) == 3, err
    assert "hidden 64, 2 layers, intermediate 192, head_dim 16, heads 4/2 kv, attention bias False" in inferred[0]
    assert "rms_norm_eps 1e-06, rope_theta 10000" in inferred[1] and "max positions 512" in inferred[1]
    assert "block size 8 (--block-size), mask token id 2 (--mask-token-id)" in inferred[2]
    assert "all layers full attention" in inferred[2]
    assert not any(line.startswith("drafter public: inferred") for line in err.splitlines())
    public, bare = read_json(out)["drafters"]
    assert bare["block_mask"] == ["bidirectional", "bidirectional"] == public["block_mask"]
    assert [p["rounds"] for p in bare["prompts"]] == [p["rounds"] for p in public["prompts"]]
    # the public drafter's sliding window is what --sliding-window overrides (named, checked, warned); the bare one
    # has no window to override: the same numbers, and that difference alone
    assert list(public["overrides"]) == ["--sliding-window ignore"] and "overrides" not in bare
    assert same_results(bare, public, also=("overrides", "override_check", "warnings"))


def test_inferred_block_size_default_is_said(forms, capsys):
    rc, _, err = run_main(FAST[:-1] + ["--ckpt", f"bare={forms['bare']}", "--mask-token-id", "2",
                                       "--layers", "1,3,4"], capsys)
    assert rc == 0, err
    assert "drafter bare: inferred block size 16 (default), mask token id 2 (--mask-token-id)" in err


# ----------------------------------------------------------------------------------------------------
# d. Prompt robustness on the demo


def test_prompt_robustness(tmp_path, capsys):
    demo = demo_prompt_rows()
    long_completion = [4 + (7 * i) % 60 for i in range(600)]
    rows = [
        {"id": "ok-1", "prompt": demo[0]["prompt"]},
        "",
        "   \t",
        {"id": "long-completion", "prompt": "w1 w2", "completion_ids": long_completion},
        {"id": "long-prompt", "prompt": " ".join(f"w{i % 60}" for i in range(600))},
        "",
        {"id": "empty", "prompt": "w3 w4", "completion_ids": []},
        {"id": "short", "prompt": "w3 w4", "completion_ids": [5, 6, 7]},
        {"id": "ok-2", "prompt": demo[5]["prompt"]},
        "",
    ]
    prompts = write_lines(tmp_path / "p.jsonl", rows)
    out = tmp_path / "out.json"
    rc, _, err = run_main(["--demo", "--prompts", prompts, "--max-new-tokens", "24", "--output", out], capsys)
    assert rc == 0, err
    assert "Traceback" not in err
    report = read_json(out)
    skipped = {s["id"]: s["reason"] for s in report["skipped"]}
    assert list(skipped) == ["long-completion", "long-prompt"]
    assert skipped["long-completion"] == "prompt + completion (602 tokens) exceed the target's 512 positions"
    assert "exceed the target's 512 positions" in skipped["long-prompt"]
    warnings = [line for line in err.splitlines() if line.startswith("warning: skipped 2 prompts")]
    assert len(warnings) == 1, err
    d = report["drafters"][0]
    by_id = {p["id"]: p for p in d["prompts"]}
    assert list(by_id) == ["ok-1", "empty", "short", "ok-2"]
    for pid in ("ok-1", "ok-2"):
        assert by_id[pid]["rounds"] and "note" not in by_id[pid]
    for pid, n in (("empty", 0), ("short", 3)):
        p = by_id[pid]
        assert p["rounds"] == [] and p["tau"] is None and p["completion_tokens"] == n
        assert p["ddtree_rounds"] and all(v == [] for v in p["ddtree_rounds"].values())
        assert f"completion of {n} tokens" in p["note"] and "nothing to score" in p["note"]
    assert d["rounds"] == len(by_id["ok-1"]["rounds"]) + len(by_id["ok-2"]["rounds"])


def test_every_prompt_skipped_still_reports(tmp_path, capsys):
    prompts = write_lines(tmp_path / "p.jsonl", [{"id": "long", "prompt": "w1 w2",
                                                  "completion_ids": [5] * 600}])
    out = tmp_path / "out.json"
    rc, _, err = run_main(["--demo", "--prompts", prompts, "--output", out], capsys)
    assert rc == 0, err
    report = read_json(out)
    assert [s["id"] for s in report["skipped"]] == ["long"]
    assert report["drafters"][0]["prompts"] == [] and report["drafters"][0]["tau"] is None


def test_note_for_a_completion_of_block_minus_one_tokens(tmp_path, capsys):
    """7 tokens with block 8: no round fits (the anchor and its 7 drafts need 8), and the note states that limit."""
    prompts = write_lines(tmp_path / "p.jsonl", [
        {"id": "seven", "prompt": "w1 w2", "completion_ids": list(range(5, 12))},
        {"id": "eight", "prompt": "w1 w2", "completion_ids": list(range(5, 13))}])
    out = tmp_path / "out.json"
    rc, _, err = run_main(["--demo", "--prompts", prompts, "--output", out, "--quiet"], capsys)
    assert rc == 0, err
    seven, eight = read_json(out)["drafters"][0]["prompts"]
    assert eight["rounds"] and "note" not in eight
    assert seven["rounds"] == []
    found = re.search(r"completion of (\d+) tokens is shorter than one block \((\d+) tokens", seven["note"])
    n, limit = map(int, found.groups())
    assert n < limit, seven["note"]


# ----------------------------------------------------------------------------------------------------
# e. Layer-set notes


def test_layers_flag_wins_over_config_with_a_note(tmp_path, capsys):
    out = tmp_path / "out.json"
    rc, _, err = run_main(["--demo", "--limit", "1", "--max-new-tokens", "16", "--layers", "0,2,4",
                           "--output", out], capsys)
    assert rc == 0, err
    notes = [line for line in err.splitlines() if "overrides" in line and not line.startswith("warning:")]
    assert len(notes) == 1 and notes[0].endswith("; --layers [0, 2, 4] (overrides the checkpoint's [1, 3, 4])")
    assert read_json(out)["drafters"][0]["layers"] == [0, 2, 4]


def test_layers_flag_equal_to_config_says_nothing(capsys):
    rc, _, err = run_main(["--demo", "--limit", "1", "--max-new-tokens", "16", "--layers", "1,3,4"], capsys)
    assert rc == 0, err
    assert "overrides" not in err and "default rule" not in err


def test_config_without_layer_ids_uses_public_rule_with_a_note(tmp_path, capsys):
    cfg = demo_config()
    del cfg["dflash_config"]["target_layer_ids"]
    ckpt = save_public(tmp_path / "noids", cfg=cfg)
    out = tmp_path / "out.json"
    rc, _, err = run_main(["--demo", "--limit", "1", "--max-new-tokens", "16", "--ckpt", f"noids={ckpt}",
                           "--output", out], capsys)
    assert rc == 0, err
    # The public rule: k ids evenly spaced over 1..N-3; k = 3 (fc width / hidden), N = 6 -> 1, 2, 3.
    notes = [line for line in err.splitlines() if "no target_layer_ids" in line]
    assert notes == ["drafter noids: no target_layer_ids in its config; using [1, 2, 3] (public default rule for 3 "
                     "layers of a 6-layer target)"]
    assert read_json(out)["drafters"][0]["layers"] == [1, 2, 3]


# ----------------------------------------------------------------------------------------------------
# c. Nothing lost: a real SIGINT to a running process, an in-process SIGTERM, and --resume after each

N_MANY = 32


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """32 demo-style prompts with 200-token references given as ids (no generation phase, so the per-prompt
    stream starts at once), and the report of an uninterrupted run over them."""
    tmp = tmp_path_factory.mktemp("many")
    demo = demo_prompt_rows()
    rows = []
    for i in range(N_MANY):
        rng = random.Random(i)
        rows.append({"id": f"p{i:02d}", "split": demo[i % 10]["split"], "prompt": demo[i % 10]["prompt"],
                     "completion_ids": [rng.randrange(4, 64) for _ in range(200)]})
    prompts = write_lines(tmp / "many.jsonl", rows)
    argv = ["--demo", "--prompts", prompts, "--threads", "1", "--quiet"]
    base = tmp / "base.json"
    assert ed.main(argv + ["--output", str(base)]) == 0
    return {"argv": argv, "base": read_json(base)}


def count_records(partial):
    """Complete lines after the header."""
    with open(partial, "rb") as f:
        return f.read().count(b"\n") - 1


def resume_and_check(many, out, finished, monkeypatch, capsys):
    """--resume evaluates only the unfinished prompts and ends with the uninterrupted run's drafters."""
    called = []
    evaluate_prompts = ed.evaluate_prompts

    def counting(group, *args, **kwargs):
        called.extend(it.id for it, _, _ in group)
        return evaluate_prompts(group, *args, **kwargs)

    monkeypatch.setattr(ed, "evaluate_prompts", counting)
    argv = [a for a in many["argv"] if a != "--quiet"]  # quiet is no setting of the results: resume accepts it
    rc, _, err = run_main(argv + ["--output", out, "--resume"], capsys)
    assert rc == 0, err
    assert f"resuming: {len(finished)} prompts already finished" in err
    assert " 0 more references" not in err   # a count of nothing is not said
    assert called == [f"p{i:02d}" for i in range(N_MANY) if f"p{i:02d}" not in finished]
    final = read_json(out)
    assert "interrupted" not in final
    assert final["drafters"] == many["base"]["drafters"]
    assert final["skipped"] == many["base"]["skipped"] == []
    assert not os.path.exists(partial_of(out)), "the partial file outlived a complete run"
    assert not [n for n in os.listdir(os.path.dirname(out)) if ".tmp" in n]


def check_interrupted_report(out):
    report = read_json(out)
    assert report["interrupted"] is True
    prompts = report["drafters"][0]["prompts"]
    with open(partial_of(out), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    assert "fingerprint" in lines[0]
    in_partial = [row["item"]["id"] for row in lines[1:]]
    # Every prompt in the partial file is in the report (the report may hold one more, finished as the signal came).
    assert set(in_partial) <= {p["id"] for p in prompts} and len(prompts) - len(in_partial) in (0, 1)
    assert [p["id"] for p in prompts] == [f"p{i:02d}" for i in range(len(prompts))]
    return report, set(in_partial)


def test_sigint_keeps_finished_prompts_and_resume_completes(many, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out.json"
    partial = partial_of(out)
    # A suite started in the background by a script inherits SIGINT ignored, and so would the child: give it
    # the default disposition, which Python turns into KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "eval_drafter.py")] + many["argv"] +
                            ["--output", str(out)], cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        while not (os.path.exists(partial) and count_records(partial) >= 2):
            assert proc.poll() is None, f"the run ended before it could be interrupted: {proc.communicate()}"
            assert time.time() < deadline, "no prompt finished within 120 s"
            time.sleep(0.005)
        seen = count_records(partial)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    report, finished = check_interrupted_report(out)
    n = len(report["drafters"][0]["prompts"])
    assert seen <= n < N_MANY
    assert f"interrupted: reporting the {n} prompts finished so far" in err
    # What the report holds of each finished prompt is what the uninterrupted run says of it.
    base = {p["id"]: p for p in many["base"]["drafters"][0]["prompts"]}
    for p in report["drafters"][0]["prompts"]:
        assert p == base[p["id"]]
    resume_and_check(many, str(out), finished, monkeypatch, capsys)


def test_sigterm_keeps_finished_prompts_and_resume_completes(many, tmp_path, monkeypatch, capsys):
    """A real SIGTERM to this process, sent as the 4th prompt starts; a guard handler stands in for the default
    one (which would end pytest) in case the tool did not install its own."""
    out = str(tmp_path / "out.json")
    started = []
    evaluate_prompts = ed.evaluate_prompts

    def signalling(group, *args, **kwargs):
        started.extend(it.id for it, _, _ in group)
        if len(started) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the tool's handler raises here
        return evaluate_prompts(group, *args, **kwargs)

    class NoHandler(Exception):
        pass

    def guard(signum, frame):
        raise NoHandler("eval_drafter did not handle SIGTERM")

    previous = signal.signal(signal.SIGTERM, guard)
    try:
        monkeypatch.setattr(ed, "evaluate_prompts", signalling)
        rc, _, err = run_main(many["argv"] + ["--output", out], capsys)
        assert signal.getsignal(signal.SIGTERM) is guard, "the tool did not restore the previous SIGTERM handler"
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.undo()
    assert rc == 130, err
    assert "interrupted: reporting the 3 prompts finished so far" in err
    report, finished = check_interrupted_report(out)
    assert finished == {"p00", "p01", "p02"} and len(report["drafters"][0]["prompts"]) == 3
    resume_and_check(many, out, finished, monkeypatch, capsys)


def test_complete_run_replaces_output_atomically_and_removes_partial(tmp_path, good_json, monkeypatch, capsys):
    out = tmp_path / "out.json"
    out.write_bytes(b'{\n "config": {"old": true}}')   # an earlier report: the one file --output may replace
    seen = []
    replace = os.replace

    def spy(src, dst):
        seen.append((os.path.basename(src), os.path.basename(dst), os.path.exists(partial_of(out))))
        return replace(src, dst)

    monkeypatch.setattr(ed.os, "replace", spy)
    rc, _, err = run_main(FAST + ["--output", out], capsys)
    assert rc == 0, err
    assert len(seen) == 1 and seen[0][1] == "out.json" and seen[0][0].startswith("out.json.tmp")
    assert seen[0][2], "the partial file should live until the final JSON is in place"
    assert not os.path.exists(partial_of(out))
    assert json.loads(out.read_bytes())["drafters"] == json.loads(good_json)["drafters"]


def test_resume_without_partial_file_starts_over(tmp_path, good_json, capsys):
    out = tmp_path / "out.json"
    rc, _, err = run_main(FAST[:-1] + ["--output", out, "--resume"], capsys)
    assert rc == 0, err
    assert f"note: --resume found no {partial_of(out)}; starting from the first prompt" in err
    assert read_json(out)["drafters"] == json.loads(good_json)["drafters"]
    assert not os.path.exists(partial_of(out))
