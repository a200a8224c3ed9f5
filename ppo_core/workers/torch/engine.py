"""``TorchEngine``: the training-engine protocol (:mod:`ppo_core.workers.engine`) for any PyTorch ``nn.Module``.

A policy is called as ``model(input_ids, attention_mask=mask)`` and returns logits ``[B, S, V]`` (or an object
whose ``.logits`` they are); a value model returns values ``[B, S]`` or ``[B, S, 1]`` the same way (a Hugging
Face token-classification head works). Training wraps the model in ``DistributedDataParallel`` when data
parallelism is on (see :mod:`ppo_core.workers.torch.distributed`) and steps it with AdamW.

Padding-free micro-batches (``remove_padding``): a model whose ``supports_packed_sequences`` attribute is true
(the Hugging Face wrappers of :mod:`ppo_core.models.hf`; with ``remove_padding="auto"`` only where its
``packed_attention_is_sparse`` is not False: a dense block mask over the packed length costs the square of it) is
called once per micro-batch as
``model(input_ids [1, T], position_ids=[1, T])`` on the valid tokens of its rows laid end to end
(:mod:`ppo_core.workers.packing`), positions restarting at 0 for each row, which the model must read as separate
causal documents; other models (``TinyGPT``, any plain module) get the padded rows. A model whose ``forward`` takes
``logits_to_keep`` (Hugging Face causal LMs) computes logits only at the positions that predict responses.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from ppo_core.keys import KEYS
from ppo_core.logprobs import entropy_from_logits, logprobs_from_logits
from ppo_core.rollout.sampling import logits_of
from ppo_core.workers._common import first_nonfinite_grad
from ppo_core.workers.config import OptimConfig
from ppo_core.workers.engine import ENTROPY, LOG_PROBS, VALUES, EngineBase, LossFn, OutputSpec, StepResult
from ppo_core.workers.packing import pack_micro_batch
from ppo_core.workers.torch.distributed import all_reduce_sum, maybe_no_sync, wrap_ddp
from ppo_core.workers.torch.exact import ExactLogProbs

__all__ = ["TorchEngine", "packs_sparsely", "response_outputs", "supports_packed_sequences"]


def packs_sparsely(module: nn.Module) -> bool:
    """Whether ``module``'s packed attention skips the work across documents (attribute
    ``packed_attention_is_sparse``, True when absent); False for a dense ``[N, N]`` block mask over the packed
    length, whose cost grows with its square (``remove_padding="auto"`` then keeps padded rows).

    Example:
        >>> packs_sparsely(nn.Linear(2, 2))
        True
    """
    return bool(getattr(module, "packed_attention_is_sparse", True))


def supports_packed_sequences(module: nn.Module) -> bool:
    """Whether ``module`` declares (attribute ``supports_packed_sequences``) that it takes packed documents:
    ``module(input_ids [1, T], position_ids=[1, T])``, each run of positions from 0 a separate causal document.

    Example:
        >>> supports_packed_sequences(nn.Linear(2, 2))
        False
    """
    return bool(getattr(module, "supports_packed_sequences", False))


def _takes_logits_to_keep(module: nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature
        return False


def response_outputs(model: nn.Module, batch: TensorDictBase) -> torch.Tensor:
    """Model outputs at the positions that predict the response: ``out[:, P-1 : P+R-1]`` (``[B, R, ...]``).

    Position ``t`` of the response is predicted from the output at position ``P + t - 1`` of ``input_ids``.
    """
    R = batch[KEYS.responses].shape[1]
    out = logits_of(model(batch[KEYS.input_ids], attention_mask=batch[KEYS.attention_mask]))
    return out[:, -R - 1 : -1]


def _as_values(out: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:
        if out.shape[-1] != 1:
            raise ValueError(
                f"the critic model must output [B, S] or [B, S, 1] values, got {tuple(out.shape)}"
            )
        out = out.squeeze(-1)
    return out.float()


def _policy_outputs(logits: torch.Tensor, labels: torch.Tensor, spec: OutputSpec) -> dict[str, torch.Tensor]:
    """Log-probs (and entropies) ``[...]`` of ``labels [...]`` under ``softmax(logits [..., V] / temperature)``."""
    logits = logits / spec.temperature
    outputs = {LOG_PROBS: logprobs_from_logits(logits, labels)}
    if spec.entropy:
        outputs[ENTROPY] = entropy_from_logits(logits)
    return outputs


class TorchEngine(EngineBase):
    """One ``nn.Module`` on one device, with AdamW when ``optim`` is given (a forward-only engine otherwise).

    Args:
        module: the model, already on ``device``.
        device: where the model and the micro-batches live.
        head: ``"policy"`` (log-probs and entropy from logits) or ``"value"`` (values).
        optim: optimiser settings; None builds a frozen forward-only engine (a reference policy).
        dp_rank / dp_size: this rank's data-parallel position (every rank is a replica).
        data_parallel: wrap the trained model in DDP and sum over the default process group (the caller has
            joined it, :func:`~ppo_core.workers.torch.distributed.init_data_parallel`).
        remove_padding: pack each micro-batch's valid tokens into one sequence: ``"auto"`` where the model
            supports it (:func:`supports_packed_sequences`) and its packed attention skips the work across
            documents (:func:`packs_sparsely`), True wherever it supports it, False never; the outputs are the
            same ``[b, R]`` either way.

    Example:
        >>> from ppo_core.models import TinyGPT, TinyGPTConfig
        >>> lm = TinyGPT(TinyGPTConfig(vocab_size=8, max_seq_len=8, d_model=16, n_heads=2))
        >>> engine = TorchEngine(lm, device=torch.device("cpu"), optim=OptimConfig(lr=1e-3))
        >>> engine.head, engine.dp_size, engine.lr
        ('policy', 1, 0.001)
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        device: torch.device,
        head: str = "policy",
        optim: OptimConfig | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        data_parallel: bool = False,
        remove_padding: bool | str = "auto",
    ) -> None:
        if not (isinstance(remove_padding, bool) or remove_padding == "auto"):
            raise ValueError(f"remove_padding must be True, False or 'auto', got {remove_padding!r}")
        model, optimizer = module, None
        if optim is not None:
            model = wrap_ddp(module, device, data_parallel)
            optimizer = torch.optim.AdamW(
                module.parameters(),
                lr=optim.lr,
                betas=tuple(optim.betas),
                eps=optim.eps,
                weight_decay=optim.weight_decay,
            )
        super().__init__(module, model, head=head, device=device, optim=optim, optimizer=optimizer)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.data_parallel = data_parallel
        # padding-free micro-batches: asked for (or "auto" and they pay), and the model supports them
        self.packed = supports_packed_sequences(module) and (
            remove_padding is True or (remove_padding == "auto" and packs_sparsely(module))
        )
        self._logits_to_keep = head == "policy" and _takes_logits_to_keep(module)
        self.exact_log_probs: ExactLogProbs | None = None
        """Exact mode (:mod:`~ppo_core.workers.torch.exact`, set by the actor worker): the log-probs take the
        batch-invariant rollout's values; None: the model forward's own."""

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(value, self.data_parallel)

    # ----- forward / backward -------------------------------------------------------------------------------
    def _outputs(self, model: nn.Module, micro: TensorDictBase, spec: OutputSpec) -> dict[str, torch.Tensor]:
        exact = self.exact_log_probs
        if exact is not None and self.head == "policy" and not (spec.entropy or torch.is_grad_enabled()):
            return {LOG_PROBS: exact.values(micro)}  # the model's forward would serve only a gradient
        outputs = self._model_outputs(model, micro, spec)
        if exact is not None and LOG_PROBS in outputs:
            outputs[LOG_PROBS] = exact(micro, outputs[LOG_PROBS])
        return outputs

    def _model_outputs(
        self, model: nn.Module, micro: TensorDictBase, spec: OutputSpec
    ) -> dict[str, torch.Tensor]:
        if self.packed:
            return self._packed_outputs(model, micro, spec)
        responses = micro[KEYS.responses]
        if self._logits_to_keep:  # the last R + 1 positions, of which the first R predict the response
            r = responses.shape[1]
            ids, mask = micro[KEYS.input_ids], micro[KEYS.attention_mask]
            out = logits_of(model(ids, attention_mask=mask, logits_to_keep=r + 1))[:, :r]
        else:
            out = response_outputs(model, micro)
        if self.head == "value":
            return {VALUES: _as_values(out)}
        return _policy_outputs(out, responses, spec)

    def _packed_outputs(
        self, model: nn.Module, micro: TensorDictBase, spec: OutputSpec
    ) -> dict[str, torch.Tensor]:
        responses = micro[KEYS.responses]
        packed = pack_micro_batch(micro[KEYS.input_ids], micro[KEYS.attention_mask], responses.shape[1])
        kwargs: dict[str, Any] = {"position_ids": packed.documents.position_ids[None]}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = packed.output_index
        out = logits_of(model(packed.input_ids[None], **kwargs))[0]
        if not self._logits_to_keep:
            out = out[packed.output_index]
        if self.head == "value":
            values = _as_values(out[None])[0]  # [n]
            return {VALUES: packed.unpack(values)}
        outputs = _policy_outputs(out, packed.labels(responses), spec)
        return {name: packed.unpack(value) for name, value in outputs.items()}

    @torch.no_grad()
    def forward(self, micros: Sequence[TensorDictBase], spec: OutputSpec) -> list[dict[str, torch.Tensor]]:
        return [self._outputs(self.module, m, spec) for m in micros]

    def forward_backward(
        self, micros: Sequence[TensorDictBase], loss_fn: LossFn, spec: OutputSpec
    ) -> list[dict[str, torch.Tensor]]:
        results = []
        for i, micro in enumerate(micros):
            # DDP averages gradients over ranks once, in the backward of the last micro-batch
            with maybe_no_sync(self.model, skip_sync=i < len(micros) - 1):
                loss, metrics = loss_fn(micro, self._outputs(self.model, micro, spec))
                loss.backward()
            results.append(metrics)
        return results

    # ----- optimiser and state ------------------------------------------------------------------------------
    def optimizer_step(self) -> StepResult:
        """Clip the gradient norm, step if it is finite (else skip, as verl does), clear gradients."""
        optim, optimizer = self._trained()
        clip = optim.grad_clip
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip is not None else math.inf))
        bad = None
        if math.isfinite(norm):
            optimizer.step()
        else:
            bad = first_nonfinite_grad((n, p.grad) for n, p in self.module.named_parameters())
        optimizer.zero_grad(set_to_none=True)
        return StepResult(grad_norm=norm, nonfinite_grad=bad)

    def zero_grad(self) -> None:
        self._trained()[1].zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self._trained()[1].state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self._trained()[1].load_state_dict(state["optimizer"])
