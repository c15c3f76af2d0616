"""What slime-lite sends to SGLang, checked by SGLang's own code (the pinned release, tests/sglang_oracle.py):
the launcher's --sglang-* passthrough parsed by SGLang's ServerArgs parser, and every /generate body the rollout and
`slime-lite send-to-engine` send validated as SGLang's server validates it (GenerateReqInput, the JSON contract,
normalize_batch_and_arguments, SamplingParams(...).verify)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from slime_lite import engine_client
from slime_lite.args import parse_args, parser_defaults
from slime_lite.backends.sglang.launcher import build_command
from slime_lite.config import EngineConfig, RolloutConfig
from slime_lite.errors import SlimeLiteError
from slime_lite.rollout import generate
from slime_lite.types import Sample
from tests import sglang_oracle as oracle

VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def sglang_server_args():
    """SGLang's server_args imported once under the oracle's fakes: the launcher's own ``from
    sglang.srt.server_args import ServerArgs`` then finds the real module (on a GPU node it imports directly)."""
    oracle.require_sglang()
    return oracle.sglang_module("sglang.srt.server_args")


@pytest.fixture()
def flags(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-backend", "sglang", "--debug-rollout-only"]


# ---- the --sglang-* passthrough -------------------------------------------------------------------------------
def test_passthrough_with_several_values_reaches_sglang_whole(flags):
    args = parse_args(flags + ["--sglang-cuda-graph-bs-decode", "2", "4", "8", "--sglang-mem-fraction-static",
                               "0.7", "--sglang-disable-cuda-graph", "--sglang-log-level=debug", "--seed", "3"])
    assert args.seed == 3  # the flag after the multi-value one is still slime-lite's
    cmd = build_command(EngineConfig.from_args(args), rank=1, port=31000)
    served = oracle.parse_server_args(cmd[3:])  # what the launched server itself would parse
    assert served.cuda_graph_bs_decode == [2, 4, 8]
    assert served.mem_fraction_static == 0.7 and served.disable_cuda_graph and served.log_level == "debug"
    assert served.port == 31000 and served.tp_size == 1 and served.random_seed == args.rollout_seed + 1


@pytest.mark.parametrize("extra, expected", [
    (["--sglang-cuda-graph-bs", "2", "4"], "ambiguous option: --cuda-graph-bs"),  # renamed upstream
    (["--sglang-not-a-flag", "3"], "--sglang-not-a-flag"),
    (["--sglang-mem-fraction-static", "lots"], "mem-fraction-static"),
    (["--sglang-po", "1234"], "port"),  # a prefix of a flag the launcher owns, as SGLang's parser resolves it
])
def test_passthrough_refused_by_sglangs_own_parser(flags, extra, expected):
    with pytest.raises(SlimeLiteError, match=expected):
        parse_args(flags + extra)


@pytest.mark.parametrize("extra, dest, owner", [
    (["--sglang-po", "30000"], "port", "free port"),  # a prefix, at SGLang's default value
    (["--sglang-ho", "127.0.0.1"], "host", "chosen by slime-lite"),
    (["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2", "--sglang-tensor-parallel-size", "1"],
     "tp_size", "--rollout-num-gpus-per-engine"),  # an alias
    (["--sglang-model-p", "/elsewhere"], "model_path", "--hf-checkpoint"),
    (["--sglang-api-k", "mine"], "api_key", "SLIME_LITE_ENGINE_API_KEY"),
    (["--lora-rank", "8", "--sglang-max-lora-r", "64"], "max_lora_rank", "--lora-rank"),
    (["--lora-rank", "8", "--sglang-lora-target", "q_proj"], "lora_target_modules", "--lora-target-modules"),
])
def test_a_passthrough_that_sets_what_the_launcher_owns_is_refused_whatever_its_spelling_or_value(
        flags, extra, dest, owner):
    """Each of these reaches SGLang's parser as the field the launcher sets (the passthrough comes last on the
    command line, so it would win): refused by the field SGLang's own parser sets, not by the flag's name or value."""
    flag, value = extra[-2].replace("--sglang-", "--"), extra[-1]
    parsed = vars(oracle.server_args_parser().parse_args(["--model-path", "/m", flag, value]))
    assert str(parsed[dest]) in (value, f"['{value}']")  # SGLang itself reads the flag as that field
    with pytest.raises(SlimeLiteError, match=rf"sets SGLang's {dest}, .*{owner}.*drop that flag"):
        parse_args(flags + extra)


@pytest.mark.parametrize("per_engine, extra", [
    ("1", ["--sglang-dp-size", "2", "--sglang-enable-dp-attention"]),
    ("2", ["--sglang-dp-size", "2", "--sglang-enable-dp-attention"]),
    ("2", ["--sglang-attn-dp-size", "3"]),
    ("4", ["--sglang-attn-dp-size", "2"]),
    ("2", ["--sglang-dp-size", "2", "--sglang-attn-dp-size", "2", "--sglang-enable-dp-attention"]),
])
def test_attention_data_parallel_sizes_are_refused_before_ray_where_sglang_would_refuse_the_server(
        tiny_model_dir, tmp_path, per_engine, extra):
    """SGLang splits a server's tp ranks (--rollout-num-gpus-per-engine) into attention data-parallel groups and
    asserts at start that they divide evenly: slime-lite refuses exactly what SGLang's own resolution refuses."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    argv = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-backend", "sglang", "--debug-rollout-only", "--rollout-num-gpus", per_engine,
            "--rollout-num-gpus-per-engine", per_engine, *extra]
    try:
        parse_args(argv)
        refusal = None
    except SlimeLiteError as exc:
        refusal = str(exc)
    served = oracle.parse_server_args(["--model-path", str(tiny_model_dir), "--tp-size", per_engine, "--device",
                                       "cpu", *[a.replace("--sglang-", "--") for a in extra]])
    try:
        with oracle._fakes_installed():  # resolving imports GPU-only modules the oracle fakes
            served.resolve_once()
        sglang_refuses = False
    except (AssertionError, ValueError):  # assert tp_size % attn_dp_size == 0; dp replicas with attention dp
        sglang_refuses = True
    assert (refusal is not None) == sglang_refuses, refusal
    if refusal:
        assert extra[0] in refusal
        assert f"--rollout-num-gpus-per-engine {per_engine}" in refusal or "--sglang-attn-dp-size 2" in refusal


