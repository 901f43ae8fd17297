"""Checkpoints hash themselves: the manifest every strategy's checkpoint gets (a ddp file's
sidecar, a DCP directory's and a DeepSpeed directory's SHA256SUMS, saved in the foreground and
in the background), ``sha256sum -c`` agreeing with it, one flipped byte in any file named, and
the verification shared by the ranks of a group."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.runner.toy import ToyModel, flip_byte
from tests.runs import shared_run
from trainrun.checkpoint import manifest
from trainrun.checkpoint.files import save_state_file, sha256_of, written_sha256
from trainrun.checkpoint.manager import CheckpointManager
from trainrun.checkpoint.manifest import (
    DamagedCheckpoint,
    manifest_of,
    read_manifest,
    sidecar,
    verify_checkpoint,
)
from trainrun.checkpoint.read import check_checkpoint_file
from trainrun.dist import get_rank
from trainrun.wrappers import STRATEGIES

# (strategy, its options, saved in the background); the files each must list at least
SAVES = {
    "ddp": ("ddp", {}, False),
    "ddp_async": ("ddp", {}, True),
    "fsdp": ("fsdp", {}, False),
    "fsdp_async": ("fsdp", {}, True),
    "zero3": ("deepspeed", {"zero_stage": 3}, False),
}
DCP_FILES = {".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"}
EXPECTED = {
    "ddp": {"iter_2.pth"}, "ddp_async": {"iter_2.pth"}, "fsdp": DCP_FILES,
    "fsdp_async": DCP_FILES,
    "zero3": {"train_state.pt", *(f"state/zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
                                  for rank in (0, 1) for kind in ("model", "optim"))},
}


def _save_body(root: str) -> int:
    for kind, (name, options, background) in SAVES.items():
        strategy = STRATEGIES[name](**options)
        strategy.configure(4, {"type": "Adam", "lr": 0.1}, "fp32")
        model, optimizer = strategy.setup(ToyModel(), torch.device("cpu"),
                                          lambda m: torch.optim.Adam(m.parameters(), lr=0.1))
        manager = CheckpointManager(Path(root) / kind, strategy)
        manager.save("iter_2", model, optimizer, {"meta": {"iter": 2}}, background=background)
        manager.finish()
        strategy.teardown()
    return get_rank()


@shared_run
def saved(run_on, tmp_path_factory) -> dict[str, Path]:
    """One checkpoint of each kind in ``SAVES``, saved by 2 ranks (once a session: the tests
    asking for it share an xdist worker)."""
    root = tmp_path_factory.mktemp("hashed")
    assert run_on(2)(_save_body, str(root)) == [0, 1]
    return {kind: root / kind / "iter_2.pth" for kind in SAVES}


def _files(checkpoint: Path) -> set[str]:
    """What a manifest must list: the checkpoint's files, as named in it."""
    if checkpoint.is_file():
        return {checkpoint.name}
    return {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*")
            if p.is_file() and p != manifest_of(checkpoint)}


def _copy(checkpoint: Path, to: Path) -> Path:
    """A copy of ``checkpoint`` (with its sidecar) in the new directory ``to``."""
    to.mkdir(parents=True)
    if checkpoint.is_dir():
        shutil.copytree(checkpoint, to / checkpoint.name)
    else:
        shutil.copy(checkpoint, to)
        shutil.copy(sidecar(checkpoint), to)
    return to / checkpoint.name


def _listed(checkpoint: Path, name: str) -> Path:
    return checkpoint / name if checkpoint.is_dir() else checkpoint.with_name(name)


def test_a_hash_taken_while_a_file_was_made_durable_is_used_only_while_it_is_unchanged(
        tmp_path):
    path = tmp_path / "state.pt"
    save_state_file(path, {"w": torch.zeros(1000)})  # hashed while it was fsynced
    assert written_sha256(path) == sha256_of(path)
    save_state_file(path, {"w": torch.zeros(1000)})
    with open(path, "ab") as f:  # changed after that hash was taken
        f.write(b"x")
    assert written_sha256(path) == sha256_of(path)


@pytest.mark.slow
def test_every_checkpoint_lists_all_its_files_and_sha256sum_agrees(saved):
    for kind, checkpoint in saved.items():
        listed = read_manifest(checkpoint)
        assert set(listed) == _files(checkpoint) and EXPECTED[kind] <= set(listed), kind
        by_hand = manifest_of(checkpoint)
        done = subprocess.run(["sha256sum", "-c", by_hand.name], cwd=by_hand.parent,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.count(": OK\n") == len(listed), kind
        assert verify_checkpoint(checkpoint, alone=True) is True


@pytest.mark.slow
def test_one_flipped_byte_in_any_file_is_named(saved, tmp_path):
    """Every listed file and the manifest itself, one at a time: verification names the file,
    and the command line's cheap look either passes or names the same file."""
    for kind, checkpoint in saved.items():
        names = [*read_manifest(checkpoint), manifest_of(checkpoint).name]
        for i, name in enumerate(names):
            copy = _copy(checkpoint, tmp_path / f"{kind}-{i}")
            flip_byte(_listed(copy, name))
            with pytest.raises(DamagedCheckpoint) as caught:
                verify_checkpoint(copy, alone=True)
            assert caught.value.file == name, (kind, name, str(caught.value))
            assert str(caught.value).startswith(f"{copy} is damaged: {name}: ")
            expected = "the manifest itself" if name == names[-1] else "sha256 mismatch"
            assert caught.value.why.startswith(expected), caught.value.why
            try:
                check_checkpoint_file(copy)
            except DamagedCheckpoint as error:
                assert error.file == name


@pytest.mark.slow
def test_a_missing_file_is_named_and_no_manifest_is_unverified(saved, tmp_path):
    copy = _copy(saved["zero3"], tmp_path / "zero3")
    (copy / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(DamagedCheckpoint, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: "
                                                "missing$"):
        verify_checkpoint(copy, alone=True)
    manifest_of(copy).unlink()  # as written before checkpoints were hashed
    assert verify_checkpoint(copy, alone=True) is False


def _verify_body(intact: str, damaged: str) -> tuple[bool, list[str], str]:
    hashed: list[str] = []
    real = manifest.sha256_of
    manifest.sha256_of = lambda file: (hashed.append(file.name), real(file))[1]
    try:
        verified = verify_checkpoint(intact)
        share = list(hashed)
        try:
            verify_checkpoint(damaged)
            refused = ""
        except DamagedCheckpoint as error:
            refused = str(error)
    finally:
        manifest.sha256_of = real
    return verified, share, refused


@pytest.mark.slow
def test_the_ranks_of_a_group_share_the_hashing_and_the_verdict(saved, run_on, tmp_path):
    intact = saved["fsdp"]
    damaged = _copy(intact, tmp_path / "damaged")
    flip_byte(damaged / "__1_0.distcp")
    results = run_on(2)(_verify_body, str(intact), str(damaged))
    shares = [share for _, share, _ in results]
    assert all(verified for verified, _, _ in results)
    assert all(shares) and sorted(shares[0] + shares[1]) == sorted(Path(name).name for name in
                                                                    read_manifest(intact))
    refused = {message for _, _, message in results}
    assert refused == {f"{damaged} is damaged: __1_0.distcp: sha256 mismatch (against "
                       "SHA256SUMS)"}
