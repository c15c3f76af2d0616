"""Find the first layer where two forwards of the same tokens part: the engine's HF model vs Megatron (or another HF).

``localize(hf_dir_a, hf_dir_b_or_megatron, tokens)`` runs side A with transformers and side B with transformers
(a path) or with Megatron-core (``"megatron"`` or ``"megatron:PATH"``; TP=1, PP=1, this process as a one-rank job,
weights read from PATH, default ``hf_dir_a``). Forward hooks record the embedding output, every decoder layer's
output, the final norm and the logits; each is compared as ``max|a - b| / max|a|`` and the first one past
``tol`` is named (hooks rather than ``output_hidden_states``, whose last entry is already normed and so hides the
last layer's own output). ``localize_sample`` does this for a dumped sample and also checks the rollout log-probs against
side A's logits, fitting the sampling temperature that explains them.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from slime_lite.errors import SlimeLiteError
from slime_lite.io import free_port

log = logging.getLogger(__name__)
# The relative difference per layer (max|a - b| / max|a|) two healthy forwards stay under, by the precision both
# sides run in. float32 HF vs Megatron differ by ~1e-6; in bfloat16 the two implementations' kernels round
# differently at every layer: 0.7e-2 after the first layer and up to 3.4e-2 at the last (Qwen2.5-0.5B shape, 24
# layers, H200: bench/gpu_doctor.sh); float16 carries 3 more mantissa bits. Two sides in different precisions are
# held to the tighter bound (the dtype cast is what to find).
LAYER_TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}
DEFAULT_TOL = LAYER_TOL["float32"]
_DTYPES = tuple(LAYER_TOL)


def layer_tol(dtype_a: str, dtype_b: str) -> float:
    """The per-layer tolerance for sides A and B in these dtypes: the tighter of the two."""
    for name in (dtype_a, dtype_b):
        _torch_dtype(name)  # an unknown name is a clear error
    return min(LAYER_TOL[dtype_a], LAYER_TOL[dtype_b])


@dataclass
class LayerDiff:
    name: str  # "embedding", "layer 0", ..., "final_norm", "logits"
    max_abs_diff: float
    rel_diff: float  # max_abs_diff / max|side A|


@dataclass
class Localization:
    side_a: str
    side_b: str
    tol: float
    layers: list[LayerDiff]
    first_divergent: str | None  # None: the two forwards agree within tol everywhere
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        if self.first_divergent is None:
            worst = max(self.layers, key=lambda d: d.rel_diff)
            head = (f"{self.side_a} and {self.side_b} agree at every layer (worst {worst.name}: rel diff "
                    f"{worst.rel_diff:.2e} <= {self.tol:g})")
        else:
            d = next(x for x in self.layers if x.name == self.first_divergent)
            head = (f"{self.side_a} and {self.side_b} first part at {self.first_divergent} (rel diff "
                    f"{d.rel_diff:.2e} > {self.tol:g}, max abs {d.max_abs_diff:.3g})")
        return "; ".join([head] + self.notes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"summary": self.summary()}


def _torch_dtype(name: str):
    import torch  # torch, Megatron: only when a mismatch is localised

    if name not in _DTYPES:
        raise SlimeLiteError(f"localize: dtype {name!r} unknown; use one of {', '.join(_DTYPES)}.")
    return getattr(torch, name)


def _first(output: Any) -> Any:
    return output[0] if isinstance(output, (tuple, list)) else output


def hf_states(hf_dir: str, tokens: Sequence[int], dtype: str = "float32") -> dict[str, Any]:
    """Hidden states of the transformers model at ``hf_dir``: ordered {name: float32 [T, H or V]}."""
    import torch  # torch, Megatron: only when a mismatch is localised
    from transformers import AutoModelForCausalLM  # transformers: only when a mismatch is localised

    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the engine runs its HF model
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=_torch_dtype(dtype))
    model = model.to(device=device, dtype=_torch_dtype(dtype)).eval()
    inner = model.model
    states: dict[str, Any] = {}
    named = [("embedding", inner.embed_tokens)] + [(f"layer {i}", m) for i, m in enumerate(inner.layers)]
    named.append(("final_norm", inner.norm))
    hooks = [m.register_forward_hook(_recorder(states, name, batch_first=True)) for name, m in named]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(tokens)], device=device)).logits
    finally:
        for h in hooks:
            h.remove()
    states["logits"] = logits[0].float().cpu()
    return states


def _recorder(states: dict[str, Any], name: str, batch_first: bool):
    def hook(module: Any, inputs: Any, output: Any) -> None:
        t = _first(output).detach()
        states[name] = (t[0] if batch_first else t[:, 0]).float().cpu()  # compared on the host, whatever the device

    return hook


def megatron_states(hf_dir: str, tokens: Sequence[int], dtype: str = "float32") -> dict[str, Any]:
    """The same hidden states from a Megatron GPTModel (TP=1, PP=1) loaded with ``hf_dir``'s weights.

    Makes this process a one-rank job for the call unless Megatron is already initialised with TP=PP=1 here.
    """
    import torch  # torch, Megatron: only when a mismatch is localised
    from megatron.core import parallel_state  # Megatron: only when a mismatch is localised
    from transformers import AutoConfig  # transformers: only when a mismatch is localised

    from slime_lite.backends.megatron import parallel  # Megatron: only when a mismatch is localised
    from slime_lite.backends.megatron.convert import load_hf_weights  # Megatron: only when localising
    from slime_lite.backends.megatron.model import build_gpt_model, forward_logits  # Megatron: only when localising

    owned = not parallel_state.model_parallel_is_initialized()
    rng = torch.get_rng_state()
    if owned:
        parallel.init_distributed(1, 1, 0, 1, "127.0.0.1", free_port())
    elif (parallel_state.get_tensor_model_parallel_world_size(),
          parallel_state.get_pipeline_model_parallel_world_size()) != (1, 1):
        raise SlimeLiteError("localize: Megatron is already initialised with TP or PP > 1 in this process; "
                             "call it from a process without a model-parallel job.")
    try:
        cfg = AutoConfig.from_pretrained(str(hf_dir))
        model = build_gpt_model(cfg, params_dtype=_torch_dtype(dtype))
        load_hf_weights(model, str(hf_dir), cfg)
        model.eval()
        states: dict[str, Any] = {}
        named = [("embedding", model.embedding)] + [(f"layer {i}", m) for i, m in enumerate(model.decoder.layers)]
        named.append(("final_norm", model.decoder.final_layernorm))
        hooks = [m.register_forward_hook(_recorder(states, name, batch_first=False)) for name, m in named]
        try:
            with torch.no_grad():
                logits = forward_logits(model, torch.tensor([list(tokens)]))
        finally:
            for h in hooks:
                h.remove()
        states["logits"] = logits[0].float().cpu()
        return states
    finally:
        if owned:
            parallel.destroy()
        torch.set_rng_state(rng)


def compare_states(a: dict[str, Any], b: dict[str, Any],
                   tol: float = DEFAULT_TOL) -> tuple[list[LayerDiff], str | None]:
    """Per-layer differences in side A's order, and the first layer past ``tol`` (None when all agree)."""
    if list(a) != list(b):
        raise SlimeLiteError(f"localize: the two models have different layers: {list(a)} vs {list(b)} "
                             "(different architectures or layer counts).")
    diffs, first = [], None
    for name in a:
        x, y = a[name], b[name]
        if x.shape != y.shape:
            raise SlimeLiteError(f"localize: {name} has shape {tuple(x.shape)} on one side, {tuple(y.shape)} on "
                                 "the other.")
        abs_diff = float((x - y).abs().max()) if x.numel() else 0.0
        rel = abs_diff / max(float(x.abs().max()), 1e-12)
        diffs.append(LayerDiff(name, abs_diff, rel))
        if first is None and not rel <= tol:  # NaN counts as parted
            first = name
    return diffs, first


