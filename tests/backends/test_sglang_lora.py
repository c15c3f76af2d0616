"""LoRA with --rollout-backend sglang: the launch flags, the push's bodies and the /generate body checked by SGLang's
own code (tests/sglang_oracle.py, the pinned release), then whole pushes against the FAKE SGLang server
(tests/fakes/fake_sglang_server.py, which keeps adapters by name and refuses a /generate naming one it lacks)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slime_lite.args import parse_args
from slime_lite.backends.megatron import weight_push
from slime_lite.backends.megatron.lora_config import LoraSettings
from slime_lite.backends.sglang import launcher
from slime_lite.config import EngineConfig
from slime_lite.engine_client import AsyncEngineClient, lora_adapter_name, request_json
from slime_lite.errors import EngineError, SlimeLiteError
from slime_lite.io import free_port
from tests import sglang_oracle as oracle

REPO = Path(__file__).resolve().parents[2]
SEVEN = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture()
def flags(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "addition",
            "--rollout-backend", "sglang", "--lora-rank", "16"]


def _adapters(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.0.self_attn.{p}.weight": (torch.randn(4, 8, generator=g), torch.randn(8, 4, generator=g))
            for p in ("q_proj", "o_proj")}


# ---- SGLang's own code --------------------------------------------------------------------------------------
@pytest.mark.parametrize("targets, expected", [([], SEVEN), (["linear_qkv", "o_proj"], {"q_proj", "k_proj", "v_proj",
                                                                                           "o_proj"})])
def test_sglang_parses_the_lora_launch_flags(flags, targets, expected):
    oracle.require_sglang()
    oracle.sglang_module("sglang.srt.server_args")  # the launcher's parser check finds the real module
    args = parse_args(flags + (["--lora-target-modules", *targets] if targets else []))
    served = oracle.parse_server_args(launcher.build_command(EngineConfig.from_args(args), 0, 31000)[3:])
    assert served.enable_lora and served.max_lora_rank == 16 and set(served.lora_target_modules) == expected


def test_colocated_lora_engines_keep_a_cpu_copy_of_the_weights_they_release(flags):
    """Under --colocate the engines release their weights every rollout; a LoRA push sends adapters only, so the
    base weights must come back from SGLang's CPU copy (without it they came back as uninitialised memory)."""
    oracle.require_sglang()
    oracle.sglang_module("sglang.srt.server_args")
    colocated = parse_args(flags + ["--colocate"])
    served = oracle.parse_server_args(launcher.build_command(EngineConfig.from_args(colocated), 0, 31000)[3:])
    assert served.enable_memory_saver and served.enable_weights_cpu_backup and served.enable_lora
    apart = oracle.parse_server_args(launcher.build_command(EngineConfig.from_args(parse_args(flags)), 0, 31000)[3:])
    assert not apart.enable_weights_cpu_backup  # full-weight pushes, or weights never released: no copy needed


def test_lora_flags_sglang_gets_from_us_or_cannot_serve_are_refused(flags):
    oracle.require_sglang()
    oracle.sglang_module("sglang.srt.server_args")
    with pytest.raises(SlimeLiteError, match="--sglang-max-lora-rank: slime-lite sets --max-lora-rank"):
        parse_args(flags + ["--sglang-max-lora-rank", "64"])
    with pytest.raises(SlimeLiteError, match="--lora-rank with --sglang-dp-size above 1"):  # SGLang asserts it
        parse_args(flags + ["--sglang-dp-size", "2"])
    # a push loads the new adapter before unloading the old: SGLang refuses that load when it may hold only one
    with pytest.raises(SlimeLiteError, match="--sglang-max-loaded-loras 1 with --lora-rank: .* give 2 or more"):
        parse_args(flags + ["--sglang-max-loaded-loras", "1", "--sglang-max-loras-per-batch", "1"])
    parse_args(flags + ["--sglang-max-loaded-loras", "2", "--sglang-max-loras-per-batch", "1"])


