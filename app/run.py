"""`localllm run`: one-shot generation streamed to stdout, like `llama-cli -p ... -no-cnv`.

It drives the same engine as the server (one request): stop strings, penalties, structured
output, n-gram drafts and the KV-cache options all come from there.

Exit status: 0 done; 1 an error (bad file, bad flag value); 2 no prompt (none given, or empty);
3 a constrained answer (--json, --json-schema, --regex, --grammar-file) that the token limit cut
before it was complete: what was generated is on stdout, a warning on stderr. Output ends with a
newline: when stdout is not a terminal one is always added (strip one to get the exact text).
"""

import argparse
import json
import sys
from pathlib import Path

from localllm.app.engine_flags import add_engine_flags, engine_kwargs
from localllm.app.residency_flags import residency_config, show_plan

EXIT_NO_PROMPT = 2  # a usage error, like argparse's
EXIT_CUT = 3  # the limit cut a constrained answer: the output is not complete JSON / a match


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text for one prompt and stream it to stdout")
    p.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted or '-'")
    p.add_argument("-m", "--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate (256)")
    s = p.add_argument_group("sampling (llama.cpp defaults)")
    s.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy (0.8)")
    s.add_argument("--top-k", type=int, default=40, help="0 disables (40)")
    s.add_argument("--top-p", type=float, default=0.95, help="1.0 disables (0.95)")
    s.add_argument("--min-p", type=float, default=0.05, help="0 disables (0.05)")
    s.add_argument("--typical", type=float, default=1.0, help="typical-p; 1.0 disables")
    s.add_argument("--repeat-penalty", type=float, default=1.0, help="1.0 disables")
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None, help="RNG seed for reproducible sampling")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-generation")
    g = p.add_argument_group("structured output (one of)")
    g.add_argument("--json-schema", help="JSON schema the output must follow (JSON text)")
    g.add_argument("--json", action="store_true", help="any JSON object")
    g.add_argument("--regex", help="regular expression the output must match")
    g.add_argument("--grammar-file", help="GBNF (llama.cpp) or Lark grammar file")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="apply the model's chat template (default when it has one)",
    )
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="raw completion")
    p.add_argument("-s", "--system", help="system prompt (chat mode)")
    v = p.add_argument_group("vision")
    v.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="attach an image (repeatable; '-' reads it from stdin); needs the model's mmproj",
    )
    v.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="FILE",
        help="attach a video (repeatable; '-' reads it from stdin; chat mode); needs the "
        "model's mmproj and a family that takes video (Qwen2.5-VL)",
    )
    v.add_argument(
        "--mmproj",
        metavar="FILE",
        help="the model's vision projector GGUF (default: the one pulled with a Hub model; "
        "a local model file needs it)",
    )
    add_engine_flags(p)
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print load time and tokens/s to stderr"
    )
    p.set_defaults(handler=handle)


def _structured(args):
    from localllm.engine import StructuredOutputParams

    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema is not valid JSON: {e}") from None
        return StructuredOutputParams(json=schema)
    if args.json:
        return StructuredOutputParams(json_object=True)
    if args.regex is not None:
        return StructuredOutputParams(regex=args.regex)
    if args.grammar_file is not None:
        return StructuredOutputParams(grammar=Path(args.grammar_file).read_text())
    return None


def handle(args: argparse.Namespace) -> int:
    from localllm.app.model_path import resolve_model
    from localllm.engine import EngineArgs, LLMEngine, SamplingParams

    if args.show_plan:
        print(show_plan(resolve_model(args.model), args, residency_config(args)))
        return 0
    prompt = args.prompt
    media = [("image", n) for n in args.image] + [("video", n) for n in args.video]
    stdin = [n for _, n in media].count("-")
    if stdin > 1 or (stdin and prompt in (None, "-")):
        raise ValueError(
            "stdin holds one input: with --image - or --video -, give the prompt as an argument"
        )
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            return _no_prompt("no prompt given (pass it as an argument or on stdin)")
        prompt = sys.stdin.read()
        if not prompt.strip():
            return _no_prompt("the prompt on stdin is empty")
    elif not prompt.strip():
        return _no_prompt("the prompt is empty")
    given = [args.json_schema, args.json or None, args.regex, args.grammar_file]
    if sum(x is not None for x in given) > 1:
        raise ValueError("give at most one of --json-schema, --json, --regex, --grammar-file")
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        typical_p=args.typical,
        repetition_penalty=args.repeat_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        structured=_structured(args),
    )
    engine_args = EngineArgs(max_num_seqs=1, **engine_kwargs(args))
    images = [(kind, *_read_image(name)) for kind, name in media]  # missing files fail first
    mmproj = _mmproj(args) if images else None
    path = resolve_model(args.model)
    engine = LLMEngine(str(path), engine_args)
    vision = None
    try:
        if args.verbose:
            print(f"localllm: loaded {path.name} in {engine.load_seconds:.2f} s", file=sys.stderr)
        use_chat = (
            args.chat if args.chat is not None else engine.tokenizer.chat_template is not None
        )
        messages = [{"role": "system", "content": args.system}] if args.system else []
        mm = []
        if images:
            vision, ids, mm = _vision_prompt(engine, mmproj, images, prompt, messages, use_chat)
        elif use_chat:
            messages.append({"role": "user", "content": prompt})
            ids = engine.chat_prompt(messages)
        else:
            ids = engine.tokenize(prompt)
        last, out_ids = _stream(engine, ids, params, mm)
        cut = _cut_constraint(engine, params, last, out_ids, args)
    finally:
        if vision is not None:
            vision.close()
        engine.close()
    if last.error:
        raise RuntimeError(last.error)
    if args.verbose:
        _report(last)
        _report_experts(engine.model)
    if cut:
        print(f"localllm: warning: {cut}", file=sys.stderr)
        return EXIT_CUT
    return 0


