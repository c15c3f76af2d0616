"""SGLang API parity of the embedded engine (issue 14 item 5): the prefix cache (cached_tokens, same results with and
without a hit, flush, eviction), top / token-id / prompt log-probs in SGLang's shapes, logit_bias,
``max_new_tokens: null``, a 400 for every field it does not implement, and the load and info routes slime reads."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import generate, http, in_thread

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/sglang_oracle.py

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _hf_logp(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)`` at every position of one HF forward of ``ids``: row j predicts token j + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, dim=-1)


def _lps(out) -> list[float]:
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


# ---- prefix cache ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [GREEDY, {"temperature": 0.9, "sampling_seed": 11, "ignore_eos": True}])
def test_a_prefix_cache_hit_gives_the_same_tokens_and_logprobs(engine, sampling):
    """float32 on CPU: a prompt whose K/V comes from the cache decodes exactly as one prefilled in full."""
    url = engine.url
    prompt = [60 + (i * 7) % 50 for i in range(40)]
    body = {"input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 12, **sampling}}
    assert http(url, "/flush_cache", {})[0] == 200  # POST
    cold = generate(url, **body)
    warm = generate(url, **body)
    assert cold["meta_info"]["cached_tokens"] == 0 and warm["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert warm["output_ids"] == cold["output_ids"]
    assert max(abs(a - b) for a, b in zip(_lps(warm), _lps(cold))) < 1e-5
    # a prompt that shares only its beginning reuses that much, and matches a cold run of itself
    other = prompt[:25] + [3, 4, 5, 6]
    part = generate(url, **{**body, "input_ids": other})
    assert part["meta_info"]["cached_tokens"] == 25
    # it took an empty slot with a copy of those 25 positions: the first prompt's K/V is still whole and right
    again = generate(url, **body)
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1 and again["output_ids"] == cold["output_ids"]
    assert max(abs(a - b) for a, b in zip(_lps(again), _lps(cold))) < 1e-5
    assert http(url, "/flush_cache")[0] == 200  # GET (slime's method)
    ref = generate(url, **{**body, "input_ids": other})
    assert ref["meta_info"]["cached_tokens"] == 0 and ref["output_ids"] == part["output_ids"]
    assert max(abs(a - b) for a, b in zip(_lps(part), _lps(ref))) < 1e-5
    info = http(url, "/get_server_info")[1]
    assert info["disable_radix_cache"] is False and info["prefix_cache"]["hits"] >= 1


def test_prompt_logprobs_are_of_the_raw_logits_whatever_the_temperature(engine, hf_model):
    """SGLang's prompt log-probs take neither the request's temperature nor its logit_bias (its output tokens'
    take both): they were divided by the temperature here."""
    prompt = [40 + i for i in range(12)]
    ref = _hf_logp(hf_model, prompt)
    for sp in ({"temperature": 0.5}, {"temperature": 1.7, "logit_bias": {"45": 3.0}}, {"temperature": 0}):
        out = generate(engine.url, input_ids=prompt, return_logprob=True, logprob_start_len=0,
                       sampling_params={"max_new_tokens": 1, **sp})
        triples = out["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in triples] == prompt and triples[0][0] is None
        assert max(abs(t[0] - ref[j - 1, prompt[j]].item()) for j, t in enumerate(triples) if j) < 1e-5


def test_prompt_logprobs_limit_the_reuse_and_match_a_cold_run(engine, hf_model):
    url = engine.url
    prompt = [30 + i for i in range(20)]
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 6,
            "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    http(url, "/flush_cache", {})
    generate(url, input_ids=prompt, sampling_params={"max_new_tokens": 1})  # caches 19 tokens of it
    out = generate(url, **body)
    assert out["meta_info"]["cached_tokens"] == 6  # K/V reused up to where prompt log-probs start
    triples = out["meta_info"]["input_token_logprobs"]
    ref = _hf_logp(hf_model, prompt)
    assert [t[1] for t in triples] == prompt[6:] and triples[0][0] is None
    assert max(abs(t[0] - ref[j - 1, prompt[j]].item()) for j, t in zip(range(7, 20), triples[1:])) < 1e-5


def test_the_least_recently_used_prefix_is_evicted_when_every_slot_holds_one(engine):
    url, slots = engine.url, engine.scheduler.max_running
    prompts = [[100 + i, 5, 6, 7, 8] for i in range(slots + 1)]
    for p in prompts:
        generate(url, input_ids=p, sampling_params={"max_new_tokens": 2})
    # one more prompt than slots: the first one's K/V made room for the last; the second one is still cached
    assert generate(url, input_ids=prompts[1], sampling_params={"max_new_tokens": 1})["meta_info"]["cached_tokens"] == 4
    assert generate(url, input_ids=prompts[0], sampling_params={"max_new_tokens": 1})["meta_info"]["cached_tokens"] == 0


def test_prefix_cache_unit_lru_and_weight_version():
    from slime_lite.engine.prefix_cache import PrefixCache

    version = [0]
    cache = PrefixCache(lambda: version[0])
    cache.release(0, [1, 2, 3, 4])
    cache.release(1, [1, 2, 9])
    assert cache.match([0, 1, 2], [1, 2, 3, 4, 5], limit=10) == (0, 4, 0)
    assert cache.match([0, 1], [1, 2, 3, 4, 5], limit=2) == (0, 2, 0)  # none empty: written over after 2
    assert cache.match([0, 1, 2], [7], limit=0) == (2, 0, 2)  # no match: a slot that holds nothing
    assert cache.match([0, 1], [7], limit=0) == (0, 0, 0)  # none empty: the least recently used
    version[0] += 1  # a weight update
    assert cache.match([0, 1, 2], [1, 2, 3, 4, 5], limit=10)[1] == 0 and len(cache) == 0
    off = PrefixCache(lambda: 0, enabled=False)
    off.release(0, [1, 2])
    assert off.match([0], [1, 2], limit=1) == (0, 0, 0)


def test_a_match_that_would_overwrite_cached_tokens_copies_them_into_an_empty_slot():
    from slime_lite.engine.prefix_cache import PrefixCache

    cache = PrefixCache(lambda: 0)
    conversation = [1] + list(range(2, 100))  # a long cached conversation; a new prompt shares its first token
    cache.release(0, conversation)
    assert cache.match([0, 1, 2], [1, 500, 501], limit=10) == (1, 1, 0)  # copy position 0 from slot 0 to slot 1
    assert cache.match([0], [1, 500, 501], limit=10) == (0, 1, 0)  # no empty slot: written over in place
    assert cache.match([0, 1], conversation + [7, 8], limit=200) == (0, 99, 0)  # reuses all it holds: in place
    # no empty slot: the least recently used entry is given up, not the matched conversation's tail (a new agent
    # trajectory that shares only the system prompt with a conversation waiting on a tool call keeps that one cached)
    cache = PrefixCache(lambda: 0)
    cache.release(1, [3, 4, 5])  # older
    cache.release(0, conversation)
    assert cache.match([0, 1], [1, 500, 501], limit=10) == (1, 1, 0)  # copy position 0 into slot 1
    cache.release(2, [6])  # after the fork's use of slot 0
    assert cache.match([0, 2], [1, 500], limit=10) == (0, 1, 0)  # slot 0 is the least recently used: in place


# ---- log-probs -------------------------------------------------------------------------------------------------
def test_top_logprobs_and_token_ids_logprob_in_sglang_shapes(engine, hf_model):
    prompt, ids = [11, 12, 13, 14, 15, 16], [3, 40, 7]
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 4, "token_ids_logprob": ids,
            "logprob_start_len": 0, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0.7, "sampling_seed": 3, "ignore_eos": True}}
    out = generate(engine.url, **body)
    meta = out["meta_info"]
    logp = _hf_logp(hf_model, prompt + out["output_ids"], 0.7)
    n = len(prompt)
    tops, tids = meta["output_top_logprobs"], meta["output_token_ids_logprobs"]
    assert len(tops) == len(tids) == len(out["output_ids"]) == meta["output_token_logprobs_length"] == 5
    for k, (top, tid) in enumerate(zip(tops, tids)):
        row = logp[n - 1 + k]
        vals, best = row.topk(4)
        assert [t[1] for t in top] == best.tolist()
        assert max(abs(t[0] - v) for t, v in zip(top, vals.tolist())) < 1e-5
        assert [t[1] for t in tid] == ids and max(abs(t[0] - row[i].item()) for t, i in zip(tid, ids)) < 1e-5
        assert top[0][2] == engine.scheduler.decode([top[0][1]], False)  # [logprob, token_id, text]
    itop, iids = meta["input_top_logprobs"], meta["input_token_ids_logprobs"]
    assert len(itop) == len(iids) == len(meta["input_token_logprobs"]) == n
    assert itop[0] is None and iids[0] is None and meta["input_token_logprobs"][0][0] is None
    assert [t[1] for t in itop[2]] == logp[1].topk(4).indices.tolist()
    try:  # the body is one SGLang's own /generate accepts
        from sglang_oracle import sglang_available, validate_generate

        if sglang_available():
            validate_generate(body)
    except ImportError:
        pass


def test_logprob_start_len_conventions(engine):
    url, prompt = engine.url, [21, 22, 23, 24, 25]
    sp = {"max_new_tokens": 1, **GREEDY}
    default = generate(url, input_ids=prompt, return_logprob=True, sampling_params=sp)["meta_info"]
    assert default["input_token_logprobs"] == []  # -1: none of the prompt
    with_ids = generate(url, input_ids=prompt, return_logprob=True, token_ids_logprob=[1], sampling_params=sp)
    assert with_ids["meta_info"]["input_token_logprobs"] == [[None, 25, None]]  # -1 with token ids: the last
    last = generate(url, input_ids=prompt, return_logprob=True, logprob_start_len=5, sampling_params=sp)
    assert last["meta_info"]["input_token_logprobs"] == []
    status, err = http(url, "/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 6})
    assert status == 400 and "logprob_start_len" in err["error"]["message"]
    # an empty token_ids_logprob is SGLang's "not given": no token-id lists, none of the prompt
    empty = generate(url, input_ids=prompt, return_logprob=True, token_ids_logprob=[], sampling_params=sp)["meta_info"]
    assert empty["input_token_logprobs"] == [] and "output_token_ids_logprobs" not in empty


def test_logit_bias_moves_the_sampled_token_and_its_logprob(engine):
    url, prompt = engine.url, [50, 51, 52]
    plain = generate(url, input_ids=prompt, return_logprob=True, sampling_params={"max_new_tokens": 4, **GREEDY})
    forced = generate(url, input_ids=prompt, return_logprob=True,
                      sampling_params={"max_new_tokens": 4, "logit_bias": {"9": 100.0}, **GREEDY})
    assert forced["output_ids"] == [9] * 4 != plain["output_ids"]
    assert all(lp > -1e-3 for lp in _lps(forced))  # the bias is part of the distribution the log-prob is of
    banned = plain["output_ids"][0]
    out = generate(url, input_ids=prompt, sampling_params={"max_new_tokens": 1, "logit_bias": {str(banned): -1e9},
                                                            **GREEDY})
    assert out["output_ids"][0] != banned
    status, err = http(url, "/generate", {"input_ids": prompt, "sampling_params": {"logit_bias": {"99999": 1}}})
    assert status == 400 and "logit_bias" in err["error"]["message"]


def test_max_new_tokens_null_runs_to_the_context_limit(engine):
    sch = engine.scheduler  # SGLang's bound: input + output <= context - 2 (and the batch slot holds them)
    prompt = [7] * (min(sch.context_len - 2, sch.slot_len + 1) - 5)  # a long prompt: 5 tokens to the limit
    out = generate(engine.url, input_ids=prompt, sampling_params={"max_new_tokens": None, **GREEDY})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    from slime_lite.engine.sampling import SamplingParams

    assert SamplingParams.from_dict({}).max_new_tokens == 128  # absent (not null): SGLang's default


# ---- loud differences ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,field", [
    ({"image_data": "http://x/y.png"}, "image_data"), ({"lora_path": "adapter"}, "lora_path"),
    ({"return_routed_experts": True}, "return_routed_experts"), ({"return_hidden_states": True}, "return_hidden_states"),
    ({"custom_logit_processor": "x"}, "custom_logit_processor"), ({"session_params": {"id": "s"}}, "session_params"),
    ({"input_embeds": [[0.1]]}, "input_embeds"), ({"no_such_field": 1}, "no_such_field"),
    ({"sampling_params": {"json_schema": "{}"}}, "json_schema"), ({"sampling_params": {"custom_params": {}}}, "custom_params"),
])
def test_unimplemented_fields_are_a_400_naming_them(engine, extra, field):
    status, out = http(engine.url, "/generate", {"input_ids": [1, 2], **extra})
    assert status == 400 and field in out["error"]["message"], out


def test_fields_at_their_default_are_accepted(engine):
    body = {"input_ids": [1, 2], "image_data": None, "lora_path": None, "return_routed_experts": False,
            "return_hidden_states": False, "log_metrics": True, "routed_experts_start_len": 0,
            "sampling_params": {"max_new_tokens": 1}}
    assert generate(engine.url, **body)["output_ids"]


@pytest.mark.parametrize("extra,field", [
    ({"return_routed_experts": "yes"}, "return_routed_experts='yes' must be true or false"),
    ({"return_routed_experts": 2}, "return_routed_experts=2"),
    ({"return_routed_experts": True, "routed_experts_start_len": 1.5}, "routed_experts_start_len=1.5 must be an "
                                                                         "integer"),
])
def test_a_wrong_type_in_the_routed_experts_fields_is_a_400_not_a_500(engine, extra, field):
    status, out = http(engine.url, "/generate", {"input_ids": [1, 2], **extra})
    assert status == 400 and field in out["error"]["message"], (status, out)


# ---- load and info routes --------------------------------------------------------------------------------------
def _num_requests(load) -> int:
    """slime's reading of /v1/loads (slime/backends/sglang_utils/server_control.py)."""
    if isinstance(load, list):
        return sum(_num_requests(x) for x in load)
    if "loads" in load:
        return _num_requests(load["loads"])
    return load.get("num_running_reqs", 0) + load.get("num_waiting_reqs", 0)


