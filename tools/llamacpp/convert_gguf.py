#!/usr/bin/env python3
"""Convert the fixture models (or given Hugging Face dirs) to GGUF: the same code as
``specparity llamacpp convert`` (``specparity/engines/server/llamacpp_convert.py``), kept at this
path for the checkout's scripts and docs. ``--help`` lists the options."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from specparity.engines.server.llamacpp_convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
