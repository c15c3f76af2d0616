"""Prompt data (rollout/data.py): what a JSONL file's rows become, and the sample metadata made from them."""

from __future__ import annotations

import json

from slime_lite.rollout.data import read_prompts
from slime_lite.rollout.generate import new_group
from slime_lite.rollout.stats import rollout_metrics


def _write(path, rows, encoding="utf-8") -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding=encoding)
    return str(path)


def test_a_line_separator_inside_a_json_string_does_not_split_the_line(tmp_path) -> None:
    # ensure_ascii=False leaves U+2028 / U+2029 / U+0085 unescaped: still one valid JSON line each
    path = _write(tmp_path / "p.jsonl", [{"prompt": "a\u2028b", "label": "1"},
                                         {"prompt": "c\u2029d\x85e", "label": "2"}])
    prompts = read_prompts(path)
    assert [(p.prompt, p.label) for p in prompts] == [("a\u2028b", "1"), ("c\u2029d\x85e", "2")]


def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "1+1=", "label": 2}\r\n\r\n{"prompt": "2+2=", "label": 4}\r\n')
    assert [(p.prompt, p.label) for p in read_prompts(str(path))] == [("1+1=", 2), ("2+2=", 4)]


def test_data_fields_never_pass_for_slime_lites_own_sample_metadata(tmp_path) -> None:
    """A row's other fields go into the samples' metadata (slime's ``metadata`` field's entries at the top), but a
    field named like a key slime-lite writes itself (the rendered prompt, multi-turn ``turns`` and ``messages``)
    would be read as that: the prompt index and text must be the run's, and the rollout metrics must not crash."""
    path = _write(tmp_path / "p.jsonl", [
        {"prompt": "1+1=", "label": "2", "prompt_index": 99, "prompt_text": "other", "source": "mtbench",
         "turns": ["first question", "second question"], "messages": [{"role": "user", "content": "x"}],
         "metadata": {"difficulty": 3, "rm_type": "math"}}])
    prompt = read_prompts(path)[0]
    assert prompt.metadata == {"source": "mtbench", "difficulty": 3, "rm_type": "math"}
    group = new_group(prompt, 2, 0, 0, "rendered 1+1=", [1, 2, 3])
    assert all(s.metadata["prompt_index"] == 0 and s.metadata["prompt_text"] == "rendered 1+1=" for s in group)
    for s in group:
        s.response_length, s.reward = 0, 1.0
    assert rollout_metrics(group)["rollout/raw_reward"] == 1.0


def test_a_label_keeps_its_data_type_as_in_slime(tmp_path) -> None:
    """A custom reward gets a list or dict label (test cases, several answers) as the data has it, as slime gives
    it, not its Python repr; an integer label stays an integer (gpqa reads it as an index), as in slime."""
    import asyncio

    from slime_lite.args import parser_defaults
    from slime_lite.rollout.rewards import compute_reward

    path = _write(tmp_path / "p.jsonl", [{"prompt": "a", "label": ["x", "y"]}, {"prompt": "b", "label": {"n": 1}},
                                         {"prompt": "c", "label": -3}, {"prompt": "d"}])
    prompts = read_prompts(path)
    assert [p.label for p in prompts] == [["x", "y"], {"n": 1}, -3, None]
    group = new_group(prompts[2], 1, 0, 0, "c", [1])
    group[0].response = "so it is \\boxed{-3}."
    assert asyncio.run(compute_reward(parser_defaults(rm_type="math"), group[0])) == 1.0


def test_a_groups_samples_and_the_data_set_do_not_share_the_prompts_objects() -> None:
    """A hook that appends to one sample's chat history or edits its nested metadata in place changes neither the
    other samples of its group nor the prompt the data set hands out again next epoch (slime copies them too)."""
    from slime_lite.rollout.data import Prompt

    prompt = Prompt(0, [{"role": "user", "content": "hi"}], ["a", "b"], {"env": {"step": 0}, "history": []})
    group = new_group(prompt, 2, 0, 0, "hi", [1])
    group[0].prompt.append({"role": "assistant", "content": "turn"})
    group[0].metadata["env"]["step"] = 1
    group[0].metadata["history"].append("turn")
    group[0].label.append("c")
    for fresh in (group[1], new_group(prompt, 1, 0, 0, "hi", [1])[0]):
        assert fresh.prompt == [{"role": "user", "content": "hi"}] and fresh.label == ["a", "b"]
        assert fresh.metadata["env"] == {"step": 0} and fresh.metadata["history"] == []


