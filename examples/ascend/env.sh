# Ascend 910B environment for megatron-prune (sourced by dpo.sh and grpo.sh; not run on its own).
#
# Every value can be overridden from the calling environment. Defaults follow the settings
# MindSpeed's own test scripts use (tests_extend/system_tests/env_npu.sh, core_r0.16.0).
#   ASCEND_TOOLKIT_HOME   CANN toolkit whose set_env.sh is sourced [/usr/local/Ascend/ascend-toolkit]
#   GPUS                  NPUs (processes) per node [8]
#   ASCEND_RT_VISIBLE_DEVICES  NPUs this node uses [0..GPUS-1]
#   HCCL_CONNECT_TIMEOUT  seconds to build HCCL links [1200]   HCCL_EXEC_TIMEOUT  seconds per collective [1200]
#   HCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME  NIC for multi-node rendezvous [unset: auto]
#   PYTORCH_NPU_ALLOC_CONF  caching allocator [expandable_segments:True]
#   TASK_QUEUE_ENABLE     torch_npu task queue: 0 off, 1 on, 2 on + deeper pipelining (newer torch_npu) [1]
#   CPU_AFFINITY_CONF     torch_npu binds each rank's threads to the CPUs near its NPU: 0 off, 1 on [1]
#   COMBINED_ENABLE       fuse non-contiguous tensor copies [1]

ascend_setup_env() {
  local toolkit=${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit}
  if [ -f "$toolkit/set_env.sh" ]; then
    # shellcheck disable=SC1091
    source "$toolkit/set_env.sh"
  elif [ "${DRY_RUN:-0}" != 1 ]; then
    echo "warning: $toolkit/set_env.sh not found; set ASCEND_TOOLKIT_HOME or source CANN yourself" >&2
  fi
  export GPUS=${GPUS:-8}
  export ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS - 1)))}
  export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}
  export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1200}
  export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
  export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-1}
  export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}
  export COMBINED_ENABLE=${COMBINED_ENABLE:-1}
  export HCCL_WHITELIST_DISABLE=${HCCL_WHITELIST_DISABLE:-1}
  export ASCEND_GLOBAL_LOG_LEVEL=${ASCEND_GLOBAL_LOG_LEVEL:-3}
  export ASCEND_LAUNCH_BLOCKING=${ASCEND_LAUNCH_BLOCKING:-0}
  # Megatron orders TP/SP communication on one stream (as on GPUs).
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  [ -n "${HCCL_SOCKET_IFNAME:-}" ] && export HCCL_SOCKET_IFNAME
  [ -n "${GLOO_SOCKET_IFNAME:-}" ] && export GLOO_SOCKET_IFNAME
  return 0
}

ascend_print_env() {
  local name
  for name in ASCEND_RT_VISIBLE_DEVICES HCCL_CONNECT_TIMEOUT HCCL_EXEC_TIMEOUT PYTORCH_NPU_ALLOC_CONF \
      TASK_QUEUE_ENABLE CPU_AFFINITY_CONF COMBINED_ENABLE HCCL_WHITELIST_DISABLE ASCEND_GLOBAL_LOG_LEVEL \
      ASCEND_LAUNCH_BLOCKING CUDA_DEVICE_MAX_CONNECTIONS OMP_NUM_THREADS HCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
    [ -n "${!name:-}" ] && printf 'export %s=%s\n' "$name" "${!name}"
  done
  return 0
}

# torchrun for one node of the job; run the same command on every node with its NODE_RANK.
ascend_launcher() {
  LAUNCH=(torchrun --nnodes "${NODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$GPUS"
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}")
}

# Print (DRY_RUN=1) or run "${CMD[@]}".
ascend_run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    ascend_print_env
    printf '%q ' "${CMD[@]}"
    echo
    return 0
  fi
  exec "${CMD[@]}"
}
