"""The jobs by command name: `apcscore score | generate | perplexity` run the job `job_class(command)`."""

from __future__ import annotations

from apcscore.jobs.base import Job
from apcscore.jobs.generate import GenerateJob
from apcscore.jobs.perplexity import PerplexityJob
from apcscore.jobs.score import ScoreJob

JOBS: dict[str, type[Job]] = {"score": ScoreJob, "generate": GenerateJob, "perplexity": PerplexityJob}


def job_class(command: str) -> type[Job]:
    """The job class of `command`; ValueError for a command that has no job."""
    try:
        return JOBS[command]
    except KeyError:
        raise ValueError(command) from None
