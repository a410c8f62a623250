"""megatron-prune: graph pruning for DPO and GRPO post-training on Megatron-Core."""

from setuptools import find_packages, setup

PACKAGES = find_packages(include=["megatron_prune", "megatron_prune.*"])
# patches/ lives at the top of the repository (one place for every run-time change to
# Megatron-Core or MindSpeed) but installs as megatron_prune.patches.
PACKAGES += ["megatron_prune.patches"]

setup(
    name="megatron-prune",
    version="0.1.0",
    description="Pruned DPO and GRPO post-training for NVIDIA Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir={"megatron_prune.patches": "patches"},
    package_data={"megatron_prune": ["data/samples/*", "data/tokenizer/*"]},
    include_package_data=True,
    install_requires=[
        # Tested: torch 2.13.0, megatron-core 0.16.1, transformers 5.24-5.25 (README); the CPU patches
        # rebind Megatron-Core internals checked on 0.16.1, so the next minor release is excluded.
        "torch>=2.4",
        "megatron-core>=0.16,<0.17",
        "numpy",
        "sentencepiece",
        "transformers",
        "safetensors",
        "protobuf",
        # dist_checkpointing.save imports psutil without declaring it.
        "psutil",
        "einops",
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis", "pyarrow", "matplotlib", "peft"],
        "gpu": ["transformer-engine[pytorch]"],
        # .parquet data files (DPO --data-path, GRPO --data-path).
        "parquet": ["pyarrow"],
        # MindSpeed and torch_npu come from Ascend's own channels, matching the CANN version;
        # they cannot be installed from PyPI (the PyPI `mindspeed` is an empty placeholder).
        "ascend": [],
        "bench": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "megatron-prune-dpo=megatron_prune.dpo.__main__:main",
            "megatron-prune-grpo=megatron_prune.grpo.__main__:main",
        ]
    },
)
