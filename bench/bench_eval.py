#!/usr/bin/env python3
"""bench_eval.py: how fast eval_drafter.py evaluates a drafter, against this machine's matmul floor.

One command; the tool runs in this process (ed.main), except where a clean process is the point (peak
memory, whole-process time):

    python bench/bench_eval.py                    # CPU; ~18 minutes on 2 cores; rewrites bench/RESULTS.md
    python bench/bench_eval.py --device cuda      # the same on a GPU (bfloat16, as the tool's default there)
    python bench/bench_eval.py --quick            # ~2 minutes: 2 prompts, 1 run each, RESULTS.md untouched

It builds, in a temp dir, a randomly initialised Qwen3 target (88M parameters: hidden 768, 10 layers,
vocab 16384, word-level tokenizer) and a random DFlash drafter shaped like the public ones relative to it
(same hidden, 1 layer, 3 feature layers, block 16), and 4 prompts whose 256-token references are the
target's own greedy output (given as completion_ids, so no generation is timed in b). Then, as the best of
--repeats runs after a warm-up:

  a. the fp32 (bf16 on CUDA) GEMM rate of this machine and the FLOPs of the work: the target's
     teacher-forced pass, the drafter's blocks at every anchor and the lm_head over their drafted slots;
     floor = FLOPs / rate.
  b. eval_drafter's evaluation (chain + DDTree 8/32/128), stages from its JSON "timing"; load excluded.
  c. an online greedy speculative loop in the public style (target with a KV cache cropped on rejection,
     one drafter block per round from the hidden states of committed tokens, one verify pass per round)
     on the same prompts, stopping where the tool's walk stops; its rounds must equal b's chain rounds.
  d. drafter-only re-evaluation from a --save-hidden file (--load-hidden).
  e. peak resident memory of b in a child process, against weights + features.
  g. a DFlash 2 drafter of the same shape (conv taps K=2 over groups of 64 channels, selector rank 64 with
     16 candidates): drafter time per anchor against DFlash's on the same features, and the shares of the
     selector (top-k, projection and the B-1 path steps) and of the conv taps.
  h. sampled evaluation with the references given, at Qwen3's thinking-mode settings (temperature 0.6, top-p
     0.95, top-k 20), argmax and sampled proposals, against b's greedy evaluation of the same references (goals
     ~1.1x and <= 1.5x); and top-p without top-k, sampled proposals: the random drafter's flat rows are the
     worst case of the top-p cut (each row sorted).
  l. DSpark (vanilla and rnn heads, rank 256) and Domino (GRU 256, bottleneck 256, P = 1) drafters of the same
     backbone shape: drafter time per anchor against DFlash's, and the sequential part's share (the slot-by-slot
     head against the same rows through one batched argmax); an EAGLE-3 drafter and a Qwen3.5-style MTP layer of
     the same hidden size drafting as many tokens (their causal pass over the text and their chained steps).
  i. local references for a hybrid target (the bundled hybrid demo pair, Qwen3.5 layers): plain greedy
     decoding against speculative decoding with the state snapshot (goal: >= 2x at tau >= 4); equal tokens.
  m. the demo as a user runs it, on an idle box and with 2 x cores other processes spinning: the default threads
     against --threads 1 (goal: within 2x on the busy box) and against libgomp's own spin count, the old default.
  r. (--only r) the real pair: SmolLM2-135M-Instruct's GGUF converted afresh and found converted, the whole
     `--demo real` process under the old reference default (speculative) and the new one (auto), its target pass
     in tokens per second and its drafter's time per anchor.
  t. (--only t) the Python entry point as a training loop calls it: eval_drafter.measure() on the demo drafter
     over the demo prompts' saved features (load_features once), its time per call against the drafter pass
     inside it, idle and on a busy box, with the caller's threads (the old default) and one thread (the new);
     and the CLI's --load-hidden process.
  Also: whole-process time of `eval_drafter.py --demo --limit 2 --quiet` split into imports and the rest;
  b with --anchors walk (one run); plain vs speculative reference generation (--reference-generation) on
  the benchmark pair and on the bundled demo pair; a cProfile of one b run and of the tool's
  speculative_generate. The GEMM rate is measured before and after b; the floor uses the higher (the
  machine is shared, so the lower one is contention).

It prints one verdict line per goal and writes every figure to bench/RESULTS.md (--no-write-results to skip).
"""
import argparse
import contextlib
import datetime
import inspect
import io
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for _path in (ROOT, os.path.join(ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import drafters as dr  # noqa: E402
import eval_drafter as ed  # noqa: E402
import make_demo as md  # noqa: E402

TOOL = os.path.join(ROOT, "eval_drafter.py")
RESULTS = os.path.join(BENCH, "RESULTS.md")
PROMPT_LENGTHS = (24, 40, 56, 72, 32, 48, 64, 80)  # words (= tokens) per prompt, cycled
BUDGETS = "8,32,128"
GEN_TOKENS = 128  # tokens per reference-generation timing on the benchmark pair
LINES = []  # everything printed, in order: it becomes RESULTS.md's figures
KEPT_MARKER = "<!-- hand-written below this line: bench_eval.py keeps it when it rewrites the file -->"


def say(text=""):
    print(text, flush=True)
    LINES.append(text)


def best(values):
    """The fastest of the timed runs: on a shared machine interference only ever adds time (two runs of the
    same code here differ by up to 10-15%), so the minimum is the steadiest estimate of the work's own cost."""
    return min(values) if values else float("nan")


OTHERS = {}  # section: share of the machine's CPU time other processes used meanwhile


def cpu_snapshot():
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its children, wall)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = float("nan")
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system, time.perf_counter()


@contextlib.contextmanager
def watch(section):
    """Record how much of the machine other processes took while `section` ran: the machine is shared,
    and on 2 cores another busy process can slow 2-thread torch many times over."""
    start = cpu_snapshot()
    try:
        yield
    finally:
        busy, mine, wall = cpu_snapshot()
        OTHERS[section] = max(0.0, (busy - start[0] - (mine - start[1])) / ((wall - start[2]) * os.cpu_count()))


def others(section):
    share = OTHERS.get(section)
    if share is None or math.isnan(share):
        return ""
    return f" [other processes: {share:.0%} of the CPUs{' - CONTENDED' if share > 0.1 else ''}]"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, help="torch CPU threads for everything (default: torch's own)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement, after a warm-up")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--ref-tokens", type=int, default=256, help="reference completion length")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--target-layers", type=int, default=10)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--workdir", help="build (or reuse) the benchmark pair here instead of a temp dir")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="profile one extra b run and print its top functions (default on)")
    p.add_argument("--quick", action="store_true", help="2 prompts, 1 run each, no RESULTS.md")
    p.add_argument("--only", help="run only these rows, e.g. j,k (no RESULTS.md): j = the --depths sweep's cost, "
                                  "k = predicted against measured speedup on the demo pair, l = DSpark and Domino "
                                  "against DFlash, m = the demo on a busy box, default threads against --threads 1, "
                                  "r = the real pair (GGUF conversion, --demo real, target tokens/s, drafter ms "
                                  "per anchor), t = measure(), the Python entry point, against its drafter pass, "
                                  "p = published speedups against the roofline, q = a ranking priced for an H100, "
                                  "n = three --costs measure runs on a busy box")
    p.add_argument("--write-results", action=argparse.BooleanOptionalAction,
                   help="write bench/RESULTS.md (default on, off with --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats = min(args.prompts, 2), 1
    if args.write_results is None:
        args.write_results = not args.quick and not args.only
    return args


# ----------------------------------------------------------------------------------------------------
# Machine


def machine_info(args):
    model = platform.processor() or "unknown"
    with contextlib.suppress(Exception):
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", out).group(1).strip()
    info = {"cpu": model, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "python": platform.python_version(), "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "load_before": os.getloadavg()[0], "device": args.device}
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32  # the tool's --dtype auto


def gemm_rate(device, repeats):
    """GFLOP/s of a large square matmul in the run dtype: the rate the floor is computed with."""
    n = 8192 if device == "cuda" else 2048
    a, b, c = (torch.randn(n, n, device=device, dtype=run_dtype(device)) for _ in range(3))
    times = []
    for i in range(max(5, repeats) + 1):
        sync(device)
        start = time.perf_counter()
        torch.matmul(a, b, out=c)
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return {"n": n, "gflops": 2 * n ** 3 / best(times) / 1e9}


# ----------------------------------------------------------------------------------------------------
# The benchmark pair: a random Qwen3 target, a random drafter shaped like the public ones, prompts with
# references (the target's greedy output, so every figure is exact and b's rounds equal c's)


def pair_config(args):
    heads = args.hidden // 64
    tcfg = md.target_config(args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                            num_hidden_layers=args.target_layers, num_attention_heads=heads,
                            num_key_value_heads=max(1, heads // 3), head_dim=64, max_position_embeddings=4096)
    layer_ids = ed.default_layer_ids(args.target_layers, 3)
    dcfg = md.drafter_config(tcfg, layer_ids=layer_ids, block_size=args.block,
                             intermediate_size=args.intermediate, num_hidden_layers=args.drafter_layers,
                             num_attention_heads=heads, num_key_value_heads=max(1, heads // 3), head_dim=64,
                             max_position_embeddings=4096, layer_types=["full_attention"] * args.drafter_layers,
                             use_sliding_window=False, sliding_window=None)
    return tcfg, dcfg


def build_pair(args, work):
    """Target, drafter and prompts under `work`; reused when `work` already holds the same build."""
    tcfg, dcfg = pair_config(args)
    stamp = {"target": tcfg.to_dict(), "drafter": dcfg, "prompts": args.prompts, "ref_tokens": args.ref_tokens,
             "device": args.device}
    stamp = json.loads(json.dumps(stamp, sort_keys=True, default=str))
    paths = {k: os.path.join(work, k) for k in ("target", "drafter")}
    paths.update(prompts=os.path.join(work, "prompts.jsonl"), bare=os.path.join(work, "prompts_bare.jsonl"))
    stamp_path = os.path.join(work, "stamp.json")
    if os.path.isfile(stamp_path) and json.load(open(stamp_path)) == stamp:
        return paths, tcfg, dcfg
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM
    start = time.perf_counter()
    md.save_tokenizer(paths["target"], n_words=args.vocab - len(md.SPECIALS))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tcfg).eval()
    model.generation_config.eos_token_id = 1
    model.save_pretrained(paths["target"])
    md.save_drafter(paths["drafter"], dcfg, md.random_drafter_weights(dcfg, 3, seed=0, scale=0.05))
    # references from the model as the tool will load it (device, dtype, rotary buffers), so that they are
    # its greedy output under the same numerics
    model = AutoModelForCausalLM.from_pretrained(paths["target"], dtype=run_dtype(args.device)).to(args.device).eval()
    write_references(args, model, paths)
    json.dump(stamp, open(stamp_path, "w"))
    say(f"built the benchmark pair in {time.perf_counter() - start:.1f} s under {work}")
    return paths, tcfg, dcfg


def write_references(args, model, paths):
    """Prompts of random words; their references are the target's greedy continuation (EOS ignored)."""
    import random
    rng = random.Random(0)
    n_words = args.vocab - len(md.SPECIALS)
    rows = [{"id": f"p{i}", "prompt": " ".join(md.word(rng.randrange(n_words))
                                                for _ in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]))}
            for i in range(args.prompts)]
    write_jsonl(paths["bare"], rows)
    for row, item in zip(rows, tool_prompts(paths["bare"], paths["target"])):
        row["completion_ids"] = ed.plain_generate(model, item.prompt_ids, args.ref_tokens, set())
    write_jsonl(paths["prompts"], rows)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def tool_prompts(path, target_dir):
    """The prompts as the tool tokenizes them (its own functions, so the ids are the same)."""
    from transformers import AutoTokenizer
    items = ed.read_prompts(path)
    ed.encode_prompts(AutoTokenizer.from_pretrained(target_dir), items, ed.Settings(quiet=True))
    return items


# ----------------------------------------------------------------------------------------------------
# a. FLOPs of the work (what is useful; the dense-mask attention the tool executes is counted apart)


def linear_params(cfg):
    """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down)."""
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return H * q + 2 * H * kv + q * H + 3 * H * cfg["intermediate_size"]


def work_flops(tcfg, dcfg, lengths):
    """FLOPs per part for prompts of (prompt tokens, completion tokens), as the tool does them:
    target over prompt + completion (lm_head on completion rows only), drafter context over all positions,
    one block of B tokens per fitting anchor, lm_head on its B-1 drafted slots."""
    t, d = tcfg.to_dict(), dcfg
    H, V, B, Ld = t["hidden_size"], t["vocab_size"], d["block_size"], d["num_hidden_layers"]
    t_attn = t["num_attention_heads"] * t["head_dim"]
    d_attn, d_kv = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
    k = len(d["dflash_config"]["target_layer_ids"])
    parts = dict.fromkeys(("target", "target_attention", "target_lm_head", "drafter_context", "drafter_blocks",
                           "drafter_attention", "drafter_lm_head", "drafter_attention_executed"), 0)
    anchors = 0
    for n_p, n_c in lengths:
        T = n_p + n_c
        a = list(range(n_p, T - B + 1))  # the tool's fitting anchors
        anchors += len(a)
        parts["target"] += 2 * t["num_hidden_layers"] * linear_params(t) * T
        parts["target_attention"] += t["num_hidden_layers"] * 2 * t_attn * T * (T + 1)
        parts["target_lm_head"] += 2 * H * V * n_c
        parts["drafter_context"] += 2 * (k * H * H + Ld * 2 * H * d_kv) * T
        parts["drafter_blocks"] += 2 * Ld * linear_params(d) * B * len(a)
        parts["drafter_attention"] += Ld * 4 * d_attn * B * sum(x + B for x in a)
        per_chunk = max(1, ed.ANCHOR_TOKENS_PER_CHUNK // B)
        for i in range(0, len(a), per_chunk):
            chunk = a[i:i + per_chunk]
            parts["drafter_attention_executed"] += Ld * 4 * d_attn * len(chunk) * B * (max(chunk) + len(chunk) * B)
        parts["drafter_lm_head"] += 2 * H * V * (B - 1) * len(a)
    parts["target_total"] = parts["target"] + parts["target_attention"] + parts["target_lm_head"]
    parts["drafter_total"] = sum(parts[p] for p in ("drafter_context", "drafter_blocks", "drafter_attention",
                                                    "drafter_lm_head"))
    parts["total"] = parts["target_total"] + parts["drafter_total"]
    parts["anchors"], parts["prompts"] = anchors, len(lengths)
    return parts


def online_flops(tcfg, dcfg, rounds_per_prompt, lengths):
    """FLOPs of the online loop: prefill, then per round a B-token verify pass over the cache plus the
    drafter block, its lm_head and the context rows it adds."""
    t, d = tcfg.to_dict(), dcfg
    H, V, B, L = t["hidden_size"], t["vocab_size"], d["block_size"], t["num_hidden_layers"]
    t_attn = t["num_attention_heads"] * t["head_dim"]
    d_attn = d["num_attention_heads"] * d["head_dim"]
    per_block = (2 * d["num_hidden_layers"] * linear_params(d) * B + 2 * H * V * (B - 1))
    total = 0
    for rounds, (n_p, n_c) in zip(rounds_per_prompt, lengths):
        total += 2 * L * linear_params(t) * n_p + L * 2 * t_attn * n_p * (n_p + 1) + 2 * H * V
        a = n_p
        for r in rounds:
            total += 2 * (L * linear_params(t) + H * V) * B + L * 4 * t_attn * (B * a + B * (B + 1) // 2)
            total += per_block + d["num_hidden_layers"] * 4 * d_attn * B * (a + B)
            a += r
        total += 2 * len(dcfg["dflash_config"]["target_layer_ids"]) * H * H * (n_p + n_c)
    return total


# ----------------------------------------------------------------------------------------------------
# b and d: the tool itself, in-process, timed from its JSON


def tool_argv(paths, args, out, *extra):
    argv = ["--target", paths["target"], "--ckpt", "bench=" + paths["drafter"], "--device", args.device,
            "--ddtree-budgets", BUDGETS, "--output", out, "--quiet", *extra]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return argv


def run_tool(argv):
    """ed.main in this process, its report on stdout swallowed; the JSON report back."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = ed.main(argv)
    out = argv[argv.index("--output") + 1]
    if rc != 0:
        raise SystemExit(f"eval_drafter exited {rc}: {stderr.getvalue().strip()}")
    with open(out) as f:
        report = json.load(f)
    report["stderr"] = stderr.getvalue()
    return report


def stage_best(reports, stages):
    timing = [r["timing"] for r in reports]
    med = {s: best([t.get(s, 0.0) for t in timing]) for s in ("load_s", "generate_s", "total_s") + stages}
    med["work_s"] = best([sum(t.get(s, 0.0) for s in stages) for t in timing])
    med["eval_s"] = best([t["total_s"] - t.get("load_s", 0.0) for t in timing])
    med["work_runs"] = [sum(t.get(s, 0.0) for s in stages) for t in timing]   # every run, to show the spread
    return med


WORK_STAGES = ("target_s", "drafter_s", "trees_s", "metrics_s")


def measure_b(paths, args, work, extra=(), warm_up=True, runs=None):
    """Warm-up (which also saves the hidden states d reads), then --repeats runs (or `runs`)."""
    out = os.path.join(work, "b.json")
    hidden = os.path.join(work, "hidden.safetensors")
    if warm_up:
        run_tool(tool_argv(paths, args, out, "--prompts", paths["prompts"], "--save-hidden", hidden, *extra))
    reports = [run_tool(tool_argv(paths, args, out, "--prompts", paths["prompts"], *extra))
               for _ in range(runs or args.repeats)]
    return stage_best(reports, WORK_STAGES), reports[-1], hidden


def measure_d(paths, args, work, hidden):
    out = os.path.join(work, "d.json")
    argv = tool_argv(paths, args, out, "--load-hidden", hidden)
    run_tool(argv)
    reports = [run_tool(argv) for _ in range(args.repeats)]
    return stage_best(reports, ("drafter_s", "trees_s", "metrics_s")), reports[-1]


def has_flag(flag):
    return flag in inspect.getsource(ed.parse_args)


def profile_b(paths, args, work, top=16):
    """One b run under cProfile: the functions and torch ops with the most time of their own."""
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    rep = run_tool(tool_argv(paths, args, os.path.join(work, "prof.json"), "--prompts", paths["prompts"]))
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(((tt, nc, func) for func, (_, nc, tt, _, _) in stats.items()), reverse=True)[:top]
    work_s = sum(rep["timing"].get(s, 0.0) for s in WORK_STAGES)
    lines = [f"one profiled b run: target + drafter + trees + metrics = {work_s:.2f} s (profiler overhead "
             "included)",
             f"{'own s':>8} {'share':>6} {'calls':>7}  function"]
    for tt, nc, (file, line, name) in rows:
        where = name if file == "~" else f"{os.path.basename(file)}:{line}({name})"
        lines.append(f"{tt:8.3f} {tt / work_s:6.1%} {nc:7d}  {where}")
    lines += ["", "grouped:"] + [f"{tt:8.3f} {tt / work_s:6.1%}  {label}" for label, tt in profile_ops(stats).items()]
    return lines


# ----------------------------------------------------------------------------------------------------
# h. sampled evaluation against greedy

QWEN3 = ("--temperature", "0.6", "--top-p", "0.95", "--top-k", "20")   # Qwen3's thinking-mode settings
SAMPLED_RUNS = {"argmax": QWEN3, "sample": QWEN3, "sample, top-p alone": ("--temperature", "1.0", "--top-p", "0.95")}


def measure_sampled(paths, args, work):
    """b's runs at sampled settings (references given), best of --repeats after a warm-up, per SAMPLED_RUNS."""
    out = {}
    for name, settings in SAMPLED_RUNS.items():
        extra = ("--prompts", paths["prompts"], *settings, "--draft-policy", name.split(",")[0])
        run_tool(tool_argv(paths, args, os.path.join(work, "h.json"), *extra))   # warm-up
        out[name] = stage_best([run_tool(tool_argv(paths, args, os.path.join(work, "h.json"), *extra))
                                for _ in range(args.repeats)], WORK_STAGES)
    return out


def report_sampled(h, b):
    for name, t in h.items():
        say(f"h. sampled evaluation, references given ({' '.join(SAMPLED_RUNS[name])}; {name} proposals): target "
            f"{t['target_s']:.2f} s, drafter {t['drafter_s']:.2f} s, trees {t['trees_s']:.3f} s, metrics "
            f"{t['metrics_s']:.3f} s; sum {t['work_s']:.2f} s = x{t['work_s'] / b['work_s']:.2f} b's greedy evaluation")


# ----------------------------------------------------------------------------------------------------
# g. DFlash 2 against DFlash, drafter only

DFLASH2_BENCH = {"conv_kernel_size": 2, "conv_group_size": 64, "selector_rank": 64, "selector_top_k": 16}


def measure_dflash2(paths, args, work, dcfg):
    """Per anchor: DFlash, DFlash 2, DFlash 2 without its selector, DFlash 2 without conv taps, all on the
    longest prompt's features (best of --repeats after a warm-up)."""
    from dataclasses import replace
    path = os.path.join(work, "drafter2")
    cfg = {**dcfg, "architectures": ["DFlash2DraftModel"], "dflash_config": {**dcfg["dflash_config"], **DFLASH2_BENCH}}
    weights = dr.dflash2_weights(cfg, md.random_drafter_weights(dcfg, 3, seed=0, scale=0.05), DFLASH2_BENCH)
    md.save_drafter(path, cfg, weights)
    model, one = load_for_loop(paths, args)
    two = ed.load_drafter("dflash2=" + path, ed.read_target_config(paths["target"]), bench_settings(paths, args))
    no_taps = replace(two, conv=(), weights={k: v for k, v in two.weights.items() if "_conv." not in k})
    variants = {"DFlash": one, "DFlash 2": two, "DFlash 2 without selector": replace(two, selector_top_k=0),
                "DFlash 2 without conv taps": no_taps}
    return time_per_anchor(paths, args, model, variants, one.block_size)


def bench_settings(paths, args):
    argv = tool_argv(paths, args, os.devnull, "--prompts", paths["prompts"])
    return ed.quietly(ed.prepare(ed.resolve_settings(ed.parse_args(argv)), ranks=False))


def time_per_anchor(paths, args, model, variants, span):
    """Each drafter's time per anchor on the longest prompt's features, at the anchors where a round of `span`
    tokens fits: its context (DFlash's projected K/V; EAGLE-3's causal pass over the text) and draft_all_anchors
    (best of --repeats after a warm-up)."""
    item = max(tool_prompts(paths["prompts"], paths["target"]), key=lambda it: len(it.prompt_ids))
    ids = item.prompt_ids + item.completion_ids
    layers = sorted({L for d in variants.values() for L in d.layers})
    features = ed.extract_hidden(model, ids, layers, len(item.prompt_ids)).features
    anchors = ed.fitting_anchors(len(item.prompt_ids), len(ids), span).to(args.device)
    ids_t = torch.tensor(ids, device=args.device)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    times = {name: [] for name in variants}
    for i in range(2 * args.repeats + 1):   # the variants in turn, so that a slow spell of the machine hits all
        for name, d in variants.items():
            sync(args.device)
            start = time.perf_counter()
            ed.draft_all_anchors(d, ed.prompt_context(d, features, ids, embed), anchors, ids_t[anchors], embed, head)
            sync(args.device)
            if i:
                times[name].append(time.perf_counter() - start)
    return {"per_anchor": {name: best(t) / len(anchors) for name, t in times.items()}, "anchors": len(anchors)}


# ----------------------------------------------------------------------------------------------------
# l. DSpark, Domino, XPress, LiLiCorr, EAGLE-3, P-EAGLE and MTP against DFlash, drafter only

FAMILY_BENCH = {   # name: (generation, head, dflash_config keys); rank 256 is speculators' default, Domino alike
    "DSpark vanilla": ("DSpark", {"kind": "vanilla", "rank": 256, "topk": 0},
                       {"markov_rank": 256, "markov_head_type": "vanilla"}),
    "DSpark rnn": ("DSpark", {"kind": "rnn", "rank": 256, "topk": 0}, {"markov_rank": 256, "markov_head_type": "rnn"}),
    "Domino": ("Domino", {"prefix": 1, "shift": False, "pool": 0},
               {"emb_dim": 256, "gru_hidden_dim": 256, "pure_draft_prefix_len": 1, "shift_label": False}),
}


LILICORR_BENCH = {"candidate_topk": 4, "hidden_size": 0, "num_layers": 2, "num_heads": 4, "mlp_ratio": 2.0,
                  "factor_dim": 64, "vector_eps": 1e-4, "logit_scale": 8.0}
NEW_FAMILY_BENCH = {   # name: (dflash_config keys, {tensor: shape} of its head): vLLM's defaults (XPress rank 256, MLP
    # 512, 6 passes, top-512 candidates); LiLiCorr at modelopt's published test knobs, its width the drafter's
    "XPress": ({"xpress_rank": 256, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6},
               lambda c: {ed.XPRESS + k: s for k, s in {
                   "token_embed.weight": (c["vocab_size"], 256), "down_h.weight": (256, c["hidden_size"]),
                   "down_g.weight": (256, c["hidden_size"]), "in_proj.weight": (256, 768),
                   "mix_l": (256, c["block_size"], c["block_size"]), "mlp_gate.weight": (512, 256),
                   "mlp_up.weight": (512, 256), "mlp_down.weight": (256, 512),
                   "readout.weight": (c["vocab_size"], 256)}.items()}),
    "LiLiCorr": ({"lilicorr_" + k: v for k, v in LILICORR_BENCH.items()},
                 lambda c: {ed.LILICORR + k: s for k, s in ed.lilicorr_tensors(
                     {**LILICORR_BENCH, "width": c["hidden_size"], "block": c["block_size"]}, c["hidden_size"]).items()}),
}


def measure_families(paths, args, work, dcfg):
    """Per anchor: DFlash, then each family drafter of the same backbone shape with its head and without it (the
    same block's rows through one batched argmax): the difference is the sequential part, slot by slot."""
    from dataclasses import replace
    model, one = load_for_loop(paths, args)
    settings = bench_settings(paths, args)
    variants = {"DFlash": one}
    for name, (generation, head, dflash) in FAMILY_BENCH.items():
        path = os.path.join(work, name.replace(" ", "_"))
        cfg = {**dcfg, "architectures": [generation + "DraftModel"], "dflash_config": {**dcfg["dflash_config"], **dflash}}
        weights = md.random_drafter_weights(dcfg, 3, seed=0, scale=0.05)
        weights.update(md.head_weights(generation, head, dflash, dcfg["hidden_size"], dcfg["vocab_size"],
                                       torch.Generator().manual_seed(1)))
        md.save_drafter(path, cfg, weights)
        d = ed.load_drafter(f"{name}={path}", ed.read_target_config(paths["target"]), settings)
        variants[name], variants[name + " without its head"] = d, replace(d, generation="DFlash")
    # EAGLE-3 of the same hidden size: one layer (the DFlash drafter's widths), one step per DFlash draft
    layer = {k: dcfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta", "vocab_size")}
    layer.update(model_type="qwen3", num_hidden_layers=1, attention_bias=False)
    path = os.path.join(work, "eagle3")
    md.save_drafter(path, md.eagle3_config(layer, one.layers, one.block_size - 1),
                    md.eagle3_weights(layer, len(one.layers), 0, scale=0.05))
    variants["EAGLE-3"] = ed.load_drafter(f"eagle3={path}", ed.read_target_config(paths["target"]), settings)
    # The target's MTP layer of the same widths (Qwen3.5's: gated attention, fc over [embedding; last hidden])
    weights = {k: v.to(device=args.device, dtype=one.weights["fc.weight"].dtype)
               for k, v in md.mtp_weights(layer, 0, scale=0.05).items()}
    variants["MTP"] = replace(md.mtp_drafter(layer, weights, one.block_size - 1, ed.build_rope(layer, args.device),
                                             model.config.num_hidden_layers - 1), logit_rows=one.logit_rows)
    # P-EAGLE: the EAGLE-3 layer drafting its K tokens in one pass (the bonus row and K - 1 mask slots)
    path = os.path.join(work, "peagle")
    md.save_drafter(path, {**md.eagle3_config(layer, one.layers, one.block_size - 1), "speculators_model_type": "peagle",
                           "mask_token_id": one.mask_token_id},
                    {**md.eagle3_weights(layer, len(one.layers), 0, scale=0.05),
                     "mask_hidden": torch.randn(1, 1, len(one.layers) * layer["hidden_size"]) * 0.05})
    variants["P-EAGLE"] = ed.load_drafter(f"peagle={path}", ed.read_target_config(paths["target"]), settings)
    # XPress and LiLiCorr: the DFlash drafter's backbone plus their heads at the engines' published sizes
    for name, (keys, shapes) in NEW_FAMILY_BENCH.items():
        path = os.path.join(work, name)
        cfg = {**dcfg, "architectures": [name + "DraftModel"], "dflash_config": {**dcfg["dflash_config"], **keys}}
        g, weights = torch.Generator().manual_seed(2), md.random_drafter_weights(dcfg, 3, seed=0, scale=0.05)
        weights.update({k: torch.ones(s) if k.endswith("norm.weight") else torch.randn(*s, generator=g) * 0.05
                        for k, s in shapes(dcfg).items()})
        md.save_drafter(path, cfg, weights)
        variants[name] = ed.load_drafter(f"{name}={path}", ed.read_target_config(paths["target"]), settings)
        variants[name + " without its head"] = replace(variants[name], generation="DFlash")
    return time_per_anchor(paths, args, model, variants, one.block_size + 1)   # DSpark's rounds are one longer


def report_families(f):
    t = f["per_anchor"]
    one = t["DFlash"]
    parts = [f"{name} {t[name] * 1e3:.3f} ms (x{t[name] / one:.2f}; sequential part "
             f"{(t[name] - t[name + ' without its head']) / t[name]:.1%})" for name in FAMILY_BENCH]
    parts += [f"{name} {t[name] * 1e3:.3f} ms (x{t[name] / one:.2f}; its head's part "
              f"{(t[name] - t[name + ' without its head']) / t[name]:.1%})" for name in NEW_FAMILY_BENCH]
    parts += [f"{name} {t[name] * 1e3:.3f} ms (x{t[name] / one:.2f})" for name in ("EAGLE-3", "P-EAGLE", "MTP")]
    say(f"l. DSpark, Domino, XPress, LiLiCorr, EAGLE-3, P-EAGLE and MTP against DFlash of the same shape, drafter only "
        "(its context included), "
        f"{f['anchors']} anchors, per anchor: "
        f"DFlash {one * 1e3:.3f} ms; " + "; ".join(parts) + " (DSpark drafts one more token a round: its anchor's "
        "slot drafts too)")


def report_dflash2(g):
    t = g["per_anchor"]
    one, two = t["DFlash"], t["DFlash 2"]
    say(f"g. DFlash 2 (conv taps {DFLASH2_BENCH['conv_kernel_size']}, groups of {DFLASH2_BENCH['conv_group_size']} "
        f"channels, selector rank {DFLASH2_BENCH['selector_rank']} x {DFLASH2_BENCH['selector_top_k']} candidates) "
        f"against DFlash of the same shape, drafter only, {g['anchors']} anchors: "
        f"{two * 1e3:.3f} ms per anchor vs {one * 1e3:.3f} ms (x{two / one:.2f}); the selector's share of DFlash 2 "
        f"{(two - t['DFlash 2 without selector']) / two:.1%}, the conv taps' "
        f"{(two - t['DFlash 2 without conv taps']) / two:.1%}")


# ----------------------------------------------------------------------------------------------------
# c. the online greedy speculative loop, public style


def new_cache(model):
    from transformers import DynamicCache
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def crop(cache, keep):
    """Roll the KV cache back to its first `keep` positions. transformers 5.x's crop takes a negative count
    of positions to remove (a positive argument is refused); 4.x's takes the length to keep, and a negative
    value there also means 'remove that many' - so the negative form works on both."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def context_rows(drafter, feats, start):
    """The drafter's context K/V for target features at absolute positions start.. (what ed.drafter_context
    computes for a whole prompt from position 0): lets the loop add only the rows each round commits."""
    w, cfg = drafter.weights, drafter.cfg
    eps, n_kv, hd = cfg.get("rms_norm_eps", 1e-6), cfg["num_key_value_heads"], ed.head_dim_of(cfg)
    ctx = ed.rms_norm(F.linear(feats, w["fc.weight"]), w["hidden_norm.weight"], eps)
    cos, sin = ed.rope_cos_sin(drafter, torch.arange(start, start + ctx.shape[0], device=ctx.device), ctx.dtype)
    kv = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}.self_attn."
        k = ed.rms_norm(ed.heads(ed.linear(ctx, w, p + "k_proj"), n_kv, hd), w[p + "k_norm.weight"], eps)
        kv.append((ed.apply_rope(k, cos, sin), ed.heads(ed.linear(ctx, w, p + "v_proj"), n_kv, hd)))
    return kv


def features(hidden_states, layers, rows):
    return torch.cat([hidden_states[L + 1][0, rows] for L in layers], dim=-1)


@torch.inference_mode()
def speculative_loop(model, drafter, prompt_ids, n_completion):
    """Greedy speculative decoding: prefill; then per round draft a block at the last committed token from
    the context of every earlier position, verify it in one cached target pass, keep the accepted drafts
    and the target's bonus token, crop the cache. Stops where the tool's walk stops (the next block's
    drafts would pass the end of the reference), so it does the rounds b replays. Returns (tokens, rounds)."""
    device, B, layers = model.device, drafter.block_size, drafter.layers
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = new_cache(model)
    n_p = len(prompt_ids)
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True, output_hidden_states=True,
                logits_to_keep=1, **{cache_arg: cache})
    ctx = context_rows(drafter, features(out.hidden_states, layers, slice(None)), 0)
    tokens = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
    rounds, total = [], n_p + n_completion
    mask_block = torch.full((1, B), drafter.mask_token_id, device=device)
    while len(tokens) - 1 + B - 1 <= total - 1:
        anchor = len(tokens) - 1
        block = mask_block.clone()
        block[0, 0] = tokens[anchor]
        hidden = ed.drafter_forward(drafter, ctx, torch.tensor([anchor], device=device), block, embed)
        drafts = head(hidden[0, 1:]).argmax(-1)
        out = model(input_ids=torch.cat([block[0, :1], drafts])[None], use_cache=True, output_hidden_states=True,
                    **{cache_arg: cache})
        greedy = out.logits[0].argmax(-1)
        matched = int((drafts == greedy[:-1]).long().cumprod(0).sum())
        tokens += drafts[:matched].tolist() + [int(greedy[matched])]
        rounds.append(matched + 1)
        new = context_rows(drafter, features(out.hidden_states, layers, slice(0, matched + 1)), anchor)
        ctx = [(torch.cat([k, nk], 1), torch.cat([v, nv], 1)) for (k, v), (nk, nv) in zip(ctx, new)]
        crop(cache, anchor + matched + 1)
    return tokens[n_p:], rounds


def load_for_loop(paths, args):
    settings = ed.prepare(ed.resolve_settings(ed.parse_args(tool_argv(paths, args, os.devnull, "--prompts",
                                                                       paths["prompts"]))), ranks=False)
    model, _ = ed.load_target(settings)
    drafter = ed.load_drafter("bench=" + paths["drafter"], ed.read_target_config(paths["target"]), settings)
    return model, drafter


def check_context_rows(model, drafter, item):
    """context_rows in pieces must equal the tool's drafter_context over the whole prompt."""
    ids = item.prompt_ids + item.completion_ids
    feats = ed.extract_hidden(model, ids, drafter.layers, len(item.prompt_ids)).features
    whole = ed.drafter_context(drafter, torch.cat([feats[L] for L in drafter.layers], -1))
    cut = len(ids) // 3
    f = torch.cat([feats[L] for L in drafter.layers], -1)
    parts = [context_rows(drafter, f[:cut], 0), context_rows(drafter, f[cut:], cut)]
    tol = 1e-3 if whole[0][0].dtype == torch.float32 else 3e-2
    for (k, v), (k0, v0), (k1, v1) in zip(whole, *parts):
        torch.testing.assert_close(torch.cat([k0, k1], 1), k, rtol=tol, atol=tol)
        torch.testing.assert_close(torch.cat([v0, v1], 1), v, rtol=tol, atol=tol)


def measure_c(paths, args, b_report):
    """--repeats runs of the loop over every prompt after a short warm-up; per-prompt times kept too."""
    model, drafter = load_for_loop(paths, args)
    items = tool_prompts(paths["prompts"], paths["target"])
    check_context_rows(model, drafter, items[0])
    speculative_loop(model, drafter, items[0].prompt_ids, 2 * args.block)  # warm-up: a few rounds
    runs, results = [], None
    for _ in range(args.repeats):
        per_prompt, results = [], []
        for it in items:
            sync(args.device)
            start = time.perf_counter()
            results.append(speculative_loop(model, drafter, it.prompt_ids, len(it.completion_ids)))
            sync(args.device)
            per_prompt.append(time.perf_counter() - start)
        runs.append(per_prompt)
    b_prompts = b_report["drafters"][0]["prompts"]
    rounds = [r for _, r in results]
    differ = [(it.id, first_difference(t, it.completion_ids), p["first_divergence"])
              for (t, _), it, p in zip(results, items, b_prompts) if t != it.completion_ids[:len(t)]]
    return {"s": best([sum(r) for r in runs]), "per_prompt": [best(p) for p in zip(*runs)], "n": len(items),
            "rounds": rounds, "same_rounds": sum(r == p["rounds"] for r, p in zip(rounds, b_prompts)),
            "differ": differ, "tokens": [len(t) for t, _ in results],
            "tau": sum(map(sum, rounds)) / max(1, sum(map(len, rounds))),
            "generation": profile_generation(model, drafter, items[0])}


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def profile_generation(model, drafter, item, n_tokens=GEN_TOKENS):
    """cProfile of the tool's own speculative_generate on one prompt: cumulative seconds of its parts."""
    import cProfile
    import pstats
    if not hasattr(ed, "speculative_generate"):
        return None
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    tokens = ed.speculative_generate(model, drafter, item.prompt_ids, n_tokens, set())
    prof.disable()
    wall = time.perf_counter() - start
    cum = {name: ct for (file, _, name), (_, _, _, ct, _) in pstats.Stats(prof).stats.items()
           if file.endswith("eval_drafter.py")}
    parts = ("target_pass", "draft_all_anchors", "drafter_context", "drafter_forward")
    return {"tokens": len(tokens), "speculative_generate": wall, **{k: cum.get(k, 0.0) for k in parts}}


# ----------------------------------------------------------------------------------------------------
# e. peak memory of b in a clean child process

# The peak is VmHWM (this process's own high-water mark): ru_maxrss is no good in a child, since Linux
# carries the parent's RSS at fork into it across exec, and this parent holds a model.
PEAK_CHILD = """
import json, re, resource, sys
def hwm_kib():
    try:
        return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
sys.path.insert(0, {root!r})
import torch, transformers, eval_drafter as ed
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.qwen3 import modeling_qwen3  # imported by every run: part of the baseline
base = hwm_kib()
rc = ed.main({argv!r})
peak = hwm_kib()
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
json.dump({{"rc": rc, "base_kib": base, "peak_kib": peak, "gpu_bytes": gpu}}, open({out!r}, "w"))
"""


def measure_e(paths, args, work):
    out = os.path.join(work, "peak.json")
    argv = tool_argv(paths, args, os.path.join(work, "e.json"), "--prompts", paths["prompts"])
    code = PEAK_CHILD.format(root=ROOT, argv=argv, out=out)
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return json.load(open(out))


def memory_needed(paths, tcfg, dcfg, lengths, device):
    """Bytes of target + drafter weights and of the selected layers' features (all prompts), run dtype."""
    from safetensors import safe_open
    size = torch.finfo(run_dtype(device)).bits // 8
    params = {}
    for name in ("target", "drafter"):
        with safe_open(os.path.join(paths[name], "model.safetensors"), "pt") as f:
            params[name] = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    k = len(dcfg["dflash_config"]["target_layer_ids"])
    feats = sum(k * (n_p + n_c) * tcfg.hidden_size for n_p, n_c in lengths) * size
    return {"target_params": params["target"], "drafter_params": params["drafter"],
            "weights_bytes": (params["target"] + params["drafter"]) * size, "features_bytes": feats,
            "features_one_prompt": max(k * (n_p + n_c) * tcfg.hidden_size for n_p, n_c in lengths) * size}


# ----------------------------------------------------------------------------------------------------
# Whole process: the demo run as a user runs it, imports apart; reference generation when the tool has it


def demo_process(args, work):
    """Wall time of `eval_drafter.py --demo --limit 2 --quiet` (plus --output for its stage timing), and the
    import time the same command spends (-X importtime: every top-level import's cumulative time)."""
    out = os.path.join(work, "demo.json")
    cmd = [sys.executable, TOOL, "--demo", "--limit", "2", "--quiet", "--output", out]
    walls, imports, timings = [], [], []
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        if i:  # the first run warms the page cache
            walls.append(time.perf_counter() - start)
            timings.append(json.load(open(out))["timing"])
    for _ in range(args.repeats):
        err = subprocess.run([sys.executable, "-X", "importtime"] + cmd[1:], check=True, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True).stderr
        top_level = [(int(m.group(1)) / 1e6, m.group(2))
                     for m in re.finditer(r"^import time:\s+\d+ \|\s+(\d+) \| (\S+)", err, re.M)]
        imports.append(sum(t for t, _ in top_level))
    biggest = sorted(top_level, reverse=True)[:5]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = time.perf_counter() - start
    keys = sorted({k for t in timings for k in t})
    return {"wall_s": best(walls), "import_s": best(imports), "python_s": bare, "biggest_imports": biggest,
            "timing": {k: best([t.get(k, 0.0) for t in timings]) for k in keys}}


BUSY_SPINCOUNTS = {"default": None, "libgomp's own spin": "300000", "--threads 1": None}


def busy_box(args):
    """Whole-process wall time of `eval_drafter.py --demo --quiet` on an idle box and with 2 x cores other
    processes spinning: the tool's default threads, the same with libgomp's own spin count (what the default was
    before the tool shortened it), and --threads 1. Goal: the default within 2x of --threads 1 on the busy box."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    figures = {}
    for busy in (0, 2 * cores):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            for label, spin in BUSY_SPINCOUNTS.items():
                env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
                env.update({"GOMP_SPINCOUNT": spin} if spin else {})
                cmd = [sys.executable, TOOL, "--demo", "--quiet"] + (["--threads", "1"] if "threads" in label else [])
                walls = []
                for _ in range(1 if busy else max(2, args.repeats)):
                    start = time.perf_counter()
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
                    walls.append(time.perf_counter() - start)
                figures[(busy, label)] = best(walls)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    return {"cores": cores, "busy": 2 * cores, "walls": figures}


def report_busy(m):
    for busy in (0, m["busy"]):
        say(f"busy box: `eval_drafter.py --demo --quiet` with {busy} spinning processes on {m['cores']} cores: "
            + ", ".join(f"{label} {m['walls'][(busy, label)]:.1f} s" for label in BUSY_SPINCOUNTS))


def busy_verdict(m):
    ratio = m["walls"][(m["busy"], "default")] / m["walls"][(m["busy"], "--threads 1")]
    return verdict(ratio <= 2, f"demo on a busy box with the default threads <= 2 x --threads 1: x{ratio:.2f}")


def real_pair(args, work):
    """The real pair (python tests/fetch_real.py first): SmolLM2-135M-Instruct's Q4_1 GGUF converted afresh (a link
    to it in `work`, so the repository's converted copy is not reused) and the converted copy loaded again; then the
    whole `eval_drafter.py --demo real --quiet` process under the old default (--reference-generation speculative)
    and the new one (auto), each with the target pass in tokens per second and the drafter's time per anchor from
    its JSON timing (the anchors: every completion token)."""
    gguf = os.path.join(ROOT, "tests", "fixtures", "real", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(gguf):
        raise SystemExit(f"row r needs {gguf}: run python tests/fetch_real.py first")
    link = os.path.join(work, "smol.gguf")
    os.symlink(gguf, link)
    code = ("import sys, time; sys.path.insert(0, {root!r}); import eval_drafter as ed; t = time.perf_counter(); "
            "ed.gguf_target({path!r}, True); print(time.perf_counter() - t)")
    convert, again = (float(subprocess.run([sys.executable, "-c", code.format(root=ROOT, path=link)], check=True,
                                           capture_output=True, text=True).stdout.split()[-1]) for _ in range(2))
    runs = {}
    for label, extra in (("speculative (the old default)", ["--reference-generation", "speculative"]),
                         ("auto (the new default)", [])):
        out = os.path.join(work, "real.json")
        start = time.perf_counter()
        subprocess.run([sys.executable, TOOL, "--demo", "real", "--quiet", "--output", out, *extra], check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        report = json.load(open(out))
        prompts = report["drafters"][0]["prompts"]
        tokens = sum(p["prompt_tokens"] + p["completion_tokens"] for p in prompts)
        anchors = sum(p["completion_tokens"] for p in prompts)
        t = report["timing"]
        runs[label] = {"wall_s": wall, "timing": t, "tokens": tokens, "anchors": anchors,
                       "tau": report["drafters"][0]["tau"], "prompts": len(prompts),
                       "target_tok_s": tokens / t["target_s"], "drafter_ms_anchor": 1e3 * t["drafter_s"] / anchors,
                       "generate_tok_s": anchors / t["generate_s"] if t.get("generate_s") else None,
                       "used": report["config"]["reference_generation_used"],
                       "choice": report["config"].get("reference_generation_choice")}
    return {"convert_s": convert, "converted_s": again, "runs": runs}


def report_real(r):
    say(f"r. the real pair (SmolLM2-135M-Instruct Q4_1 GGUF + tests/fixtures/real_drafter): GGUF converted in "
        f"{r['convert_s']:.1f} s, found converted in {r['converted_s']:.1f} s")
    for label, x in r["runs"].items():
        t = x["timing"]
        say(f"   `eval_drafter.py --demo real --quiet`, {label}: {x['wall_s']:.1f} s whole process over {x['prompts']} "
            f"prompts (tau {x['tau']:.3f}): load {t.get('load_s', 0):.1f} s, references {t.get('generate_s', 0):.1f} s "
            f"({x['generate_tok_s']:.1f} tokens/s, by {x['used']}), target pass {t['target_s']:.1f} s "
            f"({x['target_tok_s']:.0f} tokens/s over {x['tokens']} tokens), drafter {t['drafter_s']:.1f} s "
            f"({x['drafter_ms_anchor']:.2f} ms per anchor over {x['anchors']} anchors)")
        if x["choice"]:
            say(f"      its choice: {x['choice']}")


def entry_point(args, work):
    """t: measure() per call (best of --repeats after a warm-up), the drafter's stages inside it (eval_drafter's
    TIMING: drafter, trees, metrics, feature check), and the CLI over the same saved features, whole process; on this
    box as it is, and with 2 x cores other processes spinning (a busy training box), under the old default (the
    caller's torch threads: one a core, torch's default in a fresh process, whatever this one was left with) and the
    new one (one thread for the pass)."""
    from safetensors.torch import load_file
    demo = os.path.join(ROOT, "tests", "fixtures", "demo")
    saved = os.path.join(work, "demo_features.safetensors")
    subprocess.run([sys.executable, TOOL, "--demo", "--quiet", "--save-hidden", saved], check=True,
                   stdout=subprocess.DEVNULL)
    cfg = json.load(open(os.path.join(demo, "drafter", "config.json")))
    weights = load_file(os.path.join(demo, "drafter", "model.safetensors"))
    start = time.perf_counter()
    features = ed.load_features(saved, os.path.join(demo, "target"))
    load = time.perf_counter() - start
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    calls = {}
    for busy in (0, 2 * cores):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            for label, threads in (("old default", max(cores, torch.get_num_threads())), ("new default", 1)):
                features.threads = threads
                ed.measure(weights, features, config=cfg)   # warm-up
                runs, stages = [], []
                for _ in range(max(3, args.repeats)):
                    start = time.perf_counter()
                    r = ed.measure(weights, features, config=cfg)
                    runs.append(time.perf_counter() - start)
                    stages.append(sum(ed.TIMING.values()))
                calls[(busy, label)] = (best(runs), best(stages), threads)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    start = time.perf_counter()
    subprocess.run([sys.executable, TOOL, "--target", os.path.join(demo, "target"), "--ckpt", os.path.join(demo, "drafter"),
                    "--load-hidden", saved, "--quiet"], check=True, stdout=subprocess.DEVNULL)
    return {"load_s": load, "calls": calls, "busy": 2 * cores, "cli_s": time.perf_counter() - start,
            "tau": r["tau"], "prompts": len(r["prompts"]), "anchors": r["anchors"]}


def report_entry(t):
    say(f"t. measure() on the demo pair ({t['prompts']} prompts, {t['anchors']} anchors, tau {t['tau']:.3f}): "
        f"load_features once {t['load_s']:.2f} s; the CLI from the same features, whole process, {t['cli_s']:.1f} s")
    for (busy, label), (call, stages, threads) in t["calls"].items():
        say(f"   {'idle box' if not busy else f'busy box ({busy} spinning processes)'}, {label} ({threads} thread"
            f"{'s' * (threads > 1)}): a call {1e3 * call:.0f} ms, of which the drafter pass {1e3 * stages:.0f} ms")


# p. Published speedups against the roofline: rows of bench/published_speedups.json (collected from the sources
# named there); each priced by eval_drafter's roofline at the published tau, for the published GPU and shapes.
PUBLISHED_ROWS = list(range(21, 31)) + list(range(63, 118, 6)) + [186, 191, 192, 197]   # DFlash Qwen3-8B at T 0 on
# B200 (z-lab's README) and H200 (the DDTree paper, plain DFlash), EAGLE-2 / EAGLE-3 trees on A100 (Spec-Bench)
GPU_NAMES = {"B200": "B200", "H200": "H200", "A100": "A100", "3090": "RTX3090"}


def drafter_shape_of(dr, target):
    """A public drafter's passes from its published shape: DFlash's layers and fc over its feature layers; an EAGLE
    head's one layer and fc over [embedding; hidden] (EAGLE-1/2) or three captured layers (EAGLE-3); the target's
    head."""
    tgt, H = target, dr["hidden_size"]
    nh, nkv, hd = tgt["num_attention_heads"], tgt["num_key_value_heads"], tgt["head_dim"]
    layers = dr["num_layers"]
    per = H * (nh + nkv) * hd * 2 + 3 * H * dr.get("intermediate_size", tgt["intermediate_size"])
    fc = H * H * (len(dr["target_layer_ids"]) if dr.get("target_layer_ids") else 3 if "EAGLE-3" in dr["family"] else 2)
    return {"dense": layers * per + fc, "expert": 0, "experts": 0, "picks": 0, "head": tgt["vocab_size"] * H,
            "layers": layers, "full_layers": layers, "kv_token": layers * 2 * nkv * hd * 2, "state": 0, "width": nh * hd}


def published(args):
    table = json.load(open(os.path.join(BENCH, "published_speedups.json")))["rows"]
    rows = []
    for r in (r for r in table if r["id"] in PUBLISHED_ROWS):
        gpu = ed.gpu_spec("gpu:" + next(v for k, v in GPU_NAMES.items() if k in r["gpu"]["name"]))
        target = {k: r["target"][k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")}
        t, d = ed.shape_of(target), drafter_shape_of(r["drafter"], target)
        context = 512   # a typical mid-reply context: the sources give prompts and replies of ~100 to 2k tokens
        if r["drafter"]["tree"]:   # EAGLE's dynamic tree: depth 5 of top-10 rows, then 60 tokens verified
            draft = ed.round_seconds(gpu, d, "chain", "tree", 1, context, {"steps": 5, "topk": 10})
            verify = ed.pass_seconds(gpu, t, 1, r["drafter"]["tree_nodes"], context)
        else:
            K = r["drafter"]["block_size"] - 1
            draft, verify = ed.round_seconds(gpu, d, "block", str(K), 1, context), ed.pass_seconds(gpu, t, 1, K + 1,
                                                                                                      context)
        predicted = r["tau"] * ed.pass_seconds(gpu, t, 1, 1, context) / (verify + draft)
        rows.append({"id": r["id"], "source": r["source"]["name"].split(" (")[0].split(",")[0], "url": r["source"]["url"],
                     "gpu": gpu["name"], "target": r["target"]["hf_name"], "drafter": r["drafter"]["family"],
                     "dataset": r["dataset"].split(" (")[0], "tau": r["tau"], "published": r["speedup"],
                     "predicted": predicted, "off": predicted / r["speedup"] - 1})
    return rows


def report_published(rows):
    say(f"p. published speedups against the roofline at the published tau (batch 1, context 512): "
        f"{sum(abs(r['off']) <= 0.2 for r in rows)} of {len(rows)} within 20%")
    say("| id | source | GPU | target | drafter | dataset | tau | published | predicted | off |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        say(f"| {r['id']} | [{r['source']}]({r['url']}) | {r['gpu']} | {r['target']} | {r['drafter']} | "
            f"{r['dataset']} | {r['tau']} | {r['published']}x | {r['predicted']:.2f}x | {100 * r['off']:+.0f}% |")


def ranked_8b(args, work):
    """q. A CPU box deciding for an H100: the demo drafter's tau at every depth (--depths all, measured here) priced
    for a Qwen3-8B target and its public DFlash drafter's shape (5 layers, block 16: the demo's depths scaled to it
    are not claimed; the ranking by batch size is the point) at batch 1, 32 and 128."""
    out = os.path.join(work, "depths.json")
    subprocess.run([sys.executable, TOOL, "--demo", "--depths", "all", "--quiet", "--output", out], check=True,
                   stdout=subprocess.DEVNULL)
    d = json.load(open(out))["drafters"][0]
    target = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936}
    drafter = drafter_shape_of({"hidden_size": 4096, "num_layers": 5, "target_layer_ids": [1, 9, 17, 25, 33],
                                "family": "DFlash"}, target)
    t, gpu, ranks = ed.shape_of(target), ed.gpu_spec("gpu:H100"), {}
    for batch in (1, 32, 128):
        ranks[batch] = sorted(((s["tau"] * ed.pass_seconds(gpu, t, batch, 1, 1024) /
                                (ed.pass_seconds(gpu, t, batch, int(k) + 1, 1024) +
                                 ed.round_seconds(gpu, drafter, "block", k, batch, 1024)), k)
                               for k, s in d["depths"].items()), reverse=True)
    return ranks


def report_ranked(ranks):
    for batch, rows in ranks.items():
        say(f"q. the demo drafter's tau by depth priced for Qwen3-8B + a 5-layer DFlash drafter on an H100, batch "
            f"{batch}: " + ", ".join(f"K={k} {x:.2f}x" for x, k in rows[:5]))


def busy_costs(args):
    """n. Three identical `--costs measure` runs with 2 x cores other processes spinning, two drafters (the demo's
    DFlash and a DSpark fixture) at depths 3,5 and DDTree 8: the best row each run names per drafter, or the leaders
    it calls indistinguishable."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    fixtures = os.path.join(os.path.dirname(TOOL), "tests", "fixtures")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * cores)]
    picks = []
    try:
        for _ in range(3):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "o.json")
                subprocess.run([sys.executable, TOOL, "--demo", "--ckpt", "demo=" + os.path.join(fixtures, "demo",
                                "drafter"), "--ckpt", "dspark=" + os.path.join(fixtures, "families", "dspark_vanilla"),
                                "--depths", "3,5", "--ddtree-budgets", "8", "--costs", "measure", "--quiet",
                                "--output", out], check=True, stdout=subprocess.DEVNULL)
                picks.append({d["name"]: (d["predicted_speedup"]["1"]["best"], d["predicted_speedup"]["1"]["leaders"],
                                          {n: (r["speedup"], r["speedup_ci95"]) for n, r in
                                           d["predicted_speedup"]["1"]["rows"].items() if r["speedup"]})
                              for d in json.load(open(out))["drafters"]})
    finally:
        for sp in spinners:
            sp.kill()
            sp.wait()
    return {"busy": 2 * cores, "picks": picks}


def report_busy_costs(n):
    for i, run in enumerate(n["picks"], 1):
        for name, (best, leaders, rows) in run.items():
            say(f"n. run {i} on a busy box ({n['busy']} spinning processes), {name}: " +
                (f"best {best}" if best else f"leaders {', '.join(leaders)}") + "; " +
                ", ".join(f"{k} {x:.2f}x [{c[0]:.2f}, {c[1]:.2f}]" for k, (x, c) in rows.items()))
    named = {tuple((name, tuple(sorted(leaders))) for name, (_, leaders, _) in run.items()) for run in n["picks"]}
    verdict(len(named) == 1, "three busy-box --costs measure runs name the same leaders for every drafter")


def reference_generation(paths, args, work):
    """generate_s of the tool's plain vs speculative reference generation: on the benchmark pair (random
    drafter, first prompt, GEN_TOKENS tokens with EOS ignored, one run each: slow) and on the bundled demo
    pair (trained drafter, --limit 2, best of --repeats runs after a warm-up)."""
    rows = {}
    for mode in ("plain", "speculative"):
        argv = tool_argv(paths, args, os.path.join(work, f"gen_{mode}.json"), "--prompts", paths["bare"],
                         "--limit", "1", "--ignore-eos", "--max-new-tokens", str(min(GEN_TOKENS, args.ref_tokens)),
                         "--ddtree-budgets", "none", "--reference-generation", mode)
        rep = run_tool(argv)
        rows[("bench", mode)] = (rep["timing"].get("generate_s", float("nan")), rep["drafters"][0]["tau"],
                                 rep["drafters"][0]["prompts"][0]["completion_tokens"])
        demo = ["--demo", "--limit", "2", "--quiet", "--output", os.path.join(work, f"demo_{mode}.json"),
                "--reference-generation", mode] + (["--threads", str(args.threads)] if args.threads else [])
        reps = [run_tool(demo) for _ in range(args.repeats + 1)][1:]
        rows[("demo", mode)] = (best([r["timing"].get("generate_s", float("nan")) for r in reps]),
                                reps[-1]["drafters"][0]["tau"], None)
    return rows


HYBRID_DEMO = os.path.join(ROOT, "tests", "fixtures", "demo_hybrid")


def hybrid_references(args):
    """i. Local references for a hybrid target: the tool's plain greedy decoding against its speculative
    decoding (recurrent state snapshot, restore and re-run on rejection) on the bundled hybrid demo pair,
    GEN_TOKENS tokens per prompt with EOS ignored, best of --repeats after a warm-up; the tokens must be
    equal. None where transformers has no Qwen3.5 model."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        return None
    device = args.device
    target = AutoModelForCausalLM.from_pretrained(os.path.join(HYBRID_DEMO, "target"), dtype=torch.float32)
    target.to(device).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(HYBRID_DEMO, "target"))
    drafter = ed.load_drafter(os.path.join(HYBRID_DEMO, "drafter"), target.config,
                              ed.Settings(dtype="float32", device=device, quiet=True))
    with open(os.path.join(HYBRID_DEMO, "prompts.jsonl")) as fh:
        prompts = [tok(json.loads(line)["prompt"])["input_ids"] for line in fh]
    rounds, verify = [], ed.verify

    def counted(*a):
        verdict = verify(*a)
        rounds.append(verdict[0])
        return verdict

    ed.verify = counted
    try:
        times = {"plain": [], "speculative": []}
        for run in range(args.repeats + 1):
            rounds.clear()
            for mode in times:
                t = time.perf_counter()
                out = [ed.plain_generate(target, ids, GEN_TOKENS, set()) if mode == "plain" else
                       ed.speculative_generate(target, drafter, ids, GEN_TOKENS, set()) for ids in prompts]
                sync(device)
                if run:
                    times[mode].append(time.perf_counter() - t)
                if mode == "plain":
                    plain = out
            assert out == plain, "hybrid speculative references differ from plain greedy decoding"
    finally:
        ed.verify = verify
    tokens = sum(map(len, plain))
    return {"plain_s": best(times["plain"]), "spec_s": best(times["speculative"]), "tokens": tokens,
            "prompts": len(prompts), "rounds": len(rounds),
            "tau": (tokens - len(prompts)) / len(rounds),   # the first token comes from the prompt pass
            "rejected": sum(a < drafter.block_size - 1 for a in rounds), "block": drafter.block_size}


def report_hybrid(i):
    if i is None:
        say("i. hybrid references: this transformers has no Qwen3.5 model; not measured")
        return
    say(f"i. hybrid references (bundled hybrid demo pair, {i['prompts']} prompts x {GEN_TOKENS} tokens, block "
        f"{i['block']}): plain greedy {i['plain_s']:.2f} s, speculative {i['spec_s']:.2f} s -> "
        f"x{i['plain_s'] / i['spec_s']:.2f}; tau {i['tau']:.2f} over {i['rounds']} rounds, {i['rejected']} with a "
        f"rejected draft (state restored, kept tokens re-run); tokens equal")


# ----------------------------------------------------------------------------------------------------
# Report


def secs(x):
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.2f} ms"


def gf(x):
    return f"{x / 1e9:,.1f} GFLOP"


def mib(x):
    return f"{x / 2 ** 20:,.0f} MiB"


def verdict(ok, text):
    say(f"{'PASS' if ok else 'FAIL'}  {text}")
    return {"ok": ok, "text": text}


def report_flops(rates, rate, fl):
    n = rate["n"]
    measured = " and ".join(f"{r['gflops']:.1f}" for r in rates)
    say(f"a. GEMM {n}x{n} @ {n}x{n}: {measured} GFLOP/s (best runs, before "
        f"and after b; the floor uses the higher)")
    say(f"   target pass: {gf(fl['target_total'])} (linear {gf(fl['target'])}, attention "
        f"{gf(fl['target_attention'])}, lm_head on completion rows {gf(fl['target_lm_head'])})")
    say(f"   drafter: {gf(fl['drafter_total'])} over {fl['anchors']} anchors (context {gf(fl['drafter_context'])}, "
        f"blocks {gf(fl['drafter_blocks'])}, attention {gf(fl['drafter_attention'])} useful / "
        f"{gf(fl['drafter_attention_executed'])} executed under the dense mask, lm_head {gf(fl['drafter_lm_head'])})")
    floor = {k: secs(fl[k] / rate["gflops"] / 1e9) for k in ("total", "target_total", "drafter_total")}
    say(f"   total {gf(fl['total'])}; floor {floor['total']} (target {floor['target_total']}, drafter "
        f"{floor['drafter_total']})")


def report_b(b, floor, fl, rate, b_report, b_walk):
    d = b_report["drafters"][0]
    say(f"b. eval_drafter, references given: target {b['target_s']:.2f} s, drafter {b['drafter_s']:.2f} s, "
        f"trees {b['trees_s']:.3f} s, metrics {b['metrics_s']:.3f} s; sum {b['work_s']:.2f} s; JSON total "
        f"{b['total_s']:.2f} s, load {b['load_s']:.2f} s (excluded) -> eval {b['eval_s']:.2f} s{others('b')}")
    say(f"   sum per timed run: " + ", ".join(f"{x:.2f}" for x in b["work_runs"]) + " s (the best is used)")
    say(f"   sum / floor = {b['work_s'] / floor:.2f}; achieved: target {fl['target_total'] / b['target_s'] / 1e9:.1f}"
        f" GFLOP/s, drafter {fl['drafter_total'] / b['drafter_s'] / 1e9:.1f} GFLOP/s (GEMM {rate['gflops']:.1f})")
    ddt = ", ".join(f"DDTree {k}: {v['tau']:.3f}" for k, v in d["ddtree"].items())
    say(f"   tau {d['tau']:.3f} ({d['rounds']} rounds), {ddt}; target agreement {b_report['target']['agreement']:.4f}")
    if b_walk:
        say(f"   with --anchors walk (one run): drafter {b_walk['drafter_s']:.2f} s, trees {b_walk['trees_s']:.3f} "
            f"s, sum {b_walk['work_s']:.2f} s, eval {b_walk['eval_s']:.2f} s (walk / all = "
            f"{b_walk['work_s'] / b['work_s']:.2f}){others('b_walk')}")


def write_results(info, figures, verdicts, analysis, argv):
    cmd = "python bench/bench_eval.py" + ("" if not argv else " " + " ".join(argv))
    machine = (f"{info['cpu']}, {info['cores']} cores, torch threads {info['threads']}"
               + (f", GPU {info['gpu']}" if info.get("gpu") else ""))
    text = [
        "# eval_drafter.py benchmark",
        "",
        "Written by `bench/bench_eval.py` (rerun it to refresh this file). What is measured and how: see the",
        "script's docstring. Times are the best (fastest) of the timed runs after a warm-up: this machine is shared, "
        "and interference only ever adds time.",
        "",
        f"- machine: {machine}; load average before the run {info['load_before']:.2f}, after "
        f"{info['load_after']:.2f}",
        f"- python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, device "
        f"{info['device']}",
        f"- date: {info['date']}; benchmark wall time {info['wall_s']:.0f} s",
        f"- command: `{cmd}`",
        "",
        "## Verdicts",
        "",
        *[f"- **{'PASS' if v['ok'] else 'FAIL'}** {v['text']}" for v in verdicts],
        "",
        "## Figures",
        "",
        "```",
        *figures,
        "```",
        "",
        "## What dominates, and what would move each figure",
        "",
        *analysis,
        "",
    ]
    kept = ""   # hand-written sections (optimisation log, device runs) below the marker survive a rewrite
    if os.path.isfile(RESULTS):
        with open(RESULTS, encoding="utf-8") as f:
            old = f.read()
        kept = old[old.index(KEPT_MARKER):] if KEPT_MARKER in old else ""
    with open(RESULTS, "w", encoding="utf-8") as f:
        f.write("\n".join(text) + ("\n" + kept if kept else ""))


PROFILE_OPS = {  # label: substrings of a cProfile function name (torch ops appear as built-ins)
    "linear (matmuls: target layers, drafter, both lm_heads)": ("_nn.linear",),
    "scaled_dot_product_attention": ("scaled_dot_product_attention",),
    "topk": ("'topk'", "torch.topk"), "log_softmax": ("'log_softmax'", "torch.log_softmax"),
    "isfinite": ("isfinite",), "argmax": ("'argmax'",), "max (argmax + NaN/Inf check)": ("'max'",), "build_tree (DDTree, Python)": ("(build_tree)", "heappush", "heappop"),
}


def profile_ops(stats):
    """Own time per PROFILE_OPS label from a pstats dict."""
    ops = dict.fromkeys(PROFILE_OPS, 0.0)
    for (file, line, name), (_, _, tt, _, _) in stats.items():
        label = f"{os.path.basename(file)}({name})" if file != "~" else name
        for key, needles in PROFILE_OPS.items():
            if any(n in label for n in needles):
                ops[key] += tt
    return ops


def analysis_text(f):
    """What dominates each figure and what would move it, with this run's numbers."""
    fl, rate, b, c, d, e, mem, proc = (f[k] for k in ("fl", "rate", "b", "c", "d", "e", "mem", "proc"))
    need = mem["weights_bytes"] + mem["features_bytes"]
    per_anchor_all = b["drafter_s"] / fl["anchors"]
    out = [
        f"- **b** ({b['work_s']:.2f} s, x{b['work_s'] / f['floor']:.2f} its floor) is dominated by the drafter: "
        f"{b['drafter_s']:.2f} s ({b['drafter_s'] / b['work_s']:.0%}); the target pass is "
        f"{b['target_s']:.2f} s against a {fl['target_total'] / rate['gflops'] / 1e9:.2f} s floor "
        f"(x{b['target_s'] / (fl['target_total'] / rate['gflops'] / 1e9):.2f}). With `--anchors all` the tool drafts a block at each of the "
        f"{fl['anchors']} fitting anchors, so the drafter does {fl['drafter_total'] / fl['target_total']:.1f}x the "
        f"target's FLOPs, {fl['drafter_lm_head'] / fl['drafter_total']:.0%} of them in the lm_head (B-1 full-vocab "
        "rows per anchor, against one row per completion token for the target). The drafter runs at "
        f"{fl['drafter_total'] / b['drafter_s'] / 1e9:.0f} GFLOP/s against a {rate['gflops']:.0f} GFLOP/s GEMM "
        f"(floor {secs(f['floor_d'])}). The floor prices every FLOP at the rate of a square 2048 GEMM, but the "
        "lm_head's matmul (15 x 256 rows by H = 768 deep, 16384 wide) reaches only ~80% of it on this CPU "
        "(measured 133-146 GFLOP/s for 256-2048 rows), so the matmuls alone put the drafter near 1.2x its floor. "
        "Besides them it spends its time on full-vocab passes over the logits that no FLOP count sees - one "
        "`max` (argmax and the NaN/Inf check in one pass), and for DDTree a float32 `log_softmax` and a "
        "`topk(128)` per drafted slot of the anchors whose first slot ranks the reference's token within its "
        "top-128 (only those can hold it in a tree: few with a random drafter, nearly all with a trained one; "
        "see the grouped profile) - and on attention under a dense mask that computes each chunk's 32 blocks "
        f"against each other ({gf(fl['drafter_attention_executed'])} executed for {gf(fl['drafter_attention'])} "
        "useful; splitting it into groups of 8 blocks measured within noise, so it was left). The lm_head "
        "itself is irreducible at every anchor.",
    ]
    if f.get("b_walk"):
        walk = f["b_walk"]
        per_anchor_walk = walk["drafter_s"] / fl["anchors"]  # tau ~ 1: the walks visit every anchor
        out.append(
            f"- **`--anchors walk`**: drafter {walk['drafter_s']:.2f} s vs {b['drafter_s']:.2f} s with `all`. With "
            "tau ~ 1 the walks visit every anchor, so walk mode drafts as many blocks as `all`, in smaller calls: "
            f"each step drafts the anchor every walk of the group's {fl['prompts']} prompts waits for (one per "
            f"prompt here), where `all` drafts 32 anchors of one prompt per call ({per_anchor_walk * 1e3:.1f} ms per "
            f"anchor vs {per_anchor_all * 1e3:.1f} ms). It pays off when tau > ~{per_anchor_walk / per_anchor_all:.1f}, "
            "and sooner with more prompts per group (up to 16 are batched).")
    g = c.get("generation")
    out += [
        f"- **c / b** = {c['s'] / b['eval_s']:.1f}. The online loop verifies B tokens per round and commits "
        f"~{c['tau']:.2f}, so its target work is ~B/tau = {fl['B'] / c['tau']:.0f}x b's, in "
        f"{sum(map(len, c['rounds']))} 16-token passes that are memory-bound on this CPU (the weights are re-read "
        "every pass), and its drafter cannot batch anchors. A trained drafter (tau 4-8) cuts c by about tau, and "
        "the ratio with it; a faster machine for small matmuls (GPU) cuts it too.",
        f"- **d** ({d['total_s']:.2f} s, d / b {d['total_s'] / b['eval_s']:.2f}) is b without the target pass: the "
        f"drafter ({d['drafter_s']:.2f} s) plus reading the file and the embedding/head. Since the drafter is "
        f"{b['drafter_s'] / b['work_s']:.0%} of b, d / b cannot reach 0.5 until the drafter's cost falls "
        "(the levers under b).",
        f"- **trees** take {f['trees_share']:.1%} of b: a random drafter almost never ranks the reference token in "
        "its top-128, so almost no tree is built. A trained drafter builds one per visited anchor in Python "
        "(heapq); the demo pair's `trees` figure above is the closer guide.",
        f"- **memory**: peak RSS {mib(e['peak_kib'] * 1024)} against {mib(need)} of weights + features. "
        f"{mib(e['base_kib'] * 1024)} is the interpreter with torch, transformers and transformers' Qwen3 code "
        f"imported, before any model exists; the remaining {mib((e['peak_kib'] - e['base_kib']) * 1024)} is "
        f"x{(e['peak_kib'] - e['base_kib']) * 1024 / need:.2f} the weights + features (the target's weights are "
        "mmapped from safetensors, not copied; the excess is activations, the logits chunks and allocator "
        "slack while drafting). With a model this small the import baseline decides the verdict; with a real "
        "target (GBs of weights) only the second ratio matters.",
        f"- **whole process**: the demo run is {proc['wall_s']:.1f} s, of which {proc['import_s']:.1f} s are imports "
        f"(biggest: {proc['biggest_imports'][0][1]} {proc['biggest_imports'][0][0]:.1f} s, pulled in by "
        "`build_rope`'s Qwen3RotaryEmbedding and the model load) and the tool's own JSON total is "
        f"{proc['timing'].get('total_s', 0):.2f} s. Small runs are start-up bound; only fewer imports would move it.",
    ]
    if g:
        out.append(
            f"- **speculative reference generation** (`speculative_generate`) projects only the accepted rows into "
            f"the drafter's context each round ({g['drafter_context'] / g['tokens'] * 1e3:.1f} ms of "
            f"{g['speculative_generate'] / g['tokens'] * 1e3:.1f} ms per token), as loop c does; the rest is the "
            "memory-bound verify pass, so with tau ~ 1 it cannot beat plain greedy, and with a trained drafter it "
            "divides the target passes by tau.")
    return out


def report_c(c, b, online_floor):
    say(f"c. online speculative loop: {c['s']:.2f} s ({sum(map(len, c['rounds']))} rounds, tau {c['tau']:.3f}); "
        f"c / b = {c['s'] / b['eval_s']:.1f} (b = its eval time, load excluded); floor of the loop's own work "
        f"{secs(online_floor)} (x{c['s'] / online_floor:.1f}){others('c')}")
    say(f"   rounds equal to b's chain rounds: {c['same_rounds']}/{c['n']} prompts; committed tokens equal to the "
        f"references: {c['n'] - len(c['differ'])}/{c['n']}"
        + "".join(f"; {pid}: first differs at completion token {at}, where the tool's teacher-forced argmax already "
                  f"{'differs' if at == tf else 'agrees'} (its first_divergence {tf})" for pid, at, tf in c["differ"]))
    if c["differ"]:
        say("   (the reference came from 1-token decode steps; a 16-token verify or teacher-forced pass rounds "
            "differently, and a near-tie of a random target's logits can flip: what the tool's 'target agreement' "
            "measures)")


def report_d(d, b, floor_d):
    say(f"d. --load-hidden re-evaluation: total {d['total_s']:.2f} s (drafter {d['drafter_s']:.2f} s, trees "
        f"{d['trees_s']:.3f} s, metrics {d['metrics_s']:.3f} s, other {d['total_s'] - d['work_s']:.2f} s); "
        f"d / b = {d['total_s'] / b['eval_s']:.2f}; d / drafter floor = {d['total_s'] / floor_d:.2f} "
        f"(drafter floor {secs(floor_d)}){others('d')}")


def report_e(e, mem):
    need = mem["weights_bytes"] + mem["features_bytes"]
    say(f"e. peak RSS of b (child process, VmHWM): {mib(e['peak_kib'] * 1024)}; after importing torch, "
        f"transformers (with its Qwen3 code) and eval_drafter: {mib(e['base_kib'] * 1024)}; weights "
        f"{mib(mem['weights_bytes'])} + features {mib(mem['features_bytes'])} (largest prompt "
        f"{mib(mem['features_one_prompt'])}) = {mib(need)}"
        f"{others('e')}")
    say(f"   peak / (weights + features) = {e['peak_kib'] * 1024 / need:.2f}; (peak - import baseline) / "
        f"(weights + features) = {(e['peak_kib'] - e['base_kib']) * 1024 / need:.2f}"
        + (f"; GPU peak allocated {mib(e['gpu_bytes'])}" if e.get("gpu_bytes") else ""))


def report_process(proc):
    t = proc["timing"]
    stages = ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in t.items())
    say(f"process: `eval_drafter.py --demo --limit 2 --quiet`: {proc['wall_s']:.2f} s wall = imports "
        f"{proc['import_s']:.2f} s (-X importtime, top-level cumulative) + the rest "
        f"{proc['wall_s'] - proc['import_s']:.2f} s "
        f"(bare interpreter start {proc['python_s']:.2f} s){others('process')}")
    say(f"   its JSON timing (s): {stages}")
    say("   biggest top-level imports (s): " + ", ".join(f"{name} {t:.2f}" for t, name in proc["biggest_imports"]))


