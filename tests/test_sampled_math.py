"""The expected-acceptance estimator under sampled decoding, against brute-force enumeration.

A toy: vocabulary 3, block 3 (two drafts a round), a prompt of one token and a 5-token completion. The
target's distribution at every prefix, and the drafter's proposal at every anchor and slot, are fixed random
tables (some target rows put zero mass on a token, as top-k / top-p do). Every path of the real sampled loop
is enumerated: the prefill token, the drafts of each round, each accept or reject, each residual or bonus
token, with their probabilities. That gives, for every text, P(text) and E[rounds | text] exactly; the
tool's forward pass over anchors must give the same E[rounds | text] (and E[committed], the histogram) from
the per-slot acceptance probabilities c_j = min(1, q_j(r) / p_j(r)) alone.
"""
import itertools
from collections import defaultdict

import pytest
import torch

import eval_drafter as ed

V, B, N_PROMPT, L = 3, 3, 1, 6   # L: prompt + completion tokens


def table(key, zero_some=False):
    """A fixed random distribution over V tokens for any key (a tuple of ints: their hash is the same in every
    process)."""
    g = torch.Generator().manual_seed(hash(key) % (2**31))
    w = torch.rand(V, generator=g, dtype=torch.float64) + 0.05
    if zero_some and torch.rand(1, generator=g).item() < 0.4:
        w[int(torch.randint(V, (1,), generator=g))] = 0.0   # outside the support at these settings
    return w / w.sum()


def target_p(prefix):
    return table((0,) + tuple(prefix), zero_some=True)


def proposal(kind, prefix, j, previous, before=()):
    """The drafter's slot-j distribution at the anchor ending `prefix`: 'sample' (DFlash: depends on the
    anchor's context and the slot), 'argmax' (one-hot at that distribution's argmax), 'selector' (DFlash 2:
    also on the previous slot's token) or 'chain' (DSpark's rnn head, Domino: on every draft `before` it in
    the block)."""
    if kind == "selector":
        return table((2,) + tuple(prefix) + (j, previous))
    if kind == "chain":
        return table((3,) + tuple(prefix) + (j,) + tuple(before))
    q = table((1,) + tuple(prefix) + (j,))
    return torch.nn.functional.one_hot(q.argmax(), V).double() if kind == "argmax" else q


def enumerate_loop(kind):
    """{text: {round lengths: probability}} over every path of the sampled speculative loop. A round counts
    while its block lies inside the text (anchor + B - 1 <= L - 1), as the tool counts them."""
    out = defaultdict(lambda: defaultdict(float))

    def finish(prefix, lengths, prob):
        if len(prefix) >= L:
            out[tuple(prefix[:L])][lengths] += prob
            return
        for t, pt in enumerate(target_p(prefix).tolist()):
            if pt > 0:
                finish(prefix + [t], lengths, prob * pt)

    def round_at(prefix, lengths, prob):
        anchor = len(prefix) - 1
        if anchor + B - 1 > L - 1:
            return finish(prefix, lengths, prob)
        for drafts in itertools.product(range(V), repeat=B - 1):
            # the drafts: independent per slot (DFlash), or each given the one before (DFlash 2)
            qs = [proposal(kind, prefix, j, drafts[j - 1] if j else prefix[-1], drafts[:j]) for j in range(B - 1)]
            p_drafts = 1.0
            for q, x in zip(qs, drafts):
                p_drafts *= float(q[x])
            if p_drafts == 0:
                continue
            cur, pr = list(prefix), prob * p_drafts
            for j, (q, x) in enumerate(zip(qs, drafts)):
                p = target_p(cur)
                accept = min(1.0, float(p[x]) / float(q[x]))
                if accept < 1:   # rejected: the residual max(0, p - q), renormalized, gives the token
                    residual = (p - q).clamp_min(0)
                    residual = residual / residual.sum()
                    for t, rt in enumerate(residual.tolist()):
                        if rt > 0:
                            round_at(cur + [t], lengths + (j + 1,), pr * (1 - accept) * rt)
                if accept == 0:
                    break
                cur, pr = cur + [x], pr * accept
            else:   # every draft accepted: the bonus token from p
                for t, pt in enumerate(target_p(cur).tolist()):
                    if pt > 0:
                        round_at(cur + [t], lengths + (B,), pr * pt)

    prompt = [0]
    for t, pt in enumerate(target_p(prompt).tolist()):   # the first completion token: the target's prefill
        if pt > 0:
            round_at(prompt + [t], (), pt)
    return out


def tool_accept(kind, text):
    """c_j = min(1, q_j(r) / p_j(r)) at every fitting anchor of the text, as the tool computes them."""
    anchors = ed.fitting_anchors(N_PROMPT, L, B).tolist()
    c = torch.zeros(len(anchors), B - 1, dtype=torch.float64)
    for i, a in enumerate(anchors):
        for j in range(B - 1):
            r = text[a + 1 + j]
            p = float(target_p(list(text[:a + 1 + j]))[r])
            q = float(proposal(kind, list(text[:a + 1]), j, text[a + j], text[a + 1:a + 1 + j])[r])
            c[i, j] = min(1.0, q / p)
    return c


@pytest.mark.parametrize("kind", ["sample", "argmax", "selector", "chain"])
def test_expected_walk_equals_enumeration(kind):
    """For every text: E[rounds | text], E[committed | text] and the expected histogram of round lengths."""
    texts = enumerate_loop(kind)
    total = 0.0
    for text, by_lengths in texts.items():
        p_text = sum(by_lengths.values())
        want = 1.0
        for t in range(N_PROMPT, L):
            want *= float(target_p(list(text[:t]))[text[t]])
        assert p_text == pytest.approx(want, rel=1e-9, abs=1e-15)   # lossless: the text is the target's sample
        total += p_text
        histogram = [sum(p * lengths.count(n) for lengths, p in by_lengths.items()) / p_text for n in range(1, B + 1)]
        got = ed.expected_walk(tool_accept(kind, text), N_PROMPT, L, B)
        assert got["rounds"] == pytest.approx(sum(histogram), rel=1e-9), (kind, text)
        assert got["committed"] == pytest.approx(sum(n * h for n, h in enumerate(histogram, 1)), rel=1e-9)
        for n in range(B):
            assert got["histogram"][n] == pytest.approx(histogram[n], rel=1e-9, abs=1e-12), (kind, text, n + 1)
    assert total == pytest.approx(1.0, rel=1e-9)
    assert len(texts) > 50


def test_argmax_walk_is_the_greedy_walk():
    """With 0/1 acceptance the expectation is the deterministic walk the greedy code takes."""
    g = torch.Generator().manual_seed(3)
    n_prompt, total, block = 5, 60, 6
    equal = torch.rand(total - block + 1 - n_prompt, block - 1, generator=g) < 0.7
    matched = equal.long().cumprod(1).sum(1)
    rounds = ed.walk(lambda a: 1 + int(matched[a - n_prompt]), n_prompt, total, block)[0]
    got = ed.expected_walk(equal.double(), n_prompt, total, block)
    assert got["rounds"] == len(rounds) and got["committed"] == sum(rounds)
    assert got["histogram"] == [float(rounds.count(n)) for n in range(1, block + 1)]
