"""GRPO (or GSPO) with ms-swift + vLLM on a tiny Qwen3-MoE, weight sync by hwsync: the README's main job.

    python examples/grpo_tiny_moe.py                 # GRPO, vLLM colocated, HWSYNC_STRATEGY=auto
    python examples/grpo_tiny_moe.py --gspo          # GSPO: --importance_sampling_level sequence
    python examples/grpo_tiny_moe.py --family qwen3_5_moe   # on a tiny Qwen3.5-MoE (GDN + attention layers)
    python examples/grpo_tiny_moe.py --server        # vLLM in a `swift rollout` process, trainer in another
    python examples/grpo_tiny_moe.py --server --engines 2   # swift rollout --vllm_data_parallel_size 2
    python examples/grpo_tiny_moe.py --sleep-level 2 # CUDA: vLLM discards its weights while training, hwsync refills
    python examples/grpo_tiny_moe.py --steps 8 -- --learning_rate 5e-3   # anything after -- goes to swift

Everything is made on the spot in ``--workdir``: a random tiny Qwen3-MoE checkpoint (``--family qwen3_5_moe``: a
Qwen3.5-MoE text model, Gated-DeltaNet and full-attention layers, an MTP layer in the checkpoint) with a Qwen-style
chat template (:func:`hwsync.testing.make_tiny_moe`), a JSONL dataset of arithmetic questions with their answers, and
the reward plugin next to this file (``arith_reward.py``). Then one real ``swift rlhf --rlhf_type grpo`` runs with LoRA
on attention (``--target_modules``; on Qwen3.5 also the Gated-DeltaNet projections) and on the MoE experts
(``--target_parameters``), vLLM rollouts in the trainer's process (``--server``: in a separate ``swift rollout``
process, synced through hwsync's server over gloo), and
``--external_plugins <hwsync plugin>``, which routes every trainer -> vLLM weight sync through ``hwsync.sync`` and
checks each one with ``hwsync.verify``. At the end it prints, per step, the reward, the sync
strategy ``auto`` chose, MB sent, sync time and the largest |Δ logprob| between the engine and the trainer, and
exits non-zero if any check failed. On a CPU machine it sets the vLLM CPU environment it needs; on a GPU the model
and engine run in bf16 (Qwen3.5 also on CPU: vLLM's CPU Gated-DeltaNet kernel takes nothing else), and a Qwen3.5
engine gets vLLM's Triton/FLA GDN prefill kernel (:func:`hwsync.testing.portable_kernel_args`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REWARD_PLUGIN = HERE / "arith_reward.py"
ATOL = 1e-4
GSPO_STEPS_PER_GENERATION = 2
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# per family (hwsync.testing.make_tiny_moe's): a label, the LoRA targets of "attention", ms-swift's model arguments
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"label": "Qwen3-MoE", "attention": ATTENTION, "swift": ["--model_type", "qwen3_moe"]},
    # ms-swift 4.6's `qwen3_5_moe` model type loads the vision-language class (Qwen3_5MoeForConditionalGeneration);
    # a text-only checkpoint (Qwen3_5MoeForCausalLM) goes through its generic loader: no --model_type
    "qwen3_5_moe": {
        "label": "Qwen3.5-MoE",
        "swift": [],
        "attention": ATTENTION + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
    },
}

# vLLM on CPU, in the trainer's process (colocate): one engine core in-process, a small KV cache, no thread pinning
# (other jobs share the cores), only hwsync's vLLM plugin.
CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_PLUGINS": "hwsync",
    "TOKENIZERS_PARALLELISM": "false",
}


def plugin_path() -> Path:
    """hwsync's ms-swift plugin file (what ``hwsync plugin-path`` prints), found without importing ms-swift."""
    try:
        from hwsync.plugin_paths import swift_plugin_file
    except ImportError:
        raise SystemExit("hwsync is not installed in this Python: run `bash ci/install.sh` first") from None
    return swift_plugin_file()


