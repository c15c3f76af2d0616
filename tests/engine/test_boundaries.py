"""Network and file boundaries of weight updates (issue 15 item 5): weight groups listen on the address asked for
only (a wildcard is refused unless the user allows it), a distributed receive that ends early changes no weight,
and a disk load stays inside its folder."""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import pytest
from engine_helpers import http, in_thread

from slime_lite.io import free_port
from slime_lite.weight_transport import WILDCARD_ENV, WeightUpdateGroup

NAMES = ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"]


def _message(out: dict) -> str:
    """The error text of a refused request: a 400 before any work ({"error": {...}}) or a failed weight op."""
    return out["error"]["message"] if "error" in out else out["message"]


def _listeners(own: bool = False) -> list[tuple[str, int]]:
    """(local address in hex, as /proc/net shows it; port) of every listening TCP socket on this host, or with
    ``own`` of this process's only (the engine and the trainer's side both run in it; other processes on the host
    may open what they like meanwhile)."""
    mine = set()
    if own:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    mine.add(link[len("socket:["):-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                addr, p = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and (not own or fields[9] in mine):
                    out.append((addr, int(p, 16)))
    return out


def _listening(port: int) -> list[str]:
    return [addr for addr, p in _listeners() if p == port]


def _wildcard_listeners() -> set[tuple[str, int]]:
    return {(a, p) for a, p in _listeners(own=True) if set(a) == {"0"}}


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "[::]"])
def test_a_wildcard_group_address_is_a_400_naming_the_field(engine, address, monkeypatch):
    monkeypatch.delenv(WILDCARD_ENV, raising=False)
    init = {"master_address": address, "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "wild", "backend": "gloo"}
    status, out = http(engine.url, "/init_weights_update_group", init)
    assert status == 400 and "master_address" in _message(out) and WILDCARD_ENV in _message(out)
    assert http(engine.url, "/health")[0] == 200


def test_the_trainer_refuses_a_wildcard_master_address_before_asking_the_engines(monkeypatch):
    from slime_lite.backends.megatron import weight_broadcast
    from slime_lite.errors import SlimeLiteError

    monkeypatch.delenv(WILDCARD_ENV, raising=False)
    monkeypatch.setenv("SLIME_LITE_WEIGHT_MASTER_ADDR", "0.0.0.0")
    asked = []
    monkeypatch.setattr(weight_broadcast, "request_json", lambda *a, **k: asked.append(a))
    with pytest.raises(SlimeLiteError, match="SLIME_LITE_WEIGHT_MASTER_ADDR.*every interface"):
        weight_broadcast._group(["http://127.0.0.1:1"], "gloo")
    assert asked == []
    with pytest.raises(ValueError, match=WILDCARD_ENV):
        WeightUpdateGroup("0.0.0.0", free_port(), rank=0, world_size=2)


def test_a_weight_group_listens_on_loopback_only(engine):
    wildcard_before = _wildcard_listeners()
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "lo", "backend": "gloo"}
    t, box = in_thread(http, engine.url, "/init_weights_update_group", init)
    trainer = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", group_name="lo",
                                timeout_s=30)
    t.join(30)
    try:
        assert box["result"][0] == 200
        assert _listening(port) == ["0100007F"]  # the store on 127.0.0.1, not 00000000 (every interface)
        assert _wildcard_listeners() <= wildcard_before  # nor any gloo pair of either side
    finally:
        http(engine.url, "/destroy_weights_update_group", {"group_name": "lo"})
        trainer.destroy()


def test_a_receive_that_ends_half_way_changes_no_weight(engine, monkeypatch):
    import torch

    from slime_lite.engine import weights

    monkeypatch.setattr(weights, "GROUP_TIMEOUT_S", 5.0)  # also bounds the join, on a busy machine
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "half", "backend": "gloo"}
    t, box = in_thread(http, engine.url, "/init_weights_update_group", init)
    trainer = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", group_name="half",
                                timeout_s=30)
    t.join(30)
    assert box["result"][0] == 200
    try:
        before = http(engine.url, "/get_weights_checksum", {"names": NAMES})[1]
        body = {"names": NAMES, "dtypes": ["float32"] * 3, "shapes": [[128]] * 3, "group_name": "half"}
        t, box = in_thread(http, engine.url, "/update_weights_from_distributed", body)
        for _ in NAMES[:2]:  # two of three tensors arrive, then the trainer goes quiet
            trainer.broadcast(torch.full((128,), 7.0), src=0)
        t.join(30)
        status, out = box["result"]
        assert status == 400 and "after 2 of 3" in out["message"] and "no weight was changed" in out["message"]
        assert http(engine.url, "/get_weights_checksum", {"names": NAMES})[1] == before
        assert http(engine.url, "/get_weights_by_name", {"name": NAMES[0], "truncate_size": 2})[1] != [7.0, 7.0]
    finally:
        trainer.destroy()


def test_duplicate_names_in_a_receive_are_a_400(engine):
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "dup", "backend": "gloo"}
    t, box = in_thread(http, engine.url, "/init_weights_update_group", init)
    trainer = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=2, backend="gloo", group_name="dup",
                                timeout_s=30)
    t.join(30)
    assert box["result"][0] == 200
    try:
        body = {"names": [NAMES[0], NAMES[0]], "dtypes": ["float32"] * 2, "shapes": [[128]] * 2,
                "group_name": "dup"}
        status, out = http(engine.url, "/update_weights_from_distributed", body)
        assert status == 400 and "more than once" in _message(out)
    finally:
        http(engine.url, "/destroy_weights_update_group", {"group_name": "dup"})
        trainer.destroy()


