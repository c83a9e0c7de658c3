"""``kvlab serve``: OpenAI's own Python client completes, streams and chats against the
server and gets the offline engine's greedy text; lm-eval's ``local-completions`` model
scores items against it as the kvlab adapter does; every bad request gets its 4xx and the
server stays up; a bounded load of streaming clients, some leaving mid-way, leaves every
row freed and the KV bytes back to zero. Loopback only; each server stops with its test
module."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from kvlab.cache import build_cache  # noqa: E402
from kvlab.engine import Engine, GenerationConfig  # noqa: E402
from kvlab.serving.openai_api import create_app  # noqa: E402
from kvlab.serving.serve import build_server  # noqa: E402

NAME = "smol"
MAX_MODEL_LEN = 512
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a", "1, 2, 3,"]


class Running:
    """A server on a free loopback port, in a thread of this process."""

    def __init__(self, overrides: list[str]):
        self.server = build_server(overrides, MAX_MODEL_LEN, NAME)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self.server), host="127.0.0.1", port=self.port,
                                log_level="warning")  # fmt: skip
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.uvicorn.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)

    def idle(self, timeout: float = 30) -> bool:
        """Whether the engine ends up with nothing running, waiting or held."""
        engine, deadline = self.server.engine, time.monotonic() + timeout
        while time.monotonic() < deadline:
            sched = engine.sched
            if not engine.handles and sched.idle and engine.inbox.empty():
                return True
            time.sleep(0.05)
        return False


@pytest.fixture(scope="module")
def served():
    running = Running(["cache=paged", "workload.serving.kv_budget_gib=0.05",
                       "workload.serving.max_joining=4", "workload.serving.chunk=64"])  # fmt: skip
    yield running
    running.stop()


def offline_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    engine = Engine(model, build_cache("full", model.cache_spec()))
    return engine.generate([prompt], GenerationConfig(new_tokens, stop_on_eos=True)).tokens[0]


def test_completions_stream_and_chat_give_the_offline_engines_greedy_text(served):
    """Four prompts at once (joining and leaving the running batch), plain and streamed,
    and a chat turn through the model's template: each the offline engine's greedy text."""
    server = served.server
    tokenizer, model = server.tokenizer, server.engine.model
    client = served.client
    results: dict[int, str] = {}

    def complete(i: int) -> None:
        out = client.completions.create(model=NAME, prompt=PROMPTS[i], max_tokens=12,
                                        temperature=0)  # fmt: skip
        results[i] = out.choices[0].text

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, text in enumerate(PROMPTS):
        ids = tokenizer(text)["input_ids"]
        want = tokenizer.decode(offline_greedy(model, ids, 12), skip_special_tokens=True)
        assert results[i] == want
        stream = client.completions.create(model=NAME, prompt=text, max_tokens=12,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.prompt_tokens == len(ids)
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                          temperature=0)  # fmt: skip
    ids = tokenizer(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    want = tokenizer.decode(offline_greedy(model, ids["input_ids"], 10), skip_special_tokens=True)
    assert chat.choices[0].message.content == want
    streamed = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                              temperature=0, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want


def test_stop_strings_eos_and_the_metrics(served):
    client = served.client
    full = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[4:7]
    cut = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12,
                                    temperature=0, stop=[stop])  # fmt: skip
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop" and full.choices[0].finish_reason == "length"
    metrics = httpx.get(f"{served.url}/metrics").text
    for family in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds",
                   "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                   "vllm:num_requests_waiting", "vllm:num_preemptions_total",
                   "vllm:e2e_request_latency_seconds"):  # fmt: skip
        assert family in metrics
    count = next(line for line in metrics.splitlines()
                 if line.startswith("vllm:time_to_first_token_seconds_count"))  # fmt: skip
    assert float(count.split()[-1]) >= 3  # every request so far


BAD = [  # (body, status, words the message says)
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "allowed: an object"),
    ({"model": "other", "prompt": "hi"}, 404, "model='other' does not exist"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens=0 is invalid"),
    ({"model": NAME, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens=-3"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens='many'"),
    ({"model": NAME, "prompt": [[5] * 600]}, 400, "the prompt has 600 tokens"),
    ({"model": NAME, "prompt": "hi", "max_tokens": 600}, 400, "exceeds the context of 512"),
    ({"model": NAME, "prompt": "hi", "frobnicate": 1}, 400, "unsupported parameter 'frobnicate'"),
    ({"model": NAME, "prompt": "hi", "n": 2}, 400, "n=2 is not supported"),
    ({"model": NAME, "prompt": "hi", "temperature": -1}, 400, "temperature=-1"),
    ({"model": NAME, "prompt": ""}, 400, "prompt=''"),
    ({"model": NAME, "prompt": [10**9]}, 400, "token ids must lie in"),
    ({"model": NAME, "prompt": "hi", "stop": [3]}, 400, "stop=[3]"),
]


@pytest.mark.parametrize(("body", "status", "words"), BAD, ids=[w for *_, w in BAD])
def test_each_bad_request_gets_its_4xx_and_the_server_stays_up(served, body, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{served.url}/v1/completions", content=content,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == status
    assert words in response.json()["error"]["message"]
    chat = {"model": NAME, "messages": [{"role": "user"}]}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=chat)
    assert response.status_code == 400 and "messages[0]" in response.json()["error"]["message"]
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_lm_evals_local_completions_scores_as_the_kvlab_adapter(served):
    """lm-eval's OpenAI-API model (echo with logprobs: the prompt's own log-probabilities)
    against the server, and its kvlab adapter in process, on the same items."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")
    from lm_eval.tasks import TaskManager

    import kvlab.lm_eval_model  # noqa: F401  (registers lm-eval's model kvlab)
    from kvlab.eval.harness import TASKS_DIR
    from kvlab.models.loading import resolve_checkpoint

    task, limit = "lambada_openai_local", 4
    manager = TaskManager(include_path=str(TASKS_DIR))
    checkpoint = resolve_checkpoint("smollm2-135m")

    def evaluate(model: str, args: str) -> dict:
        return lm_eval.simple_evaluate(model=model, model_args=args, tasks=[task], limit=limit,
                                       log_samples=True, task_manager=manager)  # fmt: skip

    endpoint = f"base_url={served.url}/v1/completions,model={NAME},max_retries=1"
    api = evaluate("local-completions", f"{endpoint},tokenizer_backend=huggingface,"
                   f"tokenizer={checkpoint}")  # fmt: skip
    ours = evaluate("kvlab", "model=smollm2-135m,cache=full,quant=none,dtype=float32")

    def scores(result: dict) -> list[tuple[float, bool]]:
        return [tuple(s["resps"][0][0]) for s in result["samples"][task]]

    a, b = scores(api), scores(ours)
    assert len(a) == len(b) == limit
    for (x, greedy_x), (y, greedy_y) in zip(a, b, strict=True):
        assert abs(x - y) < 1e-3 and greedy_x == greedy_y
    assert api["results"][task]["acc,none"] == ours["results"][task]["acc,none"]


