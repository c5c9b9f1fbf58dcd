"""`nanoserve train`: arguments in, a checkpoint directory out."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from nanoserve.model.chat_template import validate_template
from nanoserve.model.config import PRESETS, GPTConfig
from nanoserve.model.training.data import TrainInputError
from nanoserve.model.training.serve_alongside import ServeAlongside
from nanoserve.model.training.trainer import TrainConfig, train

_MODEL_FLAGS = ("n_layer", "n_head", "n_embd", "block_size", "dropout")
# --arch: the family's choices (nanoserve/model/config.py); sizes come from --preset and the size flags.
ARCHS: dict[str, dict[str, object]] = {
    "gpt2": {},
    "llama": {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": False},
}


def add_train_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("train", help="train a checkpoint from a UTF-8 text file")
    p.add_argument("corpus", type=Path, help="UTF-8 text file to train on (last 10%% validates)")
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--tokenizer", default="char", help="char | word | bpe:VOCAB_SIZE")
    p.add_argument("--preset", choices=sorted(PRESETS), help="named model size")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--no-bias", action="store_true", help="drop biases from Linear/LayerNorm")
    p.add_argument("--arch", choices=sorted(ARCHS), default="gpt2",
                   help="gpt2: LayerNorm, GELU, learned positions; llama: RMSNorm, SwiGLU, rotary positions")
    p.add_argument("--n-kv-head", type=int, help="key/value heads (fewer than --n-head: grouped-query)")
    p.add_argument("--mlp-hidden", type=int, help="the MLP's width (default 4x, or 8/3x for SwiGLU)")
    p.add_argument("--rope-theta", type=float, help="rotary positions' base (default 10000)")
    p.add_argument("--untied", action="store_true", help="an output layer of its own, not the embedding's")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-iters", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup-iters", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=40)
    p.add_argument("--dtype", default="float32", help="autocast dtype: float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--max-minutes", type=float, help="wall-clock budget; stops at the next eval")
    p.add_argument("--name", help="checkpoint name (default: the output folder's name)")
    p.add_argument("--chat-template", type=Path, help="JSON file with the checkpoint's chat template")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--serve", action="store_true",
                   help="serve --out while training (nanoserve serve --watch, from the first save on): "
                   "each improved checkpoint is reloaded, the chat page shows the model learning; it "
                   "keeps serving after training until Ctrl-C")
    p.add_argument("--serve-port", type=int, default=8000, help="the port --serve listens on (127.0.0.1)")
    p.set_defaults(func=run_train)


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    positive = ("batch_size", "grad_accum", "max_iters", "eval_interval", "eval_iters")
    for name in positive:
        if getattr(args, name) <= 0:
            raise TrainInputError(f"--{name.replace('_', '-')} must be positive")
    if args.warmup_iters < 0 or args.warmup_iters >= args.max_iters:
        raise TrainInputError("--warmup-iters must be at least 0 and less than --max-iters")
    if args.serve and dist.is_torchelastic_launched():
        raise TrainInputError("--serve runs with one process; beside torchrun, start "
                              "`nanoserve serve --watch --checkpoint OUT` once the first save is there")
    if args.min_lr > args.lr:
        raise TrainInputError("--min-lr must not exceed --lr")
    model = dict(PRESETS[args.preset]) if args.preset else {}
    for name in _MODEL_FLAGS:
        value = getattr(args, name)
        if value is not None:
            model[name] = value
    model["bias"] = not args.no_bias
    model.update(ARCHS[args.arch])
    for name in ("n_kv_head", "mlp_hidden", "rope_theta"):
        if getattr(args, name) is not None:
            model[name] = getattr(args, name)
    if args.untied:
        model["tie_embeddings"] = False
    if not args.resume:
        try:  # every invalid combination, now rather than after the corpus is read
            GPTConfig(vocab_size=1, **model)
        except ValueError as e:
            raise TrainInputError(str(e)) from None
    if args.resume and (args.preset or any(getattr(args, n) for n in _MODEL_FLAGS[:4])):
        raise TrainInputError("--resume takes the model size from the checkpoint; drop the size flags")
    template = None
    if args.chat_template:
        try:
            template = json.loads(args.chat_template.read_text(encoding="utf-8"))
            # The checks a checkpoint's template gets at load, now, so that a broken template fails
            # here rather than in the server after hours of training.
            validate_template(template)
        except (OSError, ValueError, RecursionError) as e:
            raise TrainInputError(f"--chat-template {args.chat_template}: {e}") from None
    return TrainConfig(
        corpus=args.corpus, out_dir=args.out, tokenizer=args.tokenizer, name=args.name,
        model=model, batch_size=args.batch_size, grad_accum=args.grad_accum,
        max_iters=args.max_iters, lr=args.lr, min_lr=args.min_lr, warmup_iters=args.warmup_iters,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, dtype=args.dtype,
        device=args.device, seed=args.seed, resume=args.resume, max_minutes=args.max_minutes,
        chat_template=template, progress=not args.no_progress,
        command=shlex.join(["nanoserve", *sys.argv[1:]]),
    )


def run_train(args: argparse.Namespace) -> int:
    alongside = ServeAlongside(args.serve_port) if args.serve else None
    args.on_save = alongside.on_save if alongside is not None else None
    try:
        code = _train_and_report(args)
    except BaseException:
        if alongside is not None:
            alongside.stop()
        raise
    if dist.is_torchelastic_launched():
        _leave_worker(code)
    if alongside is None:
        return code
    if code != 0:  # a failed or interrupted run: stop serving what it left
        alongside.stop()
        return code
    return alongside.serve_on()


def _missing_extras(progress: bool) -> list[str]:
    """The `train` extra's packages this run needs and the environment lacks (the server needs
    neither, so a serving install leaves them out)."""
    wanted = ["matplotlib", *(["tqdm"] if progress else [])]
    return [name for name in wanted if importlib.util.find_spec(name) is None]


def _train_and_report(args: argparse.Namespace) -> int:
    missing = _missing_extras(progress=not args.no_progress)
    if missing:  # before any work: the plot is drawn at the very end of a run
        print(f"nanoserve train: error: needs {', '.join(missing)}; install the training extra: "
              "pip install 'nanoserve[train]'", file=sys.stderr)
        return 2
    try:
        cfg = _config_from_args(args)
        prov = train(replace(cfg, on_save=args.on_save))
    except TrainInputError as e:
        print(f"nanoserve train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"nanoserve train: interrupted; the best checkpoint so far (if any) is in {args.out}, "
              "continue with --resume", file=sys.stderr)
        return 130
    if prov:
        print(
            f"saved {args.out}: best val loss {prov['best_val_loss']:.4f} "
            f"(full split {prov['val_loss_full']:.4f}) at step {prov['best_step']}"
        )
    return 0


def _leave_worker(code: int) -> NoReturn:
    """End a torchrun worker without the interpreter's teardown. In 1 of 30-40 two-process runs a
    worker that had finished (checkpoint written, ranks met at a barrier, process group
    destroyed) aborted at exit: "terminate called without an active exception", SIGABRT with no
    Python frame left, i.e. a C++ thread object of torch's distributed runtime destroyed while
    still joinable during finalization. torchrun then reported the finished run as failed.
    Everything the run writes is written and closed by now, so flush and leave."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