def report_generation(gen, c, items):
    for pair in ("bench", "demo"):
        (plain, _, n), (spec, tau, _) = gen[(pair, "plain")], gen[(pair, "speculative")]
        note = ("random drafter, tau ~ 1: speculative cannot win" if pair == "bench"
                else "bundled pair, trained drafter, --limit 2")
        say(f"reference generation, {pair} pair ({note}): plain {plain:.2f} s, speculative {spec:.2f} s "
            f"(plain / speculative = {plain / spec:.2f}); drafter tau on these references {tau:.2f}"
            f"{others('generation')}")
    spec, _, n = gen[("bench", "speculative")]
    loop = c["per_prompt"][0] / c["tokens"][0]
    say(f"   per token (tau ~ 1: per round) on the bench pair's first prompt: the tool's speculative generation "
        f"{spec / n * 1e3:.0f} ms, loop c {loop * 1e3:.0f} ms")
    g = c.get("generation")
    if g:
        per = {k: g[k] / g["tokens"] * 1e3 for k in g if k != "tokens"}
        say(f"   cProfile of the tool's speculative_generate ({g['tokens']} tokens), ms per token: target_pass "
            f"{per['target_pass']:.1f}, draft_all_anchors {per['draft_all_anchors']:.1f} (drafter_context "
            f"{per['drafter_context']:.1f}, only the accepted rows - drafter_forward "
            f"{per['drafter_forward']:.1f}, the rest lm_head and checks), total {per['speculative_generate']:.1f}")