def write_dataset(path: Path, n: int = 64, seed: int = 0) -> Path:
    """``n`` questions like "What is 7+12?" with the answer in a ``solution`` column (passed to the reward)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b, op = rng.randint(0, 20), rng.randint(0, 20), rng.choice("+-*")
            answer = a + b if op == "+" else a - b if op == "-" else a * b
            question = f"What is {a}{op}{b}? Answer with a single number."
            f.write(json.dumps({"messages": [{"role": "user", "content": question}], "solution": str(answer)}) + "\n")
    return path


def prepare(workdir: Path, seed: int = 0, family: str = "qwen3_moe") -> tuple[Path, Path]:
    """The tiny model of ``family`` and the dataset, in ``workdir`` (reused when already there)."""
    from hwsync.testing import make_tiny_moe

    model = workdir / f"tiny-{family.replace('_', '-')}"
    if not (model / "config.json").exists():
        make_tiny_moe(model, family, seed=seed)  # type: ignore[arg-type]
    data = workdir / "arith.jsonl"
    if not data.exists():
        write_dataset(data, seed=seed)
    return model, data


def family_of(model: Path) -> str:
    """The :data:`FAMILIES` key of a checkpoint made by :func:`prepare` (from its ``config.json``)."""
    model_type = json.loads((Path(model) / "config.json").read_text()).get("model_type", "")
    return "qwen3_5_moe" if model_type.startswith("qwen3_5_moe") else "qwen3_moe"


def _gated_delta_net(model: Path) -> bool:
    return "linear_attention" in (json.loads((Path(model) / "config.json").read_text()).get("layer_types") or ())


def engine_args(model: Path, more: dict[str, Any] | None = None) -> list[str]:
    """The vLLM engine, as `swift rlhf` (colocate) and `swift rollout` (server) both take it. On a GPU the engine may
    claim half of it, or HWSYNC_EXAMPLE_GPU_UTIL of it (`ci/gpu.sh -j` runs several jobs side by side on one GPU), and
    its KV cache is a fixed 256 MiB: vLLM then skips its profiling-based sizing, whose check fails when another process
    on the GPU frees memory while this engine starts. A Qwen3.5 engine on a GPU gets vLLM's Triton/FLA GDN prefill
    kernel (its default on Hopper imports FlashInfer: :func:`hwsync.testing.portable_kernel_args`)."""
    kwargs: dict[str, Any] = {"num_gpu_blocks_override": 64, **(more or {})}
    if _has_gpu():
        kwargs["kv_cache_memory_bytes"] = 256 << 20
        if _gated_delta_net(model):
            from hwsync.testing import portable_kernel_args

            kwargs.update(portable_kernel_args(model))
    return [
        "--vllm_enforce_eager",
        "true",
        "--vllm_max_model_len",
        "256",
        "--vllm_gpu_memory_utilization",
        os.environ.get("HWSYNC_EXAMPLE_GPU_UTIL", "0.5"),
        "--vllm_engine_kwargs",
        json.dumps(kwargs),
    ]


def rollout_model_args(model: Path) -> list[str]:
    # fp32 on vLLM's CPU build; bf16 on GPUs, whose vLLM LoRA kernels take only fp16/bf16 (ms-swift starts the engine
    # in the model's dtype), and for Gated-DeltaNet models on CPU (vLLM's CPU GDN kernel takes nothing else)
    dtype = "bfloat16" if _has_gpu() or _gated_delta_net(model) else "float32"
    return [*FAMILIES[family_of(model)]["swift"], "--template", "qwen3", "--torch_dtype", dtype]


def model_args(model: Path) -> list[str]:
    args = [*rollout_model_args(model), "--check_model", "false"]  # (swift rollout has no --check_model)
    if not _has_gpu() and _gated_delta_net(model):  # bf16 weights, trained without mixed precision (which
        args += ["--bf16", "false", "--fp16", "false"]  # transformers refuses on CPU)
    return args


def swift_args(
    model: Path,
    data: Path,
    output_dir: Path,
    *,
    steps: int,
    gspo: bool = False,
    plugin: bool = True,
    server_port: int | None = None,
    extra: list[str] | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> list[str]:
    """The ``swift rlhf`` command line of the main job (``plugin=False``: the same run without hwsync;
    ``server_port``: rollouts from the ``swift rollout`` server on that port instead of a colocated engine;
    ``engine_kwargs``: more vLLM engine arguments for the colocated engine, in its ``--vllm_engine_kwargs``)."""
    plugins = [str(REWARD_PLUGIN)] + ([str(plugin_path())] if plugin else [])
    if server_port is None:
        vllm = ["--vllm_mode", "colocate", "--vllm_enable_lora", "true", *engine_args(model, engine_kwargs)]
    else:
        vllm = [
            "--vllm_mode",
            "server",
            "--vllm_server_host",
            "127.0.0.1",
            "--vllm_server_port",
            str(server_port),
            "--vllm_server_group_port",
            str(free_port()),
        ]
    args = [
        "swift",
        "rlhf",
        "--rlhf_type",
        "grpo",
        "--model",
        str(model),
        *model_args(model),
        "--dataset",
        str(data),
        "--external_plugins",
        *plugins,
        "--reward_funcs",
        "arith",
        # LoRA on attention and on the fused MoE experts (PEFT target_parameters); PEFT refuses dropout there
        "--tuner_type",
        "lora",
        "--lora_rank",
        "8",
        "--lora_alpha",
        "16",
        "--lora_dropout",
        "0",
        "--target_modules",
        *FAMILIES[family_of(model)]["attention"],
        "--target_parameters",
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
        # rollouts by vLLM; an engine with LoRA lets `auto` pick hybrid
        "--use_vllm",
        "true",
        *vllm,
        "--num_generations",
        "4",
        "--per_device_train_batch_size",
        "8",
        "--gradient_accumulation_steps",
        "1",
        "--max_completion_length",
        "16",
        "--max_length",
        "128",
        "--temperature",
        "1.0",
        "--max_steps",
        str(steps),
        "--learning_rate",
        "1e-2",
        "--beta",
        "0.0",
        "--seed",
        "42",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--dataloader_num_workers",
        "0",
        "--save_strategy",
        "steps",
        "--save_steps",
        str(steps),
        "--save_only_model",
        "true",
        "--output_dir",
        str(output_dir),
    ]
    if gspo:  # GSPO: sequence-level importance ratio, the paper's (much tighter) clipping range, and two optimizer
        # steps per rollout batch, so the second step is off-policy and the sequence-level ratio/clipping matter
        args += [
            "--importance_sampling_level",
            "sequence",
            "--epsilon",
            "3e-4",
            "--epsilon_high",
            "4e-4",
            "--steps_per_generation",
            str(GSPO_STEPS_PER_GENERATION),
        ]
    return args + list(extra or [])


def rollout_args(model: Path, port: int, engines: int = 1) -> list[str]:
    """``swift rollout`` for server mode: the same engine, LoRA enabled, with the hwsync plugin (``engines``:
    ``--vllm_data_parallel_size``, one engine per swift worker process)."""
    return [
        "swift",
        "rollout",
        "--model",
        str(model),
        *rollout_model_args(model),
        "--vllm_enable_lora",
        "true",
        "--vllm_max_lora_rank",
        "8",
        *engine_args(model),
        "--external_plugins",
        str(plugin_path()),
        "--vllm_data_parallel_size",
        str(engines),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(engines: int = 1) -> dict[str, str]:
    """What both server-mode processes need: where hwsync's sync servers listen (one address per data-parallel
    engine), and the shared secret."""
    import secrets

    return {
        "HWSYNC_SERVER": ",".join(f"127.0.0.1:{free_port()}" for _ in range(engines)),
        "HWSYNC_TOKEN": secrets.token_hex(16),
    }


def _one_trainer_gpu(env: dict[str, str]) -> dict[str, str]:
    """The trainer process's ``CUDA_VISIBLE_DEVICES`` where several GPUs are visible: one. ms-swift spreads a single
    trainer process over every GPU it sees (``device_map``), which its GRPO with vLLM refuses ("not compatible with
    `device_map`", seen on two H200s); a data-parallel ``swift rollout`` beside it still sees them all."""
    if "NPROC_PER_NODE" in env:
        return {}
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        import torch

        visible = ",".join(str(i) for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0))
    ids = [v for v in visible.split(",") if v.strip()]
    return {"CUDA_VISIBLE_DEVICES": ids[0]} if len(ids) > 1 else {}