def test_a_load_of_streaming_clients_some_leaving_frees_every_row(served):
    """32 concurrent streaming clients; every third disconnects after its first chunks,
    a few plain ones give up waiting: the server stays up, the rest finish, and the engine
    ends with no request, no row and no KV byte held."""

    async def client(i: int, http: httpx.AsyncClient) -> int:
        body = {"model": NAME, "prompt": PROMPTS[i % len(PROMPTS)] * (1 + i % 3),
                "max_tokens": 24 + i % 8, "temperature": 0.7, "seed": i, "stream": i % 5 != 4,
                "ignore_eos": True}  # fmt: skip
        if not body["stream"]:  # a client that stops waiting long before the answer
            body["max_tokens"] = 400
            with pytest.raises(httpx.ReadTimeout):
                await http.post(f"{served.url}/v1/completions", json=body, timeout=0.3)
            return -1
        chunks = 0
        async with http.stream("POST", f"{served.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return chunks
                if line.startswith("data: "):
                    chunks += 1
                    if i % 3 == 0 and chunks == 2:
                        return -1  # leaves mid-stream: the connection closes
        raise AssertionError(f"stream {i} ended without [DONE]")

    async def load() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(client(i, http) for i in range(32)))

    done = asyncio.run(load())
    finished = [n for n in done if n >= 0]
    assert len(finished) >= 15 and all(n >= 1 for n in finished)
    assert served.idle(), "requests still held after every client finished or left"
    engine = served.server.engine
    assert engine.kv_bytes_in_use() == 0
    assert engine.sched.cache.memory().used_bytes == 0
    assert [e.kind for e in engine.sched.events].count("cancel") >= 1
    assert httpx.get(f"{served.url}/health").status_code == 200
    reply = served.client.completions.create(model=NAME, prompt="Hi", max_tokens=3)
    assert reply.usage.completion_tokens == 3


