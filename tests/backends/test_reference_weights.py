"""The reference model's pass (one in-process Megatron rank, no Ray): the parameters take the start weights' storage
for the pass and get their own back afterwards, bit for bit and as the same views of Megatron's parameter buffer;
the reference log-probs after a step are the first step's. On CPU (float32) the host copy is used as is; on CUDA
(marked gpu, bf16) the copy to the GPU is started on a side stream before the actor's pass (``_stage_ref``)."""

from __future__ import annotations

import pytest
import torch

from slime_lite.io import free_port

pytestmark = pytest.mark.slow

FLAGS = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--use-kl-loss",
         "--kl-loss-coef", "0.1", "--lr", "1e-3", "--seed", "7"]


def _check_reference_pass(model_dir, dumps, *extra) -> None:
    from slime_lite.args import parse_args
    from slime_lite.backends.megatron import optimizer_ops
    from slime_lite.backends.megatron.actor import TrainActor
    from slime_lite.backends.megatron.parallel import destroy
    from slime_lite.rollout.dumps import dump_path, load_rollout_dump

    worker = TrainActor(parse_args(["--load-debug-rollout-data", dumps, "--hf-checkpoint", str(model_dir), *FLAGS,
                                    *extra]), 0, 1)
    try:
        worker.init("127.0.0.1", free_port())
        # the trainer's Adam: found inside Megatron's optimizer, and on CUDA switched to torch's fused kernel
        adams = optimizer_ops.torch_adams(worker.optimizer)
        assert adams and all(bool(g["fused"]) == torch.cuda.is_available() for a in adams for g in a.param_groups)
        samples = load_rollout_dump(dump_path(dumps, 0)).samples
        first = worker.train(0, samples, None)[0].metrics
        assert first["rollout/kl"] == 0.0  # the reference is the start weights
        params = dict(worker.gpt().named_parameters())
        trained = {n: p.detach().clone() for n, p in params.items()}
        ptrs = {n: p.data_ptr() for n, p in params.items()}
        assert any(not torch.equal(trained[n], worker.ref_state[n].to(trained[n].device)) for n in params)

        def inside() -> dict:
            return {n: p.detach().clone() for n, p in params.items()}

        seen = worker._with_ref_weights(inside, worker._stage_ref())
        for n in params:  # during the pass: the start weights; after it: the trained ones, in their own storage
            assert torch.equal(seen[n], worker.ref_state[n].to(seen[n].device)), n
            assert torch.equal(params[n], trained[n]) and params[n].data_ptr() == ptrs[n], n
        second = worker.train(0, samples, None)[0].metrics  # the same samples again, under the moved weights
        assert second["rollout/ref_log_probs"] == first["rollout/log_probs"]
        assert second["rollout/log_probs"] != first["rollout/log_probs"] and second["rollout/kl"] != 0.0
        assert all(p.data_ptr() == ptrs[n] for n, p in params.items())
    finally:
        destroy()


def test_reference_pass_swaps_the_start_weights_in_and_out_on_cpu(tiny_model_dir, replay_dumps):
    _check_reference_pass(tiny_model_dir, replay_dumps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reference_pass_with_the_copy_overlapped_on_a_gpu(medium_model):
    _check_reference_pass(*medium_model, "--bf16")
