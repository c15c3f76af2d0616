"""The rollout manager: one Ray actor owning prompt data, engine URLs, generation, rewards, eval and debug dumps.

It never imports Megatron: in ``--debug-rollout-only`` runs no process of the job does.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from slime_lite.engine_client import AsyncEngineClient, request_json
from slime_lite.errors import EngineError, SlimeLiteError
from slime_lite.hooks import HookArgs, load_hook
from slime_lite.logging_setup import setup_logging
from slime_lite.metrics import process_memory
from slime_lite.rollout import drift, dumps, functions, train_data
from slime_lite.rollout.data import DataKeys, PromptSource, drop_long_prompts, read_prompts
from slime_lite.rollout.fully_async import FullyAsyncWorker
from slime_lite.rollout.generate import Generator
from slime_lite.rollout.rewards import check_data_rm_types
from slime_lite.rollout.stats import eval_metrics, groups_rewards, rollout_metrics
from slime_lite.rollout.timing import engine_step_stats, phase_metrics
from slime_lite.rollout.oversample import GENERATED_TOKENS
from slime_lite.rollout.turns import model_tokens
from slime_lite.tokenizer import load_tokenizer, model_vocab_size, tokenizer_fingerprint
from slime_lite.types import FINISHED_BEFORE, Sample, version_number

log = logging.getLogger(__name__)


class RolloutManager:
    def __init__(self, args: Any, engine_urls: list[str], fault_engine: Any = None,
                 worker_urls: list[str] | None = None) -> None:
        """``engine_urls``: where /generate goes (the router, or each engine); ``worker_urls``: the engines' own
        URLs behind a router (over-sampling aborts requests on each)."""
        setup_logging(args.log_level)
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.grouped = groups_rewards(args)  # rollout/rewards: group-centred, as slime logs them
        self.loop = asyncio.new_event_loop()
        # debug dumps are written by one background thread, in order, while the driver trains on the rollout
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dump-writer")
        self._writing: list[Future] = []
        self._writing_lock = threading.Lock()  # the driver's wait_dumps may come from the actor's second thread
        self.source = None
        self._told_engine_version = False
        self.eval_sets: dict[str, list[Any]] = {}
        self.generator = None
        if engine_urls:
            client = AsyncEngineClient(engine_urls, timeout=args.rollout_request_timeout,
                                       wait_for_replacement=args.use_fault_tolerance)
            self.generator = Generator(args, self.tokenizer, client)
            self.generator.over.abort_urls = list(worker_urls or engine_urls)
            if fault_engine is not None:  # --debug-inject-fault kill-engine: engine 0's actor, to kill its server
                # engine 0's own URL, not the router's (which answers /health whatever its workers do)
                engine0 = (worker_urls or engine_urls)[0]
                self.generator.kill_engine = lambda: kill_engine(fault_engine, engine0)
        if args.prompt_data and not args.debug_train_only:
            where = f"--prompt-data {args.prompt_data}"
            prompts = read_prompts(args.prompt_data, DataKeys.from_args(args))
            check_data_rm_types(args, [p.metadata for p in prompts], where)
            prompts = drop_long_prompts(prompts, args.rollout_max_prompt_len, self.tokenizer, args,
                                        f"{where} with --rollout-max-prompt-len")
            self.source = PromptSource(prompts, args.rollout_shuffle, args.rollout_seed)
        if args.eval_prompt_data and not args.debug_train_only:
            pairs = args.eval_prompt_data
            for name, path in zip(pairs[0::2], pairs[1::2]):
                prompts = read_prompts(path, DataKeys.from_args(args, evaluation=True), "--eval-prompt-data")
                check_data_rm_types(args, [p.metadata for p in prompts], f"--eval-prompt-data {path}",
                                    eval_data=True)
                self.eval_sets[name] = drop_long_prompts(prompts, args.eval_max_prompt_len, self.tokenizer, args,
                                                         f"--eval-prompt-data {path} with --eval-max-prompt-len")
        self.vocab_size = model_vocab_size(args.hf_checkpoint) or len(self.tokenizer)
        self.rollout_fn = load_hook(args.rollout_function_path, "--rollout-function-path")
        self.eval_fn = load_hook(args.eval_function_path or args.rollout_function_path, "--eval-function-path")
        self.hook_args = self.generator.args if self.generator is not None else HookArgs(args)
        # slime's hooks around logging and training data, None when not given
        self.manager_hooks = {flag: load_hook(getattr(args, flag[2:].replace("-", "_")), flag)
                              if getattr(args, flag[2:].replace("-", "_")) else None
                              for flag in (train_data.FLAG, "--custom-rollout-log-function-path",
                                           "--custom-eval-rollout-log-function-path")}
        # --fully-async: generation goes on between the driver's calls, so the event loop runs in its own thread
        self.worker = None
        self._loop_thread: threading.Thread | None = None
        if args.fully_async and self.generator is not None:
            self.worker = FullyAsyncWorker(self.generator, self.source)
            self._loop_thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
            self._loop_thread.start()

    def _meta(self) -> dict[str, Any]:
        meta = dumps.make_meta(self.args, self.fingerprint)
        if self.args.deterministic_mode:  # the same run twice writes the same bytes
            meta.pop("created_at", None)
        return meta

    def _run(self, coro: Any) -> Any:
        if self._loop_thread is not None:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        return self.loop.run_until_complete(coro)

    def _save(self, path: str, rollout_id: int, samples: list[Sample], **extra: Any) -> None:
        """Write a dump in the background (a rollout's dump takes ~0.3-2 s: off the loop's critical path). A write
        that failed is raised here, at the next save, or by ``wait_dumps``."""
        import torch  # noqa: F401 - imported in this thread: a first import in the writer, racing one here, breaks

        self._reap(keep=1)  # one write queued behind the one running at most: each holds a rollout's samples
        meta = self._meta()

        def write() -> None:
            dumps.save_rollout_dump(path, rollout_id, samples, meta, **extra)
            log.info("saved rollout %d (%d samples) to %s", rollout_id, len(samples), path)

        with self._writing_lock:
            self._writing.append(self._writer.submit(write))

    def _reap(self, keep: int) -> None:
        """Raise the failure of a finished write (e.g. a full disk, naming the file); wait until at most ``keep``
        writes are pending."""
        with self._writing_lock:
            while self._writing and (self._writing[0].done() or len(self._writing) > keep):
                self._writing.pop(0).result()

    def wait_dumps(self) -> None:
        """Block until every dump asked for is on disk (the end of a run, or a failure the user will debug)."""
        self._reap(keep=0)

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """One rollout's samples (generated, or loaded from ``--load-debug-rollout-data``) and its metrics."""

        a = self.args
        if a.load_debug_rollout_data:
            t0 = time.monotonic()
            samples = self._load(rollout_id)
            extra: dict[str, float] = {}
            elapsed = time.monotonic() - t0
        else:
            if self.generator is None:
                raise SlimeLiteError("no engines to generate from.")
            urls = list(self.generator.client.urls)
            before = self._run(engine_step_stats(urls))  # outside perf/rollout_time, as the read after it
            # this rollout's first request and last answer (a custom rollout function may run no request through
            # the generator, or run an eval's before: not an earlier rollout's times)
            self.generator.first_sent = self.generator.last_back = None
            t0 = time.monotonic()
            if self.worker is not None:
                samples, extra = self._run(self.worker.rollout(rollout_id))
            else:
                flag = "--rollout-function-path"
                samples, extra = functions.train_samples(self._call(self.rollout_fn, rollout_id, False), flag)
            t1 = time.monotonic()
            elapsed = t1 - t0
            sent, back = (getattr(self.generator, k, None) for k in ("first_sent", "last_back"))
            extra.update(phase_metrics(t0, sent, back, t1, before, self._run(engine_step_stats(urls))))
        try:
            if not a.load_debug_rollout_data:  # a replay's dumps were checked before Ray started
                dumps.check_generated_samples(samples, self.vocab_size, f"rollout {rollout_id}")
                # nothing compares groups without a trainer, nor when a post-process hook normalises the rewards
                if not a.debug_rollout_only and not a.custom_reward_post_process_path:
                    functions.check_group_sizes(samples, a.n_samples_per_prompt, a.advantage_estimator)
            dumps.check_rewards(samples, a.reward_key, f"rollout {rollout_id}", strict=False)
        except SlimeLiteError:
            self._dump(rollout_id, samples)
            try:
                self.wait_dumps()  # the rollout's dump is on disk before the user reads the error: inspect it
            except Exception:  # noqa: BLE001 - the sample error is the one to report
                log.exception("writing a debug dump failed too")
            raise
        metrics = rollout_metrics(samples, a.reward_key, grouped=self.grouped, passrate=a.log_passrate,
                                  reward_category=a.log_reward_category)
        drift_metrics = drift.rollout_metrics(samples, self.tokenizer, a.apply_chat_template_kwargs)
        metrics.update(drift_metrics)
        metrics.update(extra)
        # the trained samples' last requests (not a sample carried already finished: made in an earlier rollout)
        served = [version_number(str(v)) for s in samples if FINISHED_BEFORE not in s.metadata
                  for v in s.weight_versions[-1:]]
        # --fully-async: the version the engines serve now; --partial-rollout: the oldest any request reported
        if "rollout/weight_version" in metrics:
            pass
        elif served:  # the oldest: one stale engine among several shows (a replay: the dump's newest); -1: an engine
            # still serves what it loaded itself ("default"): no push ever reached it
            metrics["rollout/weight_version"] = float(max(served) if a.load_debug_rollout_data else min(served))
        elif not a.load_debug_rollout_data and self.generator is not None:
            metrics.update(self._engine_weight_version(rollout_id))
        if not a.load_debug_rollout_data:
            metrics["perf/rollout_time"] = elapsed
            # the tokens the engines generated this rollout (over-sampling counts those of aborted and carried
            # samples too); else the trained samples' model turns (a multi-turn sample's inserted turns are not)
            tokens = metrics.get(GENERATED_TOKENS, sum(model_tokens(s) for s in samples))
            metrics["perf/rollout_tokens_per_s"] = tokens / elapsed if elapsed > 0 else 0.0
        log_fn = self.manager_hooks["--custom-rollout-log-function-path"]
        hook_logs = log_fn is not None and bool(self._call_hook(log_fn, rollout_id, self.hook_args, samples,
                                                                dict(extra), elapsed))
        if hook_logs:  # True: the hook logged the rollout (slime's contract)
            metrics = train_data.checked_only(metrics, set(drift_metrics))
        if not a.debug_rollout_only:  # slime's conversion to training data (none without a trainer)
            train_data.mask_removed(samples)
            post_process = self.manager_hooks[train_data.FLAG]
            if post_process is not None:
                means = train_data.keep_post_processed(self._call_hook(post_process, self.hook_args, samples),
                                                       samples)
                metrics.update({} if hook_logs else means)
            else:  # split trajectories: each group normalised over its trajectories here
                split = train_data.normalize_split_trajectories(
                    samples, a.n_samples_per_prompt, a.advantage_estimator, not a.disable_grpo_std_normalization,
                    a.reward_key)
                metrics.update({} if hook_logs else split)
        self._dump(rollout_id, samples)  # after the conversion: the dump holds what is trained
        return samples, metrics

    def _dump(self, rollout_id: int, samples: list[Sample]) -> None:
        if self.args.save_debug_rollout_data:
            self._save(dumps.dump_path(self.args.save_debug_rollout_data, rollout_id), rollout_id, samples)

    def _call_hook(self, fn: Any, *args: Any) -> Any:
        """A plain or async hook; a coroutine runs on this actor's event loop."""
        result = fn(*args)
        return self._run(result) if inspect.isawaitable(result) else result

    def _engine_weight_version(self, rollout_id: int) -> dict[str, float]:
        """A generate hook that records no ``weight_versions`` (many slime hooks do not): the version is read from
        the engines instead (the oldest one any engine serves), so the weight-version check still catches a
        skipped push. ``rollout/weight_version_from_engines`` marks it."""

        if not self._told_engine_version:
            log.info("rollout %d: the samples carry no weight_versions (a generate hook that does not record "
                     "meta_info.weight_version); the weight version is read from the engines instead", rollout_id)
            self._told_engine_version = True
        infos = []
        dead = set(self.generator.client.failed())  # --use-fault-tolerance: replaced, not read
        for u in self.generator.over.engine_urls():  # each engine's, not a router's
            if u in dead:
                continue
            try:
                infos.append(request_json(u, "/get_model_info", timeout=30.0, method="GET"))
            except EngineError as exc:  # one engine that does not answer says nothing of the others' versions
                log.warning("rollout %d: engine %s did not give its weight version (%s)", rollout_id, u, exc)
        versions = [version_number(str(i.get("weight_version"))) for i in infos if isinstance(i, dict)]
        if not versions:
            return {}
        return {"rollout/weight_version": float(min(versions)), "rollout/weight_version_from_engines": 1.0}

    def _load(self, rollout_id: int) -> list[Sample]:
        a = self.args
        path = dumps.dump_path(a.load_debug_rollout_data, rollout_id)
        dump = dumps.load_rollout_dump(path)
        dumps.check_replay_meta(dump, self._meta())
        samples = dump.samples
        if a.load_debug_rollout_data_subsample is not None:
            samples = dumps.subsample_groups(samples, a.load_debug_rollout_data_subsample, a.n_samples_per_prompt)
        log.info("loaded rollout %d from %s (%d samples)", rollout_id, path, len(samples))
        return samples

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        a = self.args
        metrics: dict[str, float] = {}
        if self.generator is None:
            return metrics
        t0 = time.monotonic()
        output = self._call(self.eval_fn, rollout_id, True)
        sets, extra = functions.eval_samples(output, "--eval-function-path")
        for name, samples in sets.items():
            metrics.update(eval_metrics(name, samples, a.eval_reward_key or a.reward_key, a.log_passrate,
                                        a.log_reward_category))
            if a.save_debug_rollout_data:
                path = dumps.dump_path(a.save_debug_rollout_data, rollout_id, evaluation=True)
                if len(sets) > 1:
                    root, ext = os.path.splitext(path)
                    path = f"{root}_{name}{ext}"
                self._save(path, rollout_id, samples, eval_name=name)
            # a NaN reward (a remote reward model's "NaN") would log a NaN eval metric: stopped, as in rollouts
            try:
                dumps.check_rewards(samples, a.eval_reward_key or a.reward_key,
                                    f"eval {name} at rollout {rollout_id}", strict=False)
            except SlimeLiteError:
                self.wait_dumps()  # the eval's dumps are on disk before the user reads the error
                raise
        metrics.update(extra)
        metrics["perf/eval_time"] = time.monotonic() - t0
        log_fn = self.manager_hooks["--custom-eval-rollout-log-function-path"]
        data = output.data if isinstance(output, functions.RolloutFnEvalOutput) else output
        if log_fn is not None and self._call_hook(log_fn, rollout_id, self.hook_args, data, dict(extra)):
            return {}
        return metrics

    def _call(self, fn: Any, rollout_id: int, evaluation: bool) -> Any:
        """A rollout or eval function with slime's arguments: a coroutine runs on this actor's event loop (where the
        engine client lives), a plain function is called outside it."""
        data_source = functions.DataSource(self.generator, self.source, self.eval_sets)
        result = fn(self.hook_args, rollout_id, data_source, evaluation=evaluation)
        return self._run(result) if inspect.isawaitable(result) else result

    # ---- --use-fault-tolerance: the driver reads the failed engines and hands in their replacements, from a second
    # thread of this actor while generate/evaluate runs
    def use_lora_adapter(self, name: str) -> None:
        """Every later /generate names this adapter (LoRA on real SGLang: the one the last push loaded)."""
        if self.generator is not None:
            self.generator.client.lora_path = name

    def failed_engines(self) -> list[str]:
        return self.generator.client.failed() if self.generator is not None else []

    def replace_engine(self, old_url: str, new_url: str) -> None:
        """A restarted engine (or router) serves in place of ``old_url``; the hooks' sglang_router_ip/port follow
        the client."""
        if old_url in self.generator.client.urls:
            self.generator.client.replace(old_url, new_url)
        urls = self.generator.over.abort_urls
        if old_url in urls:
            urls[urls.index(old_url)] = new_url

    def progress(self) -> list[int]:
        return list(self.generator.progress) if self.generator is not None else [0, 0]

    def close(self) -> None:
        self.wait_dumps()
        if self.worker is not None:
            self._run(self.worker.stop())
        if self.generator is not None:
            self._run(self.generator.client.close())
        agents = sys.modules.get("slime_lite.rollout.agent_endpoint")  # imported only by an agent hook
        if agents is not None:
            self._run(agents.stop_endpoint())  # its HTTP server, on the rollout's loop
        if self._loop_thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._loop_thread.join(timeout=10)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rollout side: the prompt cursor, and the samples --partial-rollout carries
        to the next rollout (a resumed run continues them: no prompt is lost or generated twice)."""
        if self.worker is not None:  # the groups queued or in flight, and the next sample index, too
            return self._run(self.worker.state())
        state: dict[str, Any] = {"source": self.source.state() if self.source else None}
        if self.generator is not None and self.generator.over.carried:
            state["carried"] = self.generator.over.carried_state()
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        if self.source is not None and state.get("source"):
            self.source.load_state(state["source"])
        if self.worker is not None:  # its groups, and its next sample index (the sampling seeds go on from it)
            self.worker.load_state(state.get("carried") or [], state.get("next_index"))
            if state.get("carried"):
                log.info("--fully-async: %d prompt groups from the checkpoint (queued or generating when it was "
                         "saved) are trained first", len(state["carried"]))
        elif self.generator is not None and state.get("carried"):
            self.generator.over.load_state(state["carried"])
            log.info("--partial-rollout: %d samples carried from the checkpoint continue in the next rollout",
                     sum(len(g) for g in state["carried"]))

    def memory(self) -> dict[str, float]:
        return process_memory()

    def imported_modules(self) -> list[str]:
        return sorted(sys.modules)


async def kill_engine(engine: Any, url: str) -> None:
    """--debug-inject-fault kill-engine: SIGKILL the engine's server process and wait until its URL stops answering."""

    log.warning("--debug-inject-fault kill-engine: killing the server process of engine 0 (%s) with SIGKILL", url)
    engine.kill_server.remote()  # the embedded engine's actor kills itself: no reply to wait for
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            await asyncio.to_thread(request_json, url, "/health", timeout=1)
        except EngineError:
            return
        await asyncio.sleep(0.05)
    raise SlimeLiteError(f"--debug-inject-fault kill-engine: engine 0 at {url} still answers 30 s after SIGKILL")
