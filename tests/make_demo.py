"""Build the tiny demo pair under tests/fixtures/demo: a Qwen3 target that speaks a synthetic language and a
DFlash drafter trained on that target's greedy output. Deterministic; about two minutes on 2 CPU cores.

    python tests/make_demo.py [OUT_DIR]
    python tests/make_demo.py --hybrid [OUT_DIR]     # the hybrid demo pair (Qwen3.5 target; transformers 5.x)
    python tests/make_demo.py --from-anchor [OUT_DIR]   # a drafter for the demo target trained with
                                                        # speculators' sample_from_anchor, in its layout
    python tests/make_demo.py --families [OUT_DIR]      # DSpark (vanilla, rnn) and Domino (shift_label off,
                                                        # on) drafters for the demo target, one layer each
    python tests/make_demo.py --lilicorr [OUT_DIR]      # a LiLiCorr drafter (the demo drafter's backbone, a
                                                        # trained correlator) in the engines' layout
    python tests/make_demo.py --confidence [OUT_DIR]    # the DSpark fixture with a fitted confidence head
                                                        # (vLLM 0.34's adaptive verification), seconds
    python tests/make_demo.py --mtp [TARGET_DIR]        # a trained MTP layer written into the hybrid demo
                                                        # target's checkpoint (mtp.*), as Qwen3.5 ships one
    python tests/make_demo.py --served-pair [OUT_DIR]   # a pair vLLM's CPU build serves (tests/fixtures/demo_vllm):
                                                        # head_dim 32, the drafter's layers all full attention
    python tests/make_demo.py --real [OUT_DIR]          # the real pair's drafter (tests/fixtures/real_drafter) for
                                                        # SmolLM2-135M-Instruct (tests/fetch_real.py): ~21 min of
                                                        # replies with their features (cached), ~19 min training,
                                                        # one thread of a busy 2-core box

The language: 60 words. Most words are followed by a fixed successor (a permutation); a quarter of them
("twist" words) are followed by a word chosen by a table over (previous word, current word). Training text
follows the rule 85% of the time and is random otherwise, so the target learns the rule as its argmax. A
random target's greedy text would be noise no drafter can learn; this one is predictable several tokens
ahead, with twists that make the later block positions harder, so tau lands well above 1 and below B.
"""
import json
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import eval_drafter as ed  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<mask>", "<unk>"]
N_WORDS = 60
MASK_ID = 2
SEQ_LEN = 192


def word(i):
    return f"w{i}"


def save_tokenizer(out_dir, n_words=N_WORDS):
    """A word-level tokenizer (ids: specials, then w0..w{n-1}) saved in the HF layout."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + [word(i) for i in range(n_words)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>")
    fast.save_pretrained(out_dir)
    # transformers 5.x writes its own class name; the generic fast class loads on 4.x and 5.x alike.
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    return len(vocab)


def target_config(vocab_size, hybrid=False, **overrides):
    """The demo target: Qwen3, or with hybrid=True a 4-layer Qwen3.5 text model of the same widths whose
    layers alternate linear and full attention (transformers 5.x only)."""
    from transformers import Qwen3Config
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
               rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    if hybrid:
        from transformers import Qwen3_5TextConfig
        cfg.pop("rope_theta")
        cfg.update(num_hidden_layers=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                   linear_num_value_heads=4, full_attention_interval=2)
        cfg.update(overrides)
        return Qwen3_5TextConfig(**cfg)
    cfg.update(overrides)
    return Qwen3Config(**cfg)


def drafter_config(target_cfg, layer_ids=(1, 3, 4), block_size=8, **overrides):
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "hidden_size": target_cfg.hidden_size, "intermediate_size": 192, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 512, "rope_theta": 10000.0, "attention_bias": False,
           "layer_types": ["sliding_attention", "full_attention"], "use_sliding_window": True,
           "sliding_window": 32, "vocab_size": target_cfg.vocab_size, "block_size": block_size,
           "num_target_layers": target_cfg.num_hidden_layers,
           "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": list(layer_ids)}}
    cfg.update(overrides)
    return cfg


def random_drafter_weights(cfg, n_feature_layers, seed=0, scale=0.08):
    """Drafter tensors in the public layout, randomly initialised (norm weights = 1)."""
    g = torch.Generator().manual_seed(seed)
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale

    w = {"fc.weight": rnd(H, n_feature_layers * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
                  p + "self_attn.q_proj.weight": rnd(nh * hd, H), p + "self_attn.k_proj.weight": rnd(nkv * hd, H),
                  p + "self_attn.v_proj.weight": rnd(nkv * hd, H), p + "self_attn.o_proj.weight": rnd(H, nh * hd),
                  p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
                  p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
                  p + "mlp.down_proj.weight": rnd(H, I)})
        if cfg.get("attention_bias"):
            for name, n_out in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd), ("o_proj", H)):
                w[p + f"self_attn.{name}.bias"] = rnd(n_out)
    return w


def save_drafter(out_dir, cfg, weights):
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"))


def language(seed=1234):
    rng = random.Random(seed)
    perm = list(range(N_WORDS))
    rng.shuffle(perm)
    twist = set(rng.sample(range(N_WORDS), N_WORDS // 4))
    table = [[rng.randrange(N_WORDS) for _ in range(N_WORDS)] for _ in range(N_WORDS)]
    return perm, twist, table


def next_word(lang, prev, cur):
    perm, twist, table = lang
    return table[prev][cur] if cur in twist else perm[cur]


def sample_text(lang, rng, length, noise):
    words = [rng.randrange(N_WORDS), rng.randrange(N_WORDS)]
    while len(words) < length:
        words.append(rng.randrange(N_WORDS) if rng.random() < noise else next_word(lang, words[-2], words[-1]))
    return words


def optimize(params, steps, loss_of, what, lr=3e-3, on_step=None):
    """AdamW under a one-cycle schedule, as every demo model is trained: loss_of(step) gives the step's loss;
    on_step(step) runs after each optimizer step (the --series mode's checkpoints and tau)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        loss = loss_of(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if on_step:
            on_step(step + 1)
        if step % 100 == 0:
            print(f"{what} step {step} loss {loss.item():.3f}", flush=True)


def train_target(out_dir, lang, steps=1500, batch=32, hybrid=False, seq_len=SEQ_LEN, llama=False, heads=None):
    vocab = save_tokenizer(out_dir)
    torch.manual_seed(0)
    if llama:   # the demo's widths in Llama's architecture (no q/k norms): SGLang serves EAGLE-3 on it as a tree
        from transformers import LlamaConfig, LlamaForCausalLM
        qwen = target_config(vocab).to_dict()
        model = LlamaForCausalLM(LlamaConfig(**{k: qwen[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
            "pad_token_id", "bos_token_id")}, rope_theta=10000.0))
    else:
        if hybrid:
            from transformers import Qwen3_5ForCausalLM as model_class
        else:
            from transformers import Qwen3ForCausalLM as model_class
        model = model_class(target_config(vocab, hybrid, **(heads or {})))
    rng = random.Random(0)

    def loss_of(step):
        ids = torch.tensor([[len(SPECIALS) + w for w in sample_text(lang, rng, seq_len, 0.15)] for _ in range(batch)])
        return model(input_ids=ids, labels=ids).loss
    optimize(model.parameters(), steps, loss_of, "target")
    model.generation_config.eos_token_id = 1
    model.save_pretrained(out_dir)
    return model.eval()


def demo_prompts(lang, n=10):
    """Ten short prompts: five like the training text (split train), five from unseen starts (split fresh)."""
    rng = random.Random(7)
    rows = []
    for i in range(n):
        split = "train" if i < n // 2 else "fresh"
        words = sample_text(lang, rng, 6 + i % 4, 0.15 if split == "train" else 0.5)
        rows.append({"id": f"{split}-{i % (n // 2)}", "split": split, "prompt": " ".join(word(w) for w in words)})
    return rows


def save_speculators(out_dir, cfg, weights, kind="dflash", **top):
    """A drafter in speculators' layout (what vLLM loads): the drafter's own layers under
    transformer_layer_config, the DFlash keys at the top level, layer ids as hidden_states indices (layer L's
    output is index L + 1); `top` sets or adds top-level keys (sample_from_anchor, draft_vocab_size, ...)."""
    zlab = ("architectures", "block_size", "dflash_config", "num_target_layers")
    spec = {"speculators_model_type": kind, "architectures": ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"],
            "transformer_layer_config": {k: v for k, v in cfg.items() if k not in zlab},
            "draft_vocab_size": cfg["vocab_size"], "block_size": cfg["block_size"], "target_hidden_size": None,
            "aux_hidden_state_layer_ids": [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]],
            "mask_token_id": cfg["dflash_config"]["mask_token_id"], "sliding_window_non_causal": kind == "dflash2",
            "sample_from_anchor": False, "speculators_version": "0.9.0", "tie_word_embeddings": False,
            "speculators_config": {"algorithm": kind, "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg["block_size"] - 1,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": None, "architectures": ["Qwen3ForCausalLM"]}}}
    spec.update(top)
    save_drafter(out_dir, spec, weights)
    return out_dir


