"""HF <-> Megatron conversion, verified numerically at every layout.

One 4-rank gloo launch does all Megatron-side work (each launch costs ~10 s): for every tiny
architecture it converts the HF model at TP=2 x PP=2, compares logits with transformers at
TP=1 (DP=4), TP=2, PP=2 and TP=2 x PP=2, and exports back to HF; it runs the negative controls
(a wrong QKV interleave, swapped gate/up, wrong rope base, rope scaling dropped) through the same
comparison; and it trains one SGD step on a converted model, saves it as the trainer does and
exports it. The bf16, sharded Qwen2 goes through the three command-line tools (their ``main``, on
the same 4 ranks, as under torchrun); the compare tool also checks the 4-layer Qwen3 at PP=2 x
VPP=2. The tests then read the results and check the exported directories with transformers in
the test process; one more runs an exporter as a plain single-process ``python tools/...`` command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist import run_distributed
from tests.unit.model.hf_models import FAKE_ASSETS, KINDS, load_hf_model, make_hf_model

LAYOUTS = {
    "tp1": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
    "tp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1),
    "pp2": dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2),
    "tp2xpp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
}
# fp32 on CPU, logits of order 1: measured max |delta logits| is exactly 0 at TP=1 and PP=2 and
# 1.2e-6 to 2.2e-6 with TP=2 (a different reduction order). The negative controls measure 3.8
# (QKV concatenated), 1.3 (gate/up swapped), 0.58 (rope base) and 4.7e-3 (llama3 scaling dropped).
TOLERANCE = 1e-4
TRAINED_KIND = "qwen3-tied"
CLI_KIND = "qwen2"  # bf16 and sharded: converted, compared and exported through the tools
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextlib.contextmanager
def _plain_qkv_concatenation():
    """Negative control: concatenate q, k, v whole instead of interleaving them per query group."""
    from megatron_prune.model import hf_mapping

    original = hf_mapping.interleave_qkv
    hf_mapping.interleave_qkv = lambda q, k, v, *, arch: torch.cat([q, k, v])
    try:
        yield
    finally:
        hf_mapping.interleave_qkv = original


class _Renamed(dict):
    """Negative control: an HF state dict in which two tensors swap names."""

    def __init__(self, hf, swaps: dict[str, str]):
        super().__init__({swaps.get(name, name): hf[name] for name in hf})


def _controlled_comparison(hf_dir: str, *, arch_change: dict | None = None, qkv_plain: bool = False,
                           swap_gate_up: bool = False):
    from megatron_prune.model import hf_convert
    from megatron_prune.model.provider import ParallelConfig

    arch = dataclasses.replace(hf_convert.read_hf_arch(hf_dir), **(arch_change or {}))
    parallel = ParallelConfig(**LAYOUTS["tp2"])
    with hf_convert.HFCheckpoint(hf_dir) as lazy:
        hf = dict(lazy.items())
    if swap_gate_up:
        swaps = {}
        for layer in range(arch.num_layers):
            gate, up = f"model.layers.{layer}.mlp.gate_proj.weight", f"model.layers.{layer}.mlp.up_proj.weight"
            swaps.update({gate: up, up: gate})
        hf = _Renamed(hf, swaps)
    return logits_against_hf(hf_dir, hf=hf, arch=arch, parallel=parallel,
                             fill_context=_plain_qkv_concatenation if qkv_plain else contextlib.nullcontext)


def logits_against_hf(hf_dir: str, *, hf, arch, parallel, fill_context=contextlib.nullcontext):
    """Fill Megatron chunks at ``parallel`` from the HF tensors ``hf`` (inside ``fill_context()``)
    and compare their logits with transformers' model in ``hf_dir``; every rank gets the result."""
    from megatron_prune.model import hf_convert
    from megatron_prune.model.provider import build_model_chunks
    from megatron_prune.training.parallel import broadcast_object, model_parallel

    tokens = hf_convert.comparison_tokens(vocab_size=arch.vocab_size, batch_size=2, seq_length=32, seed=0)
    with model_parallel(parallel):
        chunks = build_model_chunks(arch, parallel)
        for chunk in chunks:
            chunk.eval()
        with fill_context():
            hf_convert.fill_model_from_hf(chunks, hf=hf, arch=arch)
        logits = hf_convert.megatron_logits(chunks, tokens)
    result = None
    if torch.distributed.get_rank() == 0:
        result = hf_convert.compare_logits(hf_convert.hf_logits(hf_dir, tokens), logits)
    return broadcast_object(result)


