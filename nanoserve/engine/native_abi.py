"""The ctypes mirror of native/nanoserve_native.h, the native step's C interface, and its loader.

The header is the one source of the interface: these structs copy its field order, and `load`
checks them against the layouts the library reports (`ns_layout`), refuses a library of another
ABI version, and reads the header's constants from the library (`ns_constant`) rather than
copying them. A mismatch is a `LibraryMismatch` naming what differs: the engine then runs torch's
forward and logs why, as it does when the library is not built.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from nanoserve.engine.config import NATIVE_ISAS

NS_ABI_VERSION = 5  # the header's version this mirror was written against

_p, _i32, _f32, _f64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float, ctypes.c_double

# GPTConfig's family choices (norm, mlp, positions) by the header constant each is: NS_<NAME>.
FAMILY_CHOICES = ("layernorm", "rmsnorm", "gelu", "swiglu", "learned", "rope")


class Config(ctypes.Structure):
    _fields_ = [("n_layer", _i32), ("n_head", _i32), ("n_embd", _i32), ("vocab", _i32), ("slots", _i32),
                ("window", _i32), ("max_rows", _i32), ("max_threads", _i32), ("eps", _f32),
                ("weight_type", _i32), ("kv_type", _i32), ("n_kv_head", _i32), ("mlp_hidden", _i32),
                ("norm", _i32), ("mlp", _i32), ("positions", _i32), ("rope_theta", _f64)]


class Norm(ctypes.Structure):
    _fields_ = [("w", _p), ("b", _p)]


class Linear(ctypes.Structure):
    _fields_ = [("w", _p), ("b", _p), ("scale", _p)]


class Layer(ctypes.Structure):
    _fields_ = [("ln1", Norm), ("attn", Linear), ("proj", Linear), ("ln2", Norm), ("fc", Linear),
                ("mproj", Linear), ("k", _p), ("v", _p)]


class Weights(ctypes.Structure):
    _fields_ = [("wte", _p), ("wpe", _p), ("layers", ctypes.POINTER(Layer)), ("lnf", Norm), ("head", Linear)]


class OpenMP(ctypes.Structure):
    _fields_ = [("parallel", _p), ("thread_num", _p), ("num_threads", _p)]


class StepArgs(ctypes.Structure):
    _fields_ = [("tok", _p), ("pos", _p), ("slot", _p), ("out", _p), ("logits", _p), ("rows", _i32),
                ("n_out", _i32), ("threads", _i32), ("screen", _p)]


class Penalties(ctypes.Structure):
    _fields_ = [("seen", _p), ("counts", _p), ("slot", _p), ("repetition", _p), ("frequency", _p),
                ("presence", _p)]


class SampleArgs(ctypes.Structure):
    _fields_ = [("logits", _p), ("temperature", _p), ("top_k", _p), ("top_p", _p), ("min_p", _p),
                ("typical_p", _p), ("uniform", _p), ("out", _p), ("penalties", ctypes.POINTER(Penalties)),
                ("rows", _i32), ("vocab", _i32), ("threads", _i32)]


# Each mirror and its C name.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "ns_config": Config, "ns_norm": Norm, "ns_linear": Linear, "ns_layer": Layer, "ns_weights": Weights,
    "ns_openmp": OpenMP, "ns_step_args": StepArgs, "ns_penalties": Penalties, "ns_sample_args": SampleArgs,
}

# The functions and their signatures (ns_model * is a void pointer here).
_FUNCTIONS = {
    "ns_create": (_p, [ctypes.POINTER(Config), ctypes.POINTER(Weights), ctypes.POINTER(OpenMP)]),
    "ns_free": (None, [_p]),
    "ns_set_isa": (_i32, [_p, _i32]),
    "ns_tiles_possible": (_i32, [_p]),
    "ns_tile_linear": (_i32, [_p, _i32]),
    "ns_tiles_only": (_i32, [_p]),
    "ns_screen_head": (_i32, [_p, _p, _i32]),
    "ns_step": (None, [_p, ctypes.POINTER(StepArgs)]),
    "ns_sample": (_i32, [_p, ctypes.POINTER(SampleArgs)]),
}

class LibraryMismatch(RuntimeError):
    """The library on disk is not the one this code was written against."""


@dataclass(frozen=True)
class Library:
    """A loaded, checked library and the header's constants as it reports them."""

    lib: ctypes.CDLL
    panel: int  # NS_PANEL
    f32: int  # NS_F32
    bf16: int  # NS_BF16
    i8_group: int  # NS_I8_GROUP: inputs per group of an int8 panel
    isa_levels: dict[str, int]  # NS_ISA_<NAME> of each of NATIVE_ISAS ("avx2": NS_ISA_AVX2)
    family: dict[str, int]  # NS_<NAME> of each of FAMILY_CHOICES ("rmsnorm": NS_RMSNORM)


def layout_mismatches(lib: ctypes.CDLL) -> list[str]:
    """Where a mirror's size or a field's offset differs from what the library reports."""
    layout = lib.ns_layout
    wrong = []
    for name, struct in STRUCTS.items():
        if (size := layout(name.encode(), None)) != ctypes.sizeof(struct):
            wrong.append(f"sizeof({name}) is {size} in the library, {ctypes.sizeof(struct)} here")
        for field, *_ in struct._fields_:
            mine = getattr(struct, field).offset
            if (offset := layout(name.encode(), field.encode())) != mine:
                wrong.append(f"{name}.{field} is at {offset} in the library, at {mine} here")
    return wrong


def load(path: Path) -> Library:
    """The library at `path`, checked: its ABI version, then its structs' layouts. Raises
    LibraryMismatch naming the difference (rebuild the library: `pip install -e .`)."""
    lib = ctypes.CDLL(str(path))
    if not hasattr(lib, "ns_abi_version"):
        raise LibraryMismatch(f"{path.name} exports no ns_abi_version (built before it had one): rebuild it")
    lib.ns_abi_version.restype = _i32
    lib.ns_abi_version.argtypes = []
    version = lib.ns_abi_version()
    if version != NS_ABI_VERSION:
        raise LibraryMismatch(
            f"{path.name} has ABI version {version}, this nanoserve needs {NS_ABI_VERSION}: rebuild it"
        )
    lib.ns_layout.restype = lib.ns_constant.restype = ctypes.c_int64
    lib.ns_layout.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.ns_constant.argtypes = [ctypes.c_char_p]
    if wrong := layout_mismatches(lib):
        raise LibraryMismatch(f"{path.name} does not match its mirror: {'; '.join(wrong)}")
    for name, (restype, argtypes) in _FUNCTIONS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes

    def constant(name: str) -> int:
        value = int(lib.ns_constant(name.encode()))
        if value < 0:
            raise LibraryMismatch(f"{path.name} does not know the constant {name}")
        return value

    return Library(lib, panel=constant("NS_PANEL"), f32=constant("NS_F32"), bf16=constant("NS_BF16"),
                   i8_group=constant("NS_I8_GROUP"),
                   isa_levels={n: constant(f"NS_ISA_{n.upper()}") for n in NATIVE_ISAS},
                   family={n: constant(f"NS_{n.upper()}") for n in FAMILY_CHOICES})