# The family fixtures (tests/fixtures/families): one-layer drafters, so the backbone alone misses twists that
# the heads, which see the drafts before them, can catch. {name: (generation, head, dflash_config keys, layout)}
FAMILIES = {
    "dspark_vanilla": ("DSpark", {"kind": "vanilla", "rank": 16, "topk": 0},
                       {"markov_rank": 16, "markov_head_type": "vanilla"}, "speculators"),
    "dspark_rnn": ("DSpark", {"kind": "rnn", "rank": 16, "topk": 0},
                   {"markov_rank": 16, "markov_head_type": "rnn", "projector_type": "dspark"}, "specforge"),
    "domino": ("Domino", {"prefix": 1, "shift": False, "pool": 0},
               {"projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 16, "pure_draft_prefix_len": 1,
                "shift_label": False}, "specforge"),
    "domino_shift": ("Domino", {"prefix": 0, "shift": True, "pool": 0},
                     {"projector_type": "domino", "emb_dim": 32, "gru_hidden_dim": 16, "pure_draft_prefix_len": 0,
                      "shift_label": True}, "specforge"),
}


def head_weights(generation, head, dflash, H, V, g, scale=0.08):
    """A family's head tensors, randomly initialised, named as SpecForge saves them."""
    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale
    if generation == "DSpark":
        r, m = head["rank"], "markov_head."
        w = {m + "markov_w1.weight": rnd(V, r), m + "markov_w2.weight": rnd(V, r)}
        if head["kind"] == "rnn":
            w.update({m + "joint_proj.weight": rnd(3 * r, 2 * r + H), m + "joint_proj.bias": torch.zeros(3 * r)})
        return w
    G, E = dflash["gru_hidden_dim"], dflash["emb_dim"]
    return {"prefix_gru.weight_ih_l0": rnd(3 * G, H), "prefix_gru.weight_hh_l0": rnd(3 * G, G),
            "embed_proj.0.weight": rnd(E, H + G), "embed_proj.2.weight": rnd(V, E)}


def training_data(target, lang, layer_ids, rng, n_sequences=160, completion=128):
    """The target's own greedy continuations of short noisy prompts (as DFlash is trained), with their features."""
    data = []
    for i in range(n_sequences):
        if i % 20 == 0:   # minutes on a busy box: shown, not silent
            print(f"drafter data: {i}/{n_sequences} greedy continuations of the target", flush=True)
        prompt = [len(SPECIALS) + w for w in sample_text(lang, rng, rng.randrange(4, 12), 0.5)]
        ids = prompt + ed.plain_generate(target, prompt, completion, set())
        feats = ed.extract_hidden(target, ids, layer_ids, len(prompt)).features
        data.append((ids, len(prompt), torch.cat([feats[L] for L in layer_ids], -1).clone()))
    print("drafter data ready", flush=True)
    return data


def train_drafter(out_dir, target, lang, steps=1500, anchors_per_step=48, n_sequences=160, completion=128,
                  from_anchor=False, family=None, data=None, on_step=None, **config_overrides):
    """Train a drafter on the target's greedy text; config_overrides (e.g. is_causal=True, layer_types=...)
    change what is trained, so tests can make drafters trained with another mask. from_anchor: every slot of
    the block drafts, the anchor's too (slot k predicts the token after position a + k), as speculators'
    sample_from_anchor trains it; saved in speculators' layout. family: a FAMILIES name, its head trained with
    the backbone, every slot's correction given the reference tokens before it (teacher forcing, as SpecForge
    trains them)."""
    generation, head, dflash, layout = FAMILIES[family] if family else ("DFlash", None, {}, "public")
    from_anchor = from_anchor or generation == "DSpark"
    cfg = drafter_config(target.config, **config_overrides)
    cfg["dflash_config"].update(dflash)
    if family:
        cfg["architectures"] = [generation + "DraftModel"]
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    weights = random_drafter_weights(cfg, len(layer_ids))
    if family:
        weights.update(head_weights(generation, head, dflash, cfg["hidden_size"], cfg["vocab_size"],
                                    torch.Generator().manual_seed(2)))
    weights = {k: v.requires_grad_() for k, v in weights.items()}
    settings = ed.Settings()
    drafter = ed.Drafter(name="training", checkpoint=out_dir, cfg=cfg, weights=weights, layers=layer_ids,
                         block_size=cfg["block_size"] + from_anchor, mask_token_id=MASK_ID,
                         rules=ed.layer_rules(cfg, settings), rope=ed.build_rope(cfg, "cpu"),
                         logit_rows=ed.LOGIT_ROWS_PER_CHUNK, generation=generation, from_anchor=from_anchor, head=head)
    B = cfg["block_size"]
    rng = random.Random(1)   # drafts the data (unless given), then the anchors of every step
    data = data or training_data(target, lang, layer_ids, rng, n_sequences, completion)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(1)
    first = 0 if from_anchor else 1   # the first slot that drafts
    decay = torch.exp(-(torch.arange(first, B).float() - first) / 4)  # earlier slots matter more, as in DFlash training

    def loss_of(step):
        ids, n_prompt, feats = data[rng.randrange(len(data))]
        anchors = torch.tensor(sorted(rng.sample(range(n_prompt, len(ids) - B + 1 - (1 - first)), anchors_per_step)))
        ids_t = torch.tensor(ids)
        block = torch.full((len(anchors), B), MASK_ID)
        block[:, 0] = ids_t[anchors]
        hidden = ed.drafter_forward(drafter, ed.drafter_context(drafter, feats), anchors, block, embed.weight)
        labels = ids_t[anchors[:, None] + torch.arange(1, B + 1 - first)]
        if family:
            rows, prev, state, logits = ed.proposal_rows(drafter, hidden), ids_t[anchors], None, []
            for k in range(rows.shape[1]):
                raw, state = ed.family(drafter).correct(drafter, head(rows[:, k]), rows[:, k], prev, state, k,
                                                        embed.weight)
                logits.append(raw)
                prev = labels[:, k]
            logits = torch.stack(logits, 1)
        else:
            logits = head(hidden[:, first:])
        return (torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(0)
                * decay).sum() / decay.sum()
    optimize(weights.values(), steps, loss_of, "drafter", on_step=on_step and (lambda step: on_step(step, weights, cfg)))
    if family and layout == "speculators":
        save_speculators(out_dir, cfg, {k: v.detach() for k, v in weights.items()}, kind="dspark",
                         architectures=["DSparkSpeculator"], sample_from_anchor=True,
                         markov_rank=dflash["markov_rank"], markov_head_type=dflash["markov_head_type"])
    elif from_anchor and not family:
        save_speculators(out_dir, cfg, {k: v.detach() for k, v in weights.items()}, sample_from_anchor=True)
    else:
        save_drafter(out_dir, cfg, {k: v.detach() for k, v in weights.items()})


FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def train_eagle3(out_dir, target, data, steps=600, ttt=3, anchors_per_step=48, layer_ids=(1, 3, 4), seed=3):
    """An EAGLE-3 drafter (one Qwen3 layer over [embedding; fc(3 captured layers)]) trained with the test-time
    steps SpecForge and speculators use: step 1 teacher-forced over the text, then ttt - 1 steps each fed the
    previous step's hidden and the reference token, every step's prediction in the loss. Saved in speculators'
    layout (captured layers as hidden_states indices, norm_before_residual true, its lm_head the target's)."""
    H, V = target.config.hidden_size, target.config.vocab_size
    layer = {"model_type": "qwen3", "hidden_size": H, "intermediate_size": 192, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 512, "rope_theta": 10000.0, "vocab_size": V, "attention_bias": False}
    weights = {k: v.requires_grad_() for k, v in eagle3_weights(layer, len(layer_ids), seed).items()}
    drafter = ed.Drafter(name="training", checkpoint=out_dir, cfg=layer, weights=weights, layers=list(layer_ids),
                         block_size=ttt + 1, mask_token_id=-1, rules=[], rope=ed.build_rope(layer, "cpu"),
                         logit_rows=ed.LOGIT_ROWS_PER_CHUNK, generation="EAGLE-3",
                         head={"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False,
                               "norm_output": False})
    head = train_chain(drafter, target, data, steps, ttt, anchors_per_step, random.Random(4), "eagle3")
    save_drafter(out_dir, eagle3_config(layer, layer_ids, ttt, target.config.architectures[0]),
                 {**{k: v.detach() for k, v in weights.items()},
                                                                  "lm_head.weight": head.weight.detach().clone()})


def train_chain(drafter, target, data, steps, ttt, anchors_per_step, rng, what):
    """EAGLE-3's and MTP's training, as SpecForge and speculators train EAGLE-3: step 1 teacher-forced over the
    text, then ttt - 1 steps each fed the previous step's hidden and the reference token, every step's prediction
    in the loss (ttt = 1: one step). Returns the target's head."""
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    for prm in target.parameters():
        prm.requires_grad_(False)

    def loss_of(step):
        ids, n_prompt, feats = data[rng.randrange(len(data))]
        anchors = torch.tensor(sorted(rng.sample(range(n_prompt, len(ids) - ttt), anchors_per_step)))
        ids_t = torch.tensor(ids)
        context = ed.causal_pass(drafter, feats, ids, embed.weight)
        labels = ids_t[anchors[:, None] + torch.arange(1, ttt + 1)]
        logits = ed.causal_chain(drafter, context, anchors, None, embed.weight, head, "training", labels)
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels)
    optimize(drafter.weights.values(), steps, loss_of, what)
    return head


def eagle3_weights(layer, n_aux, seed, scale=0.08):
    """An EAGLE-3 drafter's tensors for a Qwen3-like layer config, randomly initialised (norm weights = 1)."""
    g = torch.Generator().manual_seed(seed)
    H, I, hd = layer["hidden_size"], layer["intermediate_size"], layer["head_dim"]
    q, kv = layer["num_attention_heads"] * hd, layer["num_key_value_heads"] * hd

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale
    p = "layers.0."
    return {"fc.weight": rnd(H, n_aux * H), "norm.weight": torch.ones(H), p + "hidden_norm.weight": torch.ones(H),
            p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
            p + "self_attn.q_proj.weight": rnd(q, 2 * H), p + "self_attn.k_proj.weight": rnd(kv, 2 * H),
            p + "self_attn.v_proj.weight": rnd(kv, 2 * H), p + "self_attn.o_proj.weight": rnd(H, q),
            p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
            p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H), p + "mlp.down_proj.weight": rnd(H, I)}


def eagle3_config(layer, layer_ids, steps, verifier="Qwen3ForCausalLM"):
    """speculators' eagle3 config: the layer under transformer_layer_config, the captured layers (this tool's layer
    ids, layer outputs) as hidden_states indices, norm_before_residual as speculators' trainer sets it."""
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
            "draft_vocab_size": layer["vocab_size"], "norm_before_residual": True, "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layer_ids], "norm_before_fc": False, "fc_norm": False,
            "norm_output": False, "speculators_version": "0.9.0",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": None, "architectures": [verifier]}}}


def mtp_weights(cfg, seed, scale=0.08):
    """An MTP layer's tensors for a target config (a dict), randomly initialised: fc over [embedding; hidden], a
    full-attention layer whose q_proj gives each head's query and gate, norm weights at the plain scale 1."""
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv, g = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * scale
    p = "layers.0."
    return {"fc.weight": rnd(H, 2 * H), "pre_fc_norm_embedding.weight": torch.ones(H),
            "pre_fc_norm_hidden.weight": torch.ones(H), "norm.weight": torch.ones(H),
            p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H),
            p + "self_attn.q_proj.weight": rnd(2 * q, H), p + "self_attn.k_proj.weight": rnd(kv, H),
            p + "self_attn.v_proj.weight": rnd(kv, H), p + "self_attn.o_proj.weight": rnd(H, q),
            p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
            p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H), p + "mlp.down_proj.weight": rnd(H, I)}


def mtp_drafter(cfg, weights, steps, rope, last_layer):
    """The Drafter record of an MTP layer, built here for training (or timing), not loaded from a checkpoint."""
    return ed.Drafter(name="mtp", checkpoint="", cfg=cfg, weights=weights, layers=[last_layer], block_size=steps + 1,
                      mask_token_id=-1, rules=[], rope=rope, logit_rows=ed.LOGIT_ROWS_PER_CHUNK, generation="MTP",
                      head={"norm_output": True, "gate": True})


