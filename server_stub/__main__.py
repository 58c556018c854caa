"""``python -m server_stub --db server.db --port 8000``: the FL server under uvicorn."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
