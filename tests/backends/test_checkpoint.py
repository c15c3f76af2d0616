"""Checkpoints hold plain data only and load with weights_only=True: a crafted checkpoint never runs code."""

from __future__ import annotations

import collections
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slime_lite.backends.megatron import checkpoint
from slime_lite.errors import SlimeLiteError
from tests.fakes.evil_pickle import Evil


def _actor(model: torch.nn.Module | None = None, optimizer=None) -> SimpleNamespace:
    args = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, no_save_optim=False,
                           ref_update_interval=None, save_hf=None, expert_model_parallel_size=1,
                           expert_tensor_parallel_size=None)
    return SimpleNamespace(role="actor", rank=0, world_size=1, args=args, model=model, optimizer=optimizer)


def _checkpoint(root: Path, payload) -> Path:
    (root / "iter_0000000").mkdir(parents=True)
    torch.save(payload, root / "iter_0000000" / "rank_000.pt")
    (root / "latest").write_text("iter_0000000")
    return root / "iter_0000000" / "rank_000.pt"


def test_crafted_checkpoint_is_refused_and_its_payload_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    file = _checkpoint(tmp_path / "ckpt", {"model": {}, "optimizer": Evil(str(marker)), "rng": {},
                                           "next_rollout_id": 1})
    with pytest.raises(SlimeLiteError, match=rf"--load .*: checkpoint {file} is not a plain-tensor file.*"
                                             r"write_marker.*nothing in it ran"):
        checkpoint.load(_actor(), str(tmp_path / "ckpt"))
    with pytest.raises(SlimeLiteError, match=rf"--load .*: checkpoint {file} is not a plain-tensor file"):
        checkpoint.check_loadable(str(tmp_path / "ckpt"), critic=False)  # preflight's check, before Ray starts
    assert not marker.exists()
    torch.load(file, weights_only=False)  # the file really runs code when loaded unsafely
    assert marker.exists()


def test_saved_state_round_trips_through_a_weights_only_load(tmp_path: Path, caplog) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": {"cpu": torch.get_rng_state(),
             "cuda": None}, "next_rollout_id": 5, "data_state": {"source": {"epoch": 1, "offset": 3}},
             "layout": {"world": 1, "tp": 1, "pp": 1}}
    root = tmp_path / "ckpt"
    _checkpoint(root, checkpoint.plain_state(state))
    _checkpoint(root / "critic", {"a": 1})
    checkpoint.check_loadable(str(root), critic=True)  # preflight passes a good checkpoint (mmapped, critic too)
    (root / "critic" / "iter_0000000" / "rank_000.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SlimeLiteError, match=r"--load .*critic/iter_0000000/rank_000.pt is not a torch file"):
        checkpoint.check_loadable(str(root), critic=True)
    model2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    with caplog.at_level("INFO", logger=checkpoint.__name__):
        out = checkpoint.load(_actor(model2, opt2), str(root))
    assert out == {"next_rollout_id": 5, "data_state": {"source": {"epoch": 1, "offset": 3}}}
    assert f"resumed the actor from checkpoint {root / 'iter_0000000'} (iteration 0); training goes on at " \
           "rollout 5" in caplog.text
    assert torch.equal(model2.weight, model.weight)
    assert opt2.state_dict()["param_groups"][0]["betas"] == (0.8, 0.9)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    other_ep = _actor(torch.nn.Linear(3, 2), None)
    other_ep.args.expert_model_parallel_size = 2  # the saved layout (world, tp, pp) holds; its EP would not
    state["layout"] = {"world": 1, "tp": 1, "pp": 1, "ep": 1, "etp": 1}
    _checkpoint(tmp_path / "ep", checkpoint.plain_state(state))
    with pytest.raises(SlimeLiteError, match=r"saved with \{'world': 1, 'tp': 1, 'pp': 1, 'ep': 1, 'etp': 1\} but "
                                             r"this run uses .*'ep': 2.*--expert-model-parallel-size"):
        checkpoint.load(other_ep, str(tmp_path / "ep"))
    bf16 = torch.nn.Linear(3, 2).to(torch.bfloat16)  # another --bf16 (or float32 norms of an older bf16 save)
    with pytest.raises(SlimeLiteError, match=r"--load .*2 weight\(s\) in another dtype .*weight: float32 saved, "
                                             r"bfloat16 here.*--hf-checkpoint .*iter_0000000/hf"):
        checkpoint.load(_actor(bf16, torch.optim.Adam(bf16.parameters())), str(root))
    state["lora"] = {"rank": 8, "alpha": 16.0}  # a LoRA checkpoint exports its adapter, not hf/
    _checkpoint(tmp_path / "lora", checkpoint.plain_state(state))
    with pytest.raises(SlimeLiteError, match=r"--lora-adapter-path .*iter_0000000/adapter\.$"):
        checkpoint.load(_actor(bf16, torch.optim.Adam(bf16.parameters())), str(tmp_path / "lora"))
    critic = _actor(bf16, torch.optim.Adam(bf16.parameters()))
    critic.role = "critic"  # no export at all
    _checkpoint(tmp_path / "c" / "critic", checkpoint.plain_state(state))
    with pytest.raises(SlimeLiteError, match=r"Resume with the same --bf16\.$"):
        checkpoint.load(critic, str(tmp_path / "c"))
    wider = torch.nn.Linear(3, 4)  # another model: a clear error, not load_state_dict's size mismatch
    with pytest.raises(SlimeLiteError, match=r"holds weight of shape \[2, 3\] and this run's model has \[4, 3\].*"
                                             r"--hf-checkpoint"):
        checkpoint.load(_actor(wider, torch.optim.Adam(wider.parameters())), str(root))


def test_a_resume_with_other_parameters_frozen_is_refused_not_given_their_optimizer_state(tmp_path: Path) -> None:
    """Adam's state is restored by position over the trainable parameters: frozen ones changed, it would go to
    other parameters (or fail to load) without a word."""
    def model_and_opt(frozen: str):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
        for n, p in model.named_parameters():
            p.requires_grad_(not n.startswith(frozen))
        return model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad])

    model, opt = model_and_opt("0.")
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    def critic(model, opt):  # a critic's save writes no HF export: the save runs on this fake actor as it is
        out = _actor(model, opt)
        out.role = "critic"
        return out

    checkpoint.save(critic(model, opt), str(tmp_path / "ckpt"), 0, None)
    assert checkpoint.load(critic(*model_and_opt("0.")), str(tmp_path / "ckpt"))["next_rollout_id"] == 1
    with pytest.raises(SlimeLiteError, match=r"trained with other parameters frozen \(0\.bias was frozen then\).*"
                                             r"--freeze-params-name-list / --only-train-params-name-list"):
        checkpoint.load(critic(*model_and_opt("1.")), str(tmp_path / "ckpt"))


