"""`mtp-engine serve`: an OpenAI-compatible HTTP server (Starlette + uvicorn) with draft-mtp on,
its draft figures in every response's `usage`, and a page at `/` that shows drafting live."""
