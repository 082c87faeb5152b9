"""The live resource panel: RAM, GPU memory, the loaded model's size and the generation speed."""

from collections.abc import Callable

from textual.widgets import Static

from localllm.app.hub.progress import human_bytes
from localllm.app.tui.resources import ExpertCache, Memory, expert_cache, probe_memory


def bar(used: int, total: int, width: int = 10) -> str:
    filled = round(width * used / total) if total else 0
    return "█" * filled + "░" * (width - filled)


def render_resources(
    mem: Memory,
    model: str | None,
    model_bytes: int,
    speed: float | None,
    compact: bool,
    experts: ExpertCache | None = None,
) -> str:
    used = mem.ram_total - mem.ram_available
    ram = f"RAM {human_bytes(used)}/{human_bytes(mem.ram_total)} {bar(used, mem.ram_total)}"
    if mem.gpu_total is not None:
        gused = mem.gpu_total - (mem.gpu_free or 0)
        gpu = f"GPU {human_bytes(gused)}/{human_bytes(mem.gpu_total)} {bar(gused, mem.gpu_total)}"
    else:
        gpu = "GPU none"
    proc = f"app {human_bytes(mem.process_rss)}"
    loaded = f"model {model} ({human_bytes(model_bytes)})" if model else "model none"
    rate = f"{speed:.1f} tok/s" if speed is not None else "-- tok/s"
    if experts is not None:  # a model streaming MoE experts from disk
        rate += f"\nexperts {experts.hit_rate:.0%} hits, read {experts.read_gbps:.2f} GB/s"
    if compact:
        return f"{ram}  {gpu}  {proc}\n{loaded}  {rate}"
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
            )
        )
