#!/usr/bin/env python3
"""device_check.py: the one prepared script for a GPU box (a few minutes). It checks the CUDA path against
the CPU and prints timings; it changes no setting of the card.

    python bench/device_check.py                  # CUDA (bf16) against CPU (fp32)
    python bench/device_check.py --device cpu     # the same comparisons on the CPU (bf16 against fp32)

1. The bundled demo pair (--demo, 10 prompts, 128 tokens): CPU fp32 against the device in bf16 (its default)
   and in fp32: tau, target agreement, the time of each stage, and the share of prompts whose rounds equal
   the CPU's (bf16 may flip near-ties, so that share is a figure, not a pass/fail).
2. --device-map auto on the device (where accelerate is installed): the same rounds as the device's bf16 run,
   since only the placement differs.
3. The hybrid demo pair (transformers 5.x), fp32 on the device: speculative references give the same results
   as plain ones, and the generation speed-up.
Exit code 1 if 2. or 3. differ where they must not.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "eval_drafter.py")
HYBRID = os.path.join(ROOT, "tests", "fixtures", "demo_hybrid")


def run(out, *argv):
    """The tool in a child process; its JSON report."""
    proc = subprocess.run([sys.executable, TOOL, *argv, "--quiet", "--output", out], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"eval_drafter {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    with open(out) as f:
        return json.load(f)


def rounds(report):
    return {p["id"]: p["rounds"] for p in report["drafters"][0]["prompts"]}


def describe(name, report):
    d, t = report["drafters"][0], report["timing"]
    stages = ", ".join(f"{k[:-2]} {t[k]:.2f} s" for k in sorted(t) if k.endswith("_s"))
    print(f"{name}: tau {d['tau']:.4f}, agreement {report['target']['agreement']:.4f}; {stages}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as work:
        def out(name):
            return os.path.join(work, name + ".json")

        cpu = run(out("cpu"), "--demo", "--device", "cpu", "--dtype", "float32")
        describe("1. cpu float32", cpu)
        runs = {}
        for dtype in ("bfloat16", "float32"):
            runs[dtype] = run(out(dtype), "--demo", "--device", args.device, "--dtype", dtype)
            same = sum(rounds(cpu)[k] == v for k, v in rounds(runs[dtype]).items())
            describe(f"1. {args.device} {dtype}", runs[dtype])
            print(f"   rounds equal to the CPU's on {same}/{len(rounds(cpu))} prompts")

        if args.device == "cuda" and importlib.util.find_spec("accelerate"):
            mapped = run(out("mapped"), "--demo", "--device", "cuda", "--dtype", "bfloat16", "--device-map", "auto")
            describe("2. --device-map auto, bfloat16", mapped)
            ok &= rounds(mapped) == rounds(runs["bfloat16"])
            print(f"   rounds equal to 1.'s bfloat16 run: {rounds(mapped) == rounds(runs['bfloat16'])}")
        else:
            print("2. --device-map auto: not run (needs CUDA and accelerate)")

        import transformers
        if hasattr(transformers, "Qwen3_5ForCausalLM"):
            reports = {}
            for mode in ("plain", "speculative"):
                reports[mode] = run(out(mode), "--target", os.path.join(HYBRID, "target"), "--ckpt",
                                    os.path.join(HYBRID, "drafter"), "--prompts", os.path.join(HYBRID, "prompts.jsonl"),
                                    "--max-new-tokens", "128", "--device", args.device, "--dtype", "float32",
                                    "--reference-generation", mode)
                describe(f"3. hybrid demo pair, {mode} references", reports[mode])
            equal = reports["plain"]["drafters"] == reports["speculative"]["drafters"]
            ok &= equal
            print(f"   the same results from both: {equal}; generation plain / speculative = "
                  f"{reports['plain']['timing']['generate_s'] / reports['speculative']['timing']['generate_s']:.2f}")
        else:
            print("3. hybrid demo pair: not run (transformers without Qwen3.5)")
    print("device check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
