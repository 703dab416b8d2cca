"""The `mtp-engine` command line: `main` (generate, convert, profile, bench, serve, chat), the
chat REPL (`chat`), the serve command (`serve`), the bench command (`bench`) and the flags they
share (`flags`). Transport only: each command builds a request and calls the engine."""
from .main import main

__all__ = ["main"]
