"""Engine test fixtures: small random checkpoints whose greedy output actually varies."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import torch

from nanoserve.engine import native_step
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.engine import Engine
from nanoserve.engine.types import SamplingParams, TokenEvent
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from nanoserve.model.config import GPTConfig
from nanoserve.model.gpt import GPT
from nanoserve.model.tokenizer import CharTokenizer
from tests.conftest import IN_CI, TINY_VOCAB_TEXT


def make_lively_checkpoint(path: Path, *, block_size: int = 32, seed: int = 0, scale: float = 6.0) -> Path:
    """A random char model with weights scaled up: GPT-2's small init makes near-uniform logits
    and a model that repeats one character, which would make parity tests blind. Scaled weights
    give sharp, context-dependent predictions with clear argmax margins."""
    tok = CharTokenizer.train(TINY_VOCAB_TEXT)
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=tok.vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return save_checkpoint(path, model, tok, name="lively-test")


@pytest.fixture(scope="session")
def lively(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return load_checkpoint(make_lively_checkpoint(tmp_path_factory.mktemp("lively") / "ckpt"))


EngineFactory = Callable[..., Engine]


# Every engine test runs once per backend (`make_engine` builds engines on `backend`), so the torch
# backend, the one a GPU runs, is tested as fully as the native one; where CUDA is present it runs
# on the GPU too ("torch-cuda"). A test of one backend's own code says so with
# @pytest.mark.backends("native").
BACKENDS = ("native", "torch", *(("torch-cuda",) if torch.cuda.is_available() else ()))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("backends")
        # A test's own list, less what this machine cannot run (torch-cuda without CUDA).
        names = [b for b in marker.args if b in BACKENDS] if marker else list(BACKENDS)
        metafunc.parametrize("backend", names, indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The backend this test's engines use; the native one needs its library (see native_library)."""
    if request.param == "native":
        request.getfixturevalue("native_library")
    return str(request.param)


@pytest.fixture
async def make_engine(lively: Checkpoint, backend: str) -> AsyncIterator[EngineFactory]:
    """Build started engines on the lively checkpoint (or another one), on this test's backend
    unless it names one; shut down afterwards."""
    engines: list[Engine] = []

    def factory(checkpoint: Checkpoint | None = None, observer=None, **overrides) -> Engine:  # type: ignore[no-untyped-def]
        name, _, device = backend.partition("-")
        overrides.setdefault("backend", name)
        overrides.setdefault("device", device or "cpu")
        engine = Engine(checkpoint or lively, EngineConfig(**overrides), observer)
        engine.start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        await engine.shutdown(0.0)


async def collect(engine: Engine, prompt: str | list[int], **params) -> list[TokenEvent]:  # type: ignore[no-untyped-def]
    stream = await engine.generate(prompt, SamplingParams(**params))
    return [event async for event in stream]


def col(values: list[float]) -> torch.Tensor:
    """Per-row sampling parameters as SamplingBatch takes them: (N, 1) float32."""
    return torch.tensor(values, dtype=torch.float32).view(-1, 1)


def token_ids(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


@pytest.fixture(scope="session", autouse=True)
def sanitized_native_library() -> Iterator[None]:
    """`make sanitize` runs the native step's tests on a build of it with AddressSanitizer and
    UBSan, which NANOSERVE_TEST_NATIVE_LIBRARY names: the engine and NativeStep load it in place
    of the installed library."""
    path = os.environ.get("NANOSERVE_TEST_NATIVE_LIBRARY")
    if not path:
        yield
        return
    if not Path(path).is_file():
        pytest.fail(f"NANOSERVE_TEST_NATIVE_LIBRARY={path} is not a file")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_step, "library_path", lambda: Path(path))
        yield


@pytest.fixture(scope="session")
def native_library() -> None:
    """Skip (fail in CI) a test of the native library where it is not built."""
    if native_step.library_path() is None:
        message = "nanoserve/engine/native/decode.c is not built (pip install -e . builds it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
