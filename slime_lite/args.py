"""Command-line flags of ``slime-lite train`` (slime's names), ``parse_args`` and ``parser_defaults``; nothing
else parses ``train`` flags.

``parse_args`` checks every rule between flags (args_check.py; the trainer's flags and layout rules: args_train.py) before Ray or any heavy import starts; a broken rule
is a SlimeLiteError that names the flags and the fix. A flag's default lives only in the parser: code that needs a group of flags takes
the frozen config built from the parsed namespace (``LossConfig.from_args(args)``, ...; slime_lite/config.py),
never ``getattr(args, name, default)``. ``parser_defaults()`` gives the namespace of a run with no flags (for tests
and tools that build one without a command line).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from slime_lite import rl_math, rollout_correction
from slime_lite.args_check import TIS_CLIP, UNDER_SWITCH, fill_implied, validate_args, warn_unread_flags
from slime_lite.args_observe import add_observability_flags
from slime_lite.args_train import add_train_flags
from slime_lite.flag_types import fraction, nonempty, nonneg_int, positive_float, top_k
from slime_lite.flag_types import nonneg_float as _nonneg_float
from slime_lite.flag_types import positive_int as _positive_int
from slime_lite.checks.faults import FAULTS
from slime_lite.config import FrozenFlags, freeze
from slime_lite.hooks import DEFAULT_ROLLOUT_FUNCTION
from slime_lite.rollout.agent_messages import TEMPLATE_OWN_ARGS
from slime_lite.rollout.rewards import RM_TYPES, rm_type_arg
from slime_lite.rollout.tool_calls import PARSER_CHOICES, REASONING_PARSERS
from slime_lite.slime_flags import add_args as add_slime_flags


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"enable_thinking\": false}}', got {text!r}")
    return value


def _template_kwargs(text: str) -> dict[str, Any]:
    value = _json_object(text)
    own = [k for k in TEMPLATE_OWN_ARGS if k in value]
    if own:
        raise argparse.ArgumentTypeError(f"{', '.join(own)}: set by slime-lite for each rendering (the generation "
                                         "prompt, the tools of a row); give only the template's own arguments")
    return value


def _key_value(text: str) -> str:
    key, eq, _ = text.partition("=")
    if not eq or not key or not key.replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (an environment variable), got {text!r}")
    return text


def _env_object(text: str) -> dict[str, Any]:
    """A JSON object of environment variables: names of letters, digits and underscores; text or number values."""
    value = _json_object(text)
    bad = next((k for k in value if not k or not k.replace("_", "").isalnum()), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"{bad!r} is not an environment variable name (letters, digits and "
                                         "underscores only)")
    bad = next((k for k, v in value.items() if not isinstance(v, (str, int, float))), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"the value of {bad!r} is {json.dumps(value[bad])}: give text or a number")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` flags, grouped as slime's documentation groups them."""
    p = argparse.ArgumentParser(
        prog="slime-lite train",
        usage="%(prog)s [flags]   (any --sglang-<name> [value] goes to the SGLang servers as --<name> [value])",
        description="RL post-training (GRPO/PPO/REINFORCE++) with Megatron-core and SGLang-compatible engines.",
        allow_abbrev=False,
    )
    g = p.add_argument_group("cluster", "where each process runs (without GPUs, each 'GPU' is one logical slot)")
    g.add_argument("--actor-num-nodes", type=_positive_int, default=1,
                   help="nodes of the training actor (default: %(default)s)")
    g.add_argument("--actor-num-gpus-per-node", type=_positive_int, default=1,
                   help="GPUs per node of the training actor (default: %(default)s)")
    g.add_argument("--critic-num-nodes", type=_positive_int, default=None,
                   help="nodes of the PPO critic (default: as --actor-num-nodes)")
    g.add_argument("--critic-num-gpus-per-node", type=_positive_int, default=None,
                   help="GPUs per node of the PPO critic (default: as --actor-num-gpus-per-node): GPUs of its own "
                        "after the actor's (slime puts the critic on the actor's GPUs), except under --colocate")
    g.add_argument("--rollout-num-gpus", type=_positive_int, default=None,
                   help="GPUs of all rollout engines together (default: 1; under --colocate, the actor's GPUs)")
    g.add_argument("--rollout-num-gpus-per-engine", type=_positive_int, default=1,
                   help="GPUs per engine, SGLang's tp_size (default: %(default)s; the embedded engine takes 1)")
    g.add_argument("--colocate", action="store_true",
                   help="engines and trainers share the same GPUs; turns on --offload-train and --offload-rollout")
    g.add_argument("--async", dest="async_train", action="store_true",
                   help="one-step-off training (slime's train_async.py): rollout r + 1 generates while rollout r "
                        "trains; needs disaggregated placement (not --colocate)")
    g.add_argument("--fully-async", action="store_true",
                   help="fully asynchronous training (slime's examples/fully_async): the engines generate "
                        "continuously and each step trains on the next --rollout-batch-size groups that finished; "
                        "a weight push pauses generation between decode steps and in-flight requests continue under "
                        "the new weights; needs disaggregated placement")
    g.add_argument("--max-weight-staleness", "--max-policy-version-lag", dest="max_weight_staleness",
                   type=nonneg_int, default=None, metavar="K",
                   help="--fully-async: a sample whose oldest token is more than K weight versions behind the "
                        "trainer is handled by --max-weight-staleness-mode (default: no bound)")
    g.add_argument("--max-weight-staleness-mode", choices=("drop", "mask"), default="drop",
                   help="drop: the sample's whole prompt group is not trained (counted in "
                        "rollout/async/dropped_stale_samples) and the next finished group takes its place; mask: "
                        "loss_mask 0 on the tokens older than K versions (rollout/async/masked_tokens) "
                        "(default: %(default)s)")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                   help="move the trainer's weights and optimizer state off the GPU while engines generate (on under "
                        "--colocate unless --no-offload-train)")
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="release the engines' weights and KV cache while the trainer trains (on under --colocate "
                        "unless --no-offload-rollout)")
    g.add_argument("--offload", action="store_true", help="--offload-train and --offload-rollout together")
    g.add_argument("--num-gpus-per-node", type=_positive_int, default=None,
                   help="GPUs per node for the engines (Ray places each engine's GPUs on one node): refused when "
                        "--rollout-num-gpus-per-engine does not divide it")
    g.add_argument("--rollout-backend", choices=("embedded", "sglang"), default="embedded",
                   help="rollout engines: slime_lite's own SGLang-compatible engine, or SGLang servers (GPU) "
                        "(default: %(default)s)")

    g = p.add_argument_group("model and checkpoint")
    g.add_argument("--hf-checkpoint", default=None,
                   help="Hugging Face model folder: tokenizer, architecture and initial weights (required)")
    g.add_argument("--load", default=None, help="resume training from this checkpoint folder (written by --save)")
    g.add_argument("--ref-load", default=None,
                   help="HF folder of the reference model for KL (default: --hf-checkpoint)")
    g.add_argument("--save", default=None, help="folder to write checkpoints to")
    g.add_argument("--save-interval", type=_positive_int, default=None,
                   help="save a checkpoint every N rollouts and after the last one (needs --save; default: "
                        "never)")

    add_train_flags(p)

    g = p.add_argument_group("rollout", "sampling and generation")
    g.add_argument("--rollout-temperature", type=_nonneg_float, default=1.0,
                   help="sampling temperature; the trainer scores log-probs at the same one (default: %(default)s)")
    g.add_argument("--rollout-top-p", type=float, default=1.0,
                   help="nucleus sampling, in (0, 1] (default: %(default)s)")
    g.add_argument("--rollout-top-k", type=top_k, default=-1, help="top-k sampling, -1 for off (default: %(default)s)")
    g.add_argument("--rollout-max-response-len", type=_positive_int, default=32,
                   help="max new tokens per response (default: %(default)s)")
    g.add_argument("--rollout-stop", type=nonempty, nargs="+", default=None,
                   help="stop strings (default: the EOS token only)")
    g.add_argument("--rollout-stop-token-ids", type=nonneg_int, nargs="+", default=None,
                   help="token ids that also end a response (rollouts and evals), besides the EOS token")
    g.add_argument("--rollout-max-prompt-len", type=_positive_int, default=None,
                   help="leave out, when the data is read, the prompts of more tokens (as rendered), logged "
                        "(default: keep all)")
    g.add_argument("--rollout-seed", type=int, default=42,
                   help="seed of prompt shuffling and sampling; engine i gets seed + i (default: %(default)s)")
    g.add_argument("--rollout-function-path", default=DEFAULT_ROLLOUT_FUNCTION,
                   help="module.fn generate_rollout(args, rollout_id, data_source, evaluation=False) -> "
                        "RolloutFnTrainOutput: the whole rollout of a step (default: %(default)s)")
    g.add_argument("--eval-function-path", default=None,
                   help="module.fn with the same signature, called with evaluation=True -> RolloutFnEvalOutput "
                        "(default: --rollout-function-path)")
    g.add_argument("--custom-generate-function-path", default=None,
                   help="module.fn async generate(args, sample, sampling_params) -> Sample or a list of Samples "
                        "(one trajectory split into training samples sharing rollout_id), replacing the default")
    g.add_argument("--max-turns", type=_positive_int, default=8,
                   help="model turns per multi-turn sample (rollout.multi_turn helpers; default: %(default)s)")
    g.add_argument("--max-inserted-tokens-per-turn", type=_positive_int, default=256,
                   help="tokens of one tool or environment turn; longer output is cut (default: %(default)s)")
    g.add_argument("--rollout-max-context-len", type=_positive_int, default=None,
                   help="tokens of a multi-turn sample, prompt included; a sample that would overflow ends "
                        "TRUNCATED (default, and at most: the model's max_position_embeddings - 1, what the "
                        "engine serves)")
    g.add_argument("--eval-max-context-len", type=_positive_int, default=None,
                   help="the same bound for eval samples: the multi-turn helpers and the built-in generate hooks "
                        "apply it when called with evaluation=True (default: --rollout-max-context-len)")
    g.add_argument("--tool-call-parser", choices=PARSER_CHOICES, default="auto",
                   help="the format the agent endpoint (rollout.agent_endpoint.openai_agent) reads the model's tool "
                        "calls in, SGLang's names: qwen25 (qwen, hermes: <tool_call>{json}</tool_call>), llama3 "
                        "(JSON after <|python_tag|>), pythonic ([f(a=1)]), qwen3_coder (<function=...> XML), glm45 "
                        "(glm: <arg_key> pairs); auto (default): the one the chat template writes, else qwen25")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="the agent endpoint returns a <think> block as reasoning_content, calls read after it "
                        "(SGLang's names); default: all text is content. The trained tokens are the same either way")
    g.add_argument("--tool-call-timeout", type=positive_float, default=30.0,
                   help="seconds per tool call; a tool that raises or hangs ends its sample FAILED "
                        "(default: %(default)s)")
    g.add_argument("--over-sampling-batch-size", type=_positive_int, default=None,
                   help="prompt groups started at a time, >= --rollout-batch-size: more start whenever the groups "
                        "generating plus those kept are fewer than --rollout-batch-size; once that many are done "
                        "(after --dynamic-sampling-filter-path) the rest are aborted on the engines and never "
                        "trained (default: --rollout-batch-size)")
    g.add_argument("--partial-rollout", action="store_true",
                   help="keep the samples aborted by over-sampling (tokens, log-probs, the weight version of each "
                        "token) and continue them first in the next rollout from the tokens they have, instead of "
                        "dropping them; needs --over-sampling-batch-size > --rollout-batch-size")
    g.add_argument("--mask-offpolicy-in-partial-rollout", action="store_true",
                   help="with --partial-rollout: loss_mask 0 on the tokens of a continued sample that older weights "
                        "generated before it was aborted (samples that had finished in an earlier rollout are "
                        "trained as they are, as in slime)")
    g.add_argument("--dynamic-sampling-filter-path", default=None,
                   help="module.fn keep(args, samples) over one group: a bool, or an object with a .keep bool (slime's "
                        "DynamicFilterOutput); "
                        "'slime_lite.rollout.filters.check_reward_nonzero_std' drops groups whose rewards agree")
    g.add_argument("--rollout-sample-filter-path", default=None,
                   help="module.fn filter(args, samples) -> None, called by the default rollout function with the "
                        "rollout's groups once generated: a sample it sets remove_sample on trains with loss mask 0 "
                        "(its reward still enters the group normalisation)")
    g.add_argument("--rollout-all-samples-process-path", default=None,
                   help="module.fn process(args, all_samples, data_source) -> None, called by the default rollout "
                        "function next, with every group that came back (the dynamic-sampling filter's drops too) "
                        "and, as slime, the data source's get_samples(n)")
    g.add_argument("--rollout-request-timeout", type=positive_float, default=300.0,
                   help="seconds per engine request (default: %(default)s); past it, an engine that still answers "
                        "/health is alive (the request is too long for the limit: the rollout stops naming this "
                        "flag), one that does not is taken out of rotation (restarted under --use-fault-tolerance)")
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="restart an engine that dies during the run (same placement, same launch), push it the "
                        "current weights and check them, and send the unfinished requests again; logged, and counted "
                        "in rollout/engine_restarts (default: a dead engine stops the run)")

    g = p.add_argument_group("data", "prompts and batch sizes")
    g.add_argument("--prompt-data", default=None, help="JSONL file of prompts (required unless --debug-train-only)")
    g.add_argument("--input-key", default="prompt", help="JSONL key of the prompt (default: %(default)s)")
    g.add_argument("--label-key", default="label", help="JSONL key of the label (default: %(default)s)")
    g.add_argument("--metadata-key", default="metadata",
                   help="JSONL key of a dict whose entries join the sample's metadata (the row's other fields are "
                        "kept there too) (default: %(default)s)")
    g.add_argument("--tool-key", default="tools",
                   help="JSONL key of a prompt's tools (a list of function schemas, or its JSON text): given to the "
                        "chat template with --apply-chat-template, and kept as metadata['tools'] (default: "
                        "%(default)s)")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="render each prompt with the tokenizer's chat template")
    g.add_argument("--apply-chat-template-kwargs", type=_template_kwargs, default="{}", metavar="JSON",
                   help="extra arguments of the chat template as a JSON object, e.g. '{\"enable_thinking\": false}' "
                        "for Qwen3; used for the prompts and every inserted multi-turn turn (default: none)")
    g.add_argument("--rollout-shuffle", action="store_true", help="shuffle the prompts every epoch")
    g.add_argument("--num-rollout", type=_positive_int, default=None,
                   help="rollouts (generate + train iterations) to run (default: 1, or as --num-epoch implies)")
    g.add_argument("--num-epoch", type=_positive_int, default=None,
                   help="without --num-rollout: --num-epoch x (prompts of --prompt-data, after "
                        "--rollout-max-prompt-len, // --rollout-batch-size) rollouts, as slime")
    g.add_argument("--rollout-batch-size", type=_positive_int, default=8,
                   help="prompts per rollout (default: %(default)s)")
    g.add_argument("--n-samples-per-prompt", type=_positive_int, default=1,
                   help="responses per prompt, the GRPO group size (default: %(default)s)")
    g.add_argument("--global-batch-size", type=_positive_int, default=None,
                   help="responses (trajectories: one an agent or a generate hook split into several training "
                        "samples counts once) per optimizer step; with --num-steps-per-rollout both must agree "
                        "(default: --rollout-batch-size x --n-samples-per-prompt / --num-steps-per-rollout)")
    g.add_argument("--num-steps-per-rollout", type=_positive_int, default=None,
                   help="optimizer steps per rollout (default: 1, or as --global-batch-size implies); the rollout's "
                        "train/ metrics are their mean, train/first_step/ the first step's; each step's are a line "
                        "of the --metrics-path steps file")
    g.add_argument("--micro-batch-size", type=_positive_int, default=1,
                   help="samples per forward/backward pass on one data-parallel rank (default: %(default)s)")
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="pack samples without padding into micro-batches of at most --max-tokens-per-gpu tokens "
                        "(balanced over data-parallel ranks; --micro-batch-size is then unused)")
    g.add_argument("--max-tokens-per-gpu", type=_positive_int, default=None,
                   help="token budget of one packed train micro-batch (with --use-dynamic-batch-size; a longer "
                        "sample gets a micro-batch of its own)")
    g.add_argument("--log-probs-max-tokens-per-gpu", type=_positive_int, default=None,
                   help="token budget of one packed micro-batch of the log-prob passes (default: --max-tokens-per-gpu)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="average the loss over all response tokens of a step instead of per-sample token means")

    g = p.add_argument_group("eval")
    g.add_argument("--eval-interval", type=nonneg_int, default=None,
                   help="evaluate every N rollouts, before training and at the end (needs --eval-prompt-data); 0 "
                        "turns eval off (e.g. appended to a script's flags)")
    g.add_argument("--eval-prompt-data", nargs="+", default=None, metavar="NAME PATH",
                   help="eval sets as pairs NAME PATH (JSONL; keys as --prompt-data unless --eval-*-key)")
    g.add_argument("--skip-eval-before-train", action="store_true",
                   help="no eval before the first rollout (--eval-interval still evaluates after training)")
    g.add_argument("--eval-max-prompt-len", type=_positive_int, default=None,
                   help="leave out the eval prompts of more tokens (default: keep all)")
    g.add_argument("--eval-min-new-tokens", type=nonneg_int, default=None,
                   help="eval responses are at least this many tokens (the EOS token is banned before; default: 0)")
    g.add_argument("--eval-reward-key", default=None,
                   help="key of a dict reward that eval metrics read (default: --reward-key)")
    g.add_argument("--eval-input-key", default=None, help="JSONL key of an eval prompt (default: --input-key)")
    g.add_argument("--eval-label-key", default=None, help="JSONL key of an eval label (default: --label-key)")
    g.add_argument("--eval-tool-key", default=None, help="JSONL key of an eval prompt's tools (default: --tool-key)")
    g.add_argument("--n-samples-per-eval-prompt", type=_positive_int, default=1,
                   help="responses per eval prompt (default: %(default)s)")
    g.add_argument("--eval-temperature", type=_nonneg_float, default=None,
                   help="eval sampling temperature (default: --rollout-temperature)")
    g.add_argument("--eval-max-response-len", type=_positive_int, default=None,
                   help="max new tokens per eval response (default: --rollout-max-response-len)")

    g.add_argument("--eval-top-p", type=float, default=None, help="eval nucleus sampling (default: --rollout-top-p)")
    g.add_argument("--eval-top-k", type=top_k, default=None, help="eval top-k sampling (default: --rollout-top-k)")
    g = p.add_argument_group("algorithm", "advantages and losses")
    critics = ", ".join(e.name for e in rl_math.ESTIMATORS.values() if e.needs_critic)
    g.add_argument("--advantage-estimator", choices=tuple(rl_math.ESTIMATORS), default="grpo",
                   help=f"(default: %(default)s; {critics} train(s) a critic)")
    g.add_argument("--loss-type", choices=(*rl_math.POLICY_LOSSES, rl_math.CUSTOM_LOSS), default="policy_loss",
                   help="the policy loss: policy_loss is PPO's clipped surrogate, custom_loss the one of "
                        "--custom-loss-function-path (default: %(default)s)")
    g.add_argument("--use-kl-loss", action="store_true",
                   help="add --kl-loss-coef x KL(actor || reference) to the policy loss")
    g.add_argument("--kl-loss-coef", type=_nonneg_float, default=0.0,
                   help="weight of the KL loss (default: %(default)s)")
    g.add_argument("--kl-loss-type", choices=rl_math.KL_TYPES, default="k1",  # slime's default
                   help="KL estimator of the KL loss and the reward penalty (default: %(default)s)")
    g.add_argument("--kl-coef", type=_nonneg_float, default=0.0,
                   help="KL penalty in the reward, PPO/REINFORCE++ only (default: %(default)s)")
    g.add_argument("--eps-clip", type=_nonneg_float, default=0.2,
                   help="PPO ratio clip, lower side (default: %(default)s)")
    g.add_argument("--eps-clip-high", type=_nonneg_float, default=None,
                   help="PPO ratio clip, upper side (default: --eps-clip)")
    g.add_argument("--eps-clip-c", type=float, default=None,
                   help="dual-clip bound (> 1) on the loss of negative-advantage tokens (default: off)")
    g.add_argument("--entropy-coef", type=_nonneg_float, default=0.0,
                   help="entropy bonus weight in the policy loss (default: %(default)s)")
    g.add_argument("--normalize-advantages", action="store_true",
                   help="whiten the advantages over the batch (REINFORCE++ always does)")
    g.add_argument("--disable-grpo-std-normalization", action="store_true",
                   help="GRPO: subtract the group mean only, do not divide by the group std")
    g.add_argument("--gamma", type=fraction, default=1.0,
                   help="discount of PPO/REINFORCE++ returns (default: %(default)s)")
    g.add_argument("--lambd", type=fraction, default=1.0, help="GAE lambda of PPO (default: %(default)s)")
    g.add_argument("--value-clip", type=_nonneg_float, default=0.2,
                   help="PPO critic: clip of the value change (default: %(default)s)")
    g.add_argument("--use-tis", action="store_true",
                   help="importance sampling against the engine's policy: weight the policy loss by the ratio "
                        "exp(old - rollout log-prob) at --tis-level, bounded by --tis-mode (default: truncated "
                        "at --tis-clip)")
    g.add_argument("--tis-clip", type=_nonneg_float, default=TIS_CLIP,
                   help="upper bound of the IS weight (default: %(default)s)")
    g.add_argument("--tis-clip-low", type=_nonneg_float, default=UNDER_SWITCH["use_tis"]["tis_clip_low"],
                   help="lower bound of the IS weight: a floor in truncate mode (default: none), the lower "
                        "rejection bound in mask mode (default: 1/--tis-clip)")
    g.add_argument("--tis-level", choices=rollout_correction.IS_LEVELS,
                   default=UNDER_SWITCH["use_tis"]["tis_level"],
                   help="IS ratio per token, per sample (product over its tokens), or per sample as the geometric "
                        "mean of its token ratios (default: %(default)s)")
    g.add_argument("--tis-mode", choices=rollout_correction.TIS_MODES, default=UNDER_SWITCH["use_tis"]["tis_mode"],
                   help="truncate: cap the weight at --tis-clip (TIS); mask: tokens (or samples) whose ratio is "
                        "outside [--tis-clip-low, --tis-clip] leave the loss (MIS) (default: %(default)s)")
    g.add_argument("--use-rs", action="store_true",
                   help="rejection sampling: tokens (or samples) whose ratio at --rs-level is outside "
                        "[--rs-lower-bound, --rs-upper-bound] leave the loss, with or without --use-tis")
    g.add_argument("--rs-level", choices=rollout_correction.IS_LEVELS, default=UNDER_SWITCH["use_rs"]["rs_level"],
                   help="level of the --use-rs ratio (default: %(default)s)")
    g.add_argument("--rs-lower-bound", type=_nonneg_float, default=UNDER_SWITCH["use_rs"]["rs_lower_bound"],
                   help="--use-rs lower bound (default: 1/--rs-upper-bound)")
    g.add_argument("--rs-upper-bound", type=_nonneg_float, default=UNDER_SWITCH["use_rs"]["rs_upper_bound"],
                   help="--use-rs upper bound (default: --tis-clip)")
    g.add_argument("--rs-veto-threshold", type=_nonneg_float,
                   default=UNDER_SWITCH["use_rs"]["rs_veto_threshold"],
                   help="--use-rs: reject a whole sample with any token ratio below this, e.g. 1e-4 (default: off)")
    g.add_argument("--get-mismatch-metrics", action="store_true",
                   help="log train vs rollout log-prob mismatch metrics per rollout (mismatch/*: token and "
                        "sequence importance ratios, k3 KL, the worst tokens; with --dump-details also "
                        "DIR/mismatch/<rollout_id>.jsonl; with --use-rollout-routing-replay one more forward pass "
                        "with the trainer's own routing: train/train_rollout_logprob_abs_diff_without_replay and "
                        "train/replay_logprob_abs_diff)")
    g.add_argument("--mismatch-ratio-bound", type=float,
                   default=UNDER_SWITCH["get_mismatch_metrics"]["mismatch_ratio_bound"],
                   help="--get-mismatch-metrics: count ratios outside [1/c, c] for this c > 1 (default: "
                        "%(default)s)")
    g.add_argument("--mismatch-top-k", type=int, default=UNDER_SWITCH["get_mismatch_metrics"]["mismatch_top_k"],
                   help="--get-mismatch-metrics: how many worst tokens to report (default: %(default)s)")

    g = p.add_argument_group("reward model")
    g.add_argument("--rm-type", type=rm_type_arg, default=None, metavar="{" + ",".join(RM_TYPES) + ",boxed_<type>}",
                   help="built-in reward of rows without an rm_type field (or give --custom-rm-path)")
    g.add_argument("--reward-key", default=None, help="key to pick when the reward is a dict")
    g.add_argument("--custom-rm-path", default=None,
                   help="module.fn async reward(args, sample) -> float or dict; replaces --rm-type")
    g.add_argument("--custom-reward-post-process-path", default=None,
                   help="module.fn post_process(args, samples) -> (raw_rewards, rewards), one of each per sample of "
                        "a rollout: the advantage estimator takes the rewards as they are, without its group "
                        "normalisation (rollout/raw_reward and rollout/rewards log their means)")
    g.add_argument("--rm-url", default=None,
                   help="URL of a reward model service for --rm-type remote_rm (or rows whose rm_type field is "
                        "remote_rm): it gets POST {prompt, response, label} and answers a JSON number or object")
    g.add_argument("--group-rm", action="store_true",
                   help="score each prompt's group at once: --custom-rm-path gets (args, samples) and returns one "
                        "reward per sample (e.g. a reward model that ranks the responses)")

    g = p.add_argument_group("debug")
    g.add_argument("--debug-rollout-only", action="store_true", help="engines only; Megatron is never imported")
    g.add_argument("--debug-train-only", action="store_true", help="train only; no engines")
    g.add_argument("--save-debug-rollout-data", default=None, metavar="TEMPLATE",
                   help="save each rollout's samples to TEMPLATE.format(rollout_id=i), e.g. /d/{rollout_id}.pt")
    g.add_argument("--save-debug-train-data", default=None, metavar="TEMPLATE",
                   help="save what training computed per sample and token (log-probs before the update, ref and "
                        "rollout log-probs, advantages, returns, values, loss mask, entropy) to "
                        "TEMPLATE.format(rollout_id=i, rank=r), e.g. /d/train_{rollout_id}_{rank}.pt; joins with "
                        "--save-debug-rollout-data on the sample index (slime-lite explain)")
    g.add_argument("--load-debug-rollout-data", default=None, metavar="TEMPLATE",
                   help="train on saved rollouts instead of generating (implies --debug-train-only)")
    g.add_argument("--load-debug-rollout-data-subsample", type=float, default=None,
                   help="train on this fraction, in (0, 1], of each loaded rollout")
    g.add_argument("--dump-details", default=None, metavar="DIR",
                   help="save rollout and train data (log-probs, advantages) of every rollout under DIR (a replay "
                        "needs a DIR of its own, not the folder holding the dumps it reads)")
    g.add_argument("--check-weight-update-equal", action="store_true",
                   help="after every weight push, check that each engine holds exactly the trainer's weights")
    g.add_argument("--debug-env", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="set an environment variable in every Ray process, e.g. CUDA_LAUNCH_BLOCKING=1 (repeatable)")
    g.add_argument("--train-env-vars", type=_env_object, default="{}", metavar="JSON",
                   help="environment variables of the train processes only (actor and critic ranks), as slime: a "
                        "JSON object, e.g. '{\"PYTORCH_CUDA_ALLOC_CONF\": \"expandable_segments:True\"}'; over "
                        "--debug-env's (default: none)")
    g.add_argument("--debug-scramble-engine-weights", action="store_true",
                   help="overwrite engine weights with noise before each push, so a parameter the push skips is "
                        "caught by --check-weight-update-equal even if it equals the old value")
    g.add_argument("--debug-inject-fault", choices=tuple(FAULTS), default=None,
                   help="deliberately break one thing, to see the checks catch it (testing only): "
                        + "; ".join(f"{k}: {v}" for k, v in FAULTS.items()))

    add_observability_flags(p)

    g = p.add_argument_group(
        "SGLang and engines",
        "the embedded engine (--rollout-backend embedded) or SGLang servers; any other --sglang-<name> [value] is "
        "passed to each SGLang server as --<name> [value]")
    g.add_argument("--rollout-external-engine-addrs", default=None,
                   help="host:port,... of engines already running; none are started")
    g.add_argument("--rollout-device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="device of embedded engines (auto: cuda when available)")
    g.add_argument("--engine-dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="dtype of embedded engines (auto: the checkpoint's)")
    g.add_argument("--engine-max-running-requests", type=_positive_int, default=None,
                   help="embedded engine: requests decoded together (default: on CUDA every request of a rollout "
                        "at once, at least 64, as many as fit with a slot's tokens each in 30%% of the GPU's memory "
                        "or in --engine-kv-cache-tokens; on CPU 64)")
    g.add_argument("--engine-kv-cache-tokens", type=_positive_int, default=None,
                   help="embedded engine: KV-cache size in tokens (default: max running requests x a slot's tokens: "
                        "4096 or a run's longest request, --rollout-max-context-len or the longest response plus "
                        "--rollout-max-prompt-len, else 1024, within the model's context)")
    g.add_argument("--engine-disable-cuda-graph", action="store_true",
                   help="embedded engine on CUDA: decode eagerly instead of replaying CUDA graphs")
    g.add_argument("--engine-enable-torch-compile", action="store_true",
                   help="embedded engine on CUDA: torch.compile the layers of the CUDA-graph decode step")
    g.add_argument("--use-sglang-router", action="store_true",
                   help="--rollout-backend sglang: put SGLang's router (sglang_router) in front of the engines")
    g.add_argument("--sglang-server-module", default="sglang.launch_server",
                   help="module run as 'python -m MODULE' for each SGLang engine (not passed to SGLang)")
    add_slime_flags(p)  # Megatron architecture flags and slime flags (slime_lite/slime_flags.py)
    p.set_defaults(num_rollout_per_epoch=None)  # not a flag: --num-epoch's rollouts per epoch (args_check)
    return p


NOT_PASSTHROUGH = ("--sglang-server-module",)  # slime_lite's own flags that share the --sglang- prefix


def split_sglang_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Take ``--sglang-<name> [value ...]`` out of argv; returns (rest, passthrough as ``--<name> [value ...]``).
    Every word up to the next flag is a value (``--sglang-cuda-graph-bs-decode 2 4``): ``train`` takes no
    positional arguments, so a word after a flag always belongs to that flag."""
    rest: list[str] = []
    sglang: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--sglang-") and arg.partition("=")[0] not in NOT_PASSTHROUGH:
            name, eq, value = arg.partition("=")
            sglang.append("--" + name[len("--sglang-"):])
            if eq:
                sglang.append(value)
            while not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                sglang.append(argv[i + 1])
                i += 1
        else:
            rest.append(arg)
        i += 1
    return rest, sglang


def parse_args(argv: list[str] | None = None) -> FrozenFlags:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, sglang = split_sglang_args(argv)
    args = build_parser().parse_args(rest)
    args.sglang_args = sglang
    validate_args(args)
    warn_unread_flags(args, {a.split("=", 1)[0] for a in rest if a.startswith("--")})
    return freeze(args)  # read-only from here on: runtime state lives in the objects that own it


def parser_defaults(**overrides: Any) -> argparse.Namespace:
    """The namespace of ``slime-lite train`` with no flags, ``overrides`` applied, and the values that default to
    other flags filled in (as ``validate_args`` fills them); no other rule is checked. For tests and tools that
    need a full namespace without a command line."""
    args = build_parser().parse_args([])
    args.sglang_args = []
    unknown = sorted(set(overrides) - set(vars(args)))
    if unknown:
        raise TypeError(f"not flags of slime-lite train: {unknown}")
    vars(args).update(overrides)
    fill_implied(args)
    if args.num_steps_per_rollout is None and args.global_batch_size is None:
        args.num_steps_per_rollout = 1
    return args
