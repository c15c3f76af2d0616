"""slime's own example scripts (their train.py arguments, stored in tests/data/slime_scripts.json) through
``parse_args`` + ``validate_args``, against config-only checkpoints with the scripts' architectures: no argparse
"unrecognized arguments"; the flags slime-lite does not support are refused together, each named with its reason;
without them (and with --rollout-backend sglang, which slime always uses) the scripts validate. The README's
Compatibility section states the counts this test computes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_lite import slime_flags
from slime_lite.args import build_parser, parse_args
from slime_lite.errors import SlimeLiteError
from tests import sglang_oracle as oracle

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "tests/data/slime_scripts.json").read_text())
SCRIPTS = DATA["scripts"]

_DENSE = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 151936,
          "max_position_embeddings": 32768}
CONFIGS = {  # the config.json fields of the checkpoints the scripts name (no weights needed)
    "run-qwen3-4B.sh": {**_DENSE, "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
                        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "head_dim": 128, "tie_word_embeddings": True, "attention_bias": False},
    "run-glm4-9B.sh": {**_DENSE, "model_type": "glm4", "hidden_size": 4096, "intermediate_size": 13696,
                       "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
                       "vocab_size": 151552, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
                       "partial_rotary_factor": 0.5, "tie_word_embeddings": False, "attention_bias": True},
    "run-qwen3-30B-A3B.sh": {**_DENSE, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                             "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                             "head_dim": 128, "tie_word_embeddings": False, "moe_intermediate_size": 768,
                             "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                             "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001},
    "run-qwen2.5-0.5B-reproducibility.sh": {**_DENSE, "model_type": "qwen2", "hidden_size": 896,
                                            "intermediate_size": 4864, "num_hidden_layers": 24,
                                            "num_attention_heads": 14, "num_key_value_heads": 2,
                                            "tie_word_embeddings": True},
}
# --sglang-* flags that the pinned SGLang itself refuses (its parser says why): renamed upstream since the scripts
SGLANG_REFUSES = {"--sglang-cuda-graph-bs": "ambiguous in SGLang 0.5.23 (now --cuda-graph-bs-decode/-prefill)"}
# what a script then still trips over, because of a refused flag: (error, flag, value that passes)
FOLLOW_ON = {"run-glm4-9B.sh": ("--max-tokens-per-gpu 4608 is smaller", "--max-tokens-per-gpu", "9216")}
# (slime's budget is per context-parallel rank, and the script's --context-parallel-size 2 is refused)


def groups(argv: list[str]) -> list[list[str]]:
    out: list[list[str]] = []
    for a in argv:
        if a.startswith("--"):
            out.append([a])
        else:
            out[-1].append(a)
    return out


def refused_flags(argv: list[str]) -> set[str]:
    """The flags of argv slime-lite refuses, by its tables (and SGLang's own refusals)."""
    ns = build_parser().parse_args([a for g in groups(argv) for a in g if not g[0].startswith("--sglang-")])
    return {line.split()[0].rstrip(":") for line in slime_flags.refused(ns)} | (set(SGLANG_REFUSES) & set(argv))


@pytest.fixture(scope="module")
def sglang_parser():
    oracle.require_sglang()
    return oracle.sglang_module("sglang.srt.server_args")  # the launcher's flag check finds the real module


def localize(name: str, argv: list[str], tmp: Path) -> list[str]:
    """The script's argv with its paths replaced by a config-only checkpoint and tiny prompt files."""
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIGS[name]))
    out = []
    for g in groups(argv):
        flag = g[0]
        if flag in ("--hf-checkpoint", "--ref-load"):
            g = [flag, str(model)]
        elif flag in ("--load", "--save"):
            g = [flag, str(tmp / "ckpt")]  # no checkpoint there yet: a fresh start, as in slime
        elif flag in ("--prompt-data", "--eval-prompt-data"):
            path = Path(g[-1])
            local = tmp / path.name
            rows = [{"prompt": "1+1=", "messages": [{"role": "user", "content": "1+1="}], "label": "2"}]
            if path.suffix == ".parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                pq.write_table(pa.Table.from_pylist(rows), local)
            else:
                local.write_text("".join(json.dumps(r) + "\n" for r in rows))
            g = [*g[:-1], str(local)]
        out += g
    return out


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_slime_script_parses_refuses_by_name_and_validates_without_refused_flags(name, tmp_path, sglang_parser):
    argv = localize(name, SCRIPTS[name], tmp_path)
    refused = refused_flags(argv)
    ours = refused - set(SGLANG_REFUSES)
    if ours:  # (a script may have none left: run-qwen2.5-0.5B-reproducibility.sh runs as written)
        with pytest.raises(SlimeLiteError) as info:  # never argparse's SystemExit("unrecognized arguments")
            parse_args(argv)
        msg = str(info.value)
        assert "not support" in msg and all(f"{flag}" in msg for flag in ours), msg
    kept = [a for g in groups(argv) if g[0] not in refused for a in g] + ["--rollout-backend", "sglang"]
    if name in FOLLOW_ON:
        error, flag, value = FOLLOW_ON[name]
        with pytest.raises(SlimeLiteError, match=error):
            parse_args(kept)
        kept = [value if i and kept[i - 1] == flag else a for i, a in enumerate(kept)]
    args = parse_args(kept)
    actor_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    assert args.load is None  # --load names a folder with no checkpoint yet: a fresh start
    if "--colocate" in argv and "--rollout-num-gpus" not in argv:
        assert args.rollout_num_gpus == actor_gpus  # slime's rule: the engines take the actor's GPUs
    if "--eval-top-p" in argv:
        assert args.eval_top_p == 1.0
    for flag in set(SGLANG_REFUSES) & set(argv):  # SGLang's own parser names it
        with pytest.raises(SlimeLiteError, match=flag.replace("--sglang-", "--")):
            parse_args(kept + [a for g in groups(argv) if g[0] == flag for a in g])


