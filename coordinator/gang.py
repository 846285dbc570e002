"""All-reduce mode's steps (coordinator/mirrored.py): each a *gang* of one
closure per member worker, run at once, and what happens when a member is
lost (elastic, as elastic Horovod's driver does it).

A step is issued to the current members (at first the workers of the
cluster spec), replica r to member r, its closures queued whole and in
step order (every worker runs its steps in the order scheduled, so the
members of a step meet). Its RemoteValues are the user's for the step's
whole life, whatever attempt sets them.

A closure of a step that fails because a member is gone (its worker did
not answer, or the step's all-reduce failed: AllReduceFailed) or out of
step (the members' replicas disagree: ReplicasDisagree, a worker that
restarted) does not fail the job. The first such failure pauses
dispatching, and a recovery (on a thread of its own):

1. takes every step's closures not taken yet off the queue (a member
   already running such a step fails within step_timeout: it is issued
   again);
2. waits until no closure of a step is running;
3. asks every worker of the spec at once, once no attempt of a step runs
   there (a call cut on the way runs on; up to SETTLE_SECONDS, then it is
   given up there), for its replicas' update counts: those that answer are
   the members from now on (a new epoch in the group names);
4. copies the replicas of the member that applied the most updates to the
   others (values, slots, counts: ``mirrored.set_state``), so the replicas
   are one again whether or not a failed step was applied somewhere;
5. counts a failed step done where a member completed it (its closure's
   reply came, or, where no reply of the step came, a member left says its
   step function returned in that attempt with its pushes through, asked
   once no attempt runs there: ``mirrored.after_steps``; its replicas,
   copied to all, have it; its batches are trained; the values not set
   are ABANDONED), and issues it again to the new members otherwise; then
   the steps taken off the queue, in order;
6. resumes dispatching.

A step function's own error on any member (the others' all-reduce fails
too, told of it) still fails the job, as in the other modes: the recovery
decides once every closure of the failed steps has ended.

A worker that joins (the cluster spec grew: TF_CONFIG re-read, DNS, a
LocalCluster.add_worker) enters at a step boundary, by the same re-forming
with no step failed: the next ``schedule`` after the spec grew pauses
dispatching, takes the steps no member started off the queue, lets the
started ones end, and then (3 to 6 above) the joiner, which has no replicas yet,
gets the current model and is a member of every step issued from then on
(those taken off included). A joiner that does not answer is tried again
at the next re-forming. A worker of the spec that a re-forming left out
(it did not answer) enters again the same way once its connection is made
again (back after an outage, or restarted): at the next ``schedule``, no
sooner than BACK_SECONDS after it was left out (doubled each time it is
left out again: a worker that flaps costs a re-forming a minute at most).
A worker left out while its connection stayed up (it answered, but not
the re-forming's question) waits for a later re-forming, as before.
"""
from __future__ import annotations

import logging
import threading
import time

from coordinator.closures import ABANDONED, Closure, RemoteValue, StepRemoteValue
from coordinator.errors import StepFunctionError, WorkerCallError
from coordinator.replica import CollectiveSpec
from psserver.errors import Unavailable

log = logging.getLogger("coordinator")

#: Attempts of a step that may fail: a step whose ring fails again and
#: again (a step_timeout too short for it, say, or workers that push other
#: variables) fails the job with its error rather than run forever. A step
#: only taken off the queue and issued again (a re-forming for another
#: step, or for a joiner) has not failed.
MAX_ATTEMPTS = 4
#: Seconds a re-forming waits for a worker that is not a member yet (one
#: joining) to answer; it is tried again at the next re-forming.
JOIN_SECONDS = 30.0
#: Seconds a re-forming waits for a worker whose call was just cut (a reply
#: lost on the way: its slot reconnects) to answer again, unless a
#: reconnection of it fails first (a worker that is gone).
RECONNECT_SECONDS = 5.0
#: Seconds after a re-forming left a worker out before its connecting again
#: lets it in again (doubled, up to 60, each time it is left out again).
BACK_SECONDS = 1.0
#: Seconds (at most; step_timeout where shorter, plus 2) a re-forming waits
#: for a worker's attempts of this coordinator's steps to end there (asking
#: every worker at once); those still running are then given up there.
SETTLE_SECONDS = 10.0


