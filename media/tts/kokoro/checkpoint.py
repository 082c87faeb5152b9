"""Reading a Kokoro checkpoint (`kokoro-v1_0.pth`): a dict of five state dicts (bert,
bert_encoder, predictor, text_encoder, decoder) into a `KokoroModel`.

Keys may be wrapped in `module.` (DataParallel training; the reference loader strips it too),
and weight norm is kept as `weight_g`/`weight_v` (or `parametrizations.weight.original0/1` from
newer torch); both are folded into one plain `weight` here, so inference never recomputes it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from localllm.media.tts.kokoro.config import KokoroConfig, KokoroFormatError
from localllm.media.tts.kokoro.model import KokoroModel

PARTS = ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")
# Keys a checkpoint may carry that inference does not use.
_UNUSED_SUFFIXES = ("position_ids",)
_UNUSED_PREFIXES = ("pooler.",)
# AdaIN's instance-norm affine weights: the model was trained without them, so a checkpoint
# may lack them (identity is then right).
_OPTIONAL_SUFFIXES = (".norm.weight", ".norm.bias")


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """weight = g * v / ||v||, the norm over every axis but the first (torch's dim=0)."""
    dims = tuple(range(1, v.ndim))
    return g * v / v.norm(dim=dims, keepdim=True)


_NORM_PAIRS = (
    ("weight_g", "weight_v"),
    ("parametrizations.weight.original0", "parametrizations.weight.original1"),
)


def _split(key: str, suffix: str) -> str | None:
    """'a.b.weight_g' -> 'a.b.' for suffix 'weight_g' (None if it does not end so)."""
    if key == suffix or key.endswith("." + suffix):
        return key[: -len(suffix)]
    return None


def normalize_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip `module.`, fold weight norm, and drop keys inference does not use."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(_UNUSED_SUFFIXES) or key.startswith(_UNUSED_PREFIXES):
            continue
        if any(_split(key, v) is not None for _, v in _NORM_PAIRS):
            continue  # consumed with its g below
        for g_name, v_name in _NORM_PAIRS:
            base = _split(key, g_name)
            if base is not None:
                v = state.get(base + v_name)
                if v is None:
                    raise KokoroFormatError(f"weight norm of {base + 'weight'} has g but no v")
                out[base + "weight"] = fold_weight_norm(value.float(), v.float())
                break
        else:
            out[key] = value
    return out


def load_parts(model: KokoroModel, parts: dict[str, dict[str, torch.Tensor]]) -> None:
    """Load the five state dicts into `model`, strictly except for optional AdaIN affines."""
    missing_parts = [p for p in PARTS if p not in parts]
    if missing_parts:
        raise KokoroFormatError(f"checkpoint lacks {', '.join(missing_parts)}")
    for name in PARTS:
        module = getattr(model, name)
        state = normalize_state_dict(parts[name])
        expected = module.state_dict()
        missing = [k for k in expected if k not in state and not k.endswith(_OPTIONAL_SUFFIXES)]
        unexpected = [k for k in state if k not in expected]
        if missing or unexpected:
            raise KokoroFormatError(
                f"checkpoint part {name!r} does not fit the config: "
                f"{len(missing)} missing (e.g. {missing[:3]}), "
                f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})"
            )
        for key, value in state.items():
            if value.shape != expected[key].shape:
                raise KokoroFormatError(
                    f"{name}.{key}: shape {tuple(value.shape)} in the checkpoint, "
                    f"{tuple(expected[key].shape)} in the config"
                )
        module.load_state_dict(state, strict=False)


def read_checkpoint(path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad pickle/zip
        raise KokoroFormatError(f"{path}: not a torch checkpoint ({exc})") from exc
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise KokoroFormatError(f"{path}: not a Kokoro checkpoint (expected a dict of dicts)")
    return data


def load_model(config: KokoroConfig, checkpoint: str | Path) -> KokoroModel:
    """Build the graph for `config` and fill it from a .pth checkpoint or the int8 ONNX export."""
    model = KokoroModel(config)
    if Path(checkpoint).suffix == ".onnx":
        from localllm.media.tts.kokoro.onnx_import import read_kokoro_onnx

        load_parts(model, read_kokoro_onnx(checkpoint))
    else:
        load_parts(model, read_checkpoint(checkpoint))
    return model.eval()
