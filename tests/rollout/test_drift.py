"""The token-level truth checks on multi-turn samples (rollout/drift.py), each fault injected by a generate hook
against a real in-process embedded engine: the rollout metrics name the samples and where, and --ci-test's
checks (checks/ci.py, the rows the doctor shows too) fail naming the fault; a healthy multi-turn hook passes."""

from __future__ import annotations

import json
import textwrap

import pytest

from slime_lite.args import parser_defaults
from slime_lite.checks.ci import CiCheckFailed, enforce, rollout_checks
from slime_lite.config import CiConfig
from tests.engine.engine_helpers import start_engine

COMMON = """
from slime_lite.rollout import multi_turn as mt
from slime_lite.rollout.turns import append_turn
from slime_lite.tokenizer import load_tokenizer


async def two_turns(args, sample, sampling_params, tool_text="=42;"):
    tok = load_tokenizer(args.hf_checkpoint)
    limits = mt.TurnLimits.from_args(args)
    params = dict(sampling_params, max_new_tokens=4, ignore_eos=True, stop=None)
    await mt.model_turn(args, sample, params, limits)
    mt.insert_turn(sample, tok, tool_text, limits)
    await mt.model_turn(args, sample, params, limits)
    return tok
"""

HOOKS = {
    "healthy": """
async def generate(args, sample, sampling_params):
    await two_turns(args, sample, sampling_params)
    return sample
""",
    # a framework that joins turns with a space and re-tokenises the text: the ids trained are not the engine's
    "retokenise": """
async def generate(args, sample, sampling_params):
    tok = load_tokenizer(args.hf_checkpoint)
    out = await args.engine_client.generate({"input_ids": sample.tokens, "return_logprob": True,
                                             "sampling_params": dict(sampling_params, max_new_tokens=4,
                                                                     ignore_eos=True, stop=None)})
    ids = tok(" " + out["text"], add_special_tokens=False)["input_ids"]
    lps = [t[0] for t in out["meta_info"]["output_token_logprobs"]]
    append_turn(sample, ids, (lps + [0.0])[:len(ids)], text=out["text"])
    return sample
""",
    # a model turn appended as not trainable: never trained
    "masks_a_turn": """
async def generate(args, sample, sampling_params):
    tok = await two_turns(args, sample, sampling_params)
    out = await args.engine_client.generate({"input_ids": sample.tokens, "return_logprob": True,
                                             "sampling_params": dict(sampling_params, max_new_tokens=3,
                                                                     ignore_eos=True, stop=None)})
    append_turn(sample, out["output_ids"], [t[0] for t in out["meta_info"]["output_token_logprobs"]],
                trainable=False, text=out["text"])
    return sample
""",
    # the tool turn's tokens left trainable by a hand-built mask: trained with placeholder log-probs
    "trains_tool_tokens": """
async def generate(args, sample, sampling_params):
    await two_turns(args, sample, sampling_params)
    sample.loss_mask = [1] * sample.response_length
    return sample
""",
    # a chat agent whose own template drops the newline after <|im_end|> (the tokenizer's template has it)
    "template_drops_separator": """
async def generate(args, sample, sampling_params):
    tok = load_tokenizer(args.hf_checkpoint)
    limits = mt.TurnLimits.from_args(args)
    params = dict(sampling_params, max_new_tokens=4, ignore_eos=True, stop=None)
    messages = [{"role": "user", "content": sample.prompt}]
    await mt.model_turn(args, sample, params, limits)
    messages.append({"role": "assistant", "content": sample.metadata["turns"][-1]["text"]})
    messages.append({"role": "tool", "content": "42"})
    mt.insert_turn(sample, tok, "<|im_end|><|im_start|>tool\\n42<|im_end|>\\n<|im_start|>assistant\\n", limits)
    await mt.model_turn(args, sample, params, limits)
    sample.metadata["messages"] = messages
    return sample
""",
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    server = start_engine(tiny_model_dir, max_running_requests=8)
    yield server
    server.stop()


def _rollout(tiny_model_dir, engine, tmp_path, monkeypatch, fault: str, **flags):
    from slime_lite.rollout.manager import RolloutManager

    name = f"drift_hook_{fault}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(COMMON) + textwrap.dedent(HOOKS[fault]))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(2)))
    args = parser_defaults(hf_checkpoint=str(tiny_model_dir), prompt_data=str(path), rm_type="addition",
                           rollout_batch_size=2, n_samples_per_prompt=1, custom_generate_function_path=f"{name}.generate",
                           **flags)
    manager = RolloutManager(args, [engine.url])
    try:
        return manager.generate(0)
    finally:
        manager.close()


def _failed(metrics: dict) -> dict:
    cfg = CiConfig.from_args(parser_defaults())
    return {c.name: c for c in rollout_checks(cfg, metrics, first=True) if not c.passed}


def test_a_healthy_multi_turn_hook_passes_every_check(tiny_model_dir, engine, tmp_path, monkeypatch):
    _, metrics = _rollout(tiny_model_dir, engine, tmp_path, monkeypatch, "healthy")
    assert metrics["rollout/token_drift_samples"] == 0, metrics.get("rollout/token_drift/examples")
    assert metrics["rollout/masked_model_turns"] == 0
    assert metrics["rollout/trained_tokens_without_engine_logprob"] == 0
    assert _failed(metrics) == {}


def test_a_hook_that_re_tokenises_text_is_caught_naming_sample_and_position(tiny_model_dir, engine, tmp_path,
                                                                           monkeypatch):
    samples, metrics = _rollout(tiny_model_dir, engine, tmp_path, monkeypatch, "retokenise")
    assert metrics["rollout/token_drift_samples"] == 2
    first = metrics["rollout/token_drift/examples"][0]
    p = samples[0].prompt_length  # the re-tokenised turn starts with the space the engine never generated
    text = samples[0].metadata["turns"][0]["text"]
    assert first == (f"sample 0 token {p} (turn 0 (model), decoded model turn): trained {(' ' + text)[:12]!r}, "
                     f"expected {text[:12]!r}"), first
    with pytest.raises(CiCheckFailed, match=r"check token_drift failed at rollout 0: value 2.0, expected == 0\. "
                                            r"Likely causes: the tokens trained are not the tokens the engine "
                                            r"generated: a generate hook or agent re-tokenised"):
        enforce(CiConfig.from_args(parser_defaults(ci_test=True)), metrics, 0, first=True, engines=False)


def test_a_template_that_drops_a_separator_is_caught_at_the_separator(tiny_model_dir, engine, tmp_path, monkeypatch):
    samples, metrics = _rollout(tiny_model_dir, engine, tmp_path, monkeypatch, "template_drops_separator",
                                apply_chat_template=True)
    assert metrics["rollout/token_drift_samples"] == 2
    s = samples[0]
    model = s.metadata["turns"][0]
    at = s.prompt_length + model["length"] + 1  # after the model's text and <|im_end|>: the missing "\n"
    example = metrics["rollout/token_drift/examples"][0]
    assert example.startswith(f"sample 0 token {at} (turn 1 (tool), re-rendered chat template)"), example
    assert "token_drift" in _failed(metrics)


def test_a_hook_that_masks_a_model_turn_is_caught(tiny_model_dir, engine, tmp_path, monkeypatch):
    _, metrics = _rollout(tiny_model_dir, engine, tmp_path, monkeypatch, "masks_a_turn")
    assert metrics["rollout/masked_model_turns"] == 2 and metrics["rollout/token_drift_samples"] == 0
    assert metrics["rollout/masked_model_turns/examples"][0].startswith("sample 0 model turns [3]")
    failed = _failed(metrics)
    assert set(failed) == {"masked_model_turns"} and "are never trained" in failed["masked_model_turns"].cause


def test_trained_tool_tokens_are_caught_and_the_logprob_failure_names_the_loss_mask(tiny_model_dir, engine, tmp_path,
                                                                                   monkeypatch):
    _, metrics = _rollout(tiny_model_dir, engine, tmp_path, monkeypatch, "trains_tool_tokens")
    assert metrics["rollout/trained_tokens_without_engine_logprob"] == 2 * 4  # "=42;" in each sample
    assert metrics["rollout/trained_tokens_without_engine_logprob/examples"][0] == (
        "sample 0: 4 tokens from response position 4 in turn 1 (tool)")
    # the trainer then finds the tool tokens' placeholder log-probs far from its own: the log-prob failure's cause
    # names the loss mask and the inserted tokens first
    record = dict(metrics, **{"train/train_rollout_logprob_abs_diff": 0.9})
    failed = _failed(record)
    assert {"trained_tokens_without_engine_logprob", "train_rollout_logprob_diff"} <= set(failed)
    assert failed["train_rollout_logprob_diff"].cause.startswith(
        "the loss mask: 8 tokens the engine did not generate (inserted turns) are trained with placeholder "
        "log-probs (sample 0: 4 tokens from response position 4 in turn 1 (tool)")


def test_a_chat_sample_is_re_rendered_with_the_runs_template_kwargs_and_its_tools(tiny_model_dir):
    """--apply-chat-template-kwargs (and the sample's tools) shape what the chat template renders: a sample rendered
    with them reads as its messages only when the check renders them with them too (no false drift)."""
    from slime_lite.rollout.drift import token_drift
    from slime_lite.tokenizer import load_tokenizer
    from slime_lite.types import Sample

    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = ("{% if greeting %}<|im_start|>system\n{{ greeting }}{{ tools | length }}<|im_end|>\n"
                         "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}")
    messages = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    tools = [{"type": "function", "function": {"name": "calc"}}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, greeting="hi")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    sample = Sample(index=3, tokens=ids, response_length=0, metadata={"messages": messages, "tools": tools})
    assert token_drift(sample, tok, {"greeting": "hi"}) is None
    report = token_drift(sample, tok)  # without the run's kwargs: another text
    assert report is not None and report["sample"] == 3


def test_a_model_turn_masked_for_its_weights_age_is_not_a_hooks_masked_turn():
    """--max-weight-staleness's mask mode and --mask-offpolicy-in-partial-rollout mask a whole stale model turn on
    purpose: --ci-test's masked-model-turn check must not stop the run for it (one the hook masks still counts)."""
    from slime_lite.rollout.drift import mask_problems
    from slime_lite.rollout.turns import append_turn, mask_older
    from slime_lite.types import Sample

    s = Sample(index=0, prompt="p", tokens=[1])
    append_turn(s, [10, 11], [-0.1] * 2, versions=[1, 1])
    append_turn(s, [8], source="tool")
    append_turn(s, [12, 13], [-0.1] * 2, versions=[3, 3])
    assert mask_older(s, [1, 1, 1, 3, 3], 3) == 2 and s.loss_mask == [0, 0, 0, 1, 1]
    assert mask_problems(s) == ([], [])
    s.loss_mask[3:] = [0, 0]  # a hook masking the new turn: caught
    assert mask_problems(s) == ([2], [])


def test_a_model_turn_whose_text_the_engine_cut_inside_its_last_token_is_no_drift():
    """With no_stop_trim the engine cuts its text right after a stop string that ends inside a token ("<|im_st" of
    "<|im_start|>"), and returns the whole token: not a drift. Text that stops before the last token, or a turn
    whose tokens were rebuilt, still is."""
    from slime_lite.rollout.drift import token_drift
    from slime_lite.rollout.turns import append_turn
    from slime_lite.tokenizer import build_tokenizer
    from slime_lite.types import Sample

    tok = build_tokenizer()
    ids = tok("ab<|im_start|>", add_special_tokens=False)["input_ids"]

    def drift(text: str, tokens: list[int] = ids):
        s = Sample(index=0, prompt="p", tokens=[1])
        append_turn(s, tokens, [-0.1] * len(tokens), text=text)
        return token_drift(s, tok)

    assert drift("ab<|im_start|>") is None and drift("ab<|im_st") is None and drift("ab") is None
    assert drift("a") is not None  # ends before the last token: not the engine's cut
    assert drift("ab<|im_sx") is not None  # not a prefix of the tokens' text
    assert drift("ab<|im_st", ids[:-1] + tok("<|im_end|>", add_special_tokens=False)["input_ids"]) is not None


def test_a_cut_inserted_turn_never_ends_inside_a_character():
    """A byte-level tokenizer (Qwen's, Llama's) writes a character in several tokens: an inserted turn cut to
    --max-inserted-tokens-per-turn inside one backs off to its start, so its text is whole and tokenizes to the
    kept tokens again (no token drift reported for untouched tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from slime_lite.rollout import drift
    from slime_lite.rollout.multi_turn import TurnLimits, insert_turn
    from slime_lite.types import Sample

    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    prompt = tok("Q:", add_special_tokens=False)["input_ids"]
    for text, keep, kept in (("xé!", 2, "x"), ("xé!", 3, "xé"), ("ab€c", 4, "ab")):  # é: 2 bytes, €: 3
        s = Sample(index=0, prompt="Q:", tokens=list(prompt))
        insert_turn(s, tok, text, TurnLimits(max_turns=4, max_inserted_tokens=keep, max_context_len=None,
                                             tool_timeout=1.0))
        turn = s.metadata["turns"][-1]
        assert turn["text"] == kept and tok(kept, add_special_tokens=False)["input_ids"] == s.tokens[len(prompt):]
        assert s.metadata["inserted_tokens_cut"] == len(text.encode()) - len(kept.encode())
        assert drift.rollout_metrics([s], tok)["rollout/token_drift_samples"] == 0
