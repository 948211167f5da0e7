"""The model worker actor: runs each StepPlan (forward + sampling, or verification of drafted
tokens, or a decode burst of several steps) on its own compute thread.

A thin shell around ModelRunner and the sampler. The model is built (see `build_runner`), and every
forward runs, on one dedicated thread, so the event loop keeps serving messages (and streams) meanwhile.
A failure traced to some sequences of a step ends those alone; the rest of the batch goes on.
A structured output's grammar is compiled on a thread before the step that starts its sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from actors.messages.front_end import (
    ListLoRAAdapters, LoadLoRAAdapter, LoRAAdapters, LoRAOutcome, TokenLogprobs, UnloadLoRAAdapter,
)
from actors.messages.step import (
    GetWorkerInfo, LayerWritten, NewSequence, ScheduledSeq, SeqOutput, StepPlan, StepProgress, StepResult,
    WorkerInfo,
)
from actors.worker.decode_burst import BurstBrake
from actors.worker.forward_batch import ForwardBatch, SequenceInput
from actors.worker.lora_adapter import LoRAAdapter, LoRAError, read_adapter
from actors.worker import grammar_compiler
from actors.worker.grammar_compiler import GrammarCompiler
from actors.worker.model_runner import ModelRunner
from actors.worker.rejection_sampler import SpecSeq, verify_logits
from actors.worker.tensor_parallel import RanksLost
from actors.worker.pooling import PoolState
from actors.worker.sampler import Sampler, SamplingState, raw_logprobs, target_logprobs
from runtime import Actor, ActorRef, get_logger

log = get_logger(component="worker")


def compute_thread() -> ThreadPoolExecutor:
    """The one thread that runs the model: loading, forwards, sampling. Keep every parallel torch op and C
    kernel call on it. OpenMP gives each thread that opens a parallel region a team of its own, and once it
    runs more threads than there are cores it stops spinning between regions: one parallel op on a second
    thread made every later one-row forward ~3x slower (6 -> 20 ms on 2 cores, for the life of the process)."""
    return ThreadPoolExecutor(1, thread_name_prefix="matinee-forward")


async def build_runner(make_runner: Callable[[], ModelRunner], executor: ThreadPoolExecutor) -> ModelRunner:
    """Loads the model on the compute thread (seconds of work, off the loop); a model that cannot be
    loaded raises its one clear error here, before any actor exists."""
    return await asyncio.get_running_loop().run_in_executor(executor, make_runner)


class WorkerActor(Actor):
    def __init__(self, runner: ModelRunner, executor: ThreadPoolExecutor, seed: int = 0,
                 brake: BurstBrake | None = None):
        self.runner = runner
        self.states: dict[int, SamplingState] = {}
        self._executor: ThreadPoolExecutor | None = executor
        self._generator = torch.Generator(runner.device).manual_seed(seed)
        self._sampler = Sampler()         # used on the compute thread only
        self._grammars: GrammarCompiler | None = None   # made at the first structured output
        self._brake = brake               # pulled by the scheduler: the decode burst in flight ends
        self._loop: asyncio.AbstractEventLoop | None = None   # where a burst's progress is sent from
        self.loras: dict[str, LoRAAdapter] = {}   # the adapters requests may name, read into CPU memory
        self._adapter_of: dict[int, LoRAAdapter] = {}   # seq id -> its adapter (kept after an unload)

    async def on_start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.states.clear()  # a restarted worker forgets sequences; the scheduler fails their step
        self._adapter_of.clear()

    async def on_stop(self) -> None:
        if self._executor is not None and getattr(self.runner, "tp", None) is not None:
            # Rank 0 stops the other ranks once the step in flight is done (a lost rank fails it at once).
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.wrap_future(self._executor.submit(self.runner.close)), 30)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)  # never block the loop on a forward
            self._executor = None

    async def receive(self, msg: Any) -> Any:
        match msg:
            case StepPlan():
                await self._compile_grammars(msg)
                try:
                    return await asyncio.get_running_loop().run_in_executor(self._executor, self.step, msg)
                except RanksLost as e:
                    return await self._ranks_lost(e)
            case GetWorkerInfo():
                r = self.runner
                return WorkerInfo(r.num_blocks, r.block_size, r.max_model_len, r.model_config.vocab_size,
                                  list(r.eos_token_ids), r.weight_bytes, r.kv_bytes_per_token,
                                  str(r.kv_cache_dtype).removeprefix("torch."))
            case LoadLoRAAdapter(lora_name=name, lora_path=path):
                return await self._load_lora(name, path)
            case UnloadLoRAAdapter(lora_name=name):
                if self.loras.pop(name, None) is None:
                    return LoRAOutcome(404, f"The lora adapter '{name}' cannot be found.")
                return LoRAOutcome()
            case ListLoRAAdapters():
                slots = self.runner.loras
                return LoRAAdapters({n: a.path for n, a in self.loras.items()}, slots.max_loras if slots else 0)
        return await super().receive(msg)

    async def _ranks_lost(self, error: RanksLost) -> None:
        """A tensor-parallel rank is gone: the node stops (exit status 1). The scheduler ends no request for
        it, so the cluster sees the engine die and continues its streams elsewhere."""
        log.critical("tensor-parallel ranks lost; stopping the engine", error=str(error))
        self.context.system.request_shutdown(1)
        raise error

    async def _load_lora(self, name: str, path: str) -> LoRAOutcome:
        """Reads and checks the adapter off the loop and off the compute thread (file reads, no tensor
        arithmetic); it is laid out in a device slot when a step first needs it."""
        if self.runner.loras is None:
            return LoRAOutcome(400, "LoRA adapters are not enabled on this engine (--max-loras 0)")
        if name in self.loras:
            return LoRAOutcome(400, f"The lora adapter '{name}' has already been loaded.")
        r = self.runner
        try:
            adapter = await asyncio.to_thread(read_adapter, name, path, r.model_config, r.max_lora_rank)
        except LoRAError as e:
            return LoRAOutcome(400, str(e))
        except (OSError, ValueError) as e:   # an unreadable file past the checks: still the folder's fault
            return LoRAOutcome(400, f"adapter {name!r} cannot be read from {path!r}: {e}")
        if name in self.loras:   # loaded meanwhile by another call
            return LoRAOutcome(400, f"The lora adapter '{name}' has already been loaded.")
        self.loras[name] = adapter
        log.info("LoRA adapter loaded", name=name, path=adapter.path, rank=adapter.rank,
                 modules=sorted(adapter.modules), digest=adapter.digest)
        return LoRAOutcome(key=adapter.key)

    def step(self, plan: StepPlan) -> StepResult:
        """Runs on the compute thread. When the batch fails, the sequences that fail on their own end
        alone (their SeqOutput carries the error) and the rest run again without them; only a step
        where every one of several sequences fails raises."""
        t0 = time.perf_counter()
        collectives_before = self.runner.collective_seconds()
        for sid in plan.finished_seq_ids:
            self.states.pop(sid, None)
            self._adapter_of.pop(sid, None)
        refused: dict[int, str] = {}
        for new in plan.new_seqs:
            if new.lora_name is not None:
                adapter = self.loras.get(new.lora_name)   # one read: the loop's thread may unload it
                if adapter is None:   # unloaded after the front end took the request
                    refused[new.seq_id] = f"the LoRA adapter {new.lora_name!r} is not loaded"
                    continue
                self._adapter_of[new.seq_id] = adapter
            try:
                state = self.states[new.seq_id] = self._new_state(new)
                state.append(new.output_token_ids)   # generated before a handover
            except ValueError as e:   # a grammar that does not compile: this sequence alone fails
                refused[new.seq_id] = f"structured output: {e}"
        seqs = [s for s in plan.seqs if s.seq_id not in refused]
        rng = self._rng_snapshot(seqs)
        failed: dict[int, str] = {}
        if plan.layers_to is not None:   # prompts handed over layer by layer: each layer's KV is announced
            self.runner.layer_written = functools.partial(self._layer_written, plan.layers_to, plan.step_id)
        try:
            tokens = self._run(seqs) if seqs else {}
        except RanksLost:
            raise   # no sequence runs alone either: the worker itself is lost
        except Exception:
            failed = self._isolate(seqs, rng)
            rest = [s for s in seqs if s.seq_id not in failed]
            if not rest and len(failed) > 1:
                raise  # not one sequence runs: the step itself is broken
            # Running the others again rewrites the same KV slots with the same values.
            tokens = self._run(rest) if rest else {}
        finally:
            self.runner.layer_written = None
        failed.update(refused)
        result = StepResult(plan.step_id, self._outputs(plan.seqs, tokens, failed), self.runner.last_forward_s,
                            time.perf_counter() - t0)
        result = self._burst(plan, result, t0) if plan.burst else result
        if self.runner.tp is not None:
            (all_reduce, collective), (ar0, coll0) = self.runner.collective_seconds(), collectives_before
            result.all_reduce_s, result.collective_s = all_reduce - ar0, collective - coll0
        return result

    def _layer_written(self, to: ActorRef, step_id: int, layer: int) -> None:
        """On the compute thread, mid-forward: the event loop tells `to`."""
        try:
            self._loop.call_soon_threadsafe(to.tell, LayerWritten(step_id, layer))
        except RuntimeError:   # the event loop closed (shutdown)
            pass

    def _outputs(self, seqs: list[ScheduledSeq], tokens: dict, failed: dict[int, str]) -> list[SeqOutput]:
        """Each sequence's SeqOutput; its tokens go into its sampling state."""
        vocab = self.runner.model_config.vocab_size
        outputs = []
        for s in seqs:
            error = failed.get(s.seq_id)
            if error is None and s.sample:
                out, logprobs = tokens[s.seq_id]
                error = _outside_vocab(out, vocab) or self._keep(s.seq_id, out)
            if error is not None:
                outputs.append(SeqOutput(s.seq_id, [], None, len(s.spec_token_ids), error))
            elif s.sample:
                state = self.states[s.seq_id]
                prompt_lps = state.take_prompt_logprobs()
                outputs.append(SeqOutput(s.seq_id, out, logprobs, len(s.spec_token_ids), None,
                                         None if prompt_lps is None else [TokenLogprobs(*p) for p in prompt_lps],
                                         state.pool.take() if state.pool is not None else None))
        return outputs

    def _burst(self, plan: StepPlan, result: StepResult, t0: float) -> StepResult:
        """A decode burst's further steps (see actors/worker/decode_burst.py): each from the token the
        step before sampled, whose tokens go to the scheduler before the next step runs. It ends at
        the brake, or at a step that fails: then with the steps before it, the failed step's KV in
        lookahead slots the scheduler gives back (the next ordinary step meets the failure with its
        own handling) and its random draws undone."""
        seqs, forward_s = self._by_adapter(plan.seqs), result.forward_s
        for _ in range(plan.burst):
            if (self._brake is not None and self._brake.pulled) or any(o.error is not None for o in result.outputs):
                break
            last = {o.seq_id: o.token_ids[-1] for o in result.outputs}
            seqs = [ScheduledSeq(s.seq_id, [last[s.seq_id]], s.start_pos + len(s.token_ids), s.block_table, True)
                    for s in seqs]
            try:
                self._loop.call_soon_threadsafe(plan.report_to.tell, StepProgress(plan.step_id, result.outputs))
            except RuntimeError:   # the event loop closed (shutdown): nobody takes these tokens
                break
            rng = self._rng_snapshot(seqs)
            try:
                tokens = self._run_next(seqs)
            except Exception:
                # The next ordinary step meets the failure with its own handling; its cause is here.
                log.exception("decode burst step failed; the burst ends before it", step_id=plan.step_id,
                              burst_step=result.num_steps + 1, seq_ids=[s.seq_id for s in seqs])
                for generator, state in rng:
                    generator.set_state(state)
                return StepResult(plan.step_id, [], forward_s, time.perf_counter() - t0, result.num_steps)
            forward_s += self.runner.last_forward_s
            result = StepResult(plan.step_id, self._outputs(seqs, tokens, {}), forward_s, time.perf_counter() - t0,
                                result.num_steps + 1)
        return result

    def _keep(self, seq_id: int, token_ids: list[int]) -> str | None:
        """Appends the tokens to the sequence's state; an error when its grammar refuses one (the
        mask makes that impossible: it ends that sequence, never the step)."""
        try:
            self.states[seq_id].append(token_ids)
        except ValueError as e:
            return str(e)
        return None

    async def _compile_grammars(self, plan: StepPlan) -> None:
        """The grammars of the plan's new sequences into the compiler's cache, on a thread."""
        specs = {new.params.structured for new in plan.new_seqs if new.params.structured is not None}
        if not specs:
            return
        if self._grammars is None:
            r = self.runner
            self._grammars = GrammarCompiler(lambda: r.tokenizer.hf, r.model_config.vocab_size, r.eos_token_ids)
        loop = asyncio.get_running_loop()
        for spec in specs:
            if not self._grammars.is_compiled(spec):
                job = loop.run_in_executor(None, self._grammars.compile, spec)
                try:   # shielded: an overrunning compile goes on, and caches its grammar when done
                    await asyncio.wait_for(asyncio.shield(job), grammar_compiler.COMPILE_TIMEOUT_S)
                except TimeoutError:
                    log.warning("grammar compile overran; its sequences fail", kind=spec.kind,
                                chars=len(spec.spec), timeout_s=grammar_compiler.COMPILE_TIMEOUT_S)
                    self._grammars.overran(spec, grammar_compiler.COMPILE_TIMEOUT_S)

    def _new_state(self, new: NewSequence) -> SamplingState:
        spec = new.params.structured
        grammar = self._grammars.state(spec) if spec is not None else None
        state = SamplingState(new.params, new.prompt_token_ids, new.seed, self.runner.device, grammar)
        if new.params.embed:
            state.pool = PoolState(self.runner.pooling, len(new.prompt_token_ids))
        return state

    def _run(self, seqs: list[ScheduledSeq]) -> dict[int, tuple[list[int], list[TokenLogprobs] | None]]:
        """One forward over `seqs`, then sampling or verification: the tokens of those that sample."""
        # Logits only where a token is drawn: the last position, or k+1 positions to verify k drafts;
        # before them, the prompt positions whose logprobs are wanted.
        seqs = self._by_adapter(seqs)
        adapter_of = self._adapter_of
        prompt_rows = [self._prompt_positions(s) for s in seqs]
        pool_rows = [self._pool_positions(s) for s in seqs]
        batch = ForwardBatch([SequenceInput(s.token_ids + s.spec_token_ids, s.start_pos, s.block_table,
                                            len(p) + (len(s.spec_token_ids) + 1 if s.sample else 0),
                                            (q.start - s.start_pos, q.stop - s.start_pos) if q else (0, 0),
                                            adapter_of.get(s.seq_id))
                              for s, p, q in zip(seqs, prompt_rows, pool_rows)])
        logits = self.runner.execute(batch)
        if any(pool_rows):
            self._pool(seqs, pool_rows, self.runner.last_pooled)
        sampled, starts, row = [], [], 0   # the sequences that sample, and each one's first sampling row
        for s, positions in zip(seqs, prompt_rows):
            if positions:
                self._prompt_logprobs(s, positions, logits[row:row + len(positions)])
                row += len(positions)
            if s.sample:
                sampled.append(s)
                starts.append(row)
                row += len(s.spec_token_ids) + 1
        tokens: dict[int, tuple[list[int], list[TokenLogprobs] | None]] = {}
        self._sample_plain(logits, [(s, r) for s, r in zip(sampled, starts) if not s.spec_token_ids], tokens)
        self._verify(logits, [(s, r) for s, r in zip(sampled, starts) if s.spec_token_ids], tokens)
        return tokens

    def _by_adapter(self, seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The sequences grouped by LoRA adapter, base model first (stable: a burst's later steps
        find the order its first step ran in): each adapter's rows are one segment of the batch."""
        if not self._adapter_of:
            return seqs
        return sorted(seqs, key=lambda s: a.uid if (a := self._adapter_of.get(s.seq_id)) is not None else 0)

    def _run_next(self, seqs: list[ScheduledSeq]) -> dict[int, tuple[list[int], list[TokenLogprobs] | None]]:
        """A burst's further step (decodes alone, in the order of the step before): the runner moves
        that step's batch on by the tokens just sampled, rather than flattening `seqs` anew."""
        logits = self.runner.execute_next([s.token_ids[0] for s in seqs])
        tokens: dict[int, tuple[list[int], list[TokenLogprobs] | None]] = {}
        self._sample_plain(logits, [(s, row) for row, s in enumerate(seqs)], tokens)
        return tokens

    def _prompt_positions(self, s: ScheduledSeq) -> range:
        """Positions of this chunk whose logits give prompt logprobs not yet computed (position p's
        for prompt token p + 1); a rerun of the same chunk (a retried step, a preempted sequence)
        computes none twice."""
        state = self.states.get(s.seq_id)
        if state is None or state.prompt_logprobs is None:
            return range(0)
        done, last = len(state.prompt_logprobs), len(state.prompt_token_ids) - 1
        first, end = max(s.start_pos, done), min(s.start_pos + len(s.token_ids), last)
        if first > done and first < end:   # the scheduler sends such a prompt from position 0
            raise RuntimeError(f"prompt logprobs from position {done} wanted, the chunk starts at {first}")
        return range(first, end)

    def _pool_positions(self, s: ScheduledSeq) -> range:
        """Positions of this chunk an embedding's pool still needs."""
        state = self.states.get(s.seq_id)
        if state is None or state.pool is None:
            return range(0)
        return state.pool.positions(s.start_pos, len(s.token_ids))

    def _pool(self, seqs: list[ScheduledSeq], positions: list[range], hidden: torch.Tensor) -> None:
        row = 0
        for s, p in zip(seqs, positions):
            if p:
                self.states[s.seq_id].pool.add(hidden[row:row + len(p)])
                row += len(p)

    def _prompt_logprobs(self, s: ScheduledSeq, positions: range, logits: torch.Tensor) -> None:
        state = self.states[s.seq_id]
        targets = state.prompt_token_ids[positions.start + 1:positions.stop + 1].tolist()
        state.prompt_logprobs.extend(target_logprobs(logits, targets, state.num_prompt_logprobs))

    def _isolate(self, seqs: list[ScheduledSeq], rng: list[tuple[torch.Generator, torch.Tensor]]) -> dict[int, str]:
        """After a failed batch: the sequences that fail when run alone, with their tracebacks. The
        random generators go back to where the step found them, so the retry draws what it would have."""
        if len(seqs) == 1:  # alone in its step, the failure is its own
            return {seqs[0].seq_id: traceback.format_exc()}
        failed = {}
        for s in seqs:
            try:
                self._run([s])
            except Exception:
                failed[s.seq_id] = traceback.format_exc()
        for generator, state in rng:
            generator.set_state(state)
        return failed

    def _rng_snapshot(self, seqs: list[ScheduledSeq]) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The generators the step may draw from, with their states; none when every sequence is
        greedy (greedy rows never draw)."""
        states = [self.states.get(s.seq_id) for s in seqs]
        if all(state is not None and state.greedy for state in states):
            return []
        generators = [self._generator] + [st.generator for st in states if st is not None and st.generator is not None]
        return [(g, g.get_state()) for g in generators]

    def _sample_plain(self, logits: torch.Tensor, seqs: list[tuple[ScheduledSeq, int]], into: dict) -> None:
        """One token per sequence without drafts, from its logits row."""
        if not seqs:
            return
        states = [self.states[s.seq_id] for s, _ in seqs]
        rows = [r for _, r in seqs]
        picked = logits if len(rows) == logits.shape[0] else logits[rows]
        out = self._sampler.sample(picked, states, self._generator)
        for (s, _), token, lp in zip(seqs, out.token_ids, out.logprobs):
            into[s.seq_id] = ([token], None if lp is None else [TokenLogprobs(*lp)])

    def _verify(self, logits: torch.Tensor, seqs: list[tuple[ScheduledSeq, int]], into: dict) -> None:
        """Accepted drafts plus one corrected or bonus token per sequence, from its k+1 rows."""
        if not seqs:
            return
        rows = torch.cat([torch.arange(r, r + len(s.spec_token_ids) + 1) for s, r in seqs])
        picked = logits[rows]
        items = [SpecSeq(self.states[s.seq_id], s.spec_token_ids, s.spec_probs) for s, _ in seqs]
        emitted = verify_logits(self._sampler, picked, items, self._generator)
        offset = 0
        for (s, _), item, out in zip(seqs, items, emitted):
            into[s.seq_id] = (out, _verified_logprobs(picked[offset:offset + len(out)], item.state, out))
            offset += len(s.spec_token_ids) + 1


def _verified_logprobs(logits: torch.Tensor, state: SamplingState, token_ids: list[int]) -> list[TokenLogprobs] | None:
    """The sampler's raw logprobs for verified positions, one row per emitted token."""
    if state.num_logprobs is None:
        return None
    for_row = raw_logprobs(logits, [state] * len(token_ids), list(range(len(token_ids))))
    return [TokenLogprobs(*for_row(j, t)) for j, t in enumerate(token_ids)]


def _outside_vocab(token_ids: list[int], vocab: int) -> str | None:
    """A token the sampler must never give; it ends its own sequence, never the step."""
    bad = [t for t in token_ids if not 0 <= t < vocab]
    return f"sampled token {bad[0]} is outside the vocabulary [0, {vocab})" if bad else None
