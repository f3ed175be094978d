"""The aggregator's durable state under `--state-dir`: a checkpoint at each phase boundary, a journal of
the inputs applied since, and the restart that rebuilds the machine from both.

    state_dir/aggregator/checkpoint.bin          the machine at the last phase boundary (protofl/checkpoint.py)
    state_dir/aggregator/journal-NNNNNN.log      every input that changed state, in order (journal.py): joins,
                                                 uploads, presence changes and the timers that fired; a new
                                                 segment at the first phase boundary past 64 MiB

Live: the shell drives its machine through `Durable`, the machine wrapped with its journal and checkpoints
(`DurableState`, the files above; `bind` puts it in place): an input that changes state is appended and fsynced
(`record`), then applied, then (a message) acknowledged by the transport; when a phase opens the machine is
checkpointed with the journal position it reflects. Restart (`restore`): load the checkpoint, replay the
journal records after its position through the shell (same decoder, same checks, same order: the same state,
bit for bit), then resume the round and phase with every deadline and grace measured from the resume. An upload
applied before the crash but not acknowledged comes again from the broker and is dropped as a duplicate; one
never written completely was never acknowledged and comes again. Without a checkpoint (deleted, or a crash
before the first) the journal alone rebuilds the federation from its first segment, and says so.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from broker_server.core.journal import Journal, JournalError, Record, crash_point
from protofl.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from protofl.config import canonical
from protofl.errors import ConfigError

if TYPE_CHECKING:
    from broker_server.core.rounds import Effect, Input, RoundMachine
    from broker_server.core.shell import Entry, Steps
    from protofl.config import FederationConfig

log = logging.getLogger("protofl.durability")
FORMAT = 3  # 2: the machine's state derived from its dataclasses, presence and timers journaled; 3: each
# technique's server rule keeps its own state (saved per technique, no longer inside the server model)
READS = (2, 3)  # a format-2 checkpoint resumes too: its rules' fields are found in its server model
ROTATE_BYTES = 64 << 20  # a journal segment is closed at the first phase boundary past this size
EXIT_JOURNAL_FAILED = 75  # EX_TEMPFAIL: restart the server once the disk is writable again


def config_changes(saved: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """The config fields whose values differ between a saved federation and this one."""
    return sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))


def segment_path(directory: Path, segment: int) -> Path:
    return directory / f"journal-{segment:06d}.log"


def segments(directory: Path | str) -> list[int]:
    """The numbers of the journal segments in `directory`, in order."""
    out = []
    for path in Path(directory).glob("journal-*.log"):
        number = path.name[len("journal-") : -len(".log")]
        if number.isdigit():
            out.append(int(number))
    return sorted(out)


def journal_records(directory: Path | str) -> list[Record]:
    """Every record of every segment, in order (the audit trail; opening a segment drops a torn tail)."""
    out: list[Record] = []
    for number in segments(directory):
        j = Journal(segment_path(Path(directory), number))
        out += j.records
        j.close()
    return out


class Server(Protocol):
    """What a state dir makes durable and rebuilds: the aggregator's shell (shell.Aggregator), or the coordinator
    of a sharded federation beside its shell (coordinator.Coordinator, which replays its shards' inputs)."""

    @property
    def machine(self) -> RoundMachine: ...

    @property
    def cfg(self) -> FederationConfig: ...

    def drive(self, steps: Steps) -> None: ...

    def replay(self, topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str) -> None: ...


class Durable:
    """The round machine made durable: what the shell drives (`shell.Steps`) when there is a state dir. An input
    that changes state is appended to the journal (`store.record`: fsynced, or with its batch under group commit,
    before the transport acknowledges it) and only then applied; at each live phase boundary the machine is
    checkpointed with the journal position it reflects (`store.checkpoint`). A replay (`DurableState.restore`)
    applies journaled inputs to the machine itself: nothing is journaled or checkpointed again."""

    def __init__(self, machine: RoundMachine, store: DurableState) -> None:
        self.machine = machine
        self.store = store

    def take(self, inp: Input, entry: Entry) -> list[Effect]:
        if self.machine.accepts(inp):
            self.store.record(*entry)  # on disk before it changes anything (and before the ack)
        return self.machine.apply(inp)

    def boundary(self) -> None:
        self.store.checkpoint(self.machine.snapshot())


class DurableState:
    """The state dir's journal segments and checkpoint: `record` and `sync` (the journal), `checkpoint` (at a phase
    boundary), `restore` (a restart: the checkpoint, then the journal replayed through the server)."""

    def __init__(
        self,
        directory: Path | str,
        fed: str,
        *,
        fsync: bool = True,
        rotate_bytes: int = ROTATE_BYTES,
        group_commit: bool = False,
    ) -> None:
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(
                f"{self.directory} is a file, not a directory; --state-dir takes a directory (it is created if missing)"
            )
        self.fed = fed
        self.fsync = fsync
        # group_commit: `record` writes without fsync; `sync()` (the transport's before_ack hook, and every
        # checkpoint) makes the batch durable before any of it is acknowledged or announced.
        self.group_commit = group_commit
        self.rotate_bytes = rotate_bytes
        self.checkpoint_path = self.directory / "checkpoint.bin"
        self._state = read_checkpoint(self.checkpoint_path)  # CheckpointError if damaged: never used then
        self.first_segment = int(self._state.get("journal_segment", 0)) if self._state else 0
        found = [n for n in segments(self.directory) if n >= self.first_segment]
        self._check_contiguous(found)
        self.segment = found[-1] if found else self.first_segment
        # The checkpoint reflects its segment up to its offset: a cut below that is refused, never truncated.
        self._keep = int(self._state.get("journal_offset", 0)) if self._state else 0
        keep = self._keep if self.segment == self.first_segment else 0
        self.journal = Journal(segment_path(self.directory, self.segment), fsync=fsync, keep=keep)
        self.on_fsync: Callable[[float], None] | None = None  # the metrics endpoint's: set with watch_fsync()
        self.position = 0  # the offset in the current segment that the machine's state reflects
        self.server: Server | None = None
        self.replayed = 0

    def _check_contiguous(self, found: list[int]) -> None:
        expected = list(range(self.first_segment, self.first_segment + len(found)))
        if found != expected:
            missing = sorted(set(range(self.first_segment, (found or [self.first_segment])[-1] + 1)) - set(found))
            where = "the checkpoint's" if self._state else "the first (no checkpoint)"
            raise JournalError(
                f"{self.directory}: journal segment(s) {', '.join(map(str, missing))} missing between "
                f"{where} segment {self.first_segment} and the last; the federation cannot be rebuilt. "
                f"Restore them from a backup, or move the state dir aside to start a new federation"
            )

    def bind(self, server: Server) -> None:
        """Make `server` durable over this state dir: it drives its machine through `Durable` from now on, and
        `restore()` rebuilds that machine through it."""
        self.server = server
        server.drive(Durable(server.machine, self))

    def watch_fsync(self, observe: Callable[[float], None]) -> None:
        """Tell `observe` how long each journal fsync takes (seconds), across segment rotations."""
        self.on_fsync = self.journal.on_fsync = observe

    def record(self, topic: str, payload: bytes, client: str, kind: str, round_: int, phase: str) -> None:
        """Append an input that changes state (and fsync): only then may it be applied and acknowledged."""
        try:
            self.position = self.journal.append(topic, payload, client, kind, round_, phase, sync=not self.group_commit)
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
        log.critical(
            "cannot write the journal %s (%s): stopping without acknowledging; restart the server "
            "when the disk is writable",
            self.journal.path,
            exc,
        )
        logging.shutdown()
        os._exit(EXIT_JOURNAL_FAILED)

    def checkpoint(self, machine: dict[str, Any]) -> None:
        """The machine's `snapshot()` at a phase boundary (live only: a replay never checkpoints). A segment past
        `rotate_bytes` is closed here and the checkpoint points at the start of a new one, so a restart
        reads one segment, not the whole run (older segments stay as the record of what was applied;
        they may be archived or deleted)."""
        # The journal up to `position` must be on disk before a checkpoint that points past it (and before
        # the round message that follows a boundary goes out).
        self.sync()
        rotate = self.journal.size >= max(1, self.rotate_bytes)
        segment, offset = (self.segment + 1, 0) if rotate else (self.segment, self.position)
        write_checkpoint(
            self.checkpoint_path,
            {
                "format": FORMAT,
                "fed": self.fed,
                "journal_segment": segment,
                "journal_offset": offset,
                "machine": machine,
            },
        )
        crash_point("AFTER_CHECKPOINT")
        if rotate:
            self.journal.close()
            self.segment, self.position = segment, 0
            self.journal = Journal(segment_path(self.directory, segment), fsync=self.fsync)
            self.journal.on_fsync = self.on_fsync

    def restore(self) -> bool:
        """Rebuild the machine from the checkpoint and journal; True if there was anything to resume."""
        server = self.server
        assert server is not None, "bind() the server first"
        state = self._state
        self._check_config()
        offset = 0
        if state is not None:
            if state.get("format") not in READS or state.get("fed") != self.fed:
                raise CheckpointError(
                    f"checkpoint {self.checkpoint_path} is of federation '{state.get('fed')}' "
                    f"(format {state.get('format')}), not '{self.fed}' (format {FORMAT}); pass "
                    f"--fed {state.get('fed')}, or another --state-dir for a new federation"
                )
            try:
                server.machine.restore(state["machine"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(
                    f"checkpoint {self.checkpoint_path} cannot be resumed: {exc}; start with the "
                    f"same settings, or use another --state-dir for a new federation"
                ) from None
            offset = int(state["journal_offset"])
        for number in range(self.first_segment, self.segment + 1):
            self._replay_segment(number, offset if number == self.first_segment else 0)
        self.position = self.journal.size
        self.journal.records = []  # replayed; the file is the record from now on
        if state is None and not self.replayed:
            return False
        if state is None:
            log.warning(
                "no checkpoint in %s (deleted, or the server stopped before its first phase boundary): "
                "rebuilt the federation from its journal alone, segments %d-%d",
                self.directory,
                self.first_segment,
                self.segment,
            )
        m = server.machine
        where = "finished" if m.finished else (f"round {m.round} {m.phase.phase.value}" if m.phase else "waiting")
        log.warning(
            "resumed federation '%s' from %s: %s, %d client(s), %d journaled input(s) replayed",
            self.fed,
            self.directory,
            where,
            len(m.clients),
            self.replayed,
        )
        return True

    def _check_config(self) -> None:
        """The federation's config is written once beside the journal (`federation.json`): a restart with
        other settings is refused even where there is no checkpoint to compare with."""
        assert self.server is not None
        mine = json.loads(json.dumps(self.server.cfg.to_dict()))
        path = self.directory / "federation.json"
        if not path.exists():
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"fed": self.fed, "config": mine}, indent=1, sort_keys=True))
            os.replace(tmp, path)
            return
        try:
            saved = json.loads(path.read_text())["config"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{path} cannot be read ({exc}); restore it from a backup, or move the state dir "
                f"aside to start a new federation"
            ) from None
        try:  # a state dir of a server before the scoped config saved the flat form: compare in today's form
            saved = json.loads(json.dumps(canonical(saved)))
        except (ConfigError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"{self.directory} cannot be resumed: its saved config ({path}) is not one this server can run ({exc})"
            ) from None
        changed = config_changes(saved, mine)
        if changed:
            raise CheckpointError(
                f"{self.directory} cannot be resumed: the saved federation was run with another "
                f"config (differs in: {', '.join(changed)}); start with the same settings, or use "
                f"another --state-dir for a new federation"
            )

    def _replay_segment(self, number: int, offset: int) -> None:
        assert self.server is not None
        keep = self._keep if number == self.first_segment else 0
        journal = self.journal if number == self.segment else Journal(segment_path(self.directory, number), keep=keep)
        try:
            for rec in journal.records_from(offset):
                self.server.replay(rec.topic, rec.payload, rec.client, rec.kind, rec.round, rec.phase)
                self.replayed += 1
        finally:
            if journal is not self.journal:
                journal.close()

    def close(self) -> None:
        self.journal.close()
