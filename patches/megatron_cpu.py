"""CPU support for Megatron-Core: the places that assume CUDA, rebound for the CPU/gloo path.

Applied only when the accelerator is CPU (see :func:`megatron_prune.patches.apply_cpu_patches`);
on GPU and NPU nothing here runs. Each entry names its target, its reason and the versions it was
checked on. Literal CUDA devices inside long functions are rewritten textually (exact strings that
must still be present), so the rest of the function stays Megatron's own.
"""

from __future__ import annotations

import functools

import torch

from .registry import Patch, register, rewrite_source

GROUP = "cpu"
CHECKED = ("0.16.1",)

_CUR = "torch.cuda.current_device()"


def _cpu(name: str, target: str, reason: str, *replacements: tuple[str, str]) -> None:
    register(
        Patch(
            name=f"cpu.{name}",
            target=target,
            reason=reason,
            build=rewrite_source(*replacements),
            group=GROUP,
            checked_versions=CHECKED,
        )
    )


# --- attention masks -----------------------------------------------------------------------
_cpu(
    "get_default_causal_mask",
    "megatron.core.transformer.utils.get_default_causal_mask",
    "the causal mask is allocated with device='cuda' (also imported by name in fused_softmax)",
    ('device="cuda"', 'device="cpu"'),
)

# --- tensor-parallel communication buffers ---------------------------------------------------
# gloo all-gathers equal shapes only: an uneven gather (the MoE token dispatchers at TP > 1) is
# gathered padded to the largest piece, then each piece is copied out.
_UNEVEN_ALL_GATHER = (
    "torch.distributed.all_gather(output_tensor_list, input_, group=group)",
    "_mp_pad = max(output_split_sizes)\n"
    "        _mp_bufs = [input_.new_empty([_mp_pad] + dim_size[1:]) for _ in output_split_sizes]\n"
    "        _mp_in = torch.cat([input_, input_.new_zeros([_mp_pad - input_.shape[0]] + dim_size[1:])])\n"
    "        torch.distributed.all_gather(_mp_bufs, _mp_in.contiguous(), group=group)\n"
    "        for _mp_out, _mp_buf, _mp_n in zip(output_tensor_list, _mp_bufs, output_split_sizes):\n"
    "            _mp_out.copy_(_mp_buf[:_mp_n])",
)
for _fn in ("_gather_along_last_dim", "_gather_along_first_dim", "_reduce_scatter_along_first_dim"):
    _cpu(
        f"mappings.{_fn}",
        f"megatron.core.tensor_parallel.mappings.{_fn}",
        "TP collective output buffers are allocated on torch.cuda.current_device()"
        + ("; gloo cannot all-gather uneven pieces" if _fn == "_gather_along_first_dim" else ""),
        (_CUR, "input_.device"),
        *((_UNEVEN_ALL_GATHER,) if _fn == "_gather_along_first_dim" else ()),
    )

_cpu(
    "GlobalMemoryBuffer.get_tensor",
    "megatron.core.utils.GlobalMemoryBuffer.get_tensor",
    "the global memory buffer (sequence-parallel all-gather) is allocated on the current CUDA device",
    (_CUR, '"cpu"'),
)

# --- pipeline p2p and schedules -------------------------------------------------------------
_cpu(
    "P2PCommunicator._communicate_shapes",
    "megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator._communicate_shapes",
    "variable-shape p2p exchanges shape tensors on the current CUDA device and syncs CUDA",
    (_CUR, '"cpu"'),
    ("torch.cuda.synchronize()", "pass"),
)
_cpu(
    "P2PCommunicator._communicate",
    "megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator._communicate",
    "p2p receive buffers are allocated on the current CUDA device; it syncs CUDA after batched p2p",
    (_CUR, '"cpu"'),
    ("torch.cuda.synchronize()", "pass"),
)
for _sched in (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
):
    _cpu(
        f"schedules.{_sched}",
        f"megatron.core.pipeline_parallel.schedules.{_sched}",
        "the schedule's token counter is a literal device='cuda' tensor",
        ('device="cuda"', 'device="cpu"'),
    )

# --- RoPE -----------------------------------------------------------------------------------
_cpu(
    "RotaryEmbedding.get_emb",
    "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb",
    "RoPE moves inv_freq from CPU to the current CUDA device at the first forward",
    ("self.inv_freq.device.type == 'cpu'", "False"),
)

# --- optimizer and gradient clipping ----------------------------------------------------------
_cpu(
    "MixedPrecisionOptimizer.__init__",
    "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer.__init__",
    "bf16/fp16 optimizers keep found_inf and scale tensors on device='cuda'",
    ("device='cuda'", "device='cpu'"),
)
_cpu(
    "Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
    "parameter types are checked against the CUDA tensor type names",
    ("'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'", "'torch.HalfTensor', 'torch.BFloat16Tensor'"),
    ("param.type() == 'torch.cuda.FloatTensor'", "param.type() == 'torch.FloatTensor'"),
)
_cpu(
    "DistributedOptimizer._build_model_and_main_param_groups",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
    "parameter types are checked against the CUDA tensor type names",
    ("'torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor'", "'torch.HalfTensor', 'torch.BFloat16Tensor'"),
    ("model_param.type() == 'torch.cuda.FloatTensor'", "model_param.type() == 'torch.FloatTensor'"),
)
_cpu(
    "get_grad_norm_fp32",
    "megatron.core.optimizer.clip_grads.get_grad_norm_fp32",
    "the gradient norm is reduced in device='cuda' tensors",
    ("device='cuda'", "device='cpu'"),
)
_cpu(
    "clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
    "gradient types are asserted to be torch.cuda.FloatTensor",
    ("param.grad.type() == 'torch.cuda.FloatTensor'", "param.grad.type() == 'torch.FloatTensor'"),
    ("device='cuda'", "device='cpu'"),
)
_cpu(
    "count_zeros_fp32",
    "megatron.core.optimizer.clip_grads.count_zeros_fp32",
    "the zero counter is a device='cuda' tensor",
    ("device='cuda'", "device='cpu'"),
)
_cpu(
    "local_multi_tensor_l2_norm",
    "megatron.core.utils.local_multi_tensor_l2_norm",
    "the apex-free L2 norm fallback returns a device='cuda' tensor",
    ('device="cuda"', 'device="cpu"'),
)


