"""The tiny model: a real Hugging Face checkpoint (Qwen2 by default; ``--arch qwen3|glm4`` for the other dense
families, ``--arch qwen3_moe|qwen2_moe`` for Mixture-of-Experts ones: ``--num-experts`` routed experts of
``--moe-intermediate-size``, top ``--num-experts-per-tok``; Qwen2-MoE adds a gated shared expert of
``--intermediate-size``)
with a character-level tokenizer, built locally.

``slime-lite make-tiny-model --out DIR`` writes config.json, model.safetensors, generation_config.json,
tokenizer.json and tokenizer_config.json. The weights are warm-started by a short supervised fit on the task
data (prompt text, then the label, then ``<|endoftext|>``; loss on the answer tokens only), so greedy answers
are on-task and right often enough for RL to have signal, wrong often enough to leave room.

The tokenizer lives in :mod:`slime_lite.tokenizer`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (AutoModelForCausalLM, GenerationConfig, Glm4Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                          Qwen3MoeConfig)

from slime_lite import tasks
from slime_lite.errors import SlimeLiteError
from slime_lite.model_families import FAMILIES
from slime_lite.rollout import calc_task
from slime_lite.tokenizer import build_tokenizer, save_tokenizer

logger = logging.getLogger(__name__)

VOCAB_PAD_MULTIPLE = 64  # the model's vocab_size is padded (as Qwen does) so TP sizes 1/2/4/8 divide it
ARCHS = ("qwen2", "qwen3", "glm4", "qwen3_moe", "qwen2_moe")  # --arch: the families of slime_lite/model_families.py with a tiny build here


def _config(arch: str, vocab_size: int, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
            head_dim: int, intermediate_size: int, tie_word_embeddings: bool, num_experts: int = 4,
            num_experts_per_tok: int = 2, moe_intermediate_size: int = 96):
    """The HF config of a tiny model of family ``arch`` (Qwen3: QK-norm, no biases; GLM4: partial interleaved
    rotary over half of each head, q/k/v biases, post-attention and post-MLP norms, fused gate/up)."""
    family = FAMILIES[arch]
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, architectures=[family.architecture],
    )
    if arch != "qwen2" or head_dim != hidden_size // num_heads:  # Qwen3 and GLM4 always store theirs
        common["head_dim"] = head_dim
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False, max_window_layers=num_layers)
    if arch == "qwen3":
        return Qwen3Config(**common, use_sliding_window=False, attention_bias=False)
    moe = dict(num_experts=num_experts, num_experts_per_tok=num_experts_per_tok, norm_topk_prob=arch == "qwen3_moe",
               moe_intermediate_size=moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
               use_sliding_window=False)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, attention_bias=False)
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=intermediate_size, qkv_bias=True,
                              max_window_layers=num_layers)
    return Glm4Config(**common, attention_bias=True, partial_rotary_factor=0.5)


# Warm start settings. The fit runs at a constant learning rate (after a short warmup) for at most WARM_START_STEPS
# steps, measures greedy exact match on a dev slice every WARM_START_EVAL_EVERY steps, keeps the weights whose dev
# accuracy is closest to the target, and stops once dev accuracy is past the target by WARM_START_OVERSHOOT.
# Accuracy rises steeply (about 10% to 50% within ~100 steps, at a seed-dependent time), so choosing the
# checkpoint, rather than a step count, is what lands reliably in the 10-50% band.
WARM_START_STEPS = 1500
WARM_START_TARGET = 0.3
WARM_START_EVAL_EVERY = 20
WARM_START_OVERSHOOT = 0.15
WARM_START_BATCH = 64
WARM_START_LR = 1e-3
WARM_START_DEV = 200


# tool_math transcripts are ~220 tokens (the others ~12): fewer per step, a slice of the ~140k problems (tokenizing
# them all takes minutes), and its dev check is teacher-forced
TOOL_WARM_START_BATCH = 16
TOOL_WARM_START_ROWS = 4000


def _encode_examples(tokenizer, rows: list[dict], task: str) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) for each row: prompt + label + eos, the loss on what follows the prompt; for tool_math the
    whole calculator conversation, the loss on the model's turns only (the tool results are not the model's)."""
    if task == "tool_math":
        pieces = [calc_task.transcript(tokenizer, r["prompt"]) for r in rows]
        flat = tokenizer([text for row in pieces for text, _ in row], add_special_tokens=False)["input_ids"]
        out, k = [], 0
        for row in pieces:
            ids, mask = [], []
            for _, model_turn in row:
                ids += flat[k]
                mask += [int(model_turn)] * len(flat[k])
                k += 1
            out.append((ids, mask))
        return out
    prompts = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r["label"] for r in rows], add_special_tokens=False)["input_ids"]
    return [(p + a + [tokenizer.eos_token_id], [0] * len(p) + [1] * (len(a) + 1)) for p, a in zip(prompts, answers)]


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, mask) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
        attention[i, : len(ids)] = 1
    return input_ids, attention, labels


