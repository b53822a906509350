"""Builders for the drafter generations and checkpoint layouts the public code runs, and the public loop.

A random drafter on a random target accepts almost nothing, so comparisons of rounds would have no teeth.
These builders start from the trained demo drafter and change what is being tested:
- `dflash2_from_demo`: DFlash 2. Conv taps close to the identity (base kernel 1 at offset 0, small random
  taps) and a small random selector keep most of the demo's skill, so rounds vary between 1 and B.
- `with_config`: the demo drafter with some config keys changed, e.g. input_embedding_scale.
- `native_from_demo`: the same weights in the transformers-native assistant layout (muse_glimmer_assistant).

`public_rounds` runs z-lab's dflash 0.1.0 `dflash_generate` and returns its tokens and acceptance lengths.
`online_rounds` (greedy) and `speculative_sampling_runs` (sampled) are online speculative loops around any
proposer a test writes from an engine's source; `run_tool` runs the tool into a JSON report.
"""
import json
import math
import os
import time

import torch
from safetensors.torch import load_file, save_file

import eval_drafter as ed
from conftest import write_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "fixtures", "demo")
DEMO_DRAFTER = os.path.join(DEMO, "drafter")


def demo_pair(target_dir=None):
    """The demo target (float32; or another on the demo's tokenizer), its prompt lines and their token ids (plain
    text, as the tool encodes them)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target_dir = target_dir or os.path.join(DEMO, "target")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    with open(os.path.join(DEMO, "prompts.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return target, rows, [tok(row["prompt"])["input_ids"] for row in rows]


def demo_drafter_files():
    with open(os.path.join(DEMO_DRAFTER, "config.json")) as f:
        return json.load(f), load_file(os.path.join(DEMO_DRAFTER, "model.safetensors"))


def save(out_dir, cfg, weights):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"))
    return str(out_dir)


def with_config(out_dir, top=None, dflash=None, drop=()):
    """The demo drafter with top-level keys `top` and dflash_config keys `dflash` set, keys `drop` removed."""
    cfg, weights = demo_drafter_files()
    cfg.update(top or {})
    cfg["dflash_config"].update(dflash or {})
    for key in drop:
        cfg.pop(key, None)
    return save(out_dir, cfg, weights)


DFLASH2_KNOBS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
                 "output_multiplier": 1.25, "final_logit_softcapping": 12.0, "input_embedding_scale": 4.0}


def dflash2_weights(cfg, weights, knobs, seed=0, tap_scale=0.05, code_scale=0.6):
    """Conv and selector tensors in the public DFlash 2 layout (codebooks as bare tensors)."""
    g = torch.Generator().manual_seed(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    K, groups, rank = knobs["conv_kernel_size"], H // knobs["conv_group_size"], knobs["selector_rank"]
    out = dict(weights)
    for i in range(cfg["num_hidden_layers"]):
        for sub in ("attention_conv", "mlp_conv"):
            base = tap_scale * torch.randn(2, K, H, generator=g)
            base[:, 0] += 1.0   # close to the identity: the demo drafter's skill survives
            out[f"layers.{i}.{sub}.base_kernel"] = base
            out[f"layers.{i}.{sub}.kernel_projection.weight"] = tap_scale * torch.randn(2 * K * groups, H, generator=g)
    out["candidate_selector.hidden_projection.weight"] = torch.randn(rank, H, generator=g) / math.sqrt(H)
    out["candidate_selector.predecessor_codebook"] = code_scale * torch.randn(V, rank, generator=g)
    out["candidate_selector.successor_codebook"] = code_scale * torch.randn(V, rank, generator=g)
    return out


def dflash2_from_demo(out_dir, seed=0, is_causal=False, block_size_in_dflash_config=True, **knobs):
    """A DFlash 2 drafter grown from the demo drafter: one sliding and one full layer, conv taps, selector,
    multiplier, softcap and embedding scale (DFLASH2_KNOBS, overridden by `knobs`)."""
    cfg, weights = demo_drafter_files()
    knobs = {**DFLASH2_KNOBS, **knobs}
    weights = dflash2_weights(cfg, weights, knobs, seed)
    cfg.update(architectures=["DFlash2DraftModel"])
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    cfg["dflash_config"].update(knobs)
    if block_size_in_dflash_config:
        cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    return save(out_dir, cfg, weights)


def native_from_demo(out_dir, sliding_window=32):
    """The demo drafter's weights in the transformers-native assistant layout: context projection under
    encoder.*, block_size / mask_token_id / target_layer_ids at the top level, model_type
    muse_glimmer_assistant (bidirectional in every layer, sliding layers windowed)."""
    cfg, weights = demo_drafter_files()
    names = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    weights = {names.get(k, k): v for k, v in weights.items()}
    native = {"architectures": ["MuseGlimmerAssistantModel"], "model_type": "muse_glimmer_assistant",
              **{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                                     "layer_types", "block_size")},
              "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"]},
              "sliding_window": sliding_window, "mask_token_id": cfg["dflash_config"]["mask_token_id"],
              "target_layer_ids": cfg["dflash_config"]["target_layer_ids"],
              "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0}
    return save(out_dir, native, weights)


# ----------------------------------------------------------------------------------------------------
# The public loop


def _crop_to_4x(cache, length):
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def public_module(monkeypatch):
    """dflash.model, made to run on CPU under the installed transformers. Its stats time with
    torch.cuda.synchronize: on CPU the clock alone does. It is written for transformers 5.x: under 4.x two
    cache helpers get 4.x semantics (a plain DynamicCache, since 4.x has no past recording; a rollback that
    never calls crop(0), which empties a 4.x cache). Its loop and its models are used as they are."""
    import transformers
    from transformers import DynamicCache
    import dflash.model as public
    monkeypatch.setattr(public, "_cuda_time", time.perf_counter)
    if ed.version_tuple(transformers.__version__) < (5, 0, 0):
        monkeypatch.setattr(public, "_make_cache", lambda config: DynamicCache())
        monkeypatch.setattr(public, "_crop_to", _crop_to_4x)
    return public


def public_rounds(public, drafter_dir, target, prompt_ids, n_new):
    """dflash_generate's output tokens and acceptance lengths (greedy, float32)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(drafter_dir)
    cls = public.DFlash2DraftModel if "DFlash2DraftModel" in (config.architectures or []) else public.DFlashDraftModel
    model = cls.from_pretrained(drafter_dir, config=config, dtype=torch.float32).eval()
    out = public.dflash_generate(model, target, torch.tensor([prompt_ids]), n_new, None, return_stats=True)
    return out.output_ids[0, len(prompt_ids):].tolist(), out.acceptance_lengths


