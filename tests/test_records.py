"""A drafter's per-prompt Result is kept in JSON field by field, as its declaration says (result_json,
result_from_json): every field survives the round trip, the keys written are the ones the records always held, and a
field added to Result is carried through a partial file (--resume), a shard's output (--merge) and a --load-hidden
run's resume without any other change.
"""
import json
from dataclasses import dataclass, fields

import pytest
import torch

import eval_drafter as ed
from conftest import interrupt_at

ARGV = ["--demo", "--limit", "4", "--max-new-tokens", "24", "--depths", "3", "--quiet"]


def same(a, b):
    """Field values equal, tensors by dtype and content, Results field by field."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, ed.Result):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def plain(rounds, drafts=3):
    """A Result with its required fields: anchors 10.., every draft right but the last."""
    equal = torch.ones(len(rounds), drafts, dtype=torch.bool)
    equal[:, -1] = False
    return ed.Result(rounds=rounds, ddtree_rounds={}, anchors=torch.arange(10, 10 + len(rounds)),
                     matched=equal.long().cumprod(1).sum(1), equal=equal)


def full():
    """A Result with every field set, the nested ones too (a depth of 2 drafts, a tree of 4, a rule)."""
    res = plain([3, 1, 2])
    res.ddtree_rounds, res.ties = {8: [3, 3], 32: [4, 2]}, torch.tensor([[True, False, False]] * 3)
    res.mask_check, res.override_check = {"configured": [1, 2, 3, 4, 0, 0]}, {"as given": [1, 2, 3, 4, 0, 0]}
    res.by_context, res.expected = {"<512": [6.0, 3.0, 3.0, 3]}, {"rounds": 2.5, "committed": 6.0}
    res.by_reply = {"<64": [6.0, 3.0, 3.0, 3]}
    res.feature_check, res.suspects, res.served_steps = [3, 3, 1, 6, 2, 9], ["layers [1, 2]"], {"rounds": [3]}
    res.confidence = [[0.9, 0.5, 0.1]] * 3
    res.depths, res.tree, res.verify = {2: plain([2, 2], 2)}, plain([5], 4), {"block": plain([3, 1, 2])}
    return res


def test_every_field_survives_the_round_trip():
    res = full()
    assert all(getattr(res, f.name) is not None for f in fields(ed.Result))   # none left to chance
    text = json.dumps(ed.result_json(res))
    back = ed.result_from_json(json.loads(text), 3, 4)
    assert same(back, res)
    assert json.dumps(ed.result_json(back)) == text


def test_the_keys_written_are_the_records_own():
    """The keys and their order as the records always had them: mask_check, override_check and by_context written
    even when None; the others left out when None; suspects null where the served steps were walked."""
    res = plain([3, 1, 2])
    assert list(ed.result_json(res)) == ["rounds", "ddtree_rounds", "anchors", "matched", "equal", "mask_check",
                                         "override_check", "by_context"]
    assert list(ed.result_json(full())) == [f.name for f in fields(ed.Result)]
    res.served_steps = {"rounds": [3]}
    assert ed.result_json(res)["suspects"] is None
    res.rounds = None   # sampled drafts: no one walk, still a key
    assert ed.result_json(res)["rounds"] is None


@dataclass
class Marked(ed.Result):
    """Result with one more field, as a later change would add it."""
    misses: torch.Tensor = ed.json_field(ed.SLOTS)   # per anchor and slot: the draft is not the reference's


def test_a_new_field_survives_the_round_trip(monkeypatch):
    monkeypatch.setattr(ed, "Result", Marked)
    res = Marked(**{f.name: getattr(full(), f.name) for f in fields(ed.Result) if f.name != "misses"})
    res.misses = ~res.equal
    back = ed.result_from_json(json.loads(json.dumps(ed.result_json(res))), 3, 4)
    assert type(back) is Marked and same(back, res)


def marking(monkeypatch):
    """Results made Marked, each (its depths' too) given misses as the prompts are scored; returns the Results
    the report is made from, as [(drafter's name, its results)], checked against their own equal tables."""
    monkeypatch.setattr(ed, "Result", Marked)
    scored, reported, report = ed.evaluate_prompts, [], ed.drafter_report

    def evaluate(*args, **kwargs):
        records = scored(*args, **kwargs)
        for res in (res for record in records for res in record["results"]):
            for r in [res, *(res.depths or {}).values()]:
                r.misses = ~r.equal
        return records

    def reporting(d, results, items):
        reported.append((d["name"], results))
        return report(d, results, items)
    monkeypatch.setattr(ed, "evaluate_prompts", evaluate)
    monkeypatch.setattr(ed, "drafter_report", reporting)
    return reported


def assert_marked(reported, prompts):
    results = [r for _, rs in reported for res in rs for r in [res, *res.depths.values()]]
    assert len(results) == 2 * prompts
    for r in results:
        assert type(r) is Marked and r.misses is not None, "a field added to Result was lost"
        assert torch.equal(r.misses, ~r.equal)


def test_a_new_field_survives_resume(tmp_path, monkeypatch):
    reported, out = marking(monkeypatch), tmp_path / "out.json"
    real, _ = interrupt_at(monkeypatch, "evaluate_prompts", 3)   # two prompts in the partial file
    assert ed.main([*ARGV, "--output", str(out)]) == 130
    with open(str(out) + ".partial.jsonl") as f:
        rows = [json.loads(line) for line in f if "results" in line]
    assert len(rows) == 2 and all("misses" in r for row in rows for r in row["results"])
    monkeypatch.setattr(ed, "evaluate_prompts", real)
    assert ed.main([*ARGV, "--output", str(out), "--resume"]) == 0
    assert_marked(reported[-1:], 4)


def test_a_new_field_survives_shards_and_merge(tmp_path, monkeypatch):
    reported = marking(monkeypatch)
    for k in (1, 2):
        assert ed.main([*ARGV, "--shard", f"{k}/2", "--output", str(tmp_path / f"s{k}.json")]) == 0
    reported.clear()
    assert ed.main(["--merge", str(tmp_path / "s1.json"), str(tmp_path / "s2.json"), "--quiet", "--output",
                    str(tmp_path / "merged.json")]) == 0
    assert_marked(reported, 4)


def test_a_new_field_survives_a_load_hidden_resume(tmp_path, monkeypatch):
    assert ed.main([*ARGV, "--save-hidden", str(tmp_path / "h.safetensors")]) == 0
    reported, out = marking(monkeypatch), tmp_path / "out.json"
    argv = ["--target", f"{ed.DEMO_DIR}/target", "--ckpt", f"demo={ed.DEMO_DIR}/drafter", "--depths", "3",
            "--load-hidden", str(tmp_path / "h.safetensors"), "--quiet", "--output", str(out)]
    real, _ = interrupt_at(monkeypatch, "evaluate_prompts", 2)
    assert ed.main(argv) == 130
    monkeypatch.setattr(ed, "evaluate_prompts", real)
    assert ed.main([*argv, "--resume"]) == 0
    assert_marked(reported[-1:], 4)


@pytest.mark.parametrize("name", [f.name for f in fields(ed.Result)])
def test_a_dropped_field_is_noticed(name):
    """The round-trip check has teeth: a field whose value does not come back is seen."""
    res = full()
    written = ed.result_json(res)
    del written[name]
    assert not same(ed.result_from_json(written, 3, 4), res)
