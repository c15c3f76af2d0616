"""LoRA on the Megatron model (CPU, one gloo rank): the adapted model starts as the base, only adapters train, the
merged weights and the PEFT export give the logits the adapted Megatron model gives, and an export loads back."""

from __future__ import annotations

import pytest
import torch

from slime_lite.backends.megatron.lora_config import LoraSettings
from slime_lite.io import free_port
from slime_lite.lora_wire import merged

torch.set_num_threads(1)
ALL = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


@pytest.fixture(scope="module")
def single_rank():
    from slime_lite.backends.megatron import parallel

    parallel.init_distributed(1, 1, 0, 1, "127.0.0.1", free_port(), seed=3)
    yield
    parallel.destroy()


def _model(tiny_model_dir, settings=None, seed=5):
    from transformers import AutoConfig

    from slime_lite.backends.megatron import lora
    from slime_lite.backends.megatron.convert import load_hf_weights
    from slime_lite.backends.megatron.model import build_gpt_model

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    model = build_gpt_model(cfg)
    load_hf_weights(model, str(tiny_model_dir), cfg)
    if settings is not None:
        lora.apply(model, settings, seed)
    return model.eval(), cfg


def _randomise_b(model, seed=0):
    from slime_lite.backends.megatron import lora

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, mod in lora.adapted_linears(model):
            mod.lora.B.copy_(torch.randn(mod.lora.B.shape, generator=g) * 0.05)


def _tokens(vocab, seed=1):
    return torch.randint(0, vocab, (2, 20), generator=torch.Generator().manual_seed(seed))


def _hf(tiny_model_dir, state=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation="eager",
                                                 dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model.eval()


def test_adapted_model_starts_as_the_base_and_only_the_adapters_train(single_rank, tiny_model_dir):
    from slime_lite.backends.megatron import lora
    from slime_lite.backends.megatron.model import forward_logits

    base, cfg = _model(tiny_model_dir)
    model, _ = _model(tiny_model_dir, LoraSettings(4, 8.0, 0.0, ALL))
    toks = _tokens(cfg.vocab_size)
    with torch.no_grad():
        want = forward_logits(base, toks)
        assert torch.equal(forward_logits(model, toks), want)  # B = 0: exactly the base model
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    layers = cfg.num_hidden_layers
    assert len(trainable) == 2 * 4 * layers and all(lora.is_adapter(n) for n in trainable)
    forward_logits(model, toks).float().logsumexp(-1).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not lora.is_adapter(n))
    assert all(mod.lora.B.grad.abs().sum() > 0 for _, _, mod in lora.adapted_linears(model))
    _randomise_b(model)
    with torch.no_grad():
        moved = forward_logits(model, toks)
        assert (moved - want).abs().max() > 1e-3
        with lora.disabled(model):  # the reference: the base, no second copy
            assert torch.equal(forward_logits(model, toks), want)
        assert torch.equal(forward_logits(model, toks), moved)


def test_frozen_linears_run_one_gemm_per_matmul_not_one_per_token(single_rank, tiny_model_dir):
    """The logits' gradient reaches the frozen output layer transposed; torch.matmul then ran a batched matmul of
    one token per batch against the whole weight (LoRA steps 4.6x slower than full fine-tuning on an H200)."""
    from torch.profiler import ProfilerActivity, profile

    from slime_lite.backends.megatron.model import forward_logits

    model, cfg = _model(tiny_model_dir, LoraSettings(4, 8.0, 0.0, ALL))
    toks = _tokens(cfg.vocab_size)[:1]  # one packed row, as the trainer runs
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_logits(model, toks).float().logsumexp(-1).sum().backward()
    names = [e.name for e in prof.events()]
    assert "aten::mm" in names and "aten::bmm" not in names


