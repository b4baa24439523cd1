"""A byte-level tokenizer for Hugging Face: byte ``b`` is token id ``b`` (256 tokens).

Built from the ``tokenizers`` library with the GPT-2 byte-to-character table and no merges, so
every text round-trips exactly. Byte 0 (NUL) doubles as the end-of-text and padding token.
"""

from __future__ import annotations

#: the byte tokenizer's vocabulary: one token per byte
BYTE_VOCAB = 256


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` with ids equal to the UTF-8 bytes of the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = byte_to_char()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(BYTE_VOCAB)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    nul = table[0]
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=nul, pad_token=nul, bos_token=None,
                                   unk_token=None, clean_up_tokenization_spaces=False)