def test_architecture_contradiction_names_flag_values_and_file(tmp_path, sglang_parser):
    name = "run-qwen3-4B.sh"
    argv = localize(name, SCRIPTS[name], tmp_path)
    kept = [a for g in groups(argv) if g[0] not in refused_flags(argv) for a in g] + ["--rollout-backend", "sglang"]
    parse_args(kept)
    bad = [("36" if a != "36" else "35") if i and kept[i - 1] == "--num-layers" else a for i, a in enumerate(kept)]
    with pytest.raises(SlimeLiteError) as info:
        parse_args(bad)
    msg = str(info.value)
    assert "--num-layers 35" in msg and "num_hidden_layers" in msg and "36" in msg
    assert str(tmp_path / "model" / "config.json") in msg
    with pytest.raises(SlimeLiteError, match="--qk-layernorm given contradicts .*model_type 'qwen2'"):
        (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIGS["run-qwen2.5-0.5B-reproducibility.sh"]))
        parse_args(["--hf-checkpoint", str(tmp_path / "model"), "--debug-train-only", "--qk-layernorm"])


def _kept(name: str, tmp: Path, config: dict) -> list[str]:
    """The script's argv without its refused flags, against a config-only checkpoint with ``config``."""
    argv = localize(name, SCRIPTS[name], tmp)
    (tmp / "model" / "config.json").write_text(json.dumps(config))
    kept = [a for g in groups(argv) if g[0] not in refused_flags(argv) for a in g] + ["--rollout-backend", "sglang"]
    if name in FOLLOW_ON:
        _, flag, value = FOLLOW_ON[name]
        kept = [value if i and kept[i - 1] == flag else a for i, a in enumerate(kept)]
    return kept


_GLM4 = CONFIGS["run-glm4-9B.sh"]
_GLM4_V5 = {k: v for k, v in _GLM4.items() if k not in ("partial_rotary_factor", "rope_theta")} | {
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
_GLM4_SILENT = {k: v for k, v in _GLM4.items() if k != "partial_rotary_factor"}  # GLM4's default: half of each head


@pytest.mark.parametrize("config", [_GLM4, _GLM4_V5, _GLM4_SILENT], ids=["top_level", "rope_parameters", "default"])
def test_glm4_script_architecture_flags_match_its_config_however_it_states_partial_rotary(tmp_path, sglang_parser,
                                                                                         config):
    args = parse_args(_kept("run-glm4-9B.sh", tmp_path, config))
    assert args.rotary_percent == 0.5 and args.rotary_interleaved and args.post_self_attn_layernorm


@pytest.mark.parametrize("name, config, edit, error", [
    ("run-glm4-9B.sh", _GLM4 | {"partial_rotary_factor": 1.0}, None,
     "--rotary-percent 0.5 contradicts .*partial_rotary_factor means --rotary-percent 1.0"),
    ("run-glm4-9B.sh", _GLM4, ["--qk-layernorm"], "--qk-layernorm given contradicts .*model_type 'glm4'"),
    ("run-glm4-9B.sh", _GLM4 | {"attention_bias": False}, None,
     "--add-qkv-bias given contradicts .*attention_bias .* means --add-qkv-bias not given"),
    ("run-glm4-9B.sh", _GLM4 | {"model_type": "qwen2"}, None,
     "--post-self-attn-layernorm given contradicts .*model_type 'qwen2'"),
    ("run-qwen3-4B.sh", CONFIGS["run-qwen3-4B.sh"] | {"head_dim": 80}, None,
     r"--kv-channels 128 contradicts .*head_dim .* means --kv-channels 80"),
    ("run-qwen3-4B.sh", CONFIGS["run-qwen3-4B.sh"], ["--post-mlp-layernorm"],
     "--post-mlp-layernorm given contradicts .*model_type 'qwen3'"),
    ("run-qwen3-4B.sh", CONFIGS["run-qwen3-4B.sh"], ["--rotary-interleaved"],
     "--rotary-interleaved given contradicts .*model_type 'qwen3'"),
])
def test_qwen3_and_glm4_architecture_flags_that_contradict_config_json_are_refused(tmp_path, sglang_parser, name,
                                                                                  config, edit, error):
    kept = _kept(name, tmp_path, CONFIGS[name])
    parse_args(kept)  # as written, against the script's own model: valid
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SlimeLiteError, match=error):
        parse_args(kept + (edit or []))


