"""HF <-> Megatron-core weights for Llama/Qwen2/Qwen3/GLM4 and Qwen3-MoE/Qwen2-MoE: names, TP shards, PP stages
and expert-parallel (EP) slices.

Pure functions over state dicts (`hf_to_megatron_shard`, `megatron_to_hf`) need no process group; on a live model,
`load_hf_weights` fills this rank's shard from an HF checkpoint and `iter_hf_weights` gathers the TP shards back.
Megatron names (local layer ids i, global id = stage offset + i):

    embedding.word_embeddings.weight                 model.embed_tokens.weight      (rows split over TP, padded)
    decoder.layers.i.input_layernorm.weight          model.layers.L.input_layernorm.weight
    decoder.layers.i.self_attention.linear_qkv.weight/.bias   self_attn.{q,k,v}_proj.weight/.bias  (fused, below)
    decoder.layers.i.self_attention.{q,k}_layernorm.weight     self_attn.{q,k}_norm.weight  (Qwen3)
    decoder.layers.i.self_attention.linear_proj.weight         self_attn.o_proj.weight    (split on input dim)
    decoder.layers.i.pre_mlp_layernorm.weight        model.layers.L.post_attention_layernorm.weight
    decoder.layers.i.mlp.linear_fc1.weight           mlp.gate_proj.weight + mlp.up_proj.weight  ([gate_r; up_r])
                                                     (GLM4: mlp.gate_up_proj.weight, gate rows then up rows)
    decoder.layers.i.post_{self_attn,mlp}_layernorm.weight    the same names (GLM4's extra norms)
    decoder.layers.i.mlp.linear_fc2.weight           mlp.down_proj.weight           (split on input dim)
    decoder.final_layernorm.weight                   model.norm.weight
    output_layer.weight                              lm_head.weight (embed_tokens when tied; absent when tied, PP=1)

MoE layers (local expert j of EP rank r is global expert E = r * experts / EP + j; expert weights are split over the
expert-TP ranks, which default to the TP ranks, as the dense MLP's are over TP):

    decoder.layers.i.mlp.router.weight               mlp.gate.weight
    decoder.layers.i.mlp.experts.local_experts.j.linear_fc1.weight   mlp.experts.E.gate_proj.weight + up_proj.weight
    decoder.layers.i.mlp.experts.local_experts.j.linear_fc2.weight   mlp.experts.E.down_proj.weight
    decoder.layers.i.mlp.shared_experts.linear_fc1/fc2.weight        mlp.shared_expert.{gate,up,down}_proj.weight
    decoder.layers.i.mlp.shared_experts.gate_weight  mlp.shared_expert_gate.weight  (Qwen2-MoE)

HF names are the on-disk, per-expert ones (transformers 5 fuses them in memory; the engine loads either).
With Transformer Engine the two layer norms are `self_attention.linear_qkv.layer_norm_weight` and
`mlp.linear_fc1.layer_norm_weight`. The fused QKV rows are grouped per KV head: [q heads of group g; k_g; v_g] for
g = 0..G-1, and TP rank r holds groups r*G/tp .. (r+1)*G/tp - 1. Tied models have no lm_head.weight on the HF side.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open

from slime_lite.backends.megatron.lora_config import ADAPTER_MARK
from slime_lite.backends.megatron.model import HFArch, check_parallel_sizes, hf_arch, padded_vocab_size, unwrap
from slime_lite.errors import SlimeLiteError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ATTN, _MLP = "self_attention.", "mlp."
# Per-layer Megatron suffix -> (kind, HF suffixes under model.layers.L.)
_LAYER_MAP = {
    "input_layernorm.weight": ("copy", ["input_layernorm.weight"]),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ["input_layernorm.weight"]),
    "self_attention.linear_qkv.weight": ("qkv", ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight"]),
    "self_attention.linear_qkv.bias": ("qkv", ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                               "self_attn.v_proj.bias"]),
    "self_attention.q_layernorm.weight": ("copy", ["self_attn.q_norm.weight"]),
    "self_attention.k_layernorm.weight": ("copy", ["self_attn.k_norm.weight"]),
    "self_attention.linear_proj.weight": ("row", ["self_attn.o_proj.weight"]),
    "pre_mlp_layernorm.weight": ("copy", ["post_attention_layernorm.weight"]),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ["post_attention_layernorm.weight"]),
    "mlp.linear_fc1.weight": ("fc1", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    "mlp.linear_fc2.weight": ("row", ["mlp.down_proj.weight"]),
    "post_self_attn_layernorm.weight": ("copy", ["post_self_attn_layernorm.weight"]),
    "post_mlp_layernorm.weight": ("copy", ["post_mlp_layernorm.weight"]),
}
_LAYER_MAP.update({
    "mlp.router.weight": ("copy", ["mlp.gate.weight"]),
    "mlp.shared_experts.linear_fc1.weight": ("fc1", ["mlp.shared_expert.gate_proj.weight",
                                                     "mlp.shared_expert.up_proj.weight"]),
    "mlp.shared_experts.linear_fc2.weight": ("row", ["mlp.shared_expert.down_proj.weight"]),
    "mlp.shared_experts.gate_weight": ("copy", ["mlp.shared_expert_gate.weight"]),
})
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_EXPERT_MAP = {"linear_fc1": ("fc1", ["gate_proj.weight", "up_proj.weight"]), "linear_fc2": ("row", ["down_proj.weight"])}
_FUSED_FC1 = ["mlp.gate_up_proj.weight"]  # GLM4's MLP: gate rows, then up rows
_EMBED = "model.embed_tokens.weight"


def layers_per_stage(arch: HFArch, pp_size: int) -> int:
    return arch.num_layers // pp_size


def megatron_param_names(arch: HFArch, pp_rank: int, pp_size: int, transformer_impl: str = "local",
                         ep_size: int = 1) -> list[str]:
    """The parameter names of the GPTModel of PP stage `pp_rank` (the same on every TP and EP rank)."""
    te = transformer_impl == "transformer_engine"
    per_layer = ["self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight",
                 "self_attention.linear_qkv.weight"]
    if arch.qkv_bias:
        per_layer.append("self_attention.linear_qkv.bias")
    if arch.qk_norm:
        per_layer += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    per_layer += ["self_attention.linear_proj.weight",
                  "mlp.linear_fc1.layer_norm_weight" if te and not arch.moe else "pre_mlp_layernorm.weight"]
    if arch.moe is None:
        per_layer += ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    else:
        per_layer += ["mlp.router.weight"] + [f"mlp.experts.local_experts.{j}.linear_fc{k}.weight"
                                              for j in range(arch.moe.num_experts // ep_size) for k in (1, 2)]
        if arch.moe.shared_expert_size:
            per_layer += ["mlp.shared_experts.gate_weight", "mlp.shared_experts.linear_fc1.weight",
                          "mlp.shared_experts.linear_fc2.weight"]
    if arch.post_norms:
        per_layer += ["post_self_attn_layernorm.weight", "post_mlp_layernorm.weight"]
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    names = ["embedding.word_embeddings.weight"] if first else []
    names += [f"decoder.layers.{i}.{s}" for i in range(layers_per_stage(arch, pp_size)) for s in per_layer]
    if last:
        names.append("decoder.final_layernorm.weight")
        if not arch.tie_embeddings or not first:
            names.append("output_layer.weight")
    return names


def _hf_names(name: str, arch: HFArch, layer_offset: int, expert_offset: int = 0) -> tuple[str, list[str]]:
    """(kind, HF names) of one Megatron parameter; layer ids in `name` are local, offset by `layer_offset`, and so
    are expert ids, offset by `expert_offset` (kinds of expert weights start with ``expert_``)."""
    m = _LAYER.match(name)
    if m:
        e = _EXPERT.match(m.group(2))
        if e:
            kind, suffixes = _EXPERT_MAP[e.group(2)]
            prefix = f"model.layers.{int(m.group(1)) + layer_offset}.mlp.experts.{int(e.group(1)) + expert_offset}."
            return "expert_" + kind, [prefix + s for s in suffixes]
        kind, suffixes = _LAYER_MAP[m.group(2)]
        if kind == "fc1" and arch.fused_gate_up:
            suffixes = _FUSED_FC1
        prefix = f"model.layers.{int(m.group(1)) + layer_offset}."
        return kind, [prefix + s for s in suffixes]
    if name == "embedding.word_embeddings.weight":
        return "vocab", [_EMBED]
    if name == "output_layer.weight":
        return "vocab", [_EMBED if arch.tie_embeddings else "lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        return "copy", ["model.norm.weight"]
    raise KeyError(f"no HF name for Megatron parameter {name!r}")


def _hf_shapes(name: str, kind: str, arch: HFArch, n: int) -> tuple[list[tuple[int, ...]], str]:
    """The shapes config.json implies for the `n` HF tensors of Megatron parameter `name`, and the config.json
    sizes they come from (for the error message)."""
    h, hd, kind = arch.hidden_size, arch.head_dim, kind.removeprefix("expert_")
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    heads = f"hidden_size {h}, num_attention_heads {arch.num_heads}, num_key_value_heads {arch.num_kv_heads}, " \
            f"head_dim {hd}"
    ffn, ffn_key = arch.ffn_hidden_size, "intermediate_size"
    if ".local_experts." in name:
        ffn, ffn_key = arch.moe.ffn_hidden_size, "moe_intermediate_size"
    elif ".shared_experts." in name:
        ffn, ffn_key = arch.moe.shared_expert_size, "shared_expert_intermediate_size"
    mlp = f"hidden_size {h}, {ffn_key} {ffn}"
    if kind == "vocab":
        return [(arch.vocab_size, h)], f"vocab_size {arch.vocab_size}, hidden_size {h}"
    if kind == "qkv":
        tail = (h,) if name.endswith(".weight") else ()
        return [(q, *tail), (kv, *tail), (kv, *tail)], heads
    if kind == "fc1":
        return ([(2 * ffn, h)] if n == 1 else [(ffn, h)] * 2), mlp
    if kind == "row":
        return ([(h, q)], heads) if "linear_proj" in name else ([(h, ffn)], mlp)
    if name.endswith("router.weight"):
        return [(arch.moe.num_experts, h)], f"num_experts {arch.moe.num_experts}, hidden_size {h}"
    if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return [(hd,)], f"head_dim {hd}"
    return [(1, h) if name.endswith("gate_weight") else (h,)], f"hidden_size {h}"  # norms; the shared-expert gate


def _hf_tensors(hf_state: Mapping[str, torch.Tensor], name: str, kind: str, hf_names: list[str],
                arch: HFArch) -> list[torch.Tensor]:
    """The HF tensors of Megatron parameter `name`, each checked to be there and of the shape config.json implies
    (a SlimeLiteError naming the key and the checkpoint otherwise, before any reshape fails unnamed)."""
    where = getattr(hf_state, "where", "the HF state dict")
    shapes, sizes = _hf_shapes(name, kind, arch, len(hf_names))
    out = []
    for key, shape in zip(hf_names, shapes):
        try:
            t = hf_state[key]
        except KeyError:
            raise SlimeLiteError(f"{where}: the weight {key} is missing; config.json's model needs it. Give a "
                                 "complete checkpoint of the model its config.json describes.") from None
        if tuple(t.shape) != shape:
            raise SlimeLiteError(f"{where}: {key} has shape {tuple(t.shape)}, but config.json ({sizes}) implies "
                                 f"{shape}. Give the checkpoint the config.json it was saved with.")
        out.append(t)
    return out


def _split(kind: str, hf: list[torch.Tensor], arch: HFArch, tp_rank: int, tp_size: int) -> torch.Tensor:
    """HF tensor(s) -> this TP rank's Megatron shard (expert kinds: this expert-TP rank's)."""
    kind = kind.removeprefix("expert_")
    if kind == "copy":
        return hf[0]
    if kind == "row":
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if kind == "fc1":
        gate_up = hf if len(hf) == 2 else hf[0].chunk(2, dim=0)
        return torch.cat([t.chunk(tp_size, dim=0)[tp_rank] for t in gate_up], dim=0)
    if kind == "vocab":
        t = hf[0]
        pad = padded_vocab_size(arch.vocab_size, tp_size) - t.shape[0]  # rows == vocab_size: _hf_tensors
        if pad:
            t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))], dim=0)
        return t.chunk(tp_size, dim=0)[tp_rank]
    if kind == "qkv":
        q, k, v = hf
        groups, per_group = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(groups, per_group * arch.head_dim, *rest),
                           k.reshape(groups, arch.head_dim, *rest),
                           v.reshape(groups, arch.head_dim, *rest)], dim=1)
        return fused.chunk(tp_size, dim=0)[tp_rank].reshape(-1, *rest)
    raise ValueError(kind)


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat``, except that one part (TP=1) is returned as it is: the caller copies what it keeps, once."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _merge(kind: str, shards: list[torch.Tensor], arch: HFArch) -> list[torch.Tensor]:
    """All TP ranks' Megatron shards (in TP order; expert kinds: expert-TP ranks') -> the full HF tensor(s), views of
    the shards where they can be."""
    kind = kind.removeprefix("expert_")
    if kind == "copy":
        return [shards[0]]
    if kind == "row":
        return [_cat(shards, dim=1)]
    if kind == "fc1":
        if arch.fused_gate_up and len(shards) == 1:
            return [shards[0]]  # TP=1: the shard is [gate; up], as HF's gate_up_proj
        halves = [s.chunk(2, dim=0) for s in shards]
        gate, up = _cat([h[0] for h in halves], dim=0), _cat([h[1] for h in halves], dim=0)
        return [torch.cat([gate, up], dim=0)] if arch.fused_gate_up else [gate, up]
    if kind == "vocab":
        return [_cat(shards, dim=0)[: arch.vocab_size]]
    if kind == "qkv":
        per_group, hd = arch.num_heads // arch.num_kv_heads, arch.head_dim
        rest = shards[0].shape[1:]
        fused = _cat([s.reshape(-1, (per_group + 2) * hd, *rest) for s in shards], dim=0)
        q, k, v = fused.split([per_group * hd, hd, hd], dim=1)
        return [t.reshape(-1, *rest) for t in (q, k, v)]
    raise ValueError(kind)


def hf_to_megatron_shard(
    hf_state: Mapping[str, torch.Tensor],
    hf_config: Any,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    *,
    transformer_impl: str = "local",
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """The parameters of rank (tp_rank, pp_rank)'s GPTModel, by their names there, from a full HF state dict; MoE:
    the experts of EP rank `ep_rank`, each split over the expert-TP ranks (`etp_*`, default the TP ones).

    Returned tensors may share memory with `hf_state`.
    """
    arch = hf_arch(hf_config)
    etp_rank, etp_size = (tp_rank, tp_size) if etp_size is None else (etp_rank, etp_size)
    # a dense model has no expert TP (Megatron still reports one, the TP size): only MoE sizes are checked
    check_parallel_sizes(arch, tp_size, pp_size, ep_size, etp_size if arch.moe else None)
    offset = pp_rank * layers_per_stage(arch, pp_size)
    expert_offset = ep_rank * arch.moe.num_experts // ep_size if arch.moe else 0
    out = {}
    for name in megatron_param_names(arch, pp_rank, pp_size, transformer_impl, ep_size):
        kind, hf_names = _hf_names(name, arch, offset, expert_offset)
        ranks = (etp_rank, etp_size) if kind.startswith("expert_") else (tp_rank, tp_size)
        out[name] = _split(kind, _hf_tensors(hf_state, name, kind, hf_names, arch), arch, *ranks)
    return out


def megatron_to_hf(shards: list[list[Mapping[str, torch.Tensor]]], hf_config: Any,
                   ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Full HF state dict from every rank's Megatron parameters, `shards[pp_rank][ep_rank * tp_size + tp_rank]`
    (dense: `shards[pp_rank][tp_rank]`); expert weights are split over the TP ranks (expert-TP = TP).

    Returned tensors may share memory with `shards`.
    """
    arch = hf_arch(hf_config)
    pp_size, tp_size = len(shards), len(shards[0]) // ep_size
    check_parallel_sizes(arch, tp_size, pp_size, ep_size)
    per_ep = arch.moe.num_experts // ep_size if arch.moe else 0
    out: dict[str, torch.Tensor] = {}
    for pp_rank, stage in enumerate(shards):
        offset = pp_rank * layers_per_stage(arch, pp_size)
        for name in stage[0]:
            if name.endswith("_extra_state") or _is_tied_copy(name, arch, pp_rank):
                continue
            for ep_rank in range(ep_size if _EXPERT.match(_LAYER.sub(r"\2", name)) else 1):
                kind, hf_names = _hf_names(name, arch, offset, ep_rank * per_ep)
                tp_shards = [s[name] for s in stage[ep_rank * tp_size : (ep_rank + 1) * tp_size]]
                out.update(zip(hf_names, _merge(kind, tp_shards, arch)))
    return out


