"""Checkpoint integrity: a manifest per checkpoint, verified before anything loads; errors that name the file;
auto-resume falling back to the newest intact checkpoint; rotation (max_ckpt_to_keep); leftovers of interrupted
saves; and a save killed at any point never costing the previous checkpoint."""

from __future__ import annotations

import hashlib
import logging
import os
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trainer_loop import (  # the fake trainer of the loop tests
    ToyActor,
    ToyTrainer,
    crash_at,
    deterministic,
    make_config,
    run,
)

from ppo_core.trainer import RewardFunctionError, read_metrics_jsonl
from ppo_core.trainer import checkpoint as ckpt
from ppo_core.trainer.manifest import MANIFEST_FILE, CheckpointCorruptError, verify_manifest, write_manifest
from ppo_core.workers import register


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The metrics per step of an uninterrupted 6-step run (as the loop tests' reference run)."""
    path = tmp_path_factory.mktemp("uninterrupted")
    run(ToyTrainer, make_config(path))
    return deterministic(read_metrics_jsonl(path))


# ----- the manifest ----------------------------------------------------------------------------------------

names = st.text(alphabet="abc_.0", min_size=1, max_size=5).filter(lambda n: n not in (".", ".."))
trees = st.dictionaries(
    st.lists(names, min_size=1, max_size=3).map(tuple), st.binary(max_size=3000), max_size=6
)


@settings(max_examples=30, deadline=None)
@given(trees)
def test_manifest_lists_every_file_with_its_size_and_sha256(tmp_path_factory, tree):
    folder = tmp_path_factory.mktemp("tree")
    written = {}
    for parts, data in tree.items():
        path = folder.joinpath(*parts)
        if any(p.is_file() for p in path.parents) or path.is_dir():
            continue  # a name used both as a file and a folder
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written["/".join(parts)] = data
    manifest = write_manifest(folder)
    want = {rel: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for rel, d in written.items()}
    assert manifest["files"] == want
    assert verify_manifest(folder) is True


def _published(tmp_path, step=1):
    """A published checkpoint with a nested worker file and a trainer state."""
    tmp = tmp_path / f"global_step_{step}.tmp"
    (tmp / "actor").mkdir(parents=True)
    torch.save({"w": torch.arange(100.0)}, tmp / "actor" / "rank_0.pt")
    ckpt.save_trainer_state(tmp, {"global_steps": step, "dataloader": {}, "rng": {}})
    return ckpt.publish_checkpoint(str(tmp), tmp_path, step)


def _overwrite_64_bytes(path):
    data = bytearray(path.read_bytes())
    data[40:104] = os.urandom(64)
    path.write_bytes(bytes(data))


DAMAGE = {
    "64 random bytes in a worker file": ("actor/rank_0.pt", _overwrite_64_bytes, "different SHA-256"),
    "worker file replaced by 64 bytes": (
        "actor/rank_0.pt",
        lambda p: p.write_bytes(os.urandom(64)),
        "has 64 bytes but",
    ),
    "truncated trainer state": (
        "trainer_state.pt",
        lambda p: p.write_bytes(p.read_bytes()[:100]),
        "has 100 bytes but",
    ),
    "empty trainer state": ("trainer_state.pt", lambda p: p.write_bytes(b""), "has 0 bytes but"),
    "deleted worker file": ("actor/rank_0.pt", lambda p: p.unlink(), "listed in its manifest but missing"),
    "garbled manifest": (MANIFEST_FILE, lambda p: p.write_text("{not json"), "manifest .* is unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    rel, spoil, message = DAMAGE[damage]
    path = _published(tmp_path)
    spoil(tmp_path / "global_step_1" / rel)
    with pytest.raises(CheckpointCorruptError, match=message) as info:
        ckpt.open_checkpoint(path)
    assert info.value.file == os.path.join(path, *rel.split("/"))
    assert info.value.checkpoint == path
    assert info.value.file in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04truncated", os.urandom(64)])
def test_unreadable_trainer_state_names_the_path_without_a_manifest(tmp_path, caplog, content):
    path = _published(tmp_path)
    os.remove(os.path.join(path, MANIFEST_FILE))  # a checkpoint from before manifests
    state_file = os.path.join(path, "trainer_state.pt")
    with open(state_file, "wb") as f:
        f.write(content)
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointCorruptError) as info:
        ckpt.open_checkpoint(path)
    assert f"cannot read the trainer state {state_file} ({len(content)} bytes)" in str(info.value)
    assert info.value.file == state_file
    assert f"checkpoint {path} has no {MANIFEST_FILE}" in caplog.text


def test_missing_manifest_is_a_warning_and_the_state_still_loads(tmp_path, caplog):
    path = _published(tmp_path, step=4)
    os.remove(os.path.join(path, MANIFEST_FILE))
    with caplog.at_level(logging.WARNING):
        assert ckpt.open_checkpoint(path)["global_steps"] == 4
    assert "cannot be verified" in caplog.text


def test_state_of_another_step_or_without_keys_is_refused(tmp_path):
    path = _published(tmp_path, step=2)
    state_file = os.path.join(path, "trainer_state.pt")
    torch.save({"global_steps": 5, "dataloader": {}, "rng": {}}, state_file)
    write_manifest(path)
    with pytest.raises(CheckpointCorruptError, match=f"{state_file} holds the state of step 5, not 2"):
        ckpt.open_checkpoint(path)
    torch.save({"global_steps": 2}, state_file)
    write_manifest(path)
    with pytest.raises(CheckpointCorruptError, match=r"lacks the key\(s\) \['dataloader', 'rng'\]"):
        ckpt.open_checkpoint(path)


def test_unlisted_files_are_reported_but_do_not_fail(tmp_path, caplog):
    path = _published(tmp_path)
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("added later")
    with caplog.at_level(logging.WARNING):
        assert verify_manifest(path) is True
    assert "['notes.txt']" in caplog.text


# ----- the trainer -----------------------------------------------------------------------------------------


def _train_three_steps(tmp_path, **trainer):
    cfg = make_config(tmp_path, trainer={"total_epochs": 1, **trainer})
    run(ToyTrainer, cfg)
    return cfg


def test_trainer_checkpoints_carry_a_manifest_of_every_worker_file(tmp_path):
    _train_three_steps(tmp_path, test_freq=0)
    folder = tmp_path / "global_step_3"
    listed = set(write_manifest(folder)["files"])  # rewriting yields the same listing
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    assert listed == on_disk == {"actor/rank0.pt", "critic/rank0.pt", "trainer_state.pt"}


def test_resume_from_a_path_with_a_spoilt_worker_file_fails_before_loading(tmp_path, monkeypatch):
    cfg = _train_three_steps(tmp_path)
    worker_file = tmp_path / "global_step_2" / "actor" / "rank0.pt"
    _overwrite_64_bytes(worker_file)
    loads = []
    monkeypatch.setattr(ToyActor, "load_checkpoint", register()(lambda self, path: loads.append(path)))
    resumed = make_config(
        tmp_path,
        trainer={
            "total_epochs": 1,
            "resume_mode": "path",
            "resume_from_path": str(tmp_path / "global_step_2"),
        },
    )
    with pytest.raises(CheckpointCorruptError, match=str(worker_file)):
        run(ToyTrainer, resumed)
    assert loads == []  # refused before any worker loaded anything
    assert cfg.trainer.resume_mode == "auto"


def test_auto_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog, reference):
    cfg = make_config(tmp_path)
    with pytest.raises(RewardFunctionError):
        run(ToyTrainer, cfg, reward_fn=crash_at(4))  # checkpoints 1, 2, 3
    state3 = tmp_path / "global_step_3" / "trainer_state.pt"
    state3.write_bytes(state3.read_bytes()[:50])
    with caplog.at_level(logging.WARNING):
        trainer = run(ToyTrainer, cfg)
    assert trainer.global_steps == 6
    warning = next(r.getMessage() for r in caplog.records if "newest intact" in r.getMessage())
    assert f"resuming from {tmp_path / 'global_step_2'}" in warning
    assert f"{state3} has 50 bytes" in warning
    # resumed from step 2, the run redid step 3 and matches the uninterrupted run from there
    got = deterministic(read_metrics_jsonl(tmp_path))
    for step in range(3, 7):
        for key, value in reference[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)


def test_latest_file_naming_a_missing_or_damaged_folder_falls_back_with_a_warning(tmp_path, caplog):
    for step in (1, 2, 3):
        _published(tmp_path, step)
    _overwrite_64_bytes(tmp_path / "global_step_2" / "actor" / "rank_0.pt")
    (tmp_path / ckpt.LATEST_FILE).write_text("5")  # e.g. the folder was deleted by hand
    with caplog.at_level(logging.WARNING):
        path, state = ckpt.find_intact_checkpoint(tmp_path)
    assert path.endswith("global_step_3") and state["global_steps"] == 3
    assert f"{tmp_path / 'global_step_5'} is named by {ckpt.LATEST_FILE} but does not exist" in caplog.text
    (tmp_path / ckpt.LATEST_FILE).write_text("2")  # folder 3 is above the latest step: a rewound run's
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        path, _ = ckpt.find_intact_checkpoint(tmp_path)
    assert path.endswith("global_step_1")
    assert "global_step_2/actor/rank_0.pt has a different SHA-256" in caplog.text
    assert ckpt.find_intact_checkpoint(tmp_path / "nothing") is None


def test_auto_resume_with_every_checkpoint_damaged_lists_them_all(tmp_path):
    cfg = _train_three_steps(tmp_path, max_ckpt_to_keep=2)
    for step in (2, 3):
        (tmp_path / f"global_step_{step}" / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(CheckpointCorruptError, match="no intact checkpoint") as info:
        run(ToyTrainer, cfg)
    for step in (2, 3):
        assert str(tmp_path / f"global_step_{step}" / "trainer_state.pt") in str(info.value)


# ----- rotation and leftovers --------------------------------------------------------------------------------


def test_max_ckpt_to_keep_keeps_the_newest(tmp_path):
    _train_three_steps(tmp_path, max_ckpt_to_keep=2)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    _train_three_steps(tmp_path / "all")
    assert len(list((tmp_path / "all").glob("global_step_*"))) == 3


@given(st.sets(st.integers(0, 12), max_size=8), st.integers(0, 12), st.one_of(st.none(), st.integers(1, 5)))
def test_prune_keeps_the_newest_up_to_the_published_step(tmp_path_factory, steps, newest, keep):
    root = tmp_path_factory.mktemp("prune")
    for s in steps | {newest}:
        (root / f"global_step_{s}").mkdir()
    ckpt.prune_checkpoints(root, keep, newest)
    left = {int(p.name.split("_")[-1]) for p in root.iterdir()}
    older = sorted(s for s in steps if s < newest)
    kept_older = older if keep is None else older[len(older) - min(len(older), keep - 1) :]
    assert left == {newest} | {s for s in steps if s > newest} | set(kept_older)


def test_stale_leftovers_are_cleared_by_the_next_save(tmp_path):
    (tmp_path / "global_step_7.tmp" / "actor").mkdir(parents=True)
    (tmp_path / "global_step_7.tmp" / "actor" / "rank0.pt").write_bytes(b"half")
    (tmp_path / (ckpt.LATEST_FILE + ".tmp")).write_text("7")
    (tmp_path / "global_step_x.tmp").mkdir()  # not ours: left alone
    _train_three_steps(tmp_path, save_freq=3)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("global", "latest"))) == [
        "global_step_3",
        "global_step_x.tmp",
        ckpt.LATEST_FILE,
    ]


