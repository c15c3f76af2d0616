"""backends/megatron/{cpu_compat,parallel,model,convert}.py on a live Megatron-core GPTModel (CPU, gloo).

The trainer's log-probs equal the engine's only if the Megatron model computes what the HF model computes: the
logits must agree to fp32 rounding, with any TP/PP layout, and the weights read back must be the checkpoint's.
"""

from __future__ import annotations

import os

import pytest
import torch

from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

torch.set_num_threads(1)


def hf_model(path_or_config, perturb: float = 0.0, seed: int = 0):
    """An HF model in float32 with eager attention; random weights get `perturb` noise (non-zero biases too)."""
    from transformers import AutoModelForCausalLM

    if isinstance(path_or_config, (str, os.PathLike)):
        model = AutoModelForCausalLM.from_pretrained(str(path_or_config), attn_implementation="eager",
                                                     dtype=torch.float32)
    else:
        path_or_config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(path_or_config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * perturb)
    return model.float().eval()


def tokens(vocab: int, batch: int = 3, seq: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def single_rank():
    """This test process as a one-rank Megatron job (TP=1, PP=1, gloo)."""
    from slime_lite.backends.megatron import parallel

    parallel.init_distributed(1, 1, 0, 1, "127.0.0.1", free_port(), seed=3)
    yield
    parallel.destroy()


def test_transformer_config_is_derived_from_config_json(tiny_model_dir):
    from transformers import AutoConfig

    from slime_lite.backends.megatron.model import transformer_config_from_hf

    hf = AutoConfig.from_pretrained(tiny_model_dir)
    c = transformer_config_from_hf(hf, tp=2, pp=2)
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.ffn_hidden_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.intermediate_size)
    assert c.kv_channels == hf.hidden_size // hf.num_attention_heads
    assert c.normalization == "RMSNorm" and c.layernorm_epsilon == hf.rms_norm_eps
    assert c.gated_linear_unit and c.activation_func is torch.nn.functional.silu
    assert c.add_qkv_bias and not c.add_bias_linear  # Qwen2: bias on q/k/v only
    assert c.hidden_dropout == 0.0 and c.attention_dropout == 0.0
    assert (c.tensor_model_parallel_size, c.pipeline_model_parallel_size) == (2, 2)
    with pytest.raises(SlimeLiteError, match="--tensor-model-parallel-size 3"):
        transformer_config_from_hf(hf, tp=3)


def test_transformer_engine_requested_but_missing_gives_the_install_hint(tiny_model_dir):
    from transformers import AutoConfig

    from slime_lite.backends.megatron.model import hf_arch, layer_spec

    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine is installed here")
    except ImportError:
        pass
    with pytest.raises(SlimeLiteError, match="pip install .*transformer_engine"):
        layer_spec(hf_arch(AutoConfig.from_pretrained(tiny_model_dir)), "transformer_engine")


def test_cpu_patches_stay_inside_megatron(single_rank):
    import megatron.core.utils
    from megatron.core.optimizer import optimizer as mcore_optimizer

    from slime_lite.backends.megatron import cpu_compat

    assert cpu_compat.apply() and cpu_compat.apply()  # idempotent: wrapped once
    assert not hasattr(mcore_optimizer.clip_grad_by_total_norm_fp32.__wrapped__, "__wrapped__")
    assert megatron.core.utils.torch.cuda.current_device() == "cpu"
    with pytest.raises((AssertionError, RuntimeError)):  # everyone else still sees the real torch.cuda
        torch.cuda.current_device()
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_tiny_model_logits_equal_hf(single_rank, tiny_model_dir):
    from transformers import AutoConfig

    from slime_lite.backends.megatron.convert import load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model, forward_logits

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    model = build_gpt_model(cfg)
    load_hf_weights(model, str(tiny_model_dir), cfg)
    hf = hf_model(tiny_model_dir)
    x = tokens(cfg.vocab_size)
    with torch.no_grad():
        got, want = forward_logits(model.eval(), x), hf(x).logits
    assert got.shape == want.shape == (3, 24, cfg.vocab_size)
    assert (got - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="right-pad"):
        forward_logits(model, x, position_ids=torch.arange(24).expand(3, 24) + 1)


def llama3_rope_config():
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    return LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, intermediate_size=96, tie_word_embeddings=True,
                       max_position_embeddings=16384, rope_parameters=rope)


def qwen3_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, intermediate_size=96)


def glm4_config():  # partial interleaved rotary (a quarter of each head: 6 of 24 dims), qkv bias, post norms
    from transformers import Glm4Config

    return Glm4Config(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
                      num_key_value_heads=2, head_dim=24, intermediate_size=96, partial_rotary_factor=0.25)


@pytest.mark.parametrize("make_config", [llama3_rope_config, qwen3_config, glm4_config],
                         ids=["llama_tied_llama3rope", "qwen3", "glm4"])
def test_other_architectures_logits_equal_hf(single_rank, make_config):
    from slime_lite.backends.megatron.convert import load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model, forward_logits

    cfg = make_config()
    hf = hf_model(cfg, perturb=0.3)
    model = build_gpt_model(cfg)
    load_hf_weights(model, hf.state_dict(), cfg)
    x = tokens(100, batch=2, seq=160)
    with torch.no_grad():
        got, want = forward_logits(model.eval(), x), hf(x).logits
    print("max |logit diff|", (got - want).abs().max().item(), "max |logit|", want.abs().max().item())
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    if make_config is llama3_rope_config:  # guard: at this length the llama3 scaling changes the logits
        cfg_plain = llama3_rope_config()
        cfg_plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
        hf_plain = hf_model(cfg_plain)
        hf_plain.load_state_dict(hf.state_dict())
        with torch.no_grad():
            assert (hf_plain(x).logits - want).abs().max().item() > 1e-2


