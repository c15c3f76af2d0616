"""Weight routes of the embedded engine: after each kind of update the engine holds and samples from the new
weights (get_weights_by_name, checksums, log-probs equal to an HF forward of the new model)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import generate, hf_logprobs, http, in_thread, start_engine

from slime_lite import weight_wire
from slime_lite.io import free_port
from slime_lite.weight_checksum import tensor_checksums
from slime_lite.weight_transport import WeightUpdateGroup

PROMPT = [10, 11, 12, 13]


@pytest.fixture(scope="module")
def new_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with every parameter perturbed, saved as a second checkpoint."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    out = tmp_path_factory.mktemp("new_model")
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def new_model(new_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(new_model_dir), dtype=torch.float32).eval()


@pytest.fixture
def fresh_engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=4)
    yield server
    server.stop()


def assert_serves(url: str, model, version: str, cached: int = 0) -> None:
    """The engine's weights are ``model``'s and its samples' log-probs come from ``model``. ``cached``: prompt tokens
    the prefix cache holds for PROMPT (0 after a weight update: an update drops the cache, or stale K/V of the old
    weights would make these log-probs wrong)."""
    name = "model.layers.1.self_attn.q_proj.weight"
    status, values = http(url, "/get_weights_by_name", {"name": name, "truncate_size": 3})
    assert status == 200
    assert torch.allclose(torch.tensor(values), model.get_parameter(name)[:3], atol=0)
    status, sums = http(url, "/get_weights_checksum", {})
    assert status == 200
    named = dict(model.named_parameters())
    assert sums == dict(zip(named, tensor_checksums(list(named.values()))))
    out = generate(url, input_ids=PROMPT, return_logprob=True,
                   sampling_params={"max_new_tokens": 8, "temperature": 0.8, "ignore_eos": True})
    lps = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    ref = hf_logprobs(model, PROMPT, out["output_ids"], 0.8)
    assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-5
    assert out["meta_info"]["cached_tokens"] == cached
    assert out["meta_info"]["weight_version"] == version
    assert http(url, "/get_weight_version")[1]["weight_version"] == version


def test_update_weights_from_disk(fresh_engine, hf_model, new_model, new_model_dir):
    url = fresh_engine.url
    assert_serves(url, hf_model, "default")
    status, out = http(url, "/update_weights_from_disk", {"model_path": str(new_model_dir), "weight_version": "v1"})
    assert status == 200 and out["success"] is True
    assert_serves(url, new_model, "v1")
    assert http(url, "/get_model_info")[1]["model_path"] == str(new_model_dir)
    status, out = http(url, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert status == 400 and out["success"] is False and "/nonexistent" in out["message"]


def test_update_weights_from_tensor(fresh_engine, new_model):
    """SGLang's payloads in both load formats (shared-memory handles and by value), inside SGLang's session."""
    url = fresh_engine.url
    named = {n: p.detach().clone() for n, p in new_model.named_parameters()}
    half = list(named)[: len(named) // 2]
    generate(url, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})  # the old weights' K/V, cached
    assert http(url, "/begin_weight_update", {})[1]["success"] is True
    assert http(url, "/begin_weight_update", {})[0] == 400  # one session at a time, as in SGLang
    payloads = (("direct", weight_wire.serialize([(n, named[n]) for n in half]), "v1"),
                ("flattened_bucket", weight_wire.serialize(weight_wire.flatten_bucket(
                    [(n, named[n]) for n in named if n not in half]), by_value=True), "v2"))
    for load_format, payload, version in payloads:  # two buckets
        body = {"serialized_named_tensors": [payload], "load_format": load_format, "flush_cache": True,
                "weight_version": version}
        status, out = http(url, "/update_weights_from_tensor", body)
        assert status == 200 and out["success"] is True, out
        assert http(url, "/get_model_info")[1]["weight_version"] == "default"  # a session's version: at its end
    assert http(url, "/end_weight_update", {})[1]["success"] is True
    assert http(url, "/end_weight_update", {})[0] == 400
    assert_serves(url, new_model, "v2")
    bad = [("model.nope.weight", torch.zeros(2), "model.nope.weight"),
           ("model.norm.weight", torch.zeros(3), "shape (3,)"),
           ("model.norm.weight", torch.zeros(named["model.norm.weight"].shape, dtype=torch.int32), "dtype int32")]
    for name, t, said in bad:  # refused before a byte is copied
        status, out = http(url, "/update_weights_from_tensor",
                           {"serialized_named_tensors": [weight_wire.serialize([(name, t)])]})
        assert status == 400 and out["success"] is False and said in out["message"], out
    assert_serves(url, new_model, "v2", cached=len(PROMPT) - 1)  # refused updates change nothing, cache included
    empty = {"serialized_named_tensors": [weight_wire.serialize(weight_wire.flatten_bucket([]))],
             "load_format": "flattened_bucket", "weight_version": "v3"}  # slime sends these for idle TP ranks
    status, out = http(url, "/update_weights_from_tensor", empty)
    assert status == 200 and out["success"] is True, out
    assert_serves(url, new_model, "v3", cached=len(PROMPT) - 1)  # nothing written: the cache stays


def join_group(url: str) -> WeightUpdateGroup:
    """The trainer's side (rank 0, gloo) of a weight update group "wu" the engine joins."""
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "wu", "backend": "gloo"}
    t, box = in_thread(http, url, "/init_weights_update_group", init)
    trainer = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", group_name="wu")
    t.join(30)
    assert box["result"][0] == 200 and box["result"][1]["success"] is True
    return trainer


