"""SLURM's compressed host and task lists, expanded without `scontrol`."""

from __future__ import annotations

import pytest

from trainrun.dist.slurm import expand_nodelist, expand_tasks_per_node


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node7", ["node7"]),
        ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padding kept past a digit carry
        ("n[9-10]", ["n9", "n10"]),  # no padding when the lower bound has none
        ("n[1-2]-r[3-4]", ["n1-r3", "n1-r4", "n2-r3", "n2-r4"]),
        ("x[5]", ["x5"]),
        ("a,b,c", ["a", "b", "c"]),
        ("  host-1.example.org ", ["host-1.example.org"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist",
    ["", "   ", "gpu[01-02", "gpu01-02]", "gpu[]", "gpu[a-b]", "gpu[3-1]", "gpu[1-]", "gpu[1,x]"],
)
def test_expand_nodelist_rejects_bad_lists(nodelist: str) -> None:
    with pytest.raises(ValueError):
        expand_nodelist(nodelist)


@pytest.mark.parametrize(
    ("spec", "counts"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,3", [1, 3]), ("8(x2)", [8, 8])],
)
def test_expand_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("spec", ["", "2(x)", "x2", "2(3)", "2,,1"])
def test_expand_tasks_per_node_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        expand_tasks_per_node(spec)
