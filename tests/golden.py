"""Golden recordings of eval_drafter.py's CLI: a safety net for behaviour-preserving refactors.

    python tests/golden.py record REPO_DIR OUT_DIR [SCENARIO ...]   # run the scenarios with REPO_DIR/eval_drafter.py
    python tests/golden.py compare OUT_A OUT_B                      # diff two recordings (exit 1 if any differ)
    python tests/golden.py list                                     # the scenarios' names

Run it with the venv's python (the one that runs the tool). Not a pytest module: nothing here is collected.

Each scenario runs its commands in a fixed scratch directory, /tmp/golden_scratch/<scenario> (wiped first; two
recordings must not run at once), with stdin /dev/null, stdout/stderr captured, PYTHONHASHSEED=0,
OMP_NUM_THREADS=1 and --threads 1. For command i, OUT_DIR/<scenario>/ gets i.cmd (argv and exit code), i.stdout,
i.stderr and i.files/<path> for every file the command created or changed in the scratch directory (JSON and
JSONL re-dumped with indent=1 in their own key order; a .safetensors as its metadata and each tensor's name,
dtype, shape and sha256); i.deleted lists the files it removed.
Normalization, the only differences allowed: REPO_DIR -> <REPO>, the scratch directory -> <TMP> everywhere; the
"timing" and "elapsed_s" keys dropped from JSON; in file names only, a left-over atomic-write <path>.tmp<pid>
is shown as <path>.tmp<PID> (none appear today). --save-hidden's shard files (<pid>-<time> in the name) are
never written at these sizes.
"""
import difflib
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time

SCRATCH = "/tmp/golden_scratch"
DROP_KEYS = ("timing", "elapsed_s")
PID_NAMES = re.compile(r"\.tmp\d+$")          # write_json's / write_safetensors' <path>.tmp<pid>

WRAPPER = '''import sys
sys.path.insert(0, {repo!r})
import eval_drafter
real, calls = eval_drafter.evaluate_prompts, []


def stopping(*args, **kwargs):   # the 3rd call is a Ctrl-C
    calls.append(1)
    if len(calls) == 3:
        raise KeyboardInterrupt
    return real(*args, **kwargs)


eval_drafter.evaluate_prompts = stopping
sys.exit(eval_drafter.main(sys.argv[1:]))
'''

# ------------------------------------------------------------------------------------------------------------
# Scenarios: name -> (setup(scratch, repo) or None, [commands]). A command is an argv for eval_drafter.py, or
# ("wrapper", argv) for the interrupting wrapper. {F} is REPO_DIR/tests/fixtures; every command gets --threads 1.

DEMO_T, DEMO_D, DEMO_P = "{F}/demo/target", "{F}/demo/drafter", "{F}/demo/prompts.jsonl"
SMALL = ["--limit", "4", "--max-new-tokens", "64"]
COSTS = {"target": {"1": 0.031, "4": 0.034, "6": 0.036, "8": 0.038, "9": 0.039, "33": 0.05},
         "draft": {"3": 0.004, "5": 0.0045, "7": 0.005, "8": 0.0052}}


def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def setup_costs(tmp, repo):
    write(os.path.join(tmp, "costs.json"), json.dumps(COSTS))


def setup_run_dir(tmp, repo):
    """A SpecForge-style training run: run/specforge-run-step100/ (the demo drafter, public layout),
    run/specforge-run-step200/training_state.pt and run/step_300.safetensors (the demo drafter with perturbed
    MLP weights, deterministic), the run's config.json, and a -latest link that must be passed over."""
    import torch
    from safetensors.torch import load_file, save_file
    src, run = os.path.join(repo, "tests/fixtures/demo/drafter"), os.path.join(tmp, "run")
    shutil.copytree(src, os.path.join(run, "specforge-run-step100"))
    shutil.copy(os.path.join(src, "config.json"), os.path.join(run, "config.json"))
    weights = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(8)

    def perturbed(scale):
        return {k: (v + scale * torch.randn(v.shape, generator=g) if k.startswith("layers.1.mlp") else v).contiguous()
                for k, v in weights.items()}
    os.makedirs(os.path.join(run, "specforge-run-step200"))
    torch.save({"draft_state_dict": {k: v.to(torch.bfloat16) for k, v in perturbed(0.05).items()},
                "global_step": 200, "epoch": 0}, os.path.join(run, "specforge-run-step200", "training_state.pt"))
    save_file(perturbed(0.1), os.path.join(run, "step_300.safetensors"))
    os.symlink("specforge-run-step200", os.path.join(run, "specforge-run-latest"))


