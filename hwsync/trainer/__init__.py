"""What runs in the trainer process to plan, produce and check a sync: :mod:`hwsync.trainer.api` (the sync
entry), payload, strategy, merged weights, verify, the report, the remote client (:mod:`hwsync.trainer.client`)
and the weight-transfer handle (:mod:`hwsync.trainer.transfer_backend`).

May import :mod:`hwsync.engine` (the colocated handle it attaches), :mod:`hwsync.patches` and :mod:`hwsync.common`
(tests/test_layering.py).
"""
