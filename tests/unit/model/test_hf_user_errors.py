"""Mistakes users make with HF models: each is one line naming the file, field or flag (exit code 2
from the tools), before any rank starts; none trains or writes a different model silently.

One process; the tools' ``main`` runs in-process with torchrun's ``WORLD_SIZE`` faked where a
layout is checked (the checks happen before ``torch.distributed`` starts).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch

from megatron_prune.model import hf_convert
from megatron_prune.model.arch import ModelArch
from tests.unit.model.hf_models import hf_config, make_hf_model, read_config

REPO = os.path.join(os.path.dirname(__file__), "..", "..", "..")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_hf_model("llama", str(tmp_path_factory.mktemp("hf") / "llama"), seed=3)


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _usage_error(tool: str, argv: list[str], monkeypatch, capsys, *, world: int = 1) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29999")  # never used: every case stops before the process group
    with pytest.raises(SystemExit) as exc:
        _tool(tool).main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err, err
    import torch.distributed as dist

    assert not dist.is_initialized()
    return err.strip().splitlines()[-1]


def _with_config(src: str, dst, text: str) -> str:
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(text)
    return str(dst)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "config.json: not valid JSON"),
        ("[1, 2]", "config.json: expected a JSON object, got list"),
        ("drop:vocab_size", "config.json: missing field 'vocab_size'"),
        ("drop:num_hidden_layers", "config.json: missing field 'num_hidden_layers'"),
        ("set:vocab_size='300'", "config.json: vocab_size must be an integer, got '300'"),
        ("set:num_key_value_heads=3", "config.json: num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
        ("set:rope_parameters={'rope_type': 'default', 'rope_theta': 'x'}", "config.json: rope_theta must be a number"),
    ],
    ids=["bad-json", "not-an-object", "no-vocab", "no-layers", "string-vocab", "kv-heads", "string-theta"],
)
def test_broken_config_names_the_file_and_field(llama_dir, tmp_path, text, message):
    config = read_config(llama_dir)
    if text.startswith("drop:"):
        config.pop(text[5:])
        text = json.dumps(config)
    elif text.startswith("set:"):
        key, value = text[4:].split("=", 1)
        config[key] = eval(value)  # noqa: S307 - test literals
        text = json.dumps(config)
    path = _with_config(llama_dir, tmp_path / "hf", text)
    with pytest.raises(ValueError) as exc:
        hf_convert.read_hf_arch(path)
    assert message in str(exc.value)
    assert os.path.join(path, "config.json") in str(exc.value)


def test_mistral_window_follows_transformers_defaults():
    """transformers gives a Mistral config without ``sliding_window`` a 4096-token window and one
    without ``max_position_embeddings`` 131072 positions: both are sliding-window models."""
    from megatron_prune.model.hf_mapping import arch_from_hf_config

    config = hf_config("mistral", max_position_embeddings=8192).to_dict()
    assert arch_from_hf_config(config).max_position_embeddings == 8192  # sliding_window: null
    del config["sliding_window"]
    with pytest.raises(ValueError, match="sliding_window=4096 .transformers' default"):
        arch_from_hf_config(config)
    config = hf_config("mistral", sliding_window=4096).to_dict()
    del config["max_position_embeddings"]
    with pytest.raises(ValueError, match="sliding_window=4096 is not supported"):
        arch_from_hf_config(config)
    config = hf_config("mistral", sliding_window=512, max_position_embeddings=512).to_dict()
    arch_from_hf_config(config)  # a window covering every position is full attention


def _hf_model_arch(hf_dir: str):
    from megatron_prune.config import CheckpointConfig, ModelConfig
    from megatron_prune.training.session import resolve_arch

    return resolve_arch(ModelConfig(hf_model=hf_dir), CheckpointConfig())


def test_trainer_hf_model_gets_the_converters_checks(tmp_path):
    """``--hf-model`` refused what the converter refuses: before, a Llama with MLP biases, one with
    an extra tensor, and a tied model whose lm_head differs from the embedding trained without them."""
    biased = make_hf_model("llama", str(tmp_path / "mlp-bias"), seed=1, assets=False, mlp_bias=True)
    with pytest.raises(ValueError, match="mlp_bias=true is not supported"):
        _hf_model_arch(biased)

    plain = make_hf_model("qwen3", str(tmp_path / "qwen3"), seed=2, assets=False)
    assert _hf_model_arch(plain) == ModelArch.from_hf_dir(plain)
    from safetensors.torch import load_file, save_file

    extra = shutil.copytree(plain, tmp_path / "extra")
    weights = load_file(extra / "model.safetensors")
    save_file({**weights, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, extra / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor.s. model.layers.0.self_attn.o_proj.bias"):
        _hf_model_arch(str(extra))

    tied = shutil.copytree(plain, tmp_path / "tied")
    (tied / "config.json").write_text(json.dumps({**read_config(plain), "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings=true but lm_head.weight differs"):
        _hf_model_arch(str(tied))


def test_converter_refuses_a_save_file_and_a_layout_the_model_does_not_split(llama_dir, tmp_path, monkeypatch,
                                                                             capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    err = _usage_error("convert_hf_to_megatron", ["--hf-dir", llama_dir, "--save", str(a_file)], monkeypatch, capsys)
    assert f"--save {a_file} exists and is not a directory" in err

    # 4 heads, 2 layers: TP=3 and PP=3 (6 and 3 ranks) were Megatron assertions after the ranks started.
    save = tmp_path / "out"
    err = _usage_error("convert_hf_to_megatron", ["--hf-dir", llama_dir, "--save", str(save),
                                                  "--tensor-model-parallel-size", "3"], monkeypatch, capsys, world=3)
    assert "--tensor-model-parallel-size 3 does not divide the model's 4 attention heads" in err
    err = _usage_error("convert_hf_to_megatron", ["--hf-dir", llama_dir, "--save", str(save),
                                                  "--pipeline-model-parallel-size", "3"], monkeypatch, capsys, world=3)
    assert "--pipeline-model-parallel-size 3 does not divide the model's 2 layers" in err
    assert not save.exists()  # nothing written before the layout was checked


def test_compare_tool_refuses_bad_sizes_and_layouts(llama_dir, monkeypatch, capsys):
    for flag in ("--seq-length", "--batch-size"):
        err = _usage_error("compare_hf_megatron", ["--hf-dir", llama_dir, "--load", "unused", flag, "0"],
                           monkeypatch, capsys)
        assert f"{flag} must be >= 1, got 0" in err
    err = _usage_error("compare_hf_megatron", ["--hf-dir", llama_dir, "--load", "unused",
                                               "--tensor-model-parallel-size", "3"], monkeypatch, capsys, world=3)
    assert "--tensor-model-parallel-size 3 does not divide the model's 4 attention heads" in err
    err = _usage_error("compare_hf_megatron", ["--hf-dir", llama_dir, "--load", "unused", "--tolerance", "-1"],
                       monkeypatch, capsys)
    assert "argument --tolerance: must be >= 0.0, got -1" in err
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _usage_error("compare_hf_megatron", ["--hf-dir", llama_dir, "--load", "unused", "--hf-device", "cuda:0"],
                       monkeypatch, capsys)
    assert err.endswith("--hf-device cuda was requested but torch.cuda.is_available() is False; use --hf-device cpu")


def test_export_output_and_assets_errors_name_the_problem(llama_dir, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="--hf-out .*/a-file/out: .*a-file exists and is not a directory"):
        hf_convert.check_output_dir(str(a_file / "out"), flag="--hf-out")
    with pytest.raises(ValueError, match="--hf-out .*a-file exists and is not an empty directory"):
        hf_convert.check_output_dir(str(a_file), flag="--hf-out")
    hf_convert.check_output_dir(str(tmp_path / "new" / "deeper"), flag="--hf-out")
    assert not (tmp_path / "new").exists()  # probing creates nothing

    other = hf_convert.read_hf_arch(llama_dir)
    qwen3 = ModelArch.from_hf_config(hf_config("qwen3").to_dict())
    with pytest.raises(ValueError) as exc:
        hf_convert.export_config(qwen3, assets=llama_dir, dtype=torch.float32)
    message = str(exc.value)
    assert "describes a different model than the checkpoint" in message and "\n" not in message
    assert f"model_type {other.model_type!r} (not 'qwen3')" in message


def test_tools_started_without_torchrun_suggest_torchrun_not_a_dry_run(llama_dir, tmp_path, monkeypatch, capsys):
    """A tool run as a plain process is a world of one rank: its refusal of a TP=2 layout says to
    launch it with torchrun, and never suggests --dry-run, which the tools do not have."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for tool, argv in (("convert_hf_to_megatron", ["--save", str(tmp_path / "out")]),
                       ("compare_hf_megatron", ["--load", "unused"])):
        with pytest.raises(SystemExit) as exc:
            _tool(tool).main(["--hf-dir", llama_dir, "--tensor-model-parallel-size", "2", *argv])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exc.value.code == 2, err
        assert "world size 1 is not divisible" in err and "launch it with torchrun --nproc-per-node N)" in err, err
        assert "--dry-run" not in err, err