def setup_wrapper(tmp, repo):
    write(os.path.join(tmp, "interrupt.py"), WRAPPER.format(repo=repo))


def setup_refusals(tmp, repo):
    write(os.path.join(tmp, "notshard.json"), json.dumps({"config": {}, "drafters": []}))
    write(os.path.join(tmp, "bad.jsonl"), '{"id": "a", "prompt": "w1 w2"}\n{"id": "b", "prompt": \n')


RESUME = ["--demo", "--limit", "5", "--max-new-tokens", "64", "--output", "out.json"]
SCENARIOS = {
    "demo": (None, [["--demo", "--output", "out.json"]]),
    "demo_walk": (None, [["--demo", "--anchors", "walk", "--output", "out.json"]]),
    "sampled": (None, [["--demo", "--temperature", "0.8", "--samples-per-prompt", "2", "--limit", "4",
                        "--output", "out.json"]]),
    "sampled_top_p": (None, [["--demo", "--temperature", "0.8", "--top-p", "0.9", "--draft-policy", "sample",
                              "--limit", "4", "--output", "out.json"]]),
    "depths_costs": (setup_costs, [["--target", DEMO_T, "--prompts", DEMO_P, "--ckpt", f"a={DEMO_D}",
                                    "--ckpt", "b={F}/demo_from_anchor/drafter", "--depths", "3,5",
                                    "--costs", "costs.json", "--ddtree-budgets", "8,32", "--export-vllm-synthetic",
                                    "x.json", *SMALL, "--output", "out.json"]]),
    "steps": (setup_run_dir, [["--demo", "--ckpt", "sf=run", *SMALL, "--output", "all.json"],
                              ["--demo", "--ckpt", "sf=run", "--steps", "100,300", *SMALL, "--output", "two.json"]]),
    "hybrid_mtp": (None, [["--target", "{F}/demo_hybrid/target", "--ckpt", "mine={F}/demo_hybrid/drafter", "--mtp",
                           "--prompts", "{F}/demo_hybrid/prompts.jsonl", *SMALL, "--output", "out.json"]]),
    "hidden": (None, [
        ["--demo", *SMALL, "--save-hidden", "h.safetensors", "--save-references", "refs.jsonl", "--output", "save.json"],
        ["--target", DEMO_T, "--ckpt", DEMO_D, "--load-hidden", "h.safetensors", "--output", "load.json"],
        ["--target", DEMO_T, "--ckpt", DEMO_D, "--prompts", "refs.jsonl", "--dtype", "bfloat16",
         "--save-hidden", "h_bf16.safetensors", "--output", "save_bf16.json"],
        ["--compare-hidden", "h.safetensors", "h_bf16.safetensors", "--target", DEMO_T, "--ckpt", f"d={DEMO_D}",
         "--output", "compare.json"]]),
    "shards": (None, [["--demo", "--limit", "6", "--max-new-tokens", "64", "--shard", "1/2", "--output", "s1.json"],
                      ["--demo", "--limit", "6", "--max-new-tokens", "64", "--shard", "2/2", "--output", "s2.json"],
                      ["--merge", "s1.json", "s2.json", "--output", "merged.json"]]),
    "resume": (setup_wrapper, [("wrapper", RESUME), [*RESUME, "--resume"]]),
    "check_mask": (None, [["--demo", "--check-mask", *SMALL, "--output", "out.json"]]),
    "families": (None, [["--demo", *[a for n in ("dspark_vanilla", "dspark_rnn", "domino", "domino_shift", "eagle3")
                                     for a in ("--ckpt", f"{n}={{F}}/families/{n}")],
                         "--limit", "3", "--max-new-tokens", "48", "--output", "out.json"]]),
    "speculators": (None, [["--demo", *[a for n in ("dflash", "dflash2", "dflash_w32", "dflash2_w32_bidi")
                                        for a in ("--ckpt", f"{n}={{F}}/speculators/{n}")],
                            "--limit", "3", "--max-new-tokens", "48", "--output", "out.json"]]),
    "refusals": (setup_refusals, [
        ["--ckpt", DEMO_D, "--prompts", DEMO_P],
        ["--target", DEMO_T, "--ckpt", DEMO_D, "--prompts", "missing.jsonl"],
        ["--demo", "--depths", "99"],
        ["--demo", "--ddtree-budgets", "0"],
        ["--demo", "--resume"],
        ["--demo", "--temperature", "-1"],
        ["--merge", "notshard.json", "--output", "merged.json"],
        ["--target", DEMO_T, "--ckpt", DEMO_D, "--prompts", "bad.jsonl"],
        ["--demo", "--top-p", "0"],
        ["--demo", "--steps", "400"]]),
}


