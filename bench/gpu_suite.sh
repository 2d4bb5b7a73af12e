#!/usr/bin/env bash
# Everything that needs the 2-GPU machine, in one call. From the project root, after
#   source bench/gpu/env.sh .whl   (installs the carried wheels; sets UCCL's environment)
# usage: bash bench/gpu_suite.sh OUTDIR [tests|bench|mn|mn1|mn2|deltas|grids|all]   (each part fits one 10-minute device
# call but mn: mn1 and mn2 run its first and second GPU placement, one call each)
set -u
out=${1:-bench/results}
part=${2:-all}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi topo -m > "$out/topo.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); print(torch.cuda.can_device_access_peer(0, 1) if torch.cuda.device_count() > 1 else '')" > "$out/env.txt" 2>&1
if [ "$part" = tests ] || [ "$part" = all ]; then
timeout 120 python3 - > "$out/uccl_api.txt" 2>&1 <<'PY'
import os, inspect
print("UCCL_P2P_TRANSPORT", os.environ.get("UCCL_P2P_TRANSPORT"), "ib:", os.listdir("/sys/class/infiniband") if os.path.isdir("/sys/class/infiniband") else None)
from uccl import p2p
print("module:", [n for n in dir(p2p) if not n.startswith("_")])
E = p2p.Endpoint
print("init:", E.__init__.__doc__)
for name in dir(E):
    if not name.startswith("_"):
        print("==", name, ":", getattr(E, name).__doc__)
PY
timeout 120 python3 - >> "$out/uccl_api.txt" 2>&1 <<'PY'
from uccl import p2p
try:
    ep = p2p.Endpoint(0, 4)
except TypeError:
    ep = p2p.Endpoint(0)
meta = ep.get_metadata()
print("metadata", len(meta), p2p.Endpoint.parse_metadata(meta))
PY
echo "uccl smoke exit: $?" >> "$out/uccl_api.txt"
# (the M -> N bench's GPU tests, tests/e2e/test_bench_mn.py -m gpu, take a few minutes more: a call of their own)
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/e2e/test_gpu.py -rs --timeout 90 --maxfail=5 -o log_cli=true --log-cli-level=WARNING > "$out/gpu_tests.txt" 2>&1
echo "gpu tests exit: $?" >> "$out/gpu_tests.txt"
fi
if [ "$part" = deltas ]; then
# delta rounds on the GPUs: the batched kernels' tests, kernel timings, transfer_delta across GPUs and on one
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/transforms/test_delta_kernel.py \
  tests/engine/datapath/test_fp64_kernel.py tests/roles/test_deltas.py tests/e2e/test_gpu.py -k "delta or fp64" \
  -rs --timeout 120 > "$out/delta_tests.txt" 2>&1
echo "delta tests exit: $?" >> "$out/delta_tests.txt"
timeout 60 python3 bench/diagnostics/fingerprints.py --json --arch qwen2.5-7b 2>&1 | tail -1 >> "$out/fingerprints.jsonl"
for config in "--fraction 0.01 --profile" "--fraction 0.001" "--fraction 0.1" "--fraction 0.01 --tile 4096"; do
  timeout 60 python3 bench/diagnostics/delta_kernels.py --json --arch qwen2.5-0.5b $config 2>&1 | tail -1 >> "$out/delta_kernels.jsonl"
done
timeout 90 python3 bench/diagnostics/delta_kernels.py --json --arch qwen2.5-7b 2>&1 | tail -1 >> "$out/delta_kernels.jsonl"
for where in across colocated; do
  timeout ${DELTA_TIMEOUT:-160} python3 bench/transfer_delta.py --gpus $where --mb ${DELTA_MB:-2048} --rounds 3 --warmup 3 \
    --fractions 0.01,0.1,1.0 --out "$out/transfer_delta_$where.json" > "$out/transfer_delta_$where.txt" 2>&1
done
# where a 1% delta round's time goes: the always and dense clusters' processes traced, their rounds summarised
# (10 rounds: the 10th is a full check: roles/round_inputs.py)
timeout 150 python3 bench/transfer_delta.py --gpus across --mb ${DELTA_MB:-2048} --rounds 7 --warmup 2 --fractions 0.01 \
  --trace /tmp/delta_trace > /dev/null 2>&1
