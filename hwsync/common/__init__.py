"""Shared by the trainer and the engine processes: the wire types and errors, expert layouts, fingerprints,
the LoRA formats, the transport and the device backends (``cpu/``, ``cuda/``, ``npu/``), the control channel's
protocol, tokens and the Engine handle interface (:mod:`hwsync.common.target`).

Imports nothing above it (tests/test_layering.py).
"""