@pytest.fixture
def sharded_copy(tiny_model_dir, tmp_path):
    """The tiny model's folder with an index file naming its one safetensors file, and a folder beside it."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) == 1
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(folder / files[0], outside / "stolen.safetensors")
    return folder, files[0], outside


def _write_index(folder, entry) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": entry}}))


@pytest.mark.parametrize("entry", ["../outside/stolen.safetensors", "ABSOLUTE", "link.safetensors"])
def test_disk_loads_stay_inside_the_folder(engine, sharded_copy, entry):
    folder, _, outside = sharded_copy
    if entry == "ABSOLUTE":
        entry = str(outside / "stolen.safetensors")
    if entry == "link.safetensors":
        (folder / entry).symlink_to(outside / "stolen.safetensors")
    _write_index(folder, entry)
    before = http(engine.url, "/get_weights_checksum", {"names": NAMES})[1]
    status, out = http(engine.url, "/update_weights_from_disk", {"model_path": str(folder)})
    assert status == 400 and repr(entry) in _message(out) and "model folder" in _message(out)
    assert http(engine.url, "/get_weights_checksum", {"names": NAMES})[1] == before


def test_a_symlinked_shard_without_an_index_may_not_lead_out(engine, sharded_copy):
    folder, name, outside = sharded_copy
    (folder / name).unlink()
    (folder / name).symlink_to(outside / "stolen.safetensors")
    status, out = http(engine.url, "/update_weights_from_disk", {"model_path": str(folder)})
    assert status == 400 and name in _message(out) and "leads out of the model folder" in _message(out)


def test_an_index_inside_the_folder_still_loads(engine, sharded_copy, tiny_model_dir):
    folder, name, _ = sharded_copy
    _write_index(folder, name)
    status, out = http(engine.url, "/update_weights_from_disk", {"model_path": str(folder)})
    assert status == 200 and out["success"] is True, out
    assert http(engine.url, "/update_weights_from_disk", {"model_path": str(tiny_model_dir)})[0] == 200


@pytest.mark.parametrize("content", [b"", b"\x08\x00\x00\x00\x00\x00\x00\x00{junk}}}", b"\xff" * 100],
                         ids=["zero-byte", "junk-header", "random"])
def test_a_junk_safetensors_file_is_a_400_naming_it(engine, sharded_copy, content):
    folder, name, _ = sharded_copy
    (folder / name).write_bytes(content)
    before = http(engine.url, "/get_weights_checksum", {"names": NAMES})[1]
    status, out = http(engine.url, "/update_weights_from_disk", {"model_path": str(folder)})
    assert status == 400 and f"{folder / name}: not a readable safetensors file" in _message(out), out
    assert http(engine.url, "/get_weights_checksum", {"names": NAMES})[1] == before


@pytest.fixture(scope="module")
def profiled_engine(tiny_model_dir, tmp_path_factory):
    from engine_helpers import start_engine

    folder = tmp_path_factory.mktemp("profiles")
    server = start_engine(tiny_model_dir, max_running_requests=2, profile_dir=str(folder / "traces"))
    yield server, folder
    server.stop()


def test_profiles_are_written_only_under_the_profile_dir(profiled_engine):
    """/start_profile writes under the server's --profile-dir only: an output_dir outside it (absolute, '..', a
    symlink out) or one that cannot be made is a 400 naming it, with nothing created; inside, the trace is written."""
    server, folder = profiled_engine
    root = folder / "traces"
    (folder / "elsewhere").mkdir()
    root.mkdir(exist_ok=True)
    (root / "out").symlink_to(folder / "elsewhere")
    (root / "a_file").write_text("x")
    for output_dir, said in ((str(folder / "elsewhere" / "new"), "outside this server's profile folder"),
                             ("../new", "outside this server's profile folder"),
                             ("out/new", "outside this server's profile folder"),
                             ("/proc/nope/x", "outside this server's profile folder"),
                             ("a_file/sub", "cannot create"), ("x\x00y", "not a usable path")):
        status, out = http(server.url, "/start_profile", {"output_dir": output_dir})
        assert status == 400 and repr(output_dir) in _message(out) and said in _message(out), (output_dir, out)
    assert not (folder / "new").exists() and not list((folder / "elsewhere").iterdir())
    for prefix in ("a/b", ".hidden", "a\x00b", "p" * 201):  # names /stop_profile could not write: refused first
        status, out = http(server.url, "/start_profile", {"profile_prefix": prefix})
        assert status == 400 and "profile_prefix" in _message(out), (prefix, out)
    assert http(server.url, "/stop_profile", {})[0] == 400  # none started
    for output_dir in ("run1", str(root / "run2"), ""):
        assert http(server.url, "/start_profile", {"output_dir": output_dir, "profile_prefix": "p"})[0] == 200
        status, text = http(server.url, "/stop_profile", {})
        assert status == 200 and "Trace written to" in text, text
        assert list((root / output_dir).glob("p-*.trace.json")), output_dir
