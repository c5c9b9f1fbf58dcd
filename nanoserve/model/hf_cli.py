"""`nanoserve export-hf` and `nanoserve import-hf`: checkpoints to and from Hugging Face GPT-2 and
Llama directories (weights, tokenizer, chat template, special and end tokens)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from nanoserve.model.checkpoint import CONFIG_FILE, CheckpointError, load_checkpoint, read_json_object
from nanoserve.model.hf import OUR_TOKENIZER, HFConversionError, export_hf, import_hf


def add_hf_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("export-hf", help="write a checkpoint as a Hugging Face GPT-2 or Llama directory")
    p.add_argument("checkpoint", type=Path, help="nanoserve checkpoint directory")
    p.add_argument("out", type=Path, help="directory to write (config.json + model.safetensors)")
    p.set_defaults(func=run_export)
    p = sub.add_parser("import-hf", help="turn a Hugging Face GPT-2 or Llama directory into a checkpoint")
    p.add_argument("hf_dir", type=Path, help="directory with config.json, model.safetensors and "
                   "a tokenizer (tokenizer.json, or vocab.json + merges.txt); its chat template "
                   "(chat_template.jinja or tokenizer_config.json) and generation_config.json's end "
                   "tokens come along")
    p.add_argument("out", type=Path, help="checkpoint directory to write")
    p.add_argument("--name", help="checkpoint name (default: the source folder's name)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="cast the weights (default: keep the source's dtype)")
    p.set_defaults(func=run_import)


def _convert(command: str, out: Path, action: Callable[[], Path]) -> Path | None:
    """Run one conversion; on bad input print one error line and return None."""
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise HFConversionError(f"{out} already exists and is not an empty directory")
        return action()
    except (CheckpointError, HFConversionError) as e:
        print(f"nanoserve {command}: error: {e}", file=sys.stderr)
    except OSError as e:
        print(f"nanoserve {command}: error: cannot write {out} ({e.strerror})", file=sys.stderr)
    return None


def run_export(args: argparse.Namespace) -> int:
    out = _convert("export-hf", args.out, lambda: export_hf(load_checkpoint(args.checkpoint), args.out))
    if out is None:
        return 2
    print(f"wrote {out} (load it with transformers.GPT2LMHeadModel.from_pretrained)")
    if (out / OUR_TOKENIZER).is_file():
        print(f"note: a char- or word-level tokenizer has no Hugging Face equivalent; it is kept as "
              f"{OUR_TOKENIZER} so `nanoserve import-hf` can read it back")
    return 0


def run_import(args: argparse.Namespace) -> int:
    out = _convert("import-hf", args.out,
                   lambda: import_hf(args.hf_dir, args.out, name=args.name, dtype=args.dtype))
    if out is None:
        return 2
    manifest = read_json_object(out / CONFIG_FILE)
    template = "Jinja" if "jinja" in manifest["chat_template"] else "none in the source: the generic one"
    print(f"wrote checkpoint {out} (chat template: {template}; end tokens: "
          f"{manifest.get('end_token_ids') or 'the end-of-text token'})")
    return 0