# ---- /generate bodies ---------------------------------------------------------------------------------------
class CapturingClient:
    """Records the /generate bodies and answers in SGLang's response shape (no server)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def generate(self, body: dict):
        self.bodies.append(json.loads(json.dumps(body)))  # exactly what goes on the wire
        one = {"text": "2", "output_ids": [5], "meta_info": {
            "finish_reason": {"type": "stop", "matched": 5}, "prompt_tokens": 3, "completion_tokens": 1,
            "cached_tokens": 0, "output_token_logprobs": [[-0.1, 5, None]]}}
        return [one] * len(body["input_ids"]) if isinstance(body["input_ids"][0], list) else one


def _rollout_params() -> list[dict]:
    variants = [
        {},
        {"rollout_temperature": 0.0, "rollout_top_k": 5, "rollout_top_p": 0.9, "rollout_stop": ["\n", "END"]},
        {"rollout_max_response_len": 1, "eval_temperature": 0.6, "eval_max_response_len": 7},
        {"rollout_stop_token_ids": [7, 9], "eval_min_new_tokens": 3, "eval_max_response_len": 7},
    ]
    out = []
    for v in variants:
        cfg = RolloutConfig.from_args(parser_defaults(**v))
        out += [generate.sampling_params(cfg), generate.sampling_params(cfg, evaluation=True)]
    return out


def _check(body: dict) -> object:
    req = oracle.validate_generate(body)
    params = body["sampling_params"]
    for p in params if isinstance(params, list) else [params]:
        oracle.verify_sampling_params(p, VOCAB)
    return req


def test_every_rollout_body_is_accepted_by_sglang():
    client = CapturingClient()
    for i, params in enumerate(_rollout_params()):
        # every other variant asks for the routed experts too (--use-rollout-routing-replay)
        args = SimpleNamespace(engine_client=client, use_rollout_routing_replay=bool(i % 2))
        group = [Sample(index=j, tokens=[1, 2, 3]) for j in range(3)]
        per_sample = [dict(params, sampling_seed=100 * i + s.index) for s in group]  # as Generator.run_group
        asyncio.run(generate.generate_group(args, group, per_sample))
        asyncio.run(generate.default_generate(args, Sample(index=0, tokens=[4, 5]), per_sample[0]))
    assert len(client.bodies) == 16
    for body in client.bodies:
        req = _check(body)
        if isinstance(body["input_ids"][0], list):  # a group: SGLang sees one request per prompt, in order
            assert req.batch_size == 3 and [p["sampling_seed"] for p in req.sampling_params] == \
                [p["sampling_seed"] for p in body["sampling_params"]]
        assert req.return_logprob in (True, [True] * 3)


def test_send_to_engine_bodies_are_accepted_by_sglang(monkeypatch):
    from slime_lite.debug import send_to_engine

    sent = []

    def fake_request_json(url, route, body=None, **kw):
        sent.append((route, body))
        return {"meta_info": {}}

    monkeypatch.setattr(send_to_engine, "request_json", fake_request_json)
    sample = Sample(index=0, tokens=[1, 2, 3, 4, 5], response_length=2,
                    metadata={"sampling_params": dict(_rollout_params()[0], sampling_seed=9)})
    flags = SimpleNamespace(temperature=1.0, top_p=1.0, max_new_tokens=None)
    params = send_to_engine.sampling_params(sample, flags)
    send_to_engine.teacher_forced("http://unused", sample, params, timeout=1)
    assert [route for route, _ in sent] == ["/generate"]
    req = _check(sent[0][1])
    assert req.logprob_start_len == 2  # SGLang reads the scoring window where send-to-engine puts it


def test_sglang_refuses_what_it_should():
    """The oracle is not a rubber stamp: SGLang's checks catch a bad body and bad sampling values."""
    with pytest.raises(Exception):
        oracle.validate_generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "bogus_key": 1}})
    with pytest.raises(ValueError):
        oracle.verify_sampling_params({"top_p": 0.0}, VOCAB)
    with pytest.raises(TypeError):
        oracle.verify_sampling_params({"not_a_param": 1}, VOCAB)