def _side(spec: str, default_dir: str, dtype: str) -> tuple[str, str]:
    """(kind 'hf'|'megatron', weights dir) of a side spec."""
    if spec == "megatron" or spec.startswith("megatron:"):
        return "megatron", spec.partition(":")[2] or default_dir
    return "hf", spec


def localize(hf_dir_a: str, hf_dir_b_or_megatron: str, tokens: Sequence[int], *, dtype_a: str = "float32",
             dtype_b: str = "float32", tol: float | None = None) -> Localization:
    """Run both sides on ``tokens`` layer by layer and name the first layer where they part beyond ``tol``
    (default: ``layer_tol`` of the two dtypes)."""
    if not tokens:
        raise SlimeLiteError("localize: no tokens to run.")
    tol = layer_tol(dtype_a, dtype_b) if tol is None else tol
    kind_b, dir_b = _side(str(hf_dir_b_or_megatron), str(hf_dir_a), dtype_b)
    states_a = hf_states(str(hf_dir_a), tokens, dtype_a)
    states_b = megatron_states(dir_b, tokens, dtype_b) if kind_b == "megatron" else hf_states(dir_b, tokens, dtype_b)
    layers, first = compare_states(states_a, states_b, tol)
    same = str(dir_b) == str(hf_dir_a)
    label_a = f"HF ({dtype_a}{'' if same else ', ' + str(hf_dir_a)})"
    label_b = f"{'Megatron' if kind_b == 'megatron' else 'HF'} ({dtype_b}{'' if same else ', ' + str(dir_b)})"
    loc = Localization(label_a, label_b, tol, layers, first, extra={"weights": [str(hf_dir_a), str(dir_b)]})
    if first is not None and dtype_a != dtype_b:
        loc.notes.append(f"the two sides run in different precisions ({dtype_a} vs {dtype_b}): a dtype cast")
    loc.extra["logits_a"] = states_a["logits"]
    loc.extra["logits_b"] = states_b["logits"]
    return loc


