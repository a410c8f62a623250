"""Test stand-in for ``mindspeed.features_manager`` (see ../../README.md).

Kept even when the tests use MindSpeed's real files: the real package imports every feature,
which needs torch_npu. Two features stand for MindSpeed's: ``--optimization-level`` and the
fusion attention that replaces ``DotProductAttention.forward`` under ``--use-flash-attn``.
"""

from mindspeed.features_manager.feature import MindSpeedFeature
from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

DOT_PRODUCT_ATTENTION_FORWARD = "megatron.core.transformer.dot_product_attention.DotProductAttention.forward"


def dot_product_attention_forward_impl(
    self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
):
    """Returns what MindSpeed's fusion attention would pass to npu_fusion_attention as actual_seq_qlen."""
    if packed_seq_params is None:
        return {"impl": "mindspeed-standin", "actual_seq_qlen": None}
    # As MindSpeed does, without looking at the type: a list here raises AttributeError.
    return {"impl": "mindspeed-standin", "actual_seq_qlen": packed_seq_params.cu_seqlens_q.tolist()}


class OptimizationLevelFeature(MindSpeedFeature):
    def __init__(self):
        super().__init__("requirements-basic", optimization_level=0)

    def register_args(self, parser):
        group = parser.add_argument_group(title=self.feature_name)
        group.add_argument("--optimization-level", type=int, choices=[0, 1, 2], default=2)


class FusionAttentionFeature(MindSpeedFeature):
    def __init__(self):
        super().__init__("use-flash-attn", optimization_level=2)

    def register_args(self, parser):
        group = parser.add_argument_group(title="fusion attention")
        group.add_argument("--sparse-mode", type=int, default=0, choices=[0, 2])

    def register_patches(self, patch_manager, args):
        patch_manager.register_patch(DOT_PRODUCT_ATTENTION_FORWARD, dot_product_attention_forward_impl)


def create_features_list():
    return [OptimizationLevelFeature(), FusionAttentionFeature()]


MindSpeedFeaturesManager.set_features_list(create_features_list())
