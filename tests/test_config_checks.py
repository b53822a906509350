"""Configs are checked, not trusted: a drafter's or target's config value of the wrong kind, a layer_types list that
does not fit the layers, a flag past what the drafter was trained for and a damaged target checkpoint are each one
line and exit 2; the defaults that change the numbers are named on the drafter's load line.

Every case starts from a bundled fixture copied to tmp_path with its config.json edited (`edited`)."""
import json
import os
import shutil

import pytest

import eval_drafter as ed
from conftest import ROOT, refused_in_one_line

DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
SPECULATORS = os.path.join(ROOT, "tests", "fixtures", "speculators", "dflash")
EAGLE3 = os.path.join(ROOT, "tests", "fixtures", "families", "eagle3")


def edited(src, dst, **edits):
    """A copy of the checkpoint directory `src` whose config.json has `edits` applied: a key "a__b" is b in the nest
    a; a value of ... removes the key."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key, value in edits.items():
        *nests, last = key.split("__")
        where = cfg
        for nest in nests:
            where = where[nest]
        if value is ...:
            where.pop(last, None)
        else:
            where[last] = value
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(dst)


def argv(target=None, ckpt=None, *more):
    return ["--target", target or os.path.join(DEMO, "target"), "--ckpt", ckpt or os.path.join(DEMO, "drafter"),
            "--prompts", os.path.join(DEMO, "prompts.jsonl"), "--limit", "1", "--max-new-tokens", "8", *more]


def drafter(tmp_path, src=os.path.join(DEMO, "drafter"), **edits):
    return edited(src, tmp_path / "drafter", **edits)


def load_lines(capsys, *args):
    """The stderr lines of a successful run (not quiet: the load lines are logged)."""
    assert ed.main(argv(*args)) == 0
    return capsys.readouterr().err.splitlines()


# ----------------------------------------------------------------------------------------------------
# layer_types and sliding_window


def test_short_layer_types_is_refused(tmp_path, capsys):
    """The demo drafter has 2 layers: one listed type would silently run one layer (tau 2.51 for the right 6.43)."""
    refused_in_one_line(capsys, argv(None, drafter(tmp_path, layer_types=["sliding_attention"])),
                        "layer_types has 1 entry for its 2 layers")


def test_long_layer_types_is_refused(tmp_path, capsys):
    refused_in_one_line(capsys, argv(None, drafter(tmp_path, layer_types=["full_attention"] * 3)),
                        "layer_types has 3 entries for its 2 layers")


def test_unknown_layer_type_is_refused(tmp_path, capsys):
    """An unknown type used to run as full attention; the refusal names it and the known ones."""
    refused_in_one_line(capsys, argv(None, drafter(tmp_path, layer_types=["sliding_attention", "linear_attention"])),
                        '"linear_attention" for layer 1, a type this tool does not run; it knows full_attention, '
                        "sliding_attention")


def test_negative_sliding_window_is_refused(tmp_path, capsys):
    """-1 was taken as a window (tau 1.00), and the wrong-drafter warning then blamed the target."""
    refused_in_one_line(capsys, argv(None, drafter(tmp_path, sliding_window=-1)),
                        "config.json: sliding_window is -1; expected an integer >= 1 (or null)")


def test_null_sliding_window_is_accepted(tmp_path, capsys):
    """null means no window: no layer is windowed."""
    lines = load_lines(capsys, None, drafter(tmp_path, sliding_window=None, use_sliding_window=False))
    assert any("in-block mask per layer: bidirectional, bidirectional" in line for line in lines), lines


# ----------------------------------------------------------------------------------------------------
# values of the wrong kind: one line naming the file, the key, the value with its type and what was expected


@pytest.mark.parametrize("key,value,fragment", [
    ("hidden_size", "64", 'hidden_size is "64" (a string); expected an integer >= 1'),
    ("dflash_config__target_layer_ids", "1,3,4",
     'dflash_config.target_layer_ids is "1,3,4" (a string); expected a list of integers >= 0'),
    ("dflash_config__target_layer_ids", [1, "3", 4], 'dflash_config.target_layer_ids[1] is "3" (a string)'),
    ("dflash_config__target_layer_ids", [1, -3, 4], "dflash_config.target_layer_ids[1] is -3; expected an integer "
     ">= 0"),
    ("rope_theta", "1e4", 'rope_theta is "1e4" (a string); expected a number > 0'),
    ("rms_norm_eps", "x", 'rms_norm_eps is "x" (a string); expected a number > 0'),
    ("num_hidden_layers", True, "num_hidden_layers is true (a boolean); expected an integer >= 1"),
    ("intermediate_size", 192.0, "intermediate_size is 192.0 (a float); expected an integer >= 1"),
    ("block_size", "4444444444444444", 'block_size is "4444444444444444" (a string)'),
    ("attention_bias", "false", 'attention_bias is "false" (a string); expected true or false'),
    ("dflash_config__mask_token_id", -2, "dflash_config.mask_token_id is -2; expected an integer >= 0"),
])
def test_drafter_config_value_of_the_wrong_kind(tmp_path, capsys, key, value, fragment):
    path = drafter(tmp_path, **{key: value})
    refused_in_one_line(capsys, argv(None, path), f"{os.path.join(path, 'config.json')}: {fragment}")


def test_drafter_config_flag_file_is_checked(tmp_path, capsys):
    """--drafter-config FILE (for a checkpoint file without a config beside it) is checked alike, naming FILE."""
    cfg = drafter(tmp_path, hidden_size="64")
    os.makedirs(tmp_path / "bare")
    weights = shutil.copy(os.path.join(DEMO, "drafter", "model.safetensors"), tmp_path / "bare" / "demo.safetensors")
    refused_in_one_line(capsys, argv(None, str(weights), "--drafter-config", os.path.join(cfg, "config.json")),
                        f"{os.path.join(cfg, 'config.json')}: hidden_size is \"64\" (a string)")


def test_speculators_nested_layer_config_is_checked(tmp_path, capsys):
    path = drafter(tmp_path, SPECULATORS, transformer_layer_config__hidden_size="64")
    refused_in_one_line(capsys, argv(None, path), 'transformer_layer_config.hidden_size is "64" (a string)')


def test_eagle3_layer_ids_are_checked(tmp_path, capsys):
    path = drafter(tmp_path, EAGLE3, eagle_aux_hidden_state_layer_ids="2,4,5")
    refused_in_one_line(capsys, argv(None, path), 'eagle_aux_hidden_state_layer_ids is "2,4,5" (a string); '
                                                  "expected a list of integers >= 0")


@pytest.mark.parametrize("key,value,fragment", [
    ("hidden_size", "64", 'hidden_size is "64" (a string); expected an integer >= 1'),
    ("rope_parameters__rope_theta", "1e4", 'rope_parameters.rope_theta is "1e4" (a string)'),
    ("tie_word_embeddings", "no", 'tie_word_embeddings is "no" (a string); expected true or false'),
])
def test_target_config_value_of_the_wrong_kind(tmp_path, capsys, key, value, fragment):
    target = edited(os.path.join(DEMO, "target"), tmp_path / "target", **{key: value})
    refused_in_one_line(capsys, argv(target), f"{os.path.join(target, 'config.json')}: {fragment}")


def test_config_checker_passes_every_bundled_fixture():
    """No bundled drafter or target config (all layouts) is refused: the table matches what real configs hold."""
    fixtures = os.path.join(ROOT, "tests", "fixtures")
    checked = 0
    for here, _, files in os.walk(fixtures):
        if "config.json" in files:
            with open(os.path.join(here, "config.json")) as f:
                ed.check_config(json.load(f), here)
            checked += 1
    assert checked >= 10


# ----------------------------------------------------------------------------------------------------
# defaults that change the numbers, named on the load line


def test_missing_block_size_is_named_a_default(tmp_path, capsys):
    lines = load_lines(capsys, None, drafter(tmp_path, block_size=...))
    assert any("block 16 (default: the config has no block_size), layers [1, 3, 4]," in line for line in lines), lines


def test_missing_layer_ids_and_rope_theta_are_named_defaults(tmp_path, capsys):
    lines = load_lines(capsys, None, drafter(tmp_path, dflash_config__target_layer_ids=..., rope_theta=...))
    line = next(line for line in lines if "in-block mask per layer" in line)
    assert "layers [1, 2, 3] (the public default rule: the config lacks target_layer_ids)" in line, line
    assert line.endswith("; rope_theta 10000.0 (default: the config has none)"), line


def test_a_full_config_names_no_default(capsys):
    line = next(line for line in load_lines(capsys) if "in-block mask per layer" in line)
    assert "default" not in line, line


def test_missing_mask_token_id_is_named(tmp_path, capsys):
    refused_in_one_line(capsys, argv(None, drafter(tmp_path, dflash_config__mask_token_id=...)),
                        "its config has no mask_token_id (dflash_config.mask_token_id); pass --mask-token-id")


# ----------------------------------------------------------------------------------------------------
# flags past what the drafter or target allows


def test_block_size_above_the_trained_block_is_refused(capsys):
    """A block-8 drafter run with --block-size 32 drafted 31 untrained positions without a word (tau 10.41)."""
    refused_in_one_line(capsys, argv(None, None, "--block-size", "32"),
                        "--block-size 32: drafter demo/drafter was trained with block 8; a block cannot exceed")


def test_block_size_within_the_trained_block_runs(capsys):
    line = next(line for line in load_lines(capsys, None, None, "--block-size", "4") if "in-block mask" in line)
    assert "block 4, layers [1, 3, 4]" in line, line


def test_max_new_tokens_past_the_positions_is_noted_once(tmp_path, capsys):
    """The demo target has 512 positions; two prompts both capped: one note, with the cap."""
    target = edited(os.path.join(DEMO, "target"), tmp_path / "target", max_position_embeddings=40)
    args = argv(target) + ["--limit", "2", "--max-new-tokens", "1000000000"]
    assert ed.main(args) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "--max-new-tokens" in line]
    assert notes == ["note: --max-new-tokens 1000000000 runs past the target's 40 positions "
                     "(max_position_embeddings): a reference stops where prompt + completion reach 40 tokens"], notes


# ----------------------------------------------------------------------------------------------------
# a damaged target checkpoint


def truncated_target(tmp_path):
    target = edited(os.path.join(DEMO, "target"), tmp_path / "target")
    weights = os.path.join(target, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    return target, weights


def test_truncated_target_safetensors_is_one_line(tmp_path, capsys):
    target, weights = truncated_target(tmp_path)
    refused_in_one_line(capsys, argv(target), f"{weights} is not a readable safetensors file")


def test_truncated_target_is_refused_wherever_first_read(tmp_path):
    """Each reader of the target's tensors names the file: the hash, the embedding/head read, the model load."""
    target, weights = truncated_target(tmp_path)
    settings = ed.Settings(target=target, dtype="float32", device="cpu", quiet=True)
    for read in (lambda: ed.target_hash(target), lambda: ed.read_embed_head(target, None, settings),
                 lambda: ed.target_tensors({"lm_head.weight": weights}, ["lm_head.weight"]),
                 lambda: ed.load_target(settings)):
        with pytest.raises(ed.UsageError, match="model.safetensors"):
            read()
