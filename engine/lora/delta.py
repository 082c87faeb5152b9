"""The unmerged LoRA computation: `LoraContext` (each flat row's factor per adapter, set once per
step) and `LoraDelta` (one linear's, or one fused linear's parts', adapter pairs).

Every loaded adapter that targets a module has its A stacked into one [R, in] matrix (R: the sum
of their ranks) and its B, already times the adapter's own scaling, into [out, R] per output part.
A step then adds, for all rows at once,

    delta = ((x @ A_all.T) * W) @ B.T        W [T, R]: row t's factor for the adapter of column r

so a batch whose rows use different adapters (or several each, or none) is the same few ops per
module whatever the mix, with no data-dependent shapes: CUDA graphs capture it once. A row that
does not use an adapter multiplies that adapter's columns by exactly 0, so its output is the one
it has alone. A step with no row on an adapter skips the deltas (the base alone, exactly); the
CUDA graphs key their captures by that (`LoraContext.active`), so a graph of such steps holds no
LoRA work at all. On CUDA, up to `triton_lora.MAX_ROWS` rows run the two triton kernels of
`kernels.fused.triton_lora` per module (a split-K shrink with atomics into the module's scratch,
an expand into every part that leaves the scratch at zero) on float16 weights; longer steps
(prompts) and CPU run the torch ops below. `SCHEME` "fused" selects `triton_lora_fused` (both
in one launch, a grid barrier between) for A/B benches. (The first kernels, looped split-K
partials, were removed after the H100 A/B of 2026-12-06: +102.9 % a token against +30.8 %.)
`SCHEME` "epilogue" (up to `EPILOGUE_ROWS` rows, packed base GEMVs only: the 8B Q4_K_M decode)
launches the shrink alone and hands each base GEMV a `LoraTail`: the GEMV adds the expand in its
epilogue (`kernels.quant.triton_lora_tail`), one launch a module fewer; "inline" hands the
module's first GEMV the shrink too (its first programs do the shrink's items, its tile
finishers wait for them): no LoRA launch at all. With PARTIAL_SHRINK the input kernels store
partial shrinks (a column block's or a head's) that the epilogues sum, so nothing is zeroed
after a call. Other steps of these schemes run the "atomic" kernels. `reference_delta` is the
plain per-adapter formula the tests compare with.
"""

import dataclasses
import logging

import torch

from localllm.kernels.fused.lora_delta import (
    PARTIALS,
    LoraPart,
    LoraShrink,
    make_tail,
    partials,
    scratch,
)

log = logging.getLogger(__name__)

# rows W holds; the runner's largest step (prompt graphs pad to 2,048) is below it on CUDA
MIN_ROWS = 2048
CUDA_DTYPE = torch.float16  # adapter weights on CUDA: half the bytes a decode step reads
KERNELS = True  # the triton kernels on CUDA (False: the torch ops; an A/B switch for benches)
# which kernels: "atomic" (triton_lora, two launches), "fused" (triton_lora_fused, one launch
# with a grid barrier; for A/B), "epilogue" (the shrink launched, the expand in the base GEMVs)
# or "inline" (both in the base GEMVs: no LoRA launch at all). "epilogue" by default: the 8B
# shape's decode on an H100 (2026-12-06 20:47 UTC, tests/perf/results/lora.md) 1 / 4 rank-16
# adapters +22.1 % / +46.5 % over the base, against "atomic"'s +32.9 % / +56.4 % ("inline"
# +35.3 % / +41.2 %)
SCHEME = "epilogue"
EPILOGUE_ROWS = 4  # rows the epilogue schemes take (the packed GEMVs' launch: MAX_ROWS)
# "epilogue": the kernel that makes a module's input (the norm before q|k|v and gate|up, the SiLU
# product before down, the flash-decoding combine before the output projection) runs its shrink
# where the model hands it over (`producer_shrink`), so no LoRA launch is left for those modules
# (False: the shrink launched, for A/B benches)
PRODUCER_SHRINK = True
# the producers take a module's stacked ranks up to this (H100, 8B shape: one rank-16 adapter,
# R 48 / 32 / 16 for q|k|v / gate|up / down and o, +16.1 % against +22.1 % launched; four,
# R 64 to 192, +54.1 % against +46.3 %: their loops over A outgrow a launch)
PRODUCER_MAX_RANK = 48
# ... and with their shares stored as partials (PARTIAL_SHRINK) up to this: four rank-16 adapters
# (R 192 / 128 / 64) +40.2 % over the base against +46.9 % launched (H100, 2026-12-07 23:07 UTC,
# twice; their GPU tests at R 192 and 64 passed in that call). Partials take 1 KB per rank of R
# a module.
PARTIAL_MAX_RANK = 192
# the producers store partial shrinks (the SiLU product's column blocks, the combine's heads)
# into the module's partials buffer and the GEMVs' epilogues sum them: no atomics, and no
# counter or zeroing after the epilogues (False: atomics into the scratch, which the last
# epilogue zeroes). On since an H100 timed it (2026-12-07 21:50 UTC, 8B shape, one rank-16
# adapter: +12.3 % over the base against +13.1 %; four with PRODUCER_MAX_RANK lifted +40.0 %
# against +46.8 % launched, not the default until its GPU test runs at those ranks)
PARTIAL_SHRINK = True
# "inline": at most this many shrink items in a GEMV, and no more than the GPU's SMs (item owners
# are the first programs to start; fewer than one per SM always find room, so the tile
# finishers waiting for them cannot fill the GPU first); more: the shrink is launched
INLINE_MAX_ITEMS = 256


