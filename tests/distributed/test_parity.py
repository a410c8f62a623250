"""One training step at every parallel layout equals the single-rank step.

Compared tensor by tensor (whole tensors reassembled from the shards): the loss, every
parameter's gradient, the gradient norm and the parameters after an SGD step (Adam amplifies
rounding, so SGD keeps the comparison tight). Negative controls prove the comparison can fail:
a deliberately mis-mapped shard and a removed CPU patch must both be caught.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import DistributedTestError, run_distributed
from tests.distributed.dpo_harness import assert_same_tensors

GLOBAL_BATCH = 8
MICRO_BATCH = 2
SEQ = 32
SEED = 1234
# fp32 on CPU: reductions in a different order differ by a few ulps; relative to the tensors'
# scale the layouts agree to ~1e-6 (measured), so 1e-5 leaves headroom without hiding a bug.
RTOL, ATOL = 1e-5, 1e-7

LAYOUTS = {
    "dp4": dict(tp=1, pp=1),
    "dp4-adam": dict(tp=1, pp=1, adam=True),
    "dp4-distopt": dict(tp=1, pp=1, distopt=True),
    "tp2": dict(tp=2, pp=1),
    "tp2-sp": dict(tp=2, pp=1, sp=True),
    "pp2": dict(tp=1, pp=2),
    "tp2xpp2": dict(tp=2, pp=2),
    "tp2xpp2-sp": dict(tp=2, pp=2, sp=True),
    "pp2-vpp2": dict(tp=1, pp=2, vpp=2),
    "tp2-distopt": dict(tp=2, pp=1, distopt=True),
}


def _batches(dp_rank: int, dp_size: int):
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, 512, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    per_rank = GLOBAL_BATCH // dp_size
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return [
        dict(tokens=mine[i : i + MICRO_BATCH, :-1], labels=mine[i : i + MICRO_BATCH, 1:],
             loss_mask=torch.ones(MICRO_BATCH, SEQ))
        for i in range(0, per_rank, MICRO_BATCH)
    ]


def one_step(*, tp=1, pp=1, vpp=None, sp=False, distopt=False, adam=False, preset="tiny", corrupt=None, bf16=False):
    """Run one optimizer step at a layout; return loss, grad norm, whole grads and whole params.

    SGD by default. Megatron's distributed optimizer only supports Adam; there a large epsilon
    keeps Adam's update smooth in the gradient (plain Adam is ~sign(g) for tiny g, which turns
    ulp-level gradient differences into lr-sized parameter differences).
    """
    adam = adam or distopt
    from megatron.core import parallel_state

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.global_state import gather_global_state, replica_differences
    from megatron_prune.model.provider import ParallelConfig
    from tests.distributed.lm_step import lm_forward_step
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import forward_backward, reduce_metrics

    parallel = ParallelConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sp,
        bf16=bf16,
    )
    with model_parallel(parallel, seed=SEED):
        model = setup_model(get_preset(preset), parallel, seed=SEED, use_distributed_optimizer=distopt)
        if corrupt is not None:
            corrupt(model)
        optim = (
            OptimConfig(optimizer="adam", lr=0.01, adam_eps=1e-3, clip_grad=1.0, use_distributed_optimizer=distopt)
            if adam
            else OptimConfig(optimizer="sgd", lr=0.5, clip_grad=1.0)
        )
        optimizer = build_optimizer(model, optim, bf16=bf16)
        inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        adam_kernels = {bool(g.get("fused")) for o in inner if isinstance(o, torch.optim.AdamW)
                        for g in o.param_groups}
        dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        batches = _batches(dp_rank, dp_size)
        initial = gather_global_state(model)
        data = iter(batches) if vpp is None else [iter(batches) for _ in range(vpp)]
        outputs = forward_backward(
            model=model, optimizer=optimizer, forward_step_func=lm_forward_step, data_iterator=data,
            num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        )
        metrics = reduce_metrics(outputs)
        # With the distributed optimizer each DP rank holds only its reduce-scattered slice of
        # the gradient buffer; there the grad norm and the updated parameters are compared.
        grads = None if distopt else gather_global_state(model, source="main_grad")
        _, grad_norm, _ = optimizer.step()
        params = gather_global_state(model)
        diverged = replica_differences(model)
    return dict(loss=metrics["lm_loss"], grad_norm=grad_norm, grads=grads, params=params, initial=initial,
                adam_kernels=adam_kernels, diverged=diverged, grads_sliced=distopt)


def run_layouts(names: list[str]) -> dict:
    return {name: one_step(**LAYOUTS[name]) for name in names}


def _swap_tp_shard_of_qkv(model) -> None:
    """Negative control: TP rank 1 gets rank 0's rows of layer 0's QKV weight."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    chunk = model[0].module
    if chunk.pre_process:
        weight = chunk.decoder.layers[0].self_attention.linear_qkv.weight
        group = parallel_state.get_tensor_model_parallel_group()
        dist.broadcast(weight.data, src=dist.get_global_rank(group, 0), group=group)