def test_eval_sampling_seeds_stay_within_int64_whatever_the_rollout_seed(tiny_model_dir) -> None:
    """A large --rollout-seed: the eval requests' seeds are kept within int64 as the rollout's are (the engine
    refuses others). The engine client is a fake (no engine runs): it validates each request's sampling params
    with the embedded engine's own parser and answers one token."""
    import asyncio

    from slime_lite.args import parser_defaults
    from slime_lite.engine.sampling import SamplingParams
    from slime_lite.rollout.data import Prompt
    from slime_lite.rollout.generate import Generator
    from slime_lite.tokenizer import load_tokenizer

    seeds = []

    class FakeEngineClient:
        urls = ["http://fake"]

        async def generate(self, body):
            params = body["sampling_params"] if isinstance(body["sampling_params"], list) else [body["sampling_params"]]
            seeds.extend(SamplingParams.from_dict(p).sampling_seed for p in params)
            outs = [{"text": "1", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"},
                                                                   "output_token_logprobs": [[-0.1, 5, None]]}}
                    for _ in params]
            return outs if isinstance(body["sampling_params"], list) else outs[0]

    args = parser_defaults(hf_checkpoint=tiny_model_dir, rm_type="addition", rollout_seed=10**13,
                           rollout_batch_size=1, n_samples_per_eval_prompt=2, eval_temperature=1.0,
                           eval_max_response_len=4)
    gen = Generator(args, load_tokenizer(tiny_model_dir), FakeEngineClient())
    samples = asyncio.run(gen.evaluate("e", [Prompt(0, "1+0=", "1", {})], 0))
    assert len(samples) == 2 and len(seeds) == 2 and len(set(seeds)) == 2
    assert all(0 <= s < 2**63 for s in seeds)


# A Qwen3-like chat template (tools in a system turn, enable_thinking closing an empty think block), on the tiny
# char tokenizer: what the tiny model's own template does not show.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_slime_data_keys_tools_and_template_kwargs_reach_the_rendered_prompts(tmp_path, tiny_model_dir):
    """slime's --metadata-key, --tool-key, --eval-input-key/--eval-label-key/--eval-tool-key and
    --apply-chat-template-kwargs: the eval set is read with its own keys, a prompt's tools (a list, or its JSON
    text) go to the chat template and the metadata, the template kwargs to the template, the meta dict's entries
    to the metadata."""
    from slime_lite.args import parse_args
    from slime_lite.rollout.data import DataKeys
    from slime_lite.rollout.generate import Generator
    from slime_lite.tokenizer import load_tokenizer

    tool = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    train = _write(tmp_path / "t.jsonl", [{"prompt": "1+1=", "label": "2", "functions": [tool], "info": {"d": 1}},
                                          {"prompt": "2+2=", "label": "4", "functions": json.dumps([tool])}])
    evals = _write(tmp_path / "e.jsonl", [{"q": "3+3=", "a": "6", "fns": [tool], "tools": "kept as data"}])
    args = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", train, "--rm-type", "math",
                       "--eval-prompt-data", "e", evals, "--eval-input-key", "q", "--eval-label-key", "a",
                       "--eval-tool-key", "fns", "--tool-key", "functions", "--metadata-key", "info",
                       "--apply-chat-template", "--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    train_prompts = read_prompts(train, DataKeys.from_args(args))
    eval_prompt = read_prompts(evals, DataKeys.from_args(args, evaluation=True), "--eval-prompt-data")[0]
    assert train_prompts[0].metadata == {"d": 1, "tools": [tool]}
    assert train_prompts[1].metadata == {"tools": [tool]}  # the JSON text parsed, as slime does
    assert (eval_prompt.prompt, eval_prompt.label, eval_prompt.metadata["tools"]) == ("3+3=", "6", [tool])
    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = TOOLS_TEMPLATE
    text, ids = Generator(args, tok, None).encode(eval_prompt)
    assert text == (f"<|im_start|>system\ntools: {json.dumps([tool])}<|im_end|>\n<|im_start|>user\n3+3=<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ids == tok(text, add_special_tokens=False)["input_ids"]


def test_bad_tools_and_template_kwargs_are_refused_naming_the_flag_and_line(tmp_path, capsys):
    import pytest

    from slime_lite.args import parse_args
    from slime_lite.errors import SlimeLiteError
    from slime_lite.rollout.data import DataKeys

    bad = _write(tmp_path / "p.jsonl", [{"prompt": "a", "tools": []}, {"prompt": "b", "tools": {"name": "calc"}}])
    with pytest.raises(SlimeLiteError, match=r"p.jsonl:2: the 'tools' field is a dict, not a list .*--tool-key"):
        read_prompts(bad)
    bad = _write(tmp_path / "q.jsonl", [{"q": "a", "fns": "[{oops"}])
    keys = DataKeys("q", None, "metadata", "fns", "--eval-input-key", "--eval-tool-key")
    with pytest.raises(SlimeLiteError, match=r"--eval-prompt-data .*q.jsonl:1: the 'fns' field is text but not JSON.*"
                                             r"--eval-tool-key"):
        read_prompts(bad, keys, "--eval-prompt-data")
    with pytest.raises(SlimeLiteError, match=r"no 'q' key \(set --eval-input-key"):
        read_prompts(_write(tmp_path / "r.jsonl", [{"prompt": "a"}]), keys, "--eval-prompt-data")
    for value, says in (("{oops", "not JSON"), ("[1]", "expected a JSON object")):
        with pytest.raises(SystemExit):
            parse_args(["--hf-checkpoint", "m", "--apply-chat-template-kwargs", value])
        assert f"--apply-chat-template-kwargs: {says}" in capsys.readouterr().err


def test_an_inserted_turn_is_rendered_with_the_template_kwargs_of_the_prompt(tiny_model_dir):
    """A multi-turn sample's tool turn ends in the same generation prompt as the first turn (Qwen3 with
    enable_thinking false: the closed think block), not the template's default."""
    from slime_lite.rollout.tool_calls import inserted_text
    from slime_lite.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = TOOLS_TEMPLATE
    history = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "calc"}]
    tool = [{"role": "tool", "content": "2"}]
    text = inserted_text(tok, history, tool, "<|im_end|>", template_kwargs={"enable_thinking": False})
    assert text == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert inserted_text(tok, history, tool, "<|im_end|>").endswith("<|im_start|>assistant\n")


