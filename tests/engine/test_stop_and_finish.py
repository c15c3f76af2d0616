"""How a generation ends, as SGLang ends it: stop strings, then stop token ids and eos (both ignored under
``ignore_eos``), then the length; the ``min_new_tokens`` ban; the text trimmed at a stop (``no_stop_trim``).

Each case forces the tokens with ``logit_bias`` (greedy), so the finish does not depend on the random tiny model. The
tiny model's tokenizer: 0 is eos (``<|endoftext|>``), 2 is ``<|im_end|>`` (special), 40 is ``D``. Where SGLang's
wheel imports (tests/sglang_oracle.py), its own request object is fed the engine's tokens and must end the same."""

from __future__ import annotations

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
