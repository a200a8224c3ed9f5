"""The ``ppo-core`` command: from a Hugging Face checkpoint and a prompt dataset to a trained, exported policy.

- :mod:`~ppo_core_cli.config`: :class:`JobConfig` (one typed config per run; YAML + dotted overrides), its
  ``rollout`` / ``actor`` / ``critic`` sections (:mod:`~ppo_core_cli.roles`) and deprecated keys
  (:mod:`~ppo_core_cli.aliases`); :mod:`~ppo_core_cli.worker_kinds`: the kinds of workers a job names;
- :mod:`~ppo_core_cli.main`: the subcommands ``make-data``, ``sft``, ``train``, ``export``, ``convert``,
  ``convert-verl``;
- :mod:`~ppo_core_cli.verl_job`: a verl config (and verl's overrides) as a job;
- :mod:`~ppo_core_cli.sft`: the supervised (format) warm-up; :mod:`~ppo_core_cli.train`: a PPO run and its outputs;
- :mod:`~ppo_core_cli.job`: tokenizer, prompts, reward, workers and trainer from a job;
- :mod:`~ppo_core_cli.convert`: a GGUF file as a Hugging Face checkpoint (converted once, reused);
  :mod:`~ppo_core_cli.tokens`: the EOS and padding of a run, and the tokenizer/embedding size check;
- :mod:`~ppo_core_cli.export`: the actor of any checkpoint (torch or megatron workers) as a Hugging Face directory;
- :mod:`~ppo_core_cli.timings`: the step-time breakdown JSON; :mod:`~ppo_core_cli.shapes`: random-init checkpoints.

The package sits on top of ``ppo_core`` and, for ``backend: monarch`` only, ``ppo_core_monarch`` (imported when a
run asks for it): ``ppo_core`` itself knows nothing of either.
"""

from __future__ import annotations

from ppo_core_cli.config import JobConfig
from ppo_core_cli.loading import load_job_config
from ppo_core_cli.main import main

__all__ = ["JobConfig", "load_job_config", "main"]
