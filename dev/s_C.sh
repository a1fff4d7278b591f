#!/usr/bin/env bash
# device call C: the fault campaign at 48 layers (adapter, hybrid), then Qwen3.5-MoE shapes at 24 layers (step bench)
REAL=$OUT; export OUT=/tmp/res/C; mkdir -p $OUT
bash /tmp/gk/kit/device-install.sh --project > $OUT/install.log 2>&1 || { tail -20 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1 BENCH_KV_BYTES=2147483648 BENCH_GPU_MEM=0.5
timeout 300 python benchmarks/verify_table.py --shapes qwen3-30b-a3b --layers 48 --rank 8 --strategies adapter,hybrid \
  --steps 20 --verbose --json $OUT/faults48.json > $OUT/faults48.log 2>&1; echo "faults48 rc=$?"
grep -vE "^(INFO|WARNING|DEBUG)|it/s\]" $OUT/faults48.log | grep -E "^\||MISSED|ALARM|caught|Error|Traceback" | cut -c1-400 | tail -40
timeout 270 python benchmarks/bench_step.py --shapes qwen3.5-moe --layers 24 --runs adapter:32,full --steps 20 \
  --json $OUT/step35.json > $OUT/step35.log 2>&1; echo "step35 rc=$?"
grep -E "^\||ALARM|Traceback|Error|hwsync: verify after" $OUT/step35.log | cut -c1-500 | tail -20
tar czf $REAL/C.tgz -C /tmp/res C
