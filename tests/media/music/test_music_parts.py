"""MusicGen's parts on their own: the delay pattern, the samplers against transformers' logits
warpers, the chroma filter bank against transformers', the cached LM against its reference on
fresh random inputs, sharded checkpoints, and seeded sampling."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from localllm.media.music import MusicGen, SamplingOptions, delay
from localllm.media.music.chroma import chroma_filters
from localllm.media.music.sampling import warp
from tests.media.music.music_fixture import DATA, expected, model


def test_delay_pattern_mono_and_stereo():
    pad, F = 9, delay.FREE
    assert delay.pattern(3, 4, 1, pad).tolist() == [
        [pad, F, F, F, pad, pad, pad],
        [pad, pad, F, F, F, pad, pad],
        [pad, pad, pad, F, F, F, pad],
        [pad, pad, pad, pad, F, F, F],
    ]
    stereo = delay.pattern(2, 4, 2, pad)
    assert stereo[0].tolist() == stereo[1].tolist() == [pad, F, F, pad]
    assert stereo[2].tolist() == stereo[3].tolist() == [pad, pad, F, F]
    prompt = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])
    pat = delay.pattern(4, 4, 1, pad, prompt)
    assert pat[1].tolist() == [pad, pad, 3, 4, F, F, pad, pad]
    assert delay.first_free(pat) == 3
    seq = torch.arange(4 * 8).view(4, 8)
    assert delay.undelay(seq, 1, 4)[2].tolist() == seq[2, 3:7].tolist()


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 3, 0.5)])
def test_warp_equals_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 3
    theirs = logits.clone()
    if temperature != 1:
        theirs = TemperatureLogitsWarper(temperature)(None, theirs)
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    opts = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(warp(logits, opts), theirs)


@pytest.mark.parametrize("n_fft,rate", [(2048, 32000), (16384, 32000), (4096, 24000)])
def test_chroma_filters_equal_transformers(n_fft, rate):
    from transformers.audio_utils import chroma_filter_bank

    theirs = chroma_filter_bank(num_frequency_bins=n_fft, num_chroma=12, sampling_rate=rate)
    np.testing.assert_allclose(chroma_filters(rate, n_fft), theirs, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["musicgen", "musicgen-stereo", "musicgen-melody"])
def test_cached_lm_equals_reference_on_random_codes(name):
    """Prefill 5 positions, then 6 single steps, against the reference over the whole
    sequence (2 rows, the second with zero cross states as CFG's unconditional row)."""
    lm = model(name).lm
    a = lm.args
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, a.vocab_size + 1, (2, a.num_codebooks, 11), generator=g)
    prefix = torch.randn(2, 4, a.hidden_size, generator=g) if not lm.cross else None
    cross = torch.randn(1, 6, a.hidden_size, generator=g) if lm.cross else None
    x = lm.embed(codes)
    if prefix is not None:
        x = torch.cat([prefix, x], dim=1)
    full = lm.add_positions(x, 0)
    if lm.cross:
        rows, mask = torch.cat([cross, torch.zeros_like(cross)]), torch.tensor([[1.0] * 6, [0] * 6])
        ref = lm.reference(full, rows, mask)
    else:
        ref = lm.reference(full)
    cache = lm.new_cache(2, full.shape[1])
    kv = lm.cross_kv(cross) if lm.cross else None
    n0 = full.shape[1] - 6
    outs = [lm.forward_cached(full[:, :n0], cache, kv, 1 if lm.cross else 0)]
    for t in range(n0, full.shape[1]):
        outs.append(lm.forward_cached(full[:, t : t + 1], cache, kv, 1 if lm.cross else 0))
    fast = lm.logits(torch.cat(outs, dim=1))
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)  # float32, logits ~10


