"""`native_decode.split_step`: a CPU step mixing decode rows with prompt rows splits into the
decode rows' batch and the others', each row and image row carried to its new place."""

import torch

from localllm.engine.core.batch import BatchMeta
from localllm.engine.layers.native_decode import split_step


class _NoLora:
    lora = None


def _batch(embeds=None) -> BatchMeta:
    # sequence 0: a prompt chunk of 3 (rows 0-2); 1: decode (row 3); 2: a one-token prompt
    # (row 4, length 1: not a decode row); 3: decode (row 5)
    return BatchMeta((0, 3, 4, 5, 6), (3, 9, 1, 17), ((0,), (1,), (2,), (3, 4)),
                     torch.tensor([0, 1, 2, 24, 32, 64]), 16, embeds=embeds)  # fmt: skip


def test_rows_and_tables_go_to_their_halves():
    drows, dec, rrows, rest = split_step(_batch(), _NoLora())
    assert drows == [3, 5] and rrows == [0, 1, 2, 4]
    assert dec.query_start == (0, 1, 2) and dec.seq_lens == (9, 17)
    assert dec.block_tables == ((1,), (3, 4)) and dec.slot_mapping.tolist() == [24, 64]
    assert rest.query_start == (0, 3, 4) and rest.seq_lens == (3, 1)
    assert rest.block_tables == ((0,), (2,)) and rest.slot_mapping.tolist() == [0, 1, 2, 32]


def test_image_rows_follow_their_prompt_rows():
    values = torch.randn(2, 8)
    _, _, _, rest = split_step(_batch((torch.tensor([1, 4]), values)), _NoLora())
    rows, vals = rest.embeds
    assert rows.tolist() == [1, 3] and vals is values  # flat rows 1 and 4 -> 1 and 3 of the rest


def test_no_split_where_an_image_row_is_a_decode_row_or_nothing_mixes():
    assert split_step(_batch((torch.tensor([3]), torch.randn(1, 8))), _NoLora()) is None
    only_decode = BatchMeta((0, 1, 2), (5, 6), ((0,), (1,)), torch.tensor([4, 21]), 16)
    assert split_step(only_decode, _NoLora()) is None