def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
    """Greedy completions of raw-text prompts (batched by prompt length, so no padding), cut at eos."""

    by_len: dict[int, list[int]] = {}
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    answers = [""] * len(prompts)
    eos = tokenizer.eos_token_id
    model.eval()
    with torch.no_grad():
        for idx in by_len.values():
            seq = torch.tensor([encoded[i] for i in idx], device=model.device)
            done = torch.zeros(len(idx), dtype=torch.bool, device=model.device)
            new: list[torch.Tensor] = []
            for _ in range(max_new_tokens):
                nxt = model(input_ids=seq).logits[:, -1].argmax(-1)
                nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                new.append(nxt)
                done |= nxt == eos
                seq = torch.cat([seq, nxt[:, None]], dim=1)
                if done.all():
                    break
            gen = torch.stack(new, dim=1).tolist()
            for row, i in zip(gen, idx):
                row = row[: row.index(eos)] if eos in row else row
                answers[i] = tokenizer.decode(row)
    return answers


def _teacher_forced_exact(model, tokenizer, examples: list[tuple[list[int], list[int]]]) -> tuple[float, list[str]]:
    """Share of examples whose every model-turn token is the greedy choice given the right conversation before it:
    a greedy rollout then writes exactly that conversation (with the calculator answering), so this is its success
    rate (a greedy run that reaches the answer another way is not counted). Per example: "right" or "wrong"."""
    right, answers = 0, []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(examples), 50):
            input_ids, attention, labels = (t.to(model.device) for t in _batch(examples[start:start + 50],
                                                                              tokenizer.pad_token_id))
            pred = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].argmax(-1)
            target = labels[:, 1:]
            ok = ((pred == target) | (target == -100)).all(dim=1)
            right += int(ok.sum())
            answers += ["right" if good else "wrong" for good in ok.tolist()]
    return right / max(1, len(examples)), answers


def _exact_match(model, tokenizer, rows: list[dict], task: str = "addition",
                 encoded: list[tuple[list[int], list[int]]] | None = None) -> tuple[float, list[str]]:
    """Greedy exact match of the rows; tool_math: teacher-forced over their ``encoded`` transcripts."""
    if task == "tool_math":
        return _teacher_forced_exact(model, tokenizer, encoded or _encode_examples(tokenizer, rows, task))
    answers = greedy_answers(model, tokenizer, [r["prompt"] for r in rows])
    return sum(a == r["label"] for a, r in zip(answers, rows)) / max(1, len(rows)), answers


