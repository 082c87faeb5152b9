"""The multimodal seam's bookkeeping (engine.multimodal): input checks, the prefix-cache keys of
blocks under an image, the encoder cache and the rows a chunked step takes."""

import pytest
import torch

from localllm.engine.core.kv_manager import KVCacheManager
from localllm.engine.core.request import Request
from localllm.engine.multimodal import (
    EncoderCache,
    MultiModalInput,
    block_extra_keys,
    check_inputs,
    step_embeds,
)
from localllm.engine.sampling.params import SamplingParams

DIM = 4


def _item(h, positions, rows=None, calls=None):
    def encode():
        if calls is not None:
            calls.append(h)
        return torch.arange(len(positions) * DIM, dtype=torch.float32).view(-1, DIM) + len(h)

    if rows is not None:
        return MultiModalInput(h, tuple(positions), embeds=rows)
    return MultiModalInput(h, tuple(positions), encoder=encode)


def test_an_input_needs_sorted_positions_and_one_source():
    with pytest.raises(ValueError, match="strictly increasing"):
        _item("a", [3, 2])
    with pytest.raises(ValueError, match="exactly one"):
        MultiModalInput("a", (1,))
    with pytest.raises(ValueError, match="at least one"):
        _item("a", [])


def test_inputs_must_lie_inside_the_prompt_in_order_with_rows_per_position():
    check_inputs([_item("a", [1, 2]), _item("b", [5])], 6, DIM)
    with pytest.raises(ValueError, match="beyond the prompt's 6 tokens"):
        check_inputs([_item("a", [6])], 6, DIM)
    with pytest.raises(ValueError, match="overlaps"):
        check_inputs([_item("a", [1, 4]), _item("b", [3])], 6, DIM)
    with pytest.raises(ValueError, match=r"expected \(2, 4\)"):
        check_inputs([_item("a", [1, 2], rows=torch.zeros(3, DIM))], 6, DIM)


def test_block_keys_name_the_images_a_block_covers():
    items = [_item("a", [3, 4, 5, 6]), _item("b", [10, 12])]
    assert block_extra_keys(items, 0, 4) == ("a",)
    assert block_extra_keys(items, 4, 8) == ("a",)
    assert block_extra_keys(items, 7, 10) == ()
    assert block_extra_keys(items, 8, 16) == ("b",)


def _hashes(mm, tokens):
    kv = KVCacheManager(block_size=4, num_blocks=16)
    req = Request("r", tokens, SamplingParams(), max_tokens=4, mm_inputs=mm)
    kv.get_computed_blocks(req)
    return req.block_hashes


def test_same_tokens_other_image_differ_from_the_image_block_on():
    tokens = list(range(16))  # blocks [0,4) [4,8) [8,12) [12,16); the image sits at 6..9
    a = _hashes([_item("img-a", [6, 7, 8, 9])], tokens)
    b = _hashes([_item("img-b", [6, 7, 8, 9])], tokens)
    same = _hashes([_item("img-a", [6, 7, 8, 9])], tokens)
    plain = _hashes([], tokens)
    assert a == same
    assert a[0] == b[0] == plain[0]  # before the image: shared
    assert a[1] != b[1] and a[1] != plain[1]  # its first block and every later one differ
    assert a[2] != b[2] and a[2] != plain[2]


def test_encoder_runs_once_per_content_and_old_outputs_go_first():
    calls = []
    cache = EncoderCache(max_bytes=2 * 2 * DIM * 4)  # room for two 2-row outputs
    for h in ("a", "b", "a", "c", "a", "b"):
        cache.get(_item(h, [0, 1], calls=calls), DIM, torch.device("cpu"))
    # a, b miss; a hits; c evicts b (a was used last); a hits; b is encoded again
    assert calls == ["a", "b", "c", "b"]
    assert (cache.hits, cache.misses) == (2, 4)


def test_encoder_output_of_the_wrong_shape_is_an_error():
    bad = MultiModalInput("x", (0, 1), encoder=lambda: torch.zeros(3, DIM))
    with pytest.raises(ValueError, match=r"expected \(2, 4\)"):
        EncoderCache().get(bad, DIM, torch.device("cpu"))


def test_a_chunk_takes_the_rows_of_its_window():
    rows = torch.arange(5 * DIM, dtype=torch.float32).view(5, DIM)
    items = [_item("a", [2, 3, 5, 6, 7], rows=rows)]
    cache = EncoderCache()
    # positions 4..7 of the request, its first new token at flat row 10
    flat, values = step_embeds(items, 4, 4, 10, cache, DIM, torch.device("cpu"))
    assert flat == [11, 12, 13]  # positions 5, 6, 7
    assert torch.equal(torch.cat(values), rows[2:5])
    assert step_embeds(items, 8, 4, 0, cache, DIM, torch.device("cpu")) == ([], [])