def _read_image(name: str) -> tuple[str, bytes]:
    if name == "-":
        return "stdin", sys.stdin.buffer.read()
    return name, Path(name).expanduser().read_bytes()


def _mmproj(args) -> Path:
    """--mmproj, else the projector pulled with a Hub model (a local file is never paired)."""
    if args.mmproj:
        return Path(args.mmproj).expanduser()
    from localllm.app.hub.pairing import paired_mmproj

    found = paired_mmproj(args.model)
    if found is None:
        raise ValueError(
            f"{'--image' if args.image else '--video'} needs the model's vision projector: pass "
            "--mmproj FILE (only a model pulled from the Hub knows its own; nothing is guessed "
            "from files beside a model)"
        )
    return found


def _vision_prompt(engine, mmproj, images, prompt, messages, chat: bool):
    """(pipeline, prompt ids, image spans): the images before the prompt text, one turn."""
    from localllm.media.vision.image import ImageError
    from localllm.media.vision.pipeline import VisionPipeline

    vision = VisionPipeline(mmproj, engine)
    try:
        prepared = []
        for kind, name, data in images:
            try:
                item = vision.prepare_video(data) if kind == "video" else vision.prepare(data)
            except ImageError as e:  # (a VideoError is one)
                raise ImageError(f"{name}: {e}") from None
            prepared.append(item)
        if not chat:
            if any(im.video for im in prepared):
                raise ValueError("--video needs chat mode (the model's chat template places it)")
            return vision, *vision.completion(engine, prompt, prepared)
        content = [{"type": "video" if im.video else "image"} for im in prepared]
        content.append({"type": "text", "text": prompt})
        turn = [*messages, {"role": "user", "content": content}]
        return vision, *vision.chat(engine, turn, prepared)
    except BaseException:
        vision.close()
        raise


def _no_prompt(why: str) -> int:
    print(f"localllm: error: {why}; nothing to generate from", file=sys.stderr)
    return EXIT_NO_PROMPT


def _cut_constraint(engine, params, last, ids: list[int], args) -> str | None:
    """Why the answer is incomplete, when a length limit cut a constrained one (else None).

    The answer is replayed through a fresh matcher of the same grammar: an answer that became
    complete on exactly the last allowed token is not reported."""
    done = last.outputs[0] if last.outputs else None
    if params.structured is None or done is None or done.finish_reason != "length":
        return None
    matcher = engine.grammars.compile(params.structured).matcher()
    if all(matcher.accept(t) for t in ids) and matcher.accepting:
        return None
    n = len(ids)
    limit = f"at {n} tokens (-n)" if n >= params.max_tokens else f"at {n} tokens (context full, -c)"
    if args.json or args.json_schema is not None:
        what = "it is not complete JSON"
    elif args.regex is not None:
        what = "it does not match --regex yet"
    else:
        what = "it is not complete under --grammar-file"
    return f"the answer was cut {limit}; {what}"


def _stream(engine, ids, params, mm=()):
    """Stream the answer to stdout; the last output and every generated token id."""
    engine.add_request("run", ids, params, delta=True, mm_inputs=mm)
    out = sys.stdout
    wrote, wrote_newline, last, out_ids = False, False, None, []
    while engine.has_unfinished_requests():
        for last in engine.step():
            text = "".join(c.text for c in last.outputs)
            out_ids += [t for c in last.outputs for t in c.token_ids]
            if text:
                out.write(text)
                out.flush()
                wrote, wrote_newline = True, text.endswith("\n")
    # a pipe always gets one (so `| wc -l`, `read` and files end cleanly); a terminal when
    # missing; a request that failed before any text leaves stdout empty
    failed = last is None or bool(last.error)
    if (wrote or not failed) and (not out.isatty() or not wrote_newline):
        out.write("\n")
    out.flush()
    return last, out_ids


def _report_experts(model) -> None:
    """Expert lookups and streaming reads of an MoE model loaded under a residency plan."""
    from localllm.offload.expert_stats import expert_stats

    if not getattr(model, "expert_sources", None):
        return
    s = expert_stats(model.expert_sources)
    print(
        f"localllm: experts {s.lookups} lookups, {s.hits} hits, {s.misses} misses; read "
        f"{s.bytes_read / 1e6:.1f} MB in {s.stall_seconds:.2f} s ({s.read_gbps:.2f} GB/s)",
        file=sys.stderr,
    )


def _report(out) -> None:
    m, u = out.metrics, out.usage

    def rate(n, s):
        return f"{n / s:.1f} tok/s" if s and s > 0 else "n/a"

    prefill = m.ttft or 0.0
    decode = (m.e2e or 0.0) - prefill
    gen = max(u.completion_tokens - 1, 0)
    spec = ""
    if m.spec_proposed:
        spec = f"; drafts accepted {m.spec_accepted}/{m.spec_proposed}"
    print(
        f"localllm: prompt {u.prompt_tokens} tokens in {prefill:.2f} s "
        f"({rate(u.prompt_tokens, prefill)}); generated {u.completion_tokens} tokens in "
        f"{decode:.2f} s after the first ({rate(gen, decode)}){spec}",
        file=sys.stderr,
    )
