#!/usr/bin/env bash
# The layout dflash exists for, on one 8-GPU machine (issue #8):
#   dflash extract on GPUs 0-4 writing cache B, while dflash train on GPUs 5-7 reads cache A
#   (extracted earlier), then a second training run on cache B as soon as its extraction ends.
# Qwen3-8B-shaped random target (speed does not depend on the weights), T = 4096, K = 5.
#
#   bash bench/full_run.sh                # WORK=/root/dflash-full CHATS=1200 STEPS=200
#
# Run from the repository root (on the device machine: `source .whl/setup.sh && bash bench/full_run.sh`).
# Writes $WORK/results.json and prints a summary: extraction tok/s per GPU and in total (against 5x
# one GPU), training tok/s (against 3x one GPU), disk bandwidth, and whether either stage slowed the other.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
WORK=${WORK:-/root/dflash-full}
CHATS=${CHATS:-1200}     # ~1.1M tokens -> ~35 GB of zstd hidden states per cache
STEPS=${STEPS:-200}
PY=${PY:-python3}
mkdir -p "$WORK"
ngpu=$($PY -c "import torch; print(torch.cuda.device_count())")
[ "$ngpu" -ge 8 ] || { echo "needs 8 GPUs, found $ngpu" >&2; exit 1; }

# 0. target, data, and the one-GPU references (same script the single-GPU figures come from)
$PY - <<EOF
import sys; sys.path.insert(0, ".")
from bench.common import QWEN3_8B, random_target_dir, synthetic_chats, write_jsonl
random_target_dir("$WORK/target", QWEN3_8B, device="cuda")
write_jsonl("$WORK/chats_a.jsonl", synthetic_chats($CHATS, seed=1, max_tokens=4000))
write_jsonl("$WORK/chats_b.jsonl", synthetic_chats($CHATS, seed=2, max_tokens=4000))
EOF
CUDA_VISIBLE_DEVICES=0 $PY bench/extract.py --skip peer,disk --chats 300 --json "$WORK/one_gpu_extract.json" | tail -12
CUDA_VISIBLE_DEVICES=5 $PY bench/train.py --shapes qwen3-8b --modes compiled:flex --steps 40 --json "$WORK/one_gpu_train.json" | tail -6

X="--target $WORK/target --seq-len 4096 --codec zstd --no-progress"
T="--target $WORK/target --drafter-layers 5 --block-size 16 --num-anchors 512 --batch-rows 4 --max-steps $STEPS --log-every 10 --save-every 100000 --no-progress"

# 1. cache A, extracted first on GPUs 0-4 (alone: the extraction reference at 5 GPUs)
t0=$(date +%s)
python3 -m dflash extract $X --data "$WORK/chats_a.jsonl" --out "$WORK/cache_a" --gpus 0,1,2,3,4 --json "$WORK/extract_a.json" 2>&1 | tail -3
t1=$(date +%s)

# 2. at the same time: extraction of cache B on GPUs 0-4 and training on cache A on GPUs 5-7
(python3 -m dflash extract $X --data "$WORK/chats_b.jsonl" --out "$WORK/cache_b" --gpus 0,1,2,3,4 --json "$WORK/extract_b.json" > "$WORK/extract_b.log" 2>&1; date +%s > "$WORK/extract_b.done") &
python3 -m dflash train $T --cache "$WORK/cache_a" --out "$WORK/run_a" --gpus 5,6,7 > "$WORK/train_a.log" 2>&1 &
train_a=$!
# 3. when extraction B ends, a second training run on cache B on the freed GPUs 0-2
while [ ! -f "$WORK/extract_b.done" ]; do sleep 2; done
python3 -m dflash train $T --cache "$WORK/cache_b" --out "$WORK/run_b" --gpus 0,1,2 > "$WORK/train_b.log" 2>&1
wait $train_a
t2=$(date +%s)

$PY - <<EOF
import json, os
W = "$WORK"
load = lambda p: json.load(open(os.path.join(W, p)))
one_x = load("one_gpu_extract.json")
one_t = load("one_gpu_train.json")["results"][0]
ea, eb = load("extract_a.json"), load("extract_b.json")
def train_tps(run):
    hist = [json.loads(l) for l in open(os.path.join(W, run, "metrics.jsonl"))][1:]
    return sum(h["ctx_tokens_per_s"] for h in hist) / len(hist), sum(h["data_wait_frac"] for h in hist) / len(hist)
ta, wa = train_tps("run_a")
tb, wb = train_tps("run_b")
size = lambda p: sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(W, p)) for f in fs)
# rank 0's tokens/s x 5 approximates the total (shards are divided evenly across ranks)
res = {
  "one_gpu_extract_tok_s": one_x.get("extract_shm", {}).get("tok_s"),
  "extract_a_tok_s_per_gpu": ea["tokens_per_s_this_rank"], "extract_a_total_tok_s": 5 * ea["tokens_per_s_this_rank"],
  "extract_b_tok_s_per_gpu_while_training": eb["tokens_per_s_this_rank"],
  "cache_a_GB": size("cache_a") / 1e9, "cache_b_GB": size("cache_b") / 1e9,
  "disk_GB_s_during_a": size("cache_a") / 1e9 / max(1, $t1 - $t0),
  "one_gpu_train_ctx_tok_s": one_t["ctx_tok_s"],
  "train_a_ctx_tok_s_3gpu_while_extracting": ta, "train_a_data_wait": wa,
  "train_b_ctx_tok_s_3gpu_alone": tb, "train_b_data_wait": wb,
}
res["extract_scaling_vs_5x"] = res["extract_a_total_tok_s"] / (5 * res["one_gpu_extract_tok_s"]) if res["one_gpu_extract_tok_s"] else None
res["train_scaling_vs_3x"] = tb / (3 * res["one_gpu_train_ctx_tok_s"])
res["extraction_slowed_by_training"] = 1 - eb["tokens_per_s_this_rank"] / ea["tokens_per_s_this_rank"]
res["training_slowed_by_extraction"] = 1 - ta / tb
json.dump(res, open(os.path.join(W, "results.json"), "w"), indent=2)
print(json.dumps(res, indent=2))
EOF
