"""The addresses a decode graph reads (``ppo_core_decode.graph_inputs``): every tensor an object holds, in a fixed
order, against a plain recursive reference; what a replaced tensor, a swap and the skipped kinds do (the decoder's
use of it on the engines' forwards: ``tests/ppo_core/test_rollout_cached.py``)."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_core_decode.graph_inputs import fully_walked, held_tensor_addresses
from ppo_core_decode.kv_cache import KVCache


@dataclasses.dataclass
class _Holder:  # an object of ppo-core's own (this test module is not, so the walk is told by its module name)
    items: object


_Holder.__module__ = "ppo_core_decode.test_stand_in"

_POOL = [torch.zeros(n) for n in (1, 2, 3, 2, 5)]


def _structures():
    leaves = st.sampled_from(range(len(_POOL))).map(lambda i: _POOL[i]) | st.integers() | st.none()
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.lists(inner, max_size=3).map(tuple)
            | st.dictionaries(st.text(max_size=2), inner, max_size=3)
            | inner.map(_Holder)
        ),
        max_leaves=12,
    )


def _reference(obj, seen):
    """Depth first, every container and own object entered once, tensors listed each time they are met."""
    if isinstance(obj, torch.Tensor):
        return [(obj.data_ptr(), obj.numel())]
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, _Holder):
        children = [obj.items]
    else:
        return []
    return [a for child in children for a in _reference(child, seen)]


@settings(max_examples=80, deadline=None)
@given(_structures())
def test_addresses_are_every_held_tensor_in_depth_first_order(structure):
    assert held_tensor_addresses(structure) == tuple(_reference(structure, set()))


def test_a_replaced_or_swapped_tensor_changes_the_addresses_and_a_rebuilt_holder_does_not():
    a, b = torch.zeros(4), torch.ones(4)
    before = held_tensor_addresses(_Holder({"w": [a, b]}))
    assert held_tensor_addresses(_Holder({"w": [a, b]})) == before  # another holder of the same tensors
    assert held_tensor_addresses(_Holder({"w": [b, a]})) != before  # two of one size swapped
    assert held_tensor_addresses(_Holder({"w": [a.clone(), b]})) != before  # made again elsewhere
    assert held_tensor_addresses(_Holder({"w": [a[:2], b]})) != before  # the same address, another size
    assert held_tensor_addresses() == ()


def test_modules_give_their_parameters_buffers_and_tensor_attributes_and_skipped_kinds_are_not_entered():
    layer = torch.nn.Linear(3, 2)
    layer.register_buffer("scale", torch.ones(2))
    layer.table = torch.arange(4.0)  # a plain tensor attribute
    model = torch.nn.Sequential(layer, torch.nn.ReLU())
    got = held_tensor_addresses(model)
    assert {a for a, _ in got} == {t.data_ptr() for t in (layer.weight, layer.bias, layer.scale, layer.table)}
    cache = KVCache.allocate(
        layers=1, batch=1, kv_heads=1, head_dim=2, length=3, dtype=torch.float32, device="cpu"
    )
    holder = _Holder([cache, {1, 2}, layer.weight])
    assert held_tensor_addresses(holder, skip=(KVCache,)) == ((layer.weight.data_ptr(), 6),)
    assert len(held_tensor_addresses(holder)) > 1  # not skipped: the cache's buffers are walked

    class Foreign:  # defined outside ppo-core's packages
        def __init__(self):
            self.weight = torch.zeros(2)

        def forward(self):
            return self.weight

    assert held_tensor_addresses(_Holder([Foreign(), Foreign().forward])) == ()  # not entered


def test_only_ppo_cores_own_forwards_are_fully_walked():
    holder = _Holder(torch.zeros(2))
    method = holder.__repr__
    assert fully_walked(holder) and fully_walked(method)
    assert held_tensor_addresses(method) == held_tensor_addresses(holder)  # a bound method walks its object
    assert not fully_walked(lambda i, p, c: i) and not fully_walked(torch.nn.Linear(2, 2))


def test_a_tensor_whose_address_cannot_be_read_never_matches():
    """A tensor subclass without storage of its own (its data may move under the same object) reads address 0: its
    entry equals no other, so that two walks of it differ and the decoder captures anew; a meta tensor without
    elements does not count."""

    class NoStorage(torch.Tensor):
        @staticmethod
        def __new__(cls):
            return torch.Tensor._make_wrapper_subclass(cls, (2,))

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    wrapped = NoStorage()
    assert held_tensor_addresses([wrapped]) != held_tensor_addresses([wrapped])
    empty = torch.empty(0)
    assert held_tensor_addresses([empty]) == held_tensor_addresses([empty])
