"""More of slime's flags that slime-lite parses and refuses (slime_flags.py merges this table into its
``NOT_SUPPORTED``): each typed as slime types it, so slime's values parse, with the reason and the way out."""

from __future__ import annotations

import json
from typing import Any

_FLAG = {"action": "store_true", "default": None}


def _v(kind: Any = str, **kw: Any) -> dict[str, Any]:
    return {"type": kind, "default": None, **kw}


_NO_CP = "context parallelism is not supported (--context-parallel-size 1 only)"
_NO_MTP = ("slime-lite builds no multi-token-prediction (MTP) layers: the model is config.json's decoder only; "
           "drop the MTP flags")
_NO_OPD = ("no on-policy distillation: there is no teacher model (the reference model enters only through "
           "--use-kl-loss / --kl-coef)")
_NO_BUFFER = ("slime's external rollout buffer (--rollout-buffer-url agents) is not implemented: generate with "
              "--custom-generate-function-path or --rollout-function-path instead")
_NO_DISK_DELTA = ("weights are always pushed in full (--update-weight-mode full): there is no delta encoding")
_NO_DEEPGEMM = ("no FP8 DeepGEMM forward: the trainer's linears run in the training dtype (--bf16 or float32)")
_NO_MEGATRON_HOOK = ("slime's Megatron-internal hooks are not called: slime-lite's trainer takes "
                     "--custom-loss-function-path, --custom-advantage-function-path and "
                     "--custom-pg-loss-reducer-function-path")

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "--allgather-cp": (_FLAG, _NO_CP + ", so there is no all-gather CP variant: drop it"),
    "--async-save": (_FLAG, "checkpoints are written synchronously at --save-interval: drop it"),
    "--balance-by-flops": (_FLAG, "micro-batches are packed first-fit by tokens (--max-tokens-per-gpu), not "
                                  "partitioned by FLOPs; --balance-data balances the data-parallel ranks by "
                                  "Megatron's FLOPs estimate"),
    "--buffer-filter-path": (_v(), "no slime sample buffer to filter: --partial-rollout carries aborted samples "
                                   "and continues them first; filter groups with --dynamic-sampling-filter-path"),
    "--custom-config-path": (_v(), "no YAML of extra args attributes: give the flags on the command line, or read "
                                   "the file in the hook itself (e.g. a path set with --debug-env)"),
    "--custom-megatron-before-log-prob-hook-path": (_v(), _NO_MEGATRON_HOOK),
    "--custom-megatron-before-train-step-hook-path": (_v(), _NO_MEGATRON_HOOK),
    "--custom-megatron-init-path": (_v(), _NO_MEGATRON_HOOK),
    "--custom-model-provider-path": (_v(), "the model is always built from --hf-checkpoint's config.json "
                                           "(slime_lite/model_families.py); no custom Megatron model provider"),
    "--custom-update-weight-post-write-path": (_v(), "the disk push (--update-weight-transport disk) writes to a "
                                                     "folder the engines read directly; no post-write hook"),
    "--data-source-path": (_v(), "the data source is always slime-lite's over --prompt-data; a "
                                 "--rollout-function-path that manages its own prompts can ignore the data_source "
                                 "it is given"),
    "--disable-compute-advantages-and-returns": (_FLAG, "advantages and returns are always computed by "
                                                        "--advantage-estimator (replace them with "
                                                        "--custom-advantage-function-path; a "
                                                        "--custom-loss-function-path may ignore them)"),
    "--disable-rollout-global-dataset": (_FLAG, "the rollout always reads its prompts from --prompt-data; a "
                                                "--rollout-function-path that manages its own prompts can ignore "
                                                "the data_source it is given"),
    "--enable-mtp-training": (_FLAG, _NO_MTP),
    "--mtp-num-layers": (_v(int), _NO_MTP),
    "--mtp-loss-scaling-factor": (_v(float), _NO_MTP),
    "--eval-config": (_v(), "no OmegaConf eval-set file: give the sets as --eval-prompt-data NAME PATH ... with "
                            "the --eval-* flags (keys, sampling, lengths)"),
    "--fetch-trajectory-retry-times": (_v(int), _NO_BUFFER),
    "--min-batch-collection-ratio": (_v(float), _NO_BUFFER),
    "--rollout-buffer-url": (_v(), _NO_BUFFER),
    "--rollout-task-type": (_v(), _NO_BUFFER),
    "--freeze-indexer": (_FLAG, "slime-lite builds no DSA indexer (no DeepSeek sparse-attention models); "
                                  "other parameters freeze with --freeze-params-name-list"),
    "--load-forge-rollout-data": (_v(), "no replay with live engines: --load-debug-rollout-data replays dumped "
                                        "rollouts (without engines; implies --debug-train-only)"),
    "--megatron-config-path": (_v(), "no YAML of Megatron roles: the critic is set with the --critic-* flags"),
    "--megatron-deepgemm-forward-layers": (_v(int, nargs="+"), _NO_DEEPGEMM),
    "--megatron-deepgemm-forward-modules": (_v(nargs="+"), _NO_DEEPGEMM),
    "--megatron-deepgemm-moe-forward-layers": (_v(int, nargs="+"), _NO_DEEPGEMM),
    "--megatron-deepgemm-moe-forward-modules": (_v(nargs="+"), _NO_DEEPGEMM),
    "--multimodal-keys": (_v(json.loads), "text-only models and prompts: no images or other media"),
    "--use-opd": (_FLAG, _NO_OPD),
    "--opd-type": (_v(choices=("sglang", "megatron")), _NO_OPD),
    "--opd-kl-coef": (_v(float), _NO_OPD),
    "--opd-teacher-load": (_v(), _NO_OPD),
    "--opd-teacher-ckpt-step": (_v(int), _NO_OPD),
    "--use-opsm": (_FLAG, "no off-policy sequence masking: --use-rs --rs-level sequence (or geometric) rejects "
                          "sequences whose importance ratio is out of bounds"),
    "--opsm-delta": (_v(float), "no off-policy sequence masking (see --use-rs)"),
    "--qwen-gdn-backend": (_v(choices=("fla", "flashqla")), "slime-lite builds no linear-attention (GDN) layers: "
                                                            "Qwen3-Next models are refused"),
    "--ref-ckpt-step": (_v(int), "--ref-load takes a Hugging Face folder, not a Megatron checkpoint's step"),
    "--release-train": (_FLAG, "the train ranks live for the whole run: --offload-train moves their weights and "
                               "optimizer state off the GPU while the engines generate"),
    "--rollout-data-postprocess-path": (_v(), "no hook after the log-prob passes: loss masks come from the "
                                              "rollout (a generate hook or --rollout-sample-filter-path)"),
    "--rollout-sample-hook-path": (_v(action="append"), "no per-sample hook before the reward: wrap the "
                                                        "generation in --custom-generate-function-path, or "
                                                        "post-process in --custom-rm-path"),
    "--update-weight-delta-checksum": (_v(choices=("xxh3-128", "blake3", "adler32")), _NO_DISK_DELTA),
    "--update-weight-delta-encoding": (_v(choices=("xor", "overwrite")), _NO_DISK_DELTA),
    "--update-weight-disk-dir": (_v(), "the disk push (--update-weight-transport disk) writes under "
                                       "--save/weight_push (or the temp folder without --save)"),
    "--update-weight-disk-keep-files": (_FLAG, "the disk push always removes a version's folder once the engines "
                                               "loaded the next one (the last one stays)"),
    "--update-weight-local-checkpoint-dir": (_v(), "no host-local copy for the engines: they read the disk "
                                                   "push's folder directly"),
    "--use-distributed-post": (_FLAG, "requests go to the engines from the rollout manager's own HTTP client; no "
                                      "Ray actors posting per node"),
    "--use-stateless-adam": (_FLAG, "Megatron's Adam keeps its moments across steps (--reset-optimizer-states "
                                    "clears them before each rollout's steps)"),
}
