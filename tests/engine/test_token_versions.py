"""Per-token weight versions (``meta_info.output_token_weight_versions``): a request in flight across weight pushes
(pause between decode steps, update, continue: what --fully-async does, retracting the running requests) reports
which version produced each of its tokens."""

from __future__ import annotations

import time

import pytest
from engine_helpers import generate, http, in_thread, start_engine


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _generated(server) -> int:
    """Output tokens of the one running request, read in the model thread (between two steps)."""
    sch = server.scheduler
    return sch.call(lambda: sum(len(r.output_ids) for r in sch.running.values())).result(10)


def _wait_generated(server, at_least: int) -> None:
    deadline = time.monotonic() + 20
    while _generated(server) < at_least:
        assert time.monotonic() < deadline, "the request stopped generating"
        time.sleep(0.005)


def _push(server, model_dir, version: str) -> int:
    """Pause between decode steps (no abort), update the weights as ``version``, continue; the tokens generated
    before the pause."""
    assert http(server.url, "/pause_generation", {"mode": "in_place"})[0] == 200
    before = _generated(server)
    status, out = http(server.url, "/update_weights_from_disk", {"model_path": str(model_dir),
                                                                  "weight_version": version})
    assert status == 200 and out["success"], out
    assert http(server.url, "/continue_generation", {})[0] == 200
    return before


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs CUDA (captured decode steps, pipelined reads)")])])
def test_tokens_carry_the_version_that_generated_them_across_pushes(tiny_model_dir, device):
    if device == "cpu":
        server = start_engine(tiny_model_dir, max_running_requests=2)
    else:
        from slime_lite.engine.server import EngineServer

        server = EngineServer(str(tiny_model_dir), device=device, max_running_requests=2)
        server.start()
    try:
        sp = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
        t, box = in_thread(generate, server.url, input_ids=[1, 2, 3], return_logprob=True, sampling_params=sp)
        _wait_generated(server, 1)
        n1 = _push(server, tiny_model_dir, "1")
        _wait_generated(server, n1 + 3)
        n2 = _push(server, tiny_model_dir, "2")
        t.join(60)
        out = box["result"]
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 400}  # continued, not aborted
        versions = meta["output_token_weight_versions"]
        assert 1 <= n1 < n2 < 400
        assert versions == ["default"] * n1 + ["1"] * (n2 - n1) + ["2"] * (400 - n2)
        assert meta["weight_version"] == "2"
        # a request that starts after the pushes is all of the newest version
        late = generate(server.url, input_ids=[4, 5], sampling_params={**sp, "max_new_tokens": 3})
        assert late["meta_info"]["output_token_weight_versions"] == ["2", "2", "2"]
    finally:
        server.stop()


def test_a_retracting_push_recomputes_what_a_request_generated_under_the_new_weights(tiny_model_dir, tmp_path):
    """--fully-async pushes with /pause_generation mode retract: a request in flight goes back to the queue and is
    prefilled again under the new weights, so every token stamped with the new version has the new weights'
    log-prob over the whole sequence (paused in place it attended over K/V the old weights wrote: ~1e-2 off here),
    and every earlier token the old weights'."""
    import shutil

    import torch
    from engine_helpers import hf_logprobs
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    new_dir = tmp_path / "new"
    shutil.copytree(tiny_model_dir, new_dir)
    g = torch.Generator().manual_seed(0)
    for f in new_dir.glob("*.safetensors"):
        w = load_file(str(f))
        save_file({k: v + 0.05 * v.float().std() * torch.randn(v.shape, generator=g).to(v.dtype) if v.dim() == 2
                   else v for k, v in w.items()}, str(f), metadata={"format": "pt"})
    server = start_engine(tiny_model_dir, max_running_requests=2)
    try:
        sp = {"max_new_tokens": 400, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
        t, box = in_thread(generate, server.url, input_ids=[1, 2, 3], return_logprob=True, sampling_params=sp)
        _wait_generated(server, 5)
        assert http(server.url, "/pause_generation", {"mode": "retract"})[0] == 200
        status, out = http(server.url, "/update_weights_from_disk", {"model_path": str(new_dir),
                                                                      "weight_version": "1"})
        assert status == 200 and out["success"], out
        assert http(server.url, "/continue_generation", {})[0] == 200
        t.join(60)
    finally:
        server.stop()
    out = box["result"]
    meta = out["meta_info"]
    versions, ids = meta["output_token_weight_versions"], out["output_ids"]
    lps = [x[0] for x in meta["output_token_logprobs"]]
    k = versions.index("1")
    assert 5 <= k < 400 and versions == ["default"] * k + ["1"] * (400 - k)
    for model_dir, version in ((tiny_model_dir, "default"), (new_dir, "1")):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        ref = hf_logprobs(model, [1, 2, 3], ids)
        worst = max(abs(a - b) for a, b, v in zip(lps, ref, versions) if v == version)
        assert worst < 1e-4, (version, worst)
