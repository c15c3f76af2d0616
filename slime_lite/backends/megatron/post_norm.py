"""GLM4's decoder layer in Megatron-core: RMSNorm of the attention output and of the MLP output, each before its
residual add (HF's ``post_self_attn_layernorm`` and ``post_mlp_layernorm``; Megatron-core 0.16 has neither).

``PostNormLayer`` is Megatron's ``TransformerLayer`` with the two norms as submodules of the same names, applied
inside the layer's bias-dropout-add steps (residual + norm(output)), so recompute, sequence parallelism (the norms
see the sequence slice the add sees; their weight gradients are then summed over the TP group like the layer's
other norms) and pipeline stages work as for any layer. model.py ``layer_spec`` puts it in the spec.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.transformer_layer import TransformerLayer


class PostNormLayer(TransformerLayer):
    """``TransformerLayer`` + ``post_self_attn_layernorm`` and ``post_mlp_layernorm`` (``post_norm``: the norm
    class, built as the layer's other norms are)."""

    def __init__(self, config: Any, submodules: Any, *args: Any, post_norm: type, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        self.post_self_attn_layernorm = post_norm(config=config, hidden_size=config.hidden_size,
                                                  eps=config.layernorm_epsilon)
        self.post_mlp_layernorm = post_norm(config=config, hidden_size=config.hidden_size,
                                            eps=config.layernorm_epsilon)
        self._attn_add, self._mlp_add = self.self_attn_bda, self.mlp_bda
        self.self_attn_bda, self.mlp_bda = self._normed_attn_add, self._normed_mlp_add

    @staticmethod
    def _normed(add: Any, norm: Any, training: bool, fused: bool) -> Any:
        inner = add(training, fused)

        def normed_add(output_with_bias: tuple, residual: Any, prob: float) -> Any:
            output, bias = output_with_bias
            if bias is not None:  # the HF layers normalise the projection's full output (GLM4 has no o/down bias)
                output, bias = output + bias, None
            return inner((norm(output), bias), residual, prob)

        return normed_add

    def _normed_attn_add(self, training: bool, fused: bool) -> Any:
        return self._normed(self._attn_add, self.post_self_attn_layernorm, training, fused)

    def _normed_mlp_add(self, training: bool, fused: bool) -> Any:
        return self._normed(self._mlp_add, self.post_mlp_layernorm, training, fused)
