"""The manual's pictures, made again from the code (needs matplotlib; CPU, about a minute, --series minutes more):

    python bench/make_pictures.py            # docs/img/demo_pair.png and docs/img/served_mismatch.png
    python bench/make_pictures.py --series   # and docs/img/training_series.png

- demo_pair.png: the README's first recipe drawn by --plot (the demo drafter against SpecForge's DSpark one):
  per-position acceptance in both conventions, acceptance lengths, tau by served depth, tau by split.
- training_series.png: the demo drafter trained again from scratch (tests/make_demo.py --series: a checkpoint every
  100 steps), followed with --watch --depths 3,5 and drawn by --plot.
- served_mismatch.png: an engine (tests/spec_engine.py, real speculative decoding) whose drafter gets the target's
  layers one lower than trained: per-position acceptance and tau per request, served against exact, from the
  report's "served" entries (docs/served.md).
"""
import json
import os
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
IMG = os.path.join(ROOT, "docs", "img")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")


def tool(*argv):
    subprocess.run([sys.executable, os.path.join(ROOT, "eval_drafter.py"), *argv], check=True, cwd=ROOT)


def demo_pair():
    tool("--demo", "--ckpt", "ref=tests/fixtures/demo/drafter", "--ckpt", "mine=tests/fixtures/families/dspark_vanilla",
         "--depths", "3,5,7", "--quiet", "--plot", os.path.join(IMG, "demo_pair.png"))


def training_series(work):
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "make_demo.py"), "--series", work], check=True)
    series = os.path.join(work, "series.jsonl")
    tool("--watch", f"demo={work}", "--load-hidden", os.path.join(work, "features.safetensors"),
         "--target", os.path.join(DEMO, "target"), "--depths", "3,5", "--watch-idle", "1", "--watch-interval", "1",
         "--output", series, "--quiet")
    tool("--plot", os.path.join(IMG, "training_series.png"), "--from", series)


def served_mismatch(work):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import eval_drafter as ed
    from spec_engine import load_demo, start_engine
    model, drafter, _ = load_demo()
    engine = start_engine(model, drafter)
    try:
        engine.reset(layers=[0, 2, 3], detailed=True)   # trained on [1, 3, 4]
        out = os.path.join(work, "served.json")
        assert ed.main(["--demo", "--limit", "6", "--max-new-tokens", "40", "--ignore-eos", "--ddtree-budgets", "none",
                        "--quiet", "--server", engine.url, "--server-api", "openai", "--server-model", "demo",
                        "--output", out]) == 0
    finally:
        engine.shutdown()
    report = json.load(open(out))
    d = report["drafters"][0]
    s, prompts = d["served"], [p for p in d["prompts"] if "served" in p]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("exact", "exact (this run)"), ("served", "served (the engine)")):
        rates = s["per_position"][key]
        left.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
    left.set(title="acceptance by position, the same rounds", xlabel="position in the block",
             ylabel="P(accept | reached)", ylim=(0, 1.05))
    left.legend()
    x = range(len(prompts))
    right.bar([i - 0.2 for i in x], [p["served"]["tau_exact"] for p in prompts], 0.4, label="exact")
    right.bar([i + 0.2 for i in x], [p["served"]["tau_served"] for p in prompts], 0.4, label="served")
    right.set(title="tau per request", xticks=list(x), xticklabels=[p["id"] for p in prompts], ylabel="tau")
    right.legend()
    fig.suptitle("an engine feeding the drafter layers [0, 2, 3], trained on [1, 3, 4]; the run names it:\n"
                 + textwrap.shorten(s["causes"][0], 120), fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(IMG, "served_mismatch.png"), dpi=90)


if __name__ == "__main__":
    os.makedirs(IMG, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        demo_pair()
        served_mismatch(work)
        if "--series" in sys.argv:
            training_series(os.path.join(work, "series"))
    print("\n".join(os.path.join("docs", "img", f) for f in sorted(os.listdir(IMG))))
