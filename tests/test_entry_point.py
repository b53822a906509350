"""The Python entry point: load_features() and measure() give what the CLI's --load-hidden JSON gives a drafter.

A training loop calls measure() on its live drafter module every N steps, so besides equal figures it must leave
the caller's process as it was: the module's training mode, requires_grad, .grad and weights, torch's thread
count, the SIGINT / SIGTERM handlers, and the files on disk (it writes nothing). Every expected value here comes
from an independent run of the CLI on a checkpoint saved from the same tensors.
"""
import json
import os
import signal
import tempfile

import pytest
import torch
from safetensors.torch import load_file, save_file

import eval_drafter as ed

TARGET = os.path.join(ed.DEMO_DIR, "target")
DRAFTER = os.path.join(ed.DEMO_DIR, "drafter")
EXTRACT = ["--demo", "--limit", "4", "--max-new-tokens", "64", "--quiet"]
WHERE = ("name", "checkpoint", "hash", "weights_hash")   # where the drafter came from, not what it measured


def figures(d):
    """A drafters[] entry without its name, checkpoint and hash."""
    return {k: v for k, v in d.items() if k not in WHERE}


def demo_config():
    with open(os.path.join(DRAFTER, "config.json")) as f:
        return json.load(f)


def cli(hidden, ckpt, out, *flags):
    """The CLI's --load-hidden run of one checkpoint directory: its drafters[0]."""
    assert ed.main(["--target", TARGET, "--ckpt", f"d={ckpt}", "--load-hidden", str(hidden), "--quiet",
                    "--output", str(out), *flags]) == 0
    with open(out) as f:
        return json.load(f)["drafters"][0]


def save_checkpoint(folder, config, state):
    """config.json + model.safetensors of a state dict (copies: the caller's tensors are not shared)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Features of 4 demo prompts saved once (--save-hidden), and the CLI's report of the demo drafter from them."""
    folder = tmp_path_factory.mktemp("features")
    hidden = folder / "h.safetensors"
    assert ed.main([*EXTRACT, "--save-hidden", str(hidden), "--output", str(folder / "x.json")]) == 0
    return {"hidden": str(hidden), "folder": folder, "demo": cli(hidden, DRAFTER, folder / "demo.json")}


@pytest.fixture(scope="module")
def features(saved):
    return ed.load_features(saved["hidden"], TARGET)


class Node(torch.nn.Module):
    """An empty module that holds what is put in it."""


def module_from(state, config):
    """A training-like nn.Module: every tensor of `state` a Parameter at its dotted name (nested submodules), with
    .config set, as a training script's drafter holds them."""
    root = Node()
    for key, value in state.items():
        *path, leaf = key.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, Node())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(value.clone()))
    root.config = config
    return root


def snapshot(module):
    """What measure() must leave alone: training flags of every submodule, and each parameter's requires_grad,
    .grad and weights (clones)."""
    return ({n: m.training for n, m in module.named_modules()},
            {n: (p.requires_grad, None if p.grad is None else p.grad.clone(), p.detach().clone())
             for n, p in module.named_parameters()})


def assert_untouched(module, before):
    flags, params = snapshot(module)
    assert flags == before[0]
    assert params.keys() == before[1].keys()
    for name, (requires_grad, grad, weight) in before[1].items():
        now = params[name]
        assert now[0] == requires_grad, name
        assert (now[1] is None) == (grad is None) and (grad is None or torch.equal(now[1], grad)), name
        assert torch.equal(now[2], weight), name


def test_measure_equals_the_cli_report(saved, features):
    """measure() on the demo drafter's state dict and config gives the CLI's drafters[0] on every key (the
    per-prompt entries included) but name, checkpoint and hash; the caller's state dict keeps all its keys."""
    state = load_file(os.path.join(DRAFTER, "model.safetensors"))
    keys = sorted(state)
    got = ed.measure(state, features, config=demo_config(), name="demo")
    assert figures(got) == figures(saved["demo"])
    assert got["prompts"] and got["tau"] is not None
    assert sorted(state) == keys