def test_merged_weights_and_the_peft_export_give_the_adapted_logits(single_rank, tiny_model_dir, tmp_path):
    """W + (alpha/R) B A in HF's model, and PEFT's own loader on the exported folder, give the Megatron LoRA
    model's logits; the folder loads back into a fresh adapted model bitwise."""
    peft = pytest.importorskip("peft")
    from slime_lite.backends.megatron import lora, peft_format
    from slime_lite.backends.megatron.convert import iter_hf_weights
    from slime_lite.backends.megatron.model import forward_logits

    settings = LoraSettings(4, 8.0, 0.0, ALL)
    model, cfg = _model(tiny_model_dir, settings)
    _randomise_b(model)
    toks = _tokens(cfg.vocab_size)
    with torch.no_grad():
        want = forward_logits(model, toks)
    adapters = lora.hf_adapters(model, cfg)
    assert {n.rsplit(".", 2)[1] for n in adapters} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"}
    base = {n: t.clone() for n, t in iter_hf_weights(model, cfg)}
    effective = {n: merged(t, *adapters[n][:1], adapters[n][1] * settings.scaling) if n in adapters else t
                 for n, t in base.items()}
    with torch.no_grad():
        got = _hf(tiny_model_dir, effective)(toks).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    folder = tmp_path / "adapter"
    peft_format.write(adapters, settings, str(tiny_model_dir), str(folder))
    assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(_hf(tiny_model_dir), str(folder)).eval()
        torch.testing.assert_close(peft_model(toks).logits, want, rtol=1e-4, atol=1e-4)

    fresh, _ = _model(tiny_model_dir, settings, seed=99)  # other A init: the load must replace it
    lora.load_hf_adapters(fresh, cfg, peft_format.read(str(folder)), "test")
    for (_, _, m1), (_, _, m2) in zip(lora.adapted_linears(model), lora.adapted_linears(fresh)):
        assert torch.equal(m1.lora.A, m2.lora.A) and torch.equal(m1.lora.B, m2.lora.B)


def test_an_adapter_whose_fused_parts_differ_is_refused(single_rank, tiny_model_dir):
    from slime_lite.backends.megatron import lora
    from slime_lite.errors import SlimeLiteError

    settings = LoraSettings(4, 4.0, 0.0, ALL)
    model, cfg = _model(tiny_model_dir, settings)
    adapters = dict(lora.hf_adapters(model, cfg))
    k = "model.layers.0.self_attn.k_proj.weight"
    adapters[k] = (adapters[k][0] + 1, adapters[k][1])
    with pytest.raises(SlimeLiteError, match="q_proj.weight, .*k_proj.weight.* have different lora_A.*linear_qkv"):
        lora.load_hf_adapters(model, cfg, adapters, "--lora-adapter-path X")


def test_an_adapter_on_modules_this_run_does_not_target_is_refused(single_rank, tiny_model_dir):
    """PEFT applies every adapter of a folder: loading only the targeted ones would silently serve another model."""
    from slime_lite.backends.megatron import lora
    from slime_lite.errors import SlimeLiteError

    full, cfg = _model(tiny_model_dir, LoraSettings(4, 4.0, 0.0, ALL))
    adapters = lora.hf_adapters(full, cfg)
    model, _ = _model(tiny_model_dir, LoraSettings(4, 4.0, 0.0, ("self_attention.linear_qkv",)))
    with pytest.raises(SlimeLiteError, match="X has an adapter for model.layers.0.self_attn.o_proj.weight, which "
                                             "this run's --lora-target-modules leave out"):
        lora.load_hf_adapters(model, cfg, adapters, "X")
    lora.load_hf_adapters(model, cfg, {n: ab for n, ab in adapters.items() if "_proj" in n and ".self_attn." in n
                                       and "o_proj" not in n}, "X")


def test_merge_formula_is_one_rounding_of_the_float32_sum_in_rank_order():
    w = torch.randn(6, 5).to(torch.bfloat16)
    a, b = torch.randn(3, 5), torch.randn(6, 3)
    want = w.float()
    for r in range(3):
        want = want + b[:, r:r + 1] * a[r:r + 1, :]
    out = merged(w, a, b)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    torch.testing.assert_close(out.float(), (w.float() + b @ a), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="do not fit the weight"):
        merged(w, a, b[:, :2])
