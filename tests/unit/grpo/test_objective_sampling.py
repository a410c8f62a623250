"""The objective the trainer builds samples its rollouts as the GRPO flags and the task's source say.

``build_objective`` turns the parsed configs into the sampler's settings; a flag dropped there
would be accepted on the command line and silently ignored. Each flag is set to a value other
than its default, and the source ends completions at a generation config's stop id besides eos.
"""

from __future__ import annotations

import json

from megatron_prune.config import CheckpointConfig, ModelConfig, TrainConfig
from megatron_prune.data import GSM8K_SAMPLE
from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
from megatron_prune.grpo.trainer import build_objective, build_source
from megatron_prune.model.arch import get_preset


def test_every_sampling_flag_reaches_the_rollout_sampler(tmp_path):
    from tests.unit.data.helpers import CHAT_TEMPLATE, save_hf_tokenizer

    directory = save_hf_tokenizer(tmp_path / "tok", chat_template=CHAT_TEMPLATE)
    (tmp_path / "tok" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 10]}))
    arch = get_preset("tiny")
    train = TrainConfig(global_batch_size=4, micro_batch_size=2, seq_length=64, seed=77)
    grpo = GRPOConfig(task="gsm8k", data_path=[GSM8K_SAMPLE], group_size=4, max_new_tokens=12, temperature=0.6,
                      top_p=0.7, kv_cache=True, rollout_micro_batch_size=3)
    defaults = GRPOConfig()
    for name in ("max_new_tokens", "temperature", "top_p", "kv_cache", "rollout_micro_batch_size"):
        assert getattr(grpo, name) != getattr(defaults, name), name
    source = build_source(grpo, arch=arch, model_cfg=ModelConfig(), ckpt_cfg=CheckpointConfig(), train_cfg=train,
                          tokenizer_name=directory)
    assert (source.eos_id, source.stop_ids, source.pad_id) == (2, {10}, 0)
    objective = build_objective(configs={"TrainConfig": train, "GRPOConfig": grpo, "DPPOArgs": DPPOArgs()},
                                arch=arch, policy=[], reference=None, source=source)
    s = objective.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.kv_cache, s.micro_batch_size) == (12, 0.6, 0.7, True, 3)
    assert (s.eos_id, s.stop_ids, s.pad_id) == (2, {10}, 0)
    assert s.ends(10) and s.ends(2) and not s.ends(1)
    assert (s.seed, s.vocab_size) == (77, arch.vocab_size)
