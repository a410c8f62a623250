"""The FLOP/memory model behind tools/bench_dpo.py, and the benchmark's JSON schema."""

from __future__ import annotations

import json
import os
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
sys.path.insert(0, os.path.abspath(TOOLS))

import bench_dpo  # noqa: E402
import flop_model as fm  # noqa: E402

# Body-dominated: a one-word vocabulary makes the head negligible.
BODY = fm.Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=1)
QWEN3_4B = fm.Shape(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=9728, vocab=151936)
PROMPT, RESP = 100, 50
SEQ = PROMPT + RESP


def _mb(rows, scored, selective=True, seq_length=None):
    return fm.Microbatch(rows=rows, seq_length=seq_length or max(sum(r) for r in rows), scored=scored,
                         selective=selective)


def concat_step(*, scored=RESP):
    """One pair, both branches in one row: reference forward + policy forward-backward."""
    both = _mb([[SEQ, SEQ]], 2 * scored)
    return [fm.Pass(kind="forward", microbatches=[both]), fm.Pass(kind="train", microbatches=[both])]


def branch_step(*, scored=RESP):
    one = _mb([[SEQ]], scored)
    return [fm.Pass(kind="forward", microbatches=[_mb([[SEQ, SEQ]], 2 * scored)]),
            fm.Pass(kind="forward", microbatches=[one]), fm.Pass(kind="train", microbatches=[one])]


def ratio(shape, a, b, **kw):
    return fm.step_flops(shape, a, **kw)["total"] / fm.step_flops(shape, b, **kw)["total"]


def test_branch_ideal_without_recompute_is_8_over_6():
    # full = policy fwd+bwd of both branches (3F each) + reference fwd of both (F each) = 8F;
    # branch = kept 3F + pruned F + reference 2F = 6F.
    assert ratio(BODY, concat_step(), branch_step()) == pytest.approx(8 / 6, rel=1e-3)


def test_branch_ideal_with_full_recompute_is_10_over_7():
    assert ratio(BODY, concat_step(), branch_step(), recompute=True) == pytest.approx(10 / 7, rel=1e-3)


def test_forward_is_params_times_two_plus_causal_attention():
    mb = _mb([[SEQ]], RESP)
    f = fm.forward_flops(BODY, mb)
    params = BODY.layer_params() * BODY.layers
    assert f["body"] == pytest.approx(2 * params * SEQ + 4 * BODY.q_width * BODY.layers * SEQ * (SEQ + 1) / 2)
    assert f["head"] == pytest.approx(2 * BODY.hidden * BODY.vocab * RESP)


def test_position_pruning_shrinks_only_head_rows():
    shape = fm.Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=32768)
    full = fm.step_flops(shape, concat_step())
    pruned = fm.step_flops(shape, concat_step(scored=int(0.6 * RESP)))
    assert pruned["train_body"] == full["train_body"] and pruned["forward_body"] == full["forward_body"]
    assert pruned["train_head"] == pytest.approx(0.6 * full["train_head"])


def test_selective_head_vs_all_positions():
    shape = fm.Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=32768)
    rows = [[SEQ, SEQ]]
    sel = fm.forward_flops(shape, _mb(rows, 2 * RESP))["head"]
    base = fm.forward_flops(shape, _mb(rows, 2 * RESP, selective=False))["head"]
    assert base / sel == pytest.approx(SEQ / RESP)


