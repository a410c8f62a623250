"""Seeded bugs of shared-prefix rows and segment attention, each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

PACKED = "tests/unit/grpo/test_packed_segments.py"
GROUP_SPLIT = f"{PACKED}::test_a_group_longer_than_a_row_is_split_with_a_prompt_copy_per_part"
CONFIG = "tests/unit/model/test_segment_attention_config.py"
SCALE = f"{CONFIG}::test_configured_softmax_scale_is_megatrons"
DROPOUT = f"{CONFIG}::test_attention_dropout_is_refused_in_training_only"
ROTARY = f"{CONFIG}::test_per_token_rotary_is_megatrons_rotary_at_each_position"

MUTANTS: list[dict] = [
    {
        "name": "grpo-shared-group-never-split",
        "why": "a --shared-prompt group longer than the row capacity is not split: packed rows refuse it, "
               "padded rows grow past the capacity",
        "file": "megatron_prune/grpo/step.py",
        "old": "if current.items and current.length + len(it.completion) > capacity:",
        "new": "if current.items and len(it.completion) > capacity:",
        "tests": [GROUP_SPLIT],
    },
    {
        "name": "segment-scale-ignores-config",
        "why": "the segment path always scales by 1/sqrt(kv_channels), ignoring a configured softmax_scale",
        "file": "megatron_prune/model/segment_attention.py",
        "old": 'for scale in (getattr(self, "softmax_scale", None), getattr(self.config, "softmax_scale", None)):',
        "new": "for scale in ():",
        "tests": [SCALE],
    },
    {
        "name": "segment-dropout-check-inverted",
        "why": "attention dropout is refused only in eval: training silently runs without the configured dropout",
        "file": "megatron_prune/model/segment_attention.py",
        "old": "if self.training and config.attention_dropout > 0:",
        "new": "if not self.training and config.attention_dropout > 0:",
        "tests": [DROPOUT],
    },
    {
        "name": "segment-rope-interpolation-inverted",
        "why": "per-token rotary multiplies positions by the interpolation factor instead of dividing by it",
        "file": "megatron_prune/model/selective_gpt.py",
        "old": "positions = positions * (1 / rope.seq_len_interpolation_factor)",
        "new": "positions = positions * rope.seq_len_interpolation_factor",
        "tests": [f"{ROTARY}[interpolation]"],
    },
    {
        "name": "segment-rope-interleaved-ignored",
        "why": "per-token rotary ignores rotary_interleaved and lays the angles out as two halves",
        "file": "megatron_prune/model/selective_gpt.py",
        "old": "emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)",
        "new": "emb = torch.cat((freqs, freqs), dim=-1)",
        "tests": [f"{ROTARY}[interleaved]"],
    },
]
