"""`localllm run`: one-shot generation streamed to stdout, like `llama-cli -p ... -no-cnv`."""

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text for one prompt and stream it to stdout")
    p.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted or '-'")
    p.add_argument("-m", "--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens to generate (256)")
    p.add_argument("--temperature", "--temp", type=float, default=0.8, help="0 = greedy (0.8)")
    p.add_argument("--top-k", type=int, default=40, help="0 disables (40)")
    p.add_argument("--top-p", type=float, default=0.95, help="1.0 disables (0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="0 disables (0.05)")
    p.add_argument("--seed", type=int, default=None, help="RNG seed for reproducible sampling")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-generation")
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
    p.add_argument("--precise", action="store_true", help="float32 reference matmuls (slower)")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="print load time and tokens/s to stderr"
    )
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from localllm.app.model_path import resolve_model
    from localllm.engine.generator import Generator
    from localllm.engine.prompt import prompt_ids
    from localllm.engine.sampling import SamplingParams
    from localllm.engine.tokenizer import IncrementalDetokenizer

    prompt = args.prompt
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise ValueError("no prompt given (pass it as an argument or on stdin)")
        prompt = sys.stdin.read()
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    path = resolve_model(args.model)
    gen = Generator.load(str(path), precise=args.precise)
    tok = gen.tokenizer
    if args.verbose:
        print(f"localllm: loaded {path.name} in {gen.load_seconds:.2f} s", file=sys.stderr)
    use_chat = args.chat if args.chat is not None else tok.chat_template is not None
    ids = prompt_ids(tok, prompt, chat=use_chat, system=args.system)
    detok = IncrementalDetokenizer(tok, prompt_ids=ids)
    out = sys.stdout
    wrote_newline = True
    for token in gen.stream(ids, params):
        text = detok.add(token)
        if text:
            out.write(text)
            out.flush()
            wrote_newline = text.endswith("\n")
    tail = detok.flush()
    if tail:
        out.write(tail)
        wrote_newline = tail.endswith("\n")
    if out.isatty() and not wrote_newline:
        out.write("\n")
    out.flush()
    if args.verbose:
        _report(gen.last_stats)
    gen.close()
    return 0


def _report(stats) -> None:
    def rate(n, s):
        return f"{n / s:.1f} tok/s" if s > 0 else "n/a"

    print(
        f"localllm: prompt {stats.prompt_tokens} tokens in {stats.prefill_seconds:.2f} s "
        f"({rate(stats.prompt_tokens, stats.prefill_seconds)}); generated "
        f"{stats.generated_tokens} tokens in {stats.decode_seconds:.2f} s "
        f"({rate(stats.generated_tokens, stats.decode_seconds)})",
        file=sys.stderr,
    )
