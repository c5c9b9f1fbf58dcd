"""A benchmark checkpoint as llama.cpp reads it: exported with `nanoserve export-hf`'s code
(nanoserve/model/hf.py: GPT2LMHeadModel or LlamaForCausalLM) and converted by llama.cpp's own
`convert_hf_to_gguf.py` (outtype f32, bf16 or q8_0), so llama.cpp's peers run exactly the weights
nanoserve runs, laid out as llama.cpp lays them out itself.

The vocabulary is the one part not converted by the script: the benchmark models' vocabularies
(bench/shapes.py: synthetic words, a char set) have no Hugging Face tokenizer, which the script
requires (and it must recognise the tokenizer's pre-tokenizer by a hash). The script runs in a
child process, `python -m bench.gguf_convert VOCAB.json <script args>`, with each model class's
`set_vocab` replaced by one writing this vocabulary (every id a token of its own, one BPE merge so
llama.cpp's BPE loader accepts it); weights, hyperparameters and file type are all the script's.
Prompts are then sent to llama.cpp as token ids, so its tokenizer never splits text.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.llama_cpp_build import LlamaCpp

REPO = Path(__file__).resolve().parents[1]
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "q8_0": "q8_0"}
VOCAB_FILE = "nanoserve_gguf_vocab.json"


class GGUFConversionError(RuntimeError):
    """convert_hf_to_gguf.py failed; the message holds the end of its output."""


def write_vocab(ckpt: Any, hf_dir: Path) -> Path:
    """The checkpoint's vocabulary for the child process: each id's piece, padded to the model's
    vocabulary size, which ids are special, and the end-of-sequence id."""
    tok, n = ckpt.tokenizer, ckpt.config.vocab_size
    pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    pieces += [f"<pad{i}>" for i in range(n - len(pieces))]
    seen: set[str] = set()
    for i, p in enumerate(pieces):  # llama.cpp maps piece -> id: a repeated piece would shadow one
        if p in seen or not p:
            pieces[i] = f"<dup{i}>"
        seen.add(pieces[i])
    special = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    path = hf_dir / VOCAB_FILE
    path.write_text(json.dumps({"pieces": pieces, "special": special, "eos": tok.eos_id}))
    return path


def export_and_convert(ckpt: Any, out_dir: Path, outtypes: list[str], lc: LlamaCpp,
                       hf_dir: Path | None = None) -> dict[str, Path]:
    """Export `ckpt` to out_dir/hf (or use `hf_dir`, already exported) and convert it once per
    outtype ("float32", "bfloat16", "q8_0"); returns each outtype's GGUF path (reused when there)."""
    from nanoserve.model.hf import export_hf

    out_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = hf_dir or out_dir / "hf"
    if not (hf_dir / "model.safetensors").is_file():
        export_hf(ckpt, hf_dir)
    vocab = write_vocab(ckpt, hf_dir)
    out = {}
    for outtype in outtypes:
        gguf = out_dir / f"model-{OUTTYPES[outtype]}.gguf"
        if not gguf.is_file():
            convert(lc, hf_dir, vocab, gguf, OUTTYPES[outtype])
        out[outtype] = gguf
    return out


def convert(lc: LlamaCpp, hf_dir: Path, vocab: Path, gguf: Path, outtype: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(lc.tree), str(lc.gguf_py)])}
    cmd = [sys.executable, "-m", "bench.gguf_convert", str(vocab), str(lc.convert_script), str(hf_dir),
           "--outfile", str(gguf), "--outtype", outtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not gguf.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise GGUFConversionError(f"convert_hf_to_gguf.py --outtype {outtype} failed:\n{tail}")


def _set_vocab_from(vocab_path: Path) -> Any:
    def set_vocab(self: Any) -> None:
        import gguf

        v = json.loads(vocab_path.read_text())
        special = set(v["special"])
        w = self.gguf_writer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(v["pieces"])
        w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                           for i in range(len(v["pieces"]))])
        w.add_token_merges([f"{v['pieces'][0]} {v['pieces'][1]}"])
        w.add_add_bos_token(False)  # token-id prompts go in as sent
        if v["eos"] is not None:
            w.add_eos_token_id(v["eos"])
    return set_vocab


def _child(argv: list[str]) -> None:
    """In the child: patch the model classes' vocabulary, then run the script as its own main."""
    vocab, script, *script_args = argv
    from conversion.gpt2 import GPT2Model
    from conversion.llama import LlamaModel

    for cls in (GPT2Model, LlamaModel):
        cls.set_vocab = _set_vocab_from(Path(vocab))  # type: ignore[method-assign]
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    _child(sys.argv[1:])
