"""Who may see what on the local Hub, answered as huggingface.co answers it.

A repo folder may hold `.hub_private` (the tokens, one a line, that may see a private repo) or
`.hub_gated` (the tokens, one a line, whose accounts accepted a gated repo's licence; empty: none
did). With `--like-huggingface` the Hub also knows which tokens belong to accounts at all
(`--user-token`), and answers as the real service does:

| request                                   | answer                                               |
|-------------------------------------------|------------------------------------------------------|
| any token the Hub does not know           | 401, `X-Error-Message: Invalid credentials in Authorization header` |
| a missing or private repo, no token       | 401, `X-Error-Code: RepoNotFound`                    |
| a missing or private repo, another token  | 404, `X-Error-Code: RepoNotFound`                    |
| a gated repo's files, no token            | 401, `X-Error-Code: GatedRepo`, "...Please log in."  |
| a gated repo's files, not accepted        | 403, `X-Error-Code: GatedRepo`, "...not in the authorized list. Visit ..." |
| a gated repo's metadata and file list     | 200, with `"gated": "manual"`                        |

Sources: huggingface_hub's `hf_raise_for_status` (utils/_http.py) tells these apart by exactly
those codes and messages, and says a 401 is returned "for private and gated repos if user is not
authenticated" and for missing ones; the gated messages are the Hub's own, as users quote them
(e.g. black-forest-labs/FLUX.1-dev in ToTheBeginning/PuLID issue 97, 401; google/gemma-3-4b-pt in
ariG23498/gemma3-object-detection issue 5, 403). Without `--like-huggingface` the older, simpler
rules stay: `--require-token` guards every repo, `.hub_private` holds one repo's token, and a
missing repo is a 404 whoever asks.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

INVALID_TOKEN = "Invalid credentials in Authorization header"


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str | None
    message: str


def _tokens(path: Path) -> list[str] | None:
    """The tokens a `.hub_private`/`.hub_gated` file lists, or None if it does not exist."""
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return None


def _among(token: str | None, tokens: list[str]) -> bool:
    """Whether `token` is one of `tokens`, compared in constant time."""
    return token is not None and any(hmac.compare_digest(token.encode(), t.encode()) for t in tokens)


def bearer(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer ...` header (None without one)."""
    kind, _, token = authorization.partition(" ")
    return token.strip() or None if kind.lower() == "bearer" else None


def is_gated(repo_path: Path) -> bool:
    return (repo_path / ".hub_gated").is_file()


@dataclass(frozen=True)
class Access:
    """The Hub's rules for one request."""

    like_huggingface: bool
    required_token: str | None  # `--require-token`: every request presents it (the simpler rules)
    user_tokens: tuple[str, ...]  # accounts the Hub knows (`--user-token`), with --like-huggingface

    def check(self, token: str | None, repo_path: Path | None, repo_id: str, files: bool, url: str) -> Refusal | None:
        """Why `token` may not see `repo_id` (None: it may). `repo_path` None: no such repo;
        `files`: the request reads file content (a gated repo's metadata is public)."""
        if not self.like_huggingface:
            return self._simple(token, repo_path)
        if token is not None and not _among(token, [*self.user_tokens, *filter(None, [self.required_token])]):
            return Refusal(401, None, INVALID_TOKEN)
        private = _tokens(repo_path / ".hub_private") if repo_path is not None else None
        if repo_path is None or (private is not None and not _among(token, private)):
            return Refusal(401 if token is None else 404, "RepoNotFound", "Repository not found")
        granted = _tokens(repo_path / ".hub_gated")
        if files and granted is not None and not _among(token, granted):
            if token is None:
                return Refusal(
                    401,
                    "GatedRepo",
                    f"Access to model {repo_id} is restricted. You must have access to it and be "
                    "authenticated to access it. Please log in.",
                )
            return Refusal(
                403,
                "GatedRepo",
                f"Access to model {repo_id} is restricted and you are not in the authorized list. "
                f"Visit {url}/{repo_id} to ask for access.",
            )
        return None

    def _simple(self, token: str | None, repo_path: Path | None) -> Refusal | None:
        if repo_path is None:
            return Refusal(404, "RepoNotFound", "Repository not found")
        wanted = _tokens(repo_path / ".hub_private") or ([self.required_token] if self.required_token else [])
        if not wanted or _among(token, wanted):
            return None
        if token is not None:
            return Refusal(401, None, INVALID_TOKEN)
        return Refusal(401, "RepoNotFound", "Repository not found")

    def knows(self, token: str | None) -> bool:
        """Whether `token` belongs to an account (`/api/whoami-v2`)."""
        tokens = [*self.user_tokens, *filter(None, [self.required_token])]
        return _among(token, tokens)
