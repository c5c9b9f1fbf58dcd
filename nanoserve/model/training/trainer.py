"""The offline training loop: single process, or data-parallel under `torchrun`."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from nanoserve.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.reference import reference_generate
from nanoserve.model.tokenizer import Tokenizer, train_tokenizer
from nanoserve.model.training.atomic_dir import staged_directory
from nanoserve.model.training.data import (
    TrainInputError,
    encode_and_split,
    get_batch,
    read_corpus,
    sequential_batches,
)
from nanoserve.model.training.optim import (
    OPTIMIZER_FILE,
    load_optimizer,
    lr_at,
    make_optimizer,
    save_optimizer,
)
from nanoserve.model.training.report import model_card, plot_loss_curve


@dataclass
class TrainConfig:
    corpus: Path
    out_dir: Path
    tokenizer: str = "char"
    name: str | None = None
    model: dict[str, Any] = field(default_factory=dict)  # GPTConfig fields except vocab_size
    batch_size: int = 32
    grad_accum: int = 1
    max_iters: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    weight_decay: float = 0.1
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_iters: int = 40
    dtype: str = "float32"  # autocast dtype for forward/backward; weights stay fp32
    device: str = "cpu"
    seed: int = 1337
    resume: bool = False
    max_minutes: float | None = None  # stop early (at an eval) when the wall-clock budget is spent
    chat_template: dict[str, Any] | None = None
    sample_tokens: int = 500
    progress: bool = True
    command: str = ""
    on_save: Callable[[Path], None] | None = None  # called after each checkpoint is in place


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def rank_device(device: str) -> str:
    """The device this process trains on. Under torchrun every process would otherwise take the
    first GPU (`cuda` is cuda:0), so plain `cuda` becomes cuda:LOCAL_RANK, as in nanoGPT; an
    explicit cuda:N, or cpu, is kept."""
    if device == "cuda" and dist.is_torchelastic_launched():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def _setup_distributed(device: str) -> _Dist:
    if not dist.is_torchelastic_launched():
        return _Dist()
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL's collectives run on the current device
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return _Dist(rank=dist.get_rank(), world=dist.get_world_size())


def _check_output_dir(out: Path, resume: bool) -> None:
    if resume:
        if not (out / OPTIMIZER_FILE).is_file():
            raise TrainInputError(f"--resume: {out} holds no optimizer state ({OPTIMIZER_FILE})")
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise TrainInputError(f"output directory {out} is not writable ({e.strerror})") from None


@torch.no_grad()
def _estimate_loss(
    model: torch.nn.Module, data: torch.Tensor, cfg: TrainConfig, block: int, seed: int,
    autocast: Any,
) -> float:
    """Mean loss over `eval_iters` random windows drawn with a fixed seed (nanoGPT's estimate)."""
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(cfg.eval_iters):
        x, y = get_batch(data, cfg.batch_size, block, gen)
        with autocast():
            logits = model(x.to(cfg.device))
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y.to(cfg.device).flatten()))
    model.train()
    return float(torch.stack(losses).mean())


