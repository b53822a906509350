"""Build the tiny demo pair under tests/fixtures/demo: a Qwen3 target that speaks a synthetic language and a
DFlash drafter trained on that target's greedy output. Deterministic; about two minutes on 2 CPU cores.

    python tests/make_demo.py [OUT_DIR]
    python tests/make_demo.py --hybrid [OUT_DIR]     # the hybrid demo pair (Qwen3.5 target; transformers 5.x)
    python tests/make_demo.py --from-anchor [OUT_DIR]   # a drafter for the demo target trained with
                                                        # speculators' sample_from_anchor, in its layout
    python tests/make_demo.py --families [OUT_DIR]      # DSpark (vanilla, rnn) and Domino (shift_label off,
                                                        # on) drafters for the demo target, one layer each
    python tests/make_demo.py --mtp [TARGET_DIR]        # a trained MTP layer written into the hybrid demo
                                                        # target's checkpoint (mtp.*), as Qwen3.5 ships one

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


def optimize(params, steps, loss_of, what):
    """AdamW under a one-cycle schedule, as every demo model is trained: loss_of(step) gives the step's loss."""
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        loss = loss_of(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"{what} step {step} loss {loss.item():.3f}", flush=True)


def train_target(out_dir, lang, steps=1500, batch=32, hybrid=False, seq_len=SEQ_LEN):
    vocab = save_tokenizer(out_dir)
    torch.manual_seed(0)
    if hybrid:
        from transformers import Qwen3_5ForCausalLM as model_class
    else:
        from transformers import Qwen3ForCausalLM as model_class
    model = model_class(target_config(vocab, hybrid))
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
    for _ in range(n_sequences):
        prompt = [len(SPECIALS) + w for w in sample_text(lang, rng, rng.randrange(4, 12), 0.5)]
        ids = prompt + ed.plain_generate(target, prompt, completion, set())
        feats = ed.extract_hidden(target, ids, layer_ids, len(prompt)).features
        data.append((ids, len(prompt), torch.cat([feats[L] for L in layer_ids], -1).clone()))
    print("drafter data ready", flush=True)
    return data


def train_drafter(out_dir, target, lang, steps=1500, anchors_per_step=48, n_sequences=160, completion=128,
                  from_anchor=False, family=None, data=None, **config_overrides):
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
    settings = {"sliding_window": "train", "block_mask": "auto"}
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
                raw, state = ed.corrected(drafter, head(rows[:, k]), rows[:, k], prev, state, k, embed.weight)
                logits.append(raw)
                prev = labels[:, k]
            logits = torch.stack(logits, 1)
        else:
            logits = head(hidden[:, first:])
        return (torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(0)
                * decay).sum() / decay.sum()
    optimize(weights.values(), steps, loss_of, "drafter")
    if family and layout == "speculators":
        save_speculators(out_dir, cfg, {k: v.detach() for k, v in weights.items()}, kind="dspark",
                         architectures=["DSparkSpeculator"], sample_from_anchor=True,
                         markov_rank=dflash["markov_rank"], markov_head_type=dflash["markov_head_type"])
    elif from_anchor and not family:
        save_speculators(out_dir, cfg, {k: v.detach() for k, v in weights.items()}, sample_from_anchor=True)
    else:
        save_drafter(out_dir, cfg, {k: v.detach() for k, v in weights.items()})


FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def train_eagle3(out_dir, target, data, steps=600, ttt=3, anchors_per_step=48, layer_ids=(1, 3, 4)):
    """An EAGLE-3 drafter (one Qwen3 layer over [embedding; fc(3 captured layers)]) trained with the test-time
    steps SpecForge and speculators use: step 1 teacher-forced over the text, then ttt - 1 steps each fed the
    previous step's hidden and the reference token, every step's prediction in the loss. Saved in speculators'
    layout (captured layers as hidden_states indices, norm_before_residual true, its lm_head the target's)."""
    H, V = target.config.hidden_size, target.config.vocab_size
    layer = {"model_type": "qwen3", "hidden_size": H, "intermediate_size": 192, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
             "max_position_embeddings": 512, "rope_theta": 10000.0, "vocab_size": V, "attention_bias": False}
    weights = {k: v.requires_grad_() for k, v in eagle3_weights(layer, len(layer_ids), 3).items()}
    drafter = ed.Drafter(name="training", checkpoint=out_dir, cfg=layer, weights=weights, layers=list(layer_ids),
                         block_size=ttt + 1, mask_token_id=-1, rules=[], rope=ed.build_rope(layer, "cpu"),
                         logit_rows=ed.LOGIT_ROWS_PER_CHUNK, generation="EAGLE-3",
                         head={"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False,
                               "norm_output": False})
    head = train_chain(drafter, target, data, steps, ttt, anchors_per_step, random.Random(4), "eagle3")
    save_drafter(out_dir, eagle3_config(layer, layer_ids, ttt), {**{k: v.detach() for k, v in weights.items()},
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


def eagle3_config(layer, layer_ids, steps):
    """speculators' eagle3 config: the layer under transformer_layer_config, the captured layers (this tool's layer
    ids, layer outputs) as hidden_states indices, norm_before_residual as speculators' trainer sets it."""
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
            "draft_vocab_size": layer["vocab_size"], "norm_before_residual": True, "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in layer_ids], "norm_before_fc": False, "fc_norm": False,
            "norm_output": False, "speculators_version": "0.9.0",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": None, "architectures": ["Qwen3ForCausalLM"]}}}


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
    for name in FAMILIES:
        train_drafter(os.path.join(out, name), target, lang, steps=600, family=name, data=data, num_hidden_layers=1,
                      layer_types=["full_attention"])
        print(f"wrote {os.path.join(out, name)}", flush=True)


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


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--mtp" in args:
        train_mtp(next((a for a in args if not a.startswith("--")), os.path.join(FIXTURES, "demo_hybrid", "target")))
    elif "--families" in args or "--eagle3" in args:
        make_families(*[a for a in args if not a.startswith("--")], only="eagle3" if "--eagle3" in args else None)
    else:
        main(*[a for a in args if not a.startswith("--")], hybrid="--hybrid" in args, from_anchor="--from-anchor" in args)