def test_measure_in_a_training_loop(saved, features, tmp_path, monkeypatch, capsys):
    """Called twice on a live module whose weights change between the calls (train() mode, then eval() mode),
    each result equals the CLI on a checkpoint saved from the module at that moment, the two differ, and each call
    leaves training flags, requires_grad, .grad, weights, torch's thread count, the SIGINT / SIGTERM handlers and
    the disk (cwd, temp dir, the features' folder) as they were, and prints nothing."""
    config = demo_config()
    module = module_from(load_file(os.path.join(DRAFTER, "model.safetensors")), config)
    params = dict(module.named_parameters())
    params["norm.weight"].requires_grad_(False)   # a frozen one stays frozen
    loss = sum((p ** 2).sum() for n, p in params.items() if n.startswith("layers.0.") or n == "fc.weight")
    loss.backward()   # .grad on some params, None on others
    assert params["fc.weight"].grad is not None and params["layers.1.mlp.up_proj.weight"].grad is None

    empty = tmp_path / "cwd"
    empty.mkdir()
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.chdir(empty)
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    beside_features = sorted(os.listdir(saved["folder"]))

    def on_signal(signum, frame):   # a training script's own handlers
        pass

    threads = torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    results = []
    capsys.readouterr()
    try:
        torch.set_num_threads(3)
        for s in handlers:
            signal.signal(s, on_signal)
        for mode in ("train", "eval"):
            getattr(module, mode)()
            if mode == "eval":   # a training step between the calls: weights changed in place
                with torch.no_grad():
                    for n, p in params.items():
                        if n.endswith("mlp.down_proj.weight"):
                            p.mul_(-0.7)
            before = snapshot(module)
            got = ed.measure(module, features, name="live")
            assert_untouched(module, before)
            assert torch.get_num_threads() == 3
            assert all(signal.getsignal(s) is on_signal for s in handlers)
            assert os.listdir(empty) == [] and os.listdir(temp) == []
            assert sorted(os.listdir(saved["folder"])) == beside_features
            assert capsys.readouterr() == ("", "")   # nothing printed either
            results.append((got, save_checkpoint(tmp_path / f"ckpt_{mode}", config, module.state_dict())))
    finally:
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            signal.signal(s, h)
    for i, (got, ckpt) in enumerate(results):
        want = cli(saved["hidden"], ckpt, tmp_path / f"cli_{i}.json")
        assert figures(got) == figures(want)
        assert got["name"] == "live"
    assert results[0][0]["tau"] != results[1][0]["tau"]   # the change is seen: the equality above means something


def test_options_pass_through(saved, features, tmp_path):
    """Keyword options are the CLI's flags: load_features(depths="3,5", ddtree_budgets="none") then measure() gives
    the CLI's report with --depths 3,5 --ddtree-budgets none (served depths 3 and 5, no DDTree figures), unlike the
    default features; measure() given the features' path, target= and the options reads them itself, the same."""
    state, config = load_file(os.path.join(DRAFTER, "model.safetensors")), demo_config()
    options = {"depths": "3,5", "ddtree_budgets": "none"}
    want = cli(saved["hidden"], DRAFTER, tmp_path / "depths.json", "--depths", "3,5", "--ddtree-budgets", "none")
    loaded = ed.measure(state, ed.load_features(saved["hidden"], TARGET, **options), config=config)
    assert figures(loaded) == figures(want)
    assert {"3", "5"} <= set(loaded["depths"]) and not loaded["ddtree"]
    default = ed.measure(state, features, config=config)
    assert (default.get("depths"), default.get("ddtree")) != (loaded["depths"], loaded["ddtree"])
    by_path = ed.measure(state, saved["hidden"], target=TARGET, config=os.path.join(DRAFTER, "config.json"), **options)
    assert by_path == loaded


