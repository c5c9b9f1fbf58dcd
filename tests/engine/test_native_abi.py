"""The native step's C interface: native/nanoserve_native.h, its ctypes mirror (native_abi.py) and
the checks the loader makes (ABI version, struct layouts, constants read from the library)."""

from __future__ import annotations

import ctypes
import logging
import re
from pathlib import Path

import pytest
import torch

from nanoserve.engine import native_abi
from nanoserve.engine.config import NATIVE_ISAS
from nanoserve.engine.kv_slots import SpanKVCache
from nanoserve.engine.native_abi import STRUCTS, LibraryMismatch, load
from nanoserve.engine.native_step import NativeStep, library_path, unavailable_reason
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from tests.engine.conftest import EngineFactory, collect, token_ids

pytestmark = pytest.mark.usefixtures("native_library")

HEADER = Path(native_abi.__file__).parent / "native" / "nanoserve_native.h"


def _library() -> ctypes.CDLL:
    path = library_path()
    assert path is not None
    return load(path).lib


def _tiny_step() -> tuple[GPT, SpanKVCache]:
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=32)).eval()
    cache = SpanKVCache(1, 2, 2, 16, 16, torch.float32, "cpu")
    return model, cache


def test_every_mirror_has_the_size_and_field_offsets_the_library_reports() -> None:
    lib = _library()
    for name, struct in STRUCTS.items():
        assert lib.ns_layout(name.encode(), None) == ctypes.sizeof(struct), name
        for field, *_ in struct._fields_:
            offset = getattr(struct, field).offset
            assert lib.ns_layout(name.encode(), field.encode()) == offset, (name, field)
    assert lib.ns_layout(b"ns_step_args", b"no_such_field") == -1
    assert lib.ns_layout(b"no_such_struct", None) == -1


def test_every_struct_of_the_header_is_mirrored() -> None:
    declared = set(re.findall(r"}\s*(ns_\w+);", HEADER.read_text()))
    assert declared == set(STRUCTS)


def test_the_library_reports_every_constant_of_the_header() -> None:
    """What the loader reads instead of copying: each #define and enum value of the header."""
    text = HEADER.read_text()
    constants = {n: int(v) for n, v in re.findall(r"#define (NS_\w+) (\d+)", text)}
    constants |= {n: int(v) for n, v in re.findall(r"\b(NS_\w+) = (\d+)", text)}
    assert {"NS_ABI_VERSION", "NS_PANEL", "NS_BF16", "NS_ISA_AMX"} <= set(constants)
    lib = _library()
    for name, value in constants.items():
        assert lib.ns_constant(name.encode()) == value, name
    assert lib.ns_constant(b"NS_NO_SUCH_CONSTANT") == -1
    native = load(library_path())  # type: ignore[arg-type]
    assert native.panel == constants["NS_PANEL"]
    assert native.isa_levels == {n: constants[f"NS_ISA_{n.upper()}"] for n in NATIVE_ISAS}


def test_a_library_of_another_abi_version_is_refused_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = native_abi.NS_ABI_VERSION
    monkeypatch.setattr(native_abi, "NS_ABI_VERSION", built + 1)
    want = f"has ABI version {built}, this nanoserve needs {built + 1}: rebuild it"
    with pytest.raises(LibraryMismatch, match=want):
        NativeStep(*_tiny_step(), max_threads=1)
    reason = unavailable_reason(torch.device("cpu"), torch.float32)
    assert reason is not None and want in reason


def test_a_mirror_that_differs_from_the_library_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Shorter(ctypes.Structure):  # ns_step_args without its last field
        _fields_ = native_abi.StepArgs._fields_[:-1]

    monkeypatch.setitem(STRUCTS, "ns_step_args", Shorter)
    with pytest.raises(LibraryMismatch, match=r"sizeof\(ns_step_args\) is \d+ in the library"):
        load(library_path())  # type: ignore[arg-type]


@pytest.mark.backends("native")
async def test_the_engine_falls_back_to_torch_and_logs_why_on_a_mismatch(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native_abi, "NS_ABI_VERSION", native_abi.NS_ABI_VERSION + 1)
    with caplog.at_level(logging.INFO, logger="nanoserve.engine.engine"):
        engine = make_engine(max_seqs=2, backend="auto")
    backend = engine.info()["backend"]
    assert backend["name"] == "torch" and "ABI version" in backend["reason"]
    assert any("backend torch" in r.message and "ABI version" in r.message for r in caplog.records)
    assert len(token_ids(await collect(engine, "hello", max_new_tokens=4, temperature=0.0))) == 4
    with pytest.raises(ValueError, match=r"backend native cannot run here: .*ABI version"):
        make_engine(max_seqs=2, backend="native")
