"""The heartbeat at thousands of ranks, simulated on one machine: store latency, the store
host's CPU, and how long a frozen rank takes to be named.

    python bench/heartbeat_scale.py [--ranks 1024,2048,4096,8192] [--ranks-per-proc 256]
                                    [--dist-timeout 10] [--warmup 5] [--window 15]

For each number of ranks N, against one TCPStore (torch's, libuv backend, the kind torchrun
serves) in a process of its own:

- Client processes of ``--ranks-per-proc`` simulated ranks each run N - 1 ranks, and one more
  process runs the rank that will freeze. Every simulated rank is trainrun's own
  `trainrun.dist.heartbeat.Heartbeat` (its beat thread and its guard thread, as
  `watch_ranks` starts them in a real rank) given a TCPStore client of its own (with the
  heartbeat's `client_timeout`), its rank and the world size N: it writes its beat about once
  a second and watches the rank before it. Only the store client is wrapped, to time each
  call (`perf_counter` before and after).
- All ranks start at one agreed time (a process starts its ranks one after the other, each
  `start` writing a first beat); after ``--warmup`` seconds the calls of the next
  ``--window`` seconds are counted: store requests per second, and their latency as the ranks
  see it (p50, p99, max).
- A probe process with one thread and no ranks makes a beat's three calls (a set, a check and
  a get, timed) ten times a second in the same window: the store's latency without the
  simulated ranks' own scheduling (hundreds of threads sharing one interpreter lock per
  process, on the same cores as the store).
- CPU, from /proc over the window: the store's process (seconds of CPU per second: 1.0 is one
  core busy; torch's libuv store serves every request from one thread, so that is where it
  saturates), the client processes, and the whole machine. The store and the probe run at a
  higher priority (nice -10) than the simulated ranks: a real store's host does not share its
  cores with thousands of ranks.
- Then the frozen rank's process gets SIGSTOP (it stops dead, its connection stays open, as a
  hung host's does). ``named after``: seconds from the SIGSTOP until the stop naming it is
  posted to the store (polled every 20 ms) by the rank after it, as in a real job; ``named``:
  whether the stop named that rank and no other. ``all ended``: seconds until every other
  client process has ended itself (each simulated rank reads the posted stop and ends its
  process, as `Heartbeat` does in a real rank).

A size breaks down when a simulated rank, starved of CPU on this machine, stops its process
(its guard finds no answer for ``dist_timeout``) or is named silent before the window ends:
the table then shows what the probe and /proc saw until then, and larger sizes are not run.

The goal (issue 14): p99 below 50 ms at 4096 ranks, and the frozen rank named within
``dist_timeout`` + 5 s. Everything printed is measured in this run, except the line marked
``extrapolated``: the store's CPU at 16k ranks from a straight line through the sizes that
ran to the end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from trainrun.dist import heartbeat
from trainrun.dist.launch import free_port

HOST = "127.0.0.1"
PREFIX = "bench/heartbeat"
WAIT = datetime.timedelta(seconds=300)  # the control client's: startup of thousands of ranks


# ---------------------------------------------------------------- the simulated ranks' side

class TimedStore:
    """A store whose every call appends ``(end time, seconds taken)`` to ``samples``."""

    def __init__(self, store: torch_dist.Store, samples: list[tuple[float, float]]):
        self._store, self._samples = store, samples

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)
        if not callable(call):
            return call

        def timed(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args)
            finally:
                took = time.perf_counter() - start
                self._samples.append((time.time(), took))
        return timed


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()))


def _dump(path: Path, samples: list[tuple[float, float]], plan: dict,
          starts: list[float]) -> None:
    """Write the latencies of the calls that ended inside the window, and when the ranks
    started, for the coordinator."""
    window = [took for end, took in list(samples) if plan["t0"] <= end <= plan["t1"]]
    np.savez(path, latency=np.array(window), starts=np.array(starts))


def _clients(port: int, count: int, dist_timeout: float) -> list[torch_dist.TCPStore]:
    """``count`` store clients, each with the heartbeat's timeout (`client_timeout`), as
    `watch_ranks` gives its own to a rank. They connect from 64 threads at once: some connects
    here wait seconds on a reverse DNS lookup that torch makes to log the client's name."""
    def connect(_: int) -> torch_dist.TCPStore:
        client = torch_dist.TCPStore(HOST, port, is_master=False, timeout=WAIT)
        client.set_timeout(heartbeat.client_timeout(dist_timeout))
        return client
    with ThreadPoolExecutor(64) as pool:
        return list(pool.map(connect, range(count)))