# --- RNG tracker: the CUDA generator becomes the CPU generator ----------------------------------
def _cpu_get_rng_state(original):
    @functools.wraps(original)
    def get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    return get_rng_state


def _cpu_set_rng_state(original):
    @functools.wraps(original)
    def set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return set_rng_state


register(
    Patch(
        name="cpu.random._get_cuda_rng_state",
        target="megatron.core.tensor_parallel.random._get_cuda_rng_state",
        reason="the model-parallel RNG tracker reads the CUDA generator; on CPU it uses torch's",
        build=_cpu_get_rng_state,
        group=GROUP,
        checked_versions=CHECKED,
    )
)
register(
    Patch(
        name="cpu.random._set_cuda_rng_state",
        target="megatron.core.tensor_parallel.random._set_cuda_rng_state",
        reason="the model-parallel RNG tracker writes the CUDA generator; on CPU it uses torch's",
        build=_cpu_set_rng_state,
        group=GROUP,
        checked_versions=CHECKED,
    )
)
_cpu(
    "CudaRNGStatesTracker.add",
    "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add",
    "tracker states are created with torch.cuda.get_rng_state/manual_seed",
    ("torch.cuda.get_rng_state()", "torch.get_rng_state()"),
    ("torch.cuda.manual_seed(seed)", "torch.manual_seed(seed)"),
)
_cpu(
    "CudaRNGStatesTracker.fork",
    "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork",
    "fork warns when the CPU generator changes, which on CPU is the tracked generator itself",
    ("if not torch.all(cpu_rng_state == torch.get_rng_state()).item():", "if False:"),
)

# --- DDP gradient buffers ---------------------------------------------------------------------
_cpu(
    "_ParamAndGradBuffer.__init__",
    "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__",
    "DDP's contiguous param/grad buffers are allocated on torch.cuda.current_device()",
    (_CUR, '"cpu"'),
)
_cpu(
    "FP32Optimizer.__init__",
    "megatron.core.optimizer.optimizer.FP32Optimizer.__init__",
    "the fp32 optimizer's unit loss scale is a device='cuda' tensor",
    ("device='cuda'", "device='cpu'"),
)

# --- tensor-parallel linear backward -----------------------------------------------------------
_cpu(
    "LinearWithGradAccumulationAndAsyncCommunication.backward",
    "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward",
    "the sequence-parallel all-gather buffer in backward is allocated on the current CUDA device",
    (_CUR, "input.device"),
)

# --- tied embeddings across pipeline stages ------------------------------------------------------
_cpu(
    "LanguageModule.setup_embeddings_and_output_layer",
    "megatron.core.models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer",
    "the shared embedding/output weight is moved with .cuda() before the embedding-group all-reduce",
    ("weight.data = weight.data.cuda()", "pass"),
)

# --- dist checkpointing ------------------------------------------------------------------------
_cpu(
    "FileSystemWriterAsync.preload_tensors",
    "megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync.preload_tensors",
    "checkpoint writing synchronises CUDA after staging tensors to host memory",
    ("torch.cuda.synchronize()", "pass"),
)
_cpu(
    "save_state_dict_async_finalize",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver.save_state_dict_async_finalize",
    "the save-failure flag is all-reduced in a tensor on the current CUDA device",
    (_CUR, '"cpu"'),
)

# --- mixture of experts: router and all-to-all token dispatcher ------------------------------------
_cpu(
    "Router.gating",
    "megatron.core.transformer.moe.router.Router.gating",
    "the router moves CPU-resident weights to the current CUDA device at the first forward",
    ("if self.weight.device.type == 'cpu':", "if False:"),
    ("if self.bias is not None and self.bias.device.type == 'cpu':", "if False:"),
)
_cpu(
    "mappings._AllToAll.forward",
    "megatron.core.tensor_parallel.mappings._AllToAll.forward",
    "the all-to-all-v output buffer is allocated on torch.cuda.current_device()",
    (_CUR, "input.device"),
)
_cpu(
    "moe_utils.maybe_move_tensor_to_cpu",
    "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu",
    "only CUDA tensors become the host-side split sizes (numpy) that all-to-all-v takes",
    ("if torch.is_tensor(tensor) and tensor.is_cuda:", "if torch.is_tensor(tensor) and (tensor.is_cuda or as_numpy):"),
)
_cpu(
    "MoEAlltoAllTokenDispatcher.__init__",
    "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.__init__",
    "the all-to-all dispatcher creates a CUDA side stream for its device-to-host copies",
    ("MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()", "pass"),
)
_cpu(
    "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
    "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
    "the split sizes are copied to the host on a CUDA side stream and synchronised with a CUDA event",
    ("on_side_stream = torch.cuda.current_stream() != self.cuda_dtoh_stream", "on_side_stream = False"),
    ("with torch.cuda.stream(self.cuda_dtoh_stream):", "if True:"),
    ("self.d2h_event = self.cuda_dtoh_stream.record_event()", "self.d2h_event = None"),
    ("self.d2h_event.synchronize()", "pass"),
)
