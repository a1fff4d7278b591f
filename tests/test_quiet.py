"""A newcomer's first screen is hwsync's (issue 41, 8): ``hwsync doctor`` opens without other libraries' import noise,
and :func:`hwsync.common.quiet.quiet_imports` drops exactly the lines it names, for its block only."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from hwsync.common.quiet import LOG_NOISE, WARNING_NOISE, quiet_imports

ROOT = Path(__file__).resolve().parent.parent

FOREIGN = {
    "bitsandbytes' missing `kernels` package": "Failed to load CPU gemm_4bit_forward",
    "torch's Triton scan": "Triton not available",
    "ms-swift's INFO on import": "[INFO:swift]",
    "TRL's vLLM-version warning": "TRL currently supports vLLM versions",
    "vLLM's DeepSelect extension": "DeepSelect extension",
    "DeepSpeed's accelerator detection": "Setting accelerator to CPU",
}


def test_doctor_screen_is_hwsyncs() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for name in ("LOG_LEVEL", "VLLM_LOGGING_LEVEL", "TORCH_LOGS"):  # the libraries' own switches show their lines
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "hwsync", "doctor"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    screen = proc.stderr + proc.stdout
    shown = {what: line for what, text in FOREIGN.items() for line in screen.splitlines() if text in line}
    assert not shown, f"hwsync doctor shows other libraries' lines: {shown}"
    assert proc.stdout.startswith("hwsync ") and "Sync strategies" in proc.stdout and "Patches" in proc.stdout
    assert proc.stderr.strip() == "", proc.stderr


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    handler, root = Keep(), logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield seen
    root.removeHandler(handler)
    root.setLevel(old_level)


def test_quiet_imports_drops_only_its_lines_for_its_block(
    records: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    for noise in LOG_NOISE:
        if noise.unless_env:
            monkeypatch.delenv(noise.unless_env, raising=False)
    bnb, swift, ds = (logging.getLogger(n) for n in ("bitsandbytes.backends.cpu.ops", "swift", "DeepSpeed"))
    with quiet_imports():
        bnb.warning("Failed to load CPU gemm_4bit_forward")  # dropped
        bnb.error("a real failure")  # errors always pass
        swift.info("Successfully registered `dataset_info.json`.")  # dropped
        swift.warning("an ms-swift warning")  # passes
        ds.warning("Setting accelerator to CPU. ...")  # dropped
        ds.warning("another DeepSpeed warning")  # passes: only that message is named
        logging.getLogger("user.code").warning("the user's own line")  # other loggers untouched
    bnb.warning("after the block")  # the filter is gone
    assert [r.getMessage() for r in records] == [
        "a real failure",
        "an ms-swift warning",
        "another DeepSpeed warning",
        "the user's own line",
        "after the block",
    ]
    assert not any(logging.getLogger(n.name).filters for n in LOG_NOISE)


def test_quiet_imports_keeps_the_users_switch(
    records: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOG_LEVEL", "INFO")
    with quiet_imports():
        logging.getLogger("swift").info("asked for by LOG_LEVEL")
    assert [r.getMessage() for r in records] == ["asked for by LOG_LEVEL"]


def test_quiet_imports_drops_the_named_warning_from_its_library_only() -> None:
    (trl,) = WARNING_NOISE
    text = "TRL currently supports vLLM versions: 0.10.2. You have version 0.32.0 installed."
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_imports():
            exec(
                compile("import warnings; warnings.warn(TEXT)", "trl/import_utils.py", "exec"),
                {"__name__": "trl.import_utils", "TEXT": text},
            )  # dropped: TRL's, from TRL
            warnings.warn(text, UserWarning, stacklevel=1)  # the same words from elsewhere pass
            warnings.warn("the user's own warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [text, "the user's own warning"]
    assert warnings.filters == before and trl.category is UserWarning
