"""Object collectives of trainrun.dist against MMEngine 0.10.7's, side by side in one job.

Run under ``torchrun --nproc_per_node 2`` (``bench/run_collectives.sh`` does). Each library
first makes one untimed call per operation (it warms allocators and connections, and its
result is the one rank 0 checks for equality); then both run for many rounds, the order
alternating every round. A call's time is the slowest rank's wall time. The table gives each
library's median, their ratio, and the median of the per-round ratios (each round pairs two
calls made moments apart, so a burst of load from elsewhere hits both). An operation meets
its target when both ratios reach it. Rank 1's peak memory during ``collect_results`` shows
who holds the whole result list. MMEngine is a bench-only dependency: it is imported here,
never by trainrun.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

import trainrun.dist as ours

BIG_BYTES = 4 * 1024 * 1024
# Operations of a few milliseconds run this many times more rounds: noise is a larger share of
# their time, and more rounds cost little.
SHORT_ROUNDS_FACTOR = 3


@dataclass
class Case:
    """One operation: a call per library, and how to compare their results."""

    name: str
    calls: dict[str, Callable[[], Any]]
    same: Callable[[Any, Any], bool]
    target: float  # MMEngine's time over trainrun's that the issue asks for
    short: bool = False  # a few milliseconds a call: more rounds
    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu_seconds: dict[str, list[float]] = field(default_factory=dict)
    rss_mb: dict[str, float] = field(default_factory=dict)


def make_results(size: int, rank: int, world_size: int) -> list[dict]:
    """This rank's share of ``size`` small results, dealt as a non-shuffling sampler deals."""
    return [
        {"idx": i, "score": i * 0.001, "label": i % 1000, "filename": f"images/{i:08d}.jpg"}
        for i in range(rank, size, world_size)
    ]


def make_big(rank: int) -> dict:
    """An object of about 4 MB, different on every rank (a prediction array and its name)."""
    array = np.full(BIG_BYTES // 4, rank, dtype=np.float32)
    return {"rank": rank, "name": f"predictions_{rank}", "scores": array}


def same_big(a: Any, b: Any) -> bool:
    """Equality for lists of `make_big` objects (numpy arrays do not compare with ==)."""
    if len(a) != len(b):
        return False
    return all(
        x["rank"] == y["rank"] and x["name"] == y["name"]
        and np.array_equal(x["scores"], y["scores"])
        for x, y in zip(a, b, strict=True)
    )


def broadcast_call(broadcast: Callable[..., None], obj: Any, rank: int) -> Callable[[], Any]:
    """A call that broadcasts ``obj`` from rank 0 into a fresh list and returns that list."""
    def call() -> list:
        data = [obj] if rank == 0 else [None]
        broadcast(data, src=0)
        return data
    return call


def build_cases(size: int, rank: int, world_size: int) -> list[Case]:
    """The operations to compare; all data is built here, outside any timed region."""
    import mmengine.dist as mm  # bench-only; works on the group trainrun initialised

    results = make_results(size, rank, world_size)
    big = make_big(rank)
    cases = [
        Case("collect_results, device='cpu'", {
            "mmengine": lambda: mm.collect_results(results, size, device="cpu"),
            "trainrun": lambda: ours.collect_results(results, size, device="cpu"),
        }, lambda a, b: a == b, target=3.0),
        Case("collect_results, device='gpu'", {
            "mmengine": lambda: mm.collect_results(results, size, device="gpu"),
            "trainrun": lambda: ours.collect_results(results, size, device="gpu"),
        }, lambda a, b: a == b, target=3.0),
        Case("all_gather_object, 4 MB", {
            "mmengine": lambda: mm.all_gather_object(big),
            "trainrun": lambda: ours.all_gather_object(big),
        }, same_big, target=1.0, short=True),
        Case("broadcast_object_list, 4 MB", {
            "mmengine": broadcast_call(mm.broadcast_object_list, big, rank),
            "trainrun": broadcast_call(ours.broadcast_object_list, big, rank),
        }, same_big, target=1.0, short=True),
        Case("gather_object, 4 MB", {
            "mmengine": lambda: mm.gather_object(big, dst=0),
            "trainrun": lambda: ours.gather_object(big, dst=0),
        }, lambda a, b: a is b is None or same_big(a, b), target=1.0, short=True),
    ]
    return cases


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) so the next reading covers one call only."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def timed(call: Callable[[], Any], measure_rss: bool) -> tuple[Any, float, float, float]:
    """Run ``call`` on every rank; return its result, the slowest rank's wall seconds, the CPU
    seconds of all ranks together (every thread, gloo's included: the work done, which other
    jobs on the machine change far less than the wall time), and this rank's peak RSS increase
    in MB during the call (NaN when not measured)."""
    gc.collect()
    rss_before = _status_kb("VmRSS")
    measure_rss = measure_rss and reset_peak_rss()
    torch_dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    out = call()
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    cpu = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
    rss_mb = (_status_kb("VmHWM") - rss_before) / 1024 if measure_rss else float("nan")
    torch_dist.all_reduce(wall, op=torch_dist.ReduceOp.MAX)
    torch_dist.all_reduce(cpu)
    return out, float(wall.item()), float(cpu.item()), rss_mb


def run_case(case: Case, rounds: int, rank: int) -> None:
    """One untimed call per library (its results checked on every rank), then ``rounds``
    timed rounds of both, alternating which goes first."""
    names = list(case.calls)
    check(case, {name: case.calls[name]() for name in names}, rank)
    measure = case.name.startswith("collect_results") and rank == 1
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            out, seconds, cpu_seconds, rss_mb = timed(case.calls[name], measure)
            del out
            case.seconds.setdefault(name, []).append(seconds)
            case.cpu_seconds.setdefault(name, []).append(cpu_seconds)
            if measure:
                case.rss_mb[name] = max(case.rss_mb.get(name, 0.0), rss_mb)


