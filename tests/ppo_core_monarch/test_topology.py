"""MeshTopology: rank <-> coords bijection, host/local mapping and the torch.distributed environment (pure)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_core_monarch.group import _ranks_in_report
from ppo_core_monarch.topology import MeshTopology


@st.composite
def topologies(draw):
    ndim = draw(st.integers(1, 4))
    labels = tuple(f"d{i}" for i in range(ndim))
    sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    return MeshTopology(labels=labels, sizes=sizes)


def _reference_coords(sizes):
    """Row-major enumeration: the i-th tuple of itertools.product is rank i."""
    return list(itertools.product(*(range(s) for s in sizes)))


@given(topologies())
def test_rank_coords_bijection_is_row_major(topo):
    ref = _reference_coords(topo.sizes)
    assert topo.world_size == len(ref)
    for rank, coords in enumerate(ref):
        assert topo.coords(rank) == coords
        assert topo.rank_of(coords) == rank
        assert topo.rank_of(topo.point(rank)) == rank


@given(topologies())
def test_host_and_local_rank_fold_leading_dims(topo):
    ref = _reference_coords(topo.sizes)
    hosts = _reference_coords(topo.sizes[:-1])  # host index = row-major index of the leading coords
    assert topo.num_hosts == len(hosts) and topo.local_size == topo.sizes[-1]
    for rank, coords in enumerate(ref):
        assert topo.local_rank_of(rank) == coords[-1]
        assert topo.host_of(rank) == hosts.index(coords[:-1])
        assert rank in topo.ranks_on_host(topo.host_of(rank))
    seen = [r for h in range(topo.num_hosts) for r in topo.ranks_on_host(h)]
    assert seen == list(range(topo.world_size))


@pytest.mark.parametrize(
    ("sizes", "hosts", "local"),
    [({"hosts": 2, "gpus": 2}, 2, 2), ({"gpus": 4}, 1, 4), ({"dc": 2, "hosts": 2, "gpus": 2}, 4, 2)],
)
def test_named_layouts(sizes, hosts, local):
    topo = MeshTopology.from_sizes(sizes)
    assert (topo.num_hosts, topo.local_size, topo.local_dim) == (hosts, local, "gpus")
    last = topo.world_size - 1
    assert (topo.host_of(last), topo.local_rank_of(last)) == (hosts - 1, local - 1)


def test_dist_env_from_topology():
    topo = MeshTopology.from_sizes({"dc": 2, "hosts": 2, "gpus": 3})
    env = topo.dist_env(7, "h0", 29400)  # 7 = (dc 0, host 1, gpu 1)
    assert env == {
        "RANK": "7",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "12",
        "LOCAL_WORLD_SIZE": "3",
        "GROUP_RANK": "2",
        "NODE_RANK": "2",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "29400",
    }


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"labels": (), "sizes": ()}, "at least one"),
        ({"labels": ("a",), "sizes": (1, 2)}, "same length"),
        ({"labels": ("a", "a"), "sizes": (1, 2)}, "distinct"),
        ({"labels": ("a",), "sizes": (0,)}, "positive"),
    ],
)
def test_invalid_topologies_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MeshTopology(**kwargs)


def test_out_of_range_queries_name_the_argument():
    topo = MeshTopology.from_sizes({"hosts": 2, "gpus": 2})
    with pytest.raises(ValueError, match="rank"):
        topo.coords(4)
    with pytest.raises(ValueError, match="host"):
        topo.ranks_on_host(2)
    with pytest.raises(ValueError, match="gpus"):
        topo.rank_of({"hosts": 0, "gpus": 5})
    with pytest.raises(ValueError, match="missing"):
        topo.rank_of({"hosts": 0})


class _FakeMesh:
    """What from_mesh reads: ``sizes`` and Monarch's ``flatten`` (which refuses sparse strides)."""

    def __init__(self, sizes, dense=True):
        self.sizes, self.dense = sizes, dense

    def flatten(self, name):
        if not self.dense:
            raise ValueError("cannot flatten sparse mesh: strides [2] != [1]")
        return self


def test_from_mesh_reads_sizes_and_rejects_sparse_slices():
    assert MeshTopology.from_mesh(_FakeMesh({"hosts": 3, "gpus": 2})).num_hosts == 3
    with pytest.raises(ValueError, match="not dense"):
        MeshTopology.from_mesh(_FakeMesh({"gpus": 2}, dense=False))


@given(topologies(), st.data())
def test_failure_reports_name_the_right_rank(topo, data):
    rank = data.draw(st.integers(0, topo.world_size - 1))
    point = ", ".join(
        f"'{lab}': {c}/{s}" for lab, c, s in zip(topo.labels, topo.coords(rank), topo.sizes, strict=True)
    )
    report = f"The actor <root>.<w ppo_worker_x{{{point}}}> and all its descendants have failed"
    assert _ranks_in_report(report, topo) == (rank,)
    assert _ranks_in_report("no point here", topo) == ()
