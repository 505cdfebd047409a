"""Byte-level tokenizer: round trips, streaming pieces, validation, prefix-block hashes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrs.errors import InvalidArgument
from kvrs.tokenizer import (
    BOS_ID,
    EOS_ID,
    VOCAB_SIZE,
    StreamDecoder,
    decode,
    encode,
    prefix_block_hashes,
    validate_token_ids,
)


def test_text_is_its_utf8_bytes_and_specials_carry_no_text():
    assert encode("héllo") == [104, 195, 169, 108, 108, 111]
    assert encode("hi", add_bos=True) == [BOS_ID, 104, 105]
    assert decode([BOS_ID, 104, 105, EOS_ID]) == "hi"
    assert VOCAB_SIZE == 258


@given(st.text())
def test_decode_inverts_encode(text):
    assert decode(encode(text)) == text


@given(st.lists(st.integers(min_value=0, max_value=VOCAB_SIZE - 1), max_size=64))
def test_streamed_pieces_concatenate_to_the_whole_decode(token_ids):
    stream = StreamDecoder()
    pieces = [stream.push(token) for token in token_ids]
    assert "".join(pieces) + stream.flush() == decode(token_ids)


def test_a_multibyte_character_is_emitted_whole_with_its_last_byte():
    stream = StreamDecoder()
    assert [stream.push(t) for t in encode("é€")] == ["", "é", "", "", "€"]
    assert stream.flush() == ""


def test_an_unfinished_character_at_the_end_flushes_as_a_replacement():
    stream = StreamDecoder()
    assert stream.push(0xE2) == ""
    assert stream.flush() == "\ufffd"


@pytest.mark.parametrize(
    ("token_ids", "field"),
    [
        ([1, 258], "prompt[1]"),
        ([-1], "prompt[0]"),
        ([1, 2, "3"], "prompt[2]"),
        ([True], "prompt[0]"),
    ],
)
def test_validation_names_the_offending_position(token_ids, field):
    with pytest.raises(InvalidArgument) as info:
        validate_token_ids(token_ids, "prompt")
    assert info.value.field == field


def test_prefix_hashes_chain_full_blocks_only():
    tokens = list(range(10))
    hashes = prefix_block_hashes(tokens, 4)
    assert len(hashes) == 2
    assert all(0 <= h < 2**64 for h in hashes)
    # The second block's hash depends on the first block, not only on its own tokens.
    other = prefix_block_hashes([9, 9, 9, 9, *tokens[4:8]], 4)
    assert other[1] != hashes[1]
    assert prefix_block_hashes(tokens[:8], 4) == hashes
    with pytest.raises(InvalidArgument):
        prefix_block_hashes(tokens, 0)