def _train_one_step_and_export(*, converted: str, trained: str, hf_out: str) -> dict:
    """Load a converted model at TP=2 x PP=2, take one SGD step, save like the trainer, export."""
    from megatron_prune.model import hf_convert
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import load_checkpoint, read_arch, save_checkpoint
    from tests.distributed.lm_step import lm_forward_step
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import forward_backward

    arch = read_arch(converted)
    parallel = ParallelConfig(**LAYOUTS["tp2xpp2"])
    gen = torch.Generator().manual_seed(5)
    data = torch.randint(0, arch.vocab_size, (2, 17), generator=gen)
    batch = dict(tokens=data[:, :-1], labels=data[:, 1:], loss_mask=torch.ones(2, 16))
    tokens = hf_convert.comparison_tokens(vocab_size=arch.vocab_size, batch_size=2, seq_length=32, seed=1)
    with model_parallel(parallel):
        model = setup_model(arch, parallel, seed=11)
        load_checkpoint(converted, model=model, arch=arch)
        before = hf_convert.megatron_logits(model, tokens)
        optimizer = build_optimizer(model, OptimConfig(optimizer="sgd", lr=1.0, clip_grad=0.0), bf16=False)
        forward_backward(model=model, optimizer=optimizer, forward_step_func=lm_forward_step,
                         data_iterator=iter([batch]), num_microbatches=1, seq_length=16, micro_batch_size=2)
        optimizer.step()
        after = hf_convert.megatron_logits(model, tokens)
        save_checkpoint(trained, iteration=1, model=model, arch=arch)
    hf_convert.export_megatron_to_hf(load_dir=trained, hf_out=hf_out,
                                     hf_assets=os.path.join(converted, hf_convert.ASSETS_DIR))
    return dict(tokens=tokens, before=before, after=after)


def _tool(name: str):
    """A module of tools/ (not a package), loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"tools_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _through_the_tools(*, hf_dir: str, converted: str, exported: str) -> dict:
    """The three CLIs' ``main`` on 4 ranks, as ``torchrun --nproc-per-node 4 tools/...`` runs them."""
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    codes = {}
    codes["convert"] = _tool("convert_hf_to_megatron").main(["--hf-dir", hf_dir, "--save", converted] + layout)
    compare = _tool("compare_hf_megatron")
    codes["compare"] = compare.main(["--hf-dir", hf_dir, "--load", converted] + layout)
    codes["compare, tolerance too tight"] = compare.main(
        ["--hf-dir", hf_dir, "--load", converted, "--tensor-model-parallel-size", "2", "--tolerance", "1e-12"])
    codes["export"] = _tool("convert_megatron_to_hf").main(
        ["--load", converted, "--hf-out", exported, "--max-shard-size", "50KB"])
    return codes


def _checkpoint_side_errors(*, root: str, hf_dirs: dict[str, str]) -> dict[str, str]:
    """Errors raised before any collective (every rank raises the same), by message."""
    from megatron.core import dist_checkpointing

    from megatron_prune.model import hf_convert
    from megatron_prune.model.provider import ParallelConfig

    converted = os.path.join(root, "llama-megatron")
    ckpt = os.path.join(converted, "iter_0000000")
    metadata = dist_checkpointing.load_tensors_metadata(os.path.join(ckpt, "dist"))
    arch = hf_convert.read_hf_arch(hf_dirs["llama"])
    attempts = {
        "wrong ffn size": lambda: hf_convert._check_checkpoint_tensors(
            metadata, dataclasses.replace(arch, intermediate_size=128), ckpt),
        "untied checkpoint read as tied": lambda: hf_convert._check_checkpoint_tensors(
            metadata, dataclasses.replace(arch, tie_word_embeddings=True), ckpt),
        "non-empty --hf-out": lambda: hf_convert.export_megatron_to_hf(load_dir=converted, hf_out=hf_dirs["llama"]),
        "--hf-assets of another model": lambda: hf_convert.export_megatron_to_hf(
            load_dir=converted, hf_out=os.path.join(root, "never"), hf_assets=hf_dirs["mistral"]),
        "HF model and checkpoint differ": lambda: hf_convert.compare_hf_and_megatron(
            hf_dir=hf_dirs["mistral"], load_dir=converted, parallel=ParallelConfig()),
        "--save holds checkpoints": lambda: hf_convert.convert_hf_to_megatron(hf_dir=hf_dirs["llama"], save_dir=converted),
    }
    errors = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = "no error"
        except (ValueError, FileNotFoundError) as exc:
            errors[name] = str(exc)
    return errors


