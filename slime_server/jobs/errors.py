"""``JobError``: what the job manager refuses (status, message, code), apart from the manager itself so
that the gateway's ``/jobs`` routes can catch it without loading the trainer the manager drives."""

from __future__ import annotations


class JobError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status_code, self.code = status, code
