"""``@register()`` without a dispatch mode replicates the call to every rank (``ONE_TO_ALL``) and lists the results
in rank order. verl's default (``ALL_TO_ALL``) would instead expect one argument per rank and fail on a scalar."""

from __future__ import annotations

from ppo_core.backends import LocalWorkerGroup
from ppo_core.workers import Worker, register


class Echo(Worker):
    @register()
    def tag(self, text: str) -> str:
        return f"{text}@{self.rank}"


def test_register_without_a_mode_sends_the_same_arguments_to_every_rank() -> None:
    with LocalWorkerGroup(Echo, world_size=3) as wg:
        assert wg.tag("x") == ["x@0", "x@1", "x@2"]
