"""How a generation ends, as SGLang ends it: stop strings, then stop token ids and eos (both ignored under
``ignore_eos``), then the length; the ``min_new_tokens`` ban; the text trimmed at a stop (``no_stop_trim``); a stop
string that spans a --partial-rollout resume, which the engine (as SGLang) does not see in the tokens of the current
request alone, ended by the rollout where one request ends it (rollout/resumed_stop.py).

Each case forces the tokens with ``logit_bias`` (greedy), so the finish does not depend on the random tiny model. The
tiny model's tokenizer: 0 is eos (``<|endoftext|>``), 2 is ``<|im_end|>`` (special), 40 is ``D``. Where SGLang's
wheel imports (tests/sglang_oracle.py), its own request object is fed the engine's tokens and must end the same."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
from engine_helpers import generate

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/sglang_oracle.py

EOS, IM_END, D = 0, 2, 40


def _forced(token: int, **sp) -> dict:
    return {"temperature": 0.0, "logit_bias": {str(token): 100.0}, **sp}


CASES = [  # (forced token, sampling params, finish_reason, output_ids)
    # eos (or a stop token) as the last allowed token is a stop, not a length finish
    (EOS, {"max_new_tokens": 1}, {"type": "stop", "matched": EOS}, [EOS]),
    (D, {"max_new_tokens": 1, "stop_token_ids": [D]}, {"type": "stop", "matched": D}, [D]),
    # ignore_eos ignores stop_token_ids as well; stop strings still apply
    (D, {"max_new_tokens": 3, "stop_token_ids": [D], "ignore_eos": True}, {"type": "length", "length": 3}, [D] * 3),
    (D, {"max_new_tokens": 3, "stop": "D", "ignore_eos": True}, {"type": "stop", "matched": "D"}, [D]),
    # a stop string beats a stop token matched by the same token
    (D, {"max_new_tokens": 3, "stop_token_ids": [D], "stop": ["D"]}, {"type": "stop", "matched": "D"}, [D]),
    # a stop string is matched on the text with special tokens, whatever skip_special_tokens says
    (IM_END, {"max_new_tokens": 4, "stop": "<|im_end|>"}, {"type": "stop", "matched": "<|im_end|>"}, [IM_END]),
]


@pytest.mark.parametrize("token,sp,reason,ids", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_finish_reasons_follow_sglangs_order(engine, token, sp, reason, ids):
    out = generate(engine.url, input_ids=[5, 6], sampling_params=_forced(token, **sp))
    assert out["meta_info"]["finish_reason"] == reason
    assert out["output_ids"] == ids
    _same_finish_in_sglang(_forced(token, **sp), out)


def _same_finish_in_sglang(sp: dict, out: dict) -> None:
    """SGLang's own request object (``Req.update_finish_state``), fed the engine's tokens one at a time, finishes at
    the same token with the same reason (skipped where the wheel does not import)."""
    from sglang_oracle import sglang_available, sglang_module

    if not sglang_available():
        return
    from array import array

    from slime_lite.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.additional_stop_token_ids = None
    params = sglang_module("sglang.srt.sampling.sampling_params").SamplingParams(
        **{k: v for k, v in sp.items() if k != "logit_bias"})
    params.normalize(tokenizer)
    req = sglang_module("sglang.srt.managers.schedule_batch").Req("r", "", array("q", [5, 6]), params,
                                                                  eos_token_ids={EOS}, vocab_size=128)
    req.tokenizer = tokenizer
    for i, token in enumerate(out["output_ids"]):
        req.output_ids.append(token)
        req.update_finish_state()
        assert (req.finished_reason is not None) == (i == len(out["output_ids"]) - 1), (i, out)
    assert req.finished_reason.to_json() == out["meta_info"]["finish_reason"]


def test_min_new_tokens_bans_eos_even_under_ignore_eos(engine):
    """SGLang's min_new_tokens penalizer bans the stop token ids and eos alike, ignore_eos or not."""
    out = generate(engine.url, input_ids=[5, 6], sampling_params=_forced(
        EOS, max_new_tokens=3, min_new_tokens=2, ignore_eos=True))
    assert EOS not in out["output_ids"][:2] and out["output_ids"][2] == EOS
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


@pytest.mark.parametrize("no_stop_trim,text", [(False, "<|"), (True, "<|im_")])
def test_text_ends_at_the_stop_string_inside_a_token(engine, no_stop_trim, text):
    """A stop string that ends inside a token's text: the text stops before it, or right after it with
    no_stop_trim (SGLang's detokenizer), not at the end of the token."""
    out = generate(engine.url, input_ids=[5, 6], sampling_params=_forced(
        IM_END, max_new_tokens=4, stop="im_", skip_special_tokens=False, no_stop_trim=no_stop_trim))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "im_"}
    assert out["output_ids"] == [IM_END] and out["text"] == text