def test_corrupt_weight_files_are_named_in_one_line(llama_dir, tmp_path, monkeypatch, capsys):
    """A truncated download or a foreign file under the safetensors name, and a broken index."""
    truncated = tmp_path / "truncated"
    shutil.copytree(llama_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = _usage_error("convert_hf_to_megatron", ["--hf-dir", str(truncated), "--save", str(tmp_path / "a")],
                       monkeypatch, capsys)
    assert f"{weights}: not a readable safetensors file" in err
    weights.write_bytes(b"<html>not found</html>")
    err = _usage_error("convert_hf_to_megatron", ["--hf-dir", str(truncated), "--save", str(tmp_path / "a")],
                       monkeypatch, capsys)
    assert f"{weights}: not a readable safetensors file" in err
    index = truncated / "model.safetensors.index.json"
    index.write_text('{"weight_map": \n')
    err = _usage_error("convert_hf_to_megatron", ["--hf-dir", str(truncated), "--save", str(tmp_path / "a")],
                       monkeypatch, capsys)
    assert f"{index}: not a safetensors index" in err
    assert not (tmp_path / "a").exists()


def test_dry_run_refuses_what_the_hf_model_cannot_run(tmp_path, monkeypatch, capsys):
    """An MLP width the tensor-parallel size does not split, a padded vocabulary it does not split
    (heads, MLP and key-value heads all split by 3), and a tokenizer larger than the model's
    vocabulary: each passed --dry-run and failed after the ranks started (a Megatron assertion per
    rank; the vocabulary check only once the data was read)."""
    from megatron_prune.data import HH_RLHF_SAMPLE
    from megatron_prune.dpo.__main__ import main

    hf_dir = make_hf_model("qwen3", str(tmp_path / "qwen3"), seed=4, intermediate_size=91, vocab_size=300)
    three_heads = make_hf_model("qwen3", str(tmp_path / "qwen3-3h"), seed=4, num_attention_heads=3,
                                num_key_value_heads=1, vocab_size=600)
    common = ["--data-path", HH_RLHF_SAMPLE, "--seq-length", "256", "--global-batch-size", "3",
              "--micro-batch-size", "1", "--dry-run"]
    monkeypatch.setenv("RANK", "0")
    for model, world, extra, message in [
        (hf_dir, 2, ["--tensor-model-parallel-size", "2"],
         "--tensor-model-parallel-size 2 does not divide the model's MLP width (intermediate_size 91)"),
        (three_heads, 3, ["--tensor-model-parallel-size", "3", "--tokenizer", "tiny"],
         "--tensor-model-parallel-size 3 does not divide the model's padded vocabulary (1024 rows: 600 padded"),
        (hf_dir, 1, ["--tokenizer", "tiny"], "tokenizer tiny has 512 tokens but the model only 300"),
    ]:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        with pytest.raises(SystemExit) as exc:
            main(["--hf-model", model, *common, *extra])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err and "Traceback" not in err, err
