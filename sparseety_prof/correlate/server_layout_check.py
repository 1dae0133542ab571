"""Checks of the first llama-server records read with this build's server struct offsets
(layouts.ServerLayout: server_task::id, server_slot::id), on live data: an offset read wrongly
fails here, with UnsupportedEngineBuild (exit 6) naming the invariant, instead of binding
requests to the wrong sequences.

They cannot run at attach: the structs are only read when a request arrives (a task posted, a
slot launched), and attaching does not wait for one; they run on the first ones recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparseety_prof.correlate.verification import failed_verification

VERIFY_POSTS = 16  # task posts checked
VERIFY_LAUNCHES = 8  # slot launches checked
# micro-batches a launched slot may wait for its first row: a new slot's prompt can queue behind
# other slots' prompts for several batches, each split into micro-batches
MAX_WAIT_UBATCHES = 512
MAX_SLOT_ID = 1 << 16

INV_TASKS_GROW = "task ids grow on each posting thread and never repeat"
INV_SLOT_IS_SEQ = "a launched slot's id is the sequence id of its micro-batch rows"


@dataclass
class ServerLayoutCheck:
    posts_verified: int = 0
    launches_verified: int = 0
    _last_task: dict[int, int] = field(default_factory=dict)  # posting thread -> its last task id
    _tasks: set[int] = field(default_factory=set)
    _waiting: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (task, micro-batch no.)
    _ubatches: int = 0

    @property
    def done(self) -> bool:
        return self.posts_verified >= VERIFY_POSTS and self.launches_verified >= VERIFY_LAUNCHES

    def on_task_post(self, tid: int, task_id: int) -> None:
        # -1: the queue numbers the task itself as it takes it (cancel tasks): nothing to check
        if self.posts_verified >= VERIFY_POSTS or task_id == -1:
            return
        last = self._last_task.get(tid)
        if task_id < 0 or task_id in self._tasks or (last is not None and task_id <= last):
            seen = "a repeat" if task_id in self._tasks else f"its previous: {last}"
            problem = f"invariant '{INV_TASKS_GROW}' failed: thread {tid} posted task {task_id} ({seen})"
            raise failed_verification("server_task layout", [problem])
        self._last_task[tid] = task_id
        self._tasks.add(task_id)
        self.posts_verified += 1

    def on_slot_launch(self, slot: int, task_id: int) -> None:
        if self.launches_verified + len(self._waiting) >= VERIFY_LAUNCHES:
            return
        if not 0 <= slot < MAX_SLOT_ID:
            raise failed_verification(
                "server_slot layout",
                [f"invariant '{INV_SLOT_IS_SEQ}' failed: slot id {slot} is no sequence id"],
            )
        self._waiting[slot] = (task_id, self._ubatches)

    def on_slot_release(self, slot: int) -> None:
        self._waiting.pop(slot, None)  # finished (or refused) before a row of it was seen: no verdict

    def on_ubatch(self, seqs: list[int]) -> None:
        self._ubatches += 1
        if not self._waiting:
            return
        for s in set(seqs):
            if self._waiting.pop(s, None) is not None:
                self.launches_verified += 1
        for slot, (task, since) in self._waiting.items():
            if self._ubatches - since > MAX_WAIT_UBATCHES:
                raise failed_verification(
                    "server_slot layout",
                    [
                        f"invariant '{INV_SLOT_IS_SEQ}' failed: slot {slot} (task {task}) was launched "
                        f"{MAX_WAIT_UBATCHES} micro-batches ago and none of them had a row of sequence {slot}"
                    ],
                )