def test_padded_view_counts_padding_and_the_whole_row():
    mb = _mb([[SEQ, SEQ // 2]], RESP, seq_length=2 * SEQ)
    ideal = fm.forward_flops(BODY, mb, view="ideal")["body"]
    padded = fm.forward_flops(BODY, mb, view="padded")["body"]
    assert padded > ideal * (2 * SEQ) / (1.5 * SEQ)  # more tokens and a quadratic over the whole row
    with pytest.raises(ValueError, match="view"):
        fm.forward_flops(BODY, mb, view="nope")


def test_sequence_pruning_shrinks_tokens_and_attention():
    short = [fm.Pass(kind=p.kind, microbatches=[_mb([[PROMPT + RESP // 2] * 2], RESP)]) for p in concat_step()]
    r = ratio(BODY, concat_step(), short)
    assert 1.0 < r < SEQ / (PROMPT + RESP // 2) + 0.05


def test_qwen3_4b_head_share_is_about_a_tenth():
    assert 0.09 < fm.head_share(QWEN3_4B, 512) < 0.10


def test_cpu_small_preset_head_share_resembles_qwen3_4b():
    from megatron_prune.model.arch import ModelArch
    from megatron_prune.model.provider import padded_vocab_size

    arch = ModelArch(**bench_dpo.PRESETS["cpu-small"]["arch"])
    shape = fm.Shape.from_arch(arch, vocab=padded_vocab_size(arch.vocab_size))
    assert abs(fm.head_share(shape, 512) - fm.head_share(QWEN3_4B, 512)) < 0.02


def test_memory_model_logits_dominate_without_selective_head():
    shape = fm.Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=151936)
    rows = [[SEQ, SEQ]]
    base = fm.step_peak_bytes(shape, [fm.Pass(kind="train", microbatches=[_mb(rows, 2 * RESP, selective=False)])],
                              optimizer_temporaries=0)
    sel = fm.step_peak_bytes(shape, [fm.Pass(kind="train", microbatches=[_mb(rows, 2 * RESP)])],
                             optimizer_temporaries=0)
    weight_grad = shape.vocab * shape.hidden * 4  # held by both
    assert base - weight_grad > 2 * (sel - weight_grad)
    assert base - sel == pytest.approx(2 * SEQ * shape.vocab * 4, rel=0.05)  # one fp32 rows x vocab
    rec = fm.step_peak_bytes(shape, [fm.Pass(kind="train", microbatches=[_mb(rows, 2 * RESP)])], recompute=True,
                             optimizer_temporaries=0)
    assert rec < sel


def test_pass_kind_is_validated_and_dicts_round_trip():
    with pytest.raises(ValueError, match="kind"):
        fm.Pass(kind="backward")
    passes = branch_step()
    again = fm.passes_from_dict(json.loads(json.dumps(fm.passes_to_dict(passes))))
    assert fm.step_flops(BODY, again) == fm.step_flops(BODY, passes)


def _fake_worker(mode: str, seconds: float) -> dict:
    spec = bench_dpo.MODES[mode]
    passes = branch_step() if spec["branch"] else concat_step()
    for p in passes:
        for mb in p.microbatches:
            mb.selective = spec["selective_head"]
    counters = dict(policy_tokens=2 * SEQ, ref_tokens=2 * SEQ, policy_padded_tokens=2 * SEQ,
                    ref_padded_tokens=2 * SEQ, scored_positions=2 * RESP, logits_rows=2 * RESP)
    rec = dict(step_time_s=seconds, peak_mem_bytes=1000, counters=counters,
               peak_mem_by_phase_bytes={"reference": 400, "train": 1000, "optimizer": 100},
               splits={"reference": 0.1, "train": seconds / 2, "optimizer": 0.01, "other": 0.0},
               passes=fm.passes_to_dict(passes))
    first = dict(rec, peak_alloc_bytes=800, live_at_peak=[["train forward aten::mm", 500]])
    timed_only = {k: v for k, v in rec.items() if not k.startswith("peak_mem")}  # past --memory-steps
    return {"records": [first, dict(rec, step_time_s=seconds * 1.2), dict(timed_only, step_time_s=seconds * 1.1)]}


def test_summary_has_the_documented_schema():
    shape = fm.Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=2048)
    modes = {m: bench_dpo.summarise(m, _fake_worker(m, 2.0 if m in ("full", "concat") else 1.5), shape=shape,
                                    recompute=False, bytes_per_elem=4) for m in bench_dpo.MODES}
    bench_dpo.add_ratios(modes)
    assert list(modes) == ["full", "concat", "selective", "position", "sequence", "branch", "position_branch", "all",
                           "shared", "shared_all", "shared_packed", "shared_all_packed", "concat_packed",
                           "branch_packed"]
    for m in modes.values():
        for key in ("step_time_s", "peak_mem_bytes", "policy_tokens", "speedup_vs_concat",
                    "ideal_speedup_vs_concat", "mem_ratio_vs_concat", "logits_elements", "ref_tokens"):
            assert key in m
    assert modes["concat"]["speedup_vs_concat"] == 1.0
    assert modes["branch"]["ideal_speedup_vs_concat"] > 1.2
    assert modes["branch"]["peak_mem_by_phase_bytes"]["train"] == 1000
    assert modes["branch"]["alloc_mem_ratio_vs_concat"] == 1.0
    assert modes["concat"]["token_saving_to_time"] is None  # no token saving, no ratio
    assert "branch" in bench_dpo.table(modes)
    assert "train forward aten::mm 0.0" in bench_dpo.memory_table(modes)


def test_token_saving_to_time_is_time_saving_over_token_saving():
    shape = fm.Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=2048)
    modes = {m: bench_dpo.summarise(m, _fake_worker(m, 2.0), shape=shape, recompute=False, bytes_per_elem=4)
             for m in ("concat", "sequence")}
    for key in ("policy_tokens", "ref_tokens"):
        modes["sequence"][key] *= 0.8  # 20% fewer tokens ...
    modes["concat"]["step_time_s"] = 2.0
    modes["sequence"]["step_time_s"] = 1.8  # ... 10% less time
    bench_dpo.add_ratios(modes)
    assert modes["sequence"]["token_saving_to_time"] == pytest.approx(0.5)


def test_memory_model_counts_the_optimizer_update_and_head_weight_gradient():
    shape = fm.Shape(hidden=256, layers=1, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=32768)
    tiny = [fm.Pass(kind="forward", microbatches=[_mb([[8]], 4)])]
    # torch's for-loop AdamW: two fp32 temporaries of the largest parameter; fused (default): none
    assert fm.step_peak_bytes(shape, tiny, optimizer_temporaries=2) == 2 * 32768 * 256 * 4
    assert fm.step_peak_bytes(shape, tiny) < 2 * 32768 * 256 * 4
    train = [fm.Pass(kind="train", microbatches=[_mb([[8]], 4)])]
    assert fm.step_peak_bytes(shape, train, optimizer_temporaries=0) > 32768 * 256 * 4  # the weight's gradient


@pytest.mark.slow
def test_bench_dpo_json_smoke(tmp_path):
    """Runs every mode in its own process for one step (about a minute on 2 quiet cores)."""
    out = tmp_path / "bench.json"
    bench_dpo.main(["--preset", "cpu-small", "--pairs", "2", "--warmup", "0", "--steps", "1",
                    "--max-seq-length", "128", "--json", str(out), "--plot", str(tmp_path / "bench.png")])
    data = json.loads(out.read_text())
    assert set(data["modes"]) == set(bench_dpo.MODES)
    assert data["config"]["preset"] == "cpu-small"
    for m in data["modes"].values():
        assert m["step_time_s"] > 0 and m["policy_tokens"] > 0
        assert {"speedup_vs_concat", "ideal_speedup_vs_concat", "mem_ratio_vs_concat"} <= set(m)
        assert m["peak_mem_bytes"] > 0 and m["peak_alloc_bytes"] > 0
        assert max(m["peak_mem_by_phase_bytes"].values()) == m["peak_mem_bytes"]
    # Branch pruning stores activations for one branch only: the tensor peak must fall.
    assert data["modes"]["branch"]["alloc_mem_ratio_vs_concat"] < 0.9
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_prompt_limit_follows_a_short_max_seq_length_and_is_checked(capsys):
    args = bench_dpo.parse_args(["--preset", "cpu-small", "--max-seq-length", "128"])
    assert args.max_prompt_length == 80  # the preset's 160 would leave no room for a response
    with pytest.raises(SystemExit) as exc:
        bench_dpo.parse_args(["--preset", "cpu-small", "--max-seq-length", "128", "--max-prompt-length", "128"])
    assert exc.value.code == 2
    assert "--max-prompt-length (128) must be in [1, --max-seq-length" in capsys.readouterr().err


def test_a_failed_mode_fails_the_run(tmp_path, capsys):
    with pytest.raises(SystemExit, match="failed.*concat"):  # a worker killed by --timeout
        bench_dpo.main(["--modes", "concat", "--steps", "1", "--warmup", "0", "--timeout", "0.5",
                        "--json", str(tmp_path / "out.json")])
    assert "concat: FAILED" in capsys.readouterr().out


def _worker_that_fails(fails: set, seconds: dict):
    """A stand-in for a bench_dpo worker: ``(mode, round)`` in ``fails`` exits non-zero, others write
    one record whose step takes ``seconds[mode, round]``."""
    import subprocess

    def launch(args, mode, out_path, *, lora_rank=None):
        rnd = int(out_path.rsplit("-", 1)[1].split(".")[0])
        if (mode, rnd) in fails:
            raise subprocess.CalledProcessError(1, ["worker", mode])
        t = seconds[mode, rnd]
        mb = {"rows": [[10]], "seq_length": 16, "scored": 5, "selective": True}
        record = {"step": 1, "step_time_s": t, "splits": {"train": t}, "peak_mem_bytes": 100,
                  "counters": {"policy_tokens": 10, "ref_tokens": 10, "policy_padded_tokens": 16, "logits_rows": 5},
                  "passes": [{"kind": "forward", "microbatches": [mb]}, {"kind": "train", "microbatches": [mb]}],
                  "peak_mem_by_phase_bytes": {"train": 100}}
        with open(out_path, "w") as f:
            json.dump({"mode": mode, "records": [record], "state_mem_bytes": 1000}, f)

    return launch


@pytest.mark.parametrize("failed", ["branch", "concat"])
def test_a_mode_that_fails_in_a_later_round_leaves_the_table(failed, tmp_path, monkeypatch):
    """--rounds 2, one mode failing in round 2: its round-1 figures leave the table and the JSON (they
    stayed as if measured); without concat, the denominator of every ratio, no mode keeps a row (the
    others' round-2 figures were silently left out of ratios to a stale concat)."""
    seconds = {("concat", 0): 1.0, ("branch", 0): 0.5, ("concat", 1): 1.0, ("branch", 1): 0.5}
    monkeypatch.setattr(bench_dpo, "launch", _worker_that_fails({(failed, 1)}, seconds))
    with pytest.raises(SystemExit, match=f"failed.*{failed}"):
        bench_dpo.main(["--preset", "cpu-small", "--modes", "concat", "branch", "--rounds", "2", "--steps", "1",
                        "--json", str(tmp_path / "out.json")])
    saved = json.loads((tmp_path / "out.json").read_text())
    assert failed not in saved["modes"] and failed in saved["failed"]
    assert sorted(saved["modes"]) == ([] if failed == "concat" else ["concat"])


@pytest.mark.parametrize("extra, message", [
    ([], "broken.jsonl:1: malformed json"),
    (["--skip-invalid-records"], "broken.jsonl: no usable preference pairs"),
])
def test_bad_data_stops_the_tool_in_one_line_before_any_worker(tmp_path, monkeypatch, extra, message):
    broken = tmp_path / "broken.jsonl"  # a data file the flags accept and no worker could read
    broken.write_text("not a JSON record\n")
    monkeypatch.setattr(bench_dpo, "launch", lambda *a, **k: pytest.fail("a worker started"))
    with pytest.raises(SystemExit) as exc:
        bench_dpo.main(["--modes", "concat", "--data-path", str(broken), *extra])
    assert message in str(exc.value) and str(exc.value).startswith("bench_dpo.py: ")
    assert ("--skip-invalid-records" in str(exc.value)) == (not extra)


def test_records_unusable_at_a_short_max_seq_length_are_named_or_skipped(capsys):
    args = bench_dpo.parse_args(["--max-seq-length", "16", "--pairs", "4"])
    with pytest.raises(SystemExit, match=r"hh_rlhf_sample.jsonl:\d+: identical responses.*--skip-invalid-records"):
        bench_dpo.check_pairs(args)
    args = bench_dpo.parse_args(["--max-seq-length", "16", "--pairs", "4", "--skip-invalid-records"])
    pairs, _ = bench_dpo.load_pairs(args, 1000)
    assert len(pairs) == 4 and all(p.chosen_ids != p.rejected_ids for _, p in pairs)


def test_a_missing_data_file_is_refused_before_any_mode_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_dpo.parse_args(["--data-path", str(tmp_path / "no-such-file.jsonl")])
    assert exc.value.code == 2
    assert f"--data-path {tmp_path / 'no-such-file.jsonl'}: data file not found" in capsys.readouterr().err


# --- LoRA ---------------------------------------------------------------------------------------
# A shape small enough to count by hand: hidden 4, one layer, one head of 4, ffn 8, vocab 10.
HAND = fm.Shape(hidden=4, layers=1, heads=1, kv_heads=1, head_dim=4, ffn=8, vocab=10)


def test_lora_step_counted_by_hand():
    """One row of 3 tokens, all scored; LoRA rank 2 on every linear.

    weights 4*12 + 4*4 + 3*4*8 = 160 -> forward matmuls 2*160*3 = 960 FLOPs; attention 4*4*(1+2+3) = 96;
    adapters 2*(4+12) + 2*(4+4) + 2*(4+16) + 2*(8+4) = 112 parameters -> forward 2*112*3 = 672;
    head 2*4*10*3 = 240.
    LoRA training pass: 2*960 (forward, dX; no dW) + 3*96 + 3*672 (forward, dX, dA/dB) + 2*240 = 4704;
    adapter-off reference: 960 + 96 + 240 = 1296; with full recompute one more forward with
    adapters: 960 + 96 + 672 = 1728. Full-parameter training pass: 3 * (960 + 96 + 240) = 3888.
    """
    mb = _mb([[3]], 3)
    assert HAND.adapter_params(2) == 112
    train, ref = fm.Pass(kind="train", microbatches=[mb]), fm.Pass(kind="forward", microbatches=[mb], adapters=False)
    lora = fm.step_flops(HAND, [ref, train], lora_rank=2)
    assert lora["train_body"] == 2 * 960 + 3 * 96 + 3 * 672 and lora["train_head"] == 2 * 240
    assert lora["forward_body"] == 960 + 96 and lora["forward_head"] == 240
    assert lora["total"] == 4704 + 1296
    assert fm.step_flops(HAND, [ref, train], lora_rank=2, recompute=True)["total"] == 4704 + 1296 + 1728
    # A forward of the policy (a pruned branch) runs its adapters.
    assert fm.step_flops(HAND, [fm.Pass(kind="forward", microbatches=[mb])], lora_rank=2)["total"] == 1296 + 672
    # The padded view's selective head recomputes its logits in backward: one more head forward.
    assert fm.step_flops(HAND, [train], lora_rank=2, view="padded")["train_head"] == 3 * 240
    # rank 0 is the full-parameter model.
    assert fm.step_flops(HAND, [ref, train])["total"] == 3888 + 1296
    # Only some linears adapted: attention's two.
    assert HAND.adapter_params(2, ("linear_qkv", "linear_proj")) == 32 + 16
    with pytest.raises(ValueError, match="unknown LoRA target"):
        HAND.adapter_params(2, ("linear_q",))


def _lora_steps(length: int):
    def mb(rows, scored):
        return _mb(rows, scored)

    full = [fm.Pass(kind="forward", adapters=False, microbatches=[mb([[length, length]], 2)]),
            fm.Pass(kind="train", microbatches=[mb([[length, length]], 2)])]
    branch = [fm.Pass(kind="forward", adapters=False, microbatches=[mb([[length, length]], 2)]),
              fm.Pass(kind="forward", microbatches=[mb([[length]], 1)]),
              fm.Pass(kind="train", microbatches=[mb([[length]], 1)])]
    return full, branch


def test_lora_branch_ideal_is_6_over_5_and_8_over_6_with_recompute():
    # Weight matmuls dominate (one-token rows: no attention; rank 1: adapters 0.5 %). F = one branch's
    # forward. Without recompute: full = reference 2F + training 2 x (forward F + dX F) = 6F;
    # branch = 2F + pruned F + kept 2F = 5F. Full recompute adds a forward per trained branch: 8F vs 6F.
    full, branch = _lora_steps(1)
    assert ratio(BODY, full, branch, lora_rank=1) == pytest.approx(6 / 5, rel=3e-3)
    assert ratio(BODY, full, branch, lora_rank=1, recompute=True) == pytest.approx(8 / 6, rel=3e-3)
    # Full-parameter training is 3F per branch: 8F vs 6F (the ideal LoRA lowers from 4/3 to 6/5).
    assert ratio(BODY, full, branch) == pytest.approx(8 / 6, rel=1e-3)


def test_lora_flags_reach_the_benchmark_and_pass_dicts_keep_the_adapter_off_reference(capsys):
    full, _ = _lora_steps(5)
    again = fm.passes_from_dict(json.loads(json.dumps(fm.passes_to_dict(full))))
    assert [p.adapters for p in again] == [False, True]
    assert fm.step_flops(HAND, again, lora_rank=2) == fm.step_flops(HAND, full, lora_rank=2)
    assert bench_dpo.parse_args(["--lora-rank", "64"]).lora_rank == 64
    assert bench_dpo.parse_args([]).lora_rank == 0
    with pytest.raises(SystemExit) as exc:
        bench_dpo.parse_args(["--lora-rank", "-1"])
    assert exc.value.code == 2 and "argument --lora-rank: must be >= 0, got -1" in capsys.readouterr().err


def test_lora_memory_is_compared_with_full_parameter_concat():
    shape = fm.Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=2048)
    raw = _fake_worker("branch", 1.5)
    raw["state_mem_bytes"] = 500
    full_param = _fake_worker("concat", 2.0)
    full_param["state_mem_bytes"] = 4000
    modes = {"branch": bench_dpo.summarise("branch", raw, shape=shape, recompute=False, bytes_per_elem=4,
                                           lora_rank=8)}
    ref = bench_dpo.summarise("concat", full_param, shape=shape, recompute=False, bytes_per_elem=4)
    bench_dpo.add_full_param_ratios(modes, ref)
    # total = persistent state + the step's peak (median over the memory steps: 1000)
    assert modes["branch"]["total_mem_bytes"] == 1500 and ref["total_mem_bytes"] == 5000
    assert modes["branch"]["total_mem_ratio_vs_full_param"] == pytest.approx(0.3)
    # with the allocator peaks (800 in both) instead of RSS, and from the memory model
    assert modes["branch"]["total_alloc_mem_ratio_vs_full_param"] == pytest.approx(1300 / 4800)
    model = modes["branch"]["model_total_mem_ratio_vs_full_param"]
    assert model == pytest.approx((fm.state_bytes(shape, lora_rank=8) + modes["branch"]["model_peak_mem_bytes"])
                                  / (fm.state_bytes(shape) + ref["model_peak_mem_bytes"]))
    assert model < 1
    assert "vs full-param" in bench_dpo.lora_table(modes, ref)


def test_shared_row_counts_the_prompt_once_and_attention_per_segment():
    """[prompt, chosen, rejected] executes P + C + R tokens; each response attends to the prompt
    and causally to itself, never to the other response."""
    p, c, r = 7, 3, 4
    shared = fm.Microbatch(rows=[[p, c, r]], prefixes=[[0, p, p]], seq_length=p + c + r, scored=c + r)
    concat = fm.Microbatch(rows=[[p + c, p + r]], seq_length=2 * p + c + r, scored=c + r)
    assert shared.tokens == p + c + r
    pairs = p * (p + 1) / 2 + c * p + c * (c + 1) / 2 + r * p + r * (r + 1) / 2
    got = fm.forward_flops(BODY, shared)
    assert got["attention"] == BODY.attention_flops(pairs)
    assert got["body"] == BODY.body_flops_per_token() * (p + c + r) + BODY.attention_flops(pairs)
    # concat's attention holds the prompt's pairs twice; shared's the prompt's once plus the responses' cross terms
    assert fm.forward_flops(BODY, concat)["attention"] - got["attention"] == BODY.attention_flops(p * (p + 1) / 2)
    again = fm.passes_from_dict(fm.passes_to_dict([fm.Pass(kind="forward", microbatches=[shared])]))
    assert again[0].microbatches[0].prefixes == [[0, p, p]]


# --- mixture of experts ---------------------------------------------------------------------------
def _moe_arch(**kw):
    from megatron_prune.model.arch import ModelArch

    # 4 layers; decoder_sparse_step 2 makes layers 1 and 3 sparse, mlp_only_layers keeps layer 1 dense.
    fields = dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=4,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=4, qk_norm=True, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=6, decoder_sparse_step=2, mlp_only_layers=[1])
    return ModelArch(**{**fields, **kw})


def _dense_like(arch, **kw):
    """``arch`` without experts (every layer a dense MLP), fields in ``kw`` replaced."""
    import dataclasses

    return dataclasses.replace(arch, model_type="qwen3", num_experts=0, num_experts_per_tok=0,
                               moe_intermediate_size=None, mlp_only_layers=[], decoder_sparse_step=1, **kw)


def test_moe_counts_active_parameters_by_hand():
    """Per token: attention 8*(8 + 2*4) + 8*8 = 192 in every layer; dense MLP 3*8*16 = 384 in layers
    0, 1, 2; the one MoE layer (3) runs the router 8*4 = 32 and 2 of its 4 experts, 2*3*8*6 = 288.
    Body 4*192 + 3*384 + 32 + 288 = 2240 parameters -> 4480 FLOPs per token; a 3-token row adds
    attention 4*8*4*(1+2+3) = 768; head 2*8*10 per scored row."""
    shape = fm.Shape.from_arch(_moe_arch())
    assert (shape.moe_layers, shape.num_experts, shape.top_k, shape.expert_ffn) == (1, 4, 2, 6)
    assert shape.body_flops_per_token() == 2 * 2240
    f = fm.forward_flops(shape, _mb([[3]], 2))
    assert f["body"] == 2 * 2240 * 3 + 768 and f["head"] == 2 * 8 * 10 * 2
    # The benchmark's JSON records the architecture as a dict: the same shape.
    assert fm.Shape.from_arch(_moe_arch().to_dict()) == shape
    # All experts' weights would be 4 * 3*8*6 = 576 per MoE layer; only the routed ones count.
    assert fm.Shape.from_arch(_moe_arch(num_experts_per_tok=4)).body_flops_per_token() == 2 * (2240 + 288)


def test_moe_with_every_expert_routed_is_a_dense_mlp_of_all_experts_plus_the_router():
    """top_k = num_experts runs every expert: the MLP of a dense model whose inner width is
    num_experts * expert_ffn (SwiGLU is separable over inner units), plus the router."""
    arch = _moe_arch(num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[])
    moe = fm.Shape.from_arch(arch)
    dense = fm.Shape.from_arch(_dense_like(arch, intermediate_size=4 * 6))
    assert moe.moe_layers == 4 and dense.moe_layers == 0
    router_fwd = 2.0 * 8 * 4 * moe.layers  # per token, all layers
    for step in (concat_step(), branch_step()):
        tokens = sum(mb.tokens * (3 if p.kind == "train" else 1) for p in step for mb in p.microbatches)
        assert fm.step_flops(moe, step)["total"] - fm.step_flops(dense, step)["total"] == pytest.approx(
            router_fwd * tokens, rel=1e-12)


def test_moe_shape_is_validated_and_its_memory_model_uses_the_routed_experts():
    with pytest.raises(ValueError, match="top_k"):
        fm.Shape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10, moe_layers=1, num_experts=4,
                 top_k=5, expert_ffn=6)
    with pytest.raises(ValueError, match="moe_layers"):
        fm.Shape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=10, moe_layers=3, num_experts=4,
                 top_k=2, expert_ffn=6)
    few = fm.Shape.from_arch(_moe_arch(num_experts_per_tok=1, norm_topk_prob=False))
    many = fm.Shape.from_arch(_moe_arch(num_experts_per_tok=4))
    step = concat_step()
    assert fm.step_peak_bytes(few, step) < fm.step_peak_bytes(many, step)
    # LoRA on a MoE layer adapts the routed experts' linears: more routed experts, more adapter FLOPs.
    assert few.adapter_flops_per_token(2) < many.adapter_flops_per_token(2)


def test_cpu_moe_small_preset_routes_half_of_cpu_small_mlp_width():
    """cpu-moe-small: cpu-small's attention and vocabulary, every layer a MoE of 8 experts of width
    256, top-2: per token the MLP runs 2 * 256 = 512 of cpu-small's 1024 inner units, plus an
    8-wide router; the options the benchmark documents parse."""
    from megatron_prune.model.arch import ModelArch

    args = bench_dpo.parse_args(["--preset", "cpu-moe-small", "--modes", "branch", "--json", "/tmp/x.json"])
    assert args.modes == ["concat", "branch"] and args.json == "/tmp/x.json" and args.device == "cpu"
    assert bench_dpo.parse_args(["--preset", "cpu-moe-small", "--lora-rank", "8"]).lora_rank == 8
    moe = fm.Shape.from_arch(ModelArch(**bench_dpo.PRESETS["cpu-moe-small"]["arch"]))
    dense = fm.Shape.from_arch(ModelArch(**bench_dpo.PRESETS["cpu-small"]["arch"]))
    assert moe.moe_layers == moe.layers == 4
    h = 256
    assert dense.active_params() - moe.active_params() == 4 * (3 * h * 1024 - (h * 8 + 2 * 3 * h * 256))


@pytest.mark.benchmark
def test_bench_dpo_moe_json_smoke(tmp_path):
    """cpu-moe-small through the benchmark (two modes, one step each): the JSON records the
    MoE architecture, its active parameters, and FLOP ratios from the active-parameter model."""
    out = tmp_path / "bench.json"
    bench_dpo.main(["--preset", "cpu-moe-small", "--modes", "branch", "--pairs", "2", "--warmup", "0", "--steps", "1",
                    "--max-seq-length", "128", "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"concat", "branch"}
    assert data["config"]["arch"]["num_experts"] == 8
    from megatron_prune.model.arch import ModelArch

    shape = fm.Shape.from_arch(ModelArch(**data["config"]["arch"]), vocab=data["config"]["padded_vocab"])
    assert data["config"]["active_params_per_token"] == shape.active_params()
    for name, m in data["modes"].items():
        passes = fm.passes_from_dict(data["records"][name][0]["passes"])
        assert m["flops_ideal"] == pytest.approx(fm.step_flops(shape, passes)["total"])
    assert data["modes"]["branch"]["ideal_speedup_vs_concat"] > 1.2


def test_gpu_bench_commands_parse_and_the_moe_slice_fits_one_h200(tmp_path):
    """Every benchmark line of tools/gpu_bench.sh parses (its dry run prints them); the
    Qwen3-30B-A3B slice keeps the model's widths, and its training state (bf16 weights, fp32
    gradients, fp32 main weights, Adam's two moments: 18 bytes a parameter; the bf16 reference
    2 more) stays well inside one H200's 141 GB with EP=1."""
    import shlex
    import subprocess

    from megatron_prune.model.arch import ModelArch

    script = os.path.join(TOOLS, "gpu_bench.sh")
    out = subprocess.run(["bash", script], env=dict(os.environ, DRY_RUN="1", OUT=str(tmp_path)), check=True,
                         capture_output=True, text=True).stdout
    lines = [shlex.split(line.split("] ", 1)[1]) for line in out.splitlines() if "tools/bench_dpo.py" in line]
    presets = {bench_dpo.parse_args(words[words.index("tools/bench_dpo.py") + 1:]).preset for words in lines}
    assert "gpu-qwen3-30b-a3b-slice" in presets
    arch = ModelArch(**bench_dpo.PRESETS["gpu-qwen3-30b-a3b-slice"]["arch"])
    assert (arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.num_experts,
            arch.num_experts_per_tok, arch.moe_intermediate_size, arch.vocab_size) == (
                2048, 32, 4, 128, 128, 8, 768, 151936)
    assert arch.model_type == "qwen3_moe" and arch.norm_topk_prob and arch.moe_layer_pattern() == [1] * arch.num_layers
    h = arch.hidden_size
    layer = h * 32 * 128 * 2 + h * 4 * 128 * 2 + h * 128 + 128 * 3 * h * 768
    params = arch.num_layers * layer + 2 * 151936 * h  # untied embedding and output layer (before padding)
    assert 60e9 < 20 * params < 100e9


def _trainer_state_bytes(cases: tuple[tuple[str, int], ...]) -> dict[tuple[str, int], tuple[int, dict]]:
    """The persistent tensors bench_dpo counts after one optimizer step: the policy, its reference
    (a second model, or the adapter-off view under LoRA), gradient buffers and Adam's state
    (created by the first step); per (preset, LoRA rank), with the model's shape."""
    return {case: _one_state(*case) for case in cases}


def _one_state(preset: str, lora_rank: int) -> tuple[int, dict]:
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.lora import LoRAConfig, adapter_off
    from megatron_prune.model.provider import ParallelConfig, padded_vocab_size
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    arch = get_preset(preset)
    with model_parallel(par, seed=3):
        if lora_rank:
            policy = setup_model(arch, par, seed=3, lora=LoRAConfig(rank=lora_rank))
            reference = adapter_off(policy)
        else:
            policy = setup_model(arch, par, seed=3)
            reference = setup_model(arch, par, seed=3, trainable=False)
        optimizer = build_optimizer(policy, OptimConfig(optimizer="adam", lr=1e-6), bf16=False)
        optimizer.step()
        return bench_dpo.state_bytes(policy, reference, optimizer), dict(
            arch=arch.to_dict(), vocab=padded_vocab_size(arch.vocab_size))


def test_state_model_equals_the_trainers_persistent_tensors():
    """flop_model.state_bytes against the tensors a real trainer holds (one rank): full-parameter
    with an online reference, and LoRA rank 8 with the adapter-off reference, on the dense tiny
    preset and on tiny-moe (an adapter per expert)."""
    from tests.dist import run_distributed

    cases = (("tiny", 0), ("tiny", 8), ("tiny-moe", 0), ("tiny-moe", 8))
    results = run_distributed(_trainer_state_bytes, 1, cases=cases)[0]
    for (preset, rank), (measured, spec) in results.items():
        shape = fm.Shape.from_arch(spec["arch"], vocab=spec["vocab"])
        assert fm.state_bytes(shape, lora_rank=rank) == measured, f"{preset}, lora rank {rank}"
    assert results[("tiny", 8)][0] < results[("tiny", 0)][0] / 2


def test_state_model_by_hand_and_lora_memory_at_real_widths():
    # HAND: 4*12 + 4*4 + 3*4*8 = 160 matmul weights, norms 2*4 per layer + 4 final, embedding and
    # head 2*10*4: 252 weights. fp32 Adam: 16 bytes each, the online reference 4 more.
    assert HAND.param_count() == 252
    assert fm.state_bytes(HAND) == 252 * 20 and fm.state_bytes(HAND, online_reference=False) == 252 * 16
    # bf16: weight 2, fp32 gradient 4, fp32 main copy 4, moments 8.
    assert fm.state_bytes(HAND, param_bytes=2) == 252 * (18 + 2)
    # LoRA rank 2: the base once (no reference copy), 112 adapter weights at 16 bytes.
    assert fm.state_bytes(HAND, lora_rank=2) == 252 * 4 + 112 * 16
    tied = fm.Shape(hidden=4, layers=1, heads=1, kv_heads=1, head_dim=4, ffn=8, vocab=10, tied_embeddings=True,
                    qk_norm=True)
    assert tied.param_count() == 252 - 40 + 2 * 4
    # Qwen3-4B in bf16 (tied embeddings, q/k norms): full-parameter with an online reference needs
    # about 20 bytes per weight (80 GB); LoRA-64 on every linear the bf16 base and 18 bytes per
    # adapter weight: under a seventh of it before activations.
    qwen = fm.Shape(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=9728, vocab=151936,
                    qk_norm=True, tied_embeddings=True)
    assert 4.0e9 < qwen.param_count() < 4.1e9
    ratio = fm.state_bytes(qwen, lora_rank=64, param_bytes=2) / fm.state_bytes(qwen, param_bytes=2)
    assert 0.12 < ratio < 0.14


def test_lora_memory_model_keeps_adapter_activations_and_drops_frozen_gradients():
    """A LoRA training microbatch keeps each adapter's rank-r activation but not the head weight's
    gradient (the norms keep only their inputs in either case)."""
    shape = fm.Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=2048, qk_norm=True)
    mb = _mb([[SEQ, SEQ]], 2 * RESP)
    train = [fm.Pass(kind="train", microbatches=[mb])]
    full, lora = fm.step_peak_bytes(shape, train), fm.step_peak_bytes(shape, train, lora_rank=64)
    per_token_layer = 4 * 64
    assert lora - full == pytest.approx((shape.layers * per_token_layer * mb.padded_tokens
                                         - shape.vocab * shape.hidden) * 4)
    only_attention = fm.step_peak_bytes(shape, train, lora_rank=64, lora_targets=("linear_qkv", "linear_proj"))
    assert lora - only_attention == pytest.approx(shape.layers * 2 * 64 * mb.padded_tokens * 4)
    # A forward-only pass keeps one layer's working set either way.
    ref = [fm.Pass(kind="forward", microbatches=[mb], adapters=False)]
    assert fm.step_peak_bytes(shape, ref, lora_rank=64) == fm.step_peak_bytes(shape, ref)


def test_memory_model_charges_segment_attention_its_own_keys_so_packing_rows_costs_nothing():
    shape = fm.Shape(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=1024, vocab=2048)
    # Two shared rows [P, C, R] = [10, 6, 4] and [12, 3, 5], unpadded, against the same four
    # segments laid end to end in one row (--dpo-pack-rows).
    rows = fm.Microbatch(rows=[[10, 6, 4], [12, 3, 5]], prefixes=[[0, 10, 10], [0, 12, 12]], seq_length=20, scored=18)
    packed = fm.Microbatch(rows=[[10, 6, 4, 12, 3, 5]], prefixes=[[0, 10, 10, 0, 12, 12]], seq_length=40, scored=18)
    keys = (10 * 11 / 2 + 6 * 10 + 6 * 7 / 2 + 4 * 10 + 4 * 5 / 2 + 12 * 13 / 2 + 3 * 12 + 3 * 4 / 2
            + 5 * 12 + 5 * 6 / 2) / 40
    assert rows.attention_keys == packed.attention_keys == pytest.approx(keys)
    for kind in ("train", "forward"):
        one = fm.step_peak_bytes(shape, [fm.Pass(kind=kind, microbatches=[rows])])
        assert fm.step_peak_bytes(shape, [fm.Pass(kind=kind, microbatches=[packed])]) == pytest.approx(one)
    dense = fm.Microbatch(rows=[[20], [20]], seq_length=20, scored=18)  # no prefixes: a causal row's full mask
    assert dense.attention_keys == 20
