"""The tokenizer: character-level, one id per character, special tokens and chat template; any checkpoint loads."""

from __future__ import annotations

from slime_lite.tokenizer import build_tokenizer, load_tokenizer, tokenizer_fingerprint

TEXT = "Hello,  world!\n  12 + 34 = 46 \t~{}<|im_end|>x "


def test_tokenizer_round_trips_text_exactly_one_id_per_char():
    tok = build_tokenizer()
    plain = "a  b\n c~ 0"
    ids = tok.encode(plain, add_special_tokens=False)
    assert len(ids) == len(plain)
    assert tok.decode(ids) == plain
    assert tok.convert_ids_to_tokens(tok.encode("12+3=", add_special_tokens=False)) == list("12+3=")


def test_tokenizer_special_tokens_and_vocab():
    tok = build_tokenizer()
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "\n", " ", "~"]) == [1, 2, 3, 4, 98]
    assert len(tok) == 99
    ids = tok.encode("1<|im_end|>2", add_special_tokens=False)
    assert ids == [tok.convert_tokens_to_ids("1"), 2, tok.convert_tokens_to_ids("2")]
    assert tok.decode(ids, skip_special_tokens=True) == "12"


def test_characters_outside_the_vocab_become_question_marks():
    tok = build_tokenizer()
    assert tok.decode(tok.encode("3×4=é", add_special_tokens=False)) == "3?4=?"


def test_saved_tokenizer_loads_identically_with_chat_template(tiny_model_dir):
    built, loaded = build_tokenizer(), load_tokenizer(tiny_model_dir)
    ids = built.encode(TEXT, add_special_tokens=False)
    assert loaded.encode(TEXT, add_special_tokens=False) == ids
    assert loaded.decode(ids) == TEXT.replace("\t", "?")
    assert tokenizer_fingerprint(loaded) == tokenizer_fingerprint(built)
    chat = loaded.apply_chat_template(
        [{"role": "user", "content": "2 + 2="}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\n2 + 2=<|im_end|>\n<|im_start|>assistant\n"
    assert loaded.eos_token_id == 0 and loaded.pad_token_id == 0


def test_load_tokenizer_falls_back_to_autotokenizer_for_other_checkpoints(tmp_path):
    build_tokenizer().save_pretrained(str(tmp_path))  # transformers' own files, without our marker
    tok = load_tokenizer(tmp_path)
    assert tok.decode(tok.encode("12+3=", add_special_tokens=False)) == "12+3="