def test_loads_get_load_and_server_info_fields_slime_reads(engine):
    url = engine.url
    t, _ = in_thread(generate, url, input_ids=[1, 2], sampling_params={"max_new_tokens": 400, **GREEDY})
    deadline = time.monotonic() + 10
    while not engine.scheduler.num_running:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    busy = http(url, "/v1/loads?include=core")[1]
    legacy = http(url, "/get_load")[1]
    http(url, "/abort_request", {"abort_all": True})
    t.join(30)
    assert _num_requests(busy) == 1 and legacy[0]["num_reqs"] == 1 and legacy[0]["dp_rank"] == 0
    assert _num_requests(http(url, "/v1/loads")[1]) == 0
    assert http(url, "/v1/loads?include=nope")[0] == 400
    info = http(url, "/get_server_info")[1]
    for key, value in {"tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "disaggregation_mode": "null",
                       "encoder_only": False, "enable_return_routed_experts": False, "dtype": "float32",
                       "enable_memory_saver": False}.items():
        assert info[key] == value, key


def test_deterministic_mode_turns_the_prefix_cache_off(tiny_model_dir, monkeypatch):
    """A hit depends on timing (which slots are free) and sums a prefill in another order: a --deterministic-mode
    run's engines start without the cache, and only because of the flag (torch's process-wide deterministic
    setting, which CPU train workers turn on, leaves an engine's cache alone)."""
    from slime_lite.args import parser_defaults
    from slime_lite.engine import server
    from slime_lite.engine.scheduler import Scheduler
    from slime_lite.rollout import engines
    from slime_lite.rollout.engines import EngineActor

    monkeypatch.setattr(engines, "set_deterministic", lambda: None)  # leave this test process's torch alone
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    made = []

    class Recorder:  # a stand-in for the server: records how the engine actor builds it
        def __init__(self, *a, **kw):
            made.append(kw)

        def start(self):
            return "http://127.0.0.1:1"

    monkeypatch.setattr(server, "EngineServer", Recorder)
    for flag in (True, False):
        EngineActor(parser_defaults(hf_checkpoint=str(tiny_model_dir), deterministic_mode=flag), 0, "/tmp/p").start()
    assert [kw["disable_radix_cache"] for kw in made] == [True, False]
    assert {kw["profile_dir"] for kw in made} == {"/tmp/p"}
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert Scheduler(str(tiny_model_dir), device="cpu", max_running_requests=2).prefix.enabled


