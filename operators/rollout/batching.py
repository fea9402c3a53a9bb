"""Fronts that serve the agent loop one turn at a time from a rollout engine.

The loop asks a *generator* for one turn of one conversation
(``await generator.generate(context_ids, max_new_tokens, seed)``) and tells
it how many conversations are ``live``. :class:`BatchingFront` serves it from
any engine's batch ``generate`` (the transformers engine on CPU): requests
waiting for a turn are gathered into one batched call, so a batch of
conversations costs one forward loop per round of turns, not one per
conversation, and a round holds every live conversation (rounds form by count,
not by timing: runs repeat exactly). Engines that batch by themselves (``serves_requests = True``,
sglang) are called per request through their ``generate_one`` (sglang's
``async_generate``) by :class:`RequestGenerator`. :func:`make_generator` picks.
"""

from __future__ import annotations

import asyncio

import torch

from operators.data.dataset import left_pad
from operators.rollout.base import RolloutEngine, SamplingParams
from operators.rollout.conversation import LENGTH, STOP, Generation


def finish_turn(ids: list[int], log_probs: list[float], budget: int, stop_ids: set[int]) -> Generation:
    """Cut a sampled turn at its first stop token or at ``budget``, and say which ended it.

    Example::

        >>> finish_turn([5, 2, 7], [-.1, -.2, -.3], 8, {2})
        Generation(ids=[5, 2], log_probs=[-0.1, -0.2], finish_reason='stop')
    """
    for i, token in enumerate(ids[:budget]):
        if token in stop_ids:
            return Generation(ids[:i + 1], log_probs[:i + 1], STOP)
    return Generation(ids[:budget], log_probs[:budget], LENGTH)


class BatchingFront:
    """Serves single turns from an engine's batch ``generate``: waiting requests share one call.

    A round is launched once every live conversation is waiting for a turn, so
    which requests share a round (and with it the padding, and the rounding of
    every row) depends on the conversations alone, never on how fast a tool
    answered: two runs with the same seeds sample the same tokens. A slow tool
    holds the round up to its timeout; ``max_wait_s`` (off by default) launches
    a round that long after its first request instead, trading that
    reproducibility for latency. Rows of a round are ordered by their seeds.
    The batched call runs in a thread, so tools keep running meanwhile. Rows are
    left-padded prompts of different lengths; each row is cut to its own token
    budget afterwards.
    """

    def __init__(self, engine: RolloutEngine, params: SamplingParams, stop_token_ids: set[int],
                 pad_token_id: int, max_wait_s: float | None = None):
        self.engine, self.params = engine, params
        self.stop_ids, self.pad_token_id = set(stop_token_ids), pad_token_id
        self.max_wait_s = max_wait_s
        self._live = 0
        self.rounds = 0
        self._queue: list[tuple[list[int], int, int | None, asyncio.Future]] = []
        self._arrived: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None

    @property
    def live(self) -> int:
        """Conversations that have not ended: the agent loop counts them, a round waits for all of them."""
        return self._live

    @live.setter
    def live(self, count: int) -> None:
        self._live = count
        if self._arrived is not None:   # one fewer to wait for: the round may be complete now
            self._arrived.set()

    async def generate(self, context_ids: list[int], max_new_tokens: int, seed: int | None = None) -> Generation:
        loop = asyncio.get_running_loop()
        if self._arrived is None:
            self._arrived = asyncio.Event()
        future: asyncio.Future = loop.create_future()
        self._queue.append((list(context_ids), max_new_tokens, seed, future))
        self._arrived.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run())
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            deadline = None if self.max_wait_s is None else loop.time() + self.max_wait_s
            while len(self._queue) < self.live:
                self._arrived.clear()
                try:
                    timeout = None if deadline is None else max(deadline - loop.time(), 0.0)
                    await asyncio.wait_for(self._arrived.wait(), timeout)
                except asyncio.TimeoutError:
                    break
            batch, self._queue = self._queue, []
            if None not in (seed for _, _, seed, _ in batch):   # arrival order is timing: seeds are not
                batch.sort(key=lambda request: request[2])
            try:
                results = await asyncio.to_thread(self._generate, [request[:3] for request in batch])
            except Exception as err:  # the engine failed: every waiting request learns why
                for *_, future in batch:
                    future.set_exception(err)
                continue
            for (*_, future), result in zip(batch, results):
                future.set_result(result)

    def _generate(self, batch: list[tuple[list[int], int, int | None]]) -> list[Generation]:
        self.rounds += 1
        input_ids, attention_mask = left_pad([ids for ids, _, _ in batch], self.pad_token_id)
        params = self.params.model_copy(update={"n": 1, "max_new_tokens": max(n for _, n, _ in batch)})
        seeds = [seed for _, _, seed in batch]
        keyed = {} if None in seeds else {"seeds": torch.tensor(seeds, dtype=torch.int64)}
        out = self.engine.generate(input_ids, attention_mask, params, **keyed)
        results = []
        for row, (_, budget, _) in enumerate(batch):
            length = int(out["response_mask"][row].sum())
            results.append(finish_turn(out["responses"][row, :length].tolist(),
                                       out["rollout_log_probs"][row, :length].tolist(), budget, self.stop_ids))
        return results


class RequestGenerator:
    """One engine call per turn (``generate_one``): for engines that batch requests themselves (sglang)."""

    def __init__(self, engine: RolloutEngine, params: SamplingParams, stop_token_ids: set[int]):
        self.engine, self.params, self.stop_ids = engine, params, set(stop_token_ids)
        self.live = 0

    async def generate(self, context_ids: list[int], max_new_tokens: int, seed: int | None = None) -> Generation:
        out = await self.engine.generate_one(list(context_ids), self.params, max_new_tokens=max_new_tokens,
                                             **({} if seed is None else {"seed": seed}))
        return finish_turn(list(out["response_ids"]), list(out["log_probs"]), max_new_tokens, self.stop_ids)


def make_generator(engine: RolloutEngine, params: SamplingParams, stop_token_ids: set[int],
                   pad_token_id: int) -> BatchingFront | RequestGenerator:
    """The right front for ``engine``: per request when it batches by itself, else :class:`BatchingFront`."""
    if engine.serves_requests:
        return RequestGenerator(engine, params, stop_token_ids)
    return BatchingFront(engine, params, stop_token_ids, pad_token_id)