def test_distributed_push_bodies_are_accepted_by_sglang(monkeypatch):
    """weight_push's /update_weights_from_distributed bodies validate as SGLang's UpdateWeightsFromDistributedReqInput;
    a bucket goes as one broadcast ("flattened_bucket", for the embedded engine) unless a tensor would need
    padding, and tensor by tensor for SGLang servers. Fakes: the engine's HTTP answer and the broadcast group (this
    test checks what is sent, not a transfer: tests/engine/test_weights.py receives both forms for real)."""
    import pydantic
    import torch

    from slime_lite.backends.megatron import weight_broadcast as wp

    req = pydantic.TypeAdapter(oracle.sglang_module("sglang.srt.managers.io_struct").UpdateWeightsFromDistributedReqInput)
    bodies, casts = [], []
    monkeypatch.setattr(wp, "_group", lambda urls, backend, ranks=1: SimpleNamespace(
        broadcast=lambda t, src: casts.append(t.numel() * t.element_size())))

    class FakeSent:  # the engine's HTTP answer
        def __init__(self, url, route, body, timeout):
            bodies.append(body)

        result = lambda self: {"success": True}
        close = lambda self: None

    monkeypatch.setattr(engine_client, "SentRequest", FakeSent)  # what engine_client.sent_to_all sends with
    named = {"a": torch.zeros(4, 3, dtype=torch.bfloat16), "b": torch.ones(5), "c": torch.zeros(3, dtype=torch.bfloat16)}
    for flattened, want_format, want_casts in ((True, "flattened_bucket", [50]), (False, None, [24, 20, 6])):
        bodies.clear(), casts.clear()
        wp.push_distributed(named, ["http://engine"], 3, flattened=flattened)
        assert [req.validate_python(b).load_format for b in bodies] == [want_format] and casts == want_casts
    bodies.clear(), casts.clear()
    wp.push_distributed({"c": named["c"], "b": named["b"]}, ["http://engine"], 4)  # b would start at byte 6
    assert "load_format" not in bodies[0] and casts == [6, 20]


def test_the_broadcast_group_gives_every_tp_rank_of_every_sglang_engine_its_own_rank(monkeypatch):
    """SGLang's TP rank r of an engine joins as ``rank_offset + r``: with 2 engines of 2 GPUs each
    (--rollout-num-gpus-per-engine 2) the group has 5 ranks and the engines start at 1 and 3 (it was 3 ranks, and
    the second engine's ranks 2-3 collided with the first's and fell outside). The bodies validate as SGLang's
    InitWeightsUpdateGroupReqInput; the embedded engine is one rank whatever its GPUs. Fake: the group."""
    import pydantic
    import torch

    from slime_lite.args import parser_defaults
    from slime_lite.backends.megatron import weight_broadcast, weight_push as wp

    req = pydantic.TypeAdapter(oracle.sglang_module("sglang.srt.managers.io_struct").InitWeightsUpdateGroupReqInput)
    world, bodies = weight_broadcast._join_bodies(["http://e0", "http://e1"], 2, "127.0.0.1", 29500)
    assert world == 5 and [req.validate_python(b).rank_offset for b in bodies] == [1, 3]
    assert {b["world_size"] for b in bodies} == {5}
    asked = []
    monkeypatch.setattr(wp, "weight_update_session", lambda urls: __import__("contextlib").nullcontext())
    monkeypatch.setattr(wp, "push_distributed", lambda *a, **kw: asked.append(kw["ranks"]))
    for backend, want in (("sglang", 2), ("embedded", 1)):
        args = parser_defaults(hf_checkpoint="/m", rollout_backend=backend, rollout_num_gpus_per_engine=2,
                               update_weight_transport="distributed")
        wp._transport(args, {"a": torch.zeros(2)}, ["http://e0"], 1)
    assert asked == [2, 1]


