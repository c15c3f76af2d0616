"""token_bytes: a token's own bytes (OpenAI's log-prob ``bytes``) for the tokenizers chat models use."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from slime_lite.tokenizer import build_tokenizer, token_bytes
from tests.rollout.test_agent_endpoint_answers import _byte_level_tokenizer


def _bytes_of(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return ids, [token_bytes(tok, i, tok.decode([i])) for i in ids]


def test_byte_level_tokens_of_one_character_give_its_bytes():
    tok = _byte_level_tokenizer()
    ids, parts = _bytes_of(tok, "aé€😀")
    assert len(ids) == 1 + 2 + 3 + 4 and b"".join(map(bytes, parts)) == "aé€😀".encode()
    assert parts[1] == [0xC3] and parts[2] == [0xA9]


def test_sentencepiece_byte_fallback_tokens_give_their_byte():
    """Llama 2's kind: a character outside the vocabulary is written as <0xNN> tokens."""
    vocab = {"<unk>": 0, "▁": 1, "a": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    sp.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=sp)
    ids, parts = _bytes_of(tok, "aé")
    assert ids == [2, 3 + 0xC3, 3 + 0xA9] and parts == [[ord("a")], [0xC3], [0xA9]]


def test_whole_characters_and_the_char_tokenizer_give_their_text_in_utf8():
    tok = build_tokenizer()
    for i in range(len(tok)):
        text = tok.decode([i])
        assert token_bytes(tok, i, text) == list(text.encode())
    assert bytes(token_bytes(tok, tok.convert_tokens_to_ids("<|im_end|>"), "<|im_end|>")) == b"<|im_end|>"
    bpe = _byte_level_tokenizer()
    for i in bpe("a b\n", add_special_tokens=False)["input_ids"]:  # whole characters: their text
        assert token_bytes(bpe, i, bpe.decode([i])) == list(bpe.decode([i]).encode())