def test_iter_hf_weights_gives_back_the_checkpoint(single_rank, tiny_model_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from slime_lite.backends.megatron.convert import iter_hf_weights, load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    model = build_gpt_model(cfg)
    load_hf_weights(model, str(tiny_model_dir), cfg)
    ckpt = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    got = dict(iter_hf_weights(model, cfg))
    assert sorted(got) == sorted(ckpt)
    assert all(torch.equal(got[k], ckpt[k]) for k in ckpt)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_megatron_ddp_optimizer_and_schedule_train_on_cpu(single_rank, tiny_model_dir, distributed_optimizer):
    """What the train actor builds on: DDP + Megatron's Adam + the forward/backward schedule, all on CPU."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from transformers import AutoConfig

    from slime_lite.backends.megatron.convert import load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model, unwrap

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    model = build_gpt_model(cfg)
    load_hf_weights(model, str(tiny_model_dir), cfg)
    config = model.config
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer),
        model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, params_dtype=torch.float32,
                        use_distributed_optimizer=distributed_optimizer), [ddp])
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, ddp.no_sync
    before = {n: p.detach().clone() for n, p in unwrap(ddp).named_parameters()}
    x = tokens(cfg.vocab_size, batch=2, seq=16)

    def forward_step(data, m):
        t = next(data)
        out = m(t, torch.arange(t.shape[1]).expand_as(t), None, runtime_gather_output=True)

        def loss_fn(logits):
            loss = -torch.log_softmax(logits[:, :-1], -1).gather(-1, t[:, 1:, None]).mean()
            return loss, {"loss": loss.detach()}

        return out, loss_fn

    losses, norms = [], []
    for _ in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([x]), model=[ddp],
                                          num_microbatches=1, seq_length=16, micro_batch_size=2)
        ok, grad_norm, _ = opt.step()
        assert ok
        losses.append(res[0]["loss"].item())
        norms.append(grad_norm)
    assert losses[2] < losses[0] and all(0 < n < float("inf") for n in norms)
    assert all(not torch.equal(before[n], p) for n, p in unwrap(ddp).named_parameters())


# ------------------------------------------------------------------------- several processes (torch spawn + gloo)

def _spawned_rank(rank: int, world: int, tp: int, pp: int, port: int, model_dir: str, ref_path: str) -> None:
    torch.set_num_threads(1)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from transformers import AutoConfig

    from slime_lite.backends.megatron import parallel
    from slime_lite.backends.megatron.convert import iter_hf_weights, load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model, forward_logits

    ref = torch.load(ref_path, weights_only=True)
    cfg = AutoConfig.from_pretrained(model_dir)
    parallel.init_distributed(tp, pp, rank, world, "127.0.0.1", port)
    try:
        model = build_gpt_model(cfg)
        load_hf_weights(model, model_dir, cfg)
        got = dict(iter_hf_weights(model, cfg))
        wrong = [k for k, v in got.items() if not torch.equal(v, ref["state"][k])]
        assert not wrong, f"rank {rank}: iter_hf_weights differs from the checkpoint for {wrong}"
        torch.save(sorted(got), f"{ref_path}.names{rank}")
        model.eval()
        x = ref["tokens"]
        with torch.no_grad():
            if pp == 1:
                logits = forward_logits(model, x)
            else:
                def step(data, m):
                    t = next(data)
                    out = m(t, torch.arange(t.shape[1]).expand_as(t), None, runtime_gather_output=True)
                    return out, lambda out, non_loss_data=False: out

                res = get_forward_backward_func()(
                    forward_step_func=step, data_iterator=iter([x]), model=[model], num_microbatches=1,
                    seq_length=x.shape[1], micro_batch_size=x.shape[0], forward_only=True, collect_non_loss_data=True)
                logits = res[0][..., : cfg.vocab_size] if parallel_state.is_pipeline_last_stage() else None
        if logits is not None:
            diff = (logits - ref["logits"]).abs().max().item()
            assert diff < 1e-5, f"rank {rank}: logits differ from HF by {diff}"
    finally:
        parallel.destroy()


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,tied,arch", [(2, 1, False, "qwen2"), (1, 2, False, "qwen2"), (2, 2, True, "qwen2"),
                                             (2, 1, False, "glm4")])
def test_tp_pp_layouts_build_load_and_match_hf(tiny_model_dir, tmp_path, tp, pp, tied, arch):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from slime_lite.tiny_model import make_tiny_model

    model_dir = str(tiny_model_dir)
    if tied or arch != "qwen2":
        model_dir = str(tmp_path / "model")
        make_tiny_model(model_dir, warm_start_steps=0, tie_word_embeddings=tied, arch=arch)
    hf = hf_model(model_dir)
    x = tokens(hf.config.vocab_size)
    with torch.no_grad():
        logits = hf(x).logits
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    ref_path = str(tmp_path / "ref.pt")
    torch.save({"state": state, "tokens": x, "logits": logits}, ref_path)
    mp.spawn(_spawned_rank, args=(tp * pp, tp, pp, free_port(), model_dir, ref_path), nprocs=tp * pp)
    # ranks are numbered tp-fastest: rank = pp_rank * tp + tp_rank; every TP rank of a stage yields the same names
    stages = [[torch.load(f"{ref_path}.names{p * tp + t}", weights_only=True) for t in range(tp)] for p in range(pp)]
    assert all(names == stage[0] for stage in stages for names in stage)
    everything = [n for stage in stages for n in stage[0]]
    assert sorted(everything) == sorted(state)  # each weight from exactly one stage, nothing missing
