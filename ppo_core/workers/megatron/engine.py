"""``MegatronEngine``: the training-engine protocol (:mod:`ppo_core.workers.engine`) for a megatron-core GPT stage.

Forward and backward run through ``get_forward_backward_func`` (no pipelining for PP = 1, 1F1B otherwise) over
the micro-batches of one call; gradients go through megatron's ``DistributedDataParallel`` (fp32 gradient
buffers, averaged over dp) and its mixed-precision optimizer (fp32 master weights, AdamW, optionally sharded over
dp), with the multi-tensor kernels of :mod:`~ppo_core.workers.megatron.optim` where megatron would fall back to
Python loops. A policy's log-probs and entropies come from the vocab-parallel logits
(:mod:`~ppo_core.workers.megatron.vocab_parallel`), computed only at the positions that predict the response.

Padding-free micro-batches (``remove_padding``, with :class:`~ppo_core.workers.megatron.model.SDPACoreAttention`):
each micro-batch's valid tokens run as one packed sequence ``[1, T]`` (:mod:`ppo_core.workers.packing`) with
megatron's ``PackedSeqParams`` (``qkv_format="thd"``), so no padding token is computed and attention never needs a
``[b, 1, S, S]`` mask; the outputs are unpacked to ``[b, R]``. With sequence parallelism the packed length is
padded to a multiple of TP; with pipeline parallelism every micro-batch of a call is padded to the longest (the
stages exchange activations of one shape).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import nn

from ppo_core.keys import KEYS
from ppo_core.workers._common import first_nonfinite_grad
from ppo_core.workers.config import OptimConfig
from ppo_core.workers.engine import ENTROPY, LOG_PROBS, VALUES, EngineBase, LossFn, OutputSpec, StepResult
from ppo_core.workers.megatron.model import SDPACoreAttention, logits_window, packed_seq_params
from ppo_core.workers.megatron.optim import clip_grads, grad_norm, speed_up_megatron_optimizer
from ppo_core.workers.megatron.parallel import MegatronLayout
from ppo_core.workers.megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy
from ppo_core.workers.packing import PackedMicroBatch, pack_micro_batch

__all__ = ["MegatronEngine", "megatron_attention_mask", "position_ids"]


def megatron_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Megatron's boolean mask ``[B, 1, S, S]`` (``True`` = masked) for padded rows, or None when nothing is padded.

    A query attends to earlier non-padding keys and always to itself, so that padding rows stay finite.

    Example:
        >>> megatron_attention_mask(torch.ones(2, 3)) is None
        True
        >>> megatron_attention_mask(torch.tensor([[0, 1, 1]]))[0, 0].int()
        tensor([[0, 1, 1],
                [1, 0, 1],
                [1, 0, 0]], dtype=torch.int32)
    """
    valid = attention_mask.bool()
    if bool(valid.all()):
        return None
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).tril()
    allowed = causal & valid[:, None, None, :]
    allowed |= torch.eye(s, dtype=torch.bool, device=valid.device)
    return ~allowed


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` positions counting only non-padding tokens (0 on left padding).

    Example:
        >>> position_ids(torch.tensor([[0, 1, 1]]))
        tensor([[0, 0, 1]])
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


@dataclasses.dataclass(frozen=True, eq=False)
class _Inputs:
    """A micro-batch and what the model is called with: padded rows, or one packed sequence."""

    micro: TensorDictBase
    input_ids: torch.Tensor
    """``[b, S]`` padded, ``[1, T]`` packed."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    packed: PackedMicroBatch | None = None
    params: Any = None
    """megatron ``PackedSeqParams`` of a packed sequence."""


class MegatronEngine(EngineBase):
    """This rank's stage of a megatron-core ``GPTModel``, trained (``optim`` given) or frozen.

    Args:
        module: the ``GPTModel`` stage on ``device``; a value model ends in a
            :class:`~ppo_core.workers.megatron.model.ValueHead`.
        layout: this rank's place in the TP x CP x DP x PP grid (megatron's parallel state is initialised).
        device: where the model and the micro-batches live.
        head: ``"policy"`` or ``"value"``.
        vocab_size: the true vocabulary (padded logit columns are excluded from the softmax).
        optim: optimiser settings; None builds a frozen forward-only engine (a reference policy; PP = 1).
        use_distributed_optimizer: shard the fp32 master weights and Adam moments over dp (megatron ZeRO-1).
        remove_padding: run micro-batches padding-free when the model's attention is
            :class:`~ppo_core.workers.megatron.model.SDPACoreAttention` (see the module docstring).
    """

    checkpoint_weights_only = False  # megatron's optimizer state holds more than tensors

    def __init__(
        self,
        module: nn.Module,
        *,
        layout: MegatronLayout,
        device: torch.device,
        head: str = "policy",
        vocab_size: int,
        optim: OptimConfig | None = None,
        use_distributed_optimizer: bool = False,
        remove_padding: bool = True,
    ) -> None:
        from megatron.core import parallel_state as ps

        self.use_distributed_optimizer = use_distributed_optimizer
        model, optimizer = (module.eval(), None) if optim is None else self._wrap(module, optim, device)
        super().__init__(module, model, head=head, device=device, optim=optim, optimizer=optimizer)
        self.dp_rank, self.dp_size, self.is_collect_rank = (
            layout.dp_rank,
            layout.dp_size,
            layout.is_collect_rank,
        )
        self.layout, self.vocab_size = layout, vocab_size
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._dp_group = ps.get_data_parallel_group()
        # padding-free micro-batches: asked for, and our attention (megatron's own cannot take packed sequences)
        self.packed = bool(remove_padding) and any(isinstance(m, SDPACoreAttention) for m in module.modules())
        self._sequence_parallel = bool(getattr(getattr(module, "config", None), "sequence_parallel", False))
        # whether the output layer honours a logits window (a policy's last stage without sequence parallelism)
        self._windowed = head == "policy" and logits_window(module, 0, 1).active

    def _wrap(self, module: nn.Module, optim: OptimConfig, device: torch.device) -> tuple[nn.Module, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        tc = module.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=self.use_distributed_optimizer
        )
        model = DistributedDataParallel(config=tc, ddp_config=ddp_config, module=module)
        tc.finalize_model_grads_func = finalize_model_grads
        tc.no_sync_func = model.no_sync
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=optim.lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0],
            adam_beta2=optim.betas[1],
            adam_eps=optim.eps,
            bf16=tc.bf16,
            fp16=tc.fp16,
            params_dtype=tc.params_dtype,
            clip_grad=0.0,  # clipped in optimizer_step, after the non-finite check
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
        optimizer = get_megatron_optimizer(opt_config, [model])
        speed_up_megatron_optimizer(optimizer, device)
        return model, optimizer

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            dist.all_reduce(value, group=self._dp_group)
        return value

    # ----- inputs -------------------------------------------------------------------------------------------
    def _prepare(self, micros: Sequence[TensorDictBase]) -> list[_Inputs]:
        """What the model is called with for each micro-batch (built before a schedule: packing and the padding
        mask synchronise with the host, which must not stall a pipeline)."""
        if not self.packed:
            return [
                _Inputs(
                    m,
                    m[KEYS.input_ids],
                    position_ids(m[KEYS.attention_mask]),
                    megatron_attention_mask(m[KEYS.attention_mask]),
                )
                for m in micros
            ]
        multiple = self.layout.tp_size if self._sequence_parallel else 1
        common = 1
        if self.layout.pp_size > 1:  # the stages exchange [T, 1, D] activations of one T
            common = max(int(m[KEYS.attention_mask].sum()) for m in micros)
        out = []
        for m in micros:
            packed = pack_micro_batch(
                m[KEYS.input_ids],
                m[KEYS.attention_mask],
                m[KEYS.responses].shape[1],
                pad_to_multiple=multiple,
                min_tokens=max(common, 1),
            )
            docs = packed.documents
            out.append(
                _Inputs(
                    m,
                    packed.input_ids[None],
                    docs.position_ids[None],
                    None,
                    packed=packed,
                    params=packed_seq_params(docs),
                )
            )
        return out

    def _call(self, model: nn.Module, inputs: _Inputs) -> torch.Tensor:
        """The model's output for ``inputs``; a policy projects onto the vocabulary only the positions that predict
        responses (``[S - R - 1, S - 1)`` of padded rows, the output positions of a packed sequence)."""
        window: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.head == "policy":
            if inputs.packed is not None:
                window = logits_window(self.module, inputs.packed.output_index)
            else:
                s, r = inputs.input_ids.shape[1], inputs.micro[KEYS.responses].shape[1]
                window = logits_window(self.module, s - r - 1, s - 1)
        with window:
            if inputs.packed is None:
                return model(inputs.input_ids, inputs.position_ids, inputs.attention_mask)
            return model(inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.params)

    # ----- outputs at the response positions ----------------------------------------------------------------
    def _outputs(self, inputs: _Inputs, output: torch.Tensor, spec: OutputSpec) -> dict[str, torch.Tensor]:
        micro, packed = inputs.micro, inputs.packed
        responses = micro[KEYS.responses]
        r = responses.shape[1]
        if self.head == "value":
            if packed is not None:
                return {VALUES: packed.unpack(output[0, packed.output_index, 0].float())}
            return {VALUES: output[:, -r - 1 : -1, 0].float()}
        if packed is not None:
            logits = output[0] if self._windowed else output[0, packed.output_index]  # [n, V/TP]
            labels = packed.labels(responses)
        else:
            logits, labels = output, responses
            if logits.shape[1] != r:  # the model ignored the logits window (sequence parallelism)
                logits = logits[:, -r - 1 : -1]
        if spec.temperature != 1.0:
            logits = logits / spec.temperature
        log_probs, entropy = vocab_parallel_log_probs_and_entropy(
            logits,
            labels,
            self._tp_group,
            vocab_size=self.vocab_size,
            with_entropy=spec.entropy,
            validate=False,  # responses are sampled from this vocabulary; saves two host syncs per micro-batch
        )
        outputs = {LOG_PROBS: log_probs, ENTROPY: entropy} if spec.entropy else {LOG_PROBS: log_probs}
        if packed is not None:
            outputs = {name: packed.unpack(value) for name, value in outputs.items()}
        return outputs

    # ----- forward / backward -------------------------------------------------------------------------------
    def _run(
        self,
        micros: Sequence[TensorDictBase],
        loss_fn: Callable[[_Inputs, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        forward_only: bool,
    ) -> list[dict[str, torch.Tensor]]:
        """One megatron schedule over ``micros``; returns ``loss_fn``'s outputs (last stage only, else [])."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = len(micros)
        if not self.packed and self.layout.pp_size > 1 and len({int(m.batch_size[0]) for m in micros}) > 1:
            raise ValueError(
                "with pipeline parallelism every micro-batch must have the same rows, got "
                f"{[int(m.batch_size[0]) for m in micros]}: make the batch a multiple of the micro-batch size"
            )
        prepared = self._prepare(micros)

        def forward_step(data_iterator: Iterator[Any], model: nn.Module) -> tuple[torch.Tensor, Any]:
            inputs = next(data_iterator)
            out = self._call(model, inputs)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
                loss, metrics = loss_fn(inputs, output)
                # megatron divides the loss by the number of micro-batches; our losses are already shares
                return loss * n, metrics

            return out, loss_func

        rows, seq = prepared[0].input_ids.shape
        run = partial(
            get_forward_backward_func(),
            forward_step_func=forward_step,
            data_iterator=iter(prepared),
            model=[self.model],
            num_microbatches=n,
            seq_length=int(seq),
            micro_batch_size=int(rows),
            forward_only=forward_only,
        )
        if forward_only:
            with torch.no_grad():
                return list(run())
        return list(run())

    def _frozen_forward(
        self, micros: Sequence[TensorDictBase], spec: OutputSpec
    ) -> list[dict[str, torch.Tensor]]:
        if self.layout.pp_size > 1:
            raise ValueError(
                "a frozen megatron engine (reference policy) with PP > 1 needs its own worker group"
            )
        with torch.no_grad():
            return [self._outputs(i, self._call(self.model, i), spec) for i in self._prepare(micros)]

    def forward(self, micros: Sequence[TensorDictBase], spec: OutputSpec) -> list[dict[str, torch.Tensor]]:
        if self.optimizer is None:
            return self._frozen_forward(micros, spec)

        def outputs(inputs: _Inputs, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return output.new_zeros(()), self._outputs(inputs, output, spec)

        return self._run(micros, outputs, forward_only=True)

    def forward_backward(
        self, micros: Sequence[TensorDictBase], loss_fn: LossFn, spec: OutputSpec
    ) -> list[dict[str, torch.Tensor]]:
        self._trained()

        def loss(inputs: _Inputs, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return loss_fn(inputs.micro, self._outputs(inputs, output, spec))

        return self._run(micros, loss, forward_only=False)

    # ----- optimiser and state ------------------------------------------------------------------------------
    def optimizer_step(self) -> StepResult:
        """Clip and step (skipped, as in verl, when the gradient norm is not finite); clear the gradients."""
        optim, opt = self._trained()
        found_inf = opt.prepare_grads()
        norm = grad_norm(opt) if not found_inf else math.inf
        bad = None
        if math.isfinite(norm):
            if optim.grad_clip is not None:
                clip_grads(opt, optim.grad_clip, norm)
            opt.step_with_ready_grads()
        else:
            grads = ((n, getattr(p, "main_grad", p.grad)) for n, p in self.module.named_parameters())
            bad = first_nonfinite_grad(grads)
        self.zero_grad()
        return StepResult(grad_norm=norm, nonfinite_grad=bad)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self._trained()[1].zero_grad()

    def state_dict(self) -> dict[str, Any]:
        opt = self._trained()[1]
        state = {"model": self.module.state_dict(), "optimizer": opt.state_dict()}
        if self.use_distributed_optimizer:
            state["optimizer_shard"] = opt.get_parameter_state_dp_reshardable()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        opt = self._trained()[1]
        self.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if self.use_distributed_optimizer:
            opt.load_parameter_state_from_dp_reshardable(state["optimizer_shard"])