def describe_pair(mem, tcfg, dcfg, lengths):
    say(f"pair: target {mem['target_params'] / 1e6:.1f} M parameters ({tcfg.num_hidden_layers} layers, hidden "
        f"{tcfg.hidden_size}, intermediate {tcfg.intermediate_size}, vocab {tcfg.vocab_size}); drafter "
        f"{mem['drafter_params'] / 1e6:.1f} M ({dcfg['num_hidden_layers']} layer, feature layers "
        f"{dcfg['dflash_config']['target_layer_ids']}, block {dcfg['block_size']}); {len(lengths)} prompts of "
        f"{[n for n, _ in lengths]} tokens, {lengths[0][1]}-token references (the target's greedy output)")


def measure_depths(paths, args, work, b):
    """j. The bench pair with --depths all (every depth 1 .. B-1) against b's drafter time: a drafter pass per
    depth, each over a shorter block, so the sweep should cost about B-1 of b's passes at most."""
    report = run_tool(tool_argv(paths, args, os.path.join(work, "j.json"), "--prompts", paths["prompts"], "--depths",
                                "all"))
    depths = len(report["drafters"][0]["depths"])
    return {"drafter_s": report["timing"]["drafter_s"], "depths": depths, "b_drafter_s": b["drafter_s"]}


