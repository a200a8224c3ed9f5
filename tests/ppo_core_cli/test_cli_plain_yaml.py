"""Without OmegaConf (a machine with only ``transformers``' dependencies) the same files and overrides give the same
job: the PyYAML reader against OmegaConf as the reference."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("omegaconf")

import ppo_core_cli.loading as loading
from ppo_core_cli import _plain_yaml

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")
OVERRIDES = [
    [],
    ["trainer.total_training_steps=5", "vars.root=/data/x", "actor.worker.optim.lr=1e-4"],
    ["data.train_files=[a.parquet,b.parquet]", "+trainer.seed=3", "model.dtype=bfloat16"],
    ["run_dir=${vars.root}/run", "trainer.val_before_train=false", "critic.enable=null"],
    ["vars.extra={a: 1, b: [x, y]}", "export_dir=out_${vars.root}"],
]


def _both(path, overrides, monkeypatch):
    reference = loading.load_job_config(path, overrides)
    with monkeypatch.context() as m:
        m.setattr(loading, "_have_omegaconf", lambda: False)
        plain = loading.load_job_config(path, overrides)
    return reference, plain


@pytest.mark.parametrize("name", sorted(os.listdir(CONFIGS)))
@pytest.mark.parametrize("overrides", OVERRIDES, ids=range(len(OVERRIDES)))
def test_shipped_configs_read_the_same(name, overrides, monkeypatch):
    reference, plain = _both(os.path.join(CONFIGS, name), overrides, monkeypatch)
    assert plain == reference


@given(
    st.one_of(
        st.integers(-(10**6), 10**6).map(str),
        st.floats(-1e6, 1e6, allow_nan=False).map(repr),
        st.sampled_from(
            ["1e-3", "-2.5E+4", ".5", "3.", "true", "false", "null", "abc", "'1e-3'", "[1, 2.0, x]"]
        ),
    )
)
def test_override_values_parse_as_omegaconf_parses_them(text):
    from omegaconf import OmegaConf

    expected = OmegaConf.to_container(OmegaConf.from_dotlist([f"v.x={text}"]))["v"]["x"]
    assert _plain_yaml.read(None, [("v.x", text)])[1]() == {"v": {"x": expected}}


def test_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(loading, "_have_omegaconf", lambda: False)
    with pytest.raises(
        ValueError, match=r"^model\.path: cannot resolve an interpolation: key 'vars\.nope' not found"
    ):
        loading.load_job_config(None, ["model.path=${vars.nope}"])
    with pytest.raises(ValueError, match="refers to itself"):
        loading.load_job_config(None, ["vars.a=${vars.b}", "vars.b=${vars.a}", "model.path=${vars.a}"])
    with pytest.raises(ValueError, match=r"^unknown config key trainer\.bogus"):
        loading.load_job_config(None, ["trainer.bogus=1"])
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n")
    with pytest.raises(TypeError, match="the config must be a mapping"):
        loading.load_job_config(listed)
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1\n")
    with pytest.raises(ValueError, match="cannot read the config"):
        loading.load_job_config(broken)
    with pytest.raises(ValueError, match=r"trainer is not a mapping"):
        loading.load_job_config(None, ["trainer=3", "trainer.seed=1"])
