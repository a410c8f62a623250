"""Tiny random-weight HF models of every supported architecture, made locally with transformers.

Every parameter (norm weights and biases included) is drawn at random, so a mapping that drops,
swaps or mis-orders any tensor changes the outputs. The vocabulary (300) is not a multiple of
the padding (1024), so padding is exercised; 2 key/value heads divide TP=2.
"""

from __future__ import annotations

import json
import os

import torch

KINDS = ("qwen3", "qwen3-tied", "qwen2", "llama", "mistral")
# Mixture-of-experts kinds: not in KINDS, whose every kind the dense conversion tests also run.
MOE_KINDS = ("qwen3-moe",)
VOCAB = 300
# Files that stand in for a tokenizer: the converter must carry them over byte for byte.
FAKE_ASSETS = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
    "tokenizer_config.json": '{"model_max_length": 512}\n',
    "special_tokens_map.json": '{"eos_token": "</s>"}\n',
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}\n",
}

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def hf_config(kind: str, **overrides):
    """The transformers config object of a tiny model of ``kind``."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    kw = dict(_COMMON)
    if kind in ("qwen3", "qwen3-tied"):
        cls = Qwen3Config
        kw.update(num_hidden_layers=4, tie_word_embeddings=kind == "qwen3-tied",
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif kind == "qwen3-moe":
        # Values other than transformers' defaults (norm_topk_prob false, every layer sparse): a
        # field dropped on the way shows.
        cls = Qwen3MoeConfig
        kw.update(num_hidden_layers=4, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif kind == "qwen2":
        cls = Qwen2Config
        kw.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    elif kind == "llama":
        cls = LlamaConfig
        # Llama-3.1 rope scaling: with theta 500000 and head_dim 16, several frequencies have
        # wavelengths beyond original_max_position_embeddings / low_freq_factor, so it matters.
        kw.update(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192},
                  max_position_embeddings=131072)
    elif kind == "mistral":
        cls = MistralConfig
        kw.update(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(f"unknown kind {kind!r}")
    kw.update(overrides)
    return cls(**kw)


@torch.no_grad()
def randomize(model, *, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.2 * noise)
        else:
            p.copy_(0.08 * noise)


def make_hf_model(kind: str, path: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                  max_shard_size: str | None = None, assets: bool = True, **overrides) -> str:
    """Save a random tiny model of ``kind`` (safetensors, optional shards) plus stand-in tokenizer files."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(kind, **overrides))
    randomize(model, seed=seed)
    model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if assets:
        for name, text in FAKE_ASSETS.items():
            with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                f.write(text)
    return path


def load_hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)