def response_log_probs(logits: Any, tokens: Sequence[int], prompt_len: int, temperature: float = 1.0) -> Any:
    """Log-probs of tokens[prompt_len:] under ``logits`` [T, V] (row t predicts token t+1) at ``temperature``."""
    import torch  # torch, Megatron: only when a mismatch is localised

    t = max(float(temperature), 1e-6)
    lp = torch.log_softmax(logits[prompt_len - 1: len(tokens) - 1].double() / t, dim=-1)
    return lp.gather(-1, torch.tensor(list(tokens[prompt_len:]))[:, None])[:, 0]


def fit_temperature(logits: Any, tokens: Sequence[int], prompt_len: int, rollout_lp: Sequence[float],
                    grid: Sequence[float] | None = None, mask: Any = None) -> tuple[float, float]:
    """The sampling temperature whose log-probs best match ``rollout_lp``: (temperature, mean abs diff there), over
    the response tokens ``mask`` keeps (default all: a multi-turn sample's inserted tokens have no engine
    log-prob)."""
    import torch  # torch, Megatron: only when a mismatch is localised

    grid = list(grid) if grid is not None else [round(0.05 * k, 2) for k in range(2, 81)]
    ref = torch.tensor(list(rollout_lp), dtype=torch.float64)
    keep = torch.ones_like(ref, dtype=torch.bool) if mask is None else mask

    def gap(t: float) -> float:
        return float((response_log_probs(logits, tokens, prompt_len, t) - ref).abs()[keep].mean())

    best = min(grid, key=gap)
    return best, gap(best)


def first_mismatch(samples: list, train_log_probs: list, threshold: float) -> int | None:
    """Index of the first sample whose train and rollout log-probs differ by more than ``threshold`` at some token."""
    for i, (s, lp) in enumerate(zip(samples, train_log_probs)):
        if s.rollout_log_probs is None or lp is None:
            continue
        mask = s.loss_mask if s.loss_mask is not None else [1] * len(s.rollout_log_probs)
        if any(m and not abs(float(x) - float(r)) <= threshold for x, r, m in zip(lp, s.rollout_log_probs, mask)):
            return i
    return None


def localize_sample(sample: Any, weights_dir: str, *, engine_dtype: str = "float32", trainer_dtype: str = "float32",
                    temperature: float = 1.0, tol: float | None = None, logprob_tol: float = 1e-3) -> Localization:
    """Localise a dumped sample's train/rollout mismatch: HF (engine dtype) vs Megatron (trainer dtype) on the
    sample's tokens, then the rollout log-probs against the engine-side logits at the trainer's temperature.
    ``logprob_tol`` is the mean per-token log-prob gap that counts as agreement (the run's log-prob threshold)."""
    import torch  # torch, Megatron: only when a mismatch is localised

    loc = localize(weights_dir, "megatron", sample.tokens, dtype_a=engine_dtype, dtype_b=trainer_dtype, tol=tol)
    logits_a, logits_b = loc.extra.pop("logits_a"), loc.extra.pop("logits_b")
    prompt_len = len(sample.tokens) - sample.response_length
    if sample.rollout_log_probs is None or sample.response_length == 0:
        return loc
    rollout = torch.tensor(sample.rollout_log_probs, dtype=torch.float64)
    # model tokens only: a multi-turn sample's inserted tokens carry no engine log-prob
    keep = torch.tensor(sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length).bool()
    if not keep.any():
        return loc
    engine_gap = (response_log_probs(logits_a, sample.tokens, prompt_len, temperature) - rollout).abs()[keep]
    trainer_gap = (response_log_probs(logits_b, sample.tokens, prompt_len, temperature) - rollout).abs()[keep]
    loc.extra["rollout_vs_hf_logprob_diff"] = float(engine_gap.max())
    loc.extra["rollout_vs_hf_logprob_mean_diff"] = float(engine_gap.mean())
    loc.extra["rollout_vs_megatron_logprob_diff"] = float(trainer_gap.max())
    best_t, fit = fit_temperature(logits_a, sample.tokens, prompt_len, sample.rollout_log_probs, mask=keep)
    loc.extra["fitted_temperature"] = best_t
    loc.extra["logprob_tol"] = logprob_tol
    if loc.first_divergent is None and float(engine_gap.mean()) > logprob_tol:
        if abs(best_t - temperature) > 0.05 and fit < logprob_tol:
            loc.notes.append(f"the rollout log-probs match these logits at temperature {best_t:g}, not at the "
                             f"trainer's {temperature:g}: a temperature mismatch between engine and trainer")
        else:
            loc.notes.append("the forwards agree on the checkpoint's weights but the rollout log-probs do not match "
                             "them: the engine held other weights (see the weight check) or sampled differently")
    return loc
