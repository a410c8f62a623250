"""Seeded bugs of the accelerator layer and the Ascend adapter (device choice, seeding, memory readings, MindSpeed flags), each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

ACC = "megatron_prune/accelerator.py"
DEVICE = "tests/unit/adapters/test_device.py"
CLI_CONTRACT = "tests/unit/test_cli_contract.py::test_a_bad_flag_off_the_npu_is_a_usage_error"

MUTANTS: list[dict] = [
    {
        "name": "device-index-from-global-rank",
        "why": "the device index is the global rank: on the second node rank 9 asks for device 9 instead of 1",
        "file": ACC,
        "old": 'return torch.device(self.kind, int(os.environ.get("LOCAL_RANK", "0")))',
        "new": 'return torch.device(self.kind, int(os.environ.get("RANK", "0")))',
        "tests": [f"{DEVICE}::test_device_index_is_the_local_rank"],
    },
    {
        "name": "device-not-selected-before-process-group",
        "why": "every rank of a node stays on device 0 (duplicate-device errors in NCCL/HCCL, or one device out of memory)",
        "file": "megatron_prune/training/parallel.py",
        "old": "    acc.set_device()\n",
        "new": "",
        "tests": ["tests/unit/test_parallel_device.py::test_each_rank_selects_its_device_before_the_process_group"],
    },
    {
        "name": "device-generator-not-seeded",
        "why": "--seed seeds torch's CPU generator only, so GPU/NPU dropout masks differ on every launch",
        "file": ACC,
        "old": "            self.module.manual_seed_all(seed)\n",
        "new": "            pass\n",
        "tests": [f"{DEVICE}::test_manual_seed_seeds_every_device_generator"],
    },
    {
        "name": "unprepared-npu-host-picks-cuda",
        "why": "a converter on an NPU host whose torch.cuda was redirected by transfer_to_npu gets kind cuda (nccl)",
        "file": ACC,
        "old": "        elif TRANSFER_TO_NPU not in sys.modules and torch.cuda.is_available():",
        "new": "        elif torch.cuda.is_available():",
        "tests": [f"{DEVICE}::test_unprepared_npu_host_falls_back_without_the_redirected_cuda"],
    },
    {
        "name": "npu-available-without-asking-torch-npu",
        "why": "auto picks the NPU on any host with torch_npu installed, even with no NPU visible",
        "file": ACC,
        "old": 'return bool(getattr(torch, "npu", None) and torch.npu.is_available())',
        "new": 'return bool(getattr(torch, "npu", None))',
        "tests": [f"{DEVICE}::test_npu_available_asks_torch_npu"],
    },
    {
        "name": "numpy-seed-not-reduced",
        "why": "a --seed of 2**32 or more crashes in numpy's seed",
        "file": ACC,
        "old": "np.random.seed(seed % 2**32)",
        "new": "np.random.seed(seed)",
        "tests": [f"{DEVICE}::test_manual_seed_takes_seeds_beyond_numpys_range"],
    },
    {
        "name": "cpu-peak-memory-reads-current-rss",
        "why": "peak memory on CPU is the RSS at the end of the step, not its peak",
        "file": ACC,
        "old": '        return _proc_status_bytes("VmHWM")',
        "new": '        return _proc_status_bytes("VmRSS")',
        "tests": [f"{DEVICE}::test_cpu_release_cached_memory_returns_freed_heap_pages"],
    },
    {
        "name": "device-peak-memory-reserved",
        "why": "peak memory on GPU/NPU counts the caching allocator's reserve, not tensors",
        "file": ACC,
        "old": "return int(self.module.max_memory_allocated())",
        "new": "return int(self.module.max_memory_reserved())",
        "tests": [f"{DEVICE}::test_device_memory_readings_count_tensors_not_the_allocator_cache"],
    },
    {
        "name": "unknown-device-value-passed-through",
        "why": "--device tpu reaches set_accelerator and escapes as a ValueError traceback instead of a usage error",
        "file": "megatron_prune/adapters/mindspeed.py",
        "old": 'return known.device if known.device in ("auto", *acc_mod.KINDS) else "auto"',
        "new": "return known.device",
        "tests": [f"{DEVICE}::test_requested_device", CLI_CONTRACT],
    },
    {
        "name": "mindspeed-flags-checked-on-every-device",
        "why": "an unknown flag on CPU/CUDA is handed to the MindSpeed parser, which needs mindspeed installed",
        "file": "megatron_prune/training/cli.py",
        "old": 'unknown_handler=parse_mindspeed_flags if kind == "npu" else None)',
        "new": "unknown_handler=parse_mindspeed_flags)",
        "tests": [CLI_CONTRACT],
    },
    {
        "name": "first-rank-per-node",
        "why": "first_rank() is true on each node's local rank 0, so every node writes and warns",
        "file": "megatron_prune/ranks.py",
        "old": 'return int(os.environ.get("RANK", "0")) == 0',
        "new": 'return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) == 0',
        "tests": ["tests/unit/test_ranks.py::test_first_rank_is_the_global_rank_0"],
    },
]
