"""Hugging Face `SmolLM3ForCausalLM` folders as the `smollm3` family.

As llama.cpp's converter (`SmolLM3Model`, a `LlamaModel`): Q and K rows permuted to interleaved
rope pairs. Its graph fixes the no-rope layers at every fourth; a config whose `no_rope_layers`
says otherwise is refused rather than run as another model.
"""

from localllm.engine.hf.config import HFConfig, HFConfigError
from localllm.engine.hf.plan import TensorPlan
from localllm.engine.models import llama_hf
from localllm.engine.models.smollm3 import NOPE_STEP

ARCH = "smollm3"


def metadata(cfg: HFConfig) -> dict:
    n = cfg.require("num_hidden_layers")
    given = cfg.get("no_rope_layers")
    want = [int((i + 1) % NOPE_STEP != 0) for i in range(n)]  # 1: the layer uses rope
    if given is not None and list(given) != want:
        raise HFConfigError(f"config.json no_rope_layers {given} is not every {NOPE_STEP}th "
                            "layer, the only pattern the smollm3 graph runs")  # fmt: skip
    meta = llama_hf.metadata(cfg)
    return {k.replace("llama.", f"{ARCH}.", 1): v for k, v in meta.items()} | {
        "general.architecture": ARCH
    }


def adapt(plan: TensorPlan, cfg: HFConfig, n_vocab: int | None) -> None:
    llama_hf.adapt(plan, cfg, n_vocab)