def corrupted_step() -> dict:
    return one_step(tp=2, corrupt=_swap_tp_shard_of_qkv)


def step_without_patch(patch_name: str) -> None:
    from megatron_prune.patches import revert_patches
    from megatron_prune.patches.registry import _APPLIED, apply_patches

    assert patch_name in _APPLIED, f"{patch_name} was not applied"
    revert_patches("cpu")
    apply_patches("cpu", names=[n for n in _registered_cpu() if n != patch_name])
    one_step(tp=2, sp=True)


def _registered_cpu() -> list[str]:
    from megatron_prune.patches import registered

    return [p.name for p in registered("cpu")]


def assert_same_step(ref: dict, got: dict, label: str) -> None:
    # Every copy of a weight (DP replicas, TP-replicated norms, the tied head) took the same step.
    assert got["diverged"] == [], f"{label}: copies on different ranks differ after the step: {got['diverged'][:5]}"
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=RTOL, atol=0, msg=f"{label}: loss")
    torch.testing.assert_close(got["grad_norm"], ref["grad_norm"], rtol=RTOL, atol=0, msg=f"{label}: grad norm")
    assert_same_tensors(ref, got, label, rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def references() -> dict:
    return run_distributed(run_layouts, 1, names=["dp4", "dp4-adam"])[0]


@pytest.fixture(scope="module")
def reference(references) -> dict:
    return references["dp4"]


@pytest.fixture(scope="module")
def layout_results() -> dict:
    return run_distributed(run_layouts, 4, names=list(LAYOUTS))[0]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(references, layout_results, layout):
    adam = "adam" in layout or "distopt" in layout
    ref = references["dp4-adam" if adam else "dp4"]
    assert_same_step(ref, layout_results[layout], layout)
    # Megatron's torch-AdamW fallback (no TE/Apex here) runs torch's fused kernel on every group.
    assert layout_results[layout]["adam_kernels"] == ({True} if adam else set())


@pytest.mark.distributed
def test_tied_embeddings_pp2_matches_single_rank():
    ref = run_distributed(one_step, 1, preset="tiny-tied")[0]
    results = run_distributed(one_step, 2, pp=2, preset="tiny-tied")
    assert_same_step(ref, results[0], "tied pp2")


def diverged_replica() -> dict:
    """Negative control: after the step, data-parallel rank 1's copy of the final norm moves."""
    from megatron.core import parallel_state

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.global_state import replica_differences
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    with model_parallel(ParallelConfig(), seed=SEED):
        model = setup_model(get_preset("tiny"), ParallelConfig(), seed=SEED)
        agree = replica_differences(model)
        if parallel_state.get_data_parallel_rank() == 1:
            with torch.no_grad():
                model[0].module.decoder.final_layernorm.weight.add_(1e-6)
        return dict(agree=agree, diverged=replica_differences(model))


@pytest.mark.distributed
def test_a_diverged_replica_is_caught():
    got = run_distributed(diverged_replica, 2)[0]
    assert got["agree"] == [] and got["diverged"] == ["decoder.final_layernorm.weight"]


@pytest.mark.distributed
def test_mismapped_shard_is_caught(reference):
    bad = run_distributed(corrupted_step, 2)[0]
    with pytest.raises(AssertionError):
        assert_same_step(reference, bad, "corrupted tp2")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "patch_name",
    ["cpu.mappings._gather_along_first_dim", "cpu.get_default_causal_mask", "cpu._ParamAndGradBuffer.__init__"],
)
def test_removing_a_cpu_patch_breaks_the_step(patch_name):
    with pytest.raises(DistributedTestError, match="CUDA|cuda"):
        run_distributed(step_without_patch, 2, patch_name=patch_name)


@pytest.mark.distributed
def test_bf16_tp2_sp_step_tracks_fp32(reference):
    """bf16 parameters with fp32 main weights run at TP=2+SP and stay close to the fp32 step."""
    got = run_distributed(one_step, 2, tp=2, sp=True, bf16=True)[0]
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-2)
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=5e-2)
    moved = 0
    for key, expected in reference["params"].items():
        torch.testing.assert_close(got["params"][key], expected, rtol=2e-2, atol=2e-3, msg=key)
        # The update itself, not only the weights (an update smaller than atol would pass above):
        # where fp32 moves a weight by several bf16 ulps, the bf16 step moves it the same way.
        before = got["initial"][key].float()
        want, step = (expected - reference["initial"][key]).float(), got["params"][key].float() - before
        ulp = torch.ldexp(torch.ones_like(before), torch.frexp(before)[1] - 8)  # bf16's spacing at each weight
        visible = want.abs() > 4 * ulp
        if visible.any():
            moved += 1
            cosine = torch.nn.functional.cosine_similarity(step[visible], want[visible], dim=0)
            assert cosine > 0.9, (key, float(cosine))
    assert moved >= len(reference["params"]) // 2, f"only {moved} tensors moved by more than bf16's rounding"
