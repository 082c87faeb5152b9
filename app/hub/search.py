"""Hub search for the TUI's model screen: GGUF repos matching a name, and the quants one offers.

`search_models` asks the Hub's model listing (filtered to the `gguf` tag, most downloaded first);
`repo_quants` lists a repo's models by quant tag with their sizes, split GGUFs counted as one,
through the same resolution rules `localllm pull` uses.
"""

from dataclasses import dataclass

from huggingface_hub import get_session
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import hf_raise_for_status

from localllm.app.hub.download import HubConfig, remote_files
from localllm.app.hub.quant import HubError, group_ggufs, pick_mmproj


@dataclass(frozen=True)
class HubRepo:
    """One search hit."""

    repo_id: str
    downloads: int
    likes: int
    last_modified: str | None


@dataclass(frozen=True)
class QuantChoice:
    """One downloadable model of a repo: `repo:quant` pulls exactly `files` (+ `mmproj`)."""

    quant: str
    size: int  # bytes of the model's shards (the mmproj not included)
    files: tuple[str, ...]
    mmproj: str | None


def search_models(query: str, config: HubConfig, limit: int = 30) -> list[HubRepo]:
    """GGUF repos whose id matches `query`, most downloaded first; HubError when unreachable."""
    query = query.strip()
    if not query:
        return []
    if config.offline:
        raise HubError("offline mode (HF_HUB_OFFLINE) is on; Hub search needs the network")
    # One plain request, no retries: huggingface_hub's listing retries for ~20 s when the Hub is
    # down, too long for a search box.
    params = {"search": query, "filter": "gguf", "sort": "downloads", "limit": str(limit)}
    try:
        r = get_session().get(f"{config.endpoint}/api/models", params=params, timeout=15)
        hf_raise_for_status(r)
        hits = r.json()
    except HfHubHTTPError as e:
        raise HubError(f"Hub search for {query!r} failed on {config.endpoint}: {e}") from None
    except ValueError:
        raise HubError(f"{config.endpoint} answered the search with something not JSON") from None
    except Exception as e:
        if isinstance(e, OSError) or type(e).__module__.startswith(("httpx", "httpcore")):
            raise HubError(f"cannot reach {config.endpoint} to search ({e})") from None
        raise
    if not isinstance(hits, list):
        raise HubError(f"{config.endpoint} answered the search with an unexpected shape")
    return [
        HubRepo(
            str(h.get("id") or h.get("modelId")),
            int(h.get("downloads") or 0),
            int(h.get("likes") or 0),
            h.get("lastModified"),
        )
        for h in hits
        if isinstance(h, dict) and (h.get("id") or h.get("modelId"))
    ]


def repo_quants(repo: str, config: HubConfig, revision: str | None = None) -> list[QuantChoice]:
    """The models `repo` offers, one per quant tag (or file stem), smallest first."""
    _, files = remote_files(config, repo, revision)
    groups, mmprojs = group_ggufs(files)
    if not groups:
        raise HubError(f"{repo} has no GGUF files")
    out = []
    for g in groups:
        tag = g.quant or g.stem
        mm = pick_mmproj(mmprojs, g.quant)
        names = tuple(f.name for f in g.files)
        out.append(QuantChoice(tag, g.size, names, mm.name if mm else None))
    return sorted(out, key=lambda q: (q.size, q.quant))
