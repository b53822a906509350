"""A serving engine that really decodes speculatively: a local HTTP server standing in for vLLM 0.33 and SGLang 0.5.23
serving the demo target with the demo DFlash drafter.

test_server.py's FakeEngine answers with plain greedy decoding, which is all a reference needs. An engine serving a
drafter also reports how its drafts fared, per request: vLLM in `metrics.speculative_decoding` (with
--per-request-spec-decode-metrics summary | detailed), SGLang in meta_info's spec_* fields. Those figures are what a
misconfigured deployment gets wrong (another depth K, other feature layers, another mask token, sampling), so this
engine produces them the way the engines do: one request at a time, a fresh target pass over the committed tokens
each round (no cache to roll back), the drafter's block [anchor, mask, ...] over features strictly before the anchor,
greedy or speculative-sampling verification, and the engines' own arithmetic for the reported fields.

    engine = start_engine(model, drafter)        # or start_engine(*load_demo()[:2])
    engine.reset(k=3, layers=[0, 2, 3], mask_token_id=7, detailed=False, metrics=True, full_block=False)
    ... POST engine.url + "/v1/completions" or "/generate" ...
    engine.requests                              # [{"path", "body"}] received since the last reset
    engine.shutdown()

From a shell (the demo pair on 127.0.0.1, serving settings as reset()'s): python tests/spec_engine.py --port 8000
--layers 0,2,3; --help lists them.
"""
import argparse
import dataclasses
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))] * (__name__ == "__main__")  # as a script

import torch  # noqa: E402

import eval_drafter as ed  # noqa: E402
from conftest import online_draft_hidden

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "fixtures", "demo")
TARGET, DRAFTER = os.path.join(DEMO, "target"), os.path.join(DEMO, "drafter")
DRAFTER_SETTINGS = ed.Settings(dtype="float32", device="cpu")