def check(case: Case, outputs: dict[str, Any], rank: int) -> None:
    """Both libraries must give the same result; `collect_results` gives None off rank 0."""
    theirs, mine = outputs["mmengine"], outputs["trainrun"]
    if case.name.startswith("collect_results") and rank != 0:
        assert mine is None, f"{case.name}: rank {rank} got {type(mine).__name__}, not None"
        return
    assert case.same(theirs, mine), f"{case.name}: trainrun and MMEngine disagree on rank {rank}"


def rss_of_rank1(cases: list[Case], rank: int) -> dict[str, dict[str, float]]:
    """Rank 1's peak RSS increases, sent to rank 0 for the report."""
    table = [{c.name: c.rss_mb for c in cases if c.rss_mb}] if rank == 1 else [None]
    torch_dist.broadcast_object_list(table, src=1)
    return table[0]


@dataclass
class Summary:
    """One operation's figures: medians, their ratio, and the spread of per-round ratios."""

    mmengine_s: float
    trainrun_s: float
    ratio_of_medians: float
    paired: list[float]  # per round, MMEngine's time over trainrun's, sorted

    @classmethod
    def of(cls, case: Case) -> Summary:
        theirs, mine = case.seconds["mmengine"], case.seconds["trainrun"]
        paired = sorted(t / m for t, m in zip(theirs, mine, strict=True))
        return cls(statistics.median(theirs), statistics.median(mine),
                   statistics.median(theirs) / statistics.median(mine), paired)

    def quartile(self, which: int) -> float:
        """The paired ratios' first (1) or third (3) quartile."""
        return statistics.quantiles(self.paired, n=4)[which - 1]

    def meets(self, target: float) -> bool:
        return min(self.ratio_of_medians, statistics.median(self.paired)) >= target


def report(cases: list[Case], rss: dict[str, dict[str, float]], size: int, rounds: int,
           load: tuple[float, float], verbose: bool) -> None:
    """Print the Markdown table and rank 1's memory use."""
    if verbose:
        for case in cases:
            for name, seconds in case.seconds.items():
                print(f"{case.name:32} {name:9} ms", " ".join(f"{s * 1e3:.1f}" for s in seconds))
    print(f"\n{size:,} results on 2 ranks, gloo; after one untimed call each, {rounds} rounds "
          f"({rounds * SHORT_ROUNDS_FACTOR} for the 4 MB objects), order alternating; slowest "
          f"rank's wall time; load average {load[0]:.2f} before, {load[1]:.2f} after\n")
    print("| operation | MMEngine s | trainrun s | ratio of medians | median paired ratio "
          "(IQR) | trainrun faster | target | met |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for case in cases:
        row = Summary.of(case)
        faster = sum(r > 1 for r in row.paired) / len(row.paired)
        print(f"| {case.name} | {row.mmengine_s:.4f} | {row.trainrun_s:.4f} | "
              f"{row.ratio_of_medians:.2f}x | {statistics.median(row.paired):.2f}x "
              f"({row.quartile(1):.2f}-{row.quartile(3):.2f}) | {faster:.0%} | "
              f">= {case.target:g}x | {'yes' if row.meets(case.target) else 'NO'} |")
    print("\nCPU time of both ranks per call, every thread (median ms):\n")
    print("| operation | MMEngine | trainrun | MMEngine/trainrun |")
    print("|---|---:|---:|---:|")
    for case in cases:
        theirs, mine = (statistics.median(case.cpu_seconds[n]) for n in ("mmengine", "trainrun"))
        print(f"| {case.name} | {theirs * 1e3:.1f} | {mine * 1e3:.1f} | {theirs / mine:.2f}x |")
    if rss:
        print("\nRank 1 peak RSS increase during collect_results (MB):\n")
        print("| operation | MMEngine | trainrun |")
        print("|---|---:|---:|")
        for name, by_lib in rss.items():
            print(f"| {name} | {by_lib['mmengine']:.0f} | {by_lib['trainrun']:.0f} |")


def shared_workdir(rank: int) -> str:
    """A fresh directory every rank moves into: MMEngine's cpu mode leaves `.dist_test` there."""
    holder = [tempfile.mkdtemp(prefix="trainrun_bench_") if rank == 0 else None]
    torch_dist.broadcast_object_list(holder, src=0)
    os.chdir(holder[0])
    return holder[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=200_000, help="results in all (default 200000)")
    parser.add_argument("--rounds", type=int, default=21,
                        help=f"timed rounds of collect_results (default 21); the 4 MB objects "
                             f"get {SHORT_ROUNDS_FACTOR} times as many")
    parser.add_argument("--only", default="", help="run only operations whose name contains this")
    parser.add_argument("--verbose", action="store_true", help="print every round's wall time too")
    args = parser.parse_args()

    ours.init_dist("pytorch", "gloo")
    rank, world_size = ours.get_dist_info()
    workdir = shared_workdir(rank)
    try:
        cases = [c for c in build_cases(args.size, rank, world_size) if args.only in c.name]
        load_before = os.getloadavg()[0]
        for case in cases:
            run_case(case, args.rounds * (SHORT_ROUNDS_FACTOR if case.short else 1), rank)
        load = (load_before, os.getloadavg()[0])
        rss = rss_of_rank1(cases, rank)
        if rank == 0:
            report(cases, rss, args.size, args.rounds, load, args.verbose)
    finally:
        torch_dist.barrier()
        if rank == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
