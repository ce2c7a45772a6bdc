"""What each test costs, as a pytest plugin: `pytest -p tests.helpers.cost --cost_table PATH` (works with xdist).

A test's CPU seconds are those of the pytest process and everything it started: its own user+sys time, its reaped
children's (torchrun, tools run as subprocesses) and those of the processes still alive beside it (the forkserver of
tests/helpers/forked.py, which reaps the runs forked from it, and their children), read from /proc before and after
the test; runs of other tests on another xdist worker are not counted. Processes started counts every subprocess and
every forked rank. Fixtures count where they are set up (a session fixture in the first test that asks for it).

The table's last line is the machine's busy CPU seconds over the session (/proc/stat: user, nice, system), which also
counts what no process tree shows (a forkserver that outlives its pytest worker is reaped by init, so `time pytest`
misses every run forked from it) and whatever else ran beside the suite."""

from __future__ import annotations

import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

_TICK = os.sysconf("SC_CLK_TCK")
_started = [0]
_ROWS: list[tuple] = []  # (nodeid, wall s, CPU s, processes started), gathered where the reports arrive


def _tree_cpu() -> float:
    """CPU seconds (user+sys, own and reaped children's) of this process and its live descendants."""
    children: dict[int, list[int]] = defaultdict(list)
    times: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        pid = int(entry.name)
        children[int(fields[1])].append(pid)
        # utime, stime, cutime, cstime; not a zombie's, which its parent's cutime takes over once it reaps it
        times[pid] = 0.0 if fields[0] == "Z" else sum(map(int, fields[11:15])) / _TICK
    total, stack = 0.0, [os.getpid()]
    while stack:
        pid = stack.pop()
        total += times.get(pid, 0.0)
        stack.extend(children.get(pid, ()))
    return total


def _count_starts() -> None:
    """Count each subprocess and each process the forkserver forks for a run."""
    popen_init = subprocess.Popen.__init__

    def counted(self, *args, **kwargs):
        _started[0] += 1
        popen_init(self, *args, **kwargs)

    subprocess.Popen.__init__ = counted
    from multiprocessing.context import ForkServerProcess

    start = ForkServerProcess._Popen

    def counted_start(process_obj):
        _started[0] += 1
        return start(process_obj)

    ForkServerProcess._Popen = staticmethod(counted_start)


def pytest_addoption(parser):
    parser.addoption("--cost_table", default=None, help="write each test file's and the slowest tests' cost here")
    parser.addoption("--cost_slowest", type=int, default=30, help="how many of the slowest tests the table lists")


def _machine_cpu() -> float:
    user, nice, system = map(int, Path("/proc/stat").read_text().split()[1:4])
    return (user + nice + system) / _TICK


def pytest_configure(config):
    _count_starts()
    config._cost_machine = _machine_cpu()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item._cost_start = (time.monotonic(), _tree_cpu(), _started[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and hasattr(item, "_cost_start"):
        wall, cpu, started = item._cost_start
        cost = (time.monotonic() - wall, _tree_cpu() - cpu, _started[0] - started)
        outcome.get_result().user_properties.append(("cost", cost))


def pytest_runtest_logreport(report):
    if report.when != "teardown":
        return
    for name, value in report.user_properties:
        if name == "cost":
            _ROWS.append((report.nodeid, *value))


def pytest_sessionfinish(session):
    path = session.config.getoption("cost_table")
    if not path or hasattr(session.config, "workerinput"):  # xdist workers report to the controller
        return
    busy = _machine_cpu() - session.config._cost_machine
    slowest = session.config.getoption("cost_slowest")
    Path(path).write_text(table(_ROWS, slowest) + f"\nThe machine's busy CPU over the session: {busy:.0f} s\n")


def table(rows: list[tuple], slowest: int = 30) -> str:
    """Markdown: per file (tests, wall s, CPU s, processes started), then the `slowest` tests by CPU."""
    files: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for nodeid, wall, cpu, started in rows:
        f = files[nodeid.split("::")[0]]
        f[0] += 1
        f[1] += wall
        f[2] += cpu
        f[3] += started
    total = [sum(f[i] for f in files.values()) for i in range(4)]
    lines = ["| file | tests | wall s | CPU s | processes started |", "|---|---:|---:|---:|---:|"]
    for name, (n, wall, cpu, started) in sorted(files.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"| {name} | {n} | {wall:.0f} | {cpu:.0f} | {started} |")
    lines.append(f"| **all** | {total[0]} | {total[1]:.0f} | {total[2]:.0f} | {total[3]} |")
    lines += ["", "| slowest tests by CPU | wall s | CPU s | processes started |", "|---|---:|---:|---:|"]
    for nodeid, wall, cpu, started in sorted(rows, key=lambda r: -r[2])[:slowest]:
        lines.append(f"| {nodeid} | {wall:.1f} | {cpu:.1f} | {started} |")
    return "\n".join(lines) + "\n"