def test_a_checkpoint_of_another_layer_count_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """Same widths, other layers: every shape the two share agrees, and torch's strict load would raise its own
    RuntimeError listing keys; the error names --load, a weight and the fix."""
    def critic(layers: int):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(layers)])
        out = _actor(model, torch.optim.Adam(model.parameters()))
        out.role = "critic"
        return out

    checkpoint.save(critic(3), str(tmp_path / "ckpt"), 0, None)
    for layers, where in ((2, "2.bias only in the checkpoint"), (4, "3.bias only here")):
        with pytest.raises(SlimeLiteError, match=rf"--load .*hold different weights \(e.g. {re.escape(where)}; 2 in "
                                                 r"all\).*Resume with the --hf-checkpoint it was trained with"):
            checkpoint.load(critic(layers), str(tmp_path / "ckpt"))
    assert checkpoint.load(critic(3), str(tmp_path / "ckpt"))["next_rollout_id"] == 1


def test_plain_state_names_what_a_weights_only_load_could_not_read() -> None:
    assert checkpoint.plain_state(collections.OrderedDict(a=(1, torch.zeros(1)))) == {"a": (1, torch.zeros(1))}
    with pytest.raises(TypeError, match=r"checkpoint state\['optimizer'\]\[0\] is a object"):
        checkpoint.plain_state({"optimizer": [object()]})


