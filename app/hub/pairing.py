"""Which vision projector (mmproj) goes with a model: the one its Hub repository ships, or none.

`localllm pull org/repo:QUANT` fetches the repo's matching `mmproj*.gguf` with the model (see
`quant.pick_mmproj`), so a model named by its Hub spec or by its library name in the Hugging
Face cache knows its projector. A local file never does: two unrelated models in one folder
must not be fused, so it takes `--mmproj FILE` and nothing is guessed from the files beside it.
The TUI loads what it pulled by the file's path in the cache: `pulled_mmproj` pairs that path
with the projector pulled with it (the cache's record, not a guess from the folder).
"""

from pathlib import Path

from localllm.app.hub.download import HubConfig, cached_model
from localllm.app.hub.library import find_model, scan_library
from localllm.app.hub.quant import HubError
from localllm.app.hub.spec import parse_spec


def paired_mmproj(name: str | None) -> Path | None:
    """The mmproj pulled with the model `-m name` names, or None (a path, or no pair)."""
    if not name:
        return None
    spec = parse_spec(name)
    config = HubConfig.current()
    if spec.kind == "hub":
        found = cached_model(config, spec.repo, spec.quant, spec.filename, spec.revision or "main")
        return found.mmproj if found is not None else None
    if spec.kind == "name":
        try:  # the cache only: a user folder's neighbours are not a pair
            model = find_model(name, scan_library(config.cache_dir))
        except HubError:
            return None
        return model.mmproj
    return None


def pulled_mmproj(path: str | Path | None) -> Path | None:
    """The mmproj pulled with the Hugging Face cache file `path`, or None (not in the cache, or
    pulled without one)."""
    if not path:
        return None
    config = HubConfig.current()
    want = Path(path).expanduser().absolute()
    cache = Path(config.cache_dir).expanduser().absolute()
    if not want.is_relative_to(cache):
        return None
    for model in scan_library(config.cache_dir):
        if model.path.absolute() == want:
            return model.mmproj
    return None
