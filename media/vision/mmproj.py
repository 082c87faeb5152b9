"""The mmproj loader: a vision projector GGUF (`general.architecture = clip`, `clip.*` metadata,
`v.*` tower and `mm.*` projector tensors) built into its family's model, weights kept quantized.

The projector type (`clip.projector_type`, or `clip.vision.projector_type` in files that also
hold an audio encoder) picks the family file; any other type is an `MMProjError` that names it
and the types we run. Loading is a walk over tensor names, like the text models': each tensor
`a.b.c.weight` goes to the module at `a.b.c` through its `load_tensor` (F16/BF16/Q8_0 as they
are); unknown or missing tensors are errors. With HALF_TOWER on, a SigLIP tower of F16/BF16
weights runs its blocks in that dtype on CUDA (`siglip.Tower.use_half`).
"""

import dataclasses
import importlib
import os
from types import ModuleType

import torch
from torch import nn

from localllm.engine.gguf import GGUFError, GGUFModel, open_gguf
from localllm.media.vision.siglip import Tower, VisionConfigError

# projector type -> the family module of media.vision that runs it
# SigLIP blocks in the weights' half dtype on CUDA by default: on an H100 (2026-12-07 04:37 UTC,
# tests/perf/gpu_vision_siglip.sh) the 896 px Gemma-3-4B tower took 15.8 ms against 170.2 in
# float32 blocks (outputs within 7.7e-4 of them; the GPU tests against transformers pass at 2e-2)
HALF_TOWER = True

FAMILIES = {
    "idefics3": "idefics3",
    "gemma3": "gemma3",
    "qwen2.5vl_merger": "qwen25vl",
    "qwen2vl_merger": "qwen2vl",
    "qwen3vl_merger": "qwen3vl",
    "mlp": "llava",
}


class MMProjError(ValueError):
    """The file is not a vision projector we can run (wrong kind, unsupported, malformed)."""


def projector_type(meta: dict) -> str | None:
    return meta.get("clip.vision.projector_type") or meta.get("clip.projector_type")


def open_mmproj(path: str | os.PathLike) -> GGUFModel:
    """The opened mmproj GGUF, checked to be a vision projector of a supported type."""
    path = os.fspath(path)
    try:
        g = open_gguf(path)
    except (GGUFError, OSError) as e:
        raise MMProjError(f"{path}: not a readable GGUF mmproj file: {e}") from None
    try:
        arch = g.architecture
        if arch != "clip":
            raise MMProjError(
                f"{path}: general.architecture is {arch!r}, not 'clip': this is a model, not a "
                "vision projector (mmproj) file"
            )
        if not g.get("clip.has_vision_encoder", False):
            raise MMProjError(f"{path}: this projector has no vision encoder (an audio one?)")
        kind = projector_type(g.metadata)
        if kind not in FAMILIES:
            raise MMProjError(
                f"{path}: vision projector type {kind!r} is not supported "
                f"(supported: {', '.join(sorted(FAMILIES))})"
            )
    except BaseException:
        g.close()
        raise
    return g


def family_module(kind: str) -> ModuleType:
    return importlib.import_module(f"localllm.media.vision.{FAMILIES[kind]}")


def build_tower(g: GGUFModel, device: torch.device | str = "cpu") -> nn.Module:
    """The family model of an opened mmproj, its tensors loaded on `device`."""
    device = torch.device(device)
    mod = family_module(projector_type(g.metadata))
    try:
        args = mod.ModelArgs.from_gguf(g.metadata)
    except VisionConfigError as e:
        raise MMProjError(f"{g.path}: {e}") from None
    model = mod.Model(args)
    for name in g.tensors:
        path, _, suffix = name.rpartition(".")
        try:
            target = model.get_submodule(path)
        except AttributeError:
            target = None
        if target is None or not hasattr(target, "load_tensor"):
            raise MMProjError(f"{g.path}: unexpected tensor '{name}' for this projector")
        w = g.weight(name)
        if w.data.device != device:
            w = dataclasses.replace(w, data=w.data.to(device))
        try:
            target.load_tensor(suffix, w)
        except (KeyError, ValueError) as e:
            raise MMProjError(f"{g.path}: tensor '{name}': {e}") from None
    missing = [n for n, m in model.named_modules() if hasattr(m, "load_tensor") and not m.loaded]
    if missing:
        raise MMProjError(f"{g.path}: missing tensors: {', '.join(missing[:8])}")
    if device.type != "cpu":
        for m in model.modules():  # tensors a module made itself (default norm weights)
            for key, v in list(vars(m).items()):
                if isinstance(v, torch.Tensor) and v.device != device:
                    setattr(m, key, v.to(device))
    if device.type == "cuda" and HALF_TOWER:  # SigLIP blocks in the weights' half dtype (siglip)
        for m in model.modules():
            if isinstance(m, Tower):
                m.use_half(m.stored_half_dtype())
    return model.eval()
