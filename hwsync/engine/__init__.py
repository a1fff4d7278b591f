"""What runs in the engine's processes: the receiver (:mod:`hwsync.engine.receiver`), everything hwsync does
inside vLLM (:mod:`hwsync.engine.vllm`), the name resolution (:mod:`hwsync.engine.names`), the engine hosts
(:mod:`hwsync.engine.server`, :mod:`hwsync.engine.served`) and the vLLM plugin (:mod:`hwsync.engine.vllm_plugin`).

Imports only :mod:`hwsync.common` and :mod:`hwsync.patches` below it, never :mod:`hwsync.trainer`
(tests/test_layering.py).
"""
