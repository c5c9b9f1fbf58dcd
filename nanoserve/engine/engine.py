"""The engine: one model, one thread that runs it, and the async API the HTTP layer calls.

The model runs only on the engine thread (never on the event loop). Requests enter through
`generate`, which validates and queues them (raising before it returns, so HTTP can reject with
a status code); each step's token events go back to the requests' event loops in one callback.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from nanoserve.engine import admission, introspection
from nanoserve.engine.backends import factory
from nanoserve.engine.backends.factory import native_unavailable
from nanoserve.engine.config import EngineConfig
from nanoserve.engine.core import EngineCore
from nanoserve.engine.cpu_quota import cpu_budget
from nanoserve.engine.dtype_probe import SLOW_FACTOR, cpu_matmul_slowdown
from nanoserve.engine.embeddings import Embeddings
from nanoserve.engine.grammar import Constraint, Grammars
from nanoserve.engine.grammar_pool import GrammarPool
from nanoserve.engine.ids import new_id, new_seed
from nanoserve.engine.inbox import Inbox
from nanoserve.engine.memory_plan import check_memory, fit_slots
from nanoserve.engine.prompt_scores import ScoringCost
from nanoserve.engine.request import Request
from nanoserve.engine.runner import ModelRunner
from nanoserve.engine.scheduler import Scheduler, StepResult
from nanoserve.engine.stream import GenerationStream
from nanoserve.engine.types import (
    Draining,
    EngineError,
    EngineObserver,
    EngineStats,
    FinishReason,
    InvalidRequest,
    NotReady,
    NullObserver,
    SamplingParams,
    TokenEvent,
)
from nanoserve.engine.validation import MAX_SEED, crop_prompt, effective_params, validate_ids, validate_params
from nanoserve.engine.waiting_queue import WaitingQueue
from nanoserve.model.checkpoint import Checkpoint, load_checkpoint
from nanoserve.model.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    def __init__(
        self, checkpoint: Checkpoint, config: EngineConfig, observer: EngineObserver | None = None
    ) -> None:
        # Everything but the weights: those live in the model (and the native step's panels), and
        # holding the state dict would keep the copies the runner releases alive (runner.py).
        self.checkpoint = replace(checkpoint, state_dict={})
        # On a GPU with gpu_memory_utilization: as many KV slots as that share of its memory holds.
        config = fit_slots(checkpoint, config)
        self.config = config
        self.observer: EngineObserver = observer or NullObserver()
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.window = config.window_for(checkpoint.config.block_size)
        # Before any of the engine's buffers: what does not fit is one line naming its size's fields.
        check_memory(checkpoint, config)
        self.device = config.resolved_device()
        native = config.backend != "torch" and native_unavailable(config) is None
        self.dtype_slowdown = 1.0  # this dtype's matmul time over float32's, on a CPU
        if self.device == "cpu" and config.torch_dtype != torch.float32:
            self.dtype_slowdown = cpu_matmul_slowdown(config.torch_dtype)
            # The native step computes in float32 whatever the weights' dtype: only torch's
            # kernels pay for a dtype this CPU emulates.
            if self.dtype_slowdown > SLOW_FACTOR and not native:
                log.warning(
                    "engine: %s matmuls run %.0fx slower than float32 on this CPU (no native %s "
                    "support, torch CPU capability %s) and the native backend is off: serve with "
                    "dtype float32", config.dtype, self.dtype_slowdown, config.dtype,
                    torch.backends.cpu.get_cpu_capability(),
                )
        self.model = checkpoint.build_model(self.device, config.torch_dtype)
        self.num_params = self.model.num_params(non_embedding=False)
        self.cpu_budget = cpu_budget(config.cpu_threads)  # the flag, else what the host leaves us
        cpu_threads = self.cpu_budget.threads
        if self.device == "cpu":
            log.info("engine: %s", self.cpu_budget.describe())
        self.backend, self.backend_reason = factory.choose_backend(
            self.model, config, self.window, cpu_threads, usable_vocab=self.tokenizer.vocab_size
        )
        log.info("engine: backend %s, kernels %s (%s)", self.backend.name, self.backend.kernels(),
                 self.backend_reason)
        self.grammars = Grammars(self.tokenizer)
        self.grammar_pool = GrammarPool()
        self.runner = ModelRunner(
            self.backend, checkpoint.config.vocab_size, usable_vocab=self.tokenizer.vocab_size,
            deterministic=config.deterministic, cpu_threads=cpu_threads,
        )
        scoring = ScoringCost.of(self.model.h, checkpoint.config.n_embd, checkpoint.config.vocab_size)
        self.scheduler = Scheduler(self.tokenizer, config, self.window,
                                   batch_invariant=self.backend.batch_invariant, scoring=scoring)
        self.core = EngineCore(self.scheduler, self.runner)
        self._waiting = WaitingQueue()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._draining = False
        self._drain_begun = asyncio.Event()  # set with _draining, for the event loop's waits
        self._warm = False
        self._crashed: str | None = None
        self._unfinished = 0  # accepted requests whose final event is not out yet
        self._step_s = 0.05  # recent engine step time (moving average), for expected_wait_s
        self.embeddings = Embeddings(self.model, cpu_threads, self._wake)  # run between steps
        log.info(
            "engine: %s on %s/%s, %d slots x %d tokens, KV cache %.1f MiB",
            checkpoint.name, self.device, config.dtype, config.max_seqs, self.window,
            self.runner.cache.nbytes / 2**20,
        )

    @classmethod
    def from_path(
        cls, path: str | Path, config: EngineConfig, observer: EngineObserver | None = None
    ) -> Engine:
        return cls(load_checkpoint(path), config, observer)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)
        self._thread.start()

    async def warmup(self) -> None:
        """Run a greedy and a sampled generation so the first real request is not the slow one."""
        for params in (
            SamplingParams(max_new_tokens=4, temperature=0.0),
            SamplingParams(max_new_tokens=4, temperature=1.0, top_k=5, top_p=0.9, seed=0, logprobs=True),
        ):
            stream = await self.generate([0] * min(8, self.window), params, request_id="warmup")
            async for event in stream:
                if event.finish_reason is FinishReason.ERROR:
                    raise RuntimeError(f"warm-up generation failed: {event.error}")
        self._warm = True

    @property
    def ready(self) -> bool:
        return self._warm and not self._draining and self.health()

    def health(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._crashed is None

    async def shutdown(self, drain_timeout: float) -> int:
        """Stop admitting; let accepted requests finish for up to `drain_timeout` seconds; then
        end the rest with an error event and stop the thread. Returns how many it ended so."""
        self._draining = True
        self._drain_begun.set()
        end = time.monotonic() + max(0.0, drain_timeout)
        while ((self._unfinished > 0 or self.embeddings.unfinished) and time.monotonic() < end
               and self.health()):
            await asyncio.sleep(0.01)
        cut = self._unfinished + self.embeddings.unfinished
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        return cut

    # ---- requests ----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except TokenizerError as e:
            raise InvalidRequest(str(e), param="inputs") from None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        stream_interval: int = 1,
        client: str | None = None,
    ) -> GenerationStream:
        """Validate and queue; raises Overloaded / NotReady / InvalidRequest / PromptTooLong.

        `stream_interval` N > 1: the stream's reader is woken once per N tokens (the first token
        and the last event at once), so a server writes a client's tokens N at a time.
        `client` identifies the caller for fair admission and its share of the queue
        (EngineConfig.max_waiting_per_client); None takes part in neither.
        """
        return (await self.generate_choices(prompt, params, 1, request_id, stream_interval, client))[0]

    async def generate_choices(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        n: int,
        request_id: str | None = None,
        stream_interval: int = 1,
        client: str | None = None,
    ) -> list[GenerationStream]:
        """`n` generations of one prompt (OpenAI's `n`, `best_of`), one stream each: choice i
        samples with seed + i, so it draws what a request with that seed draws alone. The prompt
        is prefilled once and its cache copied to the other choices' slots. The group is
        admitted when `n` slots are free and counts as one entry of the waiting queue."""
        try:
            if not 1 <= n <= self.config.max_seqs:
                raise InvalidRequest(f"n is {n}: this server runs 1 to {self.config.max_seqs} "
                                     "choices of one prompt (max_seqs)", param="n")
            constraints: list[Constraint | None] = [None] * n
            if params.grammar is not None:  # compiled now, off the event loop: a bad grammar is refused
                constraints = list(await self._compile(params, n, client))
            return self._submit(prompt, params, request_id or new_id(), stream_interval, client, n,
                                constraints)
        except EngineError as e:
            self._safe(self.observer.on_rejected, e.code)
            raise

    async def _compile(self, params: SamplingParams, n: int, client: str | None) -> list[Constraint]:
        """The request's grammar, compiled once on the grammar pool (its work counts in the client's
        share of the queue); one matcher a choice, copied: each advances with its own tokens."""
        grammar, where = params.grammar, params.grammar_param
        assert grammar is not None
        room = self.config.client_queue_share() - self._waiting.by_client.get(client, 0)
        first = await self._unless_drained(self.grammar_pool.run(
            lambda: self.grammars.constraint(grammar, where), client,
            client_room=room, total_room=self.config.max_queue - len(self._waiting)))
        return [first, *(first.copy() for _ in range(n - 1))]

    async def _unless_drained(self, work: Awaitable[T]) -> T:
        """`work`'s result, or Draining as soon as a drain begins: a request still compiling its
        grammar is not yet accepted, and the drain does not wait for it."""
        task, drained = asyncio.ensure_future(work), asyncio.ensure_future(self._drain_begun.wait())
        try:
            await asyncio.wait((task, drained), return_when=asyncio.FIRST_COMPLETED)
        finally:
            drained.cancel()
            if not task.done():  # a drain, or the caller went away: work not begun never runs,
                task.cancel()  # work running finishes alone and its result is dropped
        if not task.done():
            raise Draining("the server is shutting down")
        return task.result()

    def check_admission(self, client: str | None = None) -> None:
        """Raise what `generate` would for the engine's state alone (not running, shutting down,
        queue full), so a server can refuse a request before paying for its prompt's encoding."""
        try:
            self._check_admission(client)
        except EngineError as e:
            self._safe(self.observer.on_rejected, e.code)
            raise

    def _check_admission(self, client: str | None) -> None:
        if self._thread is None or self._stop or not self.health():
            raise NotReady("the engine is not running")
        if self._draining:
            raise Draining("the engine is shutting down")
        admission.check_queue_room(self._waiting, self.scheduler.free_slots, self.config, client,
                                   self.expected_wait_s)

    def expected_wait_s(self) -> float:
        """Seconds until a running request is expected to end and free a slot: the fewest tokens
        any of them has left, at the recent step time (an upper bound: a stop string or the
        end-of-text token may end one sooner). Read from the event loop: a snapshot, not exact."""
        return admission.expected_wait_s(self.scheduler.running, self._step_s)

    def _submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, stream_interval: int,
        client: str | None, n: int, constraints: list[Constraint | None],
    ) -> list[GenerationStream]:
        vocab = self.tokenizer.vocab_size
        validate_params(params, vocab)
        params = effective_params(params, vocab)
        if isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            ids = list(prompt)
            validate_ids(ids, vocab)
        if not ids:
            if self.tokenizer.eos_id is None:
                raise InvalidRequest("the prompt is empty: give at least one token", param="inputs")
            ids = [self.tokenizer.eos_id]  # GPT-2 convention: unconditional text follows <|endoftext|>
        kept, cropped = crop_prompt(ids, self.window, params.truncate, self.config.reject_long_prompts)
        loop = asyncio.get_running_loop()
        seed = params.seed if params.seed is not None else new_seed()
        reqs = [
            Request(
                request_id=request_id if n == 1 else f"{request_id}-{i}",
                prompt_ids=kept,
                params=params,
                seed=(seed + i) % (MAX_SEED + 1),  # wraps to stay a valid seed
                cropped=cropped,
                tokenizer=self.tokenizer,
                loop=loop,
                queue=Inbox(loop, stream_interval, _ends_stream),
                client=client,
                constraint=constraints[i],
            )
            for i in range(n)
        ]
        leader = reqs[0]
        leader.followers = reqs[1:]
        for follower in leader.followers:
            follower.leader = leader
        with self._cond:
            self._check_admission(client)  # under the lock: others may have queued since any earlier check
            self._waiting.append(leader)
            self._unfinished += n
            self._cond.notify()
        return [GenerationStream(req, self._cancel) for req in reqs]

    def _cancel(self, req: Request) -> None:
        req.cancelled = True
        self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> EngineStats:
        return introspection.engine_stats(self.scheduler, len(self._waiting), self.config, self.runner)

    def info(self) -> dict[str, Any]:
        return introspection.engine_info(
            self.checkpoint, self.config, self.tokenizer, self.runner, self.scheduler,
            num_params=self.num_params, window=self.window, device=self.device,
            dtype_slowdown=self.dtype_slowdown, backend=self.backend, backend_reason=self.backend_reason,
            cpu_budget=self.cpu_budget,
        )

    # ---- the engine thread -------------------------------------------------------------
    def _run(self) -> None:
        if self.device == "cpu":
            # This thread's own OpenMP team; the rest of the process stays at one (threads.py).
            torch.set_num_threads(self.runner.cpu_threads)
        try:
            # One inference mode for the thread's life: the runner's entry points then skip
            # entering it per call (runner._inference).
            with torch.inference_mode():
                while self._loop_once():
                    pass
        except BaseException as e:  # a bug in the loop itself: report unhealthy, fail everyone
            self._crashed = f"{type(e).__name__}: {e}"
            log.exception("engine thread crashed")
        self._fail_remaining(self._crashed or "the engine shut down before the request finished")

    def _loop_once(self) -> bool:
        with self._cond:
            while not self._stop and not self.scheduler.running and not len(self._waiting) \
                    and not len(self.embeddings):
                self._cond.wait()
            if self._stop:
                return False
            now = time.perf_counter()
            early = self._waiting.reap(now)
            admission.admit(self._waiting, self.scheduler, now, self.config.max_group_wait_s)
        t0 = time.perf_counter()
        try:
            result = self.core.step()
        except Exception as e:  # fail this step's requests, keep serving
            log.exception("engine step failed")
            result = StepResult()
            self.scheduler.fail_all(f"engine step failed: {type(e).__name__}: {e}", result)
        duration = time.perf_counter() - t0
        if result.batch_size:
            self._step_s = 0.9 * self._step_s + 0.1 * duration  # for expected_wait_s
        result.events[:0] = early
        # Observer first: metrics already count a request when its client sees it end.
        if result.batch_size:
            self._safe(self.observer.on_step, duration, result.batch_size, result.prefill_tokens)
        for _, event in result.events:
            if event.finish_reason is not None and event.usage is not None:
                self._safe(self.observer.on_finish, event.finish_reason, event.usage)
        self._publish(result.events)
        busy = bool(self.scheduler.running)  # embeddings get a prefill's share of the time
        self.embeddings.run(self.config.prefill_budget if busy else self.config.idle_prefill_budget)
        return True

    def _fail_remaining(self, message: str) -> None:
        self.embeddings.fail_all(message)
        result = StepResult()
        self.scheduler.fail_all(message, result)
        with self._cond:
            now = time.perf_counter()
            while len(self._waiting):
                for req in self._waiting.pop_fair([]).group:
                    result.events.append((req, req.final_event(FinishReason.ERROR, now, error=message)))
        self._publish(result.events)

    def _publish(self, events: list[tuple[Request, TokenEvent]]) -> None:
        """Hand events to their event loops: one thread-safe callback per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, TokenEvent]]] = {}
        for req, event in events:
            by_loop.setdefault(req.loop, []).append((req, event))
            if event.finish_reason is not None:
                with self._cond:
                    self._unfinished -= 1
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # the caller's event loop is gone: nobody will read these
                for req, _ in pairs:
                    req.cancelled = True

    @staticmethod
    def _safe(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # an observer bug must not stop generation
            log.exception("engine observer hook %s failed", getattr(fn, "__name__", fn))


def _ends_stream(event: TokenEvent) -> bool:
    return event.finish_reason is not None


def _put_all(pairs: list[tuple[Request, TokenEvent]]) -> None:
    for req, event in pairs:
        req.queue.put(event)
