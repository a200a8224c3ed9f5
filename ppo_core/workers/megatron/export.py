"""The actor of a megatron checkpoint as a Hugging Face directory: TP shards merged, PP stages joined.

A megatron worker group saves one ``rank_<r>.pt`` per rank (:meth:`ppo_core.workers.ppo.PPOWorkerBase.save_checkpoint`:
the stage's ``model`` state dict, its optimizer, its generators). The ranks of data-parallel replica 0 hold the whole
model: :func:`megatron_actor_state` reads them (which rank is which TP shard / PP stage comes from
:func:`~ppo_core.workers.megatron.parallel.megatron_layout`, the layout the workers were built with), merges the
TP shards of each stage with :func:`~ppo_core.workers.megatron.hf_loading.megatron_to_hf` and joins the stages.
:func:`export_megatron_actor` writes the result as a checkpoint that ``transformers`` loads
(``AutoModelForCausalLM.from_pretrained``), whose logits are the megatron model's (the padded vocabulary rows are
dropped). No megatron-core is needed: the files are read on the CPU.

Example:
    >>> # export_megatron_actor("runs/x/checkpoints/global_step_5/actor", "runs/x/export",
    >>> #                       model_config=cfg, parallel=ParallelConfig(tensor_model_parallel_size=2),
    >>> #                       hf_config=AutoConfig.from_pretrained(base), tokenizer_dir=base)
"""

from __future__ import annotations

import glob
import logging
import os
import re
from typing import Any

import torch

from ppo_core.workers.megatron.config import MegatronModelConfig, ParallelConfig
from ppo_core.workers.megatron.hf_config import (
    MEGATRON_SHAPE_KEYS,
    hf_config_from_model,
    model_config_from_hf,
)
from ppo_core.workers.megatron.hf_loading import megatron_to_hf
from ppo_core.workers.megatron.parallel import megatron_layout

__all__ = ["export_megatron_actor", "megatron_actor_state", "rank_files"]

logger = logging.getLogger(__name__)

_RANK_FILE = re.compile(r"rank_(\d+)\.pt$")


def rank_files(worker_dir: str | os.PathLike[str]) -> list[str]:
    """``rank_0.pt ... rank_{W-1}.pt`` of a worker checkpoint directory, in rank order.

    Raises:
        FileNotFoundError: no rank file, or a rank missing between 0 and the largest one.
    """
    worker_dir = os.fspath(worker_dir)
    found = {}
    for path in glob.glob(os.path.join(worker_dir, "rank_*.pt")):
        match = _RANK_FILE.search(os.path.basename(path))
        if match:
            found[int(match.group(1))] = path
    if not found:
        raise FileNotFoundError(f"worker_dir={worker_dir!r} holds no rank_<r>.pt file")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise FileNotFoundError(f"worker_dir={worker_dir!r} lacks the files of ranks {missing}")
    return [found[r] for r in range(len(found))]


def _model_state(path: str) -> dict[str, torch.Tensor]:
    # mmap: only the model's tensors are read from disk, not the optimizer's (3x the model in fp32)
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if "model" not in state:
        raise ValueError(f"{path} has no 'model' state (keys: {sorted(state)}); is it a worker checkpoint?")
    return {k: v for k, v in state["model"].items() if not k.endswith("_extra_state")}


def megatron_actor_state(
    worker_dir: str | os.PathLike[str], config: MegatronModelConfig, parallel: ParallelConfig
) -> dict[str, torch.Tensor]:
    """The policy's weights under Hugging Face names, from the rank files of a megatron actor checkpoint.

    Args:
        worker_dir: the actor's checkpoint directory (``.../global_step_k/actor``) with one ``rank_<r>.pt`` per rank.
        config: the model's shape (the workers' ``model``).
        parallel: the TP / PP / CP sizes the workers ran with (the world size is the number of rank files).

    Returns:
        ``{hf name: tensor}`` in the checkpoint's dtype (no ``lm_head.weight`` for tied embeddings).

    Raises:
        ValueError: the rank files do not fit ``parallel`` or the model's shape.
    """
    files = rank_files(worker_dir)
    world = len(files)
    parallel.data_parallel_size(world)  # raises naming every size when they do not divide
    stages: dict[int, dict[int, str]] = {}
    for rank, path in enumerate(files):
        layout = megatron_layout(rank, world, parallel)
        if layout.dp_rank == 0 and layout.cp_rank == 0:
            stages.setdefault(layout.pp_rank, {})[layout.tp_rank] = path
    out: dict[str, torch.Tensor] = {}
    pp = parallel.pipeline_model_parallel_size
    for stage in range(pp):
        shards = [_model_state(stages[stage][tp]) for tp in range(parallel.tensor_model_parallel_size)]
        try:
            out |= megatron_to_hf(shards, config, pp_rank=stage, pp_size=pp)
        except KeyError as exc:
            raise ValueError(
                f"the checkpoint of stage {stage} has no tensor {exc}; do model and parallel match the run?"
            ) from None
    return {k: v.contiguous() for k, v in out.items()}


def _check_shape(hf_config: Any, config: MegatronModelConfig) -> None:
    theirs = model_config_from_hf(hf_config)
    diff = {
        key: (getattr(config, key), getattr(theirs, key))
        for key in MEGATRON_SHAPE_KEYS
        if key != "num_query_groups" and getattr(config, key) != getattr(theirs, key)
    }
    if config.kv_heads != theirs.kv_heads:
        diff["num_query_groups"] = (config.kv_heads, theirs.kv_heads)
    if diff:
        raise ValueError(
            f"hf_config does not describe the checkpoint's model: (checkpoint, hf_config) {diff}"
        )


def export_megatron_actor(
    worker_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model_config: MegatronModelConfig,
    parallel: ParallelConfig,
    hf_config: Any = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str | None = None,
) -> str:
    """Write the actor of a megatron checkpoint as a Hugging Face directory (model, config, tokenizer files).

    Args:
        worker_dir, model_config, parallel: as :func:`megatron_actor_state`.
        out_dir: the output directory.
        hf_config: the ``transformers`` config to write (e.g. ``AutoConfig.from_pretrained`` of the checkpoint the
            run started from, keeping its token ids); None builds one (:func:`hf_config_from_model`). Its shape
            must be the model's.
        tokenizer_dir: directory whose tokenizer files are copied; None: none.
        dtype: dtype of the written weights; None: the checkpoint's.

    Returns:
        ``out_dir`` as a string.
    """
    from transformers import AutoModelForCausalLM

    from ppo_core.models.hf import export_hf

    if hf_config is None:
        hf_config = hf_config_from_model(model_config)
    _check_shape(hf_config, model_config)
    state = megatron_actor_state(worker_dir, model_config, parallel)
    weights_dtype = next(iter(state.values())).dtype
    model = AutoModelForCausalLM.from_config(hf_config, dtype=weights_dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if model_config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise ValueError(
            f"the merged checkpoint and the Hugging Face model disagree: missing {sorted(set(missing) - allowed)}, "
            f"unexpected {sorted(unexpected)}"
        )
    if model_config.tie_word_embeddings:
        model.tie_weights()
    out = export_hf(model, tokenizer_dir, out_dir, dtype=dtype)
    logger.info("exported the megatron actor of %s to %s", os.fspath(worker_dir), out)
    return out