class GangStep:
    """One all-reduce step: its function and arguments, the user's
    RemoteValues (one per replica it has had), its current closures."""

    def __init__(self, step: int, ref, payload: bytes, name: str, size: int,
                 datasets: tuple = ()):
        self.step, self.ref, self.payload, self.name = step, ref, payload, name
        self.datasets = datasets   # sharded datasets: each closure binds a batch of each
        self.values = [RemoteValue() for _ in range(size)]
        self.remote = StepRemoteValue(self.values)
        self.closures: list[Closure] = []
        self.attempts = 0           # attempts that failed
        self.started = False        # a closure of this attempt was taken by a worker
        self.running = 0            # closures of this attempt not ended (queued or running)
        self.succeeded = 0
        self.failed: list[tuple[Closure, BaseException, bool]] = []   # (.., lost)


class Gangs:
    """The all-reduce steps of one Cluster (its ``gangs``)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self._lock = threading.Condition()
        self._order = threading.Lock()   # steps queued whole, in step order
        self.members: tuple[str, ...] | None = None
        self.known: set[str] = set()   # every worker that was a member: not one joining
        # Workers of the spec left out of the ring -> (their connections made
        # when the re-forming began, not before when): one that connects again
        # (back after an outage, or restarted) enters again at the next step
        # boundary, as a joiner does, at most once in BACK_SECONDS, doubled
        # each time it is left out again (a worker that flaps).
        self.left_out: dict[str, tuple[int, float]] = {}
        self._back_after: dict[str, float] = {}
        self.epoch = 0
        self.paused = False   # (Cluster.may_start reads it: no step starts meanwhile)
        self._steps: dict[int, GangStep] = {}   # steps not done
        self._recovering = False
        self.completed = 0   # steps done on every member (none: no replica is needed yet)

    # -- issuing -------------------------------------------------------------------------
    def schedule(self, ref, payload: bytes, name: str, datasets: tuple = ()) -> StepRemoteValue:
        s = self.cluster.strategy
        while True:   # (not under the order lock, which the recovery takes)
            spec = tuple(s.cluster_spec.worker)
            with self._lock:
                self._lock.wait_for(lambda: not self._recovering)
                grown = [a for a in spec if a not in self.known or self._back(a)] \
                    if self.members is not None else []
                if not grown:
                    break
                for a in grown:
                    self.left_out.pop(a, None)
                self.known.update(grown)   # (tried once: one that does not answer waits
                self._start_recovery(growth=True)   # for the next re-forming)
            log.warning("workers %s joined the all-reduce job (or are back); they enter at the "
                        "next step boundary with the current model", ", ".join(grown))
            self.cluster.membership.refresh()   # (their threads now: the re-forming asks them)
        with self._order:   # (a recovery starting now takes these closures off again)
            with self._lock:
                if self.members is None:
                    self.members = spec
                    self.known.update(spec)
                step = next(s.allreduce_steps)   # (the strategy's: a new coordinator goes on)
                g = self._steps[step] = GangStep(step, ref, payload, name, len(self.members),
                                                 datasets)
                closures = self._closures(g)
            for c in closures:
                self.cluster.queue.put(c)
        return g.remote

    def _closures(self, g: GangStep) -> list[Closure]:
        """g's closures for the current members (lock held); ranks past them ABANDONED."""
        s, members = self.cluster.strategy, self.members
        compression = "fp16" if s.gradient_compression_spec is not None else None
        from coordinator.mirrored import MAX_STEP_SECONDS
        while len(g.values) < len(members):
            g.values.append(RemoteValue())
        for rv in g.values[len(members):]:
            if not rv.done():
                rv.set_value(ABANDONED)
        g.closures = []
        for r in range(len(members)):
            c = Closure(g.ref, g.payload, f"{g.name}[step {g.step} replica {r}]",
                        datasets=g.datasets, collective=CollectiveSpec(
                            f"{s.job}/{self.cluster.nonce}/e{self.epoch}/step-{g.step}",
                            members, r, g.step, s.step_timeout or MAX_STEP_SECONDS,
                            s.aggregation == "sum", compression, s.job))
            c.remote_value, c.gang = g.values[r], g
            g.closures.append(c)
        g.running, g.succeeded, g.failed, g.started = len(members), 0, [], False
        return g.closures

    # -- what the workers' threads report --------------------------------------------------
    def succeeded(self, closure: Closure) -> None:
        """A closure of a step returned (its value set by the queue already)."""
        with self._lock:
            g = closure.gang
            if closure in g.closures:
                g.running -= 1
                g.succeeded += 1
                self._settle(g)

    def failed(self, closure: Closure, error: BaseException, lost: bool) -> None:
        """A closure of a step failed; ``lost``: because a member is gone
        (its worker did not answer, or its all-reduce failed), else by the
        step's own error. It stays in flight for the queue until the
        recovery has decided: issued again, or the job failed."""
        with self._lock:
            g = closure.gang
            if closure not in g.closures or self._steps.get(g.step) is not g:
                # an earlier attempt's (replaced already), or a step no
                # longer followed (the job failed): nothing to re-form for;
                # its batches go back (else they stay handed out for ever)
                closure.settle_batches(False)
                self.cluster.queue.release(closure)
                return
            g.running -= 1
            g.failed.append((closure, error, lost))
            if self._recovering:
                self._lock.notify_all()
                return
            self._start_recovery()
        log.warning("all-reduce step %d failed on a worker (%s); pausing to re-form the "
                    "ring from the workers that answer", g.step, error)

    def _reconnections(self, address: str) -> int:
        worker = self.cluster.membership.workers.get(address)
        return -1 if worker is None else worker.connects_made

    def _back(self, address: str) -> bool:
        """A worker left out of the ring that connected again since (lock held)."""
        made, not_before = self.left_out.get(address, (None, 0.0))
        return made is not None and self._reconnections(address) > made \
            and time.monotonic() >= not_before

    def _note_left_out(self, spec: list[str], members: tuple[str, ...],
                       made: dict[str, int]) -> None:
        """After a re-forming (lock held): the workers of ``spec`` not in
        ``members``, each with its connections ``made`` before the
        re-forming asked and when it may come back (BACK_SECONDS, doubled
        each time it is left out again, up to 60 s); a member's backoff is
        reset; a worker that left the spec is forgotten (a joiner if it
        comes back)."""
        self.known &= set(spec)
        now = time.monotonic()
        for a in spec:
            if a in members:
                self._back_after.pop(a, None)
            else:
                wait = self._back_after[a] = min(
                    2 * self._back_after.get(a, BACK_SECONDS / 2), 60.0)
                self.left_out[a] = (made.get(a, -1), now + wait)
        self.left_out = {a: v for a, v in self.left_out.items()
                         if a in spec and a not in members}

    def joining(self, spec) -> int:
        """Workers of ``spec`` the next step admits: joiners and those back."""
        with self._lock:
            return sum(a not in self.known or self._back(a) for a in spec)

    def _start_recovery(self, growth: bool = False) -> None:
        """Pause dispatching and re-form the ring on a thread of its own (lock
        held). ``growth``: for a worker that joined, none lost: the steps a
        member started end as they are (their other closures are taken while
        paused, Cluster.may_start / _ClosureQueue._first_for)."""
        self._recovering = self.paused = True
        self._lock.notify_all()
        threading.Thread(target=self._recover, args=(growth,), name="AllReduceRecovery",
                         daemon=True).start()

    def _settle(self, g: GangStep) -> None:
        if not g.running and not g.failed and g.succeeded == len(g.closures):
            self._steps.pop(g.step, None)
            self.completed += 1
        self._lock.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no recovery is under way."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._recovering, timeout)

    # -- recovery ------------------------------------------------------------------------
    def _recover(self, growth: bool = False) -> None:
        c = self.cluster
        old: list[Closure] = []
        again: list[Closure] = []
        try:
            # Every step's closures not taken yet come off the queue (a member
            # running such a step fails within step_timeout: issued again), or
            # for a joiner only those of steps no member started. First
            # without the order lock (a schedule() blocked on a full queue
            # finishes its puts), then with it: no step goes in meanwhile.
            self._take_out(growth)
            with self._order:
                self._take_out(growth)
                if growth:   # a step failing meanwhile: every step's closures off, as for a loss
                    with self._lock:
                        self._lock.wait_for(lambda: all(
                            not g.running or g.failed for g in self._steps.values()),
                            2 * c.strategy.step_timeout + 120)
                    self._take_out()
                with self._lock:
                    waited = self._lock.wait_for(
                        lambda: all(not g.running for g in self._steps.values()),
                        2 * c.strategy.step_timeout + 120)
                    if not waited:
                        raise Unavailable("all-reduce: the closures of the failed steps did not "
                                          "end; the job stops")
                    steps = sorted(self._steps.values(), key=lambda g: g.step)
                    own = [e for g in steps for _, e, lost in g.failed if not lost]
                    for g in steps:   # (a step only taken off the queue did not fail)
                        g.attempts += bool(g.failed)
                    tired = [g for g in steps if g.failed and g.attempts >= MAX_ATTEMPTS]
                if own:   # a step function's own error (the others' were told of it): as ever
                    raise own[0]
                if tired:   # (the members' own finding, where one found the replicas differ)
                    errors = [e for _, e, _ in tired[0].failed]
                    raise next((e for e in errors if getattr(e, "type_name", "") ==
                                "ReplicasDisagree"), errors[-1])
                unheard = {g.closures[0].collective.group for g in steps
                           if g.failed and not g.succeeded}   # (not a reply came)
                spec = list(c.strategy.cluster_spec.worker)
                made = {a: self._reconnections(a) for a in spec}   # (before any ask)
                members, source, completed = self._live(unheard)
                if source is not None:
                    members = self._sync(members, source)
                with self._lock:
                    self.members, self.epoch = members, self.epoch + 1
                    self._note_left_out(spec, members, made)
                    for g in steps:
                        old += [cl for cl, _, _ in g.failed]
                        # Applied where it succeeded (so every member's gradient,
                        # batch and all, is in it): now everywhere; else nothing
                        # was applied: the batches go back, the step again.
                        done = bool(g.failed and (g.succeeded or g.closures[0].collective.group
                                                  in completed))
                        for cl, _, _ in g.failed:
                            cl.settle_batches(done)
                        if done:   # (replicas that failed, or were taken off unrun)
                            for rv in g.values:
                                if not rv.done():
                                    rv.set_value(ABANDONED)
                            self._steps.pop(g.step)
                            self.completed += 1
                        else:
                            again += self._closures(g)
                    self._recovering = self.paused = False   # (a new failure: a new recovery)
                    self._lock.notify_all()
                log.warning("all-reduce: %d workers go on (%s); %d closures issued again",
                            len(members), ", ".join(members), len(again))
                c.queue.wake()
                for cl in again:   # (in step order; never waiting: they replace closures
                    c.queue.put(cl, wait=False)   # the queue held, and workers may be paused)
            for cl in old:   # (after the puts: the queue never looks idle meanwhile)
                c.queue.release(cl)
        except BaseException as exc:   # a step's own error, or no ring to re-form: the job fails
            if not isinstance(exc, (StepFunctionError, WorkerCallError)):
                log.error("all-reduce: cannot re-form the ring: %s", exc)
            c.queue.mark_failed_external(exc)   # (first: a join() wakes to the error)
            with self._lock:
                pending = [cl for g in self._steps.values() for cl, _, _ in g.failed]
                for cl in pending:
                    cl.settle_batches(False)
                for g in self._steps.values():
                    for rv in g.values:
                        if not rv.done():
                            rv.set_error(exc)
                self._steps.clear()
                self._recovering = self.paused = False
                self._lock.notify_all()
            for cl in pending:
                c.queue.release(cl)
            c.queue.wake()

    def _take_out(self, unstarted_only: bool = False) -> None:
        taken = self.cluster.queue.take_out(
            lambda cl: cl.gang is not None and not (unstarted_only and cl.gang.started))
        with self._lock:
            for cl in taken:
                cl.gang.running -= 1
            self._lock.notify_all()

    def _live(self, unheard: set[str]) -> tuple[tuple[str, ...], str | None, set[str]]:
        """(the workers of the spec that answer, in spec order; the one whose
        replicas applied the most updates, None where no step was done yet
        and none has replicas; those of the ``unheard`` step attempts (no
        reply of theirs came) that a member completed). A worker without
        replicas (it restarted, or joined) is a member too: it gets the
        others'. All are asked at once, each once no attempt of this
        coordinator's steps runs there (one whose call was cut runs on: its
        pushes land first), waiting up to SETTLE_SECONDS: an attempt still
        running then is given up there (it applies nothing more:
        mirrored.after_steps) and the worker stays a member."""
        from coordinator import mirrored
        c, s = self.cluster, self.cluster.strategy
        prefix, groups = f"{s.job}/{c.nonce}/", sorted(unheard)
        settle = min(s.step_timeout or SETTLE_SECONDS, SETTLE_SECONDS) + 2.0
        spec = list(s.cluster_spec.worker)

        def ask(a: str):
            # (a worker that is no member yet may not answer at all, a TLS
            # mismatch, say: the job waits for it JOIN_SECONDS, not a tool's 120 s)
            wait = None if self.members is None or a in self.members else JOIN_SECONDS + settle
            try:
                return c.run_on(a, mirrored.after_steps, (s.mirrored_variables, prefix, groups,
                                                          settle), wait, RECONNECT_SECONDS)
            except (Unavailable, StepFunctionError) as exc:
                log.warning("all-reduce: worker %s is left out of the ring (%s)", a, exc)
                return None
        answers: dict = {}
        threads = [threading.Thread(target=lambda a=a: answers.__setitem__(a, ask(a)),
                                    name="AllReduceAsk", daemon=True) for a in spec]
        for t in threads:   # (daemons: a coordinator exiting meanwhile does not wait)
            t.start()
        for t in threads:
            t.join()
        counts, completed = {}, set()
        for a in spec:
            answer = answers.get(a)
            if answer is None:
                continue
            count, done, running = answer
            if running:
                log.warning("all-reduce: worker %s still ran %s after %.0f s: given up there "
                            "(it applies nothing more); the worker stays in the ring", a,
                            ", ".join(running), settle)
            counts[a] = count
            completed.update(done)
        members = tuple(a for a in spec if a in counts)
        if counts and max(counts.values()) < 0 and not self.completed:
            return members, None, set()   # (each makes its replicas from the initial values)
        if not counts or max(counts.values()) < 0:
            raise Unavailable("no worker of the all-reduce job answers with its replicas: "
                              f"{spec}")
        return members, max(counts, key=counts.get), completed

    def _sync(self, members: tuple[str, ...], source: str) -> tuple[str, ...]:
        """The source's replicas copied to the other members; the members
        that have them (one that stopped answering meanwhile is left out)."""
        from coordinator import mirrored
        c, variables = self.cluster, self.cluster.strategy.mirrored_variables
        states = c.run_on(source, mirrored.whole_state, (variables, True))
        kept = []
        for a in members:
            try:
                if a != source:
                    c.run_on(a, mirrored.set_state, (variables, states), None, RECONNECT_SECONDS)
                kept.append(a)
            except Unavailable as exc:
                log.warning("all-reduce: worker %s did not take the model (%s); the ring goes "
                            "on without it", a, exc)
        return tuple(kept)
