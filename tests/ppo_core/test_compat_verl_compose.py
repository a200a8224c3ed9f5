"""load_verl_tree: a Hydra defaults list composed without Hydra, then Hydra-style overrides.

The config folders are written here, in the layout of verl's trainer configs (groups in sub-folders, ``group@package``
entries, ``../group`` from inside a group, ``${choice}`` options, a ``_global_`` package, ``override``)."""

from __future__ import annotations

import pathlib

import pytest

omegaconf = pytest.importorskip("omegaconf")

from ppo_core.compat._verl_compose import load_verl_tree  # noqa: E402


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


FILES = {
    "trainer.yaml": """
defaults:
  - engine: dp
  - actor@roles.actor: ${engine}_actor
  - shared
  - _self_
roles:
  actor:
    lr: 3
top: 1
""",
    "shared.yaml": "top: 0\nshared_key: yes\n",
    "engine/dp.yaml": "# @package _global_\nengine: dp\n",
    "engine/mega.yaml": "# @package _global_\nengine: mega\n",
    "actor/base.yaml": "lr: 1\nclip: 0.2\n",
    "actor/dp_actor.yaml": "defaults:\n  - ../optim@optim: adam\n  - base\n  - _self_\nstrategy: fsdp\n",
    "actor/mega_actor.yaml": "defaults:\n  - ../optim@optim: sgd\n  - base\nstrategy: megatron\n",
    "optim/adam.yaml": "name: adam\nbetas: [0.9, 0.999]\n",
    "optim/sgd.yaml": "name: sgd\n",
    "mega_trainer.yaml": "defaults:\n  - trainer\n  - override engine: mega\n  - _self_\n",
}


def test_a_defaults_list_is_composed_in_order(tmp_path):
    _write(tmp_path, FILES)
    tree = omegaconf.OmegaConf.to_container(load_verl_tree(tmp_path / "trainer.yaml"))
    assert tree == {
        "engine": "dp",  # the _global_ package: at the root
        "roles": {
            "actor": {
                "optim": {"name": "adam", "betas": [0.9, 0.999]},  # ../optim@optim: under the actor's package
                "lr": 3,  # the primary's _self_ comes last and wins
                "clip": 0.2,
                "strategy": "fsdp",
            }
        },
        "top": 1,
        "shared_key": True,
    }


def test_override_entries_and_group_overrides_choose_another_option(tmp_path):
    _write(tmp_path, FILES)
    expected = {"name": "sgd"}
    tree = load_verl_tree(tmp_path / "mega_trainer.yaml")
    assert tree.engine == "mega" and tree.roles.actor.strategy == "megatron"
    assert omegaconf.OmegaConf.to_container(tree.roles.actor.optim) == expected
    chosen = load_verl_tree(tmp_path / "trainer.yaml", ["engine=mega"])
    assert chosen.roles.actor.strategy == "megatron" and chosen.roles.actor.lr == 3


def test_overrides_set_add_and_delete_keys(tmp_path):
    _write(tmp_path, FILES)
    tree = load_verl_tree(
        tmp_path / "trainer.yaml", ["roles.actor.lr=0.5", "+roles.actor.new=[a,b]", "~shared_key", "top=null"]
    )
    assert tree.roles.actor.lr == 0.5 and list(tree.roles.actor.new) == ["a", "b"]
    assert "shared_key" not in tree and tree.top is None


def test_a_file_without_defaults_is_read_as_is(tmp_path):
    (tmp_path / "plain.yaml").write_text("a:\n  b: ${c}\nc: 2\n")
    assert omegaconf.OmegaConf.to_container(load_verl_tree(tmp_path / "plain.yaml"), resolve=True) == {
        "a": {"b": 2},
        "c": 2,
    }


def test_errors_name_the_file_or_the_entry(tmp_path):
    _write(tmp_path, {**FILES, "broken.yaml": "defaults:\n  - actor@roles.actor: missing_actor\n"})
    with pytest.raises(FileNotFoundError, match=r"missing_actor\.yaml"):
        load_verl_tree(tmp_path / "broken.yaml")
    (tmp_path / "unchosen.yaml").write_text("defaults:\n  - actor@a: ${nothing}_actor\n")
    with pytest.raises(ValueError, match=r"\$\{nothing\}"):
        load_verl_tree(tmp_path / "unchosen.yaml")
    with pytest.raises(FileNotFoundError, match="nope"):
        load_verl_tree(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match="must be key=value"):
        load_verl_tree(tmp_path / "trainer.yaml", ["no_equals_sign"])
    # YAML's error, as one ValueError naming the file or the override
    (tmp_path / "malformed.yaml").write_text("data:\n  train_files: [a.parquet\n")
    with pytest.raises(ValueError, match=r"cannot read the verl config '.*malformed\.yaml': while parsing"):
        load_verl_tree(tmp_path / "malformed.yaml")
    with pytest.raises(ValueError, match=r"cannot apply the override 'data\.train_files=\[a,'"):
        load_verl_tree(tmp_path / "trainer.yaml", ["data.train_files=[a,"])
