"""Two "nodes" of two processes each on localhost, launched the way a cluster launches them: one torchrun agent per
node, meeting through c10d rendezvous. HYBRID_SHARD shards within a node and replicates across nodes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fsdp_trainer.config import ModelConfig
from fsdp_trainer.model import count_params
from tests.helpers import REPO, TINY_MODEL, free_port, read_metrics, run_args, train_multinode, wait_for_step


def _run(tiny_data, out_dir, sharding, **overrides):
    args = run_args(tiny_data, out_dir, parallel={"sharding": sharding}, checkpoint={"every": 10}, **overrides)
    outputs = train_multinode(args)
    records = read_metrics(out_dir)
    return outputs, {r["step"]: r["loss"] for r in records if "loss" in r}, next(r for r in records if "state_gb" in r)


@pytest.mark.slow
def test_hybrid_shard_on_two_nodes_matches_full_shard(tiny_data, tmp_path):
    outputs, full, full_state = _run(tiny_data, tmp_path / "full", "FULL_SHARD")
    # The same global batch in 2 micro-steps of 1 sequence: each reduce-scattered within the node, the two summed and
    # all-reduced across the nodes at the second.
    accumulating = {"data": {"micro_batch_size": 1, "grad_accum_steps": 2}}
    _, hybrid, hybrid_state = _run(tiny_data, tmp_path / "hybrid", "HYBRID_SHARD", **accumulating)

    # 4 ranks, one global batch; the losses agree to float rounding (the reductions are grouped differently).
    assert "| 4 rank(s), FULL_SHARD" in "".join(outputs)
    assert sorted(full) == list(range(1, 11)) and full[10] < full[1] - 0.5
    for step in full:
        assert hybrid[step] == pytest.approx(full[step], rel=1e-5), step

    # Memory per rank follows the formula: fp32 params, grads and the two AdamW moments, 16 bytes per parameter,
    # divided by the 4 ranks of FULL_SHARD and by the 2 ranks of a node for HYBRID_SHARD.
    n_params = count_params(ModelConfig(**TINY_MODEL))
    for state, shard_group in ((full_state, 4), (hybrid_state, 2)):
        assert state["params_gb"] == pytest.approx(4 * n_params / shard_group / 1e9, rel=0.02)
        assert state["grads_gb"] == pytest.approx(state["params_gb"])
        assert state["optimizer_gb"] == pytest.approx(2 * state["params_gb"], rel=0.01)
    assert hybrid_state["state_gb"] == pytest.approx(2 * full_state["state_gb"], rel=0.02)

    # Both saved a checkpoint that the two nodes wrote together.
    for name in ("full", "hybrid"):
        assert (tmp_path / name / "checkpoints" / "latest").read_text().strip() == "step_00000010"


FAKE_SRUN = """#!/bin/bash
# srun on one machine: the command once per node, side by side; SIGTERM (as Slurm sends on requeue) goes to all
echo $$ > "$FAKE_SLURM/srun.pid"
while [[ $1 == --* ]]; do shift; done  # srun's own options
pids=()
for _ in $(seq "$SLURM_NNODES"); do "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
    until wait "$pid"; do kill -0 "$pid" 2>/dev/null || { status=1; break; }; done
done
exit $status
"""

FAKE_SCONTROL = """#!/bin/bash
case "$1" in
    show) for _ in $(seq "$SLURM_NNODES"); do echo localhost; sleep 0.2; done ;;  # a node list longer than a pipe read
    requeue) echo "requeue $2" >> "$FAKE_SLURM/requeued"; kill -TERM "$(cat "$FAKE_SLURM/srun.pid")" ;;
esac
"""


@pytest.mark.slow
def test_slurm_script_launches_nodes_requeues_near_the_time_limit_and_resumes(tiny_data, tmp_path):
    """tools/slurm/train.sbatch under stand-ins for srun and scontrol: 2 nodes x 2 ranks; USR1 (Slurm's warning before
    the time limit) requeues the job, the workers save the step they are at, and the requeued job resumes there."""
    fake = tmp_path / "fake_slurm"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    out = tmp_path / "run"
    env = {
        **os.environ,
        "PATH": f"{fake}:{os.environ['PATH']}",
        "FAKE_SLURM": str(fake),
        "PYTHON": sys.executable,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "test",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "NPROC_PER_NODE": "2",
        "OUT_DIR": str(out),
        "OMP_NUM_THREADS": "1",
    }
    script = [str(REPO / "tools" / "slurm" / "train.sbatch"), str(tiny_data), "--train.log_every", "1"]

    log = tmp_path / "job1.log"
    env["PORT"] = str(free_port())
    with open(log, "w") as f:
        job = subprocess.Popen([*script, "--train.steps", "100000"], stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_step(out, 3, job, log)
        job.send_signal(signal.SIGUSR1)
        job.wait(timeout=900)
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert (fake / "requeued").read_text() == "requeue 4242\n", text[-3000:]
    assert "SIGTERM: saving step" in text and "2 node(s) x 2" in text
    saved = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert saved >= 3

    # The requeued job: same job id, so same out_dir; it resumes from latest and finishes.
    env["PORT"] = str(free_port())
    proc = subprocess.run(
        [*script, "--train.steps", str(saved + 2)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {out}/checkpoints/step_{saved:08d} at step {saved}" in proc.stdout
    steps = [r["step"] for r in read_metrics(out) if "loss" in r]
    assert steps == list(range(1, saved + 3))  # each step logged once across the two jobs