def inline_items_cap(device: torch.device) -> int:
    """The most shrink items "inline" puts in one GEMV on `device` (see INLINE_MAX_ITEMS; CPU
    tensors: the triton interpreter, which runs programs in turn)."""
    if device.type != "cuda":
        return INLINE_MAX_ITEMS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return min(INLINE_MAX_ITEMS, sms)


class LoraContext:
    """Per-step row factors [rows, slots] and the per-module column views of them."""

    def __init__(
        self, n_slots: int, device: torch.device, rows: int = MIN_ROWS, kernels: bool | None = None
    ):
        self.n_slots = n_slots
        self.device = device
        self.always = device.type == "cuda"  # graphs: W's rows are fixed once captured
        # the deltas hold the triton kernels' layout (f16 weights, a scratch): on CUDA, or on
        # CPU tensors when a test asks (the triton interpreter runs the epilogue schemes there)
        self.kernels = device.type == "cuda" if kernels is None else kernels
        self.rows = max(rows, MIN_ROWS)
        self.w = torch.zeros(self.rows, n_slots, device=device)
        self._cols: list[torch.Tensor] = []  # per signature: column -> slot index [R]
        self.buffers: list[torch.Tensor] = []  # per signature: W's columns [rows, R]
        self._sigs: dict[tuple[int, ...], int] = {}
        self._views: tuple[int, list[torch.Tensor]] = (-1, [])  # (rows, each buffer's first rows)
        self._key = None
        self.active = False  # a row of this step is on an adapter

    def signature(self, cols: list[int]) -> int:
        """The index of the [rows, R] buffer whose column r is W's column cols[r]."""
        key = tuple(cols)
        if key not in self._sigs:
            idx = torch.tensor(cols, dtype=torch.long, device=self.device)
            self._sigs[key] = len(self._cols)
            self._cols.append(idx)
            self.buffers.append(self.w.index_select(1, idx))
            self._views = (-1, [])
        return self._sigs[key]

    def view(self, sig: int, rows: int) -> torch.Tensor:
        """The first `rows` rows of buffer `sig` (made once per step for all buffers)."""
        n, views = self._views
        if n != rows:
            views = [b[:rows] for b in self.buffers]
            self._views = (rows, views)
        return views[sig]

    def set_rows(self, rows: list[tuple[tuple[tuple[int, float], ...], int]]) -> None:
        """rows: per request in batch order, ((slot, factor), ...) and its number of flat rows."""
        key = tuple(rows)
        if key == self._key:
            return  # the same requests as last step (decode): W already holds them
        total = sum(n for _, n in rows)
        if total > self.rows:
            if self.always:
                raise ValueError(
                    f"a step of {total} rows exceeds the LoRA row buffer ({self.rows})"
                )
            self._grow(total)
        host = torch.zeros(self.rows, self.n_slots)
        r = 0
        for lora, n in rows:
            for slot, factor in lora:
                host[r : r + n, slot] += factor
            r += n
        self.w.copy_(host)
        for idx, buf in zip(self._cols, self.buffers, strict=True):
            torch.index_select(self.w, 1, idx, out=buf)
        self._views = (-1, [])
        self.active = bool(host.any())
        self._key = key

    def apply_all(self, lora: tuple[tuple[int, float], ...]) -> None:
        """Every row on `lora` (the bench, which runs no per-request batches)."""
        self.set_rows([(tuple(lora), self.rows)])

    def _grow(self, rows: int) -> None:
        self.rows = rows
        self.w = torch.zeros(rows, self.n_slots, device=self.device)
        self.buffers = [self.w.index_select(1, idx) for idx in self._cols]
        self._views = (-1, [])


