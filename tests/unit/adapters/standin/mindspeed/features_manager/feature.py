"""Test stand-in for ``mindspeed.features_manager.feature.MindSpeedFeature`` (see ../../README.md)."""


class MindSpeedFeature:
    def __init__(self, feature_name, optimization_level=2):
        self.feature_name = feature_name.lower().strip().replace("-", "_")
        self.optimization_level = optimization_level
        self.default_patches = self.optimization_level == 0

    def is_need_apply(self, args):
        return (
            self.optimization_level <= args.optimization_level and getattr(args, self.feature_name, None)
        ) or self.default_patches

    def register_args(self, parser):
        pass

    def pre_validate_args(self, args):
        pass

    def validate_args(self, args):
        pass

    def post_validate_args(self, args):
        pass

    def pre_register_patches(self, patch_manager, args):
        pass

    def register_patches(self, patch_manager, args):
        pass
