"""The local layer spec's own RMSNorm and SwiGLU are the functions a built model runs.

Both keep only their inputs for the backward (``megatron_prune/model/norm.py``, ``swiglu.py``);
their numerics are tested alone in ``tests/unit/model``. Here: a model built the way the trainers
build it runs them in every place they belong (found in the autograd graph of a real forward), so
a wiring change that falls back to Megatron's ops, which compute the same values while keeping
more memory, fails a test instead of passing silently.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.dist import run_distributed

pytestmark = pytest.mark.distributed


def _backward_nodes(preset: str) -> dict:
    import torch

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    arch = get_preset(preset)
    with model_parallel(ParallelConfig(), seed=3):
        model = setup_model(arch, ParallelConfig(), seed=3)[0]
        ids = torch.randint(0, arch.vocab_size, (2, 8))
        logits = model(ids, torch.arange(8).expand(2, 8), None)
        seen, stack, names = set(), [logits.grad_fn], Counter()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            names[type(node).__name__] += 1
            stack.extend(fn for fn, _ in node.next_functions)
    return {"layers": arch.num_layers, "qk_norm": arch.qk_norm, "names": dict(names)}


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_built_model_runs_the_specs_norm_and_swiglu(preset):
    (found,) = run_distributed(_backward_nodes, 1, preset=preset)
    layers, names = found["layers"], found["names"]
    # Per layer: the attention and MLP input norms (+ q and k norms), and the final norm.
    norms = layers * (2 + 2 * found["qk_norm"]) + 1
    assert names.get("_RMSNormFunctionBackward", 0) == norms, names
    # A dense model's MLPs take the spec's SwiGLU; a mixture-of-experts model (its dense first
    # layer too) keeps Megatron's own activation.
    assert names.get("_SwiGLUFunctionBackward", 0) == (0 if preset == "tiny-moe" else layers), names


def _te_path_specs(preset: str) -> dict:
    """The Transformer-Engine path's block spec (``provider._te_block_spec``) built on this machine:
    Megatron's real builder is called with the arguments the provider gives it (an argument it does
    not take fails here), only switched to its local modules, since Transformer Engine needs a GPU."""
    import megatron.core.models.gpt.gpt_layer_specs as specs

    from megatron_prune.model import provider
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.moe import GroupMeanZLossRouter
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel

    real = specs.get_gpt_decoder_block_spec
    calls = []

    def without_te(config, use_transformer_engine, *args, **kwargs):
        calls.append(use_transformer_engine)
        return real(config, False, *args, **kwargs)

    arch = get_preset(preset)
    par = ParallelConfig(transformer_engine=True)
    specs.get_gpt_decoder_block_spec = without_te
    try:
        with model_parallel(par, seed=3):
            config = provider.transformer_config(arch, par)
            spec = provider._te_block_spec(arch, config, None)
    finally:
        specs.get_gpt_decoder_block_spec = real
    routers = [getattr(getattr(layer.submodules.mlp, "submodules", None), "router", None) for layer in spec.layer_specs]
    from megatron.core.transformer.identity_op import IdentityOp

    qk_norm = [layer.submodules.self_attention.submodules.q_layernorm is not IdentityOp for layer in spec.layer_specs]
    return dict(calls=calls, qk_norm=qk_norm, num_layers=len(spec.layer_specs),
                routers=[r is GroupMeanZLossRouter if r is not None else None for r in routers])


@pytest.mark.parametrize("preset, routers", [("tiny", [None] * 4), ("tiny-moe", [None, True, True, True])])
def test_transformer_engine_path_builds_with_our_router(preset, routers):
    """The spec of a GPU with Transformer Engine (the default there) builds — it used to pass Megatron
    0.16's builder an argument it does not take, so no model could be built — and its MoE layers
    get the router whose z-loss is the mean over the whole sequence-parallel group."""
    got = run_distributed(_te_path_specs, 1, preset=preset)[0]
    assert got["calls"] == [True]
    assert got["qk_norm"] == [True] * 4  # the presets' QK norm reaches the builder through the config
    assert got["routers"] == routers
