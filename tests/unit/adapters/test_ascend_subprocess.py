"""``prepare_ascend`` end to end, each case in a fresh interpreter (import order is per process).

torch_npu and MindSpeed are the stand-ins of ``standin/`` (see its README), or MindSpeed's real
files for everything that imports without torch_npu when ``MEGATRON_PRUNE_MINDSPEED_SRC`` is
set. Megatron-Core is the real installed package. What this proves: the order in which the
adapter imports things, that MindSpeed's adaptor sees the plugin's feature (flags typed,
patches registered last and stacked on MindSpeed's replacement, kept on ``repatch``), and the
accelerator it selects. It proves nothing about NPU kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import STANDIN

REPO = Path(__file__).resolve().parents[3]

PREPARED = r"""
import json, sys
sys.argv = ["megatron_prune.dpo", "--device", "npu", "--prune-position-ratio", "0.3",
            "--use-flash-attn", "--sparse-mode", "2"]
from megatron_prune.adapters.mindspeed import ascend_state, bootstrap_device, parse_mindspeed_flags, prepare_ascend
kind = bootstrap_device()
first = prepare_ascend()

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron_prune.accelerator import (MINDSPEED_ADAPTOR, MINDSPEED_PATCH_UTILS, TRANSFER_TO_NPU,
                                        AcceleratorError, check_npu_stack, detect_kind, get_accelerator)
from megatron_prune.patches.registry import PATCH_MARK
import mindspeed.megatron_adaptor as adaptor
from mindspeed.args_utils import get_mindspeed_args

def attention():
    cu = torch.tensor([0, 3, 7, 10], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    forward = DotProductAttention.forward
    out = forward(None, None, None, None, None, attn_mask_type=None, attention_bias=None, packed_seq_params=params)
    return {"mark": getattr(forward, PATCH_MARK, None), "inner": forward.__wrapped__.__name__, **out}

names = list(sys.modules)
first_megatron = next(n for n in names if n.startswith("megatron."))
acc = get_accelerator()
check_npu_stack()
try:
    detect_kind("cuda")
    cuda_refused = False
except AcceleratorError:
    cuda_refused = True
try:
    parse_mindspeed_flags(["--no-such-flag"])
    leftover_refused = False
except ValueError:
    leftover_refused = True
before = attention()
adaptor.repatch({})
after = attention()
ms_args = get_mindspeed_args()
print("RESULT " + json.dumps({
    "kind": kind, "same": first is acc, "backend": acc.backend, "device": str(acc.device),
    "order": [names.index(n) for n in (TRANSFER_TO_NPU, MINDSPEED_PATCH_UTILS, first_megatron, MINDSPEED_ADAPTOR)],
    "state": ascend_state(), "cuda_refused": cuda_refused, "leftover_refused": leftover_refused,
    "mindspeed_flags": vars(parse_mindspeed_flags(["--use-flash-attn", "--sparse-mode", "2"])),
    "prune_position_ratio": getattr(ms_args, "prune_position_ratio", None),
    "before": before, "after": after,
}))
"""

TOO_LATE = r"""
import json
import megatron.core
from megatron_prune.accelerator import AcceleratorError
from megatron_prune.adapters.mindspeed import bootstrap_device
try:
    bootstrap_device(["--device", "npu"])
    print("RESULT " + json.dumps({"error": None}))
except AcceleratorError as exc:
    print("RESULT " + json.dumps({"error": str(exc)}))
"""


ADAPTOR_FIRST = r"""
import json, sys
sys.argv = ["megatron_prune.grpo", "--device", "npu", "--use-flash-attn"]
import mindspeed.megatron_adaptor  # the user imported MindSpeed themselves, before the plugin
import torch
from megatron_prune.adapters.mindspeed import ascend_state, bootstrap_device
kind = bootstrap_device()
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
cu = torch.tensor([0, 2, 6], dtype=torch.int32)
out = DotProductAttention.forward(None, None, None, None, None,
                                  packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
print("RESULT " + json.dumps({"kind": kind, "state": ascend_state(), **out}))
"""


def _standin_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    shutil.copytree(STANDIN, site, ignore=shutil.ignore_patterns("__pycache__", "README.md"))
    return site


def _run(script: str, site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_prepare_ascend_with_mindspeed(mindspeed_tree):
    result = _run(PREPARED, mindspeed_tree)
    assert result["kind"] == "npu" and result["same"]
    assert result["backend"] == "hccl" and result["device"] == "npu:0"
    # sys.modules is in order of finished imports: Megatron was first imported by MindSpeed's
    # adaptor while it applied the patches (after patch_utils, before the adaptor finished).
    assert result["order"] == sorted(result["order"])
    assert result["state"]["prepared"] and result["state"]["route"] == "feature"
    assert result["state"]["patch_names"] == ["mindspeed.DotProductAttention.forward.thd_cu_seqlens"]
    assert result["cuda_refused"] and result["leftover_refused"]
    assert result["mindspeed_flags"] == {"use_flash_attn": True, "sparse_mode": 2, "optimization_level": 2}
    assert result["prune_position_ratio"] == 0.3  # typed: the plugin feature declared the flag
    for state in ("before", "after"):  # after: MindSpeed's repatch() removed and re-applied everything
        assert result[state] == {
            "mark": "mindspeed.DotProductAttention.forward.thd_cu_seqlens",
            "inner": "dot_product_attention_forward_impl",  # MindSpeed's replacement, wrapped by ours
            "impl": "mindspeed-standin",
            "actual_seq_qlen": [3, 7, 10],
        }


def test_adaptor_imported_by_the_user_first(tmp_path):
    result = _run(ADAPTOR_FIRST, _standin_site(tmp_path))
    assert result["kind"] == "npu"
    assert result["state"]["route"] == "patch_manager"
    assert result["state"]["patch_names"] == ["mindspeed.DotProductAttention.forward.thd_cu_seqlens"]
    assert result["impl"] == "mindspeed-standin" and result["actual_seq_qlen"] == [2, 6]


def test_megatron_imported_first_is_refused(tmp_path):
    error = _run(TOO_LATE, _standin_site(tmp_path))["error"]
    assert error is not None and "imported too late" in error and "megatron.core" in error


UNPREPARED = r"""
import json
import megatron.core  # a converter: Megatron imported, MindSpeed never prepared
from megatron_prune.accelerator import get_accelerator, npu_available
print("RESULT " + json.dumps({"npu_visible": npu_available(), "kind": get_accelerator().kind}))
"""


def test_a_process_that_chose_no_device_runs_on_the_cpu_of_an_npu_host(tmp_path):
    """The converters and export tools never prepare MindSpeed; on an NPU host they must not stop at
    the import-order check that only a trainer's start can pass."""
    result = _run(UNPREPARED, _standin_site(tmp_path))
    assert result == {"npu_visible": True, "kind": "cpu"}


ADAPTOR_LOADED_BY_THE_CALLER = r"""
import json
import mindspeed.megatron_adaptor  # a library caller that loaded MindSpeed itself, before Megatron
import megatron.core
from megatron_prune.accelerator import get_accelerator
print("RESULT " + json.dumps({"kind": get_accelerator().kind}))
"""


def test_a_process_that_loaded_mindspeed_itself_runs_on_the_npu(tmp_path):
    assert _run(ADAPTOR_LOADED_BY_THE_CALLER, _standin_site(tmp_path)) == {"kind": "npu"}
