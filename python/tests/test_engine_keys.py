"""How an engine's block key becomes the tokens of a one-block prefix (tutti._engine.hash_tokens),
as docs/vllm.md (the tier), docs/sglang.md (a page) and hash_tokens' docstring state it: the
words of SHA-256 over the tag b"tutti engine block key v1\\0" then the key, read as eight
little-endian u32 words; the first block_tokens of them, or all eight then zeroes. Pools already
hold blocks under these tokens: the formula must not change unnoticed."""

from __future__ import annotations

import hashlib
import struct

import pytest

from tutti._engine import BYTE_GEOMETRY_BLOCK_TOKENS, HASH_TOKENS_MIN, hash_tokens

TAG = b"tutti engine block key v1\0"


def documented(key: bytes, block_tokens: int) -> list[int]:
    words = list(struct.unpack("<8I", hashlib.sha256(TAG + key).digest()))
    return words[:block_tokens] + [0] * max(0, block_tokens - len(words))


@pytest.mark.parametrize("block_tokens", [HASH_TOKENS_MIN, 5, BYTE_GEOMETRY_BLOCK_TOKENS, 9, 16])
@pytest.mark.parametrize("key", [b"", b"abc", bytes(range(256)), "sglang-page-\u00e9".encode()])
def test_an_engine_block_key_is_stored_as_the_words_of_the_tagged_sha256(key, block_tokens):
    # Goal: hash_tokens is the documented formula, for keys of any length and block sizes under,
    # at and over the digest's eight words.
    assert hash_tokens(key, block_tokens) == documented(key, block_tokens)


def test_the_tokens_of_a_key_are_pinned_and_are_not_the_untagged_sha256():
    # Goal: the exact tokens of one key (a change of tag, byte order or word count shows here
    # even if this file's formula changed with it), and not the first words of SHA-256(key),
    # which the docs said before.
    tokens = hash_tokens(b"abc", BYTE_GEOMETRY_BLOCK_TOKENS)
    assert BYTE_GEOMETRY_BLOCK_TOKENS == 8
    assert tokens == [2057588326, 623870959, 1077743159, 3888073554, 201374454, 3449141739, 2798457433, 2314244296]
    assert tokens != list(struct.unpack("<8I", hashlib.sha256(b"abc").digest()))
    assert hash_tokens(b"abc", 12) == tokens + [0, 0, 0, 0]


def test_a_block_of_fewer_tokens_than_the_minimum_is_refused():
    with pytest.raises(ValueError, match=f"block_tokens 1 < {HASH_TOKENS_MIN}"):
        hash_tokens(b"abc", HASH_TOKENS_MIN - 1)
