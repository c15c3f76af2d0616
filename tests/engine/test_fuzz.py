"""A bounded fuzz of every route of the embedded engine (fixed seed, a few hundred generated bodies, 127.0.0.1 only):
no answer is a 5xx, the server stays healthy, and a well-formed request decoding meanwhile gives exactly what it
gives without the fuzz traffic. Then every field of every template in turn gets each numeric type and text that is
not valid Unicode, weight uploads get junk files, /start_profile gets paths it may not write, and token ids outside
the vocabulary in every field that takes ids are a 400."""

from __future__ import annotations

import copy
import json
import random
import threading
import urllib.error
import urllib.parse
import urllib.request

import pytest
from engine_helpers import generate, http, start_engine

NAN, INF = float("nan"), float("inf")
NASTY = [None, True, False, 0, 1, -1, 3, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1.5, -0.0, 1e308, NAN, INF, -INF,
         "", "x", "1", "nan", "\u0000", "\U0001f4a5" * 3, "a" * 5000, "\ud800", "a\udfffb", ["\udc00"], [], [1], [-1],
         [[1, 2]], [None], ["a"], [[]],
         {}, {"a": 1}, {"n": 2}, [[[[[]]]]]]
RAW = [b"", b"{", b"[1]", b"null", b"NaN", b'"x"', b"\xff\xfe\x00", b"[" * 100_000 + b"]" * 100_000,
       b'{"input_ids": [1], "input_ids": "x"}', b'{"text": "a"' + b" " * 10_000 + b"}"]
SP = {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.0, "stop": ["x"],
      "stop_token_ids": [3], "ignore_eos": True, "n": 1, "sampling_seed": 7, "min_new_tokens": 1}
# Routes whose well-formed bodies leave a request decoding elsewhere alone (phase 1, next to the witness).
SHARED = {
    ("POST", "/generate"): {"input_ids": [1, 2, 3], "sampling_params": SP, "return_logprob": True,
                            "logprob_start_len": 0, "rid": "fz", "stream": False, "return_text_in_logprobs": True},
    ("PUT", "/generate"): {"text": ["ab", "cd"], "sampling_params": [SP, SP], "stream": True},
    ("POST", "/v1/completions"): {"prompt": "ab", "max_tokens": 3, "temperature": 0.5, "n": 1, "stop": "x",
                                  "logprobs": 1, "stream": False, "seed": 3, "stream_options": {"include_usage": True}},
    ("POST", "/v1/chat/completions"): {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                       "logprobs": True, "stream": True},
    ("GET", "/v1/models"): {}, ("GET", "/health"): {}, ("GET", "/health_generate"): {},
    ("GET", "/get_model_info"): {}, ("GET", "/server_info"): {}, ("GET", "/get_weight_version"): {},
    ("GET", "/get_weights_by_name"): {"name": "model.norm.weight", "truncate_size": 2},
    ("POST", "/get_weights_checksum"): {"names": ["model.norm.weight"]},
    ("POST", "/flush_cache"): {}, ("POST", "/abort_request"): {"rid": "fz-other"},
    ("GET", "/no_such_route"): {},
}
# Routes that change the engine's state when well-formed (phase 2, with nothing decoding). The weight-group
# template can never join a group: world_size 1 is refused and no NASTY value is a valid world size (>= 2), and
# backend nccl is refused on a CPU engine, so no case waits on a peer.
CONTROL = {
    ("POST", "/pause_generation"): {"mode": "in_place"}, ("POST", "/continue_generation"): {},
    ("POST", "/update_weight_version"): {"new_version": "v", "abort_all_requests": False},
    ("POST", "/update_weights_from_disk"): {"model_path": "/nonexistent", "weight_version": "v"},
    ("POST", "/update_weights_from_tensor"): {"serialized_named_tensors": ["AAAA"], "load_format": None},
    ("POST", "/init_weights_update_group"): {"master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1,
                                             "world_size": 1, "group_name": "g", "backend": "nccl"},
    ("POST", "/update_weights_from_distributed"): {"names": ["model.norm.weight"], "dtypes": ["float32"],
                                                   "shapes": [[128]], "group_name": "g"},
    ("POST", "/destroy_weights_update_group"): {"group_name": "g"},
    ("POST", "/release_memory_occupation"): {"tags": ["kv_cache"]}, ("POST", "/resume_memory_occupation"): {},
    ("POST", "/abort_request"): {"abort_all": True},
    ("POST", "/start_profile"): {"output_dir": "fz", "profile_prefix": "fz", "record_shapes": False},
    ("POST", "/stop_profile"): {},
    ("POST", "/begin_weight_update"): {}, ("POST", "/end_weight_update"): {},
}
TYPES = [1.0, 1.5, True, -1, 2**64, "1", "\ud800", None, []]  # each field of each template gets each one
VOCAB = 128  # the tiny model's vocabulary
IDS = [  # (route, body, the field the 400 names) with a token id outside the vocabulary
    ("/generate", {"input_ids": [1, VOCAB]}, "input_ids"), ("/generate", {"input_ids": [[1], [-1]]}, "input_ids[1]"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [VOCAB]}}, "stop_token_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"logit_bias": {str(VOCAB): 1.0}}}, "logit_bias"),
    ("/generate", {"input_ids": [1], "return_logprob": True, "token_ids_logprob": [VOCAB]}, "token_ids_logprob"),
    ("/v1/completions", {"prompt": [1, 10**6], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [VOCAB]]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "ab", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "ab", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [VOCAB]},
     "stop_token_ids"),
    ("/detokenize", {"tokens": [VOCAB]}, "tokens"), ("/detokenize", {"tokens": [[1], [VOCAB]]}, "tokens[1]"),
]
GENERATION = ("/generate", "/v1/completions", "/v1/chat/completions")  # fuzzed five times as often as the others
WITNESS = {"input_ids": [9, 8, 7], "rid": "fuzz-witness", "return_logprob": True,
           "sampling_params": {"max_new_tokens": 24, "temperature": 0.8, "sampling_seed": 1234, "ignore_eos": True}}


