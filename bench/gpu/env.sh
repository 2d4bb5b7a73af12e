# Source on the GPU machine, from the project root:  source bench/gpu/env.sh [WHEEL_DIR]
# (the wheels come from `make gpu-wheels`, run where a package registry is reachable). Installs the carried wheels into
# /tmp/site, puts them and the project on PYTHONPATH, and sets what UCCL 0.1.1 needs on a host without
# an RDMA NIC (see docs/TRANSPORTS.md, UCCL).
_whl=${1:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$_whl"/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export LD_LIBRARY_PATH=/tmp/site/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCCL_NCCL_SO=${UCCL_NCCL_SO:-/usr/lib/x86_64-linux-gnu/libnccl.so.2}
if [ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]; then export UCCL_P2P_TRANSPORT=${UCCL_P2P_TRANSPORT:-tcp}; fi
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
