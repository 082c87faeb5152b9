"""The live resource panel: RAM, GPU memory, the loaded model's size and the generation speed."""

from collections.abc import Callable

from textual.widgets import Static

from localllm.app.hub.progress import human_bytes
from localllm.app.tui.resources import ExpertCache, Memory, expert_cache, probe_memory


def bar(used: int, total: int, width: int = 10) -> str:
    filled = round(width * used / total) if total else 0
    return "█" * filled + "░" * (width - filled)


def fit(name: str, width: int) -> str:
    """`name` in at most `width` columns (0: any): whole, or its start and its end around an
    ellipsis, since a model's quant is at the end of its name and its family at the start."""
    if width <= 0 or len(name) <= width:
        return name
    tail = (width - 1) // 2
    return name[: width - 1 - tail] + "…" + (name[-tail:] if tail else "")


def render_resources(
    mem: Memory,
    model: str | None,
    model_bytes: int,
    speed: float | None,
    compact: bool,
    experts: ExpertCache | None = None,
    width: int = 0,
) -> str:
    """The panel's text; `width` (columns, 0: any) fits the model's name on one row of the
    full panel, where a long name would otherwise wrap mid-word."""
    used = mem.ram_total - mem.ram_available
    ram = f"RAM {human_bytes(used)}/{human_bytes(mem.ram_total)} {bar(used, mem.ram_total)}"
    if mem.gpu_total is not None:
        gused = mem.gpu_total - (mem.gpu_free or 0)
        gpu = f"GPU {human_bytes(gused)}/{human_bytes(mem.gpu_total)} {bar(gused, mem.gpu_total)}"
    else:
        gpu = "GPU none"
    proc = f"app {human_bytes(mem.process_rss)}"
    # a backend holding no weights here is an endpoint's model (ChatBackend.model_bytes)
    size = human_bytes(model_bytes) if model_bytes else "remote"
    rate = f"{speed:.1f} tok/s" if speed is not None else "-- tok/s"
    if experts is not None:  # a model streaming MoE experts from disk
        rate += f"\nexperts {experts.hit_rate:.0%} hits, read {experts.read_gbps:.2f} GB/s"
    if compact:
        loaded = f"model {model} ({size})" if model else "model none"
        return f"{ram}  {gpu}  {proc}\n{loaded}  {rate}"
    loaded = f"model {size}\n{fit(model, width)}" if model else "model none"
    return "\n".join((ram, gpu, proc, loaded, rate))


class ResourcePanel(Static):
    DEFAULT_CSS = """
    ResourcePanel { height: auto; padding: 0 1; color: $text-muted; }
    """

    def __init__(
        self, compact: bool = False, probe: Callable[[], Memory] | None = None, **kw
    ) -> None:
        super().__init__(**kw)
        self.compact = compact
        self.probe = probe

    def on_mount(self) -> None:
        self.sample()
        self.set_interval(2.0, self.sample)

    def on_resize(self) -> None:
        self.sample()  # the model's name is fitted to the width

    def sample(self) -> None:
        probe = self.probe or getattr(self.app, "probe", None) or probe_memory
        backend = getattr(self.app, "backend", None)
        self.update(
            render_resources(
                probe(),
                backend.name if backend else None,
                backend.model_bytes if backend else 0,
                getattr(self.app, "last_speed", None),
                self.compact,
                expert_cache(backend),
                self.content_region.width,
            )
        )