def test_slimes_length_stop_and_eval_flags_shape_the_prompts_and_sampling(tmp_path, tiny_model_dir):
    """--rollout-max-prompt-len / --eval-max-prompt-len leave out the prompts longer as rendered (every one: an
    error naming the flag); --rollout-stop-token-ids reach every request, --eval-min-new-tokens the evals only."""
    import pytest

    from slime_lite.args import parse_args
    from slime_lite.config import RolloutConfig
    from slime_lite.errors import SlimeLiteError
    from slime_lite.rollout.data import drop_long_prompts, encode_prompt
    from slime_lite.rollout.generate import sampling_params
    from slime_lite.tokenizer import load_tokenizer

    path = _write(tmp_path / "p.jsonl", [{"prompt": "1+1="}, {"prompt": "12+34="}, {"prompt": "1+2="}])
    args = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", path, "--rm-type", "math",
                       "--rollout-max-prompt-len", "4", "--rollout-stop-token-ids", "5", "7",
                       "--eval-min-new-tokens", "2", "--apply-chat-template"])
    tok = load_tokenizer(str(tiny_model_dir))
    prompts = read_prompts(path)
    assert [len(encode_prompt(p, tok, args)[1]) for p in prompts] == [23, 25, 23]  # rendered with the template
    kept = drop_long_prompts(prompts, 24, tok, args, "--prompt-data p with --rollout-max-prompt-len")
    assert [p.index for p in kept] == [0, 2]
    with pytest.raises(SlimeLiteError, match="--prompt-data p with --rollout-max-prompt-len: every prompt is longer "
                                             "than 4 tokens"):
        drop_long_prompts(prompts, args.rollout_max_prompt_len, tok, args, "--prompt-data p with "
                                                                           "--rollout-max-prompt-len")
    cfg = RolloutConfig.from_args(args)
    train, evaluation = sampling_params(cfg), sampling_params(cfg, evaluation=True)
    assert train["stop_token_ids"] == evaluation["stop_token_ids"] == [5, 7]
    assert "min_new_tokens" not in train and evaluation["min_new_tokens"] == 2
    with pytest.raises(SlimeLiteError, match="--eval-min-new-tokens 9 is more than the eval responses may hold"):
        parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", path, "--rm-type", "math",
                    "--eval-min-new-tokens", "9", "--rollout-max-response-len", "8"])


def test_every_metadata_key_slime_lite_reads_back_is_reserved_against_data_fields(tmp_path, caplog) -> None:
    """A data field named as one of these changed the run (an int under _unversioned_leading_tokens dropped the
    per-token weight versions; engine_cuts dropped a --fully-async group early): left out, with the warning."""
    from slime_lite.rollout.turns import append_turn
    from slime_lite.types import Sample

    names = ["_unversioned_leading_tokens", "age_masked_positions", "engine_cuts", "inserted_tokens_cut",
             "post_processed_reward", "engine_aborted_unchanged"]
    with caplog.at_level("WARNING"):
        prompt = read_prompts(_write(tmp_path / "p.jsonl", [{"prompt": "a", "label": "1", "keep": 1,
                                                              **{n: 4 for n in names}}]))[0]
    assert prompt.metadata == {"keep": 1} and all(n in caplog.text for n in names)
    sample = Sample(index=0, tokens=[1], metadata=dict(prompt.metadata))
    append_turn(sample, [5, 6], [-0.1, -0.2], source="model", text="x", versions=[3, 3])
    assert sample.metadata["token_weight_versions"] == [3, 3]


