"""Build a model from a GGUF file: pick the family by architecture, then a walk over tensor names.

`open_weights` opens what `-m` names: a GGUF (or a split shard), or a Hugging Face folder
(`engine.hf`), which offers the same metadata and GGUF-named tensors; `load_tokenizer` builds
either's tokenizer.

Each GGUF tensor `a.b.c.weight` goes to the module at path `a.b.c` (after the family's aliases)
through its `load_tensor`. Unknown tensors and modules left unloaded are errors, not silence.
On a GPU every tensor's raw ggml blocks are uploaded once, before `load_tensor`, so the kernels
pick their device strategy and small tensors (norms, biases) are expanded on the device; routed
experts are the exception: their MoE block packs them from the host a few at a time.
"""

import dataclasses
import os
from collections.abc import Collection

import torch
from torch import nn

from localllm.engine.gguf import GGUFModel, open_gguf
from localllm.engine.hf import HFCheckpoint, HFError, open_hf
from localllm.engine.layers.linear import QuantLinear, dense
from localllm.engine.layers.rope import Rotary
from localllm.engine.models import UnsupportedArchitectureError, model_module
from localllm.engine.models.common import unused_tensor
from localllm.engine.models.hparams import HyperparameterError, check_args, check_tensors
from localllm.engine.moe.block import use_native_cpu_experts
from localllm.engine.moe.expert_tensor import ExpertTensor
from localllm.engine.tokenizer import Tokenizer, VocabError
from localllm.kernels.cpu.native import load as load_native
from localllm.offload import QuantWeight


class ModelLoadError(ValueError):
    """The GGUF's tensors do not fit the architecture's model (missing, extra or misshapen)."""


def open_weights(path: str | os.PathLike, quantize: str | None = None):
    """A `GGUFModel` for a .gguf path, an `HFCheckpoint` for a folder. `quantize` (a folder's
    float weights made into that ggml type at load) is refused for a GGUF, which keeps its own."""
    if os.path.isdir(path):
        try:
            return open_hf(path, quantize)
        except HFError as e:
            raise ModelLoadError(str(e)) from None
    if quantize is not None:
        raise ModelLoadError(
            f"{os.fspath(path)}: --quantize applies to Hugging Face folders; a GGUF runs in the "
            "types it was written in"
        )
    return open_gguf(path)


def load_tokenizer(source) -> Tokenizer:
    """The tokenizer of an opened GGUF or folder; a bad vocabulary is an error naming it."""
    try:
        if isinstance(source, HFCheckpoint):
            n_vocab = source.tensors["token_embd.weight"].shape[0]
            return Tokenizer.from_hf_folder(source.path, n_vocab)
        return Tokenizer.from_gguf_metadata(source.metadata)
    except VocabError as e:
        raise ModelLoadError(f"{source.path}: {e}") from None