# ----- a save killed at any point ------------------------------------------------------------------------------


class _Killed(BaseException):
    """Stands for the process dying: not an Exception, so nothing on the way catches it."""


def _die(*args, **kwargs):
    raise _Killed


def _kill_on_call(n):
    """An ``os.replace`` that dies on its n-th call."""
    calls = []

    def replace(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise _Killed
        return os.replace(*args, **kwargs)

    return types.SimpleNamespace(**{**vars(os), "replace": replace})


KILL_POINTS = ["workers", "trainer_state", "manifest", "rename", "latest", "swap_old"]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_save_killed_anywhere_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, caplog, reference, point
):
    cfg = make_config(tmp_path)
    with pytest.raises(RewardFunctionError):
        run(ToyTrainer, cfg, reward_fn=crash_at(3))  # checkpoints 1 and 2
    if point == "swap_old":  # re-publishing an existing step dies between its two renames
        other = _published(tmp_path / "other", step=2)
        monkeypatch.setattr(ckpt, "os", _kill_on_call(2))
        with pytest.raises(_Killed):
            ckpt.publish_checkpoint(other, tmp_path, 2)
        assert not (tmp_path / "global_step_2").exists() and (tmp_path / "global_step_2.old").exists()
    else:
        if point == "workers":
            monkeypatch.setattr(ToyActor, "save_checkpoint", register()(_die))
        elif point == "trainer_state":
            monkeypatch.setattr(ckpt, "save_trainer_state", _die)
        elif point == "manifest":
            monkeypatch.setattr(ckpt, "write_manifest", _die)
        else:  # os.replace calls of a new step's publish: 1 = the folder, 2 = the latest file
            monkeypatch.setattr(ckpt, "os", _kill_on_call(1 if point == "rename" else 2))
        with pytest.raises(_Killed):
            run(ToyTrainer, cfg)  # resumes from 2, dies while saving 3
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="ppo_core.trainer.base"):
        trainer = run(ToyTrainer, cfg)
    assert f"resumed from {tmp_path / 'global_step_2'} (step 2)" in caplog.text
    assert trainer.global_steps == 6
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".tmp", ".old"))]
    got = deterministic(read_metrics_jsonl(tmp_path))
    for step in range(3, 7):
        for key, value in reference[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9, nan_ok=True), (step, key)
