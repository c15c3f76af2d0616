from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from slime_lite.debug.send_to_engine import main
from slime_lite.engine_client import request_json
from slime_lite.io import free_port
from slime_lite.rollout.dumps import save_rollout_dump
from slime_lite.rollout.turns import append_turn
from slime_lite.types import Sample, Status

PARAMS = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path):
    from slime_lite.engine.server import EngineServer

    server = EngineServer(str(tiny_model_dir), port=0)
    url = server.start()
    yield url
    server.stop()


def _sample_from_engine(url: str, index: int, prompt_ids: list[int], params: dict) -> Sample:
    """What the rollout does: generate, then keep tokens, text, log-probs and the params in a Sample."""
    out = request_json(url, "/generate", {"input_ids": prompt_ids, "sampling_params": params,
                                          "return_logprob": True}, timeout=60)
    ids, meta = out["output_ids"], out["meta_info"]
    return Sample(
        group_index=0, index=index, prompt="p", tokens=prompt_ids + ids, response=out["text"],
        response_length=len(ids), reward=0.0, loss_mask=[1] * len(ids),
        rollout_log_probs=[float(e[0]) for e in meta["output_token_logprobs"]],
        status=Status.from_finish_reason(meta["finish_reason"]["type"]), metadata={"sampling_params": params},
    )


def _teacher_forced_max(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"\(a\) teacher-forced \|engine - dump\| +│ max ([-0-9.e+]+)", out)]


