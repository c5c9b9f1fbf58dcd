"""The checkpoint format: a directory that describes itself, and nothing in it is ever unpickled.

    config.json        format version, model config, tokenizer kind, chat template, end tokens,
                       provenance
    model.safetensors  the weights (names as in `GPT.state_dict()`, a tied lm_head left out)
    tokenizer.json     see nanoserve/model/tokenizer.py
    README.md          the model card

Loading validates the whole directory before anything is allocated: the manifest's fields and
their types, the model config (strict types, bounds), the chat template, the tokenizer against the
config and the manifest, and every tensor's name, shape and dtype as the weights file's header
declares them; only then are the weights read, and checked for NaN or infinite values. A failure is
a CheckpointError that names the file and the exact problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from nanoserve.model.chat_template import ChatTemplateError, template_from_file, validate_template
from nanoserve.model.config import GPTConfig
from nanoserve.model.file_pages import FilePages
from nanoserve.model.gpt import GPT
from nanoserve.model.tokenizer import Tokenizer, load_tokenizer

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CARD_FILE = "README.md"
# Weights tied to another tensor are not stored (safetensors refuses aliased tensors anyway).
TIED = ("lm_head.weight",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FILE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # safetensors' names
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
                "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                "BOOL": "bool"}
_PICKLE_SUFFIXES = {".pt", ".pth", ".bin", ".pkl", ".ckpt"}
# Bounds on the JSON files read whole at load: a manifest is a few kB, the largest published BPE
# tokenizer files tens of MB.
MAX_CONFIG_BYTES = 16 * 2**20
MAX_TOKENIZER_BYTES = 256 * 2**20
MAX_NAME_CHARS = 256
# A generic chat template (see nanoserve/model/chat_template.py): "Role: content" lines, then the
# assistant's turn is opened; a blank line ends a turn.
DEFAULT_CHAT_TEMPLATE: dict[str, Any] = {
    "roles": {"system": "System", "user": "User", "assistant": "Assistant"},
    "message": "{role}: {content}\n",
    "generation_prompt": "{role}:",
    "stop": ["\n\n"],
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


@dataclass
class Checkpoint:
    config: GPTConfig
    tokenizer: Tokenizer
    state_dict: dict[str, torch.Tensor]
    name: str = "model"
    chat_template: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_CHAT_TEMPLATE))
    provenance: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    # Token ids besides the tokenizer's eos_id that end a generation (config.json's end_token_ids).
    end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.tokenizer.end_ids = frozenset(self.end_token_ids)

    def build_model(
        self, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> GPT:
        """An eval-mode GPT holding these weights on `device` (optionally cast to `dtype`)."""
        with torch.device("meta"):
            model = GPT(self.config, init_weights=False)
        model.load_state_dict(self.state_dict, strict=False, assign=True)
        if self.config.tie_embeddings:
            model.lm_head.weight = model.wte.weight  # re-tie after `assign` replaced wte.weight
        # Buffers-free model: every parameter came from the file, so nothing stays on "meta".
        # Converted one tensor at a time, each one's file pages handed back once it is copied: a
        # whole-model .to() held the mapped file and every converted copy at once.
        pages = FilePages()
        for param in model.parameters():  # a tied parameter once: it stays tied
            old = param.data
            param.data = old.to(device=device, dtype=dtype or _DTYPES[self.dtype])
            if param.data.data_ptr() != old.data_ptr():
                pages.release(old)
        return model.eval()


def expected_tensors(config: GPTConfig) -> dict[str, tuple[tuple[int, ...], None]]:
    """Names and shapes the file must contain for `config`, computed without allocating weights."""
    with torch.device("meta"):
        model = GPT(config, init_weights=False)
    tied = TIED if config.tie_embeddings else ()
    return {
        name: (tuple(t.shape), None) for name, t in model.state_dict().items() if name not in tied
    }


def state_dict_for_saving(model: GPT) -> dict[str, torch.Tensor]:
    # Unwrap torch.compile / DDP so names are the plain module's.
    raw = getattr(model, "_orig_mod", model)
    raw = getattr(raw, "module", raw)
    tied = TIED if raw.config.tie_embeddings else ()
    return {
        k: v.detach().contiguous().cpu() for k, v in raw.state_dict().items() if k not in tied
    }


def save_checkpoint(
    out_dir: str | Path,
    model: GPT,
    tokenizer: Tokenizer,
    *,
    name: str,
    chat_template: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
    card: str | None = None,
    end_token_ids: Iterable[int] = (),
) -> Path:
    if chat_template is not None:
        validate_template(chat_template)  # never write a checkpoint that loading would refuse
    end_ids = list(end_token_ids)
    if not all(type(i) is int and 0 <= i < tokenizer.vocab_size for i in end_ids):
        raise ValueError(f"end_token_ids {end_ids} must be token ids below {tokenizer.vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = state_dict_for_saving(model)
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"all weights must share one dtype, found {sorted(dtypes)}")
    raw_config = model.config
    manifest = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "model": raw_config.to_dict(),
        "dtype": dtypes.pop(),
        "tokenizer": {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                      "eos_id": tokenizer.eos_id},
        "chat_template": chat_template or DEFAULT_CHAT_TEMPLATE,
        "provenance": provenance or {},
    }
    if end_ids:
        manifest["end_token_ids"] = end_ids
    # Write to temporary names and rename, so a crash never leaves a half-written checkpoint.
    tmp_weights = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    tmp_weights.replace(out / WEIGHTS_FILE)
    tokenizer.save(out / TOKENIZER_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    if card is not None:
        (out / CARD_FILE).write_text(card, encoding="utf-8")
    return out


def read_json_object(
    path: Path, error: type[ValueError] = CheckpointError, max_bytes: int = MAX_CONFIG_BYTES
) -> dict[str, Any]:
    """Parse a JSON file that must hold an object; `error` names the file and the problem."""
    if path.stat().st_size > max_bytes:
        raise error(f"{path}: {path.stat().st_size} bytes, more than the limit of {max_bytes}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # the parser recurses once per nested array or object
        raise error(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise error(f"{path}: must hold a JSON object")
    return data


def _read_manifest(path: Path) -> dict[str, Any]:
    config_path = path / CONFIG_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing (a checkpoint needs {CONFIG_FILE})")
    manifest = read_json_object(config_path)
    version = manifest.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:  # not True, which == 1
        raise CheckpointError(
            f"{config_path}: format_version {version!r} is not supported (expected {FORMAT_VERSION})"
        )
    for key in ("model", "tokenizer", "dtype"):
        if key not in manifest:
            raise CheckpointError(f"{config_path}: missing field {key!r}")
    dtype = manifest["dtype"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise CheckpointError(
            f"{config_path}: dtype {dtype!r} is not supported (one of {', '.join(_DTYPES)})"
        )
    for key in ("model", "tokenizer", "provenance"):
        value = manifest.get(key, {})
        if key == "provenance" and value is None:
            continue
        if not isinstance(value, dict):
            raise CheckpointError(f"{config_path}: {key} must be a JSON object")
    if manifest.get("name") is None:  # absent or null: the directory's name
        manifest["name"] = path.resolve().name
    name = manifest["name"]
    # The name is the served model's id (API responses, /info, logs): plain text, bounded.
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise CheckpointError(
            f"{config_path}: name must be 1 to {MAX_NAME_CHARS} printable characters, got {name!r}"
        )
    return manifest


def _model_config(manifest: dict[str, Any], config_path: Path) -> GPTConfig:
    try:
        return GPTConfig.from_dict(manifest["model"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config_path}: invalid model config: {e}") from None


def _chat_template(manifest: dict[str, Any], config_path: Path) -> dict[str, Any]:
    template = manifest.get("chat_template")
    if template is None:  # absent or null: the generic template
        return dict(DEFAULT_CHAT_TEMPLATE)
    try:
        validate_template(template)
    except ChatTemplateError as e:
        raise CheckpointError(f"{config_path}: invalid chat_template: {e}") from None
    return dict(template)


def _end_token_ids(manifest: dict[str, Any], config_path: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    ids = manifest.get("end_token_ids")
    if ids is None:  # absent or null: the tokenizer's eos_id alone
        return ()
    vocab = tokenizer.vocab_size
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab for i in ids):
        raise CheckpointError(
            f"{config_path}: end_token_ids must be a list of token ids from 0 to {vocab - 1}, got {ids!r}"
        )
    return tuple(ids)


def with_chat_template_file(ckpt: Checkpoint, path: Path) -> Checkpoint:
    """`ckpt` with the chat template in `path` instead of its own (`serve --chat-template`); a Jinja
    one sees the special tokens of the checkpoint's own Jinja template, or else its eos token as
    bos_token and eos_token (GPT-2's convention). ChatTemplateError names the file and the problem."""
    specials = ckpt.chat_template.get("special_tokens")
    if specials is None and ckpt.tokenizer.eos_id is not None:
        eos = ckpt.tokenizer.id_to_piece(ckpt.tokenizer.eos_id)
        specials = {"bos_token": eos, "eos_token": eos}
    return replace(ckpt, chat_template=template_from_file(path, specials or {}))


def name_mismatch(expected: Iterable[str], found: Iterable[str]) -> str | None:
    """"missing tensor(s): ..." or "unexpected tensor(s): ...", or None when the names agree."""
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing:
        return f"missing tensor(s): {_some(missing)}"
    if extra:
        return f"unexpected tensor(s): {_some(extra)}"
    return None


def _some(names: list[str], shown: int = 8) -> str:
    """The first `shown` names, and how many more (a config off by 1,000 layers is one line)."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _check_header(weights_path: Path, config: GPTConfig, dtype: str) -> None:
    """Every tensor's name, shape and dtype as the file's header declares them, against the
    config, before any tensor is read: a config that does not describe the file is refused here,
    whatever sizes it claims. (safetensors itself checks that the header's tensors cover the
    file's bytes exactly, so the file then holds exactly the bytes the config implies.)"""
    expected = expected_tensors(config)
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            declared = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
            found = {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in declared.items()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{weights_path}: not a valid safetensors file ({e})") from None
    problem = name_mismatch(expected, found)
    if problem:
        raise CheckpointError(f"{weights_path}: {problem}")
    for name, (shape, _) in expected.items():
        got_shape, got_dtype = found[name]
        if got_shape != shape:
            raise CheckpointError(
                f"{weights_path}: tensor {name} has shape {list(got_shape)}, "
                f"config.json implies {list(shape)}"
            )
        if got_dtype != _FILE_DTYPES[dtype]:
            got = _DTYPE_NAMES.get(got_dtype, got_dtype)
            raise CheckpointError(
                f"{weights_path}: tensor {name} has dtype {got}, config.json says {dtype}"
            )


def _check_values(weights_path: Path, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(f"{weights_path}: tensor {name} contains NaN or infinite values")


def _load_weights(root: Path, config: GPTConfig, dtype: str) -> dict[str, torch.Tensor]:
    weights_path = root / WEIGHTS_FILE
    if not weights_path.is_file():
        pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        hint = f" (found {', '.join(pickles)}: pickle files are never loaded)" if pickles else ""
        raise CheckpointError(f"{weights_path}: missing{hint}")
    _check_header(weights_path, config, dtype)
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{weights_path}: not a valid safetensors file ({e})") from None
    _check_values(weights_path, tensors)
    return tensors


def _load_tokenizer(root: Path, manifest: dict[str, Any], config: GPTConfig) -> Tokenizer:
    tok_path = root / TOKENIZER_FILE
    if not tok_path.is_file():
        raise CheckpointError(f"{tok_path}: missing")
    if tok_path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise CheckpointError(
            f"{tok_path}: {tok_path.stat().st_size} bytes, more than the limit of {MAX_TOKENIZER_BYTES}"
        )
    try:
        tokenizer = load_tokenizer(tok_path)
    except Exception as e:  # tokenizers raises bare Exception; json a RecursionError
        raise CheckpointError(f"{tok_path}: cannot load tokenizer ({e})") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{tok_path}: tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {config.vocab_size}"
        )
    _check_vocab_text(tok_path, tokenizer)
    # config.json describes the tokenizer too: a disagreement means the files do not belong together.
    described = manifest["tokenizer"]
    actual = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
    for key, value in actual.items():
        if key in described and (described[key] != value or type(described[key]) is not type(value)):
            raise CheckpointError(
                f"{root / CONFIG_FILE}: tokenizer.{key} is {described[key]!r} but {TOKENIZER_FILE} "
                f"has {value!r}"
            )
    return tokenizer


def _check_vocab_text(tok_path: Path, tokenizer: Tokenizer) -> None:
    """Every entry of a char or word vocabulary must encode as UTF-8: JSON admits a lone surrogate
    ("\\ud800"), which would fail every response that draws its token. (A BPE vocabulary's JSON is
    parsed by `tokenizers`, which refuses one.)"""
    for i, piece in enumerate(getattr(tokenizer, "vocab", None) or ()):
        try:
            piece.encode("utf-8")
        except UnicodeEncodeError as e:
            raise CheckpointError(
                f"{tok_path}: vocabulary entry {i} ({piece!r}) is not valid Unicode text ({e.reason})"
            ) from None


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and validate a checkpoint directory. Raises CheckpointError naming the problem.

    Everything is checked before the weights are read: the manifest's fields and types, the
    model config and its bounds, the chat template, the tokenizer against both, and every
    tensor's name, shape and dtype as the weights file's header declares them.
    """
    root = Path(path)
    manifest = _read_manifest(root)
    config_path = root / CONFIG_FILE
    config = _model_config(manifest, config_path)
    chat_template = _chat_template(manifest, config_path)
    tokenizer = _load_tokenizer(root, manifest, config)
    end_token_ids = _end_token_ids(manifest, config_path, tokenizer)
    tensors = _load_weights(root, config, manifest["dtype"])
    return Checkpoint(
        config=config,
        tokenizer=tokenizer,
        state_dict=tensors,
        name=manifest["name"],
        chat_template=chat_template,
        provenance=manifest.get("provenance") or {},  # absent or null: none
        dtype=manifest["dtype"],
        end_token_ids=end_token_ids,
    )
