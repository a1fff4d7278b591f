#!/usr/bin/env bash
# device call E: install; the checking copy's GPU tests and its kernel sweep on 60 GB
REAL=$OUT; export OUT=/tmp/res/E; mkdir -p $OUT
cp .gpukit/send/* /tmp/gk/ && (cd /tmp/gk && cat part.* | tar x) || { md5sum /tmp/gk/part.*; exit 1; }
bash /tmp/gk/kit/device-install.sh > $OUT/install.log 2>&1 || { tail -40 $OUT/install.log; exit 1; }
. /tmp/gk/env.sh
export PYTHONUNBUFFERED=1
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_checked_copy.py > $OUT/checked_copy.log 2>&1; echo "checked_copy rc=$?"; tail -3 $OUT/checked_copy.log
timeout 150 python benchmarks/bench_isfinite.py --gb 60 --device cuda --repeat 3 --sweep > $OUT/isfinite.log 2>&1; echo "isfinite rc=$?"; tail -24 $OUT/isfinite.log
tar czf $REAL/E.tgz -C /tmp/res E