def test_the_cli_composes_a_server_from_run_overrides():
    """``kvlab serve``'s flags and the run's overrides part ways; a bad flag value and a
    strategy that cannot serve are refused before any weight loads."""
    from kvlab.serving.serve import parse_args

    flags, overrides = parse_args(["--port", "9001", "cache=int4", "spec=ngram"])
    assert flags.port == 9001 and overrides == ["cache=int4", "spec=ngram"]
    with pytest.raises(ValueError, match="--max-model-len=100000 is invalid"):
        build_server(["cache=paged"], max_model_len=100000)
    with pytest.raises(ValueError, match="kvlab serve needs workload=serving"):
        build_server(["workload=default", "cache=paged"], max_model_len=256)
    with pytest.raises(ValueError, match="cache='evict' does not implement joining"):
        build_server(["cache=evict"], max_model_len=256)


def test_the_loop_runs_on_the_thread_that_calls_run():
    """``kvlab serve`` runs the engine's loop on its main thread (torch's OpenMP team
    lives there): :meth:`OnlineEngine.run` loops on the caller's thread, requests submitted
    from another thread get the offline engine's greedy tokens, and ``stop`` from that
    thread ends the loop, a request still running ending with an error event."""
    server = build_server(["cache=paged", "workload.serving.kv_budget_gib=0.05"], 256, NAME)
    engine, model = server.engine, server.engine.model
    prompt = server.tokenizer("The capital of France is")["input_ids"]
    done, events = threading.Event(), {"short": [], "long": []}

    def collect(name):
        def on_event(event):
            events[name].append(event)
            if name == "short" and event.finish:
                done.set()

        return on_event

    def client() -> None:
        engine.submit(prompt, 6, collect("short"))
        done.wait(60)
        engine.submit(prompt, 200, collect("long"))
        while not events["long"]:
            time.sleep(0.01)
        engine.stop(wait=False)

    helper = threading.Thread(target=client)
    helper.start()
    engine.run()
    helper.join()
    assert engine.thread is threading.current_thread() and not engine.alive
    short = [t for e in events["short"] for t in e.tokens]
    assert short == offline_greedy(model, prompt, 6) and events["short"][-1].finish == "length"
    assert events["long"][-1].finish == "error" and "shutting down" in events["long"][-1].error


def test_the_kvlab_serve_command_serves_and_stops_on_sigterm(tmp_path):
    """The command itself: healthy once loaded, a completion, then SIGTERM ends a stream
    still running with an error event and the process with status 0; a second server on
    the taken port exits 1 saying so."""
    import os
    import signal
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "kvlab.cli", "serve", "--port", str(port),
               "--max-model-len", "256", "--served-model-name", NAME, "cache=paged",
               "workload.serving.kv_budget_gib=0.05"]  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.2)
        body = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 5
        taken = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert taken.returncode == 1 and f"did not start on 127.0.0.1:{port}" in taken.stderr
        lines = []
        body = {**body, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            for line in filter(None, stream.iter_lines()):
                lines.append(line)
                if len(lines) == 2:  # a token in: the request runs
                    os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert any("shutting down" in line for line in lines) and lines[-1] == "data: [DONE]"
    finally:
        if process.poll() is None:
            process.kill()