@torch.no_grad()
def speculative_sampling_runs(target, prompts, sampling, runs, n_new, n_drafts, new_proposer, seed):
    """`runs` runs of speculative sampling (prompts in turn), each with a proposer made by new_proposer():
    propose(seq, generator) -> (drafts, the distribution each was drawn from). Accept draft x with
    min(1, p(x) / q(x)), else a token from max(0, p - q) renormalized; all accepted: a bonus token from p, p the
    target's distribution at `sampling`. [(prompt index, the first n_new completion tokens, the rounds whose
    block lies inside them, as the tool counts rounds)]."""
    def p_of(logits):
        return ed.sampling_probs(logits, sampling).double()

    out = []
    for i in range(runs):
        g, ids, propose = torch.Generator().manual_seed(seed + i), prompts[i % len(prompts)], new_proposer()
        seq = list(ids)
        seq.append(int(torch.multinomial(p_of(target(torch.tensor([seq])).logits[0, -1:])[0], 1, generator=g)))
        rounds = []
        while len(seq) - len(ids) < n_new + n_drafts:
            anchor = len(seq) - 1
            drafts, qs = propose(seq, g)
            ps = p_of(target(torch.tensor([seq + drafts])).logits[0, anchor:])
            accepted, token = 0, None
            for j, x in enumerate(drafts):
                if torch.rand(1, generator=g).item() < min(1.0, float(ps[j, x] / qs[j][x])):
                    accepted += 1
                    continue
                residual = (ps[j] - qs[j]).clamp_min(0)
                token = int(torch.multinomial(residual / residual.sum(), 1, generator=g))
                break
            if token is None:
                token = int(torch.multinomial(ps[n_drafts], 1, generator=g))
            seq += drafts[:accepted] + [token]
            rounds.append(accepted + 1)
        counted, at = [], 0
        for length in rounds:
            if at + n_drafts > n_new - 1:
                break
            counted.append(length)
            at += length
        out.append((i % len(prompts), seq[len(ids):len(ids) + n_new], counted))
    return out


