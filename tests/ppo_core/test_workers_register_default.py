"""``@register()`` without a dispatch mode replicates the call to every rank (``ONE_TO_ALL``) and lists the results
in rank order. verl's default (``ALL_TO_ALL``) would instead expect one argument per rank and fail on a scalar."""

from __future__ import annotations

import pytest

from ppo_core.backends import LocalWorkerGroup
from ppo_core.workers import Worker, register


class Echo(Worker):
    @register()
    def tag(self, text: str) -> str:
        return f"{text}@{self.rank}"


def test_register_without_a_mode_sends_the_same_arguments_to_every_rank() -> None:
    with LocalWorkerGroup(Echo, world_size=3) as wg:
        assert wg.tag("x") == ["x@0", "x@1", "x@2"]


@pytest.mark.parametrize("name", ["worker_layout", "set_dp_layout"])
def test_a_worker_cannot_register_a_method_under_a_layout_name(name):
    """A user's group-callable method that happens to be called ``worker_layout`` would replace the layout every
    data-parallel call asks for: refused where the class is defined, naming it; a plain override (an advanced
    worker returning its own layout) stays allowed."""
    with pytest.raises(TypeError, match=rf"Shadow registers {name} \(@register\), a name worker groups call"):
        type("Shadow", (Worker,), {name: register()(lambda self: None)})
    assert issubclass(type("Override", (Worker,), {name: lambda self: None}), Worker)