def test_a_session_with_a_refused_bucket_ends_as_partial_weights(fresh_engine, new_model):
    """A push is one version in many buckets: when one is refused after others applied, the engine holds old and
    new weights. The session's end says so (400) and the engine serves weight_version "partial" (read as -1: the
    weight-version checks fail), not the push's version, which it reported from the first bucket on."""
    url = fresh_engine.url
    named = {n: p.detach().clone() for n, p in new_model.named_parameters()}
    half = list(named)[: len(named) // 2]
    assert http(url, "/begin_weight_update", {})[1]["success"] is True
    body = {"serialized_named_tensors": [weight_wire.serialize([(n, named[n]) for n in half])], "weight_version": "7"}
    assert http(url, "/update_weights_from_tensor", body)[0] == 200
    bad = {"serialized_named_tensors": [weight_wire.serialize([("model.nope.weight", torch.zeros(2))])],
           "weight_version": "7"}
    assert http(url, "/update_weights_from_tensor", bad)[0] == 400
    status, out = http(url, "/end_weight_update", {})
    assert status == 400 and "old and new weights" in out["message"]
    assert http(url, "/get_model_info")[1]["weight_version"] == "partial"
    out = generate(url, input_ids=PROMPT, sampling_params={"max_new_tokens": 1})
    assert out["meta_info"]["weight_version"] == "partial"
    assert http(url, "/begin_weight_update", {})[1]["success"] is True  # a complete push makes it a version again
    full = {"serialized_named_tensors": [weight_wire.serialize(list(named.items()))], "weight_version": "8"}
    assert http(url, "/update_weights_from_tensor", full)[0] == 200
    assert http(url, "/end_weight_update", {})[1]["success"] is True
    assert_serves(url, new_model, "8")


def test_update_weights_from_distributed_broadcast(fresh_engine, new_model):
    url = fresh_engine.url
    trainer = join_group(url)
    generate(url, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})  # the old weights' K/V, cached
    named = list(new_model.named_parameters())
    body = {"names": [n for n, _ in named], "dtypes": [str(p.dtype).removeprefix("torch.") for _, p in named],
            "shapes": [list(p.shape) for _, p in named], "group_name": "wu", "weight_version": "v7"}
    t, box = in_thread(http, url, "/update_weights_from_distributed", body)
    for _, p in named:
        trainer.broadcast(p.detach().clone(), src=0)
    t.join(30)
    assert box["result"][0] == 200 and box["result"][1]["success"] is True
    assert_serves(url, new_model, "v7")
    huge = {**body, "names": ["x"], "dtypes": ["float32"], "shapes": [[1 << 31, 1 << 20]], "weight_version": "v8"}
    status, out = http(url, "/update_weights_from_distributed", huge)  # refused before any buffer is allocated
    assert status == 400 and "more than the whole model holds" in out["message"], out
    assert_serves(url, new_model, "v7", cached=len(PROMPT) - 1)  # nothing changed: version, cache
    assert http(url, "/destroy_weights_update_group", {"group_name": "wu"})[1]["success"] is True
    trainer.destroy()
    status, out = http(url, "/update_weights_from_distributed", {**body, "names": body["names"][:1],
                                                                 "dtypes": body["dtypes"][:1],
                                                                 "shapes": body["shapes"][:1]})
    assert status == 400 and "init_weights_update_group" in out["message"]


