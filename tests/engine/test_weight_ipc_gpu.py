"""The colocated CUDA-IPC weight push on a GPU (skipped without CUDA): the trainer's tensor transport hands an engine
in another process on the same GPU CUDA IPC handles in SGLang's flattened_bucket format (payloads of a few hundred
bytes, no tensor bytes on the wire); the engine then holds exactly the trainer's tensors (checksums) and samples with
them (its log-probs are those of an HF forward of the new weights)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import generate, hf_logprobs, http

from slime_lite.io import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPT = [10, 11, 12, 13]


@pytest.fixture(scope="module")
def gpu_engine(tiny_model_dir):
    """``slime-lite serve`` on the GPU, in its own process (as a colocated engine runs: a Ray actor)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "slime_lite.cli", "serve", "--model-path", str(tiny_model_dir),
                             "--port", str(port), "--device", "cuda", "--dtype", "float32"],
                            cwd=Path(__file__).resolve().parents[2])
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, "engine exited"
        try:
            if http(url, "/health", timeout=5)[0] == 200:
                break
        except OSError:  # not listening yet
            pass
        assert time.time() < deadline, "engine did not start within 300 s"
        time.sleep(1)
    yield url
    proc.terminate()
    proc.wait(60)


def test_colocated_push_by_cuda_ipc(gpu_engine, tiny_model_dir, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from slime_lite.backends.megatron import weight_push

    url = gpu_engine
    gen = torch.Generator().manual_seed(7)
    cpu = {n: t + torch.randn(t.shape, generator=gen) * 0.05
           for n, t in load_file(str(Path(tiny_model_dir) / "model.safetensors")).items()}
    named = {n: t.cuda() for n, t in cpu.items()}
    assert weight_push.payload_mode(url, named, True, 1 << 20) == "cuda_ipc"
    sent = []
    real = weight_push.request_json
    monkeypatch.setattr(weight_push, "request_json",
                        lambda u, r, body=None, **k: sent.append((r, body)) or real(u, r, body, **k))
    from slime_lite.args import parser_defaults

    # the whole namespace of the train command (a hand-made one missed each flag the push learned later)
    args = parser_defaults(update_weight_transport="tensor", colocate=True, rollout_backend="embedded",
                           rollout_num_gpus_per_engine=1, update_weight_buffer_size=1 << 20,
                           check_weight_update_equal=True)  # the checksum of every parameter, after the push
    weight_push.push(args, named, [url], 3)
    posts = [b for r, b in sent if r == "/update_weights_from_tensor"]
    bucket_bytes = sum(t.numel() * t.element_size() for t in cpu.values()) / len(posts)
    assert len(posts) >= 2 and bucket_bytes > 100_000
    assert all(len(b["serialized_named_tensors"][0]) < 8_000 for b in posts)  # handles, not the tensors' bytes
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    model.load_state_dict(cpu, strict=False)
    out = generate(url, input_ids=PROMPT, return_logprob=True,
                   sampling_params={"max_new_tokens": 8, "temperature": 0.8, "ignore_eos": True})
    lps = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    ref = hf_logprobs(model, PROMPT, out["output_ids"], 0.8)
    assert max(abs(a - b) for a, b in zip(lps, ref)) < 1e-3  # GPU vs CPU float32 kernels
    assert out["meta_info"]["weight_version"] == "3"


class _ForgedView:
    """A CUDA IPC handle of a real tensor with a forged view (``size``) or a forged storage size in bytes."""

    def __init__(self, tensor: torch.Tensor, size: int | None = None, storage_bytes: int | None = None) -> None:
        from torch.multiprocessing import reductions

        from slime_lite.weight_wire import device_uuid

        self.fn, args = reductions.reduce_tensor(tensor)
        args = list(args)
        args[6] = device_uuid(args[6])
        if size is not None:
            args[1] = torch.Size([size])
        if storage_bytes is not None:
            args[8] = storage_bytes
        self.args = tuple(args)

    def __reduce__(self):  # noqa: ANN204
        return self.fn, self.args


def test_cuda_ipc_view_past_its_storage_is_refused(gpu_engine):
    """The caching allocator's block holds more than the tensor: a view past the declared storage would read the
    sender's other memory, and a storage declared past the allocation memory that is not mapped at all (an illegal
    memory access). Each is a 400 naming the parameter, and the engine's weights stay as they were."""
    from slime_lite import weight_wire

    url, name = gpu_engine, "model.norm.weight"
    before = http(url, "/get_weights_checksum", {})[1]
    small = torch.full((8,), 7.0, device="cuda")
    spare = torch.full((1024,), 9.0, device="cuda")  # likely next to it in the same block
    status, out = http(url, "/update_weights_from_tensor",
                       {"serialized_named_tensors": [weight_wire.serialize([(name, _ForgedView(small, size=128))])]})
    assert status == 400 and f"'{name}'" in out["message"] and "but its storage holds 8" in out["message"], out
    # a storage declared larger than the whole IPC allocation (the view inside what it declares): refused after
    # mapping, before a byte is read (the driver's allocation range)
    odd = torch.full((128,), 5.0, device="cuda")
    status, out = http(url, "/update_weights_from_tensor", {"serialized_named_tensors": [weight_wire.serialize(
        [(name, _ForgedView(odd, storage_bytes=1 << 40))])]})
    assert status == 400 and f"'{name}'" in out["message"] and "allocation holds" in out["message"], out
    assert http(url, "/get_weights_checksum", {})[1] == before
    del spare