def train_mtp(target_dir, steps=300, ttt=1, anchors_per_step=48):
    """A trained MTP layer for the hybrid demo target, written into its checkpoint as Qwen3.5 ships one: mtp.* tensors
    in its model.safetensors (norms zero-centred: the stored weight w scales by 1 + w) and mtp_num_hidden_layers in
    its config. Trained for one step (ttt = 1: position j's output predicts token j + 2); the engines then run it
    for K steps, fed its own post-norm output."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    weights = {k: v.requires_grad_() for k, v in mtp_weights(target.config.to_dict(), 5).items()}
    last = target.config.num_hidden_layers - 1
    drafter = mtp_drafter(target.config.to_dict(), weights, ttt, ed.target_rope(target.config, "cpu"), last)
    data = training_data(target, language(), [last], random.Random(6))
    train_chain(drafter, target, data, steps, ttt, anchors_per_step, random.Random(7), "mtp")
    path = os.path.join(target_dir, "model.safetensors")
    state = {k: v for k, v in load_file(path).items() if not k.startswith("mtp.")}
    state.update({"mtp." + k: (v.detach() - 1.0 if "norm" in k.split(".")[-2] else v.detach()).contiguous()
                  for k, v in weights.items()})
    save_file(state, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)
    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    config["mtp_num_hidden_layers"] = 1
    with open(os.path.join(target_dir, "config.json"), "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(f"wrote the MTP layer into {target_dir}", flush=True)


LILICORR = {"candidate_topk": 4, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "mlp_ratio": 2.0,
            "factor_dim": 16, "vector_eps": 1e-4, "logit_scale": 8.0}   # dflash_config's lilicorr_* (modelopt's test sizes)


def train_lilicorr(out_dir, target, data, steps=600, anchors_per_step=48):
    """A LiLiCorr drafter in the engines' layout (architectures LiLiCorrDraftModel, lilicorr_* in dflash_config,
    lilicorr.* tensors; no trainer in speculators or SpecForge makes one): a one-layer DFlash backbone trained
    briefly (60 steps: often wrong, its top-k candidates still holding the reference, so the walk has choices to
    make), then frozen, and a correlator (width 32, so token_proj exists) trained to walk the reference: at each anchor, cross-entropy of the
    start scores toward the reference token's rank among slot 0's candidates, and of each pair row (from the
    reference's candidate before it) toward the next one, where both are among the candidates."""
    from safetensors.torch import load_file
    demo = out_dir + ".backbone"
    train_drafter(demo, target, language(), steps=60, data=data, num_hidden_layers=1, layer_types=["full_attention"])
    with open(os.path.join(demo, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["LiLiCorrDraftModel"]
    cfg["dflash_config"].update({"lilicorr_" + k: v for k, v in LILICORR.items()})
    backbone = load_file(os.path.join(demo, "model.safetensors"))
    head = {**LILICORR, "width": LILICORR["hidden_size"], "block": cfg["block_size"], "context_rows": True}
    g = torch.Generator().manual_seed(8)
    correlator = {k: (torch.ones(shape) if k.endswith("norm.weight") else torch.zeros(shape) if k.endswith("bias")
                      else torch.randn(*shape, generator=g) * 0.1).requires_grad_()
                  for k, shape in ed.lilicorr_tensors(head, cfg["hidden_size"]).items()}
    drafter = ed.Drafter(name="training", checkpoint=out_dir, cfg=cfg, layers=cfg["dflash_config"]["target_layer_ids"],
                         weights={**backbone, **{"lilicorr." + k: v for k, v in correlator.items()}},
                         block_size=cfg["block_size"], mask_token_id=MASK_ID,
                         rules=ed.layer_rules(cfg, ed.Settings()),
                         rope=ed.build_rope(cfg, "cpu"), logit_rows=ed.LOGIT_ROWS_PER_CHUNK, generation="LiLiCorr",
                         head=head)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    for prm in target.parameters():
        prm.requires_grad_(False)
    rng, B, k = random.Random(9), cfg["block_size"], LILICORR["candidate_topk"]

    def loss_of(step):
        ids, n_prompt, feats = data[rng.randrange(len(data))]
        anchors = torch.tensor(sorted(rng.sample(range(n_prompt, len(ids) - B + 1), anchors_per_step)))
        ids_t = torch.tensor(ids)
        block = torch.full((len(anchors), B), MASK_ID)
        block[:, 0] = ids_t[anchors]
        with torch.no_grad():
            context = ed.drafter_context(drafter, feats)
            rows = ed.drafter_forward(drafter, context, anchors, block, embed.weight)[:, 1:]
            logp, candidates = lm_head(rows).float().log_softmax(-1).topk(k, dim=-1)
        start, pairs = ed.lilicorr_scores(drafter, rows, candidates, logp, context[-1][0][0][anchors - 1], embed.weight)
        at = candidates == ids_t[anchors[:, None] + torch.arange(1, B)][:, :, None]
        has, rank = at.any(-1), at.float().argmax(-1)
        rows_of = pairs.gather(2, rank[:, :-1, None, None].expand(-1, -1, 1, k))[:, :, 0]
        losses = torch.cat([torch.nn.functional.cross_entropy(start, rank[:, 0], reduction="none")[:, None],
                            torch.nn.functional.cross_entropy(rows_of.transpose(1, 2), rank[:, 1:], reduction="none")], 1)
        keep = torch.cat([has[:, :1], has[:, :-1] & has[:, 1:]], 1)
        weight = keep * (1 + 3 * (rank > 0))   # where the backbone's argmax is wrong, the walk has to learn to turn
        return (losses * weight).sum() / weight.sum()
    optimize(list(correlator.values()), steps, loss_of, "lilicorr", lr=3e-3)
    save_drafter(out_dir, cfg, {**backbone, **{"lilicorr." + k: v.detach() for k, v in correlator.items()}})
    for name in os.listdir(demo):
        os.remove(os.path.join(demo, name))
    os.rmdir(demo)


def make_llama(out=None, steps=1000):
    """tests/fixtures/llama: a Llama target of the demo's widths trained on the demo language, and an EAGLE-3
    drafter trained for it (SGLang's default for Llama targets is a token tree: tests/test_eagle_tree.py)."""
    out = out or os.path.join(FIXTURES, "llama")
    torch.set_num_threads(2)
    lang = language()
    target = train_target(os.path.join(out, "target"), lang, steps=steps, llama=True)
    data = training_data(target, lang, [1, 3, 4], random.Random(1))
    train_eagle3(os.path.join(out, "eagle3"), target, data)
    print(f"wrote {out}", flush=True)


def make_families(out=None, only=None):
    """The family fixtures for the demo target as it is committed (minutes on 2 cores)."""
    from transformers import AutoModelForCausalLM
    out = out or os.path.join(FIXTURES, "families")
    torch.set_num_threads(2)
    lang = language()
    target = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "demo", "target"), dtype=torch.float32).eval()
    data = training_data(target, lang, [1, 3, 4], random.Random(1))
    if only == "eagle3":
        train_eagle3(os.path.join(out, "eagle3"), target, data)
        return
    if only == "lilicorr":
        train_lilicorr(os.path.join(out, "lilicorr"), target, data)
        return
    if only == "confidence":
        train_confidence(os.path.join(out, "dspark_confidence"), target, data)
        return
    for name in FAMILIES:
        train_drafter(os.path.join(out, name), target, lang, steps=600, family=name, data=data, num_hidden_layers=1,
                      layer_types=["full_attention"])
        print(f"wrote {os.path.join(out, name)}", flush=True)


def train_confidence(out, target, data, steps=200):
    """tests/fixtures/families/dspark_confidence: the DSpark fixture with a confidence head as vLLM 0.34 builds it (one
    linear over each slot's final-normed row, to a logit), fitted by logistic regression to P(slot i accepted | the
    slots before it accepted) on the training texts' anchors (L2 1e-3, L-BFGS); seconds."""
    import shutil
    import torch.nn.functional as F
    from safetensors.torch import load_file
    src = os.path.join(FIXTURES, "families", "dspark_vanilla")
    d = ed.load_drafter(src, target.config, ed.Settings(dtype="float32", device="cpu", quiet=True))
    embed_w, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings()
    rows, labels = [], []
    with torch.no_grad():
        for ids, n_prompt, feats in data:
            anchors = ed.fitting_anchors(n_prompt, len(ids), d.block_size)
            ids_t = torch.tensor(ids)
            context = ed.drafter_context(d, feats)
            drafts, _ = ed.draft_all_anchors(d, context, anchors, ids_t[anchors], embed_w, lm_head)
            hidden = ed.proposal_rows(d, ed.drafter_forward(d, context, anchors, ed.mask_block(d, ids_t[anchors]),
                                                            embed_w))
            hit = drafts == ids_t[anchors[:, None] + 1 + torch.arange(drafts.shape[1])]
            reached = torch.cat([torch.ones(len(anchors), 1, dtype=torch.bool), hit[:, :-1].cumprod(1).bool()], 1)
            rows.append(hidden[reached].float())
            labels.append(hit[reached].float())
    x, y = torch.cat(rows), torch.cat(labels)
    w, b = torch.zeros(x.shape[1], requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        value = F.binary_cross_entropy_with_logits(x @ w + b, y) + 1e-3 * w.square().sum()
        value.backward()
        return value
    opt.step(loss)
    print(f"confidence head: {len(y)} slots, {y.mean():.3f} accepted, loss {loss().item():.4f}", flush=True)
    shutil.copytree(src, out, dirs_exist_ok=True)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(enable_confidence_head=True, confidence_head_with_markov=False)
    weights = load_file(os.path.join(src, "model.safetensors"))
    weights.update({"confidence_head.proj.weight": w.detach()[None].clone(), "confidence_head.proj.bias": b.detach()})
    save_drafter(out, cfg, weights)
    print(f"wrote {out}", flush=True)


# vLLM's CPU attention takes head sizes 32-512 and its runner one in-block mask kind for every drafter layer: the demo
# language at the demo's widths, its heads 2 x 32 wide, the drafter's two layers both full (bidirectional) attention.
SERVED_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}


def make_served_pair(out=None):
    """tests/fixtures/demo_vllm: a target and drafter vLLM serves (tests/test_real_engine.py), about 3 minutes."""
    out = out or os.path.join(FIXTURES, "demo_vllm")
    torch.set_num_threads(2)
    lang = language()
    target = train_target(os.path.join(out, "target"), lang, heads=SERVED_HEADS)
    train_drafter(os.path.join(out, "drafter"), target, lang, **SERVED_HEADS, layer_types=["full_attention"] * 2,
                  use_sliding_window=False, sliding_window=None)
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        for row in demo_prompts(lang):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {out}", flush=True)


def main(out=None, hybrid=False, from_anchor=False):
    """The demo pair, or with hybrid=True the hybrid demo pair (tests/fixtures/demo_hybrid): the same
    language, a Qwen3.5 target trained on shorter texts (its reference linear-attention kernels are slow on
    CPU; the language needs two words of context), about 8 minutes."""
    out = out or os.path.join(FIXTURES, "demo_hybrid" if hybrid else "demo_from_anchor" if from_anchor else "demo")
    torch.set_num_threads(2)
    lang = language()
    if from_anchor:   # for the demo target as it is committed
        from transformers import AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "demo", "target"), dtype=torch.float32)
        train_drafter(os.path.join(out, "drafter"), target.eval(), lang, from_anchor=True)
        print(f"wrote {out}")
        return
    if hybrid:
        target = train_target(os.path.join(out, "target"), lang, steps=800, batch=16, hybrid=True, seq_len=64)
        train_drafter(os.path.join(out, "drafter"), target, lang, layer_ids=(0, 2, 3))
    else:
        target = train_target(os.path.join(out, "target"), lang)
        train_drafter(os.path.join(out, "drafter"), target, lang)
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        for row in demo_prompts(lang):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {out}")