for f in /tmp/delta_trace/*.json; do echo "== $f"; python3 bench/diagnostics/trace_rounds.py "$f" --top 20 --skip 3; done \
  > "$out/delta_trace.txt" 2>&1
fi
if [ "$part" = all ]; then
timeout 300 python3 bench/diagnostics/ipc_direction.py --gib 4 --out "$out/ipc_direction.json" > "$out/ipc_direction.txt" 2>&1
timeout 300 python3 bench/pipeline_depth.py --cpu-mib 64 --out "$out/pipeline_depth.json" > "$out/pipeline_depth.txt" 2>&1
timeout 200 python3 bench/diagnostics/copy_batches.py --out "$out/copy_batches.json" > "$out/copy_batches.txt" 2>&1
fi
if [ "$part" = grids ]; then
# copy kernels' grids: the two copies of a colocated sender at once (bench/diagnostics/copy_overlap.py), then
# 2 -> 2 colocated rounds at three grids side by side (docs/TRANSPORTS.md, "Two copies at once")
timeout 90 python3 bench/diagnostics/copy_overlap.py > "$out/copy_overlap.jsonl" 2>>"$out/transfer_mn.log"
C="--senders 2 --receivers 2 --colocated --no-broadcast"
for g in 0,0 1,2 2,4; do
  for m in qwen3-30b-a3b qwen2.5-7b; do
    timeout 75 python3 bench/transfer_mn.py --rounds 19 --json $C --model $m --kernel-grid $g 2>>"$out/transfer_mn.log" | tail -n 1
  done
done > "$out/transfer_mn_grids.jsonl"
for g in 0,0 1,2; do
  timeout 75 python3 bench/transfer_mn.py --rounds 19 --json $C --model qwen2.5-7b --fp8 --kernel-grid $g 2>>"$out/transfer_mn.log" | tail -n 1
done >> "$out/transfer_mn_grids.jsonl"
exit 0
fi
if [ "$part" = mn ] || [ "$part" = mn1 ] || [ "$part" = mn2 ]; then
# M -> N (bench/transfer_mn.py): the cases this machine's GPU count allows, one JSON line each
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
case $gpus in
  1) cases=("1 1 --colocated" "2 2 --colocated --one-gpu") ;;  # (--one-gpu: every rank on GPU 0, the empty model alone)
  2|3) cases=("2 2 --colocated" "1 1") ;;
  4|5|6|7) cases=("2 2" "4 4 --colocated") ;;
  *) cases=("4 4" "8 8 --colocated") ;;
esac
[ "$part" = mn1 ] && cases=("${cases[0]}")
[ "$part" = mn2 ] && cases=("${cases[@]:1}")
# (--ckpt: checkpoint-engine on the same case, bench/peer_ckpt.py; its wheels come with `make gpu-wheels`;
# 27 rounds: each landing slot's first is not counted, links into another GPU time their two ways on the
# first 7, which are not counted either, and of the rest every 8th is checked end to end, as the product does)
for c in "${cases[@]}"; do
  set -- $c
  models=("--model empty --no-broadcast" "--model qwen2.5-0.5b --ckpt" "--model qwen2.5-7b --ckpt" "--model qwen3-30b-a3b"
          "--model qwen2.5-7b --fp8 --no-broadcast" "--model qwen2.5-7b --fp8 --no-broadcast --full-check-every 0")
  [[ "$c" == *--one-gpu* ]] && models=("--model empty --no-broadcast")
  for m in "${models[@]}"; do
    timeout 400 python3 bench/transfer_mn.py --senders $1 --receivers $2 ${@:3} $m --rounds 27 --json 2>>"$out/transfer_mn.log" | tail -n 1
  done
done > "$out/transfer_mn_$part.jsonl"
cat "$out/transfer_mn_$part.jsonl"
# where the FP8 case's round goes on the GPU: its senders traced (bench/diagnostics/trace_rounds.py), mn1 only
if [ "$part" != mn2 ]; then
  set -- ${cases[0]}
  timeout 300 python3 bench/transfer_mn.py --senders $1 --receivers $2 ${3:-} --model qwen2.5-7b --fp8 --no-broadcast \
    --rounds 19 --json --trace /tmp/fp8_trace 2>>"$out/transfer_mn.log" | tail -n 1 > /dev/null
  for f in /tmp/fp8_trace/sender*.json.gz; do echo "== $f"; python3 bench/diagnostics/trace_rounds.py "$f" --top 20 --skip 8; done \
    > "$out/fp8_trace.txt" 2>&1
fi
exit 0
fi
if [ "$part" != tests ]; then
# dense and MoE, across GPUs and colocated: docs/results/transfer_gpu_h200x2.txt
for m in "--model qwen2.5-7b" "--model qwen2.5-7b --colocated" "--model qwen3-30b-a3b" "--model qwen3-30b-a3b --colocated"; do
  echo "\$ python3 bench/transfer_gpu.py --rounds 5 --transports cuda_ipc --baselines '' --json $m"
  timeout 280 python3 bench/transfer_gpu.py --rounds 5 --transports cuda_ipc --baselines '' --json $m 2>&1
  echo "transfer_gpu exit: $?"
done > "$out/transfer_gpu.txt"
fi
# one log (the device returns at most 8 files): every text output, in order
for f in env topo uccl_api gpu_tests ipc_direction copy_batches transfer_gpu pipeline_depth; do
  echo "===== $f"; cat "$out/$f.txt" 2>/dev/null; rm -f "$out/$f.txt"
done > "$out/suite.log"
grep -E "passed|failed|GB/s|exit" "$out/suite.log" | tail -n 40