def warm_start(model, tokenizer, *, task: str, steps: int, seed: int, target: float | None = WARM_START_TARGET,
               batch_size: int = WARM_START_BATCH, lr: float = WARM_START_LR) -> dict[str, Any]:
    """Supervised fit on the task's train split; report greedy exact match on its held-out eval split.

    With ``target`` set, keep the checkpoint whose dev accuracy (a slice of the train split held out of the
    fit) is closest to it; with ``target=None`` keep the last weights.
    """


    train_rows, eval_rows = tasks.split_problems(task, n_train=tasks.n_problems(task) - tasks.DEFAULT_N_EVAL,
                                                 n_eval=tasks.DEFAULT_N_EVAL, seed=seed)  # make-data's, same seed
    dev_rows, train_rows = train_rows[:WARM_START_DEV], train_rows[WARM_START_DEV:]
    if task == "tool_math":
        train_rows = train_rows[:TOOL_WARM_START_ROWS]
        batch_size = min(batch_size, TOOL_WARM_START_BATCH)
    examples = _encode_examples(tokenizer, train_rows, task)
    dev_encoded = _encode_examples(tokenizer, dev_rows, task) if task == "tool_math" else None
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    start = time.perf_counter()
    best: tuple[float, int, float, dict] | None = None  # (distance to target, step, dev accuracy, weights)
    first_loss, loss_value, done = float("nan"), float("nan"), 0
    try:
        for step in range(1, steps + 1):
            model.train()
            pick = torch.randint(len(examples), (batch_size,), generator=gen).tolist()
            input_ids, attention, labels = (t.to(model.device) for t in _batch([examples[i] for i in pick],
                                                                               tokenizer.pad_token_id))
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_value, done = loss.item(), step
            if step == 1:
                first_loss = loss_value
            if target is None or (step % WARM_START_EVAL_EVERY and step != steps):
                continue
            dev_acc, _ = _exact_match(model, tokenizer, dev_rows, task, dev_encoded)
            logger.info("warm start step %d/%d loss %.4f dev exact match %.3f", step, steps, loss_value, dev_acc)
            if best is None or abs(dev_acc - target) < best[0]:
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
                best = (abs(dev_acc - target), step, dev_acc, weights)
            if dev_acc >= target + WARM_START_OVERSHOOT:
                break
        if best is not None:
            model.load_state_dict(best[3])
        train_seconds = time.perf_counter() - start
        accuracy, answers = _exact_match(model, tokenizer, eval_rows, task)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    kept = best[1] if best is not None else done
    logger.info("warm start: ran %d steps in %.1fs, kept step %d, eval exact match %.3f", done, train_seconds,
                kept, accuracy)
    return {
        "steps": done, "kept_step": kept, "dev_accuracy": best[2] if best is not None else None,
        "first_loss": round(first_loss, 4), "final_loss": round(loss_value, 4), "train_seconds": round(train_seconds, 2), "accuracy": accuracy,
        "eval_prompts": len(eval_rows),
        "examples": [{"prompt": r["prompt"], "label": r["label"], "answer": a}
                     for r, a in list(zip(eval_rows, answers))[:5]],
    }


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise SlimeLiteError(f"--out {out}: exists and is not a folder; pick another path.")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise SlimeLiteError(
            f"--out {out}: folder is not empty and holds no model (no config.json); "
            "pick a new or empty folder, or a folder made by make-tiny-model to overwrite it."
        )