def test_update_weights_from_distributed_flattened_bucket(fresh_engine, new_model):
    """load_format "flattened_bucket": one broadcast of the bucket's bytes back to back (weight_broadcast._packed), read
    as SGLang's own FlattenedTensorBucket reads it; a layout that would need padding is refused after the bytes
    arrived (the sender is never left hanging) and the group keeps working."""
    from slime_lite.backends.megatron.weight_broadcast import _packed
    from tests import sglang_oracle as oracle

    url = fresh_engine.url
    trainer = join_group(url)
    named = [(n, p.detach()) for n, p in new_model.named_parameters()]
    body = {"names": [n for n, _ in named], "dtypes": [str(p.dtype).removeprefix("torch.") for _, p in named],
            "shapes": [list(p.shape) for _, p in named], "group_name": "wu", "weight_version": "v8",
            "load_format": "flattened_bucket"}
    packed = _packed([p for _, p in named], "cpu")
    bucket_cls, _ = oracle.flattened_tensor_bucket()  # SGLang's reader of the same request gets the same tensors
    theirs = bucket_cls.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
    theirs.get_flattened_tensor().copy_(packed)
    assert all(a == n and torch.equal(b, p) for (a, b), (n, p) in zip(theirs.reconstruct_tensors(), named))
    t, box = in_thread(http, url, "/update_weights_from_distributed", body)
    trainer.broadcast(packed, src=0)
    t.join(30)
    assert box["result"][0] == 200 and box["result"][1]["success"] is True, box
    assert_serves(url, new_model, "v8")
    odd = [torch.ones(3, dtype=torch.bfloat16), named[0][1]]  # 6 bytes, then a float32 tensor: needs padding
    assert _packed(odd, "cpu") is None  # the trainer sends such a bucket tensor by tensor
    bad = {**body, "names": ["x", named[0][0]], "dtypes": ["bfloat16", "float32"],
           "shapes": [[3], list(named[0][1].shape)], "weight_version": "v9"}
    t, box = in_thread(http, url, "/update_weights_from_distributed", bad)
    trainer.broadcast(torch.zeros(6 + named[0][1].numel() * 4, dtype=torch.uint8), src=0)
    t.join(30)
    assert box["result"][0] == 400 and f"{named[0][0]!r} starts at byte 6" in box["result"][1]["message"], box
    assert_serves(url, new_model, "v8", cached=len(PROMPT) - 1)  # nothing changed: version, cache
    t, box = in_thread(http, url, "/update_weights_from_distributed", body)  # the group still works
    trainer.broadcast(packed, src=0)
    t.join(30)
    assert box["result"][0] == 200, box
    trainer.destroy()


def test_get_weights_by_name_unknown_name_is_400(engine):
    status, out = http(engine.url, "/get_weights_by_name", {"name": "model.nope"})
    assert status == 400 and "model.nope" in out["error"]["message"]
    status, values = http(engine.url, "/get_weights_by_name?name=model.norm.weight&truncate_size=5")
    assert status == 200 and len(values) == 5


def test_release_and_resume_memory_keep_generation_working_on_cpu(fresh_engine, hf_model):
    url = fresh_engine.url
    assert http(url, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})[0] == 200
    assert http(url, "/resume_memory_occupation", {})[0] == 200
    assert_serves(url, hf_model, "default")


def test_update_weight_version_shows_in_generate(fresh_engine):
    status, out = http(fresh_engine.url, "/update_weight_version", {"new_version": "step-3"})
    assert status == 200 and out["success"] is True
    meta = generate(fresh_engine.url, input_ids=[1, 2], sampling_params={"max_new_tokens": 1})["meta_info"]
    assert meta["weight_version"] == "step-3"