def _is_tied_copy(name: str, arch: HFArch, pp_rank: int) -> bool:
    """The last PP stage's copy of a tied embedding: the first stage already yields embed_tokens."""
    return name == "output_layer.weight" and arch.tie_embeddings and pp_rank > 0


class _SafetensorsDir(Mapping):
    """Read-on-access view of an HF checkpoint directory's *.safetensors (each rank reads only what it needs)."""

    def __init__(self, path: str) -> None:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise SlimeLiteError(f"--hf-checkpoint {path} has no *.safetensors weights; save the model with safetensors.")
        self.where = f"--hf-checkpoint {path}"  # how errors name the folder
        self._handles = {}
        for name in files:
            handle = safe_open(os.path.join(path, name), framework="pt")
            for key in handle.keys():
                self._handles[key] = handle

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._handles[key].get_tensor(key)

    def __iter__(self):
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)


def load_hf_weights(model: torch.nn.Module, hf_dir_or_state_dict: str | Mapping, hf_config: Any) -> None:
    """Fill this rank's parameters (its TP shard of its PP stage) from an HF checkpoint directory or state dict."""

    hf_state = (
        _SafetensorsDir(hf_dir_or_state_dict) if isinstance(hf_dir_or_state_dict, str) else hf_dir_or_state_dict
    )
    gpt = unwrap(model)
    ps = parallel_state
    shard = hf_to_megatron_shard(
        hf_state,
        hf_config,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        transformer_impl=gpt.config.transformer_impl,
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=ps.get_expert_tensor_parallel_world_size(),
    )
    params = {n: p for n, p in gpt.named_parameters() if ADAPTER_MARK not in n}  # LoRA's are not in HF files
    if set(shard) != set(params):
        raise RuntimeError(
            f"HF->Megatron names disagree with the model: missing {sorted(set(params) - set(shard))}, "
            f"unexpected {sorted(set(shard) - set(params))}"
        )
    with torch.no_grad():
        for name, param in params.items():
            if shard[name].shape != param.shape:
                raise RuntimeError(f"{name}: checkpoint shard {tuple(shard[name].shape)} != model {tuple(param.shape)}")
            param.copy_(shard[name])