def run_ranks(port: int, ranks: list[int], world_size: int, dist_timeout: float,
              out: Path) -> None:
    """Simulated ranks ``ranks`` of ``world_size``: each a `Heartbeat` with a store client of
    its own. Runs until the heartbeat ends this process (a posted stop), or it is killed."""
    threading.stack_size(512 * 1024)  # a thousand or more threads in this process
    heartbeat.at_step(1)
    heartbeat.set_phase("forward")
    control = torch_dist.TCPStore(HOST, port, is_master=False, timeout=WAIT)
    samples: list[tuple[float, float]] = []
    beats = [heartbeat.Heartbeat(TimedStore(client, samples), rank, world_size, dist_timeout,
                                 PREFIX)
             for rank, client in zip(ranks, _clients(port, len(ranks), dist_timeout),
                                     strict=True)]
    control.add("bench/ready", len(ranks))
    control.wait(["bench/go"])
    plan = json.loads(control.get("bench/go"))
    _sleep_until(plan["start"])
    starts = []
    for beat in beats:
        beat.start()
        starts.append(time.time())
    _sleep_until(plan["t1"] + 0.2)
    _dump(out, samples, plan, starts)
    control.add("bench/dumped", 1)
    threading.Event().wait()


def run_probe(port: int, out: Path) -> None:
    """One thread, no ranks: a rank's three calls of a beat (set, check, get) ten times a
    second through the window, timed."""
    _ahead()
    store = torch_dist.TCPStore(HOST, port, is_master=False, timeout=WAIT)
    samples: list[tuple[float, float]] = []
    timed = TimedStore(store, samples)
    store.wait(["bench/go"])
    plan = json.loads(store.get("bench/go"))
    _sleep_until(plan["t0"])
    while time.time() < plan["t1"]:
        timed.set("bench/probe", "x" * 40)
        timed.check(["bench/stop"])
        timed.get("bench/probe")
        time.sleep(0.1)
    _dump(out, samples, plan, [])
    store.add("bench/probed", 1)


def _ahead() -> None:
    """Give this process a higher CPU priority than the simulated ranks' (nice -10), where
    that is allowed."""
    try:
        os.nice(-10)
    except PermissionError:
        print("could not raise this process's priority: its latency includes waiting for the "
              "CPU behind the simulated ranks", file=sys.stderr)


def serve_store(port: int) -> None:
    """The job's store, alone in this process (as torchrun's agent hosts it), ahead of the
    simulated ranks for the CPU: a real store's host does not share its cores with thousands
    of ranks."""
    _ahead()
    store = torch_dist.TCPStore(HOST, port, is_master=True, wait_for_workers=False,
                                timeout=WAIT, use_libuv=True)
    threading.Event().wait()  # (the server lives as long as ``store``)
    del store


# ---------------------------------------------------------------- the coordinator

def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"), sum(ticks) / os.sysconf("SC_CLK_TCK")


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as stderr:
        return subprocess.Popen([sys.executable, __file__, *map(str, args)],
                                stdout=stderr, stderr=stderr)


def _blocks(n: int, per_process: int, frozen: int) -> list[list[int]]:
    """The ranks of each client process: runs of ``per_process`` of 0..n-1 without
    ``frozen``, which gets a process of its own (last in the list)."""
    others = [r for r in range(n) if r != frozen]
    size = min(per_process, len(others))
    return [others[i:i + size] for i in range(0, len(others), size)] + [[frozen]]


