"""--partial-rollout: a sample aborted between two byte-level tokens of one character is continued from its tokens;
its response text is the whole response's decode (what one uninterrupted request returns), not the text before the
abort plus the engine's text of the new tokens (two U+FFFD where the character was). Rewards read that text.

The engine is a FAKE client answering as the embedded engine's /generate does (``text``: the decode of the
request's output ids, cut before a matched stop string without ``no_stop_trim``); the tokenizer is a real byte-level
BPE (as Qwen's and Llama 3's), built here and loaded from disk as the rollout loads ``--hf-checkpoint``'s."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import pytest

ANSWER = "答案是 √2"  # each CJK character and the root sign: three byte tokens of this tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["the answer is 42"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]))
    path = tmp_path_factory.mktemp("bytebpe")
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.mark.parametrize("no_stop_trim", [True, False])
def test_a_character_split_by_the_abort_is_whole_in_the_continued_response(tok_dir, no_stop_trim):
    from slime_lite.rollout.generate import generate_group
    from slime_lite.tokenizer import load_tokenizer
    from slime_lite.types import Status

    tok = load_tokenizer(str(tok_dir))
    prompt = tok("Q: ", add_special_tokens=False)["input_ids"]
    full = tok(ANSWER + "!", add_special_tokens=False)["input_ids"]
    assert tok.decode(full[:2]).endswith("\ufffd")  # the abort below falls inside the first character

    class Engine:  # FAKE: the first request is aborted after 2 tokens, the continuation runs to the end
        calls = 0

        async def generate(self, body):
            outs = []
            for ids, sp in zip(body["input_ids"], body["sampling_params"]):
                have = len(ids) - len(prompt)
                out = full[have:2] if Engine.calls == 0 else full[have:]
                text = tok.decode(out)
                if Engine.calls and not sp.get("no_stop_trim"):  # the matched stop string "!" cut from the text
                    text = text[:text.rindex("!")]
                finish = {"type": "abort"} if Engine.calls == 0 else {"type": "stop", "matched": "!"}
                outs.append({"text": text, "output_ids": out, "meta_info": {
                    "finish_reason": finish, "weight_version": str(Engine.calls),
                    "output_token_logprobs": [[-0.1, t, None] for t in out]}})
            Engine.calls += 1
            return outs

    from slime_lite.types import Sample

    args = SimpleNamespace(engine_client=Engine(), use_rollout_routing_replay=False, hf_checkpoint=str(tok_dir))
    params = {"max_new_tokens": 64, "stop": ["!"], "skip_special_tokens": False, "no_stop_trim": no_stop_trim}
    sample = Sample(index=0, tokens=list(prompt))
    asyncio.run(generate_group(args, [sample], [copy.deepcopy(params)]))
    assert sample.status is Status.ABORTED and sample.response == "\ufffd"
    asyncio.run(generate_group(args, [sample], [copy.deepcopy(params)]))
    assert sample.status is Status.COMPLETED and sample.tokens == prompt + full
    assert sample.response == (ANSWER + "!" if no_stop_trim else ANSWER)