def test_a_turn_end_token_sglang_stops_on_ends_a_request_and_is_banned_below_min_new_tokens(tiny_model_dir, tmp_path):
    """A tokenizer with Llama 3's <|eom_id|> among its added tokens, not named as eos: SGLang stops on it
    (attach_additional_stop_token_ids, asked of SGLang's own module where it imports) and bans it below
    min_new_tokens; this engine ran past it."""
    import shutil

    from engine_helpers import start_engine
    from transformers import AutoTokenizer

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"additional_special_tokens": ["<|eom_id|>"]})
    tok.save_pretrained(model)
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    from sglang_oracle import sglang_available, sglang_module

    if sglang_available():
        sglang_module("sglang.srt.utils.hf_transformers.common").attach_additional_stop_token_ids(tok)
        assert tok.additional_stop_token_ids == {eom}
    server = start_engine(model, max_running_requests=2)
    try:
        forced = {"temperature": 0.0, "logit_bias": {str(eom): 100.0}}
        out = generate(server.url, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, **forced})
        assert out["output_ids"] == [eom] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eom}
        out = generate(server.url, input_ids=[5, 6, 7],
                       sampling_params={"max_new_tokens": 3, "min_new_tokens": 2, **forced})
        assert out["output_ids"][:2].count(eom) == 0 and out["output_ids"][2] == eom
    finally:
        server.stop()
