"""``kvlab serve``: the run's model, weight quantizer, cache strategy and speculation — the
same Hydra overrides a ``kvlab`` run takes — behind an OpenAI-compatible HTTP server
(:mod:`kvlab.serving.openai_api`). ``workload.serving``'s budget, chunk and caps drive
the continuous batching; its trace fields are not read (clients are the trace)."""

from __future__ import annotations

import argparse

from kvlab.serving.openai_api import Server


def parse_args(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Server flags (vLLM's names) and the run's Hydra overrides."""
    parser = argparse.ArgumentParser(
        prog="kvlab serve",
        description="An OpenAI-compatible server over kvlab's engine. Other arguments are "
        "the run's overrides, e.g. cache=paged quant=rtn spec=ngram "
        "workload.serving.kv_budget_gib=1 workload.serving.max_batched_tokens=4096",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="tokens a request may hold, prompt and output (default: the "
                        "model's trained context)")  # fmt: skip
    parser.add_argument("--served-model-name", default="",
                        help="the `model` clients name (default: model.source)")  # fmt: skip
    return parser.parse_known_args(args)


def build_server(overrides: list[str], max_model_len: int = 0, served_name: str = "") -> Server:
    """The run that ``overrides`` compose to (``workload=serving`` unless another
    ``workload`` is named), its model loaded and its engine ready to start."""
    from kvlab.cache import registered
    from kvlab.cache.base import cache_options
    from kvlab.config import check_backend
    from kvlab.engine.generate import check_rollback
    from kvlab.models.loading import max_context
    from kvlab.run import _eos_ids, compose_run_config, run_model
    from kvlab.serving.online import OnlineEngine
    from kvlab.serving.prometheus import ServerMetrics
    from kvlab.serving.server import check_serves
    from kvlab.threads import apply_threads

    if not any(o.startswith("workload=") for o in overrides):
        overrides = ["workload=serving", *overrides]
    cfg = compose_run_config(overrides)
    serving = cfg.workload.serving
    if serving is None:
        raise ValueError(
            f"workload={cfg.workload.kind!r}: kvlab serve needs workload=serving (its "
            "budget, chunk and caps drive the batching)"
        )
    limit = max_context(cfg.model.source)
    max_model_len = max_model_len or limit
    if not 1 < max_model_len <= limit:
        raise ValueError(
            f"--max-model-len={max_model_len} is invalid; allowed: 2 to the model's context "
            f"of {limit} tokens"
        )
    options = cache_options(cfg.cache.name, cfg.cache.options)
    check_backend(cfg, options)
    strategy = registered()[cfg.cache.name]
    check_serves(strategy)
    if cfg.spec.enabled:
        check_rollback(strategy, options, max_model_len, cfg.spec)
    apply_threads(cfg.threads)
    model, tokenizer, new_cache = run_model(cfg)
    name = served_name or cfg.model.source
    metrics = ServerMetrics(name)
    eos = frozenset(_eos_ids(tokenizer, model))
    engine = OnlineEngine(model, new_cache, serving, max_model_len, eos, cfg.spec, metrics)
    return Server(engine, tokenizer, name, max_model_len, metrics, eos)


def serve_main(args: list[str]) -> None:
    """``kvlab serve [--host H] [--port P] [--max-model-len N] [--served-model-name NAME]
    [overrides]``: serve until interrupted (SIGINT or SIGTERM). The engine's loop runs on
    this, the main thread, and the HTTP server on a thread beside it (why:
    :mod:`kvlab.serving.online`)."""
    import signal
    import threading

    import uvicorn

    from kvlab.serving.openai_api import create_app

    flags, overrides = parse_args(args)
    try:
        server = build_server(overrides, flags.max_model_len, flags.served_model_name)
    except ValueError as exc:
        raise SystemExit(f"kvlab serve: {exc}") from None
    config = uvicorn.Config(create_app(server, run_engine=False), host=flags.host,
                            port=flags.port, log_level="warning")  # fmt: skip
    http = uvicorn.Server(config)

    def serve_http() -> None:
        try:
            http.run()
        finally:  # the loop ends with the HTTP server (a port already taken, say)
            server.engine.stop(wait=False)  # the main thread, which waits for this one

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    print(
        f"kvlab serve: {server.model_name} on http://{flags.host}:{flags.port}/v1 "
        f"(cache={server.engine.sched.cache.name}, max_model_len={server.max_model_len})",
        flush=True,
    )
    thread = threading.Thread(target=serve_http, name="kvlab-http", daemon=True)
    thread.start()
    try:
        server.engine.run()  # every request still running ends with an error event
    except KeyboardInterrupt:
        pass
    http.should_exit = True
    thread.join(timeout=30)
    if not http.started:
        raise SystemExit(f"kvlab serve: the HTTP server did not start on {flags.host}:{flags.port}")
