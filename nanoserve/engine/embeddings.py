"""Embeddings: each input's final hidden states, mean-pooled and L2-normalised, computed on the
engine thread between generation steps.

Pooling is the mean over every token's output of the final norm (what the output layer reads).
Models trained for embeddings from a causal decoder (e5-mistral, SFR) read the last token
instead, because their training taught that token to summarise the text; a model trained only
to predict the next token has no such token: its last position encodes what comes next more
than what came before, while the mean over all positions keeps every token's content (mean
pooling is also sentence-transformers' default). Vectors are normalised so a dot product is the
cosine similarity, as OpenAI's are.

Each input is its own forward of the torch model without a KV cache (no slot is taken from
generation), so an input's vector is the same bits alone or in any batch. A step of the engine
runs jobs' inputs up to a token budget (at least one input), round-robin over the waiting jobs so
a large batch does not hold back a small one, then generation steps again.

The native backend keeps its own packed copy of the weights and frees the torch model's; it
computes logits only. On that backend the torch weights are loaded again, once, by the first
embeddings request (`load_model`): the model's size in memory again from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanoserve.engine.types import NotReady, Overloaded
from nanoserve.model.gpt import GPT

log = logging.getLogger(__name__)

POOLING = "mean"


class EmbeddingFailed(Exception):
    """A job's forward failed on the engine thread (the message says why)."""


class EmbeddingJob:
    """One request's inputs (token ids each); `future` gets their vectors, (N, C) float32 on CPU."""

    def __init__(self, inputs: list[list[int]], client: str | None, loop: asyncio.AbstractEventLoop) -> None:
        self.inputs = inputs
        self.client = client
        self.loop = loop
        self.future: asyncio.Future[torch.Tensor] = loop.create_future()
        self.vectors: list[torch.Tensor] = []
        self.cancelled = False  # set on the loop when the awaiting request goes away
        self.future.add_done_callback(self._on_done)

    def _on_done(self, future: asyncio.Future[torch.Tensor]) -> None:
        self.cancelled = future.cancelled()


class Embeddings:
    """The engine's embedding jobs: `submit` queues (from the event loop), `run` computes (on the
    engine thread), `fail_all` ends them when the engine stops."""

    def __init__(self, model: GPT, cpu_threads: int, wake: Callable[[], None]) -> None:
        # The served model, unless its weights were released to the native step (meta tensors).
        self.model: GPT | None = None if model.wte.weight.device.type == "meta" else model
        self.config = model.config
        self.width = model.config.n_embd
        self.max_tokens = model.config.block_size  # per input: its positions
        self.cpu_threads = cpu_threads
        self._wake = wake
        self._jobs: deque[EmbeddingJob] = deque()
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._closed: str | None = None
        self.unfinished = 0  # submitted jobs not settled yet (shutdown waits for them)
        self._by_client: dict[str | None, int] = {}  # unfinished jobs by client

    # ---- the event loop's side -----------------------------------------------------------
    @property
    def needs_model(self) -> bool:
        return self.model is None

    def load_model(self, load: Callable[[], GPT]) -> None:
        """Give the engine torch weights to embed with (native backend), once; blocking: call
        off the event loop. `load` returns the served model's weights, checked here."""
        with self._load_lock:
            if self.model is not None:
                return
            model = load()
            if model.config != self.config:
                raise ValueError("the checkpoint loaded for embeddings is not the served model")
            self.model = model.eval()
            log.info("embeddings: torch weights loaded (%d parameters)", model.num_params(False))

    def submit(self, job: EmbeddingJob, max_waiting: int, client_share: int) -> None:
        """Queue `job`; Overloaded when `max_waiting` jobs wait, or `client_share` of its client."""
        with self._lock:
            if self._closed is not None:
                raise NotReady(self._closed)
            # Counted until settled: the job being computed is out of the deque meanwhile.
            if self.unfinished >= max_waiting:
                raise Overloaded(f"{self.unfinished} embedding requests are already waiting "
                                 f"(max_queue {max_waiting}); retry later")
            mine = self._by_client.get(job.client, 0)
            if job.client is not None and mine >= client_share:
                raise Overloaded(f"this client already has {mine} embedding requests waiting "
                                 f"(max_waiting_per_client {client_share}); retry later")
            self._jobs.append(job)
            self.unfinished += 1
            self._by_client[job.client] = mine + 1
        self._wake()

    def __len__(self) -> int:
        return len(self._jobs)

    # ---- the engine thread's side --------------------------------------------------------
    def run(self, budget: int) -> None:
        """Embed waiting inputs, about `budget` tokens (at least one input), a job's next input
        at a time in turn; a finished job's vectors go back to its loop."""
        spent = 0
        while spent < budget:
            with self._lock:
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            if job.cancelled:
                self._settle(job, EmbeddingFailed("cancelled"))  # nobody reads it
                continue
            ids = job.inputs[len(job.vectors)]
            try:
                job.vectors.append(self._embed(ids))
            except Exception as e:  # this job fails; the engine goes on
                log.warning("embedding forward failed: %s", e)
                self._settle(job, EmbeddingFailed(f"embedding failed: {type(e).__name__}: {e}"))
                continue
            spent += len(ids)
            if len(job.vectors) == len(job.inputs):
                self._settle(job, torch.stack(job.vectors))
            else:
                with self._lock:
                    self._jobs.append(job)  # its next input after the others' turns

    def _embed(self, ids: list[int]) -> torch.Tensor:
        model = self.model
        if model is None:
            raise RuntimeError("no torch weights loaded for embeddings")
        device = model.wte.weight.device
        if device.type == "cpu" and torch.get_num_threads() != self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)  # one fixed count: the same bits every time
        with torch.inference_mode():
            idx = torch.tensor([ids], dtype=torch.long, device=device)
            hidden = model.hidden_states(idx)[0].float()  # (T, C)
            return F.normalize(hidden.mean(dim=0), dim=0).cpu()  # (C,)

    def fail_all(self, message: str) -> None:
        """End every waiting job with `message`, and refuse new ones (the engine stopped)."""
        with self._lock:
            self._closed = message
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            self._settle(job, NotReady(message))

    def _settle(self, job: EmbeddingJob, outcome: torch.Tensor | Exception) -> None:
        with self._lock:
            self.unfinished -= 1
            left = self._by_client.pop(job.client) - 1
            if left:
                self._by_client[job.client] = left
        with contextlib.suppress(RuntimeError):  # its event loop is gone: nobody waits for it
            job.loop.call_soon_threadsafe(_resolve, job.future, outcome)


def _resolve(future: asyncio.Future[torch.Tensor], outcome: torch.Tensor | Exception) -> None:
    if future.done():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