def _fix_config_json(path: Path) -> None:
    """Add the keys older transformers / SGLang read (rope_theta, partial_rotary_factor, torch_dtype) next to the
    new ones."""
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in rope:
        cfg.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def make_tiny_model(
    out_dir: str | os.PathLike,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    head_dim: int | None = None,
    arch: str = "qwen2",
    task: str = "addition",
    warm_start_steps: int | None = None,
    warm_start_target: float | None = WARM_START_TARGET,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 96,
    device: str = "cpu",
    warm_start_lr: float = WARM_START_LR,
) -> dict[str, Any]:
    """Build, warm-start and save the tiny model of family ``arch``; return a report (params, steps, seconds, eval
    accuracy). ``head_dim`` defaults to hidden_size / num_heads. ``device``: where the warm start runs (a GPU makes
    the warm start of a large shape practical); the checkpoint is saved in float32 either way."""


    for name, value in (("--hidden-size", hidden_size), ("--num-layers", num_layers), ("--num-heads", num_heads),
                        ("--num-kv-heads", num_kv_heads), ("--intermediate-size", intermediate_size),
                        ("--num-experts", num_experts), ("--num-experts-per-tok", num_experts_per_tok),
                        ("--moe-intermediate-size", moe_intermediate_size)):
        if value <= 0:
            raise SlimeLiteError(f"{name} {value}: must be a positive integer.")
    if arch not in ARCHS:
        raise SlimeLiteError(f"--arch {arch!r}: choose one of {', '.join(ARCHS)}.")
    if num_experts_per_tok > num_experts:
        raise SlimeLiteError(f"--num-experts-per-tok {num_experts_per_tok}: at most --num-experts ({num_experts}).")
    if head_dim is None:
        if hidden_size % num_heads:
            raise SlimeLiteError(f"--hidden-size {hidden_size} / --num-heads {num_heads}: the hidden size must split "
                                 "into the heads, or give --head-dim.")
        head_dim = hidden_size // num_heads
    # GLM4 turns half of each head in pairs: a multiple of 4
    if num_heads % num_kv_heads or head_dim <= 0 or head_dim % (4 if arch == "glm4" else 2):
        raise SlimeLiteError(
            f"--num-heads {num_heads} / --num-kv-heads {num_kv_heads} / head size {head_dim}: heads must be a "
            f"multiple of kv heads and the head size a positive multiple of {4 if arch == 'glm4' else 2}."
        )
    if task not in tasks.TASKS:
        raise SlimeLiteError(f"--task {task!r}: unknown task; choose one of {', '.join(tasks.TASKS)}.")
    steps = WARM_START_STEPS if warm_start_steps is None else warm_start_steps
    if steps < 0:
        raise SlimeLiteError(f"--warm-start-steps {steps}: must be >= 0.")
    if warm_start_target is not None and not 0.0 < warm_start_target <= 1.0:
        raise SlimeLiteError(f"--warm-start-target {warm_start_target}: must be in (0, 1].")
    out = Path(out_dir)
    _check_out_dir(out)


    start = time.perf_counter()
    old_threads = torch.get_num_threads()
    # One thread: on a shared 2-core machine, 2 threads spin against other processes and run 5-10x slower.
    torch.set_num_threads(1)
    try:
        tokenizer = build_tokenizer()
        vocab_size = math.ceil(len(tokenizer) / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
        config = _config(
            arch, vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
            tie_word_embeddings=tie_word_embeddings, num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
        )
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().to(device)
        report: dict[str, Any] = {"arch": arch, "task": task, "seed": seed, "max_steps": steps, "steps": 0,
                                  "accuracy": None}
        if steps > 0:
            report.update(warm_start(model, tokenizer, task=task, steps=steps, seed=seed, target=warm_start_target,
                                     lr=warm_start_lr))
        out.mkdir(parents=True, exist_ok=True)
        model.cpu().save_pretrained(str(out), safe_serialization=True)
        GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0, do_sample=False).save_pretrained(str(out))
        _fix_config_json(out / "config.json")
        save_tokenizer(tokenizer, out)
    finally:
        torch.set_num_threads(old_threads)
    report["params"] = sum(p.numel() for p in model.parameters())
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["out"] = str(out)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="slime-lite make-tiny-model",
        description="Write a tiny warm-started checkpoint (Qwen2, Qwen3, GLM4, Qwen3-MoE or Qwen2-MoE) with a "
                    "character-level tokenizer.",
    )
    parser.add_argument("--out", required=True, help="output folder (new, empty, or an earlier tiny model)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=384)
    parser.add_argument("--head-dim", type=int, default=None, help="default: --hidden-size / --num-heads")
    parser.add_argument("--arch", default="qwen2", choices=ARCHS,
                        help="the model family: qwen2 (default), qwen3 (QK-norm) or glm4 (partial interleaved "
                             "rotary, post-attention and post-MLP norms), qwen3_moe (routed experts) or qwen2_moe "
                             "(routed experts and a gated shared expert)")
    parser.add_argument("--num-experts", type=int, default=4, help="MoE archs: routed experts per layer")
    parser.add_argument("--num-experts-per-tok", type=int, default=2, help="MoE archs: experts each token uses")
    parser.add_argument("--moe-intermediate-size", type=int, default=96, help="MoE archs: each expert's FFN size")
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--task", default="addition", choices=tasks.TASKS)
    parser.add_argument("--warm-start-steps", type=int, default=None,
                        help=f"most supervised steps on the task data (default {WARM_START_STEPS}; 0: random init)")
    parser.add_argument("--warm-start-target", type=float, default=WARM_START_TARGET,
                        help="keep the warm-start checkpoint whose held-out greedy exact match is closest to this "
                             "(default %(default)s); 1 keeps the best")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        report = make_tiny_model(
            args.out, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads, intermediate_size=args.intermediate_size, head_dim=args.head_dim,
            arch=args.arch, task=args.task,
            warm_start_steps=args.warm_start_steps,
            warm_start_target=args.warm_start_target, seed=args.seed, tie_word_embeddings=args.tie_word_embeddings,
            num_experts=args.num_experts, num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size,
        )
    except SlimeLiteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
