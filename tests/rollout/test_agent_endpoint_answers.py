"""The agent endpoint reads each engine answer right: the content and the trained turn from the engine's tokens, an
unreadable answer an engine failure that uses up no call, a stop token the next message's role tag (GLM's templates)
trained once, and request fields it cannot honour refused. The engine's own OpenAI route streams no part of a stop
string. The engines here are ``ScriptedEngine`` fakes of /generate (the tiny random model writes no tool calls)."""

from __future__ import annotations

import aiohttp

from slime_lite.engine.openai_api import _stream_delta
from slime_lite.rollout.drift import token_drift
from slime_lite.tokenizer import build_tokenizer
from slime_lite.types import Status
from tests.rollout.test_agent_endpoint import CALC, ScriptedEngine, _client, run_agent

USER = [{"role": "user", "content": "a"}]


async def _post(base_url: str, body: dict, answers: list) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(base_url + "/chat/completions", json=body) as resp:
            answers.append((resp.status, await resp.json()))


def test_a_stop_token_is_taken_off_the_content_once():
    """--rollout-stop-token-ids with an ordinary token ("."): the model wrote "Wait.." and stopped on "."; the agent
    gets "Wait..", not every trailing dot stripped."""
    tok, seen = build_tokenizer(), []
    dot = tok.convert_tokens_to_ids(".")

    async def agent(base_url, task):
        reply = await _client(base_url).chat.completions.create(model="m", messages=USER)
        seen.append(reply.choices[0].message.content)

    run_agent([("Wait...", {"type": "stop", "matched": dot})], agent,
              {"temperature": 1.0, "max_new_tokens": 50, "stop_token_ids": [dot]})
    assert seen == ["Wait.."]


def test_an_answer_that_cannot_be_read_is_a_502_and_uses_up_no_call():
    """A NaN log-prob (JSON's null) in the engine's answer: a 502 naming it, not a bare 500, and the call is not
    counted against --max-turns (a retry used to find the trajectory's calls spent)."""
    answers: list = []

    class NaNFirst(ScriptedEngine):
        async def generate(self, body):
            out = await super().generate(body)
            if len(self.seen) == 1:
                out["meta_info"]["output_token_logprobs"][0][0] = None
            return out

    import tests.rollout.test_agent_endpoint as scripted

    real, scripted.ScriptedEngine = scripted.ScriptedEngine, NaNFirst

    async def agent(base_url, task):
        for _ in range(2):
            await _post(base_url, {"messages": USER}, answers)

    try:
        sample = run_agent(["x<|im_end|>", "y<|im_end|>"], agent, max_turns=1)
    finally:
        scripted.ScriptedEngine = real
    assert [status for status, _ in answers] == [502, 200]
    assert "could not be read" in answers[0][1]["error"]["message"] and "NaN" in answers[0][1]["error"]["message"]
    assert sample.status == Status.COMPLETED and sample.metadata["agent_calls"] == 1


def test_a_stop_string_ending_inside_a_token_trains_the_tokens_text():
    """The engine cuts its text right after a stop string that ends inside a token (no_stop_trim) but returns the
    whole token: the turn's recorded text is its tokens' (no false token drift under --ci-test), while the agent's
    content ends before the stop string."""
    tok, seen = build_tokenizer(), []
    ids = tok("ab<|im_end|>", add_special_tokens=False)["input_ids"]

    class CutText(ScriptedEngine):
        async def generate(self, body):
            out = await super().generate(body)
            out["text"] = "ab<|im_e"  # as the engine cuts at the stop string "<|im_e"
            return out

    import tests.rollout.test_agent_endpoint as scripted

    real, scripted.ScriptedEngine = scripted.ScriptedEngine, CutText

    async def agent(base_url, task):
        reply = await _client(base_url).chat.completions.create(model="m", messages=USER, stop=["<|im_e"])
        seen.append(reply.choices[0].message.content)

    try:
        sample = run_agent([("ab<|im_end|>", {"type": "stop", "matched": "<|im_e"})], agent)
    finally:
        scripted.ScriptedEngine = real
    assert seen == ["ab"]
    assert sample.tokens[-sample.response_length:] == ids
    assert sample.metadata["turns"][-1]["text"] == tok.decode(ids) and token_drift(sample, tok) is None