def report_depths(j):
    say(f"j. --depths all ({j['depths']} depths): drafter {secs(j['drafter_s'])} against b's {secs(j['b_drafter_s'])} "
        f"for the trained depth alone: {j['drafter_s'] / j['b_drafter_s']:.2f} x b, "
        f"{j['drafter_s'] / j['b_drafter_s'] / j['depths']:.2f} x b per depth (shorter blocks cost less)")


SPEEDUP_DEPTHS = (3, 7)


def measure_speedup(args, work):
    """k. The predicted speedup (--costs measure) against the measured one: the tool's own speculative
    generation over its plain generation, on the demo pair at K = 3 and 7, the same prompts and lengths, each
    the best of --repeats after a warm-up."""
    from transformers import AutoModelForCausalLM
    demo = os.path.join(ROOT, "tests", "fixtures", "demo")
    argv = ["--demo", "--depths", ",".join(map(str, SPEEDUP_DEPTHS)), "--costs", "measure", "--ddtree-budgets",
            "none", "--device", args.device, "--output", os.path.join(work, "k.json"), "--quiet"]
    report = run_tool(argv + (["--threads", str(args.threads)] if args.threads else []))
    d = report["drafters"][0]
    predicted = {k: d["predicted_speedup"]["1"]["rows"][f"K={k}"]["speedup"] for k in SPEEDUP_DEPTHS}
    target = AutoModelForCausalLM.from_pretrained(os.path.join(demo, "target"), dtype=torch.float32).to(args.device).eval()
    settings = ed.Settings(dtype="float32", device=args.device, quiet=True)
    drafter = ed.load_drafter(os.path.join(demo, "drafter"), target.config, settings)
    prompts = [it.prompt_ids for it in tool_prompts(os.path.join(demo, "prompts.jsonl"), os.path.join(demo, "target"))]

    runs = {"plain": lambda: [ed.plain_generate(target, p, 128, set()) for p in prompts],
            **{k: lambda k=k: [ed.speculative_generate(target, ed.replace(drafter, block_size=k + 1), p, 128, set())
                               for p in prompts] for k in SPEEDUP_DEPTHS}}
    times = {name: [] for name in runs}
    for rep in range(args.repeats + 1):   # in turn, so that a slow moment of the shared box hits them alike
        for name, run in runs.items():
            elapsed = timed_run(run)
            if rep:   # the first round warms up
                times[name].append(elapsed)
    plain = min(times["plain"])
    return {"predicted": predicted, "measured": {k: plain / min(times[k]) for k in SPEEDUP_DEPTHS}, "plain_s": plain}


