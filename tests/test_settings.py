"""Settings is a declared record (issue 58): its fields are the flag table's plus the resolved ones, it is read as
attributes and never written, and the report's config is derived from its fields.

- every flag of FLAGS is a field whose default is argparse's; a name that is no field is an error, not None;
- a run's JSON config holds exactly the fields (under the flags' names), in their declared order, and reads back
  into equal settings (from_json), so a new field reaches the JSON without being listed anywhere else;
- resolving does not build or convert (the prompts' hash, --bench's prompts, a GGUF's directory are prepare's), and
  a field added to the class reaches a run's config.
"""
import dataclasses
import json
import os

import pytest

import eval_drafter as ed
from conftest import ROOT

DEMO = ["--demo", "--quiet"]


def test_every_flag_is_a_field_with_its_argparse_default():
    parser = ed.build_parser()
    names = {f.name: f for f in dataclasses.fields(ed.Settings)}
    for _, flag, _, _, _ in ed.FLAGS:
        dest = flag[2:].replace("-", "_")
        assert ed.field_name(dest) in names, flag
        default = parser.get_default(dest)
        field = names[ed.field_name(dest)]
        if dest not in ("verify", "ddtree_budgets", "batch_sizes"):   # those three default to their resolved form
            assert field.default == (tuple(default) if isinstance(default, list) else default), flag
    resolved = set(names) - {ed.field_name(flag[2:].replace("-", "_")) for _, flag, _, _, _ in ed.FLAGS}
    assert {"prompts_hash", "hidden_hashes", "rank", "ranks", "walk_rule", "transformers_version"} <= resolved


def test_settings_are_read_as_attributes_and_never_written():
    settings = ed.Settings(device="cpu")
    assert settings.device == "cpu" and settings.temperature == 0.0 and settings.verify == ("standard",)
    with pytest.raises(AttributeError):
        settings.temprature   # a typo is an error, not a silent None
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.device = "cuda"
    quiet = ed.quietly(settings)
    assert quiet.quiet and not settings.quiet and quiet.device == "cpu"


def test_the_config_is_the_fields_and_reads_back(tmp_path):
    out = tmp_path / "r.json"
    assert ed.main([*DEMO, "--limit", "2", "--output", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    fields = [("from" if f.name == "from_" else f.name) for f in dataclasses.fields(ed.Settings)]
    learned = ["target_hash", "reference_generation_choice", "reference_generation_used"]   # Run's, echoed after
    assert list(config) == fields + [k for k in learned if k in config]
    back = ed.Settings.from_json(config)
    assert back.json() == {k: config[k] for k in fields}
    assert back.max_new_tokens == 128 and back.limit == 2 and back.prompts_hash == config["prompts_hash"]


def test_resolving_builds_nothing_and_prepare_takes_the_steps():
    args = ed.parse_args(["--demo", "--quiet"])
    resolved = ed.resolve_settings(args)
    assert resolved.prompts_hash is None and resolved.transformers_version is None
    prepared = ed.prepare(resolved, ranks=False)
    assert prepared.prompts_hash == ed.file_hash(os.path.join(ROOT, "tests", "fixtures", "demo", "prompts.jsonl"))
    assert prepared.transformers_version and dataclasses.replace(prepared, prompts_hash=None,
                                                                 transformers_version=None) == resolved


def test_a_new_field_reaches_the_config_without_being_listed(tmp_path, monkeypatch):
    Extended = dataclasses.make_dataclass("Extended", [("novel", str, dataclasses.field(default="kept"))],
                                          bases=(ed.Settings,), frozen=True)
    monkeypatch.setattr(ed, "Settings", Extended)
    out = tmp_path / "r.json"
    assert ed.main([*DEMO, "--limit", "1", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["novel"] == "kept"