def test_a_checkpoint_with_rotary_buffers_loads_from_disk_but_no_tensor_update_takes_them(tiny_model_dir, tmp_path):
    """Checkpoints may hold the rotary embedding's buffers (inv_freq, cos/sin caches): Hugging Face loads such a
    folder, and so does /update_weights_from_disk, skipping them; an update of named tensors still refuses a name
    that is no parameter."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from slime_lite.engine.weights import NON_PARAMETER_BUFFERS, WeightError, Weights

    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    buffers = {f"model.layers.0.self_attn.{name}": torch.ones(4) for name in NON_PARAMETER_BUFFERS}
    save_file({**tensors, **buffers, "model.rotary_emb.inv_freq": torch.ones(4)}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)  # what startup loads
    weights = Weights(model)
    assert weights.load_from_disk(str(tmp_path)) == len(tensors)
    with pytest.raises(WeightError, match="inv_freq"):
        weights.load_named({"model.rotary_emb.inv_freq": torch.ones(4)})


def test_checksums_follow_swapped_storage_and_tied_names():
    """``Weights.params`` is made once: a parameter whose ``.data`` is swapped (the engine's fusing, offload) is
    hashed from its new storage; tied names share one digest; a subset of names gets the same digests."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from slime_lite.engine.weights import Weights

    cfg = Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64, tie_word_embeddings=True)
    weights = Weights(Qwen2ForCausalLM(cfg))
    before = weights.checksums()
    assert before["lm_head.weight"] == before["model.embed_tokens.weight"]
    name = "model.layers.0.mlp.up_proj.weight"
    param = weights.params[name]
    param.data = param.data + 1
    after = weights.checksums()
    assert after[name] == tensor_checksums([param])[0] != before[name]
    assert {n: d for n, d in after.items() if n != name} == {n: d for n, d in before.items() if n != name}
    assert weights.checksums([name, "lm_head.weight"]) == {name: after[name], "lm_head.weight": after["lm_head.weight"]}


def test_a_whole_moe_model_in_one_distributed_bucket_is_received():
    """The size bound of /update_weights_from_distributed (the whole model in float64) counts the fused expert
    parameters too: a MoE model whose experts outweigh the rest, pushed in one flattened bucket, is received and
    loaded (it was refused as "more than the whole model holds" while the trainer waited on the broadcast)."""
    from types import SimpleNamespace

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from slime_lite.backends.megatron.weight_broadcast import _packed
    from slime_lite.engine.weights import Weights

    cfg = Qwen3MoeConfig(hidden_size=16, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32, num_experts=8,
                         num_experts_per_tok=2)
    weights = Weights(Qwen3MoeForCausalLM(cfg))
    gen = torch.Generator().manual_seed(0)
    named = {n: torch.randn(weights.params[n].shape, generator=gen) for n in weights.params.canonical}
    packed = _packed(list(named.values()), "cpu")
    weights.groups["g"] = SimpleNamespace(backend="gloo", broadcast=lambda t, src: t.copy_(packed))
    assert weights.update_from_distributed(list(named), ["float32"] * len(named),
                                           [list(t.shape) for t in named.values()], "g", flattened=True) == len(named)
    assert weights.checksums() == dict(zip(named, tensor_checksums(list(named.values()))))


