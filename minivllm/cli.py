"""Command line: ``minivllm generate "prompt" ...`` streams answers from the engine;
``minivllm serve [MODEL] --port 8000`` serves it over an OpenAI-compatible HTTP API;
``minivllm bench serve --base-url URL`` load-tests such a server (any OpenAI-compatible one).

With several prompts, all of them run together in one continuously batched
engine; the answers are shown in prompt order, the current one streaming live
while the later ones catch up.  A summary line (TTFT, tokens/s, KV blocks used)
closes the run.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time

from minivllm.argtypes import bytes_or_off, nonnegative_int, port, positive_int, seconds_or_off

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in two sentences why the sky is blue.",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream answers to one or more prompts")
    g.add_argument("prompts", nargs="*", help="prompts (default: three demo questions)")
    g.add_argument("--model", default=None, help="HF directory, .gguf file or hub id (default: bundled SmolLM2-135M)")
    g.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate per prompt (default 64)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0.0: greedy, so the demo's answers are reproducible)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-chat", action="store_true", help="send prompts raw, without the chat template")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu", "triton"])
    g.add_argument("--linear-backend", default="auto", choices=["auto", "torch", "onednn"])
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn)")
    s.add_argument("model", nargs="?", default=None, help="HF directory, .gguf file or hub id (default: bundled SmolLM2-135M)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 exposes the server, "
                        "unauthenticated unless --api-keys-file, to the network)")
    s.add_argument("--port", type=port, default=8000, help="TCP port (default 8000, vLLM's)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model's); every word after it is a name, so "
                        "give MODEL before it")
    s.add_argument("--api-keys-file", default=None, help='JSON {"key": "tenant"}; else $MINIVLLM_API_KEYS; none: one tenant, no auth')
    s.add_argument("--max-num-seqs", type=positive_int, default=None)
    s.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    s.add_argument("--max-model-len", type=positive_int, default=None)
    s.add_argument("--block-size", type=positive_int, default=None)
    s.add_argument("--enable-prefix-caching", action="store_true")
    s.add_argument("--preemption-mode", default=None, choices=["recompute", "swap", "reject", "auto"])
    s.add_argument("--num-gpu-blocks-override", type=positive_int, default=None)
    s.add_argument("--dtype", default=None)
    s.add_argument("--attention-backend", default=None, choices=["auto", "torch", "cpu", "triton"])
    s.add_argument("--linear-backend", default=None, choices=["auto", "torch", "onednn"])
    s.add_argument("--max-waiting-requests", type=positive_int, default=None,
                   help="load shedding: answer 429 + Retry-After when this many sequences already wait (a request for n "
                        "choices is n; default: no limit)")
    s.add_argument("--min-free-blocks", type=nonnegative_int, default=0,
                   help="with --max-waiting-requests: also shed when requests wait and fewer KV blocks than this are "
                        "available (free, or holding cached prefixes no request uses)")
    s.add_argument("--max-request-bytes", type=bytes_or_off, default=None,
                   help="a larger request body is answered 413 before it is read whole; 'off': no limit (if not "
                        "given, the most bytes a prompt that fits --max-model-len can take as JSON, 17 MB at 8,192 "
                        "tokens of SmolLM2's vocabulary)")
    s.add_argument("--stall-timeout-s", type=seconds_or_off, default=None,
                   help="seconds a scheduling deadlock may last (nothing scheduled for 64 steps and more) before the "
                        "stuck requests get an error; 'off': never (default: the engine's 10)")
    s.add_argument("--scheduling-policy", default=None, choices=["fcfs", "caps", "wfq", "three_class"],
                   help="who is served first (minivllm.sched.fairness; default fcfs). 'priority' and 'deadline' are "
                        "not offered: over HTTP no request carries a priority or a deadline, so they would serve FCFS")
    s.add_argument("--tenants-file", default=None,
                   help='JSON {"tenant": {"weight": 2, "max_running": 4, "max_kv_share": 0.5, "over_cap": "reject", '
                        '"priority_class": "batch", ...}}: TenantConfig per tenant of --api-keys-file ("*": the rest)')
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # -h before the name is this parser's help; after it, REMAINDER hands it to the named tool
    b = sub.add_parser("bench", help="benchmarks: 'bench serve --base-url URL' load-tests an OpenAI-compatible server")
    b.add_argument("name", choices=["serve"], help="serve: the load generator (minivllm/bench/loadgen.py)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="its options (minivllm bench serve --help)")
    m = sub.add_parser("sim", help="simulator: 'sim run' (roofline engine, virtual clock), 'sim calibrate' (fit this device)")
    m.add_argument("name", choices=["run", "calibrate"], help="run: minivllm/sim/run.py; calibrate: minivllm/sim/calibrate.py")
    m.add_argument("args", nargs=argparse.REMAINDER, help="its options (minivllm sim run --help)")
    from minivllm.labs.grade import add_arguments as grade_arguments  # its options only; grading loads on use

    grade_arguments(sub.add_parser("grade", help="autograde lab notebooks: checkers + hidden cases, a score table"))
    return p


def generate(args: argparse.Namespace) -> int:
    from minivllm import LLM, SamplingParams

    prompts = args.prompts or DEFAULT_PROMPTS
    # bad sampling values fail here, in a blink, not after the model has loaded
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )
    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
    )
    load_s = time.perf_counter() - t0
    engine = llm.engine
    ids = {}
    for i, prompt in enumerate(prompts):
        source = prompt if args.no_chat or llm.tokenizer is None else llm.chat_prompt([{"role": "user", "content": prompt}])
        ids[engine.add_request(source, params)] = i
    finals: dict[int, object] = {}
    pending = ["" for _ in prompts]  # text not yet shown, per prompt
    shown = 0  # prompts are shown in order: the current one streams live, later ones catch up

    def flush() -> None:
        nonlocal shown
        while shown < len(prompts):
            if pending[shown]:
                sys.stdout.write(pending[shown])
                pending[shown] = ""
            if shown not in finals:
                break
            shown += 1
            if shown < len(prompts):
                sys.stdout.write(f"\n\n[{shown}] {prompts[shown]}\n")
        sys.stdout.flush()

    if len(prompts) > 1:
        sys.stdout.write(f"[0] {prompts[0]}\n")
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = ids[out.request_id]
            pending[i] += out.outputs[0].delta_text
            if out.finished:
                finals[i] = out
        flush()
    sys.stdout.write("\n")
    outs = [finals[i] for i in sorted(finals)]
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    span = max(o.metrics.finished_time for o in outs) - min(o.metrics.arrival_time for o in outs)
    print(
        f"-- {len(outs)} requests | load {load_s:.1f}s | TTFT mean {sum(ttfts) / len(ttfts) * 1000:.0f} ms "
        f"| {n_tokens} tokens in {span:.2f}s = {n_tokens / span:.1f} tokens/s "
        f"| KV blocks used (peak) {engine.scheduler.stats.peak_used_blocks}/{engine.pool.num_blocks} "
        f"of {engine.config.block_size} tokens"
    )
    return 0


def serve_options(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """``minivllm serve``'s engine options (``LLM``'s keyword arguments) and its API keys (``{key: tenant}``), from
    its parsed flags: one function, so a test can serve exactly what the CLI would build (tenants file included)."""
    from minivllm.server import load_api_keys, load_tenants

    options = {
        name: getattr(args, name)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "preemption_mode",
                     "num_gpu_blocks_override", "dtype", "attention_backend", "linear_backend", "stall_timeout_s",
                     "scheduling_policy")
        if getattr(args, name) is not None
    }
    if options.get("stall_timeout_s") == math.inf:
        options["stall_timeout_s"] = None  # --stall-timeout-s off: the engine's "no watchdog"
    if args.enable_prefix_caching:
        options["enable_prefix_caching"] = True
    api_keys = load_api_keys(args.api_keys_file)
    if args.tenants_file is not None:  # read before the model loads: a typo costs no load
        options["tenants"] = load_tenants(args.tenants_file, api_keys)
    return options, api_keys


def body_limit(args: argparse.Namespace) -> int | str | None:
    """``--max-request-bytes`` as ``build_app`` takes it: not given is ``"auto"`` (derived from the engine's
    tokenizer and context), ``off`` is None (no limit), a number is that many bytes."""
    given = args.max_request_bytes
    return "auto" if given is None else None if given == math.inf else given


def serve(args: argparse.Namespace) -> int:
    """``minivllm serve``: load the model, then run uvicorn until SIGINT/SIGTERM (which aborts in-flight requests)."""
    import uvicorn

    from minivllm import LLM
    from minivllm.engine.startup import freeze_startup_heap
    from minivllm.server import build_app

    options, api_keys = serve_options(args)
    llm = LLM(args.model, **options)
    door = None
    if args.max_waiting_requests is not None:
        from minivllm.server.door import DoorRule

        door = DoorRule(args.max_waiting_requests, args.min_free_blocks)
    app = build_app(llm.engine, args.served_model_name, api_keys, door=door, max_body_bytes=body_limit(args))
    async_engine = app.state.async_engine
    frozen = freeze_startup_heap()  # this process serves until it exits: see minivllm.engine.startup

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # abort in-flight requests first, so open streams end now
            async_engine.begin_shutdown()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    tenants = sorted(set(api_keys.values())) or ["default (no API keys)"]
    print(f"minivllm: serving {app.state.handlers.model_names} on http://{args.host}:{args.port} "
          f"| tenants: {', '.join(tenants)} | policy: {llm.engine.config.scheduling_policy} "
          f"| KV blocks: {llm.engine.pool.num_blocks} "
          f"| {frozen} start-up objects frozen out of the garbage collector", file=sys.stderr, flush=True)
    try:
        _Server(config).run()  # uvicorn re-raises the signal once shut down: Ctrl-C lands here
    except KeyboardInterrupt:
        pass
    finally:
        llm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "serve" and args.min_free_blocks and args.max_waiting_requests is None:
        # the door rule reads both; alone, --min-free-blocks was dropped without a word and nothing was shed
        parser.error("argument --min-free-blocks: needs --max-waiting-requests (the door sheds only with a queue limit)")
    if args.command == "serve" and args.model is None and len(args.served_model_name or ()) > 1:
        # nargs="+" takes the model too when it follows the names, and the bundled model was served under them
        *names, last = args.served_model_name
        # (a bare word is a path only if it holds a model: a name may well match a folder where the server starts)
        if (os.path.isfile(last) or os.path.isfile(os.path.join(last, "config.json")) or last.endswith(".gguf")
                or any(sep and sep in last for sep in ("/", os.sep, os.altsep))):
            fixed = shlex.join(["minivllm", "serve", last, "--served-model-name", *names])
            parser.error(f"argument --served-model-name: every word after it is a name, and the last one, {last!r}, "
                         f"looks like a path or hub id: give the model before the flag ({fixed} ...); a name that "
                         f"only looks like one goes before the other names")
    try:
        if args.command == "generate":
            return generate(args)
        if args.command == "serve":
            return serve(args)
        if args.command == "bench":
            from minivllm.bench.loadgen import main as bench_serve

            return bench_serve(args.args)
        if args.command == "sim":
            if args.name == "run":
                from minivllm.sim.run import main as sim_main
            else:
                from minivllm.sim.calibrate import main as sim_main
            return sim_main(args.args)
        if args.command == "grade":
            from minivllm.labs.grade import run as grade

            return grade(args)
    except (ValueError, OSError) as exc:  # OSError: a file named on the command line is missing or unreadable
        print(f"minivllm: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