class LoraDelta:
    """The adapter pairs of one linear (one part) or of a fused linear's parts."""

    def __init__(self, ctx: LoraContext, parts: list[tuple[torch.Tensor, torch.Tensor, list[int]]]):
        """parts: per output part, (A [R_p, in], B [out_p, R_p], slot of each of the R_p
        columns); R_p may be 0 (a part no adapter targets)."""
        self.ctx = ctx
        kern = ctx.kernels  # the kernels' layout (CUDA, or the interpreter in tests)
        dtype = CUDA_DTYPE if kern else torch.float32
        self.a = torch.cat([a for a, _, _ in parts]).to(dtype).contiguous()  # [R, in]
        # the torch path: one mm, mul_ and one addmm per part (CPU: A.T contiguous is faster)
        self.a_t = self.a.T if kern else self.a.T.contiguous()
        self.sig = ctx.signature([s for _, _, cols in parts for s in cols])
        self.b: list[tuple[int, int, int, torch.Tensor]] = []  # (part, first col, last col, B.T)
        first = 0
        for i, (a, b, _) in enumerate(parts):
            if a.shape[0]:
                self.b.append((i, first, first + a.shape[0], b.T.to(dtype).contiguous()))
            first += a.shape[0]
        self.kparts = [LoraPart(lo, hi, b_t) for _, lo, hi, b_t in self.b]
        self.whole = len(self.b) == 1 and first == self.b[0][2] - self.b[0][1]
        # the kernels' t accumulator, made here: never inside a CUDA-graph capture
        self.scratch = scratch(first, ctx.device) if kern else None
        # (made only with PARTIAL_SHRINK on at load: 1 KB per rank of R a module otherwise idle)
        small = kern and first <= PARTIAL_MAX_RANK and PARTIAL_SHRINK
        self.partials = partials(first, EPILOGUE_ROWS, ctx.device) if small else None
        self._parts = 0  # partials the last producer wrote (`PARTIAL_SHRINK`)
        self._partial_tails: dict[int, list] = {}
        self.offsets = [0]
        for _, b, _ in parts:
            self.offsets.append(self.offsets[-1] + b.shape[0])
        self._tails: list | None = None  # per base GEMV, its LoraTail (see `bind`)
        self._gemvs: list = []
        self._produced = 0  # rows whose shrink the input's kernel ran (`producer_shrink`)

    def bind(self, groups: list[tuple[object, list[int]]]) -> None:
        """The base kernels that compute this module's outputs: per kernel weight, the sizes of
        the parts it computes, in part order. Where all of them are packed GEMVs on CUDA (up to
        3 parts each), builds the `LoraTail`s the "epilogue" scheme hands them (now, at load:
        never inside a CUDA-graph capture)."""
        self._tails, self._gemvs = None, []
        if self.scratch is None or not groups:
            return
        if not all(hasattr(k, "takes_tail") and k.takes_tail(1) for k, _ in groups):
            return
        by_part = {i: kp for (i, _, _, _), kp in zip(self.b, self.kparts, strict=True)}
        specs, tiles, i = [], 0, 0
        for kernel, sizes in groups:
            parts = [(size, by_part.get(i + j)) for j, size in enumerate(sizes)]
            i += len(sizes)
            if len(parts) > 3:
                return
            on = any(p is not None for _, p in parts)
            tiles += -(-sum(sizes) // kernel.cfg.block_n) if on else 0
            specs.append(parts if on else None)
        if i != len(self.offsets) - 1:
            raise ValueError(f"LoRA bind: {i} base outputs for {len(self.offsets) - 1} parts")
        self._tails = [None if s is None else make_tail(self.scratch, s, tiles) for s in specs]
        self._partial_tails = {}
        self._gemvs = [k for k, _ in groups]
        # "inline": the first GEMV with adapter columns runs the shrink (when its items fit)
        self._inline = None
        first = next(i for i, t in enumerate(self._tails) if t is not None)
        from localllm.kernels.quant.triton_lora_tail import shrink_items

        if shrink_items(*self.a.shape) <= inline_items_cap(self.a.device):
            w = self.ctx.buffers[self.sig]
            self._inline = list(self._tails)
            self._inline[first] = dataclasses.replace(self._tails[first], a=self.a, w=w)

    def _takes(self, rows: int, device: torch.device) -> bool:
        """Whether the epilogue schemes take a call of `rows` rows on `device`."""
        if SCHEME not in ("epilogue", "inline") or self._tails is None:
            return False
        if not (KERNELS and self.ctx.active):
            return False
        if not (0 < rows <= EPILOGUE_ROWS and device == self.scratch[0].device):
            return False  # (the scratch is on CUDA only; CPU tensors: the triton interpreter)
        return all(k.takes_tail(rows) for k in self._gemvs)

    def producer_max_rank(self) -> int:
        """The stacked rank up to which this module's input kernel runs its shrink."""
        if PARTIAL_SHRINK and self.partials is not None:
            return PARTIAL_MAX_RANK
        return PRODUCER_MAX_RANK

    def producer_shrink(self, rows: int, device: torch.device) -> LoraShrink | None:
        """Under SCHEME "epilogue" (and PRODUCER_SHRINK), where `tails` will take the next call
        of `rows` rows: the shrink for the kernel that makes this module's input to run
        (`kernels.fused.ops`'s `shrink`), after which that call's `tails` launches none. The
        caller must hand it to that kernel and call this module next."""
        self._produced, self._parts = 0, 0
        if self.a.shape[0] > self.producer_max_rank():
            return None
        if not (PRODUCER_SHRINK and SCHEME == "epilogue" and self._takes(rows, device)):
            return None
        self._produced = rows
        w = self.ctx.buffers[self.sig]
        if PARTIAL_SHRINK and self.partials is not None:
            self._parts = -1  # until the producer says how many it wrote
            return LoraShrink(self.a, w, self.partials, PARTIALS, self._wrote)
        return LoraShrink(self.a, w, self.scratch[0])

    def _wrote(self, parts: int) -> None:
        self._parts = parts

    def _tails_over(self, parts: int) -> list:
        """The tails that sum `parts` partial shrinks from the partials buffer (made once per
        count, on the host: fine inside a CUDA-graph capture)."""
        if parts not in self._partial_tails:
            self._partial_tails[parts] = [
                None if t is None
                else dataclasses.replace(t, t=self.partials, np=parts, ps=PARTIALS)
                for t in self._tails
            ]  # fmt: skip
        return self._partial_tails[parts]

    def tails(self, x: torch.Tensor) -> list | None:
        """Under SCHEME "epilogue": launch the shrink into the scratch (unless the kernel that
        made x ran it: `producer_shrink`) and return each base GEMV's `LoraTail` (None: a GEMV
        without adapter columns), which the caller must pass to those GEMVs; "inline": the
        same with the shrink in the first GEMV's tail (nothing launched here); None where the
        scheme does not take this call (then `add*` as usual)."""
        rows = x.shape[0]
        produced, self._produced = self._produced, 0
        parts, self._parts = self._parts, 0
        if produced:
            if produced != rows or x.stride(-1) != 1:
                raise RuntimeError(f"LoRA: a shrink of {produced} rows for a call of {rows}")
            if parts < 0:
                raise RuntimeError("LoRA: the input's kernel did not run the partial shrinks")
            return self._tails_over(parts) if parts else self._tails
        if not self._takes(rows, x.device) or x.stride(-1) != 1:
            return None
        if SCHEME == "inline" and self._inline is not None:
            return self._inline  # (a compile failure raises: t may be left dirty)
        from localllm.kernels.fused import triton_lora

        try:
            triton_lora.shrink(x, self.a, self.ctx.buffers[self.sig], self.scratch)
        except Exception as e:  # a compile failure: the torch ops from now on, said once
            _give_up_kernels("shrink", e)
            return None
        return self._tails

    def native_parts(self) -> tuple:
        """(A [R, in], W's columns [rows, R], ((lo, hi, output column, B.T), ...)): what the
        native CPU decode step takes (`kernels.cpu.decode_lora.LinearLora`)."""
        parts = tuple((lo, hi, self.offsets[i], b_t) for i, lo, hi, b_t in self.b)
        return self.a, self.ctx.buffers[self.sig], parts

    def _low(self, x: torch.Tensor) -> torch.Tensor | None:
        """(x @ A_all.T) * W for this step's rows, or None when no adapter is in use."""
        if not self.ctx.active:
            return None
        return torch.mm(x.to(self.a_t.dtype), self.a_t).mul_(self.ctx.view(self.sig, x.shape[0]))

    def _kernels(self, x: torch.Tensor, ys: list[torch.Tensor]) -> bool:
        """ys[p] += part p's delta by the triton kernels, in place; False where they do not
        take this call (CPU, long steps) and the torch ops must run."""
        if not (KERNELS and x.is_cuda):
            return False
        from localllm.kernels.fused import triton_lora

        if not triton_lora.usable(x, self.kparts, ys):
            return False
        w = self.ctx.buffers[self.sig]
        try:
            if SCHEME == "fused":
                from localllm.kernels.fused import triton_lora_fused

                triton_lora_fused.shrink_expand(x, self.a, w, self.kparts, ys, self.scratch)
            else:
                triton_lora.shrink_expand(x, self.a, w, self.kparts, ys, self.scratch)
        except Exception as e:  # a compile failure: the torch ops from now on, said once
            _give_up_kernels("kernels", e)
            return False
        return True

    def _cols(self, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return t if self.whole else t[:, lo:hi]

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] of a single linear plus its delta."""
        if not self.ctx.active:
            return y
        if self._kernels(x, [y]):
            return y
        t = self._low(x)
        _, lo, hi, b_t = self.b[0]
        return _addmm(y, self._cols(t, lo, hi), b_t)

    def add_parts(self, x: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each part's output [T, out_p] plus its delta."""
        if not self.ctx.active:
            return outs
        outs = list(outs)
        if self._kernels(x, [outs[i] for i, _, _, _ in self.b]):
            return outs
        t = self._low(x)
        for i, lo, hi, b_t in self.b:
            outs[i] = _addmm(outs[i], self._cols(t, lo, hi), b_t)
        return outs

    def add_stacked(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The parts' outputs side by side [T, sum out_p] plus their deltas (in place)."""
        if not self.ctx.active:
            return y
        views = [y[:, self.offsets[i] : self.offsets[i + 1]] for i, _, _, _ in self.b]
        if self._kernels(x, views):
            return y
        t = self._low(x)
        for i, lo, hi, b_t in self.b:
            part = y[:, self.offsets[i] : self.offsets[i + 1]]
            if part.dtype == b_t.dtype:
                part.addmm_(self._cols(t, lo, hi), b_t)
            else:
                part += (self._cols(t, lo, hi) @ b_t).to(part.dtype)
        return y


def _addmm(y: torch.Tensor, t: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """y + t @ b_t in one op (float32 y), else computed in float32 and cast."""
    if y.dtype == b_t.dtype:
        return torch.addmm(y, t, b_t)
    return y + (t @ b_t).to(y.dtype)


def reference_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float):
    """PEFT's formula for one adapter: scaling * B(A(x)), in float32."""
    return scaling * ((x.float() @ a.float().T) @ b.float().T)


def _give_up_kernels(what: str, e: Exception) -> None:
    """After a triton LoRA launch failed (a compile failure): the torch ops from now on, said
    once; inside a CUDA graph capture the error stands (the capture is already broken)."""
    global KERNELS
    if torch.cuda.is_current_stream_capturing():
        raise e
    KERNELS = False
    log.warning("LoRA triton %s failed, torch ops from now on: %s", what, e)
