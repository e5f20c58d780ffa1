#!/bin/bash
# GRPO on 2 nodes with HSDP (FSDP2 sharded inside a node, replicated across nodes):
#   sbatch recipes/slurm_multi_node.sh --defer-grad-sync          # any recipes/grpo.py flags
# One `accelerate launch` per node; each starts one process per device and they meet at the
# first node. Adjust --gpus-per-node and hsdp.yaml's num_processes / dp_shard_size together.
# When a rank dies, every node restarts its ranks (once: --max_restarts 1) and the run continues
# from its newest complete checkpoint (--resume_from_checkpoint auto; output_dir must be on
# storage both nodes see). The c10d rendezvous and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 give each
# attempt a fresh store, without which the restarted group cannot form (README, GRPO recipe).
# On Ascend NPU: replace the --gpus-per-node line with your site's NPU request and export
# ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 below.
#SBATCH --job-name=grpo-hsdp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail

MAIN_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=29500
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# `srun` runs this once per node; SLURM_NODEID becomes the node's machine rank.
srun --kill-on-bad-exit=1 bash -c "accelerate launch \
    --config_file accelerate_configs/hsdp.yaml \
    --num_machines $SLURM_NNODES \
    --machine_rank \$SLURM_NODEID \
    --main_process_ip $MAIN_NODE \
    --main_process_port $MAIN_PORT \
    --rdzv_backend c10d \
    --max_restarts 1 \
    recipes/grpo.py --resume_from_checkpoint auto $*"