def load_demo():
    """(target model, drafter, eos ids) of the bundled demo pair, float32 on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    drafter = ed.load_drafter(DRAFTER, ed.read_target_config(TARGET), ed.quietly(DRAFTER_SETTINGS))
    return model, drafter, ed.eos_ids(model, AutoTokenizer.from_pretrained(TARGET))


def draw(probs, generator):
    return torch.multinomial(probs, 1, generator=generator)[..., 0]


def accept(drafts, p_logits, q, sampling, generator):
    """(drafts accepted j, the token after them) for k drafts against the target's k + 1 logit rows. Sampled: the
    standard rule (accept x with min(1, p(x) / q(x)), else draw from max(p - q, 0)), lossless for any q each draft was
    drawn from; DFlash drafts a block in one pass, so q_i does not depend on the drafts before it."""
    if sampling is None:
        greedy = p_logits.argmax(-1).tolist()
        j = next((i for i, x in enumerate(drafts) if x != greedy[i]), len(drafts))
        return j, greedy[j]
    p = ed.sampling_probs(p_logits, sampling)
    for i, x in enumerate(drafts):
        if float(torch.rand(1, generator=generator)) * float(q[i, x]) >= float(p[i, x]):
            residual = (p[i] - q[i]).clamp(min=0)
            return i, int(draw(residual / residual.sum() if residual.sum() > 0 else p[i], generator))
    return len(drafts), int(draw(p[-1], generator))


class SpecEngine(ThreadingHTTPServer):
    """SGLang POST /generate and vLLM POST /v1/completions, decoded speculatively; serving settings set by reset()."""
    daemon_threads = True

    def __init__(self, model, drafter, stops=None, port=0):
        super().__init__(("127.0.0.1", port), SpecHandler)
        self.model, self.drafter = model, drafter
        eos = model.generation_config.eos_token_id if stops is None else stops
        self.stops = set(eos if isinstance(eos, (list, set, tuple)) else [eos]) - {None}
        self.model_lock = threading.Lock()  # one request decodes at a time, as the figures are per request anyway
        self.thread = None
        self.reset()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reset(self, **cfg):
        """k: drafts verified a round (default: the drafter's block - 1); layers, mask_token_id: what the engine feeds
        the drafter (None: its own); full_block: draft the trained block and verify its first k (default: a block
        of 1 + k, as vLLM's DFlash runs bonus + k mask slots); context: past `context` committed tokens the drafter's
        features come from a pass over the last 3 only (a drafter served contexts longer than it handles); detailed: vLLM's per-step arrays (else summary);
        metrics: False = vLLM started without per-request metrics (SGLang reports its spec_* fields regardless)."""
        unknown = set(cfg) - {"k", "layers", "mask_token_id", "detailed", "metrics", "full_block", "context"}
        if unknown:
            raise TypeError(f"unknown engine settings {sorted(unknown)}")
        d = self.drafter
        cfg = {"k": d.block_size - 1, "layers": None, "mask_token_id": None, "detailed": True, "metrics": True,
               "full_block": False, "context": None, **cfg}
        if cfg["k"] < 1 or (cfg["full_block"] and cfg["k"] > d.block_size - 1):
            raise ValueError(f"k={cfg['k']} with a block of {d.block_size}")
        with self.model_lock:
            self.cfg = cfg
            self.served = dataclasses.replace(d, layers=list(cfg["layers"] or d.layers),
                                              mask_token_id=d.mask_token_id if cfg["mask_token_id"] is None
                                              else cfg["mask_token_id"])
            self.requests = []

    def handle_error(self, request, client_address):
        pass  # clients that gave up leave broken pipes behind

    @torch.inference_mode()
    def decode(self, prompt, max_new, ignore_eos, sampling, seed):
        """(completion ids, finish reason, drafts accepted per verify step). A round's accepted count is kept whole
        even where max_new or a stop token cuts its tokens, as vLLM's scheduler and SGLang count it."""
        generator = torch.Generator()
        if seed is not None:
            generator.manual_seed(seed)
        else:
            generator.seed()
        stops = set() if ignore_eos else self.stops
        with self.model_lock:
            k, d, model = self.cfg["k"], self.served, self.model
            slots = d.block_size if self.cfg["full_block"] else k + 1
            logits = model(torch.tensor([prompt]), use_cache=False, logits_to_keep=1).logits[0, -1:]
            out = [int(logits.argmax()) if sampling is None else int(draw(ed.sampling_probs(logits, sampling)[0],
                                                                          generator))]
            steps = []
            while len(out) < max_new and out[-1] not in stops:
                seq = list(prompt) + out
                seen = seq[-3:] if self.cfg["context"] and len(seq) > self.cfg["context"] else seq
                q_logits = model.get_output_embeddings()(online_draft_hidden(model, d, seen, slots)[1:k + 1])
                q = None if sampling is None else ed.sampling_probs(q_logits, sampling)
                drafts = (q_logits.argmax(-1) if q is None else draw(q, generator)).tolist()
                p_logits = model(torch.tensor([seq + drafts]), use_cache=False).logits[0, len(seq) - 1:]
                j, token = accept(drafts, p_logits, q, sampling, generator)
                steps.append(j)
                for t in drafts[:j] + [token]:
                    out.append(t)
                    if len(out) >= max_new or t in stops:
                        break
        return out, "stop" if out[-1] in stops else "length", steps

    def vllm_metrics(self, steps):
        """vLLM's RequestSpecDecodeMetrics.to_dict for one sequence."""
        k = self.cfg["k"]
        histogram = [0] * (k + 1)
        for j in steps:
            histogram[j] += 1
        accepted, drafted = sum(steps), k * len(steps)
        spec = {"mean_acceptance_length": 1.0 + accepted / len(steps) if steps else 1.0,
                "draft_acceptance_rate": accepted / drafted if drafted else 0.0, "acceptance_histogram": histogram,
                "num_spec_steps": len(steps), "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted,
                "num_spec_tokens": k}
        if self.cfg["detailed"] and steps:
            spec.update(per_step_accepted=list(steps), per_step_drafted=[k] * len(steps))
        return {"speculative_decoding": spec}

    def sglang_meta(self, steps, completion):
        """SGLang's tokenizer_manager spec_* fields: none before a verify step; the accept length divides all completion
        tokens (the prefill's included) by the verify steps; the histogram grows to the largest count seen."""
        if not steps:
            return {}
        k, accepted = self.cfg["k"], sum(steps)
        histogram = [0] * (max(steps) + 1)
        for j in steps:
            histogram[j] += 1
        return {"spec_accept_rate": accepted / (k * len(steps)), "spec_accept_length": len(completion) / len(steps),
                "spec_num_correct_drafts": accepted, "spec_num_proposed_drafts": k * len(steps),
                "spec_verify_ct": len(steps), "spec_correct_drafts_histogram": histogram}

    def shutdown(self):
        super().shutdown()
        self.server_close()
        if self.thread:
            self.thread.join(5)


def sampling_of(params):
    """The (temperature, top_p, top_k) of a request's parameters, None for greedy; engines default to 1.0."""
    temperature = params.get("temperature", 1.0)
    if not temperature:
        return None
    top_k = params.get("top_k")
    return float(temperature), float(params.get("top_p", 1.0)), max(0, int(top_k if top_k is not None else 0))


class SpecHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send_json(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.requests.append({"path": self.path, "body": body})
        try:
            if self.path == "/generate":
                return self.send_json(200, self.sglang(srv, body))
            if self.path == "/v1/completions":
                return self.send_json(200, self.vllm(srv, body))
        except (KeyError, TypeError, ValueError) as e:
            return self.send_json(400, {"error": {"message": f"bad request: {e!r}", "type": "BadRequestError",
                                                  "code": 400}})
        except Exception as e:  # a misconfiguration the drafter cannot run with (e.g. another number of layers)
            return self.send_json(500, {"error": {"message": repr(e), "type": "InternalServerError", "code": 500}})
        self.send_json(404, {"detail": "Not Found"})

    def sglang(self, srv, body):
        ids = body["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [ids] if single else ids
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        entries = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            out, finish, steps = srv.decode(prompt, p.get("max_new_tokens", 128), p.get("ignore_eos", False),
                                            sampling_of(p), p.get("sampling_seed"))
            reason = {"type": finish, **({"length": len(out)} if finish == "length" else {"matched": out[-1]})}
            meta = {"id": f"req-{len(srv.requests)}-{i}", "prompt_tokens": len(prompt), "completion_tokens": len(out),
                    "finish_reason": reason, **srv.sglang_meta(steps, out)}
            entries.append({"text": "", "output_ids": out, "meta_info": meta})
        return entries[0] if single else entries

    def vllm(self, srv, body):
        prompts = body["prompt"]
        prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
        sampling, choices, steps = sampling_of(body), [], None
        for i, prompt in enumerate(prompts):
            out, finish, steps = srv.decode(prompt, body.get("max_tokens", 16), body.get("ignore_eos", False),
                                            sampling, body.get("seed"))
            choices.append({"index": i, "text": "", "logprobs": None, "finish_reason": finish, "stop_reason": None,
                            "token_ids": out, "prompt_token_ids": prompt if body.get("return_token_ids") else None})
        done = sum(len(c["token_ids"]) for c in choices)
        usage = {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": done,
                 "total_tokens": sum(map(len, prompts)) + done}
        reply = {"id": f"cmpl-{len(srv.requests)}", "object": "text_completion", "created": 0,
                 "model": body.get("model"), "choices": choices, "usage": usage}
        if len(prompts) == 1 and srv.cfg["metrics"]:  # one stream only: vLLM cannot attribute a batch's figures
            reply["metrics"] = srv.vllm_metrics(steps)
        return reply


def start_engine(model, drafter, stops=None):
    """A SpecEngine serving from a daemon thread; engine.shutdown() stops it and frees the port."""
    engine = SpecEngine(model, drafter, stops)
    engine.thread = threading.Thread(target=engine.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    engine.thread.start()
    return engine


def main(argv=None):
    """The demo pair served on 127.0.0.1 until Ctrl-C, as docs/served.md starts it."""
    cli = argparse.ArgumentParser(description="serve the demo pair speculatively on 127.0.0.1 (vLLM's /v1/completions "
                                  "and SGLang's /generate), as tests/test_served.py does")
    cli.add_argument("--port", type=int, default=8000)
    cli.add_argument("--k", type=int, help="drafts verified a round (default: the drafter's block - 1)")
    cli.add_argument("--layers", help="the target layer ids the engine feeds the drafter, comma-separated (default: "
                     "its own)")
    cli.add_argument("--mask-token-id", type=int, help="the mask token the engine drafts with (default: its own)")
    cli.add_argument("--summary", action="store_true", help="vLLM's summary metrics (default: detailed per step)")
    args = cli.parse_args(argv)
    model, drafter, stops = load_demo()
    engine = SpecEngine(model, drafter, stops, args.port)
    engine.reset(**{k: v for k, v in (("k", args.k), ("mask_token_id", args.mask_token_id), ("layers", args.layers and
                 [int(x) for x in args.layers.split(",")]), ("detailed", not args.summary)) if v is not None})
    print(f"serving the demo pair on {engine.url} (Ctrl-C stops)", flush=True)
    try:
        engine.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        engine.server_close()


if __name__ == "__main__":
    main()