def nasty(rng: random.Random):
    return copy.deepcopy(rng.choice(NASTY))


def mutate(rng: random.Random, body: dict) -> dict:
    """The template with one to three fields (top level or sampling) replaced by a NASTY value, dropped, or added."""
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        target = body
        if isinstance(body.get("sampling_params"), dict) and rng.random() < 0.5:
            target = body["sampling_params"]
        op = rng.random()
        if target and op < 0.7:
            target[rng.choice(sorted(target))] = nasty(rng)
        elif target and op < 0.85:
            target.pop(rng.choice(sorted(target)))
        else:
            target[rng.choice(["junk", "n", "rid", "text", "input_ids", "sampling_params", "stream"])] = nasty(rng)
    return body


def send(url: str, method: str, route: str, body: dict | None = None, raw: bytes | None = None) -> tuple[int, bytes]:
    if method == "GET" and body:
        route += "?" + urllib.parse.urlencode({k: str(v) for k, v in body.items()}, errors="surrogatepass")
        body = None
    data = raw if raw is not None else (None if method == "GET" else json.dumps(body).encode())
    req = urllib.request.Request(url + route, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def fuzz(url: str, routes: dict, rng: random.Random, cases: int) -> list[tuple]:
    """Send ``cases`` generated requests; return those answered with a 5xx (route, body, status, answer)."""
    failures = []
    keys = sorted(routes) + 4 * [k for k in sorted(routes) if k[1] in GENERATION]
    for i in range(cases):
        method, route = rng.choice(keys)
        if i % 10 == 9:
            body, raw = None, rng.choice(RAW)
            method = "POST" if method == "GET" else method
        else:
            body, raw = (mutate(rng, routes[(method, route)]) if rng.random() < 0.9 else routes[(method, route)]), None
        status, answer = send(url, method, route, body, raw)
        if status >= 500:
            failures.append((method, route, body if raw is None else raw[:60], status, answer[:300]))
    return failures


@pytest.fixture
def own_engine(tiny_model_dir, tmp_path):
    """An engine of this test's own: the fuzz changes its weight version, pauses and resumes it, and profiles it."""
    server = start_engine(tiny_model_dir, max_running_requests=8, profile_dir=str(tmp_path / "profiles"))
    yield server
    server.stop()


def every_field(routes: dict) -> list[tuple[str, str, dict]]:
    """(method, route, body) for each field of each template (top level and sampling_params) set to each TYPES."""
    out = []
    for (method, route), body in sorted(routes.items()):
        for key in sorted(body):
            for value in TYPES:
                out.append((method, route, {**body, key: value}))
        if isinstance(body.get("sampling_params"), dict):
            for key in sorted(body["sampling_params"]):
                for value in TYPES:
                    out.append((method, route, {**body, "sampling_params": {**body["sampling_params"], key: value}}))
    return out


def junk_weight_folders(root) -> list[str]:
    """Folders whose safetensors file is not one: empty, a junk header, random bytes, a folder by that name."""
    out = []
    for i, content in enumerate((b"", b"\x08\x00\x00\x00\x00\x00\x00\x00{junk}}}", bytes(range(256)) * 4, None)):
        folder = root / f"junk{i}"
        folder.mkdir()
        if content is None:
            (folder / "model.safetensors").mkdir()
        else:
            (folder / "model.safetensors").write_bytes(content)
        out.append(str(folder))
    return out


def test_fuzzed_requests_get_2xx_or_4xx_and_leave_a_concurrent_request_exact(own_engine):
    url = own_engine.url
    alone = generate(url, **WITNESS)
    rng = random.Random(15)
    witnessed: list = []
    stop = threading.Event()

    def witness_loop() -> None:
        while not stop.is_set():
            witnessed.append(http(url, "/generate", WITNESS))

    t = threading.Thread(target=witness_loop, daemon=True)
    t.start()
    try:
        failures = fuzz(url, SHARED, rng, 300)
    finally:
        stop.set()
        t.join(60)
    failures += fuzz(url, CONTROL, rng, 100)
    for route, body in (("/continue_generation", {}), ("/resume_memory_occupation", {})):
        assert http(url, route, body)[0] == 200
    assert not failures, "\n".join(map(str, failures[:10]))
    assert len(witnessed) >= 2
    for status, out in witnessed:
        assert status == 200, out
        assert out["output_ids"] == alone["output_ids"]
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert http(url, "/health")[0] == 200 and http(url, "/health_generate")[0] == 200
    assert generate(url, **WITNESS)["output_ids"] == alone["output_ids"]


def test_every_field_type_bad_text_junk_files_and_profile_paths_get_no_5xx(own_engine, tmp_path):
    url = own_engine.url
    failures = []
    cases = every_field(SHARED) + every_field(CONTROL)
    cases += [("POST", "/update_weights_from_disk", {"model_path": p}) for p in junk_weight_folders(tmp_path)]
    cases += [("POST", "/start_profile", {"output_dir": p}) for p in ("/etc", "../up", "x\x00y", "a" * 5000, "ok")]
    cases += [("POST", "/stop_profile", {}), ("POST", "/stop_profile", {})]
    cases += [("POST", r, {"text": "a\udfffb", "prompt": "\ud800", "messages": [{"role": "user", "content": "\ud800"}]})
              for r in ("/generate", "/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/tokenize")]
    for method, route, body in cases:
        status, answer = send(url, method, route, body)
        if status >= 500:
            failures.append((method, route, body, status, answer[:300]))
    for route in ("/continue_generation", "/resume_memory_occupation"):
        assert http(url, route, {})[0] == 200
    assert not failures, f"{len(failures)} of {len(cases)}:\n" + "\n".join(map(str, failures[:10]))
    wrong_ids = [(route, body, out) for route, body, field in IDS
                 for status, out in [http(url, route, body)] if status != 400 or field not in str(out)]
    assert not wrong_ids, "\n".join(map(str, wrong_ids))
    assert generate(url, **WITNESS)["meta_info"]["finish_reason"]["type"] == "length"