def build_model(
    gguf: GGUFModel,
    precise: bool = False,
    device: torch.device | str = "cpu",
    host_tensors: Collection[str] = (),
) -> nn.Module:
    """Instantiate and load the model described by `gguf` (weights stay quantized) on `device`.

    `host_tensors` (a residency plan's host and disk tiers) are never uploaded to the device.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    args = model_args(gguf)
    model = model_module(gguf.architecture).Model(args, precise=precise)
    # the native CPU kernels (one build lookup and self-check) take Q6_K / Q8_0 linears and
    # MoE experts from the file's blocks; set before the weights come, so no fp16 copy is made
    native = load_native() if device.type == "cpu" and not precise else None
    if native is not None:
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.native = native
    # host blocks that are views of the file's mapping cost nothing to keep until the modules
    # re-lay them out on the GPU; private read copies of experts are uploaded at once (a
    # linear's are held instead: non-expert bytes in host RAM, not beside its kernel's layout)
    views = getattr(gguf, "views", True)
    aliases = getattr(model, "tensor_aliases", {})
    optional = set(getattr(model, "optional_tensors", ()))
    extra: dict[str, torch.Tensor] = {}
    for name in gguf.tensors:
        if unused_tensor(args, name):
            continue  # a block the family never runs (GLM's NextN layer): never read
        path, _, suffix = name.rpartition(".")
        target = _find(model, _alias(path, aliases))
        if target is None:
            if name not in optional:
                raise ModelLoadError(f"{gguf.path}: unexpected tensor '{name}' for {args.arch}")
            extra[name] = dense(_upload(gguf.weight(name), device))
            continue
        try:
            where = device if name not in host_tensors else torch.device("cpu")
            own = isinstance(target, QuantLinear) or (views and isinstance(target, ExpertTensor))
            if own and where.type == "cuda" and suffix == "weight":
                # uploaded by the module for its kernel's layout, never held raw: experts packed
                # by their block's `fuse` a chunk at a time, linears one at a time
                target.home, where = where, torch.device("cpu")
            target.load_tensor(suffix, _upload(gguf.weight(name), where))
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{gguf.path}: tensor '{name}': {e}") from None
    missing = [
        n
        for n, m in model.named_modules()
        if hasattr(m, "load_tensor") and not m.loaded and f"{n}.weight" not in optional
    ]
    if missing:
        raise ModelLoadError(f"{gguf.path}: missing tensors: {', '.join(missing[:8])}")
    try:
        model.finish_load(extra)  # families check what only the loaded tensors tell
    except ValueError as e:
        raise ModelLoadError(f"{gguf.path}: {e}") from None
    if device.type == "cpu":
        use_native_cpu_experts(model, native)  # raw expert blocks, no prepared copies
    if device.type != "cpu":
        _move_leftovers(model, device)
        for m in model.modules():
            if isinstance(m, QuantLinear):
                m.drop_raw_copy()
    return model.eval()


def model_args(gguf: GGUFModel):
    """The family's `ModelArgs` of `gguf`, every hyperparameter checked (`models.hparams`) against
    its range, the tensors' shapes and the others before anything is built: a hostile value is
    a `ModelLoadError` naming the file, never a long build, a huge allocation or NaN logits."""
    arch = gguf.architecture
    try:
        if type(arch) is not str:
            raise HyperparameterError(f"metadata 'general.architecture' is {arch!r}")
        mod = model_module(arch)
        check_tensors(gguf.metadata, gguf.tensors)
        vocab_size = gguf.tensors["token_embd.weight"].shape[0]
        args = mod.ModelArgs.from_gguf(gguf.metadata, vocab_size)
        check_args(args)
        family_check = getattr(args, "check", None)  # the checks of a family's own keys
        if family_check is not None:
            family_check()
    except KeyError as e:
        raise ModelLoadError(f"{gguf.path}: {e.args[0]}") from None
    except (HyperparameterError, UnsupportedArchitectureError) as e:
        raise ModelLoadError(f"{gguf.path}: {e}") from None
    return args


def _upload(w: QuantWeight, device: torch.device) -> QuantWeight:
    """The same raw blocks on `device` (the mmap view itself on CPU: no copy)."""
    if w.data.device == device:
        return w
    return dataclasses.replace(w, data=w.data.to(device))


def _move_leftovers(model: nn.Module, device: torch.device) -> None:
    """Tensors the model made itself on the host (rope frequencies, default norm weights)."""
    for m in model.modules():
        for name, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and v.device != device:
                setattr(m, name, v.to(device))
            elif isinstance(v, Rotary) and v.inv_freq.device != device:
                v.inv_freq = v.inv_freq.to(device)


def _alias(path: str, aliases: dict[str, str]) -> str:
    parts = path.split(".")
    if parts[0] == "blk" and len(parts) > 2:
        rest = ".".join(parts[2:])
        return f"blk.{parts[1]}.{aliases.get(rest, rest)}"
    return aliases.get(path, path)


def _find(model: nn.Module, path: str) -> nn.Module | None:
    try:
        m = model.get_submodule(path)
    except AttributeError:
        return None
    return m if hasattr(m, "load_tensor") else None
