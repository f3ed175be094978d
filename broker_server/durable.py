"""The aggregator's durable state under `--state-dir`: a checkpoint at each phase boundary, a journal of
the uploads applied since, and the restart that rebuilds the machine from both.

    state_dir/aggregator/checkpoint.bin          the machine at the last phase boundary (protofl/checkpoint.py)
    state_dir/aggregator/journal-NNNNNN.log      every accepted join and upload, in order (journal.py),
                                                 a new segment at the first phase boundary past 64 MiB

Live: an accepted upload is appended and fsynced (`record`), then applied, then acknowledged by the
transport; when a phase opens the machine is checkpointed with the journal position it reflects.
Restart (`restore`): load the checkpoint, replay the journal records after its position through the
aggregator (same decoder, same checks, same order: the same state, bit for bit), then resume the
round and phase. An upload applied before the crash but not acknowledged comes again from the broker
and is dropped as a duplicate; one never written completely was never acknowledged and comes again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from broker_server.journal import Journal, Record
from protofl.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from protofl.wire import Envelope

if TYPE_CHECKING:
    from broker_server.shell import Aggregator

log = logging.getLogger("protofl.durability")
FORMAT = 1
ROTATE_BYTES = 64 << 20  # a journal segment is closed at the first phase boundary past this size
EXIT_JOURNAL_FAILED = 75  # EX_TEMPFAIL: restart the server once the disk is writable again


def segment_path(directory: Path, segment: int) -> Path:
    return directory / f"journal-{segment:06d}.log"


def journal_records(directory: Path | str) -> list[Record]:
    """Every record of every segment, in order (the audit trail; opening a segment drops a torn tail)."""
    out: list[Record] = []
    for path in sorted(Path(directory).glob("journal-*.log")):
        j = Journal(path)
        out += j.records
        j.close()
    return out


class DurableState:
    def __init__(self, directory: Path | str, fed: str, *, fsync: bool = True,
                 rotate_bytes: int = ROTATE_BYTES, group_commit: bool = False) -> None:
        self.directory = Path(directory)
        self.fed = fed
        self.fsync = fsync
        # group_commit: `record` writes without fsync; `sync()` (the transport's before_ack hook, and every
        # checkpoint) makes the batch durable before any of it is acknowledged or announced.
        self.group_commit = group_commit
        self.rotate_bytes = rotate_bytes
        self.checkpoint_path = self.directory / "checkpoint.bin"
        self._state = read_checkpoint(self.checkpoint_path)  # CheckpointError if damaged: never used then
        self.segment = int(self._state.get("journal_segment", 0)) if self._state else 0
        self.journal = Journal(segment_path(self.directory, self.segment), fsync=fsync)
        self.position = 0  # the offset in the current segment that the machine's state reflects
        self.aggregator: Aggregator | None = None
        self.replayed = 0

    def bind(self, aggregator: Aggregator) -> None:
        self.aggregator = aggregator
        aggregator.journal = self.record
        aggregator.machine.on_boundary = self.checkpoint

    def record(self, topic: str, payload: bytes, env: Envelope) -> None:
        """Append an accepted upload and fsync: only then may it change state and be acknowledged."""
        try:
            self.position = self.journal.append(topic, payload, env.sender, env.kind, env.round, env.phase,
                                                sync=not self.group_commit)
        except OSError as exc:
            # Going on without a journal would silently void the guarantee.
            self._fail(exc)

    def sync(self) -> None:
        """Make what `record` wrote durable (group commit: before the batch's acks)."""
        try:
            self.journal.sync()
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        # Crash-only: nothing unsynced is acknowledged; the broker keeps it for the restarted server.
        log.critical("cannot write the journal %s (%s): stopping without acknowledging; restart the server "
                     "when the disk is writable", self.journal.path, exc)
        logging.shutdown()
        os._exit(EXIT_JOURNAL_FAILED)

    def checkpoint(self) -> None:
        """The machine at a phase boundary. Live, a segment past `rotate_bytes` is closed here and the
        checkpoint points at the start of a new one, so a restart reads one segment, not the whole run
        (older segments stay as the record of what was applied; they may be archived or deleted). While
        replaying, never: the rest of the segment still has to be replayed."""
        assert self.aggregator is not None
        # The journal up to `position` must be on disk before a checkpoint that points past it (and before
        # the round message that follows a boundary goes out).
        self.sync()
        replaying = self.aggregator.replaying
        rotate = not replaying and self.journal.size >= max(1, self.rotate_bytes)
        segment, offset = (self.segment + 1, 0) if rotate else (self.segment, self.position)
        write_checkpoint(self.checkpoint_path, {"format": FORMAT, "fed": self.fed, "journal_segment": segment,
                                                "journal_offset": offset,
                                                "machine": self.aggregator.machine.snapshot()})
        if rotate:
            self.journal.close()
            self.segment, self.position = segment, 0
            self.journal = Journal(segment_path(self.directory, segment), fsync=self.fsync)

    def restore(self) -> bool:
        """Rebuild the machine from the checkpoint and journal; True if there was anything to resume."""
        agg = self.aggregator
        assert agg is not None
        state = self._state
        offset = 0
        if state is not None:
            if state.get("format") != FORMAT or state.get("fed") != self.fed:
                raise CheckpointError(f"checkpoint {self.checkpoint_path} is of federation '{state.get('fed')}' "
                                      f"(format {state.get('format')}), not '{self.fed}' (format {FORMAT}); pass "
                                      f"--fed {state.get('fed')}, or another --state-dir for a new federation")
            try:
                agg.machine.restore(state["machine"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {self.checkpoint_path} cannot be resumed: {exc}; start with the "
                                      f"same settings, or use another --state-dir for a new federation") from None
            offset = int(state["journal_offset"])
        self.position = offset
        for rec in self.journal.records_from(offset):
            self.position = rec.end  # a checkpoint taken while replaying it reflects exactly this far
            agg.replay(rec.topic, rec.payload)
            self.replayed += 1
        self.position = self.journal.size
        self.journal.records = []  # replayed; the file is the record from now on
        if state is None and not self.replayed:
            return False
        m = agg.machine
        where = "finished" if m.finished else (f"round {m.round} {m.phase.phase.value}" if m.phase else "waiting")
        log.warning("resumed federation '%s' from %s: %s, %d client(s), %d journaled upload(s) replayed", self.fed,
                    self.directory, where, len(m.clients), self.replayed)
        return True

    def close(self) -> None:
        self.journal.close()