def _wait_count(store: torch_dist.Store, key: str, count: int, procs: list[subprocess.Popen],
                logs: list[Path], timeout: float) -> None:
    deadline = time.time() + timeout
    while store.add(key, 0) < count:
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                tail = log.read_text()[-2000:]
                raise SystemExit(f"a client process ended (exit {proc.returncode}):\n{tail}")
        if time.time() > deadline:
            raise SystemExit(f"timed out waiting for {key} to reach {count}")
        time.sleep(0.1)


def _ended(clients: list[subprocess.Popen], logs: list[Path],
           control: torch_dist.Store) -> str | None:
    """Why the run broke down before its time, if it did: a posted stop (a rank found
    silent), or a client process that ended (its last line)."""
    if control.check([f"{PREFIX}/stop"]):
        return "stop posted: " + json.loads(control.get(f"{PREFIX}/stop"))["message"][:300]
    for proc, log in zip(clients, logs, strict=True):
        if proc.poll() is not None:
            lines = [line for line in log.read_text().splitlines() if "ERROR" in line]
            return f"a client process ended: {(lines or ['(no message)'])[-1][:300]}"
    return None


def _watch_until(when: float, clients: list[subprocess.Popen], logs: list[Path],
                 control: torch_dist.Store) -> str | None:
    while time.time() < when:
        broke = _ended(clients, logs, control)
        if broke:
            return broke
        time.sleep(0.2)
    return None


def _cpu_now(procs: list[subprocess.Popen]) -> tuple[list[float], tuple[float, float], float]:
    seconds = []
    for proc in procs:
        try:
            seconds.append(_cpu_seconds(proc.pid))
        except (OSError, IndexError):  # gone
            seconds.append(float("nan"))
    return seconds, _machine_busy(), time.time()


def measure(n: int, per_process: int, dist_timeout: float, warmup: float, window: float,
            tmp: Path) -> dict:
    """One point: N ranks, steady state, then a frozen rank."""
    port = free_port()
    store_proc = _spawn(["--serve-store", port], tmp / f"store-{n}.log")
    control = torch_dist.TCPStore(HOST, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=60))
    frozen = n // 2
    blocks = _blocks(n, per_process, frozen)
    logs = [tmp / f"client-{n}-{i}.log" for i in range(len(blocks))]
    outs = [tmp / f"client-{n}-{i}.npz" for i in range(len(blocks))]
    clients = [_spawn(["--client", port, json.dumps(block), n, dist_timeout, out], log)
               for block, log, out in zip(blocks, logs, outs, strict=True)]
    probe_out = tmp / f"probe-{n}.npz"
    probe = _spawn(["--probe", port, probe_out], tmp / f"probe-{n}.log")
    try:
        began = time.time()
        _wait_count(control, "bench/ready", n, clients, logs, timeout=300)
        print(f"{n} ranks: connected in {time.time() - began:.0f} s", file=sys.stderr,
              flush=True)
        start = time.time() + 1.0
        plan = {"start": start, "t0": start + warmup, "t1": start + warmup + window}
        control.set("bench/go", json.dumps(plan))
        broke = _watch_until(plan["t0"], clients, logs, control)
        cpu0 = _cpu_now([store_proc, *clients])
        broke = broke or _watch_until(plan["t1"], clients, logs, control)
        cpu1 = _cpu_now([store_proc, *clients])
        if not broke:
            try:
                _wait_count(control, "bench/dumped", len(clients), clients, logs, timeout=120)
            except SystemExit:  # a client process ended before it wrote its figures
                broke = _ended(clients, logs, control) or "the clients' figures never came"
        _wait_count(control, "bench/probed", 1, [], [], timeout=60)
        if broke:  # what the probe and /proc saw until then; no frozen rank
            point = _summarise(n, [], probe_out, cpu0, cpu1, plan)
            point.update(procs=len(clients), broke=broke, named="-")
            return point
        point = _summarise(n, outs, probe_out, cpu0, cpu1, plan)
        point.update(procs=len(clients))
        point.update(_freeze(control, clients, frozen, dist_timeout))
        return point
    finally:
        for proc in (*clients, probe, store_proc):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _summarise(n: int, outs: list[Path], probe_out: Path, cpu0: tuple, cpu1: tuple,
               plan: dict) -> dict:
    parts = [np.load(out) for out in outs]
    latency = np.concatenate([[], *(p["latency"] for p in parts)]) * 1e3
    starts = np.concatenate([[], *(p["starts"] for p in parts)])
    probe = np.load(probe_out)["latency"] * 1e3
    elapsed = cpu1[2] - cpu0[2]
    used = [b - a for a, b in zip(cpu0[0], cpu1[0], strict=True)]
    busy = (cpu1[1][0] - cpu0[1][0]) / (cpu1[1][1] - cpu0[1][1]) * os.cpu_count()

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q)) if len(values) else float("nan")
    return {
        "ranks": n, "requests_per_s": len(latency) / elapsed,
        "p50": pct(latency, 50), "p99": pct(latency, 99), "max": pct(latency, 100),
        "probe_p50": pct(probe, 50), "probe_p99": pct(probe, 99),
        "store_cpu": used[0] / elapsed, "clients_cpu": float(np.nansum(used[1:])) / elapsed,
        "machine_busy": busy,
        "start_spread": float(starts.max() - starts.min()) if len(starts) else float("nan"),
        "started_late": float(starts.max() - plan["t0"]) if len(starts) else float("nan"),
        "named_after": float("nan"), "all_ended": float("nan"),
    }


