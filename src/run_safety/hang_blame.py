"""Which rank stuck, and how to say it (pure: records and stacks in, a rank and words out; src/run_safety/hang_watch.py
calls it).

The stuck rank is a silent one that is not inside torch.distributed (a rank waiting in a collective for a stuck peer is
its victim, not its cause); ties go to a rank inside a nested phase, then to the one silent longest (`find_stuck`).
The timeout a job is judged by grows with the longest honest pause it has lived through (`effective_timeout`). The
words: a rank's record as "rank 1 in the judge (...)" (`describe`, PLACES), the "no step for ..." line
(`stalled_line`).
"""

from __future__ import annotations

from src.progress import format_duration
from src.run_safety.hang_board import WAITING
from src.run_safety.hang_stacks import in_collective

SCALE = 3.0            # the timeout is at least this many times the longest pause measured so far
PLACES = {             # a place's words in the console line and the report
    "startup": "startup", "data": "data preparation", "model": "model loading", "generation": "generation",
    "judge": "the judge", "reference": "the reference pass", "step": "a training step", "evaluation": "an evaluation",
    "checkpoint": "a checkpoint save", "collective": "a collective (waiting for the other ranks)",
    "report": "the report", "final": "the stage's end (answers, final save, report)",
}


def find_stuck(records: dict[int, dict], silent_s: dict[int, float], stacks: dict[int, list[str]],
               timeout_s: float = 0.0) -> int:
    """The rank that stuck: a silent one (silent for `timeout_s`) that is not inside torch.distributed (by its stack;
    by its own record where no stack came back), preferring one that is not marked waiting, inside a nested phase,
    silent longest, lowest rank. Where every silent rank waits in a collective (a gather inside TRL is not marked
    waiting, so its rank can fall silent first), the cause is a rank whose stack stands outside one although its
    silence has not reached the timeout yet (it stuck after the others started waiting)."""
    silent = sorted(rank for rank, quiet in silent_s.items() if quiet >= timeout_s)

    def waits(rank: int) -> bool:
        return in_collective(stacks[rank]) if stacks.get(rank) else records[rank].get("mode") == WAITING

    causes = [rank for rank in silent if not waits(rank)] or \
        [rank for rank in sorted(silent_s) if rank not in silent and stacks.get(rank) and not waits(rank)] or silent
    return min(causes, key=lambda rank: (records[rank].get("mode") == WAITING,
                                         -int(records[rank].get("depth") or 1), -silent_s[rank], rank))


def describe(record: dict) -> str:
    """"rank 1 in the judge (tests.judges:slow: 8 answers, step 10)"."""
    place = PLACES.get(record.get("place"), record.get("place") or "?")
    details = [part for part in (record.get("what"), f"step {record['step']}" if record.get("step") else "") if part]
    return f"rank {record['rank']} in {place}" + (f" ({', '.join(details)})" if details else "")


def effective_timeout(floor_s: float, longest_pause_s: float) -> float:
    """--hang_timeout, or SCALE times the longest pause between two beats measured so far, whichever is longer."""
    return max(floor_s, SCALE * longest_pause_s)


def stalled_line(no_step_s: float, where: str | None) -> str:
    return f"no step for {format_duration(no_step_s)}" + (f"; {where}" if where else "")