def on_texts(tmp_path, name, path, rows, runs, sampling, policy):
    """The tool on the demo target over the texts of speculative_sampling_runs (each run's prompt and completion),
    at `sampling` with --draft-policy `policy`: the report, one prompt entry per run."""
    refs = [{"id": f"run{i}", "prompt": rows[p]["prompt"], "completion_ids": text} for i, (p, text, _) in enumerate(runs)]
    return run_tool(tmp_path, name, "--target", os.path.join(DEMO, "target"), "--ckpt", f"x={path}", "--prompts",
                    write_jsonl(tmp_path / f"{name}.jsonl", refs), "--draft-policy", policy, "--temperature",
                    str(sampling[0]), "--top-p", str(sampling[1]), "--top-k", str(sampling[2]))


def run_refs(rows, runs):
    """Reference lines of sampled runs [(prompt index, completion ids, rounds)]: run i's text after its prompt."""
    return [{"id": f"run{i}", "prompt": rows[p]["prompt"], "completion_ids": text}
            for i, (p, text, _) in enumerate(runs)]


def run_tool(tmp_path, name, *argv):
    """eval_drafter.main quietly into tmp_path/<name>.json (it must succeed); the report."""
    out = tmp_path / f"{name}.json"
    assert ed.main([*argv, "--quiet", "--output", str(out)]) == 0
    return json.loads(out.read_text())


@torch.no_grad()
def online_rounds(target, propose, prompt_ids, n_new, n_drafts):
    """Greedy speculative decoding: every round, draft from the committed tokens, verify with a fresh target
    pass, keep the accepted drafts and the target's token; until the next block would pass n_new tokens."""
    seq = list(prompt_ids)
    seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    rounds = []
    while len(seq) - len(prompt_ids) + n_drafts <= n_new:
        anchor, drafts = len(seq) - 1, propose(seq)
        verify = target(torch.tensor([seq + drafts])).logits[0, anchor:].argmax(-1).tolist()
        accepted = 0
        while accepted < n_drafts and drafts[accepted] == verify[accepted]:
            accepted += 1
        seq += drafts[:accepted] + [verify[accepted]]
        rounds.append(accepted + 1)
    return rounds


# ----------------------------------------------------------------------------------------------------
# A target's MTP layer, online


class RowCache:
    """An engine's draft KV cache for one attention layer, a slot per position: update() writes the query row's
    keys and values at position `at` and returns the rows at positions <= at, which the query attends to. A
    round's chain rows are overwritten by the next round's prefill, as the engines' slots are."""

    def __init__(self):
        self.rows, self.at = {}, 0

    def update(self, k, v, *args, **kwargs):
        self.rows[self.at] = (k, v)
        seen = [self.rows[j] for j in sorted(self.rows) if j <= self.at]
        return torch.cat([r[0] for r in seen], 2), torch.cat([r[1] for r in seen], 2)


