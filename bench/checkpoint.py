"""Checkpoint save and load times under ddp, fsdp and DeepSpeed ZeRO-3, against plain torch.

    python bench/checkpoint.py [--ranks 2] [--gb 1.0] [--repeats 5] [--dir work_dirs/bench_ckpt]

The state is a model of square ``Linear(2048, 2048)`` layers with its AdamW state after one
step, about ``--gb`` GB in fp32 in all (a third parameters, two thirds optimiser moments).
``--ranks`` gloo processes (one thread each) hold it under each strategy and save it with
trainrun's `CheckpointManager` (temporary name, fsync, rename, ``last``), then load it back
with the strategy's ``load_checkpoint``:

- ``floor``: one process ``torch.save`` of the same whole state (model and optimizer
  ``state_dict``) to a file in the same directory, flushed and fsynced, and ``torch.load``;
- ``ddp``: one file written by rank 0; every rank reads it;
- ``fsdp``: a directory of every rank's shards (``torch.distributed.checkpoint``);
- ``zero3``: DeepSpeed's own checkpoint directory (every rank its partition).

A time is the slowest rank's, from a barrier before to a barrier after; the median of
``--repeats`` after one round that is not kept (it warms up the allocator). Before each load
the checkpoint's pages are dropped from the page cache (``posix_fadvise(DONTNEED)``), so
loads read the disk (or whatever caches the disk below this machine).

Content hashes: every save hashes what each rank wrote (SHA-256, from the page cache, while
the file is fsynced where trainrun does the fsync) for the checkpoint's manifest. Each round
also saves the same state as saves were before checkpoints were hashed (plain fsyncs, no
manifest entries), alternating which goes first; ``verify`` is the check against the
manifest, shared by the ranks, from a cold page cache, that resuming does before loading.

``checkpoint.async``: how long training is stalled by a periodic save, the time from the call
to its return, synchronously and with ``background=True`` (what ``checkpoint.async: true``
does: ddp copies the state in memory and writes it from a thread; fsdp uses DCP's
``async_save``); and when the background write is published. DeepSpeed has no async save.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gloo_ranks import Layers, run_on_ranks

from trainrun.checkpoint import files
from trainrun.checkpoint.manager import CheckpointManager
from trainrun.checkpoint.manifest import verify_checkpoint
from trainrun.dist import barrier, get_rank, is_main_process
from trainrun.wrappers import STRATEGIES, deepspeed

WIDTH = 2048
STRATEGY_OPTIONS = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {"sharding": "full", "wrap": {"classes": ["Linear"]}}),
    "zero3": ("deepspeed", {"zero_stage": 3}),
}


class Unhashed(CheckpointManager):
    """The same saves with the hashing left out: the manifest lists no file (use it inside
    `plain_fsyncs`)."""

    def _hash_own_files(self, tmp: Path, final: Path) -> dict[str, str]:
        return {}


def _fsync(f: Any, path: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


@contextlib.contextmanager
def plain_fsyncs() -> Any:
    """Files made durable as before checkpoints were hashed: fsync without hashing."""
    hashing = files.fsync_and_hash
    files.fsync_and_hash = deepspeed.fsync_and_hash = _fsync
    try:
        yield
    finally:
        files.fsync_and_hash = deepspeed.fsync_and_hash = hashing


def _layers(gb: float) -> int:
    per_layer = (WIDTH * WIDTH + WIDTH) * 4 * 3  # fp32 parameters + two AdamW moments
    return max(1, round(gb * 1e9 / per_layer))


def _timed(action: Any, *args: Any) -> tuple[float, Any]:
    """Seconds from a barrier before ``action(*args)`` to a barrier after; and its result."""
    barrier()
    start = time.perf_counter()
    result = action(*args)
    barrier()
    return time.perf_counter() - start, result


def _built(kind: str, layers: int) -> tuple[Any, Any, Any]:
    """Strategy, wrapped model and optimiser after one AdamW step (so its state exists)."""
    name, options = STRATEGY_OPTIONS[kind]
    torch.manual_seed(0)
    strategy = STRATEGIES[name](**options)
    strategy.configure(batch_size=2, optim={"type": "AdamW", "lr": 1e-4}, precision="fp32")
    model, optimizer = strategy.setup(Layers(layers, WIDTH), torch.device("cpu"),
                                      lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))
    optim_wrapper = strategy.optim_wrapper(model, optimizer)
    loss = model(torch.randn(2, WIDTH))["loss"]
    if optim_wrapper is not None:  # DeepSpeed steps through its engine
        optim_wrapper.update_params(loss)
    else:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return strategy, model, optimizer


def _floor(directory: Path, model: Any, optimizer: Any, repeats: int) -> dict[str, list[float]]:
    """torch.save / torch.load of the whole state in this one process."""
    path = directory / "floor.pt"
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    out: dict[str, list[float]] = {"save": [], "load": []}
    for i in range(repeats + 1):  # the first round warms the allocator up and is not kept
        start = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            _fsync(f, path)
        saved = time.perf_counter() - start
        _evict(path)
        start = time.perf_counter()
        torch.load(path, map_location="cpu", weights_only=True)
        if i:
            out["save"].append(saved)
            out["load"].append(time.perf_counter() - start)
    out["bytes"] = [path.stat().st_size]
    path.unlink()
    return out


def _evict(path: Path) -> None:
    """Drop ``path``'s pages (a file, or every file below a directory) from the page cache,
    so that the load after it reads the disk (written and fsynced pages are clean)."""
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _async_times(manager: CheckpointManager, model: Any, optimizer: Any, repeats: int,
                 out: dict[str, list[float]], suffix: str = "") -> None:
    """Training's stall by a background save and by a synchronous one, and when the
    background one is published."""
    for i in range(repeats):
        start = time.perf_counter()  # a stall is this rank's own wait, no barrier
        manager.save(f"iter_{100 + i}", model, optimizer, {"meta": {"iter": i}}, background=True)
        out["stall_async" + suffix].append(time.perf_counter() - start)
        out["publish_async" + suffix].append(_timed(manager.finish)[0]
                                             + out["stall_async" + suffix][-1])
        start = time.perf_counter()
        manager.save(f"iter_{200 + i}", model, optimizer, {"meta": {"iter": i}})
        out["stall_sync" + suffix].append(time.perf_counter() - start)


def _strategy_times(kind: str, layers: int, directory: Path, repeats: int) -> dict[str, Any]:
    strategy, model, optimizer = _built(kind, layers)
    manager = CheckpointManager(directory / kind, strategy, max_keep=1)
    unhashed = Unhashed(directory / f"{kind}-unhashed", strategy, max_keep=1)
    out: dict[str, list[float]] = {key: [] for key in (
        "save", "save_unhashed", "verify", "load", "stall_sync", "stall_async",
        "publish_async", "stall_sync_unhashed", "stall_async_unhashed",
        "publish_async_unhashed")}
    for i in range(repeats + 1):  # the first round warms up and is not kept
        state = (model, optimizer, {"meta": {"iter": i}})
        if i % 2:  # which of the two goes first alternates
            with plain_fsyncs():
                plain = _timed(unhashed.save, f"iter_{i}", *state)[0]
        saved, path = _timed(manager.save, f"iter_{i}", *state)
        if not i % 2:
            with plain_fsyncs():
                plain = _timed(unhashed.save, f"iter_{i}", *state)[0]
        if is_main_process():
            _evict(path)
        verified = _timed(verify_checkpoint, path)[0]
        if is_main_process():
            _evict(path)
        loaded = _timed(strategy.load_checkpoint, str(path), model, optimizer)[0]
        if i:
            out["save"].append(saved)
            out["save_unhashed"].append(plain)
            out["verify"].append(verified)
            out["load"].append(loaded)
    out["bytes"] = [_bytes(path)] if is_main_process() else [0]
    if kind != "zero3":
        _async_times(manager, model, optimizer, repeats, out)
        with plain_fsyncs():
            _async_times(unhashed, model, optimizer, repeats, out, "_unhashed")
    strategy.teardown()
    return out


def _rank_body(layers: int, directory: str, repeats: int) -> dict[str, Any]:
    directory_path = Path(directory)
    results: dict[str, Any] = {}
    if is_main_process():
        torch.manual_seed(0)
        model = Layers(layers, WIDTH)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model(torch.randn(2, WIDTH))["loss"].backward()
        optimizer.step()
        results["floor"] = _floor(directory_path, model, optimizer, repeats)
        del model, optimizer
    barrier()
    for kind in STRATEGY_OPTIONS:
        print(f"[checkpoint] rank {get_rank()}: {kind}", file=sys.stderr, flush=True)
        results[kind] = _strategy_times(kind, layers, directory_path, repeats)
        if is_main_process():
            shutil.rmtree(directory_path / kind, ignore_errors=True)
            shutil.rmtree(directory_path / f"{kind}-unhashed", ignore_errors=True)
        barrier()
    return results


def _median_of_slowest(per_rank: list[dict[str, Any]], kind: str, key: str) -> float | None:
    runs = [r[kind][key] for r in per_rank if kind in r and r[kind][key]]
    if not runs:
        return None
    return statistics.median(max(values) for values in zip(*runs, strict=True))


def report(per_rank: list[dict[str, Any]], layers: int, ranks: int) -> str:
    floor_save = _median_of_slowest(per_rank, "floor", "save")
    floor_load = _median_of_slowest(per_rank, "floor", "load")
    gb = per_rank[0]["floor"]["bytes"][0] / 1e9
    lines = [f"{layers} x Linear({WIDTH}, {WIDTH}) + AdamW state: {gb:.2f} GB in one torch "
             f"file; {ranks} ranks; torch {torch.__version__}", "",
             "| strategy | on disk GB | save s | save / floor | load s | load / floor |",
             "|---|---:|---:|---:|---:|---:|",
             f"| floor (torch.save / torch.load) | {gb:.2f} | {floor_save:.2f} | 1.00 | "
             f"{floor_load:.2f} | 1.00 |"]
    for kind in STRATEGY_OPTIONS:
        save = _median_of_slowest(per_rank, kind, "save")
        load = _median_of_slowest(per_rank, kind, "load")
        on_disk = per_rank[0][kind]["bytes"][0] / 1e9
        lines.append(f"| {kind} | {on_disk:.2f} | {save:.2f} | {save / floor_save:.2f} | "
                     f"{load:.2f} | {load / floor_load:.2f} |")
    lines += ["", "| strategy | save s, hashed | save s, not hashed | GB/s hashed | GB/s not "
              "hashed | throughput hashed / not | hashing's share of a save | verify s |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in STRATEGY_OPTIONS:
        save = _median_of_slowest(per_rank, kind, "save")
        plain = _median_of_slowest(per_rank, kind, "save_unhashed")
        verify = _median_of_slowest(per_rank, kind, "verify")
        on_disk = per_rank[0][kind]["bytes"][0] / 1e9
        lines.append(f"| {kind} | {save:.2f} | {plain:.2f} | {on_disk / save:.2f} | "
                     f"{on_disk / plain:.2f} | {plain / save:.2f} | "
                     f"{max(save - plain, 0) / save:.0%} | {verify:.2f} |")
    lines += ["", "| strategy | stall, synchronous save s | stall, checkpoint.async s | "
              "async: published after s | the same three, not hashed |",
              "|---|---:|---:|---:|---|"]
    for kind in ("ddp", "fsdp"):
        times = [_median_of_slowest(per_rank, kind, key + suffix) for suffix in ("", "_unhashed")
                 for key in ("stall_sync", "stall_async", "publish_async")]
        lines.append(f"| {kind} | {times[0]:.2f} | {times[1]:.2f} | {times[2]:.2f} | "
                     f"{times[3]:.2f}, {times[4]:.2f}, {times[5]:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--gb", type=float, default=1.0, help="state size (default 1.0)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="work_dirs/bench_checkpoint",
                        help="where checkpoints are written (removed after)")
    args = parser.parse_args()
    directory = Path(args.dir).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    layers = _layers(args.gb)
    try:
        per_rank = run_on_ranks(args.ranks, _rank_body, layers, str(directory), args.repeats)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(report(per_rank, layers, args.ranks))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    sys.exit(main())
