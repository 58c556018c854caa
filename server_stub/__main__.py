"""``python -m server_stub --db server.db --port 8000``: the FL server under uvicorn."""

from __future__ import annotations

import argparse

import uvicorn

from .app import create_app_from_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m server_stub", description="Run the FL server.")
    parser.add_argument("--db", default="fl_server.db", help="SQLite database file (created if missing)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    uvicorn.run(create_app_from_path(args.db), host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
