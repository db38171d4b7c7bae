"""The jobs by command name: the one place a command's job class is looked up."""

from __future__ import annotations

from apcscore.jobs.base import Job
from apcscore.jobs.generate import GenerateJob
from apcscore.jobs.perplexity import PerplexityJob
from apcscore.jobs.score import ScoreJob

JOBS: dict[str, type[Job]] = {"score": ScoreJob, "generate": GenerateJob, "perplexity": PerplexityJob}


def job_class(command: str) -> type[Job]:
    """The job class of `command` (score, generate, perplexity)."""
    try:
        return JOBS[command]
    except KeyError:
        raise ValueError(f"no job for the command {command!r}; known: {', '.join(JOBS)}") from None
