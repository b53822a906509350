"""The tool's rounds equal the public reference loop's, round by round: z-lab's `dflash` 0.1.0
`dflash_generate` (greedy, CPU, float32), an implementation written independently of this tool.

Install it with `pip install --no-deps dflash==0.1.0`. CI sets EVAL_DRAFTER_REQUIRE_DFLASH=1 so that a
missing package fails there instead of skipping. The package is written for transformers 5.x: under 4.x two
of its cache helpers are swapped for ones with 4.x's semantics (a plain DynamicCache, since 4.x has no
past recording, and a rollback that never calls crop(0), which empties a 4.x cache); its loop and its
drafter are used as they are.
"""
import json
import os
import shutil
import time

import pytest
import torch

import eval_drafter as ed
from conftest import drafter_settings, write_jsonl

transformers = pytest.importorskip("transformers")
try:
    import dflash.model as public
except ImportError:
    if os.environ.get("EVAL_DRAFTER_REQUIRE_DFLASH"):
        raise
    pytest.skip("the public reference is not installed: pip install --no-deps dflash==0.1.0", allow_module_level=True)

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "demo")
N_NEW = 64
N_PROMPTS = 4


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = AutoModelForCausalLM.from_pretrained(os.path.join(DEMO, "target"), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    rows = [json.loads(line) for line in open(os.path.join(DEMO, "prompts.jsonl"))][:N_PROMPTS]
    return target, rows, [tok(row["prompt"])["input_ids"] for row in rows]


def crop_to_4x(cache, length):
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def public_rounds(drafter_dir, target, prompt_ids, n_new, monkeypatch):
    """dflash_generate's output tokens and acceptance lengths. Its stats call torch.cuda.synchronize for
    timing; on CPU the clock alone does."""
    from transformers import AutoConfig, DynamicCache
    monkeypatch.setattr(public, "_cuda_time", time.perf_counter)
    if ed.version_tuple(transformers.__version__) < (5, 0, 0):
        monkeypatch.setattr(public, "_make_cache", lambda config: DynamicCache())
        monkeypatch.setattr(public, "_crop_to", crop_to_4x)
    config = AutoConfig.from_pretrained(drafter_dir)
    model = public.DFlashDraftModel.from_pretrained(drafter_dir, config=config, dtype=torch.float32).eval()
    out = public.dflash_generate(model, target, torch.tensor([prompt_ids]), n_new, None, return_stats=True)
    return out.output_ids[0, len(prompt_ids):].tolist(), out.acceptance_lengths


@pytest.mark.parametrize("is_causal", [None, False, True])
def test_rounds_equal_the_public_loop(tmp_path, demo, monkeypatch, is_causal):
    """is_causal unset: sliding layers causal with their window (the training rule), full layers
    bidirectional; False: bidirectional everywhere, windows on both sides; True: causal everywhere. The tool
    reads the same config key under --block-mask auto."""
    target, rows, prompts = demo
    drafter_dir = tmp_path / "drafter"
    shutil.copytree(os.path.join(DEMO, "drafter"), drafter_dir)
    if is_causal is not None:
        cfg = json.loads((drafter_dir / "config.json").read_text())
        (drafter_dir / "config.json").write_text(json.dumps({**cfg, "is_causal": is_causal}))
    B = json.loads((drafter_dir / "config.json").read_text())["block_size"]
    references, expected = [], []
    for prompt_ids in prompts:
        # Past N_NEW by a block, so that the rounds whose block lies inside N_NEW tokens are not cut by its end.
        tokens, lengths = public_rounds(str(drafter_dir), target, prompt_ids, N_NEW + B, monkeypatch)
        references.append(tokens[:N_NEW])
        expected.append(lengths)
    prompts_file = write_jsonl(tmp_path / "p.jsonl", [{**row, "completion_ids": ref}
                                                      for row, ref in zip(rows, references)])
    out = tmp_path / "out.json"
    assert ed.main(["--target", os.path.join(DEMO, "target"), "--ckpt", f"demo={drafter_dir}", "--prompts",
                    prompts_file, "--ddtree-budgets", "none", "--quiet", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["target"]["agreement"] == 1.0   # the public loop's text is the target's greedy text
    all_rounds = []
    for p, lengths in zip(report["drafters"][0]["prompts"], expected):
        rounds = p["rounds"]
        assert rounds == lengths[:len(rounds)], p["id"]
        assert sum(rounds) + B - 1 > N_NEW - 1   # every round whose block fits was taken
        all_rounds += rounds
    assert min(all_rounds) == 1 and max(all_rounds) == B   # rejections and full blocks: the check has teeth


def test_speculative_references_equal_the_public_loop(demo, monkeypatch):
    """The tool's own speculative generation and the public loop commit the same tokens (both lossless)."""
    target, _, prompts = demo
    drafter = ed.load_drafter(os.path.join(DEMO, "drafter"), target.config, drafter_settings())
    for prompt_ids in prompts:
        tokens, _ = public_rounds(os.path.join(DEMO, "drafter"), target, prompt_ids, N_NEW, monkeypatch)
        assert ed.speculative_generate(target, drafter, prompt_ids, N_NEW, set()) == tokens