def file_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a log ("" if it was never written)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@dataclass
class JobResult:
    returncode: int
    wall_s: float
    peak_rss_gb: float
    log: Path
    output_dir: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    dtype: str = "float32"
    """The run's ``--torch_dtype`` (ms-swift starts the engine in it)."""

    @property
    def syncs(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == "sync"]

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("event") == "step"]

    def adapter(self, step: int) -> dict[str, Any]:
        """The LoRA tensors ms-swift saved at ``checkpoint-<step>`` (the main job saves at its last step)."""
        from safetensors.torch import load_file

        files = sorted(self.output_dir.glob(f"v*/checkpoint-{step}/adapter_model.safetensors"))
        if not files:
            raise FileNotFoundError(f"no checkpoint-{step}/adapter_model.safetensors under {self.output_dir}")
        return load_file(str(files[-1]))

    def log_tail(self, lines: int = 40) -> str:
        return file_tail(self.log, lines)

    @property
    def summary(self) -> str:
        return next((r["text"] for r in self.records if r.get("event") == "summary"), "(no hwsync summary)")

    def checks(self, steps: int, steps_per_generation: int = 1, sleep_level: int = 0) -> dict[str, bool]:
        """What the job promises, each as one boolean. Every sync must pass all of ``hwsync.verify``'s checks (exact
        content checks + the platform's logprob gate); on vLLM's CPU build in fp32 the engine also computes like
        transformers, so there engine and trainer must agree within ATOL outright (on a GPU no engine does: TF32
        fused MoE, bf16 LoRA -- the plugin's gate stops a broken run there, see docs/verify.md; nor does a bf16
        engine on CPU, the Qwen3.5 one)."""
        verified = [s.get("verify_max_abs_dlogp") for s in self.syncs]
        rollout = [s.get("rollout_max_abs_dlogp") for s in self.steps]
        generations = -(-steps // steps_per_generation)
        strict = not _has_gpu() and self.dtype == "float32"
        checks = {
            "swift exited 0": self.returncode == 0,
            f"{steps} steps trained, each rollout batch ({generations}) generated after an hwsync sync": len(self.steps)
            == steps
            and len(self.syncs) == generations,
            "hwsync.verify passed after every sync (content fingerprints + logprob gate)": bool(self.syncs)
            and all(s.get("verify_ok") is True for s in self.syncs),
            "rollouts checked against the trained policy": bool(rollout) and all(v is not None for v in rollout),
            "the policy moved (the engine followed a changed model)": any(
                (s.get("policy_shift") or 0.0) > 100 * ATOL for s in self.syncs
            ),
        }
        if sleep_level == 2:
            checks.update([refill_check(self.syncs)])
        if strict:
            checks[f"CPU fp32: engine == trainer after every sync (max |Δ logprob| <= {ATOL:g})"] = bool(
                verified
            ) and all(v is not None and v <= ATOL for v in verified)
            checks[f"CPU fp32: rollouts sampled from the trained policy (max |Δ logprob| <= {ATOL:g})"] = all(
                v is not None and v <= ATOL for v in rollout
            )
        return checks


def refill_check(syncs: list[dict[str, Any]]) -> tuple[str, bool]:
    """Sleep level 2: vLLM discards the engine's weights after each rollout, so every sync after the first must be
    hwsync's refill (its report's path says so) -- a sync that was not would have left the engine empty."""
    refills = sum("refilled after" in (s.get("path") or "") for s in syncs)
    return (
        f"vLLM slept at level 2 after every rollout and each later sync refilled the engine ({refills} of "
        f"{len(syncs)} syncs)",
        len(syncs) > 1 and refills >= len(syncs) - 1,
    )


def run_job(
    args: list[str],
    output_dir: Path,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    rollout: list[str] | None = None,
) -> JobResult:
    """Run a ``swift`` command line, logging to ``output_dir/swift.log``; measure wall time and peak RSS.

    ``rollout``: a ``swift rollout`` command line started first (log ``rollout.log``), waited for until it serves,
    and stopped afterwards; its port must be the one ``args`` names. RSS then sums both processes' trees.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    metrics = output_dir / "hwsync_metrics.jsonl"
    metrics.unlink(missing_ok=True)
    full_env = job_env({**(env or {}), "HWSYNC_METRICS": str(metrics)})
    log = output_dir / "swift.log"
    start = time.perf_counter()
    deadline = None if timeout_s is None else start + timeout_s
    peak = _PeakRss()
    rc = -1
    with contextlib.ExitStack() as stack:
        stack.callback(peak.stop)
        if rollout is not None:
            server = stack.enter_context(rollout_server(rollout, output_dir / "rollout.log", full_env, deadline))
            peak.watch(server.pid)
        with log.open("w") as out:
            # torch.distributed's default port (29500) is taken when two jobs run side by side (seen on an H100)
            trainer_env = {"MASTER_PORT": str(free_port()), **full_env, **_one_trainer_gpu(full_env)}
            proc = subprocess.Popen(
                [swift_exe(full_env), *args[1:]], stdout=out, stderr=subprocess.STDOUT, env=trainer_env
            )
            peak.watch(proc.pid)
            try:
                rc = proc.wait(timeout=None if deadline is None else max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    records = []
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    dtype = args[args.index("--torch_dtype") + 1] if "--torch_dtype" in args else "float32"
    return JobResult(rc, time.perf_counter() - start, peak.gb, log, output_dir, records, dtype)


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra``, with the vLLM CPU settings when there is no GPU."""
    # the demo checks the prompts' logprobs after every sync (a tiny model: one short forward); a real run keeps the
    # default (the first check and every 50th: its rollouts carry the logprob evidence of every step)
    env = {"HWSYNC_VERIFY_LOGPROBS_EVERY": "1", **os.environ, **(extra or {})}
    return env if _has_gpu() else {**CPU_ENV, "CUDA_VISIBLE_DEVICES": "", **env}


def swift_exe(env: dict[str, str]) -> str:
    exe = shutil.which("swift", path=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""))
    if exe is None:
        raise SystemExit("ms-swift's `swift` command is not installed: run `bash ci/install.sh` first")
    return exe


