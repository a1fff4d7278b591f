"""hwsync in trainer frameworks: ms-swift (:mod:`hwsync.integrations.swift`), TRL (:mod:`hwsync.integrations.trl`),
`vllm serve` (:mod:`hwsync.integrations.vllm_serve`), and what they share: options, the per-sync checks and the
records (:mod:`hwsync.integrations.options`, :mod:`hwsync.integrations.trainer_sync`,
:mod:`hwsync.integrations.metrics`).

The top layer below the entry modules (tests/test_layering.py).
"""