def test_push_and_generate_bodies_are_sglangs_requests(tmp_path, monkeypatch):
    import pydantic

    oracle.require_sglang()
    io = oracle.sglang_module("sglang.srt.managers.io_struct")
    classes = {"/load_lora_adapter": io.LoadLoRAAdapterReqInput, "/unload_lora_adapter": io.UnloadLoRAAdapterReqInput,
               "/update_weight_version": io.UpdateWeightVersionReqInput}
    sent = []
    monkeypatch.setattr(weight_push, "request_json", lambda url, route, body, **kw: sent.append((route, body)))
    monkeypatch.setattr(weight_push, "_lora_loaded", {})
    args = SimpleNamespace(save=str(tmp_path), hf_checkpoint=str(tmp_path), debug_inject_fault=None)
    for version in (1, 2):
        weight_push.push_lora_to_sglang(args, _adapters(version), LoraSettings(4, 8.0, 0.0, ()), ["http://e"],
                                        version, _adapters(version), None)
    assert [r for r, _ in sent] == ["/load_lora_adapter", "/update_weight_version", "/load_lora_adapter",
                                    "/update_weight_version", "/unload_lora_adapter"]
    assert {("POST", r) for r in classes} <= oracle.route_table()
    reqs = [pydantic.TypeAdapter(classes[r]).validate_python(b) for r, b in sent]
    assert reqs[2].lora_name == lora_adapter_name(2) and reqs[4].lora_name == lora_adapter_name(1)
    assert reqs[2].lora_path == str(tmp_path / "lora_push" / "v2") and not (tmp_path / "lora_push" / "v1").exists()

    # an engine restarted by --use-fault-tolerance at the same URL holds no adapter: version 2 is loaded again and
    # nothing is unloaded (unloading the name just loaded would leave it with none)
    del sent[:]
    weight_push.push_lora_to_sglang(args, _adapters(2), LoraSettings(4, 8.0, 0.0, ()), ["http://e"], 2,
                                    _adapters(2), None, restarted=True)
    assert [(r, b.get("lora_name")) for r, b in sent] == [("/load_lora_adapter", lora_adapter_name(2)),
                                                          ("/update_weight_version", None)]

    # without --save the folder is this host's temporary one, removed once the engines loaded it (it was left
    # behind at every run's exit)
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    loaded = []
    monkeypatch.setattr(weight_push, "request_json", lambda url, route, body, **kw: loaded.append(
        os.path.isfile(os.path.join(body["lora_path"], "adapter_model.safetensors")) if "lora_path" in body else None))
    weight_push.push_lora_to_sglang(SimpleNamespace(save=None, hf_checkpoint=str(tmp_path), debug_inject_fault=None),
                                    _adapters(3), LoraSettings(4, 8.0, 0.0, ()), ["http://e"], 3, _adapters(3), None)
    assert loaded[0] is True and os.listdir(tmp_path / "tmp") == []

    class Capture(AsyncEngineClient):
        async def post(self, url, route, body):
            sent.append((route, body))

    client = Capture(["http://e"])
    client.lora_path = lora_adapter_name(2)
    asyncio.run(client.generate({"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 2}}))
    assert oracle.validate_generate(sent[-1][1]).lora_path == [lora_adapter_name(2)] * 2


# ---- the FAKE SGLang server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fake_lora_server(tiny_model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.fakes.fake_sglang_server", "--model-path",
                             str(tiny_model_dir), "--port", str(port), "--enable-lora", "--max-lora-rank", "4"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                request_json(url, "/health", timeout=2)
                break
            except EngineError:
                assert proc.poll() is None, "the fake SGLang server exited"
                asyncio.run(asyncio.sleep(0.25))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_each_push_loads_a_new_adapter_that_rollouts_name_and_unloads_the_old(fake_lora_server, tiny_model_dir,
                                                                              tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setattr(weight_push, "_lora_loaded", {})
    url, settings = fake_lora_server, LoraSettings(4, 8.0, 0.0, ())
    args = SimpleNamespace(save=str(tmp_path), hf_checkpoint=str(tiny_model_dir), debug_inject_fault=None)
    base = load_file(str(tiny_model_dir / "model.safetensors"))  # the engine's base weights: the check reads them
    for version in (1, 2):
        times = weight_push.push_lora_to_sglang(args, _adapters(version), settings, [url], version,
                                                _adapters(version), base)
        assert "perf/update_weights/check_time" in times
    assert request_json(url, "/get_server_info", timeout=10)["weight_version"] == "2"

    async def generate(name):
        client = AsyncEngineClient([url], max_retries=0)
        client.lora_path = name
        try:
            return await client.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        finally:
            await client.close()

    assert asyncio.run(generate(lora_adapter_name(2)))["meta_info"]["completion_tokens"] == 2
    with pytest.raises(EngineError, match="is not loaded"):  # the previous push's adapter is gone
        asyncio.run(generate(lora_adapter_name(1)))
    with pytest.raises(SlimeLiteError, match="does not hold the trainer's adapter"):  # a push that sent the wrong one
        weight_push.push_lora_to_sglang(args, _adapters(7), settings, [url], 3, _adapters(3), base)