# ---------------------------------------------------------------------------------------------------------------
# The real pair (--real): SmolLM2-135M-Instruct (the Q4_1 GGUF tests/fetch_real.py takes out of the wheel) and a
# DFlash drafter trained here on the target's own greedy chat replies to templated instruction prompts (code in many
# languages, classes, shell, SQL; arithmetic, algebra, calculus; explanations, history; lists, advice, bullet
# summaries; rewrites, emails, letters, essays; a quarter with a system prompt). The drafter starts from the target's
# last two layers (warm_drafter_weights): at this compute that trains far better than a random start.

REAL_GGUF = os.path.join(FIXTURES, "real", "SmolLM2-135M-Instruct.Q4_1.gguf")
REAL_DRAFTER = os.path.join(FIXTURES, "real_drafter")
REAL_CACHE = os.path.join(FIXTURES, "real", "drafter_data.pt")   # git-ignored: the replies and their features
REAL_MASK_ID = 16        # <empty_output>: a StarCoder special of SmolLM2's vocab that chat text never holds
REAL_BLOCK = 8

REAL_SLOTS = {
    "lang": ["Python", "JavaScript", "Go", "C", "Java", "TypeScript", "Rust", "C++", "Ruby", "C#", "Kotlin", "PHP"],
    "code_task": ["reverses a string", "checks whether a number is prime", "counts the vowels in a sentence",
                  "returns the largest element of a list", "computes the factorial of n", "sums the digits of an integer",
                  "removes duplicates from a list while keeping the order", "checks whether a word is a palindrome",
                  "computes the nth Fibonacci number", "converts Celsius to Fahrenheit", "finds the average of a list of numbers",
                  "sorts a list of words by length", "counts how often each word appears in a text",
                  "returns the second smallest number in a list", "checks whether two strings are anagrams",
                  "flattens a nested list", "performs binary search on a sorted array", "merges two sorted arrays",
                  "rotates a matrix by 90 degrees", "finds the longest common prefix of a list of strings",
                  "validates an email address with a regular expression", "converts a Roman numeral to an integer",
                  "computes the greatest common divisor of two numbers", "checks whether parentheses are balanced",
                  "splits a list into chunks of size k", "finds all pairs in an array that sum to a target",
                  "reads a CSV file and prints the sum of one column", "capitalizes the first letter of every word",
                  "computes the running total of a list", "returns the k most frequent elements",
                  "converts a decimal number to binary", "checks whether a year is a leap year",
                  "finds the longest word in a sentence", "computes the dot product of two vectors",
                  "groups a list of people by age", "transposes a matrix", "generates all permutations of a string",
                  "counts the lines in a text file", "implements bubble sort", "implements quicksort",
                  "removes all whitespace from a string", "finds the missing number in a list from 1 to n",
                  "computes the median of a list", "parses a date string and prints the weekday",
                  "retries an HTTP request up to three times", "checks whether a linked list has a cycle"],
    "structure": ["a stack", "a queue", "a singly linked list", "a binary search tree", "a min-heap", "a hash map",
                  "a bank account with deposit and withdraw", "a to-do list", "a simple inventory", "a matrix with addition",
                  "a 2D point with a distance method", "a rectangle with area and perimeter", "a shopping cart",
                  "a counter that can be reset", "a circular buffer", "a trie for word lookup", "a graph with BFS",
                  "a student record with grades", "a timer", "a deck of cards with shuffle"],
    "shell_task": ["counts the files in the current directory", "renames all .txt files to .md",
                   "prints the disk usage of each subdirectory", "backs up a folder into a dated tar.gz archive",
                   "finds every line containing ERROR in a log file", "prints the 5 most common words in a file",
                   "checks whether a website is reachable", "deletes files older than 30 days in /tmp/cache",
                   "prints the current memory usage", "loops over all .csv files and prints their line counts",
                   "creates a directory for each month of the year", "replaces a word in every file of a folder",
                   "shows which process listens on port 8080", "prints the total size of all .log files"],
    "sql_task": ["lists all employees who earn more than their manager", "counts the orders per month in 2024",
                 "finds the three best-selling products", "returns customers who never placed an order",
                 "computes the average salary per department", "finds duplicate email addresses in a users table",
                 "lists students with their average grade, highest first", "deletes rows older than one year from a logs table",
                 "joins the orders and customers tables and shows each customer's city",
                 "returns the second highest salary", "counts the active users per country",
                 "finds products whose price is above the average price", "lists the latest order of every customer",
                 "computes the total revenue per product category"],
    "concept": ["recursion", "a closure", "a REST API", "Big O notation", "object-oriented programming", "a hash table",
                "garbage collection", "a race condition", "version control with Git", "unit testing", "an API key",
                "dynamic programming", "a database index", "the difference between a list and a tuple in Python",
                "async and await", "a pointer in C", "the difference between SQL and NoSQL databases", "a compiler",
                "an interpreter", "caching", "Docker containers", "a binary tree", "immutable data", "dependency injection",
                "the difference between TCP and UDP", "exceptions and error handling", "regular expressions",
                "the difference between == and === in JavaScript", "ownership in Rust", "goroutines in Go"],
    "name": ["Anna", "Ben", "Carlos", "Dana", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack", "Lena", "Maya", "Omar",
             "Priya", "Sam", "Tom", "Yuki", "Zoe", "Luis", "Nora"],
    "item": ["apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "cards", "oranges", "shells",
             "tickets", "balloons", "cupcakes", "coins"],
    "func": ["x^2 + 3x", "sin(x) * cos(x)", "e^(2x)", "ln(x^2 + 1)", "x * e^x", "(x + 1)^4", "sqrt(x) + 1/x",
             "x^4 - 2x^2 + 7", "cos(3x)", "x^2 * ln(x)", "tan(x)", "1 / (1 + x^2)", "5x^3 - x", "e^x * cos(x)"],
    "equation": ["3x + 7 = 22", "2x - 5 = 11", "x^2 - 5x + 6 = 0", "4(x - 2) = 20", "x/3 + 4 = 10",
                 "x^2 - 9 = 0", "5x + 3 = 2x + 18", "2x^2 + 3x - 2 = 0", "7 - 2x = 1", "x^2 + 4x + 4 = 0"],
    "topic": ["photosynthesis", "the water cycle", "how vaccines work", "gravity", "inflation", "how a rainbow forms",
              "the greenhouse effect", "how the heart pumps blood", "supply and demand", "how batteries store energy",
              "why the sky is blue", "plate tectonics", "how the internet sends data", "compound interest",
              "how airplanes fly", "the seasons on Earth", "how muscles grow", "recycling", "electricity", "volcanoes",
              "black holes", "DNA and genes", "the immune system", "climate change", "how a bill becomes a law",
              "the scientific method", "how solar panels work", "evolution by natural selection", "the stock market",
              "how the brain stores memories", "earthquakes", "the moon's phases", "how GPS works", "antibiotics",
              "how a refrigerator keeps food cold", "the nitrogen cycle", "how encryption protects data",
              "machine learning", "how tides work", "the speed of light"],
    "event": ["the fall of the Roman Empire", "the Industrial Revolution", "the American Revolution", "World War I",
              "the Renaissance", "the invention of the printing press", "the Cold War", "the moon landing in 1969",
              "the building of the pyramids", "the Black Death", "the fall of the Berlin Wall", "the age of exploration",
              "the abolition of slavery", "the rise of the Mongol Empire", "the Great Depression", "the Meiji Restoration"],
    "audience": ["a ten-year-old", "a high school student", "a beginner", "my grandmother", "a busy manager",
                 "a new employee", "a college student"],
    "things": ["healthy breakfast ideas", "ways to save money", "tips for studying", "hobbies to try at home",
               "fruits that are high in vitamin C", "ways to reduce stress", "board games for families",
               "reasons to learn a second language", "things to pack for a camping trip", "habits of good writers",
               "ways to stay focused at work", "indoor plants that are easy to care for", "benefits of walking every day",
               "famous inventions of the 20th century", "tips for a job interview", "ways to be kind to neighbors",
               "ways to improve your writing", "tips for learning to code", "ideas for a rainy day",
               "ways to make a small apartment feel bigger", "tips for public speaking", "ways to drink more water",
               "good habits for a morning routine", "tips for running your first 5K", "ways to keep a team motivated",
               "tips for traveling on a budget", "ways to protect your privacy online", "tips for cooking rice",
               "reasons to read more books", "ways to reduce plastic waste"],
    "goal": ["save money on groceries", "learn a new language", "get more exercise", "sleep less on the weekend",
             "write a novel", "start running", "keep my desk organized", "spend less time on my phone",
             "prepare for a math exam", "make new friends in a new city", "eat more vegetables",
             "get better at chess", "learn to play the guitar", "manage my time at university"],
    "sentence": ["The meeting was moved because many people could not come on Monday.",
                 "Our team finished the project early and the client was very happy with the result.",
                 "I think we should buy a new printer because the old one breaks all the time.",
                 "The weather was bad, so the school trip to the museum was cancelled.",
                 "She practiced the piano every day and finally won the competition.",
                 "The new cafe on Main Street serves great coffee but the prices are high.",
                 "Please remember to turn off the lights when you leave the office.",
                 "The city plans to build more bike lanes to reduce traffic.",
                 "He forgot his keys at home and had to wait outside for an hour.",
                 "Our website was slow last week because of a problem with the server.",
                 "The library will close early on Friday for a staff training.",
                 "We need more volunteers for the charity run next month.",
                 "The report is late because the data arrived two days after the deadline.",
                 "My brother started a small business selling handmade candles."],
    "style": ["more formal", "simpler", "more friendly", "shorter", "more polite", "more exciting", "more professional"],
    "email_about": ["asking for a day off next Monday", "thanking a client for a successful project",
                    "inviting the team to a farewell lunch", "following up on an unpaid invoice",
                    "apologizing for a late delivery", "asking a professor for an extension on an essay",
                    "introducing yourself to a new team", "requesting a refund for a broken blender",
                    "announcing a change in office hours", "asking a neighbor to keep the noise down",
                    "confirming an interview on Wednesday at 10 am", "declining a job offer politely",
                    "asking a landlord to fix the heating", "reminding the team about the quarterly report"],
    "recipient": ["my manager", "a colleague", "a customer", "my landlord", "a teacher", "the hiring team", "a friend"],
    "letter": ["a cover letter for a junior web developer job", "a thank-you note to a teacher",
               "a letter of complaint to an airline about lost luggage", "a short speech for a friend's wedding",
               "a product description for a reusable water bottle", "a short story about a lost dog finding its way home",
               "a poem about autumn", "a motivational message for a sports team", "a short blog post about working from home",
               "an announcement for a school science fair", "a review of a restaurant you liked",
               "a LinkedIn post about finishing an online course"],
    "subject": ["the benefits of regular exercise", "the history of the internet", "how remote work changed offices",
                "the pros and cons of electric cars", "why bees matter", "the causes of World War I",
                "the life of Marie Curie", "the main ideas of stoicism", "how social media affects teenagers",
                "the importance of sleep", "the Apollo program", "the causes of the Great Depression",
                "renewable energy", "the benefits of reading", "the rise of smartphones"],
    "system": ["You are a helpful assistant.", "You are a concise assistant. Answer clearly.",
               "You are an expert programmer who writes clean, well-commented code.",
               "You are a friendly teacher who explains things simply."],
}