@contextlib.contextmanager
def rollout_server(
    args: list[str], log: Path, env: dict[str, str], deadline: float | None = None
) -> Iterator[subprocess.Popen]:
    """``swift rollout`` running and answering ``/health/`` for the duration of the block (then stopped)."""
    with log.open("w") as out:
        server = subprocess.Popen(
            [swift_exe(env), *args[1:]], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait_until_serving(server, int(args[args.index("--port") + 1]), deadline, log)
        yield server
    finally:
        _stop(server)


def _wait_until_serving(server: subprocess.Popen, port: int, deadline: float | None, log: Path) -> None:
    import urllib.error
    import urllib.request

    while True:
        if server.poll() is not None:
            raise RuntimeError(
                f"swift rollout exited ({server.returncode}) before serving; see {log}; its last "
                f"lines:\n{file_tail(log, 30)}"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if deadline is not None and time.perf_counter() > deadline:
            raise TimeoutError(f"swift rollout did not serve on port {port} in time; see {log}")
        time.sleep(2)


def _stop(server: subprocess.Popen) -> None:
    """Stop ``swift rollout`` and the engine worker it spawned (its own process group)."""
    import signal

    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


class _PeakRss:
    """Largest summed RSS of the watched process trees, sampled twice a second."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> None:
        self.pids.append(pid)

    def _poll(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            for pid in list(self.pids):
                try:
                    root = psutil.Process(pid)
                    procs = [root, *root.children(recursive=True)]
                except psutil.Error:
                    continue
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        total += p.memory_info().rss
            self.peak = max(self.peak, total)
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def gb(self) -> float:
        return self.peak / 1e9


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    parser.add_argument("--gspo", action="store_true", help="GSPO: --importance_sampling_level sequence")
    parser.add_argument("--server", action="store_true", help="vLLM in a `swift rollout` process (server mode)")
    parser.add_argument(
        "--engines", type=int, default=1, help="with --server: swift rollout's --vllm_data_parallel_size (default 1)"
    )
    parser.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        default="qwen3_moe",
        help="the tiny model: qwen3_moe (default) or qwen3_5_moe (Gated-DeltaNet + attention layers)",
    )
    parser.add_argument(
        "--vllm-weight-transfer",
        action="store_true",
        help="colocated: the engine selects hwsync as vLLM's weight-transfer backend (--vllm_engine_kwargs "
        '\'{"weight_transfer_config": {"backend": "hwsync"}}\'): syncs go through vLLM\'s own protocol',
    )
    parser.add_argument(
        "--sleep-level",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="colocated, CUDA: ms-swift's --sleep_level (1: vLLM offloads its weights to host memory while the trainer "
        "trains; 2: it discards them and hwsync refills them at the next sync)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where model, data and outputs go (default: tmp)")
    opts = parser.parse_args(argv)
    if opts.sleep_level and (opts.server or not _has_gpu()):
        raise SystemExit(
            "--sleep-level needs a colocated engine on a CUDA GPU: vLLM's CPU build has no sleep mode, and ms-swift "
            "turns --sleep_level off in server mode"
        )
    if opts.family == "qwen3_5_moe" and not _has_gpu() and importlib.util.find_spec("torchvision") is None:
        raise SystemExit(
            "--family qwen3_5_moe on vLLM's CPU build needs torchvision: vLLM 0.32's Qwen3.5 module "
            "imports qwen3_vl, which imports transformers' torchvision-backed Qwen2-VL image processor "
            "(ci/install.sh removes torchvision: PyPI's wheel is built for CUDA torch). Run it on a GPU: "
            "bash ci/gpu.sh qwen35"
        )

    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="hwsync-grpo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, data = prepare(workdir, family=opts.family)
    prep_s = time.perf_counter() - t0
    algo = "GSPO" if opts.gspo else "GRPO"
    name = ("gspo" if opts.gspo else "grpo") + ("-server" if opts.server else "")
    out = workdir / (name if opts.family == "qwen3_moe" else f"{opts.family}-{name}")
    where = "in a `swift rollout` server" if opts.server else "colocated"
    label = FAMILIES[opts.family]["label"]
    print(
        f"hwsync x ms-swift {algo}: tiny {label}, LoRA on attention + experts, vLLM {where}, "
        f"HWSYNC_STRATEGY={os.environ.get('HWSYNC_STRATEGY', 'auto')}, {opts.steps} steps "
        f"(log: {out / 'swift.log'})",
        flush=True,
    )
    port = free_port() if opts.server else None
    result = run_job(
        swift_args(
            model,
            data,
            out,
            steps=opts.steps,
            gspo=opts.gspo,
            server_port=port,
            extra=[*(["--sleep_level", str(opts.sleep_level)] if opts.sleep_level else []), *extra],
            engine_kwargs={"weight_transfer_config": {"backend": "hwsync"}} if opts.vllm_weight_transfer else None,
        ),
        out,
        env=server_env(opts.engines) if opts.server else None,
        rollout=rollout_args(model, port, opts.engines) if opts.server else None,
    )

    print()
    print(result.summary)
    print()
    print(
        f"time: {result.wall_s + prep_s:.0f} s (fixture + dataset {prep_s:.0f} s, swift rlhf {result.wall_s:.0f} s); "
        f"peak RSS {result.peak_rss_gb:.2f} GB"
    )
    checks = result.checks(opts.steps, GSPO_STEPS_PER_GENERATION if opts.gspo else 1, opts.sleep_level)
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    if result.returncode != 0:
        print(f"swift failed (exit {result.returncode}); last lines of {result.log}:")
        print(result.log_tail(25))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
