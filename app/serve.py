"""`localllm serve`: load one model into an `AsyncEngine` and serve the OpenAI-compatible API.

The only place that turns flags (and $LOCALLLM_MODEL, via `resolve_model`) into `EngineArgs` and
`ServerSettings`; the server package itself reads no environment.
"""

import argparse
import sys

from localllm.app.engine_flags import add_engine_flags, engine_kwargs


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (chat, completions, ...)")
    p.add_argument("-m", "--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--alias", help="model id clients see (default: the file name without .gguf)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (8080)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` (all but /health)")
    add_engine_flags(p, parallel=16)
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="allow browser calls from this origin (repeatable; '*' for any). Off by default",
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=8 << 20, help="largest request body (8 MiB)"
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds a request may run (no limit)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log requests to stderr")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    import uvicorn

    from localllm.app.model_path import resolve_model
    from localllm.app.server.app import create_app
    from localllm.app.server.settings import ServerSettings
    from localllm.engine import AsyncEngine

    if args.max_body_bytes < 1:
        raise ValueError("--max-body-bytes must be >= 1")
    if args.timeout is not None and args.timeout <= 0:
        raise ValueError("--timeout must be > 0")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    path = resolve_model(args.model)
    settings = ServerSettings(
        model_id=args.alias or path.stem,
        model_names=frozenset({path.name, path.stem, str(path)}),
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.timeout,
        cors_origins=tuple(args.cors_origin),
    )
    engine = AsyncEngine.from_model(str(path), **engine_kwargs(args))
    try:
        app = create_app(engine, settings)
        print(
            f"localllm: serving {settings.model_id} (context {engine.max_model_len}) "
            f"on http://{args.host}:{args.port}/v1",
            file=sys.stderr,
            flush=True,
        )
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level="info" if args.verbose else "warning",
            access_log=args.verbose,
            timeout_graceful_shutdown=5,
        )
    finally:
        engine.shutdown(abort=True)
    return 0