class OnlineMTP:
    """A target's MTP layer built from transformers' own modules of the target's kind (its decoder layer as a
    full-attention layer, its zero-centred RMSNorm, its rotary embedding), the weights read from the checkpoint's
    mtp.* tensors by name: fc over [norm(embedding); norm(hidden)], the layer, mtp.norm, the target's lm_head.
    One row at a time, with an engine's KV cache."""

    def __init__(self, target, path):
        import copy
        import importlib
        from safetensors import safe_open
        cfg = copy.deepcopy(target.config)
        cfg.layer_types, cfg._attn_implementation = ["full_attention"], "eager"
        module, kind = importlib.import_module(type(target).__module__), type(target).__name__[:-len("ForCausalLM")]
        tensors = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), "pt") as f:
                    tensors.update({k[len("mtp."):]: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")})
        self.layer = getattr(module, kind + "DecoderLayer")(cfg, 0).eval()
        self.layer.load_state_dict({k[len("layers.0."):]: v for k, v in tensors.items() if k.startswith("layers.0.")})
        H = cfg.hidden_size
        self.norms = {}
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[n] = getattr(module, kind + "RMSNorm")(H, eps=cfg.rms_norm_eps)
            self.norms[n].load_state_dict({"weight": tensors[n + ".weight"]})
        self.fc = tensors["fc.weight"]
        self.embed, self.lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        self.rotary, self.cache = target.get_decoder().rotary_emb, RowCache()

    @torch.no_grad()
    def row(self, token, g, pos):
        """The post-norm output of the row for `token` (the next one) and hidden g, at position pos."""
        x = self.fc @ torch.cat([self.norms["pre_fc_norm_embedding"](self.embed[token]), self.norms["pre_fc_norm_hidden"](g)])
        self.cache.at = pos
        out = self.layer(x[None, None], position_embeddings=self.rotary(x[None, None], torch.tensor([[pos]])),
                         attention_mask=None, **ed.cache_kwarg(self.layer, self.cache))
        return self.norms["norm"]((out[0] if isinstance(out, tuple) else out)[0, 0])


def mtp_proposer(target, path, K, sampling=None):
    """The engines' MTP round (vLLM's target_dependent_ar speculator, SGLang's NEXTN): the layer's cache
    re-prefilled over the newly committed window (token j + 1 with the target's last hidden state at j, after
    the final norm, at position j); draft 1 from the window's last row; each further step feeds the layer's own
    post-norm output back with the previous draft, one position on. Greedy: argmax drafts; with `sampling`: each
    step drawn from softmax(logits / T). propose(seq[, generator]) -> (drafts, q)."""
    m, done = OnlineMTP(target, path), [0]

    def propose(seq, g=None):
        with torch.no_grad():
            h = target.get_decoder()(input_ids=torch.tensor([seq[:-1]])).last_hidden_state[0]
        for j in range(done[0], len(seq) - 1):
            out = m.row(seq[j + 1], h[j], j)
        done[0] = len(seq) - 1
        drafts, qs, pos = [], [], len(seq) - 2
        for s in range(K):
            if s:
                pos += 1
                out = m.row(drafts[-1], out, pos)
            logits = m.lm_head @ out
            if sampling is None:
                drafts.append(int(logits.argmax()))
                continue
            qs.append((logits.double() / sampling[0]).softmax(-1))
            drafts.append(int(torch.multinomial(qs[-1], 1, generator=g)))
        return drafts, qs
    return propose


def dspark_with_confidence(out_dir, markov=False, scale=2.0, bias=1.0, seed=0):
    """The DSpark fixture (families/dspark_vanilla, speculators layout) with a random confidence head as vLLM 0.34
    builds it (DSparkConfidenceHead: one linear to a logit, with a bias; over [row; markov_w1[prev]] with_markov),
    enabled in its config."""
    src = os.path.join(HERE, "fixtures", "families", "dspark_vanilla")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    weights = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    width = cfg["transformer_layer_config"]["hidden_size"] + (weights["markov_head.markov_w1.weight"].shape[1]
                                                              if markov else 0)
    weights["confidence_head.proj.weight"] = scale * torch.randn(1, width, generator=g) / math.sqrt(width)
    weights["confidence_head.proj.bias"] = torch.tensor([bias])
    cfg.update(enable_confidence_head=True, confidence_head_with_markov=markov)
    return save(out_dir, cfg, weights)
