"""LoRA adapter pushes to the embedded engine: it serves W + (alpha/R) B A merged (``lora_wire.merged``) onto its
base weights, push after push (never onto the previous merge), with halves arriving in different buckets."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import http, start_engine
from test_weights import assert_serves

from slime_lite import weight_wire
from slime_lite.lora_wire import adapter_names, merged

ADAPTED = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]


@pytest.fixture
def fresh_engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=4)
    yield server
    server.stop()


def _adapters(model, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    wire = {}
    for name in ADAPTED:
        out, inp = model.get_parameter(name).shape
        a_name, b_name = adapter_names(name)
        wire[a_name] = torch.randn(rank, inp, generator=g) * 0.1
        wire[b_name] = torch.randn(out, rank, generator=g) * 0.1
    return wire


def _served(base_model, wire):
    model = copy.deepcopy(base_model)
    with torch.no_grad():
        for name in ADAPTED:
            a_name, b_name = adapter_names(name)
            model.get_parameter(name).copy_(merged(base_model.get_parameter(name), wire[a_name], wire[b_name]))
    return model.eval()


def _push(url, named, version):
    body = {"serialized_named_tensors": [weight_wire.serialize(list(named.items()))], "flush_cache": True,
            "weight_version": version}
    return http(url, "/update_weights_from_tensor", body)


def test_adapter_push_is_merged_onto_the_base_each_time(fresh_engine, hf_model):
    url = fresh_engine.url
    first, second = _adapters(hf_model, 0), _adapters(hf_model, 1)
    names = list(first)
    assert http(url, "/begin_weight_update", {})[1]["success"] is True
    for bucket in (names[:1], names[1:]):  # q_proj's A alone, then its B with down_proj's pair
        status, out = _push(url, {n: first[n] for n in bucket}, "v1")
        assert status == 200 and out["success"] is True, out
    assert http(url, "/end_weight_update", {})[1]["success"] is True
    assert_serves(url, _served(hf_model, first), "v1")
    assert http(url, "/begin_weight_update", {})[1]["success"] is True
    assert _push(url, second, "v2")[1]["success"] is True
    assert http(url, "/end_weight_update", {})[1]["success"] is True
    assert_serves(url, _served(hf_model, second), "v2")  # the base plus the new adapter, not plus both


def test_an_adapter_that_does_not_fit_is_refused_and_changes_nothing(fresh_engine, hf_model):
    url = fresh_engine.url
    a_name, b_name = adapter_names(ADAPTED[0])
    out_dim, in_dim = hf_model.get_parameter(ADAPTED[0]).shape
    bad = [({a_name: torch.zeros(4, in_dim + 1)}, f"lora_A of shape (4, {in_dim + 1}), not float [rank, {in_dim}]"),
           ({a_name: torch.zeros(4, in_dim), b_name: torch.zeros(out_dim, 3)}, "lora_A of rank 4 and lora_B of rank 3"),
           ({"model.layers.0.input_layernorm.lora_A.weight": torch.zeros(4, in_dim)}, "is not a matrix"),
           ({"model.nope.lora_A.weight": torch.zeros(4, in_dim)}, "model.nope.weight")]
    for named, said in bad:
        status, out = _push(url, named, "v1")
        assert status == 400 and out["success"] is False and said in out["message"], out
    assert_serves(url, hf_model, "default")


def test_a_refused_adapter_half_never_pairs_with_a_later_one(fresh_engine, hf_model):
    """Halves come in different buckets: a lora_B whose rank does not fit the lora_A waiting for it is refused, and
    leaves nothing waiting that a later half could pair with (a later valid push was merged with the refused half
    and answered 200); a session that ends with a half waiting (an interrupted push) fails, naming the weight, and
    the engine serves "partial" (that weight keeps its earlier adapter) until a complete push; the half is dropped
    when the next session begins."""
    url = fresh_engine.url
    a_name, b_name = adapter_names(ADAPTED[0])
    good = _adapters(hf_model, 0)
    out_dim = hf_model.get_parameter(ADAPTED[0]).shape[0]
    assert _push(url, {a_name: good[a_name]}, "v1")[0] == 200  # rank 4, waiting for its B
    status, out = _push(url, {b_name: torch.zeros(out_dim, 8)}, "v1")
    assert status == 400 and "lora_A of rank 4 and lora_B of rank 8" in out["message"], out
    assert http(url, "/begin_weight_update", {})[1]["success"] is True  # the next push: its own A waits no more
    stale_b = {b_name: torch.ones(out_dim, 4)}
    assert _push(url, stale_b, "v2")[0] == 200  # an interrupted push: only its B arrived
    status, out = http(url, "/end_weight_update", {})
    assert status == 400 and out["success"] is False, out
    assert f"adapters of {ADAPTED[0]} came with one half" in out["message"], out
    assert http(url, "/get_weight_version")[1]["weight_version"] == "partial"
    assert http(url, "/begin_weight_update", {})[1]["success"] is True
    for bucket in ([a_name], [n for n in good if n != a_name]):  # the complete push, A first
        assert _push(url, {n: good[n] for n in bucket}, "v3")[0] == 200
    assert http(url, "/end_weight_update", {})[1]["success"] is True
    assert_serves(url, _served(hf_model, good), "v3")  # good A with good B, not with the stale B
