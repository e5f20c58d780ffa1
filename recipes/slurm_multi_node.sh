#!/bin/bash
# GRPO on 2 nodes with HSDP (FSDP2 sharded inside a node, replicated across nodes):
#   sbatch recipes/slurm_multi_node.sh --defer-grad-sync          # any recipes/grpo.py flags
# One `accelerate launch` per node; each starts one process per device and they meet at the
# first node. Adjust --gpus-per-node and hsdp.yaml's num_processes / dp_shard_size together.
# When a rank dies, every node restarts its ranks (once: --max_restarts 1) and the run continues
# from its newest complete checkpoint (--resume_from_checkpoint auto; output_dir must be on
# storage both nodes see). The c10d rendezvous and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 give each
# attempt a fresh store, without which the restarted group cannot form (README, GRPO recipe).
# Preemption and the time limit: 120 s before SLURM stops the job it sends SIGUSR1 to this shell
# (--signal=B:USR1@120), which passes it to every process of the run; each node's launcher
# forwards it to its ranks (PET_SIGNALS_TO_HANDLE) and waits up to TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# for them; they finish the optimizer step they are in, save a complete checkpoint and exit 75
# (docs/recipe.md, Preemption); then the job is requeued and resumes from that checkpoint.
# On Ascend NPU: replace the --gpus-per-node line with your site's NPU request and export
# ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 below.
#SBATCH --job-name=grpo-hsdp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
set -euo pipefail

MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=29500
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export ACCEL_GRADSYNC_SAVE_ON_SIGNAL=SIGUSR1
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1  # the launcher forwards SIGUSR1 too
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=110  # the time the ranks get to finish the step and save

preempted=0
# A trap runs only between commands, so srun runs in the background and the shell waits on it.
trap 'preempted=1; scancel --signal=USR1 "$SLURM_JOB_ID"' USR1

# `srun` runs this once per node; SLURM_NODEID becomes the node's machine rank.
srun --kill-on-bad-exit=1 bash -c "accelerate launch \
    --config_file accelerate_configs/hsdp.yaml \
    --num_machines $SLURM_NNODES \
    --machine_rank \$SLURM_NODEID \
    --main_process_ip $MAIN_NODE \
    --main_process_port $MAIN_PORT \
    --rdzv_backend c10d \
    --max_restarts 1 \
    recipes/grpo.py --resume_from_checkpoint auto $*" &
step=$!
status=0
wait "$step" || status=$?
if [ "$preempted" = 1 ]; then
    wait "$step" || status=$?  # the first wait returned when the trap ran
    scontrol requeue "$SLURM_JOB_ID"  # the same script resumes from the checkpoint just saved
    exit 0
fi
exit "$status"
