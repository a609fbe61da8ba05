"""One exception hierarchy whose messages are written for the user.

The CLI prints `str(error)` on one line and exits non-zero; it never shows a traceback
for an `ExpertmeshError`.
"""

import traceback


def without_locals(error: BaseException) -> BaseException:
    """`error` with the locals of its traceback's finished frames cleared, to hand to a future.

    A stored exception keeps its traceback, the traceback every frame it passed, and a frame its
    locals: an expert's buffer, and often the future that holds the exception (a cycle). Megabytes
    then live until a full garbage collection, and a pooled buffer never comes back to its pool.
    The traceback itself (files, lines) stays for whoever logs it.
    """
    traceback.clear_frames(error.__traceback__)
    return error


class ExpertmeshError(Exception):
    """Base of every error expertmesh reports to a user."""

    exit_code = 1


class ModelNotFoundError(ExpertmeshError):
    """The repository or the revision does not exist on the endpoint."""


class AuthError(ExpertmeshError):
    """The endpoint refused our token (or wants one)."""


class EndpointUnreachableError(ExpertmeshError):
    """The Hub endpoint cannot be reached at all."""


class UnsupportedModelError(ExpertmeshError):
    """The model cannot be run by expertmesh (architecture, no routed experts, format)."""


class InsufficientDiskError(ExpertmeshError):
    """Not enough free space for what was asked."""


class DownloadError(ExpertmeshError):
    """A download kept failing after its retries, or returned the wrong bytes."""


class RateLimitedError(DownloadError):
    """The Hub's rate limit for a bucket is used up for longer than the request may wait."""


class Abandoned(DownloadError):
    """A fetch nobody waits for (an idle-link fill, a guess that proved wrong) gave its connection
    up to a demand; whoever comes to want the expert fetches it again."""


class NotPulledError(ExpertmeshError):
    """A command needs a model that has not been pulled yet."""


class SpeculationError(ExpertmeshError):
    """Speculative decoding cannot be set up as asked (a bad mode, draft model or cache)."""


class DamagedModelError(ExpertmeshError):
    """A pulled model's local files cannot be loaded (cut, garbled): `pull` checks and repairs them."""
