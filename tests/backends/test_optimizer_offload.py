"""--optimizer-cpu-offload (Megatron's hybrid CPU optimizer): its flag rules and the refusal on a machine without
CUDA (CPU); on a GPU (scripts/test-gpu.sh), a bf16 tiny model trains with the optimizer state in host memory as it
does with the state on the GPU, through --offload-train's offload/onload and a checkpoint resume."""

from __future__ import annotations

import pytest
import torch

from slime_lite.args import parse_args, parser_defaults
from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"]


@pytest.mark.parametrize("flags, needle", [
    (["--overlap-cpu-optimizer-d2h-h2d"], "--overlap-cpu-optimizer-d2h-h2d .* needs --optimizer-cpu-offload"),
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer on its own needs Transformer Engine"),
    (["--optimizer-cpu-offload"], "Megatron requires --use-precision-aware-optimizer with it"),
    (OFFLOAD + ["--optimizer-offload-fraction", "0"], "--optimizer-offload-fraction 0.0: .* must be in"),
    (OFFLOAD + ["--lora-rank", "4"], "--optimizer-cpu-offload with --lora-rank is not supported"),
])
def test_offload_flag_rules_name_the_flag_and_the_fix(tiny_model_dir, flags, needle):
    base = ["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tiny_model_dir / "config.json"),
            "--rm-type", "addition"]
    with pytest.raises(SlimeLiteError, match=needle):
        parse_args(base + flags)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal; the GPU path is tested below")
def test_offload_is_refused_without_cuda_before_ray_starts(tiny_model_dir):
    from slime_lite.preflight import check_profiling_device

    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), optimizer_cpu_offload=True,
                           use_precision_aware_optimizer=True)
    with pytest.raises(SlimeLiteError, match="--optimizer-cpu-offload .* needs CUDA.*no CUDA device"):
        check_profiling_device(args)


def _samples(n: int = 8) -> list:
    from slime_lite.types import Sample, Status

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        resp = 4 + 3 * i
        toks = torch.randint(1, 60, (8 + resp,), generator=g).tolist()
        out.append(Sample(group_index=i // 4, index=i, tokens=toks, response_length=resp, loss_mask=[1] * resp,
                          reward=float(i % 2), status=Status.COMPLETED))
    return out


def _worker(model_dir, offload: bool, **extra):
    from slime_lite.backends.megatron.actor import TrainActor

    args = parser_defaults(hf_checkpoint=str(model_dir), bf16=True, rollout_batch_size=2, n_samples_per_prompt=4,
                           global_batch_size=4, micro_batch_size=2, lr=1e-4, seed=3, optimizer_cpu_offload=offload,
                           use_precision_aware_optimizer=offload, overlap_cpu_optimizer_d2h_h2d=offload, **extra)
    w = TrainActor(args, 0, 1, "127.0.0.1")
    w.init(free_port())
    return w


def _run(w, rollouts) -> list[tuple[float, float]]:
    out = []
    for i in rollouts:
        m = w.train(i, _samples(), None)[0].metrics
        out.append((m["train/loss"], m["train/grad_norm"]))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_cpu_optimizer_trains_like_the_gpu_one_through_offload_and_resume(tiny_model_dir, tmp_path):
    from slime_lite.backends.megatron import checkpoint
    from slime_lite.backends.megatron.parallel import destroy

    w = _worker(tiny_model_dir, False)
    ref = _run(w, range(3))
    destroy()
    w = _worker(tiny_model_dir, True)
    got = _run(w, range(2))
    state = [t for opt in getattr(w.optimizer, "chained_optimizers", [w.optimizer])
             for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    assert state and all(t.device.type == "cpu" for t in state)  # the Adam moments live in host memory
    checkpoint.save(w, str(tmp_path / "ckpt"), 1, None)
    w.offload()  # --offload-train: the weights (views of DDP's parameter buffer) leave the GPU and come back
    w.onload()
    got += _run(w, [2])
    destroy()
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):  # bf16: the same steps, within rounding
        assert loss == pytest.approx(ref_loss, rel=0.05, abs=1e-3) and norm == pytest.approx(ref_norm, rel=0.05)
    w = _worker(tiny_model_dir, True, load=str(tmp_path / "ckpt"))  # resume: master weights and moments restored
    resumed = _run(w, [2])
    destroy()
    assert resumed[0] == pytest.approx(got[2], rel=1e-3)