def iter_hf_weights(model: torch.nn.Module, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every weight of this rank's PP stage, layer ids global.

    Collective over the TP group (and for MoE the expert-TP and EP groups): all ranks of a stage must iterate
    together, and every one of them yields the same full (TP-gathered) tensors, every expert by its global id. Each PP stage yields only its own layers (the first stage the embedding, the
    last stage the final norm and lm_head), so a consumer wanting the whole model takes one TP rank per stage.
    Tensors may be views of the parameters (TP=1: all but q, k and v): copy them before changing the model.
    """

    arch = hf_arch(hf_config)
    ps = parallel_state
    tp = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group())
    etp = (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group(check_initialized=False))
    ep_size, ep_group = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group(False)
    per_ep = arch.moe.num_experts // ep_size if arch.moe else 0
    pp_rank = ps.get_pipeline_model_parallel_rank()
    gpt = unwrap(model)
    # Megatron's own global layer numbers (1-based), so the ids agree with however the stage was built.
    global_ids = [layer.layer_number - 1 for layer in gpt.decoder.layers] if hasattr(gpt, "decoder") else []
    for name, param in gpt.named_parameters():
        if _is_tied_copy(name, arch, pp_rank) or ADAPTER_MARK in name:  # adapters: lora.hf_adapters
            continue
        m = _LAYER.match(name)
        offset = global_ids[int(m.group(1))] - int(m.group(1)) if m else 0
        expert = m is not None and _EXPERT.match(m.group(2)) is not None
        kind, _ = _hf_names(name, arch, offset)
        full = _merge(kind, _gather(param.detach(), *(etp if expert else tp), kind != "copy"), arch)
        for ep_rank, tensors in enumerate(zip(*[_gather(t, ep_size, ep_group) for t in full]) if expert else [full]):
            _, hf_names = _hf_names(name, arch, offset, ep_rank * per_ep)
            yield from zip(hf_names, tensors)


def _gather(t: torch.Tensor, size: int, group: Any, split: bool = True) -> list[torch.Tensor]:
    """Every rank's ``t`` over ``group`` in rank order (``[t]`` itself when the group has one rank or ``t`` is not
    split over it)."""
    if size == 1 or not split:
        return [t]
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out