# ------------------------------------------------------------------------------------------------------------
# Normalization

def norm_text(text, repo, tmp):
    for path, tag in sorted(((repo, "<REPO>"), (tmp, "<TMP>")), key=lambda p: -len(p[0])):
        text = text.replace(path, tag)
    return text


def drop_keys(x):
    if isinstance(x, dict):
        return {k: drop_keys(v) for k, v in x.items() if k not in DROP_KEYS}
    if isinstance(x, list):
        return [drop_keys(v) for v in x]
    return x


def dump(x):
    return json.dumps(drop_keys(x), indent=1, ensure_ascii=False) + "\n"


def norm_jsonl(text):
    out = []
    for line in text.splitlines():
        try:
            out.append(dump(json.loads(line)))
        except json.JSONDecodeError:
            out.append(line + "   <not JSON>\n")
    return "".join(out)


def safetensors_summary(path):
    """Metadata (values that hold JSON parsed and normalized) and (name, dtype, shape, sha256) of every tensor,
    read from the file's own header: no framework involved."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header, base = json.loads(f.read(n)), 8 + n
        meta, tensors = header.pop("__metadata__", {}) or {}, []
        for name, t in header.items():
            f.seek(base + t["data_offsets"][0])
            data = f.read(t["data_offsets"][1] - t["data_offsets"][0])
            tensors.append({"name": name, "dtype": t["dtype"], "shape": t["shape"],
                            "sha256": hashlib.sha256(data).hexdigest()})
    for k, v in meta.items():
        try:
            meta[k] = json.loads(v)
        except (json.JSONDecodeError, TypeError):
            pass
    return dump({"metadata": meta, "tensors": tensors})


def normalized_file(path, repo, tmp):
    if path.endswith(".safetensors"):
        return norm_text(safetensors_summary(path), repo, tmp)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return f"<binary, {len(raw)} bytes, sha256 {hashlib.sha256(raw).hexdigest()}>\n"
    if path.endswith(".json"):
        try:
            text = dump(json.loads(text))
        except json.JSONDecodeError:
            text += "\n<not JSON>\n"
    elif path.endswith(".jsonl"):
        text = norm_jsonl(text)
    return norm_text(text, repo, tmp)


# ------------------------------------------------------------------------------------------------------------
# Record

def snapshot(root):
    """{relative path: sha256} of every regular file under root (links not followed)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in files:
            full = os.path.join(d, name)
            if not os.path.islink(full):
                with open(full, "rb") as f:
                    out[os.path.relpath(full, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def run_scenario(name, repo, out_dir):
    setup, commands = SCENARIOS[name]
    tmp, dest = os.path.join(SCRATCH, name), os.path.join(out_dir, name)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    os.makedirs(dest)
    if setup:
        setup(tmp, repo)
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    fixtures = os.path.join(repo, "tests", "fixtures")
    for i, command in enumerate(commands):
        script = os.path.join(repo, "eval_drafter.py")
        if isinstance(command, tuple):
            script, command = os.path.join(tmp, "interrupt.py"), command[1]
        argv = [a.replace("{F}", fixtures) for a in command] + ["--threads", "1"]
        before = snapshot(tmp)
        with open(os.devnull) as devnull:
            p = subprocess.run([sys.executable, script, *argv], cwd=tmp, env=env, stdin=devnull,
                               capture_output=True, text=True, timeout=600)
        after = snapshot(tmp)
        base = os.path.join(dest, str(i))
        shown = " ".join([os.path.relpath(script, tmp) if script.startswith(tmp) else script, *argv])
        write(base + ".cmd", norm_text(f"{shown}\nrc: {p.returncode}\n", repo, tmp))
        write(base + ".stdout", norm_text(p.stdout, repo, tmp))
        write(base + ".stderr", norm_text(p.stderr, repo, tmp))
        gone = sorted(PID_NAMES.sub(".tmp<PID>", f) for f in before if f not in after)
        if gone:
            write(base + ".deleted", "".join(f + "\n" for f in gone))
        for rel in sorted(f for f in after if before.get(f) != after[f]):
            target = os.path.join(base + ".files", PID_NAMES.sub(".tmp<PID>", rel))
            if rel.endswith(".safetensors"):
                target += ".json"
            os.makedirs(os.path.dirname(target), exist_ok=True)
            write(target, normalized_file(os.path.join(tmp, rel), repo, tmp))
        yield i, p.returncode


def record(repo, out_dir, names):
    repo = os.path.abspath(repo)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    start = time.time()
    for name in names or SCENARIOS:
        t = time.time()
        rcs = [rc for _, rc in run_scenario(name, repo, out_dir)]
        print(f"{name:16s} rc {rcs}  {time.time() - t:5.1f} s", flush=True)
    print(f"recorded {len(names or SCENARIOS)} scenarios from {repo} into {out_dir} in {time.time() - start:.0f} s")
    return 0


# ------------------------------------------------------------------------------------------------------------
# Compare

def files_under(root):
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}


def compare(a, b):
    fa, fb = files_under(a), files_under(b)
    differ = 0
    for rel in sorted(fa | fb):
        if rel not in fa or rel not in fb:
            differ += 1
            print(f"only in {a if rel in fa else b}: {rel}")
            continue
        with open(os.path.join(a, rel), encoding="utf-8") as f:
            ta = f.read().splitlines(keepends=True)
        with open(os.path.join(b, rel), encoding="utf-8") as f:
            tb = f.read().splitlines(keepends=True)
        if ta != tb:
            differ += 1
            diff = list(difflib.unified_diff(ta, tb, f"{a}/{rel}", f"{b}/{rel}"))
            print(f"differs: {rel}")
            sys.stdout.writelines(line if line.endswith("\n") else line + "\n" for line in diff[:40])
            if len(diff) > 40:
                print(f"... ({len(diff) - 40} more diff lines)")
    print(f"{len(fa | fb)} files compared, {differ} differ" + (": IDENTICAL" if not differ else ""))
    return 1 if differ else 0


def main(argv):
    if len(argv) >= 3 and argv[0] == "record":
        unknown = [n for n in argv[3:] if n not in SCENARIOS]
        if unknown:
            sys.exit(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
        return record(argv[1], argv[2], argv[3:])
    if len(argv) == 3 and argv[0] == "compare":
        return compare(argv[1], argv[2])
    if argv == ["list"]:
        print("\n".join(SCENARIOS))
        return 0
    print(__doc__.split("\n\n")[1])
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