GLM_LIKE = (  # a template that closes no turn: the next message's role tag opens it (GLM-4.x)
    "{% for m in messages %}{% if m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content }}{% for tc in m.tool_calls or [] %}"
    "<tool_call>{{ tc.function | tojson }}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|>{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_the_role_tag_the_model_stopped_on_is_not_inserted_again():
    """GLM's templates close no turn: the model stops on the next message's role tag (<|observation|>, one of its
    end-of-sequence ids), which the template then writes to open the tool message. The engine is sent, and the
    sample trains, that tag once, as the template gives the conversation."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|observation|>"]})
    tok.chat_template = GLM_LIKE
    obs = tok.convert_tokens_to_ids("<|observation|>")
    messages = list(USER)

    async def agent(base_url, task):
        client = _client(base_url)
        reply = (await client.chat.completions.create(model="m", messages=messages)).choices[0].message
        messages.extend([reply.model_dump(exclude_none=True), {"role": "tool", "content": "6"}])
        await client.chat.completions.create(model="m", messages=messages)

    box: dict = {}
    sample = run_agent([("x<|observation|>", {"type": "stop", "matched": obs}), "It is 6.<|user|>"], agent,
                       chat_template=GLM_LIKE, engine_box=box, tokenizer=tok)
    second = tok.decode(box["engine"].seen[1]["input_ids"])
    assert second.count("<|observation|>") == 1 and second.endswith("x<|observation|>6<|assistant|>\n"), second
    assert tok.decode(sample.tokens) == tok.apply_chat_template(messages, tokenize=False,
                                                                add_generation_prompt=True) + "It is 6.<|user|>"


def test_fields_the_endpoint_cannot_honour_are_400s_naming_them():
    """Constrained output (response_format) would come back unconstrained and fail the client's own parsing; the
    deprecated function-calling fields would be ignored: each is refused, naming the field and what to send."""
    answers: list = []

    async def agent(base_url, task):
        for extra in ({"response_format": {"type": "json_object"}}, {"functions": [CALC["function"]]},
                      {"function_call": "auto"}, {"response_format": {"type": "text"}}):
            await _post(base_url, {"messages": USER, **extra}, answers)

    sample = run_agent(["x<|im_end|>"], agent)
    assert [status for status, _ in answers] == [400, 400, 400, 200]
    for (_, body), field in zip(answers, ("response_format", "functions", "function_call")):
        assert body["error"]["message"].startswith(field), body
    assert sample.metadata["agent_calls"] == 1


def test_a_stream_holds_back_text_that_may_begin_a_stop_string():
    """The engine's OpenAI route streams the text before a stop string only: an end that begins one waits for the
    next token (SGLang's), and goes out when the text turns out otherwise."""
    stops = ["hhh", "</ans>"]
    assert _stream_delta("", "7hh", False, stops) == ("7", "7")
    assert _stream_delta("7", "7hh</a", False, stops) == ("hh", "7hh")
    assert _stream_delta("7hh", "7hh</ax", False, stops) == ("</ax", "7hh</ax")
    assert _stream_delta("7", "7", True, stops) == ("", "7")  # finished at the stop string: nothing of it
    assert _stream_delta("", "7hh", True, stops) == ("7hh", "7hh")  # finished otherwise: all of it


def test_a_call_continuing_a_branch_gets_the_budget_its_samples_leave():
    """A call P, two branches from its reply (the first to finish continues P's sample, the other starts one of its
    own), then a call continuing the second: it may write the budget less the response tokens the samples hold,
    not less P's reply twice and the branch's prompt (a best-of-n or tree-search agent was cut short)."""
    import asyncio

    class SlowC(ScriptedEngine):
        async def generate(self, body):
            if self.tok.decode(body["input_ids"]).endswith("user\nc<|im_end|>\n<|im_start|>assistant\n"):
                await asyncio.sleep(0.2)  # branch "c" finishes second
            return await super().generate(body)

    async def agent(base_url, task):
        client = _client(base_url)
        history = list(USER)
        history.append((await client.chat.completions.create(model="m", messages=history)).choices[0].message)
        _, second = await asyncio.gather(*(client.chat.completions.create(
            model="m", messages=history + [{"role": "user", "content": q}]) for q in ("b", "c")))
        await client.chat.completions.create(model="m", messages=history + [
            {"role": "user", "content": "c"}, second.choices[0].message, {"role": "user", "content": "d"}])

    import tests.rollout.test_agent_endpoint as scripted

    real, scripted.ScriptedEngine = scripted.ScriptedEngine, SlowC
    box: dict = {}
    try:
        samples = run_agent(["P" * 40 + "<|im_end|>", "A<|im_end|>", "B<|im_end|>", "C<|im_end|>"], agent,
                            {"temperature": 1.0, "max_new_tokens": 1000}, engine_box=box)
    finally:
        scripted.ScriptedEngine = real
    last = box["engine"].seen[-1]
    written = len(build_tokenizer()("C<|im_end|>", add_special_tokens=False)["input_ids"])
    assert len(samples) == 2
    assert last["sampling_params"]["max_new_tokens"] == 1000 - (sum(s.response_length for s in samples) - written)


def _byte_level_tokenizer():
    """A byte-level BPE tokenizer (Qwen's and Llama 3's kind: a character may take several tokens, each decoding
    alone to U+FFFD), with no merges, ChatML's turn tokens and the tiny model's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from slime_lite.tokenizer import CHAT_TEMPLATE, EOS

    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_log_prob_bytes_of_a_characters_tokens_join_into_the_character():
    """OpenAI's ``bytes`` are there so that the tokens of one character join into it: "é" is 2 byte-level tokens and
    "€" 3, each decoding alone to U+FFFD; their bytes are the raw ones, not U+FFFD's."""
    tok, seen = _byte_level_tokenizer(), []

    async def agent(base_url, task):
        reply = await _client(base_url).chat.completions.create(model="m", messages=USER, logprobs=True)
        seen.append(reply.choices[0])

    run_agent(["é€!<|im_end|>"], agent, tokenizer=tok)
    entries = seen[0].logprobs.content
    assert seen[0].message.content == "é€!" and len(entries) == 2 + 3 + 1 + 1
    assert [e.token for e in entries[:5]] == ["\ufffd"] * 5  # the token's text, as SGLang gives it
    assert bytes(b for e in entries for b in e.bytes) == "é€!<|im_end|>".encode()