def test_sharded_checkpoint_loads_the_same(tmp_path):
    """A folder with model.safetensors.index.json and two shards gives the same codes."""
    src = DATA / "musicgen"
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    wmap = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / shard)
        wmap.update(dict.fromkeys(part, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    case = expected()["cases"]["greedy_cfg3"]
    opts = SamplingOptions(temperature=0, guidance_scale=3.0)
    codes = MusicGen(tmp_path).codes(expected()["prompt"], expected()["frames"], opts)
    assert codes.tolist() == case["codes"]


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    m = model("musicgen")
    opts = SamplingOptions(temperature=1.0, top_k=50, seed=11)
    a = m.codes("lo-fi piano", 12, opts)
    b = m.codes("lo-fi piano", 12, opts)
    c = m.codes("lo-fi piano", 12, SamplingOptions(temperature=1.0, top_k=50, seed=12))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_generate_lengths_and_stereo_shape():
    m = model("musicgen-stereo")
    music = m.generate("jazz trio", 0.1, SamplingOptions(seed=1))
    assert music.samples.shape == (2, 3200)
    assert music.codes.shape == (8, 5)
    assert np.isfinite(music.samples).all()


def test_bfloat16_lm_keeps_codec_and_text_in_float32():
    m = MusicGen(DATA / "musicgen-melody", dtype=torch.bfloat16)
    assert m.lm.embeds.dtype == torch.bfloat16 and m.lm.layers[0]["qkv"].dtype == torch.bfloat16
    assert m.codec.codebooks.dtype == torch.float32 and m.text.embed.dtype == torch.float32
    music = m.generate("jazz", 0.2, SamplingOptions(seed=3))
    assert music.samples.dtype == np.float32 and np.isfinite(music.samples).all()
    # bf16 rounding changes the numbers, not the greedy path's first codes on this model
    greedy = SamplingOptions(temperature=0)
    ours = m.codes(expected()["prompt"], expected()["frames"], greedy)
    ref = torch.tensor(expected()["cases"]["melody_none_cfg3"]["codes"])
    assert (ours == ref).float().mean() > 0.5


def _break_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _drop_tensor(path):
    tensors = load_file(path / "model.safetensors")
    del tensors["decoder.lm_heads.2.weight"]
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    "breakage,message",
    [
        (lambda p: (p / "config.json").unlink(), "config.json: missing"),
        (lambda p: (p / "config.json").write_text("{oops"), "config.json: cannot read"),
        (lambda p: _break_config(p, lambda c: c.update(model_type="llama")), "not a MusicGen"),
        (
            lambda p: _break_config(p, lambda c: c["decoder"].update(num_codebooks=5)),
            "codebooks",
        ),
        (
            lambda p: _break_config(p, lambda c: c["decoder"].update(hidden_size="x")),
            "decoder.hidden_size: expected an integer",
        ),
        (lambda p: (p / "model.safetensors").write_bytes(b"\x10\x00"), "safetensors"),
        (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
        (_drop_tensor, "no tensor 'decoder.lm_heads.2.weight'"),
        (lambda p: (p / "tokenizer.json").write_text("[]"), "cannot load the T5 tokenizer"),
    ],
)
def test_bad_folders_fail_in_one_line(tmp_path, breakage, message):
    from localllm.media.music import MusicModelError

    shutil.copytree(DATA / "musicgen", tmp_path, dirs_exist_ok=True)
    breakage(tmp_path)
    with pytest.raises(MusicModelError, match=re.escape(message)) as e:
        MusicGen(tmp_path)
    assert "\n" not in str(e.value)


def test_old_weight_norm_keys_load_the_same(tmp_path):
    """Checkpoints saved before torch's parametrizations (the published MusicGen ones) name the
    EnCodec weight norm `weight_g`/`weight_v`; they give the same audio."""
    shutil.copytree(DATA / "musicgen", tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {
        k.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        ): v
        for k, v in tensors.items()
    }
    assert any(k.endswith("weight_g") for k in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    codes = torch.tensor(expected()["cases"]["greedy_cfg3"]["codes"])
    np.testing.assert_array_equal(MusicGen(tmp_path).decode(codes), model("musicgen").decode(codes))


def test_steps_choice_is_checked():
    m = model("musicgen")
    opts = SamplingOptions(temperature=0.0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        m.codes("a", 4, opts, steps="graph")
    with pytest.raises(ValueError, match="steps must be one of"):
        m.codes("a", 4, opts, steps="fast")