@pytest.mark.parametrize("before,no_stop_trim", [(1, True), (2, True), (2, False)])
def test_a_stop_string_spanning_a_partial_rollout_resume_ends_the_response_as_one_request(
        engine, tiny_model_dir, before, no_stop_trim):
    """--partial-rollout: a sample aborted after ``before`` tokens is continued from its tokens, and the stop string
    "DDD" began before the abort. The engine matches stop strings in the tokens of the current request only (as
    SGLang), so the rollout (default_generate, a hook's path, and generate_group, its own) ends the response where
    one uninterrupted request ends it: the same tokens, text, finish, and one log-prob, loss-mask entry and weight
    version per token."""
    import asyncio
    from types import SimpleNamespace

    from slime_lite.engine_client import AsyncEngineClient
    from slime_lite.rollout.generate import default_generate, generate_group
    from slime_lite.types import TOKEN_VERSIONS, Sample, Status

    params = _forced(D, max_new_tokens=6, stop=["DDD"], skip_special_tokens=False, no_stop_trim=no_stop_trim)

    async def run() -> tuple[Sample, list[Sample]]:
        client = AsyncEngineClient([engine.url])
        args = SimpleNamespace(engine_client=client, use_rollout_routing_replay=False,
                               hf_checkpoint=str(tiny_model_dir))
        try:
            whole = await default_generate(args, Sample(index=0, tokens=[5, 6]), params)
            part = await default_generate(args, Sample(index=1, tokens=[5, 6]), dict(params, max_new_tokens=before))
            assert part.tokens == [5, 6] + [D] * before
            part.status = Status.ABORTED  # what an abort after those tokens leaves (finish "abort")
            again = copy.deepcopy(part)
            return whole, [await default_generate(args, part, params), *await generate_group(args, [again], [params])]
        finally:
            await client.close()

    whole, resumed = asyncio.run(run())
    assert whole.tokens == [5, 6, D, D, D] and whole.status is Status.COMPLETED
    assert whole.response == ("DDD" if no_stop_trim else "") and len(whole.metadata[TOKEN_VERSIONS]) == 3
    for s in resumed:
        assert s.tokens == whole.tokens and s.response_length == 3
        assert s.response == whole.response and s.status is Status.COMPLETED
        assert s.loss_mask == [1] * 3 and s.rollout_log_probs == pytest.approx(whole.rollout_log_probs)
        assert s.metadata[TOKEN_VERSIONS] == whole.metadata[TOKEN_VERSIONS]


def test_a_resumed_stop_cuts_every_per_token_field_of_the_engine_result(tiny_model_dir):
    """The cut at a stop string spanning a resume drops the later tokens' log-probs, weight versions and routed
    experts (SGLang's table: one row per position fed but the last), whichever stop string of the list matched; a
    continued response with no stop string across the resume is kept as the engine gave it."""
    import asyncio
    import base64
    from types import SimpleNamespace

    import torch

    from slime_lite.rollout.generate import default_generate
    from slime_lite.types import TOKEN_VERSIONS, Sample, Status

    class Engine:  # FAKE engine client: three tokens "DDD" after the input [5, 6, D], no stop string matched
        async def generate(self, body):
            rows = len(body["input_ids"]) + 3 - 1
            table = torch.arange(rows * 2, dtype=torch.int32).numpy().tobytes()  # [rows, 1 layer, top_k 2]
            return {"text": "DDD", "output_ids": [D] * 3, "meta_info": {
                "finish_reason": {"type": "length", "length": 3}, "weight_version": "4",
                "output_token_logprobs": [[-0.5, D, None]] * 3, "output_token_weight_versions": ["4"] * 3,
                "routed_experts": base64.b64encode(table).decode()}}

    def carried() -> Sample:  # aborted after one token "D"
        return Sample(index=0, tokens=[5, 6, D], response="D", response_length=1, rollout_log_probs=[-0.1],
                      loss_mask=[1], status=Status.ABORTED, weight_versions=["3"], metadata={TOKEN_VERSIONS: [3]})

    args = SimpleNamespace(engine_client=Engine(), use_rollout_routing_replay=True, hf_checkpoint=str(tiny_model_dir))
    kept = asyncio.run(default_generate(args, carried(), {"max_new_tokens": 4, "stop": "zz"}))
    assert kept.tokens == [5, 6] + [D] * 4 and kept.response == "DDDD" and kept.status is Status.TRUNCATED
    assert kept.metadata[TOKEN_VERSIONS] == [3, 4, 4, 4] and len(kept.rollout_routed_experts) == 5 * 2
    sample = asyncio.run(default_generate(args, carried(), {"max_new_tokens": 4, "stop": ["zz", "DDD"],
                                                            "no_stop_trim": True}))
    assert sample.tokens == [5, 6, D, D, D] and sample.response == "DDD" and sample.status is Status.COMPLETED
    assert sample.rollout_log_probs == [-0.1, -0.5, -0.5] and sample.loss_mask == [1, 1, 1]
    assert sample.metadata[TOKEN_VERSIONS] == [3, 4, 4] and sample.weight_versions == ["3", "4"]
    assert sample.rollout_routed_experts.tolist() == list(range((len(sample.tokens) - 1) * 2))
    late = Engine()  # a push landed after the token that completes the stop: the request's version is the kept one's
    late.generate = lambda body, gen=late.generate: _pushed_late(gen(body))
    args.engine_client = late
    sample = asyncio.run(default_generate(args, carried(), {"max_new_tokens": 4, "stop": "DDD"}))
    assert sample.metadata[TOKEN_VERSIONS] == [3, 4, 4] and sample.weight_versions == ["3", "4"]


async def _pushed_late(result):
    out = await result
    out["meta_info"].update(weight_version="5", output_token_weight_versions=["4", "4", "5"])
    return out