REAL_TEMPLATES = [   # (category, template); {slot} names a REAL_SLOTS list, numbers are drawn
    ("code", "Write a {lang} function that {code_task}."),
    ("code", "Show me how to write a function in {lang} that {code_task}, and explain how it works."),
    ("code", "Can you give me a short {lang} program that {code_task}?"),
    ("code", "Write a function that {code_task}. Use {lang} and add comments."),
    ("code", "Write a {lang} function that {code_task}, with a docstring and an example of its use."),
    ("code", "Implement {structure} in {lang}."),
    ("code", "Write a {lang} class for {structure}, with its main methods."),
    ("code", "Show a {lang} implementation of {structure} and explain each method."),
    ("code", "Write a Bash script that {shell_task}."),
    ("code", "Give me a shell one-liner that {shell_task}, and explain it."),
    ("code", "Write a SQL query that {sql_task}."),
    ("code", "Write a SQL query that {sql_task}, and explain how it works."),
    ("code", "Explain {concept} with a short {lang} example."),
    ("code", "What is {concept}? Show an example in {lang}."),
    ("code", "Write unit tests in {lang} for a function that {code_task}."),
    ("code", "Here is my task: a program that {code_task}. Write it in {lang} and handle invalid input."),
    ("math", "{name} has {a} {item}. {name2} gives {name} {b} more. How many {item} does {name} have now?"),
    ("math", "{name} had {c} {item} and gave {b} of them away. How many are left?"),
    ("math", "A box holds {a} {item}. How many {item} are in {b} boxes?"),
    ("math", "{name} buys {a} {item} for {b} dollars each. How much does {name} pay in total? Show your work."),
    ("math", "There are {c} {item} shared equally among {d} friends. How many does each friend get, and how many are left over?"),
    ("math", "What is {a} times {b}? Explain how you got the answer."),
    ("math", "Solve for x: {equation}. Show each step."),
    ("math", "Find the derivative of f(x) = {func}. Show the steps."),
    ("math", "What is the derivative of {func}? Explain which rules you use."),
    ("math", "Compute the integral of {func} with respect to x, step by step."),
    ("math", "A train travels {c} km in {d} hours. What is its average speed? Explain."),
    ("math", "A shirt costs {c} dollars and is on sale for {b} percent off. What is the sale price? Show your work."),
    ("math", "What is {b} percent of {c}? Explain the calculation."),
    ("math", "The sides of a rectangle are {a} cm and {b} cm. Find its area and perimeter."),
    ("explain", "Explain {topic} to {audience}."),
    ("explain", "What is {topic}? Give a short explanation."),
    ("explain", "Can you describe {topic} in simple words?"),
    ("explain", "Why is {topic} important? Explain it for {audience}."),
    ("explain", "Write a short paragraph about {topic}."),
    ("explain", "Explain {topic} step by step, with an example."),
    ("explain", "What caused {event}, and what were its effects?"),
    ("explain", "Give a short history of {event}."),
    ("explain", "Explain the importance of {event} to {audience}."),
    ("explain", "What is the difference between {topic} and {topic2}?"),
    ("explain", "How would you explain {concept} to {audience}?"),
    ("list", "List {n} {things}."),
    ("list", "Give me {n} {things}, with one sentence about each."),
    ("list", "What are some {things}? Please write a numbered list."),
    ("list", "Make a bullet list of {n} {things}."),
    ("list", "Give me {n} tips to {goal}, and explain why each one works."),
    ("list", "I want to {goal}. What should I do? Give advice with reasons."),
    ("list", "Summarize {subject} in {n} bullet points."),
    ("list", "What are the pros and cons of {topic}? Use bullet points."),
    ("list", "Summarize the main points of {event} in {n} bullet points."),
    ("rewrite", "Rewrite this sentence to be {style}: {sentence}"),
    ("rewrite", "Make the following text {style}: \"{sentence}\""),
    ("rewrite", "Fix the grammar and make it {style}: {sentence}"),
    ("rewrite", "Summarize in a few words: {sentence}"),
    ("rewrite", "Translate this into French: {sentence}"),
    ("rewrite", "Write a short email to {recipient} {email_about}."),
    ("rewrite", "Write a polite, professional email {email_about}."),
    ("rewrite", "Draft a friendly email to {recipient} {email_about}. Keep it under 150 words."),
    ("rewrite", "Write {letter}."),
    ("rewrite", "Write a short essay about {subject}."),
    ("rewrite", "Write an introduction paragraph for an article about {subject}."),
]


