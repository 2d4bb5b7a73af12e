# The RL loop's changed bytes on one GPU: examples/rl_loop.py --bf16 with a Qwen2.5-0.5B-shaped policy
# (--size 0.5b: its 24 layers, 358 M parameters), fp32 master weights and AdamW at lr 1e-6, one trainer
# rank and one inference process on the same GPU (CUDA IPC), the same seeded steps with every round as
# deltas, every round whole, and `auto`; each run writes OUT/rl_loop_bf16_MODE_CARD.json (and .png where
# matplotlib is installed: `python3 examples/rl_loop.py --plot FILE.json` draws it from the JSON).
#
#   source bench/gpu/env.sh .whl && bash bench/gpu/rl_delta.sh OUT [STEPS]      (make rl-delta-gpu)
set -u
out=$1 steps=${2:-8}
card=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())")  # h100, h200
mkdir -p "$out"
for mode in always off auto; do
  OMP_NUM_THREADS=4 timeout 180 torchrun --standalone --nproc-per-node 1 examples/rl_loop.py --bf16 --size 0.5b \
    --optimizer adamw --lr 1e-6 --inference 1 --steps "$steps" --prompts 8 --group 4 --delta "$mode" \
    --transport cuda_ipc --out "$out/rl_loop_bf16_${mode}_$card" || exit 1
done