def test_a_failed_distributed_push_drops_the_broadcast_group(monkeypatch):
    """An engine that fails a bucket may have left the broadcast group (a receive that ended early destroys its
    side), so the trainer drops the group (asking every engine to destroy theirs) and the next push forms a new
    one, instead of broadcasting into a group nobody listens to. Fakes: the group and the engine's HTTP answers."""
    import torch

    from slime_lite.backends.megatron import weight_broadcast as wp
    from slime_lite.errors import EngineError

    key, calls = ("http://engine",), []
    monkeypatch.setitem(wp._groups, key, SimpleNamespace(broadcast=lambda t, src: calls.append("broadcast"),
                                                         destroy=lambda: calls.append("trainer side destroyed")))
    monkeypatch.setattr(wp, "request_json", lambda url, route, body, timeout: calls.append(route) or {})

    class FailingSent:  # the engine answers the bucket with an error, after the broadcast
        def __init__(self, url, route, body, timeout):
            pass

        def result(self):
            raise EngineError("engine http://engine/update_weights_from_distributed answered HTTP 400: receiving failed")

        close = lambda self: None

    monkeypatch.setattr(engine_client, "SentRequest", FailingSent)
    with pytest.raises(EngineError, match="receiving failed"):
        wp.push_distributed({"a": torch.ones(4)}, list(key), 1)
    assert key not in wp._groups
    assert calls == ["broadcast", "/destroy_weights_update_group", "trainer side destroyed"]


def test_offload_rollout_resumes_every_memory_sglang_released(monkeypatch):
    """--offload-rollout over one step (RolloutSide.release_memory, push_weights, resume_memory): the memory calls
    slime-lite sends, replayed on SGLang's own SchedulerWeightUpdaterManager, leave nothing paused (the tag-less
    release pauses the CUDA graphs too). Fakes: the engine's HTTP answer, the engine actor's memory report, and the
    GPU runtime under SGLang's manager (memory saver, TP group barrier, device sync)."""
    import torch

    from slime_lite.rollout import engines, side as side_mod
    from slime_lite.rollout.recovery import NoRecovery

    updater = oracle.sglang_module("sglang.srt.managers.scheduler_components.weight_updater")
    io_struct = oracle.sglang_module("sglang.srt.managers.io_struct")
    sent = []
    monkeypatch.setattr(engines, "request_json", lambda url, route, body, timeout=None: sent.append((route, body)))
    monkeypatch.setattr(side_mod, "ray", SimpleNamespace(get=lambda refs, timeout=None: refs))
    actor = SimpleNamespace(memory=SimpleNamespace(remote=lambda: {"gpu_used_gb": 1.0}))
    side = object.__new__(side_mod.RolloutSide)
    side.config = SimpleNamespace(offload_rollout=True, fully_async=False, names_lora_adapter=False,
                                  pushes_after=lambda r: True)
    side.fleet, side.recovery = engines.EngineFleet([actor], ["http://engine"]), NoRecovery()
    side.release_memory({})
    side.push_weights(lambda urls, version: {}, 1, {})
    side.resume_memory({})

    class FakeSaver:  # SGLang's memory saver adapter: which tags are paused
        def __init__(self) -> None:
            self.paused: set[str] = set()

        def pause(self, tag):
            self.paused.add(tag)

        def resume(self, tag):
            self.paused.discard(tag)

    monkeypatch.setattr(updater, "get_parallel", lambda: SimpleNamespace(tp_group=SimpleNamespace(cpu_group=None)))
    monkeypatch.setattr(updater, "get_model", lambda: SimpleNamespace(weight_cache_mode="off"))
    monkeypatch.setattr(updater, "_export_static_state", lambda model: None)
    monkeypatch.setattr(updater, "_import_static_state", lambda model, state: None)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **kw: None)
    monkeypatch.setattr(torch, "get_device_module", lambda *a: SimpleNamespace(synchronize=lambda: None))
    saver = FakeSaver()
    manager = updater.SchedulerWeightUpdaterManager(
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=None)), draft_worker=None,
        memory_saver_adapter=saver, flush_cache=lambda **kw: True, is_fully_idle=lambda **kw: True)
    assert [route for route, _ in sent] == ["/release_memory_occupation"] + ["/resume_memory_occupation"] * 2
    for route, body in sent:
        kind = "Release" if "release" in route else "Resume"
        getattr(manager, route.strip("/"))(getattr(io_struct, f"{kind}MemoryOccupationReqInput")(**body))
        if "release" in route:
            assert saver.paused == set(oracle.sglang_module("sglang.srt.constants").GPU_MEMORY_ALL_TYPES)
    assert saver.paused == set() and manager.offload_tags == set()