def real_prompts(n, seed=0):
    """n distinct instruction prompts, deterministic: templates drawn in turn, slots drawn; every fourth or so
    carries a system prompt (the chat template's default one otherwise)."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n:
        category, template = REAL_TEMPLATES[rng.randrange(len(REAL_TEMPLATES))]
        fill = {k: rng.choice(v) for k, v in REAL_SLOTS.items()}
        fill["name2"] = rng.choice([x for x in REAL_SLOTS["name"] if x != fill["name"]])
        fill["topic2"] = rng.choice([x for x in REAL_SLOTS["topic"] if x != fill["topic"]])
        fill.update(a=rng.randrange(2, 30), b=rng.randrange(2, 15), c=rng.randrange(30, 120), d=rng.randrange(2, 9),
                    n=rng.randrange(3, 8))
        text = template.format(**fill)
        system = fill["system"] if rng.random() < 0.25 else None
        if text not in seen:
            seen.add(text)
            rows.append({"category": category, "prompt": text, **({"system": system} if system else {})})
    return rows


def real_target():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path, _ = ed.gguf_target(REAL_GGUF, True)
    return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path))


def real_chat(tokenizer, p):
    """A prompt row's chat-template ids (its system prompt, if any, then the user turn)."""
    messages = ([{"role": "system", "content": p["system"]}] if p.get("system") else []) + \
        [{"role": "user", "content": p["prompt"]}]
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def real_replies(target, tokenizer, prompts, max_new_tokens, layer_ids, batch=64):
    """The target's greedy replies through its chat template, batched (left padding), each up to and with <|im_end|>,
    with the features of `layer_ids` the generation computes anyway: [(prompt ids, reply ids, features (T, k * H)
    bfloat16)], a row per prompt + reply token but the last (zeros: no draft ever reads it as context)."""
    eos = target.config.eos_token_id
    encoded = [real_chat(tokenizer, p) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))   # like lengths batched: less padding
    out = [None] * len(encoded)
    for lo in range(0, len(order), batch):
        chunk = order[lo:lo + batch]
        width = max(len(encoded[i]) for i in chunk)
        ids = torch.tensor([[eos] * (width - len(encoded[i])) + encoded[i] for i in chunk])
        mask = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in chunk])
        gen = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos, output_hidden_states=True,
                              return_dict_in_generate=True)
        # hidden_states[step][layer + 1]: decoder layer `layer`'s output; step 0 is the prompt's prefill
        steps = [torch.cat([gen.hidden_states[s][L + 1] for L in layer_ids], -1) for s in range(len(gen.hidden_states))]
        prefill, decoded = steps[0], torch.cat(steps[1:], 1) if len(steps) > 1 else steps[0][:, :0]
        for row, i in enumerate(chunk):
            g = gen.sequences[row, width:].tolist()
            reply = g[:g.index(eos) + 1] if eos in g else g
            feats = torch.cat([prefill[row, width - len(encoded[i]):], decoded[row, :len(reply) - 1],
                               prefill.new_zeros(1, prefill.shape[-1])])
            out[i] = (encoded[i], reply, feats.to(torch.bfloat16).clone())
        print(f"real: {lo + len(chunk)}/{len(encoded)} replies", flush=True)
    return out


def real_data(target, tokenizer, layer_ids, n_prompts, max_new_tokens):
    """[(ids, n_prompt, features (T, n_layers * H) bfloat16)], cached in REAL_CACHE (keyed by what made it)."""
    key = {"n_prompts": n_prompts, "max_new_tokens": max_new_tokens, "layers": list(layer_ids),
           "gguf_bytes": os.path.getsize(REAL_GGUF), "prompts": len(REAL_TEMPLATES), "from": "generate"}
    if os.path.isfile(REAL_CACHE):
        cached = torch.load(REAL_CACHE)
        if cached["key"] == key:
            print(f"real: {len(cached['data'])} replies and features from {REAL_CACHE}", flush=True)
            return cached["data"]
    import time
    t0 = time.time()
    replies = real_replies(target, tokenizer, real_prompts(n_prompts), max_new_tokens, layer_ids)
    data = [(prompt + reply, len(prompt), feats) for prompt, reply, feats in replies if len(reply) >= REAL_BLOCK + 4]
    print(f"real: generation and features {time.time() - t0:.0f} s, {len(data)} replies, "
          f"{sum(len(d[0]) - d[1] for d in data)} reply tokens", flush=True)
    torch.save({"key": key, "data": data}, REAL_CACHE)
    return data