def conversion_suite(*, root: str, hf_dirs: dict[str, str]) -> dict:
    """Everything Megatron-side, on 4 ranks; the same result on every rank."""
    from megatron_prune.model import hf_convert
    from megatron_prune.model.provider import ParallelConfig

    out: dict = {"logits": {}, "controls": {}}
    for kind, hf_dir in hf_dirs.items():
        converted, exported = os.path.join(root, f"{kind}-megatron"), os.path.join(root, f"{kind}-exported")
        if kind == CLI_KIND:
            out["cli"] = _through_the_tools(hf_dir=hf_dir, converted=converted, exported=exported)
        else:
            hf_convert.convert_hf_to_megatron(hf_dir=hf_dir, save_dir=converted,
                                              parallel=ParallelConfig(**LAYOUTS["tp2xpp2"]))
        for name, layout in LAYOUTS.items():
            out["logits"][kind, name] = hf_convert.compare_hf_and_megatron(
                hf_dir=hf_dir, load_dir=converted, parallel=ParallelConfig(**layout))
        if kind != CLI_KIND:
            hf_convert.export_megatron_to_hf(load_dir=converted, hf_out=exported)
    # Virtual pipeline stages split no reduction: the logits stay exactly those of PP=2 (measured 0).
    out["compare at PP=2 x VPP=2"] = _tool("compare_hf_megatron").main(
        ["--hf-dir", hf_dirs["qwen3"], "--load", os.path.join(root, "qwen3-megatron"), "--pipeline-model-parallel-size",
         "2", "--virtual-pipeline-model-parallel-size", "2", "--tolerance", "1e-6"])
    out["errors"] = _checkpoint_side_errors(root=root, hf_dirs=hf_dirs)
    controls = out["controls"]
    controls["qkv concatenated, not interleaved"] = _controlled_comparison(hf_dirs["qwen3"], qkv_plain=True)
    controls["gate/up swapped"] = _controlled_comparison(hf_dirs["llama"], swap_gate_up=True)
    controls["rope base 1e4 instead of 1e6"] = _controlled_comparison(
        hf_dirs["qwen3-tied"], arch_change=dict(rope_theta=10000.0))
    controls["llama3 rope scaling dropped"] = _controlled_comparison(
        hf_dirs["llama"], arch_change=dict(rope_scaling=None))
    # An architecture recorded with a rope dict of the default type (as checkpoints converted from such a
    # config.json recorded it) builds plain RoPE, not Llama-3 scaling.
    out["default rope dict"] = _controlled_comparison(hf_dirs["mistral"],
                                                      arch_change=dict(rope_scaling={"rope_type": "default"}))
    out["trained"] = _train_one_step_and_export(
        converted=os.path.join(root, f"{TRAINED_KIND}-megatron"),
        trained=os.path.join(root, "trained"), hf_out=os.path.join(root, "trained-exported"))
    return out


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: make_hf_model(kind, str(root / kind), seed=i,
                                dtype=torch.bfloat16 if kind == CLI_KIND else torch.float32,
                                max_shard_size="60KB" if kind == CLI_KIND else None)
            for i, kind in enumerate(KINDS)}


@pytest.fixture(scope="module")
def suite(hf_models, tmp_path_factory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("megatron"))
    results = run_distributed(conversion_suite, 4, root=root, hf_dirs=hf_models)
    return root, results[0]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_hf(suite, kind, layout):
    result = suite[1]["logits"][kind, layout]
    print(f"{kind} {layout}: {result.summary()}")
    assert result.ok(TOLERANCE), f"{kind} at {layout}: {result.summary()}"
    assert result.top1_agreement == 1.0 and result.top5_agreement == 1.0
    assert result.kl_mean < 1e-10


@pytest.mark.distributed
def test_negative_controls_are_flagged(suite):
    for name, result in suite[1]["controls"].items():
        print(f"{name}: {result.summary()}")
        assert not result.ok(TOLERANCE), f"{name} was not detected: {result.summary()}"
        assert result.max_abs_diff > 10 * TOLERANCE, f"{name}: too close to the tolerance to be decisive"


@pytest.mark.distributed
def test_a_rope_dict_of_the_default_type_builds_plain_rope(suite):
    result = suite[1]["default rope dict"]
    assert result.ok(TOLERANCE), result.summary()


@pytest.mark.distributed
def test_checkpoint_side_errors_are_clear(suite):
    errors = suite[1]["errors"]
    assert "linear_fc1.weight has shape [2, 192, 64], expected [2, 256, 64]" in errors["wrong ffn size"]
    assert "output_layer.weight have no HF counterpart" in errors["untied checkpoint read as tied"]
    assert "exists and is not an empty directory" in errors["non-empty --hf-out"]
    assert "describes a different model than the checkpoint" in errors["--hf-assets of another model"]
    assert "describe different models" in errors["HF model and checkpoint differ"]
    assert "already holds checkpoints (iter_0000000" in errors["--save holds checkpoints"]


