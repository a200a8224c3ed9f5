"""Where every rank lives: ``rank -> (host, local_rank)`` from a mesh's labels and sizes, nothing hard-coded.

Convention (the same as ``monarch.spmd`` and torchrun): the **last** mesh dimension is the local (GPU or
process) dimension; every dimension before it folds into the host index; ranks are row-major over the sizes,
which is the order of ``mesh.flatten("rank")`` and of ``ValueMesh.items()``. A mesh from ``this_host()`` has
only the local dimension, so it is one host.

Example:
    >>> topo = MeshTopology(labels=("hosts", "gpus"), sizes=(2, 2))
    >>> topo.host_of(3), topo.local_rank_of(3), topo.coords(3)
    (1, 1, (1, 1))
    >>> topo.ranks_on_host(1)
    (2, 3)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MeshTopology"]


@dataclass(frozen=True)
class MeshTopology:
    """The rank layout of a dense mesh: ``labels`` (outermost first) with their ``sizes``."""

    labels: tuple[str, ...]
    """Mesh dimension names, outermost first; the last one is the local (per-host) dimension."""
    sizes: tuple[int, ...]
    """Size of each dimension, in the order of ``labels``."""

    def __post_init__(self) -> None:
        labels, sizes = tuple(self.labels), tuple(self.sizes)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "sizes", sizes)
        if not labels:
            raise ValueError("labels must name at least one dimension (the local dimension), got ()")
        if len(labels) != len(sizes):
            raise ValueError(f"labels {labels} and sizes {sizes} must have the same length")
        if len(set(labels)) != len(labels):
            raise ValueError(f"labels must be distinct, got {labels}")
        for label, size in zip(labels, sizes, strict=True):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"sizes must be positive ints, got {size!r} for dimension {label!r}")

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, int]) -> MeshTopology:
        """Build from an ordered ``{label: size}`` mapping (``mesh.sizes``).

        Example:
            >>> MeshTopology.from_sizes({"dc": 2, "hosts": 2, "gpus": 2}).num_hosts
            4
        """
        return cls(labels=tuple(sizes), sizes=tuple(int(s) for s in sizes.values()))

    @classmethod
    def from_mesh(cls, mesh: Any) -> MeshTopology:
        """Build from a Monarch mesh (ProcMesh, ActorMesh or HostMesh x per-host), rejecting non-dense slices.

        A slice such as ``mesh.slice(gpus=slice(0, 4, 2))`` has strides that are not the row-major strides of
        its sizes; ranks of such a mesh do not match ``flatten("rank")``, so it is refused.

        Example:
            >>> # MeshTopology.from_mesh(this_host().spawn_procs(per_host={"gpus": 2})).world_size == 2
        """
        sizes = dict(mesh.sizes)
        try:
            # flatten() is Monarch's public density check: it refuses strides that are not row-major.
            mesh.flatten("rank")
        except ValueError as exc:
            raise ValueError(
                f"mesh is not dense (sizes {sizes}): {exc}; spawn a proc mesh of the wanted shape instead of "
                "passing a strided slice"
            ) from exc
        return cls.from_sizes(sizes)

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return math.prod(self.sizes)

    @property
    def local_dim(self) -> str:
        """Name of the local (per-host) dimension: the last label."""
        return self.labels[-1]

    @property
    def local_size(self) -> int:
        """Ranks per host (size of the last dimension)."""
        return self.sizes[-1]

    @property
    def num_hosts(self) -> int:
        """Number of hosts: the product of every dimension but the last (1 without host dimensions)."""
        return math.prod(self.sizes[:-1])

    def _check_rank(self, rank: int) -> int:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return rank

    def coords(self, rank: int) -> tuple[int, ...]:
        """Mixed-radix digits of ``rank`` over ``sizes`` (row-major), one per label."""
        rest = self._check_rank(rank)
        digits = []
        for size in reversed(self.sizes):
            digits.append(rest % size)
            rest //= size
        return tuple(reversed(digits))

    def point(self, rank: int) -> dict[str, int]:
        """``{label: coordinate}`` of ``rank`` (the keyword arguments of ``mesh.slice``)."""
        return dict(zip(self.labels, self.coords(rank), strict=True))

    def rank_of(self, coords: Sequence[int] | Mapping[str, int]) -> int:
        """Inverse of :meth:`coords`; accepts a tuple or a ``{label: coordinate}`` mapping."""
        if isinstance(coords, Mapping):
            missing = [label for label in self.labels if label not in coords]
            extra = sorted(set(coords) - set(self.labels))
            if missing or extra:
                raise ValueError(
                    f"coords must name exactly the labels {self.labels}; missing {missing}, unknown {extra}"
                )
            coords = [coords[label] for label in self.labels]
        coords = tuple(coords)
        if len(coords) != len(self.sizes):
            raise ValueError(
                f"coords must have {len(self.sizes)} entries for labels {self.labels}, got {coords}"
            )
        rank = 0
        for label, c, size in zip(self.labels, coords, self.sizes, strict=True):
            if not 0 <= c < size:
                raise ValueError(f"coordinate {c} for dimension {label!r} is outside [0, {size})")
            rank = rank * size + c
        return rank

    def host_of(self, rank: int) -> int:
        """Host index of ``rank``: all leading dimensions folded row-major."""
        return self._check_rank(rank) // self.local_size

    def local_rank_of(self, rank: int) -> int:
        """Position of ``rank`` within its host (its coordinate in the last dimension)."""
        return self._check_rank(rank) % self.local_size

    def ranks_on_host(self, host: int) -> tuple[int, ...]:
        """Global ranks on ``host``, in local-rank order."""
        if not isinstance(host, int) or not 0 <= host < self.num_hosts:
            raise ValueError(f"host must be an int in [0, {self.num_hosts}), got {host!r}")
        start = host * self.local_size
        return tuple(range(start, start + self.local_size))

    def dist_env(self, rank: int, master_addr: str, master_port: int) -> dict[str, str]:
        """The ``torch.distributed`` (torchrun-style) environment of ``rank``.

        Example:
            >>> MeshTopology(labels=("gpus",), sizes=(2,)).dist_env(1, "h0", 1234)["LOCAL_RANK"]
            '1'
        """
        return {
            "RANK": str(self._check_rank(rank)),
            "LOCAL_RANK": str(self.local_rank_of(rank)),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_size),
            "GROUP_RANK": str(self.host_of(rank)),
            "NODE_RANK": str(self.host_of(rank)),
            "MASTER_ADDR": str(master_addr),
            "MASTER_PORT": str(int(master_port)),
        }