@torch.no_grad()
def full_split_loss(model: GPT, data: torch.Tensor, block: int, device: str) -> float:
    """Exact mean loss over every non-overlapping window of a split."""
    model.eval()
    total, count = 0.0, 0
    for x, y in sequential_batches(data, 64, block):
        logits = model(x.to(device)).float()
        total += float(F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum"))
        count += y.numel()
    return total / count


def _build(cfg: TrainConfig, text: str) -> tuple[GPT, Tokenizer, dict[str, Any]]:
    if cfg.resume:
        try:
            ckpt = load_checkpoint(cfg.out_dir)
        except CheckpointError as e:
            raise TrainInputError(f"--resume: {e}") from None
        model = ckpt.build_model(cfg.device, torch.float32).train()
        return model, ckpt.tokenizer, ckpt.provenance
    try:
        tokenizer = train_tokenizer(cfg.tokenizer, text)
        config = GPTConfig(vocab_size=tokenizer.vocab_size, **cfg.model)
    except (TypeError, ValueError) as e:
        raise TrainInputError(str(e)) from None
    torch.manual_seed(cfg.seed)
    return GPT(config).to(cfg.device), tokenizer, {}


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run training; returns the provenance written into the checkpoint."""
    cfg = replace(cfg, device=rank_device(cfg.device))
    rank = _setup_distributed(cfg.device)
    try:
        result = _train(cfg, rank)
        if dist.is_initialized():
            # Leave together: rank 0 still writes the card and sample after the last collective,
            # and a rank tearing gloo down while its peer still holds the connection can abort
            # ("terminate called without an active exception", seen once in CI).
            dist.barrier()
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, rank: _Dist) -> dict[str, Any]:
    corpus = read_corpus(cfg.corpus)
    if rank.main:
        _check_output_dir(cfg.out_dir, cfg.resume)
    if cfg.dtype not in ("float32", "bfloat16", "float16"):
        raise TrainInputError(f"--dtype must be float32, bfloat16 or float16, got {cfg.dtype!r}")
    if cfg.dtype == "float16" and not cfg.device.startswith("cuda"):
        raise TrainInputError("--dtype float16 needs a CUDA device; use bfloat16 on CPU")
    model, tokenizer, old_prov = _build(cfg, corpus.text)
    block = model.config.block_size
    splits = encode_and_split(corpus, tokenizer, block)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, (0.9, cfg.beta2))
    start_step, best_val, best_step, history, elapsed_before = 0, float("inf"), 0, [], 0.0
    curve: list[list[float]] = []  # [step, train loss] at every step: the plot's training curve
    if cfg.resume:
        meta = load_optimizer(cfg.out_dir, optimizer)
        start_step, best_val, best_step = meta["step"], meta["best_val_loss"], meta["best_step"]
        history, elapsed_before = meta["history"], meta["wall_time_s"]
        curve = [p for p in meta.get("train_curve", []) if p[0] <= start_step]
    ddp_model: torch.nn.Module = model
    if rank.world > 1:
        ddp_model = DistributedDataParallel(model)
    amp_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.dtype)
    device_type = "cuda" if cfg.device.startswith("cuda") else "cpu"

    def autocast() -> Any:
        if amp_dtype is None:
            return nullcontext()
        return torch.autocast(device_type, dtype=amp_dtype)

    scaler = torch.amp.GradScaler(enabled=cfg.dtype == "float16")
    # Each rank draws different batches; the seed fixes the whole run (and its resumption).
    gen = torch.Generator().manual_seed(cfg.seed + 1000 * rank.rank + start_step)
    tokens_per_step = cfg.batch_size * block * cfg.grad_accum * rank.world
    t0 = time.time()
    bar = None
    if rank.main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.max_iters, initial=start_step, unit="step", dynamic_ncols=True,
                   mininterval=2.0)
    step, train_loss = start_step, float("nan")
    model.train()
    while step < cfg.max_iters:
        lr = lr_at(step, max_lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup_iters, total=cfg.max_iters)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for micro in range(cfg.grad_accum):
            x, y = get_batch(splits.train, cfg.batch_size, block, gen)
            sync = micro == cfg.grad_accum - 1 or rank.world == 1
            ctx = nullcontext() if sync else ddp_model.no_sync()  # type: ignore[operator]
            with ctx, autocast():
                logits = ddp_model(x.to(cfg.device))
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(cfg.device).flatten())
            scaler.scale(loss / cfg.grad_accum).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        train_loss = float(loss.detach())
        step += 1
        curve.append([step, train_loss])
        if bar is not None:
            rate = (step - start_step) * tokens_per_step / max(time.time() - t0, 1e-9)
            bar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rate:,.0f}")
            bar.update(1)
        out_of_time = cfg.max_minutes is not None and (time.time() - t0) / 60 >= cfg.max_minutes
        if step % cfg.eval_interval == 0 or step == cfg.max_iters or out_of_time:
            losses = torch.tensor([
                _estimate_loss(model, splits.train, cfg, block, cfg.seed + 1, autocast),
                _estimate_loss(model, splits.val, cfg, block, cfg.seed + 2, autocast),
            ])
            if rank.world > 1:
                dist.all_reduce(losses)
                losses /= rank.world
            tr, va = float(losses[0]), float(losses[1])
            history.append({"step": step, "train_loss": tr, "val_loss": va})
            if bar is not None:
                bar.write(f"step {step}: train {tr:.4f}, val {va:.4f}")
            if va < best_val:
                best_val, best_step = va, step
                if rank.main:
                    prov = _provenance(cfg, corpus, model, step, tr, va, history, rank,
                                       elapsed_before + time.time() - t0, tokens_per_step, old_prov)
                    _save(cfg, model, tokenizer, prov, optimizer,
                          {"history": history, "train_curve": curve}, step, best_val, best_step)
                    if cfg.on_save is not None:
                        cfg.on_save(cfg.out_dir)
            # Every rank must agree to stop, or the collectives would hang.
            stop = torch.tensor([1.0 if out_of_time else 0.0])
            if rank.world > 1:
                dist.all_reduce(stop)
            if float(stop) > 0:
                break
    if bar is not None:
        bar.close()
    replica_diff = _replica_divergence(model, rank)
    if not rank.main:
        return {}
    return _finish(cfg, tokenizer, splits.val, block, elapsed_before + time.time() - t0,
                   {"history": history, "train_curve": curve}, replica_diff)


def _replica_divergence(model: GPT, rank: _Dist) -> float | None:
    """Largest difference between any two ranks' copies of any weight (None when single-process).

    DDP keeps replicas identical by construction; checking once costs two all-reduces and turns
    a silent divergence (a parameter DDP does not see, a rank-dependent update) into an error
    instead of a checkpoint that is only one of several different models.
    """
    if rank.world == 1:
        return None
    with torch.no_grad():
        flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
        hi, lo = flat.clone(), flat.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        diff = float((hi - lo).max())
    if not diff <= 1e-5:
        raise RuntimeError(f"data-parallel replicas diverged: weights differ by up to {diff:g}")
    return diff


def _provenance(
    cfg: TrainConfig, corpus: Any, model: GPT, step: int, tr: float, va: float,
    history: list[dict[str, float]], rank: _Dist, wall: float, tokens_per_step: int,
    old: dict[str, Any],
) -> dict[str, Any]:
    return {
        **old,
        "corpus": corpus.name,
        "corpus_sha256": corpus.sha256,
        "tokenizer": cfg.tokenizer if not cfg.resume else old.get("tokenizer", cfg.tokenizer),
        "steps": step,
        "best_step": step,
        "train_loss": tr,
        "best_val_loss": va,
        "val_fraction": 0.1,
        "tokens_seen": step * tokens_per_step,
        "wall_time_s": round(wall, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "world_size": rank.world,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "command": cfg.command,
        # A resumed run keeps the commands that produced it, in order.
        "commands": [*old.get("commands", []), cfg.command],
    }


def _save(
    cfg: TrainConfig, model: GPT, tokenizer: Tokenizer, prov: dict[str, Any],
    optimizer: torch.optim.Optimizer, log: dict[str, list[Any]], step: int,
    best_val: float, best_step: int,
) -> None:
    """Write the checkpoint and the optimizer state as one directory, swapped in whole (atomic_dir.py):
    a server watching `out_dir` reloads complete saves only."""
    with staged_directory(cfg.out_dir) as stage:
        save_checkpoint(
            stage, model, tokenizer, name=cfg.name or cfg.out_dir.name,
            chat_template=cfg.chat_template, provenance=prov,
        )
        save_optimizer(stage, optimizer, {
            "step": step, "best_val_loss": best_val, "best_step": best_step, **log,
            "wall_time_s": prov["wall_time_s"],
        })


def _finish(
    cfg: TrainConfig, tokenizer: Tokenizer, val: torch.Tensor, block: int, wall: float,
    log: dict[str, list[Any]], replica_diff: float | None = None,
) -> dict[str, Any]:
    """Reload the best checkpoint, measure it on the whole val split, write card, sample, plot."""
    ckpt = load_checkpoint(cfg.out_dir)
    best = ckpt.build_model(cfg.device, torch.float32)
    prov = dict(ckpt.provenance)
    if replica_diff is not None:
        prov["replica_max_abs_diff"] = replica_diff  # 0.0: every rank ended with the same weights
    prov["val_loss_full"] = full_split_loss(best, val, block, cfg.device)
    prov["total_wall_time_s"] = round(wall, 1)
    prompt = tokenizer.encode("\n") if tokenizer.kind == "char" else [tokenizer.eos_id or 0]
    gen = torch.Generator(device=cfg.device).manual_seed(0)
    out = reference_generate(best, prompt, cfg.sample_tokens, temperature=0.8, top_k=40, generator=gen)
    sample = tokenizer.decode(out)
    card = model_card(ckpt.name, prov, ckpt.config.to_dict(), sample[:600])
    with staged_directory(cfg.out_dir) as stage:
        (stage / "sample.txt").write_text(sample + "\n", encoding="utf-8")
        plot_loss_curve(log["history"], log["train_curve"], stage / "loss.png")
        save_checkpoint(stage, best, tokenizer, name=ckpt.name, chat_template=ckpt.chat_template,
                        provenance=prov, card=card, end_token_ids=ckpt.end_token_ids)
    return prov