def warm_drafter_weights(cfg, target, layer_ids, data, first_layer, seed=0):
    """Drafter tensors started from the target's own last layers (the drafter's layer i from target layer
    first_layer + i; an MLP narrower than the target's keeps its largest neurons): fc passes the last feature layer's
    output, the input of target layer first_layer, through unchanged and hidden_norm is that layer's input norm, so
    the first drafter layer's context keys and values are the target's own; q_norm / k_norm (the target has none)
    are set to the heads' mean RMS on the replies, which keeps the attention logits' scale."""
    w = random_drafter_weights(cfg, len(layer_ids), seed=seed, scale=0.02)
    H, I, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    sd = {k: v.detach().float() for k, v in target.state_dict().items()}
    fc = torch.zeros(H, len(layer_ids) * H)
    fc[:, -H:] = torch.eye(H)
    w["fc.weight"] = fc
    w["hidden_norm.weight"] = sd[f"model.layers.{first_layer}.input_layernorm.weight"].clone()
    w["norm.weight"] = sd["model.norm.weight"].clone()
    sample = torch.cat([feats[:, -H:].float() for _, _, feats in data[:32]])
    for i in range(cfg["num_hidden_layers"]):
        t, p = f"model.layers.{first_layer + i}.", f"layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            w[p + name + ".weight"] = sd[t + name + ".weight"].clone()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[p + f"self_attn.{name}.weight"] = sd[t + f"self_attn.{name}.weight"].clone()
        gate, up, down = (sd[t + f"mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
        keep = torch.sort((gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0)).topk(I).indices).values
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = gate[keep].clone(), up[keep].clone()
        w[p + "mlp.down_proj.weight"] = down[:, keep].clone()
        h = ed.rms_norm(sample, sd[t + "input_layernorm.weight"], cfg["rms_norm_eps"])
        for name in ("q", "k"):
            y = torch.nn.functional.linear(h, sd[t + f"self_attn.{name}_proj.weight"]).view(-1, hd)
            w[p + f"self_attn.{name}_norm.weight"] = torch.full((hd,), float(y.pow(2).mean(-1).sqrt().mean()))
    return w


def make_real(out=None, n_prompts=512, max_new_tokens=128, steps=850, seqs_per_step=4, anchors_per_seq=16,
              num_layers=2, intermediate=1024, negatives=4096, lr=1e-3, init="target", data=None):
    """The real pair's drafter (tests/fixtures/real_drafter): 2 layers at the target's width, started from the
    target's last two layers, block 8, the target's layers by the public default rule, mask token <empty_output>,
    trained with DFlash's objective on the target's own greedy replies; saved in bfloat16 in the public layout."""
    import time
    out = out or REAL_DRAFTER
    # one thread unless MAKE_DEMO_THREADS says more: on a shared box two threads of a busy pair of cores wait on
    # each other at every barrier (7x slower than one, measured), and one is near two's speed on an idle one
    torch.set_num_threads(int(os.environ.get("MAKE_DEMO_THREADS", "1")))
    torch.manual_seed(0)
    target, tokenizer = real_target()
    tc = target.config
    assert REAL_MASK_ID == tokenizer.convert_tokens_to_ids("<empty_output>")
    layer_ids = ed.default_layer_ids(tc.num_hidden_layers, 3)
    data = data or real_data(target, tokenizer, layer_ids, n_prompts, max_new_tokens)
    B = REAL_BLOCK
    cfg = drafter_config(tc, layer_ids=layer_ids, block_size=B, intermediate_size=intermediate,
                         num_hidden_layers=num_layers, num_attention_heads=tc.num_attention_heads,
                         num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps,
                         max_position_embeddings=tc.max_position_embeddings,
                         rope_theta=float(tc.rope_parameters["rope_theta"]), layer_types=["full_attention"] * num_layers,
                         use_sliding_window=False, sliding_window=None)
    cfg["dflash_config"]["mask_token_id"] = REAL_MASK_ID
    if init == "target":
        init_w = warm_drafter_weights(cfg, target, layer_ids, data, tc.num_hidden_layers - num_layers)
    else:
        init_w = random_drafter_weights(cfg, len(layer_ids), scale=0.02)
    weights = {k: v.requires_grad_() for k, v in init_w.items()}
    drafter = ed.Drafter(name="training", checkpoint=out, cfg=cfg, weights=weights, layers=layer_ids, block_size=B,
                         mask_token_id=REAL_MASK_ID, rules=ed.layer_rules(cfg, ed.Settings()),
                         rope=ed.build_rope(cfg, "cpu"), logit_rows=ed.LOGIT_ROWS_PER_CHUNK)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    for p in target.parameters():
        p.requires_grad_(False)
    rng = random.Random(1)
    decay = torch.exp(-torch.arange(B - 1).float() / 4)   # earlier slots matter more, as in DFlash training
    # The softmax of each step runs over the replies' tokens and `negatives` other tokens drawn afresh (a full
    # 49152-row head per draft slot would be most of a step's time on 2 cores); every token is pushed down in turn.
    seen = torch.tensor(sorted({t for ids, n_prompt, _ in data for t in ids[n_prompt:]}))
    others = torch.ones(tc.vocab_size, dtype=torch.bool)
    others[seen] = False
    others = others.nonzero()[:, 0]
    where = torch.full((tc.vocab_size,), -1, dtype=torch.long)
    g = torch.Generator().manual_seed(3)
    print(f"real: {len(data)} replies, {len(seen)} distinct reply tokens; {negatives} negatives a step", flush=True)
    order = []

    def loss_of(step):
        total = 0.0
        vocab = torch.cat([seen, others[torch.randperm(len(others), generator=g)[:negatives]]])
        where[vocab] = torch.arange(len(vocab))
        head_w = head.weight[vocab]
        for _ in range(seqs_per_step):   # every reply in turn, a fresh shuffle each pass
            if not order:
                order.extend(rng.sample(range(len(data)), len(data)))
            ids, n_prompt, feats = data[order.pop()]
            starts = range(n_prompt, len(ids) - B + 1)   # anchors: reply tokens (the first is the prefill's)
            anchors = torch.tensor(sorted(rng.sample(starts, min(anchors_per_seq, len(starts)))))
            ids_t = torch.tensor(ids)
            block = torch.full((len(anchors), B), REAL_MASK_ID)
            block[:, 0] = ids_t[anchors]
            hidden = ed.drafter_forward(drafter, ed.drafter_context(drafter, feats.float()), anchors, block, embed.weight)
            labels = ids_t[anchors[:, None] + torch.arange(1, B)]
            logits = torch.nn.functional.linear(hidden[:, 1:], head_w)
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), where[labels], reduction="none")
            total = total + (ce.mean(0) * decay).sum() / decay.sum()
        return total / seqs_per_step
    t0 = time.time()
    optimize(weights.values(), steps, loss_of, "real drafter", lr=lr)
    print(f"real: training {time.time() - t0:.0f} s", flush=True)
    save_drafter(out, cfg, {k: v.detach().to(torch.bfloat16) for k, v in weights.items()})
    size = os.path.getsize(os.path.join(out, "model.safetensors")) / 2 ** 20
    print(f"wrote {out} ({size:.1f} MB)", flush=True)


def make_series(out, every=100, steps=800, n_sequences=160):
    """The demo drafter trained again from scratch, as a training run: a checkpoint every `every` steps into
    out/step_<N>/, its tau on the demo prompts logged as it trains by eval_drafter.measure() (the README's
    training-loop example, run), from features saved once. Then --watch out --plot draws the series."""
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    target_dir = os.path.join(FIXTURES, "demo", "target")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    os.makedirs(out, exist_ok=True)
    saved = os.path.join(out, "features.safetensors")
    print(f"a training run into {out}: {steps} steps, a checkpoint and its tau every {every}", flush=True)
    if not os.path.exists(saved):
        print(f"saving the demo prompts' features once to {saved}", flush=True)
        assert ed.main(["--demo", "--quiet", "--save-hidden", saved]) == 0
    features = ed.load_features(saved, target_dir)

    def on_step(step, weights, cfg):
        if step % every == 0:
            save_drafter(os.path.join(out, f"step_{step}"), cfg, {k: v.detach() for k, v in weights.items()})
            r = ed.measure(weights, features, config=cfg, name="demo", step=step)
            print(f"step {step}: tau {r['tau']:.3f}, first-position acceptance "
                  f"{r['per_position']['acceptance'][0]:.3f}", flush=True)
    train_drafter(os.path.join(out, "final"), target, language(), steps=steps, on_step=on_step, n_sequences=n_sequences)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--series" in args:
        out, *counts = [a for a in args if not a.startswith("--")]   # OUT [EVERY [STEPS [SEQUENCES]]]
        make_series(out, *map(int, counts))
    elif "--served-pair" in args:
        make_served_pair(*[a for a in args if not a.startswith("--")])
    elif "--real" in args:
        make_real(*[a for a in args if not a.startswith("--")])
    elif "--llama" in args:
        make_llama(*[a for a in args if not a.startswith("--")])
    elif "--mtp" in args:
        train_mtp(next((a for a in args if not a.startswith("--")), os.path.join(FIXTURES, "demo_hybrid", "target")))
    elif any(f in args for f in ("--families", "--eagle3", "--lilicorr", "--confidence")):
        make_families(*[a for a in args if not a.startswith("--")],
                      only=next((k for k in ("eagle3", "lilicorr", "confidence") if "--" + k in args), None))
    else:
        main(*[a for a in args if not a.startswith("--")], hybrid="--hybrid" in args, from_anchor="--from-anchor" in args)
