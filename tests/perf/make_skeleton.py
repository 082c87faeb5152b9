"""A real GGUF's skeleton (its metadata, tokenizer included, and its tensor plan: names, types and
shapes, no weights) and the random-weight file of the same plan grown from it on another machine.

A real file too large to carry to the GPU machine (the 64 MiB limit) travels as its skeleton; the
grown file has the real file's tensors in the real file's types (random but valid ggml blocks,
`make_synthetic.random_rows`), so prompt and decode speed, which depend on shapes and types alone,
are the real model's. Norms (F32 vectors) are ones with a little noise, as in make_synthetic.

    python tests/perf/make_skeleton.py skeleton REAL.gguf -o .refbuild/NAME.skel.gguf
    python tests/perf/make_skeleton.py grow .refbuild/NAME.skel.gguf -o /tmp/NAME.gguf [--seed 0]
"""

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

sys.path.insert(0, str(Path(__file__).parent))
from make_synthetic import _BLOCK, _tensor_data, write_plan

PLAN_KEYS = ("skeleton.tensor_names", "skeleton.tensor_types", "skeleton.tensor_dims")
SKIP = ("GGUF.", "general.architecture", "skeleton.")


def _copy_fields(reader: gguf.GGUFReader, w: gguf.GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key.startswith(SKIP):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == VT.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)


def write_skeleton(real: Path, out: Path) -> int:
    """The skeleton of `real` at `out`; returns the number of tensors planned."""
    r = gguf.GGUFReader(real)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    _copy_fields(r, w)
    ts = list(r.tensors)
    dims = [",".join(str(int(d)) for d in reversed(t.shape)) for t in ts]  # outermost first
    w.add_array(PLAN_KEYS[0], [t.name for t in ts])
    w.add_array(PLAN_KEYS[1], [int(t.tensor_type) for t in ts])
    w.add_array(PLAN_KEYS[2], dims)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return len(ts)


def grow(skeleton: Path, out: Path, seed: int = 0) -> int:
    """The random-weight file of `skeleton`'s plan at `out`; returns its tensor bytes."""
    r = gguf.GGUFReader(skeleton)
    names, types, dims_s = (r.fields[k].contents() for k in PLAN_KEYS)
    plan = []
    for name, qt, ds in zip(names, types, dims_s, strict=True):
        dims = tuple(int(d) for d in ds.split(","))
        qt = QT(qt)
        if qt != QT.F32 and qt not in _BLOCK:
            raise ValueError(f"{name}: no random blocks for {qt.name}")
        plan.append((name, dims[0] if len(dims) == 1 else dims, qt))
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    _copy_fields(r, w)
    rng = np.random.default_rng(seed)
    return write_plan(w, plan, lambda name, dims, qt: _tensor_data(name, dims, qt, rng))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("skeleton", "grow"))
    p.add_argument("source", type=Path, help="the real GGUF (skeleton) or a skeleton (grow)")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.action == "skeleton":
        n = write_skeleton(a.source, a.output)
        print(f"{a.output}: skeleton of {n} tensors, {a.output.stat().st_size / 2**20:.1f} MiB")
    else:
        n = grow(a.source, a.output, a.seed)
        print(f"{a.output}: {n / 2**20:.1f} MiB of random tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