def test_a_megatron_ref_load_is_refused_with_the_way_out(tmp_path):
    """slime's scripts pass a torch_dist conversion as --ref-load; slime-lite reads HF folders and says so."""
    model, dist = tmp_path / "model", tmp_path / "Qwen3-4B_torch_dist"
    model.mkdir()
    dist.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIGS["run-qwen3-4B.sh"]))
    (dist / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(SlimeLiteError, match="Megatron checkpoint .*torch_dist.*Hugging Face folder"):
        parse_args(["--hf-checkpoint", str(model), "--ref-load", str(dist), "--debug-train-only"])


def compat_counts() -> dict[str, int]:
    """Distinct flags over the four scripts: accepted (implemented, or an architecture flag checked against the
    checkpoint) and refused with a reason."""
    flags = sorted({a for argv in SCRIPTS.values() for a in argv if a.startswith("--")})
    refused = set().union(*(refused_flags(argv) for argv in SCRIPTS.values()))
    arch = [f for f in flags if f in slime_flags.ARCH_FLAGS]
    return {"flags": len(flags), "arch": len(arch), "refused": len(refused),
            "implemented": len(flags) - len(arch) - len(refused)}


def compat_line() -> str:
    c = compat_counts()
    return (f"- slime's example scripts ({', '.join(sorted(SCRIPTS))}; {c['flags']} distinct flags): "
            f"**{c['flags'] - c['refused']} accepted** ({c['implemented']} implemented, {c['arch']} Megatron "
            f"architecture flags checked against config.json), {c['refused']} refused with a reason, 0 unknown")


def test_readme_states_the_counts():
    line = compat_line()
    assert line in (ROOT / "README.md").read_text(), f"README's Compatibility section should say:\n{line}"


def test_parquet_and_jsonl_prompts_read_alike_and_slime_reward_rules(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from slime_lite.rollout.data import DataKeys, read_prompts
    from slime_lite.rollout.rewards import boxed_math_reward, deepscaler_reward

    rows = [{"messages": [{"role": "user", "content": "1+1?"}], "label": "2", "source": "gsm8k"},
            {"messages": [{"role": "user", "content": "2+3?"}], "label": "5", "source": "gsm8k"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = [read_prompts(str(tmp_path / f), DataKeys("messages", "label")) for f in ("train.parquet", "train.jsonl")]
    assert got[0] == got[1] and got[0][1].prompt[0]["content"] == "2+3?" and got[0][1].metadata == {"source": "gsm8k"}
    assert deepscaler_reward("<think>2+3</think> The answer is \\boxed{5}.", "5") == 1.0
    assert deepscaler_reward("The answer is \\boxed{5}.", "5") == 0.0  # no end of reasoning: slime scores 0
    assert deepscaler_reward("</think>\\boxed{\\frac{1}{2}}", "\\boxed{0.5}") == 1.0
    assert boxed_math_reward("5", "5") == 0.0 and boxed_math_reward("so \\boxed{5}", "5") == 1.0


@pytest.mark.parametrize("extra, engines", [([], 4), (["--debug-rollout-only"], 4), (["--rollout-num-gpus", "2"], 2)])
def test_colocate_gives_the_engines_the_actors_gpus_unless_told(tmp_path, extra, engines):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIGS["run-qwen3-4B.sh"]))
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    args = parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "p.jsonl"), "--rm-type", "math",
                       "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-batch-size", "4",
                       "--n-samples-per-prompt", "2", *extra])
    assert args.rollout_num_gpus == engines


def test_a_slime_flag_outside_the_example_scripts_is_refused_by_name(tiny_model_dir, tmp_path):
    """--custom-tis-function-path (slime's custom importance-sampling hook) parses and is refused with the built-in
    alternatives, never argparse's "unrecognized arguments"."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    with pytest.raises(SlimeLiteError, match=r"--custom-tis-function-path: not supported yet.*--tis-mode"):
        parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", str(tmp_path / "p.jsonl"),
                    "--custom-tis-function-path", "my_tis.py"])