def test_only_the_tool_keys_field_is_the_templates_tools(tmp_path, tiny_model_dir, caplog) -> None:
    """A data field "tools" that --tool-key does not name (or one inside --metadata-key's dict) was rendered by the
    chat template (a string there failed the template) or dropped without a word: it is left out, said."""
    from slime_lite.args import parse_args
    from slime_lite.rollout.data import DataKeys, encode_prompt
    from slime_lite.tokenizer import load_tokenizer

    tool = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "label": "2", "tools": "calc-v1"},
            {"prompt": [{"role": "user", "content": "2+2="}], "label": "4", "tools": [tool]},
            {"prompt": [{"role": "user", "content": "3+3="}], "label": "6", "info": {"tools": [tool], "env": "c"}}]
    path = _write(tmp_path / "p.jsonl", rows)
    args = parse_args(["--hf-checkpoint", str(tiny_model_dir), "--prompt-data", path, "--rm-type", "math",
                       "--tool-key", "functions", "--metadata-key", "info", "--apply-chat-template"])
    with caplog.at_level("WARNING"):
        prompts = read_prompts(path, DataKeys.from_args(args))
    assert [p.metadata for p in prompts] == [{}, {}, {"env": "c"}] and "['tools']" in caplog.text
    tok = load_tokenizer(str(tiny_model_dir))
    tok.chat_template = TOOLS_TEMPLATE
    for p in prompts:  # rendered without tools: none came from the tool key
        assert "tools:" not in encode_prompt(p, tok, args)[0]


def test_a_chat_list_row_past_the_rendered_ones_is_refused_without_a_chat_template(tmp_path, monkeypatch) -> None:
    """Only the first RENDER_CHECKED prompts are rendered before Ray starts; a chat-message row after them, with no
    --apply-chat-template, stopped the run after the engines started (hours in, without shuffling). Every row is
    checked for that; the error names the file and line."""
    import pytest

    from slime_lite.args import parser_defaults
    from slime_lite.errors import SlimeLiteError
    from slime_lite.rollout import data

    path = _write(tmp_path / "p.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="},
                                         {"prompt": [{"role": "user", "content": "hi"}]}])
    monkeypatch.setattr(data, "RENDER_CHECKED", 1)
    with pytest.raises(SlimeLiteError, match=r"p\.jsonl:3: a prompt is a chat message list: add --apply-chat"):
        data.check_renders(read_prompts(path), None, parser_defaults(), f"--prompt-data {path}")
    data.check_renders(read_prompts(path)[:2], None, parser_defaults(), f"--prompt-data {path}")


def test_slimes_row_slice_of_a_prompt_file(tmp_path):
    """slime's ``--prompt-data data.jsonl@[start:end]``: those rows only (a Python slice, negative bounds too), with
    their own line numbers for errors; a file whose name has that form is read as it is."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(5)))
    assert [(p.index, p.prompt, p.line) for p in read_prompts(f"{path}@[1:3]")] == [(0, "1+1=", 2), (1, "2+1=", 3)]
    assert [p.prompt for p in read_prompts(f"{path}@[-2:]")] == ["3+1=", "4+1="]
    literal = tmp_path / "q.jsonl@[0:1]"
    literal.write_text(json.dumps({"prompt": "x", "label": "1"}) + "\n")
    assert [p.prompt for p in read_prompts(str(literal))] == ["x"]


def test_the_flags_take_slimes_row_slice_of_a_prompt_file(tmp_path) -> None:
    """``--prompt-data`` / ``--eval-prompt-data PATH@[start:end]`` pass the flag check (PATH exists); a missing PATH
    is still refused, naming the flag."""
    import pytest

    from slime_lite.args import parse_args
    from slime_lite.errors import SlimeLiteError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    path = _write(tmp_path / "p.jsonl", [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(5)])
    base = ["--hf-checkpoint", str(model), "--rm-type", "addition", "--n-samples-per-prompt", "2"]
    args = parse_args(base + ["--prompt-data", f"{path}@[0:2]", "--eval-prompt-data", "ev", f"{path}@[-2:]"])
    assert args.prompt_data == f"{path}@[0:2]" and args.eval_prompt_data == ["ev", f"{path}@[-2:]"]
    with pytest.raises(SlimeLiteError, match=r"--eval-prompt-data .*nope\.jsonl@\[0:2\]: no such file"):
        parse_args(base + ["--prompt-data", path, "--eval-prompt-data", "ev", f"{tmp_path}/nope.jsonl@[0:2]"])