def test_bad_input_raises_usage_error(saved, features):
    """Bad input raises UsageError with a message, never runs: a state dict without fc.weight, an unknown option,
    a refused option value, and options given beside already loaded features."""
    state, config = load_file(os.path.join(DRAFTER, "model.safetensors")), demo_config()
    broken = {k: v for k, v in state.items() if k != "fc.weight"}
    with pytest.raises(ed.UsageError) as e:
        ed.measure(broken, features, config=config)
    assert "fc.weight" in str(e.value)
    with pytest.raises(ed.UsageError) as e:
        ed.load_features(saved["hidden"], TARGET, no_such_option=3)
    assert "no_such_option" in str(e.value)
    with pytest.raises(ed.UsageError) as e:
        ed.measure(state, saved["hidden"], target=TARGET, config=config, depths="three")
    assert str(e.value)
    with pytest.raises(ed.UsageError) as e:
        ed.measure(state, features, config=config, depths="3,5")
    assert "load_features" in str(e.value)


def test_step_names_the_series(features):
    """measure(name="run", step=400) labels the figures as the CLI labels a run directory's step: step 400 of the
    series "run" (the series a --plot or --tensorboard of these figures groups the steps under)."""
    state = load_file(os.path.join(DRAFTER, "model.safetensors"))
    got = ed.measure(state, features, config=demo_config(), name="run", step=400)
    assert got["step"] == 400
    assert got["series"] == "run"


def specforge_auto():
    """SpecForge 0.2.0's model registry; skipped where it does not import unless CI requires it."""
    if os.environ.get("EVAL_DRAFTER_REQUIRE_SPECFORGE"):   # CI: the reference must be there, not skipped
        import specforge.modeling.auto as draft
        return draft
    return pytest.importorskip("specforge.modeling.auto",
                               reason="specforge 0.2.0 does not import here: pip install --no-deps specforge==0.2.0")


def test_measure_a_specforge_dflash_module(saved, features, tmp_path):
    """measure() on SpecForge's own DFlashDraftModel instance (its .config, a transformers config, read for the
    drafter's settings) equals the CLI on the module's saved state, and leaves the module in train() mode."""
    draft = specforge_auto()
    model = draft.AutoDraftModel.from_config(draft.AutoDraftModelConfig.from_file(os.path.join(DRAFTER, "config.json")),
                                             torch_dtype=torch.float32)
    with torch.no_grad():   # weights of its own: the demo's, perturbed, so nothing is read from the fixture
        model.load_state_dict(load_file(os.path.join(DRAFTER, "model.safetensors")))
        for layer in model.layers:
            layer.mlp.down_proj.weight.mul_(-0.7)
    model.train()
    got = ed.measure(model, features, name="sf")
    assert model.training
    want = cli(saved["hidden"], save_checkpoint(tmp_path / "sf", demo_config(), model.state_dict()),
               tmp_path / "sf.json")
    assert figures(got) == figures(want)
    assert figures(got) != figures(saved["demo"])


def test_ctrl_c_inside_measure_reaches_the_loop_and_loses_nothing(saved, features, monkeypatch):
    """Ctrl-C in the middle of a measure() call (the drafter pass of the 2nd prompt) is the training loop's: the
    KeyboardInterrupt reaches the caller, not swallowed into a report, and the loaded features stay whole: the next
    call gives the CLI's numbers."""
    from conftest import interrupt_at
    state = load_file(os.path.join(DRAFTER, "model.safetensors"))
    real, calls = interrupt_at(monkeypatch, "draft_all_anchors", 2)
    with pytest.raises(KeyboardInterrupt):
        ed.measure(state, features, config=demo_config())
    assert len(calls) == 2
    monkeypatch.setattr(ed, "draft_all_anchors", real)
    assert figures(ed.measure(state, features, config=demo_config())) == figures(saved["demo"])


def test_measure_takes_a_checkpoint_path_or_refuses_in_one_line(saved, features):
    """Issue 52: measure("tests/fixtures/demo/drafter", f) raised a ValueError from dict(); a path (str or Path) is
    read as --ckpt reads it and gives the CLI's figures; a value of no drafter kind is one UsageError line."""
    import pathlib
    for path in (DRAFTER, pathlib.Path(DRAFTER)):
        assert figures(ed.measure(path, features, name="demo")) == figures(saved["demo"])
    for bad in (3, ["w"]):
        with pytest.raises(ed.UsageError) as caught:
            ed.measure(bad, features)
        assert "\n" not in str(caught.value) and "drafter" in str(caught.value)
