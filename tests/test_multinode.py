"""Two "nodes" of two processes each on localhost, launched the way a cluster launches them: one torchrun agent per
node, meeting through c10d rendezvous. HYBRID_SHARD shards within a node and replicates across nodes."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from fsdp_trainer.config import ModelConfig
from fsdp_trainer.model import count_params
from tests.helpers import (
    REPO,
    TINY_MODEL,
    forked,
    free_port,
    read_metrics,
    run_args,
    train_cli,
    train_losses,
    train_multinode,
    wait_for_step,
)


def _state(records: list[dict]) -> dict:
    return next(r for r in records if "state_gb" in r)


def _assert_zero_3_state(state: dict, shard_group: int) -> None:
    """fp32 params, grads and the two AdamW moments, 16 bytes per parameter, divided by the ranks they are sharded
    over."""
    n_params = count_params(ModelConfig(**TINY_MODEL))
    assert state["params_gb"] == pytest.approx(4 * n_params / shard_group / 1e9, rel=0.02)
    assert state["grads_gb"] == pytest.approx(state["params_gb"])
    assert state["optimizer_gb"] == pytest.approx(2 * state["params_gb"], rel=0.01)


@pytest.mark.slow
def test_hybrid_shard_on_two_nodes_matches_one_process(tiny_data, tmp_path):
    """HSDP with context parallelism within each node: the node's 2 ranks split each window, so the 4 ranks read 2
    windows a micro-step, in 2 micro-steps: each micro-step's gradients reduce-scattered within the node, the two
    summed and all-reduced across the nodes at the second. One process takes the same windows in 4 micro-batches of 1.
    The losses agree to float rounding (the reductions are grouped differently); the state is sharded within a node
    and replicated across the two; the checkpoint is one the two nodes wrote together. (One launch of two agents for
    both: each costs ~20 s of CPU.)"""
    flags = {"checkpoint": {"every": 10}}
    split = {"parallel": {"sharding": "HYBRID_SHARD", "context_parallel": 2},
             "data": {"micro_batch_size": 1, "grad_accum_steps": 2}}  # fmt: skip
    outputs = train_multinode(run_args(tiny_data, tmp_path / "hybrid", **split, **flags))
    train_cli(run_args(tiny_data, tmp_path / "one", data={"micro_batch_size": 1, "grad_accum_steps": 4}, **flags))
    one, records = train_losses(tmp_path / "one"), read_metrics(tmp_path / "hybrid")
    assert "| 4 rank(s) (context parallel 2), HYBRID_SHARD" in "".join(outputs)
    assert sorted(one) == list(range(1, 11)) and one[10] < one[1] - 0.5
    assert train_losses(tmp_path / "hybrid") == pytest.approx(one, rel=1e-5)
    _assert_zero_3_state(_state(records), shard_group=2)  # sharded within a node, replicated across the two
    assert (tmp_path / "hybrid" / "checkpoints" / "latest").read_text().strip() == "step_00000010"


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
    """tools/slurm/train.sbatch under stand-ins for srun and scontrol: 2 nodes of a rank each; USR1 (Slurm's warning
    before the time limit) requeues the job, the workers save the step they are at, and the requeued job resumes
    there. Each node's launcher is forked from the tests' forkserver (its PYTHON: forked.STAND_IN), its workers new
    interpreters as torchrun starts them."""
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
        "PYTHON": str(forked.STAND_IN),
        **forked.stand_in_env(),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "test",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "NPROC_PER_NODE": "1",
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
    assert "SIGTERM: saving step" in text and "2 node(s) x 1" in text
    saved = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert saved >= 3

    # The requeued job: same job id, so same out_dir; it resumes from latest and finishes.
    env["PORT"] = str(free_port())
    proc = subprocess.run(
        [*script, "--train.steps", str(saved + 2)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {out}/checkpoints/step_{saved:08d} at step {saved}" in proc.stdout
    records = read_metrics(out)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, saved + 3))  # each step logged once
    _assert_zero_3_state(_state(records), shard_group=2)  # FULL_SHARD over both nodes
