"""The tokenizer every slime_lite module loads a checkpoint's tokenizer with, and the tiny model's own.

:func:`load_tokenizer` reads any checkpoint: the tiny model's character-level tokenizer (marked in its
tokenizer_config.json) with ``PreTrainedTokenizerFast``, since ``AutoTokenizer`` would pick Qwen2's for a qwen2
config, and any other with ``AutoTokenizer``. :func:`tokenizer_fingerprint` tells two processes whether they use
the same tokenizer. :func:`build_tokenizer` / :func:`save_tokenizer` make the character-level one.
:func:`token_bytes` gives a token's own bytes (OpenAI's log-prob ``bytes``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
SPECIAL_TOKENS = (EOS, "<|im_start|>", "<|im_end|>")
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
# Qwen's turn markers; an assistant message's tool calls follow its content in the Qwen/Hermes form,
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, without Qwen's newlines (a char-level model writes every
# character). ``tools`` is not rendered: the tiny model is warm-started on its one tool.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Marks a folder whose tokenizer is ours: load it with PreTrainedTokenizerFast, never AutoTokenizer.
CHAR_TOKENIZER_MARK = "slime_lite_char_tokenizer"


def _vocab() -> dict[str, int]:
    return {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + list(CHARS))}


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        CHAR_TOKENIZER_MARK: True,
        "eos_token": EOS,
        "pad_token": EOS,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": tok, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
    }


def build_tokenizer():
    """The character-level tokenizer: ids 0-2 are the special tokens (0 is eos and pad), then "\\n", then ASCII 32..126."""
    # tokenizers: only when one is built
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast  # transformers: only when a tokenizer loads

    tok = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token=None))
    tok.normalizer = normalizers.Replace(Regex(r"[^\n -~]"), "?")  # outside the vocab: "?" (never an error)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate characters, insert nothing
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, clean_up_tokenization_spaces=False,
        model_max_length=512, padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer, out_dir: str | os.PathLike) -> None:
    """Write tokenizer.json and a tokenizer_config.json that old and new transformers both read."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": EOS}, indent=2) + "\n"
    )


def is_char_tokenizer_dir(path: str | os.PathLike) -> bool:
    cfg = Path(path) / "tokenizer_config.json"
    if not cfg.is_file():
        return False
    try:
        return bool(json.loads(cfg.read_text()).get(CHAR_TOKENIZER_MARK))
    except (OSError, ValueError):
        return False


def load_tokenizer(path: str | os.PathLike):
    """Load any checkpoint's tokenizer: ours with PreTrainedTokenizerFast (AutoTokenizer would pick Qwen2's), else AutoTokenizer."""
    if is_char_tokenizer_dir(path):
        from transformers import PreTrainedTokenizerFast  # transformers: only when a tokenizer loads

        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        if not getattr(tok, "chat_template", None):
            tok.chat_template = CHAT_TEMPLATE
        return tok
    from transformers import AutoTokenizer  # transformers: only when a tokenizer loads

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short sha256 of the vocab and special tokens; equal for equal tokenizers in any process."""
    data = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "eos": tokenizer.eos_token,
        "pad": tokenizer.pad_token,
        "bos": tokenizer.bos_token,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def model_vocab_size(hf_checkpoint: str) -> int | None:
    """The embedding rows of the model (config.json's vocab_size): every token id must be below it."""
    with open(os.path.join(hf_checkpoint, "config.json"), encoding="utf-8") as f:
        value = json.load(f).get("vocab_size")
    return value if isinstance(value, int) and value > 0 else None


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte-level alphabet

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token: int, text: str) -> list[int]:
    """The bytes of one token, as OpenAI's log-probs give them (``bytes``, so that the tokens of one character join
    into it): ``text``, the token decoded alone, in UTF-8; but where that holds U+FFFD because the token is part of
    a character, the token's raw bytes: a byte-level BPE token (Qwen's, Llama 3's) mapped back from GPT-2's byte
    alphabet, a SentencePiece byte token ``<0xNN>`` (Llama 2's) read as its byte."""
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(int(token))
        if isinstance(piece, str) and piece:
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            if byte:
                return [int(byte.group(1), 16)]
            table = _byte_of_char()
            if all(c in table for c in piece):
                return [table[c] for c in piece]
    return list(text.encode())