def test_a_full_write_sent_with_its_adapter_is_the_base_the_adapter_merges_onto():
    """An update carrying a weight and its LoRA adapter (both halves, or one half now and one later): the engine
    serves new weight + BA; it had merged onto the old weight and kept that as the base for every later adapter."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from slime_lite.engine.weights import Weights
    from slime_lite.lora_wire import adapter_names, merged

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    w = Weights(Qwen2ForCausalLM(cfg))
    name = "model.layers.0.mlp.up_proj.weight"
    na, nb = adapter_names(name)
    base, a, b = torch.randn(32, 16), torch.randn(4, 16) * 0.1, torch.randn(32, 4) * 0.1
    assert w.load_named({name: base, na: a, nb: b}) == 1
    assert torch.equal(w.params[name].detach(), merged(base, a, b))
    a2, b2 = torch.randn(4, 16) * 0.1, torch.randn(32, 4) * 0.1  # the next push: adapters only
    w.load_named({na: a2, nb: b2})
    assert torch.equal(w.params[name].detach(), merged(base, a2, b2))
    base2 = torch.randn(32, 16)  # a new base with one half, the other half in the next bucket
    w.load_named({name: base2, na: a})
    w.load_named({nb: b})
    assert torch.equal(w.params[name].detach(), merged(base2, a, b))


def test_a_push_that_fails_half_way_leaves_the_engine_partial_not_at_its_version(fresh_engine, new_model, monkeypatch):
    """The trainer's push stops after its first bucket (another engine died, the trainer raised): this engine's own
    updates all applied, so its session would end as a success and report the push's version while it holds old and
    new weights. The trainer names its weights "partial" (read as -1: the weight-version checks fail) until a
    complete push."""
    from types import SimpleNamespace

    from slime_lite.backends.megatron import weight_push

    url = fresh_engine.url
    named = {n: p.detach().clone() for n, p in new_model.named_parameters()}
    args = SimpleNamespace(update_weight_buffer_size=1 << 16, colocate=False, rollout_backend="embedded",
                           fully_async=False, debug_scramble_engine_weights=False, debug_inject_fault=None,
                           check_weight_update_equal=False, update_weight_transport="tensor",
                           rollout_num_gpus_per_engine=1)
    assert len(weight_push.buckets(named, args.update_weight_buffer_size)) > 1
    flatten, calls = weight_push.flatten_bucket, []

    def dies_after_one(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the trainer died between two buckets")
        return flatten(*a, **kw)

    monkeypatch.setattr(weight_push, "flatten_bucket", dies_after_one)
    with pytest.raises(RuntimeError, match="between two buckets"):
        weight_push.push(args, named, [url], version=7)
    assert http(url, "/get_weight_version")[1]["weight_version"] == "partial"
    monkeypatch.setattr(weight_push, "flatten_bucket", flatten)
    weight_push.push(args, named, [url], version=8)  # a complete push makes it a version again
    assert_serves(url, new_model, "8")


def test_an_update_that_applies_after_its_session_ended_leaves_the_weights_partial(tmp_path):
    """An update queued for the model thread inside a session can apply after that session ended (committing its
    version) or after the next one began: the engine then holds weights its version does not name, so it serves
    "partial", never the late update's version. A FAKE model thread (the test runs each queued call) and request."""
    import asyncio
    from concurrent.futures import Future
    from types import SimpleNamespace

    from slime_lite.engine.admin_routes import _Admin

    class ModelThread:  # FAKE: the scheduler's model thread; a held call waits until the test runs it
        weight_version = "6"

        def __init__(self) -> None:
            self.queued: list = []
            self.hold = False
            self.weights = SimpleNamespace(drop_pending_adapters=lambda: None, pending_adapters=lambda: [])

        def call(self, fn, *args):
            done: Future = Future()
            self.queued.append(lambda: done.set_result(fn(*args)))
            if not self.hold:
                self.queued.pop()()
            return done

    class Request:  # FAKE: an empty POST body
        method = "POST"

        async def read(self) -> bytes:
            return b""

    async def scenario() -> list[str]:
        model = ModelThread()
        admin = _Admin(model, str(tmp_path), lambda *a: None)
        seen = []
        for late_into_next in (False, True):
            assert (await admin.begin_weight_update(Request())).status == 200
            model.hold = True
            update = asyncio.ensure_future(admin._weight_op(lambda: 1, version="7"))
            await asyncio.sleep(0)  # queued in the model thread, not yet applied
            model.hold = False
            # the end's own call to the model thread (its adapter check) runs at once, ahead of the held update, as
            # for an update whose body was still being read at the end (the scheduler runs calls in order: one
            # already queued applies before the end's check, and is recorded in its session)
            assert (await admin.end_weight_update(Request())).status == 200  # nothing applied yet: a success
            if late_into_next:
                assert (await admin.begin_weight_update(Request())).status == 200
            model.queued.pop(0)()  # the update applies now
            assert (await update).status == 200
            seen.append(model.weight_version)
            if late_into_next:
                assert (await admin.end_weight_update(Request())).status == 200
                seen.append(model.weight_version)
            model.weight_version = "6"
        return seen

    # after its session ended; after the next began, and still at that one's end (it applied no update of its own)
    assert asyncio.run(scenario()) == ["partial", "partial", "partial"]


def test_a_session_that_cannot_open_on_every_engine_leaves_the_others_weights_named(monkeypatch):
    """One engine refuses /begin_weight_update: the sessions the others opened are closed again, and since nothing
    was sent their weights keep their version (not "partial"). FAKE engines: the trainer's HTTP calls recorded."""
    from slime_lite.backends.megatron import weight_push
    from slime_lite.errors import EngineError

    calls = []

    def request_json(url, route, body, timeout=None):
        calls.append((url, route))
        if url == "http://b" and route == "/begin_weight_update":
            raise EngineError("engine http://b/begin_weight_update answered HTTP 500: busy")
        return {"success": True}

    monkeypatch.setattr(weight_push, "request_json", request_json)
    with pytest.raises(EngineError, match="HTTP 500"):
        with weight_push.weight_update_session(["http://a", "http://b"]):
            raise AssertionError("the push must not start")
    assert ("http://a", "/end_weight_update") in calls
    assert not any(route == "/update_weight_version" for _, route in calls)