def timed_run(run):
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def report_speedup(k):
    say("k. predicted speedup (--costs measure) against the measured one (speculative over plain generation, "
        f"demo pair, plain {secs(k['plain_s'])}): " + ", ".join(
            f"K={d}: predicted {k['predicted'][d]:.2f}x, measured {k['measured'][d]:.2f}x "
            f"({k['predicted'][d] / k['measured'][d] - 1:+.0%})" for d in SPEEDUP_DEPTHS))


def speedup_verdict(k):
    off = {d: k["predicted"][d] / k["measured"][d] - 1 for d in SPEEDUP_DEPTHS}
    return verdict(all(abs(x) <= 0.2 for x in off.values()), "predicted speedup within 20% of the measured one at "
                   "K = 3 and 7: " + ", ".join(f"{x:+.0%}" for x in off.values()))


def verdicts_of(f):
    b, c, d, e, need = f["b"], f["c"], f["d"], f["e"], f["mem"]["weights_bytes"] + f["mem"]["features_bytes"]
    peak, where = (e["gpu_bytes"], "GPU peak allocated") if e.get("gpu_bytes") else (e["peak_kib"] * 1024, "peak RSS")
    return [
        verdict(b["work_s"] <= 1.3 * f["floor"], f"b <= 1.3 x floor: {b['work_s']:.2f} s vs floor {secs(f['floor'])} "
                                                 f"(x{b['work_s'] / f['floor']:.2f})"),
        verdict(c["s"] / b["eval_s"] >= 5, f"c / b >= 5: {c['s'] / b['eval_s']:.1f}"),
        verdict(d["total_s"] <= 0.5 * b["eval_s"] and d["total_s"] <= 1.3 * f["floor_d"],
                f"d <= 0.5 x b and d <= 1.3 x drafter floor: d / b = {d['total_s'] / b['eval_s']:.2f}, "
                f"d / drafter floor = {d['total_s'] / f['floor_d']:.2f}"),
        verdict(f["trees_share"] <= 0.15, f"trees <= 15% of b at budget 128: {f['trees_share']:.1%}"),
        verdict(f["h"]["argmax"]["work_s"] <= 1.1 * b["work_s"] and f["h"]["sample"]["work_s"] <= 1.5 * b["work_s"],
                f"sampled evaluation at Qwen3's settings <= 1.1 x b (argmax) and <= 1.5 x b (sample): "
                f"x{f['h']['argmax']['work_s'] / b['work_s']:.2f} and x{f['h']['sample']['work_s'] / b['work_s']:.2f}"),
        *([speedup_verdict(f["k"])] if f.get("k") else []),
        *([busy_verdict(f["m"])] if f.get("m") else []),
        *([verdict(f["i"]["tau"] >= 4 and f["i"]["plain_s"] >= 2 * f["i"]["spec_s"],
                   f"hybrid speculative references >= 2 x plain greedy at tau >= 4: x"
                   f"{f['i']['plain_s'] / f['i']['spec_s']:.2f} at tau {f['i']['tau']:.2f}")] if f.get("i") else []),
        verdict(peak <= 1.25 * need, f"peak memory of b <= 1.25 x (weights + features): {where} {mib(peak)} vs "
                                     f"{mib(need)} (x{peak / need:.2f})"),
    ]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    t_start = time.perf_counter()
    info = machine_info(args)
    say(f"machine: {info['cpu']}, {info['cores']} cores, torch threads {info['threads']}, load average "
        f"{info['load_before']:.2f}; torch {info['torch']}, transformers {info['transformers']}; device {args.device}")
    f = {}
    if args.only:   # a few rows alone: printed, RESULTS.md left as it is
        with tempfile.TemporaryDirectory(prefix="bench_eval_") as work:
            rows = set(args.only.split(","))
            if "j" in rows:
                paths, _, _ = build_pair(args, args.workdir or work)
                b = measure_b(paths, args, work, ("--anchors", "all"), warm_up=False, runs=1)[0]
                report_depths(measure_depths(paths, args, work, b))
            if "l" in rows:
                paths, _, dcfg = build_pair(args, args.workdir or work)
                report_families(measure_families(paths, args, work, dcfg))
            if "k" in rows:
                f["k"] = measure_speedup(args, work)
                report_speedup(f["k"])
                speedup_verdict(f["k"])
            if "p" in rows:
                report_published(published(args))
            if "q" in rows:
                report_ranked(ranked_8b(args, work))
            if "n" in rows:
                report_busy_costs(busy_costs(args))
            if "r" in rows:
                report_real(real_pair(args, work))
            if "t" in rows:
                report_entry(entry_point(args, work))
            if "m" in rows:
                f["m"] = busy_box(args)
                report_busy(f["m"])
                busy_verdict(f["m"])
        return
    with contextlib.ExitStack() as stack:
        work = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_eval_"))
        os.makedirs(work, exist_ok=True)
        paths, tcfg, dcfg = build_pair(args, work)
        items = tool_prompts(paths["prompts"], paths["target"])
        lengths = [(len(it.prompt_ids), len(it.completion_ids)) for it in items]
        f["mem"] = mem = memory_needed(paths, tcfg, dcfg, lengths, args.device)
        describe_pair(mem, tcfg, dcfg, lengths)

        anchors = ("--anchors", "all") if has_flag("--anchors") else ()
        with watch("b"):
            rates = [gemm_rate(args.device, args.repeats)]
            b, b_report, hidden = measure_b(paths, args, work, anchors)
            rates.append(gemm_rate(args.device, args.repeats))
        with watch("b_walk"):
            b_walk = measure_b(paths, args, work, ("--anchors", "walk"), warm_up=False, runs=1)[0] if anchors else None
        rate = max(rates, key=lambda r: r["gflops"])  # the machine's capability: a lower one is contention
        fl = work_flops(tcfg, dcfg, lengths)
        fl["B"] = dcfg["block_size"]
        floor, floor_d = (fl[k] / rate["gflops"] / 1e9 for k in ("total", "drafter_total"))
        f.update(fl=fl, rate=rate, b=b, b_walk=b_walk, floor=floor, floor_d=floor_d,
                 trees_share=b["trees_s"] / b["work_s"])
        report_flops(rates, rate, fl)
        report_b(b, floor, fl, rate, b_report, b_walk)

        with watch("c"):
            f["c"] = c = measure_c(paths, args, b_report)
        report_c(c, b, online_flops(tcfg, dcfg, c["rounds"], lengths) / rate["gflops"] / 1e9)
        with watch("d"):
            f["d"] = measure_d(paths, args, work, hidden)[0]
        report_d(f["d"], b, floor_d)
        with watch("e"):
            f["e"] = measure_e(paths, args, work)
        report_e(f["e"], mem)
        with watch("g"):
            f["g"] = measure_dflash2(paths, args, work, dcfg)
        report_dflash2(f["g"])
        with watch("l"):
            f["l"] = measure_families(paths, args, work, dcfg)
        report_families(f["l"])
        with watch("h"):
            f["h"] = measure_sampled(paths, args, work)
        report_sampled(f["h"], b)
        with watch("i"):
            f["i"] = hybrid_references(args)
        report_hybrid(f["i"])
        with watch("j"):
            report_depths(measure_depths(paths, args, work, b))
        with watch("k"):
            f["k"] = measure_speedup(args, work)
        report_speedup(f["k"])
        with watch("process"):
            f["proc"] = demo_process(args, work)
        report_process(f["proc"])
        f["m"] = busy_box(args)   # not watched: it makes the other processes itself
        report_busy(f["m"])
        if has_flag("--reference-generation"):
            with watch("generation"):
                generation = reference_generation(paths, args, work)
            report_generation(generation, c, items)
        else:
            say("reference generation: this eval_drafter.py has no --reference-generation; not measured")
        if args.profile:
            with watch("profile"):
                lines = profile_b(paths, args, work)
            lines[0] += others("profile")
            for line in lines:
                say("   " + line)

    say("")
    verdicts = verdicts_of(f)
    info.update(load_after=os.getloadavg()[0], wall_s=time.perf_counter() - t_start)
    say(f"benchmark wall time {info['wall_s']:.0f} s; load average {info['load_before']:.2f} -> "
        f"{info['load_after']:.2f}")
    say("CPU time other processes took while each part ran: "
        + ", ".join(f"{k} {v:.0%}" for k, v in OTHERS.items() if not math.isnan(v)))
    if args.write_results:
        write_results(info, LINES, verdicts, analysis_text(f), argv)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
