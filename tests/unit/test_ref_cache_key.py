"""The key of a precomputed reference table follows every token the reference scores."""

from __future__ import annotations

import json
import types

from megatron_prune.data.preference import PreferencePair
from megatron_prune.dpo.trainer import _fingerprint, reference_table_key


def _data(*pairs: tuple[list[int], list[int], list[int]], source: str = "a.jsonl"):
    return types.SimpleNamespace(pairs=[PreferencePair(p, c, r, source, i) for i, (p, c, r) in enumerate(pairs)])


def test_key_changes_with_any_token_and_not_with_the_file():
    base = _data(([1, 2, 3], [4, 5], [6]), ([7], [8, 9], [10, 11]))
    key = _fingerprint(base, "model")
    assert key == _fingerprint(_data(([1, 2, 3], [4, 5], [6]), ([7], [8, 9], [10, 11]), source="moved/a.jsonl"),
                               "model")
    changed = [
        _data(([1, 2, 9], [4, 5], [6]), ([7], [8, 9], [10, 11])),  # a prompt token
        _data(([1, 2], [3, 4, 5], [6]), ([7], [8, 9], [10, 11])),  # the same ids split otherwise
        _data(([1, 2, 3], [4, 5], [6]), ([7], [8, 9], [10])),  # a response cut shorter
        _data(([7], [8, 9], [10, 11]), ([1, 2, 3], [4, 5], [6])),  # the order (table keys are pair indices)
        _data(([1, 2, 3], [4, 5], [6])),  # a pair fewer
    ]
    keys = [_fingerprint(d, "model") for d in changed]
    assert key not in keys and len(set(keys)) == len(keys)
    assert _fingerprint(base, "another reference") != key


def test_reference_is_identified_by_its_weights_not_its_path(tmp_path):
    import shutil

    from megatron_prune.dpo.trainer import reference_identity
    from tests.unit.model.hf_models import make_hf_model

    first = make_hf_model("qwen3", str(tmp_path / "a"), seed=1)
    other = make_hf_model("qwen3", str(tmp_path / "b"), seed=2)  # the same architecture, other weights
    copy = shutil.copytree(first, tmp_path / "copy")

    def of(hf_dir, **kw):
        meta = {"reference_load": None, "reference_hf_model": str(hf_dir)}
        return reference_identity(meta, ref_source=None, lora_base=None, adapter_off_base=False, **kw)

    assert of(first) == of(copy) != of(other)
    # One value changed in place, where a sampling fingerprint does not look: a new table.
    edited = shutil.copytree(first, tmp_path / "edited")
    weights = edited / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    spans = [info["data_offsets"] for name, info in json.loads(data[8:header]).items() if name != "__metadata__"]
    begin, end = max(spans, key=lambda span: span[1] - span[0])
    assert end - begin > 4096
    data[header + begin + 1500] ^= 0x01
    weights.write_bytes(bytes(data))
    assert of(edited) != of(first)
    # Under LoRA the adapter-off policy scores the table: its base's record (with the fingerprint).
    bases = [{"kind": "hf", "path": str(first), "fingerprint": "sha256:1"},
             {"kind": "hf", "path": str(first), "fingerprint": "sha256:2"}]
    keys = {reference_identity({"reference_load": None, "reference_hf_model": None}, ref_source=None, lora_base=b,
                               adapter_off_base=True) for b in bases}
    assert len(keys) == 2
    # ... by content too: a moved copy of the base reuses its table, an edited one does not.
    from megatron_prune.model.lora_base import hf_base

    def adapter_off(hf_dir):
        return reference_identity({"reference_load": None, "reference_hf_model": None}, ref_source=None,
                                  lora_base=hf_base(str(hf_dir)).to_dict(), adapter_off_base=True)

    assert adapter_off(first) == adapter_off(copy) != adapter_off(edited)


def test_key_changes_with_the_precision_seed_architecture_and_reference():
    from megatron_prune.model.arch import get_preset

    data = _data(([1, 2, 3], [4, 5], [6]))
    tiny = get_preset("tiny")
    key = reference_table_key(data, arch=tiny, identity="initialisation", seed=1, bf16=False)
    assert key == reference_table_key(data, arch=tiny, identity="initialisation", seed=1, bf16=False)
    others = [reference_table_key(data, arch=tiny, identity="initialisation", seed=1, bf16=True),
              reference_table_key(data, arch=tiny, identity="initialisation", seed=2, bf16=False),
              reference_table_key(data, arch=tiny, identity="hf:abc", seed=1, bf16=False),
              reference_table_key(data, arch=get_preset("tiny-tied"), identity="initialisation", seed=1, bf16=False)]
    assert key not in others and len(set(others)) == len(others)
    # The seed makes a preset's initial weights, not a loaded model's: a table of one is reused across seeds.
    assert reference_table_key(data, arch=tiny, identity="hf:abc", seed=2, bf16=False) == others[2]


def test_a_table_is_checked_against_the_pairs_it_is_read_for():
    import pytest
    import torch

    from megatron_prune.dpo.trainer import check_reference_table
    from megatron_prune.training.session import UsageError

    data = _data(([1, 2, 3], [4, 5], [6]), ([7], [8, 9], [10, 11]))
    table = {(0, 0): torch.zeros(2), (0, 1): torch.zeros(1), (1, 0): torch.zeros(2), (1, 1): torch.zeros(2)}
    check_reference_table(table, data, "t.pt")
    with pytest.raises(UsageError, match=r"t.pt does not match the data: pair 1 \(a.jsonl:1\) has a rejected response "
                                         r"of 2 tokens, the table holds 3 values for it"):
        check_reference_table({**table, (1, 1): torch.zeros(3)}, data, "t.pt")
    with pytest.raises(UsageError, match="pair 1 .* the table holds nothing for it"):
        check_reference_table({k: v for k, v in table.items() if k[0] == 0}, data, "t.pt")