def test_latest_must_name_an_iteration_folder(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("../../etc")
    with pytest.raises(SlimeLiteError, match=r"latest names '\.\./\.\./etc', not an iteration folder"):
        checkpoint.latest(str(tmp_path))


def test_a_failed_save_leaves_no_folder_behind(tmp_path: Path, monkeypatch) -> None:
    """A full disk while writing a rank file: the error says so, and neither iter_* nor .tmp-iter_* is left."""
    import errno

    model = torch.nn.Linear(3, 2)
    actor = _actor(model, torch.optim.Adam(model.parameters()))
    actor.hf_weights = lambda: None

    def full(obj, path):
        with open(path, "wb") as f:  # part of the file written, then the disk is full
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "atomic_torch_save", full)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(actor, str(tmp_path / "ckpt"), 3, None)
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_checkpoint_that_cannot_resume_exactly_is_refused_before_ray(tmp_path: Path) -> None:
    """preflight's check: ``latest`` naming a folder that is gone, or a critic saved at another iteration than the
    actor (the run stopped between the two saves), is refused naming the files and the fix, not found after the
    models are built (or not at all: the critic would resume rollouts behind the actor)."""
    root = tmp_path / "ckpt"
    _checkpoint(root, {"model": {}})
    _checkpoint(root / "critic", {"model": {}})
    (root / "iter_0000004").mkdir()
    torch.save({"model": {}}, root / "iter_0000004" / "rank_000.pt")
    (root / "latest").write_text("iter_0000004")
    with pytest.raises(SlimeLiteError, match=r"the actor's newest checkpoint is iter_0000004 but the critic's is "
                                             r"iter_0000000 .*write iter_0000000 into .*ckpt/latest and "
                                             r".*ckpt/critic/latest"):
        checkpoint.check_loadable(str(root), critic=True)
    checkpoint.check_loadable(str(root), critic=False)  # a run without a critic resumes the actor's
    (root / "critic" / "latest").write_text("iter_0000004")
    with pytest.raises(SlimeLiteError, match=r"critic/latest names iter_0000004, but there is no folder "
                                             r".*critic/iter_0000004"):
        checkpoint.check_loadable(str(root), critic=True)
    (root / "critic" / "latest").write_text("iter_0000000")
    (root / "latest").write_text("iter_0000000")
    checkpoint.check_loadable(str(root), critic=True)
    (root / "iter_0000006").mkdir()  # named by latest but copied in part: no rank file
    (root / "latest").write_text("iter_0000006")
    with pytest.raises(SlimeLiteError, match=r"iter_0000006 holds no rank files .*a complete iteration folder"):
        checkpoint.check_loadable(str(root), critic=False)
    (root / "latest").write_text("iter_0000000")
    (root / "critic" / "latest").unlink()  # a checkpoint of a run without a critic, resumed with one
    with pytest.raises(SlimeLiteError, match=r"the run trains a critic, but the checkpoint has none"):
        checkpoint.check_loadable(str(root), critic=True)
    checkpoint.check_loadable(str(root), critic=False)


def _save_rank(rank: int, port: int, out: str) -> None:
    import datetime
    import errno

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a rank left waiting fails the test, late
    model = torch.nn.Linear(3, 2)
    actor = _actor(model, torch.optim.Adam(model.parameters()))
    actor.rank, actor.world_size, actor.hf_weights = rank, 2, lambda: None
    if rank == 1:
        def full(obj, path):
            raise OSError(errno.ENOSPC, "No space left on device")
        checkpoint.atomic_torch_save = full
    try:
        checkpoint.save(actor, f"{out}/ckpt", 3, None)
        result = "saved"
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        result = f"{type(exc).__name__}: {exc}"
    Path(f"{out}/rank{rank}.txt").write_text(result)
    dist.destroy_process_group()


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_leaves_nothing(tmp_path: Path) -> None:
    """Rank 1's disk is full: rank 1 raises its error, rank 0 one naming rank 1, at once (not at the process
    group's timeout, waiting at a barrier for a rank that left), and no checkpoint folder is left."""
    import torch.multiprocessing as mp

    from slime_lite.io import free_port

    mp.spawn(_save_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    assert (tmp_path / "rank1.txt").read_text() == "OSError: [Errno 28] No space left on device"
    assert (tmp_path / "rank0.txt").read_text() == (f"SlimeLiteError: saving checkpoint {tmp_path}/ckpt/iter_0000003: "
                                                    "failed on rank 1 (its error is in that rank's log)")
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_failed_save_hf_export_says_the_checkpoint_was_saved(tmp_path: Path, monkeypatch) -> None:
    """--save-hf's folder cannot be written after the checkpoint is in place: the error says both, and the
    checkpoint stays (latest names it); a failure before (the checkpoint's own hf/ export) leaves no folder."""
    model = torch.nn.Linear(3, 2)
    actor = _actor(model, torch.optim.Adam(model.parameters()))
    actor.role, actor.args.hf_checkpoint, actor.args.ref_load = "actor", str(tmp_path / "base"), None
    actor.args.save_hf = str(tmp_path / "hf_{rollout_id}")
    actor.hf_weights = lambda: {"w": torch.zeros(1)}

    def no_room(named, base, out):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_hf_folder", no_room)
    with pytest.raises(SlimeLiteError, match=r"no space left writing .*iter_0000003/hf "):  # the checkpoint's own
        checkpoint.save(actor, str(tmp_path / "ckpt"), 3, None)  # export, before the checkpoint is in place
    assert list((tmp_path / "ckpt").iterdir()) == []

    calls = []
    monkeypatch.setattr(checkpoint, "write_hf_folder", lambda named, base, out: calls.append(out) or (
        None if out.endswith("hf") else no_room(named, base, out)))
    with pytest.raises(SlimeLiteError, match=r"checkpoint .*iter_0000004 was saved, but writing the Hugging Face"):
        checkpoint.save(actor, str(tmp_path / "ckpt"), 4, None)
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000004"
    assert (tmp_path / "ckpt" / "iter_0000004" / "rank_000.pt").exists() and calls[-1].endswith("hf_4")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["iter_0000004", "latest"]
