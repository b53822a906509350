"""References from a serving engine (--server): a real HTTP server on 127.0.0.1 stands in for SGLang and vLLM.

The fake engine runs the demo target greedily (the tool's own plain_generate, float32) behind both request
shapes: SGLang's POST /generate and vLLM's POST /v1/completions. Each test sets its behaviour (legacy reply
shapes, faults, perturbed references) and reads back the request bodies it received. The rounds measured from
the server's references must equal those from the tool's local generation, every fault must end in one clear
"error:" line with exit code 2, and --save-references must keep what was fetched.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import eval_drafter as ed
from conftest import write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "tests", "fixtures", "demo")
TARGET = os.path.join(DEMO, "target")
N_NEW = 40
LIMIT = 4
VOCAB = 64
COMMON = ["--demo", "--max-new-tokens", str(N_NEW), "--quiet", "--ddtree-budgets", "none"]
BASE = COMMON + ["--limit", str(LIMIT), "--ignore-eos"]
NEUTRAL = {"temperature": 0, "repetition_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0}
SERVER_WORDS = "CUDA error: an illegal memory access was encountered"
# Faults a server shows from its first request on: the tool's check before loading meets them
PERSISTENT = ("always_500", "malformed", "non_dict_entries", "missing_ids", "wrong_count", "error_400_other",
              "openai_no_token_ids")


# ----------------------------------------------------------------------------------------------------
# The fake engine


class FakeEngine(ThreadingHTTPServer):
    """SGLang /generate and vLLM /v1/completions over the demo target; behaviour set per test by reset()."""
    daemon_threads = True

    def __init__(self, model, stops):
        super().__init__(("127.0.0.1", 0), EngineHandler)
        self.model, self.stops = model, stops
        self.model_lock = threading.Lock()  # one model call at a time
        self.state_lock = threading.Lock()
        self.cache = {}
        self.release = threading.Event()
        self.reset()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reset(self, **behaviour):
        """mode: normal | legacy_token_ids | echo_prompt | openai_no_token_ids | shuffle_choices | fail_first_500 |
        reset_first | always_500 | fail_after_first | fail_with_prompt | sleep | malformed | non_dict_entries |
        missing_ids | wrong_count | error_400_context | error_400_other | perturb"""
        self.release.set()  # wake handlers still sleeping for an earlier test
        with self.state_lock:
            self.release = threading.Event()
            self.behaviour = {"mode": "normal", "perturb_at": 5, "sleep_s": 10.0, "words": "error.message",
                              "context_len": None, "fail_prompt": None, "fail_delay_s": 0.0, **behaviour}
            self.requests, self.probes = [], []

    def handle_error(self, request, client_address):
        pass  # clients that gave up (timeouts) leave broken pipes behind: expected here

    def sampled(self, prompt, max_new, ignore_eos, params, seed):
        """Sampled decoding at the request's settings, its seed making it reproducible (as engines do)."""
        generator = torch.Generator().manual_seed(seed)
        sampling = (params["temperature"], params["top_p"], max(0, params["top_k"]))
        with self.model_lock:
            return ed.plain_generate(self.model, list(prompt), max_new, set() if ignore_eos else self.stops, sampling,
                                      generator)

    def greedy(self, prompt, max_new, ignore_eos):
        key = (tuple(prompt), max_new, ignore_eos)
        with self.model_lock:
            if key not in self.cache:
                stops = set() if ignore_eos else self.stops
                self.cache[key] = ed.plain_generate(self.model, list(prompt), max_new, stops)
        return list(self.cache[key])


class EngineHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send_json(self, status, payload):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_words(self, status, message):
        style = self.server.behaviour["words"]
        payload = {"error.message": {"error": {"message": message, "type": "BadRequestError", "code": status}},
                   "message": {"object": "error", "message": message, "type": "BadRequestError", "code": status},
                   "detail": {"detail": message},
                   "text": message.encode()}[style]
        self.send_json(status, payload)

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        # The tool's one-token request before anything loads (--server checked first): kept apart from the fetches,
        # and answered as a server that is broken from the start would (PERSISTENT faults), else as a healthy one
        params = body.get("sampling_params") or {}
        probe = (body.get("max_tokens") or (params[0] if isinstance(params, list) else params).get("max_new_tokens")) == 1
        with srv.state_lock:
            (srv.probes if probe else srv.requests).append({"path": self.path, "body": body})
            n, b, release = len(srv.requests), dict(srv.behaviour), srv.release
        if probe and b["mode"] not in PERSISTENT:
            b["mode"] = "normal"
        if self.path == "/generate":
            api, prompts = "sglang", body["input_ids"]
            params = body["sampling_params"]   # one dict for the batch, or one per prompt (sampled, seeded)
            params = params if isinstance(params, list) else [params] * (len(prompts) if isinstance(prompts[0], list) else 1)
            max_new, ignore = params[0]["max_new_tokens"], params[0].get("ignore_eos", False)
            seeds = [p.get("sampling_seed") for p in params]
        elif self.path == "/v1/completions":
            api, prompts, max_new, ignore = "openai", body["prompt"], body["max_tokens"], body.get("ignore_eos", False)
            params, seeds = [body] * len(prompts), [body.get("seed")] * len(prompts)
        else:
            return self.send_json(404, {"detail": "Not Found"})
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        mode = b["mode"]

        if mode == "reset_first" and n == 1:
            return  # close the connection without an answer
        if mode == "sleep":
            release.wait(b["sleep_s"])
            return
        if (mode == "fail_first_500" and n == 1) or mode == "always_500" or (mode == "fail_after_first" and n > 1):
            return self.send_error_words(500, SERVER_WORDS)
        if mode == "fail_with_prompt" and b["fail_prompt"] in prompts:
            time.sleep(b["fail_delay_s"])
            return self.send_error_words(500, SERVER_WORDS)
        if mode == "malformed":
            return self.send_json(200, b'{"output_ids": [5, 6,')
        if mode == "non_dict_entries":  # valid JSON of the wrong shape: one string per prompt
            entries = ["5 6 7"] * len(prompts)
            return self.send_json(200, entries if api == "sglang" else {"id": "cmpl", "choices": entries})
        if mode == "error_400_other":
            words = (f"The model `{body.get('model')}` does not exist." if api == "openai"
                     else "sampling_params: unknown field 'min_p_x'")
            return self.send_error_words(400, words)
        if mode == "error_400_context":
            ctx = b["context_len"]
            too_long = [p for p in prompts if ctx is None or len(p) + max_new > ctx]
            if too_long:
                p, ctx = too_long[0], ctx or 32
                words = (f"This model's maximum context length is {ctx} tokens. However, you requested "
                         f"{len(p) + max_new} tokens ({len(p)} in the messages, {max_new} in the completion). "
                         "Please reduce the length of the messages or completion." if api == "openai" else
                         f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                         f"You requested a total of {len(p) + max_new} tokens: {len(p)} tokens from the input "
                         f"messages and {max_new} tokens for the completion.")
                return self.send_error_words(400, words)

        outs = [srv.greedy(p, max_new, ignore) if not params[i].get("temperature") else
                srv.sampled(p, max_new, ignore, params[i], seeds[i]) for i, p in enumerate(prompts)]
        if mode == "perturb":
            k = b["perturb_at"]
            for c in outs:
                c[k] = (c[k] + 1) % VOCAB
        finishes = ["length" if len(c) == max_new and (ignore or c[-1] not in srv.stops) else "stop" for c in outs]

        if api == "sglang":
            entries = []
            for i, (p, c, f) in enumerate(zip(prompts, outs, finishes)):
                meta = {"id": f"req-{n}-{i}", "prompt_tokens": len(p), "completion_tokens": len(c),
                        "finish_reason": {"type": f, "length": len(c)} if f == "length" else {"type": f, "matched": c[-1]}}
                entry = {"text": "", "output_ids": c, "meta_info": meta}
                if mode == "legacy_token_ids":
                    entry = {"text": "", "token_ids": c, "meta_info": {**meta, "finish_reason": f}}
                elif mode == "echo_prompt":
                    entry["output_ids"] = list(p) + c
                elif mode == "missing_ids":
                    del entry["output_ids"]
                entries.append(entry)
            if mode == "wrong_count":
                entries = entries[:-1]
            return self.send_json(200, entries)

        choices = []
        for i, (c, f) in enumerate(zip(outs, finishes)):
            choice = {"index": i, "text": "", "logprobs": None, "finish_reason": f, "stop_reason": None,
                      "token_ids": c, "prompt_token_ids": None}
            if mode in ("openai_no_token_ids", "missing_ids"):
                del choice["token_ids"]
                if mode == "openai_no_token_ids" and body.get("return_tokens_as_token_ids") and "logprobs" in body:
                    choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in c], "token_logprobs": [0.0] * len(c),
                                          "top_logprobs": [{} for _ in c], "text_offset": [0] * len(c)}
            choices.append(choice)
        if mode == "shuffle_choices":
            choices.reverse()
        if mode == "wrong_count":
            choices = choices[:-1]
        usage = {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": sum(map(len, outs))}
        self.send_json(200, {"id": f"cmpl-{n}", "object": "text_completion", "created": 0,
                             "model": body.get("model"), "choices": choices, "usage": usage})


@pytest.fixture(scope="module")
def engine():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    srv = FakeEngine(model, ed.eos_ids(model, AutoTokenizer.from_pretrained(TARGET)))
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()
    thread.join(5)


@pytest.fixture
def server(engine):
    engine.reset()
    yield engine
    engine.reset()


# ----------------------------------------------------------------------------------------------------
# Helpers


@pytest.fixture(scope="module")
def demo_rows():
    with open(os.path.join(DEMO, "prompts.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def tokenize():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TARGET)  # no chat template: plain text, as the tool encodes it
    return lambda text: tok(text)["input_ids"]


def run_tool(tmp_path, args, name="out.json"):
    """ed.main in-process; (exit code, JSON report or None)."""
    out = tmp_path / name
    code = ed.main(list(args) + ["--output", str(out)])
    return code, (json.loads(out.read_text()) if code == 0 else None)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The tool's own greedy references (no server): the rounds every server run must reproduce."""
    code, report = run_tool(tmp_path_factory.mktemp("local"), BASE)
    assert code == 0
    return report


def server_args(server, api="sglang", url=None):
    args = ["--server", url or server.url]
    if api == "openai":
        args += ["--server-api", "openai", "--server-model", "demo-target"]
    return args


def prompts_of(report):
    return report["drafters"][0]["prompts"]


def without_source(drafter):
    return {**drafter, "prompts": [{k: v for k, v in p.items() if k != "reference_source"} for p in drafter["prompts"]]}


def assert_same_rounds(report, local_report):
    got, want = report["drafters"][0], local_report["drafters"][0]
    assert [p["id"] for p in got["prompts"]] == [p["id"] for p in want["prompts"]]
    for g, w in zip(got["prompts"], want["prompts"]):
        assert g["completion_tokens"] == w["completion_tokens"], g["id"]
        assert g["rounds"] == w["rounds"], g["id"]
    assert without_source(got) == without_source(want)


def fault_line(tmp_path, server, capsys, mode, args):
    """Run the tool against the server in a fault mode: it must fail with exit 2; return its error line."""
    server.reset(mode=mode)
    code, _ = run_tool(tmp_path, BASE + args)
    assert code == 2
    return error_line(capsys)


def error_line(capsys):
    """The single stderr line of a failed run (and nothing that looks like a traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------------
# Server references equal local generation; the request shapes


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_server_references_give_the_local_rounds(tmp_path, server, local, demo_rows, tokenize, api):
    code, report = run_tool(tmp_path, BASE + server_args(server, api))
    assert code == 0
    assert_same_rounds(report, local)
    assert report["target"]["agreement"] == 1.0
    for p in prompts_of(report):
        assert p["reference_source"] == "server" and p["reference_generated"] is True
        assert p["first_divergence"] is None and p["target_agreement"] == 1.0
    assert all(p["reference_source"] == "target" for p in prompts_of(local))

    # One request (LIMIT <= SERVER_BATCH) carrying the token ids, greedy, neutral, ignore_eos and the length.
    assert len(server.requests) == 1
    request = server.requests[0]
    ids = [tokenize(row["prompt"]) for row in demo_rows[:LIMIT]]
    if api == "sglang":
        assert request["path"] == "/generate"
        assert request["body"] == {"input_ids": ids,
                                   "sampling_params": {**NEUTRAL, "max_new_tokens": N_NEW, "ignore_eos": True}}
    else:
        assert request["path"] == "/v1/completions"
        assert request["body"] == {"model": "demo-target", "prompt": ids, "max_tokens": N_NEW, **NEUTRAL,
                                   "return_token_ids": True, "ignore_eos": True, "skip_special_tokens": False}


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_without_ignore_eos_the_server_is_told_so(tmp_path, server, api):
    """(The demo target emits no EOS within 40 tokens, so this checks the flag sent and the rounds.)"""
    args = COMMON + ["--limit", "2"]
    code, want = run_tool(tmp_path, args, "local.json")
    assert code == 0
    code, report = run_tool(tmp_path, args + server_args(server, api))
    assert code == 0
    assert_same_rounds(report, want)
    body = server.requests[0]["body"]
    assert (body["sampling_params"] if api == "sglang" else body)["ignore_eos"] is False


@pytest.mark.parametrize("api,mode", [("sglang", "legacy_token_ids"), ("sglang", "echo_prompt"),
                                      ("openai", "openai_no_token_ids"), ("openai", "shuffle_choices")])
def test_legacy_reply_shapes_give_the_same_rounds(tmp_path, server, local, api, mode):
    server.reset(mode=mode)
    refs = tmp_path / "refs.jsonl"
    code, report = run_tool(tmp_path, BASE + server_args(server, api) + ["--save-references", str(refs)])
    assert code == 0
    assert_same_rounds(report, local)
    assert all(p["reference_source"] == "server" for p in prompts_of(report))
    assert [row["finish_reason"] for row in read_jsonl(refs)] == ["length"] * LIMIT
    if mode == "openai_no_token_ids":
        # The check before loading learns it: first the return_token_ids request, then the resend asking for
        # token_id:N logprob strings; the fetch then asks in that form at once.
        assert len(server.probes) == 2 and len(server.requests) == 1
        retry = server.probes[1]["body"]
        assert retry["logprobs"] == 0 and retry["return_tokens_as_token_ids"] is True
        assert "return_token_ids" not in retry and "return_token_ids" not in server.requests[0]["body"]
        assert retry["prompt"] == server.probes[0]["body"]["prompt"]
    else:
        assert len(server.requests) == 1


def test_batches_and_concurrency(tmp_path, server, local, monkeypatch):
    monkeypatch.setattr(ed, "SERVER_BATCH", 3)
    code, report = run_tool(tmp_path, BASE + server_args(server) + ["--server-concurrency", "2"])
    assert code == 0
    assert_same_rounds(report, local)
    assert sorted(len(r["body"]["input_ids"]) for r in server.requests) == [1, 3]


def test_only_missing_references_are_fetched(tmp_path, server, demo_rows, tokenize):
    rows = [dict(demo_rows[0], completion_ids=tokenize("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10")), demo_rows[1],
            dict(demo_rows[2], completion="w5 w6 w7 w8 w9 w10 w11 w12"), demo_rows[3]]
    prompts = write_jsonl(tmp_path / "mixed.jsonl", rows)
    code, report = run_tool(tmp_path, BASE + ["--prompts", prompts] + server_args(server))
    assert code == 0
    assert [p["reference_source"] for p in prompts_of(report)] == ["file", "server", "file", "server"]
    assert [p["reference_generated"] for p in prompts_of(report)] == [False, True, False, True]
    assert [r["body"]["input_ids"] for r in server.requests] == [[tokenize(demo_rows[1]["prompt"]),
                                                                   tokenize(demo_rows[3]["prompt"])]]


def test_a_full_context_batch_does_not_shorten_its_neighbours(tmp_path, server, demo_rows):
    """A prompt near the target's 512 positions gets room for fewer new tokens; the others sent with it in the
    same request must still get --max-new-tokens, exactly as local generation gives them."""
    long_prompt = " ".join(f"w{i % 60}" for i in range(480))  # 480 tokens: room for 32 new ones
    rows = demo_rows[:3] + [{"id": "long", "split": "train", "prompt": long_prompt}]
    prompts = write_jsonl(tmp_path / "long.jsonl", rows)
    code, want = run_tool(tmp_path, BASE + ["--prompts", prompts], "local.json")
    assert code == 0
    assert [p["completion_tokens"] for p in prompts_of(want)] == [N_NEW, N_NEW, N_NEW, 32]
    code, report = run_tool(tmp_path, BASE + ["--prompts", prompts] + server_args(server))
    assert code == 0
    assert [p["completion_tokens"] for p in prompts_of(report)] == [N_NEW, N_NEW, N_NEW, 32]
    assert_same_rounds(report, want)


# ----------------------------------------------------------------------------------------------------
# Faults: retried, or one clear line and exit 2


@pytest.mark.parametrize("mode", ["fail_first_500", "reset_first"])
def test_transient_fault_is_retried(tmp_path, server, local, mode):
    server.reset(mode=mode)
    code, report = run_tool(tmp_path, BASE + server_args(server))
    assert code == 0
    assert len(server.requests) == 2
    assert server.requests[0]["body"] == server.requests[1]["body"]
    assert_same_rounds(report, local)


BEFORE = "checking --server with a one-token request before anything loads"


@pytest.mark.parametrize("words", ["error.message", "message", "detail", "text"])
def test_persistent_500_is_found_before_loading_with_the_server_words(tmp_path, server, capsys, words, monkeypatch):
    loads = []
    monkeypatch.setattr(ed, "load_target", lambda *a: loads.append(1))
    server.reset(mode="always_500", words=words)
    code, _ = run_tool(tmp_path, BASE + server_args(server) + ["--server-retries", "1"])
    assert code == 2
    line = error_line(capsys)
    assert SERVER_WORDS in line and BEFORE in line and "500" in line
    assert len(server.probes) == 2 and server.requests == [] and loads == []  # the first try and one retry


def test_timeout(tmp_path, server, capsys):
    server.reset(mode="sleep")
    t0 = time.time()
    code, _ = run_tool(tmp_path, BASE + server_args(server) + ["--server-timeout", "0.5", "--server-retries", "1"])
    assert code == 2
    assert time.time() - t0 < 8
    line = error_line(capsys)
    assert "timed out" in line and "after 2 tries" in line and "train-0" in line
    assert len(server.requests) == 2


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_connection_refused(tmp_path, capsys, api):
    url = f"http://127.0.0.1:{free_port()}"
    code, _ = run_tool(tmp_path, BASE + server_args(None, api, url=url) + ["--server-retries", "3"])
    assert code == 2
    line = error_line(capsys)
    assert "connection refused" in line and url in line


def test_wrong_url_path_is_a_404(tmp_path, server, capsys):
    code, _ = run_tool(tmp_path, BASE + server_args(server, url=server.url + "/nope"))
    assert code == 2
    line = error_line(capsys)
    assert "HTTP 404" in line and "Not Found" in line and BEFORE in line
    assert len(server.probes) == 1 and server.requests == []  # a 4xx is not retried


def test_malformed_json(tmp_path, server, capsys):
    line = fault_line(tmp_path, server, capsys, "malformed", server_args(server))
    assert "malformed JSON" in line and BEFORE in line
    assert len(server.probes) == 1 and server.requests == []


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_missing_id_fields(tmp_path, server, capsys, api):
    line = fault_line(tmp_path, server, capsys, "missing_ids", server_args(server, api))
    assert "no token ids" in line and BEFORE in line
    assert ("output_ids" in line) if api == "sglang" else ("token_id:N" in line)


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_reply_entries_that_are_not_objects(tmp_path, server, capsys, api):
    """Valid JSON, right count, wrong shape (strings where objects belong): still one clear line, exit 2."""
    assert BEFORE in fault_line(tmp_path, server, capsys, "non_dict_entries", server_args(server, api))


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_wrong_number_of_replies(tmp_path, server, capsys, api):
    line = fault_line(tmp_path, server, capsys, "wrong_count", server_args(server, api))
    assert "answered for 0 prompts, 1 were sent" in line and BEFORE in line


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_context_length_400_names_the_prompt_and_its_tokens(tmp_path, server, capsys, demo_rows, tokenize, api):
    line = fault_line(tmp_path, server, capsys, "error_400_context", ["--limit", "1"] + server_args(server, api))
    n = len(tokenize(demo_rows[0]["prompt"]))
    assert "train-0" in line and f"{n} prompt tokens" in line and "context length" in line
    assert len(server.requests) == 1


def test_context_length_400_in_a_batch_names_the_long_prompt(tmp_path, server, capsys, demo_rows):
    """Only one prompt of a full batch is too long for the server: the error must name that one."""
    server.reset(mode="error_400_context", context_len=256)
    rows = demo_rows[:LIMIT - 1] + [{"id": "the-long-one", "prompt": " ".join(f"w{i % 60}" for i in range(300))}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    code, _ = run_tool(tmp_path, BASE + ["--prompts", prompts] + server_args(server))
    assert code == 2
    line = error_line(capsys)
    assert "300 prompt tokens" in line
    assert "the-long-one" in line, line


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_other_400_shows_the_server_message(tmp_path, server, capsys, api):
    line = fault_line(tmp_path, server, capsys, "error_400_other", server_args(server, api))
    words = "The model `demo-target` does not exist." if api == "openai" else "unknown field 'min_p_x'"
    assert "HTTP 400" in line and words in line and BEFORE in line
    assert "prompt tokens" not in line
    assert len(server.probes) == 1 and server.requests == []


def test_cli_failure_is_one_line_without_traceback(server):
    """The real CLI in a subprocess: a fault raised in the request thread pool still ends as one line."""
    server.reset(mode="always_500")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval_drafter.py"), *BASE, "--limit", "2",
                           "--threads", "1", "--server", server.url, "--server-retries", "0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {BEFORE}"), proc.stderr
    assert SERVER_WORDS in lines[0]


# ----------------------------------------------------------------------------------------------------
# --save-references


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_saved_references_rerun_without_server(tmp_path, server, demo_rows, api):
    refs = tmp_path / "refs.jsonl"
    code, report = run_tool(tmp_path, BASE + server_args(server, api) + ["--save-references", str(refs)])
    assert code == 0
    saved = read_jsonl(refs)
    assert [row["id"] for row in saved] == [row["id"] for row in demo_rows[:LIMIT]]
    for row, original in zip(saved, demo_rows):
        assert row["prompt"] == original["prompt"] and row["split"] == original["split"]
        assert len(row["completion_ids"]) == N_NEW and all(isinstance(t, int) for t in row["completion_ids"])
        assert row["reference_source"] == "server" and row["server"] == server.url
        assert row["server_api"] == api and row["finish_reason"] == "length"

    server.reset()
    code, rerun = run_tool(tmp_path, COMMON + ["--prompts", str(refs)], "rerun.json")
    assert code == 0
    assert server.requests == []
    assert rerun["drafters"] == report["drafters"]
    assert rerun["target"]["agreement"] == 1.0
    assert all(p["reference_source"] == "server" for p in prompts_of(rerun))


def test_references_before_a_failure_are_saved(tmp_path, server, capsys, monkeypatch):
    monkeypatch.setattr(ed, "SERVER_BATCH", 2)
    server.reset(mode="fail_after_first")
    refs = tmp_path / "refs.jsonl"
    code, _ = run_tool(tmp_path, BASE + server_args(server) + ["--server-concurrency", "1", "--server-retries", "0",
                                                              "--save-references", str(refs)])
    assert code == 2
    assert "train-2" in error_line(capsys)
    saved = read_jsonl(refs)
    assert [row["id"] for row in saved] == ["train-0", "train-1"]
    assert all(len(row["completion_ids"]) == N_NEW for row in saved)
    # The saved part works as --prompts with no server.
    server.reset()
    code, rerun = run_tool(tmp_path, COMMON + ["--prompts", str(refs)], "rerun.json")
    assert code == 0 and len(prompts_of(rerun)) == 2 and server.requests == []


def test_references_fetched_alongside_a_failed_batch_are_saved(tmp_path, server, capsys, monkeypatch, tokenize,
                                                               demo_rows):
    """Concurrent requests: the first batch fails (slowly) after the others have come back. Those references
    were fetched before the failure, so they belong in the --save-references file ("as it arrives")."""
    monkeypatch.setattr(ed, "SERVER_BATCH", 1)
    server.reset(mode="fail_with_prompt", fail_prompt=tokenize(demo_rows[0]["prompt"]), fail_delay_s=1.0)
    refs = tmp_path / "refs.jsonl"
    code, _ = run_tool(tmp_path, BASE + server_args(server) + ["--server-concurrency", str(LIMIT),
                                                              "--server-retries", "0", "--save-references", str(refs)])
    assert code == 2
    assert "train-0" in error_line(capsys)
    assert len(server.requests) == LIMIT
    assert sorted(row["id"] for row in read_jsonl(refs)) == ["train-1", "train-2", "train-3"]


# ----------------------------------------------------------------------------------------------------
# First divergence


@pytest.mark.parametrize("k", [0, 17])
def test_first_divergence_of_perturbed_references(tmp_path, server, capsys, k):
    server.reset(mode="perturb", perturb_at=k)
    code, report = run_tool(tmp_path, BASE + server_args(server))
    assert code == 0
    for p in prompts_of(report):
        assert p["first_divergence"] == k, p["id"]
        assert p["target_agreement"] < 1.0
        assert p["reference_source"] == "server"
    assert report["target"]["agreement"] < ed.AGREEMENT_WARN
    err = capsys.readouterr().err
    assert "warning: target agreement" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------------
# Sampled references


SAMPLED = ["--temperature", "1.5", "--top-p", "0.9", "--top-k", "30", "--samples-per-prompt", "2"]


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_sampled_references_from_the_server(tmp_path, server, api):
    """Every request carries the run's temperature, top-p, top-k and a seed, every other knob neutral; the
    references are samples (inside the target's support at those settings); saved references record their
    settings and sample, are reused by a rerun with the same settings, and refetched under another seed."""
    saved = tmp_path / "refs.jsonl"
    argv = BASE + SAMPLED + server_args(server, api) + ["--save-references", str(saved)]
    code, report = run_tool(tmp_path, argv)
    assert code == 0
    bodies = [r["body"] for r in server.requests]
    params = [p for b in bodies for p in (b["sampling_params"] if api == "sglang" else [b])]
    for p in params:
        assert {k: p[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                                  "presence_penalty")} == {"temperature": 1.5, "top_p": 0.9, "top_k": 30, "min_p": 0.0,
                                                           "repetition_penalty": 1.0, "frequency_penalty": 0,
                                                           "presence_penalty": 0}
    seeds = [p["sampling_seed"] for p in params] if api == "sglang" else [b["seed"] for b in bodies]
    assert len(set(seeds)) == (2 * LIMIT if api == "sglang" else 2)   # per prompt and sample / per sample
    prompts = prompts_of(report)
    assert len(prompts) == 2 * LIMIT and {p["sample"] for p in prompts} == {0, 1}
    assert all(p["reference_source"] == "server" for p in prompts)
    assert report["target"]["reference_support"] == 1.0 and report["target"]["self_check"] is None
    by_id = {}
    for p in prompts:
        by_id.setdefault(p["id"], []).append(p)
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    assert len(rows) == 2 * LIMIT
    assert all(r["sampling"] == {"temperature": 1.5, "top_p": 0.9, "top_k": 30, "seed": 0} for r in rows)
    assert sorted((r["id"], r["sample"]) for r in rows) == sorted((p["id"], p["sample"]) for p in prompts)
    assert any(a["reference_mean_logprob"] != b["reference_mean_logprob"] for a, b in by_id.values())   # two texts

    server.reset()
    code, again = run_tool(tmp_path, argv, "again.json")
    assert code == 0 and server.requests == [] and again["drafters"] == report["drafters"]
    # The saved file works as --prompts: one reference per (id, sample), as fetched.
    code, from_file = run_tool(tmp_path, COMMON + SAMPLED[:6] + ["--prompts", str(saved)], "file.json")
    assert code == 0 and from_file["drafters"][0]["tau"] == report["drafters"][0]["tau"]
    assert [(p["id"], p["sample"]) for p in prompts_of(from_file)] == [(r["id"], r["sample"]) for r in rows]
    code, other = run_tool(tmp_path, argv + ["--seed", "5"], "other.json")
    assert code == 0 and len(server.requests) > 0 and other["drafters"] != report["drafters"]


def test_fetched_references_survive_an_interrupt(tmp_path, server, monkeypatch):
    """Ctrl-C after the references came back, while the second prompt is being extracted: the fetched references
    are in the partial file, and --resume scores the rest without asking the server again."""
    from conftest import interrupt_at
    code, whole = run_tool(tmp_path, BASE + server_args(server), "whole.json")
    assert code == 0
    server.reset()
    real, _ = interrupt_at(monkeypatch, "extract_hidden", 2)
    assert run_tool(tmp_path, BASE + server_args(server))[0] == 130
    lines = [json.loads(line) for line in (tmp_path / "out.json.partial.jsonl").read_text().splitlines()]
    assert sorted(row["reference"]["id"] for row in lines if "reference" in row) == sorted(p["id"] for p in prompts_of(whole))
    monkeypatch.setattr(ed, "extract_hidden", real)
    server.reset()
    code, resumed = run_tool(tmp_path, BASE + server_args(server) + ["--resume"])
    assert code == 0 and server.requests == []
    assert resumed["drafters"] == whole["drafters"] and resumed["target"] == whole["target"]
