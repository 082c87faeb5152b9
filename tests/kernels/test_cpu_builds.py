"""Each checked native CPU library loads its fastest build wherever that build compiles.

A loader tries its flag sets fastest first (`-march=native` with OpenMP, then plainer ones) and
takes the first build whose load-time self-check passes. A kernel bug that only the
`-march=native` build has (an AVX-512 / VNNI path) would make the loader fall back quietly to a
plainer build, and every kernel test would then run, and pass, on that fallback. These tests
make such a fallback a failure: where the fastest flag set compiles on this machine, the loader
must hand out that very build.
"""

import tempfile
from pathlib import Path

import pytest

from localllm.kernels.cpu import block_linear, float_gemv, native, prompt_attention, recurrent_step
from localllm.kernels.cpu.cbuild import build_library, compiler

# (module, library stem, sources as the loader keys them, the loaded object's library path)
LOADERS = {
    "block_linear": (block_linear, "localllm-block-linear", block_linear.SOURCES,
                     lambda k: k.path),
    "moe_gemv": (native, "localllm-moe-gemv", (native.SOURCE, *native.HEADERS), lambda k: k.path),
    "float_gemv": (float_gemv, "localllm-float-gemv", (float_gemv.SOURCE,), lambda k: k.path),
    "recurrent_step": (recurrent_step, "localllm-recurrent-step",
                       (recurrent_step.SOURCE, recurrent_step.HEADER),
                       lambda k: k.path),
    "prompt_attention": (prompt_attention, "localllm-prompt-attention",
                         (prompt_attention.SOURCE,), lambda lib: Path(lib._name)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_the_fastest_build_passes_its_self_check(name):
    mod, stem, sources, path_of = LOADERS[name]
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler")
    # the loaders build into the system's temporary folder by default
    fastest = build_library(cc, mod.FLAG_SETS[0], sources, stem, Path(tempfile.gettempdir()))
    if fastest is None:
        pytest.skip(f"{' '.join(mod.FLAG_SETS[0])} does not compile here")
    loaded = mod.load()
    assert loaded is not None, f"{name}: no build passed its self-check"
    assert path_of(loaded) == fastest, (
        f"{name}: the {' '.join(mod.FLAG_SETS[0])} build failed its self-check; "
        f"loaded {path_of(loaded).name} instead"
    )
