"""Skip-Join MLFQ (``policyType`` 6): FastServe's preemptive multi-level feedback queue (Wu et al. 2023).

The queues are Q0, Q1, ...; Q_k serves a job for a quantum of ``2**k`` units before the job is demoted
to Q_{k+1} (FastServe doubles the quantum from one queue to the next, starting at the shortest
iteration). A unit here is the work of one token: one decode iteration of one job, or one prompt token
of its first iteration. FastServe measures iteration times from a profile of the model; this host has
no such profile, so it counts tokens, and the order it gives does not depend on the machine.

* **Skip-join**: an arriving job does not start in Q0. It joins the highest queue whose quantum covers
  its first (prefill) iteration, Q_j with ``2**j >= prompt length``, since a long prompt would use up
  the quanta above at once.
* **Demotion**: a job that joined Q_j and has been served ``A`` units (its prompt and the tokens it has
  generated; 0 before it first ran) is in the lowest queue whose cumulative quanta
  ``2**j + ... + 2**k`` exceed ``A``.
* **Starvation**: a job that has not run for :data:`STARVE_LIMIT_S` seconds is promoted to Q0, and its
  quanta start again from there.
* **Preemption**: each step serves the ``maxBatchSize`` jobs of the highest queues (FCFS within a queue).
  An admitted job that falls out of them is paused and keeps its KV blocks, as in FastServe; when a
  served job's next token finds the pool dry the lowest job gives its blocks back first (swapped out
  with a swap space, else recomputed later).
* **Admission only into free blocks**: a waiting job (new, or recomputed) of a higher queue is admitted
  only into blocks that are free; it never takes the blocks of a job that holds KV (paused or not), and
  while it cannot be admitted its place in the batch goes to the running jobs next in queue order, so
  every step computes something. FastServe preempts for a higher queue by swapping the lower job's KV
  out to host memory ahead of time, which costs a copy; without that, preempting means recomputing the
  job's prompt and tokens. Doing that to admit a job thrashed: under a dry pool every arrival and every
  job the starvation guard promoted (TTFTs beyond :data:`STARVE_LIMIT_S` promote them all) evicted a
  paused job, which later starved, was promoted and evicted another, recomputing without end (a
  simulated closed loop of 48 jobs: 224 preemptions, 215 of them for admission, against 10 under FCFS).
  Now a job is recomputed only when a served job's next token needs its blocks, which happens at most
  once per block a job generates into, so preemptions are bounded by the tokens generated.

:class:`SkipJoinMLFQ` keeps the two things the queue position cannot be computed from: when each job
last ran, and where a promoted job's quanta restarted. :func:`plan_skip_join` is the Standard template
under this policy (a step is all prefills or all decodes).
"""

from __future__ import annotations

from .policy import SchedulerState, StepPlan, admit_prefills, prefill_turn
from .sequence import SequenceView

#: A job that has not run for this long is promoted to the highest queue (FastServe's starvation guard).
STARVE_LIMIT_S = 10.0


def entry_queue(prompt_len: int) -> int:
    """Skip-join: the highest queue whose quantum covers a first iteration of ``prompt_len`` tokens."""
    return max(0, prompt_len - 1).bit_length()


def queue_after(joined: int, attained: int) -> int:
    """The queue of a job that joined Q_``joined`` and has been served ``attained`` units since.

    It leaves Q_k once ``attained >= 2**joined + ... + 2**k = 2**(k+1) - 2**joined``.
    """
    return (attained + (1 << joined)).bit_length() - 1


def attained_units(seq: SequenceView) -> int:
    """Units a job has been served: its prompt and generated tokens once it has run, else 0."""
    return seq.prompt_len + seq.num_output_tokens if seq.num_output_tokens else 0


class SkipJoinMLFQ:
    """The per-engine state of the policy: when each job last ran and where promoted jobs restarted."""

    def __init__(self, starve_limit_s: float = STARVE_LIMIT_S) -> None:
        self.starve_limit_s = starve_limit_s
        self.last_run: dict[str, float] = {}  # by request id
        self.promoted_at: dict[str, int] = {}  # request id -> units attained when promoted to Q0

    def queue(self, seq: SequenceView, now: float) -> int:
        """The queue ``seq`` is in at ``now`` (0 is served first); promotes it if it starved."""
        attained = attained_units(seq)
        rid = seq.request_id
        if now - self.last_run.get(rid, seq.arrival_time) >= self.starve_limit_s:
            self.promoted_at[rid] = attained
            self.last_run[rid] = now  # the guard restarts: promoted once per starvation
        base = self.promoted_at.get(rid)
        if base is not None:
            return queue_after(0, attained - base)
        return queue_after(entry_queue(seq.prompt_len), attained)

    def order(self, seqs: list[SequenceView], now: float) -> list[SequenceView]:
        """``seqs`` from the highest queue to the lowest, FCFS within a queue."""
        keys = {s.seq_id: (self.queue(s, now), s.arrival_time, s.seq_id) for s in seqs}
        return sorted(seqs, key=lambda s: keys[s.seq_id])

    def ran(self, seqs: list[SequenceView], now: float) -> None:
        """``seqs`` run in the step of ``now``."""
        for s in seqs:
            self.last_run[s.request_id] = now

    def forget(self, request_id: str) -> None:
        """Drop what is kept about a request that left the engine."""
        self.last_run.pop(request_id, None)
        self.promoted_at.pop(request_id, None)


def plan_skip_join(state: SchedulerState, mlfq: SkipJoinMLFQ) -> StepPlan:
    """One step under Skip-Join MLFQ in the Standard template.

    ``state.running`` and ``state.waiting`` come ordered by queue. The jobs served are the
    ``maxBatchSize`` first of both together; when some of them wait, the step admits them (prefills,
    within the prefill budgets, when the Standard template's turn rule gives a prefill step), else it
    decodes the running ones among them; running jobs outside them are paused.
    """
    limits = state.limits
    waiting_ids = {s.seq_id for s in state.waiting}
    keys = {s.seq_id: (mlfq.queue(s, state.now), s.arrival_time, s.seq_id) for s in [*state.running, *state.waiting]}
    ordered = sorted([*state.running, *state.waiting], key=lambda s: keys[s.seq_id])
    top = ordered[: limits.max_batch_size]
    newcomers = [s for s in top if s.seq_id in waiting_ids]
    serving = [s for s in top if s.seq_id not in waiting_ids]
    if newcomers:
        view = SchedulerState(serving, newcomers, state.kv, limits, state.config, state.now, state.memo)
        if not serving or prefill_turn(view):
            picked = admit_prefills(view, limits.max_prefill_tokens, limits.max_prefill_batch_size)
            first = picked[0] if picked else None
            if first is not None and state.running and state.kv.blocks_needed(*first) > state.kv.num_free_blocks():
                picked = []  # admitted only into free blocks: no job that holds KV is recomputed to make room
            if picked:
                mlfq.ran([s for s, _ in picked], state.now)
                return StepPlan(picked)
            # no room for the top waiting jobs: their places go to the running jobs next in queue order
            serving = [s for s in ordered if s.seq_id not in waiting_ids][: limits.max_batch_size]
    batch = [(s, s.num_uncomputed) for s in serving if s.num_uncomputed > 0]
    mlfq.ran([s for s, _ in batch], state.now)
    return StepPlan(batch)
