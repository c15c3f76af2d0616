"""slime's --only-train-params-name-list / --freeze-params-name-list on a live Megatron-core GPTModel (CPU, gloo):
the matched parameters keep their values through DDP + Megatron's Adam steps, the others train; the flags' rules
are checked when they are parsed."""

from __future__ import annotations

import pytest
import torch

from slime_lite.args import parser_defaults
from slime_lite.args_train import check_slime_train_flags
from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def single_rank():
    from slime_lite.backends.megatron import parallel

    parallel.init_distributed(1, 1, 0, 1, "127.0.0.1", free_port(), seed=3)
    yield
    parallel.destroy()


def _train(model, vocab: int, distributed: bool) -> None:
    """Two steps of DDP + Megatron's Adam, as the train worker wraps the model after freezing it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = model.config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, params_dtype=torch.float32,
                                                 use_distributed_optimizer=distributed), [ddp])
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, ddp.no_sync
    x = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))

    def forward_step(data, m):
        t = next(data)
        out = m(t, torch.arange(t.shape[1]).expand_as(t), None, runtime_gather_output=True)
        return out, lambda logits: ((loss := -torch.log_softmax(logits[:, :-1], -1).gather(
            -1, t[:, 1:, None]).mean()), {"loss": loss.detach()})

    for _ in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([x]), model=[ddp],
                                    num_microbatches=1, seq_length=16, micro_batch_size=2)
        assert opt.step()[0]


@pytest.mark.parametrize("only, freeze, distributed", [(None, [r"embedding", r"layers\.0\."], False),
                                                      ([r"layers\.1\.mlp"], None, True)])
def test_matched_parameters_stay_and_the_others_train(single_rank, tiny_model_dir, only, freeze, distributed):
    from transformers import AutoConfig

    from slime_lite.backends.megatron.convert import load_hf_weights
    from slime_lite.backends.megatron.freeze import freeze_by_name
    from slime_lite.backends.megatron.model import build_gpt_model

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    model = build_gpt_model(cfg)
    load_hf_weights(model, str(tiny_model_dir), cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = freeze_by_name(model, only, freeze)
    names = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == len(names) > 0 and len(names) < len(before)
    if freeze:
        assert any("embedding" in n for n in names) and all("layers.1." not in n for n in names)
    else:
        assert all("layers.1.mlp" not in n for n in names)
    _train(model, cfg.vocab_size, distributed)  # distributed: the optimizer of --optimizer-cpu-offload runs under
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p) == (n in names), n  # frozen: unchanged; the rest trained
    with pytest.raises(SlimeLiteError, match="--freeze-params-name-list . leaves no parameter to train"):
        freeze_by_name(model, None, ["."])


@pytest.mark.parametrize("kw, error", [
    (dict(only_train_params_name_list=["a"], freeze_params_name_list=["b"]), "give one of them"),
    (dict(freeze_params_name_list=["embedding"], lora_rank=8), "with --lora-rank"),
    (dict(only_train_params_name_list=["(unclosed"]), "is not a Python regex"),
])
def test_the_flags_rules_are_checked_when_parsed(kw, error):
    with pytest.raises(SlimeLiteError, match=error):
        check_slime_train_flags(parser_defaults(**kw))


def test_an_empty_list_freezes_nothing_as_in_slime():
    from slime_lite.backends.megatron.freeze import freeze_by_name

    model = torch.nn.Linear(2, 2)
    assert freeze_by_name(model, [], None) == 0 and all(p.requires_grad for p in model.parameters())
    check_slime_train_flags(parser_defaults(freeze_params_name_list=[]))
