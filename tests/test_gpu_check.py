"""benchmarks/gpu_check.py at toy size on the CPU, as CI runs it on every change: every check but the CUDA kernels
themselves (the debug recipe killed after a checkpoint and resumed, the SFT and LoRA / QLoRA rows beside the
planner's, flex_attention against the dense mask, CPU offload, the sampler's rate) passes, and both reports are
written."""

from __future__ import annotations

import json

from tests.helpers import REPO, script

GPU_CHECK = REPO / "benchmarks" / "gpu_check.py"


def test_every_check_runs_at_toy_size_on_a_cpu_and_writes_both_reports(tmp_path):
    proc = script(GPU_CHECK, "--device", "cpu", "--tiny", "--out", tmp_path, check=False)  # forked, as python runs it
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = report["checks"]
    assert list(checks) == ["environment", "debug_recipe", "sft_speed", "flex_equals_dense", "lora_speed",
                            "cpu_offload", "rollouts"]  # fmt: skip
    assert all(check["status"] == "passed" for check in checks.values()), checks
    found = {name: check["found"] for name, check in checks.items()}
    assert found["environment"]["torch"].startswith("2.") and found["environment"]["flex_attention"] is True
    debug = found["debug_recipe"]
    assert debug["resume_bitwise"] and debug["killed_after_step"] == 6 and debug["last_loss"] < debug["first_loss"]
    for row in ("sft_eager_none", "sft_eager_selective"):
        assert found["sft_speed"][row]["tokens_per_s"] > 0 and found["sft_speed"][row]["planned_gb"] > 0
    assert found["sft_speed"]["compile"] == "skipped on a CPU"
    assert all(found["flex_equals_dense"][family]["relative_gap"] < 1e-4 for family in ("qwen3", "mistral"))
    assert set(found["lora_speed"]) == {"lora", "qlora"} and found["lora_speed"]["qlora"]["tokens_per_s"] > 0
    assert found["rollouts"]["tokens"] == 8 * 8 * 16
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} | passed |" in table for name in checks)


def test_a_check_out_of_time_is_killed_with_what_it_started_and_the_next_runs(tmp_path):
    # the debug recipe prepares data and trains: never within half a second; the sampler has its 30 s
    proc = script(GPU_CHECK, "--device", "cpu", "--tiny", "--out", tmp_path, "--only", "debug_recipe", "rollouts",
                  "--limit", "debug_recipe=0.5", check=False)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert checks["debug_recipe"]["status"] == "timeout" and checks["rollouts"]["status"] == "passed"
    assert "no result within 0.5 s" in checks["debug_recipe"]["error"]


def test_the_planner_knows_a_cuda_device_by_its_name():
    from fsdp_trainer.planner.speed import gpu_named

    assert gpu_named("NVIDIA H100 80GB HBM3") == "H100" and gpu_named("NVIDIA H200") == "H200"
    assert gpu_named("NVIDIA A100-SXM4-80GB") == "A100" and gpu_named("Tesla T4") is None
