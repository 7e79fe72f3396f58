"""make test-all's xdist scheduler: --dist loadscope, but the tests of a few files are each a unit
of their own, spread over every worker (tests/conftest.py says which and why); and a worker that
dies (killed for memory, a crash in C++) loses only the test it was running. pytest-xdist 3.8.0,
the latest release, then waits forever: it puts back every unit the dead worker ever ran, and the
finished ones go out as empty work that never completes (pytest-xdist#1378); it hands a worker
started in its place a single test, which a worker runs only once it knows the next one or is
told to stop (#1327); and the replacement runs the test that killed the worker again (#1371)."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling


class SpreadSomeFiles(LoadScopeScheduling):
    def __init__(self, config, log=None, spread: tuple[str, ...] = ()):
        super().__init__(config, log)
        self.spread = spread

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.split("::", 1)[0] in self.spread:
            return nodeid
        return super()._split_scope(nodeid)

    def remove_node(self, node) -> str | None:
        """The test the node died in (reported failed by xdist), or None at a normal end; its
        unfinished units go back on the queue, without that test."""
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None
        scope, crashed = next(
            (s, n) for s, unit in unfinished.items() for n, done in unit.items() if not done
        )
        unfinished[scope][crashed] = True
        self.workqueue.update({s: u for s, u in unfinished.items() if not all(u.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node) -> None:
        """xdist's rule (more work when two tests or fewer are left), then: a worker holding
        fewer than two is given more, or told to stop once nothing is left."""
        super()._reschedule(node)
        while not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
            if not self.workqueue:
                node.shutdown()
                return
            self._assign_work_unit(node)