def _freeze(control: torch_dist.Store, clients: list[subprocess.Popen], frozen: int,
            dist_timeout: float) -> dict:
    """SIGSTOP the frozen rank's process; time until the stop naming it is posted, and until
    every other client process has ended itself."""
    victim, others = clients[-1], clients[:-1]
    stop_key = f"{PREFIX}/stop"
    os.kill(victim.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    deadline = stopped + dist_timeout + 60
    while not control.check([stop_key]) and time.monotonic() < deadline:
        time.sleep(0.02)
    named_after = time.monotonic() - stopped
    if not control.check([stop_key]):
        return {"named_after": float("nan"), "named": "never", "all_ended": float("nan"),
                "message": ""}
    posted = json.loads(control.get(stop_key))
    while any(p.poll() is None for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = [p.poll() is not None for p in others]
    return {"named_after": named_after,
            "named": "yes" if posted["ranks"] == [frozen] else f"{posted['ranks']}",
            "all_ended": time.monotonic() - stopped if all(ended) else float("nan"),
            "message": posted["message"]}


def _uptime() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def _print_table(points: list[dict]) -> None:
    print(f"\n| ranks | client procs | store req/s | p50 ms | p99 ms | max ms "
          f"| probe p50/p99 ms | store CPU s/s | clients CPU s/s | machine busy (of "
          f"{os.cpu_count()}) | named after s | named | all ended s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for p in points:
        print(f"| {p['ranks']} | {p['procs']} | {p['requests_per_s']:.0f} | {p['p50']:.1f} "
              f"| {p['p99']:.1f} | {p['max']:.0f} | {p['probe_p50']:.2f} / {p['probe_p99']:.1f} "
              f"| {p['store_cpu']:.2f} | {p['clients_cpu']:.2f} | {p['machine_busy']:.2f} "
              f"| {p['named_after']:.1f} | {p['named']} | {p['all_ended']:.1f} |")
    for p in points:
        if p.get("broke"):
            print(f"{p['ranks']} ranks broke down before the end of the window "
                  f"(figures up to then): {p['broke']}")


def _extrapolate(points: list[dict], to: int = 16384) -> None:
    """The store's CPU at ``to`` ranks, from a straight line through the points that ran
    to the end (their request rates are known)."""
    points = [p for p in points if not p.get("broke")]
    ranks = np.array([p["ranks"] for p in points], dtype=float)
    if len(ranks) < 2:
        return
    cpu = np.array([p["store_cpu"] for p in points])
    reqs = np.array([p["requests_per_s"] for p in points])
    slope, intercept = np.polyfit(ranks, cpu, 1)
    per_request = float(np.sum(cpu) / np.sum(reqs)) * 1e6
    print(f"\nstore CPU per 1k ranks (fit): {slope * 1000:.3f} s/s; per request: "
          f"{per_request:.1f} us; requests per rank per second: "
          f"{float(np.mean(reqs / ranks)):.2f}")
    print(f"extrapolated, not measured: {to} ranks -> {reqs[-1] / ranks[-1] * to:.0f} "
          f"requests/s, store CPU {intercept + slope * to:.2f} s/s (one core: 1.0)")


def account_time(n: int, dist_timeout: float, tmp: Path) -> float:
    """Seconds a watcher's `Heartbeat.account` takes at ``n`` ranks (every rank's beat read to
    name the silent ones), against a store of its own holding ``n`` beats: the part of
    naming a frozen rank that grows with the job."""
    port = free_port()
    store_proc = _spawn(["--serve-store", port], tmp / f"store-account-{n}.log")
    try:
        client = torch_dist.TCPStore(HOST, port, is_master=False, timeout=WAIT)
        beat = heartbeat.Beat(1, time.time(), 1, "forward").encode()
        keys = [f"{PREFIX}/{rank}" for rank in range(n)]
        for i in range(0, n, 1024):
            client.multi_set(keys[i:i + 1024], [beat] * len(keys[i:i + 1024]))
        watcher = heartbeat.Heartbeat(client, 1, n, dist_timeout, PREFIX)
        began = time.perf_counter()
        message, silent = watcher.account()
        took = time.perf_counter() - began
        assert not silent, message
        return took
    finally:
        store_proc.kill()
        store_proc.wait()


def _judge(points: list[dict], dist_timeout: float) -> None:
    """The issue's goals, against the sizes that ran to the end."""
    for p in points:
        if p.get("broke"):
            continue
        fast = "below" if p["p99"] < 50 else "NOT below"
        soon = "within" if p["named_after"] <= dist_timeout + 5 else "NOT within"
        print(f"{p['ranks']} ranks: p99 {p['p99']:.1f} ms ({fast} 50 ms); the frozen rank "
              f"named after {p['named_after']:.1f} s ({soon} dist_timeout + 5 s = "
              f"{dist_timeout + 5:g} s), and no other: {p['named']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1024,2048,4096,8192")
    parser.add_argument("--ranks-per-proc", type=int, default=256,
                        help="simulated ranks in one client process")
    parser.add_argument("--dist-timeout", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument("--logs", help="keep the processes' output and samples here")
    parser.add_argument("--serve-store", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--client", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_store:
        return serve_store(args.serve_store)
    if args.client:
        port, ranks, world, timeout, out = args.client
        return run_ranks(int(port), json.loads(ranks), int(world), float(timeout), Path(out))
    if args.probe:
        return run_probe(int(args.probe[0]), Path(args.probe[1]))
    # torch looks up each store client's own name (for its logs); a resolver that stalls 5 s
    # on some of those lookups would make connecting thousands of clients take minutes
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    print(f"torch {torch.__version__}, TCPStore libuv backend, {os.cpu_count()} CPU cores, "
          f"dist_timeout {args.dist_timeout:g} s, load average before: {_uptime()}")
    points = []
    with tempfile.TemporaryDirectory(prefix="heartbeat_scale-") as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for n in (int(x) for x in args.ranks.split(",")):
            point = measure(n, args.ranks_per_proc, args.dist_timeout, args.warmup,
                            args.window, logs)
            points.append(point)
            print(f"{n} ranks: {json.dumps(point)}", flush=True)
            if point.get("broke"):
                print(f"(larger sizes not run: {n} ranks already broke down)")
                break
        accounts = {n: account_time(n, args.dist_timeout, logs) for n in (8192, 16384)}
    print(f"load average after: {_uptime()}")
    _print_table(points)
    print("\nnaming a silent rank reads every rank's beat (Heartbeat.account): " + ", ".join(
        f"{n} ranks {seconds * 1e3:.0f} ms" for n, seconds in accounts.items()))
    _extrapolate(points)
    _judge(points, args.dist_timeout)


if __name__ == "__main__":
    main()