def _safetensors_state(path: str) -> dict[str, torch.Tensor]:
    from megatron_prune.model.hf_convert import HFCheckpoint

    with HFCheckpoint(path) as hf:
        return {name: hf[name] for name in hf}


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_identical(suite, hf_models, kind):
    exported = os.path.join(suite[0], f"{kind}-exported")
    original, back = _safetensors_state(hf_models[kind]), _safetensors_state(exported)
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    with open(os.path.join(hf_models[kind], "config.json")) as f, open(os.path.join(exported, "config.json")) as g:
        assert json.load(f) == json.load(g)
    for name in list(FAKE_ASSETS) + ["generation_config.json"]:
        with open(os.path.join(hf_models[kind], name), "rb") as f, open(os.path.join(exported, name), "rb") as g:
            assert f.read() == g.read(), name
    assets = os.path.join(suite[0], f"{kind}-megatron", "hf_assets")
    assert "config.json" in os.listdir(assets) and not any(n.endswith(".safetensors") for n in os.listdir(assets))


def _greedy(model, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_exported_model_generates_like_the_original(suite, hf_models, kind):
    prompt = torch.tensor([[5, 17, 42, 99, 3]])
    original = _greedy(load_hf_model(hf_models[kind]), prompt)
    exported = _greedy(load_hf_model(os.path.join(suite[0], f"{kind}-exported")), prompt)
    assert original.shape == (1, 11)
    assert torch.equal(exported, original)


@pytest.mark.distributed
def test_trained_model_exports_and_matches_megatron(suite):
    from megatron_prune.model.hf_convert import compare_logits

    trained = suite[1]["trained"]
    moved = compare_logits(trained["before"], trained["after"])
    assert moved.max_abs_diff > 1e-2, "the SGD step did not change the model"
    model = load_hf_model(os.path.join(suite[0], "trained-exported"))
    with torch.no_grad():
        hf = model(input_ids=trained["tokens"]).logits
    result = compare_logits(hf, trained["after"])
    print(f"trained {TRAINED_KIND} (TP2xPP2) vs exported HF: {result.summary()}")
    assert result.ok(TOLERANCE), result.summary()
    assert _greedy(model, torch.tensor([[7, 8, 9]])).shape == (1, 9)


@pytest.mark.distributed
def test_tools_convert_compare_export(suite, hf_models):
    assert suite[1]["cli"] == {"convert": 0, "compare": 0, "compare, tolerance too tight": 1, "export": 0}
    with open(os.path.join(suite[0], f"{CLI_KIND}-megatron", "iter_0000000", "meta.json")) as f:
        conversion = json.load(f)["hf_conversion"]
    assert conversion["dtype"] == "bfloat16"  # --dtype auto keeps a bf16 model in bf16
    assert (conversion["vocab_size"], conversion["padded_vocab_size"]) == (300, 1024)
    exported = os.path.join(suite[0], f"{CLI_KIND}-exported")
    assert os.path.isfile(os.path.join(exported, "model.safetensors.index.json"))
    assert len([n for n in os.listdir(exported) if n.endswith(".safetensors")]) > 1


@pytest.mark.distributed
def test_compare_tool_runs_virtual_pipeline_stages(suite, hf_models, capsys):
    """PP=2 x VPP=2 on 4 ranks (the interleaved schedule over the model's 4 layers in 4 chunks)
    matches transformers to 1e-6; a layer count the chunks cannot split is a usage error."""
    assert suite[1]["compare at PP=2 x VPP=2"] == 0
    compare = _tool("compare_hf_megatron")
    with pytest.raises(SystemExit) as exc:  # the 2-layer Qwen2 in 2 x 2 chunks
        compare.main(["--hf-dir", hf_models[CLI_KIND], "--load", "unused", "--pipeline-model-parallel-size", "2",
                      "--virtual-pipeline-model-parallel-size", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "do not split into" in err and "equal model chunks" in err, err


@pytest.mark.distributed
@pytest.mark.e2e
def test_exporter_runs_as_a_plain_command(suite, hf_models, tmp_path):
    """``python tools/convert_megatron_to_hf.py`` in one process, casting the bf16 checkpoint to fp32."""
    out = str(tmp_path / "fp32")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, "tools/convert_megatron_to_hf.py", "--load", os.path.join(suite[0], f"{CLI_KIND}-megatron"),
         "--hf-out", out, "--dtype", "fp32"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote {out}: " in done.stdout
    original, back = _safetensors_state(hf_models[CLI_KIND]), _safetensors_state(out)
    assert set(back) == set(original)
    assert all(back[n].dtype == torch.float32 and torch.equal(back[n], original[n].float()) for n in original)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"