def test_honest_dump_matches_and_perturbed_logprobs_do_not(engine_url: str, tmp_path: Path, capsys) -> None:
    template = str(tmp_path / "d_{rollout_id}.pt")
    samples = [
        _sample_from_engine(engine_url, 0, [5, 6, 7, 8], dict(PARAMS, sampling_seed=11)),
        _sample_from_engine(engine_url, 1, [9, 10, 11], dict(PARAMS, sampling_seed=12)),
    ]
    save_rollout_dump(template.format(rollout_id=0), 0, samples)
    argv = ["--load-debug-rollout-data", template, "--rollout-id", "0", "--url", engine_url, "--all"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    diffs = _teacher_forced_max(out)
    assert len(diffs) == 2 and max(diffs) < 1e-4, out
    assert len(re.findall(r"\(b\) regenerated tokens +│ identical", out)) == 2  # seeded sampling reproduces them
    assert "verdict: MATCH (2 match" in out

    samples[1].rollout_log_probs[0] += 0.5
    save_rollout_dump(template.format(rollout_id=0), 0, samples)
    assert main(argv) == 1
    out = capsys.readouterr().out
    diffs = _teacher_forced_max(out)
    assert diffs[0] < 1e-4 and abs(diffs[1] - 0.5) < 1e-3
    assert "verdict: DIFFER (1 match, 1 differ" in out

    assert main(argv[:-1] + ["--sample-index", "0"]) == 0  # only the honest sample
    no_scheme = engine_url.removeprefix("http://")  # host:port, as users type it
    assert main(argv[:-1] + ["--sample-index", "0", "--url", no_scheme]) == 0
    assert main(argv[:-1] + ["--sample-index", "7"]) == 2
    assert "--sample-index 7" in capsys.readouterr().err


def test_a_sample_of_another_temperature_is_checked_by_regeneration_only(engine_url, tmp_path, capsys) -> None:
    """At temperature 0.7 the dump's log-probs are of logits / 0.7 and prompt log-probs of the raw logits (SGLang's
    too): (a) would differ for an honest dump, so it is not run and (b) decides."""
    template = str(tmp_path / "d_{rollout_id}.pt")
    sample = _sample_from_engine(engine_url, 0, [5, 6, 7, 8], dict(PARAMS, temperature=0.7, sampling_seed=11))
    save_rollout_dump(template.format(rollout_id=0), 0, [sample])
    assert main(["--load-debug-rollout-data", template, "--rollout-id", "0", "--url", engine_url, "--all"]) == 0
    out = capsys.readouterr().out
    assert _teacher_forced_max(out) == [] and "the dump's of logits at temperature 0.7" in out, out
    assert re.search(r"\(b\) regenerated tokens +│ identical", out) and "verdict: MATCH (1 match" in out


def test_a_sample_continued_across_weight_versions_compares_its_newest_tokens_only(engine_url, tmp_path, capsys):
    """--partial-rollout: a sample whose first tokens older weights generated (here: their log-probs off by 0.5,
    as other weights give) and whose seed is the continuation's. Its older tokens are not compared and its
    regeneration is not expected to match: MATCH, not DIFFER. An empty dump is an error, not a MATCH."""
    template = str(tmp_path / "d_{rollout_id}.pt")
    sample = _sample_from_engine(engine_url, 0, [5, 6, 7, 8], dict(PARAMS, sampling_seed=11))
    n = sample.response_length
    assert n >= 2
    sample.rollout_log_probs = [x + 0.5 for x in sample.rollout_log_probs[:1]] + sample.rollout_log_probs[1:]
    sample.metadata.update(token_weight_versions=[0] + [1] * (n - 1), start_rollout_id=0)
    sample.metadata["sampling_params"] = dict(PARAMS, sampling_seed=99)  # the continuation request's
    save_rollout_dump(template.format(rollout_id=1), 1, [sample])
    argv = ["--load-debug-rollout-data", template, "--rollout-id", "1", "--url", engine_url, "--all"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert _teacher_forced_max(out)[0] < 1e-4 and "several weight versions" in out and "verdict: MATCH" in out
    save_rollout_dump(template.format(rollout_id=2), 2, [])
    assert main(argv[:3] + ["2", "--url", engine_url, "--all"]) == 2
    assert "holds no samples" in capsys.readouterr().err


def test_a_sample_of_other_weights_than_the_engine_serves_is_inconclusive(engine_url, tmp_path, capsys):
    """A sample of weight version 1 (rollout 1 of a run) sent to an engine started from the checkpoint (version
    "default", 0): its log-probs differ because the weights do, which the tool says instead of DIFFER."""
    template = str(tmp_path / "d_{rollout_id}.pt")
    sample = _sample_from_engine(engine_url, 0, [5, 6, 7, 8], dict(PARAMS, sampling_seed=11))
    sample.rollout_log_probs = [x + 0.5 for x in sample.rollout_log_probs]  # as other weights give
    sample.weight_versions = ["1"]
    save_rollout_dump(template.format(rollout_id=1), 1, [sample])
    argv = ["--load-debug-rollout-data", template, "--rollout-id", "1", "--url", engine_url, "--all"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "engine default, sample 1: the engine holds other weights" in out and "verdict: INCONCLUSIVE" in out
    sample.rollout_log_probs = [x - 0.5 for x in sample.rollout_log_probs]
    for same in ("default", "0"):  # the checkpoint's weights, as the engine names them or as a version number
        sample.weight_versions = [same]
        save_rollout_dump(template.format(rollout_id=1), 1, [sample])
        assert main(argv) == 0 and "verdict: MATCH" in capsys.readouterr().out


def test_unreachable_engine_names_the_url(tmp_path: Path, capsys, samples_factory) -> None:
    template = str(tmp_path / "d_{rollout_id}.pt")
    save_rollout_dump(template.format(rollout_id=0), 0, samples_factory(1, 1))
    url = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    assert main(["--load-debug-rollout-data", template, "--rollout-id", "0", "--url", url, "--timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and url in err and "Traceback" not in err
    for bad in ("http://127.0.0.1:abc", "http://[::1"):  # not a URL: an error line naming it, not a traceback
        assert main(["--load-debug-rollout-data", template, "--rollout-id", "0", "--url", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {bad}: not an engine URL") and "Traceback" not in err, err


class _FakeSGLang(BaseHTTPRequestHandler):
    """A fake SGLang that never returns input_token_logprobs and answers every prompt with tokens 7, 8, 9."""

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = min(3, body["sampling_params"]["max_new_tokens"])
        out = {"text": "789"[:n], "output_ids": [7, 8, 9][:n], "meta_info": {
            "finish_reason": {"type": "length", "length": n},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip([-0.5, -0.25, -1.0], [7, 8, 9])][:n]}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # quiet
        pass


def test_fake_sglang_without_input_logprobs_falls_back_to_regeneration(tmp_path: Path, capsys) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        template = str(tmp_path / "d_{rollout_id}.pt")
        # the dump agrees on the first two response tokens (7, 8), then has 5; log-probs differ by 0.01 there
        sample = Sample(index=0, tokens=[1, 2, 7, 8, 5], response="785", response_length=3,
                        rollout_log_probs=[-0.51, -0.25, -3.0], status=Status.TRUNCATED,
                        metadata={"sampling_params": {"temperature": 1.0, "max_new_tokens": 3}})
        save_rollout_dump(template.format(rollout_id=0), 0, [sample])
        argv = ["--load-debug-rollout-data", template, "--rollout-id", "0", "--url", url]
        assert main(argv + ["--atol", "0.05"]) == 0
        out = capsys.readouterr().out
        assert "engine gave no input_token_logprobs; using (b)" in out
        assert "first difference at response token 2" in out
        assert "max 0.01, mean 0.005 over 2 tokens" in out  # only where the tokens agree
        assert main(argv) == 1  # 0.01 > default --atol
    finally:
        server.shutdown()
        server.server_close()


def _multi_turn_sample(versions: bool, seed: int | None) -> Sample:
    s = Sample(group_index=0, index=0, prompt="p", tokens=[1, 2], reward=1.0, status=Status.COMPLETED,
               metadata={"sampling_params": {"temperature": 1.0, "max_new_tokens": 2,
                                             **({"sampling_seed": seed} if seed else {})}})
    append_turn(s, [10, 11], [-0.1, -0.2], source="model", text="a", versions=[1, 1] if versions else None)
    append_turn(s, [50, 51], source="tool", text="t")
    append_turn(s, [12, 13], [-0.3, -0.4], source="model", text="b", versions=[2, 2] if versions else None)
    return s


def _fake_engine(turns_out: dict):
    """A fake SGLang (in-process, through request_json): no input_token_logprobs, so (b) regenerates each model
    turn; ``turns_out`` maps the length of the tokens sent to the turn's (ids, log-probs)."""
    def request(url, path, body=None, timeout=None, **kw):
        if path == "/get_model_info":
            return {"model_path": "m", "weight_version": "default"}
        if body["sampling_params"].get("max_new_tokens") == 1 and "logprob_start_len" in body:
            return {"output_ids": [0], "meta_info": {}}
        ids, lps = turns_out[len(body["input_ids"])]
        return {"output_ids": ids, "text": "", "meta_info": {
            "output_token_logprobs": [[lp, t] for t, lp in zip(ids, lps)], "finish_reason": {"type": "stop"}}}
    return request


def test_a_multi_turn_verdict_takes_every_turn_and_skips_older_weights_turns(tmp_path, capsys, monkeypatch) -> None:
    import slime_lite.debug.send_to_engine as ste
    template = str(tmp_path / "d_{rollout_id}.pt")
    argv = ["--load-debug-rollout-data", template, "--url", "127.0.0.1:1"]
    # the first turn matches, the second's log-probs are 1.0 off: the verdict is the second's
    save_rollout_dump(template.format(rollout_id=0), 0, [_multi_turn_sample(False, None)])
    monkeypatch.setattr(ste, "request_json", _fake_engine({2: ([10, 11], [-0.1, -0.2]), 6: ([12, 13], [-1.3, -1.4])}))
    assert main(argv + ["--rollout-id", "0"]) == 1
    assert "DIFFER" in capsys.readouterr().out
    # seeded, the turns by weight versions 1 and 2: the engine (version 2) regenerates turn 0 otherwise, which
    # is neither compared nor expected to match
    save_rollout_dump(template.format(rollout_id=1), 1, [_multi_turn_sample(True, 7)])
    monkeypatch.setattr(ste, "request_json", _fake_engine({2: ([10, 99], [-0.1, -0.9]), 6: ([12, 13], [-0.3, -0.4])}))
    assert main(argv + ["--rollout-id", "1"]) == 0
    out = capsys.readouterr().out
    assert "no (generated by several weight versions)" in out and "MATCH" in out
